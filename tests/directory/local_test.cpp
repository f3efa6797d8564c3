// local_directory: the directory contract (tests/directory/contract.hpp) on an in-process registry,
// and what only the local implementation can show: incarnations counted from 1 on a fresh registry,
// the registry's leases ending with their publications, a lease lost while the client's executor
// stalled (the record put back under the same incarnation, a named_peer reconnecting to it), the
// process-wide registry, and the constructors' checks.

#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <ferry/directory.hpp>

#include "directory/contract.hpp"
#include "helpers.hpp"

namespace {

namespace contract = ferry_test::directory_contract;
using contract::bytes_of;
using contract::client;
using contract::eventually;
using contract::failure_of;
using contract::failure_of_call;
using contract::settle;
using contract::string_of;
using contract::take;
using contract::text;
using contract::with_lease;
using ferry_test::clock_type;
using ferry_test::hang_bound;

// Clients of one fresh local_registry; killing one abandons it.
class local_world final : public contract::directory_world {
 public:
  std::unique_ptr<ferry::directory> make_client(ferry::progress_executor& exec,
                                                ferry::directory_options options) override {
    return std::make_unique<ferry::local_directory>(exec, options, registry_);
  }
  void plant_raw(const std::string& name, std::vector<std::byte> bytes) override {
    registry_->put_raw(name, std::move(bytes));
  }
  void kill(ferry::directory& d) override { dynamic_cast<ferry::local_directory&>(d).abandon(); }
  [[nodiscard]] std::string label() const override { return "local"; }

  [[nodiscard]] ferry::local_registry& registry() const { return *registry_; }

 private:
  std::shared_ptr<ferry::local_registry> registry_ = std::make_shared<ferry::local_registry>();
};

std::unique_ptr<contract::directory_world> make_local_world() {
  return std::make_unique<local_world>();
}

// A completion source that, when asked, holds its executor's thread for a while: an engine process
// that hangs (its keepalives stop) and then comes back.
class executor_stall {
 public:
  explicit executor_stall(ferry::progress_executor& exec) : exec_(exec) { exec_.add_source(*this); }
  executor_stall(const executor_stall&) = delete;
  executor_stall& operator=(const executor_stall&) = delete;
  ~executor_stall() { exec_.remove_source(*this); }

  // Holds the executor's thread for `d` from its next round; returns once it is held.
  void hold(std::chrono::milliseconds d) {
    hold_ms_.store(static_cast<int>(d.count()));
    exec_.notify();
    REQUIRE(ferry_test::wait_until([&] { return held_.load(); }, hang_bound));
  }

  std::size_t poll(std::size_t) noexcept {
    if (const int ms = hold_ms_.exchange(0); ms > 0) {
      held_.store(true);
      std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    }
    return 0;
  }

 private:
  ferry::progress_executor& exec_;
  std::atomic<int> hold_ms_{0};
  std::atomic<bool> held_{false};
};

}  // namespace

FERRY_DIRECTORY_CONTRACT("local_directory", "[directory][local][concurrency]", make_local_world)

TEST_CASE("local_directory: a fresh registry counts incarnations from 1, per name",
          "[directory][local]") {
  local_world w;
  client a(w), b(w), consumer(w);
  ferry::publication p = take(a->publish("svc/x", bytes_of("x1")));
  CHECK(p.incarnation() == 1u);
  CHECK(take(a->publish("svc/y", bytes_of("y1"))).incarnation() == 1u);

  contract::fake_factory factory;
  ferry::named_peer<contract::fake_endpoint> peer(*consumer, "svc/x", factory.connect());
  const contract::fake_endpoint e1 = peer.get(hang_bound);
  CHECK(e1.incarnation == 1u);
  CHECK(peer.incarnation() == 1u);

  ferry::publication restarted = take(b->publish("svc/x", bytes_of("x2")));
  CHECK(restarted.incarnation() == 2u);
  // The local registry tells its watchers before the publish returns: severed already.
  CHECK(e1.severed() == static_cast<int>(ferry::directory_errc::peer_restarted));
  const contract::fake_endpoint e2 = peer.get(hang_bound);
  CHECK(e2.incarnation == 2u);
  CHECK(peer.connects() == 2u);

  REQUIRE(settle(restarted.withdraw()) == ferry::transfer_state::success);
  CHECK(e2.severed() == static_cast<int>(ferry::directory_errc::peer_gone));
  CHECK(take(b->publish("svc/x", bytes_of("x3"))).incarnation() == 3u);
}

TEST_CASE("local_directory: gone events carry the incarnation that went", "[directory][local]") {
  local_world w;
  client b(w);
  auto a = std::make_unique<client>(w);
  ferry::watcher watch = b->watch("svc/", true);
  ferry::publication p = take((*a)->publish("svc/w", bytes_of("w")));
  ferry::publication q =
      take((*a)->publish("svc/k", bytes_of("k"), with_lease(std::chrono::milliseconds(200))));
  CHECK(take(watch.next(hang_bound)).record.incarnation == p.incarnation());
  CHECK(take(watch.next(hang_bound)).record.incarnation == q.incarnation());
  REQUIRE(settle(p.withdraw()) == ferry::transfer_state::success);
  ferry::directory_event ev = take(watch.next(hang_bound));
  CHECK(ev.what == ferry::directory_event::kind::gone);
  CHECK(ev.record.incarnation == p.incarnation());
  w.kill(**a);
  ev = take(watch.next(hang_bound));
  CHECK(ev.what == ferry::directory_event::kind::gone);
  CHECK(ev.record.name == "svc/k");
  CHECK(ev.record.incarnation == q.incarnation());
}

TEST_CASE("local_directory: the registry's leases end with their publications",
          "[directory][local]") {
  local_world w;
  ferry::local_registry& registry = w.registry();
  client b(w);
  auto a = std::make_unique<client>(w);
  CHECK(registry.leases() == 0u);

  ferry::publication p = take((*a)->publish("svc/p", bytes_of("p")));
  CHECK(registry.leases() == 1u);
  REQUIRE(settle(p.withdraw()) == ferry::transfer_state::success);
  CHECK(registry.leases() == 0u);

  {
    ferry::publication dropped = take((*a)->publish("svc/d", bytes_of("d")));
    CHECK(registry.leases() == 1u);
  }
  CHECK(eventually([&] { return registry.leases() == 0u; }));

  // A restart: two leases until the superseded publication is withdrawn.
  ferry::publication old = take((*a)->publish("svc/r", bytes_of("r1")));
  ferry::publication now = take(b->publish("svc/r", bytes_of("r2")));
  CHECK(registry.leases() == 2u);
  REQUIRE(settle(old.withdraw()) == ferry::transfer_state::success);
  CHECK(registry.leases() == 1u);
  CHECK(string_of(take(b->lookup("svc/r", hang_bound)).value) == "r2");
  REQUIRE(settle(now.withdraw()) == ferry::transfer_state::success);
  CHECK(registry.leases() == 0u);

  // A client that goes ends its leases; a killed one's end when they expire.
  ferry::publication left = take((*a)->publish("svc/l", bytes_of("l")));
  CHECK(registry.leases() == 1u);
  a.reset();
  CHECK(registry.leases() == 0u);
  auto c = std::make_unique<client>(w);
  ferry::publication dead =
      take((*c)->publish("svc/k", bytes_of("k"), with_lease(std::chrono::milliseconds(200))));
  CHECK(registry.leases() == 1u);
  w.kill(**c);
  CHECK(eventually([&] { return registry.leases() == 0u; }));
  CHECK(text(failure_of(b->lookup("svc/k", hang_bound)).code) ==
        text(ferry::directory_errc::not_found));
  // A killed client publishes nothing more.
  CHECK(text(failure_of((*c)->publish("svc/k2", bytes_of("k2"))).code) ==
        text(ferry::directory_errc::closed));
  CHECK(registry.leases() == 0u);
}

TEST_CASE("local_directory: a lease lost while the executor stalled is put back, same incarnation",
          "[directory][local][concurrency]") {
  local_world w;
  client a(w), b(w);
  executor_stall stall(*a.exec);
  ferry::watcher watch = b->watch("svc/s");
  ferry::publication p =
      take(a->publish("svc/s", bytes_of("s"), with_lease(std::chrono::milliseconds(300))));
  REQUIRE(take(watch.next(hang_bound)).what == ferry::directory_event::kind::published);
  contract::fake_factory factory;
  ferry::named_peer<contract::fake_endpoint> peer(*b, "svc/s", factory.connect());
  const contract::fake_endpoint e1 = peer.get(hang_bound);
  REQUIRE(e1.incarnation == p.incarnation());

  // The publisher hangs past its lease: the record goes, the endpoint is severed.
  stall.hold(std::chrono::milliseconds(1500));
  ferry::directory_event ev = take(watch.next(hang_bound));
  CHECK(ev.what == ferry::directory_event::kind::gone);
  CHECK(ev.record.incarnation == p.incarnation());
  // (The registry tells the named_peer's watch just after this test's own.)
  REQUIRE(ferry_test::wait_until([&] { return e1.severed() != 0; }, hang_bound));
  CHECK(e1.severed() == static_cast<int>(ferry::directory_errc::peer_gone));

  // It comes back: the record is put back under the same incarnation, and the lease held again.
  ev = take(watch.next(hang_bound));
  CHECK(ev.what == ferry::directory_event::kind::published);
  CHECK(ev.record.incarnation == p.incarnation());
  CHECK(string_of(ev.record.value) == "s");
  CHECK(eventually([&] { return p.republished() == 1u; }));
  CHECK(eventually([&] { return !p.health(); }));
  CHECK(take(b->lookup("svc/s", hang_bound)).incarnation == p.incarnation());

  // The peer is the same process, alive again: named_peer connects to it anew.
  contract::fake_endpoint e2;
  CHECK(eventually([&] {
    return failure_of_call([&] {
             e2 = peer.get(hang_bound);
             return 0;
           }).code == std::error_code{};
  }));
  REQUIRE(e2.link != nullptr);
  CHECK(e2.incarnation == p.incarnation());
  CHECK(e2.severed() == 0);
  CHECK(peer.connects() == 2u);
}

TEST_CASE("local_directory: a publisher that hung past its lease does not put its old record over "
          "its replacement's when it comes back",
          "[directory][local][concurrency]") {
  local_world w;
  client a(w), b(w), reader(w);
  executor_stall stall(*a.exec);
  ferry::watcher watch = reader->watch("svc/z");
  ferry::publication old =
      take(a->publish("svc/z", bytes_of("old"), with_lease(std::chrono::milliseconds(300))));
  REQUIRE(take(watch.next(hang_bound)).what == ferry::directory_event::kind::published);
  // The old publisher hangs past its lease; its replacement publishes meanwhile.
  stall.hold(std::chrono::milliseconds(1500));  // returns once its executor is held
  REQUIRE(take(watch.next(hang_bound)).what == ferry::directory_event::kind::gone);
  ferry::publication fresh = take(b->publish("svc/z", bytes_of("new")));
  CHECK(fresh.incarnation() > old.incarnation());
  // It comes back and finds its lease gone: it gives the name up instead of putting its record back.
  CHECK(eventually([&] { return old.health() == ferry::directory_errc::superseded; }));
  const ferry::directory_record now = take(reader->lookup("svc/z", hang_bound));
  CHECK(now.incarnation == fresh.incarnation());
  CHECK(string_of(now.value) == "new");
  CHECK(!fresh.health());
  CHECK(old.republished() == 0u);
}

TEST_CASE("local_directory: clients made without a registry share the process-wide one",
          "[directory][local]") {
  ferry::progress_executor e1, e2;
  ferry::local_directory a(e1), b(e2);
  CHECK(a.registry() == ferry::local_registry::process_wide());
  const std::string name = contract::scope(local_world{}, "process-wide") + "x";
  ferry::publication p = take(a.publish(name, bytes_of("shared")));
  const ferry::directory_record r = take(b.lookup(name, hang_bound));
  CHECK(r.incarnation == p.incarnation());
  CHECK(string_of(r.value) == "shared");
}

TEST_CASE("local_directory: constructors refuse what cannot work", "[directory][local]") {
  ferry::progress_executor exec;
  CHECK_THROWS_AS(ferry::local_directory(exec, {}, nullptr), std::invalid_argument);
  ferry::directory_options zero;
  zero.max_record_bytes = 0;
  CHECK_THROWS_AS(ferry::local_directory(exec, zero, std::make_shared<ferry::local_registry>()),
                  std::invalid_argument);
  zero = {};
  zero.max_watch_events = 0;
  CHECK_THROWS_AS(ferry::local_directory(exec, zero, std::make_shared<ferry::local_registry>()),
                  std::invalid_argument);
  // A lease of zero is refused by publish.
  local_world w;
  client a(w);
  CHECK(failure_of(a->publish("svc/z", bytes_of("z"), with_lease(std::chrono::milliseconds(0))))
            .code == ferry::directory_errc::bad_name);
}

TEST_CASE("local_directory: a watcher that falls behind fails with watch_overflowed",
          "[directory][local]") {
  local_world w;
  ferry::directory_options few;
  few.max_watch_events = 4;
  client a(w), b(w, few);
  ferry::watcher watch = b->watch("svc/", true);
  std::vector<ferry::publication> pubs;
  for (int i = 0; i < 5; ++i)
    pubs.push_back(take(a->publish("svc/" + std::to_string(i), bytes_of("v"))));
  CHECK(text(failure_of(watch.next(hang_bound)).code) ==
        text(ferry::directory_errc::watch_overflowed));
  // A new watch works.
  watch = b->watch("svc/", true);
  pubs.clear();
  CHECK(take(watch.next(hang_bound)).what == ferry::directory_event::kind::gone);
}

// The etcd directory against a real etcd (Debian etcd-server) that the tests start on 127.0.0.1
// ports they picked: etcd stopped and started again, with and without its data; what the client
// does meanwhile; and its pieces that read what etcd sends (base64, key ranges, options).

#include <catch2/catch.hpp>

#include <signal.h>

#include <chrono>
#include <string>
#include <vector>

#include <ferry/directory.hpp>
#include <ferry/directory/etcd.hpp>

#include "directory/contract.hpp"
#include "directory/etcd_server.hpp"
#include "helpers.hpp"

using namespace ferry_test;
using ferry::directory_errc;
using ferry::transfer_state;

namespace {

ferry::etcd_options at(const etcd_server& s, const std::string& root) {
  ferry::etcd_options o;
  o.endpoints = {s.url()};
  o.root = root;
  o.request_timeout = std::chrono::milliseconds(1000);
  o.reconnect_max = std::chrono::milliseconds(300);
  return o;
}

std::vector<std::byte> bytes_of(const std::string& s) {
  return {reinterpret_cast<const std::byte*>(s.data()),
          reinterpret_cast<const std::byte*>(s.data()) + s.size()};
}

std::error_code lookup_error(ferry::directory& d, const std::string& name) {
  try {
    (void)d.lookup(name, std::chrono::seconds(5)).get();
    return {};
  } catch (const std::system_error& e) {
    return e.code();
  }
}

// Clients of the shared etcd under a root of the world's own; killing one abandons it (its leases
// stop being renewed, as when its process dies).
class etcd_world final : public ferry_test::directory_contract::directory_world {
 public:
  std::unique_ptr<ferry::directory> make_client(ferry::progress_executor& exec,
                                                ferry::directory_options options) override {
    ferry::etcd_options o;
    o.endpoints = {shared_etcd().url()};
    o.root = root_;
    return std::make_unique<ferry::etcd_directory>(exec, o, options);
  }
  void plant_raw(const std::string& name, std::vector<std::byte> bytes) override {
    shared_etcd().put_raw(root_ + "records/" + name, bytes);
  }
  void kill(ferry::directory& d) override { d.abandon(); }
  [[nodiscard]] std::string label() const override { return "etcd"; }

 private:
  std::string root_ = fresh_root();
};

// A world on the shared etcd, or none (the contract's cases then pass with a warning) where etcd is
// not installed.
std::unique_ptr<ferry_test::directory_contract::directory_world> make_etcd_world() {
  std::string why;
  if (!etcd_server::available(why)) return nullptr;
  return std::make_unique<etcd_world>();
}

}  // namespace

// The behaviours every directory has (tests/directory/contract.hpp), against a real etcd.
FERRY_DIRECTORY_CONTRACT("etcd_directory", "[directory-etcd][concurrency]", make_etcd_world)

TEST_CASE("etcd stopped and started again: a clear error meanwhile, then publications and the "
          "watch come back",
          "[directory-etcd][concurrency]") {
  if (!etcd_or_skip()) return;
  etcd_server etcd;
  const bool wipe = GENERATE(false, true);
  INFO((wipe ? "etcd restarted without its data" : "etcd restarted with its data"));
  ferry::progress_executor exec;
  ferry::etcd_directory a(exec, at(etcd, "restart/")), b(exec, at(etcd, "restart/"));
  ferry::watcher w = b.watch("", true);
  ferry::publish_options po;
  po.lease = std::chrono::milliseconds(2000);
  ferry::publication pub = a.publish("svc", bytes_of("v1"), po).get();
  REQUIRE(w.next(hang_bound).get().record.incarnation == pub.incarnation());
  REQUIRE(b.watch_streams() == 1);

  etcd.stop(SIGKILL);
  if (wipe) etcd.wipe();
  // Meanwhile: lookups fail with unavailable, naming etcd; the publication says it is not held.
  const auto down_at = clock_type::now();
  try {
    (void)b.lookup("svc", std::chrono::seconds(5)).get();
    FAIL("a lookup succeeded with etcd stopped");
  } catch (const std::system_error& e) {
    CHECK(e.code() == directory_errc::unavailable);
    CHECK_THAT(e.what(), Catch::Contains(etcd.url()));
  }
  CHECK(ms_since(down_at) < 5000);
  CHECK(wait_until([&] { return pub.health() == directory_errc::unavailable; }, hang_bound));
  try {
    (void)a.publish("other", bytes_of("x"), po).get();
    FAIL("a publication succeeded with etcd stopped");
  } catch (const std::system_error& e) {
    CHECK(e.code() == directory_errc::unavailable);
  }

  etcd.start();
  // The publication is held again (renewed, or put back under the same incarnation if etcd lost
  // it), and found.
  CHECK(wait_until([&] { return !pub.health(); }, std::chrono::seconds(20)));
  CHECK(wait_until([&] { return !lookup_error(b, "svc"); }, std::chrono::seconds(20)));
  const ferry::directory_record r = b.lookup("svc", std::chrono::seconds(5)).get();
  CHECK(r.incarnation == pub.incarnation());
  CHECK(r.value == bytes_of("v1"));
  CHECK(pub.republished() == (wipe ? 1u : 0u));
  // The watch came back: a new name published now is seen.
  CHECK(wait_until([&] { return b.watch_streams() >= 2; }, std::chrono::seconds(20)));
  ferry::publication later = a.publish("later", bytes_of("v2"), po).get();
  bool seen = false;
  for (int i = 0; i < 10 && !seen; ++i) {
    const ferry::directory_event ev = w.next(hang_bound).get();
    seen = ev.record.name == "later" && ev.what == ferry::directory_event::kind::published;
  }
  CHECK(seen);
  // The incarnation counter is etcd's: after a restart without data, the publication put back
  // restored it, so a later publication under the name still counts on from there.
  ferry::publication next = b.publish("svc", bytes_of("v3"), po).get();
  CHECK(next.incarnation() > pub.incarnation());
}

TEST_CASE("etcd: a publisher whose lease was lost does not put its old record over its "
          "replacement's",
          "[directory-etcd][concurrency]") {
  if (!etcd_or_skip()) return;
  etcd_server& etcd = shared_etcd();
  const std::string root = fresh_root();
  ferry::progress_executor exec_a, exec_b;
  ferry::etcd_directory a(exec_a, at(etcd, root)), b(exec_b, at(etcd, root));
  ferry::publish_options po;
  po.lease = std::chrono::milliseconds(3000);
  ferry::publication old = a.publish("svc/z", bytes_of("old"), po).get();
  // Its lease ends behind its back (as when it hangs past it): every lease in etcd is revoked.
  std::string leases;
  REQUIRE(etcd.post("/v3/lease/leases", "{}", &leases) == 200);
  for (std::size_t at_id = leases.find("\"ID\":\""); at_id != std::string::npos;
       at_id = leases.find("\"ID\":\"", at_id + 1)) {
    const std::size_t from = at_id + 6;
    const std::string id = leases.substr(from, leases.find('"', from) - from);
    (void)etcd.post("/v3/lease/revoke", "{\"ID\":\"" + id + "\"}");
  }
  ferry::publication fresh = b.publish("svc/z", bytes_of("new"), po).get();
  CHECK(fresh.incarnation() > old.incarnation());
  // Its next keepalive finds the lease gone; the name is no longer its own.
  CHECK(wait_until([&] { return old.health() == directory_errc::superseded; }, hang_bound));
  const ferry::directory_record now = b.lookup("svc/z", std::chrono::seconds(5)).get();
  CHECK(now.incarnation == fresh.incarnation());
  CHECK(now.value == bytes_of("new"));
  CHECK(old.republished() == 0u);
}

TEST_CASE("etcd directory options that cannot work are refused with a message",
          "[directory-etcd]") {
  ferry::progress_executor exec;
  auto refused = [&](ferry::etcd_options o, const char* says) {
    try {
      ferry::etcd_directory d(exec, std::move(o));
      FAIL("accepted");
    } catch (const std::invalid_argument& e) {
      CHECK_THAT(e.what(), Catch::Contains(says));
    }
  };
  ferry::etcd_options none;
  none.endpoints.clear();
  refused(none, "no endpoints");
  ferry::etcd_options bad_url;
  bad_url.endpoints = {"127.0.0.1:2379"};
  refused(bad_url, "not an http");
  ferry::etcd_options bad_root;
  bad_root.root = "with space/";
  refused(bad_root, "root");
  ferry::etcd_options zero;
  zero.request_timeout = std::chrono::milliseconds(0);
  refused(zero, "request_timeout");
}

TEST_CASE("etcd that does not answer: calls fail with unavailable by their bound, nothing hangs",
          "[directory-etcd][concurrency]") {
  ferry::progress_executor exec;
  ferry::etcd_options o;
  o.endpoints = {"http://127.0.0.1:9"};  // discard port: nothing listens
  o.request_timeout = std::chrono::milliseconds(500);
  ferry::etcd_directory d(exec, o);
  const auto start = clock_type::now();
  CHECK(lookup_error(d, "x") == directory_errc::unavailable);
  std::vector<std::string> names(200, "n");
  for (std::size_t i = 0; i < names.size(); ++i) names[i] += std::to_string(i);
  try {
    (void)d.lookup(names, std::chrono::seconds(5)).get();
    FAIL("a lookup succeeded with no etcd");
  } catch (const std::system_error& e) {
    CHECK(e.code() == directory_errc::unavailable);
  }
  ferry::watcher w = d.watch("x");  // returns although the stream cannot open
  CHECK(ms_since(start) < 10000);
}

TEST_CASE("base64 and key ranges read what etcd sends, and refuse what is malformed",
          "[directory-etcd]") {
  using ferry::detail::base64_decode;
  using ferry::detail::base64_encode;
  std::string out;
  for (std::size_t n = 0; n < 70; ++n) {
    std::string s;
    for (std::size_t i = 0; i < n; ++i) s += static_cast<char>((i * 37 + n) & 0xff);
    REQUIRE(base64_decode(base64_encode(s), out));
    CHECK(out == s);
  }
  CHECK(base64_encode("ab") == "YWI=");
  CHECK_FALSE(base64_decode("YWI", out));     // not a multiple of 4
  CHECK_FALSE(base64_decode("Y!I=", out));    // a character outside the alphabet
  CHECK_FALSE(base64_decode("Y=I=", out));    // padding inside
  CHECK(ferry::detail::prefix_end("ferry/records/") == "ferry/records0");
  CHECK(ferry::detail::prefix_end("a\xff") == "b");
  CHECK(ferry::detail::prefix_end("") == std::string(1, '\0'));
}

#pragma once
// The directory contract: what every ferry::directory implementation must do, written once against
// a small fixture (directory_world) so that local_directory and etcd_directory pass the same tests.
//
// A test file gives a world and registers the contract's test cases for it:
//
//   std::unique_ptr<ferry_test::directory_contract::directory_world> make_world() { ... }
//   FERRY_DIRECTORY_CONTRACT("local_directory", "[directory][local]", make_world)
//
// FERRY_DIRECTORY_CONTRACT(LABEL, TAGS, MAKE_WORLD) registers one TEST_CASE per behaviour, named
// LABEL ": <behaviour>" and tagged TAGS plus [contract]. Each test case calls MAKE_WORLD()
// (anything callable with no argument that returns a std::unique_ptr<directory_world>) for a world
// of its own; a null world (the service is not there: no etcd to talk to) makes the case pass with
// a warning. The behaviours are also plain functions in namespace ferry_test::directory_contract
// (each takes a directory_world&), for a file that wants to run some of them its own way.
//
// Names. Every name a case uses is under "ferry-test/<label>/<run token>/<case>/", the token random
// per process, so that runs against one long-lived etcd, and the cases of one run, never see each
// other's records; incarnations are only compared with each other, never with fixed numbers (an
// etcd keeps its counters across runs), except in tests of one implementation.
//
// Time. Leases are 1 s where a case waits for one to end (etcd rounds a lease up to whole seconds
// and to its own minimum, a few seconds at most); every wait is bounded by hang_bound (10 s), and
// no bound is tighter than "did not hang": the cases run under TSan and ASan on loaded machines.

#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include <ferry/directory.hpp>
#include <ferry/sync_wait.hpp>

#include "helpers.hpp"

namespace ferry_test::directory_contract {

/// What the contract needs from an implementation under test: clients (one per simulated engine
/// process) of one shared directory service, a way to write bytes under a name behind the clients'
/// backs, and a way to make a client die. A world is made afresh for each test case and destroyed
/// after every client made from it.
struct directory_world {
  /// Destroyed after every client it made (a local world may free its registry, an etcd world may
  /// delete what the case left under its prefix).
  virtual ~directory_world() = default;

  /// A new client of the world's directory service, running on `exec` (which outlives it) with
  /// `options`: what one engine process would make. Clients made from one world see each other's
  /// publications.
  virtual std::unique_ptr<ferry::directory> make_client(ferry::progress_executor& exec,
                                                        ferry::directory_options options) = 0;

  /// Writes `bytes` under `name` as they are, with no lease, as a foreign writer to the service
  /// could (garbage, a cut record, a record over a reader's limit). The bytes stay until the world
  /// goes or the name is published over.
  virtual void plant_raw(const std::string& name, std::vector<std::byte> bytes) = 0;

  /// Makes `client` (made by make_client) die as a crashed process would: its leases stop being
  /// renewed and nothing is withdrawn, so its records go one lease later. The contract then drops
  /// the client's publications and destroys it as usual: that must renew or put back nothing.
  virtual void kill(ferry::directory& client) = 0;

  /// A short name for the implementation ("local", "etcd"): in test names and in every name used.
  [[nodiscard]] virtual std::string label() const = 0;
};

/// One client and the progress executor it runs on: one simulated engine process. The directory
/// goes before its executor.
struct client {
  /// A client of `world` with `options`, on an executor of its own.
  explicit client(directory_world& world, ferry::directory_options options = {})
      : exec(std::make_unique<ferry::progress_executor>()), dir(world.make_client(*exec, options)) {
    REQUIRE(dir != nullptr);
  }
  /// The executor (declared first, so destroyed last).
  std::unique_ptr<ferry::progress_executor> exec;
  /// The directory client.
  std::unique_ptr<ferry::directory> dir;

  /// The directory client.
  ferry::directory* operator->() const { return dir.get(); }
  /// The directory client.
  ferry::directory& operator*() const { return *dir; }
};

/// `s`'s bytes, to publish.
inline std::vector<std::byte> bytes_of(std::string_view s) {
  std::vector<std::byte> out(s.size());
  for (std::size_t i = 0; i < s.size(); ++i) out[i] = static_cast<std::byte>(s[i]);
  return out;
}

/// `b` as a string, for messages and comparisons.
inline std::string string_of(const std::vector<std::byte>& b) {
  std::string out(b.size(), '\0');
  for (std::size_t i = 0; i < b.size(); ++i) out[i] = static_cast<char>(b[i]);
  return out;
}

/// An error code in words ("ferry.directory:4 nothing is published under the name"), so that a
/// failed comparison of two codes says which they were.
inline std::string text(std::error_code ec) {
  if (!ec) return "no error";
  return std::string(ec.category().name()) + ":" + std::to_string(ec.value()) + " " + ec.message();
}

/// A directory error in words, as text(std::error_code) gives it.
inline std::string text(ferry::directory_errc e) { return text(make_error_code(e)); }

/// How long the contract waits for any one result or withdrawal before it calls the implementation
/// hung (longer than every timeout the contract gives, so that those fire first).
inline constexpr auto result_bound = std::chrono::seconds(30);

/// Waits up to result_bound for `p`, then takes its value (throws as pending_result::get does);
/// fails the test case when it never completes, rather than hang.
template <class T>
T take(ferry::pending_result<T>& p) {
  if (p.made().wait_for(result_bound) == ferry::transfer_state::pending) {
    FAIL("a directory result did not complete within " << result_bound.count() << " s");
  }
  return p.get();
}

/// take() for a temporary.
template <class T>
T take(ferry::pending_result<T>&& p) {
  return take(p);
}

/// Waits up to result_bound for `t` (a withdrawal) and returns its state; fails the test case when
/// it never ends.
inline ferry::transfer_state settle(const ferry::transfer& t) {
  const ferry::transfer_state state = t.wait_for(result_bound);
  if (state == ferry::transfer_state::pending) {
    FAIL("a directory transfer did not end within " << result_bound.count() << " s");
  }
  return state;
}

/// How a pending result failed: its code and message (empty when it did not fail).
struct failure {
  std::error_code code;  ///< the std::system_error's code; empty when the value came
  std::string what;      ///< its what()
};

/// Waits for `p` and says how it failed (an empty failure when it gave its value).
template <class T>
failure failure_of(ferry::pending_result<T> p) {
  try {
    (void)take(p);
  } catch (const std::system_error& e) {
    return {e.code(), e.what()};
  }
  return {};
}

/// Calls `fn` and says how it threw std::system_error (an empty failure when it did not throw).
template <class Fn>
failure failure_of_call(Fn&& fn) {
  try {
    (void)fn();
  } catch (const std::system_error& e) {
    return {e.code(), e.what()};
  }
  return {};
}

/// Polls `pred` every 10 ms (a service is not asked thousands of times a second) until it holds or
/// `bound` passes; returns whether it held.
template <class Pred>
bool eventually(Pred pred, std::chrono::milliseconds bound = hang_bound) {
  const auto start = clock_type::now();
  for (;;) {
    if (pred()) return true;
    if (clock_type::now() - start > bound) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

/// Publish options with lease `lease`.
inline ferry::publish_options with_lease(std::chrono::milliseconds lease) {
  ferry::publish_options o;
  o.lease = lease;
  return o;
}

/// The names a case of `world` uses start with this: "ferry-test/<label>/<run token>/<what>/",
/// different for every call in a process and for every process.
inline std::string scope(const directory_world& world, const std::string& what) {
  static const std::string token = [] {
    std::random_device rd;
    const auto now = static_cast<std::uint64_t>(clock_type::now().time_since_epoch().count());
    std::mt19937_64 gen((static_cast<std::uint64_t>(rd()) << 32) ^ rd() ^ now);
    static constexpr char hex[] = "0123456789abcdef";
    std::string t;
    for (int i = 0; i < 12; ++i) t += hex[gen() % 16];
    return t;
  }();
  static std::atomic<unsigned> calls{0};
  std::string label = world.label();
  for (char& c : label) {
    if (!ferry::detail::name_char(c) || c == '/') c = '-';
  }
  return "ferry-test/" + label + "/" + token + "-" + std::to_string(calls.fetch_add(1)) + "/" +
         what + "/";
}

// ---- the endpoint named_peer binds in these tests

/// What a fake endpoint's copies share: why it was severed (0 while it was not; else the
/// directory_errc's value, -1 for a code of another category) and how many times.
struct fake_link {
  std::atomic<int> severed_code{0};  ///< the first reason it was severed with, as described above
  std::atomic<int> severs{0};        ///< sever() calls
};

/// A stand-in for a transport endpoint (a ucx::endpoint): copies share one link, sever() records
/// why, and a fence (peer_restarted, peer_gone) raises the shared floor: the newest incarnation an
/// endpoint was fenced at, below which no get() may answer afterwards.
struct fake_endpoint {
  std::shared_ptr<fake_link> link;  ///< shared by the copies: one connection
  std::uint64_t incarnation = 0;    ///< the incarnation of the record it was made from
  std::string value;                ///< the record's value
  std::shared_ptr<std::atomic<std::uint64_t>> severed_floor;  ///< the factory's; may be null

  /// Records `ec` (the first reason stays) and, for a fence, raises the factory's floor.
  void sever(std::error_code ec) {
    const int code = ec.category() == ferry::directory_category() ? ec.value() : -1;
    int none = 0;
    (void)link->severed_code.compare_exchange_strong(none, code);
    link->severs.fetch_add(1);
    if (severed_floor &&
        (ec == ferry::directory_errc::peer_restarted || ec == ferry::directory_errc::peer_gone)) {
      std::uint64_t seen = severed_floor->load();
      while (seen < incarnation && !severed_floor->compare_exchange_weak(seen, incarnation)) {
      }
    }
  }
  /// Why it was severed (0: it was not), as fake_link::severed_code.
  [[nodiscard]] int severed() const { return link->severed_code.load(); }
  /// True when `other` is a copy of this endpoint.
  [[nodiscard]] bool same(const fake_endpoint& other) const { return link == other.link; }
};

/// named_peer's connect function for fake endpoints: makes one per record and keeps them all, to
/// check afterwards which were severed. Thread-safe.
class fake_factory {
 public:
  /// The connect function to give named_peer.
  [[nodiscard]] std::function<fake_endpoint(const ferry::directory_record&)> connect() {
    return [this](const ferry::directory_record& r) {
      fake_endpoint e{std::make_shared<fake_link>(), r.incarnation, string_of(r.value), floor_};
      std::lock_guard lock(mutex_);
      made_.push_back(e);
      return e;
    };
  }
  /// Every endpoint made so far.
  [[nodiscard]] std::vector<fake_endpoint> made() const {
    std::lock_guard lock(mutex_);
    return made_;
  }
  /// The newest incarnation any endpoint made here was fenced at (0: none was).
  [[nodiscard]] std::uint64_t severed_floor() const { return floor_->load(); }

 private:
  mutable std::mutex mutex_;
  std::vector<fake_endpoint> made_;
  std::shared_ptr<std::atomic<std::uint64_t>> floor_ =
      std::make_shared<std::atomic<std::uint64_t>>(0);
};

// ---- the behaviours

/// A record published by one client is found by another with the same bytes and an incarnation
/// above 0; an unknown name is not_found, the message naming it; an empty value and a value of
/// exactly max_record_bytes go through.
inline void publish_then_lookup(directory_world& w) {
  const std::string ns = scope(w, "publish");
  client a(w), b(w);
  const std::vector<std::byte> value = pattern(100, 7);
  ferry::publication pub = take(a->publish(ns + "peer", value));
  REQUIRE(pub);
  CHECK(pub.name() == ns + "peer");
  CHECK(pub.incarnation() > 0u);
  CHECK(!pub.health());

  const ferry::directory_record r = take(b->lookup(ns + "peer", hang_bound));
  CHECK(r.name == ns + "peer");
  CHECK(r.incarnation == pub.incarnation());
  CHECK(r.value == value);
  // The publisher finds its own record too.
  CHECK(take(a->lookup(ns + "peer", hang_bound)).value == value);

  const failure missing = failure_of(b->lookup(ns + "nobody", hang_bound));
  CHECK(text(missing.code) == text(ferry::directory_errc::not_found));
  CHECK_THAT(missing.what, Catch::Contains(ns + "nobody"));

  ferry::publication empty = take(a->publish(ns + "empty", std::span<const std::byte>{}));
  const ferry::directory_record e = take(b->lookup(ns + "empty", hang_bound));
  CHECK(e.value.empty());
  CHECK(e.incarnation == empty.incarnation());

  ferry::directory_options small;
  small.max_record_bytes = 64;
  client c(w, small);
  ferry::publication full = take(c->publish(ns + "full", pattern(64, 3)));
  CHECK(take(c->lookup(ns + "full", hang_bound)).value == pattern(64, 3));
  const failure over = failure_of(c->publish(ns + "over", pattern(65, 3)));
  CHECK(text(over.code) == text(ferry::directory_errc::record_too_large));
  CHECK_THAT(over.what, Catch::Contains(ns + "over"));
  CHECK(text(failure_of(b->lookup(ns + "over", hang_bound)).code) ==
        text(ferry::directory_errc::not_found));
}

/// Each publication under a name has a greater incarnation than the one before: after a withdraw,
/// and while the earlier one is still live (a restart: another client publishes). Withdrawing the
/// superseded publication leaves the newer record in place.
inline void incarnations_grow(directory_world& w) {
  const std::string name = scope(w, "incarnations") + "peer";
  client a(w), b(w), c(w);
  ferry::publication p1 = take(a->publish(name, bytes_of("one")));
  REQUIRE(settle(p1.withdraw()) == ferry::transfer_state::success);
  ferry::publication p2 = take(a->publish(name, bytes_of("two")));
  CHECK(p2.incarnation() > p1.incarnation());

  // A restart: a new process publishes while the old one's lease is still held.
  ferry::publication p3 = take(b->publish(name, bytes_of("three")));
  CHECK(p3.incarnation() > p2.incarnation());
  ferry::directory_record r = take(c->lookup(name, hang_bound));
  CHECK(r.incarnation == p3.incarnation());
  CHECK(string_of(r.value) == "three");

  // The old process withdraws late (or its handle goes): the newer record stays.
  REQUIRE(settle(p2.withdraw()) == ferry::transfer_state::success);
  r = take(c->lookup(name, hang_bound));
  CHECK(r.incarnation == p3.incarnation());
  CHECK(string_of(r.value) == "three");

  // And the same client publishing again is a restart too.
  ferry::publication p4 = take(b->publish(name, bytes_of("four")));
  CHECK(p4.incarnation() > p3.incarnation());
  p3 = ferry::publication{};  // drops (withdraws) the superseded one
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  r = take(c->lookup(name, hang_bound));
  CHECK(r.incarnation == p4.incarnation());
}

/// 1000 names published by one client, looked up by another in one call among missing and bad
/// names: every outcome right and in order. Then 1000 single lookups all started before any is
/// awaited. An empty batch, and a batch of bad names only, are answered too.
inline void many_lookups_at_once(directory_world& w) {
  const std::string ns = scope(w, "many");
  constexpr std::size_t n = 1000;
  client a(w), b(w);
  auto name_of = [&](std::size_t i) { return ns + "n" + std::to_string(i); };
  auto value_of = [&](std::size_t i) { return bytes_of("value of " + std::to_string(i)); };

  // A long lease: 1000 keepalives every few seconds is not what this case is about.
  std::vector<ferry::pending_result<ferry::publication>> pending;
  for (std::size_t i = 0; i < n; ++i) {
    pending.push_back(a->publish(name_of(i), value_of(i), with_lease(std::chrono::seconds(30))));
  }
  std::vector<ferry::publication> pubs;
  for (auto& p : pending) pubs.push_back(take(p));

  // Names: each published one, a missing one every 97th, and a bad one in the middle.
  std::vector<std::string> names;
  std::vector<long> which;  // index into pubs; -1: missing; -2: bad
  for (std::size_t i = 0; i < n; ++i) {
    names.push_back(name_of(i));
    which.push_back(static_cast<long>(i));
    if (i % 97 == 0) {
      names.push_back(ns + "missing" + std::to_string(i));
      which.push_back(-1);
    }
    if (i == n / 2) {
      names.push_back(ns + "bad name");
      which.push_back(-2);
    }
  }
  const std::vector<ferry::lookup_result> results = take(b->lookup(names, hang_bound));
  REQUIRE(results.size() == names.size());
  std::size_t wrong = 0;
  std::string first_wrong;
  for (std::size_t j = 0; j < names.size(); ++j) {
    const ferry::lookup_result& r = results[j];
    bool ok = r.name == names[j];
    if (which[j] >= 0) {
      const auto i = static_cast<std::size_t>(which[j]);
      ok = ok && !r.error && r.record && r.record->name == names[j] &&
           r.record->incarnation == pubs[i].incarnation() && r.record->value == value_of(i);
    } else {
      const auto want =
          which[j] == -1 ? ferry::directory_errc::not_found : ferry::directory_errc::bad_name;
      ok = ok && !r.record && r.error == want && r.message.find(names[j]) != std::string::npos;
    }
    if (!ok && wrong++ == 0) first_wrong = names[j] + ": " + text(r.error) + " " + r.message;
  }
  INFO("first wrong outcome: " << first_wrong);
  CHECK(wrong == 0u);

  // 1000 single lookups in flight at once (and some missing names among them).
  std::vector<ferry::pending_result<ferry::directory_record>> singles;
  for (std::size_t i = 0; i < n; ++i) {
    singles.push_back(
        b->lookup(i % 10 == 9 ? ns + "absent" + std::to_string(i) : name_of(i), hang_bound));
  }
  wrong = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (i % 10 == 9) {
      const failure f = failure_of(std::move(singles[i]));
      if (f.code != ferry::directory_errc::not_found && wrong++ == 0) first_wrong = text(f.code);
    } else {
      const failure f = failure_of_call([&] {
        const ferry::directory_record r = take(singles[i]);
        if (r.name != name_of(i) || r.incarnation != pubs[i].incarnation() ||
            r.value != value_of(i)) {
          throw std::system_error(make_error_code(ferry::directory_errc::bad_record),
                                  "wrong record");
        }
        return 0;
      });
      if (f.code && wrong++ == 0) first_wrong = name_of(i) + ": " + f.what;
    }
  }
  INFO("first wrong single lookup: " << first_wrong);
  CHECK(wrong == 0u);

  CHECK(take(b->lookup(std::vector<std::string>{}, hang_bound)).empty());
  const auto bad_only = take(b->lookup(std::vector<std::string>{"", "a b"}, hang_bound));
  REQUIRE(bad_only.size() == 2u);
  CHECK(text(bad_only[0].error) == text(ferry::directory_errc::bad_name));
  CHECK(text(bad_only[1].error) == text(ferry::directory_errc::bad_name));
}

/// A watch on a prefix reports, in order, each publication under it (with its incarnation and
/// bytes) and each name gone on withdraw, a restart as a newer incarnation, and nothing for a name
/// outside the prefix or for the superseded publication withdrawn.
inline void watch_prefix(directory_world& w) {
  const std::string ns = scope(w, "watch-prefix");
  client a(w), b(w), c(w);
  ferry::watcher watch = b->watch(ns, true);
  REQUIRE(watch);

  // Outside the prefix (a sibling that shares all but the last '/').
  ferry::publication outside = take(a->publish(ns.substr(0, ns.size() - 1) + "x", bytes_of("no")));
  ferry::publication px = take(a->publish(ns + "x", bytes_of("x1")));
  ferry::publication py = take(a->publish(ns + "y", bytes_of("y1")));

  ferry::directory_event ev = take(watch.next(hang_bound));
  CHECK(ev.what == ferry::directory_event::kind::published);
  CHECK(ev.record.name == ns + "x");
  CHECK(ev.record.incarnation == px.incarnation());
  CHECK(string_of(ev.record.value) == "x1");
  ev = take(watch.next(hang_bound));
  CHECK(ev.what == ferry::directory_event::kind::published);
  CHECK(ev.record.name == ns + "y");
  CHECK(ev.record.incarnation == py.incarnation());

  REQUIRE(settle(px.withdraw()) == ferry::transfer_state::success);
  ev = take(watch.next(hang_bound));
  CHECK(ev.what == ferry::directory_event::kind::gone);
  CHECK(ev.record.name == ns + "x");
  // gone carries the incarnation that went, or 0 where the directory cannot tell.
  CHECK((ev.record.incarnation == px.incarnation() || ev.record.incarnation == 0u));

  // y restarts: a newer incarnation, from another client.
  ferry::publication py2 = take(c->publish(ns + "y", bytes_of("y2")));
  ev = take(watch.next(hang_bound));
  CHECK(ev.what == ferry::directory_event::kind::published);
  CHECK(ev.record.name == ns + "y");
  CHECK(ev.record.incarnation == py2.incarnation());
  CHECK(ev.record.incarnation > py.incarnation());
  CHECK(string_of(ev.record.value) == "y2");

  // The superseded one withdrawn: nothing to report. Then y goes for good.
  REQUIRE(settle(py.withdraw()) == ferry::transfer_state::success);
  REQUIRE(settle(py2.withdraw()) == ferry::transfer_state::success);
  ev = take(watch.next(hang_bound));
  CHECK(ev.what == ferry::directory_event::kind::gone);
  CHECK(ev.record.name == ns + "y");
  CHECK((ev.record.incarnation == py2.incarnation() || ev.record.incarnation == 0u));

  // Nothing else came (the name outside the prefix included).
  CHECK(text(failure_of(watch.next(std::chrono::milliseconds(200))).code) ==
        text(ferry::directory_errc::deadline_exceeded));
}

/// A watch on an exact name ignores every other name, those that start with it included.
inline void watch_exact(directory_world& w) {
  const std::string ns = scope(w, "watch-exact");
  client a(w), b(w);
  ferry::watcher watch = b->watch(ns + "a");
  ferry::publication pab = take(a->publish(ns + "ab", bytes_of("ab")));
  ferry::publication pb = take(a->publish(ns + "b", bytes_of("b")));
  ferry::publication pa = take(a->publish(ns + "a", bytes_of("a")));
  ferry::directory_event ev = take(watch.next(hang_bound));
  CHECK(ev.what == ferry::directory_event::kind::published);
  CHECK(ev.record.name == ns + "a");
  CHECK(ev.record.incarnation == pa.incarnation());
  REQUIRE(settle(pab.withdraw()) == ferry::transfer_state::success);
  REQUIRE(settle(pa.withdraw()) == ferry::transfer_state::success);
  ev = take(watch.next(hang_bound));
  CHECK(ev.what == ferry::directory_event::kind::gone);
  CHECK(ev.record.name == ns + "a");
  CHECK(text(failure_of(watch.next(std::chrono::milliseconds(200))).code) ==
        text(ferry::directory_errc::deadline_exceeded));
}

/// next() with nothing happening fails with deadline_exceeded once its timeout passed, and did not
/// hang; a zero timeout fails at once; a timed-out next() leaves the watch working; a second next()
/// while one waits is refused; a watch whose directory went fails with closed.
inline void watch_next_deadline(directory_world& w) {
  const std::string ns = scope(w, "watch-deadline");
  client a(w);
  auto b = std::make_unique<client>(w);
  ferry::watcher watch = (*b)->watch(ns + "quiet");

  const auto timeout = std::chrono::milliseconds(100);
  auto start = clock_type::now();
  const failure f = failure_of(watch.next(timeout));
  const auto took = clock_type::now() - start;
  CHECK(text(f.code) == text(ferry::directory_errc::deadline_exceeded));
  CHECK_THAT(f.what, Catch::Contains(ns + "quiet"));
  CHECK(took >= timeout);
  CHECK(took < hang_bound);

  start = clock_type::now();
  CHECK(text(failure_of(watch.next(std::chrono::nanoseconds::zero())).code) ==
        text(ferry::directory_errc::deadline_exceeded));
  CHECK(clock_type::now() - start < hang_bound);
  CHECK(!watch.try_next());

  // Still watching: one waiting next() (a second is refused), then an event for it.
  ferry::pending_result<ferry::directory_event> waiting = watch.next(hang_bound);
  CHECK_THROWS_AS(watch.next(hang_bound), std::logic_error);
  ferry::publication p = take(a->publish(ns + "quiet", bytes_of("now")));
  const ferry::directory_event ev = take(waiting);
  CHECK(ev.what == ferry::directory_event::kind::published);
  CHECK(ev.record.incarnation == p.incarnation());

  // An event buffered while nobody waited is there at once, also through try_next().
  REQUIRE(settle(p.withdraw()) == ferry::transfer_state::success);
  REQUIRE(wait_until(
      [&] {
        if (auto e = watch.try_next()) return e->what == ferry::directory_event::kind::gone;
        return false;
      },
      hang_bound));

  // The watching client goes: the watch ends with closed.
  b.reset();
  CHECK(text(failure_of(watch.next(hang_bound)).code) == text(ferry::directory_errc::closed));
}

/// A client killed (its leases no longer renewed, nothing withdrawn) loses its record one lease
/// later: a watcher sees it gone and a lookup then fails with not_found.
inline void killed_client_goes(directory_world& w) {
  const std::string name = scope(w, "killed") + "peer";
  client b(w);
  auto a = std::make_unique<client>(w);
  ferry::watcher watch = b->watch(name);
  ferry::publication pub =
      take((*a)->publish(name, bytes_of("alive"), with_lease(std::chrono::seconds(1))));
  const std::uint64_t incarnation = pub.incarnation();
  ferry::directory_event ev = take(watch.next(hang_bound));
  CHECK(ev.what == ferry::directory_event::kind::published);

  const auto start = clock_type::now();
  w.kill(**a);
  ev = take(watch.next(hang_bound));
  INFO("gone after " << ms_since(start) << " ms");
  CHECK(ev.what == ferry::directory_event::kind::gone);
  CHECK(ev.record.name == name);
  CHECK((ev.record.incarnation == incarnation || ev.record.incarnation == 0u));
  CHECK(clock_type::now() - start < hang_bound);
  CHECK(text(failure_of(b->lookup(name, hang_bound)).code) ==
        text(ferry::directory_errc::not_found));

  // The dead client's handles and the client itself go quietly.
  pub = ferry::publication{};
  a.reset();
  CHECK(text(failure_of(b->lookup(name, hang_bound)).code) ==
        text(ferry::directory_errc::not_found));
}

/// A live client keeps its record past several lease times: keepalives work.
inline void keepalive_keeps_record(directory_world& w) {
  const std::string name = scope(w, "keepalive") + "peer";
  client a(w), b(w);
  ferry::watcher watch = b->watch(name);
  ferry::publication pub =
      take(a->publish(name, bytes_of("kept"), with_lease(std::chrono::seconds(1))));
  REQUIRE(take(watch.next(hang_bound)).what == ferry::directory_event::kind::published);
  std::this_thread::sleep_for(std::chrono::seconds(3));
  const ferry::directory_record r = take(b->lookup(name, hang_bound));
  CHECK(r.incarnation == pub.incarnation());
  CHECK(string_of(r.value) == "kept");
  CHECK(text(pub.health()) == text(std::error_code{}));
  CHECK(!watch.try_next());  // it never went
}

/// Bytes under a name that are no record (random, cut, a bit flipped, incarnation 0) are refused
/// with bad_record, and one over the reader's limit with record_too_large, each message naming the
/// name; the other names of the same batch are unaffected; a watcher reports none of them.
inline void garbage_is_refused(directory_world& w) {
  const std::string ns = scope(w, "garbage");
  client a(w);
  ferry::directory_options small;
  small.max_record_bytes = 64;
  client s(w, small);

  // A valid record a foreign writer left (before the watch: it would be an event).
  w.plant_raw(ns + "foreign", ferry::encode_record(5, bytes_of("foreign")));
  ferry::watcher watch = s->watch(ns, true);

  ferry::publication good = take(a->publish(ns + "good", bytes_of("good")));
  REQUIRE(take(watch.next(hang_bound)).record.name == ns + "good");

  struct planted {
    std::string name;
    ferry::directory_errc want;
  };
  std::vector<planted> bad;
  auto plant = [&](const std::string& name, std::vector<std::byte> bytes,
                   ferry::directory_errc want) {
    w.plant_raw(ns + name, std::move(bytes));
    bad.push_back({ns + name, want});
  };
  std::mt19937 gen(12345);
  for (int i = 0; i < 16; ++i) {
    std::vector<std::byte> junk(gen() % 80);
    for (auto& b : junk) b = static_cast<std::byte>(gen() & 0xff);
    plant("random" + std::to_string(i), std::move(junk), ferry::directory_errc::bad_record);
  }
  const std::vector<std::byte> record = ferry::encode_record(9, pattern(8, 1));
  for (const std::size_t cut :
       {std::size_t{0}, std::size_t{7}, std::size_t{23}, std::size_t{24}, record.size() - 1}) {
    plant("cut" + std::to_string(cut), {record.begin(), record.begin() + static_cast<long>(cut)},
          ferry::directory_errc::bad_record);
  }
  for (std::size_t bit = 0; bit < record.size() * 8; ++bit) {
    std::vector<std::byte> flipped = record;
    flipped[bit / 8] ^= static_cast<std::byte>(1u << (bit % 8));
    plant("flip" + std::to_string(bit), std::move(flipped), ferry::directory_errc::bad_record);
  }
  std::vector<std::byte> longer = record;
  longer.push_back(std::byte{0});
  plant("longer", std::move(longer), ferry::directory_errc::bad_record);
  plant("zero", ferry::encode_record(0, pattern(8, 1)), ferry::directory_errc::bad_record);
  // Valid, but over the small client's limit (the default client reads it).
  plant("big", ferry::encode_record(3, pattern(1000, 2)), ferry::directory_errc::record_too_large);

  // Every one refused, in one batch between good names, by the small client.
  std::vector<std::string> names{ns + "good"};
  for (const planted& p : bad) names.push_back(p.name);
  names.push_back(ns + "foreign");
  names.push_back(ns + "missing");
  const auto results = take(s->lookup(names, hang_bound));
  REQUIRE(results.size() == names.size());
  REQUIRE(results.front().record);
  CHECK(string_of(results.front().record->value) == "good");
  CHECK(results.front().record->incarnation == good.incarnation());
  REQUIRE(results[names.size() - 2].record);
  CHECK(results[names.size() - 2].record->incarnation == 5u);
  CHECK(string_of(results[names.size() - 2].record->value) == "foreign");
  CHECK(text(results.back().error) == text(ferry::directory_errc::not_found));
  std::size_t wrong = 0;
  std::string first_wrong;
  for (std::size_t i = 0; i < bad.size(); ++i) {
    const ferry::lookup_result& r = results[i + 1];
    const bool ok = !r.record && r.name == bad[i].name && r.error == bad[i].want &&
                    r.message.find(bad[i].name) != std::string::npos;
    if (!ok && wrong++ == 0) first_wrong = bad[i].name + ": " + text(r.error) + " " + r.message;
  }
  INFO("first wrong outcome: " << first_wrong);
  CHECK(wrong == 0u);

  // Single lookups say the same, the message naming the name.
  for (const planted& p : {bad.front(), bad.back()}) {
    const failure f = failure_of(s->lookup(p.name, hang_bound));
    CHECK(text(f.code) == text(p.want));
    CHECK_THAT(f.what, Catch::Contains(p.name));
  }
  // The default client reads the big one: it is a valid record.
  const ferry::directory_record big = take(a->lookup(ns + "big", hang_bound));
  CHECK(big.incarnation == 3u);
  CHECK(big.value == pattern(1000, 2));

  // The watcher reported none of them, and goes on.
  ferry::publication after = take(a->publish(ns + "after", bytes_of("after")));
  const ferry::directory_event ev = take(watch.next(hang_bound));
  CHECK(ev.what == ferry::directory_event::kind::published);
  CHECK(ev.record.name == ns + "after");

  // A name with garbage under it can be published over.
  ferry::publication over = take(a->publish(ns + "random0", bytes_of("clean")));
  CHECK(string_of(take(s->lookup(ns + "random0", hang_bound)).value) == "clean");
}

/// Names that are empty, over 255 bytes, or have a byte outside A-Z a-z 0-9 . _ - : / are refused
/// with bad_name by publish, lookup (single and in a batch) and watch (which throws); 255 bytes and
/// the empty prefix are fine.
inline void bad_names_are_refused(directory_world& w) {
  const std::string ns = scope(w, "names");
  client a(w);
  const std::vector<std::string> bad{
      "",           std::string(256, 'a'), ns + "a space", ns + std::string("nul\0byte", 8),
      ns + "tab\t", ns + "\xc3\xa9",       ns + "star*"};
  for (const std::string& name : bad) {
    INFO("name '" << name << "' (" << name.size() << " bytes)");
    const failure pub = failure_of(a->publish(name, bytes_of("x")));
    CHECK(text(pub.code) == text(ferry::directory_errc::bad_name));
    CHECK_THAT(pub.what, Catch::Contains(name.substr(0, name.find('\0'))));  // what() ends at a NUL
    CHECK(text(failure_of(a->lookup(name, hang_bound)).code) ==
          text(ferry::directory_errc::bad_name));
    const auto batch = take(a->lookup(std::vector<std::string>{ns + "fine", name}, hang_bound));
    REQUIRE(batch.size() == 2u);
    CHECK(text(batch[0].error) == text(ferry::directory_errc::not_found));
    CHECK(text(batch[1].error) == text(ferry::directory_errc::bad_name));
    CHECK(batch[1].name == name);
    CHECK(text(failure_of_call([&] { return a->watch(name); }).code) ==
          text(ferry::directory_errc::bad_name));
    if (!name.empty()) {
      CHECK(text(failure_of_call([&] { return a->watch(name, true); }).code) ==
            text(ferry::directory_errc::bad_name));
    }
  }
  // The longest name is fine, as is watching everything.
  REQUIRE(ns.size() < 255u);
  const std::string longest = ns + std::string(255 - ns.size(), 'n');
  client b(w);
  ferry::watcher all = b->watch("", true);
  ferry::watcher exact = b->watch(longest);
  ferry::publication p = take(a->publish(longest, bytes_of("long")));
  CHECK(take(b->lookup(longest, hang_bound)).incarnation == p.incarnation());
  CHECK(take(exact.next(hang_bound)).record.name == longest);
  // The watch on everything sees it among whatever else the service holds.
  bool seen = false;
  const auto start = clock_type::now();
  for (int i = 0; i < 10000 && !seen && clock_type::now() - start < hang_bound; ++i) {
    try {
      seen = take(all.next(std::chrono::milliseconds(100))).record.name == longest;
    } catch (const std::system_error& e) {
      REQUIRE(e.code() == ferry::directory_errc::deadline_exceeded);
    }
  }
  CHECK(seen);
}

/// withdraw() then lookup: not_found; withdrawing twice is fine; dropping the handle withdraws (in
/// a while); move-assigning over a handle withdraws what it held; a client that goes withdraws what
/// it published, and its leftover handles fail with closed; a handle dropped just before its client
/// goes is withdrawn by the time the client is gone.
inline void withdraw_takes_name_down(directory_world& w) {
  const std::string ns = scope(w, "withdraw");
  auto a = std::make_unique<client>(w);
  client b(w);
  auto gone = [&](const std::string& name) {
    return eventually([&] {
      return failure_of(b->lookup(name, hang_bound)).code == ferry::directory_errc::not_found;
    });
  };

  ferry::publication p = take((*a)->publish(ns + "w", bytes_of("w")));
  REQUIRE(take(b->lookup(ns + "w", hang_bound)).incarnation == p.incarnation());
  REQUIRE(settle(p.withdraw()) == ferry::transfer_state::success);
  CHECK(text(failure_of(b->lookup(ns + "w", hang_bound)).code) ==
        text(ferry::directory_errc::not_found));
  CHECK(settle(p.withdraw()) == ferry::transfer_state::success);  // again: nothing to do

  {
    ferry::publication dropped = take((*a)->publish(ns + "dropped", bytes_of("d")));
    REQUIRE(string_of(take(b->lookup(ns + "dropped", hang_bound)).value) == "d");
  }
  CHECK(gone(ns + "dropped"));

  ferry::publication moved = take((*a)->publish(ns + "m1", bytes_of("m1")));
  moved = take((*a)->publish(ns + "m2", bytes_of("m2")));
  CHECK(gone(ns + "m1"));
  CHECK(string_of(take(b->lookup(ns + "m2", hang_bound)).value) == "m2");

  // The client goes: what it still published goes with it; its handles turn inert.
  ferry::publication left = take((*a)->publish(ns + "left", bytes_of("l")));
  a.reset();
  CHECK(gone(ns + "m2"));
  CHECK(gone(ns + "left"));
  const ferry::transfer late = left.withdraw();
  CHECK(settle(late) == ferry::transfer_state::failed);
  CHECK(text(late.error()) == text(ferry::directory_errc::closed));
  CHECK(left.name() == ns + "left");

  // A publication dropped just before its client goes (a server's shutdown: the handle, then the
  // directory) is withdrawn, not left to a lease longer than any wait here.
  for (int round = 0; round < 5; ++round) {
    auto c = std::make_unique<client>(w);
    const std::string name = ns + "last-" + std::to_string(round);
    {
      ferry::publication last = take((*c)->publish(name, bytes_of("x"), with_lease(std::chrono::seconds(60))));
    }
    c.reset();
    CHECK(text(failure_of(b->lookup(name, hang_bound)).code) == text(ferry::directory_errc::not_found));
  }
}

/// named_peer with a fake endpoint: bound to the publication's incarnation; severed with
/// peer_restarted when another incarnation is published (the next get() connects to it), not
/// touched when the superseded one withdraws, severed with peer_gone when the publisher dies (then
/// get() throws), and again when a later one withdraws.
inline void named_peer_fencing(directory_world& w) {
  const std::string name = scope(w, "fencing") + "peer";
  client consumer(w);
  auto first = std::make_unique<client>(w);
  ferry::publication p1 =
      take((*first)->publish(name, bytes_of("gen-1"), with_lease(std::chrono::seconds(1))));

  fake_factory factory;
  ferry::named_peer<fake_endpoint> peer(*consumer, name, factory.connect());
  CHECK(peer.incarnation() == 0u);
  CHECK(peer.connects() == 0u);
  CHECK(!peer.fenced());

  const fake_endpoint e1 = peer.get(hang_bound);
  CHECK(e1.incarnation == p1.incarnation());
  CHECK(e1.value == "gen-1");
  CHECK(peer.incarnation() == p1.incarnation());
  CHECK(peer.connects() == 1u);
  CHECK(e1.severed() == 0);
  CHECK(peer.get(hang_bound).same(e1));  // the same endpoint while nothing changed
  CHECK(ferry::sync_wait(peer.use(hang_bound)).same(e1));
  CHECK(peer.connects() == 1u);

  // A restart: a second process publishes while the first one's lease is live.
  auto second = std::make_unique<client>(w);
  ferry::publication p2 =
      take((*second)->publish(name, bytes_of("gen-2"), with_lease(std::chrono::seconds(1))));
  REQUIRE(p2.incarnation() > p1.incarnation());
  REQUIRE(wait_until([&] { return e1.severed() != 0; }, hang_bound));
  CHECK(e1.severed() == static_cast<int>(ferry::directory_errc::peer_restarted));
  CHECK(text(peer.fenced()) == text(ferry::directory_errc::peer_restarted));
  const fake_endpoint e2 = peer.get(hang_bound);
  CHECK(!e2.same(e1));
  CHECK(e2.incarnation == p2.incarnation());
  CHECK(e2.value == "gen-2");
  CHECK(peer.incarnation() == p2.incarnation());
  CHECK(peer.connects() == 2u);

  // The first process goes (withdrawing its superseded record): nothing happens to e2.
  p1 = ferry::publication{};
  first.reset();
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  CHECK(e2.severed() == 0);
  CHECK(peer.get(hang_bound).same(e2));

  // The second dies: e2 is severed with peer_gone within its lease (plus slack).
  const auto start = clock_type::now();
  w.kill(**second);
  REQUIRE(wait_until([&] { return e2.severed() != 0; }, hang_bound));
  INFO("severed after " << ms_since(start) << " ms");
  CHECK(e2.severed() == static_cast<int>(ferry::directory_errc::peer_gone));
  CHECK(text(peer.fenced()) == text(ferry::directory_errc::peer_gone));
  CHECK(peer.incarnation() == 0u);
  const failure after = failure_of_call([&] { return peer.get(hang_bound); });
  CHECK((after.code == ferry::directory_errc::not_found ||
         after.code == ferry::directory_errc::peer_gone));
  CHECK(e1.link->severs.load() == 1);
  CHECK(e2.link->severs.load() == 1);
  p2 = ferry::publication{};
  second.reset();

  // A third comes up: get() connects to it; it withdraws: severed with peer_gone.
  client third(w);
  ferry::publication p3 = take(third->publish(name, bytes_of("gen-3")));
  fake_endpoint e3;
  REQUIRE(eventually([&] {
    return failure_of_call([&] {
             e3 = peer.get(hang_bound);
             return 0;
           }).code == std::error_code{};
  }));
  CHECK(e3.incarnation == p3.incarnation());
  CHECK(e3.value == "gen-3");
  CHECK(peer.connects() == 3u);
  REQUIRE(settle(p3.withdraw()) == ferry::transfer_state::success);
  REQUIRE(wait_until([&] { return e3.severed() != 0; }, hang_bound));
  CHECK(e3.severed() == static_cast<int>(ferry::directory_errc::peer_gone));
  // It had a peer and now has none: peer_gone, not merely not_found.
  CHECK(text(failure_of_call([&] { return peer.get(hang_bound); }).code) ==
        text(ferry::directory_errc::peer_gone));
}

/// named_peer under a storm: getter threads call get() without pause while the publisher restarts
/// 20 times. No get() returns an endpoint at or below an incarnation already fenced when it was
/// called; afterwards every endpoint handed out for an older incarnation was severed with
/// peer_restarted, every endpoint made is severed but one, and that one is the last incarnation's,
/// which get() returns. (An endpoint made by a get() that lost the race to install it is closed:
/// severed with directory_errc::closed.)
inline void named_peer_storm(directory_world& w) {
  const std::string name = scope(w, "storm") + "peer";
  constexpr int restarts = 20;
  constexpr int getters = 4;
  constexpr int max_gets = 200000;  // per thread
  const auto opts = with_lease(std::chrono::seconds(5));
  const auto start = clock_type::now();

  client consumer(w);
  auto live = std::make_unique<client>(w);
  ferry::publication live_pub = take((*live)->publish(name, bytes_of("gen-0"), opts));
  fake_factory factory;
  ferry::named_peer<fake_endpoint> peer(*consumer, name, factory.connect());

  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> newest_got{0};
  std::atomic<int> stale{0}, refused{0}, unexpected{0}, got{0};
  std::mutex unexpected_mutex;
  std::string first_unexpected;
  std::vector<std::vector<fake_endpoint>> handed(getters);
  std::vector<std::thread> threads;
  for (int t = 0; t < getters; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < max_gets && !stop.load(); ++i) {
        const std::uint64_t floor = factory.severed_floor();
        try {
          fake_endpoint e = peer.get(hang_bound);
          if (e.incarnation <= floor) stale.fetch_add(1);
          std::uint64_t seen = newest_got.load();
          while (seen < e.incarnation && !newest_got.compare_exchange_weak(seen, e.incarnation)) {
          }
          auto& mine = handed[static_cast<std::size_t>(t)];
          if (mine.empty() || !mine.back().same(e)) mine.push_back(std::move(e));
          got.fetch_add(1);
        } catch (const std::system_error& e) {
          // Lost a race with a restart while connecting: allowed, the caller looks up again.
          if (e.code() == ferry::directory_errc::peer_gone ||
              e.code() == ferry::directory_errc::peer_restarted) {
            refused.fetch_add(1);
          } else {
            std::lock_guard lock(unexpected_mutex);
            if (unexpected.fetch_add(1) == 0) first_unexpected = e.what();
          }
        } catch (const std::exception& e) {
          std::lock_guard lock(unexpected_mutex);
          if (unexpected.fetch_add(1) == 0) first_unexpected = e.what();
        }
        std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
    });
  }
  // Stops and joins the getters however this scope is left (a failed REQUIRE throws).
  struct joiner {
    std::atomic<bool>& stop;
    std::vector<std::thread>& threads;
    ~joiner() {
      stop.store(true);
      for (auto& t : threads) {
        if (t.joinable()) t.join();
      }
    }
  } join_getters{stop, threads};

  std::uint64_t last = live_pub.incarnation();
  for (int k = 1; k <= restarts; ++k) {
    // Let the getters reach the current incarnation first, so that each restart fences something.
    (void)wait_until([&] { return newest_got.load() >= last; }, std::chrono::seconds(2));
    auto next = std::make_unique<client>(w);
    ferry::publication pub =
        take((*next)->publish(name, bytes_of("gen-" + std::to_string(k)), opts));
    REQUIRE(pub.incarnation() > last);
    last = pub.incarnation();
    live_pub = std::move(pub);  // the old process withdraws its superseded record
    live = std::move(next);     // and goes
  }
  (void)wait_until([&] { return newest_got.load() >= last; }, std::chrono::seconds(2));
  stop.store(true);
  for (auto& t : threads) t.join();
  REQUIRE(clock_type::now() - start < 2 * hang_bound);  // the getters ended

  // Settled: get() gives the last incarnation's endpoint.
  fake_endpoint final_endpoint;
  REQUIRE(eventually([&] {
    return failure_of_call([&] {
             final_endpoint = peer.get(hang_bound);
             return 0;
           }).code == std::error_code{} &&
           final_endpoint.incarnation == last;
  }));
  CHECK(final_endpoint.value == "gen-" + std::to_string(restarts));
  CHECK(peer.incarnation() == last);
  CHECK(final_endpoint.severed() == 0);

  INFO("gets: " << got.load() << ", refused: " << refused.load() << ", connects: "
                << peer.connects() << ", endpoints made: " << factory.made().size()
                << ", storm took " << ms_since(start) << " ms");
  {
    std::lock_guard lock(unexpected_mutex);
    INFO("first unexpected failure: " << first_unexpected);
    CHECK(unexpected.load() == 0);
  }
  CHECK(stale.load() == 0);
  CHECK(got.load() > 0);

  // Every endpoint handed out for an older incarnation was fenced as a restart (no name ever went).
  std::size_t handed_old_unfenced = 0, handed_count = 0;
  for (const auto& mine : handed) {
    for (const fake_endpoint& e : mine) {
      ++handed_count;
      if (!e.same(final_endpoint) &&
          e.severed() != static_cast<int>(ferry::directory_errc::peer_restarted)) {
        ++handed_old_unfenced;
      }
    }
  }
  INFO(handed_count << " endpoints handed out");
  CHECK(handed_old_unfenced == 0u);
  // Every endpoint made: exactly one live, the final one; the others fenced as a restart or, for a
  // duplicate never handed out, closed; each severed once.
  std::size_t made_live = 0, final_live = 0, wrong_reason = 0, severed_twice = 0;
  for (const fake_endpoint& e : factory.made()) {
    if (e.severed() == 0) {
      ++made_live;
      if (e.same(final_endpoint)) ++final_live;
    } else if (e.severed() != static_cast<int>(ferry::directory_errc::peer_restarted) &&
               e.severed() != static_cast<int>(ferry::directory_errc::closed)) {
      ++wrong_reason;
    }
    if (e.link->severs.load() > 1) ++severed_twice;
  }
  CHECK(made_live == 1u);
  CHECK(final_live == 1u);
  CHECK(wrong_reason == 0u);
  CHECK(severed_twice == 0u);
  CHECK(peer.connects() >= 2u);
  CHECK(clock_type::now() - start < 2 * hang_bound);
}

/// Makes a world with `make` and runs `behaviour` on it; a null world passes with a warning.
template <class Make>
void run_case(Make&& make, void (*behaviour)(directory_world&)) {
  std::unique_ptr<directory_world> world = make();
  if (!world) {
    WARN("no directory service for this world: skipped");
    return;
  }
  behaviour(*world);
}

}  // namespace ferry_test::directory_contract

/// Registers one contract behaviour as a TEST_CASE (see FERRY_DIRECTORY_CONTRACT).
#define FERRY_DIRECTORY_CONTRACT_CASE(LABEL, TAGS, MAKE_WORLD, BEHAVIOUR, WHAT)               \
  TEST_CASE(LABEL ": " WHAT, TAGS "[contract]") {                                             \
    ::ferry_test::directory_contract::run_case(MAKE_WORLD,                                    \
                                               &::ferry_test::directory_contract::BEHAVIOUR); \
  }

/// Registers the whole directory contract for the worlds MAKE_WORLD() makes: one TEST_CASE per
/// behaviour, named LABEL ": <behaviour>" (LABEL and TAGS are string literals).
#define FERRY_DIRECTORY_CONTRACT(LABEL, TAGS, MAKE_WORLD)                                      \
  FERRY_DIRECTORY_CONTRACT_CASE(LABEL, TAGS, MAKE_WORLD, publish_then_lookup,                  \
                                "a publication is found by another client")                    \
  FERRY_DIRECTORY_CONTRACT_CASE(LABEL, TAGS, MAKE_WORLD, incarnations_grow,                    \
                                "incarnations grow across withdraws and restarts")             \
  FERRY_DIRECTORY_CONTRACT_CASE(LABEL, TAGS, MAKE_WORLD, many_lookups_at_once,                 \
                                "1000 names looked up at once, in a batch and singly")         \
  FERRY_DIRECTORY_CONTRACT_CASE(LABEL, TAGS, MAKE_WORLD, watch_prefix,                         \
                                "a prefix watch reports publications and gone names in order") \
  FERRY_DIRECTORY_CONTRACT_CASE(LABEL, TAGS, MAKE_WORLD, watch_exact,                          \
                                "an exact watch ignores other names")                          \
  FERRY_DIRECTORY_CONTRACT_CASE(LABEL, TAGS, MAKE_WORLD, watch_next_deadline,                  \
                                "watcher::next times out, and the watch goes on")              \
  FERRY_DIRECTORY_CONTRACT_CASE(LABEL, TAGS, MAKE_WORLD, killed_client_goes,                   \
                                "a killed client's record goes one lease later")               \
  FERRY_DIRECTORY_CONTRACT_CASE(LABEL, TAGS, MAKE_WORLD, keepalive_keeps_record,               \
                                "a live client's record outlives its lease")                   \
  FERRY_DIRECTORY_CONTRACT_CASE(LABEL, TAGS, MAKE_WORLD, garbage_is_refused,                   \
                                "garbage under a name is refused, naming the name")            \
  FERRY_DIRECTORY_CONTRACT_CASE(LABEL, TAGS, MAKE_WORLD, bad_names_are_refused,                \
                                "bad names are refused by publish, lookup and watch")          \
  FERRY_DIRECTORY_CONTRACT_CASE(LABEL, TAGS, MAKE_WORLD, withdraw_takes_name_down,             \
                                "withdrawing, or dropping the handle, takes the name down")    \
  FERRY_DIRECTORY_CONTRACT_CASE(LABEL, TAGS, MAKE_WORLD, named_peer_fencing,                   \
                                "named_peer fences a restarted or dead peer")                  \
  FERRY_DIRECTORY_CONTRACT_CASE(LABEL, TAGS, MAKE_WORLD, named_peer_storm,                     \
                                "named_peer under concurrent gets and 20 restarts")

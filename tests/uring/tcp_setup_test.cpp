// Awaitable TCP set-up through the io_uring ring: tcp_connection::connect_async and
// tcp_listener::accept_async, with deadlines the kernel keeps, cancels, drops and a ring that goes.

#include <catch2/catch.hpp>

#include <atomic>
#include <cerrno>
#include <filesystem>
#include <optional>
#include <random>
#include <string>
#include <system_error>
#include <vector>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <ferry/loopback.hpp>
#include <ferry/metrics.hpp>
#include <ferry/uring/tcp.hpp>
#include <ferry/wait_all.hpp>
#include <ferry/when_all.hpp>

#include "helpers.hpp"
#include "uring/uring_helpers.hpp"

using namespace ferry_test;
using ferry::transfer_state;
namespace uring = ferry::uring;

namespace {

// Descriptors this process has open now.
std::size_t open_descriptors() {
  std::size_t n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
  return n;
}

// A listener whose accept queue is full (backlog 0, one connection waiting in it, never accepted):
// the kernel drops further SYNs, so a connect to it waits until its deadline.
struct full_listener {
  int fd = -1;
  std::vector<int> queued;
  std::uint16_t port = 0;

  full_listener() {
    fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    REQUIRE(::listen(fd, 0) == 0);
    socklen_t len = sizeof a;
    REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0);
    port = ntohs(a.sin_port);
    a.sin_port = htons(port);
    for (int i = 0; i < 2; ++i) {
      const int c = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
      (void)::connect(c, reinterpret_cast<sockaddr*>(&a), sizeof a);
      queued.push_back(c);
    }
  }
  ~full_listener() {
    for (const int c : queued) ::close(c);
    ::close(fd);
  }
};

// The error a pending connection ended with, or empty if it succeeded.
std::error_code failure_of(uring::pending_connection& p) {
  try {
    (void)p.get();
    return {};
  } catch (const std::system_error& e) {
    return e.code();
  }
}

ferry::task<std::pair<uring::tcp_connection, uring::tcp_connection>> dial_and_accept(
    uring::ring& r, uring::tcp_listener& l) {
  uring::pending_connection accepting = l.accept_async(r, 5s);
  uring::tcp_connection client =
      co_await uring::tcp_connection::connect_async(r, "127.0.0.1", l.port(), 5s);
  uring::tcp_connection server = co_await accepting;
  co_return std::pair{std::move(client), std::move(server)};
}

}  // namespace

TEST_CASE("tcp setup: connect_async and accept_async, co_awaited, make a working connection",
          "[tcp][concurrency]") {
  FERRY_REQUIRE_URING();
  for (const ferry::progress_mode mode :
       {ferry::progress_mode::busy, ferry::progress_mode::adaptive, ferry::progress_mode::park}) {
    INFO(mode_name(mode));
    ferry::progress_executor exec(executor_in(mode));
    uring::ring r(exec);
    uring::tcp_listener l("127.0.0.1", 0);
    ferry::run_loop loop;
    auto [client, server] = ferry::sync_wait(loop, dial_and_accept(r, l));
    const auto payload = pattern(70000, 3);
    std::vector<std::byte> dst(70000);
    uring::received_block got;
    ferry::transfer in = server.receive(dst, got);
    REQUIRE(client.send(42, payload).wait_for(hang_bound) == transfer_state::success);
    REQUIRE(in.wait_for(hang_bound) == transfer_state::success);
    CHECK(got.id == 42);
    CHECK(dst == payload);
  }
}

TEST_CASE("tcp setup: an accept with no peer fails at its deadline, not before and not much after",
          "[tcp]") {
  FERRY_REQUIRE_URING();
  ferry::progress_executor exec;
  uring::ring r(exec);
  uring::tcp_listener l("127.0.0.1", 0);
  const auto start = clock_type::now();
  uring::pending_connection p = l.accept_async(r, 200ms);
  REQUIRE(p.made().wait_for(hang_bound) == transfer_state::failed);
  CHECK(ms_since(start) >= 200);
  CHECK(ms_since(start) < 5000);
  CHECK(p.made().error() == uring::errc::deadline_exceeded);
  try {
    (void)p.get();
    FAIL("get() of a failed accept returned");
  } catch (const std::system_error& e) {
    CHECK(e.code() == uring::errc::deadline_exceeded);
    CHECK(std::string(e.what()).find("accept_async") != std::string::npos);
  }
  // A zero timeout looks once: with nobody there, it fails at once.
  uring::pending_connection look = l.accept_async(r, 0s);
  REQUIRE(look.made().wait_for(hang_bound) == transfer_state::failed);
  CHECK(look.made().error() == uring::errc::deadline_exceeded);
  // The listener still takes the next peer.
  uring::pending_connection next = l.accept_async(r, hang_bound);
  uring::tcp_connection c = uring::tcp_connection::connect(r, "127.0.0.1", l.port());
  CHECK(next.get().is_open());
}

TEST_CASE("tcp setup: a connect nobody answers fails at its deadline and closes its socket",
          "[tcp]") {
  FERRY_REQUIRE_URING();
  ferry::progress_executor exec;
  uring::ring r(exec);
  full_listener silent;
  const std::size_t before = open_descriptors();
  const auto start = clock_type::now();
  uring::pending_connection p =
      uring::tcp_connection::connect_async(r, "127.0.0.1", silent.port, 300ms);
  REQUIRE(p.made().wait_for(hang_bound) == transfer_state::failed);
  CHECK(ms_since(start) >= 300);
  CHECK(ms_since(start) < 5000);
  CHECK(failure_of(p) == uring::errc::deadline_exceeded);
  CHECK(open_descriptors() == before);
}

TEST_CASE("tcp setup: a refused connect names the address and the system's error", "[tcp]") {
  FERRY_REQUIRE_URING();
  ferry::progress_executor exec;
  uring::ring r(exec);
  std::uint16_t closed_port = 0;
  {
    uring::tcp_listener gone("127.0.0.1", 0);
    closed_port = gone.port();
  }
  const std::size_t before = open_descriptors();
  uring::pending_connection p = uring::tcp_connection::connect_async(r, "127.0.0.1", closed_port);
  try {
    (void)p.get();
    FAIL("a connect to a closed port succeeded");
  } catch (const std::system_error& e) {
    CHECK(e.code() == std::errc::connection_refused);
    CHECK(std::string(e.what()).find("127.0.0.1:" + std::to_string(closed_port)) !=
          std::string::npos);
  }
  CHECK(open_descriptors() == before);
  // A host that does not resolve is refused before anything is published, naming it.
  CHECK_THROWS_WITH(uring::tcp_connection::connect_async(r, "no-such-host.invalid", 1),
                    Catch::Contains("no-such-host.invalid"));
  // And a negative buffer size, naming the field.
  uring::tcp_options bad;
  bad.receive_buffer = -1;
  CHECK_THROWS_WITH(uring::tcp_connection::connect_async(r, "127.0.0.1", 1, 1s, bad),
                    Catch::Contains("receive_buffer"));
}

TEST_CASE("tcp setup: a connect tries each address the host resolves to, in turn", "[tcp]") {
  FERRY_REQUIRE_URING();
  const auto addresses = ferry::detail::resolve("localhost", 1, 0, {}, "test");
  bool v4 = false;
  bool v6_first = false;
  for (const auto& a : addresses) v4 = v4 || a.family == AF_INET;
  if (!addresses.empty()) v6_first = addresses.front().family == AF_INET6;
  if (!v4 || !v6_first) {
    WARN("localhost does not resolve to ::1 before 127.0.0.1 here; nothing to fall back from");
    return;
  }
  ferry::progress_executor exec;
  uring::ring r(exec);
  uring::tcp_listener l("127.0.0.1", 0);  // not on ::1: the first address is refused
  uring::pending_connection accepting = l.accept_async(r, hang_bound);
  uring::pending_connection p = uring::tcp_connection::connect_async(r, "localhost", l.port());
  CHECK(p.get().is_open());
  CHECK(accepting.get().is_open());
}

TEST_CASE("tcp setup: cancelling an accept ends it cancelled, and the listener goes on", "[tcp]") {
  FERRY_REQUIRE_URING();
  ferry::progress_executor exec;
  uring::ring r(exec);
  uring::tcp_listener l("127.0.0.1", 0);
  uring::pending_connection p = l.accept_async(r, hang_bound);
  REQUIRE(wait_until([&] { return r.counters().submitted >= 1; }));
  r.cancel(p.made());
  REQUIRE(p.made().wait_for(hang_bound) == transfer_state::cancelled);
  CHECK_THROWS_AS(p.get(), std::system_error);
  uring::pending_connection next = l.accept_async(r, hang_bound);
  uring::tcp_connection c = uring::tcp_connection::connect(r, "127.0.0.1", l.port());
  CHECK(next.get().is_open());
}

TEST_CASE("tcp setup: closing the listener ends its waiting accepts with listener_closed",
          "[tcp][concurrency]") {
  FERRY_REQUIRE_URING();
  ferry::progress_executor exec;
  uring::ring r(exec);
  const std::size_t before = open_descriptors();
  std::vector<uring::pending_connection> waiting;
  {
    uring::tcp_listener l("127.0.0.1", 0);
    for (int i = 0; i < 4; ++i) waiting.push_back(l.accept_async(r, hang_bound));
    REQUIRE(wait_until([&] { return r.counters().submitted >= 4; }));
  }
  for (auto& p : waiting) {
    REQUIRE(p.made().wait_for(hang_bound) == transfer_state::failed);
    CHECK(p.made().error() == uring::errc::listener_closed);
  }
  waiting.clear();
  // The listening socket closes with the last accept (the executor lets go of it just after the
  // transfer ends).
  CHECK(wait_until([&] { return open_descriptors() == before; }));
  // A moved-from listener refuses at once.
  uring::tcp_listener a("127.0.0.1", 0);
  uring::tcp_listener b(std::move(a));
  uring::pending_connection none = a.accept_async(r);  // NOLINT(bugprone-use-after-move)
  CHECK(none.made().error() == uring::errc::listener_closed);
}

TEST_CASE("tcp setup: a pending connection dropped untaken closes what it made", "[tcp]") {
  FERRY_REQUIRE_URING();
  ferry::progress_executor exec;
  uring::ring r(exec);
  uring::tcp_listener l("127.0.0.1", 0);
  const std::size_t before = open_descriptors();
  {
    // Dropped while waiting: the peer that then connects is accepted and closed by the executor.
    std::optional<uring::pending_connection> p(l.accept_async(r, hang_bound));
    REQUIRE(wait_until([&] { return r.counters().submitted >= 1; }));
    p.reset();
    uring::tcp_connection peer = uring::tcp_connection::connect(r, "127.0.0.1", l.port());
    char byte = 0;
    CHECK(::recv(peer.native_handle(), &byte, 1, 0) == 0);  // end of stream: closed by ferry
  }
  {
    // Dropped after it was made.
    uring::pending_connection made = uring::tcp_connection::connect_async(r, "127.0.0.1", l.port());
    REQUIRE(made.made().wait_for(hang_bound) == transfer_state::success);
    uring::tcp_connection server = l.accept(r);
  }
  CHECK(wait_until([&] { return open_descriptors() == before; }));
}

TEST_CASE("tcp setup: get() refuses to wait on the ring's executor thread", "[tcp]") {
  FERRY_REQUIRE_URING();
  ferry::progress_executor exec;
  uring::ring r(exec);
  ferry::loopback_backend lb(exec);
  uring::tcp_listener l("127.0.0.1", 0);
  uring::pending_connection p = l.accept_async(r, hang_bound);
  std::atomic<int> outcome{0};
  ferry::inline_scheduler on_executor;
  std::vector<std::byte> a(8), b(8);
  [](ferry::inline_scheduler& s, ferry::transfer t, uring::pending_connection& p,
     std::atomic<int>& outcome) -> detached_inline {
    (void)co_await ferry::resume_on(s, t);  // on the executor's thread from here
    try {
      (void)p.get();
      outcome.store(1);
    } catch (const std::system_error& e) {
      outcome.store(e.code() == std::errc::resource_deadlock_would_occur ? 2 : 3);
    }
  }(on_executor, lb.copy(b, a), p, outcome);
  REQUIRE(wait_until([&] { return outcome.load() != 0; }));
  CHECK(outcome.load() == 2);
}

TEST_CASE("tcp setup: a batch wait on an accept and a connect together", "[tcp]") {
  FERRY_REQUIRE_URING();
  ferry::progress_executor exec;
  uring::ring r(exec);
  uring::tcp_listener l("127.0.0.1", 0);
  uring::pending_connection a = l.accept_async(r, hang_bound);
  uring::pending_connection c = uring::tcp_connection::connect_async(r, "127.0.0.1", l.port());
  std::vector<ferry::transfer> both{a.made(), c.made()};
  REQUIRE(ferry::wait_all(both, hang_bound).ok());
  CHECK(a.get().is_open());
  CHECK(c.get().is_open());
  CHECK_THROWS_AS(c.get(), std::logic_error);  // taken already
}

TEST_CASE("tcp setup: a ring destroyed under waiting accepts and connects ends them all",
          "[tcp][concurrency]") {
  FERRY_REQUIRE_URING();
  full_listener silent;
  ferry::progress_executor exec;
  const std::size_t before = open_descriptors();
  std::vector<uring::pending_connection> waiting;
  {
    uring::tcp_listener l("127.0.0.1", 0);
    {
      uring::ring r(exec);
      for (int i = 0; i < 8; ++i) {
        waiting.push_back(l.accept_async(r, hang_bound));
        waiting.push_back(uring::tcp_connection::connect_async(r, "127.0.0.1", silent.port, -1s));
      }
      REQUIRE(wait_until([&] { return r.counters().submitted >= 16; }));
    }
    for (auto& p : waiting) {
      REQUIRE(p.made().done());
      CHECK(p.made().error() == ferry::errc::backend_shut_down);
    }
    waiting.clear();
  }
  CHECK(wait_until([&] { return open_descriptors() == before; }));
}

TEST_CASE("tcp setup: many connects and accepts at once, with random deadlines, cancels and drops: "
          "each ends, each one made works, and no descriptor leaks",
          "[tcp][concurrency]") {
  FERRY_REQUIRE_URING();
  ferry::progress_executor exec;
  // A small ring: connects and accepts wait for room, and are cancelled and dropped there too.
  uring::ring_options small;
  small.entries = 16;
  uring::ring r(exec, small);
  uring::tcp_listener l("127.0.0.1", 0, 512);
  const std::size_t before = open_descriptors();
  std::mt19937 rng(Catch::rngSeed());
  constexpr int rounds = 3;
  constexpr int n = 48;
  for (int round = 0; round < rounds; ++round) {
    std::vector<std::optional<uring::pending_connection>> accepts;
    std::vector<std::optional<uring::pending_connection>> connects;
    for (int i = 0; i < n; ++i) {
      const auto deadline = std::chrono::milliseconds(rng() % 4 == 0 ? 1 + rng() % 20 : 5000);
      accepts.emplace_back(l.accept_async(r, deadline));
      connects.emplace_back(uring::tcp_connection::connect_async(r, "127.0.0.1", l.port(), 5s));
    }
    for (int i = 0; i < n; ++i) {
      switch (rng() % 6) {
        case 0: r.cancel(accepts[i]->made()); break;
        case 1: r.cancel(connects[i]->made()); break;
        case 2: accepts[i].reset(); break;
        case 3: connects[i].reset(); break;
        default: break;
      }
    }
    // Accepts that are left take the connects that are left; a connect whose peer was never
    // accepted still connects (the kernel's queue): everything ends by its deadline.
    std::vector<uring::tcp_connection> made;
    for (auto* side : {&accepts, &connects}) {
      for (auto& p : *side) {
        if (!p) continue;
        REQUIRE(p->made().wait_for(hang_bound) != transfer_state::pending);
        if (p->made().state() == transfer_state::success) {
          made.push_back(p->get());
        } else {
          const std::error_code ec = p->made().error();
          CHECK((ec == ferry::errc::cancelled || ec == uring::errc::deadline_exceeded));
        }
      }
    }
    // Each connection made is usable: a frame sent on it ends (its peer may be a dropped connect,
    // closed by now, so the send may fail; it never hangs).
    const auto payload = pattern(100, 1);
    for (auto& c : made) CHECK(c.send(1, payload).wait_for(hang_bound) != transfer_state::pending);
    made.clear();
    accepts.clear();
    connects.clear();
    // Connections left in the listener's queue: take and close them.
    for (;;) {
      uring::pending_connection drain = l.accept_async(r, 0s);
      if (drain.made().wait_for(hang_bound) != transfer_state::success) break;
      (void)drain.get();
    }
  }
  CHECK(wait_until([&] { return open_descriptors() == before; }));
}

TEST_CASE("tcp setup: a metered ring makes connections and meters only its transfers", "[tcp]") {
  FERRY_REQUIRE_URING();
  ferry::metrics::registry metrics("uring");
  {
    ferry::progress_executor exec;
    uring::ring_options options;
    options.metrics = &metrics;
    uring::ring r(exec, options);
    uring::tcp_listener l("127.0.0.1", 0);
    ferry::run_loop loop;
    auto [client, server] = ferry::sync_wait(loop, dial_and_accept(r, l));
    const auto payload = pattern(100, 2);
    REQUIRE(client.send(1, payload).wait_for(hang_bound) == transfer_state::success);
  }
  const ferry::metrics::snapshot s = metrics.snapshot();
  CHECK(find_series(s, "send", "").succeeded == 1);
}

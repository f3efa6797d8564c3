// transfer and completer: the state machine, errors, blocking waits and handle lifetimes.

#include <catch2/catch.hpp>

#include <atomic>
#include <thread>
#include <vector>

#include <ferry/transfer.hpp>

#include "helpers.hpp"

using namespace ferry_test;
using ferry::transfer_state;

TEST_CASE("a new manual transfer is pending with no error", "[transfer]") {
  auto [t, c] = ferry::make_manual_transfer();
  CHECK(t.state() == transfer_state::pending);
  CHECK_FALSE(t.done());
  CHECK(t.valid());
  CHECK_FALSE(t.error());
}

TEST_CASE("the first terminal call wins and later calls change nothing", "[transfer]") {
  SECTION("succeed first") {
    auto [t, c] = ferry::make_manual_transfer();
    CHECK(c.succeed());
    CHECK_FALSE(c.fail(std::make_error_code(std::errc::io_error)));
    CHECK_FALSE(c.cancel());
    CHECK_FALSE(c.succeed());
    CHECK(t.state() == transfer_state::success);
    CHECK_FALSE(t.error());
  }
  SECTION("fail first: a later success does not overwrite the error") {
    auto [t, c] = ferry::make_manual_transfer();
    CHECK(c.fail(std::make_error_code(std::errc::connection_reset)));
    CHECK_FALSE(c.succeed());
    CHECK_FALSE(c.cancel());
    CHECK(t.state() == transfer_state::failed);
    CHECK(t.error() == std::errc::connection_reset);
  }
  SECTION("cancel first") {
    auto [t, c] = ferry::make_manual_transfer();
    CHECK(c.cancel());
    CHECK_FALSE(c.succeed());
    CHECK(t.state() == transfer_state::cancelled);
    CHECK(t.error() == ferry::errc::cancelled);
  }
  SECTION("a copy of the completer is refused too") {
    auto [t, c] = ferry::make_manual_transfer();
    ferry::completer c2 = c;
    CHECK(c2.succeed());
    CHECK_FALSE(c.fail(std::make_error_code(std::errc::io_error)));
    CHECK(t.state() == transfer_state::success);
  }
}

TEST_CASE("concurrent completers: exactly one wins", "[transfer][concurrency]") {
  for (int round = 0; round < 2000; ++round) {
    auto [t, c] = ferry::make_manual_transfer();
    std::atomic<int> winners{0};
    std::atomic<bool> go{false};
    std::vector<std::thread> threads;
    for (int i = 0; i < 3; ++i) {
      threads.emplace_back([&, i, c = c]() mutable {
        while (!go.load()) {
        }
        const bool won = i == 0   ? c.succeed()
                         : i == 1 ? c.fail(std::make_error_code(std::errc::io_error))
                                  : c.cancel();
        if (won) winners.fetch_add(1);
      });
    }
    go.store(true);
    for (auto& th : threads) th.join();
    REQUIRE(winners.load() == 1);
    REQUIRE(t.done());
    REQUIRE((t.state() == transfer_state::success) == !t.error());
  }
}

TEST_CASE("a failure always carries an error code", "[transfer]") {
  auto [t, c] = ferry::make_manual_transfer();
  CHECK(c.fail(std::error_code{}));
  CHECK(t.state() == transfer_state::failed);
  CHECK(t.error() == ferry::errc::unspecified_failure);
  CHECK_THAT(t.error().message(), Catch::Contains("empty error_code"));
}

TEST_CASE("an empty transfer handle reports a clear error and never blocks", "[transfer]") {
  ferry::transfer t;
  CHECK_FALSE(t.valid());
  CHECK(t.state() == transfer_state::failed);
  CHECK(t.done());
  CHECK(t.error() == ferry::errc::empty_transfer);
  CHECK(t.wait() == transfer_state::failed);
  CHECK(t.wait_for(-1ms) == transfer_state::failed);
  CHECK_THAT(t.error().message(), Catch::Contains("empty"));

  auto [moved_from, c] = ferry::make_manual_transfer();
  ferry::transfer taken = std::move(moved_from);
  CHECK(moved_from.error() == ferry::errc::empty_transfer);  // NOLINT(bugprone-use-after-move)
  CHECK(taken.state() == transfer_state::pending);
}

TEST_CASE("the last completer to go fails a pending transfer as abandoned", "[transfer]") {
  ferry::transfer t;
  {
    auto [tt, c] = ferry::make_manual_transfer();
    t = tt;
    ferry::completer copy = c;
  }
  CHECK(t.state() == transfer_state::failed);
  CHECK(t.error() == ferry::errc::abandoned);

  ferry::transfer done;
  {
    auto [tt, c] = ferry::make_manual_transfer();
    done = tt;
    c.succeed();
  }
  CHECK(done.state() == transfer_state::success);
}

TEST_CASE("dropping every transfer handle of a pending transfer and completing it later is safe",
          "[transfer][concurrency]") {
  std::vector<ferry::completer> completers;
  for (int i = 0; i < 1000; ++i) {
    auto [t, c] = ferry::make_manual_transfer();
    completers.push_back(std::move(c));
  }
  std::atomic<int> accepted{0};
  std::thread later([&] {
    for (auto& c : completers) accepted.fetch_add(c.succeed() ? 1 : 0);
  });
  later.join();
  CHECK(accepted.load() == 1000);
  completers.clear();
}

TEST_CASE("wait_for: zero looks once, negative waits forever, positive waits up to the timeout",
          "[transfer][concurrency]") {
  SECTION("zero never blocks") {
    auto [t, c] = ferry::make_manual_transfer();
    const auto start = clock_type::now();
    CHECK(t.wait_for(0ms) == transfer_state::pending);
    CHECK(ms_since(start) < 1000);
  }
  SECTION("done fast path: a finished transfer returns at once whatever the timeout") {
    auto [t, c] = ferry::make_manual_transfer();
    c.succeed();
    const auto start = clock_type::now();
    CHECK(t.wait_for(std::chrono::hours(1)) == transfer_state::success);
    CHECK(t.wait_for(0ms) == transfer_state::success);
    CHECK(t.wait() == transfer_state::success);
    CHECK(ms_since(start) < 1000);
  }
  SECTION("a bounded wait returns pending near its deadline, and a later completion is seen") {
    auto [t, c] = ferry::make_manual_transfer();
    const auto start = clock_type::now();
    CHECK(t.wait_for(50ms) == transfer_state::pending);
    const double waited = ms_since(start);
    CHECK(waited >= 50);
    CHECK(waited < 5000);
    c.succeed();
    CHECK(t.state() == transfer_state::success);
    CHECK(t.wait_for(0ms) == transfer_state::success);
  }
  SECTION("a tiny positive timeout waits rather than being rounded down to a look") {
    auto [t, c] = ferry::make_manual_transfer();
    const auto start = clock_type::now();
    CHECK(t.wait_for(std::chrono::duration<double, std::milli>(20.4)) == transfer_state::pending);
    CHECK(ms_since(start) >= 20);
    CHECK(t.wait_for(std::chrono::duration<double>(1e-12)) == transfer_state::pending);
  }
  SECTION("an enormous timeout does not overflow into a look") {
    auto [t, c] = ferry::make_manual_transfer();
    auto th = complete_later(c, 20ms);
    CHECK(t.wait_for(std::chrono::hours::max()) == transfer_state::success);
    th.join();
  }
  SECTION("negative waits until the completion") {
    auto [t, c] = ferry::make_manual_transfer();
    const auto start = clock_type::now();  // before the completing thread starts its 30 ms
    auto th = complete_later(c, 30ms);
    CHECK(t.wait_for(-1ms) == transfer_state::success);
    CHECK(ms_since(start) >= 25);
    th.join();
  }
}

TEST_CASE("a completion wakes a blocked waiter, and two waiters are both woken",
          "[transfer][concurrency]") {
  auto [t, c] = ferry::make_manual_transfer();
  std::atomic<int> woken{0};
  // Catch2 assertions are main-thread only: the waiters count what they saw.
  auto waiter = [&, t = t] {
    if (t.wait_for(hang_bound) == transfer_state::failed) woken.fetch_add(1);
  };
  std::thread a(waiter);
  std::thread b(waiter);
  std::this_thread::sleep_for(20ms);
  CHECK(woken.load() == 0);
  const auto start = clock_type::now();
  c.fail(std::make_error_code(std::errc::host_unreachable));
  a.join();
  b.join();
  CHECK(woken.load() == 2);
  CHECK(ms_since(start) < 5000);  // woken by the completion, not by the 10 s bound
}

namespace {

struct wait_record {
  std::uint64_t late_sleeps = 0;  // over the last half of the waits
  std::chrono::nanoseconds spin_after{};
};

// Waits on this thread for `count` transfers that another thread completes one at a time, each
// `gap` after this thread said it was about to wait for it. Timed from that word rather than from
// the completion before: a waiter a loaded machine held off the CPU for longer than the rest of the
// stream would otherwise find every later transfer already complete and never sleep at all (which
// failed this test once in CI).
wait_record wait_on_stream(int count, std::chrono::microseconds gap) {
  std::vector<ferry::transfer> ts;
  std::vector<ferry::completer> cs;
  for (int i = 0; i < count; ++i) {
    auto [t, c] = ferry::make_manual_transfer();
    ts.push_back(t);
    cs.push_back(c);
  }
  std::atomic<int> about_to_wait{-1};
  std::thread completing([&] {
    for (int i = 0; i < count; ++i) {
      // Bounded: a waiter that never says so gets its completion after hang_bound anyway.
      const auto give_up = clock_type::now() + hang_bound;
      while (about_to_wait.load(std::memory_order_acquire) < i && clock_type::now() < give_up) {
        std::this_thread::yield();
      }
      std::this_thread::sleep_for(gap);
      cs[static_cast<std::size_t>(i)].succeed();
    }
  });
  std::uint64_t halfway = 0;
  int succeeded = 0;
  for (int i = 0; i < count; ++i) {
    if (i == count / 2) halfway = ferry::this_thread_wait_spin().sleeps;
    about_to_wait.store(i, std::memory_order_release);
    if (ts[static_cast<std::size_t>(i)].wait() == transfer_state::success) ++succeeded;
  }
  completing.join();
  CHECK(succeeded == count);
  return {ferry::this_thread_wait_spin().sleeps - halfway, ferry::this_thread_wait_spin().current};
}

}  // namespace

TEST_CASE("a thread's blocking waits do not spin unless it opts in; then they spin longer while its "
          "transfers keep completing soon",
          "[transfer][concurrency]") {
  // Each completion 200 us after its wait began: far longer than the look before a sleep, so a
  // thread that does not spin sleeps before nearly every one; far shorter than a 5 ms limit (which
  // a busy machine's hiccups rarely reach), so an adaptive spin soon stops sleeping at all.
  constexpr int count = 400;
  constexpr auto gap = 200us;
  ferry::set_wait_spin_limit(ferry::default_wait_spin_limit);
  const wait_record by_default = wait_on_stream(count, gap);
  CHECK(by_default.late_sleeps >= count / 4);
  CHECK(by_default.spin_after == 0ns);

  // The spin is bounded in wall time, so a machine loaded enough to hold this thread or the
  // completing one off the CPU for milliseconds makes even a grown spin sleep: the best of three
  // streams must show it. A thread whose spin did not grow sleeps before nearly every wait of all
  // three. Each stream starts from no spin.
  wait_record busy{static_cast<std::uint64_t>(count), {}};
  for (int attempt = 0; attempt < 3 && busy.late_sleeps > count / 8; ++attempt) {
    ferry::set_wait_spin_limit(0ns);
    ferry::set_wait_spin_limit(5ms);
    busy = wait_on_stream(count, gap);
  }
  CHECK(busy.late_sleeps <= count / 8);
  CHECK(busy.spin_after >= gap / 2);  // a stall past 5 ms near the end may have halved it once
  CHECK(busy.spin_after <= 5ms);

  // Completions 20 ms apart, longer than the limit: each sleep halves the spin (from 5 ms, twelve
  // halvings bring it under 2 us; 32 waits leave room for a few that a loaded machine makes end
  // within the limit, which double it).
  CHECK(wait_on_stream(32, 20ms).spin_after < 2us);

  // A lower limit caps the spin at once; the default comes back for the tests after this one.
  ferry::set_wait_spin_limit(5ms);
  CHECK(wait_on_stream(count / 4, gap).spin_after > 100us);
  ferry::set_wait_spin_limit(100us);
  CHECK(ferry::this_thread_wait_spin().current <= 100us);
  ferry::set_wait_spin_limit(ferry::default_wait_spin_limit);
  CHECK(ferry::this_thread_wait_spin().limit == 0ns);
  CHECK(ferry::this_thread_wait_spin().current == 0ns);
}

TEST_CASE("a timed wait's deadline ends its spin, and a timeout halves the spin",
          "[transfer][concurrency]") {
  // Grow this thread's spin to tens of milliseconds: completions 30 ms apart under a 1 s limit
  // double it at every wait, past 32 ms in sixteen.
  // A wait whose spin met its completion leaves the spin as it was, so a waiter held off the CPU
  // past the end of its spin (on a loaded machine) loses a doubling: the best of three streams
  // must show the growth.
  std::chrono::nanoseconds grown{};
  for (int attempt = 0; attempt < 3 && grown < 32ms; ++attempt) {
    ferry::set_wait_spin_limit(0ns);
    ferry::set_wait_spin_limit(1s);
    grown = wait_on_stream(18, 30ms).spin_after;
  }
  CHECK(grown >= 32ms);

  // A 1 ms wait on a transfer nobody completes returns near its deadline, not after the spin: one
  // that spun its whole spin would take `grown` at least.
  auto [t, c] = ferry::make_manual_transfer();
  const auto start = clock_type::now();
  CHECK(t.wait_for(1ms) == transfer_state::pending);
  CHECK(ms_since(start) < std::chrono::duration<double, std::milli>(grown).count());
  CHECK(ferry::this_thread_wait_spin().current == grown / 2);
  ferry::set_wait_spin_limit(0ns);
  ferry::set_wait_spin_limit(ferry::default_wait_spin_limit);
}

TEST_CASE("a thread's wait spin limit: its default, and the values it refuses", "[transfer]") {
  ferry::wait_spin_info fresh{};
  std::thread([&] { fresh = ferry::this_thread_wait_spin(); }).join();
  CHECK(ferry::default_wait_spin_limit == 0ns);
  CHECK(fresh.limit == 0ns);
  CHECK(fresh.current == 0ns);
  CHECK(fresh.sleeps == 0);
  CHECK_THROWS_WITH(ferry::set_wait_spin_limit(-1us), Catch::Contains("must not be negative"));
  CHECK_THROWS_WITH(ferry::set_wait_spin_limit(2s), Catch::Contains("must be at most 1 s"));
  CHECK(ferry::this_thread_wait_spin().limit == ferry::default_wait_spin_limit);
}

TEST_CASE("make_completed_transfer gives a terminal transfer", "[transfer]") {
  const ferry::transfer t = ferry::make_completed_transfer(transfer_state::failed,
                                                           ferry::errc::destination_too_small);
  CHECK(t.state() == transfer_state::failed);
  CHECK(t.error() == ferry::errc::destination_too_small);
  CHECK_THAT(t.error().message(), Catch::Contains("destination"));
}

namespace {

held await_and_count(ferry::run_loop& loop, ferry::transfer t, std::atomic<int>& resumed) {
  (void)loop;
  (void)co_await t;
  resumed.fetch_add(1);
}

}  // namespace

TEST_CASE("a coroutine destroyed while suspended is never resumed, even mid-completion",
          "[transfer][concurrency]") {
  SECTION("destroyed before any completion") {
    ferry::run_loop loop;  // never run: anything posted stays visible in it
    auto [t, c] = ferry::make_manual_transfer();
    std::atomic<int> resumed{0};
    held victim = await_and_count(loop, t, resumed);
    victim.handle.destroy();
    CHECK(c.succeed());
    CHECK(loop.size() == 0);
  }
  SECTION("destroyed after the completion detached it, before its notification") {
    ferry::run_loop loop;
    auto [t, c] = ferry::make_manual_transfer();
    std::atomic<int> stage{0};
    std::atomic<int> resumed{0};
    held staller = stall_completer(loop, t, stage);   // first in t's list
    held victim = await_and_count(loop, t, resumed);  // second
    std::thread completer([c = std::move(c)]() mutable { c.succeed(); });
    while (stage.load() != 1) std::this_thread::yield();
    victim.handle.destroy();  // must cancel the pending notification, not race it
    stage.store(2);
    completer.join();
    staller.handle.destroy();
    CHECK(loop.size() == 0);  // the destroyed coroutine was not posted
    CHECK(resumed.load() == 0);
  }
}

// wait_all and drain: the verdict rules, the shared deadline, failure short-circuit.

#include <catch2/catch.hpp>

#include <malloc.h>

#include <atomic>
#include <optional>
#include <random>
#include <thread>
#include <vector>

#include <ferry/detail/spin.hpp>
#include <ferry/detail/status_block.hpp>
#include <ferry/poll_all.hpp>
#include <ferry/sync_wait.hpp>
#include <ferry/task.hpp>
#include <ferry/wait_all.hpp>
#include <ferry/when_all.hpp>

#include "helpers.hpp"

using namespace ferry_test;
using ferry::transfer_state;
using ferry::verdict;

TEST_CASE("the first failure in time is reported, not the lowest index", "[wait_all]") {
  batch b(8);
  b.completers[6].fail(std::make_error_code(std::errc::timed_out));
  b.completers[2].fail(io_error);
  b.completers[4].cancel();
  const auto polled = ferry::poll_all(b.transfers);
  CHECK(polled.first_failed == 6u);
  CHECK(polled.error == std::errc::timed_out);
  const auto waited = ferry::wait_all(b.transfers, 1s);
  CHECK(waited.first_failed == 6u);
  CHECK(waited.error == std::errc::timed_out);
}

TEST_CASE("wait_all: empty, all succeed, one failure, timeout", "[wait_all][concurrency]") {
  SECTION("empty gives success at once, even with no deadline") {
    CHECK(ferry::wait_all({}, -1ms).verdict == verdict::success);
  }
  SECTION("all succeed") {
    batch b(4);
    std::vector<std::thread> threads;
    for (std::size_t i = 0; i < 4; ++i) {
      threads.push_back(complete_later(b.completers[i], std::chrono::milliseconds(5 * i)));
    }
    const auto r = ferry::wait_all(b.transfers, hang_bound);
    for (auto& th : threads) th.join();
    CHECK(r.verdict == verdict::success);
    CHECK(r.pending == 0);
  }
  SECTION("one failure ends the wait while the others are still pending") {
    batch b(4);
    auto th = complete_later(b.completers[2], 20ms, transfer_state::failed, io_error);
    const auto start = clock_type::now();
    const auto r = ferry::wait_all(b.transfers, hang_bound);
    th.join();
    CHECK(r.verdict == verdict::failed);
    CHECK(r.first_failed == 2u);
    CHECK(r.error == std::errc::io_error);
    CHECK(r.pending == 3);
    CHECK(ms_since(start) < 5000);
  }
  SECTION("timeout with members pending and none failed") {
    batch b(3);
    b.completers[0].succeed();
    const auto start = clock_type::now();
    const auto r = ferry::wait_all(b.transfers, 30ms);
    CHECK(r.verdict == verdict::timed_out);
    CHECK(r.pending == 2);
    CHECK_FALSE(r.first_failed);
    CHECK(ms_since(start) >= 30);
  }
  SECTION("zero timeout is exactly poll_all") {
    batch b(2);
    b.completers[0].succeed();
    const auto r = ferry::wait_all(b.transfers, 0ms);
    CHECK(r.verdict == verdict::pending);
    CHECK(r.pending == 1);
  }
}

TEST_CASE("wait_all shares one budget across members", "[wait_all][concurrency]") {
  SECTION("members finishing at 40/80/120 ms fit in one 2 s budget") {
    batch b(3);
    // Taken before the completers start, so that none of their sleeps begins before it.
    const auto start = clock_type::now();
    std::vector<std::thread> threads;
    for (std::size_t i = 0; i < 3; ++i) {
      threads.push_back(complete_later(b.completers[i], std::chrono::milliseconds(40 * (i + 1))));
    }
    const auto r = ferry::wait_all(b.transfers, 2s);
    const double waited = ms_since(start);
    for (auto& th : threads) th.join();
    CHECK(r.verdict == verdict::success);
    CHECK(waited >= 115);
  }
  SECTION("three members that never finish time out after one budget, not three") {
    batch b(3);
    const auto start = clock_type::now();
    const auto r = ferry::wait_all(b.transfers, 1s);
    const double waited = ms_since(start);
    CHECK(r.verdict == verdict::timed_out);
    CHECK(r.pending == 3);
    CHECK(waited >= 1000);
    CHECK(waited < 2900);  // three budgets would be 3 s; the rest is room for a loaded machine
  }
}

TEST_CASE("a failure beats the timeout", "[wait_all][concurrency]") {
  batch b(3);
  b.completers[0].succeed();
  auto th = complete_later(b.completers[1], 10ms, transfer_state::failed, io_error);
  const auto r = ferry::wait_all(b.transfers, 2s);
  th.join();
  CHECK(r.verdict == verdict::failed);
  CHECK(r.first_failed == 1u);

  batch already(2);
  already.completers[1].fail(io_error);
  CHECK(ferry::wait_all(already.transfers, 1ns).verdict == verdict::failed);
}

TEST_CASE("a failure at the last index of 4096 pending members ends wait_all at once",
          "[wait_all][concurrency]") {
  batch b(4096);
  auto th = complete_later(b.completers.back(), 20ms, transfer_state::failed, io_error);
  const auto start = clock_type::now();
  const auto r = ferry::wait_all(b.transfers, std::chrono::seconds(30));
  const double waited = ms_since(start);
  th.join();
  CHECK(r.verdict == verdict::failed);
  CHECK(r.first_failed == 4095u);
  CHECK(r.pending == 4095);
  CHECK(waited < 5000);  // not the 30 s deadline
}

TEST_CASE("completions after a verdict are harmless and the members keep running",
          "[wait_all][concurrency]") {
  batch b(16);
  const auto r = ferry::wait_all(b.transfers, 5ms);
  CHECK(r.verdict == verdict::timed_out);
  for (auto& c : b.completers) CHECK(c.succeed());
  CHECK(ferry::poll_all(b.transfers).verdict == verdict::success);
  // Repeated timed waits on transfers that never finish do not grow without bound (each new
  // registration sweeps the nodes of ended waits off the status): this runs in bounded memory.
  batch stuck(4);
  for (int i = 0; i < 2000; ++i) {
    CHECK(ferry::wait_all(stuck.transfers, 1us).verdict == verdict::timed_out);
  }
}

TEST_CASE("drain waits for every member, failures included", "[wait_all][concurrency]") {
  SECTION("a failure does not end the drain early") {
    batch b(3);
    b.completers[0].fail(io_error);
    // Timed from before the completing threads start, so that a slow start (under TSan) cannot
    // make the wait look shorter than the 40 ms it has to be.
    const auto start = clock_type::now();
    auto th = complete_later(b.completers[2], 40ms);
    std::thread th2([c = b.completers[1]]() mutable {
      std::this_thread::sleep_for(20ms);
      c.cancel();
    });
    const auto r = ferry::drain(b.transfers, hang_bound);
    th.join();
    th2.join();
    CHECK(ms_since(start) >= 35);
    CHECK(r.verdict == verdict::failed);
    CHECK(r.first_failed == 0u);
    CHECK(r.pending == 0);
    for (auto& t : b.transfers) CHECK(t.done());
  }
  SECTION("all succeed") {
    batch b(2);
    for (auto& c : b.completers) c.succeed();
    CHECK(ferry::drain(b.transfers, 1s).verdict == verdict::success);
  }
  SECTION("the deadline passes first") {
    batch b(2);
    b.completers[0].fail(io_error);
    const auto r = ferry::drain(b.transfers, 20ms);
    CHECK(r.verdict == verdict::timed_out);
    CHECK(r.pending == 1);
    CHECK(r.first_failed == 0u);
  }
}

TEST_CASE("the first failure in time wins even when its notification arrives second",
          "[wait_all][concurrency]") {
  // t0 fails first (and is visible as failed), but its completer stalls before notifying the
  // batch; t1 fails later and its notification decides. The report must still name t0.
  ferry::run_loop loop;
  batch b(2);
  std::atomic<int> stage{0};
  held staller = stall_completer(loop, b.transfers[0], stage);
  ferry::batch_result r;
  std::thread waiter([&] { r = ferry::wait_all(b.transfers, -1ms); });
  std::this_thread::sleep_for(20ms);  // the wait is registered on both members
  const std::error_code first = std::make_error_code(std::errc::timed_out);
  std::thread fail0([c = b.completers[0], first]() mutable { c.fail(first); });
  while (stage.load() != 1) std::this_thread::yield();
  b.completers[1].fail(io_error);
  waiter.join();
  stage.store(2);
  fail0.join();
  staller.handle.destroy();
  CHECK(r.verdict == verdict::failed);
  CHECK(r.first_failed == 0u);
  CHECK(r.error == first);
}

TEST_CASE("a failure published before the deadline is not reported as a timeout",
          "[wait_all][concurrency]") {
  ferry::run_loop loop;
  batch b(2);
  std::atomic<int> stage{0};
  held staller = stall_completer(loop, b.transfers[0], stage);
  ferry::batch_result r;
  // The failure must be published before the deadline: 400 ms leaves room for a loaded machine.
  std::thread waiter([&] { r = ferry::wait_all(b.transfers, 400ms); });
  std::this_thread::sleep_for(10ms);
  std::thread fail0([c = b.completers[0]]() mutable { c.fail(io_error); });
  waiter.join();  // the notification is stalled past the deadline
  stage.store(2);
  fail0.join();
  staller.handle.destroy();
  CHECK(r.verdict == verdict::failed);
  CHECK(r.first_failed == 0u);
}

TEST_CASE("repeated timed waits behind a waiter that stays do not grow the waiter list",
          "[wait_all]") {
  ferry::run_loop loop;
  auto made = ferry::make_manual_transfer();
  std::atomic<int> stage{0};
  // A coroutine stays linked at the head for the whole test; the sweep must get past it.
  held stays = stall_completer(loop, made.first, stage);
  std::vector<ferry::transfer> one{made.first};
  for (int i = 0; i < 1000; ++i) (void)ferry::wait_all(one, 1ns);  // warm the pools
  const std::size_t before = mallinfo2().uordblks;
  for (int i = 0; i < 100'000; ++i) {
    CHECK(ferry::wait_all(one, 1ns).verdict == verdict::timed_out);
  }
  const std::size_t grown = mallinfo2().uordblks - before;
  CHECK(grown < 1'000'000);
  stays.handle.destroy();
}

TEST_CASE("wait_all decided by its first look names the failure first in time",
          "[wait_all][concurrency][regression]") {
  for (const std::size_t n : {std::size_t{2}, std::size_t{4096}}) {
    const int wrong = later_failure_named(n, 300, [](std::span<const ferry::transfer> ts) {
      return ferry::wait_all(ts, hang_bound);
    });
    CAPTURE(n);
    CHECK(wrong == 0);
  }
}

TEST_CASE("a member that never ends keeps no part of a wait_all that timed out",
          "[wait_all][regression]") {
  // A join for 2048 members is over 100 KiB: pinned by one lost completion per batch, a long-running
  // server would grow by that much for every one.
  batch b(2048);
  for (std::size_t i = 1; i < b.completers.size(); ++i) b.completers[i].succeed();
  const auto r = ferry::wait_all(b.transfers, 1ms);
  CHECK(r.verdict == verdict::timed_out);
  CHECK(b.transfers[0].status()->linked_waiters() == 0);
  CHECK(b.transfers[0].status()->references() == 2);  // the handle and its completer
  b.completers[0].succeed();
}

TEST_CASE("the first failure in time is named even when its completer stops before publishing",
          "[wait_all][concurrency][regression]") {
  // Member 0's failure takes the earlier number, then its completer stops before the state is
  // published; member 1's failure is published, delivered, and decides the wait. The verdict must
  // still name member 0: the wait holds on until member 0's completion is no longer under way.
  numbering_hold hold;
  batch b(2);
  std::atomic<bool> returned{false};
  ferry::batch_result r;
  std::thread waiter([&] {
    r = ferry::wait_all(b.transfers, hang_bound);
    returned.store(true);
  });
  // The wait is registered on both members before anything fails (registering takes the member's
  // lock, which the held completer keeps).
  REQUIRE(wait_until([&] {
    return b.transfers[0].status()->linked_waiters() == 1 &&
           b.transfers[1].status()->linked_waiters() == 1;
  }));
  const std::error_code first = std::make_error_code(std::errc::timed_out);
  hold.fail_held(b.completers[0], first);
  b.completers[1].fail(io_error);
  std::this_thread::sleep_for(50ms);  // the waiter has had its verdict decided by member 1
  CHECK_FALSE(returned.load());       // ...and waits for member 0's completion to publish
  hold.release();
  waiter.join();
  CHECK(r.verdict == verdict::failed);
  CHECK(r.first_failed == 0u);
  CHECK(r.error == first);
}

TEST_CASE("a wait decided by its first look still names a failure numbered earlier but not yet "
          "published",
          "[wait_all][concurrency][regression]") {
  // Member 0's completer is held between numbering and publishing; member 1 fails after it. A wait
  // that starts now finds member 1 failed in its first look (poll_all decides: no join at all) and
  // must still name member 0, for wait_all and for co_await when_all alike.
  numbering_hold hold;
  const std::error_code first = std::make_error_code(std::errc::timed_out);
  for (const bool awaited : {false, true}) {
    CAPTURE(awaited);
    batch b(2);
    hold.fail_held(b.completers[0], first);
    b.completers[1].fail(io_error);
    std::atomic<bool> returned{false};
    ferry::batch_result r;
    std::thread waiter([&] {
      if (awaited) {
        ferry::run_loop loop;
        r = ferry::sync_wait(loop, [](std::span<const ferry::transfer> ts)
                                       -> ferry::task<ferry::batch_result> {
          co_return co_await ferry::when_all(ts, hang_bound);
        }(b.transfers));
      } else {
        r = ferry::wait_all(b.transfers, hang_bound);
      }
      returned.store(true);
    });
    std::this_thread::sleep_for(50ms);
    CHECK_FALSE(returned.load());  // it waits for member 0's completion to publish
    hold.release();
    waiter.join();
    CHECK(r.verdict == verdict::failed);
    CHECK(r.first_failed == 0u);
    CHECK(r.error == first);
  }
}

TEST_CASE("a wait's verdict and a later poll_all agree on the first failure under racing failures",
          "[wait_all][concurrency][regression]") {
  // Three threads fail three of four members at once, each after its own random pause and each
  // lingering a random while between taking its number and publishing (as a preempted completer
  // would, only more often), while a thread waits on the batch: the verdict names the failure
  // first in time, which a poll_all after everything has ended confirms.
  numbering_hold hold;
  constexpr int rounds = 3000;
  constexpr std::size_t failers = 3;
  int disagreements = 0;
  std::mt19937 rng(36);
  for (int round = 0; round < rounds; ++round) {
    batch b(failers + 1);
    std::atomic<int> ready{0};
    std::atomic<bool> go{false};
    std::vector<std::thread> threads;
    for (std::size_t k = 0; k < failers; ++k) {
      const int pause = static_cast<int>(rng() % 2000);
      const int linger = static_cast<int>(rng() % 2000);
      threads.emplace_back([&, k, pause, linger, c = b.completers[k]]() mutable {
        numbering_hold::linger(linger);
        ready.fetch_add(1);
        while (!go.load(std::memory_order_acquire)) std::this_thread::yield();
        for (int i = 0; i < pause; ++i) ferry::detail::cpu_relax();
        c.fail(std::error_code(static_cast<int>(k) + 1, std::generic_category()));
      });
    }
    while (ready.load() != static_cast<int>(failers)) std::this_thread::yield();
    go.store(true, std::memory_order_release);
    const ferry::batch_result r = ferry::wait_all(b.transfers, hang_bound);
    for (std::thread& t : threads) t.join();
    b.completers[failers].succeed();
    const ferry::batch_result later = ferry::poll_all(b.transfers);
    if (r.verdict != verdict::failed || r.first_failed != later.first_failed) ++disagreements;
  }
  CHECK(disagreements == 0);
}

// task and sync_wait: values, nesting, exceptions, and the scheduler a caller resumes on.

#include <catch2/catch.hpp>

#include <atomic>
#include <stdexcept>
#include <thread>
#include <utility>
#include <vector>

#include <ferry/ferry.hpp>

#include "helpers.hpp"

using namespace ferry_test;
using ferry::transfer_state;

namespace {

ferry::task<int> add_one(int x) { co_return x + 1; }

ferry::task<int> nested(int depth) {
  if (depth == 0) co_return 0;
  const int below = co_await nested(depth - 1);
  co_return below + co_await add_one(0);
}

ferry::task<void> throws_after_await(ferry::transfer t) {
  (void)co_await t;
  throw std::runtime_error("boom after the transfer");
}

}  // namespace

TEST_CASE("task: values, nesting, exceptions and sync_wait", "[task]") {
  CHECK(ferry::sync_wait(add_one(41)) == 42);
  CHECK(ferry::sync_wait(nested(50)) == 50);

  auto [t, c] = ferry::make_manual_transfer();
  c.succeed();
  CHECK_THROWS_WITH(ferry::sync_wait(throws_after_await(t)),
                    Catch::Contains("boom after the transfer"));
}

TEST_CASE("sync_wait drives a user's run_loop, running other work posted to it",
          "[task][concurrency]") {
  ferry::progress_executor exec;
  ferry::loopback_backend lb{exec};
  ferry::run_loop loop;
  std::vector<std::byte> src(256, std::byte{3}), dst(256);
  const auto state = ferry::sync_wait(loop, [&]() -> ferry::task<transfer_state> {
    co_return co_await lb.copy(dst, src);
  }());
  CHECK(state == transfer_state::success);
  CHECK(dst == src);
}

TEST_CASE("task: a caller resumes on its own scheduler even when the task it awaited ended on "
          "another thread",
          "[task][concurrency]") {
  // The child goes on, through resume_on, on the thread that completes its transfer, and ends
  // there. Transferring straight back would run the caller on that thread too, off its run_loop.
  // A round where the transfer completed before the child suspended shows nothing (the child never
  // moved), so rounds repeat until enough of them did move.
  ferry::inline_scheduler on_completer;
  const auto child = [](ferry::transfer t, ferry::inline_scheduler& s,
                        std::atomic<bool>& awaiting) -> ferry::task<std::thread::id> {
    awaiting.store(true);
    (void)co_await ferry::resume_on(s, t);
    co_return std::this_thread::get_id();
  };
  int moved = 0;
  for (int round = 0; round < 1000 && moved < 20; ++round) {
    std::atomic<bool> awaiting{false};
    auto [t, c] = ferry::make_manual_transfer();
    std::thread completer([&awaiting, c = std::move(c)]() mutable {
      while (!awaiting.load()) std::this_thread::yield();
      std::this_thread::sleep_for(1ms);
      (void)c.succeed();
    });
    using ids_t = std::pair<std::thread::id, std::thread::id>;  // where the child ended, the caller
    const ids_t ids = ferry::sync_wait([](auto child, ferry::transfer t, ferry::inline_scheduler& s,
                                          std::atomic<bool>& awaiting) -> ferry::task<ids_t> {
      const std::thread::id child_ended_on = co_await child(t, s, awaiting);
      co_return ids_t{child_ended_on, std::this_thread::get_id()};
    }(child, t, on_completer, awaiting));
    completer.join();
    if (ids.first == std::this_thread::get_id()) continue;  // the child never left
    ++moved;
    REQUIRE(ids.second == std::this_thread::get_id());  // the caller went on on sync_wait's loop
  }
  CHECK(moved == 20);
}

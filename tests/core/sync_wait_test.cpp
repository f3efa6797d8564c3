// sync_wait on a scheduler that other threads drive: the task runs there, the caller blocks.

#include <atomic>
#include <catch2/catch.hpp>
#include <ferry/sync_wait.hpp>
#include <stdexcept>
#include <thread>

#include "helpers.hpp"

using namespace ferry_test;
using ferry::transfer_state;

namespace {

ferry::task<std::thread::id> where_it_resumes(ferry::transfer t) {
  (void)co_await t;
  co_return std::this_thread::get_id();
}

}  // namespace

TEST_CASE("sync_wait on another thread's scheduler runs the task there and returns its value",
          "[sync_wait][concurrency]") {
  // A run_loop given as itself is driven by the caller (the last test); as an any_scheduler it is
  // one more scheduler that its own thread runs.
  engine_thread engine;
  ferry::any_scheduler s = ferry::any_scheduler::reference(engine.loop());
  auto [t, c] = ferry::make_manual_transfer();
  std::thread completer = complete_later(std::move(c), 2ms);
  const std::thread::id resumed_on = ferry::sync_wait(s, where_it_resumes(t));
  completer.join();
  CHECK(resumed_on == engine.id());
  CHECK(resumed_on != std::this_thread::get_id());
}

TEST_CASE("sync_wait on a scheduler given as any_scheduler: values, void and exceptions",
          "[sync_wait][concurrency]") {
  engine_thread engine;
  ferry::any_scheduler s = ferry::any_scheduler::reference(engine.loop());
  CHECK(ferry::sync_wait(s, []() -> ferry::task<int> { co_return 42; }()) == 42);
  std::atomic<bool> ran{false};
  ferry::sync_wait(s, [](std::atomic<bool>& ran) -> ferry::task<void> {
    ran.store(true);
    co_return;
  }(ran));
  CHECK(ran.load());
  CHECK_THROWS_WITH(ferry::sync_wait(s,
                                     []() -> ferry::task<int> {
                                       throw std::runtime_error("no such layer");
                                       co_return 0;
                                     }()),
                    "no such layer");
}

TEST_CASE(
    "sync_wait on another thread's scheduler: completions racing the caller's block, "
    "every round returns once with its own value",
    "[sync_wait][concurrency]") {
  engine_thread engine;
  ferry::any_scheduler s = ferry::any_scheduler::reference(engine.loop());
  ferry::progress_executor exec;
  ferry::loopback_backend lb{exec};
  const auto src = pattern(64, 1);
  for (int round = 0; round < 300; ++round) {
    std::vector<std::byte> dst(64);
    const int got =
        ferry::sync_wait(s,
                         [](ferry::loopback_backend& lb, std::span<std::byte> dst,
                            std::span<const std::byte> src, int round) -> ferry::task<int> {
                           const transfer_state s = co_await lb.copy(dst, src);
                           co_return s == transfer_state::success ? round : -1;
                         }(lb, dst, src, round));
    REQUIRE(got == round);
    REQUIRE(dst == src);
  }
}

TEST_CASE("sync_wait on a run_loop still drives the loop on the calling thread", "[sync_wait]") {
  ferry::run_loop loop;
  auto [t, c] = ferry::make_manual_transfer();
  (void)c.succeed();
  CHECK(ferry::sync_wait(loop, where_it_resumes(t)) == std::this_thread::get_id());
}

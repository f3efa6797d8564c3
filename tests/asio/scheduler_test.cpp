// asio_scheduler: ferry coroutines resumed on an Asio executor, started with spawn and sync_wait,
// and the scheduler-by-reference pattern for an any_io_executor.

#include <asio/any_io_executor.hpp>
#include <asio/strand.hpp>
#include <atomic>
#include <catch2/catch.hpp>
#include <coroutine>
#include <exception>
#include <ferry/asio/scheduler.hpp>
#include <ferry/spawn.hpp>
#include <ferry/sync_wait.hpp>
#include <thread>

#include "asio_helpers.hpp"
#include "helpers.hpp"

using namespace ferry_test;
using ferry::transfer_state;

namespace {

ferry::task<std::thread::id> resumed_on(ferry::transfer t) {
  (void)co_await t;
  co_return std::this_thread::get_id();
}

// A user's coroutine type whose scheduler holds an any_io_executor: too large for ferry to copy,
// so the promise keeps it and get_scheduler() returns a reference (docs/asio.md).
struct io_coroutine {
  struct promise_type {
    ferry::asio_scheduler<asio::any_io_executor> scheduler;
    template <class... Args>
    explicit promise_type(asio::any_io_executor ex, Args&&...) : scheduler(std::move(ex)) {}
    ferry::asio_scheduler<asio::any_io_executor>& get_scheduler() noexcept { return scheduler; }
    io_coroutine get_return_object() noexcept { return {}; }
    std::suspend_never initial_suspend() noexcept { return {}; }
    std::suspend_never final_suspend() noexcept { return {}; }
    void return_void() noexcept {}
    void unhandled_exception() noexcept { std::terminate(); }
  };
};

io_coroutine await_on_io(asio::any_io_executor, ferry::transfer t,
                         std::atomic<std::thread::id>& where) {
  (void)co_await t;
  where.store(std::this_thread::get_id());
}

}  // namespace

TEST_CASE(
    "an asio_scheduler over an any_io_executor is too large to copy; returned by reference "
    "it resumes a user's coroutine on the io_context thread",
    "[asio][concurrency]") {
  STATIC_REQUIRE(sizeof(ferry::asio_scheduler<asio::any_io_executor>) >
                 ferry::any_scheduler::inline_capacity);
  STATIC_REQUIRE(sizeof(ferry::asio_scheduler<asio::io_context::executor_type>) <=
                 ferry::any_scheduler::inline_capacity);
  io_thread io;
  auto [t, c] = ferry::make_manual_transfer();
  std::atomic<std::thread::id> where{};
  await_on_io(io.io().get_executor(), t, where);
  std::thread completer = complete_later(std::move(c), 2ms);
  REQUIRE(wait_until([&] { return where.load() != std::thread::id{}; }));
  completer.join();
  CHECK(where.load() == io.id());
}

TEST_CASE(
    "spawn on an asio_scheduler: the task runs on the io_context thread and its exception "
    "reaches the handler there",
    "[asio][concurrency]") {
  io_thread io;
  ferry::asio_scheduler sched{io.io().get_executor()};
  auto [t, c] = ferry::make_manual_transfer();
  std::atomic<bool> done{false};
  std::atomic<bool> handler_on_io{false};
  std::atomic<std::thread::id> inside{};
  std::exception_ptr error;
  ferry::spawn(
      sched,
      [](ferry::transfer t, std::atomic<std::thread::id>& inside) -> ferry::task<void> {
        const transfer_state s = co_await t;
        inside.store(std::this_thread::get_id());
        if (s != transfer_state::success) throw std::runtime_error("transfer failed");
      }(t, inside),
      [&](std::exception_ptr e) noexcept {
        error = e;
        handler_on_io.store(io.here());
        done.store(true);
      });
  std::thread completer = complete_later(std::move(c), 2ms, transfer_state::failed, io_error);
  REQUIRE(wait_until([&] { return done.load(); }));
  completer.join();
  CHECK(inside.load() == io.id());
  CHECK(handler_on_io.load());
  REQUIRE(error);
  CHECK_THROWS_WITH(std::rethrow_exception(error), "transfer failed");
}

TEST_CASE("sync_wait on an asio_scheduler (a strand) runs the task on the io_context thread",
          "[asio][concurrency]") {
  io_thread io;
  ferry::asio_scheduler sched{asio::make_strand(io.io())};
  auto [t, c] = ferry::make_manual_transfer();
  std::thread completer = complete_later(std::move(c), 2ms);
  const std::thread::id inside = ferry::sync_wait(sched, resumed_on(t));
  completer.join();
  CHECK(inside == io.id());
}

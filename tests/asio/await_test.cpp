// async_await: a ferry::task, when_all and resume_on awaited from Asio, through one adapter.

#include <asio/bind_executor.hpp>
#include <asio/co_spawn.hpp>
#include <asio/use_awaitable.hpp>
#include <asio/use_future.hpp>
#include <atomic>
#include <catch2/catch.hpp>
#include <exception>
#include <ferry/asio/await.hpp>
#include <future>
#include <stdexcept>
#include <thread>
#include <vector>

#include "asio_helpers.hpp"
#include "helpers.hpp"

using namespace ferry_test;
using ferry::transfer_state;
using ferry::verdict;

namespace {

ferry::task<std::thread::id> resumed_on(ferry::transfer t) {
  (void)co_await t;
  co_return std::this_thread::get_id();
}

ferry::task<int> fails_after(ferry::transfer t) {
  (void)co_await t;
  throw std::runtime_error("decode step failed");
}

}  // namespace

TEST_CASE(
    "async_await runs a ferry::task from an asio coroutine: the task's awaits and the "
    "coroutine resume on the io_context thread",
    "[asio][concurrency]") {
  io_thread io;
  run_awaitable(io, [&]() -> asio::awaitable<void> {
    auto [t, c] = ferry::make_manual_transfer();
    std::thread completer = complete_later(std::move(c), 2ms);
    const std::thread::id inside = co_await ferry::async_await(resumed_on(t), asio::use_awaitable);
    completer.join();
    CHECK(inside == io.id());
    CHECK(io.here());

    // An exception from the task is rethrown in the asio coroutine.
    auto [t2, c2] = ferry::make_manual_transfer();
    std::thread completer2 = complete_later(std::move(c2), 2ms);
    bool threw = false;
    try {
      (void)co_await ferry::async_await(fails_after(t2), asio::use_awaitable);
    } catch (const std::runtime_error& e) {
      threw = std::string(e.what()) == "decode step failed";
    }
    completer2.join();
    CHECK(threw);
    CHECK(io.here());
  });
}

TEST_CASE(
    "async_await of when_all, resume_on and a transfer resumes the asio coroutine on the "
    "io_context thread",
    "[asio][concurrency]") {
  io_thread io;
  engine_thread engine;
  run_awaitable(io, [&]() -> asio::awaitable<void> {
    batch b(3);
    std::thread completer([&b] {
      std::this_thread::sleep_for(2ms);
      for (ferry::completer& c : b.completers) (void)c.succeed();
    });
    const ferry::batch_result r =
        co_await ferry::async_await(ferry::when_all(b.transfers, 5s), asio::use_awaitable);
    completer.join();
    CHECK(io.here());
    CHECK(r.verdict == verdict::success);

    // resume_on: the awaited task runs its awaits on the engine's loop; the asio coroutine still
    // goes on on its own thread.
    auto [t, c] = ferry::make_manual_transfer();
    std::thread completer2 = complete_later(std::move(c), 2ms);
    const std::thread::id inside = co_await ferry::async_await(
        ferry::resume_on(engine.loop(), resumed_on(t)), asio::use_awaitable);
    completer2.join();
    CHECK(inside == engine.id());
    CHECK(io.here());

    auto [t3, c3] = ferry::make_manual_transfer();
    std::thread completer3 = complete_later(std::move(c3), 2ms, transfer_state::cancelled);
    const transfer_state s = co_await ferry::async_await(t3, asio::use_awaitable);
    completer3.join();
    CHECK(io.here());
    CHECK(s == transfer_state::cancelled);
  });
}

TEST_CASE("async_await with a callback bound to the io_context runs it there",
          "[asio][concurrency]") {
  io_thread io;
  auto [t, c] = ferry::make_manual_transfer();
  std::atomic<int> calls{0};
  std::atomic<bool> on_io{false};
  std::exception_ptr error;
  ferry::async_await(resumed_on(t),
                     asio::bind_executor(io.io(), [&](std::exception_ptr e, std::thread::id) {
                       error = e;
                       on_io.store(io.here());
                       calls.fetch_add(1);
                     }));
  (void)c.succeed();
  REQUIRE(wait_until([&] { return calls.load() == 1; }));
  CHECK(on_io.load());
  CHECK_FALSE(error);
}

// Not run under ThreadSanitizer: the exception travels through std::future's shared state, whose
// last reference Asio's promise handler may drop on its own thread after get() has read it; the
// exception's reference count lives in uninstrumented libstdc++, so TSan reports that delete.
TEST_CASE("async_await with use_future hands the task's exception to the future", "[asio]") {
  auto [t2, c2] = ferry::make_manual_transfer();
  std::future<int> f = ferry::async_await(fails_after(t2), asio::use_future);
  (void)c2.succeed();
  REQUIRE(f.wait_for(hang_bound) == std::future_status::ready);
  CHECK_THROWS_WITH(f.get(), "decode step failed");
}

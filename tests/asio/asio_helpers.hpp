#pragma once
// Shared by the Asio adapter tests: an io_context run by a thread of its own, and a way to run an
// asio coroutine on it.

#include <asio/awaitable.hpp>
#include <asio/co_spawn.hpp>
#include <asio/executor_work_guard.hpp>
#include <asio/io_context.hpp>
#include <asio/use_future.hpp>
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <future>
#include <optional>
#include <thread>
#include <utility>

#include "helpers.hpp"

namespace ferry_test {

class io_thread {
 public:
  io_thread()
      : work_(asio::make_work_guard(io_)), thread_([this] {
          id_.store(std::this_thread::get_id());
          io_.run();
        }) {
    while (id_.load() == std::thread::id{}) std::this_thread::yield();
  }
  // Lets the operations still counted finish (bounded), then stops.
  ~io_thread() {
    work_.reset();
    (void)wait_until([this] { return io_.stopped(); }, std::chrono::seconds(10));
    io_.stop();
    thread_.join();
  }
  asio::io_context& io() { return io_; }
  [[nodiscard]] std::thread::id id() const { return id_.load(); }
  [[nodiscard]] bool here() const { return std::this_thread::get_id() == id(); }

 private:
  asio::io_context io_;
  asio::executor_work_guard<asio::io_context::executor_type> work_;
  std::atomic<std::thread::id> id_{};
  std::thread thread_;
};

// Runs `body` as an asio::awaitable on the io thread and waits for it (rethrowing what it threw).
template <class Body>
void run_awaitable(io_thread& io, Body body) {
  std::future<void> done = asio::co_spawn(io.io(), std::move(body), asio::use_future);
  REQUIRE(done.wait_for(hang_bound) == std::future_status::ready);
  done.get();
}

}  // namespace ferry_test

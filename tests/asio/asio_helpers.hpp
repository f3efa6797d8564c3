#pragma once
// Shared by the Asio adapter tests: an io_context run by a thread of its own.

#include <asio/executor_work_guard.hpp>
#include <asio/io_context.hpp>
#include <atomic>
#include <chrono>
#include <optional>
#include <thread>

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

}  // namespace ferry_test

// spawn: a task started detached on any scheduler, its awaits resumed there, its outcome reported.

#include <atomic>
#include <catch2/catch.hpp>
#include <coroutine>
#include <deque>
#include <exception>
#include <ferry/spawn.hpp>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include "helpers.hpp"

using namespace ferry_test;

namespace {

// A user's own event loop, nothing to do with ferry's: a queue of handles one thread resumes.
class user_loop {
 public:
  user_loop() : thread_([this] { run(); }) {}
  ~user_loop() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }
  void post(std::coroutine_handle<> h) noexcept {
    {
      std::lock_guard lock(mutex_);
      queue_.push_back(h);
    }
    wake_.notify_all();
  }
  [[nodiscard]] std::thread::id id() const noexcept { return thread_.get_id(); }

 private:
  void run() {
    std::unique_lock lock(mutex_);
    for (;;) {
      wake_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;
      const std::coroutine_handle<> h = queue_.front();
      queue_.pop_front();
      lock.unlock();
      h.resume();
      lock.lock();
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::coroutine_handle<>> queue_;
  bool stopping_ = false;
  std::thread thread_;
};

// A scheduler the test drains by hand: shows what ran inside spawn itself.
struct manual_queue {
  std::vector<std::coroutine_handle<>> queued;
  void post(std::coroutine_handle<> h) noexcept { queued.push_back(h); }
  void drain() {
    while (!queued.empty()) {
      const auto h = queued.back();
      queued.pop_back();
      h.resume();
    }
  }
};

struct report {
  std::atomic<bool> done{false};
  std::atomic<std::thread::id> handler_thread{};
  std::exception_ptr error;
};

}  // namespace

TEST_CASE("spawn runs a task on a user's scheduler: it starts there and its awaits resume there",
          "[spawn][concurrency]") {
  user_loop loop;
  auto [t, c] = ferry::make_manual_transfer();
  std::atomic<std::thread::id> started{}, resumed{};
  report r;
  ferry::spawn(
      loop,
      [](ferry::transfer t, std::atomic<std::thread::id>& started,
         std::atomic<std::thread::id>& resumed) -> ferry::task<void> {
        started.store(std::this_thread::get_id());
        (void)co_await t;
        resumed.store(std::this_thread::get_id());
      }(t, started, resumed),
      [&r](std::exception_ptr e) noexcept {
        r.error = e;
        r.handler_thread.store(std::this_thread::get_id());
        r.done.store(true);
      });
  REQUIRE(wait_until([&] { return started.load() != std::thread::id{}; }));
  std::thread completer([c = std::move(c)]() mutable { (void)c.succeed(); });
  completer.join();
  REQUIRE(wait_until([&] { return r.done.load(); }));
  CHECK(started.load() == loop.id());
  CHECK(resumed.load() == loop.id());
  CHECK(r.handler_thread.load() == loop.id());
  CHECK_FALSE(r.error);
}

TEST_CASE("spawn reports a task's exception to its handler, on the scheduler's thread",
          "[spawn][concurrency]") {
  user_loop loop;
  auto [t, c] = ferry::make_manual_transfer();
  report r;
  ferry::spawn(
      loop,
      [](ferry::transfer t) -> ferry::task<int> {
        (void)co_await t;
        throw std::runtime_error("the layer did not load");
      }(t),
      [&r](std::exception_ptr e) noexcept {
        r.error = e;
        r.handler_thread.store(std::this_thread::get_id());
        r.done.store(true);
      });
  std::thread completer([c = std::move(c)]() mutable { (void)c.fail(io_error); });
  completer.join();
  REQUIRE(wait_until([&] { return r.done.load(); }));
  CHECK(r.handler_thread.load() == loop.id());
  REQUIRE(r.error);
  CHECK_THROWS_WITH(std::rethrow_exception(r.error), "the layer did not load");
}

TEST_CASE("spawn runs none of the task inside the call: it is posted to the scheduler", "[spawn]") {
  manual_queue q;
  bool ran = false;
  bool handled = false;
  ferry::spawn(
      q,
      [](bool& ran) -> ferry::task<void> {
        ran = true;
        co_return;
      }(ran),
      [&handled](std::exception_ptr e) noexcept { handled = !e; });
  CHECK_FALSE(ran);
  REQUIRE(q.queued.size() == 1);
  q.drain();
  CHECK(ran);
  CHECK(handled);
}

TEST_CASE("spawn copies an any_scheduler it is given, and refers to any other scheduler",
          "[spawn]") {
  manual_queue q;
  int runs = 0;
  {
    ferry::any_scheduler handle = ferry::any_scheduler::reference(q);
    ferry::spawn(handle, [](int& runs) -> ferry::task<void> {
      ++runs;
      co_return;
    }(runs));
  }  // the handle is gone; the spawned task holds its own copy
  q.drain();
  CHECK(runs == 1);
}

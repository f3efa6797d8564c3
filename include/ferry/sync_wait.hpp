#pragma once
// sync_wait: runs a task to completion from a thread outside any coroutine and returns its value
// (or rethrows its exception).
//  - sync_wait(task) and sync_wait(run_loop&, task): the calling thread drives the loop, so the
//  task
//    and everything else posted to that loop run on the calling thread.
//  - sync_wait(scheduler, task), any other scheduler (an Asio io_context's, a user's event loop):
//    the task starts on that scheduler (posted there) and resumes there; the calling thread only
//    blocks until it ends. Some other thread must run the scheduler meanwhile: called on the
//    scheduler's own thread, or with nobody running it, this never returns. A run_loop passed as
//    itself is driven by the caller, as above; to wait for a task on a run_loop that another thread
//    runs, pass any_scheduler::reference(loop).

#include <condition_variable>
#include <coroutine>
#include <exception>
#include <mutex>
#include <optional>
#include <type_traits>
#include <utility>

#include "ferry/detail/detached_task.hpp"
#include "ferry/run_loop.hpp"
#include "ferry/scheduler.hpp"
#include "ferry/task.hpp"

namespace ferry {

namespace detail {

// The coroutine sync_wait drives: it awaits the task on the loop and stops the loop when done.
class sync_wait_driver {
 public:
  struct promise_type {
    run_loop* loop = nullptr;
    std::exception_ptr error;

    run_loop& get_scheduler() noexcept { return *loop; }
    sync_wait_driver get_return_object() noexcept {
      return sync_wait_driver(std::coroutine_handle<promise_type>::from_promise(*this));
    }
    std::suspend_always initial_suspend() noexcept { return {}; }
    auto final_suspend() noexcept {
      struct stop_loop {
        bool await_ready() noexcept { return false; }
        void await_suspend(std::coroutine_handle<promise_type> h) noexcept {
          h.promise().loop->stop();
        }
        void await_resume() noexcept {}
      };
      return stop_loop{};
    }
    void return_void() noexcept {}
    void unhandled_exception() noexcept { error = std::current_exception(); }
  };

  sync_wait_driver(sync_wait_driver&& other) noexcept : handle_(std::exchange(other.handle_, {})) {}
  sync_wait_driver(const sync_wait_driver&) = delete;
  sync_wait_driver& operator=(const sync_wait_driver&) = delete;
  ~sync_wait_driver() {
    if (handle_) handle_.destroy();
  }

  void run_on(run_loop& loop) {
    handle_.promise().loop = &loop;
    loop.post(handle_);
    loop.run();
    if (handle_.promise().error) std::rethrow_exception(handle_.promise().error);
  }

 private:
  explicit sync_wait_driver(std::coroutine_handle<promise_type> h) noexcept : handle_(h) {}
  std::coroutine_handle<promise_type> handle_;
};

template <class T>
sync_wait_driver drive(task<T>& t, std::optional<T>& out) {
  out.emplace(co_await std::move(t));
}

inline sync_wait_driver drive(task<void>& t) { co_await std::move(t); }

}  // namespace detail

/// Runs `t` to completion on `loop`, driven by the calling thread, and returns its value (or
/// rethrows its exception). Work other coroutines posted to `loop` meanwhile runs too.
template <class T>
T sync_wait(run_loop& loop, task<T> t) {
  if constexpr (std::is_void_v<T>) {
    detail::drive(t).run_on(loop);
  } else {
    std::optional<T> out;
    detail::drive(t, out).run_on(loop);
    return std::move(*out);
  }
}

/// Runs `t` to completion on a run_loop of its own on the calling thread.
template <class T>
T sync_wait(task<T> t) {
  run_loop loop;
  return sync_wait(loop, std::move(t));
}

/// Runs `t` on `scheduler`, which other threads drive, and blocks the calling thread until it ends.
/// The scheduler is referred to (an any_scheduler is copied) and must outlive the call.
template <detail::has_post S, class T>
requires(!std::same_as<std::remove_cv_t<S>, run_loop>) T sync_wait(S& scheduler, task<T> t) {
  static_assert(detail::check_scheduler<std::remove_cv_t<S>>());
  using value_type = std::conditional_t<std::is_void_v<T>, bool, T>;
  struct outcome {
    std::mutex mutex;
    std::condition_variable ended;
    bool done = false;
    std::exception_ptr error;
    std::optional<value_type> value;
  } out;
  auto done = [&out](std::exception_ptr error, auto&&... value) noexcept {
    // Notified under the lock: the waiter cannot return, and free `out`, before this unlocks.
    std::lock_guard lock(out.mutex);
    out.error = std::move(error);
    if constexpr (sizeof...(value) != 0) {
      if (!out.error) out.value.emplace(std::move(*value)...);
    }
    out.done = true;
    out.ended.notify_all();
  };
  detail::run_detached(std::move(t), std::move(done)).start_on(detail::hold_scheduler(scheduler));
  std::unique_lock lock(out.mutex);
  out.ended.wait(lock, [&out] { return out.done; });
  if (out.error) std::rethrow_exception(out.error);
  if constexpr (!std::is_void_v<T>) return std::move(*out.value);
}

}  // namespace ferry

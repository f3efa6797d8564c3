#pragma once
// The coroutine behind spawn and sync_wait on any scheduler: it starts on a scheduler, awaits one
// task there, hands the task's outcome to a completion function and frees itself.

#include <coroutine>
#include <exception>
#include <optional>
#include <type_traits>
#include <utility>

#include "ferry/scheduler.hpp"

namespace ferry {
// Declared only: task.hpp includes sync_wait.hpp, which includes this header.
template <class T>
class task;
}  // namespace ferry

namespace ferry::detail {

class [[nodiscard]] detached_task {
 public:
  struct promise_type {
    // Every await inside inherits this one: the task awaited below runs on it, and posts back to
    // it.
    any_scheduler scheduler;

    any_scheduler& get_scheduler() noexcept { return scheduler; }
    detached_task get_return_object() noexcept {
      return detached_task(std::coroutine_handle<promise_type>::from_promise(*this));
    }
    std::suspend_always initial_suspend() noexcept { return {}; }
    std::suspend_never final_suspend() noexcept { return {}; }
    void return_void() noexcept {}
    // The task's own exception is caught in run_detached; what reaches here came from the
    // completion function, which has nobody to report to.
    void unhandled_exception() noexcept { std::terminate(); }
  };

  detached_task(detached_task&& other) noexcept : handle_(std::exchange(other.handle_, {})) {}
  detached_task(const detached_task&) = delete;
  detached_task& operator=(const detached_task&) = delete;
  ~detached_task() {
    if (handle_) handle_.destroy();
  }

  // Starts the coroutine on `s`, by posting it there: from here on the frame frees itself when it
  // ends.
  void start_on(any_scheduler s) && noexcept {
    promise_type& p = std::exchange(handle_, {}).promise();
    p.scheduler = std::move(s);
    const any_scheduler local = p.scheduler;
    local.post(std::coroutine_handle<promise_type>::from_promise(p));
  }

 private:
  explicit detached_task(std::coroutine_handle<promise_type> h) noexcept : handle_(h) {}
  std::coroutine_handle<promise_type> handle_;
};

// Awaits `t` and calls done(error) for a task<void>, done(error, value) otherwise, where `value` is
// a std::optional<T> that is empty when `error` is set.
//
// The task's frame is destroyed before done() runs, and done() is given the only other reference to
// the exception: done() hands the outcome to another thread (sync_wait's caller), which must then
// be the last to touch it, not this thread dropping the frame or a copy after the hand-over.
template <class T, class Done>
detached_task run_detached(task<T> t, Done done) {
  std::exception_ptr error;
  if constexpr (std::is_void_v<T>) {
    {
      task<T> awaited = std::move(t);
      try {
        co_await std::move(awaited);
      } catch (...) {
        error = std::current_exception();
      }
    }
    done(std::move(error));
  } else {
    std::optional<T> value;
    {
      task<T> awaited = std::move(t);
      try {
        value.emplace(co_await std::move(awaited));
      } catch (...) {
        error = std::current_exception();
      }
    }
    done(std::move(error), std::move(value));
  }
}

// A scheduler passed by reference to spawn or sync_wait: referred to, except an any_scheduler,
// which is itself a handle and is copied.
template <has_post S>
[[nodiscard]] any_scheduler hold_scheduler(S& s) noexcept {
  if constexpr (std::same_as<std::remove_cv_t<S>, any_scheduler>) {
    return s;
  } else {
    return any_scheduler::reference(s);
  }
}

}  // namespace ferry::detail

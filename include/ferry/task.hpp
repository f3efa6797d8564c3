#pragma once
// task<T>: a lazy coroutine that carries its scheduler. Awaited from another coroutine it inherits the
// awaiting coroutine's scheduler; sync_wait (ferry/sync_wait.hpp, included below) runs one from a
// thread outside any coroutine, spawn (ferry/spawn.hpp) starts one detached.

#include <coroutine>
#include <exception>
#include <optional>
#include <type_traits>
#include <utility>

#include "ferry/scheduler.hpp"

namespace ferry {

template <class T = void>
class task;

namespace detail {

class task_promise_base {
 public:
  // Awaiters inside the task copy this scheduler (see scheduler_of).
  [[nodiscard]] any_scheduler& get_scheduler() noexcept { return scheduler_; }

  std::suspend_always initial_suspend() noexcept { return {}; }

  struct final_awaiter {
    bool await_ready() noexcept { return false; }

    template <class Promise>
    std::coroutine_handle<> await_suspend(std::coroutine_handle<Promise> h) noexcept {
      task_promise_base& p = h.promise();
      if (!p.continuation_) return std::noop_coroutine();
      if (p.post_continuation_ || p.resumed_elsewhere_) {
        // resume_on asked for the awaiting coroutine to resume through the scheduler; or this task
        // went on elsewhere through a resume_on of its own, may be ending on another thread, and
        // hands back through the scheduler it inherited. Posting may resume the awaiting
        // coroutine, and it may destroy this frame, at once: nothing touches `p` after this.
        const any_scheduler s = p.scheduler_;
        s.post(p.continuation_);
        return std::noop_coroutine();
      }
      return p.continuation_;
    }

    void await_resume() noexcept {}
  };

  final_awaiter final_suspend() noexcept { return {}; }

  void unhandled_exception() noexcept { error_ = std::current_exception(); }

  // resume_on, inside this task: from here it may run on another scheduler's thread.
  void note_resumed_elsewhere() noexcept { resumed_elsewhere_ = true; }

  void start(std::coroutine_handle<> continuation, any_scheduler s, bool post_continuation) noexcept {
    continuation_ = continuation;
    scheduler_ = std::move(s);
    post_continuation_ = post_continuation;
  }

 protected:
  void rethrow_if_failed() const {
    if (error_) std::rethrow_exception(error_);
  }

 private:
  any_scheduler scheduler_;
  std::coroutine_handle<> continuation_;
  bool post_continuation_ = false;
  bool resumed_elsewhere_ = false;
  std::exception_ptr error_;
};

template <class T>
class task_promise : public task_promise_base {
 public:
  task<T> get_return_object() noexcept;

  template <class U>
    requires std::convertible_to<U&&, T>
  void return_value(U&& value) noexcept(std::is_nothrow_constructible_v<T, U&&>) {
    value_.emplace(std::forward<U>(value));
  }

  T take() {
    rethrow_if_failed();
    return std::move(*value_);
  }

 private:
  std::optional<T> value_;
};

template <>
class task_promise<void> : public task_promise_base {
 public:
  task<void> get_return_object() noexcept;
  void return_void() noexcept {}
  void take() const { rethrow_if_failed(); }
};

}  // namespace detail

/// A lazy coroutine returning `T` that runs on the scheduler of whoever awaits it.
///
/// Nothing runs until it is awaited (co_await std::move(t)), run by sync_wait or started by spawn;
/// its exception is rethrown to the awaiter. Move-only; destroying it destroys the frame.
template <class T>
class [[nodiscard]] task {
  static_assert(!std::is_reference_v<T>, "ferry::task<T&> is not supported; return a pointer");

 public:
  /// The coroutine promise (its get_scheduler() is the scheduler the task inherited).
  using promise_type = detail::task_promise<T>;
  /// The coroutine handle of the task's frame.
  using handle_type = std::coroutine_handle<promise_type>;

  /// Takes `other`'s coroutine, leaving `other` empty.
  task(task&& other) noexcept : handle_(std::exchange(other.handle_, {})) {}
  /// Destroys this task's coroutine, if any, and takes `other`'s.
  task& operator=(task&& other) noexcept {
    if (this != &other) {
      destroy();
      handle_ = std::exchange(other.handle_, {});
    }
    return *this;
  }
  task(const task&) = delete;
  task& operator=(const task&) = delete;
  /// Destroys the coroutine frame, if the task still owns one.
  ~task() { destroy(); }

  /// What `co_await std::move(t)` uses: starts the task inline and yields its result.
  class awaiter {
   public:
    /// An awaiter on the task's coroutine `h` (not owned).
    explicit awaiter(handle_type h) noexcept : handle_(h) {}

    /// True for an empty or finished task: nothing to start.
    bool await_ready() const noexcept { return !handle_ || handle_.done(); }

    /// Awaited from a coroutine with a scheduler: the task inherits it, starts inline and, when it
    /// finishes, transfers straight back to the awaiting coroutine (through the scheduler, if the
    /// task went elsewhere with resume_on meanwhile).
    template <class Promise>
    std::coroutine_handle<> await_suspend(std::coroutine_handle<Promise> h) {
      if constexpr (detail::promise_with_scheduler<Promise>) {
        handle_.promise().start(h, detail::scheduler_of(h.promise()), false);
        return handle_;
      } else {
        return detail::suspend_on_promise_scheduler(*this, h);
      }
    }

    /// Through resume_on: the task runs its awaits on `s`, and the awaiting coroutine resumes through
    /// `s` when the task finishes.
    std::coroutine_handle<> await_suspend_on(std::coroutine_handle<> h, any_scheduler s) noexcept {
      handle_.promise().start(h, std::move(s), true);
      return handle_;
    }

    /// The task's value, or its exception rethrown.
    T await_resume() { return handle_.promise().take(); }

   private:
    handle_type handle_;
  };

  /// Awaiting a task (as an rvalue) starts it; its value or exception comes back to the awaiter.
  awaiter operator co_await() && noexcept { return awaiter(handle_); }

  /// The task's coroutine handle; the task still owns it.
  /// For sync_wait and for users who start a task on a scheduler of their own.
  [[nodiscard]] handle_type handle() const noexcept { return handle_; }

 private:
  friend promise_type;
  explicit task(handle_type h) noexcept : handle_(h) {}

  void destroy() noexcept {
    if (handle_) std::exchange(handle_, {}).destroy();
  }

  handle_type handle_;
};

namespace detail {

template <class T>
task<T> task_promise<T>::get_return_object() noexcept {
  return task<T>(std::coroutine_handle<task_promise<T>>::from_promise(*this));
}

inline task<void> task_promise<void>::get_return_object() noexcept {
  return task<void>(std::coroutine_handle<task_promise<void>>::from_promise(*this));
}

}  // namespace detail

}  // namespace ferry

// sync_wait has its own header; included here so that code which found it in this one still does.
#include "ferry/sync_wait.hpp"

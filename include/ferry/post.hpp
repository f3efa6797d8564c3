#pragma once
// Posting into a backend whose submission queue may be full: retry with exponential backoff until one
// deadline, then hand back an ordinary failed transfer, so a full queue is never a silent drop and
// never a hang. post_with_backoff blocks the calling thread through its pauses (for callers without
// a scheduler); co_await post_with_backoff_async pauses on a timer instead, so an engine thread goes
// on with other work while the queue drains.

#include <algorithm>
#include <chrono>
#include <coroutine>
#include <optional>
#include <thread>
#include <type_traits>
#include <utility>

#include "ferry/detail/timeout.hpp"
#include "ferry/detail/timer_service.hpp"
#include "ferry/errors.hpp"
#include "ferry/scheduler.hpp"
#include "ferry/task.hpp"
#include "ferry/transfer.hpp"

namespace ferry {

/// The pauses between tries of post_with_backoff: doubling from `initial` up to `limit`.
struct backoff_options {
  std::chrono::nanoseconds initial = std::chrono::microseconds(2);  ///< the first pause
  std::chrono::nanoseconds limit = std::chrono::milliseconds(1);  ///< the longest single pause
};

namespace detail {

template <class Submit>
concept submit_function =
    std::is_same_v<std::remove_cvref_t<std::invoke_result_t<Submit&>>, std::optional<transfer>>;

// The pauses between tries: doubling from `initial` up to `limit`, never past the deadline.
class backoff {
 public:
  backoff(std::chrono::steady_clock::time_point deadline, backoff_options options) noexcept
      : deadline_(deadline),
        pause_(std::max(options.initial, std::chrono::nanoseconds(1))),
        limit_(std::max({options.limit, options.initial, pause_})) {}

  // The next pause, or nullopt once the deadline has passed.
  [[nodiscard]] std::optional<std::chrono::nanoseconds> next() noexcept {
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline_) return std::nullopt;
    const auto pause = std::min<std::chrono::nanoseconds>(
        pause_, std::chrono::duration_cast<std::chrono::nanoseconds>(deadline_ - now));
    // Doubled up to the limit, without overflowing for a limit near the largest duration.
    pause_ = pause_ > limit_ / 2 ? limit_ : pause_ * 2;
    return pause;
  }

 private:
  std::chrono::steady_clock::time_point deadline_;
  std::chrono::nanoseconds pause_;
  std::chrono::nanoseconds limit_;
};

[[nodiscard]] inline transfer queue_stayed_full() {
  return make_completed_transfer(transfer_state::failed, errc::submission_queue_full);
}

// co_await pause_for(d): resumes on the awaiting coroutine's scheduler once `d` has passed; the
// process-wide timer thread posts it. The awaiting coroutine must not be destroyed while it waits.
class [[nodiscard]] pause_awaitable {
 public:
  explicit pause_awaitable(std::chrono::nanoseconds d) noexcept : pause_(d) {}
  pause_awaitable(const pause_awaitable&) = delete;
  pause_awaitable& operator=(const pause_awaitable&) = delete;
  // A coroutine destroyed while it pauses (before the deadline) takes its timer with it. (After
  // the timer has fired, cancel finds nothing and this costs one lock.)
  ~pause_awaitable() {
    if (armed_) process_timers().cancel(node_);
  }

  [[nodiscard]] bool await_ready() const noexcept { return pause_ <= std::chrono::nanoseconds(0); }

  template <class Promise>
  bool await_suspend(std::coroutine_handle<Promise> h) {
    return suspend_on_promise_scheduler(*this, h);
  }

  // Throws std::bad_alloc if the timer cannot be armed (the coroutine then goes on at once, with
  // the exception).
  bool await_suspend_on(std::coroutine_handle<> h, any_scheduler s) {
    continuation_ = h;
    scheduler_ = std::move(s);
    node_.owner = this;
    node_.fire = &fire;
    node_.deadline = deadline_after(pause_);
    process_timers().arm(node_);
    armed_ = true;
    return true;
  }

  void await_resume() const noexcept {}

 private:
  struct node : timer_node {
    pause_awaitable* owner = nullptr;
  };

  static void fire(timer_node* t) noexcept {
    pause_awaitable* self = static_cast<node*>(t)->owner;
    // Posting may resume the coroutine, which frees this awaitable: nothing touches it after.
    self->scheduler_.post(self->continuation_);
  }

  std::chrono::nanoseconds pause_;
  bool armed_ = false;
  std::coroutine_handle<> continuation_;
  any_scheduler scheduler_;
  node node_;
};

}  // namespace detail

/// Posts through `submit`, retrying while the backend's queue is full, until `deadline`.
/// `submit()` returns std::optional<transfer>: a transfer when the backend took the request, nullopt
/// when its submission queue is full. Retried, with pauses doubling from `initial` up to `limit`, until
/// `deadline`; after that the result is a transfer already failed with errc::submission_queue_full.
/// The calling thread sleeps through the pauses.
template <class Submit>
  requires detail::submit_function<Submit>
[[nodiscard]] transfer post_with_backoff(Submit&& submit, std::chrono::steady_clock::time_point deadline,
                                         backoff_options options = {}) {
  detail::backoff pauses(deadline, options);
  for (;;) {
    if (std::optional<transfer> t = submit()) return std::move(*t);
    const std::optional<std::chrono::nanoseconds> pause = pauses.next();
    if (!pause) return detail::queue_stayed_full();
    std::this_thread::sleep_for(*pause);
  }
}

/// post_with_backoff as a task: it pauses on a timer rather than sleeping the thread.
/// The same, awaited: co_await post_with_backoff_async(submit, deadline) pauses on a timer and goes on
/// on the awaiting coroutine's scheduler, so the thread that awaits it never sleeps. `submit` is
/// kept (moved) in the task until it ends.
template <class Submit>
  requires detail::submit_function<Submit>
[[nodiscard]] task<transfer> post_with_backoff_async(Submit submit,
                                                     std::chrono::steady_clock::time_point deadline,
                                                     backoff_options options = {}) {
  detail::backoff pauses(deadline, options);
  for (;;) {
    if (std::optional<transfer> t = submit()) co_return std::move(*t);
    const std::optional<std::chrono::nanoseconds> pause = pauses.next();
    if (!pause) co_return detail::queue_stayed_full();
    co_await detail::pause_awaitable(*pause);
  }
}

}  // namespace ferry

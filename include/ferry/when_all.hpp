#pragma once
// co_await when_all(members, timeout): the wait_all verdict, awaited. The coroutine resumes on its own
// scheduler the moment any member fails, when the last member succeeds, or at the shared deadline.

#include <chrono>
#include <coroutine>
#include <span>
#include <utility>

#include "ferry/batch_result.hpp"
#include "ferry/detail/batch_join.hpp"
#include "ferry/detail/timeout.hpp"
#include "ferry/detail/timer_service.hpp"
#include "ferry/poll_all.hpp"
#include "ferry/progress_executor.hpp"
#include "ferry/scheduler.hpp"
#include "ferry/transfer.hpp"

namespace ferry {

/// What when_all returns: `co_await` it once for the batch_result.
/// The members must stay valid until the co_await completes.
class [[nodiscard]] when_all_awaitable {
 public:
  /// The wait over `members` with timeout `t`, its deadline served by `timers` (use when_all).
  when_all_awaitable(std::span<const transfer> members, detail::timeout t,
                     detail::timer_service* timers) noexcept
      : members_(members), timeout_(t), timers_(timers) {}

  /// Takes over `other`'s members, timeout and any wait under way (move it before awaiting).
  when_all_awaitable(when_all_awaitable&& other) noexcept
      : members_(other.members_),
        timeout_(other.timeout_),
        timers_(other.timers_),
        result_(other.result_),
        join_(std::exchange(other.join_, nullptr)) {}
  when_all_awaitable& operator=(when_all_awaitable&&) = delete;

  /// Ends the wait's bookkeeping; the transfers go on running.
  ~when_all_awaitable() {
    if (join_ != nullptr) join_->finish();
  }

  /// Decided without suspending: a failure or full success already visible, or a zero timeout.
  bool await_ready() noexcept {
    result_ = poll_all(members_);
    if (result_.verdict == verdict::failed) detail::name_first_failure(result_, members_);
    return result_.verdict != verdict::pending || timeout_.is_look();
  }

  /// Suspends `h` until the verdict, to resume on its promise's get_scheduler().
  template <class Promise>
  bool await_suspend(std::coroutine_handle<Promise> h) {
    return detail::suspend_on_promise_scheduler(*this, h);
  }

  /// Suspends `h` until the verdict, to resume on `s`; false (resume now) if it was reached at once.
  /// A batch over 2^32 - 1 members fails at once with errc::batch_too_large.
  bool await_suspend_on(std::coroutine_handle<> h, any_scheduler s) {
    if (members_.size() > detail::max_batch_members) {
      result_ = {verdict::failed, std::nullopt, make_error_code(errc::batch_too_large),
                 members_.size()};
      return false;
    }
    const detail::clock::time_point deadline =
        timeout_.is_bounded() ? timeout_.deadline() : detail::clock::time_point{};
    join_ = detail::batch_join::create(members_.size(), detail::batch_mode::short_circuit);
    join_->deliver_to(h, std::move(s));
    try {
      // When start() returns false the verdict may be delivered, and this frame resumed and freed,
      // on another thread at any moment: nothing after it touches *this.
      return !join_->start(members_, timeout_.is_bounded() ? timers_ : nullptr, deadline);
    } catch (...) {
      join_->finish();
      join_ = nullptr;
      throw;
    }
  }

  /// The verdict, with the member that failed first in time and its error.
  batch_result await_resume() noexcept {
    if (join_ != nullptr) {
      result_ = join_->result(members_);
      std::exchange(join_, nullptr)->finish();
    }
    return result_;
  }

 private:
  std::span<const transfer> members_;
  detail::timeout timeout_;
  detail::timer_service* timers_;
  batch_result result_;
  detail::batch_join* join_ = nullptr;
};

/// `co_await when_all(members, timeout)`: the wait_all verdict, awaited on the coroutine's scheduler.
/// The deadline is served by a process-wide timer thread, started on first use. The overload taking a
/// progress_executor uses that executor's timers instead.
template <class Rep, class Period>
[[nodiscard]] when_all_awaitable when_all(std::span<const transfer> members,
                                          std::chrono::duration<Rep, Period> timeout) {
  const detail::timeout t = detail::make_timeout(timeout);
  return when_all_awaitable(members, t, t.is_bounded() ? &detail::process_timers() : nullptr);
}

/// when_all with its deadline served by `exec`'s timers rather than the process-wide timer thread.
template <class Rep, class Period>
[[nodiscard]] when_all_awaitable when_all(progress_executor& exec,
                                          std::span<const transfer> members,
                                          std::chrono::duration<Rep, Period> timeout) {
  const detail::timeout t = detail::make_timeout(timeout);
  return when_all_awaitable(members, t, t.is_bounded() ? &exec.timers() : nullptr);
}

}  // namespace ferry

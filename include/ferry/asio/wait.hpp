#pragma once
// Batch and single-transfer waits as Asio asynchronous operations (async_initiate), so that any
// completion token works: a callback, asio::use_awaitable, asio::use_future,
// asio::experimental::deferred.
//
//   async_wait_all(members, timeout, token)  void(std::error_code, batch_result): the when_all
//   verdict async_drain(members, timeout, token)     void(std::error_code, batch_result): the drain
//   verdict async_wait(transfer, [timeout,] token)   void(std::error_code, transfer_state)
//
// The handler runs on its associated executor (asio::get_associated_executor; a callback without
// one runs on asio::system_executor, so bind it with asio::bind_executor), always through a post:
// never inside the initiating call, never on the thread that completed a transfer (the progress
// executor's, a timer's). The error code is empty unless the operation was cancelled; a deadline is
// a verdict (timed_out, or pending for async_wait), as for when_all.
//
// Per-operation cancellation (the handler's associated cancellation slot: terminal, partial or
// total, so `wait || timer` with asio::experimental::awaitable_operators works) ends the wait at
// once: the handler gets asio::error::operation_aborted with the members as they were (verdict
// pending, state pending). It is the join's own deadline brought forward (batch_join::expire_now),
// so the waiter nodes are unlinked as after a deadline, a completion that comes later touches
// nothing of the operation, and the transfers go on running, as after a timed-out when_all. A
// cancellation racing the verdict delivers one outcome: whichever decides first, through one CAS;
// should the members be decided by the time the handler is prepared, that verdict is delivered
// with no error. Every cancellation type is honoured, total included, since a wait changes nothing
// about what it waits for.
//
// As with Asio's own operations, the cancellation signal is emitted on the handler's executor (a
// strand, where an io_context runs on several threads), and the members (for the batch waits) and
// the handler's execution context stay alive until the handler has run.

#include <asio/associated_cancellation_slot.hpp>
#include <asio/associated_executor.hpp>
#include <asio/async_result.hpp>
#include <asio/cancellation_type.hpp>
#include <asio/error.hpp>
#include <asio/executor_work_guard.hpp>
#include <asio/post.hpp>
#include <chrono>
#include <coroutine>
#include <cstddef>
#include <memory>
#include <span>
#include <system_error>
#include <type_traits>
#include <utility>

#include "ferry/batch_result.hpp"
#include "ferry/detail/batch_join.hpp"
#include "ferry/detail/timeout.hpp"
#include "ferry/detail/timer_service.hpp"
#include "ferry/errors.hpp"
#include "ferry/poll_all.hpp"
#include "ferry/scheduler.hpp"
#include "ferry/transfer.hpp"

namespace ferry {

namespace detail::asio_wait {

using wait_signature = void(std::error_code, batch_result);
using transfer_signature = void(std::error_code, transfer_state);

// The members an operation waits on: the caller's span, or one transfer the operation holds.
struct span_members {
  std::span<const transfer> members;
  [[nodiscard]] std::span<const transfer> get() const noexcept { return members; }
};
struct one_member {
  transfer member;
  [[nodiscard]] std::span<const transfer> get() const noexcept { return {&member, 1}; }
};

// The one result type the handler sees, from the batch verdict.
[[nodiscard]] inline batch_result completion_value(const batch_result& r, span_members) noexcept {
  return r;
}
[[nodiscard]] inline transfer_state completion_value(const batch_result& r,
                                                     const one_member& m) noexcept {
  // A member that decided the verdict is terminal, and stays so.
  return r.verdict == verdict::timed_out || r.verdict == verdict::pending ? transfer_state::pending
                                                                          : m.member.state();
}

[[nodiscard]] inline bool decided(const batch_result& r, batch_mode mode) noexcept {
  return mode == batch_mode::short_circuit ? r.verdict != verdict::pending : r.pending == 0;
}

template <class Handler>
using handler_executor_t = ::asio::associated_executor_t<Handler, ::asio::system_executor>;

// One operation in flight: its handler, the work it keeps counted on the handler's executor, and
// its join. Freed on the handler's executor just before the handler is called.
template <class Handler, class Members>
class operation {
 public:
  using executor_type = handler_executor_t<Handler>;

  operation(Handler&& h, Members members, batch_mode mode)
      : handler_(std::move(h)),
        work_(::asio::get_associated_executor(handler_, ::asio::system_executor())),
        members_(std::move(members)),
        mode_(mode) {}

  operation(const operation&) = delete;
  operation& operator=(const operation&) = delete;

  // Starts the wait; the operation owns itself from here (`self` is this, freshly allocated).
  static void start(std::unique_ptr<operation> self, timeout t) {
    operation& op = *self;
    const std::span<const transfer> members = op.members_.get();
    op.join_ = batch_join::create(members.size(), op.mode_);
    // The join delivers by "posting" to this scheduler, whose post posts the completion to the
    // handler's executor; the coroutine handle is unused.
    op.join_->deliver_to(std::noop_coroutine(), any_scheduler(verdict_delivery{&op}));
    // The slot before start(): once start() returns false, the verdict may be delivered, and the
    // completion run, at any moment. The signal is not emitted during this call (it is emitted on
    // the handler's executor, as this initiation runs or before it, never beside it).
    op.slot_ = ::asio::get_associated_cancellation_slot(op.handler_);
    if (op.slot_.is_connected()) op.slot_.template emplace<stop_request>(&op);
    const clock::time_point deadline = t.is_bounded() ? t.deadline() : clock::time_point{};
    bool decided_now = false;
    try {
      decided_now =
          op.join_->start(members, t.is_bounded() ? &process_timers() : nullptr, deadline);
    } catch (...) {
      // Nothing was linked (only arming the timer throws).
      if (op.slot_.is_connected()) op.slot_.clear();
      op.join_->finish();
      throw;
    }
    // Either way the operation now belongs to its completion, posted below or by the join.
    operation* raw = self.release();
    if (decided_now) raw->post_completion();
  }

 private:
  // The cancellation handler installed in the slot.
  struct stop_request {
    // A constructor, not an aggregate: Asio's emplace constructs with parentheses, which clang 14
    // does not take for aggregates.
    explicit stop_request(operation* o) noexcept : op(o) {}
    operation* op;
    void operator()(::asio::cancellation_type_t type) const noexcept {
      if ((type & (::asio::cancellation_type::terminal | ::asio::cancellation_type::partial |
                   ::asio::cancellation_type::total)) == ::asio::cancellation_type::none) {
        return;
      }
      // The signal and the completion run on the handler's executor one after the other, and the
      // completion clears the slot first, so the join is alive here. Whether this, a member or the
      // deadline decides, one CAS in the join says; the loser changes nothing. stopped_ is written
      // after the completion was posted, and read by it: the same serialisation orders the two
      // (a completion queued behind this handler runs after it returns).
      if (op->join_->expire_now()) op->stopped_ = true;
    }
  };

  struct verdict_delivery {
    operation* op;
    void post(std::coroutine_handle<>) const noexcept { op->post_completion(); }
  };

  // Runs the completion on the handler's executor; destroyed unrun (its context shut down), it
  // frees the operation and the handler without calling it, as Asio does with its own handlers.
  class completion {
   public:
    explicit completion(operation* op) noexcept : op_(op) {}
    completion(completion&& other) noexcept : op_(std::exchange(other.op_, nullptr)) {}
    completion& operator=(completion&&) = delete;
    ~completion() {
      if (op_ != nullptr) {
        if (op_->slot_.is_connected()) op_->slot_.clear();
        op_->join_->finish();
        delete op_;
      }
    }
    void operator()() { std::exchange(op_, nullptr)->complete(); }

   private:
    operation* op_;
  };

  // Called once, by whichever actor decided the verdict, on any thread.
  void post_completion() noexcept { ::asio::post(work_.get_executor(), completion(this)); }

  void complete() {
    if (slot_.is_connected()) slot_.clear();
    batch_result r = join_->result(members_.get());
    join_->finish();
    std::error_code ec;
    if (stopped_ && r.verdict == verdict::timed_out) {
      ec = ::asio::error::operation_aborted;
      r.verdict = verdict::pending;
    }
    auto value = completion_value(r, members_);
    // Free the operation before the upcall, so that a handler starting the next wait can reuse its
    // memory; the work stays counted until the handler returns.
    Handler handler(std::move(handler_));
    auto work(std::move(work_));
    delete this;
    std::move(handler)(ec, std::move(value));
  }

  Handler handler_;
  ::asio::executor_work_guard<executor_type> work_;
  Members members_;
  batch_mode mode_;
  batch_join* join_ = nullptr;
  ::asio::cancellation_slot slot_;
  bool stopped_ = false;
};

// A result known at initiation: still through a post to the handler's executor.
template <class Handler, class Value>
void post_now(Handler&& handler, std::error_code ec, Value value) {
  auto ex = ::asio::get_associated_executor(handler, ::asio::system_executor());
  ::asio::post(ex, [h = std::move(handler), ec, value]() mutable { std::move(h)(ec, value); });
}

struct initiate_wait {
  template <class Handler, class Members>
  void operator()(Handler&& handler, Members members, timeout t, batch_mode mode) const {
    using op_type = operation<std::decay_t<Handler>, Members>;
    const std::span<const transfer> span = members.get();
    batch_result r = poll_all(span);
    if (r.verdict == verdict::failed) ferry::detail::name_first_failure(r, span);
    if (decided(r, mode) || t.is_look()) {
      post_now(std::forward<Handler>(handler), std::error_code{}, completion_value(r, members));
      return;
    }
    if (span.size() > max_batch_members) {
      const batch_result too_large{verdict::failed, std::nullopt,
                                   make_error_code(errc::batch_too_large), span.size()};
      post_now(std::forward<Handler>(handler), std::error_code{},
               completion_value(too_large, members));
      return;
    }
    op_type::start(
        std::make_unique<op_type>(std::forward<Handler>(handler), std::move(members), mode), t);
  }
};

}  // namespace detail::asio_wait

/// The when_all verdict as an Asio operation: failed the moment a member fails, success when the
/// last succeeds, timed_out at the shared deadline (timeout < 0: none; 0: poll_all). The members
/// must stay valid until the handler runs.
template <class Rep, class Period, class CompletionToken>
auto async_wait_all(std::span<const transfer> members, std::chrono::duration<Rep, Period> timeout,
                    CompletionToken&& token) {
  return ::asio::async_initiate<CompletionToken, detail::asio_wait::wait_signature>(
      detail::asio_wait::initiate_wait{}, token, detail::asio_wait::span_members{members},
      detail::make_timeout(timeout), detail::batch_mode::short_circuit);
}

/// The drain verdict as an Asio operation: every member terminal, failures included, or the
/// deadline.
template <class Rep, class Period, class CompletionToken>
auto async_drain(std::span<const transfer> members, std::chrono::duration<Rep, Period> timeout,
                 CompletionToken&& token) {
  return ::asio::async_initiate<CompletionToken, detail::asio_wait::wait_signature>(
      detail::asio_wait::initiate_wait{}, token, detail::asio_wait::span_members{members},
      detail::make_timeout(timeout), detail::batch_mode::drain);
}

/// One transfer's terminal state as an Asio operation (pending if the deadline passes first). The
/// operation holds its own handle on the transfer.
template <class Rep, class Period, class CompletionToken>
auto async_wait(transfer t, std::chrono::duration<Rep, Period> timeout, CompletionToken&& token) {
  return ::asio::async_initiate<CompletionToken, detail::asio_wait::transfer_signature>(
      detail::asio_wait::initiate_wait{}, token, detail::asio_wait::one_member{std::move(t)},
      detail::make_timeout(timeout), detail::batch_mode::short_circuit);
}

/// async_wait without a deadline: completes when the transfer is terminal.
template <class CompletionToken>
auto async_wait(transfer t, CompletionToken&& token) {
  return async_wait(std::move(t), std::chrono::nanoseconds(-1),
                    std::forward<CompletionToken>(token));
}

}  // namespace ferry

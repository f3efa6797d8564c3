#pragma once
// transfer: the waiting side of one data movement; completer: the completing side. Both are cheap
// copyable handles to one pooled status block.

#include <algorithm>
#include <chrono>
#include <coroutine>
#include <cstdint>
#include <stdexcept>
#include <system_error>
#include <utility>

#include "ferry/detail/status_block.hpp"
#include "ferry/detail/timeout.hpp"
#include "ferry/errors.hpp"
#include "ferry/scheduler.hpp"
#include "ferry/transfer_state.hpp"

namespace ferry {

namespace detail {
struct adopt_t {};
inline constexpr adopt_t adopt{};
}  // namespace detail

/// Awaits one transfer: yields its terminal state and resumes on the awaiting coroutine's scheduler.
/// An already-finished transfer does not suspend.
///
/// The awaiter holds no reference of its own: while its node is linked the status is pending, and a
/// pending status is kept alive by its completers (the last of which completes it, and so notifies
/// us, before it lets go). Once notified, the awaiter reads only what the notification handed it.
class transfer_awaiter : private detail::waiter {
 public:
  /// An awaiter on status `s` (transfer::operator co_await makes it; nullptr yields failed).
  explicit transfer_awaiter(detail::status_block* s) noexcept : status_(s) {}
  transfer_awaiter(const transfer_awaiter&) = delete;
  transfer_awaiter& operator=(const transfer_awaiter&) = delete;

  // Only a coroutine destroyed while suspended here still has a node that a completion may
  // notify. remove_waiter makes sure it will not be (the status is alive: it is pending, or its
  // completer is inside complete()); if the notification had already started, the coroutine was as
  // good as resumed, and destroying it was the caller's error, as with any coroutine.
  ~transfer_awaiter() {
    if (suspended_ && !resumed_) status_->remove_waiter(this);
  }

  /// True, without suspending, when the transfer is already terminal (or the handle empty).
  [[nodiscard]] bool await_ready() noexcept {
    if (status_ == nullptr) {
      result_ = transfer_state::failed;
      return true;
    }
    result_ = status_->state();
    return result_ != transfer_state::pending;
  }

  /// Suspends `h` until completion, to resume on its promise's get_scheduler(); does not compile
  /// for a promise without one (use resume_on).
  template <class Promise>
  bool await_suspend(std::coroutine_handle<Promise> h) {
    return detail::suspend_on_promise_scheduler(*this, h);
  }

  /// Suspends `h` until completion, to resume on `s`; false (resume now) if it already completed.
  bool await_suspend_on(std::coroutine_handle<> h, any_scheduler s) noexcept {
    continuation_ = h;
    scheduler_ = std::move(s);
    notify = &on_complete;
    suspended_ = true;
    // Once linked, a completion on another thread may resume the coroutine at once: nothing after
    // add_waiter touches *this.
    if (status_->add_waiter(this)) return true;
    suspended_ = false;
    result_ = status_->state();
    return false;
  }

  /// The transfer's terminal state (failed for an empty handle).
  [[nodiscard]] transfer_state await_resume() noexcept {
    resumed_ = true;
    return result_;
  }

 private:
  static void on_complete(detail::waiter* w, const detail::completion_event& ev) noexcept {
    auto* self = static_cast<transfer_awaiter*>(w);
    self->result_ = ev.state;
    // post() copies the scheduler before it makes the coroutine runnable: *self may be gone after.
    self->scheduler_.post(self->continuation_);
  }

  detail::status_block* status_;
  std::coroutine_handle<> continuation_;
  any_scheduler scheduler_;
  transfer_state result_ = transfer_state::pending;
  bool suspended_ = false;
  bool resumed_ = false;
};

/// The waiting side of one data movement: a cheap, copyable handle on its pooled status.
///
/// Ask for its state (one atomic load), block on it with wait() or wait_for(), or `co_await` it
/// for its terminal transfer_state. Copies share the status; the last handle and completer free it.
class transfer {
 public:
  /// An empty handle: state() is failed and error() is errc::empty_transfer.
  transfer() noexcept = default;

  /// Takes over a reference on `s` that the caller already holds (for backends).
  transfer(detail::adopt_t, detail::status_block* s) noexcept : status_(s) {}

  /// Another handle on the same transfer.
  transfer(const transfer& other) noexcept : status_(other.status_) {
    if (status_ != nullptr) status_->add_transfer_ref();
  }
  /// Takes `other`'s transfer, leaving `other` empty.
  transfer(transfer&& other) noexcept : status_(std::exchange(other.status_, nullptr)) {}

  /// Makes this a handle on `other`'s transfer, letting go of its own.
  transfer& operator=(const transfer& other) noexcept {
    transfer(other).swap(*this);
    return *this;
  }
  /// Takes `other`'s transfer, leaving `other` empty, and lets go of its own.
  transfer& operator=(transfer&& other) noexcept {
    transfer(std::move(other)).swap(*this);
    return *this;
  }

  /// Lets go of the handle; the status is freed once no handle or completer holds it.
  ~transfer() {
    if (status_ != nullptr) status_->release_transfer_ref();
  }

  /// Exchanges the transfers the two handles refer to.
  void swap(transfer& other) noexcept { std::swap(status_, other.status_); }

  /// The transfer's current state (failed for an empty handle).
  /// One atomic load: never blocks, never drives progress.
  [[nodiscard]] transfer_state state() const noexcept {
    return status_ == nullptr ? transfer_state::failed : status_->state();
  }

  /// True once the transfer is terminal (succeeded, failed or cancelled); an empty handle is done.
  [[nodiscard]] bool done() const noexcept { return state() != transfer_state::pending; }

  /// False for an empty handle (default-constructed or moved-from).
  [[nodiscard]] bool valid() const noexcept { return status_ != nullptr; }

  /// Empty while pending or succeeded; the reason once failed or cancelled.
  [[nodiscard]] std::error_code error() const noexcept {
    return status_ == nullptr ? make_error_code(errc::empty_transfer) : status_->error();
  }

  /// Blocks the calling thread until the transfer is terminal.
  transfer_state wait() const noexcept {
    return status_ == nullptr ? transfer_state::failed : status_->wait(nullptr);
  }

  /// Blocks until the transfer is terminal or `timeout` passes, and returns the state it saw.
  /// timeout < 0: until terminal; == 0: look once; > 0: up to timeout, then returns what it sees
  /// (pending if the transfer has not finished).
  template <class Rep, class Period>
  transfer_state wait_for(std::chrono::duration<Rep, Period> timeout) const noexcept {
    if (status_ == nullptr) return transfer_state::failed;
    const detail::timeout t = detail::make_timeout(timeout);
    if (t.is_look()) return status_->state();
    if (t.is_forever()) return status_->wait(nullptr);
    const detail::clock::time_point deadline = t.deadline();
    return status_->wait(&deadline);
  }

  /// `co_await t` yields the terminal state, resuming on the awaiting coroutine's scheduler.
  [[nodiscard]] transfer_awaiter operator co_await() const noexcept {
    return transfer_awaiter(status_);
  }

  /// The status block behind the handle (nullptr when empty).
  /// For backends and batch waits; users never need it.
  [[nodiscard]] detail::status_block* status() const noexcept { return status_; }

  /// True when both handle the same transfer (or both are empty).
  friend bool operator==(const transfer& a, const transfer& b) noexcept {
    return a.status_ == b.status_;
  }

 private:
  detail::status_block* status_ = nullptr;
};

/// The completing side of a transfer: a copyable handle whose first succeed, fail or cancel wins.
///
/// A backend keeps one per transfer it posted; make_manual_transfer() gives a pair for bridging a
/// callback API. Destroying the last completer of a pending transfer fails it (errc::abandoned).
class completer {
 public:
  /// An empty handle: every completion call returns false.
  completer() noexcept = default;
  /// Takes over a completer reference on `s` that the caller already holds (for backends).
  completer(detail::adopt_t, detail::status_block* s) noexcept : status_(s) {}

  /// Another completer of the same transfer.
  completer(const completer& other) noexcept : status_(other.status_) {
    if (status_ != nullptr) status_->add_completer_ref();
  }
  /// Takes `other`'s transfer, leaving `other` empty.
  completer(completer&& other) noexcept : status_(std::exchange(other.status_, nullptr)) {}

  /// Makes this a completer of `other`'s transfer, letting go of its own.
  completer& operator=(const completer& other) noexcept {
    completer(other).swap(*this);
    return *this;
  }
  /// Takes `other`'s transfer, leaving `other` empty, and lets go of its own.
  completer& operator=(completer&& other) noexcept {
    completer(std::move(other)).swap(*this);
    return *this;
  }

  /// The last completer of a transfer that never completed fails it with errc::abandoned.
  ~completer() {
    if (status_ != nullptr) status_->release_completer_ref();
  }

  /// Exchanges the transfers the two handles complete.
  void swap(completer& other) noexcept { std::swap(status_, other.status_); }

  /// Completes the transfer as succeeded; true if this call completed it.
  /// The first terminal call wins; every later call returns false and changes nothing.
  bool succeed() noexcept { return complete(transfer_state::success, {}); }

  /// Completes the transfer as failed with `ec`; true if this call completed it.
  /// An empty error_code is replaced by errc::unspecified_failure: a failed transfer always says why.
  bool fail(std::error_code ec) noexcept { return complete(transfer_state::failed, ec); }

  /// Completes the transfer as cancelled (errc::cancelled); true if this call completed it.
  bool cancel() noexcept {
    return complete(transfer_state::cancelled, make_error_code(errc::cancelled));
  }

  /// Completes the transfer in terminal state `to` with `ec`; false for pending, an empty handle,
  /// or a transfer already terminal.
  bool complete(transfer_state to, std::error_code ec) noexcept {
    if (status_ == nullptr || to == transfer_state::pending) return false;
    return status_->complete(to, ec);
  }

  /// False for an empty handle (default-constructed or moved-from).
  [[nodiscard]] bool valid() const noexcept { return status_ != nullptr; }

  /// A handle on the same status, for backends that hand out the transfer after posting.
  [[nodiscard]] transfer get_transfer() const noexcept {
    if (status_ == nullptr) return {};
    status_->add_transfer_ref();
    return transfer(detail::adopt, status_);
  }

 private:
  detail::status_block* status_ = nullptr;
};

/// A pending transfer and the completer that ends it.
[[nodiscard]] inline std::pair<transfer, completer> make_manual_transfer() {
  detail::status_block* s = detail::status_block::make();
  return {transfer(detail::adopt, s), completer(detail::adopt, s)};
}

/// A transfer that is already terminal, for a backend that rejects a request before posting it.
[[nodiscard]] inline transfer make_completed_transfer(transfer_state to, std::error_code ec = {}) {
  auto [t, c] = make_manual_transfer();
  c.complete(to, ec);
  return std::move(t);
}

/// The calling thread's wait spin, as this_thread_wait_spin() reports it.
///
/// Blocking waits (transfer::wait, wait_for) look at the transfer for about a microsecond, less than
/// a futex sleep costs the sleeper, then sleep on a futex. By default they spin no longer: a spinning
/// waiter takes its CPU from whatever shares it, the model beside an engine thread, or the very
/// thread that would complete the transfer when the scheduler wakes that onto the spinner's CPU
/// (bench/RESULTS.md, "Blocking wait latency and CPU per wait": on a 2-vCPU VM with completions 50 µs
/// apart, a 500 µs spin woke in well under a microsecond on an idle machine but at several times the
/// CPU of a condition variable, and beside a process keeping both CPUs busy it was slower than one).
/// A thread with a CPU of its own opts in with set_wait_spin_limit(d): its waits then spin for a
/// while of the thread's own before they sleep, which adapts as run_loop's idle spin does. It starts
/// at none, doubles (up to d) after a sleep that ended within d of the moment the spin began, and
/// halves after a sleep longer than d and after a wait that times out; a wait's deadline also ends
/// its spin. A thread waiting on a stream of transfers that complete a few hundred microseconds apart
/// (reads kept in flight on a disk) then meets them awake instead of being woken for each. The spin
/// does not decay with time alone: after a quiet spell the next wait spins as long as the last did,
/// then halves the spin if it sleeps past the limit.
struct wait_spin_info {
  /// The most a wait on this thread spins (set_wait_spin_limit; zero by default).
  std::chrono::nanoseconds limit;
  std::chrono::nanoseconds current;  ///< what the next wait on this thread spins
  std::uint64_t sleeps;              ///< waits on this thread that went on to sleep after it
};

/// A thread's wait spin limit until it calls set_wait_spin_limit: no spin past the first look.
inline constexpr std::chrono::nanoseconds default_wait_spin_limit =
    detail::wait_spin_state::default_limit;
/// The largest limit set_wait_spin_limit accepts (one second).
inline constexpr std::chrono::nanoseconds max_wait_spin_limit = std::chrono::seconds(1);

/// Sets how long the calling thread's blocking waits may spin before they sleep.
/// The calling thread's limit, from zero (the default: sleep after the look) to max_wait_spin_limit.
/// Throws std::invalid_argument for a negative limit or one above max_wait_spin_limit.
inline void set_wait_spin_limit(std::chrono::nanoseconds limit) {
  if (limit < std::chrono::nanoseconds::zero()) {
    throw std::invalid_argument("ferry::set_wait_spin_limit: the limit must not be negative");
  }
  if (limit > max_wait_spin_limit) {
    throw std::invalid_argument("ferry::set_wait_spin_limit: the limit must be at most 1 s");
  }
  detail::wait_spin_state& spin = detail::this_thread_wait_spin();
  spin.limit = limit;
  spin.current = std::min(spin.current, limit);
}

/// The calling thread's wait spin: its limit, its current spin and how many of its waits slept.
[[nodiscard]] inline wait_spin_info this_thread_wait_spin() noexcept {
  const detail::wait_spin_state& spin = detail::this_thread_wait_spin();
  return {spin.limit, spin.current, spin.sleeps};
}

}  // namespace ferry

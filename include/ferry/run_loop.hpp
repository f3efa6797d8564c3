#pragma once
// A scheduler that an engine thread drives: any thread posts, the owning thread runs.
//
// An idle loop looks at its queue for a while before it sleeps: completions that come in bursts a
// few microseconds apart then continue without a futex wake each, and on a virtual machine without
// the vCPU halting and being woken again, which costs tens of microseconds. While it looks it pauses
// the core, and offers its CPU once, a few microseconds in, so that a thread the kernel woke onto
// that CPU runs then rather than after the spin (detail::idle_spin: why once, and what was measured).
//
// How long it looks adapts, as KVM's halt polling does: from 50 µs by default, doubled (up to
// max_spin, 500 µs by default) after a sleep that ended within max_spin of the moment the loop
// went idle, so that a spin that long would have met the work, and halved (down to the minimum)
// after a sleep that outlasted max_spin. Work that arrives every few hundred microseconds (the
// bursts of completions of reads kept in flight on a disk) is then met awake, without a wake-up per
// burst; a loop whose work comes seldom spins little.
//
// A sleeping loop is woken once per sleep: the first post to find it registered claims the wake, so
// a burst of completions posted to it while it wakes up costs one futex call, not one each.
//
// post() never throws (ferry's schedulers must not: see scheduler.hpp). The queue is a ring made
// at construction and grown as work piles up. Should growing fail for want of memory: a post made
// on the thread running the loop (inside run, run_one or poll) runs the oldest queued item there,
// at once, in the middle of whatever called post; a post from another thread waits for the running
// thread to take one; and a post while no thread runs the loop cannot be queued at all, so the
// process ends with a message saying so. Nothing is lost, and nothing runs on a thread it does not
// belong to.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <coroutine>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <new>
#include <stdexcept>
#include <thread>
#include <utility>

#include "ferry/detail/futex.hpp"
#include "ferry/detail/spin.hpp"
#include "ferry/detail/short_hold_mutex.hpp"
#include "ferry/detail/timeout.hpp"

namespace ferry {

/// A scheduler that an engine thread drives (run, run_one, poll): any thread posts, the owner runs.
///
/// An idle loop spins for a while (adapting, from 50 µs up to 500 µs by default) before it sleeps
/// on a futex; post() never throws and wakes a sleeping loop once. See the top of run_loop.hpp.
class run_loop {
 public:
  /// The idle spin a default-constructed loop starts from, and its least (50 µs).
  static constexpr std::chrono::nanoseconds default_spin = std::chrono::microseconds(50);
  /// The most a default-constructed loop's idle spin grows to (500 µs).
  static constexpr std::chrono::nanoseconds default_max_spin = std::chrono::microseconds(500);

  /// Adapts its idle spin between default_spin and default_max_spin. Throws std::bad_alloc if the
  /// queue's first ring cannot be made.
  run_loop() : run_loop(spins{default_spin, default_max_spin}) {}

  /// A fixed idle spin: how long an idle run() or run_one() looks for work before it sleeps; zero
  /// (or less) sleeps at once (no CPU spent idle, a futex wake for every post to a sleeping loop).
  explicit run_loop(std::chrono::nanoseconds spin) : run_loop(at_least_zero(spin)) {}

  /// An idle spin that adapts between `spin` and `max_spin` (see the top of this file). max_spin is
  /// also the idle time past which the spin shrinks: a loop given a long one spins that long after
  /// every idle period, until periods longer than it come.
  run_loop(std::chrono::nanoseconds spin, std::chrono::nanoseconds max_spin)
      : run_loop(checked(spin, max_spin)) {}

  run_loop(const run_loop&) = delete;
  run_loop& operator=(const run_loop&) = delete;

  ///@{
  /// The least and the most an idle loop looks for work before sleeping, and what it looks now.
  [[nodiscard]] std::chrono::nanoseconds spin() const noexcept { return spin_; }
  [[nodiscard]] std::chrono::nanoseconds max_spin() const noexcept { return max_spin_; }
  [[nodiscard]] std::chrono::nanoseconds current_spin() const noexcept {
    return std::chrono::nanoseconds(current_spin_.load(std::memory_order_relaxed));
  }
  ///@}

  /// How many times the loop has found nothing to do after its spin and registered to sleep on its
  /// futex since it was made (a post or stop that lands meanwhile ends such a sleep at once).
  [[nodiscard]] std::uint64_t sleeps() const noexcept {
    return sleeps_.load(std::memory_order_relaxed);
  }

  /// Queues `h` to be resumed by the thread running the loop.
  /// Any thread; never throws. Wakes the running thread only if it sleeps, and only the first post to
  /// find it so.
  void post(std::coroutine_handle<> h) noexcept {
    for (;;) {
      bool wake = false;
      bool queued = false;
      {
        std::lock_guard lock(mutex_);
        queued = push(h);
        wake = claim_sleepers();
      }
      if (wake) detail::futex_wake_all(epoch_);
      if (queued) return;
      // The ring is full and cannot grow (see the top of this file).
      const std::thread::id runner = running_.load(std::memory_order_acquire);
      if (runner == std::this_thread::get_id()) {
        if (std::coroutine_handle<> oldest = pop()) oldest.resume();
      } else if (runner != std::thread::id{}) {
        std::this_thread::yield();
      } else {
        std::fprintf(stderr,
                     "ferry: run_loop::post: out of memory, the queue is full and no thread is "
                     "running the loop to make room\n");
        std::abort();
      }
    }
  }

  /// How many handles the queue can hold before it must grow (for tests and monitoring).
  [[nodiscard]] std::size_t capacity() const noexcept {
    std::lock_guard lock(mutex_);
    return capacity_;
  }

  /// Runs posted work until stop(); the stop is consumed, so run() may be called again.
  void run() {
    const running_here running(running_);
    while (run_one()) {
    }
  }

  /// Runs one posted item, sleeping until there is one. Returns false, without running anything, when
  /// stop() ends the wait (the stop is consumed).
  bool run_one() {
    const running_here running(running_);
    for (;;) {
      if (take_stop()) return false;
      if (std::coroutine_handle<> h = pop(); h) {
        h.resume();
        return true;
      }
      wait_for_work();
    }
  }

  /// Runs what is ready now, never sleeping; returns how many items ran.
  std::size_t poll() {
    const running_here running(running_);
    std::size_t ran = 0;
    while (std::coroutine_handle<> h = pop()) {
      h.resume();
      ++ran;
    }
    return ran;
  }

  /// Ends the current run() (or the next, if none is running). Any thread, a signal handler included
  /// (it takes no lock). The stop is one atomic operation on the futex word, and run() cannot return
  /// before it: after it, stop() only names the word's address to the kernel, which reads nothing
  /// there. So the loop may be destroyed as soon as run() returns, even while stop() is still in the
  /// wake (sync_wait's task may finish, and stop its loop, on another thread). Sleepers are not
  /// claimed: their registrations stay counted until the next post claims them (one futex call that
  /// wakes nobody).
  void stop() noexcept {
    epoch_.fetch_or(stop_bit, std::memory_order_release);
    detail::futex_wake_all(epoch_);
  }

  /// How many handles are queued now (for tests and monitoring).
  [[nodiscard]] std::size_t size() const {
    std::lock_guard lock(mutex_);
    return count_;
  }

 private:
  using nanoseconds = std::chrono::nanoseconds;
  struct spins {
    nanoseconds least, most;
  };

  explicit run_loop(spins s)
      : ring_(new std::coroutine_handle<>[first_capacity]),
        capacity_(first_capacity),
        spin_(s.least),
        max_spin_(s.most),
        current_spin_(s.least.count()) {}

  static spins at_least_zero(nanoseconds spin) noexcept {
    const nanoseconds least = std::max(spin, nanoseconds::zero());
    return {least, least};
  }

  static spins checked(nanoseconds spin, nanoseconds max_spin) {
    if (spin < nanoseconds::zero()) {
      throw std::invalid_argument("ferry::run_loop: spin must not be negative");
    }
    if (max_spin < spin) {
      throw std::invalid_argument("ferry::run_loop: max_spin must not be less than spin");
    }
    return {spin, max_spin};
  }

  [[nodiscard]] bool stop_requested(std::memory_order order) const noexcept {
    return (epoch_.load(order) & stop_bit) != 0;
  }

  bool take_stop() noexcept {
    return stop_requested(std::memory_order_acquire) &&
           (epoch_.fetch_and(~stop_bit, std::memory_order_acq_rel) & stop_bit) != 0;
  }

  // Under mutex_. Takes every registered sleeper for one wake, which the caller then makes: the
  // epoch moves on, so a sleeper that has not reached the futex yet will not sleep there. Posts that
  // find nothing to claim rely on that one call, even if its poster is descheduled before making it.
  bool claim_sleepers() noexcept {
    if (sleepers_ == 0) return false;
    sleepers_ = 0;
    epoch_.fetch_add(epoch_step, std::memory_order_relaxed);
    return true;
  }

  // True when work (or a stop) arrived while spinning for `how_long`.
  bool spin_for_work(nanoseconds how_long) const noexcept {
    if (how_long == nanoseconds::zero()) return false;
    // The deadline saturates rather than overflowing for a spin of any length.
    return detail::spin_until(detail::deadline_after(how_long), [this] {
      return queued_.load(std::memory_order_relaxed) != 0 ||
             stop_requested(std::memory_order_relaxed);
    });
  }

  // The epoch is read first: a stop() (which takes no lock) that lands after this read moves it, and
  // one that landed before is seen in its bit. A post cannot slip in unseen either: it queues under
  // mutex_, where this thread looks at the queue, and claims under it too.
  void wait_for_work() {
    const nanoseconds spin(current_spin_.load(std::memory_order_relaxed));
    const auto idle_from = detail::clock::now();
    if (spin_for_work(spin)) return;
    const std::uint32_t epoch = epoch_.load(std::memory_order_acquire);
    {
      std::lock_guard lock(mutex_);
      if (count_ != 0 || (epoch & stop_bit) != 0) return;
      ++sleepers_;
    }
    sleeps_.fetch_add(1, std::memory_order_relaxed);
    detail::futex_wait(epoch_, epoch);
    // Measured from the moment the loop went idle, not from the futex call: a thread the kernel
    // preempted after registering finds the post that claimed it at once, and its sleep would have
    // seemed to end at once, doubling the spin of a loop whose work comes 20 ms apart (CI's clang
    // pass saw that).
    const nanoseconds idle = detail::clock::now() - idle_from;
    adapt(spin, std::max(idle - spin, nanoseconds::zero()));
    std::lock_guard lock(mutex_);
    // Unchanged epoch: nothing claimed this registration or stopped (the futex returned on a signal).
    // Changed: a post claimed it, or a stop() or a claim made before it registered moved the epoch;
    // the count then stays high, which costs the next post one futex call and nothing else.
    if (epoch_.load(std::memory_order_relaxed) == epoch) --sleepers_;
  }

  // After a sleep that followed a spin of `spin` (see the top of this file).
  void adapt(nanoseconds spin, nanoseconds slept) noexcept {
    current_spin_.store(detail::adapted_spin(spin, slept, spin_, max_spin_).count(),
                        std::memory_order_relaxed);
  }

  // A growable ring: no allocation once it has reached its working size. Under mutex_; false when it
  // is full and cannot grow (no memory).
  bool push(std::coroutine_handle<> h) noexcept {
    if (count_ == capacity_ && !grow()) return false;
    ring_[(head_ + count_) & (capacity_ - 1)] = h;
    ++count_;
    queued_.store(count_, std::memory_order_relaxed);
    return true;
  }

  std::coroutine_handle<> pop() noexcept {
    std::lock_guard lock(mutex_);
    if (count_ == 0) return {};
    std::coroutine_handle<> h = ring_[head_];
    head_ = (head_ + 1) & (capacity_ - 1);
    --count_;
    queued_.store(count_, std::memory_order_relaxed);
    return h;
  }

  // Marks the calling thread as the one running the loop while it is inside run, run_one or poll
  // (nested calls find it marked already). One relaxed load per call on the common path: only the
  // owning thread runs a loop, so nothing races these writes; posters read them only when the ring
  // cannot grow.
  class running_here {
   public:
    explicit running_here(std::atomic<std::thread::id>& running) noexcept
        : running_(running), me_(std::this_thread::get_id()),
          before_(running.load(std::memory_order_relaxed)) {
      if (before_ != me_) running_.store(me_, std::memory_order_release);
    }
    ~running_here() {
      if (before_ != me_) running_.store(before_, std::memory_order_release);
    }
    running_here(const running_here&) = delete;
    running_here& operator=(const running_here&) = delete;

   private:
    std::atomic<std::thread::id>& running_;
    std::thread::id me_;
    std::thread::id before_;
  };

  bool grow() noexcept {
    const std::size_t bigger = capacity_ * 2;
    std::unique_ptr<std::coroutine_handle<>[]> ring(
        new (std::nothrow) std::coroutine_handle<>[bigger]);
    if (ring == nullptr) return false;
    for (std::size_t i = 0; i < count_; ++i) ring[i] = ring_[(head_ + i) & (capacity_ - 1)];
    ring_ = std::move(ring);
    capacity_ = bigger;
    head_ = 0;
    return true;
  }

  static constexpr std::size_t first_capacity = 64;  // a power of two, as every later size

  mutable detail::short_hold_mutex mutex_;
  // The thread inside run, run_one or poll, if any: a post from it may run queued work.
  std::atomic<std::thread::id> running_{};
  std::unique_ptr<std::coroutine_handle<>[]> ring_;
  std::size_t capacity_ = 0;
  std::size_t head_ = 0;
  std::size_t count_ = 0;
  // count_ mirrored for the idle spin, which looks without the lock (a hint: pop() decides).
  std::atomic<std::size_t> queued_{0};
  nanoseconds spin_ = default_spin;
  nanoseconds max_spin_ = default_max_spin;
  // The spin an idle loop makes now, between spin_ and max_spin_. Atomic only so that current_spin()
  // may be read from any thread: the running thread alone writes it.
  std::atomic<nanoseconds::rep> current_spin_{default_spin.count()};
  std::atomic<std::uint64_t> sleeps_{0};
  // Under mutex_: at least the number of sleepers no post has claimed yet (stop() leaves it high;
  // 64 bits, so that no number of stops between two posts can wrap it to zero).
  std::uint64_t sleepers_ = 0;
  // The futex word: a count moved by every claim, and below it the stop bit, so that a stop also
  // moves the word (waking a sleeper) in the same single operation.
  static constexpr std::uint32_t stop_bit = 1;
  static constexpr std::uint32_t epoch_step = 2;
  std::atomic<std::uint32_t> epoch_{0};
};

}  // namespace ferry

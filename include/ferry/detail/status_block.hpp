#pragma once
// The shared status behind every transfer handle and completer.
//
// One 32-bit word holds the state (2 bits), a spin lock bit and a "a thread sleeps on me" bit, so that
// state() is a single acquire load, and so that a blocked thread can futex-wait on the very word a
// completion changes. The lock serialises the waiter list against completion: a waiter is either
// linked before the state turns terminal (and is then notified) or finds the state terminal (and is
// not linked). Notification runs after the lock is released, so a continuation resumed inline may
// touch this status again without deadlocking.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <system_error>

#include <sched.h>

#include "ferry/detail/block_pool.hpp"
#include "ferry/detail/futex.hpp"
#include "ferry/detail/spin.hpp"
#include "ferry/errors.hpp"
#include "ferry/transfer_state.hpp"

namespace ferry::detail {

// How long blocking waits on this thread spin before they sleep, beyond the brief look every wait
// takes (look_before_sleep): not at all unless the thread opts in with ferry::set_wait_spin_limit;
// then from none, adapted between zero and `limit` by adapted_spin, and halved by a wait that times
// out (ferry::this_thread_wait_spin reads it). Not for signal handlers, as no thread_local is.
struct wait_spin_state {
  // None: a spinning waiter takes its CPU from whatever shares it, the model beside an engine thread,
  // or the completing thread when the scheduler wakes that onto it (ferry::set_wait_spin_limit says
  // what that costs).
  static constexpr std::chrono::nanoseconds default_limit{0};
  std::chrono::nanoseconds limit = default_limit;
  std::chrono::nanoseconds current{0};
  std::uint64_t sleeps = 0;  // waits that went on to the futex after their spin
};

// Out of line, so that a coroutine that blocks in wait() on one thread, suspends, and blocks again
// on another cannot be compiled to reuse the first thread's address for the second.
[[gnu::noinline]] inline wait_spin_state& this_thread_wait_spin() noexcept {
  thread_local wait_spin_state state;
  return state;
}

// What a waiter learns when the status it waits on ends. state == pending means the waiter was
// swept off the list without a completion because its wait had already ended (see expired()).
struct completion_event {
  transfer_state state = transfer_state::pending;
  std::error_code error;
  std::uint64_t sequence = 0;
};

// An intrusive node in a status's waiter list. Owners: a coroutine awaiting one transfer, or one
// member of a batch join. `linked` is guarded by the status lock.
struct waiter {
  using notify_fn = void (*)(waiter*, const completion_event&) noexcept;
  using expired_fn = bool (*)(const waiter*) noexcept;

  waiter* next = nullptr;
  waiter* prev = nullptr;
  notify_fn notify = nullptr;
  expired_fn expired = nullptr;  // null: never swept
  std::uint32_t index = 0;       // the owner's own use (a batch member's position)
  bool linked = false;
};

// "First failure in time" is decided by `sequence`. Successes take no number: no verdict depends on
// the order of successes, and skipping them keeps the success path free of a shared counter. A
// failing completion takes its number while it holds its status's lock, and publishes before it
// lets go (see complete()), which is what a batch wait relies on to name the first failure.
struct alignas(64) failure_clock {
  std::atomic<std::uint64_t> sequence{0};
};
inline failure_clock failures;

// Tests only: called by a failing completion after it has taken its number and before it publishes
// its state, so that a test can hold a completer there (as if preempted). Null unless a test sets
// it: one predictable branch on the failure path.
inline std::atomic<void (*)() noexcept> after_failure_numbered{nullptr};

class alignas(64) status_block {
 public:
  static constexpr std::uint32_t state_mask = 0x3;
  static constexpr std::uint32_t lock_bit = 0x4;
  static constexpr std::uint32_t sleepers_bit = 0x8;

  using pool = block_pool<status_block>;

  // A new pending status with one transfer reference and one completer reference.
  [[nodiscard]] static status_block* make() {
    status_block* s = pool::acquire();
    s->word_.store(0, std::memory_order_relaxed);
    s->completers_.store(1, std::memory_order_relaxed);
    s->refs_.store(2, std::memory_order_relaxed);  // one transfer handle + the completer group
    s->sequence_ = 0;
    s->error_ = {};
    s->head_ = nullptr;
    s->tail_ = nullptr;
    return s;
  }

  [[nodiscard]] transfer_state state() const noexcept {
    // Pairs with the release in complete(): a terminal state carries error_ and sequence_.
    return static_cast<transfer_state>(word_.load(std::memory_order_acquire) & state_mask);
  }

  // Valid only once state() returned a terminal state.
  [[nodiscard]] completion_event event() const noexcept { return {state(), error_, sequence_}; }

  [[nodiscard]] std::error_code error() const noexcept {
    return state() == transfer_state::pending ? std::error_code{} : error_;
  }

  // The first terminal call wins; later ones return false and change nothing.
  //
  // Waiters are handed out one at a time, each taken off the list under the lock and notified
  // outside it. So a waiter's owner can always take its node off with remove_waiter (it is either
  // still linked, or its notification has started), and a continuation resumed inline may touch
  // this status, or remove another waiter, without deadlocking.
  bool complete(transfer_state to, std::error_code ec) noexcept {
    if (!lock_pending()) return false;
    const bool failure = to != transfer_state::success;
    if (failure) {
      if (!ec) ec = make_error_code(to == transfer_state::cancelled ? errc::cancelled
                                                                    : errc::unspecified_failure);
      // Taken under the lock, with acq_rel: whoever sees a later number also sees this status
      // locked, until it has published (batch_join::settle waits for that).
      sequence_ = failures.sequence.fetch_add(1, std::memory_order_acq_rel) + 1;
      if (auto* hook = after_failure_numbered.load(std::memory_order_relaxed); hook != nullptr) hook();
    } else {
      ec = {};
    }
    error_ = ec;
    const completion_event ev{to, ec, sequence_};
    const auto state_bits = static_cast<std::uint32_t>(to);

    waiter* w = head_;
    if (w == nullptr || w->next == nullptr) {
      // No waiter or one: take it, then publish and unlock in one RMW. The state bits are zero and
      // the lock bit is set, so XOR sets the one and clears the other, keeping a sleepers bit that
      // wait() may have set meanwhile. Release pairs with the acquire in state(): a terminal state
      // carries error_ and sequence_.
      if (w != nullptr) take(w);
      const std::uint32_t before = word_.fetch_xor(lock_bit | state_bits, std::memory_order_release);
      if ((before & sleepers_bit) != 0) futex_wake_all(word_);
      if (w != nullptr) w->notify(w, ev);
    } else {
      // Several: publish while still locked (nothing can link any more), then hand them out.
      const std::uint32_t before = word_.fetch_or(state_bits, std::memory_order_release);
      take(w);
      unlock();
      if ((before & sleepers_bit) != 0) futex_wake_all(word_);
      for (;;) {
        // A notified owner may free its node at once: nothing touches `w` after notify.
        w->notify(w, ev);
        lock();
        w = head_;
        if (w == nullptr) break;
        take(w);
        unlock();
      }
      unlock();
    }
    return true;
  }

  // Returns once no terminal call is under way: the status is terminal, or its lock is free (a lock
  // held by waiter-list changes is held for moments). A completer may have been preempted holding
  // it, perhaps on this very CPU: after a short spin this yields, so that the holder can run.
  void wait_for_completion_under_way() const noexcept {
    for (unsigned looks = 0;; ++looks) {
      const std::uint32_t v = word_.load(std::memory_order_acquire);
      if ((v & state_mask) != 0 || (v & lock_bit) == 0) return;
      if (looks < 256) {
        cpu_relax();
      } else {
        ::sched_yield();
      }
    }
  }

  // Links `w` unless the status is already terminal (returns false: nothing was linked).
  [[nodiscard]] bool add_waiter(waiter* w) noexcept { return link(w, false); }

  // As add_waiter, and a linked `w` also holds a transfer reference on this status, so that the
  // node's owner can take it off later (remove_waiter) without holding the transfer itself; whoever
  // ends up with the node gives the reference back with release_transfer_ref().
  [[nodiscard]] bool add_holding_waiter(waiter* w) noexcept { return link(w, true); }

  // Takes `w` off the list if it is still there: true means it will never be notified; false
  // means its notification has started (it has run, or is running on the completing thread).
  bool remove_waiter(waiter* w) noexcept {
    lock();
    const bool was_linked = w->linked;
    if (was_linked) unlink(w);
    unlock();
    return was_linked;
  }

  // Blocks until terminal or until `deadline` passes (null: no deadline). Returns the state seen.
  transfer_state wait(const clock::time_point* deadline) noexcept {
    // A brief look first: a completion already landing is met without a futex round trip, for less
    // CPU than that round trip costs the sleeper.
    if (look_before_sleep([this] { return state() != transfer_state::pending; })) return state();
    // Then, on a thread that opted in, its adaptive spin, which its recent waits have grown if they
    // kept ending soon after it slept (a stream of reads completing in bursts a few hundred
    // microseconds apart). Under the default limit it stays at none.
    wait_spin_state& spin = this_thread_wait_spin();
    const std::chrono::nanoseconds spun = spin.current;
    // The sleep is timed from the moment the spin was due to end, not from when this thread got
    // past it: a waiter the kernel held off the CPU meanwhile was idle all that time, and a sleep
    // timed from later would seem to end at once and double the spin of a stream that is slow.
    clock::time_point slept_from{};
    if (spun > std::chrono::nanoseconds::zero()) {
      clock::time_point until = clock::now() + spun;  // spun <= limit <= 1 s: no overflow
      const bool deadline_first = deadline != nullptr && *deadline < until;
      if (deadline_first) until = *deadline;
      if (spin_until(until, [this] { return state() != transfer_state::pending; })) return state();
      if (deadline_first) return timed_out(spin, spun);
      slept_from = until;
    } else {
      slept_from = clock::now();
    }
    ++spin.sleeps;
    std::uint32_t v = word_.load(std::memory_order_acquire);
    while ((v & state_mask) == 0) {
      if ((v & sleepers_bit) == 0) {
        // Once set, the completer's unlock sees the bit (both are RMWs on this word) and wakes us.
        if (!word_.compare_exchange_weak(v, v | sleepers_bit, std::memory_order_acquire,
                                         std::memory_order_acquire)) {
          continue;
        }
        v |= sleepers_bit;
      }
      if (!futex_wait(word_, v, deadline)) return timed_out(spin, spun);
      v = word_.load(std::memory_order_acquire);
    }
    // min(): a limit lowered meanwhile (set_wait_spin_limit is not for signal handlers, but costs
    // nothing to respect) must not break adapted_spin's spin <= limit, which keeps the result within.
    spin.current = adapted_spin(std::min(spun, spin.limit), clock::now() - slept_from,
                                std::chrono::nanoseconds::zero(), spin.limit);
    return static_cast<transfer_state>(v & state_mask);
  }

  // A wait that reached its deadline: spinning did not meet the completion, so the next wait on this
  // thread spins half as long (a loop of short timed waits does not keep a long spin going).
  transfer_state timed_out(wait_spin_state& spin, std::chrono::nanoseconds spun) noexcept {
    spin.current = std::min(spun / 2, spin.limit);
    return state();
  }

  void add_transfer_ref() noexcept { refs_.fetch_add(1, std::memory_order_relaxed); }

  void release_transfer_ref() noexcept { release(); }

  // Diagnostics, for tests and leak hunts: the references held (transfer handles, one for the
  // completers while any exists, one per linked holding waiter) and the waiters linked now.
  [[nodiscard]] std::uint32_t references() const noexcept {
    return refs_.load(std::memory_order_acquire);
  }
  [[nodiscard]] std::size_t linked_waiters() noexcept {
    if (!lock_pending()) return 0;
    std::size_t n = 0;
    for (const waiter* w = head_; w != nullptr; w = w->next) ++n;
    unlock();
    return n;
  }

  void add_completer_ref() noexcept { completers_.fetch_add(1, std::memory_order_relaxed); }

  // The last completer to go fails a pending transfer as abandoned, so that no transfer can stay
  // pending because the side that should complete it forgot it.
  void release_completer_ref() noexcept {
    if (completers_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      complete(transfer_state::failed, make_error_code(errc::abandoned));
      release();
    }
  }

 private:
  friend class block_pool<status_block>;

  // Takes the lock if the status is still pending; false (not locked) once it is terminal. The
  // common case, pending with nobody asleep, is one CAS.
  bool lock_pending() noexcept {
    std::uint32_t v = 0;
    if (word_.compare_exchange_strong(v, lock_bit, std::memory_order_acquire,
                                      std::memory_order_relaxed)) {
      return true;
    }
    for (;;) {
      // Terminal: callers that go on to read the result do so through state(), an acquire load.
      if ((v & state_mask) != 0) return false;
      if ((v & lock_bit) == 0 &&
          word_.compare_exchange_weak(v, v | lock_bit, std::memory_order_acquire,
                                      std::memory_order_relaxed)) {
        return true;
      }
      if ((v & lock_bit) != 0) {
        cpu_relax();
        v = word_.load(std::memory_order_relaxed);
      }
    }
  }

  // A held reference is taken under the lock, so it exists exactly when `w` was linked.
  bool link(waiter* w, bool hold) noexcept {
    if (!lock_pending()) return false;
    if (hold) refs_.fetch_add(1, std::memory_order_relaxed);
    waiter* swept = sweep_expired();
    w->next = nullptr;
    w->prev = tail_;
    if (tail_ != nullptr) {
      tail_->next = w;
    } else {
      head_ = w;
    }
    tail_ = w;
    w->linked = true;
    unlock();
    notify_swept(swept);
    return true;
  }

  void lock() noexcept {
    std::uint32_t v = word_.load(std::memory_order_relaxed);
    for (;;) {
      if ((v & lock_bit) == 0 &&
          word_.compare_exchange_weak(v, v | lock_bit, std::memory_order_acquire,
                                      std::memory_order_relaxed)) {
        return;
      }
      cpu_relax();
      v = word_.load(std::memory_order_relaxed);
    }
  }

  void unlock() noexcept { word_.fetch_and(~lock_bit, std::memory_order_release); }

  void unlink(waiter* w) noexcept {
    if (w->prev != nullptr) {
      w->prev->next = w->next;
    } else {
      head_ = w->next;
    }
    if (w->next != nullptr) {
      w->next->prev = w->prev;
    } else {
      tail_ = w->prev;
    }
    w->next = w->prev = nullptr;
    w->linked = false;
  }

  // Under the lock: the head waiter leaves the list to be notified.
  void take(waiter* w) noexcept {
    head_ = w->next;
    if (head_ != nullptr) {
      head_->prev = nullptr;
    } else {
      tail_ = nullptr;
    }
    w->next = w->prev = nullptr;
    w->linked = false;
  }

  // Looks at up to three waiters from the head: an expired one is taken off, a live one is moved to
  // the tail, so the look walks round the whole list over successive registrations. A caller that
  // waits on a transfer that never ends, again and again with a timeout, therefore cannot grow the
  // list without bound, even behind waiters that stay: each registration adds one node and, once
  // dead nodes are common, removes more than one.
  waiter* sweep_expired() noexcept {
    waiter* swept = nullptr;
    for (int i = 0; i < 3 && head_ != nullptr; ++i) {
      waiter* w = head_;
      if (w->expired != nullptr && w->expired(w)) {
        unlink(w);
        w->next = swept;
        swept = w;
      } else if (w != tail_) {
        unlink(w);
        w->prev = tail_;
        tail_->next = w;
        tail_ = w;
        w->linked = true;
      }
    }
    return swept;
  }

  static void notify_swept(waiter* swept) noexcept {
    while (swept != nullptr) {
      waiter* next = swept->next;
      swept->notify(swept, completion_event{});
      swept = next;
    }
  }

  void release() noexcept {
    if (refs_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      // Every completer is gone, so the status is terminal and its waiter list is empty.
      pool::release(this);
    }
  }

  std::atomic<std::uint32_t> word_{0};
  std::atomic<std::uint32_t> completers_{0};
  std::atomic<std::uint32_t> refs_{0};  // transfer handles, plus one while any completer exists
  std::uint64_t sequence_ = 0;
  std::error_code error_;
  waiter* head_ = nullptr;
  waiter* tail_ = nullptr;
  status_block* pool_next_ = nullptr;  // the pool's free-list link, never poisoned

 public:
  // The pool may poison everything before pool_next_.
  static constexpr std::size_t poisonable_bytes = 56;
};

static_assert(sizeof(status_block) == 64, "a status block is one cache line");

}  // namespace ferry::detail

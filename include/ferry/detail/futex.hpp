#pragma once
// The two futex operations ferry sleeps on. std::atomic::wait has no timed form, and every bounded
// wait in ferry needs one, so blocked threads sleep here. Sleeping is only an optimisation: every
// caller re-checks its atomic after waking, and all synchronisation is through the atomics.

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdint>
#include <ctime>

#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace ferry::detail {

using clock = std::chrono::steady_clock;

static_assert(sizeof(std::atomic<std::uint32_t>) == sizeof(std::uint32_t));

// Sleeps while *word == expected, until woken or `deadline` (steady clock, absolute) passes.
// Returns false only when the deadline passed.
inline bool futex_wait(std::atomic<std::uint32_t>& word, std::uint32_t expected,
                       const clock::time_point* deadline = nullptr) noexcept {
  timespec ts{};
  timespec* tsp = nullptr;
  if (deadline != nullptr) {
    // steady_clock is CLOCK_MONOTONIC, the clock FUTEX_WAIT_BITSET measures absolute time on.
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                        deadline->time_since_epoch())
                        .count();
    if (ns <= 0) return false;
    ts.tv_sec = static_cast<time_t>(ns / 1'000'000'000);
    ts.tv_nsec = static_cast<long>(ns % 1'000'000'000);
    tsp = &ts;
  }
  const long rc = ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word),
                            FUTEX_WAIT_BITSET_PRIVATE, expected, tsp, nullptr,
                            FUTEX_BITSET_MATCH_ANY);
  return !(rc == -1 && errno == ETIMEDOUT);
}

inline void futex_wake_all(std::atomic<std::uint32_t>& word) noexcept {
  ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word), FUTEX_WAKE_PRIVATE, INT_MAX,
            nullptr, nullptr, 0);
}

#if defined(__SANITIZE_THREAD__)
#define FERRY_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define FERRY_TSAN 1
#endif
#endif

// A full two-way barrier for the Dekker handshakes (a submitter's "queue, then look at the sleeper
// flag" against a sleeper's "set the flag, then look at the queue"). ThreadSanitizer rejects
// atomic_thread_fence, so its builds use a locked RMW on a private atomic, which orders the same way
// on every architecture ferry runs on.
inline void full_barrier() noexcept {
#if defined(FERRY_TSAN)
  static std::atomic<std::uint32_t> barrier_word{0};
  barrier_word.fetch_add(0, std::memory_order_seq_cst);
#else
  std::atomic_thread_fence(std::memory_order_seq_cst);
#endif
}

inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// Paces an idle spin that may last long (the executor's spin budget, run_loop's spin): each step
// pauses, and every `offer_every` it offers the CPU to any other thread that is ready to run on it.
// A thread woken onto the CPU of a spinning one (the kernel places a wakee beside its waker when it
// can) otherwise waits for the spin to end. On a two-vCPU machine that happened in nearly every
// burst of disk reads: the engine thread, woken by the executor, sat behind the executor's spin, and
// the executor behind the engine thread's (the io_uring benchmark at depth 32: 0.80x-0.81x of fio
// with a plain spin, 0.94x-0.97x with this). With nothing else ready, sched_yield returns at once
// (about 0.7 us there), so it is paced rather than made every step: at every step, the
// executor-thread runner at depth 1 lost a tenth of its rate.
class idle_spin {
 public:
  static constexpr std::chrono::nanoseconds offer_every = std::chrono::microseconds(5);

  void step(clock::time_point now) noexcept {
    if (now - offered_ >= offer_every) {
      ::sched_yield();
      offered_ = now;
    } else {
      cpu_relax();
    }
  }

 private:
  clock::time_point offered_{};
};

// Looks at `ready` until it says yes (true) or `until` passes (false), pacing the looks with
// idle_spin. Reading the clock costs more than a look at an atomic: it looks 32 times between
// readings.
template <class Ready>
bool spin_until(clock::time_point until, Ready ready) noexcept {
  idle_spin spin;
  for (;;) {
    for (int i = 0; i < 32; ++i) {
      if (ready()) return true;
      cpu_relax();
    }
    const auto now = clock::now();
    if (now >= until) return false;
    spin.step(now);
  }
}

// An idle spin that adapts as KVM's halt polling does: after a spin of `spin` that ended in a sleep
// of `slept`, the next is doubled (from at least 1 µs, up to `most`) if the sleep ended within
// `most` of the moment the spin began, so that a spin that long would have met the wake-up; halved
// (down to `least`) if the sleep outlasted `most`; otherwise the same. Needs least <= spin <= most.
inline std::chrono::nanoseconds adapted_spin(std::chrono::nanoseconds spin,
                                             std::chrono::nanoseconds slept,
                                             std::chrono::nanoseconds least,
                                             std::chrono::nanoseconds most) noexcept {
  using std::chrono::nanoseconds;
  constexpr nanoseconds first_step = std::chrono::microseconds(1);  // growing from a zero spin
  if (slept <= most - spin) {  // spin + slept <= most, without overflowing
    const nanoseconds doubled = spin <= most / 2 ? std::max(spin * 2, first_step) : most;
    return std::min(doubled, most);
  }
  if (slept > most) return std::max(spin / 2, least);
  return spin;
}

}  // namespace ferry::detail

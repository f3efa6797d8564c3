#pragma once
// The spin policy: how ferry's idle spins pause and pace themselves, how long a blocking wait looks
// before it sleeps, and how a spin before a sleep adapts to the gaps it sees (the progress executor,
// run_loop and blocking waits all use it).

#include <algorithm>
#include <chrono>

#include <sched.h>

#include "ferry/detail/futex.hpp"

namespace ferry::detail {

inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// Paces an idle spin that may last long (the executor's spin budget, run_loop's spin): each step
// pauses the core, and once per idle period, a few microseconds into it, the spinner offers its CPU
// (sched_yield) to any thread ready to run there.
//
// Why once. A thread woken onto a spinning thread's CPU (the kernel places a wakee beside its
// waker when it can) otherwise waits for the spin to end, up to its budget: with a client and a
// server process on a 2-vCPU VM, four threads spinning idle, an adaptive TCP round trip took
// 421 us on average with no yield, 47 us yielding every 5 us, 77 us yielding once. But under
// Linux's EEVDF scheduler (6.6 on) every sched_yield pushes the spinner's virtual deadline back by
// a whole slice: a spinner that yielded every 5 us soon had a later deadline than any runnable
// task, a nice-19 build job included, which then kept the CPU until the next tick (posts 50 us
// apart to a run_loop beside four nice-19 hogs per CPU: 2.05 ms late on average, p50 3.5 ms;
// 80-110 us yielding once, 100-250 us with no yield). One yield per idle period pushes the
// deadline one slice: behind the spinner's equals, which then run, and not behind a niced task,
// whose deadline lies tens of slices out. The deadline is set afresh whenever the thread sleeps or
// uses up its slice.
class idle_spin {
 public:
  static constexpr std::chrono::nanoseconds offer_after = std::chrono::microseconds(5);

  // A new idle period begins (after work was found, or after a sleep).
  void restart() noexcept { started_ = false; }

  void step(clock::time_point now) noexcept {
    if (!started_) {
      started_ = true;
      offered_ = false;
      since_ = now;
    } else if (!offered_ && now - since_ >= offer_after) {
      offered_ = true;
      ::sched_yield();
      return;
    }
    cpu_relax();
  }

 private:
  clock::time_point since_{};
  bool started_ = false;
  bool offered_ = false;
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

// How long a blocking wait looks before it sleeps, whatever else its thread spins: less than a futex
// sleep and wake-up cost the sleeper in CPU (system calls and two context switches: 2 us and more on
// the VM of bench/RESULTS.md), so that a wait that sleeps anyway spends at most that much more than
// sleeping at once, and one whose completion is already landing meets it without the round trip.
// Bounded in time rather than in pauses: a pause lasts from about 10 to about 140 cycles, depending on
// the x86 generation (256 take 4 us on that VM).
inline constexpr std::chrono::nanoseconds look_before_sleep_for = std::chrono::microseconds(1);

// Looks at `ready` for up to look_before_sleep_for: true as soon as it says yes. Reads the clock every
// eight looks.
template <class Ready>
bool look_before_sleep(Ready ready) noexcept {
  if (ready()) return true;
  const clock::time_point until = clock::now() + look_before_sleep_for;
  do {
    for (int i = 0; i < 8; ++i) {
      cpu_relax();
      if (ready()) return true;
    }
  } while (clock::now() < until);
  return false;
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

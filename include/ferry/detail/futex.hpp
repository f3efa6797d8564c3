#pragma once
// The two futex operations ferry sleeps on. std::atomic::wait has no timed form, and every bounded
// wait in ferry needs one, so blocked threads sleep here. Sleeping is only an optimisation: every
// caller re-checks its atomic after waking, and all synchronisation is through the atomics.

#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdint>
#include <ctime>

#include <linux/futex.h>
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

}  // namespace ferry::detail

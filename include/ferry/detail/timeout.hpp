#pragma once
// One reading of every timeout argument in ferry: negative waits forever, zero looks once, positive
// waits up to that long. A positive timeout is rounded up, never down to a look, and saturates
// instead of overflowing when it is too long to add to the clock.

#include <chrono>
#include <cstdint>

#include "ferry/detail/futex.hpp"

namespace ferry::detail {

struct timeout {
  enum class kind : std::uint8_t { forever, look, bounded };
  kind how = kind::forever;
  std::chrono::nanoseconds length{};

  // The deadline of a bounded wait that starts now.
  [[nodiscard]] clock::time_point deadline() const noexcept { return clock::now() + length; }

  [[nodiscard]] bool is_forever() const noexcept { return how == kind::forever; }
  [[nodiscard]] bool is_look() const noexcept { return how == kind::look; }
  [[nodiscard]] bool is_bounded() const noexcept { return how == kind::bounded; }
};

// About 73 years: far enough to mean "no deadline" and small enough that now() + it cannot overflow.
inline constexpr std::chrono::nanoseconds longest_timeout{std::int64_t{1} << 61};

template <class Rep, class Period>
[[nodiscard]] timeout make_timeout(std::chrono::duration<Rep, Period> d) noexcept {
  using std::chrono::duration;
  if (d < d.zero()) return {timeout::kind::forever, {}};
  if (d == d.zero()) return {timeout::kind::look, {}};
  // Compare in long double so that days::max() or a huge double cannot overflow the conversion.
  const duration<long double, std::nano> as_ns{d};
  std::chrono::nanoseconds ns = longest_timeout;
  if (as_ns.count() < static_cast<long double>(longest_timeout.count())) {
    ns = std::chrono::ceil<std::chrono::nanoseconds>(as_ns);
    if (ns <= ns.zero()) ns = std::chrono::nanoseconds{1};
  }
  return {timeout::kind::bounded, ns};
}

// The deadline of a wait of `d` that starts now, read as above: negative never comes (the clock's
// end), zero is now, and a long one saturates rather than overflowing into the past.
template <class Rep, class Period>
[[nodiscard]] clock::time_point deadline_after(std::chrono::duration<Rep, Period> d) noexcept {
  const timeout t = make_timeout(d);
  if (t.is_forever()) return clock::time_point::max();
  if (t.is_look()) return clock::now();
  return t.deadline();
}

}  // namespace ferry::detail

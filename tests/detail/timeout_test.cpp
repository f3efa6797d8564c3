// detail/timeout.hpp: one reading of every timeout argument.

#include <catch2/catch.hpp>

#include <chrono>

#include <ferry/detail/timeout.hpp>

using clock_type = ferry::detail::clock;
using ferry::detail::deadline_after;
using ferry::detail::longest_timeout;
using ferry::detail::make_timeout;
using namespace std::chrono_literals;

TEST_CASE("make_timeout: negative waits forever, zero looks once, positive waits, rounded up",
          "[detail]") {
  CHECK(make_timeout(-1ms).is_forever());
  CHECK(make_timeout(std::chrono::hours::min()).is_forever());
  CHECK(make_timeout(0s).is_look());
  CHECK(make_timeout(std::chrono::duration<double>(0.0)).is_look());
  const auto five = make_timeout(5ms);
  CHECK(five.is_bounded());
  CHECK(five.length == 5ms);
  // Rounded up, never down to a look.
  CHECK(make_timeout(std::chrono::duration<double, std::nano>(0.25)).length == 1ns);
  CHECK(make_timeout(std::chrono::duration<double, std::micro>(1.0005)).length == 1001ns);
  // Saturates at longest_timeout instead of overflowing.
  CHECK(make_timeout(std::chrono::hours::max()).length == longest_timeout);
  CHECK(make_timeout(std::chrono::duration<double>(1e300)).length == longest_timeout);
}

TEST_CASE("deadline_after: forever is the clock's end, zero is now, a long one does not wrap",
          "[detail]") {
  CHECK(deadline_after(-1s) == clock_type::time_point::max());
  const auto before = clock_type::now();
  const auto now = deadline_after(0s);
  CHECK(now >= before);
  CHECK(now <= clock_type::now());
  CHECK(deadline_after(1s) > before + 999ms);
  CHECK(deadline_after(std::chrono::hours::max()) > clock_type::now() + std::chrono::hours(24 * 365));
}

// detail/spin.hpp: spin_until, look_before_sleep and adapted_spin's rule.

#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <thread>

#include <ferry/detail/spin.hpp>

using ferry::detail::adapted_spin;
using clock_type = ferry::detail::clock;
using std::chrono::nanoseconds;
using namespace std::chrono_literals;

TEST_CASE("spin_until: true as soon as ready, false only once the time has passed", "[detail]") {
  int looks = 0;
  CHECK(ferry::detail::spin_until(clock_type::now() + 10s, [&] { return ++looks == 100; }));
  CHECK(looks == 100);

  const auto until = clock_type::now() + 5ms;
  CHECK_FALSE(ferry::detail::spin_until(until, [] { return false; }));
  CHECK(clock_type::now() >= until);

  // A time already past still gets its looks.
  looks = 0;
  CHECK(ferry::detail::spin_until(clock_type::now() - 1s, [&] { return ++looks == 3; }));
}

TEST_CASE("spin_until sees a flag another thread sets", "[detail][concurrency]") {
  for (int round = 0; round < 200; ++round) {
    std::atomic<bool> flag{false};
    std::thread setter([&] { flag.store(true, std::memory_order_release); });
    const bool seen = ferry::detail::spin_until(
        clock_type::now() + 10s, [&] { return flag.load(std::memory_order_acquire); });
    setter.join();
    REQUIRE(seen);
  }
}

TEST_CASE("look_before_sleep: true as soon as ready, false only once its time has passed",
          "[detail]") {
  int looks = 0;
  CHECK(ferry::detail::look_before_sleep([&] { return ++looks == 1; }));
  CHECK(looks == 1);
  looks = 0;
  CHECK(ferry::detail::look_before_sleep([&] { return ++looks == 5; }));
  CHECK(looks == 5);

  const auto from = clock_type::now();
  looks = 0;
  CHECK_FALSE(ferry::detail::look_before_sleep([&] {
    ++looks;
    return false;
  }));
  CHECK(clock_type::now() - from >= ferry::detail::look_before_sleep_for);
  CHECK(looks > 8);  // the first look, then at least one round of eight before the clock is read
}

TEST_CASE("adapted_spin: doubles when a spin that long would have met the wake, halves when the "
          "sleep outlasted the most, else stays",
          "[detail]") {
  const nanoseconds least = 2us, most = 100us;
  // A sleep that ended within `most` of the spin's start: double, from at least 1 us, up to most.
  CHECK(adapted_spin(0ns, 0ns, 0ns, most) == 1us);
  CHECK(adapted_spin(10us, 5us, least, most) == 20us);
  CHECK(adapted_spin(10us, most - 10us, least, most) == 20us);  // exactly at the bound
  CHECK(adapted_spin(60us, 10us, least, most) == most);          // capped
  CHECK(adapted_spin(most, 0ns, least, most) == most);
  // Between: the same.
  CHECK(adapted_spin(10us, most - 10us + 1ns, least, most) == 10us);
  CHECK(adapted_spin(10us, most, least, most) == 10us);
  // Longer than most: halve, down to least.
  CHECK(adapted_spin(10us, most + 1ns, least, most) == 5us);
  CHECK(adapted_spin(3us, 1s, least, most) == least);
  CHECK(adapted_spin(0ns, 1s, 0ns, most) == 0ns);
  // No overflow at the ends of the range.
  CHECK(adapted_spin(nanoseconds::max(), nanoseconds::max(), 0ns, nanoseconds::max()) ==
        nanoseconds::max());
  CHECK(adapted_spin(nanoseconds::max() / 2 + 1ns, 0ns, 0ns, nanoseconds::max()) ==
        nanoseconds::max());
}

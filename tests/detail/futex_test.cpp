// detail::futex_wait and futex_wake_all: timed sleeps on a 32-bit word.

#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>

#include <ferry/detail/futex.hpp>

using clock_type = ferry::detail::clock;
using ferry::detail::futex_wait;
using ferry::detail::futex_wake_all;
using namespace std::chrono_literals;

TEST_CASE("futex_wait: a word that already differs returns at once, as a wake", "[detail]") {
  std::atomic<std::uint32_t> word{1};
  const auto deadline = clock_type::now() + 10s;
  CHECK(futex_wait(word, 0, &deadline));
  CHECK(clock_type::now() < deadline);
}

TEST_CASE("futex_wait: the deadline ends the sleep and is reported", "[detail]") {
  std::atomic<std::uint32_t> word{0};
  const auto deadline = clock_type::now() + 20ms;
  bool woken = true;
  // A spurious wake may return true early: the caller re-checks, as here.
  while (woken && clock_type::now() < deadline) woken = futex_wait(word, 0, &deadline);
  CHECK_FALSE(woken);
  CHECK(clock_type::now() >= deadline);
  const clock_type::time_point epoch{};
  CHECK_FALSE(futex_wait(word, 0, &epoch));  // a deadline at or before the clock's epoch
}

TEST_CASE("futex_wake_all wakes every sleeper on the word, however the change and the sleep "
          "interleave",
          "[detail][concurrency]") {
  // The waker may change the word before a sleeper reaches the futex (which then refuses to sleep)
  // or after it sleeps (and the wake finds it). A sleeper that misses both stays until its deadline.
  constexpr int rounds = 2000;
  constexpr int sleepers = 3;
  int timeouts = 0;
  for (int i = 0; i < rounds; ++i) {
    std::atomic<std::uint32_t> word{0};
    std::atomic<int> late{0};
    std::atomic<int> ready{0};
    std::thread threads[sleepers];
    for (auto& t : threads) {
      t = std::thread([&] {
        ready.fetch_add(1);
        const auto deadline = clock_type::now() + 10s;
        while (word.load() == 0) {
          if (!futex_wait(word, 0, &deadline)) {
            late.fetch_add(1);
            return;
          }
        }
      });
    }
    while (ready.load() != sleepers) std::this_thread::yield();
    for (int k = 0; k < i % 256; ++k) ferry::detail::clock::now();
    word.store(1);
    futex_wake_all(word);
    for (auto& t : threads) t.join();
    timeouts += late.load();
  }
  CHECK(timeouts == 0);
}

// detail::mpsc_ring: the bounded multi-producer, single-consumer ring.

#include <catch2/catch.hpp>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <thread>
#include <vector>

#include <ferry/detail/mpsc_ring.hpp>

using ferry::detail::mpsc_ring;

TEST_CASE("mpsc_ring: capacity is a power of two, at least two", "[detail]") {
  CHECK(mpsc_ring<int>(0).capacity() == 2);
  CHECK(mpsc_ring<int>(1).capacity() == 2);
  CHECK(mpsc_ring<int>(4).capacity() == 4);
  CHECK(mpsc_ring<int>(5).capacity() == 8);
}

TEST_CASE("mpsc_ring: first in, first out; full refuses a push, empty a pop, across many wraps",
          "[detail]") {
  mpsc_ring<int> ring(4);
  int out = -1;
  CHECK_FALSE(ring.try_pop(out));
  int next_in = 0, next_out = 0;
  for (int lap = 0; lap < 100; ++lap) {
    // Fill it, then take a varying number, so that the head and tail meet every cell.
    while (ring.try_push(next_in)) ++next_in;
    CHECK(next_in - next_out == 4);
    for (int k = 0; k <= lap % 4; ++k) {
      REQUIRE(ring.try_pop(out));
      CHECK(out == next_out++);
    }
  }
  while (ring.try_pop(out)) CHECK(out == next_out++);
  CHECK(next_out == next_in);
}

TEST_CASE("mpsc_ring: producers racing for cells lose nothing and keep each producer's order",
          "[detail][concurrency]") {
  // A small ring, so that producers keep meeting it full and the consumer keeps meeting it empty:
  // a cell claimed twice, or read before it is published, shows as a lost, doubled or reordered
  // value.
  constexpr std::uint64_t producers = 4;
  constexpr std::uint64_t per_producer = 50000;
  mpsc_ring<std::uint64_t> ring(8);
  std::atomic<std::uint64_t> finished{0};
  std::vector<std::thread> threads;
  for (std::uint64_t p = 0; p < producers; ++p) {
    threads.emplace_back([&ring, &finished, p] {
      for (std::uint64_t i = 0; i < per_producer; ++i) {
        while (!ring.try_push(p << 32 | i)) std::this_thread::yield();
      }
      finished.fetch_add(1);
    });
  }
  std::vector<std::uint64_t> next(producers, 0);
  std::uint64_t received = 0, out_of_order = 0;
  for (;;) {
    const bool last_look = finished.load() == producers;
    std::uint64_t v = 0;
    if (!ring.try_pop(v)) {
      if (last_look) break;
      std::this_thread::yield();
      continue;
    }
    const std::uint64_t p = v >> 32;
    if (p >= producers || (v & 0xffffffff) != next[p]) {
      ++out_of_order;
    } else {
      ++next[p];
    }
    ++received;
  }
  for (auto& t : threads) t.join();
  CHECK(out_of_order == 0);
  CHECK(received == producers * per_producer);
}

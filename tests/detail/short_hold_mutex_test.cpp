// detail::short_hold_mutex: a mutex that retries briefly before it blocks.

#include <catch2/catch.hpp>

#include <mutex>
#include <thread>
#include <vector>

#include <ferry/detail/short_hold_mutex.hpp>

TEST_CASE("short_hold_mutex: try_lock fails while held, and lock waits for the holder", "[detail]") {
  ferry::detail::short_hold_mutex m;
  m.lock();
  bool got = true;
  std::thread other([&] { got = m.try_lock(); });
  other.join();
  CHECK_FALSE(got);
  m.unlock();
  CHECK(m.try_lock());
  // Held far longer than the retries last: the second locker goes on to block, and gets it.
  bool entered = false;
  std::thread blocker([&] {
    std::lock_guard lock(m);
    entered = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  m.unlock();
  blocker.join();
  CHECK(entered);
}

TEST_CASE("short_hold_mutex: contended short sections exclude each other", "[detail][concurrency]") {
  constexpr int threads = 4;
  constexpr int per_thread = 20000;
  ferry::detail::short_hold_mutex m;
  long counter = 0;  // plain: only the lock keeps the increments apart
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t) {
    ts.emplace_back([&] {
      for (int i = 0; i < per_thread; ++i) {
        std::lock_guard lock(m);
        ++counter;
      }
    });
  }
  for (auto& t : ts) t.join();
  CHECK(counter == long{threads} * per_thread);
}

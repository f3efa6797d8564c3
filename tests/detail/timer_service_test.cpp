// detail::timer_service: deadline timers in one heap, fired by their owner, armed and cancelled by
// any thread.

#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <random>
#include <thread>
#include <vector>

#include <ferry/detail/timer_service.hpp>

using clock_type = ferry::detail::clock;
using ferry::detail::timer_node;
using ferry::detail::timer_service;
using namespace std::chrono_literals;

namespace {

// A timer that counts its firings.
struct recorded_timer : timer_node {
  std::atomic<int> fired{0};

  recorded_timer() {
    fire = [](timer_node* t) noexcept {
      auto* self = static_cast<recorded_timer*>(t);
      self->fired.fetch_add(1);
    };
  }
};

struct kick_counter {
  std::atomic<int> kicks{0};
  static void kick(void* self) noexcept { static_cast<kick_counter*>(self)->kicks.fetch_add(1); }
};

}  // namespace

TEST_CASE("timer_service: each timer fires once it is due and not before, a cancelled one never",
          "[detail]") {
  kick_counter k;
  timer_service timers(&kick_counter::kick, &k);
  CHECK(timers.empty());
  const auto t0 = clock_type::now();
  std::vector<recorded_timer> ts(20);
  std::minstd_rand shuffle(3);
  for (std::size_t i = 0; i < ts.size(); ++i) {
    ts[i].deadline = t0 + std::chrono::milliseconds(shuffle() % 1000);
    timers.arm(ts[i]);
  }
  CHECK_FALSE(timers.empty());
  CHECK(timers.cancel(ts[7]));
  CHECK_FALSE(timers.cancel(ts[7]));  // no longer armed
  CHECK(timers.fire_expired(t0 - 1ms) == 0);
  std::size_t fired = 0;
  for (auto now = t0; now <= t0 + 1s; now += 100ms) {
    fired += timers.fire_expired(now);
    for (std::size_t i = 0; i < ts.size(); ++i) {
      if (i == 7) continue;
      CHECK(ts[i].fired.load() == (ts[i].deadline <= now ? 1 : 0));
    }
  }
  CHECK(fired == ts.size() - 1);
  CHECK(ts[7].fired.load() == 0);
  CHECK(timers.empty());
  CHECK_FALSE(timers.cancel(ts[0]));  // fired: cancel says it ran
}

TEST_CASE("timer_service: the earliest deadline is published, and an arm that moves it earlier "
          "kicks the owner",
          "[detail]") {
  kick_counter k;
  timer_service timers(&kick_counter::kick, &k);
  const auto t0 = clock_type::now();
  recorded_timer late, early, middle;
  late.deadline = t0 + 3s;
  early.deadline = t0 + 1s;
  middle.deadline = t0 + 2s;
  timers.arm(late);
  CHECK(k.kicks.load() == 1);
  CHECK(timers.next_deadline() == late.deadline);
  timers.arm(early);
  CHECK(k.kicks.load() == 2);
  timers.arm(middle);
  CHECK(k.kicks.load() == 2);  // not the earliest: the owner's sleep is still right
  CHECK(timers.next_deadline() == early.deadline);
  CHECK(timers.cancel(early));
  CHECK(timers.next_deadline() == middle.deadline);
  CHECK(timers.cancel(middle));
  CHECK(timers.cancel(late));
  CHECK(timers.empty());
}

TEST_CASE("timer_service: timers armed and cancelled from many threads fire exactly once or never",
          "[detail][concurrency]") {
  // The owner fires while others arm and cancel, each cancel aimed at a timer armed a little earlier
  // so that it often meets the owner firing that very timer. A timer whose cancel() returned true
  // must never fire; one whose cancel() returned false has fired (or is firing) exactly once.
  constexpr int threads = 4;
  constexpr int per_thread = 5000;
  constexpr int behind = 8;
  kick_counter k;
  timer_service timers(&kick_counter::kick, &k);
  std::vector<std::vector<recorded_timer>> ts(threads);
  for (auto& v : ts) v = std::vector<recorded_timer>(per_thread);
  std::vector<std::vector<char>> cancelled(threads, std::vector<char>(per_thread, 0));
  std::atomic<int> done{0};
  std::thread owner([&] {
    while (done.load() != threads) (void)timers.fire_expired(clock_type::now());
  });
  std::vector<std::thread> workers;
  for (int w = 0; w < threads; ++w) {
    workers.emplace_back([&, w] {
      std::vector<recorded_timer>& mine = ts[static_cast<std::size_t>(w)];
      std::minstd_rand pick(static_cast<unsigned>(w + 1));
      for (std::size_t i = 0; i < mine.size(); ++i) {
        mine[i].deadline = clock_type::now() + std::chrono::microseconds(pick() % 50);
        timers.arm(mine[i]);
        if (i >= behind && pick() % 2 == 0) {
          cancelled[static_cast<std::size_t>(w)][i - behind] = timers.cancel(mine[i - behind]) ? 1 : 0;
        }
      }
      done.fetch_add(1);
    });
  }
  for (auto& t : workers) t.join();
  owner.join();
  (void)timers.fire_expired(clock_type::time_point::max());
  CHECK(timers.empty());
  int bad = 0, cancels = 0;
  for (std::size_t w = 0; w < ts.size(); ++w) {
    for (std::size_t i = 0; i < ts[w].size(); ++i) {
      if (ts[w][i].fired.load() != (cancelled[w][i] != 0 ? 0 : 1)) ++bad;
      cancels += cancelled[w][i];
    }
  }
  CHECK(bad == 0);
  CHECK(cancels > 0);
}

TEST_CASE("process_timers: the timer thread fires a timer at its deadline", "[detail][concurrency]") {
  recorded_timer t;
  t.deadline = clock_type::now() + 10ms;
  ferry::detail::process_timers().arm(t);
  const auto bound = clock_type::now() + 10s;
  while (t.fired.load() == 0 && clock_type::now() < bound) std::this_thread::sleep_for(1ms);
  CHECK(t.fired.load() == 1);
  CHECK(clock_type::now() >= t.deadline);
}

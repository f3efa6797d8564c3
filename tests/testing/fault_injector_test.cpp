// The fault injector: failures, hangs, delays and reordering, chosen from a seed.

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <thread>
#include <utility>
#include <vector>

#include <ferry/testing.hpp>

#include "helpers.hpp"

using namespace ferry_test;
using ferry::transfer_state;
using ferry::verdict;

TEST_CASE("fault injector: failures, hangs, delays and reordering from a seed",
          "[testing][faults][concurrency]") {
  ferry::progress_executor exec;
  const auto src = pattern(64, 5);

  SECTION("every transfer fails when failure_rate is 1, after the data moved") {
    ferry::fault_profile p;
    p.failure_rate = 1.0;
    ferry::faulty_loopback lb{exec, p};
    std::vector<std::byte> dst(64);
    ferry::transfer t = lb.copy(dst, src);
    REQUIRE(t.wait_for(hang_bound) == transfer_state::failed);
    CHECK(t.error() == ferry::testing::errc::injected_fault);
    CHECK(dst == src);
    CHECK(lb.faults().counters().failed == 1);
  }
  SECTION("a hung transfer never completes until released, and a late completion is seen") {
    ferry::fault_profile p;
    p.hang_rate = 1.0;
    ferry::faulty_loopback lb{exec, p};
    std::vector<std::byte> dst(64);
    ferry::transfer t = lb.copy(dst, src);
    std::vector<ferry::transfer> ts{t};
    CHECK(ferry::wait_all(ts, 30ms).verdict == verdict::timed_out);
    CHECK(t.state() == transfer_state::pending);
    while (lb.faults().counters().hung == 0) std::this_thread::yield();
    CHECK(lb.faults().release_hung() == 1);
    CHECK(t.wait_for(hang_bound) == transfer_state::success);
    CHECK(dst == src);
  }
  SECTION("destroying the injector fails hung transfers as abandoned") {
    ferry::transfer t;
    {
      ferry::fault_profile p;
      p.hang_rate = 1.0;
      ferry::faulty_loopback lb{exec, p};
      std::vector<std::byte> dst(64);
      t = lb.copy(dst, src);
      std::vector<ferry::transfer> ts{t};
      CHECK(ferry::wait_all(ts, 10ms).verdict == verdict::timed_out);
      // Make sure the hang has been routed before the injector goes.
      while (lb.faults().counters().hung == 0) std::this_thread::yield();
    }
    CHECK(t.state() == transfer_state::failed);
    CHECK(t.error() == ferry::errc::abandoned);
  }
  SECTION("delayed transfers complete later, through the executor's timers") {
    ferry::fault_profile p;
    p.delay_rate = 1.0;
    p.max_delay = std::chrono::milliseconds(30);
    ferry::faulty_loopback lb{exec, p};
    std::vector<std::vector<std::byte>> dsts(20, std::vector<std::byte>(64));
    std::vector<ferry::transfer> ts;
    for (auto& d : dsts) ts.push_back(lb.copy(d, src));
    CHECK(ferry::wait_all(ts, hang_bound).verdict == verdict::success);
    CHECK(lb.faults().counters().delayed == 20);
  }
  SECTION("reordering releases completions out of submission order") {
    // Every member fails, so each takes a number from the failure sequence when it completes:
    // sorting by that number gives the order in which the caller heard of them.
    ferry::fault_profile p;
    p.failure_rate = 1.0;
    p.reorder_window = 16;
    p.reorder_hold = std::chrono::seconds(5);  // only a full window is released
    p.seed = 42;
    ferry::faulty_loopback lb{exec, p};
    std::vector<std::vector<std::byte>> dsts(16, std::vector<std::byte>(64));
    std::vector<ferry::transfer> ts;
    for (auto& d : dsts) ts.push_back(lb.copy(d, src));
    REQUIRE(ferry::drain(ts, hang_bound).pending == 0);
    std::vector<std::pair<std::uint64_t, std::size_t>> heard;
    for (std::size_t i = 0; i < ts.size(); ++i) {
      heard.emplace_back(ts[i].status()->event().sequence, i);
    }
    std::sort(heard.begin(), heard.end());
    std::vector<std::size_t> order;
    for (auto& h : heard) order.push_back(h.second);
    std::vector<std::size_t> submitted(16);
    std::iota(submitted.begin(), submitted.end(), 0);
    CHECK(order != submitted);
    CHECK(std::is_permutation(order.begin(), order.end(), submitted.begin()));
    CHECK(ferry::poll_all(ts).first_failed == order.front());
  }
  SECTION("the same seed gives the same choices") {
    ferry::fault_profile p;
    p.failure_rate = 0.3;
    p.hang_rate = 0.2;
    p.seed = 7;
    std::vector<std::vector<transfer_state>> runs;
    for (int run = 0; run < 2; ++run) {
      ferry::faulty_loopback lb{exec, p};
      std::vector<std::byte> dst(64);
      std::vector<ferry::transfer> ts;
      for (int i = 0; i < 200; ++i) ts.push_back(lb.copy(dst, src));
      // Every choice made and acted on: all but the hung ones have ended.
      REQUIRE(wait_until([&] {
        const auto c = lb.faults().counters();
        return c.failed + c.forwarded + c.hung == ts.size() &&
               static_cast<std::size_t>(std::count_if(ts.begin(), ts.end(), [](const auto& t) {
                 return t.state() == transfer_state::pending;
               })) == c.hung;
      }));
      std::vector<transfer_state> states;
      for (auto& t : ts) states.push_back(t.state());
      runs.push_back(states);
      const auto c = lb.faults().counters();
      CHECK(c.failed > 20);
      CHECK(c.hung > 10);
    }
    CHECK(runs[0] == runs[1]);
  }
  SECTION("bad profiles are refused with a message") {
    ferry::fault_profile p;
    p.failure_rate = 0.8;
    p.hang_rate = 0.5;
    CHECK_THROWS_WITH(ferry::fault_injector(exec, p), Catch::Contains("sum to at most 1"));
  }
}

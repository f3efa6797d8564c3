// The loopback backend and the fault injector.

#include <catch2/catch.hpp>

#include <algorithm>
#include <numeric>
#include <thread>
#include <vector>

#include <ferry/testing.hpp>
#include <ferry/loopback.hpp>

#include "helpers.hpp"

using namespace ferry_test;
using ferry::transfer_state;
using ferry::verdict;

namespace {

std::vector<std::byte> pattern(std::size_t n, unsigned seed) {
  std::vector<std::byte> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<std::byte>((i * 131 + seed) & 0xff);
  return v;
}

}  // namespace

TEST_CASE("loopback copies are byte-exact and complete through the executor",
          "[loopback][concurrency]") {
  ferry::progress_executor exec;
  ferry::loopback_backend lb{exec};
  const auto size = GENERATE(std::size_t{0}, std::size_t{1}, std::size_t{4096},
                             std::size_t{1} << 20);
  const auto src = pattern(size, 7);
  std::vector<std::byte> dst(size + 16, std::byte{0xee});
  ferry::transfer t = lb.copy(dst, src);
  REQUIRE(t.wait_for(hang_bound) == transfer_state::success);
  CHECK(std::equal(src.begin(), src.end(), dst.begin()));
  CHECK(std::all_of(dst.begin() + static_cast<std::ptrdiff_t>(size), dst.end(),
                    [](std::byte b) { return b == std::byte{0xee}; }));
}

TEST_CASE("loopback copy(dst, src, bytes) copies exactly that many bytes", "[loopback][concurrency]") {
  ferry::progress_executor exec;
  ferry::loopback_backend lb{exec};
  const auto src = pattern(100, 1);
  std::vector<std::byte> dst(100);
  REQUIRE(lb.copy(dst, src, 10).wait_for(hang_bound) == transfer_state::success);
  CHECK(std::equal(src.begin(), src.begin() + 10, dst.begin()));
  CHECK(dst[10] == std::byte{0});
}

TEST_CASE("loopback rejects bad input with a clear error and copies nothing", "[loopback]") {
  ferry::progress_executor exec;
  ferry::loopback_backend lb{exec};
  std::vector<std::byte> small(8), big(64, std::byte{1});
  SECTION("destination too small") {
    ferry::transfer t = lb.copy(small, big);
    CHECK(t.state() == transfer_state::failed);
    CHECK(t.error() == ferry::errc::destination_too_small);
    CHECK(small == std::vector<std::byte>(8));
  }
  SECTION("more bytes than the source has") {
    ferry::transfer t = lb.copy(big, small, 32);
    CHECK(t.error() == ferry::errc::source_too_small);
  }
  SECTION("overlapping buffers") {
    ferry::transfer t = lb.copy(std::span(big).subspan(4, 16), std::span(big).subspan(0, 16));
    CHECK(t.error() == ferry::errc::overlapping_buffers);
    CHECK_THAT(t.error().message(), Catch::Contains("overlap"));
  }
  CHECK_THROWS_WITH(ferry::loopback_backend(exec, ferry::loopback_options{0}),
                    Catch::Contains("queue_depth"));
}

TEST_CASE("loopback spills past its ring and loses nothing", "[loopback][concurrency]") {
  ferry::executor_options options;
  options.mode = ferry::progress_mode::park;
  ferry::progress_executor exec(options);
  ferry::loopback_backend lb{exec, ferry::loopback_options{4}};
  const auto src = pattern(64, 3);
  std::vector<std::vector<std::byte>> dsts(5000, std::vector<std::byte>(64));
  std::vector<ferry::transfer> ts;
  for (auto& d : dsts) ts.push_back(lb.copy(d, src));
  const auto r = ferry::wait_all(ts, hang_bound);
  CHECK(r.verdict == verdict::success);
  for (auto& d : dsts) REQUIRE(d == src);
}

TEST_CASE("loopback copies that spill past its ring complete in the order they were made",
          "[loopback][concurrency]") {
  // Everything is submitted, and every completion hooked, from the executor's own thread (inside
  // another backend's completion), so nothing completes in between: the order seen is the order
  // the executor takes the requests in. Taken newest first, the spilled ones would come reversed,
  // and under load the oldest could wait behind ever newer ones.
  ferry::progress_executor exec;
  ferry::loopback_backend starter{exec};
  // The kick is held back until the coroutine below is suspended on it, so it cannot complete
  // early and let the coroutine run on, on this thread (where its copies would complete under it).
  ferry::fault_profile hold_kick;
  hold_kick.hang_rate = 1.0;
  ferry::fault_injector gate{exec, hold_kick};
  ferry::loopback_backend lb{exec, ferry::loopback_options{4}};
  constexpr std::size_t n = 100;
  const auto src = pattern(64, 5);
  std::vector<std::vector<std::byte>> dsts(n, std::vector<std::byte>(64));
  std::vector<std::byte> kick_dst(1);
  const std::byte kick_src[1] = {};
  std::vector<std::size_t> order;  // appended on the executor thread only
  std::vector<ferry::transfer> copies;
  std::atomic<bool> submitted{false};
  std::atomic<bool> submitted_on_executor{false};
  ferry::inline_scheduler on_executor;
  [](ferry::transfer kick, ferry::inline_scheduler& s, ferry::progress_executor& exec,
     ferry::loopback_backend& lb, const std::vector<std::byte>& src,
     std::vector<std::vector<std::byte>>& dsts, std::vector<ferry::transfer>& copies,
     std::vector<std::size_t>& order, std::atomic<bool>& submitted,
     std::atomic<bool>& submitted_on_executor) -> detached_inline {
    (void)co_await ferry::resume_on(s, kick);  // on the executor thread from here
    submitted_on_executor.store(exec.on_executor_thread());
    for (auto& d : dsts) copies.push_back(lb.copy(d, src));
    for (std::size_t i = 0; i < copies.size(); ++i) {
      [](ferry::transfer t, ferry::inline_scheduler& s, std::vector<std::size_t>& order,
         std::size_t i) -> detached_inline {
        (void)co_await ferry::resume_on(s, t);
        order.push_back(i);
      }(copies[i], s, order, i);
    }
    submitted.store(true);
  }(gate.wrap(starter.copy(kick_dst, kick_src)), on_executor, exec, lb, src, dsts, copies, order,
    submitted, submitted_on_executor);
  REQUIRE(wait_until([&] { return gate.counters().hung == 1; }));
  REQUIRE(gate.release_hung() == 1);  // completes the kick on the executor's thread
  REQUIRE(wait_until([&] { return submitted.load(); }));
  REQUIRE(submitted_on_executor.load());
  REQUIRE(ferry::wait_all(copies, hang_bound).verdict == verdict::success);
  exec.sync();  // the round that completed the last copy, and ran its waiter, is over
  std::vector<std::size_t> expected(n);
  std::iota(expected.begin(), expected.end(), std::size_t{0});
  CHECK(order == expected);
}

TEST_CASE("many threads submit to one loopback; every completion is accounted for",
          "[loopback][concurrency]") {
  ferry::progress_executor exec;
  ferry::loopback_backend lb{exec, ferry::loopback_options{256}};
  constexpr int threads = 4;
  constexpr int per_thread = 5000;
  std::atomic<int> ok{0};
  std::vector<std::thread> pool;
  for (int i = 0; i < threads; ++i) {
    pool.emplace_back([&, i] {
      const auto src = pattern(32, static_cast<unsigned>(i));
      std::vector<std::byte> dst(32);
      std::vector<ferry::transfer> window;
      for (int j = 0; j < per_thread; ++j) {
        window.push_back(lb.copy(dst, src));
        if (window.size() == 64) {
          if (ferry::wait_all(window, hang_bound).ok()) ok.fetch_add(64);
          window.clear();
        }
      }
      if (ferry::wait_all(window, hang_bound).ok()) ok.fetch_add(static_cast<int>(window.size()));
    });
  }
  for (auto& th : pool) th.join();
  CHECK(ok.load() == threads * per_thread);
}

TEST_CASE("destroying a loopback fails what it never started, without touching the buffers",
          "[loopback][concurrency]") {
  ferry::executor_options options;
  options.mode = ferry::progress_mode::park;
  ferry::progress_executor exec(options);
  std::vector<ferry::transfer> ts;
  auto src = pattern(16, 9);
  std::vector<std::vector<std::byte>> dsts(1000, std::vector<std::byte>(16));
  {
    ferry::loopback_backend lb{exec};
    for (auto& d : dsts) ts.push_back(lb.copy(d, src));
  }
  // Every transfer is terminal: either copied (success) or failed as shut down with its buffer
  // untouched.
  for (std::size_t i = 0; i < ts.size(); ++i) {
    REQUIRE(ts[i].done());
    if (ts[i].state() == transfer_state::success) {
      CHECK(dsts[i] == src);
    } else {
      CHECK(ts[i].error() == ferry::errc::backend_shut_down);
      CHECK(dsts[i] == std::vector<std::byte>(16));
    }
  }
}

TEST_CASE("fault injector: failures, hangs, delays and reordering from a seed",
          "[loopback][faults][concurrency]") {
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

TEST_CASE("a soak: random faults, every transfer ends or is accounted hung",
          "[loopback][faults][concurrency]") {
  ferry::progress_executor exec;
  ferry::fault_profile p;
  p.failure_rate = 0.05;
  p.hang_rate = 0.01;
  p.delay_rate = 0.2;
  p.max_delay = std::chrono::milliseconds(2);
  p.reorder_window = 8;
  p.seed = 2026;
  ferry::faulty_loopback lb{exec, p};
  const auto src = pattern(128, 11);
  std::vector<std::byte> dst(128);
  constexpr std::size_t batches = 200, per_batch = 32;
  std::vector<std::vector<ferry::transfer>> all;
  std::vector<verdict> verdicts;
  for (std::size_t batch = 0; batch < batches; ++batch) {
    std::vector<ferry::transfer> ts;
    for (std::size_t i = 0; i < per_batch; ++i) ts.push_back(lb.copy(dst, src));
    verdicts.push_back(ferry::wait_all(ts, 20ms).verdict);
    (void)ferry::drain(ts, 20ms);
    all.push_back(std::move(ts));
  }
  // Under load a drain may give up before a delayed transfer ends: wait until every transfer the
  // injector did not hang has ended (then none is pending but the hung ones).
  const auto pending = [&] {
    std::size_t n = 0;
    for (const auto& ts : all) {
      for (const auto& t : ts) n += t.state() == transfer_state::pending ? 1 : 0;
    }
    return n;
  };
  REQUIRE(wait_until([&] {
    const auto c = lb.faults().counters();
    return c.failed + c.forwarded + c.hung == batches * per_batch && pending() == c.hung;
  }));
  const auto c = lb.faults().counters();
  std::size_t failed = 0, succeeded = 0;
  for (std::size_t batch = 0; batch < batches; ++batch) {
    bool hung_member = false;
    for (const auto& t : all[batch]) {
      if (t.state() == transfer_state::success) ++succeeded;
      if (t.state() == transfer_state::failed) ++failed;
      if (t.state() == transfer_state::pending) hung_member = true;
    }
    // A batch with a member that never ends cannot have succeeded.
    if (hung_member) CHECK(verdicts[batch] != verdict::success);
  }
  CHECK(succeeded + failed + c.hung == batches * per_batch);
  CHECK(failed == c.failed);
  CHECK(c.hung > 0);
}

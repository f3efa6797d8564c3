// The loopback backend: byte-exact copies through the executor, spills, many submitters, teardown.

#include <catch2/catch.hpp>

#include <algorithm>
#include <numeric>
#include <thread>
#include <vector>

#include <ferry/loopback.hpp>
#include <ferry/testing/fault_injector.hpp>

#include "helpers.hpp"

using namespace ferry_test;
using ferry::transfer_state;
using ferry::verdict;

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

// The io_uring ring (ring.hpp) on real files and pipes in a temporary directory, no mocks: how
// submissions are gathered into calls, parking and waking, both set-ups, destruction, counters.

#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <ferry/metrics.hpp>
#include <ferry/testing.hpp>
#include <ferry/task.hpp>
#include <ferry/uring/aligned_buffer.hpp>
#include <ferry/uring/ring.hpp>
#include <ferry/wait_all.hpp>

#include "helpers.hpp"
#include "uring/uring_helpers.hpp"

using namespace ferry_test;
using ferry::transfer_state;
using ferry::verdict;
namespace uring = ferry::uring;

namespace {


// A new file of n 4 KiB blocks, just written, so in the page cache.
struct cached_blocks {
  static constexpr std::size_t n = 16;
  static constexpr std::size_t block = 4096;
  temp_dir dir;
  fd_guard fd{open_file(dir.file("blocks"))};
  std::vector<std::byte> data;

  explicit cached_blocks(unsigned seed) : data(byte_pattern(n * block, seed)) {
    REQUIRE(::pwrite(fd.get(), data.data(), data.size(), 0) == static_cast<ssize_t>(data.size()));
  }
  // Reads of every block in order, into `dst` (n blocks long).
  static std::vector<uring::read_block> reads_into(std::vector<std::byte>& dst) {
    std::vector<uring::read_block> reads;
    for (std::size_t i = 0; i < n; ++i) {
      reads.push_back({std::span(dst).subspan(i * block, block), i * block});
    }
    return reads;
  }
};

// A ring_options::submit_batch, and the submission calls a test expects with it.
struct split {
  unsigned submit_batch;
  std::uint64_t calls;
};

uring::ring_options with_submit_batch(unsigned n) {
  uring::ring_options options;
  options.submit_batch = n;
  return options;
}

}  // namespace

TEST_CASE("uring: one submission call carries at most submit_batch requests",
          "[uring][concurrency]") {
  FERRY_REQUIRE_URING();
  cached_blocks file(3);
  constexpr std::size_t n = cached_blocks::n;
  // A read_batch is published with one CAS, so the executor takes all of it in one round; only
  // submit_batch then splits it into calls.
  for (const split& want : {split{1, 16}, split{2, 8}, split{5, 4}, split{0, 1}}) {
    INFO("submit_batch " << want.submit_batch);
    ferry::progress_executor exec;
    uring::ring r(exec, with_submit_batch(want.submit_batch));
    std::vector<std::byte> back(file.data.size());
    std::vector<ferry::transfer> rt(n);
    r.read_batch(file.fd.get(), cached_blocks::reads_into(back), rt);
    REQUIRE(ferry::wait_all(rt, hang_bound).verdict == verdict::success);
    CHECK(back == file.data);
    const uring::ring_counters c = r.counters();
    REQUIRE(c.resubmitted == 0);  // a short read would add calls of its own
    CHECK(c.submitted == n);
    CHECK(c.submit_calls == want.calls);
  }
}

TEST_CASE("uring: reads submitted by continuations resumed inline share calls of submit_batch",
          "[uring][concurrency]") {
  // A starter coroutine on the executor's thread makes n reads and hooks a continuation on each,
  // before the ring can take any of them. The reads hit the page cache, so the kernel completes
  // them inside the call that submits them and the ring reaps them together; each continuation,
  // resumed inline in that reap, makes one more read. Those go out in calls of submit_batch, as the
  // first ones did, not one call each.
  FERRY_REQUIRE_URING();
  cached_blocks file(11);
  constexpr std::size_t n = cached_blocks::n;
  constexpr std::size_t block = cached_blocks::block;
  // Calls for the first reads and the follow-ups together.
  for (const split& want : {split{0, 2}, split{2, 16}, split{1, 32}}) {
    INFO("submit_batch " << want.submit_batch);
    ferry::progress_executor exec;
    uring::ring r(exec, with_submit_batch(want.submit_batch));
    ferry::fault_profile hold;
    hold.hang_rate = 1.0;
    ferry::fault_injector gate{exec, hold};
    std::vector<std::byte> first(n * block), second(n * block);
    std::vector<ferry::transfer> firsts(n), seconds(n);
    std::atomic<std::size_t> started{0};
    // What ring::counters().completed said as each continuation ran: the ring adds a reap's
    // completions after the reap, so one value for all means one reap resumed them all.
    std::vector<std::atomic<std::uint64_t>> completed_before(n);
    ferry::inline_scheduler on_executor;
    const auto follow = [](uring::ring& r, int fd, ferry::inline_scheduler& s, ferry::transfer t,
                           std::span<std::byte> dst, std::uint64_t at, ferry::transfer& next,
                           std::atomic<std::uint64_t>& completed_before,
                           std::atomic<std::size_t>& started) -> detached_inline {
      const transfer_state st = co_await ferry::resume_on(s, t);
      completed_before.store(r.counters().completed);
      if (st == transfer_state::success) next = r.read(fd, dst, at);
      started.fetch_add(1);
    };
    [](uring::ring& r, int fd, ferry::inline_scheduler& s, ferry::transfer kick, auto follow,
       std::vector<std::byte>& first, std::vector<std::byte>& second,
       std::vector<ferry::transfer>& firsts, std::vector<ferry::transfer>& seconds,
       std::vector<std::atomic<std::uint64_t>>& completed_before,
       std::atomic<std::size_t>& started) -> detached_inline {
      (void)co_await ferry::resume_on(s, kick);  // on the executor's thread from here
      r.read_batch(fd, cached_blocks::reads_into(first), firsts);
      for (std::size_t i = 0; i < n; ++i) {
        follow(r, fd, s, firsts[i], std::span(second).subspan(i * block, block),
               (n - 1 - i) * block, seconds[i], completed_before[i], started);
      }
    }(r, file.fd.get(), on_executor,
      gate.wrap(ferry::make_completed_transfer(transfer_state::success)), follow, first, second,
      firsts, seconds, completed_before, started);
    REQUIRE(wait_until([&] { return gate.counters().hung == 1; }));
    REQUIRE(gate.release_hung() == 1);
    REQUIRE(wait_until([&] { return started.load() == n; }));
    REQUIRE(ferry::wait_all(firsts, hang_bound).verdict == verdict::success);
    REQUIRE(ferry::wait_all(seconds, hang_bound).verdict == verdict::success);
    CHECK(first == file.data);
    for (std::size_t i = 0; i < n; ++i) {
      CHECK(std::equal(second.begin() + static_cast<std::ptrdiff_t>(i * block),
                       second.begin() + static_cast<std::ptrdiff_t>((i + 1) * block),
                       file.data.begin() + static_cast<std::ptrdiff_t>((n - 1 - i) * block)));
    }
    const uring::ring_counters c = r.counters();
    REQUIRE(c.resubmitted == 0);
    CHECK(c.submitted == 2 * n);
    const std::uint64_t first_seen = completed_before[0].load();
    const bool one_reap = std::all_of(completed_before.begin(), completed_before.end(),
                                      [&](const auto& v) { return v.load() == first_seen; });
    if (one_reap) {
      CHECK(c.submit_calls == want.calls);
    } else {
      // The kernel did not complete the reads inside the call that submitted them (a file system
      // that hands buffered reads to its workers, such as tmpfs): they came back in several reaps.
      WARN("the first reads came back in several reaps, not one (file system under "
           << file.dir.file("") << "); submission calls not checked");
    }
  }
}

TEST_CASE("uring: the executor parks on the ring and the kernel wakes it", "[uring][concurrency]") {
  FERRY_REQUIRE_URING();
  ferry::progress_executor exec(ferry::executor_options{.mode = ferry::progress_mode::park});
  uring::ring r(exec);
  int p[2];
  REQUIRE(::pipe2(p, O_CLOEXEC) == 0);
  fd_guard rd(p[0]), wr(p[1]);
  std::vector<std::byte> buf(5);
  ferry::transfer t = r.read(rd.get(), buf, uring::current_position);
  // Parked: no submission will call notify() from here on; only the ring's descriptor can wake it.
  REQUIRE(wait_until([&] { return exec.counters().parks > 0; }));
  std::this_thread::sleep_for(20ms);
  const auto wakeups = exec.counters().wakeups;
  REQUIRE(::write(wr.get(), "hello", 5) == 5);
  REQUIRE(t.wait_for(hang_bound) == transfer_state::success);
  CHECK(std::memcmp(buf.data(), "hello", 5) == 0);
  CHECK(exec.counters().wakeups == wakeups);
}

TEST_CASE("uring: an adaptive executor spins rather than sleeps while a read is out",
          "[uring][concurrency]") {
  FERRY_REQUIRE_URING();
  std::vector<std::byte> buf(5);  // before the ring, which may still read into it when it goes
  ferry::progress_executor exec(spin_while_in_flight());
  uring::ring r(exec);
  pipe_set pipe(1);
  REQUIRE(wait_until([&] { return exec.counters().parks >= 1; }));
  ferry::transfer t = r.read(pipe.read_ends[0].get(), buf, uring::current_position);
  REQUIRE(wait_until([&] { return r.counters().submitted >= 1; }));
  const counters_over_100ms seen(exec);
  CHECK_FALSE(seen.slept());
  CHECK(seen.went_round());
  REQUIRE(::write(pipe.write_ends[0].get(), "hello", 5) == 5);
  REQUIRE(t.wait_for(hang_bound) == transfer_state::success);
  CHECK(std::memcmp(buf.data(), "hello", 5) == 0);
  // Nothing out: it sleeps again.
  CHECK(wait_until([&] { return exec.counters().parks > seen.after.parks; }));
}

namespace {

// Whether this kernel can defer completions to the issuer's own calls (Linux 6.1 on).
bool kernel_defers_task_work() {
  io_uring probe{};
  io_uring_params p{};
  p.flags = IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN;
  if (::io_uring_queue_init_params(4, &probe, &p) != 0) return false;
  ::io_uring_queue_exit(&probe);
  return true;
}

}  // namespace

TEST_CASE("uring: both ring set-ups, deferred completions and plain, serve every thread",
          "[uring][concurrency]") {
  FERRY_REQUIRE_URING();
  for (const bool defer : {true, false}) {
    INFO("defer_task_work = " << defer);
    // Deferred completions only on an executor that never parks; the plain set-up on one that does.
    ferry::progress_executor exec(ferry::executor_options{
        .mode = defer ? ferry::progress_mode::busy : ferry::progress_mode::park});
    temp_dir dir;
    fd_guard fd(open_file(dir.file("both")));
    pipe_set pipe(1);
    fd_guard& rd = pipe.read_ends[0];
    fd_guard& wr = pipe.write_ends[0];
    std::vector<ferry::transfer> stranded;
    uring::aligned_buffer arena(8192);
    std::vector<std::byte> buf(5);
    {
      uring::ring r(exec, uring::ring_options{.defer_task_work = defer});
      CHECK(r.defers_task_work() == (defer && kernel_defers_task_work()));
      // Registration from this thread, which is not the ring's issuer when completions are
      // deferred: the kernel would refuse it here (EEXIST), so it runs on the executor's.
      const std::span<std::byte> regions[] = {arena.subspan(0, 8192)};
      const auto buffers = r.register_buffers(regions);
      const int fds[] = {fd.get()};
      const auto files = r.register_files(fds);
      const auto data = byte_pattern(4096, 5);
      std::memcpy(arena.data(), data.data(), data.size());
      REQUIRE(r.write(files[0], buffers[0].memory.first(4096), 0, buffers[0]).wait_for(hang_bound) ==
              transfer_state::success);
      REQUIRE(r.read(files[0], buffers[0].memory.subspan(4096, 4096), 0, buffers[0])
                  .wait_for(hang_bound) == transfer_state::success);
      CHECK(std::equal(data.begin(), data.end(), buffers[0].memory.begin() + 4096));
      // The parked executor (the plain set-up) is woken by the kernel alone (no submission after
      // the park); the busy one (deferred) finds the completion in its own calls.
      ferry::transfer t = r.read(rd.get(), buf, uring::current_position);
      REQUIRE(wait_until(
          [&] { return (defer || exec.counters().parks > 0) && r.counters().submitted >= 3; }));
      std::this_thread::sleep_for(10ms);
      REQUIRE(::write(wr.get(), "hello", 5) == 5);
      REQUIRE(t.wait_for(hang_bound) == transfer_state::success);
      CHECK(std::memcmp(buf.data(), "hello", 5) == 0);
      // Destroyed from this thread with a read in the kernel: cancelled and waited for.
      stranded.push_back(r.read(rd.get(), buf, uring::current_position));
      REQUIRE(wait_until([&] { return r.counters().submitted >= 4; }));
    }
    REQUIRE(stranded[0].done());
    CHECK(stranded[0].state() == transfer_state::cancelled);
  }
}

TEST_CASE("uring: stress: a parking executor misses no completion the kernel defers to it",
          "[uring][concurrency]") {
  FERRY_REQUIRE_URING();
  // Each round parks the executor while a pipe read waits, and the write that completes it races
  // the park: before it, during it (after the executor switched the ring's eventfd on, or before),
  // or after. A completion that comes while the executor decides to sleep must still wake it.
  std::vector<std::byte> buf(1);  // before the ring, which may still read into it when it goes
  ferry::progress_executor exec(ferry::executor_options{.mode = ferry::progress_mode::park});
  uring::ring r(exec);
  pipe_set pipe(1);
  fd_guard& rd = pipe.read_ends[0];
  fd_guard& wr = pipe.write_ends[0];
  std::mt19937 rng(7);
  for (int i = 0; i < 30000; ++i) {
    ferry::transfer t = r.read(rd.get(), buf, uring::current_position);
    // A spin, not a sleep: sleeps are too coarse to land inside the park.
    const auto until = clock_type::now() + std::chrono::nanoseconds(rng() % 60'000);
    while (clock_type::now() < until) {
    }
    const char c = static_cast<char>(i);
    REQUIRE(::write(wr.get(), &c, 1) == 1);
    REQUIRE(t.wait_for(hang_bound) == transfer_state::success);
    REQUIRE(buf[0] == static_cast<std::byte>(c));
  }
  CHECK(exec.counters().parks > 0);
}

TEST_CASE("uring: destroying the ring cancels what the kernel holds and waits for it",
          "[uring][concurrency]") {
  FERRY_REQUIRE_URING();
  ferry::progress_executor exec;
  int p[2];
  REQUIRE(::pipe2(p, O_CLOEXEC) == 0);
  fd_guard rd(p[0]), wr(p[1]);
  std::vector<std::byte> buf(64);
  std::vector<ferry::transfer> ts;
  {
    uring::ring r(exec, uring::ring_options{.entries = 2});
    for (int i = 0; i < 16; ++i) ts.push_back(r.read(rd.get(), buf, uring::current_position));
    REQUIRE(wait_until([&] { return r.counters().submitted >= 2 && r.counters().backlogged > 0; }));
  }
  // Every transfer is terminal: those with the kernel were cancelled, the backlog never started.
  std::size_t cancelled = 0;
  std::size_t shut_down = 0;
  for (const auto& t : ts) {
    REQUIRE(t.done());
    if (t.state() == transfer_state::cancelled) ++cancelled;
    if (t.error() == ferry::errc::backend_shut_down) ++shut_down;
  }
  CHECK(cancelled >= 1);
  CHECK(cancelled + shut_down == ts.size());
  // Nothing reads the pipe any more.
  REQUIRE(::write(wr.get(), "x", 1) == 1);
  char c = 0;
  CHECK(::read(rd.get(), &c, 1) == 1);
}

namespace {

inline_task read_twice(uring::ring& r, int fd, std::span<std::byte> buf, ferry::transfer& second) {
  const transfer_state first = co_await r.read(fd, buf, uring::current_position);
  (void)first;
  second = r.read(fd, buf, uring::current_position);  // submitted from inside ~ring
}

// Reads again after every failure, up to `tries` reads: each refusal during the ring's destruction
// resumes it, and it submits again at once. `done` is set when it has finished.
inline_task read_until_refused(uring::ring& r, int fd, std::span<std::byte> buf, int tries,
                               std::vector<ferry::transfer>& attempts, std::atomic<bool>& done) {
  for (int i = 0; i < tries; ++i) {
    const ferry::transfer t = r.read(fd, buf, uring::current_position);
    attempts.push_back(t);
    const transfer_state s = co_await t;
    if (s == transfer_state::success) break;
  }
  done.store(true, std::memory_order_release);
}

}  // namespace

TEST_CASE("uring: work submitted while the ring is being destroyed is refused, not lost",
          "[uring][concurrency]") {
  FERRY_REQUIRE_URING();
  ferry::progress_executor exec;
  int p[2];
  REQUIRE(::pipe2(p, O_CLOEXEC) == 0);
  fd_guard rd(p[0]), wr(p[1]);
  std::vector<std::byte> buf(1);
  ferry::transfer second;
  {
    uring::ring r(exec);
    read_twice(r, rd.get(), buf, second);
    REQUIRE(wait_until([&] { return r.counters().submitted >= 1; }));
  }
  // The destructor cancelled the first read; its continuation's read was refused.
  REQUIRE(second.valid());
  CHECK(second.state() == transfer_state::failed);
  CHECK(second.error() == ferry::errc::backend_shut_down);
}

TEST_CASE("uring: a continuation that keeps submitting while the ring is destroyed has each try "
          "refused", "[uring][concurrency]") {
  FERRY_REQUIRE_URING();
  for (const bool defer : {true, false}) {
    INFO("defer_task_work = " << defer);
    for (int round = 0; round < 50; ++round) {
      ferry::progress_executor exec;
      pipe_set pipe(1);
      fd_guard& rd = pipe.read_ends[0];
      std::vector<std::byte> buf(1);
      std::vector<ferry::transfer> attempts;
      std::atomic<bool> done{false};
      {
        uring::ring r(exec, uring::ring_options{.defer_task_work = defer});
        read_until_refused(r, rd.get(), buf, 16, attempts, done);
        REQUIRE(wait_until([&] { return r.counters().submitted >= 1; }));
      }
      // The first read was cancelled; every later try was refused, and the coroutine ran out.
      REQUIRE(done.load(std::memory_order_acquire));
      REQUIRE(attempts.size() == 16);
      CHECK(attempts[0].state() == transfer_state::cancelled);
      for (std::size_t i = 1; i < attempts.size(); ++i) {
        CHECK(attempts[i].error() == ferry::errc::backend_shut_down);
      }
    }
  }
}

TEST_CASE("uring: 10^5 mixed reads and writes from several threads, every completion counted",
          "[uring][concurrency]") {
  FERRY_REQUIRE_URING();
  temp_dir dir;
  fd_guard fd(open_file(dir.file("stress")));
  ferry::progress_executor exec;
  uring::ring r(exec, uring::ring_options{.entries = 64});
  constexpr int threads = 4;
  constexpr int per_thread = 25000;
  constexpr std::size_t block = 512;
  constexpr int window = 64;  // each thread keeps this many in flight
  REQUIRE(::ftruncate(fd.get(), threads * window * block) == 0);

  std::atomic<int> succeeded{0};
  std::atomic<int> mismatched{0};
  std::vector<std::thread> workers;
  for (int w = 0; w < threads; ++w) {
    workers.emplace_back([&, w] {
      std::vector<std::vector<std::byte>> out(window, std::vector<std::byte>(block));
      std::vector<std::vector<std::byte>> in(window, std::vector<std::byte>(block));
      std::vector<ferry::transfer> ts(window);
      for (int i = 0; i < per_thread; i += 2 * window) {
        // A window of writes of this thread's blocks, then a window of reads checking them.
        for (int k = 0; k < window; ++k) {
          std::fill(out[k].begin(), out[k].end(), static_cast<std::byte>((i / window + k + w) & 0xff));
          ts[k] = r.write(fd.get(), std::span<const std::byte>(out[k]),
                          (static_cast<std::uint64_t>(w) * window + k) * block);
        }
        for (auto& t : ts) succeeded += t.wait() == transfer_state::success ? 1 : 0;
        for (int k = 0; k < window; ++k) {
          ts[k] = r.read(fd.get(), in[k], (static_cast<std::uint64_t>(w) * window + k) * block);
        }
        for (int k = 0; k < window; ++k) {
          succeeded += ts[k].wait() == transfer_state::success ? 1 : 0;
          if (in[k] != out[k]) ++mismatched;
        }
      }
    });
  }
  for (auto& t : workers) t.join();
  const int expected = threads * ((per_thread + 2 * window - 1) / (2 * window)) * 2 * window;
  CHECK(expected >= 100000);
  CHECK(succeeded.load() == expected);
  CHECK(mismatched.load() == 0);
  CHECK(r.counters().completed >= static_cast<std::uint64_t>(expected));
}

TEST_CASE("uring: a ring given a metrics registry records each read and write that ends, by outcome",
          "[uring]") {
  ferry::metrics::registry metrics("uring");
  cached_blocks file(7);
  std::vector<std::byte> dst(cached_blocks::n * cached_blocks::block);
  {
    ferry::progress_executor exec;
    uring::ring_options options;
    options.metrics = &metrics;
    uring::ring ring(exec, options);
    const auto reads = cached_blocks::reads_into(dst);
    std::vector<ferry::transfer> out(reads.size());
    ring.read_batch(file.fd.get(), reads, out);
    REQUIRE(ferry::wait_all(out, hang_bound).ok());
    REQUIRE(ring.write(file.fd.get(), std::span<const std::byte>(dst).first(100), 0).wait_for(hang_bound) ==
            transfer_state::success);
    // Past the end of the file: fails with end_of_file.
    REQUIRE(ring.read(file.fd.get(), std::span(dst).first(4096), cached_blocks::n * cached_blocks::block)
                .wait_for(hang_bound) == transfer_state::failed);
  }
  const ferry::metrics::snapshot s = metrics.snapshot();
  auto find = [&](const char* kind) { return find_series(s, kind); };
  const auto read = find("read");
  CHECK(read.succeeded == cached_blocks::n);
  CHECK(read.failed == 1);
  CHECK(read.bytes == cached_blocks::n * cached_blocks::block);
  CHECK(read.latency_sum_ns > 0);
  const auto write = find("write");
  CHECK(write.succeeded == 1);
  CHECK(write.bytes == 100);
}

TEST_CASE("uring: a ring without a metrics registry records nothing and works as before", "[uring]") {
  ferry::metrics::registry metrics("uring");
  cached_blocks file(9);
  std::vector<std::byte> dst(cached_blocks::block);
  ferry::progress_executor exec;
  uring::ring ring(exec);
  REQUIRE(ring.read(file.fd.get(), dst, 0).wait_for(hang_bound) == transfer_state::success);
  CHECK(metrics.snapshot().operations.empty());
}

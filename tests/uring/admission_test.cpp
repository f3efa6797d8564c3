// The io_uring ring's bound on what is in flight and its backlogs (detail/admission.hpp).

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

TEST_CASE("uring: submissions beyond the completion queue wait instead of overflowing it",
          "[uring][concurrency]") {
  FERRY_REQUIRE_URING();
  temp_dir dir;
  fd_guard fd(open_file(dir.file("many")));
  ferry::progress_executor exec;
  uring::ring r(exec, uring::ring_options{.entries = 4});
  REQUIRE(r.in_flight_limit() == 8);
  const auto data = byte_pattern(1 << 16, 3);
  REQUIRE(r.write(fd.get(), cview(data), 0).wait_for(hang_bound) == transfer_state::success);

  constexpr std::size_t n = 2000;
  std::vector<std::vector<std::byte>> bufs(n, std::vector<std::byte>(32));
  // Published at once (one CAS), so the executor takes them all in one round, far more than fit.
  std::vector<uring::read_block> reads;
  for (std::size_t i = 0; i < n; ++i) reads.push_back({bufs[i], (i * 32) % data.size()});
  std::vector<ferry::transfer> ts(n);
  r.read_batch(fd.get(), reads, ts);
  REQUIRE(ferry::wait_all(ts, hang_bound).verdict == verdict::success);
  for (std::size_t i = 0; i < n; ++i) {
    const auto off = static_cast<std::ptrdiff_t>((i * 32) % data.size());
    REQUIRE(std::equal(bufs[i].begin(), bufs[i].end(), data.begin() + off));
  }
  CHECK(r.counters().backlogged > 0);
}

TEST_CASE("uring: cancels always reach the kernel, even with the ring full of reads that wait",
          "[uring][concurrency]") {
  FERRY_REQUIRE_URING();
  ferry::progress_executor exec;
  uring::ring r(exec, uring::ring_options{.entries = 2});
  constexpr int pipes = 8;
  pipe_set fds(pipes);
  std::vector<fd_guard>& rd = fds.read_ends;
  std::vector<fd_guard>& wr = fds.write_ends;
  std::vector<std::vector<std::byte>> buf(pipes, std::vector<std::byte>(1));
  // More reads than the ring holds, none of which can finish: only cancels end them.
  std::vector<ferry::transfer> ts;
  for (int i = 0; i < pipes; ++i) ts.push_back(r.read(rd[i].get(), buf[i], uring::current_position));
  REQUIRE(wait_until([&] { return r.counters().backlogged > 0; }));
  for (const auto& t : ts) r.cancel(t);
  REQUIRE(ferry::drain(ts, hang_bound).pending == 0);
  for (const auto& t : ts) CHECK(t.state() == transfer_state::cancelled);

  // Cancels racing completions, many times: a cancel that waited while its target finished must
  // not touch anything afterwards (AddressSanitizer), and every transfer ends.
  for (int round = 0; round < 300; ++round) {
    ts.clear();
    for (int i = 0; i < pipes; ++i) {
      ts.push_back(r.read(rd[i].get(), buf[i], uring::current_position));
    }
    for (int i = 0; i < pipes; i += 2) r.cancel(ts[i]);
    for (int i = 0; i < pipes; ++i) REQUIRE(::write(wr[i].get(), "z", 1) == 1);
    REQUIRE(ferry::drain(ts, hang_bound).pending == 0);
    for (int i = 0; i < pipes; ++i) {
      // A read that lost to its cancel left its byte in the pipe: take it out.
      if (ts[i].state() == transfer_state::cancelled) {
        char c;
        REQUIRE(::read(rd[i].get(), &c, 1) == 1);
      } else {
        REQUIRE(ts[i].state() == transfer_state::success);
      }
    }
  }
}

// Cancelling file operations on the io_uring ring (detail/cancellation.hpp).

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

TEST_CASE("uring: cancelling a read on a pipe that never becomes readable", "[uring][concurrency]") {
  FERRY_REQUIRE_URING();
  ferry::progress_executor exec;
  uring::ring r(exec);
  const one_pipe pipe;
  const fd_guard &rd = pipe.rd, &wr = pipe.wr;
  std::vector<std::byte> buf(4096);

  SECTION("the transfer turns cancelled once the kernel confirms") {
    ferry::transfer t = r.read(rd.get(), buf, uring::current_position);
    CHECK(t.wait_for(20ms) == transfer_state::pending);
    r.cancel(t);
    REQUIRE(t.wait_for(hang_bound) == transfer_state::cancelled);
    CHECK(t.error() == ferry::errc::cancelled);
    // The pipe is untouched: a later read gets the next bytes written.
    ferry::transfer next = r.read(rd.get(), std::span(buf).first(3), uring::current_position);
    REQUIRE(::write(wr.get(), "abc", 3) == 3);
    REQUIRE(next.wait_for(hang_bound) == transfer_state::success);
    CHECK(std::memcmp(buf.data(), "abc", 3) == 0);
  }
  SECTION("a deadline, then cancel, then drain: the buffer is free only after drain") {
    std::vector<ferry::transfer> layer{r.read(rd.get(), buf, uring::current_position)};
    const auto start = clock_type::now();
    const ferry::batch_result w = ferry::wait_all(layer, 50ms);
    CHECK(w.verdict == verdict::timed_out);
    CHECK(ms_since(start) < 5000);
    // The deadline left the read with the kernel.
    CHECK(layer[0].state() == transfer_state::pending);
    r.cancel(layer[0]);
    const ferry::batch_result d = ferry::drain(layer, hang_bound);
    CHECK(d.verdict != verdict::timed_out);
    CHECK(layer[0].state() == transfer_state::cancelled);
  }
  SECTION("cancelling a finished transfer, or one from elsewhere, changes nothing") {
    REQUIRE(::write(wr.get(), buf.data(), 10) == 10);
    ferry::transfer t = r.read(rd.get(), std::span(buf).first(10), uring::current_position);
    REQUIRE(t.wait_for(hang_bound) == transfer_state::success);
    r.cancel(t);
    auto [manual, completer] = ferry::make_manual_transfer();
    r.cancel(manual);
    r.cancel(ferry::transfer{});
    std::this_thread::sleep_for(10ms);
    CHECK(t.state() == transfer_state::success);
    CHECK(manual.state() == transfer_state::pending);
  }
}

TEST_CASE("uring: a cancelled stream read that already took bytes says how many, never plain "
          "cancelled", "[uring][concurrency][regression]") {
  // Issue 23, item 3: the pipe gives 5 bytes, ferry goes on reading for the rest, then cancel().
  FERRY_REQUIRE_URING();
  ferry::progress_executor exec;
  uring::ring r(exec);
  const one_pipe pipe;
  const fd_guard &rd = pipe.rd, &wr = pipe.wr;
  std::vector<std::byte> buf(4096);
  std::size_t transferred = 12345;
  ferry::transfer t = r.read(rd.get(), buf, uring::current_position, &transferred);
  REQUIRE(::write(wr.get(), "hello", 5) == 5);
  // The read has taken the 5 bytes and waits for the rest.
  REQUIRE(wait_until([&] { return r.counters().resubmitted >= 1; }));
  CHECK(t.state() == transfer_state::pending);
  r.cancel(t);
  REQUIRE(t.wait_for(hang_bound) == transfer_state::failed);
  CHECK(t.error() == uring::errc::cancelled_part_way);
  CHECK(transferred == 5);
  CHECK(std::memcmp(buf.data(), "hello", 5) == 0);
}

TEST_CASE("uring: a read or write reports the bytes it moved", "[uring]") {
  FERRY_REQUIRE_URING();
  ferry::progress_executor exec;
  uring::ring r(exec);
  const one_pipe pipe;
  const fd_guard &rd = pipe.rd, &wr = pipe.wr;
  const std::vector<std::byte> out(100, std::byte{7});
  std::vector<std::byte> in(100);
  std::size_t written = 0;
  std::size_t read = 0;
  ferry::transfer w = r.write(wr.get(), out, uring::current_position, &written);
  REQUIRE(w.wait_for(hang_bound) == transfer_state::success);
  CHECK(written == 100);
  ferry::transfer rt = r.read(rd.get(), in, uring::current_position, &read);
  REQUIRE(rt.wait_for(hang_bound) == transfer_state::success);
  CHECK(read == 100);
  CHECK(in == out);
}

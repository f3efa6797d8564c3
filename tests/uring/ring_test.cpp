// The io_uring backend on real files and pipes in a temporary directory: no mocks.

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

namespace {

int open_file(const std::string& path, int flags = O_RDWR | O_CREAT) {
  const int fd = ::open(path.c_str(), flags | O_CLOEXEC, 0600);
  if (fd < 0) throw std::system_error(errno, std::system_category(), "open " + path);
  return fd;
}

std::span<const std::byte> cview(const std::vector<std::byte>& v) { return v; }

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

TEST_CASE("uring: round trips are byte-exact at 4 KiB, 64 KiB and 1 MiB", "[uring][concurrency]") {
  FERRY_REQUIRE_URING();
  temp_dir dir;
  fd_guard fd(open_file(dir.file("blocks")));
  ferry::progress_executor exec;
  uring::ring r(exec);
  const std::size_t size = GENERATE(std::size_t{4096}, std::size_t{64} << 10, std::size_t{1} << 20);
  const auto data = byte_pattern(size, static_cast<unsigned>(size));
  const std::uint64_t offset = 3 * size;  // a hole before it: reads must not start at 0

  REQUIRE(r.write(fd.get(), cview(data), offset).wait_for(hang_bound) == transfer_state::success);
  std::vector<std::byte> back(size);
  ferry::transfer t = r.read(fd.get(), back, offset);
  REQUIRE(t.wait_for(hang_bound) == transfer_state::success);
  CHECK(t.error() == std::error_code{});
  CHECK(back == data);

  // The same through a coroutine, which resumes on its own scheduler.
  std::vector<std::byte> again(size);
  const auto state = ferry::sync_wait([&]() -> ferry::task<transfer_state> {
    co_return co_await r.read(fd.get(), again, offset);
  }());
  CHECK(state == transfer_state::success);
  CHECK(again == data);
}

TEST_CASE("uring: readv and writev scatter and gather in order", "[uring][concurrency]") {
  FERRY_REQUIRE_URING();
  temp_dir dir;
  fd_guard fd(open_file(dir.file("vectored")));
  ferry::progress_executor exec;
  uring::ring r(exec);
  std::vector<std::vector<std::byte>> blocks;
  std::vector<iovec> out_iov;
  for (unsigned i = 0; i < 16; ++i) {
    blocks.push_back(byte_pattern(1000 + 97 * i, i));
    out_iov.push_back(iovec{blocks.back().data(), blocks.back().size()});
  }
  REQUIRE(r.writev(fd.get(), out_iov, 512).wait_for(hang_bound) == transfer_state::success);

  std::vector<std::vector<std::byte>> copies;
  std::vector<iovec> in_iov;
  for (const auto& b : blocks) copies.emplace_back(b.size());
  for (auto& c : copies) in_iov.push_back(iovec{c.data(), c.size()});
  REQUIRE(r.readv(fd.get(), in_iov, 512).wait_for(hang_bound) == transfer_state::success);
  CHECK(copies == blocks);
}

TEST_CASE("uring: batched reads and writes give one transfer per block", "[uring][concurrency]") {
  FERRY_REQUIRE_URING();
  temp_dir dir;
  fd_guard fd(open_file(dir.file("batch")));
  ferry::progress_executor exec;
  uring::ring r(exec);
  constexpr std::size_t n = 64;
  constexpr std::size_t block = 4096;
  std::vector<std::vector<std::byte>> data;
  std::vector<uring::write_block> writes;
  for (std::size_t i = 0; i < n; ++i) {
    data.push_back(byte_pattern(block, static_cast<unsigned>(i)));
    writes.push_back({data.back(), (n - 1 - i) * block});  // out of file order on purpose
  }
  std::vector<ferry::transfer> wt(n);
  r.write_batch(fd.get(), writes, wt);
  REQUIRE(ferry::wait_all(wt, hang_bound).verdict == verdict::success);

  std::vector<std::vector<std::byte>> back(n, std::vector<std::byte>(block));
  std::vector<uring::read_block> reads;
  for (std::size_t i = 0; i < n; ++i) reads.push_back({back[i], (n - 1 - i) * block});
  std::vector<ferry::transfer> rt(n);
  r.read_batch(fd.get(), reads, rt);
  REQUIRE(ferry::wait_all(rt, hang_bound).verdict == verdict::success);
  CHECK(back == data);

  std::vector<ferry::transfer> too_few(n - 1);
  CHECK_THROWS_WITH(r.read_batch(fd.get(), reads, too_few),
                    Catch::Contains("holds 63 transfers for 64 blocks"));
}

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

TEST_CASE("uring: O_DIRECT reads and writes with aligned buffers", "[uring][concurrency]") {
  FERRY_REQUIRE_URING();
  temp_dir dir;
  const int raw = ::open(dir.file("direct").c_str(), O_RDWR | O_CREAT | O_DIRECT | O_CLOEXEC, 0600);
  if (raw < 0) {
    WARN("the file system under " << dir.file("") << " refuses O_DIRECT ("
                                  << std::strerror(errno) << "); O_DIRECT test skipped");
    return;
  }
  fd_guard fd(raw);
  ferry::progress_executor exec;
  uring::ring r(exec);
  constexpr std::size_t size = 1 << 20;
  uring::aligned_buffer out(size), in(size);
  const auto data = byte_pattern(size, 42);
  std::memcpy(out.data(), data.data(), size);
  ferry::transfer w = r.write(fd.get(), out.span(), 4096 * 7);
  REQUIRE(w.wait_for(hang_bound) == transfer_state::success);
  ferry::transfer t = r.read(fd.get(), in.span(), 4096 * 7);
  REQUIRE(t.wait_for(hang_bound) == transfer_state::success);
  CHECK(std::memcmp(in.data(), data.data(), size) == 0);

  // A misaligned direct read is the kernel's EINVAL, in the system category.
  std::vector<std::byte> unaligned(4096 + 1);
  ferry::transfer bad = r.read(fd.get(), std::span(unaligned).subspan(1), 4096 * 7);
  REQUIRE(bad.wait_for(hang_bound) == transfer_state::failed);
  CHECK(bad.error() == std::error_code(EINVAL, std::system_category()));
}

TEST_CASE("uring: registered buffers and registered files", "[uring][concurrency]") {
  FERRY_REQUIRE_URING();
  temp_dir dir;
  fd_guard fd(open_file(dir.file("fixed")));
  ferry::progress_executor exec;
  uring::ring r(exec);
  uring::aligned_buffer arena(256 << 10);
  const std::span<std::byte> regions[] = {arena.subspan(0, 128 << 10), arena.subspan(128 << 10, 128 << 10)};
  const auto buffers = r.register_buffers(regions);
  const int fds[] = {fd.get()};
  const auto files = r.register_files(fds);
  REQUIRE(buffers.size() == 2);
  REQUIRE(files.size() == 1);

  const auto data = byte_pattern(64 << 10, 9);
  std::memcpy(buffers[0].memory.data(), data.data(), data.size());
  const auto src = buffers[0].memory.first(data.size());
  REQUIRE(r.write(files[0], src, 8192, buffers[0]).wait_for(hang_bound) == transfer_state::success);
  const auto dst = buffers[1].memory.subspan(4096, data.size());
  REQUIRE(r.read(files[0], dst, 8192, buffers[1]).wait_for(hang_bound) == transfer_state::success);
  CHECK(std::equal(data.begin(), data.end(), dst.begin()));

  // A plain read through a registered descriptor, and a fixed read through a plain one.
  std::vector<std::byte> plain(data.size());
  REQUIRE(r.read(files[0], plain, 8192).wait_for(hang_bound) == transfer_state::success);
  CHECK(plain == data);
  REQUIRE(r.read(fd.get(), buffers[1].memory.first(100), 8192, buffers[1]).wait_for(hang_bound) ==
          transfer_state::success);

  // Batches through a registered buffer: each block inside it goes as READ/WRITE_FIXED; one that
  // is not fails alone.
  {
    const auto blocks_data = byte_pattern(4 * 4096, 12);
    std::memcpy(buffers[0].memory.data(), blocks_data.data(), blocks_data.size());
    std::vector<uring::write_block> writes;
    for (std::size_t i = 0; i < 4; ++i) {
      writes.push_back({buffers[0].memory.subspan(i * 4096, 4096), 65536 + i * 4096});
    }
    std::vector<ferry::transfer> written(4);
    r.write_batch(fd.get(), writes, written, buffers[0]);
    REQUIRE(ferry::wait_all(written, hang_bound).verdict == verdict::success);
    std::vector<uring::read_block> reads;
    for (std::size_t i = 0; i < 4; ++i) {
      reads.push_back({buffers[1].memory.subspan(i * 4096, 4096), 65536 + (3 - i) * 4096});
    }
    reads.push_back({buffers[0].memory.first(4096), 65536});  // not inside buffers[1]
    std::vector<ferry::transfer> read(5);
    r.read_batch(files[0], reads, read, buffers[1]);
    CHECK(read[4].state() == transfer_state::failed);
    CHECK(read[4].error() == ferry::uring::errc::outside_registered_buffer);
    REQUIRE(ferry::wait_all(std::span(read).first(4), hang_bound).verdict == verdict::success);
    for (std::size_t i = 0; i < 4; ++i) {
      CHECK(std::equal(blocks_data.begin() + (3 - i) * 4096, blocks_data.begin() + (4 - i) * 4096,
                       buffers[1].memory.begin() + i * 4096));
    }
    // They really go as fixed reads: naming buffer 1's index with buffer 0's memory passes ferry's
    // check, and the kernel, which holds buffer 1's range for that index, refuses the address.
    const uring::fixed_buffer mislabelled{buffers[1].index, buffers[0].memory};
    const uring::read_block one[] = {{buffers[0].memory.first(4096), 65536}};
    ferry::transfer refused;
    r.read_batch(fd.get(), one, std::span(&refused, 1), mislabelled);
    REQUIRE(refused.wait_for(hang_bound) == transfer_state::failed);
    CHECK(refused.error() == std::error_code(EFAULT, std::system_category()));
  }

  // A span outside the buffer it names is refused before the kernel sees it.
  ferry::transfer outside = r.read(fd.get(), buffers[1].memory.subspan(1), 0, buffers[0]);
  CHECK(outside.state() == transfer_state::failed);
  CHECK(outside.error() == ferry::uring::errc::outside_registered_buffer);
  // So is an index no SQE can carry (it has 16 bits): cut short, it would name another buffer.
  const uring::fixed_buffer forged{0x10001, buffers[1].memory};
  ferry::transfer unnameable = r.read(fd.get(), buffers[1].memory.first(100), 0, forged);
  CHECK(unnameable.state() == transfer_state::failed);
  CHECK(unnameable.error() == ferry::uring::errc::bad_registered_index);
  ferry::transfer negative = r.write(fd.get(), buffers[1].memory.first(100), 0,
                                     uring::fixed_buffer{0x80000000u, buffers[1].memory});
  CHECK(negative.error() == ferry::uring::errc::bad_registered_index);
}

TEST_CASE("uring: bad input fails with an error naming it", "[uring][concurrency]") {
  FERRY_REQUIRE_URING();
  temp_dir dir;
  ferry::progress_executor exec;
  uring::ring r(exec);
  std::vector<std::byte> buf(4096);

  SECTION("a descriptor that is not open is EBADF") {
    ferry::transfer t = r.read(-1, buf, 0);
    REQUIRE(t.wait_for(hang_bound) == transfer_state::failed);
    CHECK(t.error() == std::error_code(EBADF, std::system_category()));
    CHECK(t.error().category() == std::system_category());
    int closed = open_file(dir.file("closed"));
    ::close(closed);
    CHECK(r.write(closed, cview(buf), 0).wait_for(hang_bound) == transfer_state::failed);
  }
  SECTION("writing to a descriptor opened read-only is EBADF") {
    fd_guard ro(open_file(dir.file("ro"), O_RDONLY | O_CREAT));
    ferry::transfer t = r.write(ro.get(), cview(buf), 0);
    REQUIRE(t.wait_for(hang_bound) == transfer_state::failed);
    CHECK(t.error() == std::error_code(EBADF, std::system_category()));
  }
  SECTION("an empty buffer") {
    ferry::transfer t = r.read(0, std::span<std::byte>{}, 0);
    CHECK(t.state() == transfer_state::failed);
    CHECK(t.error() == ferry::errc::empty_buffer);
  }
  SECTION("a bad ring size") {
    CHECK_THROWS_WITH(uring::ring(exec, uring::ring_options{.entries = 0}),
                      Catch::Contains("entries must be at least 1"));
    // Too many is clamped to the kernel's limit, not wrapped round to a confusing EINVAL.
    uring::ring huge(exec, uring::ring_options{.entries = 0x80000000u});
    CHECK(huge.in_flight_limit() >= 4);
  }
  SECTION("iovec lengths whose sum overflows") {
    const iovec iov[] = {{buf.data(), SIZE_MAX / 2 + 1}, {buf.data(), SIZE_MAX / 2 + 1}};
    ferry::transfer t = r.readv(0, iov, 0);
    CHECK(t.state() == transfer_state::failed);
    CHECK(t.error() == ferry::uring::errc::vector_too_large);
  }
  SECTION("writing to a pipe whose reader has gone is EPIPE, not a SIGPIPE that ends the process") {
    int p[2];
    REQUIRE(::pipe2(p, O_CLOEXEC) == 0);
    ::close(p[0]);
    fd_guard wr(p[1]);
    ferry::transfer t = r.write(wr.get(), cview(buf), uring::current_position);
    REQUIRE(t.wait_for(hang_bound) == transfer_state::failed);
    CHECK(t.error() == std::error_code(EPIPE, std::system_category()));
  }
}

TEST_CASE("uring: a read past the end of the file fails, never succeeds with partial data",
          "[uring][concurrency]") {
  FERRY_REQUIRE_URING();
  temp_dir dir;
  fd_guard fd(open_file(dir.file("short")));
  ferry::progress_executor exec;
  uring::ring r(exec);
  const auto data = byte_pattern(10000, 5);
  REQUIRE(r.write(fd.get(), cview(data), 0).wait_for(hang_bound) == transfer_state::success);
  std::vector<std::byte> buf(8192);

  SECTION("entirely past the end") {
    ferry::transfer t = r.read(fd.get(), buf, 20000);
    REQUIRE(t.wait_for(hang_bound) == transfer_state::failed);
    CHECK(t.error() == ferry::uring::errc::end_of_file);
  }
  SECTION("starting inside the file and running past its end") {
    ferry::transfer t = r.read(fd.get(), buf, 4096);
    REQUIRE(t.wait_for(hang_bound) == transfer_state::failed);
    CHECK(t.error() == ferry::uring::errc::end_of_file);
    // The bytes that did exist arrived; the transfer still is not a success.
    CHECK(std::equal(buf.begin(), buf.begin() + (10000 - 4096), data.begin() + 4096));
  }
}

TEST_CASE("uring: short reads and writes are continued for the remainder", "[uring][concurrency]") {
  FERRY_REQUIRE_URING();
  ferry::progress_executor exec;
  uring::ring r(exec);
  int p[2];
  REQUIRE(::pipe2(p, O_CLOEXEC) == 0);
  fd_guard rd(p[0]), wr(p[1]);
  const auto data = byte_pattern(3000, 11);
  std::vector<std::byte> buf(data.size());
  ferry::transfer t = r.read(rd.get(), buf, uring::current_position);
  // The pipe delivers the block in three pieces, so the kernel completes the read short twice.
  for (int i = 0; i < 3; ++i) {
    // The previous piece has been taken and the rest asked for again, so this one comes alone.
    REQUIRE(wait_until([&] { return r.counters().resubmitted >= static_cast<std::uint64_t>(i); }));
    std::this_thread::sleep_for(20ms);
    CHECK(t.state() == transfer_state::pending);
    REQUIRE(::write(wr.get(), data.data() + i * 1000, 1000) == 1000);
  }
  REQUIRE(t.wait_for(hang_bound) == transfer_state::success);
  CHECK(buf == data);
  CHECK(r.counters().resubmitted >= 2);
}

TEST_CASE("uring: cancelling a read on a pipe that never becomes readable", "[uring][concurrency]") {
  FERRY_REQUIRE_URING();
  ferry::progress_executor exec;
  uring::ring r(exec);
  int p[2];
  REQUIRE(::pipe2(p, O_CLOEXEC) == 0);
  fd_guard rd(p[0]), wr(p[1]);
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
    ferry::progress_executor exec(ferry::executor_options{.mode = ferry::progress_mode::park});
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
      // The parked executor is woken by the kernel alone (no submission after the park).
      ferry::transfer t = r.read(rd.get(), buf, uring::current_position);
      REQUIRE(wait_until([&] { return exec.counters().parks > 0 && r.counters().submitted >= 3; }));
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

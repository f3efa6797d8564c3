// File reads and writes on the io_uring ring (detail/file_io.hpp) on real files and pipes in a
// temporary directory: plain, vectored, batched, O_DIRECT, registered, and how they fail.

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

TEST_CASE("uring: batched reads and writes report each block's byte count, failures included",
          "[uring]") {
  FERRY_REQUIRE_URING();
  temp_dir dir;
  fd_guard fd(open_file(dir.file("counted")));
  ferry::progress_executor exec;
  uring::ring r(exec);
  const auto data = byte_pattern(3000, 4);
  std::vector<std::size_t> written(2, 99);
  const std::vector<uring::write_block> writes{{data, 0, &written[0]},
                                               {std::span<const std::byte>(), 0, &written[1]}};
  std::vector<ferry::transfer> wt(2);
  r.write_batch(fd.get(), writes, wt);
  REQUIRE(wt[0].wait_for(hang_bound) == transfer_state::success);
  CHECK(wt[1].error() == ferry::errc::empty_buffer);
  CHECK(written == std::vector<std::size_t>{3000, 0});
  // A whole block, one past the end of the file (end_of_file after 1000 bytes), an empty one.
  std::vector<std::byte> a(1000), b(2000), c;
  std::vector<std::size_t> read(3, 99);
  const std::vector<uring::read_block> reads{
      {a, 0, &read[0]}, {b, 2000, &read[1]}, {c, 0, &read[2]}};
  std::vector<ferry::transfer> rt(3);
  r.read_batch(fd.get(), reads, rt);
  REQUIRE(ferry::drain(rt, hang_bound).verdict != verdict::pending);
  CHECK(rt[0].state() == transfer_state::success);
  CHECK(rt[1].error() == uring::errc::end_of_file);
  CHECK(read == std::vector<std::size_t>{1000, 1000, 0});
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
  const one_pipe pipe;
  const fd_guard &rd = pipe.rd, &wr = pipe.wr;
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

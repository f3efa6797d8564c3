// basic_memory_region::register_dmabuf over the in-process fake adapter, given fake dma-bufs
// (ferry/testing/fake_dmabuf.hpp) whose host memory stands in for GPU memory: WRITEs and READs
// move the bytes behind the dma-buf, and bad descriptors and ranges are refused by name.

#include <catch2/catch.hpp>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include <ferry/ferry.hpp>
#include <ferry/testing/fake_dmabuf.hpp>
#include <ferry/testing/verbs.hpp>
#include <ferry/verbs/device.hpp>
#include <ferry/verbs/memory_region.hpp>

#include "helpers.hpp"
#include "verbs/verbs_helpers.hpp"

namespace {

using namespace ferry_test::verbs;
using ferry::testing::fake_dmabuf;

// The std::system_error `f` throws (failing the test when it throws none).
template <class F>
std::system_error thrown_by(F f) {
  try {
    f();
  } catch (const std::system_error& e) {
    return e;
  }
  FAIL("no std::system_error thrown");
  return std::system_error(std::error_code());
}

}  // namespace

TEST_CASE("verbs: a WRITE into a dma-buf region lands in the memory behind the dma-buf, and a READ "
          "from the other side brings it back byte-exact",
          "[verbs]") {
  rig r;
  // "Device memory" on b, exported as a dma-buf and registered through it, offset into the dma-buf.
  std::vector<std::byte> gpu_b(3 * 4096);
  fake_dmabuf exported(gpu_b.data(), gpu_b.size());
  const std::uint64_t offset = 4096;
  const std::size_t n = 2 * 4096;
  const std::uint64_t device_address = exported.device_address() + offset;
  const region on_b =
      region::register_dmabuf(*r.b, exported.fd(), offset, n, device_address);
  CHECK(on_b.is_dmabuf());
  CHECK_FALSE(r.b_mem->is_dmabuf());
  CHECK(on_b.size() == n);
  CHECK(on_b.remote().address == device_address);
  CHECK(reinterpret_cast<std::uintptr_t>(on_b.data()) == device_address);
  // The region keeps the dma-buf's memory in the kernel's model: the descriptor may go at once.
  exported.close();

  fill_pattern(r.a_mem->bytes().first(n), 11);
  auto w = r.a_qp->write(r.a_mem->slice(0, n), on_b.remote().slice(0, n));
  REQUIRE(w.wait_for(hang_bound) == transfer_state::success);
  CHECK(has_pattern(std::span(gpu_b).subspan(offset, n), 11));
  // Nothing before the registered range was touched.
  CHECK(std::all_of(gpu_b.begin(), gpu_b.begin() + static_cast<std::ptrdiff_t>(offset),
                    [](std::byte b) { return b == std::byte{0}; }));

  std::memset(r.a_mem->data(), 0, n);
  auto g = r.a_qp->read(r.a_mem->slice(0, n), on_b.remote().slice(0, n));
  REQUIRE(g.wait_for(hang_bound) == transfer_state::success);
  CHECK(has_pattern(r.a_mem->bytes().first(n), 11));
}

TEST_CASE("verbs: a dma-buf region addressed by an iova other than where its bytes are is read and "
          "written through that iova, as local slices and as the peer's target",
          "[verbs]") {
  rig r;
  std::vector<std::byte> gpu_a(8192);
  std::vector<std::byte> gpu_b(8192);
  fake_dmabuf da(gpu_a.data(), gpu_a.size());
  fake_dmabuf db(gpu_b.data(), gpu_b.size());
  // Device addresses that are not host addresses of this process (a GPU's own address space).
  const std::uint64_t iova_a = 0x7f0000000000ull;
  const std::uint64_t iova_b = 0x100000000000ull;
  const region on_a = region::register_dmabuf(*r.a, da.fd(), 0, gpu_a.size(), iova_a);
  const region on_b = region::register_dmabuf(*r.b, db.fd(), 0, gpu_b.size(), iova_b);
  CHECK(reinterpret_cast<std::uintptr_t>(on_a.slice(100, 8).data()) == iova_a + 100);

  // dma-buf to dma-buf: a's local slice is posted at its iova, b's remote range named by its iova.
  fill_pattern(gpu_a, 23);
  auto w = r.a_qp->write(on_a.slice(512, 4096), on_b.remote().slice(1024, 4096));
  REQUIRE(w.wait_for(hang_bound) == transfer_state::success);
  CHECK(std::memcmp(gpu_b.data() + 1024, gpu_a.data() + 512, 4096) == 0);

  // Host memory on b read into a's dma-buf region.
  fill_pattern(r.b_mem->bytes().first(2048), 31);
  auto g = r.a_qp->read(on_a.slice(0, 2048), r.b_mem->remote().slice(0, 2048));
  REQUIRE(g.wait_for(hang_bound) == transfer_state::success);
  CHECK(has_pattern(std::span(gpu_a).first(2048), 31));

  // An address past the iova range is outside the region, even where host memory lies there.
  fv::remote_region past = on_b.remote();
  past.address = reinterpret_cast<std::uintptr_t>(gpu_b.data());
  auto bad = r.a_qp->write(r.a_mem->slice(0, 64), past.slice(0, 64));
  CHECK(bad.wait_for(hang_bound) == transfer_state::failed);
}

TEST_CASE("verbs: register_dmabuf refuses an unknown descriptor with EBADF, and zero bytes or a "
          "range past the dma-buf with EINVAL, naming ibv_reg_dmabuf_mr",
          "[verbs]") {
  ferry::progress_executor exec;
  fv::device_options o;
  o.name = fresh_device("dmabuf_refusals");
  device dev(exec, o);
  std::vector<std::byte> gpu(4096);
  fake_dmabuf exported(gpu.data(), gpu.size());
  const std::uint64_t at = exported.device_address();

  // A descriptor that is open but no dma-buf, one that is not open, and one closed since export.
  int pipe_fds[2];
  REQUIRE(::pipe(pipe_fds) == 0);
  for (const int fd : {pipe_fds[0], -1, 1 << 20}) {
    CAPTURE(fd);
    const auto e = thrown_by([&] { (void)region::register_dmabuf(dev, fd, 0, 64, at); });
    CHECK(e.code() == std::error_code(EBADF, std::system_category()));
    CHECK(std::string(e.what()).find("ibv_reg_dmabuf_mr(fd " + std::to_string(fd)) !=
          std::string::npos);
  }
  ::close(pipe_fds[0]);
  ::close(pipe_fds[1]);
  {
    fake_dmabuf gone(gpu.data(), gpu.size());
    const int fd = gone.fd();
    gone.close();
    const auto e = thrown_by([&] { (void)region::register_dmabuf(dev, fd, 0, 64, at); });
    CHECK(e.code() == std::error_code(EBADF, std::system_category()));
  }

  struct range {
    std::uint64_t offset;
    std::size_t length;
  };
  for (const range bad : {range{0, 0}, range{0, 4097}, range{4096, 1}, range{1, 4096},
                          range{~std::uint64_t{0}, 2}}) {
    CAPTURE(bad.offset, bad.length);
    const auto e = thrown_by(
        [&] { (void)region::register_dmabuf(dev, exported.fd(), bad.offset, bad.length, at); });
    CHECK(e.code() == std::error_code(EINVAL, std::system_category()));
    const std::string what = e.what();
    CHECK(what.find("ibv_reg_dmabuf_mr") != std::string::npos);
    CHECK(what.find(std::to_string(bad.length) + " bytes") != std::string::npos);
  }
  // The whole dma-buf, and its last byte, are inside it.
  CHECK(region::register_dmabuf(dev, exported.fd(), 0, 4096, at).size() == 4096);
  CHECK(region::register_dmabuf(dev, exported.fd(), 4095, 1, at + 4095).size() == 1);
}

TEST_CASE("fake_dmabuf: exports are looked up by descriptor from any thread, end when closed, and "
          "bad memory is refused",
          "[verbs]") {
  std::vector<std::byte> mem(64);
  CHECK_THROWS_AS(fake_dmabuf(nullptr, 64), std::invalid_argument);
  CHECK_THROWS_AS(fake_dmabuf(mem.data(), 0), std::invalid_argument);

  fake_dmabuf a(mem.data(), mem.size());
  REQUIRE(a.fd() >= 0);
  const auto found = fake_dmabuf::lookup(a.fd());
  REQUIRE(found);
  CHECK(found->base == mem.data());
  CHECK(found->length == 64);
  CHECK(::lseek(a.fd(), 0, SEEK_END) == 64);  // the token has the dma-buf's size

  // Moving keeps the export; the moved-from handle owns nothing.
  fake_dmabuf b(std::move(a));
  CHECK(a.fd() == -1);  // NOLINT(bugprone-use-after-move): the moved-from state is the guarantee
  CHECK(fake_dmabuf::lookup(b.fd()));

  const int closed = b.fd();
  b.close();
  CHECK(b.fd() == -1);
  CHECK_FALSE(fake_dmabuf::lookup(closed));

  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 200; ++i) {
        fake_dmabuf d(mem.data() + i % 32, 32);
        const auto e = fake_dmabuf::lookup(d.fd());
        if (!e || e->base != mem.data() + i % 32 || e->length != 32) failures.fetch_add(1);
      }
    });
  }
  for (auto& t : threads) t.join();
  CHECK(failures.load() == 0);

  // A descriptor closed behind the registry's back, its number reused for another file, is not
  // the export. (The export's own close then closes the reused number, which it owns by then.)
  fake_dmabuf c(mem.data(), mem.size());
  const int fd = c.fd();
  ::close(fd);
  REQUIRE(::dup2(0, fd) == fd);
  CHECK_FALSE(fake_dmabuf::lookup(fd));
}

// worker::register_memory with a memory type, against the UCX installed here: GPU memory types this
// UCX was built without are refused by name before anything is mapped, and host memory registered
// through the typed overload carries puts and gets like any other region.

#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

#include <ferry/ferry.hpp>
#include <ferry/ucx.hpp>

#include "helpers.hpp"
#include "ucx/side.hpp"

using namespace ferry_test;
using ferry::transfer_state;
namespace ucx = ferry::ucx;

namespace {

using ucx_side::side;

bool supports(ucx::worker& w, ucx::memory_type t) {
  return (w.engine().context()->memory_types() &
          (std::uint64_t{1} << static_cast<unsigned>(ucx::to_ucs(t)))) != 0;
}

}  // namespace

TEST_CASE("ucx: memory types are named and map onto UCX's own values", "[ucx]") {
  CHECK(std::string(ucx::memory_type_name(ucx::memory_type::host)) == "host");
  CHECK(std::string(ucx::memory_type_name(ucx::memory_type::cuda)) == "cuda");
  CHECK(std::string(ucx::memory_type_name(ucx::memory_type::cuda_managed)) == "cuda_managed");
  CHECK(std::string(ucx::memory_type_name(ucx::memory_type::rocm)) == "rocm");
  CHECK(std::string(ucx::memory_type_name(ucx::memory_type::rocm_managed)) == "rocm_managed");
  CHECK(std::string(ucx::memory_type_name(static_cast<ucx::memory_type>(99))) == "unknown");
  CHECK(ucx::to_ucs(ucx::memory_type::cuda) == UCS_MEMORY_TYPE_CUDA);
  CHECK(ucx::to_ucs(ucx::memory_type::rocm_managed) == UCS_MEMORY_TYPE_ROCM_MANAGED);
  CHECK(ucx::memory_region().memory_type() == ucx::memory_type::host);
}

TEST_CASE("ucx: registering GPU memory on a UCX built without it fails with "
          "memory_type_unsupported, naming the type, the bytes, what this UCX supports and the "
          "fix, and maps nothing",
          "[ucx]") {
  side s("tcp");
  REQUIRE(supports(s.worker, ucx::memory_type::host));
  // Host bytes passed off as device memory: were the type not checked, UCX could map them as
  // whatever it found them to be.
  std::vector<std::byte> stand_in(12345);
  int refused = 0;
  for (const ucx::memory_type t : {ucx::memory_type::cuda, ucx::memory_type::cuda_managed,
                                   ucx::memory_type::rocm, ucx::memory_type::rocm_managed}) {
    const std::string name = ucx::memory_type_name(t);
    CAPTURE(name);
    if (supports(s.worker, t)) {
      WARN("this UCX supports " << name << " memory: its refusal is not tested here");
      continue;
    }
    ++refused;
    try {
      (void)s.worker.register_memory(stand_in.data(), stand_in.size(), t);
      FAIL("registering " << name << " memory succeeded on a UCX without it");
    } catch (const std::system_error& e) {
      CHECK(e.code() == ucx::errc::memory_type_unsupported);
      const std::string what = e.what();
      CAPTURE(what);
      CHECK(what.find("12345 bytes of " + name + " memory") != std::string::npos);
      CHECK(what.find("supports host") != std::string::npos);
      const bool nvidia = name.rfind("cuda", 0) == 0;
      CHECK(what.find(nvidia ? "--with-cuda" : "--with-rocm") != std::string::npos);
      CHECK(what.find("does not stage device memory") != std::string::npos);
    }
  }
  // Debian's UCX, which this project's CI uses, is built without CUDA and ROCm.
  if (refused == 0) WARN("every GPU memory type is supported here: nothing was refused");
  // The worker is unharmed: host memory still registers.
  const auto ok = s.worker.register_memory(stand_in.data(), stand_in.size(), ucx::memory_type::host);
  CHECK(ok.memory_type() == ucx::memory_type::host);
  CHECK_THROWS_AS(s.worker.register_memory(stand_in.data(), 0, ucx::memory_type::host),
                  std::invalid_argument);
  CHECK_THROWS_AS(s.worker.register_memory(stand_in.data(), stand_in.size(),
                                           static_cast<ucx::memory_type>(99)),
                  std::invalid_argument);
  CHECK_THROWS_AS(s.worker.register_memory(stand_in.data(), stand_in.size(),
                                           static_cast<ucx::memory_type>(-1)),
                  std::invalid_argument);
}

TEST_CASE("ucx: host memory registered with memory_type::host carries puts and gets byte-exact",
          "[ucx]") {
  for (const char* transports : {"tcp", "shm"}) {
    CAPTURE(transports);
    side a(transports), b(transports);
    auto ab = a.worker.connect(b.worker.address());
    auto ba = b.worker.connect(a.worker.address());
    const std::size_t n = std::size_t{1} << 20;
    std::vector<std::byte> at_a(n), at_b(n);
    const auto local = a.worker.register_memory(at_a.data(), n, ucx::memory_type::host);
    const auto target = b.worker.register_memory(at_b.data(), n, ucx::memory_type::host);
    CHECK(local.memory_type() == ucx::memory_type::host);
    CHECK(local.bytes().data() == at_a.data());
    const auto remote = ab.import(ucx::remote_region::from_bytes(target.describe().to_bytes()));

    for (std::size_t i = 0; i < n; ++i) at_a[i] = static_cast<std::byte>((i * 131) >> 3);
    auto put = ab.put(local.slice(0, n), remote.slice(0, n), 60s);
    REQUIRE(put.wait_for(hang_bound * 6) == transfer_state::success);
    CHECK(std::memcmp(at_b.data(), at_a.data(), n) == 0);

    for (std::size_t i = 0; i < n; ++i) at_b[i] = static_cast<std::byte>((i * 7) >> 2);
    std::memset(at_a.data(), 0, n);
    auto get = ab.get(local.slice(4096, n - 4096), remote.slice(0, n - 4096), 60s);
    REQUIRE(get.wait_for(hang_bound * 6) == transfer_state::success);
    CHECK(std::memcmp(at_a.data() + 4096, at_b.data(), n - 4096) == 0);
  }
}

// The GPU copy backend on a real GPU, through the runtime this build targets (HIP, or CUDA with
// FERRY_GPU_CUDA): byte-exact copies of every kind, 1000 copies in flight across streams, a when_all
// over a layer's copies, and a copy from an invalid pointer failing with a clear error. Where no GPU
// is present it exits 77, which meson test reports as skipped, and says why.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include <ferry/ferry.hpp>
#include <ferry/gpu.hpp>

namespace {

using namespace std::chrono_literals;
namespace fh = ferry::gpu;
using rt = fh::gpu_runtime;

int failures = 0;

void check(bool ok, const std::string& what) {
  std::printf("%s %s\n", ok ? "ok:  " : "FAIL:", what.c_str());
  if (!ok) ++failures;
}

void require(int e, const char* what) {
  if (e != rt::success) {
    throw std::runtime_error(std::string(what) + ": " + fh::make_runtime_error<rt>(e).message());
  }
}

// Device memory for the test's lifetime.
struct device_buffer {
  explicit device_buffer(std::size_t n) : size(n) { require(rt::malloc_device(&ptr, n), "malloc_device"); }
  ~device_buffer() { rt::free_device(ptr); }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  void* ptr = nullptr;
  std::size_t size;
};

std::vector<std::byte> pattern(std::size_t n, unsigned seed) {
  std::vector<std::byte> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<std::byte>((i * 131 + seed) >> 3);
  return v;
}

bool ok(const ferry::transfer& t) { return t.wait_for(30s) == ferry::transfer_state::success; }

}  // namespace

int main() {
  int devices = 0;
  const int e = rt::device_count(devices);
  if (e != rt::success || devices == 0) {
    std::printf("SKIP: no GPU found by the %s runtime (%s); the backend's event polling is tested "
                "against the fake runtime in ferry_tests [hip]\n",
                rt::name(), e != rt::success ? fh::make_runtime_error<rt>(e).message().c_str() : "0 devices");
    return 77;
  }
  try {
    ferry::progress_executor exec;
    fh::copy_engine engine(exec);
    std::printf("%s runtime, %d device(s)\n", rt::name(), devices);

    // Every kind, byte-exact: host → device → device → host.
    constexpr std::size_t n = std::size_t{8} << 20;
    const std::vector<std::byte> src = pattern(n, 1);
    std::vector<std::byte> back(n);
    device_buffer d1(n), d2(n);
    check(ok(engine.copy(d1.ptr, src.data(), n, fh::copy_kind::host_to_device)), "host-to-device");
    check(ok(engine.copy(d2.ptr, d1.ptr, n, fh::copy_kind::device_to_device)), "device-to-device");
    check(ok(engine.copy(back.data(), d2.ptr, n, fh::copy_kind::device_to_host)) && back == src,
          "device-to-host brings back exactly what went in (8 MiB)");
    if (devices >= 2) {
      require(rt::set_device(1), "set_device(1)");
      device_buffer peer(n);
      rt::enable_peer_access(0);
      require(rt::set_device(0), "set_device(0)");
      rt::enable_peer_access(1);
      std::vector<std::byte> again(n);
      const bool moved = ok(engine.copy(peer.ptr, d2.ptr, n, fh::copy_kind::peer)) &&
                         ok(engine.copy(again.data(), peer.ptr, n, fh::copy_kind::device_to_host));
      check(moved && again == src, "peer copy to device 1 and back, byte-exact");
    } else {
      std::printf("note: one device only, so the peer copy was not run\n");
    }

    // 1000 copies in flight across the engine's streams.
    constexpr std::size_t block = 64 << 10;
    device_buffer many(1000 * block);
    std::vector<ferry::transfer> ts;
    for (std::size_t i = 0; i < 1000; ++i) {
      ts.push_back(engine.copy(static_cast<std::byte*>(many.ptr) + i * block,
                               static_cast<const std::byte*>(d1.ptr) + (i % 64) * block, block,
                               fh::copy_kind::device_to_device));
    }
    bool all = true;
    for (const ferry::transfer& t : ts) all = ok(t) && all;
    std::vector<std::byte> sample(block);
    all = all && ok(engine.copy(sample.data(), static_cast<std::byte*>(many.ptr) + 999 * block, block,
                                fh::copy_kind::device_to_host));
    check(all && std::memcmp(sample.data(), src.data() + (999 % 64) * block, block) == 0,
          "1000 copies in flight across " + std::to_string(engine.streams()) + " streams");

    // A layer's copies under one when_all with one deadline.
    std::vector<ferry::transfer> layer;
    for (std::size_t i = 0; i < 64; ++i) {
      layer.push_back(engine.copy(static_cast<std::byte*>(d2.ptr) + i * block,
                                  static_cast<const std::byte*>(d1.ptr) + i * block, block,
                                  fh::copy_kind::device_to_device));
    }
    const ferry::batch_result r = ferry::wait_all(std::span<const ferry::transfer>(layer), 30s);
    check(r.ok(), "wait_all over a layer's 64 copies");

    // An invalid pointer: a clear error, not a crash or a hang.
    auto* bogus = reinterpret_cast<void*>(std::uintptr_t{0x10});
    ferry::transfer bad = engine.copy(d1.ptr, bogus, 4096, fh::copy_kind::device_to_device);
    const bool failed = bad.wait_for(30s) == ferry::transfer_state::failed;
    std::printf("      invalid pointer: %s\n", bad.error().message().c_str());
    check(failed && bad.error().category() == fh::runtime_category<rt>(),
          "a copy from an invalid pointer fails with the runtime's error");
  } catch (const std::exception& ex) {
    std::printf("FAIL: %s\n", ex.what());
    return 1;
  }
  std::printf("%s\n", failures == 0 ? "all passed" : "FAILED");
  return failures == 0 ? 0 : 1;
}

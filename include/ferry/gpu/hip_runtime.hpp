#pragma once
// The GPU runtime calls the copy backend makes, gathered in one place, as a struct of static
// functions over plain int error codes. `hip_runtime` (here) forwards to the HIP runtime on AMD
// GPUs; `cuda_runtime` (cuda_runtime.hpp) forwards the same calls to the CUDA runtime on NVIDIA
// GPUs, since Debian's HIP 5.2 headers for NVIDIA do not compile against CUDA 13; `fake::runtime`
// (ferry/testing/fake_gpu.hpp) answers them in process for tests. The backend is a template over the choice, made at
// build time (ferry/gpu.hpp), so one backend serves all three.

#include <cstddef>

#if !defined(__HIP_PLATFORM_AMD__) && !defined(__HIP_PLATFORM_HCC__)
#define __HIP_PLATFORM_AMD__ 1
#endif
#include <hip/hip_runtime_api.h>

#include "ferry/gpu/copy_kind.hpp"

namespace ferry::gpu {

struct hip_runtime {
  using stream_handle = hipStream_t;
  using event_handle = hipEvent_t;

  static constexpr int success = hipSuccess;
  static constexpr int not_ready = hipErrorNotReady;

  [[nodiscard]] static const char* name() noexcept { return "hip"; }
  [[nodiscard]] static const char* error_name(int e) noexcept {
    return ::hipGetErrorName(static_cast<hipError_t>(e));
  }
  [[nodiscard]] static const char* error_string(int e) noexcept {
    return ::hipGetErrorString(static_cast<hipError_t>(e));
  }

  static int device_count(int& n) noexcept { return ::hipGetDeviceCount(&n); }
  // The current device is per thread.
  static int get_device(int& d) noexcept { return ::hipGetDevice(&d); }
  static int set_device(int d) noexcept { return ::hipSetDevice(d); }
  static int enable_peer_access(int peer) noexcept { return ::hipDeviceEnablePeerAccess(peer, 0); }

  // Non-blocking streams: they never wait on the legacy default stream.
  static int stream_create(stream_handle& s) noexcept {
    return ::hipStreamCreateWithFlags(&s, hipStreamNonBlocking);
  }
  static int stream_destroy(stream_handle s) noexcept { return ::hipStreamDestroy(s); }
  static int stream_synchronize(stream_handle s) noexcept { return ::hipStreamSynchronize(s); }

  // Events without timing: recording and querying them is cheapest.
  static int event_create(event_handle& e) noexcept {
    return ::hipEventCreateWithFlags(&e, hipEventDisableTiming);
  }
  static int event_destroy(event_handle e) noexcept { return ::hipEventDestroy(e); }
  static int event_record(event_handle e, stream_handle s) noexcept { return ::hipEventRecord(e, s); }
  // success, not_ready, or the error the work before the event hit.
  static int event_query(event_handle e) noexcept { return ::hipEventQuery(e); }
  static int event_synchronize(event_handle e) noexcept { return ::hipEventSynchronize(e); }

  static int memcpy_async(void* dst, const void* src, std::size_t n, copy_kind kind,
                          stream_handle s) noexcept {
    return ::hipMemcpyAsync(dst, src, n, native(kind), s);
  }

  // For tests and benchmarks.
  static int malloc_device(void** p, std::size_t n) noexcept { return ::hipMalloc(p, n); }
  static int free_device(void* p) noexcept { return ::hipFree(p); }
  static int malloc_host(void** p, std::size_t n) noexcept { return ::hipHostMalloc(p, n, 0); }
  static int free_host(void* p) noexcept { return ::hipHostFree(p); }
  static int memset_device(void* p, int value, std::size_t n) noexcept { return ::hipMemset(p, value, n); }
  static int device_synchronize() noexcept { return ::hipDeviceSynchronize(); }

 private:
  static hipMemcpyKind native(copy_kind k) noexcept {
    switch (k) {
      case copy_kind::device_to_device: return hipMemcpyDeviceToDevice;
      case copy_kind::host_to_device: return hipMemcpyHostToDevice;
      case copy_kind::device_to_host: return hipMemcpyDeviceToHost;
      case copy_kind::peer: break;
    }
    return hipMemcpyDefault;  // peer: unified addressing finds both devices
  }
};

}  // namespace ferry::gpu

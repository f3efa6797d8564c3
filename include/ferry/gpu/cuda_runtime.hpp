#pragma once
// The thin mapping of the GPU runtime calls ferry makes onto the CUDA runtime, for NVIDIA builds:
// the same functions as hip_runtime (hip_runtime.hpp), so the copy backend is the same code. Built only
// where the CUDA toolkit is found (Meson's `hip` feature, or bench/gpu_check.sh); link with -lcudart.

#include <cstddef>

#include <cuda_runtime_api.h>

#include "ferry/gpu/copy_kind.hpp"

namespace ferry::gpu {

struct cuda_runtime {
  using stream_handle = cudaStream_t;
  using event_handle = cudaEvent_t;

  static constexpr int success = cudaSuccess;
  static constexpr int not_ready = cudaErrorNotReady;

  [[nodiscard]] static const char* name() noexcept { return "cuda"; }
  [[nodiscard]] static const char* error_name(int e) noexcept {
    return ::cudaGetErrorName(static_cast<cudaError_t>(e));
  }
  [[nodiscard]] static const char* error_string(int e) noexcept {
    return ::cudaGetErrorString(static_cast<cudaError_t>(e));
  }

  static int device_count(int& n) noexcept { return ::cudaGetDeviceCount(&n); }
  static int get_device(int& d) noexcept { return ::cudaGetDevice(&d); }
  static int set_device(int d) noexcept { return ::cudaSetDevice(d); }
  static int enable_peer_access(int peer) noexcept { return ::cudaDeviceEnablePeerAccess(peer, 0); }

  static int stream_create(stream_handle& s) noexcept {
    return ::cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  }
  static int stream_destroy(stream_handle s) noexcept { return ::cudaStreamDestroy(s); }
  static int stream_synchronize(stream_handle s) noexcept { return ::cudaStreamSynchronize(s); }

  static int event_create(event_handle& e) noexcept {
    return ::cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
  }
  static int event_destroy(event_handle e) noexcept { return ::cudaEventDestroy(e); }
  static int event_record(event_handle e, stream_handle s) noexcept { return ::cudaEventRecord(e, s); }
  static int event_query(event_handle e) noexcept { return ::cudaEventQuery(e); }
  static int event_synchronize(event_handle e) noexcept { return ::cudaEventSynchronize(e); }

  static int memcpy_async(void* dst, const void* src, std::size_t n, copy_kind kind,
                          stream_handle s) noexcept {
    return ::cudaMemcpyAsync(dst, src, n, native(kind), s);
  }

  static int malloc_device(void** p, std::size_t n) noexcept { return ::cudaMalloc(p, n); }
  static int free_device(void* p) noexcept { return ::cudaFree(p); }
  static int malloc_host(void** p, std::size_t n) noexcept { return ::cudaMallocHost(p, n); }
  static int free_host(void* p) noexcept { return ::cudaFreeHost(p); }
  static int memset_device(void* p, int value, std::size_t n) noexcept { return ::cudaMemset(p, value, n); }
  static int device_synchronize() noexcept { return ::cudaDeviceSynchronize(); }

 private:
  static cudaMemcpyKind native(copy_kind k) noexcept {
    switch (k) {
      case copy_kind::device_to_device: return cudaMemcpyDeviceToDevice;
      case copy_kind::host_to_device: return cudaMemcpyHostToDevice;
      case copy_kind::device_to_host: return cudaMemcpyDeviceToHost;
      case copy_kind::peer: break;
    }
    return cudaMemcpyDefault;
  }
};

}  // namespace ferry::gpu

#pragma once
// The thin mapping of the GPU runtime calls ferry makes onto the CUDA runtime, for NVIDIA builds:
// the same functions as hip_runtime (hip_runtime.hpp), so the copy backend is the same code. Built only
// where the CUDA toolkit is found (Meson's `hip` feature, or bench/gpu_check.sh); link with -lcudart.

#include <cstddef>

#include <cuda_runtime_api.h>

#include "ferry/gpu/copy_kind.hpp"

namespace ferry::gpu {

/// The GPU runtime calls of the copy backend, forwarded to the CUDA runtime (NVIDIA GPUs).
/// Static functions returning the runtime's error code as an int (success, not_ready, or an error).
struct cuda_runtime {
  /// The runtime's stream.
  using stream_handle = cudaStream_t;
  /// The runtime's event.
  using event_handle = cudaEvent_t;

  /// The code of a call that succeeded.
  static constexpr int success = cudaSuccess;
  /// What event_query returns while the work before the event is unfinished.
  static constexpr int not_ready = cudaErrorNotReady;

  /// The runtime's name, "cuda".
  [[nodiscard]] static const char* name() noexcept { return "cuda"; }
  /// The name of error code `e` (the runtime's static string).
  [[nodiscard]] static const char* error_name(int e) noexcept {
    return ::cudaGetErrorName(static_cast<cudaError_t>(e));
  }
  /// The runtime's description of error code `e`.
  [[nodiscard]] static const char* error_string(int e) noexcept {
    return ::cudaGetErrorString(static_cast<cudaError_t>(e));
  }

  /// Sets `n` to the number of GPUs visible.
  static int device_count(int& n) noexcept { return ::cudaGetDeviceCount(&n); }
  /// Sets `d` to the calling thread's current device (per thread).
  static int get_device(int& d) noexcept { return ::cudaGetDevice(&d); }
  /// Makes GPU `d` the calling thread's current device.
  static int set_device(int d) noexcept { return ::cudaSetDevice(d); }
  /// Lets the current device reach GPU `peer`'s memory (for peer copies).
  static int enable_peer_access(int peer) noexcept { return ::cudaDeviceEnablePeerAccess(peer, 0); }

  /// Makes a non-blocking stream into `s` (it never waits on the legacy default stream).
  static int stream_create(stream_handle& s) noexcept {
    return ::cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  }
  /// Destroys a stream (after its work has finished).
  static int stream_destroy(stream_handle s) noexcept { return ::cudaStreamDestroy(s); }
  /// Blocks until everything enqueued on the stream has finished.
  static int stream_synchronize(stream_handle s) noexcept { return ::cudaStreamSynchronize(s); }

  /// Makes an event without timing into `e` (cheapest to record and query).
  static int event_create(event_handle& e) noexcept {
    return ::cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
  }
  /// Destroys an event.
  static int event_destroy(event_handle e) noexcept { return ::cudaEventDestroy(e); }
  /// Records `e` on `s`: it becomes ready when the work enqueued before it has finished.
  static int event_record(event_handle e, stream_handle s) noexcept { return ::cudaEventRecord(e, s); }
  /// Whether the event is ready: success, not_ready, or the error the work before it hit.
  static int event_query(event_handle e) noexcept { return ::cudaEventQuery(e); }
  /// Blocks until the event is ready.
  static int event_synchronize(event_handle e) noexcept { return ::cudaEventSynchronize(e); }

  /// Enqueues a copy of `n` bytes from `src` to `dst` on stream `s`.
  static int memcpy_async(void* dst, const void* src, std::size_t n, copy_kind kind,
                          stream_handle s) noexcept {
    return ::cudaMemcpyAsync(dst, src, n, native(kind), s);
  }

  /// Allocates `n` bytes of device memory into `*p` (for tests and benchmarks).
  static int malloc_device(void** p, std::size_t n) noexcept { return ::cudaMalloc(p, n); }
  /// Frees device memory from malloc_device.
  static int free_device(void* p) noexcept { return ::cudaFree(p); }
  /// Allocates `n` bytes of pinned host memory into `*p`.
  static int malloc_host(void** p, std::size_t n) noexcept { return ::cudaMallocHost(p, n); }
  /// Frees pinned host memory from malloc_host.
  static int free_host(void* p) noexcept { return ::cudaFreeHost(p); }
  /// Sets `n` bytes of device memory to `value`.
  static int memset_device(void* p, int value, std::size_t n) noexcept { return ::cudaMemset(p, value, n); }
  /// Blocks until everything on the current device has finished.
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

#pragma once
// The thin mapping of the GPU runtime calls ferry makes onto the CUDA runtime, for NVIDIA builds:
// the same functions as hip_runtime (hip_runtime.hpp), so the copy backend and the layer gate are the
// same code. Built only where the CUDA toolkit is found (Meson's `gpu` feature, or bench/gpu_check.sh);
// link with -lcudart. The driver calls the layer gate needs (stream memory operations, loading its
// kernel) are reached through cudaGetDriverEntryPointByVersion, so nothing links against libcuda: the
// toolkit's headers suffice to build, and the driver installed on the GPU machine answers.

#include <cstddef>
#include <cstdint>

#include <cuda.h>
#include <cudaTypedefs.h>
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

  /// The layer gate's kernel, loaded from PTX into the current device's primary context.
  struct kernel_handle {
    CUmodule module = nullptr;  ///< the module the PTX was loaded into
    CUfunction function = nullptr;  ///< ferry_gate_wait in it
  };
  /// A captured graph.
  using graph_handle = cudaGraph_t;
  /// An instantiated graph.
  using graph_exec_handle = cudaGraphExec_t;

  /// The layer gate's kernel in PTX (ISA 6.3, sm_70 and later; the driver compiles it for the GPU
  /// it runs on). One thread reads the epoch word once, then waits, sleeping 200 ns between looks,
  /// until the gate word reaches it cyclically, with an acquire load at system scope (the host
  /// writes the gate word).
  static constexpr const char* gate_kernel_ptx = R"(.version 6.3
.target sm_70
.address_size 64

.visible .entry ferry_gate_wait(.param .u64 gate, .param .u64 epoch)
{
  .reg .pred %p<2>;
  .reg .b32 %r<4>;
  .reg .b64 %rd<5>;
  ld.param.u64 %rd1, [gate];
  ld.param.u64 %rd2, [epoch];
  cvta.to.global.u64 %rd3, %rd1;
  cvta.to.global.u64 %rd4, %rd2;
  ld.volatile.global.u32 %r1, [%rd4];
WAIT:
  ld.acquire.sys.global.u32 %r2, [%rd3];
  sub.s32 %r3, %r2, %r1;
  setp.ge.s32 %p1, %r3, 0;
  @%p1 bra DONE;
  nanosleep.u32 200;
  bra.uni WAIT;
DONE:
  ret;
}
)";

  /// Enqueues on `s` a wait until the word at `word` (device address) reaches `value`, cyclically
  /// (cuStreamWaitValue32, CU_STREAM_WAIT_VALUE_GEQ).
  static int stream_wait_value32(stream_handle s, void* word, std::uint32_t value) noexcept {
    static const auto fn = driver<PFN_cuStreamWaitValue32_v11070>("cuStreamWaitValue32");
    if (fn == nullptr) return cudaErrorNotSupported;
    return fn(s, reinterpret_cast<CUdeviceptr>(word), value, CU_STREAM_WAIT_VALUE_GEQ);
  }
  /// Enqueues on `s` a write of `value` to the word at `word` (cuStreamWriteValue32).
  static int stream_write_value32(stream_handle s, void* word, std::uint32_t value) noexcept {
    static const auto fn = driver<PFN_cuStreamWriteValue32_v11070>("cuStreamWriteValue32");
    if (fn == nullptr) return cudaErrorNotSupported;
    return fn(s, reinterpret_cast<CUdeviceptr>(word), value, CU_STREAM_WRITE_VALUE_DEFAULT);
  }

  /// Loads the layer gate's kernel (gate_kernel_ptx) on the current device.
  static int gate_kernel_load(kernel_handle& k) noexcept {
    static const auto load = driver<PFN_cuModuleLoadData_v2000>("cuModuleLoadData");
    static const auto get = driver<PFN_cuModuleGetFunction_v2000>("cuModuleGetFunction");
    if (load == nullptr || get == nullptr) return cudaErrorNotSupported;
    // The primary context must exist before a driver call uses it.
    if (const cudaError_t e = ::cudaFree(nullptr); e != cudaSuccess) return e;
    if (const CUresult e = load(&k.module, gate_kernel_ptx); e != CUDA_SUCCESS) return e;
    if (const CUresult e = get(&k.function, k.module, "ferry_gate_wait"); e != CUDA_SUCCESS) {
      gate_kernel_unload(k);
      return e;
    }
    return cudaSuccess;
  }
  /// Unloads the layer gate's kernel.
  static int gate_kernel_unload(kernel_handle& k) noexcept {
    static const auto unload = driver<PFN_cuModuleUnload_v2000>("cuModuleUnload");
    if (unload == nullptr || k.module == nullptr) return cudaSuccess;
    const CUresult e = unload(k.module);
    k = {};
    return e;
  }
  /// Launches the layer gate's kernel (one thread) on `s`: it holds the stream until the word at
  /// `word` reaches the epoch at `epoch`, read when it starts. Capturable into a graph.
  static int launch_gate_wait(const kernel_handle& k, stream_handle s, const void* word,
                              const void* epoch) noexcept {
    static const auto launch = driver<PFN_cuLaunchKernel_v4000>("cuLaunchKernel");
    if (launch == nullptr) return cudaErrorNotSupported;
    CUdeviceptr w = reinterpret_cast<CUdeviceptr>(word);
    CUdeviceptr e = reinterpret_cast<CUdeviceptr>(epoch);
    void* args[] = {&w, &e};
    return launch(k.function, 1, 1, 1, 1, 1, 1, 0, s, args, nullptr);
  }

  /// Starts capturing `s` into a graph (thread-local mode: other threads, such as the progress
  /// executor querying events, go on).
  static int stream_begin_capture(stream_handle s) noexcept {
    return ::cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal);
  }
  /// Ends the capture on `s` into `g`.
  static int stream_end_capture(stream_handle s, graph_handle& g) noexcept {
    return ::cudaStreamEndCapture(s, &g);
  }
  /// Sets `capturing` to whether `s` is capturing.
  static int stream_is_capturing(stream_handle s, bool& capturing) noexcept {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    const cudaError_t e = ::cudaStreamIsCapturing(s, &status);
    capturing = status != cudaStreamCaptureStatusNone;
    return e;
  }
  /// Instantiates graph `g` into `x`.
  static int graph_instantiate(graph_exec_handle& x, graph_handle g) noexcept {
    return ::cudaGraphInstantiate(&x, g, 0);
  }
  /// Launches graph `x` on `s`.
  static int graph_launch(graph_exec_handle x, stream_handle s) noexcept { return ::cudaGraphLaunch(x, s); }
  /// Destroys a graph.
  static int graph_destroy(graph_handle g) noexcept { return ::cudaGraphDestroy(g); }
  /// Destroys an instantiated graph.
  static int graph_exec_destroy(graph_exec_handle x) noexcept { return ::cudaGraphExecDestroy(x); }

  /// Allocates `n` bytes of pinned host memory the GPU reaches too (mapped, portable) into `*p`.
  static int malloc_host_mapped(void** p, std::size_t n) noexcept {
    return ::cudaHostAlloc(p, n, cudaHostAllocMapped | cudaHostAllocPortable);
  }
  /// Sets `*device` to the address the GPU reaches mapped host memory `host` by.
  static int host_device_pointer(void** device, void* host) noexcept {
    return ::cudaHostGetDevicePointer(device, host, 0);
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
  // A driver function through the runtime (no link against libcuda); null where this driver has
  // none. Driver and runtime error codes share their numbers for the calls made here.
  template <class F>
  static F driver(const char* symbol) noexcept {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    if (::cudaGetDriverEntryPointByVersion(symbol, &p, 12000, cudaEnableDefault, &found) != cudaSuccess) {
      return nullptr;
    }
#else
    if (::cudaGetDriverEntryPoint(symbol, &p, cudaEnableDefault, &found) != cudaSuccess) return nullptr;
#endif
    return found == cudaDriverEntryPointSuccess ? reinterpret_cast<F>(p) : nullptr;
  }

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

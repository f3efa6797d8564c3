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
#include <hip/hiprtc.h>

#include <cstdint>
#include <string>
#include <vector>

#include "ferry/gpu/copy_kind.hpp"

namespace ferry::gpu {

/// The GPU runtime calls of the copy backend, forwarded to the HIP runtime (AMD GPUs).
/// Static functions returning the runtime's error code as an int (success, not_ready, or an error).
struct hip_runtime {
  /// The runtime's stream.
  using stream_handle = hipStream_t;
  /// The runtime's event.
  using event_handle = hipEvent_t;

  /// The code of a call that succeeded.
  static constexpr int success = hipSuccess;
  /// What event_query returns while the work before the event is unfinished.
  static constexpr int not_ready = hipErrorNotReady;

  /// The runtime's name, "hip".
  [[nodiscard]] static const char* name() noexcept { return "hip"; }
  /// The name of error code `e` (the runtime's static string).
  [[nodiscard]] static const char* error_name(int e) noexcept {
    return ::hipGetErrorName(static_cast<hipError_t>(e));
  }
  /// The runtime's description of error code `e`.
  [[nodiscard]] static const char* error_string(int e) noexcept {
    return ::hipGetErrorString(static_cast<hipError_t>(e));
  }

  /// Sets `n` to the number of GPUs visible.
  static int device_count(int& n) noexcept { return ::hipGetDeviceCount(&n); }
  /// Sets `d` to the calling thread's current device.
  /// The current device is per thread.
  static int get_device(int& d) noexcept { return ::hipGetDevice(&d); }
  /// Makes GPU `d` the calling thread's current device.
  static int set_device(int d) noexcept { return ::hipSetDevice(d); }
  /// Lets the current device reach GPU `peer`'s memory (for peer copies).
  static int enable_peer_access(int peer) noexcept { return ::hipDeviceEnablePeerAccess(peer, 0); }

  /// Makes a stream into `s`.
  /// Non-blocking streams: they never wait on the legacy default stream.
  static int stream_create(stream_handle& s) noexcept {
    return ::hipStreamCreateWithFlags(&s, hipStreamNonBlocking);
  }
  /// Destroys a stream (after its work has finished).
  static int stream_destroy(stream_handle s) noexcept { return ::hipStreamDestroy(s); }
  /// Blocks until everything enqueued on the stream has finished.
  static int stream_synchronize(stream_handle s) noexcept { return ::hipStreamSynchronize(s); }

  /// Makes an event into `e`.
  /// Events without timing: recording and querying them is cheapest.
  static int event_create(event_handle& e) noexcept {
    return ::hipEventCreateWithFlags(&e, hipEventDisableTiming);
  }
  /// Destroys an event.
  static int event_destroy(event_handle e) noexcept { return ::hipEventDestroy(e); }
  /// Records `e` on `s`: it becomes ready when the work enqueued before it has finished.
  static int event_record(event_handle e, stream_handle s) noexcept { return ::hipEventRecord(e, s); }
  /// Whether the event is ready: success, not_ready, or the error the work before the event hit.
  static int event_query(event_handle e) noexcept { return ::hipEventQuery(e); }
  /// Blocks until the event is ready.
  static int event_synchronize(event_handle e) noexcept { return ::hipEventSynchronize(e); }

  /// Enqueues a copy of `n` bytes from `src` to `dst` on stream `s`.
  static int memcpy_async(void* dst, const void* src, std::size_t n, copy_kind kind,
                          stream_handle s) noexcept {
    return ::hipMemcpyAsync(dst, src, n, native(kind), s);
  }

  /// The layer gate's kernel, compiled at run time (hiprtc) for the current device and loaded.
  struct kernel_handle {
    hipModule_t module = nullptr;  ///< the module it was loaded into
    hipFunction_t function = nullptr;  ///< ferry_gate_wait in it
  };
  /// A captured graph.
  using graph_handle = hipGraph_t;
  /// An instantiated graph.
  using graph_exec_handle = hipGraphExec_t;

  /// The layer gate's kernel, as HIP source for hiprtc: one thread reads the epoch word once, then
  /// waits, sleeping between looks, until the gate word reaches it cyclically.
  static constexpr const char* gate_kernel_source = R"(
extern "C" __global__ void ferry_gate_wait(const unsigned* gate, const unsigned* epoch) {
  const unsigned e = __atomic_load_n(epoch, __ATOMIC_RELAXED);
  while (static_cast<int>(__atomic_load_n(gate, __ATOMIC_ACQUIRE) - e) < 0) __builtin_amdgcn_s_sleep(2);
}
)";

  /// Enqueues on `s` a wait until the word at `word` reaches `value` (hipStreamWaitValue32,
  /// hipStreamWaitValueGte; HIP compares without wrapping).
  static int stream_wait_value32(stream_handle s, void* word, std::uint32_t value) noexcept {
    return ::hipStreamWaitValue32(s, word, value, hipStreamWaitValueGte, 0xffffffffu);
  }
  /// Enqueues on `s` a write of `value` to the word at `word` (hipStreamWriteValue32).
  static int stream_write_value32(stream_handle s, void* word, std::uint32_t value) noexcept {
    return ::hipStreamWriteValue32(s, word, value, 0);
  }

  /// Compiles the layer gate's kernel (hiprtc) for the current device and loads it.
  static int gate_kernel_load(kernel_handle& k) noexcept {
    try {
      int device = 0;
      if (const hipError_t e = ::hipGetDevice(&device); e != hipSuccess) return e;
      hipDeviceProp_t prop{};
      if (const hipError_t e = ::hipGetDeviceProperties(&prop, device); e != hipSuccess) return e;
      hiprtcProgram program = nullptr;
      if (::hiprtcCreateProgram(&program, gate_kernel_source, "ferry_gate.hip", 0, nullptr, nullptr) !=
          HIPRTC_SUCCESS) {
        return hipErrorInvalidImage;
      }
      const std::string arch = std::string("--gpu-architecture=") + prop.gcnArchName;
      const char* options[] = {arch.c_str()};
      std::vector<char> code;
      std::size_t size = 0;
      const bool compiled = ::hiprtcCompileProgram(program, 1, options) == HIPRTC_SUCCESS &&
                            ::hiprtcGetCodeSize(program, &size) == HIPRTC_SUCCESS;
      if (compiled) {
        code.resize(size);
        (void)::hiprtcGetCode(program, code.data());
      }
      (void)::hiprtcDestroyProgram(&program);
      if (!compiled) return hipErrorInvalidImage;
      if (const hipError_t e = ::hipModuleLoadData(&k.module, code.data()); e != hipSuccess) return e;
      if (const hipError_t e = ::hipModuleGetFunction(&k.function, k.module, "ferry_gate_wait");
          e != hipSuccess) {
        gate_kernel_unload(k);
        return e;
      }
      return hipSuccess;
    } catch (...) {
      return hipErrorOutOfMemory;
    }
  }
  /// Unloads the layer gate's kernel.
  static int gate_kernel_unload(kernel_handle& k) noexcept {
    if (k.module == nullptr) return hipSuccess;
    const hipError_t e = ::hipModuleUnload(k.module);
    k = {};
    return e;
  }
  /// Launches the layer gate's kernel (one thread) on `s`: it holds the stream until the word at
  /// `word` reaches the epoch at `epoch`, read when it starts. Capturable into a graph.
  static int launch_gate_wait(const kernel_handle& k, stream_handle s, const void* word,
                              const void* epoch) noexcept {
    const void* w = word;
    const void* e = epoch;
    void* args[] = {&w, &e};
    return ::hipModuleLaunchKernel(k.function, 1, 1, 1, 1, 1, 1, 0, s, args, nullptr);
  }

  /// Starts capturing `s` into a graph (thread-local mode).
  static int stream_begin_capture(stream_handle s) noexcept {
    return ::hipStreamBeginCapture(s, hipStreamCaptureModeThreadLocal);
  }
  /// Ends the capture on `s` into `g`.
  static int stream_end_capture(stream_handle s, graph_handle& g) noexcept {
    return ::hipStreamEndCapture(s, &g);
  }
  /// Sets `capturing` to whether `s` is capturing.
  static int stream_is_capturing(stream_handle s, bool& capturing) noexcept {
    hipStreamCaptureStatus status = hipStreamCaptureStatusNone;
    const hipError_t e = ::hipStreamIsCapturing(s, &status);
    capturing = status != hipStreamCaptureStatusNone;
    return e;
  }
  /// Instantiates graph `g` into `x`.
  static int graph_instantiate(graph_exec_handle& x, graph_handle g) noexcept {
    return ::hipGraphInstantiate(&x, g, nullptr, nullptr, 0);
  }
  /// Launches graph `x` on `s`.
  static int graph_launch(graph_exec_handle x, stream_handle s) noexcept { return ::hipGraphLaunch(x, s); }
  /// Destroys a graph.
  static int graph_destroy(graph_handle g) noexcept { return ::hipGraphDestroy(g); }
  /// Destroys an instantiated graph.
  static int graph_exec_destroy(graph_exec_handle x) noexcept { return ::hipGraphExecDestroy(x); }

  /// Allocates `n` bytes of pinned host memory the GPU reaches too (mapped, portable, coherent)
  /// into `*p`.
  static int malloc_host_mapped(void** p, std::size_t n) noexcept {
    return ::hipHostMalloc(p, n, hipHostMallocMapped | hipHostMallocPortable | hipHostMallocCoherent);
  }
  /// Sets `*device` to the address the GPU reaches mapped host memory `host` by.
  static int host_device_pointer(void** device, void* host) noexcept {
    return ::hipHostGetDevicePointer(device, host, 0);
  }

  /// Allocates `n` bytes of device memory into `*p`.
  /// For tests and benchmarks.
  static int malloc_device(void** p, std::size_t n) noexcept { return ::hipMalloc(p, n); }
  /// Frees device memory from malloc_device.
  static int free_device(void* p) noexcept { return ::hipFree(p); }
  /// Allocates `n` bytes of pinned host memory into `*p`.
  static int malloc_host(void** p, std::size_t n) noexcept { return ::hipHostMalloc(p, n, 0); }
  /// Frees pinned host memory from malloc_host.
  static int free_host(void* p) noexcept { return ::hipHostFree(p); }
  /// Sets `n` bytes of device memory to `value`.
  static int memset_device(void* p, int value, std::size_t n) noexcept { return ::hipMemset(p, value, n); }
  /// Blocks until everything on the current device has finished.
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

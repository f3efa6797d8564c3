// The layer gate in an engine whose forward is one captured graph: each layer's kernels wait on the
// GPU for that layer's KV blocks, which arrive as transfers (here the loopback backend's copies on
// the progress executor; in a server, UCX or verbs). It runs on ferry's fake GPU runtime, so it needs
// no GPU; with a GPU, ferry::gpu::layer_gate and the runtime's own stream and graph calls are the
// same code (docs/gpu.md).
//
// Four steps of a four-layer "model": the forward is captured once (per layer, the gate's wait, then
// the layer's "kernel", a copy of its KV block into its output) and replayed every step through
// launch_graph, which gives each launch its step's epoch. In step 3 one layer's load fails: the gate releases it at once, and the engine
// reads the verdict after the step to recompute that layer.

#include <array>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <span>
#include <vector>

#include <ferry/ferry.hpp>
#include <ferry/gpu/layer_gate.hpp>
#include <ferry/testing/fake_gpu.hpp>

using namespace std::chrono_literals;
namespace fg = ferry::gpu;
using rt = fg::fake::runtime;  // with a GPU: fg::gpu_runtime (<ferry/gpu.hpp>)

int main() {
  constexpr std::size_t layers = 4;
  constexpr std::size_t block = 4096;
  ferry::progress_executor exec;
  ferry::loopback_backend net{exec};  // stands in for the transport that brings the KV blocks
  fg::basic_layer_gate<rt> gate({.device = 0, .layers = layers});

  // "Device memory": the KV blocks the loads land in, and each layer's output.
  std::array<std::vector<std::byte>, layers> kv, out, remote;
  for (std::size_t l = 0; l < layers; ++l) {
    kv[l].resize(block);
    out[l].resize(block);
    remote[l].resize(block);
  }

  // Captured once: before each layer's kernel, the gate's wait.
  rt::stream_handle compute = nullptr;
  rt::stream_create(compute);
  rt::stream_begin_capture(compute);
  for (std::size_t l = 0; l < layers; ++l) {
    gate.enqueue_graph_wait(compute, l);
    rt::memcpy_async(out[l].data(), kv[l].data(), block, fg::copy_kind::device_to_device, compute);
  }
  rt::graph_handle graph = nullptr;
  rt::stream_end_capture(compute, graph);
  rt::graph_exec_handle forward = nullptr;
  rt::graph_instantiate(forward, graph);

  bool all_right = true;
  for (int step = 1; step <= 4; ++step) {
    for (std::size_t l = 0; l < layers; ++l) {
      std::memset(remote[l].data(), step * 16 + static_cast<int>(l), block);  // what the peer sends
    }
    const std::uint32_t e = gate.begin_step(1s);  // no layer waits past this
    gate.launch_graph(compute, forward, e);       // the step's epoch, then the graph: the GPU starts,
                                                  // and layer 0 waits for its load

    std::array<ferry::transfer, layers> loads;
    for (std::size_t l = 0; l < layers; ++l) {
      if (step == 3 && l == 2) {  // the peer went away: this layer's load fails
        loads[l] = ferry::make_completed_transfer(ferry::transfer_state::failed,
                                                  std::make_error_code(std::errc::connection_reset));
      } else {
        loads[l] = net.copy(kv[l], remote[l]);
      }
      gate.arm(e, l, std::span<const ferry::transfer>(&loads[l], 1));
    }
    gate.seal(e);

    rt::stream_synchronize(compute);  // the step's end
    std::printf("step %d:", step);
    for (std::size_t l = 0; l < layers; ++l) {
      const fg::layer_verdict v = gate.verdict(e, l);
      const bool fresh = out[l][0] == remote[l][0] && out[l][block - 1] == remote[l][0];
      std::printf("  layer %zu %s%s", l, fg::to_string(v.state),
                  v.state == fg::layer_state::success ? (fresh ? " (computed on its own bytes)" : " (STALE)")
                                                      : " (recompute it)");
      if (v.state == fg::layer_state::success && !fresh) all_right = false;
      if (step == 3 && l == 2 && v.state != fg::layer_state::failed) all_right = false;
    }
    std::printf("\n");
  }
  rt::graph_exec_destroy(forward);
  rt::graph_destroy(graph);
  rt::stream_destroy(compute);
  std::printf("%s\n", all_right ? "every layer computed after its load, the failed one named" : "WRONG");
  return all_right ? 0 : 1;
}

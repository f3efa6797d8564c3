// KV blocks moving from a prefill side to a decode side with one-sided RDMA WRITEs, layer by layer:
// the prefill side writes each layer's blocks as one batch and sends a notification right behind it;
// the decode side, a coroutine on its own run_loop, awaits each layer's notification (RC delivers it
// only after the WRITEs before it have landed) and checks the layer's bytes.
//
// It runs on the in-process fake adapter (<ferry/testing/verbs.hpp>), so it needs no RDMA
// hardware; on a real adapter the same code uses ferry::verbs::device and friends, and the two sides
// connect over the TCP side channel (ferry::verbs::connect / side_channel_listener) instead of
// directly.

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <span>
#include <thread>
#include <vector>

#include <ferry/ferry.hpp>
#include <ferry/verbs/device.hpp>
#include <ferry/testing/verbs.hpp>

using namespace std::chrono_literals;
namespace fv = ferry::verbs;
using provider = fv::fake::provider;

constexpr std::size_t layers = 32;
constexpr std::size_t blocks_per_layer = 16;
constexpr std::size_t block_bytes = 16 << 10;
constexpr std::size_t layer_bytes = blocks_per_layer * block_bytes;

std::byte expected(std::size_t layer, std::size_t i) {
  return static_cast<std::byte>((layer * 131 + i * 7) & 0xff);
}

// The decode side: awaits layer after layer, on its own scheduler.
ferry::task<std::size_t> decode(fv::basic_queue_pair<provider>& qp,
                                const fv::basic_memory_region<provider>& kv) {
  std::size_t good = 0;
  for (std::size_t l = 0; l < layers; ++l) {
    std::uint64_t layer = 0;
    const ferry::transfer_state s = co_await qp.receive_notification(layer, 5s);
    if (s != ferry::transfer_state::success || layer != l) break;
    bool intact = true;
    for (std::size_t i = 0; i < layer_bytes; ++i) {
      intact = intact && kv.data()[l * layer_bytes + i] == expected(l, i);
    }
    if (intact) ++good;  // compute on this layer here, while later ones stream in
  }
  co_return good;
}

int main() {
  fv::fake::fabric::instance().add_device("prefill0");
  fv::fake::fabric::instance().add_device("decode0");
  ferry::progress_executor exec;
  fv::basic_device<provider> prefill_nic(exec, {"prefill0"});
  fv::basic_device<provider> decode_nic(exec, {"decode0"});
  auto staged = fv::basic_memory_region<provider>::allocate(prefill_nic, layers * layer_bytes);
  auto kv = fv::basic_memory_region<provider>::allocate(decode_nic, layers * layer_bytes);
  fv::basic_queue_pair<provider> to_decode(prefill_nic);
  fv::basic_queue_pair<provider> from_prefill(decode_nic);
  to_decode.connect(from_prefill.local_info());  // over the TCP side channel on real adapters
  from_prefill.connect(to_decode.local_info());
  const fv::remote_region target = kv.remote();  // what the handshake hands the prefill side

  std::thread prefill([&] {
    std::vector<fv::basic_rdma_block<provider>> batch(blocks_per_layer);
    std::vector<ferry::transfer> out(blocks_per_layer);
    for (std::size_t l = 0; l < layers; ++l) {
      for (std::size_t i = 0; i < layer_bytes; ++i) staged.data()[l * layer_bytes + i] = expected(l, i);
      for (std::size_t b = 0; b < blocks_per_layer; ++b) {
        const std::size_t at = l * layer_bytes + b * block_bytes;
        batch[b] = {staged.slice(at, block_bytes), target.slice(at, block_bytes)};
      }
      to_decode.write_batch(std::span<const fv::basic_rdma_block<provider>>(batch),
                            std::span<ferry::transfer>(out), 5s);
      // Notify only if the queue pair took the whole batch (a refused WRITE never went).
      if (ferry::poll_all(out).verdict != ferry::verdict::failed) (void)to_decode.send_notification(l);
      // The staging memory of this layer is reused only once its WRITEs are done.
      if (!ferry::wait_all(out, 5s).ok()) std::printf("layer %zu: WRITEs failed\n", l);
    }
  });

  ferry::run_loop engine;
  const std::size_t good = ferry::sync_wait(engine, decode(from_prefill, kv));
  prefill.join();
  std::printf("%zu of %zu layers arrived intact, each announced after its %zu WRITEs landed\n", good,
              layers, blocks_per_layer);
  const auto c = prefill_nic.counters();
  std::printf("prefill adapter: %llu work requests in %llu doorbells\n",
              static_cast<unsigned long long>(c.work_requests_posted),
              static_cast<unsigned long long>(c.post_calls));
  return good == layers ? 0 : 1;
}

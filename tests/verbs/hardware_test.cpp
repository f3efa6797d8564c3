// The verbs backend's full loop on a real RDMA adapter, through libibverbs: device set-up, two RC
// queue pairs connected over the TCP side channel on this host, WRITE, READ, a batch, the
// notification after WRITEs, and error injection with a bad rkey. Where no adapter is present it
// exits 77, which meson test reports as skipped, and says why.
//
// FERRY_VERBS_DEVICE names the adapter to use (default: the first one found).

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <ferry/ferry.hpp>
#include <ferry/verbs.hpp>

namespace {

using namespace std::chrono_literals;
namespace fv = ferry::verbs;

int failures = 0;

void check(bool ok, const char* what) {
  std::printf("%s %s\n", ok ? "ok:  " : "FAIL:", what);
  if (!ok) ++failures;
}

bool ends(const ferry::transfer& t, ferry::transfer_state want, const char* what) {
  const ferry::transfer_state got = t.wait_for(10s);
  if (got != want) {
    std::printf("      %s ended %d (%s)\n", what, static_cast<int>(got), t.error().message().c_str());
  }
  return got == want;
}

}  // namespace

int main() {
  std::vector<std::string> names;
  try {
    names = fv::real_provider::device_names();
  } catch (const std::exception& e) {
    std::printf("SKIP: cannot list RDMA devices: %s\n", e.what());
    return 77;
  }
  if (names.empty()) {
    std::printf("SKIP: no RDMA device on this machine (ibv_get_device_list found none: no adapter, "
                "or no kernel RDMA support); the backend's logic is tested against the fake in "
                "ferry_tests [verbs]\n");
    return 77;
  }
  const char* chosen = std::getenv("FERRY_VERBS_DEVICE");
  try {
    ferry::progress_executor exec;
    fv::device_options options;
    options.name = chosen != nullptr ? chosen : names.front();
    fv::device dev(exec, options);
    std::printf("device %s, LID %u\n", dev.name().c_str(), dev.lid());
    constexpr std::size_t bytes = std::size_t{4} << 20;
    fv::memory_region local = fv::memory_region::allocate(dev, bytes);
    fv::memory_region target = fv::memory_region::allocate(dev, bytes);

    fv::side_channel_listener listener(0);
    std::optional<fv::connection> server;
    std::thread accept_thread([&] {
      const fv::remote_region exposed[] = {target.remote()};
      server.emplace(listener.accept(dev, std::span<const fv::remote_region>(exposed)));
    });
    fv::connection client =
        fv::connect(dev, "127.0.0.1", listener.port(), std::span<const fv::remote_region>());
    accept_thread.join();
    check(client.peer_regions.size() == 1, "handshake exchanged the target region");
    const fv::remote_region peer = client.peer_regions.at(0);

    for (std::size_t i = 0; i < bytes; ++i) local.data()[i] = static_cast<std::byte>(i * 7 + 1);
    ferry::transfer w = client.qp.write(local.slice(0, 1 << 20), peer.slice(0, 1 << 20));
    check(ends(w, ferry::transfer_state::success, "WRITE") &&
              std::memcmp(local.data(), target.data(), 1 << 20) == 0,
          "1 MiB WRITE lands byte-exact");

    std::memset(local.data() + (2 << 20), 0, 1 << 20);
    ferry::transfer r = client.qp.read(local.slice(2 << 20, 1 << 20), peer.slice(0, 1 << 20));
    check(ends(r, ferry::transfer_state::success, "READ") &&
              std::memcmp(local.data() + (2 << 20), target.data(), 1 << 20) == 0,
          "1 MiB READ comes back byte-exact");

    std::vector<fv::rdma_block> blocks;
    for (std::size_t i = 0; i < 64; ++i) {
      blocks.push_back({local.slice(i * 4096, 4096), peer.slice((1 << 20) + i * 4096, 4096)});
    }
    std::vector<ferry::transfer> out(blocks.size());
    client.qp.write_batch(std::span<const fv::rdma_block>(blocks), std::span<ferry::transfer>(out));
    std::uint64_t note = 0;
    ferry::transfer arrival = server->qp.receive_notification(note, 10s);
    ferry::transfer sent = client.qp.send_notification(1234);
    bool batch_ok = true;
    for (const ferry::transfer& t : out) batch_ok = ends(t, ferry::transfer_state::success, "batch") && batch_ok;
    check(batch_ok, "64-member WRITE batch succeeds");
    check(ends(arrival, ferry::transfer_state::success, "notification") && note == 1234 &&
              std::memcmp(local.data(), target.data() + (1 << 20), 64 * 4096) == 0,
          "notification after the batch arrives with its data landed");
    check(ends(sent, ferry::transfer_state::success, "send_notification"), "notification send completes");

    const fv::remote_region bad{peer.address, peer.length, peer.rkey ^ 0x5a5a5a};
    ferry::transfer e = client.qp.write(local.slice(0, 4096), bad.slice(0, 4096), 10s);
    check(ends(e, ferry::transfer_state::failed, "bad rkey") &&
              e.error() == fv::make_error_code(IBV_WC_REM_ACCESS_ERR),
          "a bad rkey fails with IBV_WC_REM_ACCESS_ERR");
    std::printf("      (%s)\n", e.error().message().c_str());
  } catch (const std::exception& ex) {
    std::printf("FAIL: %s\n", ex.what());
    return 1;
  }
  std::printf("%s\n", failures == 0 ? "all passed" : "FAILED");
  return failures == 0 ? 0 : 1;
}

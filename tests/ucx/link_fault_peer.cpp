// One side of the UCX link-fault test (link_faults.sh), run in a network namespace of its own.
//
//   link_fault_peer target HOST PORT
//     listens on HOST:PORT exposing a 16 MiB region, accepts initiators, runs until killed.
//   link_fault_peer initiator HOST PORT SECONDS
//     for SECONDS: puts a batch of random 256 KiB blocks into the target's region, gets them back and
//     compares, each step with a 2 s deadline; after a failure it reconnects (2 s deadline) and goes
//     on. Prints one line per outcome and a summary "verified=N failed=M pending=P mismatched=Q";
//     exits 0 when nothing stayed pending past its deadline and every completed round trip was
//     byte-exact, 1 otherwise, 2 on bad arguments.

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <random>
#include <string>
#include <system_error>
#include <thread>

#include <unistd.h>
#include <vector>

#include <ferry/ferry.hpp>
#include <ferry/ucx.hpp>

namespace ucx = ferry::ucx;
using namespace std::chrono_literals;

namespace {

constexpr std::size_t region_bytes = std::size_t{16} << 20;
constexpr std::size_t block_bytes = std::size_t{256} << 10;
constexpr std::size_t blocks_per_batch = 8;
constexpr auto step_deadline = 2s;
// A request must have ended this long after its deadline: past it, it counts as left pending.
constexpr auto pending_bound = 10s;

ucx::worker_options tcp_only() {
  ucx::worker_options o;
  o.transports = "tcp";
  return o;
}

int usage() {
  std::fprintf(stderr,
               "usage: link_fault_peer target HOST PORT\n"
               "       link_fault_peer initiator HOST PORT SECONDS\n");
  return 2;
}

int run_target(const std::string& host, std::uint16_t port) {
  ferry::progress_executor exec;
  ucx::worker w(exec, tcp_only());
  auto region = w.allocate(region_bytes);
  std::vector<ucx::memory_region> expose{region};
  auto l = w.listen(host, port, expose);
  std::printf("listening on %s:%u\n", host.c_str(), static_cast<unsigned>(l.port()));
  std::fflush(stdout);
  std::vector<ucx::endpoint> peers;
  for (;;) {  // until killed; each accept is bounded
    try {
      peers.push_back(l.accept(1s));
    } catch (const std::system_error&) {
    }
    if (peers.size() > 64) peers.erase(peers.begin());
  }
}

struct tally {
  int verified = 0;
  int failed = 0;
  int pending = 0;
  int mismatched = 0;
};

// Waits for every transfer; false if any is still pending past its deadline and the bound.
bool settle(std::span<ferry::transfer> ts, tally& t, const char* what) {
  const auto r = ferry::drain(ts, step_deadline + pending_bound);
  if (r.pending != 0) {
    t.pending += static_cast<int>(r.pending);
    std::printf("%s: %zu request(s) still pending past the deadline\n", what, r.pending);
    return false;
  }
  if (r.verdict != ferry::verdict::success) {
    ++t.failed;
    std::printf("%s failed: %s\n", what, r.error.message().c_str());
    return false;
  }
  return true;
}

int run_initiator(const std::string& host, std::uint16_t port, double seconds) {
  ferry::progress_executor exec;
  ucx::worker w(exec, tcp_only());
  std::vector<std::byte> out(blocks_per_batch * block_bytes), back(out.size());
  auto src = w.register_memory(out);
  auto dst = w.register_memory(back);
  std::minstd_rand rng(static_cast<unsigned>(::getpid()));
  tally t;
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  ucx::endpoint ep;
  ucx::remote_memory remote{};
  bool connected = false;
  while (std::chrono::steady_clock::now() < end) {
    if (!connected) {
      try {
        ep = w.connect(host, port, {}, step_deadline);
        remote = ep.peer_regions().at(0);
        connected = true;
        std::printf("connected\n");
      } catch (const std::exception& e) {
        ++t.failed;
        std::printf("connect failed: %s\n", e.what());
        std::this_thread::sleep_for(100ms);
        continue;
      }
    }
    for (auto& b : out) b = static_cast<std::byte>(rng());
    std::vector<ucx::rma_block> puts, gets;
    const std::size_t base = (rng() % (region_bytes / out.size())) * out.size();
    for (std::size_t i = 0; i < blocks_per_batch; ++i) {
      puts.push_back({src.slice(i * block_bytes, block_bytes),
                      remote.slice(base + i * block_bytes, block_bytes)});
      gets.push_back({dst.slice(i * block_bytes, block_bytes),
                      remote.slice(base + i * block_bytes, block_bytes)});
    }
    std::vector<ferry::transfer> ts(blocks_per_batch);
    ep.put_batch(puts, ts, step_deadline);
    bool ok = settle(ts, t, "put batch");
    if (ok) {
      std::fill(back.begin(), back.end(), std::byte{0});
      ep.get_batch(gets, ts, step_deadline);
      ok = settle(ts, t, "get batch");
    }
    if (ok) {
      if (std::memcmp(out.data(), back.data(), out.size()) == 0) {
        ++t.verified;
      } else {
        ++t.mismatched;
        std::printf("round trip NOT byte-exact\n");
      }
    } else {
      // A failed request closed the endpoint (or found it closed): start over on a new one.
      ep = {};
      connected = false;
    }
    if (t.pending != 0) break;
  }
  std::printf("verified=%d failed=%d pending=%d mismatched=%d\n", t.verified, t.failed, t.pending,
              t.mismatched);
  std::fflush(stdout);
  if (t.pending != 0) {
    // Requests are still out in UCX: leave without tearing the worker down under them.
    std::_Exit(1);
  }
  return t.mismatched == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) return usage();
  const std::string mode = argv[1];
  const std::string host = argv[2];
  const long port = std::strtol(argv[3], nullptr, 10);
  if (port <= 0 || port > 65535) return usage();
  try {
    if (mode == "target" && argc == 4) return run_target(host, static_cast<std::uint16_t>(port));
    if (mode == "initiator" && argc == 5) {
      const double seconds = std::strtod(argv[4], nullptr);
      if (seconds <= 0) return usage();
      return run_initiator(host, static_cast<std::uint16_t>(port), seconds);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "link_fault_peer %s: %s\n", mode.c_str(), e.what());
    return 1;
  }
  return usage();
}

// Two processes move a request's KV cache over TCP through io_uring: a "prefill" process sends every
// layer's blocks as framed transfers, and a "decode" process, whose engine thread runs a coroutine on
// its own run_loop, awaits each layer with one deadline and checks every byte before "computing" it.
//
//   kv_over_tcp [layers] [blocks-per-layer] [block-KiB]     (defaults: 32 4 64)
//
// The processes are forked before either starts a thread, and each has its own progress executor
// and ring, as two machines would. Exit status 0 means every block arrived intact and in time.

#include <cstdio>
#include <cstdlib>
#include <span>
#include <string>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

#include <ferry/ferry.hpp>
#include <ferry/uring/tcp.hpp>

using namespace std::chrono_literals;
namespace uring = ferry::uring;

namespace {

struct shape {
  std::size_t layers = 32;
  std::size_t blocks = 4;  // per layer
  std::size_t block_bytes = 64 << 10;

  [[nodiscard]] std::uint64_t id(std::size_t layer, std::size_t block) const {
    return layer * blocks + block;
  }
};

// The KV bytes of block `id`: what prefill computed and what decode must find.
std::byte expected(std::uint64_t id, std::size_t i) {
  return static_cast<std::byte>((id * 2654435761u + i * 40503u) >> 7);
}

int prefill(const shape& s, std::uint16_t port) {
  ferry::progress_executor exec;
  // Declared before the ring, so freed after it: whatever happens below (a send still in flight at
  // the deadline), the ring's destructor waits out everything the kernel holds before the KV
  // buffers go, and the connection (closed first) ends what was still queued.
  std::vector<std::vector<std::byte>> kv(s.layers * s.blocks, std::vector<std::byte>(s.block_bytes));
  uring::ring ring(exec);
  uring::tcp_connection conn = uring::tcp_connection::connect(ring, "127.0.0.1", port);
  std::vector<ferry::transfer> sends;
  for (std::size_t layer = 0; layer < s.layers; ++layer) {
    for (std::size_t b = 0; b < s.blocks; ++b) {
      const std::uint64_t id = s.id(layer, b);
      for (std::size_t i = 0; i < s.block_bytes; ++i) kv[id][i] = expected(id, i);
      sends.push_back(conn.send(id, kv[id]));  // layer by layer, as prefill produces them
    }
  }
  const ferry::batch_result r = ferry::drain(sends, 30s);
  if (!r.ok()) {
    std::fprintf(stderr, "prefill: send %zu failed: %s\n", r.first_failed.value_or(0),
                 r.error.message().c_str());
    return 1;
  }
  std::printf("prefill: sent %zu blocks (%zu KiB)\n", sends.size(),
              sends.size() * s.block_bytes >> 10);
  return 0;
}

ferry::task<bool> forward_pass(const shape& s, uring::tcp_connection& conn,
                               std::vector<std::vector<std::byte>>& kv,
                               std::vector<uring::received_block>& got) {
  // Post every layer's receives up front; they complete in order while earlier layers compute.
  std::vector<ferry::transfer> loads;
  for (std::size_t id = 0; id < kv.size(); ++id) loads.push_back(conn.receive(kv[id], got[id]));
  bool ok = true;
  for (std::size_t layer = 0; layer < s.layers && ok; ++layer) {
    const std::span<const ferry::transfer> this_layer(loads.data() + layer * s.blocks, s.blocks);
    const ferry::batch_result r = co_await ferry::when_all(this_layer, 10s);
    if (!r.ok()) {
      std::fprintf(stderr, "decode: layer %zu: %s%s%s\n", layer, ferry::to_string(r.verdict),
                   r.first_failed ? ": " : "", r.first_failed ? r.error.message().c_str() : "");
      ok = false;
      break;
    }
    // "Compute" the layer: here, check that every byte is what prefill produced.
    for (std::size_t b = 0; b < s.blocks; ++b) {
      const std::uint64_t id = s.id(layer, b);
      if (got[id].id != id || got[id].length != s.block_bytes) {
        std::fprintf(stderr, "decode: expected block %llu, got %llu (%zu bytes)\n",
                     static_cast<unsigned long long>(id),
                     static_cast<unsigned long long>(got[id].id), got[id].length);
        ok = false;
      }
      for (std::size_t i = 0; ok && i < s.block_bytes; ++i) {
        if (kv[id][i] != expected(id, i)) {
          std::fprintf(stderr, "decode: block %llu differs at byte %zu\n",
                       static_cast<unsigned long long>(id), i);
          ok = false;
        }
      }
    }
  }
  // Whatever happened, end the receives still waiting (decode's ring then waits out any the kernel
  // holds, before the buffers they write into are freed).
  conn.close();
  co_return ok;
}

int decode(const shape& s, uring::tcp_listener& listener) {
  ferry::progress_executor exec;
  // Before the ring, as in prefill: freed only once the ring has nothing of theirs in the kernel.
  std::vector<std::vector<std::byte>> kv(s.layers * s.blocks, std::vector<std::byte>(s.block_bytes));
  std::vector<uring::received_block> got(kv.size());
  uring::ring ring(exec);
  uring::tcp_connection conn = listener.accept(ring);
  ferry::run_loop engine;  // the decode engine's own scheduler, driven by this thread
  const bool ok = ferry::sync_wait(engine, forward_pass(s, conn, kv, got));
  std::printf("decode: %zu layers x %zu blocks of %zu KiB %s\n", s.layers, s.blocks,
              s.block_bytes >> 10, ok ? "arrived and verified" : "FAILED");
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  shape s;
  if (argc > 1) s.layers = std::strtoul(argv[1], nullptr, 10);
  if (argc > 2) s.blocks = std::strtoul(argv[2], nullptr, 10);
  if (argc > 3) s.block_bytes = std::strtoul(argv[3], nullptr, 10) << 10;
  if (s.layers == 0 || s.blocks == 0 || s.block_bytes == 0) {
    std::fprintf(stderr, "usage: %s [layers] [blocks-per-layer] [block-KiB], all at least 1\n",
                 argv[0]);
    return 2;
  }
  uring::tcp_listener listener("127.0.0.1", 0);
  const std::uint16_t port = listener.port();
  std::fflush(stdout);
  const pid_t child = ::fork();
  if (child < 0) {
    std::perror("fork");
    return 1;
  }
  if (child == 0) {
    ::close(listener.native_handle());
    const int rc = prefill(s, port);
    std::fflush(stdout);
    std::_Exit(rc);
  }
  const int decoded = decode(s, listener);
  int status = 0;
  ::waitpid(child, &status, 0);
  const bool prefill_ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
  return decoded == 0 && prefill_ok ? 0 : 1;
}

// The smallest useful ferry program: a progress executor, the loopback backend, and a coroutine on a
// run_loop that awaits a batch of copies with one shared deadline.

#include <cstdio>
#include <span>
#include <vector>

#include <ferry/ferry.hpp>

using namespace std::chrono_literals;

ferry::task<bool> move_blocks(ferry::loopback_backend& lb, std::span<const std::byte> src,
                              std::span<std::byte> dst, std::size_t block) {
  std::vector<ferry::transfer> layer;
  for (std::size_t off = 0; off < src.size(); off += block) {
    layer.push_back(lb.copy(dst.subspan(off, block), src.subspan(off, block)));
  }
  // Resumes on this coroutine's run_loop the moment the last copy lands, any copy fails, or 100 ms
  // pass; the executor's thread never runs this code.
  const ferry::batch_result r = co_await ferry::when_all(layer, 100ms);
  std::printf("%zu copies: %s", layer.size(), ferry::to_string(r.verdict));
  if (r.first_failed) std::printf(" (member %zu: %s)", *r.first_failed, r.error.message().c_str());
  std::printf("\n");
  co_return r.ok();
}

int main() {
  ferry::progress_executor exec;         // the dedicated polling thread
  ferry::loopback_backend lb{exec};      // in-memory copies, completed by that thread
  std::vector<std::byte> src(1 << 20), dst(1 << 20);
  for (std::size_t i = 0; i < src.size(); ++i) src[i] = static_cast<std::byte>(i * 7);

  ferry::run_loop engine;                // the engine's own scheduler, driven by this thread
  const bool ok = ferry::sync_wait(engine, move_blocks(lb, src, dst, 64 << 10));
  const bool same = src == dst;
  std::printf("verdict %s, bytes %s\n", ok ? "success" : "failure", same ? "identical" : "DIFFER");
  return ok && same ? 0 : 1;
}

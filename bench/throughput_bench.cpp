// Loopback completions per second through one progress executor, and heap allocations per transfer
// (counted by replacing operator new in this binary).

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include <ferry/ferry.hpp>

#include "bench.hpp"
#include "harness.hpp"

// The replacements below pair malloc with free, which g++ cannot see through once ferry's own
// new/delete pairs are inlined into this file.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif

namespace {
std::atomic<std::uint64_t> heap_allocations{0};
}

void* operator new(std::size_t n) {
  heap_allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n) { return ::operator new(n); }
void* operator new(std::size_t n, std::align_val_t a) {
  heap_allocations.fetch_add(1, std::memory_order_relaxed);
  const std::size_t align = static_cast<std::size_t>(a);
  if (void* p = std::aligned_alloc(align, (n + align - 1) / align * align)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n, std::align_val_t a) { return ::operator new(n, a); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }

namespace ferry_bench {
namespace {

struct throughput_result {
  double per_second = 0;
  double allocations_per_transfer = 0;
  std::uint64_t transfers = 0;
};

// Fire-and-forget copies of `bytes` bytes, at most `window` in flight, for `seconds`.
throughput_result fire_and_forget(ferry::progress_executor& exec, ferry::loopback_backend& lb,
                                  std::size_t bytes, std::size_t window, double seconds) {
  std::vector<std::byte> src(bytes, std::byte{1}), dst(bytes);
  const auto submit_for = [&](double secs) {
    const auto start_completions = exec.counters().completions;
    std::uint64_t submitted = 0;
    const auto start = bench_clock::now();
    const auto until = start + std::chrono::duration<double>(secs);
    while (bench_clock::now() < until) {
      // Look at the executor's counter once per 256 submissions, not per copy.
      while (submitted - (exec.counters().completions - start_completions) + 256 > window) {
      }
      for (int i = 0; i < 256; ++i) (void)lb.copy(dst, src);
      submitted += 256;
    }
    while (exec.counters().completions - start_completions < submitted) {
    }
    const double elapsed = std::chrono::duration<double>(bench_clock::now() - start).count();
    return std::pair{submitted, elapsed};
  };
  submit_for(0.1);  // warm the pools and the ring
  const auto allocs_before = heap_allocations.load();
  const auto [n, elapsed] = submit_for(seconds);
  const auto allocs = heap_allocations.load() - allocs_before;
  return {static_cast<double>(n) / elapsed, static_cast<double>(allocs) / static_cast<double>(n), n};
}

// Batches of `batch` copies, each batch awaited with wait_all: the verdict path included.
throughput_result batched(ferry::loopback_backend& lb, std::size_t batch, double seconds) {
  std::vector<std::byte> src(64, std::byte{1}), dst(64);
  std::vector<ferry::transfer> ts;
  ts.reserve(batch);
  const auto run_for = [&](double secs) {
    std::uint64_t n = 0;
    const auto start = bench_clock::now();
    const auto until = start + std::chrono::duration<double>(secs);
    while (bench_clock::now() < until) {
      for (std::size_t i = 0; i < batch; ++i) ts.push_back(lb.copy(dst, src));
      (void)ferry::wait_all(ts, std::chrono::seconds(10));
      n += ts.size();
      ts.clear();
    }
    return std::pair{n, std::chrono::duration<double>(bench_clock::now() - start).count()};
  };
  run_for(0.1);
  const auto allocs_before = heap_allocations.load();
  const auto [n, elapsed] = run_for(seconds);
  const auto allocs = heap_allocations.load() - allocs_before;
  return {static_cast<double>(n) / elapsed, static_cast<double>(allocs) / static_cast<double>(n), n};
}

}  // namespace

void run_throughput(const options& opt) {
  const double seconds = opt.quick ? 0.3 : 1.5;
  full_printf("\n## Loopback completions through one executor thread (%.1f s per row)\n\n", seconds);
  full_printf("| workload | executor mode | completions/s | heap allocations per transfer |\n"
              "|---|---|---|---|\n");
  double best_fire = 0;
  double allocs_fire = 1;
  for (const auto mode : {ferry::progress_mode::busy, ferry::progress_mode::adaptive}) {
    ferry::executor_options eo;
    eo.mode = mode;
    ferry::progress_executor exec(eo);
    ferry::loopback_backend lb{exec};
    const char* mode_name = mode == ferry::progress_mode::busy ? "busy" : "adaptive";
    const auto f = fire_and_forget(exec, lb, 64, 8192, seconds);
    full_printf("| 64 B copies, fire and forget, 8192 in flight | %s | %.2f M | %.4f |\n", mode_name,
                f.per_second / 1e6, f.allocations_per_transfer);
    if (f.per_second > best_fire) {
      best_fire = f.per_second;
      allocs_fire = f.allocations_per_transfer;
    }
    const auto b = batched(lb, 256, seconds);
    full_printf("| 64 B copies, batches of 256 awaited with wait_all | %s | %.2f M | %.4f |\n",
                mode_name, b.per_second / 1e6, b.allocations_per_transfer);
  }
  char buf[128];
  std::snprintf(buf, sizeof buf, "%.2f M/s", best_fire / 1e6);
  report_target(">= 5 million loopback completions/s", buf, best_fire >= 5e6);
  std::snprintf(buf, sizeof buf, "%.4f", allocs_fire);
  report_target("zero heap allocations per transfer in steady state", buf, allocs_fire == 0.0);
  std::snprintf(buf, sizeof buf, "loopback completions/s, %s allocs each",
                allocs_fire == 0.0 ? "0" : std::to_string(allocs_fire).c_str());
  const std::string what = buf;
  std::snprintf(buf, sizeof buf, "%.2f M/s", best_fire / 1e6);
  report_figure({what, buf, "-", "(none)", "-", "-"});
}

}  // namespace ferry_bench

// The GPU copy backend on a real GPU (HIP, or CUDA with FERRY_GPU_CUDA), each figure beside its
// baseline in the same run:
// - device-to-device bandwidth, 64 KiB to 256 MiB: ferry (copy, then wait on the transfer) against
//   the raw runtime copy followed by a stream synchronize;
// - completion → resume: how long after the copy's work is done its waiter runs. A probe event is
//   recorded right behind the copy on the same stream and a thread spinning on it (started once,
//   before any copy) notes when it turns ready; the waiter notes when it wakes. ferry's waiter blocks in transfer::wait(); the baseline's
//   blocks in the runtime's event synchronize;
// - the layer gate's wake-up: a stream waits on a layer (eagerly, and in a captured graph); the host
//   ends the layer's load; the stream, once past the wait, writes a flag in mapped host memory that
//   a thread spins on. Beside it, the same stream wait released by a raw host store (no ferry), and
//   the host-mediated way without a gate: a thread blocked in transfer::wait() enqueues the flag
//   write once the load ends. CPU time per release is the releasing thread's own.
// Without a GPU it says so and exits 77.
//
// Usage: ferry_gpu_bench [--quick]

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <ferry/ferry.hpp>
#include <ferry/gpu.hpp>

#include <ctime>

namespace {

double thread_cpu_us() {
  timespec ts{};
  ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e6 + static_cast<double>(ts.tv_nsec) / 1e3;
}

namespace fh = ferry::gpu;
using rt = fh::gpu_runtime;
using bench_clock = std::chrono::steady_clock;

void require(int e, const char* what) {
  if (e != rt::success) {
    throw std::runtime_error(std::string(what) + ": " + fh::make_runtime_error<rt>(e).message());
  }
}

double seconds_since(bench_clock::time_point t0) {
  return std::chrono::duration<double>(bench_clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double percentile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<std::size_t>(q * static_cast<double>(v.size())))];
}

std::string size_name(std::size_t n) {
  return n >= (1u << 20) ? std::to_string(n >> 20) + " MiB" : std::to_string(n >> 10) + " KiB";
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  int devices = 0;
  if (rt::device_count(devices) != rt::success || devices == 0) {
    std::printf("SKIP: no GPU found by the %s runtime\n", rt::name());
    return 77;
  }
  try {
    ferry::progress_executor exec;
    fh::copy_engine engine(exec);
    typename rt::stream_handle raw_stream{};
    require(rt::stream_create(raw_stream), "stream_create");
    constexpr std::size_t largest = std::size_t{256} << 20;
    void* a = nullptr;
    void* b = nullptr;
    require(rt::malloc_device(&a, largest), "malloc_device");
    require(rt::malloc_device(&b, largest), "malloc_device");
    require(rt::memset_device(a, 1, largest), "memset");
    require(rt::device_synchronize(), "device_synchronize");

    struct row {
      std::size_t bytes;
      double ferry_gbs;
      double raw_gbs;
    };
    std::vector<row> rows;
    for (std::size_t n = 64 << 10; n <= largest; n *= 4) {
      const int iters = static_cast<int>(std::clamp<std::size_t>(((quick ? std::size_t{256} : std::size_t{2048}) << 20) / n, 8, 20000));
      std::vector<double> f, r;
      for (int round = 0; round < (quick ? 3 : 7); ++round) {
        auto t0 = bench_clock::now();
        for (int i = 0; i < iters; ++i) {
          ferry::transfer t = engine.copy_on(0, b, a, n, fh::copy_kind::device_to_device);
          if (t.wait() != ferry::transfer_state::success) throw std::runtime_error(t.error().message());
        }
        f.push_back(static_cast<double>(n) * iters / seconds_since(t0) / 1e9);
        t0 = bench_clock::now();
        for (int i = 0; i < iters; ++i) {
          require(rt::memcpy_async(b, a, n, fh::copy_kind::device_to_device, raw_stream), "memcpy_async");
          require(rt::stream_synchronize(raw_stream), "stream_synchronize");
        }
        r.push_back(static_cast<double>(n) * iters / seconds_since(t0) / 1e9);
      }
      rows.push_back({n, median(f), median(r)});
    }

    // Completion → resume.
    const std::size_t lat_bytes = std::size_t{64} << 20;
    const int samples = quick ? 200 : 2000;
    typename rt::event_handle probe{}, done{};
    require(rt::event_create(probe), "event_create");
    require(rt::event_create(done), "event_create");
    std::vector<double> ferry_us, sync_us;
    // The spinner is started once, before any copy, so that its own start-up is never measured:
    // for each sample it is handed the generation of a recorded probe, spins until the probe is
    // ready and notes when.
    std::atomic<std::uint64_t> probe_generation{0};
    std::atomic<std::uint64_t> seen_generation{0};
    std::atomic<std::int64_t> seen_at{0};
    std::atomic<bool> stop{false};
    std::thread spinner([&] {
      std::uint64_t done_with = 0;
      while (!stop.load(std::memory_order_acquire)) {
        const std::uint64_t g = probe_generation.load(std::memory_order_acquire);
        if (g == done_with) continue;
        while (rt::event_query(probe) == rt::not_ready) {
        }
        seen_at.store(bench_clock::now().time_since_epoch().count(), std::memory_order_relaxed);
        seen_generation.store(g, std::memory_order_release);
        done_with = g;
      }
    });
    struct stop_spinner {
      std::atomic<bool>& stop;
      std::thread& t;
      ~stop_spinner() {
        stop.store(true, std::memory_order_release);
        t.join();
      }
    } stopper{stop, spinner};
    std::uint64_t generation = 0;
    for (int i = 0; i < samples; ++i) {
      for (int side = 0; side < 2; ++side) {
        typename rt::stream_handle s = side == 0 ? engine.native_stream(0) : raw_stream;
        ferry::transfer t;
        if (side == 0) {
          t = engine.copy_on(0, b, a, lat_bytes, fh::copy_kind::device_to_device);
        } else {
          require(rt::memcpy_async(b, a, lat_bytes, fh::copy_kind::device_to_device, s), "memcpy_async");
          require(rt::event_record(done, s), "event_record");
        }
        require(rt::event_record(probe, s), "event_record(probe)");
        probe_generation.store(++generation, std::memory_order_release);
        if (side == 0) {
          if (t.wait() != ferry::transfer_state::success) throw std::runtime_error(t.error().message());
        } else {
          require(rt::event_synchronize(done), "event_synchronize");
        }
        const auto woke = bench_clock::now().time_since_epoch().count();
        while (seen_generation.load(std::memory_order_acquire) != generation) {
        }
        (side == 0 ? ferry_us : sync_us).push_back(static_cast<double>(woke - seen_at.load()) / 1e3);
      }
    }
    // The layer gate's wake-up.
    const int gate_samples = quick ? 200 : 1000;
    void* flag_host = nullptr;
    void* flag_dev = nullptr;
    void* raw_host = nullptr;
    void* raw_dev = nullptr;
    require(rt::malloc_host_mapped(&flag_host, 64), "malloc_host_mapped");
    require(rt::host_device_pointer(&flag_dev, flag_host), "host_device_pointer");
    require(rt::malloc_host_mapped(&raw_host, 64), "malloc_host_mapped");
    require(rt::host_device_pointer(&raw_dev, raw_host), "host_device_pointer");
    auto word = [](void* p) { return std::atomic_ref<std::uint32_t>(*static_cast<std::uint32_t*>(p)); };
    word(flag_host).store(0);
    word(raw_host).store(0);
    typename rt::stream_handle gs{};
    require(rt::stream_create(gs), "stream_create");
    struct gate_row {
      const char* what;
      std::vector<double> us;
      std::vector<double> cpu_us;
    };
    std::vector<gate_row> gate_rows = {{"layer gate, eager stream wait", {}, {}},
                                       {"layer gate, kernel wait in a captured graph", {}, {}},
                                       {"raw stream wait released by a host store (no ferry)", {}, {}},
                                       {"host-mediated: transfer::wait(), then enqueue", {}, {}}};
    {
      fh::layer_gate_options go;
      go.layers = 1;
      fh::layer_gate gate(go);
      // The graph: the gate's wait, then the flag write.
      require(rt::stream_begin_capture(gs), "stream_begin_capture");
      gate.enqueue_graph_wait(gs, 0);
      require(rt::stream_write_value32(gs, flag_dev, 1), "stream_write_value32 (captured)");
      typename rt::graph_handle graph{};
      require(rt::stream_end_capture(gs, graph), "stream_end_capture");
      typename rt::graph_exec_handle forward{};
      require(rt::graph_instantiate(forward, graph), "graph_instantiate");
      std::uint32_t raw_value = 0;
      for (int i = 1; i <= gate_samples; ++i) {
        for (gate_row& row : gate_rows) {
          const std::size_t mode = static_cast<std::size_t>(&row - gate_rows.data());
          const std::uint32_t want = mode == 1 ? 1u : static_cast<std::uint32_t>(i);
          word(flag_host).store(0);
          auto [t, c] = ferry::make_manual_transfer();
          std::thread host_side;
          if (mode <= 1) {
            const std::uint32_t e = gate.begin_step(std::chrono::seconds(30));
            gate.arm(e, 0, std::span<const ferry::transfer>(&t, 1));
            gate.seal(e);
            if (mode == 0) {
              gate.enqueue_wait(gs, e, 0);
              require(rt::stream_write_value32(gs, flag_dev, want), "stream_write_value32");
            } else {
              gate.launch_graph(gs, forward, e);
            }
          } else if (mode == 2) {
            require(rt::stream_wait_value32(gs, raw_dev, ++raw_value), "stream_wait_value32");
            require(rt::stream_write_value32(gs, flag_dev, want), "stream_write_value32");
          } else {
            host_side = std::thread([&, tt = t] {
              (void)tt.wait();
              require(rt::stream_write_value32(gs, flag_dev, want), "stream_write_value32");
            });
          }
          std::this_thread::sleep_for(std::chrono::microseconds(300));  // the stream is waiting now
          const double cpu0 = thread_cpu_us();
          const auto t0 = bench_clock::now();
          if (mode == 2) {
            word(raw_host).store(raw_value, std::memory_order_release);
          } else {
            c.succeed();
          }
          const double cpu1 = thread_cpu_us();
          while (word(flag_host).load(std::memory_order_acquire) != want) {
          }
          const auto t1 = bench_clock::now();
          if (host_side.joinable()) host_side.join();
          require(rt::stream_synchronize(gs), "stream_synchronize");
          row.us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
          row.cpu_us.push_back(cpu1 - cpu0);
        }
      }
      rt::graph_exec_destroy(forward);
      rt::graph_destroy(graph);
    }
    rt::stream_destroy(gs);
    rt::free_host(flag_host);
    rt::free_host(raw_host);
    rt::event_destroy(probe);
    rt::event_destroy(done);
    rt::free_device(a);
    rt::free_device(b);
    rt::stream_destroy(raw_stream);

    std::printf("\n## GPU copies (%s runtime, %d device(s))\n\n", rt::name(), devices);
    std::printf("| device-to-device | ferry | copy + stream synchronize | ferry / raw |\n|---|---|---|---|\n");
    bool bandwidth_met = true;
    for (const row& r : rows) {
      std::printf("| %s | %.1f GB/s | %.1f GB/s | %.3f |\n", size_name(r.bytes).c_str(), r.ferry_gbs,
                  r.raw_gbs, r.ferry_gbs / r.raw_gbs);
      if (r.bytes >= (std::size_t{1} << 20) && r.ferry_gbs < 0.95 * r.raw_gbs) bandwidth_met = false;
    }
    const double f50 = median(ferry_us), s50 = median(sync_us);
    std::printf("\n| completion → resume (%s copy) | p50 | p99 |\n|---|---|---|\n", size_name(lat_bytes).c_str());
    std::printf("| ferry: transfer::wait() | %.1f us | %.1f us |\n", f50, percentile(ferry_us, 0.99));
    std::printf("| runtime event synchronize | %.1f us | %.1f us |\n", s50, percentile(sync_us, 0.99));
    std::printf("\n| layer released → stream past its wait | p50 | p99 | CPU per release |\n|---|---|---|---|\n");
    for (const gate_row& row : gate_rows) {
      std::printf("| %s | %.1f us | %.1f us | %.2f us |\n", row.what, median(row.us), percentile(row.us, 0.99),
                  median(row.cpu_us));
    }
    std::printf("\n| target | measured | |\n|---|---|---|\n");
    std::printf("| bandwidth >= 95%% of raw at >= 1 MiB | see the ratios above | %s |\n",
                bandwidth_met ? "met" : "MISSED");
    std::printf("| completion noticed within 10 us of the event | p50 %.1f us | %s |\n", f50,
                f50 <= 10.0 ? "met" : "MISSED");
  } catch (const std::exception& ex) {
    std::printf("FAIL: %s\n", ex.what());
    return 1;
  }
  return 0;
}

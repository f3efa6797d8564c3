// ferry's microbenchmarks. Every figure is measured in this process, next to its baseline, and the
// targets are printed as ratios.
// Usage: ferry_bench [--quick] [latency] [when_all] [throughput] [uring] [tcp] [kv] [verbs]
//                    [metrics] [uring_depth]
// With no group named, every group but uring_depth runs (a sweep of queue depths that takes
// about two minutes).

#include <cstdio>
#include <cstring>
#include <string>
#include <thread>

#include "bench.hpp"
#include "harness.hpp"

int main(int argc, char** argv) {
  ferry_bench::options opt;
  bool latency = false, when_all = false, throughput = false, uring = false, tcp = false,
       kv = false, verbs = false, metrics = false, uring_depth = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") {
      opt.quick = true;
    } else if (a == "latency") {
      latency = true;
    } else if (a == "when_all") {
      when_all = true;
    } else if (a == "throughput") {
      throughput = true;
    } else if (a == "uring") {
      uring = true;
    } else if (a == "tcp") {
      tcp = true;
    } else if (a == "kv") {
      kv = true;
    } else if (a == "verbs") {
      verbs = true;
    } else if (a == "metrics") {
      metrics = true;
    } else if (a == "uring_depth") {
      uring_depth = true;
    } else {
      std::fprintf(stderr,
                   "usage: %s [--quick] [latency] [when_all] [throughput] [uring] [tcp] [kv] "
                   "[verbs] [metrics] [uring_depth]\n",
                   argv[0]);
      return 2;
    }
  }
  if (!latency && !when_all && !throughput && !uring && !tcp && !kv && !verbs && !metrics && !uring_depth) {
    latency = when_all = throughput = uring = tcp = kv = verbs = metrics = true;
  }

  std::printf("# ferry benchmarks%s (%u hardware threads)\n", opt.quick ? " (quick)" : "",
              std::thread::hardware_concurrency());
  if (latency) ferry_bench::run_latency(opt);
  if (when_all) ferry_bench::run_when_all(opt);
  if (throughput) ferry_bench::run_throughput(opt);
  if (kv) ferry_bench::run_kv(opt);
#if FERRY_BENCH_URING
  if (uring) ferry_bench::run_uring(opt);
  if (tcp) ferry_bench::run_tcp(opt);
  if (metrics) ferry_bench::run_metrics(opt);
  if (uring_depth) ferry_bench::run_uring_depth(opt);
#else
  if (uring || tcp || metrics || uring_depth) {
    std::printf("\n## io_uring and TCP\n\nskipped: built without liburing\n");
  }
#endif
#if FERRY_BENCH_VERBS
  if (verbs) {
    ferry_bench::run_verbs(opt);
    ferry_bench::run_verbs_hardware(opt);
  }
#else
  if (verbs) std::printf("\n## RDMA verbs\n\nskipped: built without libibverbs\n");
#endif

  std::printf("\n## Targets\n\n| target | measured | |\n|---|---|---|\n");
  for (const auto& t : ferry_bench::targets()) {
    std::printf("| %s | %s | %s |\n", t.what.c_str(), t.measured.c_str(), t.met ? "met" : "MISSED");
  }
  return 0;
}

// ferry's microbenchmarks. Every figure is measured in this process, next to its baseline, and the
// targets are printed as ratios.
// Usage: ferry_bench [--quick [--tables]] [latency] [when_all] [throughput] [uring] [tcp] [kv]
//                    [verbs] [metrics] [uring_depth]
// With no group named, every group but uring_depth runs (a sweep of queue depths that takes
// about two minutes).
// The full run prints every group's tables and then its targets. --quick runs each group briefly
// and prints one short table of headline figures instead, with no target verdicts: a quick run on
// a shared machine is no place to judge them. --quick --tables prints the quick run's tables and
// targets the way the full run does.

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "bench.hpp"
#include "harness.hpp"

namespace {

// How many CPUs this process may run on (what nproc prints).
unsigned usable_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof set, &set) != 0) return std::thread::hardware_concurrency();
  return static_cast<unsigned>(CPU_COUNT(&set));
}

// Whether the CPU says it runs under a hypervisor (the "hypervisor" flag in /proc/cpuinfo).
bool in_a_vm() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("flags", 0) == 0) return line.find(" hypervisor") != std::string::npos;
  }
  return false;
}

void print_quick_header() {
  const unsigned cpus = usable_cpus();
  double load[1] = {0};
  char load_text[128] = "";
  if (::getloadavg(load, 1) == 1) {
    std::snprintf(load_text, sizeof load_text, ", load average %.2f as the run began%s", load[0],
                  load[0] >= cpus ? " (busy with other work)" : "");
  }
  std::printf("# ferry_bench --quick: headline figures, each measured in this run beside its "
              "baseline.\n");
  std::printf("# Machine: %u CPUs (nproc)%s%s.\n", cpus, in_a_vm() ? ", a virtual machine" : "",
              load_text);
  std::printf("# A quick run is short, so its ratios move from run to run: by 15%% or more even on "
              "a quiet\n# machine, by 2x or more on a busy one. Recorded runs, with machine, commit "
              "and command:\n# bench/RESULTS.md.\n");
}

// The quick run's one table: its columns padded to their widest cell.
void print_figures() {
  using row = std::vector<std::string>;
  std::vector<row> rows = {
      {"figure", "ferry", "baseline", "which baseline", "ratio", "CPU per op"}};
  for (const auto& f : ferry_bench::figures()) {
    rows.push_back({f.what, f.ferry, f.baseline, f.baseline_name, f.ratio, f.cpu});
  }
  std::vector<std::size_t> width(rows.front().size(), 0);
  for (const row& r : rows) {
    for (std::size_t c = 0; c < r.size(); ++c) width[c] = std::max(width[c], r[c].size());
  }
  for (const row& r : rows) {
    std::string line;
    for (std::size_t c = 0; c < r.size(); ++c) {
      // Figures right-aligned, so that their units line up; names left-aligned.
      const bool right = c == 1 || c == 2 || c == 4;
      const std::string pad(width[c] - r[c].size(), ' ');
      line += c == 0 ? "" : "  ";
      line += right ? pad + r[c] : (c + 1 == r.size() ? r[c] : r[c] + pad);
    }
    std::printf("%s\n", line.c_str());
  }
}

void print_quick_footer() {
  std::printf("\nratio: ferry / baseline; below 1 is better for times (ns, us, ms), above 1 for "
              "rates (/s, IOPS, B/s).\nCPU per op: ferry's / the baseline's, every thread "
              "involved counted, where measured.\n");
  for (const std::string& n : ferry_bench::notes()) std::printf("%s\n", n.c_str());
  std::printf("Targets are not judged here: a quick run on a shared machine is too short and too "
              "noisy\nfor that. ferry_bench without --quick prints every table and ends with its "
              "targets;\nferry_latency_matrix judges the round-trip targets.\n");
}

}  // namespace

int main(int argc, char** argv) {
  ferry_bench::options opt;
  bool tables = false;
  bool latency = false, when_all = false, throughput = false, uring = false, tcp = false,
       kv = false, verbs = false, metrics = false, uring_depth = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") {
      opt.quick = true;
    } else if (a == "--tables") {
      tables = true;
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
                   "usage: %s [--quick [--tables]] [latency] [when_all] [throughput] [uring] [tcp] "
                   "[kv] [verbs] [metrics] [uring_depth]\n",
                   argv[0]);
      return 2;
    }
  }
  if (!latency && !when_all && !throughput && !uring && !tcp && !kv && !verbs && !metrics && !uring_depth) {
    latency = when_all = throughput = uring = tcp = kv = verbs = metrics = true;
  }

  if (tables && !opt.quick) {
    std::fprintf(stderr, "%s: --tables goes with --quick (the full run prints every table)\n",
                 argv[0]);
    return 2;
  }
  // A quick run prints a summary at the end instead of the tables, unless asked for them.
  const bool summary = opt.quick && !tables;
  ferry_bench::tables_shown() = !summary;
  if (summary) {
    print_quick_header();
  } else {
    std::printf("# ferry benchmarks%s (%u hardware threads)\n", opt.quick ? " (quick)" : "",
                std::thread::hardware_concurrency());
  }
  // In a summary run, what is being measured, on one line that grows as the run goes.
  const auto started = std::chrono::steady_clock::now();
  if (summary) std::printf("measuring:");
  const auto group = [&](const char* name) {
    if (!summary) return;
    std::printf(" %s", name);
    std::fflush(stdout);
  };
  if (latency) {
    group("latency");
    ferry_bench::run_latency(opt);
  }
  if (when_all) {
    group("when_all");
    ferry_bench::run_when_all(opt);
  }
  if (throughput) {
    group("throughput");
    ferry_bench::run_throughput(opt);
  }
  if (kv) {
    group("kv");
    ferry_bench::run_kv(opt);
  }
#if FERRY_BENCH_URING
  if (uring) {
    group("uring");
    ferry_bench::run_uring(opt);
  }
  if (tcp) {
    group("tcp");
    ferry_bench::run_tcp(opt);
  }
  if (metrics) {
    group("metrics");
    ferry_bench::run_metrics(opt);
  }
  if (uring_depth) {
    group("uring_depth");
    ferry_bench::run_uring_depth(opt);
  }
#else
  if (uring || tcp || metrics || uring_depth) {
    ferry_bench::full_printf("\n## io_uring and TCP\n\nskipped: built without liburing\n");
    ferry_bench::note("io_uring, TCP and metrics: not measured, built without liburing");
  }
#endif
#if FERRY_BENCH_VERBS
  if (verbs) {
    group("verbs");
    ferry_bench::run_verbs(opt);
    ferry_bench::run_verbs_hardware(opt);
  }
#else
  if (verbs) {
    ferry_bench::full_printf("\n## RDMA verbs\n\nskipped: built without libibverbs\n");
    ferry_bench::note("RDMA verbs: not measured, built without libibverbs");
  }
#endif

  if (summary) {
    std::printf(" (%.0f s)\n\n",
                std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
    print_figures();
    print_quick_footer();
    return 0;
  }
  std::printf("\n## Targets\n\n| target | measured | |\n|---|---|---|\n");
  for (const auto& t : ferry_bench::targets()) {
    std::printf("| %s | %s | %s |\n", t.what.c_str(), t.measured.c_str(), t.met ? "met" : "MISSED");
  }
  return 0;
}

// The directory's costs: a lookup's round trip (and the CPU it takes), 1000 names looked up at once
// against the same 1000 one after another (the sequential metadata fetch connectors do today), and
// how long after a peer republishes its name a named_peer is fenced. The in-process directory
// always; etcd with --etcd URL (a running etcd 3.4+; the figures in bench/RESULTS.md used one on
// 127.0.0.1). Medians over --runs runs; CPU is this process's user + system time per operation,
// every thread included (the executor's, and etcd's HTTP through it).
//
//   ferry_directory_bench [--etcd URL] [--runs N] [--quick]

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <ferry/directory.hpp>
#ifdef FERRY_BENCH_ETCD
#include <ferry/directory/etcd.hpp>
#endif

namespace {

using clock_type = std::chrono::steady_clock;
using maker = std::function<std::unique_ptr<ferry::directory>(ferry::progress_executor&)>;

double cpu_us() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) * 1e6 +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

double percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[std::min(v.size() - 1, static_cast<std::size_t>(p * static_cast<double>(v.size())))];
}

struct figures {
  double p50_us = 0, p99_us = 0, cpu_per_lookup_us = 0;  // one name, round trip
  double batch_ms = 0, batch_cpu_ms = 0;                  // 1000 names at once
  double sequential_ms = 0, sequential_cpu_ms = 0;        // the same 1000, one after another
  double fence_ms = 0;                                    // republish -> named_peer fenced
};

struct fake_endpoint {
  std::shared_ptr<std::atomic<bool>> severed = std::make_shared<std::atomic<bool>>(false);
  void sever(std::error_code) { severed->store(true); }
};

figures run_once(const maker& make, int singles, int names) {
  figures f;
  ferry::progress_executor exec_a, exec_b;
  std::unique_ptr<ferry::directory> pub = make(exec_a), reader = make(exec_b);
  const std::vector<std::byte> value(256, std::byte{7});  // a KV engine description's size
  std::vector<ferry::publication> pubs;
  std::vector<ferry::pending_result<ferry::publication>> pending;
  std::vector<std::string> all;
  for (int i = 0; i < names; ++i) {
    all.push_back("bench/" + std::to_string(i));
    pending.push_back(pub->publish(all.back(), value, {.lease = std::chrono::seconds(30)}));
  }
  for (auto& p : pending) pubs.push_back(p.get());

  // One name, round trip.
  std::vector<double> lat;
  double c0 = cpu_us();
  for (int i = 0; i < singles; ++i) {
    const auto t0 = clock_type::now();
    (void)reader->lookup(all[static_cast<std::size_t>(i % names)], std::chrono::seconds(5)).get();
    lat.push_back(std::chrono::duration<double, std::micro>(clock_type::now() - t0).count());
  }
  f.cpu_per_lookup_us = (cpu_us() - c0) / singles;
  f.p50_us = percentile(lat, 0.5);
  f.p99_us = percentile(lat, 0.99);

  // All names at once, under one deadline.
  c0 = cpu_us();
  auto t0 = clock_type::now();
  const auto results = reader->lookup(all, std::chrono::seconds(10)).get();
  f.batch_ms = std::chrono::duration<double, std::milli>(clock_type::now() - t0).count();
  f.batch_cpu_ms = (cpu_us() - c0) / 1000;
  for (const auto& r : results) {
    if (!r.record) std::fprintf(stderr, "lookup of %s failed: %s\n", r.name.c_str(), r.message.c_str());
  }

  // The same names one after another.
  c0 = cpu_us();
  t0 = clock_type::now();
  for (const std::string& n : all) (void)reader->lookup(n, std::chrono::seconds(5)).get();
  f.sequential_ms = std::chrono::duration<double, std::milli>(clock_type::now() - t0).count();
  f.sequential_cpu_ms = (cpu_us() - c0) / 1000;

  // Fence: a named_peer bound to bench/0; a new incarnation is published; time until it is severed.
  fake_endpoint bound;
  ferry::named_peer<fake_endpoint> peer(*reader, all[0], [&](const ferry::directory_record&) { return bound; });
  (void)peer.get(std::chrono::seconds(5));
  std::unique_ptr<ferry::directory> restarted = make(exec_a);
  t0 = clock_type::now();
  ferry::publication again = restarted->publish(all[0], value).get();
  while (!bound.severed->load() && clock_type::now() - t0 < std::chrono::seconds(10)) {
    std::this_thread::yield();
  }
  f.fence_ms = std::chrono::duration<double, std::milli>(clock_type::now() - t0).count();
  return f;
}

void report(const char* what, const maker& make, int runs, int singles, int names) {
  std::vector<figures> all;
  for (int r = 0; r < runs; ++r) all.push_back(run_once(make, singles, names));
  auto med = [&](double figures::*m) {
    std::vector<double> v;
    for (const figures& f : all) v.push_back(f.*m);
    return median(v);
  };
  std::printf("%-8s lookup p50 %8.1f us  p99 %8.1f us  cpu %7.1f us/lookup | %d names: at once %7.2f ms "
              "(cpu %6.2f ms), one by one %8.2f ms (cpu %7.2f ms), ratio %5.1fx | fence %6.2f ms\n",
              what, med(&figures::p50_us), med(&figures::p99_us), med(&figures::cpu_per_lookup_us), names,
              med(&figures::batch_ms), med(&figures::batch_cpu_ms), med(&figures::sequential_ms),
              med(&figures::sequential_cpu_ms), med(&figures::sequential_ms) / med(&figures::batch_ms),
              med(&figures::fence_ms));
}

}  // namespace

int main(int argc, char** argv) {
  std::string etcd;
  int runs = 5, singles = 2000, names = 1000;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--etcd" && i + 1 < argc) {
      etcd = argv[++i];
    } else if (a == "--runs" && i + 1 < argc) {
      runs = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--quick") {
      runs = 1;
      singles = 200;
      names = 100;
    } else {
      std::fprintf(stderr, "usage: %s [--etcd URL] [--runs N] [--quick]\n", argv[0]);
      return 2;
    }
  }
  std::printf("directory: medians of %d runs, %d single lookups, %d names of 256 bytes\n", runs, singles,
              names);
  auto registry = std::make_shared<ferry::local_registry>();
  report("local", [&](ferry::progress_executor& e) {
    return std::make_unique<ferry::local_directory>(e, ferry::directory_options{}, registry);
  }, runs, singles, names);
  if (!etcd.empty()) {
#ifdef FERRY_BENCH_ETCD
    int round = 0;
    report("etcd", [&](ferry::progress_executor& e) {
      ferry::etcd_options o;
      o.endpoints = {etcd};
      o.root = "ferry-bench-" + std::to_string(::getpid()) + "-" + std::to_string(round / 3) + "/";
      ++round;
      return std::make_unique<ferry::etcd_directory>(e, o);
    }, runs, singles, names);
#else
    std::fprintf(stderr, "built without the etcd directory\n");
    return 2;
#endif
  }
  return 0;
}

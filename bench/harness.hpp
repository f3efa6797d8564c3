#pragma once
// A small benchmark harness: latency samples with medians and tails, a table printer, and targets
// that are reported (never asserted) as ratios against baselines measured in the same run.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <coroutine>
#include <cstdarg>
#include <exception>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <csignal>

#include <pthread.h>
#include <sched.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

namespace ferry_bench {

using bench_clock = std::chrono::steady_clock;

inline std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             bench_clock::now().time_since_epoch())
      .count();
}

struct summary {
  double p50 = 0;
  double p99 = 0;
  double min = 0;
  double max = 0;
  std::size_t samples = 0;
};

inline summary summarize(std::vector<double> v) {
  summary s;
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  const auto at = [&](double q) {
    return v[std::min(v.size() - 1, static_cast<std::size_t>(q * static_cast<double>(v.size())))];
  };
  s.p50 = at(0.50);
  s.p99 = at(0.99);
  s.min = v.front();
  s.max = v.back();
  s.samples = v.size();
  return s;
}

inline std::string human_ns(double ns) {
  char buf[32];
  if (ns < 1e3) {
    std::snprintf(buf, sizeof buf, "%.0f ns", ns);
  } else if (ns < 1e6) {
    std::snprintf(buf, sizeof buf, "%.1f us", ns / 1e3);
  } else {
    std::snprintf(buf, sizeof buf, "%.2f ms", ns / 1e6);
  }
  return buf;
}

// What a run prints. The full run prints every group's tables as it goes, then the targets. A quick
// run prints none of that: each group hands its headline figures to report_figure (and what it
// skipped to note), and main prints them as one short table at the end.
inline bool& tables_shown() {
  static bool shown = true;
  return shown;
}

// printf for the detailed tables: prints only where the run shows them (not in a quick summary).
[[gnu::format(printf, 1, 2)]] inline void full_printf(const char* format, ...) {
  if (!tables_shown()) return;
  va_list args;
  va_start(args, format);
  std::vprintf(format, args);
  va_end(args);
}

// One line of the quick summary: ferry's figure beside its baseline's, measured in the same run.
struct figure {
  std::string what;           // what was measured
  std::string ferry;          // ferry's figure, with its unit
  std::string baseline;       // the baseline's figure, or "-" where the bench has none
  std::string baseline_name;  // which baseline: "raw liburing", "fio", "blocking sockets", ...
  std::string ratio;          // ferry / baseline, e.g. "1.08x", or "-"
  std::string cpu;            // CPU per operation, "ferry / baseline", or "-" where not measured
};

inline std::vector<figure>& figures() {
  static std::vector<figure> all;
  return all;
}

inline void report_figure(figure f) { figures().push_back(std::move(f)); }

// "1.08x" for a ratio, or "-" where the baseline measured nothing.
inline std::string ratio_text(double ferry, double baseline) {
  if (!(baseline > 0)) return "-";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2fx", ferry / baseline);
  return buf;
}

// "ferry / baseline" for two CPU times per operation; "-" for one not measured.
inline std::string cpu_pair(double ferry_ns, double baseline_ns) {
  return (ferry_ns > 0 ? human_ns(ferry_ns) : std::string("-")) + " / " +
         (baseline_ns > 0 ? human_ns(baseline_ns) : std::string("-"));
}

// Something a quick summary should mention that is not a figure: a group skipped, a baseline
// missing.
inline std::vector<std::string>& notes() {
  static std::vector<std::string> all;
  return all;
}

inline void note(std::string text) { notes().push_back(std::move(text)); }

// A target line: measured against what it must reach, printed as MET or MISSED.
struct target {
  std::string what;
  std::string measured;
  bool met = false;
};

inline std::vector<target>& targets() {
  static std::vector<target> all;
  return all;
}

inline void report_target(std::string what, std::string measured, bool met) {
  targets().push_back({std::move(what), std::move(measured), met});
}

// A user's own spinning scheduler: one slot, polled in a tight loop by the thread that runs it.
class spinning_scheduler {
 public:
  void post(std::coroutine_handle<> h) noexcept { slot_.store(h.address(), std::memory_order_release); }

  // Runs posted continuations until `stop` is set.
  void run_until(const std::atomic<bool>& stop) {
    while (!stop.load(std::memory_order_acquire)) {
      if (void* p = slot_.exchange(nullptr, std::memory_order_acquire)) {
        std::coroutine_handle<>::from_address(p).resume();
      }
    }
  }

 private:
  std::atomic<void*> slot_{nullptr};
};

// A fire-and-forget coroutine whose promise names its first argument as its scheduler.
struct spinning_coroutine {
  struct promise_type {
    spinning_scheduler* sched;
    template <class... Rest>
    explicit promise_type(spinning_scheduler& s, Rest&&...) : sched(&s) {}
    spinning_scheduler& get_scheduler() noexcept { return *sched; }
    spinning_coroutine get_return_object() noexcept { return {}; }
    std::suspend_never initial_suspend() noexcept { return {}; }
    std::suspend_never final_suspend() noexcept { return {}; }
    void return_void() noexcept {}
    void unhandled_exception() noexcept { std::terminate(); }
  };
};

// Calls each(i) for every i < count, once per pass, in a new order every pass (the same orders in
// every run), then after_pass(): drift in the machine's load, and whatever one measurement leaves
// behind for the next, then land on every configuration alike.
template <class Each, class AfterPass>
void in_shuffled_passes(std::size_t count, int passes, Each each, AfterPass after_pass) {
  std::vector<std::size_t> order(count);
  for (std::size_t i = 0; i < count; ++i) order[i] = i;
  std::mt19937 shuffler(2024);
  for (int pass = 0; pass < passes; ++pass) {
    std::shuffle(order.begin(), order.end(), shuffler);
    for (std::size_t i : order) each(i);
    after_pass();
  }
}

// Threads that hand work to each other are pinned to different CPUs, so that a measurement never
// includes the two sharing one.
inline void pin_to(unsigned cpu) {
  if (std::thread::hardware_concurrency() < 2) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu % std::thread::hardware_concurrency(), &set);
  ::pthread_setaffinity_np(::pthread_self(), sizeof set, &set);
}

// Pins the calling thread for a scope and restores its affinity afterwards, so that one section's
// pinning never squeezes a later section's threads onto one core.
class pinned_scope {
 public:
  explicit pinned_scope(unsigned cpu) {
    ::pthread_getaffinity_np(::pthread_self(), sizeof saved_, &saved_);
    pin_to(cpu);
  }
  ~pinned_scope() { ::pthread_setaffinity_np(::pthread_self(), sizeof saved_, &saved_); }
  pinned_scope(const pinned_scope&) = delete;
  pinned_scope& operator=(const pinned_scope&) = delete;

 private:
  cpu_set_t saved_{};
};

// Spin-wait helper for handshakes between benchmark threads.
inline void spin_until(const std::atomic<bool>& flag) {
  while (!flag.load(std::memory_order_acquire)) {
  }
}

// Spins, without sleeping, for `ns` nanoseconds.
inline void busy_wait_ns(std::int64_t ns) {
  const std::int64_t until = now_ns() + ns;
  while (now_ns() < until) {
  }
}

// CPU time the calling thread has used. A system call here (about 0.3 us), so measurements read it
// outside the interval whose latency they time.
inline std::int64_t thread_cpu_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<std::int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

// Another process keeping every CPU busy at normal priority while it lives: one child process per
// hardware thread, each a plain loop, so that measurements see what an engine thread sees beside a
// model that uses the whole machine. Children rather than threads, since the benchmark may already
// run threads, and a forked child should do no more than loop. Each child dies with the benchmark.
class cpu_load {
 public:
  cpu_load() {
    const unsigned n = std::max(1u, std::thread::hardware_concurrency());
    const pid_t parent = ::getpid();
    for (unsigned i = 0; i < n; ++i) {
      const pid_t pid = ::fork();
      if (pid == 0) {
        ::prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (::getppid() != parent) ::_exit(0);
        std::atomic<std::uint64_t> spins{0};
        for (;;) spins.fetch_add(1, std::memory_order_relaxed);  // a loop the compiler must keep
      }
      if (pid > 0) children_.push_back(pid);
    }
    // Give the children a moment to be scheduled before anything is measured beside them.
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ~cpu_load() {
    for (const pid_t pid : children_) ::kill(pid, SIGKILL);
    for (const pid_t pid : children_) ::waitpid(pid, nullptr, 0);
  }
  cpu_load(const cpu_load&) = delete;
  cpu_load& operator=(const cpu_load&) = delete;

 private:
  std::vector<pid_t> children_;
};

}  // namespace ferry_bench

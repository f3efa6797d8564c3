// Verdict latency after a failure at index k of N pending members: ferry's when_all (co_await) and
// wait_all (blocking) against a batch wait that waits member by member on condition variables with one
// shared deadline, the way mori-io's WaitAll does.

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <coroutine>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <ferry/ferry.hpp>

#include "bench.hpp"
#include "harness.hpp"

namespace ferry_bench {
namespace {

using namespace std::chrono_literals;

struct round_state {
  std::atomic<bool> waiting{false};             // the waiter is about to register
  std::atomic<std::int64_t> waiting_since{0};   // coroutine rounds: when registration began
  std::atomic<std::int64_t> registered_at{0};   // coroutine rounds: when registration ended
  std::atomic<bool> finished{false};
  std::atomic<std::int64_t> t0{0};
  double latency = 0;
  ferry::verdict seen = ferry::verdict::pending;
};

spinning_coroutine await_batch(spinning_scheduler& loop, std::span<const ferry::transfer> ts, round_state& st) {
  (void)loop;
  st.waiting_since.store(now_ns(), std::memory_order_relaxed);
  st.waiting.store(true, std::memory_order_release);
  const ferry::batch_result r = co_await ferry::when_all(ts, 60s);
  st.latency = static_cast<double>(now_ns() - st.t0.load(std::memory_order_acquire));
  st.seen = r.verdict;
  st.finished.store(true, std::memory_order_release);
}

// How long the waiting side idles between the end of its registration and the failure: the same for
// every row. Measured from the end of registration, not from its start, because the idle time itself
// moves the result on the shared VMs this was measured on (the lines under the table show how much):
// a settle counted from the start would leave the largest batches, which take milliseconds to
// register, the least idle time, and N would be measured together with it.
constexpr std::int64_t idle_ns = 2'000'000;

// How long registering N members took on the coroutine rounds. A blocking wait_all registers the
// same way but cannot say when it has finished, so its rounds wait this long before the idle starts.
class registration_times {
 public:
  void add(std::int64_t ns) { samples_.push_back(static_cast<double>(ns)); }
  [[nodiscard]] std::int64_t typical() const {
    return samples_.empty() ? 0 : static_cast<std::int64_t>(summarize(samples_).p50);
  }

 private:
  std::vector<double> samples_;
};

// Written one store per cache line by the waiting thread right after it registers, in one comparison
// line: about what registering 65536 members writes, left just as fresh in the cache.
std::vector<char>& scratch() {
  static std::vector<char> memory(std::size_t{8} << 20, 1);
  return memory;
}

enum class waiter_kind { coroutine, blocking };

struct round_setup {
  std::int64_t idle = idle_ns;
  std::size_t dirty_bytes = 0;  // coroutine rounds: written by the waiting thread once registered
};

double ferry_round(std::size_t n, std::size_t k, waiter_kind kind, registration_times& registration,
                   round_setup setup = {}) {
  std::vector<ferry::transfer> ts;
  std::vector<ferry::completer> cs;
  ts.reserve(n);
  cs.reserve(n);
  for (std::size_t i = 0; i < n; ++i) {
    auto [t, c] = ferry::make_manual_transfer();
    ts.push_back(std::move(t));
    cs.push_back(std::move(c));
  }
  round_state st;
  std::vector<char>& dirty = scratch();
  const pinned_scope pinned(0);
  std::thread waiter([&] {
    pin_to(1);
    if (kind == waiter_kind::coroutine) {
      spinning_scheduler loop;
      await_batch(loop, ts, st);  // returns once registered and suspended
      for (std::size_t i = 0; i < setup.dirty_bytes && i < dirty.size(); i += 64) {
        dirty[i] = static_cast<char>(i);
      }
      st.registered_at.store(now_ns(), std::memory_order_release);
      loop.run_until(st.finished);
    } else {
      st.waiting.store(true, std::memory_order_release);
      const auto r = ferry::wait_all(ts, 60s);
      st.latency = static_cast<double>(now_ns() - st.t0.load(std::memory_order_acquire));
      st.seen = r.verdict;
      st.finished.store(true, std::memory_order_release);
    }
  });
  if (kind == waiter_kind::coroutine) {
    while (st.registered_at.load(std::memory_order_acquire) == 0) {
    }
    registration.add(st.registered_at.load(std::memory_order_relaxed) -
                     st.waiting_since.load(std::memory_order_relaxed));
    busy_wait_ns(setup.idle);
  } else {
    spin_until(st.waiting);
    busy_wait_ns(registration.typical() + setup.idle);
  }
  st.t0.store(now_ns(), std::memory_order_release);
  cs[k].fail(std::make_error_code(std::errc::io_error));
  waiter.join();
  if (st.seen != ferry::verdict::failed) std::fprintf(stderr, "unexpected verdict\n");
  return st.latency;
}

// The baseline: one mutex + condition variable per member, waited in index order against one shared
// deadline. A failure at member k is noticed only after members 0..k-1 have finished, or at the
// deadline when they never do.
struct cv_member {
  std::mutex m;
  std::condition_variable cv;
  int state = 0;  // 0 pending, 1 success, 2 failed
};

double baseline_round(std::size_t n, std::size_t k, std::chrono::milliseconds deadline,
                      bool& saw_failure) {
  std::vector<std::unique_ptr<cv_member>> members;
  members.reserve(n);
  for (std::size_t i = 0; i < n; ++i) members.push_back(std::make_unique<cv_member>());
  std::atomic<bool> waiting{false};
  std::atomic<std::int64_t> t0{0};
  double latency = 0;
  bool failed = false;
  const pinned_scope pinned(0);
  std::thread waiter([&] {
    pin_to(1);
    const auto until = bench_clock::now() + deadline;
    waiting.store(true, std::memory_order_release);
    for (auto& m : members) {
      std::unique_lock lock(m->m);
      if (!m->cv.wait_until(lock, until, [&] { return m->state != 0; })) break;  // timed out
      if (m->state == 2) {
        failed = true;
        break;
      }
    }
    latency = static_cast<double>(now_ns() - t0.load(std::memory_order_acquire));
  });
  spin_until(waiting);
  busy_wait_ns(idle_ns);
  t0.store(now_ns(), std::memory_order_release);
  {
    std::lock_guard lock(members[k]->m);
    members[k]->state = 2;
  }
  members[k]->cv.notify_all();
  waiter.join();
  saw_failure = failed;
  return latency;
}

// The floor under this table: one word handed from the failing thread to the waiting one, after
// the same idle time.
double handoff_round() {
  std::atomic<bool> ready{false};
  std::atomic<int> slot{0};
  std::atomic<std::int64_t> t0{0};
  double latency = 0;
  const pinned_scope pinned(0);
  std::thread waiter([&] {
    pin_to(1);
    ready.store(true, std::memory_order_release);
    while (slot.load(std::memory_order_acquire) == 0) {
    }
    latency = static_cast<double>(now_ns() - t0.load(std::memory_order_acquire));
  });
  spin_until(ready);
  busy_wait_ns(idle_ns);
  t0.store(now_ns(), std::memory_order_release);
  slot.store(1, std::memory_order_release);
  waiter.join();
  return latency;
}

}  // namespace

void run_when_all(const options& opt) {
  const std::vector<std::size_t> sizes = {1, 64, 4096, 65536};
  const auto baseline_deadline = std::chrono::milliseconds(opt.quick ? 20 : 50);
  full_printf("\n## when_all verdict latency after a failure at index k of N pending members\n\n");
  full_printf("Medians over interleaved passes. co_await rows: the member fails %.1f ms after the "
              "waiter finished registering. wait_all cannot say when it has registered: its rows "
              "wait the co_await rounds' median registration time for the same N, then the same "
              "idle. The baseline waits member by member with a %lld ms shared deadline.\n\n",
              static_cast<double>(idle_ns) / 1e6, static_cast<long long>(baseline_deadline.count()));
  full_printf("| N | k | ferry co_await | ferry wait_all | member-by-member baseline | baseline saw "
              "the failure |\n|---|---|---|---|---|---|\n");
  struct config {
    std::size_t n;
    std::size_t k;
    std::vector<double> co, blocking;
  };
  std::vector<config> configs;
  for (std::size_t n : sizes) {
    std::vector<std::size_t> ks = {0, n / 2, n - 1};
    ks.erase(std::unique(ks.begin(), ks.end()), ks.end());
    for (std::size_t k : ks) configs.push_back({n, k, {}, {}});
  }
  std::map<std::size_t, registration_times> registration;  // by N
  for (config& c : configs) {  // warm-up: pools, pages, the timer thread, registration times
    (void)ferry_round(c.n, c.k, waiter_kind::coroutine, registration[c.n]);
    (void)ferry_round(c.n, c.k, waiter_kind::blocking, registration[c.n]);
  }
  const int passes = opt.quick ? 5 : 21;
  // Measured in the same passes, outside the sweep: the bare handoff after the same idle time; and
  // N = 64 twice more, once idle three times as long, once with the waiting thread writing 8 MiB
  // right after registering (about what registering 65536 members writes), to show what each does
  // to the result. Their registration times are kept apart from the sweep's.
  constexpr std::int64_t long_idle_ns = 3 * idle_ns;
  constexpr std::size_t dirty_bytes = std::size_t{8} << 20;
  std::vector<double> floor, long_idle, after_writes;
  registration_times comparison_registration;
  // Every configuration is measured once per pass, in a new order each pass (freeing 65536
  // transfers is not free, and a fixed order would always charge it to the same row).
  in_shuffled_passes(
      configs.size(), passes,
      [&](std::size_t i) {
        config& c = configs[i];
        c.co.push_back(ferry_round(c.n, c.k, waiter_kind::coroutine, registration[c.n]));
        c.blocking.push_back(ferry_round(c.n, c.k, waiter_kind::blocking, registration[c.n]));
      },
      [&] {
        floor.push_back(handoff_round());
        long_idle.push_back(ferry_round(64, 63, waiter_kind::coroutine, comparison_registration,
                                        round_setup{long_idle_ns, 0}));
        after_writes.push_back(ferry_round(64, 63, waiter_kind::coroutine, comparison_registration,
                                           round_setup{idle_ns, dirty_bytes}));
      });
  double lo = 1e300, hi = 0;
  double lo_b = 1e300, hi_b = 0;
  for (config& c : configs) {
    bool saw = false;
    std::vector<double> base;
    for (int r = 0; r < (opt.quick ? 1 : 3); ++r) {
      base.push_back(baseline_round(c.n, c.k, baseline_deadline, saw));
    }
    const double c50 = summarize(c.co).p50;
    const double b50 = summarize(c.blocking).p50;
    lo = std::min(lo, c50);
    hi = std::max(hi, c50);
    lo_b = std::min(lo_b, b50);
    hi_b = std::max(hi_b, b50);
    full_printf("| %zu | %zu | %s | %s | %s | %s |\n", c.n, c.k, human_ns(c50).c_str(),
                human_ns(b50).c_str(), human_ns(summarize(base).p50).c_str(),
                saw ? "yes" : "no (timed out)");
    if (&c == &configs.back()) {  // the largest N, failing at its last member
      const double b = summarize(base).p50;
      report_figure({"when_all verdict, failure at " + std::to_string(c.k) + "/" +
                         std::to_string(c.n),
                     human_ns(c50), human_ns(b), saw ? "one by one" : "one by one, timed out",
                     ratio_text(c50, b), "-"});
    }
  }
  full_printf("\nMeasured in the same passes: a bare one-word handoff between the same two threads "
              "after the same idle time takes %s. ferry co_await with N = 64, k = 63 takes %s when "
              "the waiter idles %.1f ms instead of %.1f ms, and %s when the waiting thread wrote "
              "%zu MiB right after registering. Registering took %s for N = %zu (median).\n",
              human_ns(summarize(floor).p50).c_str(), human_ns(summarize(long_idle).p50).c_str(),
              static_cast<double>(long_idle_ns) / 1e6, static_cast<double>(idle_ns) / 1e6,
              human_ns(summarize(after_writes).p50).c_str(), dirty_bytes >> 20,
              human_ns(static_cast<double>(registration[sizes.back()].typical())).c_str(),
              sizes.back());
  char buf[128];
  std::snprintf(buf, sizeof buf, "max/min %.2f (co_await), %.2f (wait_all)", hi / lo, hi_b / lo_b);
  report_target("short-circuit latency flat in k and N (max/min <= 2)", buf, hi / lo <= 2.0);
}

}  // namespace ferry_bench

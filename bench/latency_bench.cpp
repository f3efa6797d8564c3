// Completion -> resume latency: from the moment a completing thread ends a transfer to the moment the
// waiting side runs again, for ferry's co_await and blocking wait and for the ways engines wait today,
// with the CPU time each side spends per wait. Every waiter runs in four settings: its two threads
// pinned to different CPUs or left to the scheduler, on an idle machine and beside another process
// that keeps every CPU busy (as a model does an engine's machine).

#include <atomic>
#include <condition_variable>
#include <coroutine>
#include <cstdio>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include <sys/prctl.h>
#include <time.h>

#include <ferry/ferry.hpp>

#include "bench.hpp"
#include "harness.hpp"

namespace ferry_bench {
namespace {

// How long after the waiter blocks the completing thread ends the transfer: completions 50 us apart,
// longer than any waiter's fixed pauses and far shorter than a scheduler's time slice.
constexpr std::int64_t completion_gap_ns = 50'000;

// One round's handshake between the completing thread and the waiting thread. Both sides block on
// these words between rounds (std::atomic wait), so that on a loaded machine, or with the two
// threads sharing a CPU, neither spins in the other's way outside the wait being measured.
struct handshake {
  std::atomic<std::uint32_t> armed{0};
  std::atomic<std::uint32_t> waiting{0};
  std::atomic<std::uint32_t> done{0};
  std::atomic<std::int64_t> t0{0};
  std::int64_t announced = 0;  // when the waiter announced its wait; read by the completer
  std::int64_t cpu_from = 0;   // the waiter's CPU clock then; the waiter's own

  // The waiting side calls this just before it blocks. The waiter's CPU clock starts after the
  // notify, which is the benchmark's cost rather than the wait's.
  void announce() {
    announced = now_ns();
    waiting.store(1, std::memory_order_release);
    waiting.notify_one();
    cpu_from = thread_cpu_ns();
  }
};

void await_set(std::atomic<std::uint32_t>& word) {
  while (word.load(std::memory_order_acquire) == 0) word.wait(0, std::memory_order_acquire);
}

void set_and_notify(std::atomic<std::uint32_t>& word) {
  word.store(1, std::memory_order_release);
  word.notify_one();
}

void sleep_until_ns(std::int64_t deadline) {
  const timespec ts{static_cast<time_t>(deadline / 1'000'000'000),
                    static_cast<long>(deadline % 1'000'000'000)};
  while (::clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, nullptr) != 0) {
  }
}

// What a set of rounds measured: each round's latency and gap, and the CPU time each side spent.
struct rounds_measured {
  std::vector<double> latency;
  std::vector<double> gap;  // from the waiter's announcement to the completion
  double waiter_cpu_ns = 0;     // from the announcement to the waiter running again
  double completer_cpu_ns = 0;  // in the completing call

  void add(const rounds_measured& more) {
    latency.insert(latency.end(), more.latency.begin(), more.latency.end());
    gap.insert(gap.end(), more.gap.begin(), more.gap.end());
    waiter_cpu_ns += more.waiter_cpu_ns;
    completer_cpu_ns += more.completer_cpu_ns;
  }
};

// Runs `iterations` rounds on two new threads, pinned to CPUs 1 and 0 when `pinned`: the waiter side
// calls wait_side(h), which must call h.announce() just before it blocks and return the latency it
// measured; the completer side calls prepare(), then, completion_gap_ns after the announcement
// (sleeping, as a thread that completes transfers does between them), stamps t0 and calls complete().
template <class Prepare, class Wait, class Complete>
rounds_measured measure(bool pinned, int iterations, Prepare prepare, Wait wait_side,
                        Complete complete) {
  rounds_measured m;
  m.latency.reserve(static_cast<std::size_t>(iterations));
  m.gap.reserve(static_cast<std::size_t>(iterations));
  handshake h;
  std::thread waiter([&] {
    if (pinned) pin_to(1);
    for (int i = 0; i < iterations; ++i) {
      await_set(h.armed);
      h.armed.store(0, std::memory_order_relaxed);
      const double latency = wait_side(h);
      m.waiter_cpu_ns += static_cast<double>(thread_cpu_ns() - h.cpu_from);
      m.latency.push_back(latency);
      set_and_notify(h.done);
    }
  });
  std::thread completing([&] {
    // The default timer slack (50 us) would stretch every gap by up to that much.
    ::prctl(PR_SET_TIMERSLACK, 1UL);
    if (pinned) pin_to(0);
    for (int i = 0; i < iterations; ++i) {
      prepare();
      h.done.store(0, std::memory_order_relaxed);
      h.waiting.store(0, std::memory_order_relaxed);
      set_and_notify(h.armed);
      await_set(h.waiting);
      sleep_until_ns(h.announced + completion_gap_ns);
      const std::int64_t cpu_from = thread_cpu_ns();
      h.t0.store(now_ns(), std::memory_order_release);
      complete();
      m.completer_cpu_ns += static_cast<double>(thread_cpu_ns() - cpu_from);
      m.gap.push_back(static_cast<double>(h.t0.load(std::memory_order_relaxed) - h.announced));
      await_set(h.done);
    }
  });
  completing.join();
  waiter.join();
  return m;
}

double since(const handshake& h) {
  return static_cast<double>(now_ns() - h.t0.load(std::memory_order_acquire));
}

// A mori-io style status: a mutex, a condition variable and a flag, waited on by the engine thread.
struct cv_status {
  std::mutex m;
  std::condition_variable cv;
  bool done = false;
};

spinning_coroutine await_once(spinning_scheduler& sched, ferry::transfer t, handshake& hs,
                            double& out, std::atomic<bool>& stop) {
  (void)sched;
  hs.announce();
  (void)co_await t;
  out = since(hs);
  stop.store(true, std::memory_order_release);
}

// The transfer a round waits on, and its completer: made fresh for every round.
struct manual_round {
  ferry::transfer current;
  ferry::completer completing;

  void prepare() {
    auto [t, c] = ferry::make_manual_transfer();
    current = std::move(t);
    completing = std::move(c);
  }
  void complete() { completing.succeed(); }
};

// Rounds of ferry's wait() on a manual transfer, on a thread whose wait spin limit is `limit`, or
// the default when none is given. The waiting thread is new, so its adaptive spin starts from none.
rounds_measured ferry_wait_rounds(bool pinned, int n,
                                  std::optional<std::chrono::nanoseconds> limit) {
  manual_round round;
  return measure(
      pinned, n, [&] { round.prepare(); },
      [&](handshake& h) {
        if (limit) ferry::set_wait_spin_limit(*limit);
        h.announce();
        (void)round.current.wait();
        return since(h);
      },
      [&] { round.complete(); });
}

struct waiter_kind {
  const char* name;
  std::function<rounds_measured(bool pinned, int rounds)> rounds;
};

std::vector<waiter_kind> waiter_kinds() {
  std::vector<waiter_kind> kinds;

  // The floor: a bare cross-thread atomic handoff.
  kinds.push_back({"atomic handoff (floor)", [](bool pinned, int n) {
    std::atomic<bool> flag{false};
    return measure(
        pinned, n, [&] { flag.store(false); },
        [&](handshake& h) {
          h.announce();
          while (!flag.load(std::memory_order_acquire)) {
          }
          return since(h);
        },
        [&] { flag.store(true, std::memory_order_release); });
  }});

  // ferry: co_await on a spinning user scheduler.
  kinds.push_back({"ferry co_await (spinning user scheduler)", [](bool pinned, int n) {
    manual_round round;
    return measure(
        pinned, n, [&] { round.prepare(); },
        [&](handshake& h) {
          spinning_scheduler sched;
          std::atomic<bool> stop{false};
          double latency = 0;
          await_once(sched, round.current, h, latency, stop);
          sched.run_until(stop);
          return latency;
        },
        [&] { round.complete(); });
  }});

  kinds.push_back({"ferry wait(), default", [](bool pinned, int n) {
    return ferry_wait_rounds(pinned, n, std::nullopt);
  }});
  kinds.push_back({"ferry wait(), spin limit 0", [](bool pinned, int n) {
    return ferry_wait_rounds(pinned, n, std::chrono::nanoseconds::zero());
  }});
  // The opt-in for a thread with a CPU of its own: rounds end about 50 us after the waiter starts,
  // within the limit, so after its first few sleeps the waiter meets them spinning.
  kinds.push_back({"ferry wait(), spin limit 500 us (opt-in)", [](bool pinned, int n) {
    return ferry_wait_rounds(pinned, n, std::chrono::microseconds(500));
  }});

  // Baseline: condition variable (how mori-io's Wait works, member by member).
  kinds.push_back({"condition variable", [](bool pinned, int n) {
    auto st = std::make_unique<cv_status>();
    return measure(
        pinned, n, [&] { st = std::make_unique<cv_status>(); },
        [&](handshake& h) {
          std::unique_lock lock(st->m);
          h.announce();
          st->cv.wait(lock, [&] { return st->done; });
          return since(h);
        },
        [&] {
          {
            std::lock_guard lock(st->m);
            st->done = true;
          }
          st->cv.notify_all();
        });
  }});

  // Baseline: std::future.
  kinds.push_back({"std::future", [](bool pinned, int n) {
    std::promise<void> p;
    std::future<void> f;
    return measure(
        pinned, n,
        [&] {
          p = std::promise<void>();
          f = p.get_future();
        },
        [&](handshake& h) {
          h.announce();
          f.get();
          return since(h);
        },
        [&] { p.set_value(); });
  }});
  return kinds;
}

// Baseline: a 1 ms polling loop on the status.
rounds_measured polling_rounds(bool pinned, int n) {
  manual_round round;
  return measure(
      pinned, n, [&] { round.prepare(); },
      [&](handshake& h) {
        h.announce();
        while (!round.current.done()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
        return since(h);
      },
      [&] { round.complete(); });
}

struct row {
  const char* name;
  summary latency;
  double waiter_cpu_ns;
  double completer_cpu_ns;
};

row summarize_row(const char* name, const rounds_measured& m) {
  const double n = static_cast<double>(std::max<std::size_t>(1, m.latency.size()));
  return {name, summarize(m.latency), m.waiter_cpu_ns / n, m.completer_cpu_ns / n};
}

// Row indices, in waiter_kinds() order.
constexpr std::size_t floor_row = 0, co_await_row = 1, default_wait_row = 2, cv_row = 5;

struct setting {
  const char* name;
  bool pinned;
  bool loaded;
};

// The rows of one setting, in the order waiter_kinds() gives them, then the polling loop.
std::vector<row> measure_setting(const setting& s, int fast_iters, int slow_iters, int passes,
                                 double& gap_p50) {
  const std::vector<waiter_kind> kinds = waiter_kinds();
  // Interleaved passes, each waiter's share in a new order every pass: the machine's load drifts
  // over seconds, and the rows compared with each other should all see the same drift.
  std::vector<rounds_measured> measured(kinds.size());
  in_shuffled_passes(
      kinds.size(), passes,
      [&](std::size_t i) { measured[i].add(kinds[i].rounds(s.pinned, fast_iters / passes)); },
      [] {});
  std::vector<row> rows;
  std::vector<double> gaps;
  for (std::size_t i = 0; i < kinds.size(); ++i) {
    rows.push_back(summarize_row(kinds[i].name, measured[i]));
    gaps.insert(gaps.end(), measured[i].gap.begin(), measured[i].gap.end());
  }
  rows.push_back(summarize_row("1 ms polling loop", polling_rounds(s.pinned, slow_iters)));
  gap_p50 = summarize(gaps).p50;
  return rows;
}

void print_setting(const setting& s, const std::vector<row>& rows, double gap_p50) {
  full_printf("\n### %s, %s (completions a median %s after the waiter blocks)\n\n",
              s.pinned ? "pinned apart" : "unpinned",
              s.loaded ? "every CPU busy with another process" : "idle machine",
              human_ns(gap_p50).c_str());
  full_printf("| waiter | p50 | p99 | p50 / condition variable | CPU per wait: waiter | CPU per "
              "wait: completer |\n|---|---|---|---|---|---|\n");
  const double cv = rows[cv_row].latency.p50;
  for (const row& r : rows) {
    full_printf("| %s | %s | %s | %.2fx | %s | %s |\n", r.name, human_ns(r.latency.p50).c_str(),
                human_ns(r.latency.p99).c_str(), r.latency.p50 / cv,
                human_ns(r.waiter_cpu_ns).c_str(), human_ns(r.completer_cpu_ns).c_str());
  }
}

}  // namespace

void run_latency(const options& opt) {
  // Rounds on a loaded machine take far longer (a spinning waiter shares its CPU with the load), so
  // the quick run keeps them few.
  const int fast_iters = opt.quick ? 300 : 3000;
  const int loaded_iters = opt.quick ? 30 : 1000;
  const int slow_iters = opt.quick ? 20 : 200;
  const int passes = opt.quick ? 3 : 10;

  full_printf("\n## Completion -> resume latency, and CPU time per wait (%d rounds per waiter in %d "
              "interleaved passes, %d beside the load; 1 ms polling: %d)\n",
              fast_iters, passes, loaded_iters, slow_iters);
  full_printf("\nCPU per wait: the waiter's from just before it blocks until it runs again; the "
              "completer's in the call that completes.\n");

  const setting settings[] = {
      {"pinned, idle", true, false},
      {"unpinned, idle", false, false},
      {"pinned, loaded", true, true},
      {"unpinned, loaded", false, true},
  };
  std::optional<cpu_load> load;
  char buf[160];
  for (const setting& s : settings) {
    if (s.loaded && !load) load.emplace();
    double gap_p50 = 0;
    const std::vector<row> rows =
        measure_setting(s, s.loaded ? loaded_iters : fast_iters, slow_iters, passes, gap_p50);
    print_setting(s, rows, gap_p50);

    const double wait = rows[default_wait_row].latency.p50;
    const double cv = rows[cv_row].latency.p50;
    // CPU per wait, for the quick summary: the waiter's and the completer's together.
    const auto cpu = [&](std::size_t r) {
      return rows[r].waiter_cpu_ns + rows[r].completer_cpu_ns;
    };
    if (s.pinned && !s.loaded) {
      const double co = rows[co_await_row].latency.p50;
      const double floor = rows[floor_row].latency.p50;
      report_figure({"co_await resume, spinning scheduler, p50", human_ns(co), human_ns(floor),
                     "atomic handoff, spins", ratio_text(co, floor),
                     cpu_pair(cpu(co_await_row), cpu(floor_row))});
      std::snprintf(buf, sizeof buf, "%.2fx the floor", co / floor);
      report_target("co_await p50 within 3x of the bare handoff", buf, co <= 3 * floor);
    }
    // The quick summary keeps the pinned setting without the added load: beside the load, a
    // quick run's few rounds give medians that jump between microseconds and milliseconds.
    if (s.pinned && !s.loaded) {
      report_figure({"blocking wait() p50, threads pinned apart", human_ns(wait), human_ns(cv),
                     "condition variable", ratio_text(wait, cv),
                     cpu_pair(cpu(default_wait_row), cpu(cv_row))});
    }
    std::snprintf(buf, sizeof buf, "%.2fx the condition variable; CPU per wait %s against %s",
                  wait / cv, human_ns(rows[default_wait_row].waiter_cpu_ns).c_str(),
                  human_ns(rows[cv_row].waiter_cpu_ns).c_str());
    report_target(std::string("default wait() p50 no slower than the condition variable (") +
                      s.name + ")",
                  buf, wait <= cv);
  }
}

}  // namespace ferry_bench

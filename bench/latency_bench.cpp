// Completion -> resume latency: from the moment a completing thread ends a transfer to the moment the
// waiting side runs again, for ferry's co_await and blocking wait and for the ways engines wait today.

#include <atomic>
#include <condition_variable>
#include <coroutine>
#include <cstdio>
#include <functional>
#include <future>
#include <mutex>
#include <thread>
#include <vector>

#include <ferry/ferry.hpp>

#include "bench.hpp"
#include "harness.hpp"

namespace ferry_bench {
namespace {

// One iteration's handshake between the completing thread and the waiting thread.
struct handshake {
  std::atomic<bool> armed{false};
  std::atomic<bool> waiting{false};
  std::atomic<bool> done{false};
  std::atomic<std::int64_t> t0{0};
};

// Runs `iterations` rounds: the waiter side calls wait_side(i) (which must set h.waiting just before it
// blocks, and return the latency it measured); the completer side sleeps a little once the waiter is
// blocked, stamps t0 and calls complete(i).
template <class Prepare, class Wait, class Complete>
std::vector<double> measure(int iterations, Prepare prepare, Wait wait_side, Complete complete) {
  std::vector<double> samples;
  samples.reserve(static_cast<std::size_t>(iterations));
  handshake h;
  std::thread waiter([&] {
    pin_to(1);
    for (int i = 0; i < iterations; ++i) {
      spin_until(h.armed);
      h.armed.store(false, std::memory_order_relaxed);
      samples.push_back(wait_side(h));
      h.done.store(true, std::memory_order_release);
    }
  });
  const pinned_scope pinned(0);
  for (int i = 0; i < iterations; ++i) {
    prepare();
    h.done.store(false, std::memory_order_relaxed);
    h.waiting.store(false, std::memory_order_relaxed);
    h.armed.store(true, std::memory_order_release);
    spin_until(h.waiting);
    busy_wait_ns(30'000);  // let the waiter block for real
    h.t0.store(now_ns(), std::memory_order_release);
    complete();
    spin_until(h.done);
  }
  waiter.join();
  return samples;
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
  hs.waiting.store(true, std::memory_order_release);
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

// Rounds of ferry's wait() on a manual transfer; `adaptive` false holds the waiter's spin at zero.
std::vector<double> ferry_wait_rounds(int n, bool adaptive) {
  manual_round round;
  return measure(
      n, [&] { round.prepare(); },
      [&](handshake& h) {
        if (!adaptive) ferry::set_wait_spin_limit(std::chrono::nanoseconds::zero());
        h.waiting.store(true, std::memory_order_release);
        (void)round.current.wait();
        return since(h);
      },
      [&] { round.complete(); });
}

}  // namespace

void run_latency(const options& opt) {
  const int fast_iters = opt.quick ? 300 : 3000;
  const int slow_iters = opt.quick ? 30 : 200;

  struct row {
    const char* name;
    summary s;
  };
  std::vector<row> rows;

  // Each waiter measures `n` rounds and returns their latencies.
  struct waiter_kind {
    const char* name;
    std::function<std::vector<double>(int)> rounds;
  };
  std::vector<waiter_kind> kinds;

  // The floor: a bare cross-thread atomic handoff.
  kinds.push_back({"atomic handoff (floor)", [](int n) {
    std::atomic<bool> flag{false};
    return measure(
        n, [&] { flag.store(false); },
        [&](handshake& h) {
          h.waiting.store(true, std::memory_order_release);
          while (!flag.load(std::memory_order_acquire)) {
          }
          return since(h);
        },
        [&] { flag.store(true, std::memory_order_release); });
  }});

  // ferry: co_await on a spinning user scheduler.
  kinds.push_back({"ferry co_await (spinning scheduler)", [](int n) {
    manual_round round;
    return measure(
        n, [&] { round.prepare(); },
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

  // ferry: blocking wait(), sleeping after its fixed pauses, as a thread that waits seldom or long
  // does (its adaptive spin held at zero).
  kinds.push_back({"ferry wait() (blocking)", [](int n) { return ferry_wait_rounds(n, false); }});

  // Baseline: condition variable (how mori-io's Wait works, member by member).
  kinds.push_back({"condition variable", [](int n) {
    auto st = std::make_unique<cv_status>();
    return measure(
        n, [&] { st = std::make_unique<cv_status>(); },
        [&](handshake& h) {
          std::unique_lock lock(st->m);
          h.waiting.store(true, std::memory_order_release);
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
  kinds.push_back({"std::future", [](int n) {
    std::promise<void> p;
    std::future<void> f;
    return measure(
        n,
        [&] {
          p = std::promise<void>();
          f = p.get_future();
        },
        [&](handshake& h) {
          h.waiting.store(true, std::memory_order_release);
          f.get();
          return since(h);
        },
        [&] { p.set_value(); });
  }});

  // ferry: wait() with the default adaptive spin. Rounds end about 30 us after the waiter starts,
  // within the 500 us limit, so after its first few sleeps the waiter meets them spinning.
  kinds.push_back({"ferry wait() (adaptive spin)", [](int n) { return ferry_wait_rounds(n, true); }});

  // Interleaved passes, each waiter's share in a new order every pass: the machine's load drifts
  // over seconds, and the rows compared with each other should all see the same drift.
  const int passes = opt.quick ? 3 : 10;
  std::vector<std::vector<double>> samples(kinds.size());
  in_shuffled_passes(
      kinds.size(), passes,
      [&](std::size_t i) {
        const std::vector<double> got = kinds[i].rounds(fast_iters / passes);
        samples[i].insert(samples[i].end(), got.begin(), got.end());
      },
      [] {});
  for (std::size_t i = 0; i < kinds.size(); ++i) rows.push_back({kinds[i].name, summarize(samples[i])});

  // Baseline: a 1 ms polling loop on the status.
  {
    manual_round round;
    auto s = measure(
        slow_iters,
        [&] { round.prepare(); },
        [&](handshake& h) {
          h.waiting.store(true, std::memory_order_release);
          while (!round.current.done()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
          return since(h);
        },
        [&] { round.complete(); });
    rows.push_back({"1 ms polling loop", summarize(s)});
  }

  std::printf("\n## Completion -> resume latency (%d iterations in %d interleaved passes; 1 ms "
              "polling: %d)\n\n",
              fast_iters, passes, slow_iters);
  std::printf("| waiter | p50 | p99 | p50 / floor |\n|---|---|---|---|\n");
  const double floor = rows[0].s.p50;
  for (const row& r : rows) {
    std::printf("| %s | %s | %s | %.1fx |\n", r.name, human_ns(r.s.p50).c_str(),
                human_ns(r.s.p99).c_str(), r.s.p50 / floor);
  }
  const double co = rows[1].s.p50;
  const double blocking = rows[2].s.p50;
  const double cv = rows[3].s.p50;
  char buf[128];
  std::snprintf(buf, sizeof buf, "%.2fx the floor", co / floor);
  report_target("co_await p50 within 3x of the bare handoff", buf, co <= 3 * floor);
  std::snprintf(buf, sizeof buf, "%.2fx the condition variable", blocking / cv);
  report_target("blocking wait() p50 no slower than the condition variable", buf, blocking <= cv);
}

}  // namespace ferry_bench

#pragma once
// Shared by the tests: an engine thread driving a run_loop, a stopwatch, thread identities, and the
// data and errors the tests move and inject, and a metrics series looked up by kind and peer.

#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <coroutine>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <span>
#include <string>
#include <system_error>
#include <thread>
#include <type_traits>
#include <vector>

#include <ferry/detail/spin.hpp>
#include <ferry/detail/status_block.hpp>
#include <ferry/ferry.hpp>
#include <ferry/metrics.hpp>

namespace ferry_test {

using namespace std::chrono_literals;
using clock_type = std::chrono::steady_clock;

// Generous bounds: "did not hang" and "did not wait for the deadline", never performance.
inline constexpr auto hang_bound = std::chrono::seconds(10);

// The error most tests fail a transfer with.
inline const std::error_code io_error = std::make_error_code(std::errc::io_error);

// `n` bytes that differ from those of another seed, to copy and compare.
inline std::vector<std::byte> pattern(std::size_t n, unsigned seed) {
  std::vector<std::byte> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<std::byte>((i * 131 + seed) & 0xff);
  return v;
}

inline double ms_since(clock_type::time_point start) {
  return std::chrono::duration<double, std::milli>(clock_type::now() - start).count();
}

// Polls `pred` until it holds or `bound` passes; returns whether it held.
template <class Pred>
bool wait_until(Pred pred, std::chrono::milliseconds bound = std::chrono::seconds(10)) {
  const auto start = clock_type::now();
  while (!pred()) {
    if (clock_type::now() - start > bound) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  return true;
}

// Adaptive executor options that park as soon as a round finds nothing, but spin all along while a
// source has I/O in flight: whether the executor sleeps then shows in its counters.
inline ferry::executor_options spin_while_in_flight() {
  ferry::executor_options options;
  options.spin_budget = std::chrono::nanoseconds::zero();
  options.in_flight_spin = std::chrono::hours(1);
  return options;
}

// An executor's counters now and 100 ms later.
struct counters_over_100ms {
  ferry::executor_counters before, after;

  explicit counters_over_100ms(const ferry::progress_executor& exec) : before(exec.counters()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    after = exec.counters();
  }
  [[nodiscard]] bool slept() const { return after.parks != before.parks; }
  [[nodiscard]] bool went_round() const { return after.rounds > before.rounds + 10; }
};

// N manual transfers and their completers.
struct batch {
  std::vector<ferry::transfer> transfers;
  std::vector<ferry::completer> completers;

  explicit batch(std::size_t n) {
    for (std::size_t i = 0; i < n; ++i) {
      auto [t, c] = ferry::make_manual_transfer();
      transfers.push_back(std::move(t));
      completers.push_back(std::move(c));
    }
  }
};

// A run_loop driven by its own thread, like an inference engine's scheduler thread.
class engine_thread {
 public:
  engine_thread() : engine_thread(ferry::run_loop::default_spin) {}
  explicit engine_thread(std::chrono::nanoseconds spin) : loop_(spin), thread_([this] {
    id_.store(std::this_thread::get_id());
    loop_.run();
  }) {
    while (id_.load() == std::thread::id{}) std::this_thread::yield();
  }
  ~engine_thread() {
    loop_.stop();
    thread_.join();
  }
  ferry::run_loop& loop() { return loop_; }
  std::thread::id id() const { return id_.load(); }

 private:
  ferry::run_loop loop_;
  std::atomic<std::thread::id> id_{};
  std::thread thread_;
};

// A fire-and-forget coroutine whose promise names a scheduler by reference.
struct detached {
  struct promise_type {
    ferry::run_loop* loop = nullptr;
    // The loop is the coroutine's first argument (after the closure, for a lambda).
    template <class... Args>
    promise_type(ferry::run_loop& l, Args&&...) : loop(&l) {}
    template <class Closure, class... Args>
      requires(!std::is_same_v<std::remove_cvref_t<Closure>, ferry::run_loop>)
    promise_type(Closure&&, ferry::run_loop& l, Args&&...) : loop(&l) {}
    ferry::run_loop& get_scheduler() noexcept { return *loop; }
    detached get_return_object() noexcept { return {}; }
    std::suspend_never initial_suspend() noexcept { return {}; }
    std::suspend_never final_suspend() noexcept { return {}; }
    void return_void() noexcept {}
    void unhandled_exception() noexcept { std::terminate(); }
  };
};

// A fire-and-forget coroutine with no scheduler of its own (it awaits through resume_on).
struct detached_inline {
  struct promise_type {
    detached_inline get_return_object() noexcept { return {}; }
    std::suspend_never initial_suspend() noexcept { return {}; }
    std::suspend_never final_suspend() noexcept { return {}; }
    void return_void() noexcept {}
    void unhandled_exception() noexcept { std::terminate(); }
  };
};

// A coroutine whose frame stays until the test destroys it (final_suspend suspends).
struct held {
  struct promise_type {
    ferry::run_loop* loop;
    template <class... Args>
    explicit promise_type(ferry::run_loop& l, Args&&...) : loop(&l) {}
    ferry::run_loop& get_scheduler() noexcept { return *loop; }
    held get_return_object() noexcept {
      return {std::coroutine_handle<promise_type>::from_promise(*this)};
    }
    std::suspend_never initial_suspend() noexcept { return {}; }
    std::suspend_always final_suspend() noexcept { return {}; }
    void return_void() noexcept {}
    void unhandled_exception() noexcept { std::terminate(); }
  };
  std::coroutine_handle<promise_type> handle;
};

// Links a waiter at the head of t's list whose continuation runs inline on the completing thread
// and holds it there (stage 1) until the test says go (stage 2), then for `linger` more: a
// completer stalled between publishing a completion and notifying the waiters behind this one.
inline held stall_completer(ferry::run_loop& loop, ferry::transfer t, std::atomic<int>& stage,
                            std::chrono::microseconds linger = std::chrono::microseconds(0)) {
  (void)loop;
  ferry::inline_scheduler here;
  (void)co_await ferry::resume_on(here, t);
  stage.store(1);
  while (stage.load() != 2) std::this_thread::yield();
  const auto until = clock_type::now() + linger;
  while (clock_type::now() < until) {
  }
}

// co_await hop{loop}: continue on the loop's thread.
struct hop {
  ferry::run_loop& loop;
  bool await_ready() const noexcept { return false; }
  void await_suspend(std::coroutine_handle<> h) { loop.post(h); }
  void await_resume() const noexcept {}
};

// Completes `c` from another thread after `delay`.
inline std::thread complete_later(ferry::completer c, std::chrono::milliseconds delay,
                                  ferry::transfer_state to = ferry::transfer_state::success,
                                  std::error_code ec = {}) {
  return std::thread([c, delay, to, ec]() mutable {
    std::this_thread::sleep_for(delay);
    c.complete(to, ec);
  });
}

// A fire-and-forget coroutine that continues on whichever thread completes what it awaits (the
// executor, for transfers).
struct inline_task {
  struct promise_type {
    ferry::inline_scheduler get_scheduler() const noexcept { return {}; }
    inline_task get_return_object() noexcept { return {}; }
    std::suspend_never initial_suspend() noexcept { return {}; }
    std::suspend_never final_suspend() noexcept { return {}; }
    void return_void() noexcept {}
    void unhandled_exception() noexcept { std::terminate(); }
  };
};

// One thread fails member 0 and then member n-1 of a fresh batch, strictly one after the other,
// while `look` reads a verdict on this thread, landing at a different point of the look each round
// (a look at 4096 members takes a few microseconds). Returns how many rounds named member n-1, the
// later failure, among those that came back failed.
template <class Look>
int later_failure_named(std::size_t n, int rounds, Look look) {
  int wrong = 0;
  for (int round = 0; round < rounds; ++round) {
    batch b(n);
    std::atomic<bool> ready{false};
    std::atomic<bool> go{false};
    std::thread failer([&] {
      ready.store(true, std::memory_order_release);
      while (!go.load(std::memory_order_acquire)) {
      }
      const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(round % 8 * 300);
      while (std::chrono::steady_clock::now() < until) {
      }
      b.completers[0].fail(io_error);
      b.completers[n - 1].fail(std::make_error_code(std::errc::timed_out));
    });
    while (!ready.load(std::memory_order_acquire)) {
    }
    go.store(true, std::memory_order_release);
    const ferry::batch_result r = look(std::span<const ferry::transfer>(b.transfers));
    failer.join();
    if (r.verdict == ferry::verdict::failed && r.first_failed != 0u) ++wrong;
  }
  return wrong;
}

// Failing completions held between taking their failure number and publishing their state
// (status_block's test hook), as a completer preempted there would be. fail_held() fails a
// completer on a thread of its own and returns once that completion holds its number unpublished;
// release() lets it publish. A thread that calls linger(n) spins n pauses there instead on each of
// its failures: a completer slow to publish. One at a time in a process.
class numbering_hold {
 public:
  numbering_hold() { ferry::detail::after_failure_numbered.store(&at_number); }
  ~numbering_hold() {
    release();
    ferry::detail::after_failure_numbered.store(nullptr);
  }
  numbering_hold(const numbering_hold&) = delete;
  numbering_hold& operator=(const numbering_hold&) = delete;

  void fail_held(ferry::completer c, std::error_code ec) {
    stage_.store(0);
    failing_ = std::thread([c = std::move(c), ec]() mutable {
      held_here_ = true;
      c.fail(ec);
    });
    while (stage_.load() != 1) std::this_thread::yield();
  }

  void release() {
    stage_.store(2);
    if (failing_.joinable()) failing_.join();
  }

  static void linger(int pauses) noexcept { linger_here_ = pauses; }

 private:
  static void at_number() noexcept {
    for (int i = 0; i < linger_here_; ++i) ferry::detail::cpu_relax();
    if (!held_here_) return;
    stage_.store(1);
    while (stage_.load() != 2) std::this_thread::yield();
  }

  static inline thread_local bool held_here_ = false;
  static inline thread_local int linger_here_ = 0;
  static inline std::atomic<int> stage_{0};  // 1: a completion is held; 2: let it go
  std::thread failing_;
};

// Wake-up tests ([wakeup]): round trips through a completion source with its executor parking
// (park mode, then adaptive) must not wait for a scheduler tick, a timer or a later poll to be
// found. A completion that does not wake a parked executor is found a tick late or later: at
// 250 Hz a tick is 4 ms, so every round trip would take milliseconds. The bound is half a tick per
// round trip on average, which a sanitizer build on a loaded machine meets with room (its round
// trips take tens to hundreds of microseconds). The executor also had to park, or the test proved
// nothing: its counters say so.
inline constexpr int wakeup_rounds = 200;
inline constexpr std::chrono::microseconds wakeup_bound_per_round{2000};
inline constexpr ferry::progress_mode wakeup_modes[] = {ferry::progress_mode::park,
                                                        ferry::progress_mode::adaptive};

inline const char* mode_name(ferry::progress_mode m) {
  return m == ferry::progress_mode::park ? "park" : m == ferry::progress_mode::adaptive ? "adaptive"
                                                                                        : "busy";
}

inline ferry::executor_options executor_in(ferry::progress_mode m) {
  ferry::executor_options o;
  o.mode = m;
  return o;
}

// Runs `one` (one round trip, awaited to its end) wakeup_rounds times, with a pause before each
// long enough for the executor to have parked (an adaptive one spins 50 us, 500 us with I/O out),
// and checks the bound. `parks` reads the parks of the executors involved.
template <class One, class Parks>
void check_round_trips_wake(const char* what, ferry::progress_mode mode, Parks parks, One one) {
  const std::uint64_t parks_before = parks();
  clock_type::duration took{};
  for (int i = 0; i < wakeup_rounds; ++i) {
    std::this_thread::sleep_for(1ms);
    const auto start = clock_type::now();
    one();
    took += clock_type::now() - start;
  }
  const double per_round_us =
      std::chrono::duration<double, std::micro>(took).count() / wakeup_rounds;
  INFO(what << ", " << mode_name(mode) << " mode: " << per_round_us << " us per round trip on "
            << "average over " << wakeup_rounds);
  CHECK(took < wakeup_rounds * wakeup_bound_per_round);
  CHECK(parks() - parks_before >= static_cast<std::uint64_t>(wakeup_rounds / 2));
}

// The series of `kind` for `peer` (empty: the kind's total) in a metrics snapshot; a failed check
// naming it, and an empty series, where there is none.
inline ferry::metrics::operation_snapshot find_series(const ferry::metrics::snapshot& s,
                                                      const std::string& kind,
                                                      const std::string& peer = {}) {
  for (const auto& o : s.operations) {
    if (o.kind == kind && o.peer == peer) return o;
  }
  FAIL_CHECK("no " << kind << " series for peer '" << peer << "'");
  return {};
}

}  // namespace ferry_test

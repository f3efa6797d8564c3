// The progress executor: modes, parking and wake-ups, timers, source registration.

#include <catch2/catch.hpp>

#include <atomic>
#include <thread>
#include <vector>

#include <ferry/ferry.hpp>

#include "helpers.hpp"

using namespace ferry_test;
using ferry::transfer_state;

namespace {

// A completion source fed by the test: each queued completer is completed by the executor.
class manual_source {
 public:
  explicit manual_source(ferry::progress_executor& e) : exec_(e) { exec_.add_source(*this); }
  ~manual_source() { exec_.remove_source(*this); }

  ferry::transfer submit() {
    auto [t, c] = ferry::make_manual_transfer();
    {
      std::lock_guard lock(mutex_);
      queue_.push_back(std::move(c));
    }
    exec_.notify();
    return std::move(t);
  }

  std::size_t poll(std::size_t budget) {
    polls_.fetch_add(1);
    std::vector<ferry::completer> batch;
    {
      std::lock_guard lock(mutex_);
      while (!queue_.empty() && batch.size() < budget) {
        batch.push_back(std::move(queue_.back()));
        queue_.pop_back();
      }
    }
    for (auto& c : batch) c.succeed();
    if (poller_.load() == std::thread::id{}) poller_.store(std::this_thread::get_id());
    return batch.size();
  }

  std::uint64_t polls() const { return polls_.load(); }
  std::thread::id poller() const { return poller_.load(); }

 private:
  ferry::progress_executor& exec_;
  std::mutex mutex_;
  std::vector<ferry::completer> queue_;
  std::atomic<std::uint64_t> polls_{0};
  std::atomic<std::thread::id> poller_{};
};

// A source with nothing to complete whose first poll holds the executor until release().
class gate_source {
 public:
  explicit gate_source(ferry::progress_executor& e) : exec_(e) { exec_.add_source(*this); }
  ~gate_source() {
    release();
    exec_.remove_source(*this);
  }

  std::size_t poll(std::size_t) {
    if (!held_.exchange(true)) {
      while (!released_.load()) std::this_thread::yield();
    }
    return 0;
  }

  void wait_until_held() const {
    while (!held_.load()) std::this_thread::yield();
  }
  void release() { released_.store(true); }

 private:
  ferry::progress_executor& exec_;
  std::atomic<bool> held_{false};
  std::atomic<bool> released_{false};
};

// A source like a disk's ring: in_flight() says a device holds work that finishes on its own.
// set_in_flight() also hands the executor one piece of work, so that its idle spin starts again.
// go_in_flight_at_next_arm() stands for a submission that the executor's last look before sleeping
// takes: arm(), which the executor calls after that look, puts I/O in flight.
class device_source {
 public:
  explicit device_source(ferry::progress_executor& e) : exec_(e) { exec_.add_source(*this); }
  ~device_source() { exec_.remove_source(*this); }

  void set_in_flight(bool out) {
    out_.store(out);
    kicks_.fetch_add(1);
    exec_.notify();
  }
  void go_in_flight_at_next_arm() { out_at_arm_.store(true); }
  std::uint64_t handled() const { return handled_.load(); }

  std::size_t poll(std::size_t) {
    if (kicks_.load() == handled_.load()) return 0;
    handled_.fetch_add(1);
    return 1;
  }
  bool arm() {
    if (out_at_arm_.exchange(false)) out_.store(true);
    return true;
  }
  bool in_flight() const { return out_.load(); }

 private:
  ferry::progress_executor& exec_;
  std::atomic<bool> out_{false};
  std::atomic<bool> out_at_arm_{false};
  std::atomic<std::uint64_t> kicks_{0};
  std::atomic<std::uint64_t> handled_{0};
};

// A source like a GPU copy engine: nothing signals its completions, so the executor must not sleep
// while it is busy(). Each piece of work is done a set time after it was handed over, and only a
// poll finds it. submit_during_next_busy_check() hands work over from inside the executor's next
// busy() check, just after that check has read "not busy": the same as a submitter on another
// thread running at that moment, between the executor's last busy check and its sleep.
class poll_only_source {
 public:
  explicit poll_only_source(ferry::progress_executor& e) : exec_(e) { exec_.add_source(*this); }
  ~poll_only_source() { exec_.remove_source(*this); }

  void submit_during_next_busy_check() { inject_.store(true); }
  int completed() const { return completed_.load(); }

  std::size_t poll(std::size_t) {
    if (outstanding_.load() == 0 || clock_type::now() < ready_at_.load()) return 0;
    outstanding_.fetch_sub(1);
    completed_.fetch_add(1);
    return 1;
  }
  bool busy() const {
    const bool busy = outstanding_.load() != 0;
    if (inject_.exchange(false)) {
      ready_at_.store(clock_type::now() + 2ms);
      outstanding_.fetch_add(1);
      exec_.notify();
    }
    return busy;
  }

 private:
  ferry::progress_executor& exec_;
  mutable std::atomic<bool> inject_{false};
  mutable std::atomic<int> outstanding_{0};
  mutable std::atomic<clock_type::time_point> ready_at_{};
  std::atomic<int> completed_{0};
};

}  // namespace

TEST_CASE("every mode completes submitted work", "[executor][concurrency]") {
  const auto mode = GENERATE(ferry::progress_mode::busy, ferry::progress_mode::adaptive,
                             ferry::progress_mode::park);
  ferry::executor_options options;
  options.mode = mode;
  options.spin_budget = std::chrono::microseconds(20);
  ferry::progress_executor exec(options);
  manual_source source(exec);
  for (int i = 0; i < 200; ++i) {
    ferry::transfer t = source.submit();
    REQUIRE(t.wait_for(hang_bound) == transfer_state::success);
    if (i % 50 == 0) std::this_thread::sleep_for(2ms);  // let an adaptive executor park
  }
  // The counter is published after the round that completed the last transfer.
  const auto start = clock_type::now();
  while (exec.counters().completions < 200 && clock_type::now() - start < hang_bound) {
    std::this_thread::yield();
  }
  CHECK(exec.counters().completions >= 200);
  CHECK(source.poller() != std::this_thread::get_id());
  if (mode == ferry::progress_mode::busy) CHECK(exec.counters().parks == 0);
}

TEST_CASE("a parked executor is woken by a submission, and only a parked one",
          "[executor][concurrency]") {
  ferry::executor_options options;
  options.mode = ferry::progress_mode::park;
  ferry::progress_executor exec(options);
  manual_source source(exec);
  // Its thread may not get a CPU for a while on a loaded machine: wait for it to park, however long.
  REQUIRE(ferry_test::wait_until([&] { return exec.counters().parks >= 1; }));
  const auto before = exec.counters();
  for (int i = 0; i < 50; ++i) {
    REQUIRE(source.submit().wait_for(hang_bound) == transfer_state::success);
    std::this_thread::sleep_for(1ms);
  }
  const auto after = exec.counters();
  CHECK(after.wakeups > before.wakeups);
  // A wake-up is only sent to a parked thread: never more wake-ups than parks.
  CHECK(after.wakeups <= after.parks);

  ferry::executor_options busy;
  busy.mode = ferry::progress_mode::busy;
  ferry::progress_executor spinning(busy);
  manual_source source2(spinning);
  for (int i = 0; i < 50; ++i) REQUIRE(source2.submit().wait_for(hang_bound) == transfer_state::success);
  CHECK(spinning.counters().wakeups == 0);
}

TEST_CASE("an executor parks when idle and its timers still fire", "[executor][concurrency]") {
  ferry::progress_executor exec;  // adaptive
  REQUIRE(ferry_test::wait_until([&] { return exec.counters().parks >= 1; }));
  const auto rounds = exec.counters().rounds;
  std::this_thread::sleep_for(30ms);
  CHECK(exec.counters().rounds - rounds < 1000);  // asleep, not spinning

  auto [t, c] = ferry::make_manual_transfer();
  std::vector<ferry::transfer> ts{t};
  const auto start = clock_type::now();
  const auto r = ferry::sync_wait([&]() -> ferry::task<ferry::batch_result> {
    co_return co_await ferry::when_all(exec, ts, 40ms);
  }());
  CHECK(r.verdict == ferry::verdict::timed_out);
  CHECK(ms_since(start) >= 40);
  CHECK(ms_since(start) < 5000);
  // The counter is bumped after the timer's callback has run: give it a moment.
  CHECK(wait_until([&] { return exec.counters().timers_fired == 1; }));
}

TEST_CASE("adaptive: while a source has I/O in flight the executor spins for in_flight_spin, not "
          "spin_budget", "[executor][concurrency]") {
  ferry::progress_executor exec(spin_while_in_flight());
  device_source source(exec);
  // Nothing out: it parks as soon as a round finds nothing.
  REQUIRE(wait_until([&] { return exec.counters().parks >= 1; }));
  source.set_in_flight(true);
  REQUIRE(wait_until([&] { return source.handled() == 1; }));
  // From the round that handled that work on, it spins: its rounds go on, and it never sleeps.
  const counters_over_100ms seen(exec);
  CHECK_FALSE(seen.slept());
  CHECK(seen.went_round());
  // Nothing out any more: it parks again.
  source.set_in_flight(false);
  CHECK(wait_until([&] { return exec.counters().parks > seen.after.parks; }));

  // With in_flight_spin no longer than spin_budget, I/O out changes nothing.
  ferry::executor_options short_spin;
  short_spin.spin_budget = 0ns;
  short_spin.in_flight_spin = 0ns;
  ferry::progress_executor parking(short_spin);
  device_source out(parking);
  REQUIRE(wait_until([&] { return parking.counters().parks >= 1; }));
  out.set_in_flight(true);
  REQUIRE(wait_until([&] { return out.handled() == 1; }));
  // It may have parked already; a wake-up makes it go round and park again.
  const auto parks = parking.counters().parks;
  parking.notify();
  CHECK(wait_until([&] { return parking.counters().parks > parks; }));
}

TEST_CASE("adaptive: I/O that the last look before sleeping put in flight is spun for, not slept on",
          "[executor][concurrency]") {
  ferry::progress_executor exec(spin_while_in_flight());
  device_source source(exec);
  REQUIRE(wait_until([&] { return exec.counters().parks >= 1; }));
  source.go_in_flight_at_next_arm();
  exec.notify();  // a round, which finds nothing and goes to park again
  REQUIRE(wait_until([&] { return source.in_flight(); }));
  const counters_over_100ms seen(exec);
  CHECK_FALSE(seen.slept());
  CHECK(seen.went_round());
  source.set_in_flight(false);
  CHECK(wait_until([&] { return exec.counters().parks > seen.after.parks; }));
}

TEST_CASE("after remove_source returns the executor never calls the source again",
          "[executor][concurrency]") {
  ferry::executor_options options;
  options.mode = ferry::progress_mode::busy;
  ferry::progress_executor exec(options);
  for (int i = 0; i < 200; ++i) {
    auto source = std::make_unique<manual_source>(exec);
    (void)source->submit().wait_for(hang_bound);
    source.reset();  // ASan/TSan catch a poll on the freed source
  }
  SUCCEED();
}

TEST_CASE("work on a source added just as the executor parks is not slept on",
          "[executor][concurrency]") {
  // The executor is held inside a round that polls the old source list while a source is added and
  // given work. Both announcements come before the executor says it sleeps, so they wake nobody:
  // the executor must notice the new list before it sleeps, or that work waits forever.
  ferry::executor_options options;
  options.mode = ferry::progress_mode::park;
  ferry::progress_executor exec(options);
  gate_source gate(exec);
  gate.wait_until_held();
  manual_source source(exec);
  const ferry::transfer t = source.submit();
  gate.release();
  REQUIRE(t.wait_for(hang_bound) == transfer_state::success);
}

TEST_CASE("work handed to a poll-only source just as the executor parks is not slept on",
          "[executor][concurrency]") {
  // The executor finds nothing, reads "not busy", and goes to park; the work arrives between that
  // check and its announcement, so its notify() wakes nobody, and the last look before sleeping
  // finds it not done yet. The executor must look at busy() again after announcing, or it sleeps
  // with work out that nothing will ever signal.
  ferry::executor_options options;
  options.mode = ferry::progress_mode::park;
  ferry::progress_executor exec(options);
  poll_only_source source(exec);
  for (int i = 1; i <= 20; ++i) {
    source.submit_during_next_busy_check();
    exec.notify();  // a round, if it sleeps, so that it checks busy() and parks again
    REQUIRE(wait_until([&] { return source.completed() == i; }));
  }
}

TEST_CASE("executor options are checked", "[executor]") {
  ferry::executor_options bad;
  bad.poll_budget = 0;
  CHECK_THROWS_WITH(ferry::progress_executor(bad), Catch::Contains("poll_budget"));
  ferry::executor_options negative;
  negative.spin_budget = std::chrono::nanoseconds(-1);
  CHECK_THROWS_WITH(ferry::progress_executor(negative), Catch::Contains("spin_budget"));
  ferry::executor_options negative_in_flight;
  negative_in_flight.in_flight_spin = std::chrono::nanoseconds(-1);
  CHECK_THROWS_WITH(ferry::progress_executor(negative_in_flight),
                    Catch::Contains("in_flight_spin must not be negative"));
}

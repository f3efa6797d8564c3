// Regression tests for problems an independent review found in the GPU copy backend
// (copy_engine.hpp), each of which failed before its fix, and a park-mode stress run.

#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#include <ferry/ferry.hpp>
#include <ferry/gpu/copy_engine.hpp>
#include <ferry/testing/fake_gpu.hpp>

#include "helpers.hpp"
#include "gpu/gpu_helpers.hpp"

namespace {

using namespace std::chrono_literals;
using namespace ferry_test::hip;

// A completion source that, when armed, holds the executor inside its poll() until the test lets
// it go: a way to line up "everything is ready before the executor's next round".
struct gate_source {
  std::mutex m;
  std::condition_variable cv;
  bool armed = false;
  bool inside = false;
  bool go = false;
  std::uint64_t entries = 0;  // rounds that have come in
  std::uint64_t awaited = 0;  // the last one wait_inside() returned for

  std::size_t poll(std::size_t) {
    std::unique_lock lock(m);
    if (!armed) return 0;
    inside = true;
    ++entries;
    cv.notify_all();
    cv.wait(lock, [&] { return go; });
    go = false;
    inside = false;
    return 0;
  }
  // Returns once a round that wait_inside() has not returned for yet is held inside.
  void wait_inside() {
    std::unique_lock lock(m);
    cv.wait(lock, [&] { return inside && entries > awaited; });
    awaited = entries;
  }
  void release(bool stay_armed) {
    std::lock_guard lock(m);
    armed = stay_armed;
    go = true;
    cv.notify_all();
  }
};

ferry_test::detached_inline submit_after(transfer t, engine* e, transfer* out, std::atomic<bool>* resumed,
                                         void* dst, const void* src) {
  ferry::inline_scheduler here;
  (void)co_await ferry::resume_on(here, t);
  if (!resumed->exchange(true)) *out = e->copy_on(0, dst, src, 16, fh::copy_kind::device_to_device);
}

}  // namespace

// Was: set_device is per thread, the engine calls it only in its constructor, and take_event makes
// new events on the submitting thread. An engine on device 1 whose pool has run dry makes events
// on device 0 for submitters on other threads: the record fails (the copy is synchronously waited
// for and failed), and the wrong-device event goes back into the pool, where it fails later copies
// from any thread.
TEST_CASE("gpu: an engine on device 1 makes its events there, whichever thread needs one",
          "[gpu]") {
  device_count two(2);
  ferry::progress_executor exec;
  fh::copy_engine_options o;
  o.device = 1;
  o.events = 0;  // the same as any engine once more copies are out than it made events up front
  o.streams = 1;
  engine e(exec, o);
  std::vector<std::byte> a(64), b(64, std::byte{3});

  transfer from_worker;
  std::thread worker([&] { from_worker = e.copy(a.data(), b.data(), 64, fh::copy_kind::device_to_device); });
  worker.join();
  REQUIRE(from_worker.wait_for(hang_bound) != transfer_state::pending);
  INFO("worker thread's copy: " << from_worker.error().message());
  CHECK(from_worker.state() == transfer_state::success);

  // The constructing thread (now on device 1) takes the poisoned event out of the pool.
  transfer from_owner = e.copy(a.data(), b.data(), 64, fh::copy_kind::device_to_device);
  REQUIRE(from_owner.wait_for(hang_bound) != transfer_state::pending);
  INFO("constructing thread's copy: " << from_owner.error().message());
  CHECK(from_owner.state() == transfer_state::success);
}

// Was: the constructor switches the calling thread's current device and leaves it
// switched, so the caller's next plain runtime call (malloc, kernel launch) goes to another GPU.
TEST_CASE("gpu: constructing an engine on device 1 leaves the caller's current device alone",
          "[gpu]") {
  device_count two(2);
  ferry::progress_executor exec;
  fh::fake::current_device = 0;
  fh::copy_engine_options o;
  o.device = 1;
  engine e(exec, o);
  CHECK(fh::fake::current_device == 0);
  fh::fake::current_device = 0;
}

// Was (fairness): poll() walks the lanes from 0 every round and stops when the budget is spent, so
// while lane 0 has a budget's worth of finished copies each round, lane 1 is never looked at: its
// finished copy stays pending.
TEST_CASE("gpu: a busy stream 0 does not starve a finished copy on stream 1", "[gpu]") {
  copy_time instant(0ns);
  ferry::executor_options eo;
  eo.poll_budget = 256;
  eo.mode = ferry::progress_mode::busy;
  ferry::progress_executor exec(eo);
  fh::copy_engine_options o;
  o.streams = 2;
  o.events = 1024;
  engine e(exec, o);
  gate_source gate;
  exec.add_source(gate);
  std::vector<std::byte> a(16), b(16, std::byte{9});
  std::vector<transfer> lane0;

  {
    std::lock_guard lock(gate.m);
    gate.armed = true;
  }
  gate.wait_inside();
  for (int i = 0; i < 300; ++i) lane0.push_back(e.copy_on(0, a.data(), b.data(), 16, fh::copy_kind::device_to_device));
  transfer lane1 = e.copy_on(1, a.data(), b.data(), 16, fh::copy_kind::device_to_device);
  gate.release(true);
  int rounds_pending = 0;
  for (int r = 0; r < 5; ++r) {
    gate.wait_inside();  // the engine has been polled once more
    if (lane1.state() == transfer_state::pending) ++rounds_pending;
    for (int i = 0; i < 300; ++i) lane0.push_back(e.copy_on(0, a.data(), b.data(), 16, fh::copy_kind::device_to_device));
    gate.release(r != 4);
  }
  // Each round starts at the next stream: stream 1 is looked at within two rounds (it was never,
  // when every round started at stream 0 and its budget ran out there).
  CHECK(rounds_pending <= 1);
  REQUIRE(lane1.wait_for(hang_bound) == transfer_state::success);
  for (const transfer& t : lane0) REQUIRE(t.wait_for(hang_bound) == transfer_state::success);
  exec.remove_source(gate);
}

// Was (counters): park() counts every source whose arm() says "don't sleep" as a completion. The
// copy engine's arm() says so whenever a copy is out, so one slow copy in park mode reports many.
TEST_CASE("gpu: one slow copy counts as one executor completion", "[gpu]") {
  copy_time slow(30ms);
  ferry::executor_options eo;
  eo.mode = ferry::progress_mode::park;
  ferry::progress_executor exec(eo);
  engine e(exec);
  std::vector<std::byte> a(16), b(16, std::byte{1});
  const auto before = exec.counters().completions;
  REQUIRE(e.copy(a.data(), b.data(), 16, fh::copy_kind::device_to_device).wait_for(hang_bound) ==
          transfer_state::success);
  REQUIRE(ferry_test::wait_until([&] { return e.outstanding() == 0; }));
  exec.sync();  // the round that completed the copy is over, and has stored its count
  CHECK(exec.counters().completions - before == 1);
}

// Was (cost): while any copy is out the executor never sleeps, yet each round of park mode (and each
// spin-budget expiry in adaptive mode) announces sleep; submitters that see it pay an eventfd write.
TEST_CASE("gpu: while copies are out the executor never announces sleep, so submitters never write its eventfd", "[gpu]") {
  ferry::executor_options eo;
  eo.mode = ferry::progress_mode::park;
  ferry::progress_executor exec(eo);
  fh::copy_engine_options o;
  o.streams = 2;
  engine e(exec, o);
  std::vector<std::byte> a(16), b(16, std::byte{1});
  fh::fake::control::instance().set_copy_time(300ms);
  transfer slow = e.copy_on(0, a.data(), b.data(), 16, fh::copy_kind::device_to_device);
  fh::fake::control::instance().set_copy_time(0ns);
  std::this_thread::sleep_for(5ms);
  const auto c0 = exec.counters();
  for (int i = 0; i < 2000 && slow.state() == transfer_state::pending; ++i) {
    REQUIRE(e.copy_on(1, a.data(), b.data(), 16, fh::copy_kind::device_to_device).wait_for(hang_bound) ==
            transfer_state::success);
  }
  const bool still_out = slow.state() == transfer_state::pending;
  const auto c1 = exec.counters();
  fh::fake::control::instance().set_copy_time(20us);
  REQUIRE(slow.wait_for(hang_bound) == transfer_state::success);
  REQUIRE(still_out);
  INFO("parks " << c1.parks - c0.parks << ", eventfd wakeups " << c1.wakeups - c0.wakeups);
  CHECK(c1.parks == c0.parks);      // it never slept ...
  CHECK(c1.wakeups == c0.wakeups);  // ... so no submitter should have written the eventfd
}

// Was (counters): a copy refused at submission is counted in `failed` but not in `submitted`, so
// submitted == completed + failed + outstanding does not hold.
TEST_CASE("gpu: counters add up after a refused copy", "[gpu]") {
  ferry::progress_executor exec;
  engine e(exec);
  std::vector<std::byte> a(16), b(16);
  fh::fake::control::instance().refuse_next_enqueues(1);
  CHECK(e.copy(a.data(), b.data(), 16, fh::copy_kind::device_to_device).state() == transfer_state::failed);
  const auto c = e.counters();
  CHECK(c.submitted == c.completed + c.failed + static_cast<std::uint64_t>(e.outstanding()));
}

// Was: the destructor completes transfers on the destroying thread; a continuation resumed
// inline there that submits another copy (to any lane) appends it after that lane was drained. It is
// never completed, not even as abandoned, and its stream is destroyed under it.
TEST_CASE("gpu: a copy submitted from a continuation the destructor resumes is refused, not lost",
          "[gpu]") {
  copy_time slow(5ms);
  ferry::progress_executor exec;
  ferry_test::engine_thread loop;
  std::vector<std::byte> a(16), b(16, std::byte{4});
  transfer second;
  std::atomic<bool> resumed{false};
  {
    fh::copy_engine_options o;
    o.streams = 2;
    engine e(exec, o);
    // Take the executor out of the picture, before the copy exists, so the destructor is the one
    // to complete `first` (what the destructor does first; calling it twice is harmless).
    exec.remove_source(e);
    transfer first = e.copy_on(1, a.data(), b.data(), 16, fh::copy_kind::device_to_device);
    submit_after(first, &e, &second, &resumed, a.data(), b.data());
  }
  REQUIRE(resumed.load());
  REQUIRE(second.valid());
  CHECK(second.state() == transfer_state::failed);
  CHECK(second.error() == ferry::errc::backend_shut_down);
}

// Guard: a copy submitted while the executor parks is noticed; no lost wake-up under a
// park-mode executor with instant copies from several threads.
TEST_CASE("gpu: a park-mode executor never loses a submitted copy", "[gpu][concurrency]") {
  copy_time instant(0ns);
  ferry::executor_options eo;
  eo.mode = ferry::progress_mode::park;
  ferry::progress_executor exec(eo);
  engine e(exec);
  std::atomic<int> bad{0};
  std::vector<std::thread> ts;
  for (int w = 0; w < 3; ++w) {
    ts.emplace_back([&] {
      std::vector<std::byte> a(16), b(16, std::byte{5});
      for (int i = 0; i < 400; ++i) {
        if (e.copy(a.data(), b.data(), 16, fh::copy_kind::device_to_device).wait_for(hang_bound) !=
            transfer_state::success) {
          ++bad;
        }
        if (i % 50 == 0) std::this_thread::sleep_for(200us);  // let it park
      }
    });
  }
  for (auto& t : ts) t.join();
  CHECK(bad == 0);
  CHECK(e.outstanding() == 0);
}

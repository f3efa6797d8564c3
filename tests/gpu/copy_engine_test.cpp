// The GPU copy backend (copy_engine.hpp) against the in-process fake runtime (ferry/testing/fake_gpu.hpp):
// the same backend code that runs on HIP and CUDA, with no GPU. The [regression] cases each failed before
// the fix for a problem an independent review found; the last case is a park-mode stress run.

#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
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

std::vector<std::byte> pattern(std::size_t n, int seed) {
  std::vector<std::byte> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<std::byte>((i * 31 + static_cast<std::size_t>(seed)) & 0xff);
  return v;
}


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

TEST_CASE("gpu: a copy completes when its event does, with its bytes moved", "[gpu]") {
  copy_time slow(100ms);  // long enough that the copy is still out when looked at below
  ferry::progress_executor exec;
  engine e(exec);
  const auto src = pattern(4096, 1);
  std::vector<std::byte> dst(4096);
  transfer t = e.copy(dst.data(), src.data(), src.size(), fh::copy_kind::device_to_device);
  // Not ready yet: the event says so. (The bytes are the GPU's until then: not looked at.)
  CHECK(t.state() == transfer_state::pending);
  REQUIRE(t.wait_for(hang_bound) == transfer_state::success);
  CHECK(dst == src);
  CHECK(e.outstanding() == 0);
  CHECK(e.counters().completed == 1);
  CHECK(e.counters().event_queries > 1);  // it kept asking while the copy ran
}

TEST_CASE("gpu: copies on one stream complete in order, and only the oldest is asked", "[gpu]") {
  copy_time slow(2ms);
  ferry::progress_executor exec;
  fh::copy_engine_options o;
  o.streams = 1;
  engine e(exec, o);
  const auto src = pattern(256, 2);
  std::vector<std::vector<std::byte>> dst(20, std::vector<std::byte>(256));
  std::vector<transfer> ts;
  for (auto& d : dst) ts.push_back(e.copy(d.data(), src.data(), src.size(), fh::copy_kind::host_to_device));
  // Each completes no earlier than the one before it.
  for (std::size_t i = 0; i < ts.size(); ++i) {
    REQUIRE(ts[i].wait_for(hang_bound) == transfer_state::success);
    for (std::size_t j = i + 1; j < ts.size(); ++j) {
      if (ts[j].state() != transfer_state::pending) CHECK(ts[j - 1].state() == transfer_state::success);
    }
  }
  for (const auto& d : dst) CHECK(d == src);
  // A not-ready head stops the look at that stream: far fewer queries than copies × rounds.
  const auto c = e.counters();
  CHECK(c.completed == 20);
}

TEST_CASE("gpu: an error on one stream fails only that stream's copies, naming the error", "[gpu]") {
  copy_time fast(200us);
  ferry::progress_executor exec;
  fh::copy_engine_options o;
  o.streams = 4;
  engine e(exec, o);
  fh::fake::control::instance().fail_next_copies(e.native_stream(1), 3);
  const auto src = pattern(1024, 3);
  std::vector<std::vector<std::byte>> dst(16, std::vector<std::byte>(1024));
  std::vector<transfer> ts;
  for (unsigned i = 0; i < 16; ++i) {
    ts.push_back(e.copy_on(i % 4, dst[i].data(), src.data(), src.size(), fh::copy_kind::device_to_host));
  }
  for (unsigned i = 0; i < 16; ++i) {
    INFO("copy " << i << " on stream " << i % 4);
    if (i % 4 == 1 && i / 4 < 3) {
      REQUIRE(ts[i].wait_for(hang_bound) == transfer_state::failed);
      CHECK(ts[i].error().value() == fh::fake::error_launch_failure);
      CHECK(ts[i].error().category() == fh::runtime_category<fh::fake::runtime>());
      CHECK(ts[i].error().message() == "fakeErrorLaunchFailure: unspecified launch failure");
    } else {
      REQUIRE(ts[i].wait_for(hang_bound) == transfer_state::success);
      CHECK(dst[i] == src);
    }
  }
  CHECK(e.counters().failed == 3);
}

TEST_CASE("gpu: a copy the runtime refuses, and bad input, fail at once", "[gpu]") {
  ferry::progress_executor exec;
  engine e(exec);
  std::vector<std::byte> a(64), b(64);
  fh::fake::control::instance().refuse_next_enqueues(1);
  transfer refused = e.copy(a.data(), b.data(), 64, fh::copy_kind::device_to_device);
  CHECK(refused.state() == transfer_state::failed);
  CHECK(refused.error().message() == "fakeErrorInvalidValue: invalid argument");
  CHECK(e.outstanding() == 0);

  CHECK(e.copy(a.data(), b.data(), 0, fh::copy_kind::device_to_device).error() == ferry::errc::empty_buffer);
  CHECK(e.copy(nullptr, b.data(), 8, fh::copy_kind::device_to_device).error() ==
        std::make_error_code(std::errc::bad_address));
  CHECK_THROWS_AS(e.copy_on(e.streams(), a.data(), b.data(), 8, fh::copy_kind::peer), std::out_of_range);
  fh::copy_engine_options none;
  none.streams = 0;
  CHECK_THROWS_AS(engine(exec, none), std::invalid_argument);
  fh::copy_engine_options missing;
  missing.device = 5;
  try {
    engine bad(exec, missing);
    FAIL("an engine on a device that does not exist was made");
  } catch (const std::system_error& ex) {
    CHECK(std::string(ex.what()).find("set_device(5)") != std::string::npos);
  }
  // The next good copy still works.
  REQUIRE(e.copy(a.data(), b.data(), 64, fh::copy_kind::device_to_device).wait_for(hang_bound) ==
          transfer_state::success);
}

TEST_CASE("gpu: a runtime that makes no event gives a failed transfer, not an exception", "[gpu]") {
  ferry::progress_executor exec;
  fh::copy_engine_options lazy;
  lazy.events = 0;  // every copy needs a new event
  engine e(exec, lazy);
  std::vector<std::byte> a(64), b(64, std::byte{3});
  fh::fake::control::instance().refuse_next_event_creates(1);
  transfer refused = e.copy(a.data(), b.data(), 64, fh::copy_kind::device_to_device);
  CHECK(refused.state() == transfer_state::failed);
  CHECK(refused.error().message() == "fakeErrorInvalidValue: invalid argument");
  CHECK(e.outstanding() == 0);
  CHECK(e.counters().submitted == e.counters().failed);
  REQUIRE(e.copy(a.data(), b.data(), 64, fh::copy_kind::device_to_device).wait_for(hang_bound) ==
          transfer_state::success);
  CHECK(a == b);
}

TEST_CASE("gpu: a query that fails while its copy still runs fails the transfer only once the copy "
          "is over",
          "[gpu]") {
  // The error is the query's own: the copy goes on. Its transfer must not turn failed (and its
  // buffer be freed or reused) while the GPU still writes into it.
  ferry::progress_executor exec;
  engine e(exec);
  std::optional<copy_time> slow(std::in_place, 50ms);
  std::vector<std::byte> dst(64), src(64, std::byte{9});
  fh::fake::control::instance().fail_next_queries(1);
  transfer t = e.copy(dst.data(), src.data(), 64, fh::copy_kind::device_to_device);
  REQUIRE(t.wait_for(hang_bound) == transfer_state::failed);
  CHECK(t.error().message() == "fakeErrorInvalidResourceHandle: invalid resource handle");
  CHECK(dst == src);  // the copy had finished before the failure was reported
  slow.reset();
  // The engine goes on.
  REQUIRE(e.copy(dst.data(), src.data(), 64, fh::copy_kind::device_to_device).wait_for(hang_bound) ==
          transfer_state::success);
}

TEST_CASE("gpu: a when_all over a layer's copies resumes on the engine's scheduler", "[gpu]") {
  copy_time t(1ms);
  ferry::progress_executor exec;
  engine e(exec);
  ferry_test::engine_thread eng;
  const auto src = pattern(8192, 4);
  std::vector<std::vector<std::byte>> dst(32, std::vector<std::byte>(8192));
  std::vector<transfer> layer;
  for (auto& d : dst) layer.push_back(e.copy(d.data(), src.data(), src.size(), fh::copy_kind::peer));
  // A member that ends only once the waiter is suspended: the copies may all be done before it
  // awaits, and then it would go on here, on this thread.
  auto [last, last_done] = ferry::make_manual_transfer();
  layer.push_back(last);
  std::atomic<bool> done{false}, ok{false}, on_engine{false};
  auto waiter = [&](ferry::run_loop&) -> ferry_test::detached {
    const ferry::batch_result r = co_await ferry::when_all(exec, std::span<const transfer>(layer), hang_bound);
    ok = r.ok();
    on_engine = std::this_thread::get_id() == eng.id();
    done = true;
  };
  waiter(eng.loop());
  CHECK_FALSE(done.load());
  (void)last_done.succeed();
  REQUIRE(ferry_test::wait_until([&] { return done.load(); }));
  CHECK(ok);
  CHECK(on_engine);
  for (const auto& d : dst) CHECK(d == src);
}

TEST_CASE("gpu: the executor keeps watching while copies are out, and parks once none are",
          "[gpu]") {
  copy_time t(5ms);
  ferry::executor_options eo;
  eo.mode = ferry::progress_mode::park;
  ferry::progress_executor exec(eo);
  engine e(exec);
  std::vector<std::byte> a(64), b(64, std::byte{7});
  for (int i = 0; i < 20; ++i) {
    // Events have no descriptor: had the executor slept with a copy out, this would wait for ever.
    REQUIRE(e.copy(a.data(), b.data(), 64, fh::copy_kind::device_to_device).wait_for(hang_bound) ==
            transfer_state::success);
  }
  // Nothing out: it sleeps instead of going round.
  REQUIRE(ferry_test::wait_until([&] { return e.outstanding() == 0; }));
  std::this_thread::sleep_for(5ms);
  const auto rounds_before = exec.counters().rounds;
  std::this_thread::sleep_for(20ms);
  CHECK(exec.counters().rounds - rounds_before < 5);
  CHECK(a == b);
}

TEST_CASE("gpu: destroying the engine waits for the copies still on the GPU", "[gpu]") {
  copy_time slow(20ms);
  ferry::progress_executor exec;
  const auto src = pattern(512, 5);
  std::vector<std::vector<std::byte>> dst(8, std::vector<std::byte>(512));
  std::vector<transfer> ts;
  {
    engine e(exec);
    for (auto& d : dst) ts.push_back(e.copy(d.data(), src.data(), src.size(), fh::copy_kind::device_to_device));
  }
  for (const transfer& t : ts) CHECK(t.state() == transfer_state::success);
  for (const auto& d : dst) CHECK(d == src);
}

TEST_CASE("gpu: copies from four threads over four streams", "[gpu][concurrency]") {
  copy_time fast(1us);
  ferry::progress_executor exec;
  engine e(exec);
  constexpr int threads = 4;
  constexpr int per_thread = 2000;
  std::atomic<int> ok{0}, bad{0};
  std::vector<std::thread> workers;
  for (int w = 0; w < threads; ++w) {
    workers.emplace_back([&, w] {
      std::vector<std::byte> src(128, static_cast<std::byte>(w + 1));
      std::vector<std::vector<std::byte>> dst(16, std::vector<std::byte>(128));
      std::vector<transfer> window(16);
      for (int i = 0; i < per_thread; ++i) {
        transfer& slot = window[static_cast<std::size_t>(i % 16)];
        if (slot.valid()) (slot.wait_for(hang_bound) == transfer_state::success ? ok : bad)++;
        slot = e.copy(dst[static_cast<std::size_t>(i % 16)].data(), src.data(), src.size(),
                      fh::copy_kind::device_to_device);
      }
      for (transfer& t : window) (t.wait_for(hang_bound) == transfer_state::success ? ok : bad)++;
      for (const auto& d : dst) {
        if (d != src) ++bad;
      }
    });
  }
  for (std::thread& t : workers) t.join();
  CHECK(bad == 0);
  CHECK(ok == threads * per_thread);
  CHECK(e.outstanding() == 0);
}

// Was: set_device is per thread, the engine calls it only in its constructor, and take_event makes
// new events on the submitting thread. An engine on device 1 whose pool has run dry makes events
// on device 0 for submitters on other threads: the record fails (the copy is synchronously waited
// for and failed), and the wrong-device event goes back into the pool, where it fails later copies
// from any thread.
TEST_CASE("gpu: an engine on device 1 makes its events there, whichever thread needs one",
          "[gpu][regression]") {
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
          "[gpu][regression]") {
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
TEST_CASE("gpu: a busy stream 0 does not starve a finished copy on stream 1", "[gpu][regression]") {
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
TEST_CASE("gpu: one slow copy counts as one executor completion", "[gpu][regression]") {
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
TEST_CASE("gpu: while copies are out the executor never announces sleep, so submitters never write its eventfd", "[gpu][regression]") {
  ferry::executor_options eo;
  eo.mode = ferry::progress_mode::park;
  ferry::progress_executor exec(eo);
  fh::copy_engine_options o;
  o.streams = 2;
  engine e(exec, o);
  std::vector<std::byte> a(16), b(16, std::byte{1});
  // The slow copy is held out until the other copies are done, however slowly a loaded machine
  // runs them (a copy time of 300 ms once ran out before 2000 copies did, under CI's clang pass).
  fh::fake::control::instance().set_copy_time(std::chrono::hours(1));
  transfer slow = e.copy_on(0, a.data(), b.data(), 16, fh::copy_kind::device_to_device);
  struct let_go {  // also when a REQUIRE below throws, before the engine goes
    ~let_go() { fh::fake::control::instance().finish_queued_now(); }
  } finish_slow_at_exit;
  fh::fake::control::instance().set_copy_time(0ns);
  std::this_thread::sleep_for(5ms);
  const auto c0 = exec.counters();
  for (int i = 0; i < 2000; ++i) {
    REQUIRE(e.copy_on(1, a.data(), b.data(), 16, fh::copy_kind::device_to_device).wait_for(hang_bound) ==
            transfer_state::success);
  }
  const bool still_out = slow.state() == transfer_state::pending;
  const auto c1 = exec.counters();
  fh::fake::control::instance().set_copy_time(20us);
  fh::fake::control::instance().finish_queued_now();
  REQUIRE(slow.wait_for(hang_bound) == transfer_state::success);
  REQUIRE(still_out);
  INFO("parks " << c1.parks - c0.parks << ", eventfd wakeups " << c1.wakeups - c0.wakeups);
  CHECK(c1.parks == c0.parks);      // it never slept ...
  CHECK(c1.wakeups == c0.wakeups);  // ... so no submitter should have written the eventfd
}

// Was (counters): a copy refused at submission is counted in `failed` but not in `submitted`, so
// submitted == completed + failed + outstanding does not hold.
TEST_CASE("gpu: counters add up after a refused copy", "[gpu][regression]") {
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
          "[gpu][regression]") {
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

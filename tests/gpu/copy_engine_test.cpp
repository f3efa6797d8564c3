// The GPU copy backend's event polling against the in-process fake runtime (ferry/testing/fake_gpu.hpp):
// the same backend code that runs on HIP and CUDA, with no GPU.

#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstring>
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

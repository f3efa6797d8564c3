// The layer gate (ferry/gpu/layer_gate.hpp) against the in-process fake runtime: stream memory waits
// and the gate's kernel modelled as the GPU runs them, graphs captured once and replayed. The same
// gate code runs on CUDA and HIP (compiled and linked in CI; bench/gpu_check.sh runs it on a GPU).

#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include <ferry/ferry.hpp>
#include <ferry/gpu/layer_gate.hpp>
#include <ferry/testing/fake_gpu.hpp>

#include "helpers.hpp"
#include "gpu/gpu_helpers.hpp"

namespace {

using namespace std::chrono_literals;
using namespace ferry_test::hip;
using gate = fh::basic_layer_gate<fh::fake::runtime>;
using rt = fh::fake::runtime;
using fh::layer_state;
using clock_type = std::chrono::steady_clock;

// A fake stream for the test's scope.
struct test_stream {
  rt::stream_handle s = nullptr;
  test_stream() { REQUIRE(rt::stream_create(s) == rt::success); }
  ~test_stream() {
    (void)rt::stream_synchronize(s);
    (void)rt::stream_destroy(s);
  }
  test_stream(const test_stream&) = delete;
  test_stream& operator=(const test_stream&) = delete;
};

fh::layer_gate_options opts(std::size_t layers, std::size_t history = 64) {
  fh::layer_gate_options o;
  o.layers = layers;
  o.history = history;
  return o;
}

// Waits, bounded, until `pred` holds, letting the fake run meanwhile.
template <class Pred>
bool eventually(Pred pred, std::chrono::milliseconds bound = std::chrono::duration_cast<std::chrono::milliseconds>(hang_bound)) {
  const auto until = clock_type::now() + bound;
  while (clock_type::now() < until) {
    fh::fake::control::instance().run_now();
    if (pred()) return true;
    std::this_thread::sleep_for(100us);
  }
  return false;
}

std::size_t queued(const test_stream& s) { return fh::fake::control::instance().queued(s.s); }

}  // namespace

TEST_CASE("layer gate: a stream waits for its layer, and only its layer", "[gpu][layer_gate]") {
  gate g(opts(3));
  test_stream st;
  const std::uint32_t e = g.begin_step(hang_bound);
  CHECK(e == 1);
  auto [t0, c0] = ferry::make_manual_transfer();
  auto [t1, c1] = ferry::make_manual_transfer();
  g.arm(e, 0, std::span<const transfer>(&t0, 1));
  g.arm(e, 1, std::span<const transfer>(&t1, 1));
  g.seal(e);  // layer 2 loads nothing: released now
  CHECK(g.verdict(e, 2).state == layer_state::success);
  CHECK(g.released(2) == e);

  // Layer by layer, as an engine's forward: wait, then the layer's "kernel" (a copy of its block).
  std::vector<std::byte> block0(64, std::byte{0}), block1(64, std::byte{0}), out0(64), out1(64);
  g.enqueue_wait(st.s, e, 0);
  REQUIRE(rt::memcpy_async(out0.data(), block0.data(), 64, fh::copy_kind::device_to_device, st.s) == rt::success);
  g.enqueue_wait(st.s, e, 1);
  REQUIRE(rt::memcpy_async(out1.data(), block1.data(), 64, fh::copy_kind::device_to_device, st.s) == rt::success);
  std::this_thread::sleep_for(2ms);
  fh::fake::control::instance().run_now();
  CHECK(queued(st) == 4);  // held at layer 0's wait
  CHECK(g.verdict(e, 0).state == layer_state::pending);

  std::memset(block0.data(), 0xa0, 64);  // layer 0 "arrives"
  c0.succeed();
  CHECK(g.verdict(e, 0).state == layer_state::success);
  CHECK(g.released(0) == e);
  REQUIRE(eventually([&] { return queued(st) == 2; }));  // layer 0 computed; held at layer 1
  CHECK(out0[0] == std::byte{0xa0});
  std::this_thread::sleep_for(2ms);
  fh::fake::control::instance().run_now();
  CHECK(queued(st) == 2);

  std::memset(block1.data(), 0xa1, 64);
  c1.succeed();
  REQUIRE(rt::stream_synchronize(st.s) == rt::success);
  CHECK(out1[63] == std::byte{0xa1});
  CHECK(g.verdict(e, 1).state == layer_state::success);
  const fh::layer_gate_counters n = g.counters();
  CHECK(n.steps == 1);
  CHECK(n.decided == 3);
  CHECK(n.failed == 0);
}

TEST_CASE("layer gate: a failed layer is released at once, its failure readable after the step",
          "[gpu][layer_gate]") {
  gate g(opts(2));
  test_stream st;
  const auto start = clock_type::now();
  const std::uint32_t e = g.begin_step(hang_bound);
  std::vector<transfer> layer0;
  std::vector<ferry::completer> cs;
  for (int i = 0; i < 4; ++i) {
    auto [t, c] = ferry::make_manual_transfer();
    layer0.push_back(std::move(t));
    cs.push_back(std::move(c));
  }
  g.arm(e, 0, layer0);
  g.seal(e);
  g.enqueue_wait(st.s, e, 0);
  g.enqueue_wait(st.s, e, 1);
  cs[0].succeed();
  cs[2].fail(std::make_error_code(std::errc::connection_reset));
  REQUIRE(rt::stream_synchronize(st.s) == rt::success);  // released by the failure, not the deadline
  CHECK(clock_type::now() - start < hang_bound / 2);
  const fh::layer_verdict v = g.verdict(e, 0);
  CHECK(v.state == layer_state::failed);
  CHECK(v.error == std::errc::connection_reset);
  CHECK(std::string(fh::to_string(v.state)) == "failed");
  CHECK(g.counters().failed == 1);
  // The rest of the layer's transfers end later; nothing changes.
  cs[1].succeed();
  cs[3].succeed();
  CHECK(g.verdict(e, 0).state == layer_state::failed);
}

TEST_CASE("layer gate: no stream waits past the step's deadline, armed, unarmed or unsealed",
          "[gpu][layer_gate]") {
  gate g(opts(3));
  test_stream st;
  const auto deadline = clock_type::now() + 50ms;
  const std::uint32_t e = g.begin_step(deadline);
  auto [never, keep] = ferry::make_manual_transfer();  // a load that never ends
  g.arm(e, 0, std::span<const transfer>(&never, 1));
  // Layer 1 is never armed, and the step is never sealed.
  for (std::size_t l = 0; l < 3; ++l) g.enqueue_wait(st.s, e, l);
  REQUIRE(rt::stream_synchronize(st.s) == rt::success);
  const auto released_at = clock_type::now();
  CHECK(released_at >= deadline);
  CHECK(released_at - deadline < hang_bound);
  for (std::size_t l = 0; l < 3; ++l) {
    const fh::layer_verdict v = g.verdict(e, l);
    CHECK(v.state == layer_state::timed_out);
    CHECK(v.error == fh::gate_errc::deadline_passed);
    CHECK(v.error.message().find("deadline") != std::string::npos);
  }
  CHECK(g.counters().timed_out == 3);
  // Arming after the deadline changes nothing.
  auto [late, late_c] = ferry::make_manual_transfer();
  late_c.succeed();
  g.arm(e, 1, std::span<const transfer>(&late, 1));
  CHECK(g.verdict(e, 1).state == layer_state::timed_out);
}

TEST_CASE("layer gate: a word never passes a step whose layer is undecided", "[gpu][layer_gate]") {
  gate g(opts(1));
  test_stream st;
  const std::uint32_t e1 = g.begin_step(hang_bound);
  const std::uint32_t e2 = g.begin_step(hang_bound);
  auto [t1, c1] = ferry::make_manual_transfer();
  auto [t2, c2] = ferry::make_manual_transfer();
  g.arm(e1, 0, std::span<const transfer>(&t1, 1));
  g.arm(e2, 0, std::span<const transfer>(&t2, 1));
  g.enqueue_wait(st.s, e1, 0);
  c2.succeed();  // step 2 decided first
  CHECK(g.verdict(e2, 0).state == layer_state::success);
  CHECK(g.released(0) == 0);  // step 1 is still loading: its wait must hold
  std::this_thread::sleep_for(2ms);
  fh::fake::control::instance().run_now();
  CHECK(queued(st) == 1);
  c1.succeed();
  CHECK(g.released(0) == e2);  // both now
  REQUIRE(rt::stream_synchronize(st.s) == rt::success);
}

TEST_CASE("layer gate: a captured graph replayed 1000 times, with failures and timeouts injected",
          "[gpu][layer_gate]") {
  constexpr std::size_t layers = 4;
  constexpr std::size_t bytes = 256;
  constexpr int steps = 1000;
  gate g(opts(layers, 8));
  test_stream st;
  std::vector<std::vector<std::byte>> blocks(layers, std::vector<std::byte>(bytes));
  std::vector<std::vector<std::byte>> out(layers, std::vector<std::byte>(bytes));

  // The forward, captured once: per layer the gate's wait, then the layer's "kernel".
  REQUIRE(rt::stream_begin_capture(st.s) == rt::success);
  CHECK_THROWS_AS(g.enqueue_wait(st.s, 1, 0), std::logic_error);  // no step 1 yet: refused first
  for (std::size_t l = 0; l < layers; ++l) {
    g.enqueue_graph_wait(st.s, l);
    REQUIRE(rt::memcpy_async(out[l].data(), blocks[l].data(), bytes, fh::copy_kind::device_to_device,
                             st.s) == rt::success);
  }
  rt::graph_handle graph = nullptr;
  REQUIRE(rt::stream_end_capture(st.s, graph) == rt::success);
  rt::graph_exec_handle exec = nullptr;
  REQUIRE(rt::graph_instantiate(exec, graph) == rt::success);
  CHECK(queued(st) == 0);  // captured, not run

  std::mt19937 rng(7);
  int failed = 0;
  int expect_failed = 0;
  int timed_out = 0;
  for (int step = 0; step < steps; ++step) {
    const bool slow_step = step % 100 == 99;  // one layer never loads: its deadline releases it
    const auto deadline = clock_type::now() + (slow_step ? 5ms : hang_bound);
    const std::uint32_t e = g.begin_step(deadline);
    std::vector<ferry::completer> cs(layers);
    std::vector<transfer> ts(layers);
    for (std::size_t l = 0; l < layers; ++l) {
      auto [t, c] = ferry::make_manual_transfer();
      ts[l] = std::move(t);
      cs[l] = std::move(c);
      g.arm(e, l, std::span<const transfer>(&ts[l], 1));
    }
    g.seal(e);
    g.launch_graph(st.s, exec, e);

    // The loads land in a random order from another thread; some fail, one may never end.
    const std::size_t failing =
        step % 7 == 3 && !slow_step ? static_cast<std::size_t>(rng() % layers) : layers;
    if (failing < layers) ++expect_failed;
    const std::size_t hanging = slow_step ? static_cast<std::size_t>(rng() % layers) : layers;
    std::vector<std::size_t> order(layers);
    for (std::size_t l = 0; l < layers; ++l) order[l] = l;
    std::shuffle(order.begin(), order.end(), rng);
    std::thread loader([&] {
      for (const std::size_t l : order) {
        if (l == hanging) continue;
        std::memset(blocks[l].data(), (step * 7 + static_cast<int>(l)) & 0xff, bytes);
        if (l == failing) {
          cs[l].fail(std::make_error_code(std::errc::io_error));
        } else {
          cs[l].succeed();
        }
      }
    });
    REQUIRE(rt::stream_synchronize(st.s) == rt::success);
    loader.join();

    for (std::size_t l = 0; l < layers; ++l) {
      const fh::layer_verdict v = g.verdict(e, l);
      if (l == failing) {
        REQUIRE(v.state == layer_state::failed);
        ++failed;
      } else if (l == hanging) {
        REQUIRE(v.state == layer_state::timed_out);
        ++timed_out;
      } else {
        REQUIRE(v.state == layer_state::success);
        // The layer's kernel ran after its load: it saw this step's bytes.
        REQUIRE(out[l][0] == static_cast<std::byte>((step * 7 + static_cast<int>(l)) & 0xff));
        REQUIRE(out[l][bytes - 1] == out[l][0]);
      }
    }
    cs.clear();  // a hanging load's completer goes: that transfer is abandoned, long after its step
  }
  CHECK(failed == expect_failed);
  CHECK(expect_failed > 100);
  CHECK(timed_out == steps / 100);
  CHECK(g.counters().steps == steps);
  CHECK_THROWS_AS((void)g.verdict(1, 0), std::out_of_range);  // older than the 8 steps kept
  (void)rt::graph_exec_destroy(exec);
  (void)rt::graph_destroy(graph);
}

TEST_CASE("layer gate: waits that would freeze an epoch into a graph are refused", "[gpu][layer_gate]") {
  gate g(opts(2));
  test_stream st;
  const std::uint32_t e = g.begin_step(hang_bound);
  g.seal(e);
  REQUIRE(rt::stream_begin_capture(st.s) == rt::success);
  try {
    g.enqueue_wait(st.s, e, 0);
    FAIL("enqueue_wait during capture was accepted");
  } catch (const std::logic_error& x) {
    CHECK(std::string(x.what()).find("capturing") != std::string::npos);
  }
  CHECK_THROWS_AS(g.enqueue_epoch(st.s, e), std::logic_error);
  g.enqueue_graph_wait(st.s, 1);
  rt::graph_handle graph = nullptr;
  REQUIRE(rt::stream_end_capture(st.s, graph) == rt::success);  // the refusals left it valid
  CHECK(graph->ops.size() == 1);
  (void)rt::graph_destroy(graph);
}

TEST_CASE("layer gate: bad input is refused, naming what was wrong", "[gpu][layer_gate]") {
  CHECK_THROWS_AS(gate(opts(0)), std::invalid_argument);
  CHECK_THROWS_AS(gate(opts(65537)), std::invalid_argument);
  CHECK_THROWS_AS(gate(opts(2, 0)), std::invalid_argument);
  {
    ferry_test::hip::device_count one(1);
    fh::layer_gate_options o = opts(2);
    o.device = 3;
    CHECK_THROWS_AS(gate(o), std::system_error);
  }
  gate g(opts(2, 2));
  test_stream st;
  CHECK_THROWS_AS(g.arm(1, 0, {}), std::logic_error);  // not begun
  CHECK_THROWS_AS(g.seal(1), std::logic_error);
  CHECK_THROWS_AS(g.enqueue_wait(st.s, 1, 0), std::logic_error);
  CHECK_THROWS_AS(g.enqueue_epoch(st.s, 1), std::logic_error);
  CHECK_THROWS_AS((void)g.verdict(1, 0), std::out_of_range);
  const std::uint32_t e = g.begin_step(hang_bound);
  CHECK_THROWS_AS(g.arm(e, 2, {}), std::logic_error);
  CHECK_THROWS_AS(g.enqueue_wait(st.s, e, 2), std::logic_error);
  CHECK_THROWS_AS(g.enqueue_graph_wait(st.s, 2), std::logic_error);
  CHECK_THROWS_AS((void)g.word_address(2), std::logic_error);
  g.arm(e, 0, {});
  CHECK(g.verdict(e, 0).state == layer_state::success);  // nothing to load
  try {
    g.arm(e, 0, {});
    FAIL("a layer was armed twice");
  } catch (const std::logic_error& x) {
    CHECK(std::string(x.what()).find("armed already") != std::string::npos);
  }
  g.seal(e);
  CHECK_THROWS_AS(g.arm(e, 1, {}), std::logic_error);  // sealed
  // A refusal by the runtime is a system_error naming the call; the gate goes on.
  fh::fake::control::instance().refuse_next_enqueues(1);
  try {
    g.enqueue_wait(st.s, e, 0);
    FAIL("a refused enqueue was not reported");
  } catch (const std::system_error& x) {
    CHECK(std::string(x.what()).find("stream_wait_value32") != std::string::npos);
    CHECK(x.code().value() == fh::fake::error_invalid_value);
  }
  g.enqueue_wait(st.s, e, 0);
  REQUIRE(rt::stream_synchronize(st.s) == rt::success);
}

TEST_CASE("layer gate: destroying the gate releases a stream still waiting", "[gpu][layer_gate]") {
  test_stream st;
  auto [never, keep] = ferry::make_manual_transfer();
  const auto start = clock_type::now();
  {
    gate g(opts(1));
    const std::uint32_t e = g.begin_step(std::chrono::hours(1));
    g.arm(e, 0, std::span<const transfer>(&never, 1));
    g.enqueue_wait(st.s, e, 0);
    std::this_thread::sleep_for(1ms);
  }  // the destructor releases the wait and waits for the stream
  CHECK(queued(st) == 0);
  CHECK(clock_type::now() - start < hang_bound);
  keep.succeed();  // the watch ends after the gate, changing nothing
}

TEST_CASE("layer gate: words move in step order while loads end on many threads",
          "[gpu][layer_gate][concurrency]") {
  constexpr std::size_t layers = 8;
  constexpr int steps = 200;
  constexpr int per_layer = 3;
  gate g(opts(layers, steps + 1));
  std::vector<std::vector<ferry::completer>> pending(steps);
  std::atomic<bool> done{false};
  std::atomic<int> violations{0};
  std::atomic<std::uint64_t> looks{0};

  // A reader, as the GPU: whatever a word says, every step up to it has that layer decided.
  std::thread reader([&] {
    while (!done.load()) {
      for (std::size_t l = 0; l < layers; ++l) {
        const std::uint32_t w = std::atomic_ref<const std::uint32_t>(*g.word_address(l)).load(std::memory_order_acquire);
        for (std::uint32_t e = 1; e <= w; ++e) {
          if (g.verdict(e, l).state == layer_state::pending) violations.fetch_add(1);
        }
        looks.fetch_add(1);
      }
    }
  });

  std::vector<std::uint32_t> epochs;
  for (int s = 0; s < steps; ++s) {
    const std::uint32_t e = g.begin_step(hang_bound);
    epochs.push_back(e);
    for (std::size_t l = 0; l < layers; ++l) {
      std::vector<transfer> ts;
      for (int k = 0; k < per_layer; ++k) {
        auto [t, c] = ferry::make_manual_transfer();
        ts.push_back(std::move(t));
        pending[static_cast<std::size_t>(s)].push_back(std::move(c));
      }
      g.arm(e, l, ts);
    }
    g.seal(e);
  }
  // Four threads end the loads in a scrambled order, newest steps often first.
  std::vector<std::thread> finishers;
  for (int w = 0; w < 4; ++w) {
    finishers.emplace_back([&, w] {
      std::mt19937 rng(static_cast<unsigned>(w) + 11);
      for (int s = steps - 1 - w; s >= 0; s -= 4) {
        auto& cs = pending[static_cast<std::size_t>(s)];
        std::shuffle(cs.begin(), cs.end(), rng);
        for (std::size_t i = 0; i < cs.size(); ++i) {
          if (i % 17 == 5) {
            cs[i].fail(std::make_error_code(std::errc::io_error));
          } else {
            cs[i].succeed();
          }
        }
      }
    });
  }
  for (auto& t : finishers) t.join();
  REQUIRE(eventually([&] { return looks.load() > layers * 10; }));
  done.store(true);
  reader.join();
  CHECK(violations.load() == 0);
  for (std::size_t l = 0; l < layers; ++l) CHECK(g.released(l) == epochs.back());
  CHECK(g.counters().decided == steps * layers);
}

TEST_CASE("layer gate: a step's deadline releases it even when an earlier step's deadline is later",
          "[gpu][layer_gate]") {
  gate g(opts(1));
  test_stream st;
  const std::uint32_t e1 = g.begin_step(std::chrono::hours(1));  // loading, its deadline far off
  auto [slow, slow_c] = ferry::make_manual_transfer();
  g.arm(e1, 0, std::span<const transfer>(&slow, 1));
  const auto deadline = clock_type::now() + 30ms;
  const std::uint32_t e2 = g.begin_step(deadline);
  g.enqueue_wait(st.s, e2, 0);
  REQUIRE(rt::stream_synchronize(st.s) == rt::success);
  CHECK(clock_type::now() - deadline < hang_bound / 2);  // not held until e1's hour
  CHECK(g.verdict(e1, 0).state == layer_state::timed_out);
  CHECK(g.verdict(e2, 0).state == layer_state::timed_out);
  CHECK(g.released(0) == e2);
  slow_c.succeed();  // too late: changes nothing
  CHECK(g.verdict(e1, 0).state == layer_state::timed_out);
}

TEST_CASE("layer gate: epochs cross the wrap at 2^32", "[gpu][layer_gate]") {
  fh::layer_gate_options o = opts(2, 4);
  o.first_epoch = 0xfffffffdu;
  gate g(o);
  test_stream st;
  std::vector<std::uint32_t> seen;
  for (int i = 0; i < 8; ++i) {
    const std::uint32_t e = g.begin_step(hang_bound);
    seen.push_back(e);
    auto [t, c] = ferry::make_manual_transfer();
    g.arm(e, 0, std::span<const transfer>(&t, 1));
    g.seal(e);
    g.enqueue_wait(st.s, e, 0);
    g.enqueue_wait(st.s, e, 1);
    g.enqueue_epoch(st.s, e);
    g.enqueue_graph_wait(st.s, 0);
    c.succeed();
    REQUIRE(rt::stream_synchronize(st.s) == rt::success);
    CHECK(g.verdict(e, 0).state == layer_state::success);
    CHECK(g.released(0) == e);
    CHECK(g.released(1) == e);
  }
  CHECK(seen == std::vector<std::uint32_t>{0xfffffffdu, 0xfffffffeu, 0xffffffffu, 0, 1, 2, 3, 4});
  // A graph wait before any epoch was written passes: the epoch word starts where the words do.
  gate fresh(o);
  fresh.enqueue_graph_wait(st.s, 1);
  REQUIRE(rt::stream_synchronize(st.s) == rt::success);
}

TEST_CASE("layer gate: a timeout too long for the clock is no deadline, not an overflow",
          "[gpu][layer_gate]") {
  gate g(opts(1));
  const std::uint32_t e = g.begin_step(std::chrono::hours(24 * 365 * 400));
  std::this_thread::sleep_for(5ms);
  CHECK(g.verdict(e, 0).state == layer_state::pending);
  const std::uint32_t e2 = g.begin_step(std::chrono::milliseconds(-5));  // already past
  CHECK(eventually([&] { return g.verdict(e2, 0).state == layer_state::timed_out; }));
  CHECK(g.verdict(e, 0).state == layer_state::timed_out);  // released through the later step
}

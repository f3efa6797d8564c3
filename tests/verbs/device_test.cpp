// basic_device (device.hpp) over the in-process fake adapter: fatal events, deadlines, the
// executor's sleep on the completion channel, teardown, and stress runs of them. Cases tagged
// [regression] each failed before the fix their comment names.

#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <ferry/ferry.hpp>
#include <ferry/metrics.hpp>
#include <ferry/testing/verbs.hpp>
#include <ferry/verbs/device.hpp>

#include "helpers.hpp"
#include "verbs/verbs_helpers.hpp"

namespace {

using namespace std::chrono_literals;
using namespace ferry_test::verbs;

}  // namespace

TEST_CASE("verbs: a fatal queue pair event fails 1000 transfers in flight, none hangs",
          "[verbs]") {
  fv::queue_pair_options o;
  o.send_depth = 1024;
  o.flush_timeout = 100ms;  // paused, the adapter flushes nothing: the wait for it gives up
  rig r(o);
  std::vector<transfer> in_flight;
  {
    paused_fabric pause;
    in_flight = post_writes(r, 1000);
    REQUIRE(ferry_test::wait_until([&] { return r.a->counters().work_requests_posted >= 1000; }));
    const auto start = ferry_test::clock_type::now();
    fabric::instance().inject_qp_fatal(r.a_qp->native_handle());
    // Failed while the adapter is still paused: no completion is needed.
    REQUIRE(all_end(in_flight, transfer_state::failed));
    CHECK(ferry_test::ms_since(start) < 5000);
    for (const transfer& t : in_flight) CHECK(t.error() == fv::errc::queue_pair_fatal);
    CHECK(r.a_mem->in_use());  // still pinned: the adapter has not flushed them yet
  }
  // The flushes come; the memory is released.
  REQUIRE(ferry_test::wait_until([&] { return !r.a_mem->in_use(); }));
  CHECK(r.a_qp->write(r.a_mem->slice(0, 8), r.b_mem->remote().slice(0, 8)).error() ==
        fv::errc::queue_pair_fatal);
}

TEST_CASE("verbs: device fatal, port down and CQ error fail everything they strand", "[verbs]") {
  struct kind {
    const char* name;
    fv::errc expected;
  };
  for (const kind k : {kind{"device fatal", fv::errc::device_fatal},
                       kind{"port down", fv::errc::port_down},
                       kind{"cq error", fv::errc::completion_queue_error}}) {
    INFO(k.name);
    rig r;
    std::vector<transfer> in_flight;
    paused_fabric pause;
    in_flight = post_writes(r, 100);
    std::uint64_t value = 0;
    transfer waiting = r.a_qp->receive_notification(value);
    REQUIRE(ferry_test::wait_until([&] { return r.a->counters().work_requests_posted >= 100; }));
    if (k.expected == fv::errc::device_fatal) fabric::instance().inject_device_fatal(r.a->native_context());
    if (k.expected == fv::errc::port_down) fabric::instance().inject_port_down(r.a->native_context());
    if (k.expected == fv::errc::completion_queue_error) fabric::instance().inject_cq_error(r.a->native_cq());
    REQUIRE(all_end(in_flight, transfer_state::failed));
    for (const transfer& t : in_flight) CHECK(t.error() == k.expected);
    REQUIRE(waiting.wait_for(hang_bound) == transfer_state::failed);
    CHECK(waiting.error() == k.expected);
    CHECK(r.a_qp->write(r.a_mem->slice(0, 8), r.b_mem->remote().slice(0, 8)).error() == k.expected);
    pause.resume();
  }
}

TEST_CASE("verbs: a deadline takes back a request the adapter holds: its memory is free when it fails",
          "[verbs]") {
  rig r;
  region dst = region::allocate(*r.a, 4096);
  fill_pattern(dst.bytes(), 1);
  fill_pattern(r.b_mem->bytes().first(4096), 2);
  // Requests towards b wait, as behind a pulled cable; moving a queue pair to error still flushes.
  fabric::instance().inject_port_down(r.b->native_context());
  const auto start = ferry_test::clock_type::now();
  transfer t = r.a_qp->read(dst.slice(0, 4096), r.b_mem->remote().slice(0, 4096), 50ms);
  transfer behind = r.a_qp->write(r.a_mem->slice(0, 64), r.b_mem->remote().slice(8192, 64));
  REQUIRE(t.wait_for(hang_bound) == transfer_state::failed);
  // The adapter has flushed it: nothing holds the region, and nothing will write into it.
  CHECK_FALSE(dst.in_use());
  CHECK(t.error() == fv::errc::deadline_exceeded);
  CHECK(ferry_test::ms_since(start) >= 45);
  CHECK(ferry_test::ms_since(start) < 5000);
  // Taking it back took the queue pair: what was behind it is flushed too, and nothing more goes.
  REQUIRE(behind.wait_for(hang_bound) == transfer_state::failed);
  CHECK(behind.error() == fv::errc::queue_pair_timed_out);
  CHECK(r.a_qp->write(r.a_mem->slice(0, 8), r.b_mem->remote().slice(0, 8)).error() ==
        fv::errc::queue_pair_timed_out);
  CHECK(r.a->counters().flushes_overdue == 0);
  fabric::instance().inject_port_up(r.b->native_context());
  std::this_thread::sleep_for(20ms);
  CHECK(has_pattern(dst.bytes(), 1));
}

TEST_CASE("verbs: an adapter that never flushes cannot hang a deadline; the memory stays pinned",
          "[verbs]") {
  fv::queue_pair_options o;
  o.flush_timeout = 100ms;
  rig r(o);
  paused_fabric pause;  // executes, flushes and completes nothing
  const auto start = ferry_test::clock_type::now();
  transfer t = r.a_qp->write(r.a_mem->slice(0, 4096), r.b_mem->remote().slice(0, 4096), 50ms);
  REQUIRE(t.wait_for(hang_bound) == transfer_state::failed);
  CHECK(ferry_test::ms_since(start) >= 145);  // the deadline, then the wait for the flush
  CHECK(ferry_test::ms_since(start) < 5000);
  CHECK(t.error() == fv::errc::deadline_exceeded);
  CHECK(r.a->counters().flushes_overdue == 1);
  // The adapter still holds the request: the region stays registered until it hands it back.
  CHECK(r.a_mem->in_use());
  pause.resume();
  REQUIRE(ferry_test::wait_until([&] { return !r.a_mem->in_use(); }));
  CHECK(t.error() == fv::errc::deadline_exceeded);
}

TEST_CASE("verbs: destroying the device ends every transfer it still holds", "[verbs]") {
  std::vector<transfer> in_flight;
  {
    rig r;
    paused_fabric pause;
    in_flight = post_writes(r, 16);
    r.a_qp.reset();
    r.b_qp.reset();
    r.a_mem.reset();  // the requests still hold the registration
    r.b_mem.reset();
  }
  for (const transfer& t : in_flight) {
    CHECK(t.state() == transfer_state::failed);
  }
}

TEST_CASE("verbs: the executor sleeps on the completion channel and never misses a completion",
          "[verbs][concurrency]") {
  ferry::executor_options eo;
  eo.mode = ferry::progress_mode::park;
  rig_options ro;
  ro.exec = eo;
  rig r(ro);
  // Every round trip lets the executor arm the CQ and sleep; a completion that lands between its
  // last poll and the arming must still wake it (the re-poll after arming).
  for (int i = 0; i < 5000; ++i) {
    transfer t = r.a_qp->write(r.a_mem->slice(0, 64), r.b_mem->remote().slice(0, 64));
    REQUIRE(t.wait_for(hang_bound) == transfer_state::success);
  }
  CHECK(r.exec_a->counters().parks > 0);
}

TEST_CASE("verbs: 10^5 transfers from four threads over two queue pairs", "[verbs][concurrency]") {
  fv::queue_pair_options o;
  o.send_depth = 128;
  rig r(o);
  queue_pair second_a(*r.a, o);
  queue_pair second_b(*r.b, o);
  second_a.connect(second_b.local_info());
  second_b.connect(second_a.local_info());
  constexpr int threads = 4;
  constexpr int per_thread = 25000;
  constexpr int window = 32;
  std::atomic<int> succeeded{0};
  std::atomic<int> wrong{0};
  std::vector<std::thread> workers;
  for (int w = 0; w < threads; ++w) {
    workers.emplace_back([&, w] {
      queue_pair& qp = w % 2 == 0 ? *r.a_qp : second_a;
      std::vector<transfer> ring(window);
      for (int i = 0; i < per_thread; ++i) {
        transfer& slot = ring[static_cast<std::size_t>(i % window)];
        if (slot.valid()) {
          if (slot.wait_for(hang_bound) == transfer_state::success) {
            ++succeeded;
          } else {
            ++wrong;
          }
        }
        const std::size_t at = static_cast<std::size_t>(w * 4096 + (i % window) * 64);
        if (i % 3 == 0) {
          slot = qp.read(r.a_mem->slice(at, 64), r.b_mem->remote().slice(at, 64));
        } else {
          slot = qp.write(r.a_mem->slice(at, 64), r.b_mem->remote().slice(at, 64));
        }
      }
      for (transfer& t : ring) {
        if (t.wait_for(hang_bound) == transfer_state::success) {
          ++succeeded;
        } else {
          ++wrong;
        }
      }
    });
  }
  for (std::thread& t : workers) t.join();
  CHECK(wrong == 0);
  CHECK(succeeded == threads * per_thread);
  CHECK(r.a->counters().completions <= r.a->counters().work_requests_posted);
}

// Was: IBV_EVENT_CQ_ERR sets cq_failed_ (reap() never polls again) and breaks only the queue pairs
// the executor knows at that moment. A queue pair created afterwards starts with broken == 0, so
// its requests are accepted and posted, and nothing can ever complete them: pending forever.
TEST_CASE("verbs: a queue pair created after a CQ error fails its transfers instead of holding them",
          "[verbs][regression]") {
  rig r;
  fabric::instance().inject_cq_error(r.a->native_cq());
  REQUIRE(ferry_test::wait_until([&] { return bool(r.a_qp->error()); }));
  CHECK(r.a_qp->error() == fv::errc::completion_queue_error);

  queue_pair a2(*r.a);
  queue_pair b2(*r.b);
  // A fixed device may refuse the new queue pair at once (connect then throws): that is fine.
  bool connected = true;
  try {
    a2.connect(b2.local_info());
    b2.connect(a2.local_info());
  } catch (const std::system_error&) {
    connected = false;
  }
  transfer w = a2.write(r.a_mem->slice(0, 64), r.b_mem->remote().slice(0, 64));
  std::uint64_t value = 0;
  transfer n = a2.receive_notification(value);
  if (connected) (void)b2.send_notification(5).wait_for(hang_bound);
  REQUIRE(w.wait_for(hang_bound) == transfer_state::failed);
  REQUIRE(n.wait_for(hang_bound) == transfer_state::failed);
  CHECK(w.error() == fv::errc::completion_queue_error);
  CHECK(n.error() == fv::errc::completion_queue_error);
  CHECK(r.a->failure() == fv::errc::completion_queue_error);
}

// --- Stress runs (guards; the suite runs them in the ASan and TSan builds too). ---

namespace {

// A chain of inline continuations: each completion submits the next WRITE from inside poll(), and
// the last one closes a second queue pair from there too.
ferry_test::detached_inline inline_chain(queue_pair& qp, std::unique_ptr<queue_pair>& doomed,
                                         region& src, region& dst, int rounds,
                                         std::atomic<int>& ok, std::atomic<bool>& done) {
  ferry::inline_scheduler here;
  for (int i = 0; i < rounds; ++i) {
    transfer t = qp.write(src.slice(static_cast<std::size_t>(i % 64) * 64, 64),
                          dst.remote().slice(static_cast<std::size_t>(i % 64) * 64, 64));
    if (co_await ferry::resume_on(here, t) == transfer_state::success) ++ok;
  }
  doomed.reset();  // closes a queue pair from inside the executor's poll()
  done = true;
}

// Receives a notification and answers it with the next value, resuming inline each time.
ferry_test::detached_inline inline_pong(queue_pair& qp, int rounds, std::uint64_t first,
                                        std::atomic<int>& in_order, std::atomic<bool>& done) {
  ferry::inline_scheduler here;
  for (int i = 0; i < rounds; ++i) {
    std::uint64_t v = 0;
    transfer n = qp.receive_notification(v, std::chrono::seconds(10));
    if (co_await ferry::resume_on(here, n) != transfer_state::success) break;
    if (v == first + 2 * static_cast<std::uint64_t>(i)) ++in_order;
    (void)qp.send_notification(v + 1);
  }
  done = true;
}

}  // namespace

TEST_CASE("verbs: stress: the device is destroyed while deadlines fire", "[verbs][regression][concurrency]") {
  fv::queue_pair_options o;
  o.send_depth = 256;
  o.receive_depth = 8;
  for (int iter = 0; iter < 40; ++iter) {
    std::vector<transfer> all;
    std::vector<std::uint64_t> values(16);
    {
      std::optional<paused_fabric> pause;
      if (iter % 2 == 0) pause.emplace();
      rig r(rig::with(o, std::size_t{1} << 16));
      for (int i = 0; i < 200; ++i) {
        const auto timeout = std::chrono::microseconds((i % 7) * 300) - std::chrono::microseconds(i % 11 == 0 ? 1 : 0);
        const std::size_t at = static_cast<std::size_t>(i % 64) * 64;
        if (i % 3 == 0) {
          all.push_back(r.a_qp->read(r.a_mem->slice(at, 64), r.b_mem->remote().slice(at, 64), timeout));
        } else {
          all.push_back(r.a_qp->write(r.a_mem->slice(at, 64), r.b_mem->remote().slice(at, 64), timeout));
        }
        if (i % 13 == 0) {
          std::vector<block> bl{{r.a_mem->slice(0, 32), r.b_mem->remote().slice(0, 32)},
                                {r.a_mem->slice(32, 32), r.b_mem->remote().slice(32, 32)}};
          std::vector<transfer> out(2);
          r.a_qp->write_batch(std::span<const block>(bl), std::span<transfer>(out), timeout);
          for (transfer& t : out) all.push_back(std::move(t));
        }
        if (i % 20 == 0) {
          all.push_back(r.b_qp->receive_notification(values[static_cast<std::size_t>(i / 20)],
                                                     std::chrono::microseconds(i * 50)));
          all.push_back(r.a_qp->send_notification(static_cast<std::uint64_t>(i), timeout));
        }
      }
      std::this_thread::sleep_for(std::chrono::microseconds((iter % 5) * 400));
      if (iter % 3 == 0) r.a_qp.reset();
    }
    for (const transfer& t : all) REQUIRE(t.state() != transfer_state::pending);
  }
}

TEST_CASE("verbs: stress: continuations resumed inline submit and close from inside poll()",
          "[verbs][regression][concurrency]") {
  rig r;
  auto extra_a = std::make_unique<queue_pair>(*r.a);
  queue_pair extra_b(*r.b);
  extra_a->connect(extra_b.local_info());
  extra_b.connect(extra_a->local_info());
  transfer pending_on_extra;
  {
    paused_fabric pause;
    pending_on_extra = extra_a->write(r.a_mem->slice(8192, 64), r.b_mem->remote().slice(8192, 64));
  }
  std::atomic<int> ok{0};
  std::atomic<bool> done{false};
  inline_chain(*r.a_qp, extra_a, *r.a_mem, *r.b_mem, 2000, ok, done);
  REQUIRE(ferry_test::wait_until([&] { return done.load(); }));
  CHECK(ok == 2000);
  CHECK(pending_on_extra.wait_for(hang_bound) != transfer_state::pending);

  std::atomic<int> a_in_order{0}, b_in_order{0};
  std::atomic<bool> a_done{false}, b_done{false};
  inline_pong(*r.b_qp, 500, 0, b_in_order, b_done);
  inline_pong(*r.a_qp, 500, 1, a_in_order, a_done);
  REQUIRE(r.a_qp->send_notification(0).wait_for(hang_bound) == transfer_state::success);
  REQUIRE(ferry_test::wait_until([&] { return a_done.load() && b_done.load(); }));
  CHECK(a_in_order == 500);
  CHECK(b_in_order == 500);
}

TEST_CASE("verbs: a deadline that takes a queue pair down while a wait on it expires in the same "
          "round", "[verbs][regression]") {
  // Both deadlines fire in one timer round. Taking the queue pair down for the WRITE ends the
  // notification wait too; that wait, still further down the round's list of expired requests,
  // must not be ended a second time (the ASan build sees the freed request otherwise).
  fv::queue_pair_options o;
  o.flush_timeout = 20ms;
  rig r(o);
  paused_fabric pause;
  for (int i = 0; i < 20; ++i) {
    std::uint64_t value = 0;
    transfer write = r.a_qp->write(r.a_mem->slice(0, 64), r.b_mem->remote().slice(0, 64), 30ms);
    transfer wait = r.a_qp->receive_notification(value, 30ms);
    REQUIRE(wait.wait_for(hang_bound) == transfer_state::failed);
    REQUIRE(write.wait_for(hang_bound) == transfer_state::failed);
    CHECK(write.error() == fv::errc::deadline_exceeded);
    // Its own deadline, or (had the two fired in different rounds) the queue pair going down.
    CHECK((wait.error() == fv::errc::deadline_exceeded ||
           wait.error() == fv::errc::queue_pair_timed_out));
    // The queue pair is down: a fresh pair for the next round.
    r.a_qp.reset();
    r.b_qp.reset();
    r.a_qp = std::make_unique<queue_pair>(*r.a, o);
    r.b_qp = std::make_unique<queue_pair>(*r.b, o);
    r.a_qp->connect(r.b_qp->local_info());
    r.b_qp->connect(r.a_qp->local_info());
  }
}

TEST_CASE("verbs: a request whose deadline passed with its success still in the CQ takes nothing "
          "down", "[verbs][regression]") {
  // The executor reaps one completion per round here, and is held inside the first: when it goes
  // on, the expired request's success is still in the CQ behind the others. It must end in
  // success, and its queue pair must stay up (taking it down is for requests the adapter holds).
  rig_options ro;
  ro.exec.poll_budget = 1;
  rig r(ro);
  std::atomic<int> stage{0};
  transfer first, second, late;
  {
    paused_fabric pause;
    first = r.a_qp->write(r.a_mem->slice(0, 64), r.b_mem->remote().slice(0, 64));
    second = r.a_qp->write(r.a_mem->slice(64, 64), r.b_mem->remote().slice(64, 64));
    // The executor must be held before this deadline passes: 600 ms leaves room for a thread held
    // off the CPU on a loaded machine.
    late = r.a_qp->write(r.a_mem->slice(128, 64), r.b_mem->remote().slice(128, 64), 600ms);
    REQUIRE(ferry_test::wait_until([&] { return r.a->counters().work_requests_posted >= 3; }));
    hold_executor(first, stage);
  }
  REQUIRE(ferry_test::wait_until([&] { return stage.load() == 1; }));
  std::this_thread::sleep_for(700ms);  // the deadline passes while the success waits in the CQ
  stage = 2;
  REQUIRE(late.wait_for(hang_bound) == transfer_state::success);
  REQUIRE(second.wait_for(hang_bound) == transfer_state::success);
  std::this_thread::sleep_for(20ms);
  CHECK_FALSE(r.a_qp->error());
  CHECK(r.a_qp->write(r.a_mem->slice(0, 8), r.b_mem->remote().slice(0, 8)).wait_for(hang_bound) ==
        transfer_state::success);
}

TEST_CASE("verbs: a request whose deadline passed keeps that reason when the device goes",
          "[verbs][regression]") {
  auto r = std::make_unique<rig>();
  paused_fabric pause;  // the adapter holds the WRITE and never flushes it
  transfer t = r->a_qp->write(r->a_mem->slice(0, 64), r->b_mem->remote().slice(0, 64), 30ms);
  REQUIRE(ferry_test::wait_until([&] { return r->a->counters().work_requests_posted >= 1; }));
  // Expired, waiting for its flush: the expiry has taken the queue pair down.
  REQUIRE(ferry_test::wait_until([&] { return static_cast<bool>(r->a_qp->error()); }));
  r.reset();
  REQUIRE(t.state() == transfer_state::failed);
  CHECK(t.error() == fv::errc::deadline_exceeded);
}

TEST_CASE("verbs: a device given a metrics registry records each WRITE and READ, batches included",
          "[verbs]") {
  ferry::metrics::registry metrics("verbs");
  {
    metered_devices d(metrics, "metrics");
    device& a = d.a;
    device& b = d.b;
    region& a_mem = d.a_mem;
    region& b_mem = d.b_mem;
    queue_pair a_qp(a, fv::queue_pair_options{});
    queue_pair b_qp(b, fv::queue_pair_options{});
    a_qp.connect(b_qp.local_info());
    b_qp.connect(a_qp.local_info());
    REQUIRE(a_qp.write(a_mem.slice(0, 4096), b_mem.remote().slice(0, 4096)).wait_for(hang_bound) ==
            transfer_state::success);
    std::vector<block> blocks;
    for (std::size_t i = 0; i < 3; ++i) {
      blocks.push_back({a_mem.slice(i * 1024, 1024), b_mem.remote().slice(i * 1024, 1024)});
    }
    std::vector<transfer> out(blocks.size());
    a_qp.read_batch(blocks, out);
    REQUIRE(ferry::wait_all(out, hang_bound).ok());
  }
  const ferry::metrics::snapshot s = metrics.snapshot();
  REQUIRE(s.operations.size() == 2);
  CHECK(s.operations[0].kind == "write");
  CHECK(s.operations[0].succeeded == 1);
  CHECK(s.operations[0].bytes == 4096);
  CHECK(s.operations[1].kind == "read");
  CHECK(s.operations[1].succeeded == 3);
  CHECK(s.operations[1].bytes == 3 * 1024);
}

TEST_CASE("verbs: a metered device also counts each queue pair's WRITEs and READs under its peer's name",
          "[verbs]") {
  ferry::metrics::registry metrics("verbs");
  {
    metered_devices d(metrics, "peer_metrics");
    // Two queue pairs to named peers and one without a name: its requests count only in the totals.
    std::vector<queue_pair> mine;
    std::vector<queue_pair> theirs;
    for (const char* name : {"decode-1", "decode-2", ""}) {
      fv::queue_pair_options qo;
      qo.peer_name = name;
      mine.emplace_back(d.a, qo);
      theirs.emplace_back(d.b, fv::queue_pair_options{});
      mine.back().connect(theirs.back().local_info());
      theirs.back().connect(mine.back().local_info());
    }
    std::vector<transfer> ts;
    for (std::size_t q = 0; q < mine.size(); ++q) {
      for (std::size_t i = 0; i <= q; ++i) {
        ts.push_back(mine[q].write(d.a_mem.slice(i * 512, 512), d.b_mem.remote().slice(i * 512, 512)));
      }
      ts.push_back(mine[q].read(d.a_mem.slice(8192, 100), d.b_mem.remote().slice(0, 100)));
    }
    REQUIRE(ferry::wait_all(ts, hang_bound).ok());
  }
  const ferry::metrics::snapshot s = metrics.snapshot();
  auto find = [&](const std::string& kind, const std::string& peer) { return ferry_test::find_series(s, kind, peer); };
  CHECK(find("write", "").succeeded == 6);
  CHECK(find("read", "").succeeded == 3);
  CHECK(find("write", "decode-1").succeeded == 1);
  CHECK(find("write", "decode-2").succeeded == 2);
  CHECK(find("write", "decode-2").bytes == 1024);
  CHECK(find("read", "decode-1").succeeded == 1);
  CHECK(find("read", "decode-2").bytes == 100);
  CHECK(s.operations.size() == 6);  // the totals and two peers, for each of the two kinds
}

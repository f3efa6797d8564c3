// The verbs backend against the in-process fake adapter (ferry/verbs/fake.hpp): the same backend
// code the real build runs, with every verbs call answered by the fake.

#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <ferry/ferry.hpp>
#include <ferry/verbs/device.hpp>
#include <ferry/verbs/fake.hpp>
#include <ferry/verbs/handshake.hpp>

#include "helpers.hpp"
#include "verbs/verbs_helpers.hpp"

namespace {

using namespace std::chrono_literals;
using namespace ferry_test::verbs;

bool all_end(std::span<const transfer> ts, transfer_state want) {
  for (const transfer& t : ts) {
    if (t.wait_for(hang_bound) != want) return false;
  }
  return true;
}

}  // namespace

TEST_CASE("verbs: WRITE and READ move exactly the bytes asked for", "[verbs]") {
  rig r;
  for (const std::size_t n : {std::size_t{1}, std::size_t{4097}, std::size_t{512} << 10}) {
    fill_pattern(r.a_mem->bytes().first(n), static_cast<std::uint32_t>(n));
    std::memset(r.b_mem->data(), 0, r.b_mem->size());
    transfer w = r.a_qp->write(r.a_mem->slice(0, n), r.b_mem->remote().slice(100, n));
    REQUIRE(w.wait_for(hang_bound) == transfer_state::success);
    CHECK(has_pattern(r.b_mem->bytes().subspan(100, n), static_cast<std::uint32_t>(n)));
    CHECK(std::to_integer<int>(r.b_mem->data()[99]) == 0);
    CHECK(std::to_integer<int>(r.b_mem->data()[100 + n]) == 0);

    fill_pattern(r.b_mem->bytes().subspan(200000, n), static_cast<std::uint32_t>(n) + 7);
    transfer rd = r.a_qp->read(r.a_mem->slice(300000, n), r.b_mem->remote().slice(200000, n));
    REQUIRE(rd.wait_for(hang_bound) == transfer_state::success);
    CHECK(has_pattern(r.a_mem->bytes().subspan(300000, n), static_cast<std::uint32_t>(n) + 7));
  }
  CHECK_FALSE(r.a_mem->in_use());
}

TEST_CASE("verbs: a batch is one linked list with only its last work request signalled", "[verbs]") {
  rig r;
  constexpr std::size_t members = 64;
  constexpr std::size_t size = 4096;
  fill_pattern(r.a_mem->bytes().first(members * size), 3);
  std::vector<block> blocks;
  for (std::size_t i = 0; i < members; ++i) {
    blocks.push_back({r.a_mem->slice(i * size, size), r.b_mem->remote().slice(i * size, size)});
  }
  std::vector<transfer> out(members);
  // Paused, so that the whole batch is queued before the adapter runs any of it.
  const std::uint64_t pushed_before = fabric::instance().completions_pushed();
  const auto before = r.a->counters();
  {
    paused_fabric pause;
    r.a_qp->write_batch(std::span<const block>(blocks), std::span<transfer>(out));
    REQUIRE(ferry_test::wait_until(
        [&] { return r.a->counters().work_requests_posted - before.work_requests_posted == members; }));
  }
  REQUIRE(all_end(out, transfer_state::success));
  CHECK(has_pattern(r.b_mem->bytes().first(members * size), 3));
  const auto after = r.a->counters();
  CHECK(after.post_calls - before.post_calls == 1);                          // one doorbell
  CHECK(fabric::instance().completions_pushed() - pushed_before == 1);       // one completion

  // A READ batch brings it back.
  std::vector<block> back;
  for (std::size_t i = 0; i < members; ++i) {
    back.push_back({r.a_mem->slice((members + i) * size, size), r.b_mem->remote().slice(i * size, size)});
  }
  r.a_qp->read_batch(std::span<const block>(back), std::span<transfer>(out), 10s);
  REQUIRE(all_end(out, transfer_state::success));
  CHECK(has_pattern(r.a_mem->bytes().subspan(members * size, members * size), 3));
}

TEST_CASE("verbs: an error completion fails every transfer of its batch", "[verbs]") {
  rig r;
  const fv::remote_region bad{r.b_mem->remote().address, r.b_mem->remote().length,
                              r.b_mem->rkey() ^ 0x5a5a5a};
  std::vector<block> blocks;
  for (std::size_t i = 0; i < 8; ++i) {
    const fv::remote_region& target = i == 5 ? bad : r.b_mem->remote();
    blocks.push_back({r.a_mem->slice(i * 64, 64), target.slice(i * 64, 64)});
  }
  std::vector<transfer> out(8);
  r.a_qp->write_batch(std::span<const block>(blocks), std::span<transfer>(out));
  REQUIRE(all_end(out, transfer_state::failed));
  // The member the adapter refused names the status; the flushed ones and the ones before it
  // fail too, since a batch succeeds or fails as a whole.
  for (const transfer& t : out) CHECK(t.error().category() == fv::work_completion_category());
  CHECK(out[5].error() == fv::make_error_code(IBV_WC_REM_ACCESS_ERR));
  CHECK(out[5].error().message().find("IBV_WC_REM_ACCESS_ERR") != std::string::npos);
}

TEST_CASE("verbs: a bad rkey fails with IBV_WC_REM_ACCESS_ERR and breaks the queue pair", "[verbs]") {
  rig r;
  const fv::remote_region bad{r.b_mem->remote().address, r.b_mem->remote().length, 0xdeadbeef};
  transfer t = r.a_qp->write(r.a_mem->slice(0, 128), bad.slice(0, 128));
  REQUIRE(t.wait_for(hang_bound) == transfer_state::failed);
  CHECK(t.error() == fv::make_error_code(IBV_WC_REM_ACCESS_ERR));
  // The queue pair is in the error state: the next request fails at once, saying so.
  REQUIRE(ferry_test::wait_until([&] { return bool(r.a_qp->error()); }));
  transfer next = r.a_qp->write(r.a_mem->slice(0, 128), r.b_mem->remote().slice(0, 128));
  CHECK(next.state() == transfer_state::failed);
  CHECK(next.error() == fv::errc::queue_pair_error);
  // The responder's queue pair went to the error state too (an access error event, and its
  // receives flushed: whichever the executor saw first names it).
  REQUIRE(ferry_test::wait_until([&] { return bool(r.b_qp->error()); }));
  CHECK((r.b_qp->error() == fv::errc::queue_pair_fatal || r.b_qp->error() == fv::errc::queue_pair_error));
}

TEST_CASE("verbs: a full send queue backs off until room frees, or fails at the admission deadline",
          "[verbs]") {
  SECTION("room frees before the deadline: success") {
    fv::queue_pair_options o;
    o.send_depth = 4;
    o.admission_timeout = 10s;
    rig r(o);
    paused_fabric pause;
    std::vector<transfer> first = post_writes(r, 4);
    CHECK(r.a_qp->send_credits() == 0);
    CHECK_FALSE(r.a_qp->try_write(r.a_mem->slice(0, 64), r.b_mem->remote().slice(0, 64)).has_value());
    const auto start = ferry_test::clock_type::now();  // before the resumer's sleep can begin
    std::thread resumer([&] {
      std::this_thread::sleep_for(50ms);
      pause.resume();
    });
    transfer fifth = r.a_qp->write(r.a_mem->slice(512, 64), r.b_mem->remote().slice(512, 64));
    resumer.join();
    CHECK(ferry_test::ms_since(start) >= 40);  // it did wait for room
    CHECK(fifth.wait_for(hang_bound) == transfer_state::success);
    CHECK(all_end(first, transfer_state::success));
  }
  SECTION("the longest admission timeout waits for room, not overflowing into an expired deadline") {
    fv::queue_pair_options o;
    o.send_depth = 4;
    o.admission_timeout = std::chrono::nanoseconds::max();
    rig r(o);
    paused_fabric pause;
    std::vector<transfer> first = post_writes(r, 4);
    std::thread resumer([&] {
      std::this_thread::sleep_for(50ms);
      pause.resume();
    });
    transfer fifth = r.a_qp->write(r.a_mem->slice(512, 64), r.b_mem->remote().slice(512, 64));
    resumer.join();
    CHECK(fifth.wait_for(hang_bound) == transfer_state::success);
    CHECK(all_end(first, transfer_state::success));
  }
  SECTION("the queue stays full: a clear failure at the deadline, nothing lost") {
    fv::queue_pair_options o;
    o.send_depth = 4;
    o.admission_timeout = 50ms;
    rig r(o);
    paused_fabric pause;
    std::vector<transfer> first = post_writes(r, 4);
    const auto start = ferry_test::clock_type::now();
    transfer fifth = r.a_qp->write(r.a_mem->slice(512, 64), r.b_mem->remote().slice(512, 64));
    CHECK(ferry_test::ms_since(start) < 5000);
    CHECK(fifth.state() == transfer_state::failed);
    CHECK(fifth.error() == ferry::errc::submission_queue_full);
    // A batch that cannot get its slots fails whole, the same way.
    std::vector<block> two{{r.a_mem->slice(0, 8), r.b_mem->remote().slice(0, 8)},
                           {r.a_mem->slice(8, 8), r.b_mem->remote().slice(8, 8)}};
    std::vector<transfer> out(2);
    r.a_qp->write_batch(std::span<const block>(two), std::span<transfer>(out));
    CHECK(out[0].error() == ferry::errc::submission_queue_full);
    CHECK(out[1].error() == ferry::errc::submission_queue_full);
    pause.resume();
    CHECK(all_end(first, transfer_state::success));
  }
}

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

TEST_CASE("verbs: a queue pair never has more RDMA READs out than its peer accepts", "[verbs]") {
  // The requester pipelines up to its max_rd_atomic READs; a responder set up for fewer answers the
  // excess with an invalid-request NAK (the fake does as adapters do), which breaks both queue
  // pairs. Connecting takes the smaller of the two.
  rig r;
  fv::queue_pair_options many;
  many.max_rd_atomic = 16;
  fv::queue_pair_options few;
  few.max_rd_atomic = 4;
  r.a_qp = std::make_unique<queue_pair>(*r.a, many);
  r.b_qp = std::make_unique<queue_pair>(*r.b, few);
  CHECK(r.b_qp->local_info().max_rd_atomic == 4);
  r.a_qp->connect(r.b_qp->local_info());
  r.b_qp->connect(r.a_qp->local_info());
  fill_pattern(r.b_mem->bytes().first(16 * 64), 3);
  std::vector<block> reads;
  for (std::size_t i = 0; i < 16; ++i) {
    reads.push_back({r.a_mem->slice(i * 64, 64), r.b_mem->remote().slice(i * 64, 64)});
  }
  std::vector<transfer> out(reads.size());
  r.a_qp->read_batch(std::span<const block>(reads), std::span<transfer>(out));
  REQUIRE(ferry::wait_all(out, hang_bound).verdict == ferry::verdict::success);
  CHECK(has_pattern(r.a_mem->bytes().first(16 * 64), 3));
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

TEST_CASE("verbs: a notification arrives only after the WRITEs posted before it have landed",
          "[verbs]") {
  rig r(rig::with({}, std::size_t{8} << 20));
  constexpr std::uint32_t rounds = 64;
  constexpr std::size_t per_round = 16;
  constexpr std::size_t size = 4096;
  std::thread writer([&] {
    for (std::uint32_t k = 0; k < rounds; ++k) {
      const std::size_t base = k * per_round * size;
      fill_pattern(r.a_mem->bytes().subspan(base, per_round * size), k);
      std::vector<block> blocks;
      for (std::size_t i = 0; i < per_round; ++i) {
        blocks.push_back({r.a_mem->slice(base + i * size, size),
                          r.b_mem->remote().slice(base + i * size, size)});
      }
      std::vector<transfer> out(per_round);
      r.a_qp->write_batch(std::span<const block>(blocks), std::span<transfer>(out));
      (void)r.a_qp->send_notification(k);  // posted right behind the batch, not after it ends
    }
  });
  std::uint32_t bad = 0;
  for (std::uint32_t k = 0; k < rounds; ++k) {
    std::uint64_t value = ~std::uint64_t{0};
    transfer n = r.b_qp->receive_notification(value, hang_bound);
    REQUIRE(n.wait_for(hang_bound) == transfer_state::success);
    REQUIRE(value == k);  // in order
    if (!has_pattern(r.b_mem->bytes().subspan(k * per_round * size, per_round * size), k)) ++bad;
  }
  writer.join();
  CHECK(bad == 0);
}

TEST_CASE("verbs: the target co_awaits a notification on its own scheduler", "[verbs]") {
  rig r;
  ferry_test::engine_thread engine;
  std::atomic<std::uint64_t> got{0};
  std::atomic<bool> on_engine{false};
  std::atomic<bool> done{false};
  auto waiter = [&](ferry::run_loop&) -> ferry_test::detached {
    std::uint64_t value = 0;
    const transfer_state s = co_await r.b_qp->receive_notification(value, hang_bound);
    on_engine = std::this_thread::get_id() == engine.id();
    got = s == transfer_state::success ? value : 0;
    done = true;
  };
  waiter(engine.loop());
  fill_pattern(r.a_mem->bytes().first(1024), 9);
  transfer w = r.a_qp->write(r.a_mem->slice(0, 1024), r.b_mem->remote().slice(0, 1024));
  transfer n = r.a_qp->send_notification(42);
  REQUIRE(ferry_test::wait_until([&] { return done.load(); }));
  CHECK(got == 42);
  CHECK(on_engine);
  CHECK(w.wait_for(hang_bound) == transfer_state::success);
  CHECK(n.wait_for(hang_bound) == transfer_state::success);
  CHECK(has_pattern(r.b_mem->bytes().first(1024), 9));
}

TEST_CASE("verbs: notifications wait for a taker and time out when none comes", "[verbs]") {
  fv::queue_pair_options o;
  o.receive_depth = 4;
  rig r(o);
  // Sent before anyone asks: they wait, in order, in the posted receives.
  for (std::uint64_t v = 1; v <= 3; ++v) {
    REQUIRE(r.a_qp->send_notification(v).wait_for(hang_bound) == transfer_state::success);
  }
  for (std::uint64_t v = 1; v <= 3; ++v) {
    std::uint64_t got = 0;
    REQUIRE(r.b_qp->receive_notification(got).wait_for(hang_bound) == transfer_state::success);
    CHECK(got == v);
  }
  std::uint64_t never = 0;
  const auto start = ferry_test::clock_type::now();
  transfer t = r.b_qp->receive_notification(never, 30ms);
  REQUIRE(t.wait_for(hang_bound) == transfer_state::failed);
  CHECK(t.error() == fv::errc::deadline_exceeded);
  CHECK(ferry_test::ms_since(start) < 5000);
  // A later notification goes to a later taker, not the one that gave up.
  REQUIRE(r.a_qp->send_notification(7).wait_for(hang_bound) == transfer_state::success);
  std::uint64_t got = 0;
  REQUIRE(r.b_qp->receive_notification(got).wait_for(hang_bound) == transfer_state::success);
  CHECK(got == 7);
  CHECK(never == 0);
}

TEST_CASE("verbs: a notification wait with no deadline fails once its peer has gone", "[verbs]") {
  // RC tells of a dead peer only when something is sent to it; with nothing else in flight, the
  // waiting side's peer checks are what sends.
  fv::queue_pair_options o;
  o.peer_check = 5ms;
  rig r(o);
  // A request that came back tells the queue pair that its peer is connected: checks may start.
  REQUIRE(post_writes(r, 1)[0].wait_for(hang_bound) == transfer_state::success);
  std::uint64_t value = 0;
  transfer waiting = r.a_qp->receive_notification(value);
  r.b_qp.reset();  // the peer's queue pair goes, as when its process dies
  REQUIRE(waiting.wait_for(hang_bound) == transfer_state::failed);
  CHECK(waiting.error() == fv::errc::peer_unreachable);
  CHECK(r.a->counters().peer_checks >= 1);
  CHECK(value == 0);
  // The queue pair is down, and says why.
  CHECK(r.a_qp->write(r.a_mem->slice(0, 8), r.b_mem->remote().slice(0, 8)).error() ==
        fv::errc::peer_unreachable);
  std::uint64_t later = 0;
  CHECK(r.a_qp->receive_notification(later).wait_for(hang_bound) == transfer_state::failed);
}

TEST_CASE("verbs: a request the peer never answers says the peer is unreachable", "[verbs]") {
  rig r;
  std::uint64_t value = 0;
  transfer waiting = r.a_qp->receive_notification(value);
  const std::size_t live = fabric::instance().live_objects();
  r.b_qp.reset();
  // The close is the executor's to carry out: wait until the peer's queue pair is gone.
  REQUIRE(ferry_test::wait_until([&] { return fabric::instance().live_objects() < live; }));
  transfer w = post_writes(r, 1)[0];
  REQUIRE(w.wait_for(hang_bound) == transfer_state::failed);
  CHECK(w.error() == ferry::verbs::make_error_code(IBV_WC_RETRY_EXC_ERR));  // the adapter's status
  REQUIRE(waiting.wait_for(hang_bound) == transfer_state::failed);
  CHECK(waiting.error() == fv::errc::peer_unreachable);  // and the queue pair's reason
  CHECK(r.a_qp->error() == fv::errc::peer_unreachable);
}

TEST_CASE("verbs: peer checks of a live peer change nothing, and run only while a wait needs them",
          "[verbs]") {
  fv::queue_pair_options o;
  o.peer_check = 2ms;
  rig r(o);
  r.b_qp->mark_peer_connected();  // as the handshake does
  std::uint64_t value = 0;
  transfer waiting = r.b_qp->receive_notification(value);
  REQUIRE(ferry_test::wait_until([&] { return r.b->counters().peer_checks >= 5; }));
  CHECK(waiting.state() == transfer_state::pending);
  REQUIRE(r.a_qp->send_notification(42).wait_for(hang_bound) == transfer_state::success);
  REQUIRE(waiting.wait_for(hang_bound) == transfer_state::success);
  CHECK(value == 42);
  // Nobody waits now: the checks stop.
  const std::uint64_t settled = r.b->counters().peer_checks;
  std::this_thread::sleep_for(30ms);
  CHECK(r.b->counters().peer_checks == settled);
  // Both ways still work, and no check took a send-queue slot for good.
  fill_pattern(r.b_mem->bytes().subspan(0, 4096), 3);
  REQUIRE(r.b_qp->write(r.b_mem->slice(0, 4096), r.a_mem->remote().slice(0, 4096))
              .wait_for(hang_bound) == transfer_state::success);
  CHECK(has_pattern(r.a_mem->bytes().subspan(0, 4096), 3));
  std::vector<transfer> full;
  for (std::uint32_t i = 0; i < o.send_depth; ++i) {
    full.push_back(r.b_qp->write(r.b_mem->slice(0, 64), r.a_mem->remote().slice(0, 64)));
  }
  CHECK(all_end(full, transfer_state::success));
}

TEST_CASE("verbs: no peer check goes out before both sides are connected, or with checks off",
          "[verbs]") {
  fv::queue_pair_options o;
  o.peer_check = 1ms;
  rig r;
  // This side not connected: it cannot post, and a check would break it instead of checking.
  queue_pair lonely(*r.a, o);
  lonely.mark_peer_connected();
  std::uint64_t value = 0;
  transfer waiting = lonely.receive_notification(value, 50ms);
  REQUIRE(waiting.wait_for(hang_bound) == transfer_state::failed);
  CHECK(waiting.error() == fv::errc::deadline_exceeded);
  CHECK(r.a->counters().peer_checks == 0);
  // This side connected, its peer not yet: a check would find nobody and take down a pair about to
  // work. The wait goes on until the peer connects and sends.
  queue_pair early(*r.a, o);
  queue_pair late(*r.b, o);
  early.connect(late.local_info());
  transfer first = early.receive_notification(value);
  std::this_thread::sleep_for(30ms);
  CHECK(r.a->counters().peer_checks == 0);
  late.connect(early.local_info());
  REQUIRE(late.send_notification(5).wait_for(hang_bound) == transfer_state::success);
  REQUIRE(first.wait_for(hang_bound) == transfer_state::success);
  CHECK(value == 5);
  CHECK_FALSE(early.error());
  // Checks off: a wait on a peer that has gone relies on its deadline alone.
  o.peer_check = 0ns;
  rig off(o);
  off.a_qp->mark_peer_connected();
  transfer bounded = off.a_qp->receive_notification(value, 50ms);
  off.b_qp.reset();
  REQUIRE(bounded.wait_for(hang_bound) == transfer_state::failed);
  CHECK(bounded.error() == fv::errc::deadline_exceeded);
  CHECK(off.a->counters().peer_checks == 0);
}

TEST_CASE("verbs: bad input is refused with an error naming what was wrong", "[verbs]") {
  rig r;
  CHECK_THROWS_AS(r.a_mem->slice(r.a_mem->size() - 4, 8), std::out_of_range);
  CHECK_THROWS_AS(r.b_mem->remote().slice(0, r.b_mem->size() + 1), std::out_of_range);
  std::byte outside[16];
  CHECK_THROWS_AS(r.a_mem->slice(std::span<std::byte>(outside)), std::out_of_range);

  transfer empty = r.a_qp->write(r.a_mem->slice(0, 0), r.b_mem->remote().slice(0, 0));
  CHECK(empty.error() == ferry::errc::empty_buffer);
  transfer mismatch = r.a_qp->write(r.a_mem->slice(0, 16), r.b_mem->remote().slice(0, 8));
  CHECK(mismatch.error() == fv::errc::length_mismatch);
  transfer foreign = r.a_qp->write(r.b_mem->slice(0, 16), r.b_mem->remote().slice(0, 16));
  CHECK(foreign.error() == fv::errc::outside_local_region);

  queue_pair lonely(*r.a);
  transfer unconnected = lonely.write(r.a_mem->slice(0, 16), r.b_mem->remote().slice(0, 16));
  CHECK(unconnected.error() == fv::errc::not_connected);

  fv::queue_pair_options small;
  small.send_depth = 4;
  queue_pair shallow(*r.a, small);
  shallow.connect(r.b_qp->local_info());
  std::vector<block> five;
  for (int i = 0; i < 5; ++i) five.push_back({r.a_mem->slice(i * 8, 8), r.b_mem->remote().slice(i * 8, 8)});
  std::vector<transfer> out(5);
  shallow.write_batch(std::span<const block>(five), std::span<transfer>(out));
  for (const transfer& t : out) CHECK(t.error() == fv::errc::batch_exceeds_send_queue);
  std::vector<transfer> too_few(2);
  CHECK_THROWS_AS(shallow.write_batch(std::span<const block>(five), std::span<transfer>(too_few)),
                  std::invalid_argument);

  fv::queue_pair_options zero;
  zero.send_depth = 0;
  CHECK_THROWS_AS(queue_pair(*r.a, zero), std::invalid_argument);
  fv::queue_pair_options no_reads;
  no_reads.max_rd_atomic = 0;
  CHECK_THROWS_WITH(queue_pair(*r.a, no_reads), Catch::Contains("max_rd_atomic must be at least 1"));
  fv::queue_pair_options backwards;
  backwards.flush_timeout = -1ms;
  CHECK_THROWS_WITH(queue_pair(*r.a, backwards), Catch::Contains("flush_timeout must not be negative"));
  backwards = {};
  backwards.peer_check = -1ms;
  CHECK_THROWS_WITH(queue_pair(*r.a, backwards), Catch::Contains("peer_check must not be negative"));
  fv::queue_pair_options huge;
  huge.send_depth = 100000;
  CHECK_THROWS_AS(queue_pair(*r.a, huge), std::length_error);
  CHECK_THROWS_AS(device(*r.exec_a, fv::device_options{"ferry_no_such_device", 1, 0, 64}),
                  std::runtime_error);
  CHECK_THROWS_AS(region::allocate(*r.a, 0), std::invalid_argument);
  // A size that cannot be rounded up to whole pages is refused, not wrapped round to nothing.
  CHECK_THROWS_AS(region::allocate(*r.a, SIZE_MAX - 100), std::length_error);
}

namespace {

// Continues on the completing thread (the executor) and notes, at that moment, whether the region
// is still held.
ferry_test::inline_task note_in_use_at_end(transfer t, const region& held,
                                           std::atomic<int>& in_use_then) {
  (void)co_await t;
  in_use_then.store(held.in_use() ? 1 : 0, std::memory_order_release);
}

}  // namespace

TEST_CASE("verbs: closing a queue pair ends what it holds once the adapter has flushed it",
          "[verbs]") {
  rig r;
  region src = region::allocate(*r.a, 64);
  fabric::instance().inject_port_down(r.b->native_context());  // the WRITE waits in the adapter
  transfer t = r.a_qp->write(src.slice(0, 64), r.b_mem->remote().slice(0, 64));
  std::atomic<int> in_use_then{-1};
  note_in_use_at_end(t, src, in_use_then);
  REQUIRE(ferry_test::wait_until([&] { return r.a->counters().work_requests_posted >= 1; }));
  r.a_qp.reset();
  REQUIRE(t.wait_for(hang_bound) == transfer_state::failed);
  CHECK(t.error() == fv::errc::queue_pair_closed);
  REQUIRE(ferry_test::wait_until([&] { return in_use_then.load() != -1; }));
  CHECK(in_use_then.load() == 0);  // it ended with its flush, not before
  fabric::instance().inject_port_up(r.b->native_context());
}

TEST_CASE("verbs: closing a queue pair the adapter never flushes still ends what it holds",
          "[verbs]") {
  fv::queue_pair_options o;
  o.flush_timeout = 100ms;
  rig r(o);
  std::vector<transfer> in_flight;
  {
    paused_fabric pause;
    in_flight = post_writes(r, 32);
    REQUIRE(ferry_test::wait_until([&] { return r.a->counters().work_requests_posted >= 32; }));
    const auto start = ferry_test::clock_type::now();
    r.a_qp.reset();
    REQUIRE(all_end(in_flight, transfer_state::failed));
    CHECK(ferry_test::ms_since(start) >= 95);  // it waited for the flushes first
    for (const transfer& t : in_flight) CHECK(t.error() == fv::errc::queue_pair_closed);
    // Then it destroyed the closed queue pair, the one way left to take the requests back, and
    // ended them only after that: nothing holds the region.
    CHECK_FALSE(r.a_mem->in_use());
    CHECK(r.a->counters().flushes_overdue == 1);
  }
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

namespace {

// Two fake adapters with a region each, connected over the TCP side channel on loopback: `c` is the
// connecting side (exposing nothing), `accepted` the listening side (exposing its region).
struct side_channel_pair {
  explicit side_channel_pair(fv::queue_pair_options o = {}) {
    fv::side_channel_listener listener(0);
    std::thread server([&] {
      const fv::remote_region exposed[] = {b_mem.remote()};
      accepted.emplace(listener.accept(b, std::span<const fv::remote_region>(exposed), o));
    });
    c.emplace(fv::connect(a, "127.0.0.1", listener.port(), std::span<const fv::remote_region>(), o));
    server.join();
  }

  ferry::progress_executor exec;
  device a{exec, fv::device_options{fresh_device("hs_a"), 1, 0, 1024}};
  device b{exec, fv::device_options{fresh_device("hs_b"), 1, 0, 1024}};
  region a_mem = region::allocate(a, 1 << 16);
  region b_mem = region::allocate(b, 1 << 16);
  std::optional<fv::basic_connection<provider>> accepted;
  std::optional<fv::basic_connection<provider>> c;
};

}  // namespace

TEST_CASE("verbs: two queue pairs connect over the TCP side channel and exchange rkeys",
          "[verbs]") {
  side_channel_pair p;
  REQUIRE(p.accepted.has_value());
  REQUIRE(p.c->peer_regions.size() == 1);
  CHECK(p.accepted->peer_regions.empty());
  CHECK(p.c->peer_regions[0].rkey == p.b_mem.rkey());
  fill_pattern(p.a_mem.bytes().first(4096), 11);
  transfer t = p.c->qp.write(p.a_mem.slice(0, 4096), p.c->peer_regions[0].slice(512, 4096));
  REQUIRE(t.wait_for(hang_bound) == transfer_state::success);
  CHECK(has_pattern(p.b_mem.bytes().subspan(512, 4096), 11));
  std::uint64_t v = 0;
  transfer note = p.accepted->qp.receive_notification(v);
  REQUIRE(p.c->qp.send_notification(99).wait_for(hang_bound) == transfer_state::success);
  REQUIRE(note.wait_for(hang_bound) == transfer_state::success);
  CHECK(v == 99);
}

TEST_CASE("verbs: after the handshake, peer checks start before any traffic", "[verbs]") {
  // The handshake's last step tells each side that the other is connected; nothing else has come
  // back from the peer when the wait starts.
  fv::queue_pair_options o;
  o.peer_check = 5ms;
  side_channel_pair p(o);
  std::uint64_t v = 0;
  transfer note = p.c->qp.receive_notification(v);
  p.accepted.reset();
  REQUIRE(note.wait_for(hang_bound) == transfer_state::failed);
  CHECK(note.error() == fv::errc::peer_unreachable);
}

TEST_CASE("verbs: a side channel peer that is not speaking the handshake is refused", "[verbs]") {
  ferry::progress_executor exec;
  device a(exec, fv::device_options{fresh_device("hs_bad"), 1, 0, 1024});
  fv::side_channel_listener listener(0);
  std::thread impostor([&] {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in to{};
    to.sin_family = AF_INET;
    to.sin_port = htons(listener.port());
    to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof to) == 0) {
      const char junk[64] = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
      [[maybe_unused]] const ssize_t n = ::send(fd, junk, sizeof junk, MSG_NOSIGNAL);
      char sink[256];
      while (::recv(fd, sink, sizeof sink, 0) > 0) {
      }
    }
    ::close(fd);
  });
  try {
    (void)listener.accept(a, std::span<const fv::remote_region>(), {}, 5s);
    FAIL("the handshake accepted a peer that sent junk");
  } catch (const std::system_error& e) {
    CHECK(e.code() == fv::errc::handshake_failed);
    CHECK(std::string(e.what()).find("magic") != std::string::npos);
  }
  impostor.join();
  // Nobody connects: a clear timeout, not a hang.
  fv::side_channel_listener quiet(0);
  CHECK_THROWS_AS(quiet.accept(a, std::span<const fv::remote_region>(), {}, 50ms), std::system_error);
}

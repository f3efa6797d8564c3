// Regression tests for bugs an independent review found in the verbs backend (device.hpp), each of
// which failed before its fix, and two stress runs of teardown and of continuations resumed inline
// on the executor thread.

#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <ferry/ferry.hpp>
#include <ferry/verbs/device.hpp>
#include <ferry/verbs/fake.hpp>

#include "helpers.hpp"
#include "verbs/verbs_helpers.hpp"

namespace {

using namespace std::chrono_literals;
using namespace ferry_test::verbs;
// Queue pairs deep enough for a `members`-long batch, and one 8-byte WRITE block per member.
struct batch_rig {
  batch_rig(std::size_t members, int cq_entries) : r(options(members, cq_entries)) {
    blocks.reserve(members);
    for (std::size_t i = 0; i < members; ++i) {
      blocks.push_back({r.a_mem->slice(i * 8, 8), r.b_mem->remote().slice(i * 8, 8)});
    }
  }
  static rig_options options(std::size_t members, int cq_entries) {
    fv::queue_pair_options o;
    o.send_depth = static_cast<std::uint32_t>(members);
    o.receive_depth = 1;
    rig_options ro = rig::with(o, members * 8);
    ro.cq_entries = cq_entries;
    return ro;
  }
  rig r;
  std::vector<block> blocks;
};

// Awaits `first` resuming inline (on the executor thread, from inside the device's poll), then
// submits a second WRITE from there.
ferry_test::detached_inline write_again_inline(ferry::progress_executor& exec, queue_pair& qp,
                                               region& src, region& dst, transfer first,
                                               transfer& second, std::atomic<bool>& on_executor,
                                               double& waited_ms, std::atomic<bool>& done) {
  ferry::inline_scheduler here;
  (void)co_await ferry::resume_on(here, first);
  on_executor = exec.on_executor_thread();
  const auto start = ferry_test::clock_type::now();
  second = qp.write(src.slice(64, 64), dst.remote().slice(64, 64));
  waited_ms = ferry_test::ms_since(start);
  done = true;
}

// Awaits `t` resuming inline and then holds the executor thread (inside the device's poll) until
// `stage` becomes 2.
ferry_test::detached_inline hold_executor(transfer t, std::atomic<int>& stage) {
  ferry::inline_scheduler here;
  (void)co_await ferry::resume_on(here, t);
  stage = 1;
  while (stage.load() != 2) std::this_thread::yield();
  stage = 3;
}

}  // namespace

// Was: IBV_EVENT_CQ_ERR sets cq_failed_ (reap() never polls again) and breaks only the queue pairs
// the executor knows at that moment. A queue pair created afterwards starts with broken == 0, so
// its requests are accepted and posted, and nothing can ever complete them: pending forever.
TEST_CASE("verbs: a queue pair created after a CQ error fails its transfers instead of holding them",
          "[verbs]") {
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

// Was: on a success completion, on_completion() completes the unit's transfers (succeed_unit) before
// release_unit() hands its send-queue slots back. A continuation resumed inline there that submits
// again finds the slots still taken: write() backs off on the executor thread itself (so nothing can
// free a slot) for the whole admission timeout and then fails with submission_queue_full. The same
// order (complete, then release) is in route()'s refusal and drain_expired().
TEST_CASE("verbs: a continuation resumed inline reuses at once the slot of the transfer it awaited",
          "[verbs]") {
  fv::queue_pair_options o;
  o.send_depth = 1;
  o.admission_timeout = 300ms;
  rig r(o);
  transfer second;
  std::atomic<bool> on_executor{false};
  std::atomic<bool> done{false};
  double waited_ms = -1;
  {
    paused_fabric pause;  // so that the coroutine suspends before the first write completes
    transfer first = r.a_qp->write(r.a_mem->slice(0, 64), r.b_mem->remote().slice(0, 64));
    write_again_inline(*r.exec_a, *r.a_qp, *r.a_mem, *r.b_mem, first, second, on_executor,
                       waited_ms, done);
  }
  REQUIRE(ferry_test::wait_until([&] { return done.load(); }));
  CHECK(on_executor);
  INFO("the second write waited " << waited_ms << " ms on the executor thread");
  CHECK(waited_ms < 300);  // the admission timeout, which the bug waited out
  CHECK(second.wait_for(hang_bound) == transfer_state::success);
  CHECK(second.error() != ferry::errc::submission_queue_full);
}

// Was: a closing queue pair is destroyed by maybe_destroy(), which on_completion() and on_receive()'s
// error path call. If the last completion it waits for is a *successful* receive (a notification
// that landed before the close was handled, not yet reaped), on_receive() files it in `arrived` and
// returns without calling maybe_destroy(): the queue pair, its receive buffers' registration and its
// completion-queue room stay until the device is destroyed.
TEST_CASE("verbs: a closed queue pair whose last completion is a successful receive is destroyed",
          "[verbs]") {
  fv::queue_pair_options o;
  o.receive_depth = 1;
  rig_options ro = rig::with(o, std::size_t{1} << 16);
  ro.cq_entries = 1024;
  ro.two_executors = true;
  rig r(ro);
  std::atomic<int> stage{0};
  {
    paused_fabric pause;  // the coroutine suspends before the write completes
    transfer w = r.b_qp->write(r.b_mem->slice(0, 64), r.a_mem->remote().slice(0, 64));
    hold_executor(w, stage);
  }
  // b's executor is now held inside b's poll(); a's executor runs freely.
  REQUIRE(ferry_test::wait_until([&] { return stage.load() == 1; }));
  REQUIRE(r.a_qp->send_notification(7).wait_for(hang_bound) == transfer_state::success);
  // b's only receive has completed; the completion waits in b's CQ, unreaped.
  const std::size_t before = fabric::instance().live_objects();
  r.b_qp.reset();  // publishes the close op
  stage = 2;       // b's executor goes on: routes the close, then reaps the receive
  REQUIRE(ferry_test::wait_until([&] { return stage.load() == 3; }));
  // The queue pair and its receive buffers' registration go (two fake objects).
  CHECK(ferry_test::wait_until([&] { return fabric::instance().live_objects() == before - 2; },
                               2000ms));
}

// Was: a unit cut by post_send part-way (bad_wr in the middle of the chain) is listed as posted by
// its lead, but its signalled last member is still pending. (a) With ENOMEM the executor waits for
// "completions in flight" to free room, but the only thing in flight may be this unit's unsignalled
// head: no completion ever comes and the batch stays pending forever. (b) abandon_pending() (close,
// fatal event, error completion, post failure) drops the unit's unposted tail with `continue`, so the
// unit's last member is never posted and release_unit() is never called: its region stays
// referenced and the closed queue pair is never destroyed (until the device is).
//
// The fake grants at most 32768 send slots and clamps a larger request; the device took its credits
// from what it asked for, not from what create_qp granted, so a batch of 33000 was cut. (A cut is
// still handled, for a provider that refuses part of a chain: see abandon_pending.)
TEST_CASE("verbs: a batch larger than the send queue the device granted is refused whole",
          "[verbs]") {
  constexpr std::size_t members = 33000;
  batch_rig br(members, 70000);
  rig& r = br.r;
  const std::vector<block>& blocks = br.blocks;
  std::vector<transfer> out(members);
  r.a_qp->write_batch(std::span<const block>(blocks), std::span<transfer>(out));
  // Credits come from what the device granted (the fake grants at most 32768), so the batch can
  // never be cut by post_send: it is refused whole, at once.
  CHECK(out.back().wait_for(hang_bound) == transfer_state::failed);
  CHECK(out.front().error() == fv::errc::batch_exceeds_send_queue);
  CHECK(r.a->counters().work_requests_posted == 0);
  r.a_qp.reset();
  CHECK(ferry_test::wait_until([&] { return !r.a_mem->in_use(); }));
}

// Was (liveness): every completion of a failed unit calls fail_unit(lead), which walks the whole
// unit, so flushing a batch of k members costs k^2 status look-ups on the executor thread (the same
// holds for break_queue_pair()'s and fail_everything()'s walks of the pending queue). Measured at
// -O2: 4096 members 0.15 s, 16384 members 3.4 s, 32768 (mlx5's usual max_qp_wr) 15 s, during which
// the executor completes nothing else.
TEST_CASE("verbs: flushing a large failed batch costs linear time", "[verbs]") {
  constexpr std::size_t members = 16384;
  batch_rig br(members, 40000);
  rig& r = br.r;
  const std::vector<block>& blocks = br.blocks;
  std::vector<transfer> out(members);
  double ms = 0;
  {
    paused_fabric pause;
    r.a_qp->write_batch(std::span<const block>(blocks), std::span<transfer>(out));
    REQUIRE(ferry_test::wait_until([&] { return r.a->counters().work_requests_posted >= members; }));
    r.a_qp.reset();  // every member fails now; the flush (16384 completions) comes on resume
    REQUIRE(out.back().wait_for(hang_bound) == transfer_state::failed);
    const auto start = ferry_test::clock_type::now();
    pause.resume();
    REQUIRE(ferry_test::wait_until([&] { return !r.a_mem->in_use(); }, std::chrono::seconds(60)));
    ms = ferry_test::ms_since(start);
  }
  INFO("16384 flush completions took " << ms << " ms to handle");
  // Linear: tens of ms; it took seconds when each flush walked the whole batch. Room for a loaded
  // machine and the sanitizer builds.
  CHECK(ms < 3000);
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

TEST_CASE("verbs: stress: the device is destroyed while deadlines fire", "[verbs][concurrency]") {
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
          "[verbs][concurrency]") {
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
          "round", "[verbs]") {
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
          "down", "[verbs]") {
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
    late = r.a_qp->write(r.a_mem->slice(128, 64), r.b_mem->remote().slice(128, 64), 150ms);
    REQUIRE(ferry_test::wait_until([&] { return r.a->counters().work_requests_posted >= 3; }));
    hold_executor(first, stage);
  }
  REQUIRE(ferry_test::wait_until([&] { return stage.load() == 1; }));
  std::this_thread::sleep_for(250ms);  // the deadline passes while the success waits in the CQ
  stage = 2;
  REQUIRE(late.wait_for(hang_bound) == transfer_state::success);
  REQUIRE(second.wait_for(hang_bound) == transfer_state::success);
  std::this_thread::sleep_for(20ms);
  CHECK_FALSE(r.a_qp->error());
  CHECK(r.a_qp->write(r.a_mem->slice(0, 8), r.b_mem->remote().slice(0, 8)).wait_for(hang_bound) ==
        transfer_state::success);
}

TEST_CASE("verbs: a request whose deadline passed keeps that reason when the device goes",
          "[verbs]") {
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

namespace {

// The fake adapter, except that while `refuse_naming_none` is set, post_send fails with EINVAL and
// a bad_wr that names no request of the chain, having taken the whole chain (`takes_chain`) or
// none of it.
std::atomic<bool> refuse_naming_none{false};
std::atomic<bool> takes_chain{false};

struct vague_provider : fv::fake::provider {
  static int post_send(qp_handle qp, ibv_send_wr* wr, ibv_send_wr** bad) noexcept {
    if (!refuse_naming_none.load()) return fv::fake::provider::post_send(qp, wr, bad);
    if (takes_chain.load()) (void)fv::fake::provider::post_send(qp, wr, bad);
    *bad = nullptr;
    return EINVAL;
  }
};

}  // namespace

TEST_CASE("verbs: a post refused without naming a request never leaves a transfer pending",
          "[verbs]") {
  for (const bool taken : {false, true}) {
    INFO("the adapter took the chain: " << taken);
    using vdevice = fv::basic_device<vague_provider>;
    using vregion = fv::basic_memory_region<vague_provider>;
    using vqp = fv::basic_queue_pair<vague_provider>;
    ferry::progress_executor exec;
    vdevice a(exec, fv::device_options{fresh_device("vague_a"), 1, 0, 4096});
    vdevice b(exec, fv::device_options{fresh_device("vague_b"), 1, 0, 4096});
    std::vector<transfer> ts;
    {
      vregion a_mem = vregion::allocate(a, 1 << 16);
      vregion b_mem = vregion::allocate(b, 1 << 16);
      fv::queue_pair_options o;
      o.flush_timeout = 100ms;
      vqp a_qp(a, o);
      vqp b_qp(b, o);
      a_qp.connect(b_qp.local_info());
      b_qp.connect(a_qp.local_info());
      takes_chain = taken;
      refuse_naming_none = true;
      for (std::size_t i = 0; i < 8; ++i) {
        ts.push_back(a_qp.write(a_mem.slice(i * 64, 64), b_mem.remote().slice(i * 64, 64)));
      }
      for (const transfer& t : ts) REQUIRE(t.wait_for(hang_bound) != transfer_state::pending);
      refuse_naming_none = false;
      // The queue pair went down: nothing is accepted after such a refusal.
      CHECK(a_qp.write(a_mem.slice(0, 8), b_mem.remote().slice(0, 8)).wait_for(hang_bound) ==
            transfer_state::failed);
    }
  }
}

namespace {

// The fake adapter, except that a post can be cut: with `cut_after` at n, the next post_send takes
// the first n requests of its chain and refuses the rest with ENOMEM (bad_wr naming the first one
// refused), as an adapter whose send queue filled part-way does; `refuse_posts` then refuses that
// many whole posts the same way.
std::atomic<int> cut_after{-1};
std::atomic<int> refuse_posts{0};

struct cutting_provider : fv::fake::provider {
  static int post_send(qp_handle qp, ibv_send_wr* wr, ibv_send_wr** bad) noexcept {
    if (const int n = cut_after.exchange(-1); n >= 0) {
      ibv_send_wr* last = nullptr;
      ibv_send_wr* rest = wr;
      for (int i = 0; i < n && rest != nullptr; ++i) {
        last = rest;
        rest = rest->next;
      }
      if (rest == nullptr) return fv::fake::provider::post_send(qp, wr, bad);
      if (last != nullptr) {
        last->next = nullptr;
        const int r = fv::fake::provider::post_send(qp, wr, bad);
        last->next = rest;
        if (r != 0) return r;
      }
      *bad = rest;
      return ENOMEM;
    }
    if (refuse_posts.load() > 0) {
      refuse_posts.fetch_sub(1);
      *bad = wr;
      return ENOMEM;
    }
    return fv::fake::provider::post_send(qp, wr, bad);
  }
};

// Two fake adapters behind cutting_provider, with a region each and a connected queue pair.
struct cut_rig {
  using cdevice = fv::basic_device<cutting_provider>;
  using cregion = fv::basic_memory_region<cutting_provider>;
  using cqp = fv::basic_queue_pair<cutting_provider>;
  using cblock = fv::basic_rdma_block<cutting_provider>;

  explicit cut_rig(fv::queue_pair_options o)
      : a_qp(std::make_unique<cqp>(a, o)), b_qp(std::make_unique<cqp>(b, o)) {
    a_qp->connect(b_qp->local_info());
    b_qp->connect(a_qp->local_info());
    fill_pattern(a_mem.bytes(), 11);
  }
  ~cut_rig() {
    cut_after = -1;
    refuse_posts = 0;
  }

  // A batch of `n` 64-byte WRITEs, block i at offset 64 (first + i) on both sides: one unit, only
  // its last request signalled.
  std::vector<transfer> batch(std::size_t first, std::size_t n) {
    std::vector<cblock> blocks;
    for (std::size_t i = first; i < first + n; ++i) {
      blocks.push_back({a_mem.slice(i * 64, 64), b_mem.remote().slice(i * 64, 64)});
    }
    std::vector<transfer> out(n);
    a_qp->write_batch(std::span<const cblock>(blocks), std::span<transfer>(out));
    return out;
  }

  [[nodiscard]] bool landed(std::size_t first, std::size_t n) const {
    const auto at = static_cast<std::ptrdiff_t>(first * 64);
    const auto len = static_cast<std::ptrdiff_t>(n * 64);
    return std::equal(a_mem.bytes().begin() + at, a_mem.bytes().begin() + at + len,
                      b_mem.bytes().begin() + at);
  }

  ferry::progress_executor exec;
  cdevice a{exec, fv::device_options{fresh_device("cut_a"), 1, 0, 4096}};
  cdevice b{exec, fv::device_options{fresh_device("cut_b"), 1, 0, 4096}};
  cregion a_mem = cregion::allocate(a, 1 << 16);
  cregion b_mem = cregion::allocate(b, 1 << 16);
  std::unique_ptr<cqp> a_qp;
  std::unique_ptr<cqp> b_qp;
};

bool all_in(const std::vector<transfer>& ts, transfer_state want) {
  return std::all_of(ts.begin(), ts.end(),
                     [want](const transfer& t) { return t.wait_for(hang_bound) == want; });
}

}  // namespace

TEST_CASE("verbs: a batch cut part-way by the adapter, with a completion coming, is finished later",
          "[verbs]") {
  cut_rig r({});
  paused_fabric pause;  // the first WRITE stays in the adapter: its completion is coming
  std::vector<transfer> first = r.batch(0, 1);
  REQUIRE(ferry_test::wait_until([&] { return r.a.counters().work_requests_posted >= 1; }));
  cut_after = 2;
  std::vector<transfer> cut = r.batch(1, 4);
  REQUIRE(ferry_test::wait_until([&] { return cut_after.load() == -1; }));
  pause.resume();
  REQUIRE(all_in(first, transfer_state::success));
  REQUIRE(all_in(cut, transfer_state::success));
  CHECK(r.landed(0, 5));
  CHECK_FALSE(r.a_qp->error());
}

TEST_CASE("verbs: a batch cut part-way with no completion coming ends on its flush, not before",
          "[verbs]") {
  fv::queue_pair_options o;
  o.flush_timeout = 10s;  // the flush, not the guard, must end it
  cut_rig r(o);
  cut_after = 2;  // the first two go out, the last two are refused
  std::vector<transfer> cut = r.batch(0, 4);
  REQUIRE(all_in(cut, transfer_state::failed));
  // The queue pair went down; the refused tail was handed to it to flush, and that flush ended the
  // unit: nothing holds the region any more, with the queue pair still open.
  REQUIRE(ferry_test::wait_until([&] { return !r.a_mem.in_use(); }));
  CHECK(r.a_qp->error());
  CHECK(r.a.counters().flushes_overdue == 0);
}

TEST_CASE("verbs: a batch cut part-way whose tail cannot be handed over ends when its queue pair goes",
          "[verbs]") {
  fv::queue_pair_options o;
  o.flush_timeout = 20ms;
  cut_rig r(o);
  cut_after = 2;
  refuse_posts = 1;  // and the tail's post into the broken queue pair is refused too
  std::vector<transfer> cut = r.batch(0, 4);
  REQUIRE(all_in(cut, transfer_state::failed));  // the head's flushes fail it, but the flush
  std::this_thread::sleep_for(60ms);              // that would end it never comes, past the
  CHECK(r.a_mem.in_use());                        // flush timeout too: the region stays
  r.a_qp.reset();  // destroying the queue pair is what takes everything back
  CHECK(ferry_test::wait_until([&] { return !r.a_mem.in_use(); }));
}

TEST_CASE("verbs: a peer check never takes a request's send-queue credit", "[verbs]") {
  // With one slot and checks every 20 us between requests, a check that took the requests' credit
  // made try_write return nullopt on an idle queue pair (and an inline continuation's request fail
  // with submission_queue_full).
  fv::queue_pair_options o;
  o.send_depth = 1;
  o.peer_check = 20us;
  rig r(o);
  std::uint64_t v = 0;
  transfer waiting = r.a_qp->receive_notification(v);
  int refused = 0;
  for (int i = 0; i < 5000 && refused == 0; ++i) {
    std::optional<transfer> t =
        r.a_qp->try_write(r.a_mem->slice(0, 8), r.b_mem->remote().slice(0, 8));
    if (!t) {
      ++refused;
      break;
    }
    REQUIRE(t->wait_for(hang_bound) == transfer_state::success);
    CHECK(r.a_qp->send_credits() == 1);
  }
  CHECK(refused == 0);
  CHECK(r.a->counters().peer_checks > 0);
  REQUIRE(r.b_qp->send_notification(1).wait_for(hang_bound) == transfer_state::success);
  REQUIRE(waiting.wait_for(hang_bound) == transfer_state::success);
}

TEST_CASE("verbs: a request that finds a peer check filling the send queue goes out after it",
          "[verbs]") {
  fv::queue_pair_options o;
  o.send_depth = 1;
  o.peer_check = 1ms;
  rig r(o);
  r.b_qp->mark_peer_connected();
  std::uint64_t v = 0;
  transfer waiting = r.b_qp->receive_notification(v);
  paused_fabric pause;  // the adapter holds the check: the one-slot send queue is full
  REQUIRE(ferry_test::wait_until([&] { return r.b->counters().peer_checks >= 1; }));
  fill_pattern(r.b_mem->bytes().first(64), 5);
  transfer w = r.b_qp->write(r.b_mem->slice(0, 64), r.a_mem->remote().slice(0, 64));
  REQUIRE(ferry_test::wait_until([&] { return r.b->counters().post_calls >= 2; }));  // refused
  CHECK(w.state() == transfer_state::pending);
  pause.resume();
  REQUIRE(w.wait_for(hang_bound) == transfer_state::success);
  CHECK(has_pattern(r.a_mem->bytes().first(64), 5));
  CHECK_FALSE(r.b_qp->error());
  REQUIRE(r.a_qp->send_notification(3).wait_for(hang_bound) == transfer_state::success);
  REQUIRE(waiting.wait_for(hang_bound) == transfer_state::success);
}

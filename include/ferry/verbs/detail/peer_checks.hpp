#pragma once
// Peer checks (queue_pair_options::peer_check): while a notification wait is queued, the timer
// runs; when it fires with nothing else in flight, a zero-length RDMA WRITE goes out, whose
// failure breaks the queue pair with errc::peer_unreachable (reaping.hpp, on_completion). RC tells
// of a peer that has gone only when something is sent to it. The executor thread only.

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>

#include <infiniband/verbs.h>

#include "ferry/detail/status_block.hpp"
#include "ferry/transfer.hpp"
#include "ferry/verbs/detail/deadlines.hpp"
#include "ferry/verbs/detail/op.hpp"
#include "ferry/verbs/detail/queue_pair_state.hpp"

namespace ferry::verbs::detail {

// Peer checks: a part of basic_device<P> (device.hpp), which derives from it privately; it
// reaches the device and the other parts through self().
template <class P>
struct peer_checks {
  using op_body = verbs::detail::op_body<P>;
  using op = verbs::detail::op<P>;
  using qp_state = verbs::detail::qp_state<P>;
  using qp_timer = verbs::detail::qp_timer<P>;

  [[nodiscard]] basic_device<P>& self() noexcept { return static_cast<basic_device<P>&>(*this); }
  [[nodiscard]] const basic_device<P>& self() const noexcept {
    return static_cast<const basic_device<P>&>(*this);
  }

  void arm_peer_check(qp_state* q) noexcept {
    if (q->peer_check == std::chrono::nanoseconds::zero() || self().shutting_down_ ||
        q->lifecycle.in_error() || q->check.armed || q->check.fired) {
      return;
    }
    // Out of memory: no check, and a wait without a deadline relies on its peer as before.
    (void)self().arm_timer(q->check, q->peer_check,
                           &deadlines<P>::template list_fired<&deadlines<P>::checks_due_>);
  }

  std::size_t check_peers() noexcept {
    std::size_t n = 0;
    while (qp_timer* c = self().take_fired(self().checks_due_)) {
      qp_state* q = c->qp;
      ++n;
      if (q->lifecycle.in_error() || q->waiters.empty()) continue;  // armed again by the next wait
      // Anything else in flight tells of a peer that has gone as well as a check would.
      // A check towards a peer not yet connected would fail and take the queue pair down.
      if (q->lifecycle.connected() && q->peer_up.load(std::memory_order_relaxed) &&
          q->posted_head == nullptr && q->pending.empty()) {
        post_peer_check(q);
      }
      arm_peer_check(q);
    }
    return n;
  }

  void post_peer_check(qp_state* q) noexcept {
    // It takes no credit: the send queue is empty now, and a request posted while the check is out
    // and the queue is full is refused for now (ENOMEM) and posted again once the check completes.
    op_body* o = nullptr;
    try {
      o = op::make(op_kind::peer_check);
      o->status = ferry::detail::status_block::make();
    } catch (...) {
      if (o != nullptr) op::free(o);
      return;
    }
    // Nobody waits for it: its handle goes at once, and end_unit releases the completer's
    // reference.
    { const transfer unwatched(ferry::detail::adopt, o->status); }
    o->qp = q;
    o->wr.wr_id = reinterpret_cast<std::uintptr_t>(o);
    o->wr.opcode = IBV_WR_RDMA_WRITE;  // zero length: no scatter/gather entry, no rkey checked
    o->wr.send_flags = IBV_SEND_SIGNALED;
    self().queue_unit(q, o);
    peer_checks_.fetch_add(1, std::memory_order_relaxed);
  }

  std::atomic<std::uint64_t> peer_checks_{0};
};

}  // namespace ferry::verbs::detail

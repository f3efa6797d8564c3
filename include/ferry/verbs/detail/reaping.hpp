#pragma once
// Reaping: the executor polls the completion queue in batches and ends what each completion names.
// A send's completion ends its unit (only a unit's last member is signalled, and RC completes in
// order); a failed one fails the unit and breaks its queue pair. A receive's delivers a
// notification to the first wait, or keeps it until one comes. Ending a unit gives its send-queue
// slots back first, then releases its regions and completes its members. The executor thread
// only.

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <system_error>

#include <infiniband/verbs.h>

#include "ferry/detail/status_block.hpp"
#include "ferry/transfer.hpp"
#include "ferry/verbs/detail/op.hpp"
#include "ferry/verbs/detail/queue_pair_state.hpp"
#include "ferry/verbs/errors.hpp"

namespace ferry::verbs::detail {

// Completion handling: a part of basic_device<P> (device.hpp), which derives from it privately; it
// reaches the device and the other parts through self().
template <class P>
struct reaping {
  using op_body = verbs::detail::op_body<P>;
  using op = verbs::detail::op<P>;
  using qp_state = verbs::detail::qp_state<P>;
  using receive_slot = verbs::detail::receive_slot<P>;
  using region_state = verbs::detail::region_state<P>;

  [[nodiscard]] basic_device<P>& self() noexcept { return static_cast<basic_device<P>&>(*this); }
  [[nodiscard]] const basic_device<P>& self() const noexcept {
    return static_cast<const basic_device<P>&>(*this);
  }

  std::size_t reap(std::size_t budget) noexcept {
    if (self().cq_failed_) return 0;
    constexpr int batch = 32;
    ibv_wc wc[batch];
    std::size_t handled = 0;
    while (handled < budget) {
      const int want = static_cast<int>(std::min<std::size_t>(batch, budget - handled));
      const int n = P::poll_cq(self().cq_, want, wc);
      if (n < 0) {
        self().fail_device(errc::completion_queue_error);
        break;
      }
      // Counted before any of them completes, so a caller that sees its transfer end (complete()
      // publishes with release) reads a count that includes it.
      if (n > 0) completions_.fetch_add(static_cast<std::uint64_t>(n), std::memory_order_relaxed);
      for (int i = 0; i < n; ++i) on_completion(wc[i]);
      // Closing queue pairs that may now go are destroyed only after the whole batch: a later
      // entry of it may still name one of them.
      while (qp_state* q = doomed_) {
        doomed_ = q->doomed_next;
        q->doomed = false;
        self().maybe_destroy(q);
      }
      handled += static_cast<std::size_t>(n);
      if (n < want) break;
    }
    return handled;
  }

  void on_completion(const ibv_wc& wc) noexcept {
    if ((wc.wr_id & 1) != 0) {
      return on_receive(reinterpret_cast<receive_slot*>(wc.wr_id & ~std::uint64_t{1}), wc);
    }
    op_body* o = reinterpret_cast<op_body*>(wc.wr_id);
    op_body* lead = o->lead;
    qp_state* q = lead->qp;
    if (wc.status == IBV_WC_SUCCESS) {
      note_peer_up(q);
      // Only a unit's last member is signalled, and RC completes in order: every member landed.
      end_unit(lead, transfer_state::success, {});
    } else {
      const std::error_code ec = failure_of(lead, wc);
      // The adapter's retries ran out: the peer did not answer (a check, or any request).
      const bool peer_gone = wc.status == IBV_WC_RETRY_EXC_ERR;
      if (o == lead->last) {
        end_unit(lead, transfer_state::failed, ec);
      } else {
        fail_unit(lead, ec);  // the flushes of the rest follow; the last one ends the unit
      }
      // The queue pair is in the error state now: nothing queued behind can succeed.
      if (!q->lifecycle.in_error()) {
        self().break_queue_pair(q, peer_gone ? errc::peer_unreachable : errc::queue_pair_error,
                                false);
      }
    }
    if (q->lifecycle.closing()) doom(q);
  }

  // What a failed completion of `lead`'s unit reports: a flush of a queue pair ferry broke reports
  // why it broke it (its own deadline, for the request whose deadline passed); anything else, the
  // adapter's status.
  static std::error_code failure_of(const op_body* lead, const ibv_wc& wc) noexcept {
    if (wc.status == IBV_WC_WR_FLUSH_ERR) {
      if (lead->expired) return make_error_code(errc::deadline_exceeded);
      const int b = lead->qp->broken.load(std::memory_order_relaxed);
      if (b != 0 && b != static_cast<int>(errc::queue_pair_error)) return lead->qp->broken_error(b);
    }
    return make_error_code(static_cast<ibv_wc_status>(wc.status));
  }

  static void note_peer_up(qp_state* q) noexcept {
    if (!q->peer_up.load(std::memory_order_relaxed)) {
      q->peer_up.store(true, std::memory_order_relaxed);
    }
  }

  void doom(qp_state* q) noexcept {
    if (q->doomed) return;
    q->doomed = true;
    q->doomed_next = doomed_;
    doomed_ = q;
  }

  void on_receive(receive_slot* slot, const ibv_wc& wc) noexcept {
    qp_state* q = slot->qp;
    --q->receives_posted;
    if (q->lifecycle.closing()) return doom(q);  // nobody can take it any more
    if (wc.status != IBV_WC_SUCCESS) {
      if (!q->lifecycle.in_error()) self().break_queue_pair(q, errc::queue_pair_error, false);
      return;
    }
    note_peer_up(q);
    if (wc.byte_len != sizeof slot->value) {
      // Not a ferry notification: fail whoever waits for one, and keep the receive going.
      if (op_body* w = q->waiters.pop()) {
        self().cancel_timer(w);
        end_wait(w, transfer_state::failed, make_error_code(errc::bad_notification));
      }
      repost(q, slot);
      return;
    }
    if (op_body* w = q->waiters.pop()) {
      self().cancel_timer(w);
      return deliver(q, w, slot);
    }
    q->arrived[(q->arrived_at++)] = slot;
  }

  receive_slot* take_arrived(qp_state* q) noexcept {
    receive_slot* first = q->arrived[0];
    std::move(q->arrived.begin() + 1,
              q->arrived.begin() + static_cast<std::ptrdiff_t>(q->arrived_at), q->arrived.begin());
    --q->arrived_at;
    return first;
  }

  void deliver(qp_state* q, op_body* w, receive_slot* slot) noexcept {
    *w->value_out = slot->value;
    end_wait(w, transfer_state::success, {});
    repost(q, slot);
  }

  void repost(qp_state* q, receive_slot* slot) noexcept {
    if (q->lifecycle.in_error()) return;
    ibv_recv_wr* bad = nullptr;
    if (P::post_recv(q->qp, &slot->wr, &bad) == 0) {
      ++q->receives_posted;
    } else {
      self().break_queue_pair(q, errc::queue_pair_error);
    }
  }

  void end_wait(op_body* w, transfer_state to, std::error_code ec) noexcept {
    ferry::detail::status_block* s = w->status;
    op::free(w);
    s->complete(to, ec);
    s->release_completer_ref();
  }

  // Fails every member still pending; a member already ended keeps its result. Once per unit: a
  // failed batch of k members gets up to k flush completions, each of which lands here.
  void fail_unit(op_body* lead, std::error_code ec) noexcept {
    if (lead->failed) return;
    lead->failed = true;
    for (op_body* m = lead; m != nullptr; m = m->unit_next) {
      m->status->complete(transfer_state::failed, ec);
    }
  }

  // The adapter is done with the unit (or never had it). Its slots go back first, then its members
  // end (`to`, unless already ended): a continuation resumed inline by that may post again at once.
  void end_unit(op_body* lead, transfer_state to, std::error_code ec) noexcept {
    qp_state* q = lead->qp;
    self().cancel_timer(lead);
    self().unlist_posted(q, lead);
    if (q->posted_head == nullptr) self().disarm_flush_guard(q);
    if (lead->kind != op_kind::peer_check) {
      q->credits.fetch_add(lead->unit_size, std::memory_order_release);
    }
    const std::uint64_t published = lead->published_ns;
    for (op_body* m = lead; m != nullptr;) {
      op_body* next = m->unit_next;
      ferry::detail::status_block* s = m->status;
      // op_kind's write and read are the meter's kinds 0 and 1; the rest were never stamped.
      if (m->kind == op_kind::write || m->kind == op_kind::read) {
        self().meter_.record_cached(static_cast<std::size_t>(m->kind), published, m->sge.length,
                                    to == transfer_state::success && s->state() != transfer_state::failed,
                                    q->peer_metrics[static_cast<std::size_t>(m->kind)], q->peer);
      }
      region_state* r = m->region;
      op::free(m);
      // The adapter is done with the memory: the region goes first, so that a continuation resumed
      // by the completion already sees it free (in_use() false).
      if (r != nullptr) r->release();
      s->complete(to, ec);
      s->release_completer_ref();
      m = next;
    }
  }

  // The executor's.
  qp_state* doomed_ = nullptr;  // closing queue pairs to look at after a completion batch
  std::atomic<std::uint64_t> completions_{0};
};

}  // namespace ferry::verbs::detail

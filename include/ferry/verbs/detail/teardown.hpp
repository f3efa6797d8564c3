#pragma once
// How queue pairs and the device stop: a queue pair broken (an error completion, a fatal event, a
// deadline, closing) fails what it holds and goes to the error state so the adapter flushes what it
// was given; a closed one is destroyed once the adapter has handed everything back; a CQ error or
// a fatal device event fails everything at once. Asynchronous events (async_event_watcher.hpp) are
// handled here. The executor thread only (or the destructor, once the source is removed).

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <system_error>
#include <vector>

#include <infiniband/verbs.h>

#include "ferry/transfer.hpp"
#include "ferry/verbs/detail/op.hpp"
#include "ferry/verbs/detail/queue_pair_state.hpp"
#include "ferry/verbs/errors.hpp"

namespace ferry::verbs::detail {

// Breaking, closing and destroying queue pairs: a part of basic_device<P> (device.hpp), which
// derives from it privately; it reaches the device and the other parts through self().
template <class P>
struct teardown {
  using op_body = verbs::detail::op_body<P>;
  using op = verbs::detail::op<P>;
  using qp_state = verbs::detail::qp_state<P>;
  using async_event = typename P::async_event;

  [[nodiscard]] basic_device<P>& self() noexcept { return static_cast<basic_device<P>&>(*this); }
  [[nodiscard]] const basic_device<P>& self() const noexcept {
    return static_cast<const basic_device<P>&>(*this);
  }

  // The queue pair can no longer succeed: fail everything it holds with `why` and move it to the
  // error state, so the adapter flushes what it was given (`move` false: it is already there).
  void break_queue_pair(qp_state* q, errc why, bool move = true) noexcept {
    int none = 0;
    q->broken.compare_exchange_strong(none, static_cast<int>(why), std::memory_order_release,
                                      std::memory_order_relaxed);
    const std::error_code ec = q->broken_error(q->broken.load(std::memory_order_relaxed));
    // created or connected -> broken; already broken or closing, it stays so. The reason was
    // stored first, so that a submitter that sees the new state finds it.
    if (q->lifecycle.break_off() && move) {
      ibv_qp_attr attr{};
      attr.qp_state = IBV_QPS_ERR;
      P::modify_qp(q->qp, attr, IBV_QP_STATE);
    }
    self().abandon_pending(q, ec);
    // What is posted ends with its flush, once the adapter has let go of its memory; the guard
    // bounds the wait for an adapter that never flushes.
    self().arm_flush_guard(q);
    while (op_body* w = q->waiters.pop()) {
      self().cancel_timer(w);
      self().end_wait(w, transfer_state::failed, ec);
    }
  }

  void close_now(qp_state* q) noexcept {
    break_queue_pair(q, errc::queue_pair_closed);
    // broken -> closing: its handle is gone, so nothing races this. A queue pair left anywhere else
    // would never be destroyed: that is a bug in ferry, reported rather than left to leak.
    if (!q->lifecycle.close()) {
      std::fprintf(stderr, "ferry: verbs queue pair closed from a state other than broken\n");
      std::abort();
    }
    maybe_destroy(q);
  }

  // A closing queue pair goes once the adapter has handed back everything it was given (an orphaned
  // unit will never be: destroying the queue pair is what ends it).
  void maybe_destroy(qp_state* q) noexcept {
    if (q->receives_posted != 0 || self().shutting_down_) return;
    for (const op_body* l = q->posted_head; l != nullptr; l = l->list_next) {
      if (!l->orphaned) return;
    }
    unlist_and_destroy(q);
  }

  void unlist_and_destroy(qp_state* q,
                          std::error_code ec = make_error_code(errc::queue_pair_closed)) noexcept {
    (q->all_prev == nullptr ? self().qps_ : q->all_prev->all_next) = q->all_next;
    if (q->all_next != nullptr) q->all_next->all_prev = q->all_prev;
    destroy_qp(q, ec);
  }

  // Destroys the queue pair first (the adapter stops touching memory), then releases what it held;
  // what was still posted ends with `ec` (deadline_exceeded for a request whose deadline passed).
  void destroy_qp(qp_state* q,
                  std::error_code ec = make_error_code(errc::queue_pair_closed)) noexcept {
    if (q->listed_pending) {
      qp_state** link = &self().with_pending_;
      while (*link != q) link = &(*link)->pending_next;
      *link = q->pending_next;
    }
    if (q->expiry_listed) {
      qp_state** link = &self().to_break_;
      while (*link != q) link = &(*link)->expiry_next;
      *link = q->expiry_next;
    }
    self().disarm_timer(q->guard);
    self().unlist_fired(self().overdue_, q->guard);
    self().disarm_timer(q->check);
    self().unlist_fired(self().checks_due_, q->check);
    P::destroy_qp(q->qp);
    while (op_body* l = q->posted_head) {
      self().end_unit(l, transfer_state::failed,
                      l->expired ? make_error_code(errc::deadline_exceeded) : ec);
    }
    if (q->slots_mr) P::dereg_mr(q->slots_mr);
    {
      std::lock_guard lock(self().setup_mutex_);
      self().cq_room_ += q->cq_reserved;
    }
    if (q->close_op != nullptr) op::free(q->close_op);
    delete q;
  }

  // The destructor's: what never reached the adapter. The queue pair is destroyed next, which ends
  // what is posted, once the adapter can no longer touch it.
  void fail_everything(qp_state* q, std::error_code ec) noexcept {
    while (op_body* o = q->pending.front()) {
      op_body* lead = o->lead;
      q->pending.remove_all([lead](op_body* m) { return m->lead == lead; });
      if (!lead->posted) self().end_unit(lead, transfer_state::failed, ec);
    }
    while (op_body* w = q->waiters.pop()) self().end_wait(w, transfer_state::failed, ec);
  }

  // Calls f on every queue pair; f may destroy the one it is given.
  template <class F>
  void for_each_qp(F f) noexcept {
    for (qp_state* q = self().qps_; q != nullptr;) {
      qp_state* next = q->all_next;
      f(q);
      q = next;
    }
  }

  template <class F>
  void for_each_timed(qp_state* q, F f) noexcept {
    for (op_body* o = q->pending.front(); o != nullptr; o = o->next) {
      if (o == o->lead) f(o);
    }
    for (op_body* l = q->posted_head; l != nullptr; l = l->list_next) f(l);
    for (op_body* w = q->waiters.front(); w != nullptr; w = w->next) f(w);
  }

  // Nothing on the device can complete any more: every queue pair, and any created later, fails.
  void fail_device(errc why) noexcept {
    int none = 0;
    self().failure_.compare_exchange_strong(none, static_cast<int>(why), std::memory_order_release,
                                            std::memory_order_relaxed);
    self().cq_failed_ = true;
    // No completion will be reaped any more, flushes included: what is posted fails now (its memory
    // stays registered until its queue pair goes).
    for_each_qp([this, why](qp_state* q) {
      break_queue_pair(q, why);
      self().give_up_flushes(q, false);
    });
  }

  std::size_t handle_async_events() noexcept {
    const std::vector<async_event> events = self().watcher_.take();
    async_events_.fetch_add(events.size(), std::memory_order_relaxed);
    for (const async_event& ev : events) {
      switch (ev.type) {
        case IBV_EVENT_QP_FATAL:
        case IBV_EVENT_QP_REQ_ERR:
        case IBV_EVENT_QP_ACCESS_ERR:
        case IBV_EVENT_PATH_MIG_ERR:
          for_each_qp([&](qp_state* q) {
            if (q->qp == ev.qp && q->qp_num == ev.qp_num) {
              break_queue_pair(q, errc::queue_pair_fatal);
            }
          });
          break;
        case IBV_EVENT_CQ_ERR:
          fail_device(errc::completion_queue_error);
          break;
        case IBV_EVENT_DEVICE_FATAL:
          fail_device(errc::device_fatal);
          break;
        case IBV_EVENT_PORT_ERR:
          if (ev.port == self().options_.port) {
            for_each_qp([this](qp_state* q) { break_queue_pair(q, errc::port_down); });
          }
          break;
        default:
          break;  // informational (port active, LID change, communication established, ...)
      }
    }
    return events.size();
  }

  std::atomic<std::uint64_t> async_events_{0};
};

}  // namespace ferry::verbs::detail

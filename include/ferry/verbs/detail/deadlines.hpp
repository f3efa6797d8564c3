#pragma once
// Deadlines and a queue pair's timers. A request's deadline timer only lists it when it fires;
// poll() handles the list before anything that can end a unit. One that never reached the adapter
// ends at once; one the adapter holds is taken back by breaking its queue pair after the round's
// reap, and ends with its flush. A broken queue pair's flush guard (queue_pair_options::
// flush_timeout) bounds the wait for flushes; its peer-check timer (peer_checks.hpp) shares the
// same arm / list / take machinery. The executor thread only.

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <system_error>
#include <type_traits>

#include "ferry/detail/timeout.hpp"
#include "ferry/detail/timer_service.hpp"
#include "ferry/transfer.hpp"
#include "ferry/verbs/detail/op.hpp"
#include "ferry/verbs/detail/queue_pair_state.hpp"
#include "ferry/verbs/errors.hpp"

namespace ferry::verbs::detail {

// Deadlines and queue pair timers: a part of basic_device<P> (device.hpp), which derives from it
// privately; it reaches the device and the other parts through self().
template <class P>
struct deadlines {
  using op_body = verbs::detail::op_body<P>;
  using qp_state = verbs::detail::qp_state<P>;
  using qp_timer = verbs::detail::qp_timer<P>;

  [[nodiscard]] basic_device<P>& self() noexcept { return static_cast<basic_device<P>&>(*this); }
  [[nodiscard]] const basic_device<P>& self() const noexcept {
    return static_cast<const basic_device<P>&>(*this);
  }

  // Arms the deadline timer; false when it cannot (out of memory), and the caller ends the request.
  bool arm_deadline(op_body* lead) noexcept {
    if (!lead->has_deadline) return true;
    lead->timer.fire = &on_deadline;
    try {
      self().exec_.timers().arm(lead->timer);
    } catch (...) {
      return false;
    }
    lead->timer_armed = true;
    return true;
  }

  void cancel_timer(op_body* lead) noexcept {
    // Both run on the executor thread, and poll() takes expired timers before anything that can
    // end a unit: a timer that already fired has been handled, so a failed cancel needs nothing.
    if (lead->timer_armed && self().exec_.timers().cancel(lead->timer)) lead->timer_armed = false;
  }

  // Runs inside the executor's timer round, concurrently with nothing of ours: it only queues.
  static void on_deadline(ferry::detail::timer_node* t) noexcept {
    op_body* o = detail::op_of<P>(t);
    deadlines* owner = o->qp->device;
    o->expired_next = owner->expired_;
    owner->expired_ = o;
  }

  std::size_t drain_expired() noexcept {
    std::size_t n = 0;
    while (expired_ != nullptr) {
      op_body* lead = expired_;
      expired_ = lead->expired_next;
      lead->timer_armed = false;
      ++n;
      const std::error_code late = make_error_code(errc::deadline_exceeded);
      if (lead->kind == op_kind::wait_notification) {
        lead->qp->waiters.remove_first([lead](op_body* w) { return w == lead; });
        self().end_wait(lead, transfer_state::failed, late);
        continue;
      }
      if (!lead->posted) {
        // Never reached the adapter (the provider refused it for now): it can go at once.
        lead->qp->pending.remove_all([lead](op_body* m) { return m->lead == lead; });
        self().end_unit(lead, transfer_state::failed, late);
      } else {
        // The adapter holds it, and an RC queue pair hands a request back only by flushing it: the
        // queue pair goes to the error state (break_expired, after this round's reap), and the
        // flush ends the unit (deadline_exceeded) once the adapter no longer touches its memory.
        lead->expired = true;
        qp_state* q = lead->qp;
        if (!q->lifecycle.in_error() && !q->expiry_listed) {
          q->expiry_listed = true;
          q->expiry_next = to_break_;
          to_break_ = q;
        }
      }
    }
    return n;
  }

  // Queue pairs with a posted unit whose deadline passed go to the error state here, after the
  // reap (a unit whose success was already in the CQ has ended by now), and never while expired_
  // is walked: breaking ends waiters and unposted units, which may be further down that list.
  void break_expired() noexcept {
    while (qp_state* q = to_break_) {
      to_break_ = q->expiry_next;
      q->expiry_listed = false;
      if (q->lifecycle.in_error()) continue;
      for (op_body* l = q->posted_head; l != nullptr; l = l->list_next) {
        if (l->expired) {
          self().break_queue_pair(q, errc::queue_pair_timed_out);
          break;
        }
      }
    }
  }

  // --- A queue pair's timers: fired in the executor's timer round, which only lists them (in
  // overdue_ or checks_due_); poll() handles the lists first. ---

  // False when the timer cannot be armed (out of memory).
  bool arm_timer(qp_timer& t, std::chrono::nanoseconds after,
                 void (*fire)(ferry::detail::timer_node*) noexcept) noexcept {
    t.timer.deadline = ferry::detail::deadline_after(after);
    t.timer.fire = fire;
    try {
      self().exec_.timers().arm(t.timer);
    } catch (...) {
      return false;
    }
    t.armed = true;
    return true;
  }

  void disarm_timer(qp_timer& t) noexcept {
    // As cancel_timer: one that already fired is listed, and poll() drains the lists first.
    if (t.armed && self().exec_.timers().cancel(t.timer)) t.armed = false;
  }

  // The timers' callback: lists the fired timer in `List`.
  template <qp_timer* deadlines::*List>
  static void list_fired(ferry::detail::timer_node* node) noexcept {
    static_assert(std::is_standard_layout_v<qp_timer>);
    auto* t = reinterpret_cast<qp_timer*>(node);
    deadlines* owner = t->qp->device;
    t->fired = true;
    t->fired_next = owner->*List;
    owner->*List = t;
  }

  // The next fired timer of `list`, taken off it; null when there is none.
  static qp_timer* take_fired(qp_timer*& list) noexcept {
    qp_timer* t = list;
    if (t == nullptr) return nullptr;
    list = t->fired_next;
    t->armed = false;
    t->fired = false;
    return t;
  }

  // For a queue pair that is going: takes its timer off `list` if it fired.
  static void unlist_fired(qp_timer*& list, qp_timer& t) noexcept {
    if (!t.fired) return;
    qp_timer** link = &list;
    while (*link != &t) link = &(*link)->fired_next;
    *link = t.fired_next;
    t.fired = false;
  }

  void arm_flush_guard(qp_state* q) noexcept {
    // The destructor ends everything itself (and a timer armed then could fire on the executor).
    // After a CQ error nothing is reaped, and everything posted has been failed already.
    if (self().shutting_down_ || self().cq_failed_ || q->posted_head == nullptr || q->guard.armed ||
        q->guard.fired) {
      return;
    }
    // No timer (out of memory): give up waiting at once, as the guard would.
    if (!arm_timer(q->guard, q->flush_timeout, &list_fired<&deadlines::overdue_>)) {
      give_up_flushes(q);
    }
  }

  void disarm_flush_guard(qp_state* q) noexcept { disarm_timer(q->guard); }

  std::size_t drain_overdue() noexcept {
    std::size_t n = 0;
    while (qp_timer* g = take_fired(overdue_)) {
      qp_state* q = g->qp;
      if (q->lifecycle.closing()) {
        // Closed, its handle gone: destroying it is the only way left to take back what the
        // adapter holds (receives included), and it ends the requests only once it is done.
        if (q->posted_head != nullptr) flushes_overdue_.fetch_add(1, std::memory_order_relaxed);
        self().unlist_and_destroy(q, make_error_code(errc::queue_pair_closed));
      } else {
        give_up_flushes(q);
      }
      ++n;
    }
    return n;
  }

  // The adapter has not handed back what the broken queue pair holds: fail it now (nothing may wait
  // for ever). Its memory stays registered until the flush comes or the queue pair goes.
  // `overdue`: the flush timeout ran out (counted when anything is failed, first, so that a waiter
  // woken here sees the count), rather than the CQ or the device failing.
  void give_up_flushes(qp_state* q, bool overdue = true) noexcept {
    const op_body* first = q->posted_head;
    while (first != nullptr && first->failed) first = first->list_next;
    if (first == nullptr) return;
    if (overdue) flushes_overdue_.fetch_add(1, std::memory_order_relaxed);
    const int b = q->broken.load(std::memory_order_relaxed);
    const std::error_code why = q->broken_error(b != 0 ? b : 1);
    for (op_body* l = q->posted_head; l != nullptr; l = l->list_next) {
      self().fail_unit(l, l->expired ? make_error_code(errc::deadline_exceeded) : why);
    }
  }

  // The executor's.
  op_body* expired_ = nullptr;
  qp_state* to_break_ = nullptr;
  qp_timer* overdue_ = nullptr;     // flush guards that fired
  qp_timer* checks_due_ = nullptr;  // peer checks that fired
  std::atomic<std::uint64_t> flushes_overdue_{0};
};

}  // namespace ferry::verbs::detail

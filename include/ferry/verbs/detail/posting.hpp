#pragma once
// Posting: a queue pair's queued members go out as one chain with one ibv_post_send, so requests
// from many threads share doorbells. Posted units are listed on their queue pair until their
// completion or flush ends them. A refusal backs off (ENOMEM while a completion is coming, which
// frees room) or breaks the queue pair; what a broken queue pair never posted is abandoned here.
// Submitters take send-queue slots before publishing (queue_pair.hpp); the executor thread posts.

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <system_error>
#include <utility>

#include <infiniband/verbs.h>

#include "ferry/transfer.hpp"
#include "ferry/verbs/detail/op.hpp"
#include "ferry/verbs/detail/queue_pair_state.hpp"
#include "ferry/verbs/errors.hpp"

namespace ferry::verbs::detail {

// Posting: a part of basic_device<P> (device.hpp), which derives from it privately; it
// reaches the device and the other parts through self().
template <class P>
struct posting {
  using op_body = verbs::detail::op_body<P>;
  using qp_state = verbs::detail::qp_state<P>;

  [[nodiscard]] basic_device<P>& self() noexcept { return static_cast<basic_device<P>&>(*this); }
  [[nodiscard]] const basic_device<P>& self() const noexcept {
    return static_cast<const basic_device<P>&>(*this);
  }

  // The unit goes out with the queue pair's next chain (post_all).
  void queue_unit(qp_state* q, op_body* lead) noexcept {
    for (op_body* m = lead; m != nullptr; m = m->unit_next) q->pending.push(m);
    if (!q->listed_pending) {
      q->listed_pending = true;
      q->pending_next = with_pending_;
      with_pending_ = q;
    }
  }

  void post_all() noexcept {
    qp_state* list = std::exchange(with_pending_, nullptr);
    while (list != nullptr) {
      qp_state* q = list;
      list = q->pending_next;
      post_pending(q);
      if (q->pending.empty()) {
        q->listed_pending = false;
      } else {
        q->pending_next = with_pending_;
        with_pending_ = q;
      }
    }
  }

  // Posts the queue pair's queued members as one chain: one doorbell for everything queued.
  void post_pending(qp_state* q) noexcept {
    if (q->pending.empty()) return;
    for (op_body* o = q->pending.front(); o != nullptr; o = o->next) {
      o->wr.next = o->next != nullptr ? &o->next->wr : nullptr;
    }
    ibv_send_wr* bad = nullptr;
    const int r = P::post_send(q->qp, &q->pending.front()->wr, &bad);
    post_calls_.fetch_add(1, std::memory_order_relaxed);
    std::uint64_t posted = 0;
    while (!q->pending.empty() && (r == 0 || &q->pending.front()->wr != bad)) {
      op_body* o = q->pending.pop();
      o->wr.next = nullptr;
      o->posted = true;
      ++posted;
      if (o == o->lead) list_posted(q, o);
    }
    posted_.fetch_add(posted, std::memory_order_relaxed);
    if (r == 0) return;
    if (q->pending.empty()) {
      // Refused, naming no request of the chain (bad_wr outside it): which ones the adapter took is
      // unknown, so all count as posted and the queue pair goes down. The adapter flushes what it
      // has; the flush timeout ends what it never had.
      return self().break_queue_pair(q, errc::queue_pair_error);
    }
    // ENOMEM while whole units are in flight: their signalled completions free room, and the rest
    // goes then. Without one, nothing would ever free it (the head of a unit cut here is
    // unsignalled): the queue pair cannot go on.
    if (r == ENOMEM && completion_coming(q)) return;
    // Units the adapter never saw fail with the reason it refused them; one cut part-way ends on
    // its flush (abandon_pending).
    const std::error_code ec(r, std::system_category());
    for (op_body* o = q->pending.front(); o != nullptr; o = o->next) {
      if (!o->lead->posted) self().fail_unit(o->lead, ec);
    }
    self().break_queue_pair(q, errc::queue_pair_error);
  }

  [[nodiscard]] static bool completion_coming(const qp_state* q) noexcept {
    for (const op_body* l = q->posted_head; l != nullptr; l = l->list_next) {
      if (l->last->posted && !l->orphaned) return true;
    }
    return false;
  }

  void list_posted(qp_state* q, op_body* lead) noexcept {
    lead->listed = true;
    lead->list_prev = q->posted_tail;
    lead->list_next = nullptr;
    (q->posted_tail == nullptr ? q->posted_head : q->posted_tail->list_next) = lead;
    q->posted_tail = lead;
  }

  void unlist_posted(qp_state* q, op_body* lead) noexcept {
    if (!lead->listed) return;
    (lead->list_prev == nullptr ? q->posted_head : lead->list_prev->list_next) = lead->list_next;
    (lead->list_next == nullptr ? q->posted_tail : lead->list_next->list_prev) = lead->list_prev;
    lead->listed = false;
  }

  // Ends what has not reached the adapter. A unit cut by post_send part-way has its head in the
  // adapter: its tail is posted now, into the queue pair in the error state, so that the adapter
  // flushes it and the flush of its last member ends the unit. If even that is refused, the flush
  // of its head fails it, and it stays until the queue pair is destroyed (which stops the adapter
  // touching its memory). Either way it ends on a flush, never before the adapter lets go of it.
  void abandon_pending(qp_state* q, std::error_code ec) noexcept {
    while (op_body* o = q->pending.front()) {
      op_body* lead = o->lead;
      if (!lead->posted) {
        q->pending.remove_all([lead](op_body* m) { return m->lead == lead; });
        self().end_unit(lead, transfer_state::failed, ec);
        continue;
      }
      op_body* tail = o;
      for (op_body* m = o; m != nullptr; m = m->unit_next) {
        q->pending.pop();
        m->wr.next = m->unit_next != nullptr ? &m->unit_next->wr : nullptr;
      }
      ibv_send_wr* bad = nullptr;
      if (P::post_send(q->qp, &tail->wr, &bad) == 0) {
        for (op_body* m = tail; m != nullptr; m = m->unit_next) m->posted = true;
      } else {
        lead->orphaned = true;
      }
    }
  }

  // The executor's.
  qp_state* with_pending_ = nullptr;  // queue pairs with members to post
  std::atomic<std::uint64_t> posted_{0};
  std::atomic<std::uint64_t> post_calls_{0};
};

}  // namespace ferry::verbs::detail

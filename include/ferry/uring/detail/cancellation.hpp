#pragma once
// Cancelling on the io_uring ring. cancel(t) asks the kernel with IORING_OP_ASYNC_CANCEL; the
// transfer turns cancelled only when its own completion (-ECANCELED) arrives, so a buffer is never
// released while the kernel may still write it. An operation still in a backlog, or queued on its
// connection, never reached the kernel and is cancelled at once. A cancel request is itself an
// operation, with room of its own in the ring (admission.hpp); it carries a transfer reference to
// the status it names, so that issue() can tell its target from an op recycled at the same address.

#include <liburing.h>

#include <cerrno>
#include <cstdint>

#include "ferry/transfer.hpp"
#include "ferry/uring/detail/connection_state.hpp"
#include "ferry/uring/detail/engine.hpp"
#include "ferry/uring/detail/op.hpp"
#include "ferry/uring/detail/receive.hpp"
#include "ferry/uring/detail/send.hpp"
#include "ferry/uring/errors.hpp"

namespace ferry::uring::detail {

inline void prepare_cancel(io_uring_sqe* sqe, op* o) noexcept {
  ::io_uring_prep_cancel64(sqe, reinterpret_cast<std::uintptr_t>(o->target), 0);
}

// Its completion says only whether the kernel found the target; the target's own completion ends
// the transfer.
inline void on_cancel(engine&, op* c, int) noexcept { engine::release_cancel(c); }
inline void refuse_cancel(engine&, op* c) noexcept { engine::release_cancel(c); }

// Frame i (not the lead) of the group `conn` is sending. No byte of it has gone out (the frames
// before it have not all gone: finish_sent_frames). With the group waiting for room, it simply
// leaves the group. With the group in the kernel, its bytes belong to the one sendmsg, which
// stops: frames that went out whole succeed, untouched frames other than those cancelled are
// sent again (end_send_group).
inline void cancel_group_frame(engine& e, connection_state* conn, unsigned i, op* cancel) noexcept {
  op* frame = conn->send_group[i];
  op* lead = conn->send_group[0];
  frame->frame_cancel = true;
  const bool lead_in_kernel = lead->slot < e.in_flight_.size() && e.in_flight_[lead->slot] == lead;
  if (!lead_in_kernel) {
    engine::release_cancel(cancel);
    for (unsigned k = i; k + 1 < conn->send_group_size; ++k) {
      conn->send_group[k] = conn->send_group[k + 1];
    }
    --conn->send_group_size;
    conn->group_length -= frame->length;
    return e.finish(frame, transfer_state::cancelled, {});
  }
  if (lead->cancel_requested) return engine::release_cancel(cancel);  // the group is stopping already
  lead->cancel_requested = true;
  // The request names the lead, and carries the lead's transfer reference: issue() tells the
  // lead from an op recycled at the same address by its status.
  lead->status->add_transfer_ref();
  cancel->status->release_transfer_ref();
  cancel->status = lead->status;
  cancel->target = lead;
  e.start(cancel);
}

// Waiting for room in the ring: it never reached the kernel, or is between two parts of a short
// transfer. A connection's operation in the backlog is its active one; if it had moved bytes,
// the stream is out of step.
inline void cancel_backlogged(engine& e, op* o) noexcept {
  connection_state* c = o->connection;
  if (c == nullptr) {
    // A file's (perhaps between two parts), a connect's or an accept's: it ends as it would have
    // in the kernel, by its kind's completion with -ECANCELED.
    o->cancel_requested = true;
    return o->handlers->complete(e, o, -ECANCELED);
  }
  if (o->kind == op_kind::send) {  // `o` leads the group
    o->frame_cancel = true;
    return end_send_group(e, c, true, {});
  }
  // A receive: if it had taken bytes of a frame, the stream is out of step.
  if ((o->done != 0 || o->receiving_payload) && !c->receive_error) {
    c->receive_error = make_error_code(errc::connection_broken);
  }
  c->receiving = false;
  c->refs.fetch_add(1, std::memory_order_relaxed);  // finish() may drop the last reference
  e.finish(o, transfer_state::cancelled, {});
  next_receive(e, c);
  c->release();
}

// A cancel request taken off the submission stack: finds what it names, in the kernel, in a
// backlog, queued on a connection or inside a send group.
inline void handle_cancel(engine& e, op* c) noexcept {
  status_block* s = c->status;
  if (s->state() != transfer_state::pending) return engine::release_cancel(c);
  for (op* o : e.in_flight_) {
    if (o->status != s) continue;
    if (o->kind == op_kind::send) o->frame_cancel = true;  // the lead of its group
    if (o->cancel_requested) return engine::release_cancel(c);
    o->cancel_requested = true;
    c->target = o;
    e.start(c);
    return;
  }
  op* o = e.file_backlog_.remove_first(completing(s));
  if (o == nullptr) o = e.send_backlog_.remove_first(completing(s));
  if (o == nullptr) o = e.receive_backlog_.remove_first(completing(s));
  if (o != nullptr) {
    engine::release_cancel(c);
    return cancel_backlogged(e, o);
  }
  for (connection_state* conn = e.connections_.front(); conn != nullptr;
       conn = conn->list_next) {
    o = conn->sends.remove_first(completing(s));
    if (o == nullptr) o = conn->receives.remove_first(completing(s));
    if (o != nullptr) {
      engine::release_cancel(c);
      return e.finish(o, transfer_state::cancelled, {});
    }
  }
  // A frame behind the lead of a send group. Every group's lead is in flight or in the backlog,
  // whether or not close() has taken its connection off the list.
  connection_state* group = nullptr;
  unsigned index = 0;
  auto look = [&](const op* lead) {
    connection_state* conn = lead->connection;
    if (lead->kind != op_kind::send || !conn->sending || conn->send_group[0] != lead) return;
    for (unsigned i = 1; i < conn->send_group_size; ++i) {
      if (conn->send_group[i]->status == s) {
        group = conn;
        index = i;
      }
    }
  };
  for (const op* lead : e.in_flight_) look(lead);
  for (const op* lead = e.send_backlog_.front(); lead != nullptr; lead = lead->next) look(lead);
  if (group != nullptr) return cancel_group_frame(e, group, index, c);
  engine::release_cancel(c);
}

inline constexpr op_handlers cancel_handlers{op_kind::cancel, handle_cancel, prepare_cancel,
                                             on_cancel, refuse_cancel};

// Best effort: asks the kernel to cancel the operation completing `t` (ring::cancel).
inline void request_cancel(engine& e, const transfer& t) {
  if (t.status() == nullptr || t.done()) return;
  op* c = op::make(cancel_handlers);
  t.status()->add_transfer_ref();
  c->status = t.status();
  e.publish(c, c);
}

}  // namespace ferry::uring::detail

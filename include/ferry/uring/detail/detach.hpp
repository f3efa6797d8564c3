#pragma once
// Closing a TCP connection on the io_uring ring: once its handle is gone (its socket already shut
// down), the ring ends what the connection still has queued and takes it off its list.

#include "ferry/transfer.hpp"
#include "ferry/uring/detail/connection_state.hpp"
#include "ferry/uring/detail/engine.hpp"
#include "ferry/uring/detail/op.hpp"
#include "ferry/uring/detail/send.hpp"

namespace ferry::uring::detail {

// The connection's send group or receive may be waiting for room in the ring (not started yet, or
// between two parts). With the socket shut down it never starts again: it ends here, as queued
// work does (frames already sent whole succeed), rather than going to the kernel later, on a
// closed connection, with buffers its owner may already have freed.
inline void end_waiting_for_room(engine& e, connection_state* c) noexcept {
  if (c->sending && e.send_backlog_.remove_first(completing(c->send_group[0]->status)) != nullptr) {
    for (unsigned i = 0; i < c->send_group_size; ++i) c->send_group[i]->frame_cancel = true;
    end_send_group(e, c, true, {});
  }
  if (!c->receiving) return;
  if (op* o = e.receive_backlog_.remove_first([c](const op* q) { return q->connection == c; })) {
    c->receiving = false;
    e.finish(o, transfer_state::cancelled, {});
  }
}

// Cancels what is queued and takes `c` off the list; true if it was listed (the caller then owns
// the list's reference).
inline bool unlink_connection(engine& e, connection_state* c) noexcept {
  if (!c->listed) return false;
  end_waiting_for_room(e, c);
  while (op* o = c->sends.pop()) e.finish(o, transfer_state::cancelled, {});
  while (op* o = c->receives.pop()) e.finish(o, transfer_state::cancelled, {});
  e.connections_.remove(c);
  return true;
}

inline void unlist(engine& e, connection_state* c) noexcept {
  if (unlink_connection(e, c)) c->release();
}

// The handle is gone (its socket already shut down): queued operations never start.
inline void detach(engine& e, op* d) noexcept {
  connection_state* c = d->connection;
  op::pool::release(d);
  // The handle's reference (the detach op carried it) and the list's, dropped together.
  c->release(unlink_connection(e, c) ? 2 : 1);
}

inline constexpr op_handlers detach_handlers{op_kind::detach, detach, nullptr, nullptr, nullptr};

// tcp_connection::sever (its socket already shut down, its reason set): what is queued or waiting
// for room ends now (failed with the reason: engine::finish), and every later send and receive
// fails at once.
inline void sever(engine& e, op* s) noexcept {
  connection_state* c = s->connection;
  op::pool::release(s);
  const std::error_code why = c->severed();
  if (!c->send_error) c->send_error = why;
  if (!c->receive_error) c->receive_error = why;
  end_waiting_for_room(e, c);
  if (!c->sending) {
    while (op* o = c->sends.pop()) e.finish(o, transfer_state::failed, why);
  }
  if (!c->receiving) {
    while (op* o = c->receives.pop()) e.finish(o, transfer_state::failed, why);
  }
  c->release();  // the sever op's reference
}

inline constexpr op_handlers sever_handlers{op_kind::sever, sever, nullptr, nullptr, nullptr};

}  // namespace ferry::uring::detail

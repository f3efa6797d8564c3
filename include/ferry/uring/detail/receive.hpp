#pragma once
// Framed receives on a TCP connection through the io_uring ring: one receive in flight per
// connection, in submission order. A receive takes the frame's header, checks it (frame.hpp), then
// the payload; a short receive is continued. A receive that fails part-way puts the stream out of
// step: the connection's later receives fail with errc::connection_broken.

#include <liburing.h>

#include <algorithm>
#include <cstddef>
#include <system_error>

#include <sys/socket.h>

#include "ferry/errors.hpp"
#include "ferry/transfer.hpp"
#include "ferry/uring/detail/connection_state.hpp"
#include "ferry/uring/detail/engine.hpp"
#include "ferry/uring/detail/op.hpp"
#include "ferry/uring/errors.hpp"
#include "ferry/uring/frame.hpp"

namespace ferry::uring::detail {

inline void prepare_receive(io_uring_sqe* sqe, op* o) noexcept {
  const auto n = static_cast<unsigned>(std::min(o->length - o->done, max_chunk));
  std::byte* at = o->receiving_payload ? o->buffer : reinterpret_cast<std::byte*>(&o->header);
  ::io_uring_prep_recv(sqe, o->fd, at + o->done, n, MSG_WAITALL);
}

inline void next_receive(engine& e, connection_state* c) noexcept {
  if (c->closing.load(std::memory_order_acquire)) return;  // detach cancels what is queued
  while (op* o = c->receives.pop()) {
    if (c->receive_error) {
      e.finish(o, transfer_state::failed, c->receive_error);
      continue;
    }
    c->receiving = true;
    e.start(o);
    return;
  }
}

inline void enqueue_receive(engine& e, op* o) noexcept {
  connection_state* c = o->connection;
  e.connections_.add(c);
  c->receives.push(o);
  if (!c->receiving) next_receive(e, c);
}

// The header is in: check it and switch to the payload. Returns pending to go on receiving,
// success for an empty block, failed (with `ec`) for a header that cannot be accepted.
[[nodiscard]] inline transfer_state begin_payload(op* o, std::error_code& ec) noexcept {
  const frame_header& h = o->header;
  if (const errc bad = check_frame(h, o->parts[1].iov_len); bad != errc{}) {
    ec = make_error_code(bad);
    return transfer_state::failed;
  }
  o->received->id = h.id;
  o->received->length = static_cast<std::size_t>(h.length);
  if (h.length == 0) return transfer_state::success;
  o->receiving_payload = true;
  o->buffer = static_cast<std::byte*>(o->parts[1].iov_base);
  o->length = static_cast<std::size_t>(h.length);
  o->done = 0;
  return transfer_state::pending;
}

inline void on_receive(engine& e, op* o, int res) noexcept {
  connection_state* c = o->connection;
  const bool started = o->done != 0 || o->receiving_payload;
  std::error_code ec;
  transfer_state to = transfer_state::pending;
  if (was_cancelled(o, res)) {
    to = transfer_state::cancelled;
    if (started) c->receive_error = make_error_code(errc::connection_broken);
  } else if (res == -EINTR && !e.shutting_down_) {
    e.resume(o);
    return;
  } else if (res < 0) {
    to = transfer_state::failed;
    ec = system_error_code(-res);
    c->receive_error = ec;
  } else if (res == 0) {
    to = transfer_state::failed;
    ec = make_error_code(errc::connection_closed);
    c->receive_error = ec;
  } else {
    o->done += static_cast<std::size_t>(res);
    if (o->done == o->length) {
      to = o->receiving_payload ? transfer_state::success : begin_payload(o, ec);
    }
    if (to == transfer_state::pending) {
      if (o->cancel_requested || e.shutting_down_) {
        c->receive_error = make_error_code(errc::connection_broken);
        to = o->cancel_requested ? transfer_state::cancelled : transfer_state::failed;
        if (!o->cancel_requested) ec = make_error_code(ferry::errc::backend_shut_down);
      } else {
        e.resume(o);
        return;
      }
    } else if (to == transfer_state::failed) {
      c->receive_error = make_error_code(errc::connection_broken);
    }
  }
  c->receiving = false;
  // Ends the connection's active receive and starts its next one. While the connection is listed
  // the ring holds a reference, so it outlives finish(); once detached nothing is queued.
  const bool go_on = c->listed && !e.shutting_down_;
  e.finish(o, to, ec);
  if (go_on) next_receive(e, c);
}

inline constexpr op_handlers receive_handlers{op_kind::receive, enqueue_receive, prepare_receive,
                                              on_receive, fail_shut_down};

}  // namespace ferry::uring::detail

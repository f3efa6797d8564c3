#pragma once
// Framed sends on a TCP connection through the io_uring ring: one send group in flight per
// connection, in submission order. Queued frames are coalesced into one sendmsg (header and payload
// of each), the first of them (the lead) owning the SQE; a short sendmsg is continued from where
// the kernel stopped.

#include <liburing.h>

#include <cstddef>
#include <system_error>

#include <sys/socket.h>
#include <sys/uio.h>

#include "ferry/errors.hpp"
#include "ferry/transfer.hpp"
#include "ferry/uring/detail/connection_state.hpp"
#include "ferry/uring/detail/engine.hpp"
#include "ferry/uring/detail/op.hpp"
#include "ferry/uring/errors.hpp"

namespace ferry::uring::detail {

// The group's frames from where the kernel stopped: header and payload of each.
inline void prepare_send(io_uring_sqe* sqe, op* lead) noexcept {
  connection_state* c = lead->connection;
  std::size_t skip = c->group_done;
  std::size_t count = 0;
  for (unsigned i = 0; i < c->send_group_size; ++i) {
    for (const iovec& part : c->send_group[i]->parts) {
      if (skip >= part.iov_len) {
        skip -= part.iov_len;
        continue;
      }
      c->send_live[count++] =
          iovec{static_cast<std::byte*>(part.iov_base) + skip, part.iov_len - skip};
      skip = 0;
    }
  }
  c->send_message = msghdr{};
  c->send_message.msg_iov = c->send_live;
  c->send_message.msg_iovlen = count;
  ::io_uring_prep_sendmsg(sqe, lead->fd, &c->send_message, MSG_NOSIGNAL | MSG_WAITALL);
}

// Starts the next group: as many queued frames as fit, sent with one sendmsg.
inline void next_send(engine& e, connection_state* c) noexcept {
  if (c->closing.load(std::memory_order_acquire)) return;  // detach cancels what is queued
  c->send_group_size = 0;
  c->group_length = 0;
  c->group_done = 0;
  while (c->send_group_size < connection_state::max_send_group) {
    op* o = c->sends.pop();
    if (o == nullptr) break;
    if (c->send_error) {
      e.finish(o, transfer_state::failed, c->send_error);  // the ring's list keeps `c` alive
      continue;
    }
    c->send_group[c->send_group_size++] = o;
    c->group_length += o->length;
  }
  if (c->send_group_size == 0) return;
  c->sending = true;
  e.start(c->send_group[0]);
}

inline void enqueue_send(engine& e, op* o) noexcept {
  connection_state* c = o->connection;
  e.connections_.add(c);
  c->sends.push(o);
  if (!c->sending) next_send(e, c);
}

// A sendmsg came back short: the frames the kernel has wholly taken succeed now, not when the
// rest of the group has gone (a peer that stops reading would hold them, and a cancel of one
// could only stop the sendmsg, cutting the next frame). The first frame left leads what is left.
// So a group's lead is never wholly sent, and the frames behind it are untouched.
inline op* finish_sent_frames(engine& e, connection_state* c) noexcept {
  unsigned sent = 0;
  std::size_t sent_bytes = 0;
  while (sent_bytes + c->send_group[sent]->length <= c->group_done) {
    sent_bytes += c->send_group[sent]->length;
    ++sent;
  }
  // The frames left hold references to `c`, so finishing these cannot free it.
  for (unsigned i = 0; i < sent; ++i) e.finish(c->send_group[i], transfer_state::success, {});
  for (unsigned i = sent; i < c->send_group_size; ++i) c->send_group[i - sent] = c->send_group[i];
  c->send_group_size -= sent;
  c->group_done -= sent_bytes;
  c->group_length -= sent_bytes;
  return c->send_group[0];
}

// Ends the group in flight. Frames that went out whole succeed. If it was cut short: the frame cut
// part-way fails with the cause (errc::cancelled_part_way for a cancel: part of it reached the
// peer, so "cancelled", which says nothing happened, would be wrong), and since the stream is then
// out of step, so does every later one
// on the connection; after an error, every frame left fails with it; after a cancel at a frame
// boundary, the untouched frames that cancel() named end cancelled and the others go back to the
// front of the queue (or end cancelled too, if the connection is closed or the ring shutting
// down, since nothing would send them).
inline void end_send_group(engine& e, connection_state* c, bool cancelled,
                           std::error_code ec) noexcept {
  const bool go_on = c->listed && !e.shutting_down_;
  c->refs.fetch_add(1, std::memory_order_relaxed);  // finish() may drop the last other reference
  const std::error_code broken = make_error_code(errc::connection_broken);
  bool in_step = true;
  op* requeue[connection_state::max_send_group];
  unsigned requeued = 0;
  std::size_t begin = 0;
  for (unsigned i = 0; i < c->send_group_size; ++i) {
    op* o = c->send_group[i];
    const std::size_t end = begin + o->length;
    if (end <= c->group_done) {
      e.finish(o, transfer_state::success, {});
    } else if (begin < c->group_done) {
      in_step = false;
      e.finish(o, transfer_state::failed, cancelled ? make_error_code(errc::cancelled_part_way) : ec);
    } else if (cancelled && in_step && !o->frame_cancel && go_on) {
      o->cancel_requested = false;  // the next group's SQE is a new one
      requeue[requeued++] = o;
    } else if (cancelled && in_step) {
      e.finish(o, transfer_state::cancelled, {});
    } else {
      e.finish(o, transfer_state::failed, in_step ? ec : broken);
    }
    begin = end;
  }
  c->send_group_size = 0;
  c->sending = false;
  if (!in_step) {
    // The peer has part of a frame and would wait for the rest of it for ever: end the stream,
    // so that its receive fails (connection_closed) and it knows. Receives here go on.
    c->send_error = broken;
    ::shutdown(c->fd, SHUT_WR);
  } else if (!cancelled && !c->send_error) {
    c->send_error = ec;
  }
  // Back to the front of the queue, in their order.
  while (requeued != 0) c->sends.push_front(requeue[--requeued]);
  if (go_on) next_send(e, c);
  c->release();
}

inline void on_send(engine& e, op* lead, int res) noexcept {
  connection_state* c = lead->connection;
  if (res > 0) {
    c->group_done += static_cast<std::size_t>(res);
    if (c->group_done == c->group_length) return end_send_group(e, c, false, {});
    if (!lead->cancel_requested && !e.shutting_down_) {
      e.resubmitted_.fetch_add(1, std::memory_order_relaxed);
      e.resume(finish_sent_frames(e, c));
      return;
    }
  } else if (res == -EINTR && !lead->cancel_requested && !e.shutting_down_) {
    e.resume(lead);
    return;
  }
  std::error_code ec;
  bool cancelled = false;
  if (res < 0 && !was_cancelled(lead, res)) {
    ec = system_error_code(-res);
  } else if (res == 0) {
    ec = make_error_code(errc::connection_closed);
  } else if (lead->cancel_requested) {
    cancelled = true;
  } else {
    ec = make_error_code(ferry::errc::backend_shut_down);
  }
  end_send_group(e, c, cancelled, ec);
}

inline void refuse_send(engine& e, op* o) noexcept {
  if (o->connection->sending && o->connection->send_group[0] == o) {
    // The lead of a send group: the whole group ends.
    return end_send_group(e, o->connection, false,
                          make_error_code(ferry::errc::backend_shut_down));
  }
  fail_shut_down(e, o);
}

inline constexpr op_handlers send_handlers{op_kind::send, enqueue_send, prepare_send, on_send,
                                           refuse_send};

}  // namespace ferry::uring::detail

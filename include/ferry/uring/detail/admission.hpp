#pragma once
// The io_uring ring's bound on what is in flight, and the lines that wait for room.
//
// At most as many operations are in flight as the completion queue has entries (cancel requests
// and the deadlines linked to connects and accepts included), so the CQ never overflows; beyond that, submissions wait in backlogs, one per kind,
// served in order of arrival as each kind's share allows. Part of the queue is kept for cancel
// requests, so a cancel always reaches the kernel. Socket operations wait on a peer for as long as
// it takes, so receives (with connects and accepts) and sends may each use at most half of the rest, and three quarters
// together: file I/O always finds room, and so do sends beside idle receives. An operation that
// goes on from where it stopped (the rest of a short transfer, a retry after EINTR) keeps its
// place: it is issued again at once, or first in line, never behind later work (engine::resume).
//
// The executor thread's only; the engine moves operations between these lines and the kernel.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "ferry/uring/detail/op.hpp"

namespace ferry::uring::detail {

struct admission {
  // Shares the completion queue's `cq_entries` out between the kinds.
  void bound(unsigned cq_entries) noexcept {
    limit_ = cq_entries;
    cancel_room_ = std::max(1u, limit_ / 8);
    const unsigned rest = limit_ - cancel_room_;
    socket_kind_room_ = std::max(1u, rest / 2);
    socket_room_ = std::max(2u, rest * 3 / 4);
  }

  // The CQ bound: cancels have room of their own; socket receives and sends, which may wait on a
  // peer indefinitely, never take more than half of the rest each and three quarters together, so
  // file I/O always gets in, and sends get in beside receives (and receives beside sends).
  [[nodiscard]] bool has_room(op_kind kind) const noexcept {
    if (outstanding() >= limit_) return false;
    if (kind == op_kind::cancel) return cancels_in_flight_ < cancel_room_;
    // A connect or an accept brings its deadline: two completions.
    const unsigned completions = kind == op_kind::connect || kind == op_kind::accept ? 2 : 1;
    if (in_flight_.size() + deadlines_in_flight_ + completions > limit_ - cancel_room_) return false;
    const bool socket_room = receives_in_flight_ + sends_in_flight_ < socket_room_;
    if (waits_on_peer(kind)) return socket_room && receives_in_flight_ < socket_kind_room_;
    if (kind == op_kind::send) return socket_room && sends_in_flight_ < socket_kind_room_;
    return true;
  }

  // Completions the kernel still owes: operations, cancel requests and linked deadlines.
  [[nodiscard]] std::size_t outstanding() const noexcept {
    return in_flight_.size() + cancels_in_flight_ + deadlines_in_flight_;
  }

  // `o` has gone to the kernel.
  void admit(op* o) noexcept {
    if (o->kind == op_kind::cancel) {
      ++cancels_in_flight_;
    } else {
      if (waits_on_peer(o->kind)) ++receives_in_flight_;
      if (o->kind == op_kind::send) ++sends_in_flight_;
      o->slot = in_flight_.size();
      in_flight_.push_back(o);
    }
  }

  // `o`'s completion has come back.
  void retire(op* o) noexcept {
    if (o->kind == op_kind::cancel) {
      --cancels_in_flight_;
      return;
    }
    if (waits_on_peer(o->kind)) --receives_in_flight_;
    if (o->kind == op_kind::send) --sends_in_flight_;
    op* last = in_flight_.back();
    in_flight_[o->slot] = last;
    last->slot = o->slot;
    in_flight_.pop_back();
  }

  // Whether the kernel holds `o` now. Found in in_flight_ before `o` is read: a finished operation
  // may be back in the pool.
  [[nodiscard]] bool holds(const op* o) const noexcept {
    return std::find(in_flight_.begin(), in_flight_.end(), o) != in_flight_.end();
  }

  [[nodiscard]] op_queue<op>& backlog_for(const op* o) noexcept {
    if (o->kind == op_kind::cancel) return cancel_backlog_;
    if (waits_on_peer(o->kind)) return receive_backlog_;
    if (o->kind == op_kind::send) return send_backlog_;
    return file_backlog_;
  }

  // Whether anything but cancels waits for room.
  [[nodiscard]] bool waiting() const noexcept {
    return !file_backlog_.empty() || !send_backlog_.empty() || !receive_backlog_.empty();
  }

  // The backlog whose head arrived first among those whose kind has room now, or nullptr: no kind
  // waits behind another (sends behind file I/O that keeps coming, say, for ever).
  [[nodiscard]] op_queue<op>* next_in_line() noexcept {
    op_queue<op>* next = nullptr;
    for (op_queue<op>* q : {&file_backlog_, &send_backlog_, &receive_backlog_}) {
      if (q->empty() || !has_room(q->front()->kind)) continue;
      if (next == nullptr || q->front()->ticket < next->front()->ticket) next = q;
    }
    return next;
  }

  unsigned limit_ = 0;
  std::vector<op*> in_flight_;
  unsigned cancels_in_flight_ = 0;
  unsigned receives_in_flight_ = 0;
  unsigned sends_in_flight_ = 0;
  unsigned deadlines_in_flight_ = 0;  // linked to connects and accepts (user data 1)
  unsigned cancel_room_ = 1;       // CQ entries only cancels may use
  unsigned socket_kind_room_ = 1;  // the most socket receives, or sends, in flight at once
  unsigned socket_room_ = 2;       // the most socket receives and sends in flight together
  // Waiting for room, one queue per kind, so that no kind waits behind another's share.
  op_queue<op> file_backlog_;
  op_queue<op> send_backlog_;
  op_queue<op> receive_backlog_;
  op_queue<op> cancel_backlog_;
  std::uint64_t tickets_ = 0;  // handed out in backlog arrival order
};

}  // namespace ferry::uring::detail

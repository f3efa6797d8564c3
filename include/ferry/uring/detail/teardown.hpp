#pragma once
// Finishing the io_uring ring: everything the kernel still holds is cancelled and its own
// completion awaited, so no buffer is written after the ring's destructor returns; operations not
// yet given to the kernel fail with ferry::errc::backend_shut_down. With deferred task work only
// the executor (the issuer) may do this, a little each round; with the plain set-up the
// destructor's thread does it once the executor no longer polls the ring.

#include <liburing.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>

#include <unistd.h>

#include "ferry/transfer.hpp"
#include "ferry/uring/detail/engine.hpp"
#include "ferry/uring/detail/executor_call.hpp"
#include "ferry/uring/detail/op.hpp"

namespace ferry::uring::detail {

// The destructor's op arriving (deferred): the executor finishes the ring from now on.
inline void begin_closing(engine& e, op* o) noexcept {
  e.shutting_down_ = true;
  e.closing_ = o;
  e.fail_backlogs();  // before any pump() of this round could hand them to the kernel
}

inline constexpr op_handlers shutdown_handlers{op_kind::shutdown, begin_closing, nullptr, nullptr,
                                               nullptr};

// One cancel per operation the kernel holds, as CQ room allows (every kernel has these;
// CANCEL_ANY is 5.19+). Their completions carry user data 0. A cancelled connect or accept takes its
// linked deadline with it.
inline void cancel_everything(engine& e) noexcept {
  for (op* o : e.in_flight_) {
    if (o->cancelled_at_shutdown) continue;
    if (e.outstanding() >= e.limit_) break;
    io_uring_sqe* sqe = e.next_sqe();
    if (sqe == nullptr) break;
    ::io_uring_prep_cancel64(sqe, reinterpret_cast<std::uintptr_t>(o), 0);
    ::io_uring_sqe_set_data64(sqe, 0);
    o->cancel_requested = true;
    o->cancelled_at_shutdown = true;
    ++e.cancels_in_flight_;
  }
}

// Deferred: the executor's part of the destructor, a little each round (nothing here waits).
// Refuses what is queued, asks the kernel to cancel what it holds, and once every completion is
// back, lets the destructor go on.
inline void go_on_closing(engine& e) noexcept {
  // Refusals resume continuations inline, which may publish more: refused here, on this thread,
  // before the destructor goes on.
  if (!e.incoming_.empty()) e.take_incoming();
  e.fail_backlogs();
  cancel_everything(e);
  e.flush();
  if (e.outstanding() != 0 || !e.incoming_.empty()) return;
  op* o = std::exchange(e.closing_, nullptr);
  e.finish(o, transfer_state::success, {});
}

// The plain set-up's destructor, once the executor no longer polls the ring: cancels everything
// in flight and waits for every completion on this thread. Completing an operation may resume a
// continuation inline here, which may submit more: that is taken (and refused) each time round,
// until nothing is queued or in flight.
inline void shut_down(engine& e) noexcept {
  e.shutting_down_ = true;
  for (;;) {
    e.take_incoming();
    run_calls(e);
    e.fail_backlogs();
    if (e.outstanding() == 0 && e.incoming_.empty()) break;
    cancel_everything(e);
    e.flush();
    if (e.outstanding() == 0) continue;
    // Submits again what flush() could not hand over (the kernel was short of memory) in the
    // same call that waits, so that the wait is never for a cancel the kernel does not have.
    io_uring_cqe* cqe = nullptr;
    int r = ::io_uring_submit_and_wait(&e.ring_, 1);
    if (r >= 0) r = ::io_uring_peek_cqe(&e.ring_, &cqe);
    if (r == -EINTR || r == -EAGAIN || r == -EBUSY) continue;
    if (r < 0) {
      // The kernel may still write into buffers it holds; returning would free them under it.
      std::fprintf(stderr,
                   "ferry: uring::ring destroyed but waiting for its completions failed (%s)\n",
                   std::strerror(-r));
      std::abort();
    }
    const std::uint64_t data = cqe->user_data;
    const int res = cqe->res;
    ::io_uring_cqe_seen(&e.ring_, cqe);
    if (data == 0) {
      --e.cancels_in_flight_;
    } else if (data == linked_deadline_data) {
      --e.deadlines_in_flight_;
    } else {
      e.complete(reinterpret_cast<op*>(data), res);
    }
  }
}

// The destructor's op, when the destructor does not need it (or the constructor failed).
inline void release_closing_op(engine& e) noexcept {
  if (op* o = std::exchange(e.closing_op_, nullptr)) e.finish(o, transfer_state::success, {});
}

inline void close_ring(engine& e) noexcept {
  ::io_uring_queue_exit(&e.ring_);
  if (e.due_fd_ >= 0) ::close(e.due_fd_);
  e.due_fd_ = -1;
}

}  // namespace ferry::uring::detail

#pragma once
// The io_uring ring's engine: it takes published operations, issues them as SQEs within the bound
// (admission.hpp), reaps CQEs and hands each to its kind's handlers (op.hpp), and ends operations.
//
// Submission. Any thread prepares an operation (a pooled `op`), then publishes it last with one CAS
// onto a lock-free stack. Only the executor thread touches the ring itself: it takes the whole stack
// with one exchange and turns it into SQEs, so calls from many threads are gathered without a lock
// and the ring needs no locking at all. The submitter then calls progress_executor::notify(), which
// writes the executor's eventfd only if it has parked.
//
// One io_uring_enter carries at most ring_options::submit_batch SQEs (two by default). The kernel
// plugs the block layer for a call that carries more than two, and a plugged request reaches the
// device only once the whole call has been prepared: the first of twelve reads waits for the
// other eleven. Requests that go out as they are ready keep a device busier than lumps do.
//
// Completion. The executor reaps CQEs in batches and gives each to its operation's kind, which
// continues it (the rest of a short transfer) or ends it. Errno results are std::system_category
// codes.

#include <liburing.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <string_view>
#include <system_error>

#include "ferry/detail/submission_stack.hpp"
#include "ferry/errors.hpp"
#include "ferry/metrics.hpp"
#include "ferry/progress_executor.hpp"
#include "ferry/transfer.hpp"
#include "ferry/uring/detail/admission.hpp"
#include "ferry/uring/detail/connection_state.hpp"
#include "ferry/uring/detail/op.hpp"
#include "ferry/uring/options.hpp"

namespace ferry::uring::detail {

class engine : public admission {
 public:
  explicit engine(progress_executor& exec) noexcept : exec_(exec) {}
  engine(const engine&) = delete;
  engine& operator=(const engine&) = delete;

  // Pairs an op with a new status; the op keeps the completer reference.
  [[nodiscard]] static transfer attach(op* o) {
    status_block* s = nullptr;
    try {
      s = status_block::make();
    } catch (...) {
      op::pool::release(o);
      throw;
    }
    o->status = s;
    return transfer(ferry::detail::adopt, s);
  }

  // Publishes a chain linked newest → oldest through op::next. The caller prepared everything: after
  // the CAS the executor owns the ops.
  void publish(op* newest, op* oldest) noexcept {
    if (meter_.attached()) {
      const std::uint64_t now = ferry::metrics::now_ns();
      for (op* o = newest;; o = o->next) {
        o->published_ns = now;
        if (o == oldest) break;
      }
    }
    incoming_.push(newest, oldest);
    exec_.notify();
  }

  // Records every read, write, send and receive that ends into `r` (ring_options::metrics); before
  // anything is published.
  void meter(ferry::metrics::registry& r) {
    meter_.attach(&r, {"read", "write", "readv", "writev", "send", "receive"});  // op_kind's order
  }

  // tcp.hpp: whether a new connection should learn its peer's address for the per-peer figures.
  [[nodiscard]] bool metered() const noexcept { return meter_.attached(); }

  // tcp.hpp: a connection's operations go through the same stack as everything else.
  void post(op* o) noexcept { publish(o, o); }

  // tcp.hpp: open tcp_connection handles, checked by the ring's destructor.
  void connection_opened() noexcept { open_connections_.fetch_add(1, std::memory_order_relaxed); }
  void connection_closed() noexcept { open_connections_.fetch_sub(1, std::memory_order_release); }

  [[nodiscard]] ring_counters counters() const noexcept {
    ring_counters c;
    c.submitted = submitted_.load(std::memory_order_relaxed);
    c.submit_calls = submit_calls_.load(std::memory_order_relaxed);
    c.completed = completed_.load(std::memory_order_relaxed);
    c.resubmitted = resubmitted_.load(std::memory_order_relaxed);
    c.backlogged = backlogged_.load(std::memory_order_relaxed);
    return c;
  }

  // --- Executor thread from here on (or the ring's destructor, once the source is removed). ---

  void take_incoming() noexcept {
    incoming_.take([this](op* o) { o->handlers->arrive(*this, o); });
  }

  // Issues `o` now if the ring has room for its kind, else queues it behind the others of its kind
  // (order is kept within each).
  void start(op* o) noexcept {
    if (shutting_down_) {
      refuse(o);
      return;
    }
    op_queue<op>& q = backlog_for(o);
    if (o->kind == op_kind::cancel) {  // cancels have room of their own, and a queue of their own
      if (!q.empty() || !issue(o)) {
        q.push(o);
        backlogged_.fetch_add(1, std::memory_order_relaxed);
      }
      return;
    }
    // With anything waiting, room that has just come back (a completion in this round) belongs to
    // the oldest waiter that fits it, not to whatever is started next: `o` takes its turn.
    if (!waiting() && issue(o)) return;
    o->ticket = ++tickets_;
    q.push(o);
    pump();
    // `o` went in last, so `q` is empty only if pump() has issued it.
    if (!q.empty()) backlogged_.fetch_add(1, std::memory_order_relaxed);  // still waiting
  }

  // Goes on with an operation that was in flight a moment ago: the rest of a short transfer, or a
  // retry after EINTR. It keeps its place in the ring: issued at once (its own entry has just come
  // back), or else first in line. Behind later work it could wait forever: a receive whose frame
  // has arrived, queued behind receives on connections whose peers are silent.
  void resume(op* o) noexcept {
    if (!issue(o)) {
      o->ticket = 0;
      backlog_for(o).push_front(o);
      backlogged_.fetch_add(1, std::memory_order_relaxed);
    }
  }

  // Cancels first (they have room of their own), then the other kinds in the order they arrived,
  // each as its share allows (admission::next_in_line). Popped before it is issued: issuing a stale
  // cancel releases it.
  void pump() noexcept {
    while (op* o = cancel_backlog_.pop()) {
      if (!issue(o)) {
        cancel_backlog_.push_front(o);
        break;
      }
    }
    while (op_queue<op>* next = next_in_line()) {
      op* o = next->pop();
      if (!issue(o)) {
        next->push_front(o);
        return;
      }
    }
  }

  void fail_backlogs() noexcept {
    for (op_queue<op>* q : {&cancel_backlog_, &file_backlog_, &send_backlog_, &receive_backlog_}) {
      while (op* o = q->pop()) refuse(o);
    }
  }

  [[nodiscard]] io_uring_sqe* next_sqe() noexcept {
    io_uring_sqe* sqe = ::io_uring_get_sqe(&ring_);
    if (sqe == nullptr) {
      flush();
      sqe = ::io_uring_get_sqe(&ring_);
    }
    return sqe;
  }

  void flush() noexcept {
    const unsigned ready = ::io_uring_sq_ready(&ring_);
    if (ready == 0) return;
    const int r = ::io_uring_submit(&ring_);
    if (r > 0) {
      submitted_.fetch_add(static_cast<std::uint64_t>(r), std::memory_order_relaxed);
      submit_calls_.fetch_add(1, std::memory_order_relaxed);
    }
  }

  // Prepares an SQE for `o` if both the CQ bound and the SQ allow it; a connect or accept with a
  // deadline takes two, linked: the operation and its IORING_OP_LINK_TIMEOUT, which cancels it
  // (-ECANCELED) at the deadline. Either way the timeout's own completion comes back too.
  bool issue(op* o) noexcept {
    if (!has_room(o->kind)) return false;
    if (o->kind == op_kind::cancel) {
      // The target may have finished while this request waited in the backlog.
      op* target = o->target;
      if (!holds(target) || target->status != o->status) {
        release_cancel(o);
        return true;
      }
    }
    io_uring_sqe* sqe = nullptr;
    if (o->linked_deadline) {
      // Both in one submission: a link cut at a submission's end would lose the deadline.
      if (::io_uring_sq_space_left(&ring_) < 2) flush();
      if (::io_uring_sq_space_left(&ring_) < 2) return false;
      sqe = ::io_uring_get_sqe(&ring_);
    } else {
      sqe = next_sqe();
    }
    if (sqe == nullptr) return false;
    o->handlers->prepare(sqe, o);
    ::io_uring_sqe_set_data(sqe, o);
    if (o->linked_deadline) {
      sqe->flags |= IOSQE_IO_LINK;
      io_uring_sqe* timeout = ::io_uring_get_sqe(&ring_);
      ::io_uring_prep_link_timeout(timeout, &o->deadline, IORING_TIMEOUT_ABS);
      ::io_uring_sqe_set_data64(timeout, linked_deadline_data);
      ++deadlines_in_flight_;
    }
    if (submit_batch_ != 0 && ::io_uring_sq_ready(&ring_) >= submit_batch_) flush();
    admit(o);
    return true;
  }

  std::size_t reap(std::size_t budget) noexcept {
    std::size_t handled = 0;
    io_uring_cqe* batch[64];
    while (handled < budget) {
      const auto want = static_cast<unsigned>(std::min<std::size_t>(64, budget - handled));
      const unsigned n = ::io_uring_peek_batch_cqe(&ring_, batch, want);
      if (n == 0) break;
      // One clock read for the batch's metrics: each of its operations ended by now.
      if (meter_.attached()) reaped_ns_ = ferry::metrics::now_ns();
      struct entry {
        std::uint64_t data;
        int res;
      } taken[64];
      for (unsigned i = 0; i < n; ++i) taken[i] = {batch[i]->user_data, batch[i]->res};
      // Give the entries back before completing anything: a completion may resume a coroutine
      // inline, which may submit more.
      ::io_uring_cq_advance(&ring_, n);
      // Counted before any of them completes, so a caller that sees its transfer end (complete()
      // publishes with release) reads a count that includes it.
      completed_.fetch_add(n, std::memory_order_relaxed);
      for (unsigned i = 0; i < n; ++i) {
        if (taken[i].data == 0) {  // a cancel made by cancel_everything() (teardown.hpp)
          --cancels_in_flight_;
          continue;
        }
        if (taken[i].data == linked_deadline_data) {  // its operation ends by its own completion
          --deadlines_in_flight_;
          continue;
        }
        complete(reinterpret_cast<op*>(taken[i].data), taken[i].res);
        // Work submitted by a continuation resumed inline is prepared now, not after the rest of
        // the batch, and goes to the kernel as soon as it makes up a call of submit_batch (issue()
        // flushes then; poll() flushes what is left after the batch). A device given requests
        // early keeps more of them in flight; the next continuation's request, a moment later,
        // shares the call, which halves the calls where the CPU is the limit.
        if (!incoming_.empty()) take_incoming();
      }
      handled += n;
    }
    reaped_ns_ = 0;
    return handled;
  }

  // The CQE of `o`: its room comes back, then its kind goes on with it or ends it.
  void complete(op* o, int res) noexcept {
    retire(o);
    o->handlers->complete(*this, o, res);
  }

  // --- Ending operations. ---

  void finish(op* o, transfer_state to, std::error_code ec) noexcept {
    status_block* s = o->status;
    connection_state* c = o->connection;
    // Written before complete() publishes the state (release), so a caller that sees the transfer
    // terminal reads the count.
    if (o->transferred != nullptr) *o->transferred = o->done;
    // A severed connection's operations that do not succeed end with the reason it was given.
    if (c != nullptr && to != transfer_state::success) {
      if (const std::error_code why = c->severed()) {
        to = transfer_state::failed;
        ec = why;
      }
    }
    if (o->published_ns != 0) record(o, to);
    op::pool::release(o);
    s->complete(to, ec);
    s->release_completer_ref();
    if (c != nullptr) c->release();
  }

  // A cancel took effect. `cancelled` promises that nothing happened: a read or write that had
  // already moved bytes (part of a stream consumed, part of a file written) fails instead, saying
  // so, with the count in its `transferred`.
  void finish_cancelled(op* o) noexcept {
    if (o->done == 0) return finish(o, transfer_state::cancelled, {});
    finish(o, transfer_state::failed, make_error_code(errc::cancelled_part_way));
  }

  void record(const op* o, transfer_state to) noexcept {
    if (o->kind > op_kind::receive) return;  // metered: read through receive (meter())
    std::uint64_t bytes = o->done;
    if (o->kind == op_kind::send) bytes = o->parts[1].iov_len;
    if (o->kind == op_kind::receive) bytes = o->received != nullptr ? o->received->length : 0;
    // In a reaped batch, the batch's clock read. That also times an operation that ends without a
    // completion of its own while the batch is handled (a backlogged one cancelled by a continuation
    // resumed inline, say); one published after the read and ended within the batch counts as
    // taking no time.
    // Sends and receives also count for their connection's peer (0 and 1 of its figures).
    connection_state* c = o->connection;
    ferry::metrics::op_metrics* no_peer = nullptr;
    meter_.record_cached(static_cast<std::size_t>(o->kind), o->published_ns, bytes,
                         to == transfer_state::success,
                         c != nullptr ? c->peer_metrics[o->kind == op_kind::send ? 0 : 1] : no_peer,
                         c != nullptr ? std::string_view(c->peer) : std::string_view(), reaped_ns_);
  }

  // Never reached the kernel, and the ring is shutting down.
  void refuse(op* o) noexcept { o->handlers->refuse(*this, o); }

  static void release_cancel(op* c) noexcept {
    c->status->release_transfer_ref();
    op::pool::release(c);
  }

  progress_executor& exec_;
  io_uring ring_{};
  unsigned submit_batch_ = 2;
  bool deferred_ = false;    // SINGLE_ISSUER | DEFER_TASKRUN, the executor thread the issuer
  int due_fd_ = -1;          // deferred: the eventfd the kernel signals when completions are due
  bool signalling_ = false;  // deferred: due_fd_ switched on, for a park

  // Submitters push here; the executor takes the whole stack at once.
  ferry::detail::submission_stack<op> incoming_;

  // The executor thread's state (besides admission's).
  op_queue<op> calls_;        // on_executor() calls taken, run at the end of the round
  op* closing_op_ = nullptr;  // made by the ring's constructor for its destructor
  transfer closed_;           // its transfer: done once the executor has finished the ring
  op* closing_ = nullptr;     // the executor's: the destructor's op while it finishes the ring
  bool shutting_down_ = false;
  connection_list connections_;

  // Open tcp_connection handles, checked by the ring's destructor.
  std::atomic<int> open_connections_{0};

  std::atomic<std::uint64_t> submitted_{0};
  std::atomic<std::uint64_t> submit_calls_{0};
  std::atomic<std::uint64_t> completed_{0};
  std::atomic<std::uint64_t> resubmitted_{0};
  std::atomic<std::uint64_t> backlogged_{0};

  // Kinds by op_kind, read through receive; attached before the first publish, then recorded into by
  // the executor.
  ferry::metrics::backend_meter meter_;
  std::uint64_t reaped_ns_ = 0;  // while reap() completes a metered batch: when it was taken
};

// The arrival of an operation that goes to the kernel as it comes (or waits for room).
inline void start_on_arrival(engine& e, op* o) noexcept { e.start(o); }

// Refused: it fails with ferry::errc::backend_shut_down.
inline void fail_shut_down(engine& e, op* o) noexcept {
  e.finish(o, transfer_state::failed, make_error_code(ferry::errc::backend_shut_down));
}

}  // namespace ferry::uring::detail

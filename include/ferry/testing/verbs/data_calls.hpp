#pragma once
// The fake fabric's data path verbs, as provider (provider.hpp) forwards them: posting sends and
// receives, polling and arming completion queues, taking completion and asynchronous events.

#include <infiniband/verbs.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include <sys/eventfd.h>
#include <unistd.h>

#include "ferry/testing/verbs/object_calls.hpp"
#include "ferry/testing/verbs/objects.hpp"

namespace ferry::verbs::fake {

class data_calls : protected object_calls {
 protected:
  // The verbs of the data path, as provider forwards them.

  int req_notify_cq(cq* c, bool solicited_only) {
    std::lock_guard lock(mutex_);
    c->armed_ = true;
    c->solicited_only_ = solicited_only;
    return 0;
  }

  int get_cq_event(channel* ch, cq*& out) {
    std::lock_guard lock(mutex_);
    if (ch->events_.empty()) return EAGAIN;
    out = ch->events_.front();
    ch->events_.pop_front();
    unsignal(ch->fd_, 1);
    ++out->events_taken_;
    return 0;
  }

  void ack_cq_events(cq* c, unsigned n) {
    std::lock_guard lock(mutex_);
    c->events_acked_ += n;
  }

  int poll_cq(cq* c, int n, ibv_wc* wc) {
    // Acquire pairs with the release stores under the mutex; a completion pushed after this look
    // is found by the next poll (and an armed CQ raises its event for it).
    if (c->ready_.load(std::memory_order_acquire) == 0) return 0;
    std::lock_guard lock(mutex_);
    int got = 0;
    for (; got < n && !c->entries_.empty(); ++got) {
      const completion& e = c->entries_.front();
      wc[got] = e.wc;
      qp& q = *e.owner;
      if (e.send) {
        while (!q.sq_.empty() && q.sq_.front().seq <= e.seq) q.sq_.pop_front();
      } else {
        --q.receives_outstanding_;
      }
      c->entries_.pop_front();
    }
    c->ready_.store(c->entries_.size(), std::memory_order_release);
    return got;
  }

  int post_send(qp* q, ibv_send_wr* wr, ibv_send_wr** bad) {
    std::lock_guard lock(mutex_);
    for (; wr != nullptr; wr = wr->next) {
      const int err = admit(*q, *wr);
      if (err != 0) {
        *bad = wr;
        wake();
        return err;
      }
    }
    wake();
    return 0;
  }

  int admit(qp& q, const ibv_send_wr& wr) {
    if (dead(*q.pd_->context_)) return EIO;
    if (q.state_ != IBV_QPS_RTS && q.state_ != IBV_QPS_ERR) return EINVAL;
    const bool known = wr.opcode == IBV_WR_RDMA_WRITE || wr.opcode == IBV_WR_RDMA_WRITE_WITH_IMM ||
                       wr.opcode == IBV_WR_RDMA_READ || wr.opcode == IBV_WR_SEND ||
                       wr.opcode == IBV_WR_SEND_WITH_IMM;
    const bool inlined = (wr.send_flags & IBV_SEND_INLINE) != 0;
    if (!known || !valid_sges(wr.sg_list, wr.num_sge, q.cap_.max_send_sge) ||
        (inlined && wr.opcode == IBV_WR_RDMA_READ)) {
      return EINVAL;
    }
    send_request w;
    w.sges.assign(wr.sg_list, wr.sg_list + wr.num_sge);
    for (const ibv_sge& s : w.sges) w.length += s.length;
    if (inlined && w.length > q.cap_.max_inline_data) return EINVAL;
    if (q.sq_.size() >= q.cap_.max_send_wr) return ENOMEM;
    if (inlined) {
      w.inline_data.resize(w.length);
      std::size_t at = 0;
      for (const ibv_sge& s : w.sges) {
        copy(w.inline_data.data() + at, to_pointer(s.addr), s.length);
        at += s.length;
      }
      w.sges.clear();
    }
    w.seq = q.next_seq_++;
    w.wr_id = wr.wr_id;
    w.opcode = wr.opcode;
    w.flags = wr.send_flags;
    w.remote_addr = wr.wr.rdma.remote_addr;
    w.rkey = wr.wr.rdma.rkey;
    w.imm = wr.imm_data;
    q.sq_.push_back(std::move(w));
    posted_send_wrs_.fetch_add(1, std::memory_order_relaxed);
    return 0;
  }

  static bool valid_sges(const ibv_sge* list, int n, std::uint32_t max) {
    return n >= 0 && static_cast<std::uint32_t>(n) <= max && (n == 0 || list != nullptr);
  }

  int post_recv(qp* q, ibv_recv_wr* wr, ibv_recv_wr** bad) {
    std::lock_guard lock(mutex_);
    for (; wr != nullptr; wr = wr->next) {
      int err = 0;
      if (dead(*q->pd_->context_)) {
        err = EIO;
      } else if (q->state_ == IBV_QPS_RESET ||
                 !valid_sges(wr->sg_list, wr->num_sge, q->cap_.max_recv_sge)) {
        err = EINVAL;
      } else if (q->receives_outstanding_ >= q->cap_.max_recv_wr) {
        err = ENOMEM;
      }
      if (err != 0) {
        *bad = wr;
        wake();
        return err;
      }
      q->rq_.push_back(receive_request{wr->wr_id, {wr->sg_list, wr->sg_list + wr->num_sge}});
      ++q->receives_outstanding_;
    }
    wake();
    return 0;
  }

  int get_async_event(context* c, event& out) {
    std::lock_guard lock(mutex_);
    if (c->events_.empty()) return EAGAIN;
    out = c->events_.front();
    if (out.qp != nullptr) out.qp_num = out.qp->num_;  // alive: destroying it drops its events
    c->events_.pop_front();
    unsignal(c->async_fd_, 1);
    return 0;
  }
};

}  // namespace ferry::verbs::fake

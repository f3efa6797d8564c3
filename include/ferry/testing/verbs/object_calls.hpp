#pragma once
// The fake fabric's verbs that make, query, change and destroy objects (devices' contexts,
// protection domains, memory regions, completion channels and queues, queue pairs), as provider
// (provider.hpp) forwards them. Queue pair transitions demand exactly the kernel's masks.

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

#include "ferry/testing/fake_dmabuf.hpp"
#include "ferry/testing/verbs/nic.hpp"
#include "ferry/testing/verbs/objects.hpp"

namespace ferry::verbs::fake {

class object_calls : protected nic {
 protected:
  // The attribute masks a transition requires and allows besides IBV_QP_STATE, from the kernel's
  // table for RC queue pairs.
  struct transition {
    bool valid = false;
    int required = 0;
    int optional = 0;
  };

  static transition rule(ibv_qp_state from, ibv_qp_state to) {
    if (to == IBV_QPS_RESET || to == IBV_QPS_ERR) return {true, 0, 0};
    if (from == IBV_QPS_RESET && to == IBV_QPS_INIT) {
      return {true, IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS, 0};
    }
    if (from == IBV_QPS_INIT && to == IBV_QPS_INIT) {
      return {true, 0, IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS};
    }
    if (from == IBV_QPS_INIT && to == IBV_QPS_RTR) {
      return {true,
              IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                  IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER,
              IBV_QP_ALT_PATH | IBV_QP_ACCESS_FLAGS | IBV_QP_PKEY_INDEX};
    }
    if (from == IBV_QPS_RTR && to == IBV_QPS_RTS) {
      return {true,
              IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                  IBV_QP_MAX_QP_RD_ATOMIC,
              IBV_QP_CUR_STATE | IBV_QP_ALT_PATH | IBV_QP_ACCESS_FLAGS | IBV_QP_MIN_RNR_TIMER |
                  IBV_QP_PATH_MIG_STATE};
    }
    if (from == IBV_QPS_RTS && to == IBV_QPS_RTS) {
      return {true, 0,
              IBV_QP_CUR_STATE | IBV_QP_ACCESS_FLAGS | IBV_QP_ALT_PATH | IBV_QP_PATH_MIG_STATE |
                  IBV_QP_MIN_RNR_TIMER};
    }
    return {};
  }

  // The verbs, as provider forwards them.

  std::vector<std::string> device_names() const {
    std::lock_guard lock(mutex_);
    std::vector<std::string> names;
    for (const auto& d : devices_) names.push_back(d->name_);
    return names;
  }

  context* open_device(const std::string& name) {
    std::lock_guard lock(mutex_);
    device* d = find_device(name);
    if (d == nullptr || d->fatal_) {
      errno = d == nullptr ? ENODEV : EIO;
      return nullptr;
    }
    const int fd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK | EFD_SEMAPHORE);
    if (fd < 0) return nullptr;
    auto c = std::make_unique<context>();
    c->device_ = d;
    c->async_fd_ = fd;
    ++d->open_contexts_;
    return keep(contexts_, std::move(c));
  }

  void close_device(context* c) {
    std::lock_guard lock(mutex_);
    if (c->users_ != 0) {
      errno = EBUSY;
      return;
    }
    ::close(c->async_fd_);
    device& d = *c->device_;
    discard(contexts_, c);
    if (--d.open_contexts_ == 0) {
      d.port_up_ = true;
      d.fatal_ = false;
    }
  }

  int query_port(const context* c, std::uint8_t port, ibv_port_attr& out) const {
    std::lock_guard lock(mutex_);
    if (dead(*c)) return EIO;
    if (port != 1) return EINVAL;
    const device& d = *c->device_;
    out = ibv_port_attr{};
    out.state = d.port_up_ ? IBV_PORT_ACTIVE : IBV_PORT_DOWN;
    out.max_mtu = IBV_MTU_4096;
    out.active_mtu = IBV_MTU_4096;
    out.gid_tbl_len = 1;
    out.max_msg_sz = 1u << 31;
    out.pkey_tbl_len = 1;
    out.lid = d.lid_;
    out.sm_lid = 1;
    out.max_vl_num = 1;
    out.active_width = 2;              // 4x
    out.active_speed = 32;             // EDR
    out.phys_state = d.port_up_ ? 5 : 3;  // LinkUp, Disabled
    out.link_layer = IBV_LINK_LAYER_INFINIBAND;
    return 0;
  }

  int query_gid(const context* c, std::uint8_t port, int index, ibv_gid& out) const {
    std::lock_guard lock(mutex_);
    if (dead(*c)) return EIO;
    if (port != 1 || index != 0) return EINVAL;
    out = ibv_gid{};
    return 0;
  }

  pd* alloc_pd(context* c) {
    std::lock_guard lock(mutex_);
    if (dead(*c)) {
      errno = EIO;
      return nullptr;
    }
    auto p = std::make_unique<pd>();
    p->context_ = c;
    ++c->users_;
    return keep(pds_, std::move(p));
  }

  void dealloc_pd(pd* p) {
    std::lock_guard lock(mutex_);
    if (p->users_ != 0) {
      errno = EBUSY;
      return;
    }
    --p->context_->users_;
    discard(pds_, p);
  }

  // As the kernel refuses them: remote write or atomic rights without local write.
  static bool remote_needs_local(int access) {
    return (access & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC)) != 0 &&
           (access & IBV_ACCESS_LOCAL_WRITE) == 0;
  }

  mr* reg_mr(pd* p, void* addr, std::size_t length, int access) {
    std::lock_guard lock(mutex_);
    if (addr == nullptr || length == 0 || remote_needs_local(access)) {
      errno = EINVAL;
      return nullptr;
    }
    const auto base = reinterpret_cast<std::uintptr_t>(addr);
    return make_mr(p, base, base, length, access);
  }

  // The memory behind the fake dma-buf `fd` (ferry/testing/fake_dmabuf.hpp), from `offset` on, as
  // the kernel's ib_umem_dmabuf_get checks it: a descriptor that is no dma-buf's fails with EBADF,
  // a range past the dma-buf's size with EINVAL. Work requests address it from `iova` on.
  mr* reg_dmabuf_mr(pd* p, std::uint64_t offset, std::size_t length, std::uint64_t iova, int fd,
                    int access) {
    // The registry has its own lock, never held while it calls out: looked up before ours.
    const auto exported = ferry::testing::fake_dmabuf::lookup(fd);
    std::lock_guard lock(mutex_);
    if (!exported) {
      errno = EBADF;
      return nullptr;
    }
    if (length == 0 || offset > exported->length || length > exported->length - offset ||
        iova > UINT64_MAX - length || remote_needs_local(access)) {
      errno = EINVAL;
      return nullptr;
    }
    const auto base = reinterpret_cast<std::uintptr_t>(exported->base) +
                      static_cast<std::uintptr_t>(offset);
    return make_mr(p, base, iova, length, access);
  }

  // Under the fabric's mutex.
  mr* make_mr(pd* p, std::uintptr_t base, std::uint64_t iova, std::size_t length, int access) {
    if (dead(*p->context_)) {
      errno = EIO;
      return nullptr;
    }
    auto m = std::make_unique<mr>();
    m->pd_ = p;
    m->base_ = base;
    m->iova_ = iova;
    m->length_ = length;
    m->access_ = access;
    m->lkey_ = next_key();
    m->rkey_ = next_key();
    by_lkey_[m->lkey_] = m.get();
    by_rkey_[m->rkey_] = m.get();
    ++p->users_;
    return keep(mrs_, std::move(m));
  }

  int dereg_mr(mr* m) {
    std::lock_guard lock(mutex_);
    by_lkey_.erase(m->lkey_);
    by_rkey_.erase(m->rkey_);
    --m->pd_->users_;
    discard(mrs_, m);
    return 0;
  }

  channel* create_comp_channel(context* c) {
    std::lock_guard lock(mutex_);
    if (dead(*c)) {
      errno = EIO;
      return nullptr;
    }
    const int fd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK | EFD_SEMAPHORE);
    if (fd < 0) return nullptr;
    auto ch = std::make_unique<channel>();
    ch->context_ = c;
    ch->fd_ = fd;
    ++c->users_;
    return keep(channels_, std::move(ch));
  }

  int destroy_comp_channel(channel* ch) {
    std::lock_guard lock(mutex_);
    if (ch->users_ != 0) return EBUSY;
    ::close(ch->fd_);
    --ch->context_->users_;
    discard(channels_, ch);
    return 0;
  }

  cq* create_cq(context* c, int entries, channel* ch) {
    std::lock_guard lock(mutex_);
    if (entries > max_cqe || (ch != nullptr && ch->context_ != c)) {
      errno = EINVAL;
      return nullptr;
    }
    if (dead(*c)) {
      errno = EIO;
      return nullptr;
    }
    auto q = std::make_unique<cq>();
    q->context_ = c;
    q->channel_ = ch;
    q->capacity_ = static_cast<std::size_t>(std::max(entries, 1));
    ++c->users_;
    if (ch != nullptr) ++ch->users_;
    return keep(cqs_, std::move(q));
  }

  int destroy_cq(cq* c) {
    std::lock_guard lock(mutex_);
    if (c->users_ != 0 || c->events_taken_ != c->events_acked_) return EBUSY;
    if (channel* ch = c->channel_) {
      unsignal(ch->fd_, std::erase(ch->events_, c));
      --ch->users_;
    }
    forget_events(*c->context_, [c](const event& e) { return e.cq == c; });
    --c->context_->users_;
    discard(cqs_, c);
    return 0;
  }

  qp* create_qp(pd* p, cq* send_cq, cq* recv_cq, ibv_qp_cap& cap) {
    std::lock_guard lock(mutex_);
    if (send_cq == nullptr || recv_cq == nullptr || send_cq->context_ != p->context_ ||
        recv_cq->context_ != p->context_ || cap.max_send_wr == 0) {
      errno = EINVAL;
      return nullptr;
    }
    if (dead(*p->context_)) {
      errno = EIO;
      return nullptr;
    }
    auto q = std::make_unique<qp>();
    q->pd_ = p;
    q->send_cq_ = send_cq;
    q->recv_cq_ = recv_cq;
    q->num_ = next_qpn_++;
    q->cap_.max_send_wr = std::min(cap.max_send_wr, max_wr);
    q->cap_.max_recv_wr = std::min(cap.max_recv_wr, max_wr);
    q->cap_.max_send_sge = std::clamp(cap.max_send_sge, 1u, max_sge);
    q->cap_.max_recv_sge = std::clamp(cap.max_recv_sge, 1u, max_sge);
    q->cap_.max_inline_data = std::min(cap.max_inline_data, max_inline);
    cap = q->cap_;
    ++p->users_;
    ++send_cq->users_;
    ++recv_cq->users_;
    by_qpn_[q->num_] = q.get();
    return keep(qps_, std::move(q));
  }

  int destroy_qp(qp* q) {
    std::lock_guard lock(mutex_);
    forget_completions(*q);
    forget_events(*q->pd_->context_, [q](const event& e) { return e.qp == q; });
    --q->pd_->users_;
    --q->send_cq_->users_;
    --q->recv_cq_->users_;
    by_qpn_.erase(q->num_);
    discard(qps_, q);
    return 0;
  }

  int modify_qp(qp* q, const ibv_qp_attr& attr, int mask) {
    std::lock_guard lock(mutex_);
    if (dead(*q->pd_->context_)) return EIO;
    const ibv_qp_state to = (mask & IBV_QP_STATE) != 0 ? attr.qp_state : q->state_;
    const transition t = rule(q->state_, to);
    if (!t.valid || (mask & t.required) != t.required ||
        (mask & ~(t.required | t.optional | IBV_QP_STATE)) != 0) {
      return EINVAL;
    }
    // One port, and a partition key table holding only the default key.
    if (((mask & IBV_QP_PORT) != 0 && attr.port_num != 1) ||
        ((mask & IBV_QP_PKEY_INDEX) != 0 && attr.pkey_index != 0)) {
      return EINVAL;
    }
    if (to == IBV_QPS_RTR) {
      if (peer(attr.ah_attr.dlid, attr.dest_qp_num) == nullptr) return EINVAL;
      q->dest_lid_ = attr.ah_attr.dlid;
      q->dest_qpn_ = attr.dest_qp_num;
    }
    if ((mask & IBV_QP_MAX_DEST_RD_ATOMIC) != 0) q->max_dest_rd_atomic_ = attr.max_dest_rd_atomic;
    if ((mask & IBV_QP_MAX_QP_RD_ATOMIC) != 0) q->max_rd_atomic_ = attr.max_rd_atomic;
    if ((mask & IBV_QP_ACCESS_FLAGS) != 0) q->access_ = attr.qp_access_flags;
    if (to == IBV_QPS_RESET) {
      forget_completions(*q);
      q->sq_.clear();
      q->next_exec_ = q->next_seq_;
      q->rq_.clear();
      q->receives_outstanding_ = 0;
      q->access_ = 0;
    }
    q->state_ = to;
    wake();
    return 0;
  }
};

}  // namespace ferry::verbs::fake

#pragma once
// The fake fabric's NIC: a thread that executes posted send work requests asynchronously, in post
// order per queue pair, with the fabric's mutex held, copies included: it checks keys as the
// adapter does, moves the bytes, consumes the responder's receives and pushes the completions.

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

#include "ferry/testing/verbs/fabric_state.hpp"

namespace ferry::verbs::fake {

class nic : protected fabric_state {
 protected:
  nic() : nic_([this] { run_nic(); }) {}

  void stop_nic() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    nic_wake_.notify_one();
    nic_.join();
  }

  // Sleeps until something changed, then executes until nothing more can move.
  void run_nic() {
    std::unique_lock lock(mutex_);
    std::uint64_t seen = 0;  // not generation_: work posted before this thread ran is not missed
    for (;;) {
      nic_wake_.wait(lock, [&] { return stop_ || (!paused_ && generation_ != seen); });
      if (stop_) return;
      seen = generation_;
      for (bool moved = true; moved;) {
        moved = false;
        for (const auto& q : qps_) moved = advance(*q) || moved;
      }
    }
  }

  bool advance(qp& q) {
    const device& d = *q.pd_->context_->device_;
    if (d.fatal_) return false;
    bool moved = false;
    if (q.state_ == IBV_QPS_ERR) {
      while (q.next_exec_ < q.next_seq_) {
        retire(q, IBV_WC_WR_FLUSH_ERR);
        moved = true;
      }
      while (!q.rq_.empty()) {
        ibv_wc wc{};
        wc.wr_id = q.rq_.front().wr_id;
        wc.status = IBV_WC_WR_FLUSH_ERR;
        wc.opcode = IBV_WC_RECV;
        wc.qp_num = q.num_;
        q.rq_.pop_front();
        push(*q.recv_cq_, completion{wc, &q, 0, false}, false);
        moved = true;
      }
      return moved;
    }
    while (q.state_ == IBV_QPS_RTS && d.port_up_ && q.next_exec_ < q.next_seq_ && execute(q)) {
      moved = true;
    }
    return moved;
  }

  // Executes the queue pair's next send request; false when it has to wait.
  bool execute(qp& q) {
    const send_request& w = q.sq_[q.next_exec_ - q.sq_.front().seq];
    const bool reads = w.opcode == IBV_WR_RDMA_READ;
    if ((w.flags & IBV_SEND_INLINE) == 0 && !local_access(*q.pd_, w.sges, reads)) {
      retire(q, IBV_WC_LOC_PROT_ERR);
      return true;
    }
    qp* r = peer(q.dest_lid_, q.dest_qpn_);
    if (r != nullptr) {
      const device& rd = *r->pd_->context_->device_;
      if (!rd.port_up_ || rd.fatal_) return false;
    }
    if (r == nullptr || (r->state_ != IBV_QPS_RTR && r->state_ != IBV_QPS_RTS)) {
      retire(q, IBV_WC_RETRY_EXC_ERR);
      return true;
    }
    std::vector<std::byte> staging;
    if (w.opcode == IBV_WR_SEND || w.opcode == IBV_WR_SEND_WITH_IMM) {
      if (r->rq_.empty()) return false;
      retire(q, deliver(q, *r, w, staging));
      return true;
    }
    if (reads && reads_in_flight(q) > r->max_dest_rd_atomic_) {
      // The requester pipelines up to its max_rd_atomic READs; a responder that accepts fewer
      // answers the excess with an invalid-request NAK, and both go to the error state.
      retire(q, IBV_WC_REM_INV_REQ_ERR);
      r->state_ = IBV_QPS_ERR;
      post_event(*r->pd_->context_, event{IBV_EVENT_QP_REQ_ERR, r, nullptr, 0});
      return true;
    }
    if (!remote_access(*r, w, reads ? IBV_ACCESS_REMOTE_READ : IBV_ACCESS_REMOTE_WRITE)) {
      retire(q, IBV_WC_REM_ACCESS_ERR);
      r->state_ = IBV_QPS_ERR;
      post_event(*r->pd_->context_, event{IBV_EVENT_QP_ACCESS_ERR, r, nullptr, 0});
      return true;
    }
    if (reads) {
      scatter({remote_pointer(w), w.length}, w.sges);
    } else {
      if (w.opcode == IBV_WR_RDMA_WRITE_WITH_IMM && r->rq_.empty()) return false;
      const std::span<const std::byte> data = payload(w, staging);
      copy(remote_pointer(w), data.data(), data.size());
      if (w.opcode == IBV_WR_RDMA_WRITE_WITH_IMM) deliver(q, *r, w, staging);
    }
    retire(q, IBV_WC_SUCCESS);
    return true;
  }

  // The READs a real adapter would have out at once from here: those queued to execute, up to the
  // requester's max_rd_atomic (at least the one about to go).
  static std::size_t reads_in_flight(const qp& q) {
    const std::size_t cap = std::max<std::size_t>(q.max_rd_atomic_, 1);
    std::size_t n = 0;
    for (std::size_t i = q.next_exec_ - q.sq_.front().seq; i < q.sq_.size() && n < cap; ++i) {
      if (q.sq_[i].opcode == IBV_WR_RDMA_READ) ++n;
    }
    return n;
  }

  // Consumes the responder's oldest receive for `w` (a SEND lands in its buffers; an RDMA WRITE
  // with immediate only uses it up) and completes it. Returns what the requester learns: the
  // responder answers a receive it may not write with a remote operational error NAK, and one too
  // short with an invalid request NAK, and goes to the error state.
  ibv_wc_status deliver(const qp& q, qp& r, const send_request& w,
                        std::vector<std::byte>& staging) {
    const receive_request& rr = r.rq_.front();
    ibv_wc wc{};
    wc.wr_id = rr.wr_id;
    wc.opcode = IBV_WC_RECV;
    wc.byte_len = static_cast<std::uint32_t>(w.length);
    wc.qp_num = r.num_;
    wc.src_qp = q.num_;
    wc.slid = q.pd_->context_->device_->lid_;
    if (w.opcode == IBV_WR_SEND_WITH_IMM || w.opcode == IBV_WR_RDMA_WRITE_WITH_IMM) {
      wc.wc_flags = IBV_WC_WITH_IMM;
      wc.imm_data = w.imm;
    }
    ibv_wc_status nak = IBV_WC_SUCCESS;
    if (w.opcode == IBV_WR_RDMA_WRITE_WITH_IMM) {
      wc.opcode = IBV_WC_RECV_RDMA_WITH_IMM;
    } else if (!local_access(*r.pd_, rr.sges, true)) {
      wc.status = IBV_WC_LOC_PROT_ERR;
      nak = IBV_WC_REM_OP_ERR;
    } else if (w.length > capacity(rr.sges)) {
      wc.status = IBV_WC_LOC_LEN_ERR;
      nak = IBV_WC_REM_INV_REQ_ERR;
    } else {
      scatter(payload(w, staging), rr.sges);
    }
    if (nak != IBV_WC_SUCCESS) r.state_ = IBV_QPS_ERR;
    r.rq_.pop_front();
    push(*r.recv_cq_, completion{wc, &r, 0, false}, (w.flags & IBV_SEND_SOLICITED) != 0);
    return nak;
  }

  // Completes the queue pair's next request to execute with `status`. Errors always produce a
  // completion and move the queue pair to the error state; a success only when signalled.
  void retire(qp& q, ibv_wc_status status) {
    const send_request& w = q.sq_[q.next_exec_ - q.sq_.front().seq];
    ++q.next_exec_;
    if (status != IBV_WC_SUCCESS) q.state_ = IBV_QPS_ERR;
    if (status == IBV_WC_SUCCESS && (w.flags & IBV_SEND_SIGNALED) == 0) return;
    ibv_wc wc{};
    wc.wr_id = w.wr_id;
    wc.status = status;
    wc.opcode = wc_opcode(w.opcode);
    wc.byte_len = static_cast<std::uint32_t>(w.length);
    wc.qp_num = q.num_;
    push(*q.send_cq_, completion{wc, &q, w.seq, true}, false);
  }

  static ibv_wc_opcode wc_opcode(ibv_wr_opcode opcode) {
    switch (opcode) {
      case IBV_WR_RDMA_READ:
        return IBV_WC_RDMA_READ;
      case IBV_WR_SEND:
      case IBV_WR_SEND_WITH_IMM:
        return IBV_WC_SEND;
      default:
        return IBV_WC_RDMA_WRITE;
    }
  }

  static std::size_t capacity(const std::vector<ibv_sge>& sges) {
    std::size_t n = 0;
    for (const ibv_sge& s : sges) n += s.length;
    return n;
  }

  static std::byte* to_pointer(std::uint64_t address) {
    return reinterpret_cast<std::byte*>(static_cast<std::uintptr_t>(address));
  }

  // memmove, as a loopback request may copy within one buffer.
  static void copy(std::byte* to, const std::byte* from, std::size_t n) {
    if (n != 0) std::memmove(to, from, n);
  }

  static bool covers(const mr& m, std::uint64_t address, std::uint64_t length) {
    return address >= m.iova_ && length <= m.length_ && address - m.iova_ <= m.length_ - length;
  }

  // Where `address`, inside region `m`, is in this process: a region registered through a dma-buf
  // is addressed by the iova its owner chose, not by where its bytes are.
  static std::byte* host_pointer(const mr& m, std::uint64_t address) {
    return to_pointer(m.base_ + static_cast<std::uintptr_t>(address - m.iova_));
  }

  // The local bytes of entry `s`, whose key local_access has checked.
  std::byte* local_pointer(const ibv_sge& s) const {
    const auto it = by_lkey_.find(s.lkey);
    return it == by_lkey_.end() ? to_pointer(s.addr) : host_pointer(*it->second, s.addr);
  }

  // The responder's bytes that `w` names, checked by remote_access (a zero-length request names
  // none, and may carry any key).
  std::byte* remote_pointer(const send_request& w) const {
    const auto it = by_rkey_.find(w.rkey);
    if (w.length == 0 || it == by_rkey_.end()) return to_pointer(w.remote_addr);
    return host_pointer(*it->second, w.remote_addr);
  }

  bool local_access(const pd& p, const std::vector<ibv_sge>& sges, bool write) const {
    return std::all_of(sges.begin(), sges.end(), [&](const ibv_sge& s) {
      const auto it = by_lkey_.find(s.lkey);
      if (it == by_lkey_.end()) return false;
      const mr& m = *it->second;
      return m.pd_ == &p && covers(m, s.addr, s.length) &&
             (!write || (m.access_ & IBV_ACCESS_LOCAL_WRITE) != 0);
    });
  }

  // Whether the responder lets `w` touch its memory with `right`. A zero-length request carries no
  // rkey worth checking, as in the InfiniBand specification.
  bool remote_access(const qp& r, const send_request& w, int right) const {
    if (w.length == 0) return true;
    if ((r.access_ & static_cast<unsigned>(right)) == 0) return false;
    const auto it = by_rkey_.find(w.rkey);
    if (it == by_rkey_.end()) return false;
    const mr& m = *it->second;
    return m.pd_ == r.pd_ && (m.access_ & right) != 0 && covers(m, w.remote_addr, w.length);
  }

  // The request's data in one piece: the inline copy, the only entry, or the entries gathered.
  std::span<const std::byte> payload(const send_request& w, std::vector<std::byte>& staging) const {
    if ((w.flags & IBV_SEND_INLINE) != 0) return w.inline_data;
    if (w.sges.size() == 1) return {local_pointer(w.sges[0]), w.length};
    staging.resize(w.length);
    std::size_t at = 0;
    for (const ibv_sge& s : w.sges) {
      copy(staging.data() + at, local_pointer(s), s.length);
      at += s.length;
    }
    return staging;
  }

  void scatter(std::span<const std::byte> data, const std::vector<ibv_sge>& sges) const {
    std::size_t at = 0;
    for (const ibv_sge& s : sges) {
      const std::size_t n = std::min<std::size_t>(s.length, data.size() - at);
      copy(local_pointer(s), data.data() + at, n);
      at += n;
    }
  }

  std::thread nic_;  // last, so that it starts once everything it reads is constructed
};

}  // namespace ferry::verbs::fake

#pragma once
// An in-process RDMA fabric behind the same calls as real_provider (provider.hpp), so the verbs
// backend's logic is tested without an adapter or libibverbs (only <infiniband/verbs.h>'s structures
// are used). Tests create devices and inject faults through fabric::instance().
//
// What it models, as RC hardware behaves. A "NIC" thread executes posted send work requests
// asynchronously, in post order per queue pair, copying real memory (RDMA WRITE and READ, SEND and
// SEND_WITH_IMM into the peer's oldest posted receive, RDMA_WRITE_WITH_IMM) and pushing completions
// into completion queues out of band. Keys are checked as the adapter checks them: the lkey's region
// must belong to the queue pair's protection domain and cover the scatter/gather entry; the rkey's
// region and the responder queue pair must both grant the remote right, or the requester gets
// IBV_WC_REM_ACCESS_ERR and both queue pairs go to the error state (the responder with an
// IBV_EVENT_QP_ACCESS_ERR). A SEND with no receive posted waits for one (rnr_retry 7). A queue pair in
// the error state flushes what it has not executed, unsignalled requests included. Queue pair
// transitions demand exactly the kernel's required and allowed attribute masks. A send request, and a
// receive, stays outstanding until the poller polls its completion or, for sends, a later one of the
// same queue pair: the depth a queue pair was granted is a real limit. A completion queue has the
// capacity asked for and goes into error when it would overrun. Arming a completion queue fires one
// event, for the next completion only. Destroying an object that another live object uses fails with
// EBUSY (dealloc_pd and close_device cannot report it, so they set errno and leave the object live,
// which fabric::live_objects() shows).
//
// What it does not. Timeouts: what hardware reports once its retries run out (the peer queue pair is
// gone, or not in RTR or RTS) is reported at once as IBV_WC_RETRY_EXC_ERR; towards a downed port or a
// dead device, requests wait instead, as with a pulled cable. Atomics, memory windows, shared receive
// queues, UD and UC, the SQD state and PSNs are not modelled; atomic opcodes are refused with EINVAL.
// destroy_cq returns EBUSY where libibverbs would block until the events are acknowledged.
//
// Lifetime. Devices are added once and never removed, and there is no reset: tests compare the
// counters before and after. A downed port and a fatal device are properties of the device that last
// until its last context is closed, so a test that closes what it opened leaves the device healthy.
// The fabric itself is never destroyed (calls from other static destructors stay valid); its NIC
// thread is stopped and joined by a static destructor at exit.
//
// Locking. One mutex guards all of the fabric's state; the NIC thread holds it while it executes,
// copies included, so it never sees an object half-destroyed. poll_cq takes it once per call, and
// not at all for an empty completion queue (it reads the queue's count, as a real poll reads the
// ring), so a busy poller does not contend with the NIC thread. The time of the last completion
// pushed is kept for benchmarks (last_completion_pushed_at).

#include <infiniband/verbs.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include <sys/eventfd.h>
#include <unistd.h>

#include "ferry/verbs/provider.hpp"

namespace ferry::verbs::fake {

class fabric;
class qp;
class cq;

using event = basic_async_event<qp*, cq*>;

// The objects the provider's handles point to. Only the fabric looks inside, under its mutex, except
// for the fields that never change after creation (keys, numbers, descriptors).

class device {
  friend class fabric;
  std::string name_;
  std::uint16_t lid_ = 0;
  std::size_t open_contexts_ = 0;
  bool port_up_ = true;
  bool fatal_ = false;
};

class context {
  friend class fabric;
  friend struct provider;
  device* device_ = nullptr;
  int async_fd_ = -1;
  std::deque<event> events_;
  std::size_t users_ = 0;  // protection domains, channels and completion queues
};

class pd {
  friend class fabric;
  context* context_ = nullptr;
  std::size_t users_ = 0;  // memory regions and queue pairs
};

class mr {
  friend class fabric;
  friend struct provider;
  pd* pd_ = nullptr;
  std::uintptr_t base_ = 0;
  std::size_t length_ = 0;
  int access_ = 0;
  std::uint32_t lkey_ = 0;
  std::uint32_t rkey_ = 0;
};

class channel {
  friend class fabric;
  friend struct provider;
  context* context_ = nullptr;
  int fd_ = -1;  // an EFD_SEMAPHORE eventfd counting events_, so it is readable while one is pending
  std::deque<cq*> events_;
  std::size_t users_ = 0;  // completion queues
};

struct completion {
  ibv_wc wc{};
  qp* owner = nullptr;
  std::uint64_t seq = 0;  // the send request's sequence number; polling it releases it and older ones
  bool send = false;
};

class cq {
  friend class fabric;
  context* context_ = nullptr;
  channel* channel_ = nullptr;
  std::size_t capacity_ = 0;
  std::deque<completion> entries_;
  // entries_.size(), stored under the fabric mutex after every change: an empty poll (the common
  // case for a busy poller) reads it without taking the mutex, as a real CQ poll reads the ring.
  std::atomic<std::size_t> ready_{0};
  bool armed_ = false;
  bool solicited_only_ = false;
  bool error_ = false;
  std::uint64_t events_taken_ = 0;
  std::uint64_t events_acked_ = 0;
  std::size_t users_ = 0;  // queue pairs
};

struct send_request {
  std::uint64_t seq = 0;
  std::uint64_t wr_id = 0;
  ibv_wr_opcode opcode = IBV_WR_SEND;
  unsigned flags = 0;
  std::vector<ibv_sge> sges;         // not used when inline
  std::vector<std::byte> inline_data;
  std::size_t length = 0;
  std::uint64_t remote_addr = 0;
  std::uint32_t rkey = 0;
  std::uint32_t imm = 0;  // network byte order, as posted
};

struct receive_request {
  std::uint64_t wr_id = 0;
  std::vector<ibv_sge> sges;
};

class qp {
  friend class fabric;
  friend struct provider;
  pd* pd_ = nullptr;
  cq* send_cq_ = nullptr;
  cq* recv_cq_ = nullptr;
  std::uint32_t num_ = 0;
  ibv_qp_cap cap_{};
  ibv_qp_state state_ = IBV_QPS_RESET;
  unsigned access_ = 0;
  std::uint16_t dest_lid_ = 0;
  std::uint32_t dest_qpn_ = 0;
  std::uint8_t max_rd_atomic_ = 0;       // READs it has in flight at once as a requester (RTS)
  std::uint8_t max_dest_rd_atomic_ = 0;  // READs it accepts in flight as a responder (RTR)
  // Every outstanding send request, oldest first: those executed but not yet released by a poll,
  // then those still to execute, from sequence number next_exec_ on.
  std::deque<send_request> sq_;
  std::uint64_t next_seq_ = 0;
  std::uint64_t next_exec_ = 0;
  std::deque<receive_request> rq_;  // posted and not yet consumed
  std::size_t receives_outstanding_ = 0;  // posted and whose completion has not been polled
  bool drop_completions_ = false;
};

class fabric {
 public:
  fabric(const fabric&) = delete;
  fabric& operator=(const fabric&) = delete;

  // Never destroyed, so that verbs calls from other static destructors stay valid; the stopper,
  // constructed after it, joins the NIC thread at exit.
  [[nodiscard]] static fabric& instance() {
    static fabric* const f = new fabric;
    static const nic_stopper stopper{*f};
    return *f;
  }

  // Adds a device with one active InfiniBand port; adding a name twice changes nothing.
  void add_device(const std::string& name) {
    std::lock_guard lock(mutex_);
    if (find_device(name) != nullptr) return;
    auto d = std::make_unique<device>();
    d->name_ = name;
    d->lid_ = static_cast<std::uint16_t>(devices_.size() + 1);
    devices_.push_back(std::move(d));
  }

  // While paused the NIC executes, flushes and completes nothing; resume carries on from there.
  void pause() {
    std::lock_guard lock(mutex_);
    paused_ = true;
  }
  void resume() {
    std::lock_guard lock(mutex_);
    paused_ = false;
    wake();
  }

  // The queue pair goes to the error state (its requests are flushed) with IBV_EVENT_QP_FATAL.
  void inject_qp_fatal(qp* q) {
    std::lock_guard lock(mutex_);
    q->state_ = IBV_QPS_ERR;
    post_event(*q->pd_->context_, event{IBV_EVENT_QP_FATAL, q, nullptr, 0});
    wake();
  }

  // The completion queue takes no more completions, with IBV_EVENT_CQ_ERR.
  void inject_cq_error(cq* c) {
    std::lock_guard lock(mutex_);
    fail(*c);
  }

  // IBV_EVENT_PORT_ERR on every context of the device; its queue pairs' requests, and requests
  // towards them, then wait until the port comes back (moving a queue pair to ERR still flushes).
  void inject_port_down(context* c) {
    std::lock_guard lock(mutex_);
    device& d = *c->device_;
    if (!d.port_up_) return;
    d.port_up_ = false;
    post_device_event(d, IBV_EVENT_PORT_ERR);
  }

  // IBV_EVENT_PORT_ACTIVE on every context of the device, and the waiting requests go on.
  void inject_port_up(context* c) {
    std::lock_guard lock(mutex_);
    device& d = *c->device_;
    if (d.port_up_) return;
    d.port_up_ = true;
    post_device_event(d, IBV_EVENT_PORT_ACTIVE);
    wake();
  }

  // IBV_EVENT_DEVICE_FATAL on every context of the device, which from then on completes nothing,
  // flushes included, and fails posts and creations with EIO.
  void inject_device_fatal(context* c) {
    std::lock_guard lock(mutex_);
    device& d = *c->device_;
    if (d.fatal_) return;
    d.fatal_ = true;
    post_device_event(d, IBV_EVENT_DEVICE_FATAL);
  }

  // While on, the queue pair's requests still execute but their completions are lost, flushes
  // included, so they stay outstanding.
  void drop_completions(qp* q, bool on) {
    std::lock_guard lock(mutex_);
    q->drop_completions_ = on;
  }

  [[nodiscard]] std::uint64_t posted_send_wrs() const noexcept {
    return posted_send_wrs_.load(std::memory_order_relaxed);
  }
  [[nodiscard]] std::uint64_t completions_pushed() const noexcept {
    return completions_pushed_.load(std::memory_order_relaxed);
  }
  // When the adapter last pushed a completion: benchmarks time completion → resume from it.
  [[nodiscard]] std::chrono::steady_clock::time_point last_completion_pushed_at() const noexcept {
    return std::chrono::steady_clock::time_point(
        std::chrono::steady_clock::duration(last_push_.load(std::memory_order_acquire)));
  }
  [[nodiscard]] std::size_t outstanding_sends(qp* q) const {
    std::lock_guard lock(mutex_);
    return q->sq_.size();
  }
  // Contexts, protection domains, memory regions, channels, completion queues and queue pairs not
  // yet destroyed, for tests that check nothing leaked.
  [[nodiscard]] std::size_t live_objects() const {
    std::lock_guard lock(mutex_);
    return contexts_.size() + pds_.size() + mrs_.size() + channels_.size() + cqs_.size() +
           qps_.size();
  }

 private:
  friend struct provider;

  // The limits create_qp and create_cq grant at most.
  static constexpr std::uint32_t max_wr = 32768;
  static constexpr std::uint32_t max_sge = 16;
  static constexpr std::uint32_t max_inline = 256;
  static constexpr int max_cqe = (1 << 22) - 1;

  struct nic_stopper {
    fabric& f;
    ~nic_stopper() { f.stop_nic(); }
  };

  // The attribute masks a transition requires and allows besides IBV_QP_STATE, from the kernel's
  // table for RC queue pairs.
  struct transition {
    bool valid = false;
    int required = 0;
    int optional = 0;
  };

  fabric() : nic_([this] { run_nic(); }) {}

  void stop_nic() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    nic_wake_.notify_one();
    nic_.join();
  }

  // Called with the mutex held after every change that may give the NIC something to do.
  void wake() {
    ++generation_;
    nic_wake_.notify_one();
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
      scatter({to_pointer(w.remote_addr), w.length}, w.sges);
    } else {
      if (w.opcode == IBV_WR_RDMA_WRITE_WITH_IMM && r->rq_.empty()) return false;
      const std::span<const std::byte> data = payload(w, staging);
      copy(to_pointer(w.remote_addr), data.data(), data.size());
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

  void push(cq& c, const completion& e, bool solicited) {
    if (e.owner->drop_completions_ || c.error_) return;
    if (c.entries_.size() == c.capacity_) {
      fail(c);
      return;
    }
    last_push_.store(std::chrono::steady_clock::now().time_since_epoch().count(),
                     std::memory_order_release);
    c.entries_.push_back(e);
    c.ready_.store(c.entries_.size(), std::memory_order_release);
    completions_pushed_.fetch_add(1, std::memory_order_relaxed);
    const bool fires = !c.solicited_only_ || solicited || e.wc.status != IBV_WC_SUCCESS;
    if (!c.armed_ || !fires) return;
    c.armed_ = false;
    if (c.channel_ == nullptr) return;
    c.channel_->events_.push_back(&c);
    ::eventfd_write(c.channel_->fd_, 1);
  }

  void fail(cq& c) {
    if (c.error_) return;
    c.error_ = true;
    post_event(*c.context_, event{IBV_EVENT_CQ_ERR, nullptr, &c, 0});
  }

  static void post_event(context& c, const event& e) {
    c.events_.push_back(e);
    ::eventfd_write(c.async_fd_, 1);
  }

  void post_device_event(const device& d, ibv_event_type type) {
    const int port = type == IBV_EVENT_DEVICE_FATAL ? 0 : 1;
    for (const auto& c : contexts_) {
      if (c->device_ == &d) post_event(*c, event{type, nullptr, nullptr, port});
    }
  }

  // Takes `n` events off a semaphore eventfd.
  static void unsignal(int fd, std::size_t n) {
    eventfd_t value = 0;
    for (std::size_t i = 0; i < n; ++i) ::eventfd_read(fd, &value);
  }

  static std::byte* to_pointer(std::uint64_t address) {
    return reinterpret_cast<std::byte*>(static_cast<std::uintptr_t>(address));
  }

  // memmove, as a loopback request may copy within one buffer.
  static void copy(std::byte* to, const std::byte* from, std::size_t n) {
    if (n != 0) std::memmove(to, from, n);
  }

  static bool covers(const mr& m, std::uint64_t address, std::uint64_t length) {
    return address >= m.base_ && length <= m.length_ && address - m.base_ <= m.length_ - length;
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
  static std::span<const std::byte> payload(const send_request& w, std::vector<std::byte>& staging) {
    if ((w.flags & IBV_SEND_INLINE) != 0) return w.inline_data;
    if (w.sges.size() == 1) return {to_pointer(w.sges[0].addr), w.length};
    staging.resize(w.length);
    std::size_t at = 0;
    for (const ibv_sge& s : w.sges) {
      copy(staging.data() + at, to_pointer(s.addr), s.length);
      at += s.length;
    }
    return staging;
  }

  static void scatter(std::span<const std::byte> data, const std::vector<ibv_sge>& sges) {
    std::size_t at = 0;
    for (const ibv_sge& s : sges) {
      const std::size_t n = std::min<std::size_t>(s.length, data.size() - at);
      copy(to_pointer(s.addr), data.data() + at, n);
      at += n;
    }
  }

  qp* peer(std::uint16_t lid, std::uint32_t qpn) const {
    const auto it = by_qpn_.find(qpn);
    if (it == by_qpn_.end() || it->second->pd_->context_->device_->lid_ != lid) return nullptr;
    return it->second;
  }

  device* find_device(const std::string& name) const {
    for (const auto& d : devices_) {
      if (d->name_ == name) return d.get();
    }
    return nullptr;
  }

  // A new key: an odd multiplier makes them distinct over 2^32 and far from each other, so a key
  // off by a constant is not another live one.
  std::uint32_t next_key() { return ++keys_issued_ * 0x9E3779B1u; }

  template <class T>
  static T* keep(std::vector<std::unique_ptr<T>>& owned, std::unique_ptr<T> object) {
    owned.push_back(std::move(object));
    return owned.back().get();
  }

  template <class T>
  static void discard(std::vector<std::unique_ptr<T>>& owned, const T* object) {
    std::erase_if(owned, [object](const std::unique_ptr<T>& o) { return o.get() == object; });
  }

  static void forget_events(context& c, auto&& names) {
    unsignal(c.async_fd_, std::erase_if(c.events_, names));
  }

  // As the adapter's driver does when a queue pair is reset or destroyed: its completions still in
  // the completion queues are discarded.
  static void forget_completions(const qp& q) {
    const auto owned = [&q](const completion& e) { return e.owner == &q; };
    std::erase_if(q.send_cq_->entries_, owned);
    std::erase_if(q.recv_cq_->entries_, owned);
    q.send_cq_->ready_.store(q.send_cq_->entries_.size(), std::memory_order_release);
    q.recv_cq_->ready_.store(q.recv_cq_->entries_.size(), std::memory_order_release);
  }

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

  static bool dead(const context& c) { return c.device_->fatal_; }

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

  mr* reg_mr(pd* p, void* addr, std::size_t length, int access) {
    std::lock_guard lock(mutex_);
    const bool remote_needs_local =
        (access & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC)) != 0 &&
        (access & IBV_ACCESS_LOCAL_WRITE) == 0;
    if (addr == nullptr || length == 0 || remote_needs_local) {
      errno = EINVAL;
      return nullptr;
    }
    if (dead(*p->context_)) {
      errno = EIO;
      return nullptr;
    }
    auto m = std::make_unique<mr>();
    m->pd_ = p;
    m->base_ = reinterpret_cast<std::uintptr_t>(addr);
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

  mutable std::mutex mutex_;
  std::condition_variable nic_wake_;
  bool stop_ = false;
  bool paused_ = false;
  std::uint64_t generation_ = 0;  // bumped by wake(); the NIC sleeps while it is unchanged
  std::vector<std::unique_ptr<device>> devices_;
  std::vector<std::unique_ptr<context>> contexts_;
  std::vector<std::unique_ptr<pd>> pds_;
  std::vector<std::unique_ptr<mr>> mrs_;
  std::vector<std::unique_ptr<channel>> channels_;
  std::vector<std::unique_ptr<cq>> cqs_;
  std::vector<std::unique_ptr<qp>> qps_;
  std::unordered_map<std::uint32_t, mr*> by_lkey_;
  std::unordered_map<std::uint32_t, mr*> by_rkey_;
  std::unordered_map<std::uint32_t, qp*> by_qpn_;
  std::uint32_t keys_issued_ = 0;
  std::uint32_t next_qpn_ = 0x100;
  std::atomic<std::uint64_t> posted_send_wrs_{0};
  std::atomic<std::uint64_t> completions_pushed_{0};
  std::atomic<std::chrono::steady_clock::rep> last_push_{0};
  std::thread nic_;  // last, so that it starts once everything it reads is constructed
};

// The verbs calls, with real_provider's signatures and errno conventions, on fabric::instance().
struct provider {
  using context_handle = context*;
  using pd_handle = pd*;
  using mr_handle = mr*;
  using channel_handle = channel*;
  using cq_handle = cq*;
  using qp_handle = qp*;
  using async_event = basic_async_event<qp_handle, cq_handle>;

  [[nodiscard]] static std::vector<std::string> device_names() {
    return fabric::instance().device_names();
  }

  [[nodiscard]] static context_handle open_device(const std::string& name) noexcept {
    return fabric::instance().open_device(name);
  }

  static void close_device(context_handle c) noexcept { fabric::instance().close_device(c); }

  static int query_port(context_handle c, std::uint8_t port, ibv_port_attr& out) noexcept {
    return fabric::instance().query_port(c, port, out);
  }

  static int query_gid(context_handle c, std::uint8_t port, int index, ibv_gid& out) noexcept {
    return fabric::instance().query_gid(c, port, index, out);
  }

  [[nodiscard]] static pd_handle alloc_pd(context_handle c) noexcept {
    return fabric::instance().alloc_pd(c);
  }
  static void dealloc_pd(pd_handle pd) noexcept { fabric::instance().dealloc_pd(pd); }

  [[nodiscard]] static mr_handle reg_mr(pd_handle pd, void* addr, std::size_t length,
                                        int access) noexcept {
    return fabric::instance().reg_mr(pd, addr, length, access);
  }
  static int dereg_mr(mr_handle mr) noexcept { return fabric::instance().dereg_mr(mr); }
  [[nodiscard]] static std::uint32_t lkey(mr_handle mr) noexcept { return mr->lkey_; }
  [[nodiscard]] static std::uint32_t rkey(mr_handle mr) noexcept { return mr->rkey_; }

  [[nodiscard]] static channel_handle create_comp_channel(context_handle c) noexcept {
    return fabric::instance().create_comp_channel(c);
  }
  static int destroy_comp_channel(channel_handle ch) noexcept {
    return fabric::instance().destroy_comp_channel(ch);
  }
  [[nodiscard]] static int channel_fd(channel_handle ch) noexcept { return ch->fd_; }

  [[nodiscard]] static cq_handle create_cq(context_handle c, int entries,
                                           channel_handle ch) noexcept {
    return fabric::instance().create_cq(c, entries, ch);
  }
  static int destroy_cq(cq_handle cq) noexcept { return fabric::instance().destroy_cq(cq); }

  static int req_notify_cq(cq_handle cq, bool solicited_only) noexcept {
    return fabric::instance().req_notify_cq(cq, solicited_only);
  }
  static int get_cq_event(channel_handle ch, cq_handle& out) noexcept {
    return fabric::instance().get_cq_event(ch, out);
  }
  static void ack_cq_events(cq_handle cq, unsigned n) noexcept {
    fabric::instance().ack_cq_events(cq, n);
  }
  static int poll_cq(cq_handle cq, int n, ibv_wc* wc) noexcept {
    return fabric::instance().poll_cq(cq, n, wc);
  }

  [[nodiscard]] static qp_handle create_qp(pd_handle pd, cq_handle send_cq, cq_handle recv_cq,
                                           ibv_qp_cap& cap) noexcept {
    return fabric::instance().create_qp(pd, send_cq, recv_cq, cap);
  }
  static int destroy_qp(qp_handle qp) noexcept { return fabric::instance().destroy_qp(qp); }
  [[nodiscard]] static std::uint32_t qp_num(qp_handle qp) noexcept { return qp->num_; }
  static int modify_qp(qp_handle qp, ibv_qp_attr& attr, int mask) noexcept {
    return fabric::instance().modify_qp(qp, attr, mask);
  }

  static int post_send(qp_handle qp, ibv_send_wr* wr, ibv_send_wr** bad) noexcept {
    return fabric::instance().post_send(qp, wr, bad);
  }
  static int post_recv(qp_handle qp, ibv_recv_wr* wr, ibv_recv_wr** bad) noexcept {
    return fabric::instance().post_recv(qp, wr, bad);
  }

  [[nodiscard]] static int async_fd(context_handle c) noexcept { return c->async_fd_; }
  // The descriptor is non-blocking from the start.
  [[nodiscard]] static bool prepare_async_fd(context_handle) noexcept { return true; }

  static int get_async_event(context_handle c, async_event& out) noexcept {
    return fabric::instance().get_async_event(c, out);
  }
};

}  // namespace ferry::verbs::fake

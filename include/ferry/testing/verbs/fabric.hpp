#pragma once
// An in-process RDMA fabric behind the same calls as real_provider (ferry/verbs/provider.hpp), so
// the verbs backend's logic is tested without an adapter or libibverbs (only <infiniband/verbs.h>'s
// structures are used). Tests create devices (fabric::instance().add_device) and inject faults
// through it; the calls themselves are fake::provider's (testing/verbs/provider.hpp).
//
// What it models, as RC hardware behaves. A "NIC" thread executes posted send work requests
// asynchronously, in post order per queue pair, copying real memory (RDMA WRITE and READ, SEND and
// SEND_WITH_IMM into the peer's oldest posted receive, RDMA_WRITE_WITH_IMM) and pushing completions
// into completion queues out of band. Keys are checked as the adapter checks them: the lkey's region
// must belong to the queue pair's protection domain and cover the scatter/gather entry; the rkey's
// region and the responder queue pair must both grant the remote right, or the requester gets
// IBV_WC_REM_ACCESS_ERR and both queue pairs go to the error state (the responder with an
// IBV_EVENT_QP_ACCESS_ERR). A region registered through a dma-buf (reg_dmabuf_mr, given a
// ferry::testing::fake_dmabuf's descriptor) reaches the memory behind it and is addressed by the
// iova its owner chose, which need not be where its bytes are. A SEND with no receive posted waits
// for one (rnr_retry 7). A queue pair in the error state flushes what it has not executed,
// unsignalled requests included. Queue pair transitions demand exactly the kernel's required and
// allowed attribute masks. A send request, and a receive, stays outstanding until the poller polls
// its completion or, for sends, a later one of the same queue pair: the depth a queue pair was
// granted is a real limit. A completion queue has the capacity asked for and goes into error when it
// would overrun. Arming a completion queue fires one event, for the next completion only.
// Destroying an object that another live object uses fails with EBUSY (dealloc_pd and close_device
// cannot report it, so they set errno and leave the object live, which fabric::live_objects()
// shows).
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
//
// Parts. This class holds what tests call (devices, pausing, fault injection, counters); the rest
// is layered beneath it: fabric_state.hpp (the objects and the mutex), nic.hpp (the NIC thread),
// object_calls.hpp and data_calls.hpp (the verbs provider forwards).

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

#include "ferry/testing/verbs/data_calls.hpp"
#include "ferry/testing/verbs/objects.hpp"
#include "ferry/verbs/provider.hpp"

namespace ferry::verbs::fake {

/// The in-process RDMA fabric behind fake::provider: tests add devices and inject faults here.
///
/// One per process (instance()), never destroyed. It models RC hardware: a NIC thread executes
/// posted work requests in order per queue pair, checks keys as an adapter does and pushes
/// completions (see the top of testing/verbs/fabric.hpp for what it models and what it does not).
class fabric : data_calls {
 public:
  fabric(const fabric&) = delete;
  fabric& operator=(const fabric&) = delete;

  /// The one fabric of the process, made on first use.
  /// Never destroyed, so that verbs calls from other static destructors stay valid; the stopper,
  /// constructed after it, joins the NIC thread at exit.
  [[nodiscard]] static fabric& instance() {
    static fabric* const f = new fabric;
    static const nic_stopper stopper{*f};
    return *f;
  }

  /// Adds a device with one active InfiniBand port; adding a name twice changes nothing.
  void add_device(const std::string& name) {
    std::lock_guard lock(mutex_);
    if (find_device(name) != nullptr) return;
    auto d = std::make_unique<device>();
    d->name_ = name;
    d->lid_ = static_cast<std::uint16_t>(devices_.size() + 1);
    devices_.push_back(std::move(d));
  }

  /// While paused the NIC executes, flushes and completes nothing; resume carries on from there.
  void pause() {
    std::lock_guard lock(mutex_);
    paused_ = true;
  }
  /// Lets the NIC go on from where pause() stopped it.
  void resume() {
    std::lock_guard lock(mutex_);
    paused_ = false;
    wake();
  }

  /// The queue pair goes to the error state (its requests are flushed) with IBV_EVENT_QP_FATAL.
  void inject_qp_fatal(qp* q) {
    std::lock_guard lock(mutex_);
    q->state_ = IBV_QPS_ERR;
    post_event(*q->pd_->context_, event{IBV_EVENT_QP_FATAL, q, nullptr, 0});
    wake();
  }

  /// The completion queue takes no more completions, with IBV_EVENT_CQ_ERR.
  void inject_cq_error(cq* c) {
    std::lock_guard lock(mutex_);
    fail(*c);
  }

  /// IBV_EVENT_PORT_ERR on every context of the device; its queue pairs' requests, and requests
  /// towards them, then wait until the port comes back (moving a queue pair to ERR still flushes).
  void inject_port_down(context* c) {
    std::lock_guard lock(mutex_);
    device& d = *c->device_;
    if (!d.port_up_) return;
    d.port_up_ = false;
    post_device_event(d, IBV_EVENT_PORT_ERR);
  }

  /// IBV_EVENT_PORT_ACTIVE on every context of the device, and the waiting requests go on.
  void inject_port_up(context* c) {
    std::lock_guard lock(mutex_);
    device& d = *c->device_;
    if (d.port_up_) return;
    d.port_up_ = true;
    post_device_event(d, IBV_EVENT_PORT_ACTIVE);
    wake();
  }

  /// IBV_EVENT_DEVICE_FATAL on every context of the device, which from then on completes nothing,
  /// flushes included, and fails posts and creations with EIO.
  void inject_device_fatal(context* c) {
    std::lock_guard lock(mutex_);
    device& d = *c->device_;
    if (d.fatal_) return;
    d.fatal_ = true;
    post_device_event(d, IBV_EVENT_DEVICE_FATAL);
  }

  /// While on, the queue pair's requests still execute but their completions are lost, flushes
  /// included, so they stay outstanding.
  void drop_completions(qp* q, bool on) {
    std::lock_guard lock(mutex_);
    q->drop_completions_ = on;
  }

  /// Send work requests posted so far, on every queue pair.
  [[nodiscard]] std::uint64_t posted_send_wrs() const noexcept {
    return posted_send_wrs_.load(std::memory_order_relaxed);
  }
  /// Completions pushed into completion queues so far.
  [[nodiscard]] std::uint64_t completions_pushed() const noexcept {
    return completions_pushed_.load(std::memory_order_relaxed);
  }
  /// When the adapter last pushed a completion: benchmarks time completion → resume from it.
  [[nodiscard]] std::chrono::steady_clock::time_point last_completion_pushed_at() const noexcept {
    return std::chrono::steady_clock::time_point(
        std::chrono::steady_clock::duration(last_push_.load(std::memory_order_acquire)));
  }
  /// Send requests of `q` still outstanding (executed or not, their completions not yet polled).
  [[nodiscard]] std::size_t outstanding_sends(qp* q) const {
    std::lock_guard lock(mutex_);
    return q->sq_.size();
  }
  /// Contexts, protection domains, memory regions, channels, completion queues and queue pairs not
  /// yet destroyed, for tests that check nothing leaked.
  [[nodiscard]] std::size_t live_objects() const {
    std::lock_guard lock(mutex_);
    return contexts_.size() + pds_.size() + mrs_.size() + channels_.size() + cqs_.size() +
           qps_.size();
  }

 private:
  friend struct provider;

  struct nic_stopper {
    fabric& f;
    ~nic_stopper() { f.stop_nic(); }
  };

  fabric() = default;
};

}  // namespace ferry::verbs::fake

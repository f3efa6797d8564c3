#pragma once
// The RDMA verbs backend: one-sided READ and WRITE over RC queue pairs, as transfers completed by the
// progress executor. A template over a verbs provider (provider.hpp): `real_provider` talks to the
// adapter through libibverbs; `fake::provider` (ferry/testing/verbs/provider.hpp) is the
// in-process fake the tests use.
//
// Objects. A `basic_device` opens the adapter, allocates one protection domain and one completion
// queue with its completion channel, and is the executor's completion source: only the executor
// polls the CQ. `basic_memory_region` (memory_region.hpp) is registered memory; every request
// using it holds a reference, so it is deregistered (and, when it owns its memory, freed) only once
// the adapter can no longer touch it. `basic_queue_pair` (queue_pair.hpp) is an RC queue pair, its
// lifecycle in detail/qp_lifecycle.hpp; handshake.hpp connects two of them over a TCP side channel.
// This header includes both, so it is all a user of the device needs.
//
// Submission. A submitter reserves send-queue slots with one CAS on the queue pair's credit counter
// (none left: try_* returns nullopt and write/read back off up to the admission timeout, then fail
// with errc::submission_queue_full), prepares pooled work requests, and publishes them with one CAS
// onto a lock-free stack. The executor takes the stack, chains every queued work request of a queue
// pair and posts the chain with one ibv_post_send, so requests from many threads share doorbells and
// the queue pair's state needs no lock. A batch is posted as one linked list with only its last
// work request signalled: RC completes a queue pair's requests in order, so the last one's success
// means every one landed.
//
// Completion. The executor polls the CQ in batches. In adaptive and park modes it arms the CQ with
// ibv_req_notify_cq before sleeping on the channel's descriptor and polls once more after arming,
// since a completion that arrived before the arming raises no event.
//
// Failure. An error completion fails every transfer of its batch with the ibv_wc_status, and the queue
// pair (now in the error state) fails everything queued behind it; requests already posted come back
// flushed. A fatal asynchronous event (QP fatal, CQ error, device fatal, port down), read by a small
// watcher thread and handled on the executor, moves the queue pairs it names to the error state.
// A request ends only when the adapter has handed it back: its completion or its flush. One whose
// deadline passes while the adapter holds it is taken back the only way RC allows, by moving its
// queue pair to the error state (as the kernel's ib_drain_qp does); it fails with deadline_exceeded
// when its flush arrives, so its memory is quiescent once its transfer is terminal. A broken queue
// pair waits for its flushes up to queue_pair_options::flush_timeout; past it (an adapter that
// never flushes) the requests fail anyway and their regions stay registered until the flushes come
// or the queue pair goes. After a CQ error or a fatal device event nothing can be reaped: everything
// fails at once, likewise. RC tells of a peer that has gone only when something is sent to it, so
// while a notification wait is queued with nothing else in flight, the queue pair checks its peer
// with a zero-length RDMA WRITE (queue_pair_options::peer_check); its failure fails the waits.
//
// Parts. This class is the facade: opening and closing the adapter's objects, registering memory,
// and the executor's poll and arm. What the executor does is in detail/, one part each, which the
// device derives from: qp_setup.hpp (making and connecting queue pairs), arrival.hpp (routing what
// submitters publish, one handler per op kind), posting.hpp, reaping.hpp (completion handling),
// deadlines.hpp (deadlines and a queue pair's timers), peer_checks.hpp and teardown.hpp (breaking,
// closing and destroying queue pairs; async events).

#include <infiniband/verbs.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

#include "ferry/detail/block_pool.hpp"
#include "ferry/metrics.hpp"
#include "ferry/detail/status_block.hpp"
#include "ferry/detail/submission_stack.hpp"
#include "ferry/detail/timeout.hpp"
#include "ferry/detail/timer_service.hpp"
#include "ferry/errors.hpp"
#include "ferry/post.hpp"
#include "ferry/progress_executor.hpp"
#include "ferry/transfer.hpp"
#include "ferry/verbs/detail/arrival.hpp"
#include "ferry/verbs/detail/async_event_watcher.hpp"
#include "ferry/verbs/detail/deadlines.hpp"
#include "ferry/verbs/detail/op.hpp"
#include "ferry/verbs/detail/peer_checks.hpp"
#include "ferry/verbs/detail/posting.hpp"
#include "ferry/verbs/detail/qp_setup.hpp"
#include "ferry/verbs/detail/queue_pair_state.hpp"
#include "ferry/verbs/detail/reaping.hpp"
#include "ferry/verbs/detail/teardown.hpp"
#include "ferry/verbs/errors.hpp"
#include "ferry/verbs/memory_region.hpp"
#include "ferry/verbs/options.hpp"
#include "ferry/verbs/provider.hpp"
#include "ferry/verbs/queue_pair.hpp"
#include "ferry/verbs/remote.hpp"

namespace ferry::verbs {

/// An opened RDMA adapter: its protection domain, its completion queue and the executor's
/// completion source for every queue pair made on it.
///
/// Make queue pairs (basic_queue_pair) and regions (basic_memory_region) on it; every one of them
/// must be destroyed before the device (the process aborts otherwise). `P` is the verbs provider:
/// real_provider (the ferry::verbs::device alias) or fake::provider in tests.
template <class P>
class basic_device : detail::qp_setup<P>,
                     detail::arrival<P>,
                     detail::posting<P>,
                     detail::reaping<P>,
                     detail::deadlines<P>,
                     detail::peer_checks<P>,
                     detail::teardown<P> {
 public:
  using provider = P;  ///< the verbs provider the device calls

  /// Opens the adapter (`options.name`, or the first one) and registers with `exec`, which must
  /// outlive the device. Throws std::runtime_error when there is no such adapter, and
  /// std::system_error naming the verbs call that failed.
  explicit basic_device(progress_executor& exec, device_options options = {})
      : exec_(exec), options_(std::move(options)) {
    meter_.attach(options_.metrics, {"write", "read"});  // op_kind's order
    try {
      open();
      watcher_.start(context_, exec_);
      exec_.add_source(*this);
    } catch (...) {
      watcher_.stop();
      close_objects();
      throw;
    }
  }

  basic_device(const basic_device&) = delete;
  basic_device& operator=(const basic_device&) = delete;

  /// Every queue pair and region handle must be gone. Requests still in flight fail with
  /// errc::backend_shut_down; queue pairs are destroyed (so the adapter stops touching memory) before
  /// the regions their requests held are deregistered.
  ~basic_device() {
    if (queue_pairs_.load(std::memory_order_acquire) != 0) {
      std::fprintf(stderr,
                   "ferry: verbs device destroyed with %d queue_pair handle(s) still open; destroy "
                   "queue pairs before their device\n",
                   queue_pairs_.load(std::memory_order_relaxed));
      std::abort();
    }
    watcher_.stop();
    exec_.remove_source(*this);
    // Timers may still fire on the executor thread until cancelled; after sync() none is running.
    this->for_each_qp([this](qp_state* q) {
      this->for_each_timed(q, [this](op_body* o) { this->cancel_timer(o); });
      this->disarm_timer(q->guard);
      this->disarm_timer(q->check);
    });
    exec_.sync();
    shutting_down_ = true;
    this->drain_expired();
    while (qp_state* q = this->to_break_) {  // everything ends below, with the shut-down's reason
      this->to_break_ = q->expiry_next;
      q->expiry_listed = false;
    }
    this->drain_overdue();
    while (this->take_fired(this->checks_due_) != nullptr) {
    }
    this->take_incoming();
    const std::error_code shut = make_error_code(ferry::errc::backend_shut_down);
    this->for_each_qp([&](qp_state* q) {
      this->fail_everything(q, shut);
      this->destroy_qp(q, shut);
    });
    qps_ = nullptr;
    this->with_pending_ = nullptr;
    if (regions_.load(std::memory_order_acquire) != 0) {
      std::fprintf(stderr,
                   "ferry: verbs device destroyed with %d memory_region(s) still registered; "
                   "destroy regions before their device\n",
                   regions_.load(std::memory_order_relaxed));
      std::abort();
    }
    close_objects();
  }

  /// The executor that polls the device.
  [[nodiscard]] progress_executor& executor() const noexcept { return exec_; }
  /// The adapter's name (the one opened, when device_options::name was empty).
  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  /// The port's LID (0 on RoCE, where GIDs route).
  [[nodiscard]] std::uint16_t lid() const noexcept { return lid_; }
  /// Empty while usable; otherwise why nothing on this device can complete (a CQ error or a fatal
  /// device event).
  [[nodiscard]] std::error_code failure() const noexcept {
    const int f = failure_.load(std::memory_order_acquire);
    return f == 0 ? std::error_code{} : make_error_code(static_cast<errc>(f));
  }
  /// The provider's context handle (an ibv_context* for real_provider); the device owns it.
  [[nodiscard]] typename P::context_handle native_context() const noexcept { return context_; }
  /// The provider's handle of the device's completion queue; the device owns it.
  [[nodiscard]] typename P::cq_handle native_cq() const noexcept { return cq_; }

  /// What the device has done so far; any thread.
  [[nodiscard]] device_counters counters() const noexcept {
    device_counters c;
    c.work_requests_posted = this->posted_.load(std::memory_order_relaxed);
    c.post_calls = this->post_calls_.load(std::memory_order_relaxed);
    c.completions = this->completions_.load(std::memory_order_relaxed);
    c.async_events = this->async_events_.load(std::memory_order_relaxed);
    c.flushes_overdue = this->flushes_overdue_.load(std::memory_order_relaxed);
    c.peer_checks = this->peer_checks_.load(std::memory_order_relaxed);
    return c;
  }

  // --- The executor's side: a completion source parked on the completion channel. ---

  /// Posts what submitters queued and reaps up to `budget` completions; returns how many things it
  /// handled (completion_source). Called by the executor only.
  std::size_t poll(std::size_t budget) noexcept {
    std::size_t handled = 0;
    if (this->expired_ != nullptr) handled += this->drain_expired();
    if (this->overdue_ != nullptr) handled += this->drain_overdue();
    if (this->checks_due_ != nullptr) handled += this->check_peers();
    if (watcher_.pending()) handled += this->handle_async_events();
    if (!incoming_.empty()) handled += this->take_incoming();
    this->post_all();
    const std::size_t reaped = this->reap(budget);
    // Only once the reap has emptied the CQ: a success still in it would end its unit next round.
    if (this->to_break_ != nullptr && reaped < budget) this->break_expired();
    if (reaped != 0) this->post_all();
    return handled + reaped;
  }

  /// The completion channel's descriptor, which the executor sleeps on (parkable_source).
  [[nodiscard]] int park_fd() const noexcept { return P::channel_fd(channel_); }

  /// Arms the completion channel; false when completions arrived meanwhile (armable_source).
  /// Before the executor sleeps: take the events already signalled, ask for the next one, and look
  /// again, since a completion that landed before the request raises no event.
  bool arm() noexcept {
    typename P::cq_handle cq{};
    unsigned events = 0;
    while (P::get_cq_event(channel_, cq) == 0) ++events;
    if (events != 0) P::ack_cq_events(cq_, events);
    if (P::req_notify_cq(cq_, false) != 0) return false;
    return poll(exec_.options().poll_budget) == 0;
  }

 private:
  friend class basic_memory_region<P>;
  friend class basic_queue_pair<P>;
  friend struct detail::region_state<P>;
  // The parts (detail/): each reaches the device, and the others, through self().
  friend struct detail::qp_setup<P>;
  friend struct detail::arrival<P>;
  friend struct detail::posting<P>;
  friend struct detail::reaping<P>;
  friend struct detail::deadlines<P>;
  friend struct detail::peer_checks<P>;
  friend struct detail::teardown<P>;

  using op_body = detail::op_body<P>;
  using qp_state = detail::qp_state<P>;
  using region_state = detail::region_state<P>;

  // --- Set-up and tear-down (constructor and destructor threads). ---

  void open() {
    const std::vector<std::string> names = P::device_names();
    if (names.empty()) {
      throw std::runtime_error(std::string("ferry::verbs::device: no RDMA device found (") +
                               P::no_device_help + ")");
    }
    name_ = options_.name.empty() ? names.front() : options_.name;
    if (std::find(names.begin(), names.end(), name_) == names.end()) {
      std::string found;
      for (const std::string& n : names) found += (found.empty() ? "" : ", ") + n;
      throw std::runtime_error("ferry::verbs::device: no RDMA device called '" + name_ +
                               "' (found: " + found + ")");
    }
    context_ = P::open_device(name_);
    if (!context_) throw system_error("ibv_open_device(" + name_ + ")");
    ibv_port_attr port{};
    if (const int r = P::query_port(context_, options_.port, port); r != 0) {
      throw std::system_error(r, std::system_category(),
                              "ferry::verbs: ibv_query_port(" + name_ + ", port " +
                                  std::to_string(options_.port) + ")");
    }
    lid_ = port.lid;
    mtu_ = static_cast<std::uint8_t>(port.active_mtu);
    if (port.link_layer == IBV_LINK_LAYER_ETHERNET) {
      if (const int r = P::query_gid(context_, options_.port, options_.gid_index, gid_); r != 0) {
        throw std::system_error(r, std::system_category(),
                                "ferry::verbs: ibv_query_gid(" + name_ + ", GID index " +
                                    std::to_string(options_.gid_index) + ")");
      }
      has_gid_ = true;
    }
    pd_ = P::alloc_pd(context_);
    if (!pd_) throw system_error("ibv_alloc_pd");
    channel_ = P::create_comp_channel(context_);
    if (!channel_) throw system_error("ibv_create_comp_channel");
    cq_ = P::create_cq(context_, options_.completion_queue_entries, channel_);
    if (!cq_) {
      throw system_error("ibv_create_cq(" + std::to_string(options_.completion_queue_entries) +
                         " entries)");
    }
    cq_room_ = options_.completion_queue_entries;
    if (!P::prepare_async_fd(context_)) throw system_error("making the async event fd non-blocking");
  }

  void close_objects() noexcept {
    if (cq_) {
      // Events taken but not acknowledged would make ibv_destroy_cq fail.
      typename P::cq_handle cq{};
      unsigned events = 0;
      while (P::get_cq_event(channel_, cq) == 0) ++events;
      if (events != 0) P::ack_cq_events(cq_, events);
      P::destroy_cq(cq_);
    }
    if (channel_) P::destroy_comp_channel(channel_);
    if (pd_) P::dealloc_pd(pd_);
    if (context_) P::close_device(context_);
    cq_ = {};
    channel_ = {};
    pd_ = {};
    context_ = {};
  }

  [[nodiscard]] std::system_error system_error(const std::string& what) const {
    return std::system_error(errno, std::system_category(), "ferry::verbs: " + what);
  }

  region_state* register_state(std::byte* data, std::size_t bytes, int access, bool owned) {
    auto* r = new region_state;
    r->mr = P::reg_mr(pd_, data, bytes, access);
    if (!r->mr) {
      const int err = errno;
      delete r;
      throw std::system_error(err, std::system_category(),
                              "ferry::verbs: ibv_reg_mr(" + std::to_string(bytes) + " bytes)");
    }
    return adopt_state(r, data, bytes, owned);
  }

  // Device memory behind the dma-buf `fd`, addressed (locally and by peers) from `iova` on.
  region_state* register_dmabuf_state(int fd, std::uint64_t offset, std::size_t bytes,
                                      std::uint64_t iova, int access) {
    const auto what = [&] {
      char address[2 + 16 + 1];
      std::snprintf(address, sizeof address, "0x%llx", static_cast<unsigned long long>(iova));
      return "ferry::verbs: ibv_reg_dmabuf_mr(fd " + std::to_string(fd) + ", offset " +
             std::to_string(offset) + ", " + std::to_string(bytes) + " bytes, iova " + address +
             ")";
    };
    // Refused here rather than left to the driver, which may or may not check it.
    if (bytes == 0) {
      throw std::system_error(EINVAL, std::system_category(),
                              what() + ": a region needs at least one byte");
    }
    auto* r = new region_state;
    r->mr = P::reg_dmabuf_mr(pd_, offset, bytes, iova, fd, access);
    if (!r->mr) {
      const int err = errno;
      delete r;
      throw std::system_error(err, std::system_category(), what());
    }
    r->dmabuf = true;
    return adopt_state(r, reinterpret_cast<std::byte*>(static_cast<std::uintptr_t>(iova)), bytes,
                       false);
  }

  region_state* adopt_state(region_state* r, std::byte* data, std::size_t bytes, bool owned) noexcept {
    r->data = data;
    r->size = bytes;
    r->lkey = P::lkey(r->mr);
    r->rkey = P::rkey(r->mr);
    r->owned = owned;
    r->device = this;
    regions_.fetch_add(1, std::memory_order_relaxed);
    return r;
  }

  void unregister(region_state* r) noexcept {
    P::dereg_mr(r->mr);
    if (r->owned) ::operator delete(r->data, std::align_val_t{4096});
    delete r;
    regions_.fetch_sub(1, std::memory_order_release);
  }

  void sever_queue_pair(qp_state* s, std::error_code why) {
    op_body* o = detail::op<P>::make(detail::op_kind::sever);
    o->qp = s;
    o->reason = why;
    publish(o);
  }

  void close_queue_pair(qp_state* s) noexcept {
    publish(s->close_op);
    queue_pairs_.fetch_sub(1, std::memory_order_release);
  }

  // --- Submission (any thread). ---

  // Publishes a unit (its lead; members hang off unit_next). After it the executor owns the unit.
  void publish(op_body* lead) noexcept {
    if (lead->kind == detail::op_kind::write || lead->kind == detail::op_kind::read) {
      lead->published_ns = meter_.stamp();
    }
    incoming_.push(lead);
    exec_.notify();
  }

  progress_executor& exec_;
  device_options options_;
  ferry::metrics::backend_meter meter_;  // set by the constructor; recorded into by the executor
  std::string name_;
  typename P::context_handle context_{};
  typename P::pd_handle pd_{};
  typename P::channel_handle channel_{};
  typename P::cq_handle cq_{};
  std::uint16_t lid_ = 0;
  std::uint8_t mtu_ = IBV_MTU_1024;
  bool has_gid_ = false;
  ibv_gid gid_{};

  std::mutex setup_mutex_;
  std::int64_t cq_room_ = 0;  // completion queue entries not yet promised to a queue pair
  std::atomic<int> queue_pairs_{0};
  std::atomic<int> regions_{0};
  std::atomic<int> failure_{0};  // a verbs::errc once the CQ or the device failed

  detail::async_event_watcher<P> watcher_;

  ferry::detail::submission_stack<op_body> incoming_;

  // The executor's.
  qp_state* qps_ = nullptr;
  bool cq_failed_ = false;
  bool shutting_down_ = false;
};

}  // namespace ferry::verbs

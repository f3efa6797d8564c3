#pragma once
// The RDMA verbs backend: one-sided READ and WRITE over RC queue pairs, as transfers completed by the
// progress executor. A template over a verbs provider (provider.hpp): `real_provider` talks to the
// adapter through libibverbs; `fake::provider` (fake.hpp) is the in-process fake the tests use.
//
// Objects. A `basic_device` opens the adapter, allocates one protection domain and one completion
// queue with its completion channel, and is the executor's completion source: only the executor
// polls the CQ. `basic_memory_region` is registered memory; every request using it holds a reference,
// so it is deregistered (and, when it owns its memory, freed) only once the adapter can no longer
// touch it. `basic_queue_pair` is an RC queue pair; handshake.hpp connects two of them over a TCP
// side channel.
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

#include <infiniband/verbs.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "ferry/detail/block_pool.hpp"
#include "ferry/detail/status_block.hpp"
#include "ferry/detail/submission_stack.hpp"
#include "ferry/detail/timeout.hpp"
#include "ferry/detail/timer_service.hpp"
#include "ferry/errors.hpp"
#include "ferry/post.hpp"
#include "ferry/progress_executor.hpp"
#include "ferry/transfer.hpp"
#include "ferry/verbs/errors.hpp"
#include "ferry/verbs/provider.hpp"

namespace ferry::verbs {

template <class P>
class basic_device;
template <class P>
class basic_memory_region;
template <class P>
class basic_queue_pair;

struct device_options {
  std::string name;              // the device to open; empty: the first one found
  std::uint8_t port = 1;
  int gid_index = 0;             // the source GID when the port's link layer is Ethernet (RoCE)
  int completion_queue_entries = 4096;
};

struct queue_pair_options {
  std::uint32_t send_depth = 256;     // work requests in flight at once
  std::uint32_t receive_depth = 64;   // notifications that may have arrived and not yet been taken
  std::uint32_t max_inline_data = 64;
  std::uint8_t max_rd_atomic = 16;    // RDMA READs in flight at once, each way
  std::chrono::nanoseconds admission_timeout = std::chrono::milliseconds(100);
  // How long a broken queue pair (deadline, close, fatal event, error completion) waits for the
  // adapter to flush back what it holds. A request ends when its flush arrives, when the adapter
  // no longer touches its memory; one still held after this fails anyway (its region stays
  // registered until the flush or the queue pair's end), so that an adapter that never flushes
  // cannot hang a wait.
  std::chrono::nanoseconds flush_timeout = std::chrono::seconds(1);
  // How often a queue pair with a receive_notification waiting, and nothing else in flight, checks
  // that its peer is still there. RC tells of a peer that has gone (its process killed, its queue
  // pair destroyed) only when something is sent to it, so a wait for its next notification would
  // otherwise wait for ever. The check is a zero-length RDMA WRITE, which the peer's adapter answers
  // without its software; when it fails (IBV_WC_RETRY_EXC_ERR, once the adapter's retries run out)
  // the waits fail with errc::peer_unreachable. Checks start once the peer is known to be
  // connected (the handshake, mark_peer_connected, or anything that came back from it), go out only
  // while nothing else is in flight, and take no request's send-queue credit. Zero turns them off.
  std::chrono::nanoseconds peer_check = std::chrono::seconds(1);
};

// The default access of a registered region: the peer may read and write it.
inline constexpr int default_region_access =
    IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;

// The largest message one work request moves (the RC limit of every current adapter).
inline constexpr std::size_t max_message_bytes = std::size_t{1} << 31;

// A range of a peer's registered memory.
struct remote_slice {
  std::uint64_t address = 0;
  std::uint64_t length = 0;
  std::uint32_t rkey = 0;
};

// A peer's registered region, as the handshake hands it over.
struct remote_region {
  std::uint64_t address = 0;
  std::uint64_t length = 0;
  std::uint32_t rkey = 0;

  // Throws std::out_of_range when [offset, offset + n) is not inside the region.
  [[nodiscard]] remote_slice slice(std::uint64_t offset, std::uint64_t n) const {
    if (offset > length || n > length - offset) {
      throw std::out_of_range("ferry::verbs::remote_region::slice: bytes [" +
                              std::to_string(offset) + ", " + std::to_string(offset) + " + " +
                              std::to_string(n) + ") are outside the peer's region of " +
                              std::to_string(length) + " bytes");
    }
    return {address + offset, n, rkey};
  }
};

// What one side tells the other to connect an RC queue pair.
struct endpoint_info {
  std::uint32_t qp_num = 0;
  std::uint32_t psn = 0;
  std::uint16_t lid = 0;
  std::uint8_t mtu = IBV_MTU_1024;  // an ibv_mtu
  bool has_gid = false;             // RoCE: routed by GID
  ibv_gid gid{};
  // The RDMA READs this side accepts in flight as a responder: the peer never has more out at once.
  std::uint8_t max_rd_atomic = 16;
};

struct device_counters {
  std::uint64_t work_requests_posted = 0;  // peer checks included
  std::uint64_t post_calls = 0;  // ibv_post_send calls: doorbells
  std::uint64_t completions = 0;
  std::uint64_t async_events = 0;
  std::uint64_t flushes_overdue = 0;  // broken queue pairs the adapter did not flush in time
  std::uint64_t peer_checks = 0;      // zero-length WRITEs sent to check a peer is still there
};

namespace detail {

using ferry::detail::status_block;

template <class P>
struct region_state {
  std::atomic<int> refs{1};
  typename P::mr_handle mr{};
  std::byte* data = nullptr;
  std::size_t size = 0;
  std::uint32_t lkey = 0;
  std::uint32_t rkey = 0;
  bool owned = false;
  basic_device<P>* device = nullptr;

  void add_ref() noexcept { refs.fetch_add(1, std::memory_order_relaxed); }
  void release() noexcept;
};

enum class op_kind : std::uint8_t { write, read, notify, wait_notification, open, close, peer_check };

template <class P>
struct qp_state;

template <class P>
struct op_body {
  ferry::detail::timer_node timer;  // first: a fired timer finds its op (see op_of)
  op_kind kind = op_kind::write;
  bool has_deadline = false;
  bool timer_armed = false;
  bool posted = false;
  bool listed = false;       // a lead in its queue pair's list of posted units
  bool orphaned = false;     // a lead cut part-way whose tail cannot be posted: ends with its QP
  bool failed = false;       // a lead whose members have all been failed
  bool expired = false;      // a lead whose deadline passed while the adapter held it
  std::uint32_t unit_size = 1;
  qp_state<P>* qp = nullptr;
  region_state<P>* region = nullptr;
  status_block* status = nullptr;  // the completer reference
  op_body* lead = nullptr;         // the first member of the unit (itself for a single request)
  op_body* last = nullptr;         // on the lead: the signalled member
  op_body* unit_next = nullptr;    // the unit's members, in order
  op_body* next = nullptr;         // submission stack, pending queue, waiter queue
  op_body* list_prev = nullptr;
  op_body* list_next = nullptr;
  op_body* expired_next = nullptr;
  std::uint64_t payload = 0;         // a notification's value, sent inline
  std::uint64_t* value_out = nullptr;  // where a received notification's value goes
  ibv_sge sge{};
  ibv_send_wr wr{};
};

template <class P>
struct op : op_body<P> {
  op* pool_next_ = nullptr;  // the pool's free-list link, never poisoned
  static constexpr std::size_t poisonable_bytes = sizeof(op_body<P>);
  using pool = ferry::detail::block_pool<op>;

  [[nodiscard]] static op_body<P>* make(op_kind kind) {
    op* o = pool::acquire();
    static_cast<op_body<P>&>(*o) = op_body<P>{};
    o->kind = kind;
    o->lead = o;
    o->last = o;
    return o;
  }

  static void free(op_body<P>* o) noexcept { pool::release(static_cast<op*>(o)); }
};

template <class P>
[[nodiscard]] op_body<P>* op_of(ferry::detail::timer_node* t) noexcept {
  static_assert(std::is_standard_layout_v<op_body<P>>);
  return reinterpret_cast<op_body<P>*>(t);
}

// A FIFO linked through op_body::next.
template <class P>
struct op_queue {
  op_body<P>* head = nullptr;
  op_body<P>* tail = nullptr;

  [[nodiscard]] bool empty() const noexcept { return head == nullptr; }
  void push(op_body<P>* o) noexcept {
    o->next = nullptr;
    if (tail == nullptr) {
      head = tail = o;
    } else {
      tail->next = o;
      tail = o;
    }
  }
  op_body<P>* pop() noexcept {
    op_body<P>* o = head;
    if (o != nullptr) {
      head = o->next;
      if (head == nullptr) tail = nullptr;
      o->next = nullptr;
    }
    return o;
  }
  // Unlinks every queued op for which `pred` holds, keeping the order of the rest.
  template <class Pred>
  void remove_if(Pred pred) noexcept {
    op_body<P>* keep_head = nullptr;
    op_body<P>* keep_tail = nullptr;
    for (op_body<P>* o = head; o != nullptr;) {
      op_body<P>* next = o->next;
      o->next = nullptr;
      if (!pred(o)) {
        (keep_tail == nullptr ? keep_head : keep_tail->next) = o;
        keep_tail = o;
      }
      o = next;
    }
    head = keep_head;
    tail = keep_tail;
  }
};

// One posted receive for notifications; wr_id is its address with the low bit set, which tells it
// apart from a send's op (ops are aligned).
template <class P>
struct receive_slot {
  qp_state<P>* qp = nullptr;
  std::uint64_t value = 0;  // the received payload lands here (registered memory)
  ibv_sge sge{};
  ibv_recv_wr wr{};
};

// A queue pair's timer: its flush guard (queue_pair_options::flush_timeout) or its peer check
// (queue_pair_options::peer_check). The node comes first, so that a fired timer finds its queue pair.
template <class P>
struct qp_timer {
  ferry::detail::timer_node timer;
  qp_state<P>* qp = nullptr;
  bool armed = false;
  bool fired = false;  // and listed in the device's list for it (overdue_ or checks_due_)
  qp_timer* fired_next = nullptr;
};

template <class P>
struct qp_state {
  basic_device<P>* device = nullptr;
  typename P::qp_handle qp{};
  std::uint32_t qp_num = 0;
  std::uint32_t psn = 0;
  std::uint32_t send_depth = 0;
  std::uint32_t max_inline = 0;
  std::uint8_t max_rd_atomic = 0;
  std::chrono::nanoseconds admission_timeout{};
  std::chrono::nanoseconds flush_timeout{};
  std::chrono::nanoseconds peer_check{};
  qp_timer<P> guard;  // the flush timeout
  qp_timer<P> check;  // the next peer check
  // Free send-queue slots: submitters take them, the executor gives them back when a unit ends.
  alignas(64) std::atomic<std::int64_t> credits{0};
  // 0 while usable; else the verbs::errc that ended it (read by submitters to fail fast).
  std::atomic<int> broken{0};
  std::atomic<bool> connected{false};
  // The peer is known to be connected too: the handshake said so, the user did
  // (mark_peer_connected), or something came back from it. Only then are peer checks sent.
  std::atomic<bool> peer_up{false};
  op_body<P>* close_op = nullptr;  // made up front, so that closing cannot fail

  // The executor's from here on.
  op_queue<P> pending;  // members not yet posted, in order
  op_body<P>* posted_head = nullptr;  // units with members in the adapter
  op_body<P>* posted_tail = nullptr;
  op_queue<P> waiters;  // receive_notification requests, in order
  std::vector<receive_slot<P>*> arrived;  // notifications not yet taken, in order (a FIFO)
  std::size_t arrived_at = 0;
  std::unique_ptr<receive_slot<P>[]> slots;
  std::uint32_t slot_count = 0;
  typename P::mr_handle slots_mr{};
  std::uint32_t receives_posted = 0;
  std::int64_t cq_reserved = 0;  // completion queue entries promised to it
  bool in_error = false;  // the executor moved it, or saw it move, to the error state
  bool closing = false;
  bool listed_pending = false;
  qp_state* all_prev = nullptr;  // the device's queue pairs
  qp_state* all_next = nullptr;
  qp_state* pending_next = nullptr;  // the device's queue pairs with members to post
  qp_state* doomed_next = nullptr;   // closing queue pairs to look at after a completion batch
  qp_state* expiry_next = nullptr;
  bool expiry_listed = false;
  bool doomed = false;
};

template <class P>
[[nodiscard]] std::uint32_t initial_psn(const qp_state<P>* s) noexcept {
  return static_cast<std::uint32_t>(reinterpret_cast<std::uintptr_t>(s) >> 6) & 0xffffff;
}

}  // namespace detail

// A range of a registered region, to read into or write from.
template <class P>
class basic_local_slice {
 public:
  basic_local_slice() noexcept = default;

  [[nodiscard]] std::byte* data() const noexcept { return data_; }
  [[nodiscard]] std::size_t size() const noexcept { return length_; }
  [[nodiscard]] std::span<std::byte> bytes() const noexcept { return {data_, length_}; }

 private:
  friend class basic_memory_region<P>;
  friend class basic_queue_pair<P>;
  basic_local_slice(detail::region_state<P>* r, std::byte* d, std::size_t n) noexcept
      : region_(r), data_(d), length_(n) {}

  detail::region_state<P>* region_ = nullptr;
  std::byte* data_ = nullptr;
  std::size_t length_ = 0;
};

// One member of a batched READ or WRITE.
template <class P>
struct basic_rdma_block {
  basic_local_slice<P> local;
  remote_slice remote;
};

// Registered memory. Requests hold references to it: it is deregistered, and memory it owns freed,
// only when the handle and every request that used it are gone.
template <class P>
class basic_memory_region {
 public:
  basic_memory_region() noexcept = default;

  // `bytes` of page-aligned, zeroed memory owned by the region.
  [[nodiscard]] static basic_memory_region allocate(basic_device<P>& device, std::size_t bytes,
                                                    int access = default_region_access) {
    if (bytes == 0) {
      throw std::invalid_argument("ferry::verbs::memory_region::allocate: zero bytes requested");
    }
    constexpr std::size_t page = 4096;
    if (bytes > SIZE_MAX - (page - 1)) {
      throw std::length_error("ferry::verbs::memory_region::allocate: " + std::to_string(bytes) +
                              " bytes cannot be rounded up to whole pages");
    }
    const std::size_t rounded = (bytes + page - 1) / page * page;
    auto* data = static_cast<std::byte*>(::operator new(rounded, std::align_val_t{page}));
    std::memset(data, 0, rounded);
    try {
      return basic_memory_region(device.register_state(data, bytes, access, true));
    } catch (...) {
      ::operator delete(data, std::align_val_t{page});
      throw;
    }
  }

  // Registers memory the caller owns; it must outlive the region and every request using it
  // (in_use() tells when none does).
  [[nodiscard]] static basic_memory_region register_memory(basic_device<P>& device,
                                                           std::span<std::byte> memory,
                                                           int access = default_region_access) {
    if (memory.empty()) {
      throw std::invalid_argument("ferry::verbs::memory_region::register_memory: empty span");
    }
    return basic_memory_region(device.register_state(memory.data(), memory.size(), access, false));
  }

  basic_memory_region(basic_memory_region&& other) noexcept
      : state_(std::exchange(other.state_, nullptr)) {}
  basic_memory_region& operator=(basic_memory_region&& other) noexcept {
    basic_memory_region(std::move(other)).swap(*this);
    return *this;
  }
  ~basic_memory_region() {
    if (state_ != nullptr) state_->release();
  }
  void swap(basic_memory_region& other) noexcept { std::swap(state_, other.state_); }

  [[nodiscard]] std::byte* data() const noexcept { return state_->data; }
  [[nodiscard]] std::size_t size() const noexcept { return state_->size; }
  [[nodiscard]] std::span<std::byte> bytes() const noexcept { return {state_->data, state_->size}; }
  [[nodiscard]] std::uint32_t lkey() const noexcept { return state_->lkey; }
  [[nodiscard]] std::uint32_t rkey() const noexcept { return state_->rkey; }

  // What a peer needs to read or write this region.
  [[nodiscard]] remote_region remote() const noexcept {
    return {reinterpret_cast<std::uintptr_t>(state_->data), state_->size, state_->rkey};
  }

  // True while some request still holds the region.
  [[nodiscard]] bool in_use() const noexcept {
    return state_->refs.load(std::memory_order_acquire) > 1;
  }

  // Throws std::out_of_range when [offset, offset + n) is not inside the region.
  [[nodiscard]] basic_local_slice<P> slice(std::size_t offset, std::size_t n) const {
    if (offset > state_->size || n > state_->size - offset) {
      throw std::out_of_range("ferry::verbs::memory_region::slice: bytes [" +
                              std::to_string(offset) + ", " + std::to_string(offset) + " + " +
                              std::to_string(n) + ") are outside the region of " +
                              std::to_string(state_->size) + " bytes");
    }
    return {state_, state_->data + offset, n};
  }

  // The same, for a span that must lie inside the region.
  [[nodiscard]] basic_local_slice<P> slice(std::span<std::byte> part) const {
    const auto begin = reinterpret_cast<std::uintptr_t>(state_->data);
    const auto at = reinterpret_cast<std::uintptr_t>(part.data());
    if (at < begin || at - begin > state_->size || part.size() > state_->size - (at - begin)) {
      throw std::out_of_range("ferry::verbs::memory_region::slice: the span of " +
                              std::to_string(part.size()) +
                              " bytes does not lie inside the registered region");
    }
    return {state_, part.data(), part.size()};
  }

 private:
  explicit basic_memory_region(detail::region_state<P>* s) noexcept : state_(s) {}
  detail::region_state<P>* state_ = nullptr;
};

template <class P>
class basic_device {
 public:
  using provider = P;

  explicit basic_device(progress_executor& exec, device_options options = {})
      : exec_(exec), options_(std::move(options)) {
    try {
      open();
      stop_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
      if (stop_fd_ < 0) throw std::system_error(errno, std::system_category(), "ferry::verbs: eventfd");
      watcher_ = std::thread([this] { watch_async_events(); });
      exec_.add_source(*this);
    } catch (...) {
      stop_watcher();
      close_objects();
      throw;
    }
  }

  basic_device(const basic_device&) = delete;
  basic_device& operator=(const basic_device&) = delete;

  // Every queue pair and region handle must be gone. Requests still in flight fail with
  // errc::backend_shut_down; queue pairs are destroyed (so the adapter stops touching memory) before
  // the regions their requests held are deregistered.
  ~basic_device() {
    if (queue_pairs_.load(std::memory_order_acquire) != 0) {
      std::fprintf(stderr,
                   "ferry: verbs device destroyed with %d queue_pair handle(s) still open; destroy "
                   "queue pairs before their device\n",
                   queue_pairs_.load(std::memory_order_relaxed));
      std::abort();
    }
    stop_watcher();
    exec_.remove_source(*this);
    // Timers may still fire on the executor thread until cancelled; after sync() none is running.
    for_each_qp([this](qp_state* q) {
      for_each_timed(q, [this](op_body* o) { cancel_timer(o); });
      disarm(q->guard);
      disarm(q->check);
    });
    exec_.sync();
    shutting_down_ = true;
    drain_expired();
    while (qp_state* q = to_break_) {  // everything ends below, with the shut-down's reason
      to_break_ = q->expiry_next;
      q->expiry_listed = false;
    }
    drain_overdue();
    while (take_fired(checks_due_) != nullptr) {
    }
    take_incoming();
    const std::error_code shut = make_error_code(ferry::errc::backend_shut_down);
    for_each_qp([&](qp_state* q) {
      fail_everything(q, shut);
      destroy_qp(q, shut);
    });
    qps_ = nullptr;
    with_pending_ = nullptr;
    if (regions_.load(std::memory_order_acquire) != 0) {
      std::fprintf(stderr,
                   "ferry: verbs device destroyed with %d memory_region(s) still registered; "
                   "destroy regions before their device\n",
                   regions_.load(std::memory_order_relaxed));
      std::abort();
    }
    close_objects();
  }

  [[nodiscard]] progress_executor& executor() const noexcept { return exec_; }
  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  [[nodiscard]] std::uint16_t lid() const noexcept { return lid_; }
  // Empty while usable; otherwise why nothing on this device can complete (a CQ error or a fatal
  // device event).
  [[nodiscard]] std::error_code failure() const noexcept {
    const int f = failure_.load(std::memory_order_acquire);
    return f == 0 ? std::error_code{} : make_error_code(static_cast<errc>(f));
  }
  [[nodiscard]] typename P::context_handle native_context() const noexcept { return context_; }
  [[nodiscard]] typename P::cq_handle native_cq() const noexcept { return cq_; }

  [[nodiscard]] device_counters counters() const noexcept {
    device_counters c;
    c.work_requests_posted = posted_.load(std::memory_order_relaxed);
    c.post_calls = post_calls_.load(std::memory_order_relaxed);
    c.completions = completions_.load(std::memory_order_relaxed);
    c.async_events = async_events_.load(std::memory_order_relaxed);
    c.flushes_overdue = flushes_overdue_.load(std::memory_order_relaxed);
    c.peer_checks = peer_checks_.load(std::memory_order_relaxed);
    return c;
  }

  // --- The executor's side: a completion source parked on the completion channel. ---

  std::size_t poll(std::size_t budget) noexcept {
    std::size_t handled = 0;
    if (expired_ != nullptr) handled += drain_expired();
    if (overdue_ != nullptr) handled += drain_overdue();
    if (checks_due_ != nullptr) handled += check_peers();
    if (events_pending_.load(std::memory_order_acquire)) handled += handle_async_events();
    if (!incoming_.empty()) handled += take_incoming();
    post_all();
    const std::size_t reaped = reap(budget);
    // Only once the reap has emptied the CQ: a success still in it would end its unit next round.
    if (to_break_ != nullptr && reaped < budget) break_expired();
    if (reaped != 0) post_all();
    return handled + reaped;
  }

  [[nodiscard]] int park_fd() const noexcept { return P::channel_fd(channel_); }

  // Before the executor sleeps: take the events already signalled, ask for the next one, and look
  // again, since a completion that landed before the request raises no event.
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

  using op_body = detail::op_body<P>;
  using op = detail::op<P>;
  using op_kind = detail::op_kind;
  using qp_state = detail::qp_state<P>;
  using qp_timer = detail::qp_timer<P>;
  using receive_slot = detail::receive_slot<P>;
  using region_state = detail::region_state<P>;
  using async_event = typename P::async_event;

  // --- Set-up and tear-down (constructor and destructor threads). ---

  void open() {
    const std::vector<std::string> names = P::device_names();
    if (names.empty()) {
      throw std::runtime_error("ferry::verbs::device: no RDMA device found (ibv_get_device_list "
                               "returned none; is an adapter present and its driver loaded?)");
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
    if (stop_fd_ >= 0) ::close(stop_fd_);
    cq_ = {};
    channel_ = {};
    pd_ = {};
    context_ = {};
    stop_fd_ = -1;
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

  // Creates an RC queue pair in INIT with its receives posted. The executor learns of it through the
  // `open` op, published before any request on it can be.
  qp_state* create_queue_pair(const queue_pair_options& o) {
    if (o.max_rd_atomic == 0) {
      throw std::invalid_argument(
          "ferry::verbs::queue_pair_options::max_rd_atomic must be at least 1");
    }
    if (o.send_depth == 0) {
      throw std::invalid_argument("ferry::verbs::queue_pair_options::send_depth must be at least 1");
    }
    if (o.receive_depth == 0) {
      throw std::invalid_argument(
          "ferry::verbs::queue_pair_options::receive_depth must be at least 1");
    }
    if (o.flush_timeout < std::chrono::nanoseconds::zero()) {
      throw std::invalid_argument(
          "ferry::verbs::queue_pair_options::flush_timeout must not be negative");
    }
    if (o.peer_check < std::chrono::nanoseconds::zero()) {
      throw std::invalid_argument(
          "ferry::verbs::queue_pair_options::peer_check must not be negative");
    }
    // A peer check goes out only on an idle queue pair and takes no request's credit, so a request
    // can find the send queue full while one is out (post_pending retries once it completes); its
    // completion has an entry of its own.
    const std::int64_t check_entry = o.peer_check > std::chrono::nanoseconds::zero() ? 1 : 0;
    const std::int64_t needs = std::int64_t{o.send_depth} + check_entry + o.receive_depth;
    {
      std::lock_guard lock(setup_mutex_);
      if (needs > cq_room_) {
        throw std::length_error(
            "ferry::verbs: a queue pair of send depth " + std::to_string(o.send_depth) +
            " and receive depth " + std::to_string(o.receive_depth) +
            (check_entry != 0 ? " (and one for peer checks)" : "") + " needs " +
            std::to_string(needs) + " completion queue entries, and only " +
            std::to_string(cq_room_) + " of the device's " +
            std::to_string(options_.completion_queue_entries) + " are left");
      }
      cq_room_ -= needs;
    }
    auto s = std::make_unique<qp_state>();
    s->device = this;
    try {
      ibv_qp_cap cap{};
      cap.max_send_wr = o.send_depth;
      cap.max_recv_wr = o.receive_depth;
      cap.max_send_sge = 1;
      cap.max_recv_sge = 1;
      cap.max_inline_data = std::max<std::uint32_t>(o.max_inline_data, sizeof(std::uint64_t));
      s->qp = P::create_qp(pd_, cq_, cq_, cap);
      if (!s->qp) throw system_error("ibv_create_qp");
      s->qp_num = P::qp_num(s->qp);
      s->psn = detail::initial_psn(s.get());
      // What the device granted: a provider may clamp the request.
      s->send_depth = std::min(o.send_depth, cap.max_send_wr);
      s->max_inline = cap.max_inline_data;
      s->max_rd_atomic = o.max_rd_atomic;
      s->admission_timeout = o.admission_timeout;
      s->flush_timeout = o.flush_timeout;
      s->peer_check = o.peer_check;
      s->guard.qp = s.get();
      s->check.qp = s.get();
      s->cq_reserved = needs;
      s->credits.store(s->send_depth, std::memory_order_relaxed);

      ibv_qp_attr attr{};
      attr.qp_state = IBV_QPS_INIT;
      attr.pkey_index = 0;
      attr.port_num = options_.port;
      attr.qp_access_flags =
          IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
      if (const int r = P::modify_qp(s->qp, attr,
                                     IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
                                         IBV_QP_ACCESS_FLAGS);
          r != 0) {
        throw std::system_error(r, std::system_category(), "ferry::verbs: ibv_modify_qp(INIT)");
      }

      s->slot_count = std::min(o.receive_depth, cap.max_recv_wr);
      s->slots = std::make_unique<receive_slot[]>(s->slot_count);
      s->arrived.resize(s->slot_count);
      s->slots_mr = P::reg_mr(pd_, s->slots.get(), sizeof(receive_slot) * s->slot_count,
                              IBV_ACCESS_LOCAL_WRITE);
      if (!s->slots_mr) throw system_error("ibv_reg_mr(receive buffers)");
      for (std::uint32_t i = 0; i < s->slot_count; ++i) {
        receive_slot& slot = s->slots[i];
        slot.qp = s.get();
        slot.sge.addr = reinterpret_cast<std::uintptr_t>(&slot.value);
        slot.sge.length = sizeof slot.value;
        slot.sge.lkey = P::lkey(s->slots_mr);
        slot.wr.wr_id = reinterpret_cast<std::uintptr_t>(&slot) | 1;
        slot.wr.sg_list = &slot.sge;
        slot.wr.num_sge = 1;
        ibv_recv_wr* bad = nullptr;
        if (const int r = P::post_recv(s->qp, &slot.wr, &bad); r != 0) {
          throw std::system_error(r, std::system_category(), "ferry::verbs: ibv_post_recv");
        }
        ++s->receives_posted;
      }
      s->close_op = op::make(op_kind::close);
      s->close_op->qp = s.get();
      op_body* open_op = op::make(op_kind::open);
      open_op->qp = s.get();
      queue_pairs_.fetch_add(1, std::memory_order_relaxed);
      publish(open_op);
    } catch (...) {
      if (s->close_op != nullptr) op::free(s->close_op);
      if (s->qp) P::destroy_qp(s->qp);
      if (s->slots_mr) P::dereg_mr(s->slots_mr);
      std::lock_guard lock(setup_mutex_);
      cq_room_ += needs;
      throw;
    }
    return s.release();
  }

  [[nodiscard]] endpoint_info local_info(const qp_state* s) const noexcept {
    endpoint_info info;
    info.qp_num = s->qp_num;
    info.psn = s->psn;
    info.lid = lid_;
    info.mtu = mtu_;
    info.has_gid = has_gid_;
    info.gid = gid_;
    info.max_rd_atomic = s->max_rd_atomic;
    return info;
  }

  // INIT → RTR → RTS towards `remote`. Throws std::system_error naming the step that failed.
  void connect(qp_state* s, const endpoint_info& remote) {
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_RTR;
    attr.path_mtu = static_cast<ibv_mtu>(std::min(mtu_, remote.mtu));
    attr.dest_qp_num = remote.qp_num;
    attr.rq_psn = remote.psn;
    attr.max_dest_rd_atomic = s->max_rd_atomic;
    attr.min_rnr_timer = 12;
    attr.ah_attr.dlid = remote.lid;
    attr.ah_attr.port_num = options_.port;
    if (remote.has_gid) {
      attr.ah_attr.is_global = 1;
      attr.ah_attr.grh.dgid = remote.gid;
      attr.ah_attr.grh.sgid_index = static_cast<std::uint8_t>(options_.gid_index);
      attr.ah_attr.grh.hop_limit = 64;
    }
    if (const int r = P::modify_qp(s->qp, attr,
                                   IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                                       IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
                                       IBV_QP_MIN_RNR_TIMER);
        r != 0) {
      throw std::system_error(r, std::system_category(),
                              "ferry::verbs: ibv_modify_qp(RTR) towards queue pair " +
                                  std::to_string(remote.qp_num) + " at LID " +
                                  std::to_string(remote.lid));
    }
    attr = ibv_qp_attr{};
    attr.qp_state = IBV_QPS_RTS;
    attr.timeout = 14;   // 4.096 µs × 2^14 ≈ 67 ms per transport retry
    attr.retry_cnt = 7;
    attr.rnr_retry = 7;  // the peer not ready to receive a notification: retry without limit
    attr.sq_psn = s->psn;
    // No more READs out at once than the peer accepts: beyond that it would answer with an
    // invalid-request NAK, and the queue pair would go to the error state. (A peer that accepts none
    // can still be written to; a READ towards it fails.)
    attr.max_rd_atomic = std::min(s->max_rd_atomic, remote.max_rd_atomic);
    if (const int r = P::modify_qp(s->qp, attr,
                                   IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                                       IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC);
        r != 0) {
      throw std::system_error(r, std::system_category(), "ferry::verbs: ibv_modify_qp(RTS)");
    }
    s->connected.store(true, std::memory_order_release);
  }

  void close_queue_pair(qp_state* s) noexcept {
    publish(s->close_op);
    queue_pairs_.fetch_sub(1, std::memory_order_release);
  }

  void stop_watcher() noexcept {
    if (!watcher_.joinable()) return;
    const std::uint64_t one = 1;
    [[maybe_unused]] const ssize_t n = ::write(stop_fd_, &one, sizeof one);
    watcher_.join();
  }

  // The watcher thread: asynchronous events are rare, so they get a thread of their own instead of
  // a system call in every executor round. It hands them to the executor, which owns all state.
  void watch_async_events() noexcept {
    pollfd fds[2]{};
    fds[0].fd = P::async_fd(context_);
    fds[0].events = POLLIN;
    fds[1].fd = stop_fd_;
    fds[1].events = POLLIN;
    for (;;) {
      const int n = ::poll(fds, 2, -1);
      if (n < 0) {
        if (errno == EINTR) continue;
        return;
      }
      if (fds[1].revents != 0) return;
      if ((fds[0].revents & POLLIN) != 0) {
        async_event ev{};
        bool any = false;
        while (P::get_async_event(context_, ev) == 0) {
          std::lock_guard lock(events_mutex_);
          try {
            events_.push_back(ev);
          } catch (...) {
            // Out of memory: a fatal event still ends everything it names through its flushes
            // and deadlines; nothing else can be done here.
          }
          any = true;
        }
        if (any) {
          // Release pairs with the acquire load in poll(): the queued events travel with it.
          events_pending_.store(true, std::memory_order_release);
          exec_.notify();
        }
      } else if ((fds[0].revents & (POLLERR | POLLHUP | POLLNVAL)) != 0) {
        return;
      }
    }
  }

  // --- Submission (any thread). ---

  // Publishes a unit (its lead; members hang off unit_next). After it the executor owns the unit.
  void publish(op_body* lead) noexcept {
    incoming_.push(lead);
    exec_.notify();
  }

  // --- The executor thread from here on (or the destructor, once the source is removed). ---

  std::size_t take_incoming() noexcept {
    return incoming_.take([this](op_body* o) { route(o); });
  }

  void route(op_body* lead) noexcept {
    qp_state* q = lead->qp;
    switch (lead->kind) {
      case op_kind::open:
        op::free(lead);
        q->all_next = qps_;
        if (qps_ != nullptr) qps_->all_prev = q;
        qps_ = q;
        // Created after the CQ or the device failed: nothing on it could ever complete.
        if (const int f = failure_.load(std::memory_order_relaxed); f != 0) {
          break_queue_pair(q, static_cast<errc>(f));
        }
        return;
      case op_kind::close:
        op::free(lead);
        q->close_op = nullptr;
        return close_now(q);
      case op_kind::wait_notification:
        return route_wait(lead);
      case op_kind::write:
      case op_kind::read:
      case op_kind::notify:
      case op_kind::peer_check:
        break;
    }
    if (const std::error_code ec = refusal(q); ec) return end_unit(lead, transfer_state::failed, ec);
    if (!arm_deadline(lead)) {
      return end_unit(lead, transfer_state::failed,
                      std::make_error_code(std::errc::not_enough_memory));
    }
    queue_unit(q, lead);
  }

  // The unit goes out with the queue pair's next chain (post_all).
  void queue_unit(qp_state* q, op_body* lead) noexcept {
    for (op_body* m = lead; m != nullptr; m = m->unit_next) q->pending.push(m);
    if (!q->listed_pending) {
      q->listed_pending = true;
      q->pending_next = with_pending_;
      with_pending_ = q;
    }
  }

  [[nodiscard]] std::error_code refusal(const qp_state* q) const noexcept {
    if (shutting_down_) return make_error_code(ferry::errc::backend_shut_down);
    if (const int b = q->broken.load(std::memory_order_relaxed); b != 0) {
      return make_error_code(static_cast<errc>(b));
    }
    return {};
  }

  void route_wait(op_body* w) noexcept {
    qp_state* q = w->qp;
    if (q->arrived_at != 0) return deliver(q, w, take_arrived(q));
    if (const std::error_code ec = refusal(q); ec) return end_wait(w, transfer_state::failed, ec);
    if (!arm_deadline(w)) {
      return end_wait(w, transfer_state::failed, std::make_error_code(std::errc::not_enough_memory));
    }
    q->waiters.push(w);
    arm_peer_check(q);
  }

  // --- Peer checks (queue_pair_options::peer_check): while a notification wait is queued, the
  // timer runs; when it fires with nothing else in flight, a zero-length RDMA WRITE goes out, whose
  // failure breaks the queue pair with errc::peer_unreachable (on_completion). ---

  void arm_peer_check(qp_state* q) noexcept {
    if (q->peer_check == std::chrono::nanoseconds::zero() || shutting_down_ || q->in_error ||
        q->check.armed || q->check.fired) {
      return;
    }
    // Out of memory: no check, and a wait without a deadline relies on its peer as before.
    (void)arm(q->check, q->peer_check, &list_fired<&basic_device::checks_due_>);
  }

  std::size_t check_peers() noexcept {
    std::size_t n = 0;
    while (qp_timer* c = take_fired(checks_due_)) {
      qp_state* q = c->qp;
      ++n;
      if (q->in_error || q->waiters.empty()) continue;  // armed again by the next wait
      // Anything else in flight tells of a peer that has gone as well as a check would.
      // A check towards a peer not yet connected would fail and take the queue pair down.
      if (q->connected.load(std::memory_order_acquire) &&
          q->peer_up.load(std::memory_order_relaxed) && q->posted_head == nullptr &&
          q->pending.empty()) {
        post_peer_check(q);
      }
      arm_peer_check(q);
    }
    return n;
  }

  void post_peer_check(qp_state* q) noexcept {
    // It takes no credit: the send queue is empty now, and a request posted while the check is out
    // and the queue is full is refused for now (ENOMEM) and posted again once the check completes.
    op_body* o = nullptr;
    try {
      o = op::make(op_kind::peer_check);
      o->status = ferry::detail::status_block::make();
    } catch (...) {
      if (o != nullptr) op::free(o);
      return;
    }
    // Nobody waits for it: its handle goes at once, and end_unit releases the completer's reference.
    { const transfer unwatched(ferry::detail::adopt, o->status); }
    o->qp = q;
    o->wr.wr_id = reinterpret_cast<std::uintptr_t>(o);
    o->wr.opcode = IBV_WR_RDMA_WRITE;  // zero length: no scatter/gather entry, no rkey checked
    o->wr.send_flags = IBV_SEND_SIGNALED;
    queue_unit(q, o);
    peer_checks_.fetch_add(1, std::memory_order_relaxed);
  }

  // Arms the deadline timer; false when it cannot (out of memory), and the caller ends the request.
  bool arm_deadline(op_body* lead) noexcept {
    if (!lead->has_deadline) return true;
    lead->timer.fire = &on_deadline;
    try {
      exec_.timers().arm(lead->timer);
    } catch (...) {
      return false;
    }
    lead->timer_armed = true;
    return true;
  }

  void cancel_timer(op_body* lead) noexcept {
    // Both run on the executor thread, and poll() takes expired timers before anything that can
    // end a unit: a timer that already fired has been handled, so a failed cancel needs nothing.
    if (lead->timer_armed && exec_.timers().cancel(lead->timer)) lead->timer_armed = false;
  }

  // Runs inside the executor's timer round, concurrently with nothing of ours: it only queues.
  static void on_deadline(ferry::detail::timer_node* t) noexcept {
    op_body* o = detail::op_of<P>(t);
    basic_device* self = o->qp->device;
    o->expired_next = self->expired_;
    self->expired_ = o;
  }

  std::size_t drain_expired() noexcept {
    std::size_t n = 0;
    while (expired_ != nullptr) {
      op_body* lead = expired_;
      expired_ = lead->expired_next;
      lead->timer_armed = false;
      ++n;
      const std::error_code late = make_error_code(errc::deadline_exceeded);
      if (lead->kind == op_kind::wait_notification) {
        lead->qp->waiters.remove_if([lead](op_body* w) { return w == lead; });
        end_wait(lead, transfer_state::failed, late);
        continue;
      }
      if (!lead->posted) {
        // Never reached the adapter (the provider refused it for now): it can go at once.
        lead->qp->pending.remove_if([lead](op_body* m) { return m->lead == lead; });
        end_unit(lead, transfer_state::failed, late);
      } else {
        // The adapter holds it, and an RC queue pair hands a request back only by flushing it: the
        // queue pair goes to the error state (break_expired, after this round's reap), and the
        // flush ends the unit (deadline_exceeded) once the adapter no longer touches its memory.
        lead->expired = true;
        qp_state* q = lead->qp;
        if (!q->in_error && !q->expiry_listed) {
          q->expiry_listed = true;
          q->expiry_next = to_break_;
          to_break_ = q;
        }
      }
    }
    return n;
  }

  // Queue pairs with a posted unit whose deadline passed go to the error state here, after the
  // reap (a unit whose success was already in the CQ has ended by now), and never while expired_
  // is walked: breaking ends waiters and unposted units, which may be further down that list.
  void break_expired() noexcept {
    while (qp_state* q = to_break_) {
      to_break_ = q->expiry_next;
      q->expiry_listed = false;
      if (q->in_error) continue;
      for (op_body* l = q->posted_head; l != nullptr; l = l->list_next) {
        if (l->expired) {
          break_queue_pair(q, errc::queue_pair_timed_out);
          break;
        }
      }
    }
  }

  void post_all() noexcept {
    qp_state* list = std::exchange(with_pending_, nullptr);
    while (list != nullptr) {
      qp_state* q = list;
      list = q->pending_next;
      post_pending(q);
      if (q->pending.empty()) {
        q->listed_pending = false;
      } else {
        q->pending_next = with_pending_;
        with_pending_ = q;
      }
    }
  }

  // Posts the queue pair's queued members as one chain: one doorbell for everything queued.
  void post_pending(qp_state* q) noexcept {
    if (q->pending.empty()) return;
    for (op_body* o = q->pending.head; o != nullptr; o = o->next) {
      o->wr.next = o->next != nullptr ? &o->next->wr : nullptr;
    }
    ibv_send_wr* bad = nullptr;
    const int r = P::post_send(q->qp, &q->pending.head->wr, &bad);
    post_calls_.fetch_add(1, std::memory_order_relaxed);
    std::uint64_t posted = 0;
    while (!q->pending.empty() && (r == 0 || &q->pending.head->wr != bad)) {
      op_body* o = q->pending.pop();
      o->wr.next = nullptr;
      o->posted = true;
      ++posted;
      if (o == o->lead) list_posted(q, o);
    }
    posted_.fetch_add(posted, std::memory_order_relaxed);
    if (r == 0) return;
    if (q->pending.empty()) {
      // Refused, naming no request of the chain (bad_wr outside it): which ones the adapter took is
      // unknown, so all count as posted and the queue pair goes down. The adapter flushes what it
      // has; the flush timeout ends what it never had.
      return break_queue_pair(q, errc::queue_pair_error);
    }
    // ENOMEM while whole units are in flight: their signalled completions free room, and the rest
    // goes then. Without one, nothing would ever free it (the head of a unit cut here is
    // unsignalled): the queue pair cannot go on.
    if (r == ENOMEM && completion_coming(q)) return;
    // Units the adapter never saw fail with the reason it refused them; one cut part-way ends on
    // its flush (abandon_pending).
    const std::error_code ec(r, std::system_category());
    for (op_body* o = q->pending.head; o != nullptr; o = o->next) {
      if (!o->lead->posted) fail_unit(o->lead, ec);
    }
    break_queue_pair(q, errc::queue_pair_error);
  }

  [[nodiscard]] static bool completion_coming(const qp_state* q) noexcept {
    for (const op_body* l = q->posted_head; l != nullptr; l = l->list_next) {
      if (l->last->posted && !l->orphaned) return true;
    }
    return false;
  }

  void list_posted(qp_state* q, op_body* lead) noexcept {
    lead->listed = true;
    lead->list_prev = q->posted_tail;
    lead->list_next = nullptr;
    (q->posted_tail == nullptr ? q->posted_head : q->posted_tail->list_next) = lead;
    q->posted_tail = lead;
  }

  void unlist_posted(qp_state* q, op_body* lead) noexcept {
    if (!lead->listed) return;
    (lead->list_prev == nullptr ? q->posted_head : lead->list_prev->list_next) = lead->list_next;
    (lead->list_next == nullptr ? q->posted_tail : lead->list_next->list_prev) = lead->list_prev;
    lead->listed = false;
  }

  std::size_t reap(std::size_t budget) noexcept {
    if (cq_failed_) return 0;
    constexpr int batch = 32;
    ibv_wc wc[batch];
    std::size_t handled = 0;
    while (handled < budget) {
      const int want = static_cast<int>(std::min<std::size_t>(batch, budget - handled));
      const int n = P::poll_cq(cq_, want, wc);
      if (n < 0) {
        fail_device(errc::completion_queue_error);
        break;
      }
      for (int i = 0; i < n; ++i) on_completion(wc[i]);
      // Closing queue pairs that may now go are destroyed only after the whole batch: a later
      // entry of it may still name one of them.
      while (qp_state* q = doomed_) {
        doomed_ = q->doomed_next;
        q->doomed = false;
        maybe_destroy(q);
      }
      handled += static_cast<std::size_t>(n);
      if (n < want) break;
    }
    if (handled != 0) completions_.fetch_add(handled, std::memory_order_relaxed);
    return handled;
  }

  void on_completion(const ibv_wc& wc) noexcept {
    if ((wc.wr_id & 1) != 0) {
      return on_receive(reinterpret_cast<receive_slot*>(wc.wr_id & ~std::uint64_t{1}), wc);
    }
    op_body* o = reinterpret_cast<op_body*>(wc.wr_id);
    op_body* lead = o->lead;
    qp_state* q = lead->qp;
    if (wc.status == IBV_WC_SUCCESS) {
      note_peer_up(q);
      // Only a unit's last member is signalled, and RC completes in order: every member landed.
      end_unit(lead, transfer_state::success, {});
    } else {
      const std::error_code ec = failure_of(lead, wc);
      // The adapter's retries ran out: the peer did not answer (a check, or any request).
      const bool peer_gone = wc.status == IBV_WC_RETRY_EXC_ERR;
      if (o == lead->last) {
        end_unit(lead, transfer_state::failed, ec);
      } else {
        fail_unit(lead, ec);  // the flushes of the rest follow; the last one ends the unit
      }
      // The queue pair is in the error state now: nothing queued behind can succeed.
      if (!q->in_error) {
        break_queue_pair(q, peer_gone ? errc::peer_unreachable : errc::queue_pair_error, false);
      }
    }
    if (q->closing) doom(q);
  }

  // What a failed completion of `lead`'s unit reports: a flush of a queue pair ferry broke reports
  // why it broke it (its own deadline, for the request whose deadline passed); anything else, the
  // adapter's status.
  static std::error_code failure_of(const op_body* lead, const ibv_wc& wc) noexcept {
    if (wc.status == IBV_WC_WR_FLUSH_ERR) {
      if (lead->expired) return make_error_code(errc::deadline_exceeded);
      const int b = lead->qp->broken.load(std::memory_order_relaxed);
      if (b != 0 && b != static_cast<int>(errc::queue_pair_error)) {
        return make_error_code(static_cast<errc>(b));
      }
    }
    return make_error_code(static_cast<ibv_wc_status>(wc.status));
  }

  static void note_peer_up(qp_state* q) noexcept {
    if (!q->peer_up.load(std::memory_order_relaxed)) q->peer_up.store(true, std::memory_order_relaxed);
  }

  void doom(qp_state* q) noexcept {
    if (q->doomed) return;
    q->doomed = true;
    q->doomed_next = doomed_;
    doomed_ = q;
  }

  void on_receive(receive_slot* slot, const ibv_wc& wc) noexcept {
    qp_state* q = slot->qp;
    --q->receives_posted;
    if (q->closing) return doom(q);  // nobody can take it any more
    if (wc.status != IBV_WC_SUCCESS) {
      if (!q->in_error) break_queue_pair(q, errc::queue_pair_error, false);
      return;
    }
    note_peer_up(q);
    if (wc.byte_len != sizeof slot->value) {
      // Not a ferry notification: fail whoever waits for one, and keep the receive going.
      if (op_body* w = q->waiters.pop()) {
        cancel_timer(w);
        end_wait(w, transfer_state::failed, make_error_code(errc::bad_notification));
      }
      repost(q, slot);
      return;
    }
    if (op_body* w = q->waiters.pop()) {
      cancel_timer(w);
      return deliver(q, w, slot);
    }
    q->arrived[(q->arrived_at++)] = slot;
  }

  receive_slot* take_arrived(qp_state* q) noexcept {
    receive_slot* first = q->arrived[0];
    std::move(q->arrived.begin() + 1, q->arrived.begin() + static_cast<std::ptrdiff_t>(q->arrived_at),
              q->arrived.begin());
    --q->arrived_at;
    return first;
  }

  void deliver(qp_state* q, op_body* w, receive_slot* slot) noexcept {
    *w->value_out = slot->value;
    end_wait(w, transfer_state::success, {});
    repost(q, slot);
  }

  void repost(qp_state* q, receive_slot* slot) noexcept {
    if (q->in_error) return;
    ibv_recv_wr* bad = nullptr;
    if (P::post_recv(q->qp, &slot->wr, &bad) == 0) {
      ++q->receives_posted;
    } else {
      break_queue_pair(q, errc::queue_pair_error);
    }
  }

  void end_wait(op_body* w, transfer_state to, std::error_code ec) noexcept {
    ferry::detail::status_block* s = w->status;
    op::free(w);
    s->complete(to, ec);
    s->release_completer_ref();
  }

  // Fails every member still pending; a member already ended keeps its result. Once per unit: a
  // failed batch of k members gets up to k flush completions, each of which lands here.
  void fail_unit(op_body* lead, std::error_code ec) noexcept {
    if (lead->failed) return;
    lead->failed = true;
    for (op_body* m = lead; m != nullptr; m = m->unit_next) m->status->complete(transfer_state::failed, ec);
  }

  // The adapter is done with the unit (or never had it). Its slots go back first, then its members
  // end (`to`, unless already ended): a continuation resumed inline by that may post again at once.
  void end_unit(op_body* lead, transfer_state to, std::error_code ec) noexcept {
    qp_state* q = lead->qp;
    cancel_timer(lead);
    unlist_posted(q, lead);
    if (q->posted_head == nullptr) disarm_flush_guard(q);
    if (lead->kind != op_kind::peer_check) {
      q->credits.fetch_add(lead->unit_size, std::memory_order_release);
    }
    for (op_body* m = lead; m != nullptr;) {
      op_body* next = m->unit_next;
      ferry::detail::status_block* s = m->status;
      region_state* r = m->region;
      op::free(m);
      // The adapter is done with the memory: the region goes first, so that a continuation resumed
      // by the completion already sees it free (in_use() false).
      if (r != nullptr) r->release();
      s->complete(to, ec);
      s->release_completer_ref();
      m = next;
    }
  }

  // Ends what has not reached the adapter. A unit cut by post_send part-way has its head in the
  // adapter: its tail is posted now, into the queue pair in the error state, so that the adapter
  // flushes it and the flush of its last member ends the unit. If even that is refused, the flush
  // of its head fails it, and it stays until the queue pair is destroyed (which stops the adapter
  // touching its memory). Either way it ends on a flush, never before the adapter lets go of it.
  void abandon_pending(qp_state* q, std::error_code ec) noexcept {
    while (op_body* o = q->pending.head) {
      op_body* lead = o->lead;
      if (!lead->posted) {
        q->pending.remove_if([lead](op_body* m) { return m->lead == lead; });
        end_unit(lead, transfer_state::failed, ec);
        continue;
      }
      op_body* tail = o;
      for (op_body* m = o; m != nullptr; m = m->unit_next) {
        q->pending.pop();
        m->wr.next = m->unit_next != nullptr ? &m->unit_next->wr : nullptr;
      }
      ibv_send_wr* bad = nullptr;
      if (P::post_send(q->qp, &tail->wr, &bad) == 0) {
        for (op_body* m = tail; m != nullptr; m = m->unit_next) m->posted = true;
      } else {
        lead->orphaned = true;
      }
    }
  }

  // The queue pair can no longer succeed: fail everything it holds with `why` and move it to the
  // error state, so the adapter flushes what it was given (`move` false: it is already there).
  void break_queue_pair(qp_state* q, errc why, bool move = true) noexcept {
    int none = 0;
    q->broken.compare_exchange_strong(none, static_cast<int>(why), std::memory_order_release,
                                      std::memory_order_relaxed);
    const std::error_code ec =
        make_error_code(static_cast<errc>(q->broken.load(std::memory_order_relaxed)));
    if (move && !q->in_error) {
      ibv_qp_attr attr{};
      attr.qp_state = IBV_QPS_ERR;
      P::modify_qp(q->qp, attr, IBV_QP_STATE);
    }
    q->in_error = true;
    abandon_pending(q, ec);
    // What is posted ends with its flush, once the adapter has let go of its memory; the guard
    // bounds the wait for an adapter that never flushes.
    arm_flush_guard(q);
    while (op_body* w = q->waiters.pop()) {
      cancel_timer(w);
      end_wait(w, transfer_state::failed, ec);
    }
  }

  // --- A queue pair's timers: fired in the executor's timer round, which only lists them (in
  // overdue_ or checks_due_); poll() handles the lists first. ---

  // False when the timer cannot be armed (out of memory).
  bool arm(qp_timer& t, std::chrono::nanoseconds after,
           void (*fire)(ferry::detail::timer_node*) noexcept) noexcept {
    t.timer.deadline = ferry::detail::deadline_after(after);
    t.timer.fire = fire;
    try {
      exec_.timers().arm(t.timer);
    } catch (...) {
      return false;
    }
    t.armed = true;
    return true;
  }

  void disarm(qp_timer& t) noexcept {
    // As cancel_timer: one that already fired is listed, and poll() drains the lists first.
    if (t.armed && exec_.timers().cancel(t.timer)) t.armed = false;
  }

  // The timers' callback: lists the fired timer in `List`.
  template <qp_timer* basic_device::*List>
  static void list_fired(ferry::detail::timer_node* node) noexcept {
    static_assert(std::is_standard_layout_v<qp_timer>);
    auto* t = reinterpret_cast<qp_timer*>(node);
    basic_device* self = t->qp->device;
    t->fired = true;
    t->fired_next = self->*List;
    self->*List = t;
  }

  // The next fired timer of `list`, taken off it; null when there is none.
  static qp_timer* take_fired(qp_timer*& list) noexcept {
    qp_timer* t = list;
    if (t == nullptr) return nullptr;
    list = t->fired_next;
    t->armed = false;
    t->fired = false;
    return t;
  }

  // For a queue pair that is going: takes its timer off `list` if it fired.
  static void unlist_fired(qp_timer*& list, qp_timer& t) noexcept {
    if (!t.fired) return;
    qp_timer** link = &list;
    while (*link != &t) link = &(*link)->fired_next;
    *link = t.fired_next;
    t.fired = false;
  }

  void arm_flush_guard(qp_state* q) noexcept {
    // The destructor ends everything itself (and a timer armed then could fire on the executor).
    // After a CQ error nothing is reaped, and everything posted has been failed already.
    if (shutting_down_ || cq_failed_ || q->posted_head == nullptr || q->guard.armed ||
        q->guard.fired) {
      return;
    }
    // No timer (out of memory): give up waiting at once, as the guard would.
    if (!arm(q->guard, q->flush_timeout, &list_fired<&basic_device::overdue_>)) give_up_flushes(q);
  }

  void disarm_flush_guard(qp_state* q) noexcept { disarm(q->guard); }

  std::size_t drain_overdue() noexcept {
    std::size_t n = 0;
    while (qp_timer* g = take_fired(overdue_)) {
      qp_state* q = g->qp;
      if (q->closing) {
        // Closed, its handle gone: destroying it is the only way left to take back what the
        // adapter holds (receives included), and it ends the requests only once it is done.
        if (q->posted_head != nullptr) flushes_overdue_.fetch_add(1, std::memory_order_relaxed);
        unlist_and_destroy(q, make_error_code(errc::queue_pair_closed));
      } else {
        give_up_flushes(q);
      }
      ++n;
    }
    return n;
  }

  // The adapter has not handed back what the broken queue pair holds: fail it now (nothing may wait
  // for ever). Its memory stays registered until the flush comes or the queue pair goes.
  // `overdue`: the flush timeout ran out (counted when anything is failed, first, so that a waiter
  // woken here sees the count), rather than the CQ or the device failing.
  void give_up_flushes(qp_state* q, bool overdue = true) noexcept {
    const op_body* first = q->posted_head;
    while (first != nullptr && first->failed) first = first->list_next;
    if (first == nullptr) return;
    if (overdue) flushes_overdue_.fetch_add(1, std::memory_order_relaxed);
    const int b = q->broken.load(std::memory_order_relaxed);
    const std::error_code why = make_error_code(static_cast<errc>(b != 0 ? b : 1));
    for (op_body* l = q->posted_head; l != nullptr; l = l->list_next) {
      fail_unit(l, l->expired ? make_error_code(errc::deadline_exceeded) : why);
    }
  }

  void close_now(qp_state* q) noexcept {
    q->closing = true;
    break_queue_pair(q, errc::queue_pair_closed);
    maybe_destroy(q);
  }

  // A closing queue pair goes once the adapter has handed back everything it was given (an orphaned
  // unit will never be: destroying the queue pair is what ends it).
  void maybe_destroy(qp_state* q) noexcept {
    if (q->receives_posted != 0 || shutting_down_) return;
    for (const op_body* l = q->posted_head; l != nullptr; l = l->list_next) {
      if (!l->orphaned) return;
    }
    unlist_and_destroy(q);
  }

  void unlist_and_destroy(qp_state* q,
                          std::error_code ec = make_error_code(errc::queue_pair_closed)) noexcept {
    (q->all_prev == nullptr ? qps_ : q->all_prev->all_next) = q->all_next;
    if (q->all_next != nullptr) q->all_next->all_prev = q->all_prev;
    destroy_qp(q, ec);
  }

  // Destroys the queue pair first (the adapter stops touching memory), then releases what it held;
  // what was still posted ends with `ec` (deadline_exceeded for a request whose deadline passed).
  void destroy_qp(qp_state* q,
                  std::error_code ec = make_error_code(errc::queue_pair_closed)) noexcept {
    if (q->listed_pending) {
      qp_state** link = &with_pending_;
      while (*link != q) link = &(*link)->pending_next;
      *link = q->pending_next;
    }
    if (q->expiry_listed) {
      qp_state** link = &to_break_;
      while (*link != q) link = &(*link)->expiry_next;
      *link = q->expiry_next;
    }
    disarm(q->guard);
    unlist_fired(overdue_, q->guard);
    disarm(q->check);
    unlist_fired(checks_due_, q->check);
    P::destroy_qp(q->qp);
    while (op_body* l = q->posted_head) {
      end_unit(l, transfer_state::failed, l->expired ? make_error_code(errc::deadline_exceeded) : ec);
    }
    if (q->slots_mr) P::dereg_mr(q->slots_mr);
    {
      std::lock_guard lock(setup_mutex_);
      cq_room_ += q->cq_reserved;
    }
    if (q->close_op != nullptr) op::free(q->close_op);
    delete q;
  }

  // The destructor's: what never reached the adapter. The queue pair is destroyed next, which ends
  // what is posted, once the adapter can no longer touch it.
  void fail_everything(qp_state* q, std::error_code ec) noexcept {
    while (op_body* o = q->pending.head) {
      op_body* lead = o->lead;
      q->pending.remove_if([lead](op_body* m) { return m->lead == lead; });
      if (!lead->posted) end_unit(lead, transfer_state::failed, ec);
    }
    while (op_body* w = q->waiters.pop()) end_wait(w, transfer_state::failed, ec);
  }

  // Calls f on every queue pair; f may destroy the one it is given.
  template <class F>
  void for_each_qp(F f) noexcept {
    for (qp_state* q = qps_; q != nullptr;) {
      qp_state* next = q->all_next;
      f(q);
      q = next;
    }
  }

  template <class F>
  void for_each_timed(qp_state* q, F f) noexcept {
    for (op_body* o = q->pending.head; o != nullptr; o = o->next) {
      if (o == o->lead) f(o);
    }
    for (op_body* l = q->posted_head; l != nullptr; l = l->list_next) f(l);
    for (op_body* w = q->waiters.head; w != nullptr; w = w->next) f(w);
  }

  // Nothing on the device can complete any more: every queue pair, and any created later, fails.
  void fail_device(errc why) noexcept {
    int none = 0;
    failure_.compare_exchange_strong(none, static_cast<int>(why), std::memory_order_release,
                                     std::memory_order_relaxed);
    cq_failed_ = true;
    // No completion will be reaped any more, flushes included: what is posted fails now (its memory
    // stays registered until its queue pair goes).
    for_each_qp([this, why](qp_state* q) {
      break_queue_pair(q, why);
      give_up_flushes(q, false);
    });
  }

  std::size_t handle_async_events() noexcept {
    std::vector<async_event> events;
    {
      std::lock_guard lock(events_mutex_);
      events.swap(events_);
      events_pending_.store(false, std::memory_order_relaxed);
    }
    async_events_.fetch_add(events.size(), std::memory_order_relaxed);
    for (const async_event& ev : events) {
      switch (ev.type) {
        case IBV_EVENT_QP_FATAL:
        case IBV_EVENT_QP_REQ_ERR:
        case IBV_EVENT_QP_ACCESS_ERR:
        case IBV_EVENT_PATH_MIG_ERR:
          for_each_qp([&](qp_state* q) {
            if (q->qp == ev.qp && q->qp_num == ev.qp_num) break_queue_pair(q, errc::queue_pair_fatal);
          });
          break;
        case IBV_EVENT_CQ_ERR:
          fail_device(errc::completion_queue_error);
          break;
        case IBV_EVENT_DEVICE_FATAL:
          fail_device(errc::device_fatal);
          break;
        case IBV_EVENT_PORT_ERR:
          if (ev.port == options_.port) {
            for_each_qp([this](qp_state* q) { break_queue_pair(q, errc::port_down); });
          }
          break;
        default:
          break;  // informational (port active, LID change, communication established, ...)
      }
    }
    return events.size();
  }

  progress_executor& exec_;
  device_options options_;
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

  int stop_fd_ = -1;
  std::thread watcher_;
  std::mutex events_mutex_;
  std::vector<async_event> events_;
  std::atomic<bool> events_pending_{false};

  ferry::detail::submission_stack<op_body> incoming_;

  // The executor's.
  qp_state* qps_ = nullptr;
  qp_state* with_pending_ = nullptr;
  qp_state* doomed_ = nullptr;
  op_body* expired_ = nullptr;
  qp_state* to_break_ = nullptr;
  qp_timer* overdue_ = nullptr;     // flush guards that fired
  qp_timer* checks_due_ = nullptr;  // peer checks that fired
  bool cq_failed_ = false;
  bool shutting_down_ = false;

  std::atomic<std::uint64_t> posted_{0};
  std::atomic<std::uint64_t> post_calls_{0};
  std::atomic<std::uint64_t> completions_{0};
  std::atomic<std::uint64_t> async_events_{0};
  std::atomic<std::uint64_t> flushes_overdue_{0};
  std::atomic<std::uint64_t> peer_checks_{0};
};

template <class P>
void detail::region_state<P>::release() noexcept {
  if (refs.fetch_sub(1, std::memory_order_acq_rel) == 1) device->unregister(this);
}

// An RC queue pair. Destroying the handle moves it to the error state: requests still in flight
// fail with errc::queue_pair_closed, and the queue pair itself is destroyed once the adapter has
// flushed them.
template <class P>
class basic_queue_pair {
 public:
  using local_slice = basic_local_slice<P>;
  using rdma_block = basic_rdma_block<P>;

  basic_queue_pair() noexcept = default;

  basic_queue_pair(basic_device<P>& device, queue_pair_options options = {})
      : state_(device.create_queue_pair(options)) {}

  basic_queue_pair(basic_queue_pair&& other) noexcept : state_(std::exchange(other.state_, nullptr)) {}
  basic_queue_pair& operator=(basic_queue_pair&& other) noexcept {
    basic_queue_pair(std::move(other)).swap(*this);
    return *this;
  }
  ~basic_queue_pair() {
    if (state_ != nullptr) state_->device->close_queue_pair(state_);
  }
  void swap(basic_queue_pair& other) noexcept { std::swap(state_, other.state_); }

  // What the peer needs to connect to this queue pair.
  [[nodiscard]] endpoint_info local_info() const noexcept { return state_->device->local_info(state_); }

  // Brings the queue pair to RTS towards `remote`. Throws std::system_error naming the failed step.
  void connect(const endpoint_info& remote) { state_->device->connect(state_, remote); }

  // Tells the queue pair that its peer has connected too (the handshake does this itself), so that
  // peer checks may start before anything has come back from it: a check towards a peer not yet
  // connected would fail and take the queue pair down.
  void mark_peer_connected() noexcept { state_->peer_up.store(true, std::memory_order_relaxed); }

  [[nodiscard]] std::uint32_t qp_num() const noexcept { return state_->qp_num; }
  [[nodiscard]] typename P::qp_handle native_handle() const noexcept { return state_->qp; }

  // Empty while usable; otherwise why nothing more can be posted.
  [[nodiscard]] std::error_code error() const noexcept {
    const int b = state_->broken.load(std::memory_order_acquire);
    return b == 0 ? std::error_code{} : make_error_code(static_cast<errc>(b));
  }

  // Free send-queue slots right now.
  [[nodiscard]] std::int64_t send_credits() const noexcept {
    return state_->credits.load(std::memory_order_relaxed);
  }

  // One-sided WRITE of `src` into the peer's `dst` (same length). `timeout` (negative: none) bounds
  // the wait for the completion. When the send queue is full these back off up to the queue pair's
  // admission timeout; the try_ forms return nullopt instead.
  template <class Rep = std::int64_t, class Period = std::nano>
  [[nodiscard]] transfer write(local_slice src, remote_slice dst,
                               std::chrono::duration<Rep, Period> timeout = std::chrono::nanoseconds(-1)) {
    return admitted([&] { return try_write(src, dst, timeout); });
  }

  template <class Rep = std::int64_t, class Period = std::nano>
  [[nodiscard]] std::optional<transfer> try_write(local_slice src, remote_slice dst,
      std::chrono::duration<Rep, Period> timeout = std::chrono::nanoseconds(-1)) {
    const rdma_block b{src, dst};
    return try_single(IBV_WR_RDMA_WRITE, b, detail_timeout(timeout));
  }

  // One-sided READ of the peer's `src` into `dst` (same length).
  template <class Rep = std::int64_t, class Period = std::nano>
  [[nodiscard]] transfer read(local_slice dst, remote_slice src,
                              std::chrono::duration<Rep, Period> timeout = std::chrono::nanoseconds(-1)) {
    return admitted([&] { return try_read(dst, src, timeout); });
  }

  template <class Rep = std::int64_t, class Period = std::nano>
  [[nodiscard]] std::optional<transfer> try_read(local_slice dst, remote_slice src,
      std::chrono::duration<Rep, Period> timeout = std::chrono::nanoseconds(-1)) {
    const rdma_block b{dst, src};
    return try_single(IBV_WR_RDMA_READ, b, detail_timeout(timeout));
  }

  // A batch posted as one linked list of work requests, only the last signalled, with one deadline:
  // out[i] is blocks[i]'s transfer. An error completion fails every member still pending.
  template <class Rep = std::int64_t, class Period = std::nano>
  void write_batch(std::span<const rdma_block> blocks, std::span<transfer> out,
                   std::chrono::duration<Rep, Period> timeout = std::chrono::nanoseconds(-1)) {
    batch(IBV_WR_RDMA_WRITE, blocks, out, detail_timeout(timeout));
  }

  template <class Rep = std::int64_t, class Period = std::nano>
  void read_batch(std::span<const rdma_block> blocks, std::span<transfer> out,
                  std::chrono::duration<Rep, Period> timeout = std::chrono::nanoseconds(-1)) {
    batch(IBV_WR_RDMA_READ, blocks, out, detail_timeout(timeout));
  }

  // A small inline SEND carrying `value`. RC delivers it after every WRITE posted before it on this
  // queue pair has landed, so the peer's receive_notification tells it that its data is there. It
  // covers only WRITEs the queue pair accepted: one whose transfer came back already failed (bad
  // input, a full send queue) never went, so check those before notifying.
  template <class Rep = std::int64_t, class Period = std::nano>
  [[nodiscard]] transfer send_notification(std::uint64_t value,
      std::chrono::duration<Rep, Period> timeout = std::chrono::nanoseconds(-1)) {
    const ferry::detail::timeout t = detail_timeout(timeout);
    return admitted([&]() -> std::optional<transfer> {
      if (std::optional<transfer> refused = refuse_early()) return refused;
      if (!reserve(1)) return std::nullopt;
      op_body* o = nullptr;
      transfer tr;
      try {
        o = make_op(op_kind::notify, t);
        o->payload = value;
        o->sge.addr = reinterpret_cast<std::uintptr_t>(&o->payload);
        o->sge.length = sizeof o->payload;
        o->wr.opcode = IBV_WR_SEND;
        o->wr.send_flags = IBV_SEND_INLINE | IBV_SEND_SIGNALED;
        o->wr.sg_list = &o->sge;
        o->wr.num_sge = 1;
        o->wr.wr_id = reinterpret_cast<std::uintptr_t>(o);
        tr = attach(o);
      } catch (...) {
        state_->credits.fetch_add(1, std::memory_order_relaxed);
        throw;
      }
      state_->device->publish(o);
      return tr;
    });
  }

  // The next notification the peer sent, in order; `value` is written before the transfer succeeds,
  // so it must stay valid until the transfer is terminal (a deadline bounds that wait).
  template <class Rep = std::int64_t, class Period = std::nano>
  [[nodiscard]] transfer receive_notification(std::uint64_t& value,
      std::chrono::duration<Rep, Period> timeout = std::chrono::nanoseconds(-1)) {
    op_body* o = make_op(op_kind::wait_notification, detail_timeout(timeout));
    o->value_out = &value;
    transfer tr = attach(o);
    state_->device->publish(o);
    return tr;
  }

 private:
  using op_body = detail::op_body<P>;
  using op = detail::op<P>;
  using op_kind = detail::op_kind;

  template <class Rep, class Period>
  static ferry::detail::timeout detail_timeout(std::chrono::duration<Rep, Period> d) noexcept {
    return ferry::detail::make_timeout(d);
  }

  // On the executor's own thread (a continuation resumed inline) waiting would only stop the
  // completions that free room, so there the request is tried once.
  template <class Try>
  transfer admitted(Try&& attempt) {
    if (state_->device->executor().on_executor_thread()) {
      if (std::optional<transfer> t = attempt()) return std::move(*t);
      return failed(make_error_code(ferry::errc::submission_queue_full));
    }
    return post_with_backoff(std::forward<Try>(attempt),
                             ferry::detail::deadline_after(state_->admission_timeout));
  }

  // A request refused before it takes a slot: the device is dead, the queue pair broken or never
  // connected.
  [[nodiscard]] std::optional<transfer> refuse_early() const {
    if (const std::error_code f = state_->device->failure(); f) return failed(f);
    if (const std::error_code ec = error(); ec) return failed(ec);
    if (!state_->connected.load(std::memory_order_acquire)) {
      return failed(make_error_code(errc::not_connected));
    }
    return std::nullopt;
  }

  [[nodiscard]] static transfer failed(std::error_code ec) {
    return make_completed_transfer(transfer_state::failed, ec);
  }

  [[nodiscard]] bool reserve(std::int64_t n) noexcept {
    std::int64_t have = state_->credits.load(std::memory_order_relaxed);
    do {
      if (have < n) return false;
    } while (!state_->credits.compare_exchange_weak(have, have - n, std::memory_order_acquire,
                                                    std::memory_order_relaxed));
    return true;
  }

  // Why a block cannot be posted, if it cannot.
  [[nodiscard]] std::error_code check(const rdma_block& b) const noexcept {
    if (b.local.size() == 0) return make_error_code(ferry::errc::empty_buffer);
    if (b.local.region_ == nullptr || b.local.region_->device != state_->device) {
      return make_error_code(errc::outside_local_region);
    }
    if (b.remote.length != b.local.size()) return make_error_code(errc::length_mismatch);
    if (b.local.size() > max_message_bytes) return make_error_code(errc::message_too_large);
    return {};
  }

  op_body* make_op(op_kind kind, const ferry::detail::timeout& t) {
    op_body* o = op::make(kind);
    o->qp = state_;
    if (!t.is_forever()) {
      o->has_deadline = true;
      o->timer.deadline = t.is_look() ? ferry::detail::clock::now() : t.deadline();
    }
    return o;
  }

  void fill(op_body* o, ibv_wr_opcode opcode, const rdma_block& b) noexcept {
    o->region = b.local.region_;
    o->region->add_ref();
    o->sge.addr = reinterpret_cast<std::uintptr_t>(b.local.data());
    o->sge.length = static_cast<std::uint32_t>(b.local.size());
    o->sge.lkey = b.local.region_->lkey;
    o->wr.wr_id = reinterpret_cast<std::uintptr_t>(o);
    o->wr.opcode = opcode;
    o->wr.sg_list = &o->sge;
    o->wr.num_sge = 1;
    o->wr.wr.rdma.remote_addr = b.remote.address;
    o->wr.wr.rdma.rkey = b.remote.rkey;
  }

  static transfer attach(op_body* o) {
    ferry::detail::status_block* s = nullptr;
    try {
      s = ferry::detail::status_block::make();
    } catch (...) {
      if (o->region != nullptr) o->region->release();
      op::free(o);
      throw;
    }
    o->status = s;
    return transfer(ferry::detail::adopt, s);
  }

  std::optional<transfer> try_single(ibv_wr_opcode opcode, const rdma_block& b,
                                     const ferry::detail::timeout& t) {
    if (const std::error_code ec = check(b); ec) return failed(ec);
    if (std::optional<transfer> refused = refuse_early()) return refused;
    if (!reserve(1)) return std::nullopt;
    op_body* o = nullptr;
    transfer tr;
    try {
      o = make_op(opcode == IBV_WR_RDMA_READ ? op_kind::read : op_kind::write, t);
      fill(o, opcode, b);
      o->wr.send_flags = IBV_SEND_SIGNALED;
      tr = attach(o);
    } catch (...) {
      state_->credits.fetch_add(1, std::memory_order_relaxed);  // the slot is not used after all
      throw;
    }
    state_->device->publish(o);
    return tr;
  }

  void batch(ibv_wr_opcode opcode, std::span<const rdma_block> blocks, std::span<transfer> out,
             const ferry::detail::timeout& t) {
    if (out.size() < blocks.size()) {
      throw std::invalid_argument("ferry::verbs::queue_pair: batch output span holds " +
                                  std::to_string(out.size()) + " transfers for " +
                                  std::to_string(blocks.size()) + " blocks");
    }
    // Members refused on their own merits fail alone; the rest form the unit.
    std::int64_t n = 0;
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      if (const std::error_code ec = check(blocks[i]); ec) {
        out[i] = failed(ec);
      } else {
        ++n;
      }
    }
    if (n == 0) return;
    auto refuse_all = [&](std::error_code ec) {
      for (std::size_t i = 0; i < blocks.size(); ++i) {
        if (!check(blocks[i])) out[i] = failed(ec);
      }
    };
    if (n > static_cast<std::int64_t>(state_->send_depth)) {
      return refuse_all(make_error_code(errc::batch_exceeds_send_queue));
    }
    std::optional<transfer> admitted_one = admitted_batch(n);
    if (admitted_one) return refuse_all(admitted_one->error());
    const op_kind kind = opcode == IBV_WR_RDMA_READ ? op_kind::read : op_kind::write;
    op_body* lead = nullptr;
    op_body* last = nullptr;
    std::uint32_t made = 0;
    try {
      for (std::size_t i = 0; i < blocks.size(); ++i) {
        if (check(blocks[i])) continue;
        op_body* o = make_op(kind, lead == nullptr ? t : ferry::detail::timeout{});
        fill(o, opcode, blocks[i]);
        out[i] = attach(o);
        ++made;
        if (lead == nullptr) {
          lead = o;
        } else {
          last->unit_next = o;
          o->lead = lead;
        }
        last = o;
      }
    } catch (...) {
      // Out of memory part-way: what was prepared still goes, so every handed-out transfer ends.
      state_->credits.fetch_add(n - made, std::memory_order_relaxed);
      if (lead != nullptr) post_unit(lead, last, made);
      throw;
    }
    post_unit(lead, last, made);
  }

  void post_unit(op_body* lead, op_body* last, std::uint32_t size) noexcept {
    lead->last = last;
    lead->unit_size = size;
    last->wr.send_flags = IBV_SEND_SIGNALED;
    state_->device->publish(lead);
  }

  // Reserves `n` slots, backing off up to the admission timeout. nullopt once they are reserved;
  // otherwise a failed transfer saying why.
  std::optional<transfer> admitted_batch(std::int64_t n) {
    bool got = false;
    transfer verdict = admitted([&]() -> std::optional<transfer> {
      if (std::optional<transfer> refused = refuse_early()) return refused;
      if (!reserve(n)) return std::nullopt;
      got = true;
      return transfer{};
    });
    if (got) return std::nullopt;
    return verdict;
  }

  detail::qp_state<P>* state_ = nullptr;
};

}  // namespace ferry::verbs

#pragma once
// The io_uring backend: file reads and writes at offsets (KV offload to local NVMe), and the socket
// sends and receives under tcp.hpp, as transfers completed by the progress executor.
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
// Completion. The executor reaps CQEs in batches. A short read or write is resubmitted for the
// remainder; a read that hits the end of the file fails with errc::end_of_file, so partial data is
// never a success. Errno results are std::system_category codes.
//
// Bounds. At most as many operations are in flight as the completion queue has entries (cancel
// requests included), so the CQ never overflows; beyond that, submissions wait in backlogs, one per
// kind, served in order of arrival as each kind's share allows. Part of the queue is kept for
// cancel requests, so a cancel always reaches the kernel. Socket operations wait on a peer for as
// long as it takes, so receives and sends may each use at most half of the rest, and three
// quarters together: file I/O always finds room, and so do sends beside idle receives. An
// operation that goes on from where it stopped (the rest of a short transfer, a retry after EINTR)
// keeps its place: it is issued again at once, or first in line, never behind later work.
//
// Cancellation. cancel(t) asks the kernel with IORING_OP_ASYNC_CANCEL; the transfer turns cancelled
// only when its own completion (-ECANCELED) arrives, so a buffer is never released while the kernel
// may still write it. An operation still in the backlog never reached the kernel and is cancelled at
// once.
//
// Task work. By default (Linux 6.1 on) the ring is set up SINGLE_ISSUER | DEFER_TASKRUN with the
// executor thread as its one issuer: the kernel finishes completions only inside the executor's own
// io_uring_enter calls, never by interrupting it, and needs no cross-CPU wake-ups to do so. That
// ties every call into the ring to that thread: registrations run there (the calling thread waits
// for them), the executor cancels and collects what the ring still holds when it is destroyed (in
// its ordinary rounds, while the destructor's thread waits), and it parks on an eventfd the kernel
// signals when completions are due. On an older kernel the ring silently falls back to the plain
// set-up (`defers_task_work()` tells), whose destructor does that work on its own thread.

#include <liburing.h>
#include <pthread.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <stdexcept>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include "ferry/detail/block_pool.hpp"
#include "ferry/detail/full_barrier.hpp"
#include "ferry/detail/status_block.hpp"
#include "ferry/detail/submission_stack.hpp"
#include "ferry/errors.hpp"
#include "ferry/uring/errors.hpp"
#include "ferry/progress_executor.hpp"
#include "ferry/transfer.hpp"

namespace ferry::uring {

// As the offset of a read or write: use and advance the descriptor's own position (pipes, sockets,
// character devices).
inline constexpr std::uint64_t current_position = ~std::uint64_t{0};

struct ring_options {
  // Submission queue entries (at most 32768). The completion queue gets twice as many and bounds
  // what is in flight at once: with the default, 448 operations besides cancels, of which at most
  // 224 socket receives, 224 sends and 336 of both together (a connection has one of each in
  // flight at a time). A receive waiting on a silent peer, or a send on one that does not read,
  // holds its place until the peer acts; beyond the bound, receives (or sends) on every other
  // connection wait for one of those to complete. A server with more connections than that raises
  // `entries`.
  unsigned entries = 256;
  // The most SQEs one io_uring_enter carries; 0 for no limit (one call per executor round). Up to
  // two, the kernel does not plug the block layer, so each request reaches the device at once.
  unsigned submit_batch = 2;
  // SINGLE_ISSUER | DEFER_TASKRUN with the executor as the issuer, where the kernel has them (6.1
  // on): completions are finished in the executor's own system calls rather than by interrupting
  // it. false: the plain set-up, which costs more per operation when the CPU is the limit.
  bool defer_task_work = true;
};

// A descriptor registered with ring::register_files.
struct fixed_file {
  unsigned index = 0;
};

// Memory registered with ring::register_buffers. Reads and writes naming it must stay inside it.
struct fixed_buffer {
  unsigned index = 0;
  std::span<std::byte> memory;
};

// The file argument of a read or write: a plain descriptor or a registered one.
class file_ref {
 public:
  file_ref(int fd) noexcept : fd_(fd) {}  // NOLINT: implicit by design
  file_ref(fixed_file f) noexcept : fd_(static_cast<int>(f.index)), fixed_(true) {}  // NOLINT

  [[nodiscard]] int descriptor() const noexcept { return fd_; }
  [[nodiscard]] bool fixed() const noexcept { return fixed_; }

 private:
  int fd_;
  bool fixed_ = false;
};

// One block of a batched read or write.
struct read_block {
  std::span<std::byte> dst;
  std::uint64_t offset = 0;
};
struct write_block {
  std::span<const std::byte> src;
  std::uint64_t offset = 0;
};

// What a received framed block carried (tcp.hpp).
struct received_block {
  std::uint64_t id = 0;
  std::size_t length = 0;
};

struct ring_counters {
  std::uint64_t submitted = 0;    // SQEs handed to the kernel, resubmissions and cancels included
  std::uint64_t submit_calls = 0;  // io_uring_enter calls that handed over SQEs
  std::uint64_t completed = 0;    // CQEs reaped
  std::uint64_t resubmitted = 0;  // short reads and writes continued
  std::uint64_t backlogged = 0;   // operations that waited because the ring was full
};

class ring;
class tcp_connection;

namespace detail {

using ferry::detail::status_block;

enum class op_kind : std::uint8_t {
  read, write, readv, writev, send, receive, cancel, detach, call, shutdown
};

// The wire header of one framed block.
struct frame_header {
  static constexpr std::uint32_t magic_value = 0x31595246;  // "FRY1" read as little-endian
  std::uint32_t magic = magic_value;
  std::uint32_t reserved = 0;
  std::uint64_t id = 0;
  std::uint64_t length = 0;
};
static_assert(sizeof(frame_header) == 24);

struct op;

// A TCP connection as the ring sees it. The handle (tcp_connection), every operation naming it and
// the ring's list of connections with queued work each hold a reference; the last one closes the
// socket. Everything but `fd` and `refs` belongs to the executor thread.
struct connection_state {
  int fd = -1;
  std::atomic<int> refs{1};
  std::atomic<bool> closing{false};  // set by close(): nothing queued starts any more
  connection_state* list_prev = nullptr;
  connection_state* list_next = nullptr;
  bool listed = false;
  op* send_head = nullptr;
  op* send_tail = nullptr;
  op* receive_head = nullptr;
  op* receive_tail = nullptr;
  bool sending = false;
  bool receiving = false;
  // The sends in flight: queued frames coalesced into one sendmsg, the first of them (the lead)
  // owning the SQE. Frames complete when the whole group has gone out, or it is cut short.
  static constexpr unsigned max_send_group = 16;
  op* send_group[max_send_group] = {};
  unsigned send_group_size = 0;
  std::size_t group_length = 0;
  std::size_t group_done = 0;
  iovec send_live[2 * max_send_group] = {};
  msghdr send_message{};
  std::error_code send_error;     // once set, every later send fails with it
  std::error_code receive_error;  // likewise for receives

  void release(int n = 1) noexcept {
    if (refs.fetch_sub(n, std::memory_order_acq_rel) == n) {
      ::close(fd);
      delete this;
    }
  }
};

struct op_body {
  op_kind kind = op_kind::read;
  bool fixed_file = false;
  bool cancel_requested = false;
  bool cancelled_at_shutdown = false;
  bool receiving_payload = false;  // a receive has its header and is filling the payload
  bool frame_cancel = false;       // a send frame cancel() named (cancel_requested: its group's SQE)
  int fd = -1;
  int buffer_index = -1;
  std::uint32_t iov_count = 0;
  std::uint32_t iov_at = 0;        // first iovec not yet fully transferred
  std::size_t iov_skip = 0;        // bytes of iov[iov_at] already transferred
  std::size_t slot = 0;            // position in ring::in_flight_
  std::uint64_t ticket = 0;        // arrival in a backlog (0: going on from where it stopped)
  status_block* status = nullptr;  // the completer reference (for a cancel: a transfer reference)
  std::byte* buffer = nullptr;
  std::size_t length = 0;  // bytes wanted (for a receive: of the current phase)
  std::size_t done = 0;    // bytes transferred so far (of the current phase)
  std::uint64_t offset = 0;
  const iovec* iov = nullptr;
  connection_state* connection = nullptr;
  received_block* received = nullptr;
  op* target = nullptr;  // for a cancel: the operation it asks the kernel to cancel
  int (*call)(void*) noexcept = nullptr;  // a call: run on the executor thread, returns -errno or 0
  void* call_argument = nullptr;
  op* next = nullptr;    // submission stack, backlog and connection queues
  frame_header header;
  iovec parts[2]{};  // a send: header and payload; a receive: parts[1] is the destination
};

struct op : op_body {
  op* pool_next_ = nullptr;  // the pool's free-list link, never poisoned
  static constexpr std::size_t poisonable_bytes = sizeof(op_body);
  using pool = ferry::detail::block_pool<op>;

  [[nodiscard]] static op* make(op_kind kind) {
    op* o = pool::acquire();
    static_cast<op_body&>(*o) = op_body{};
    o->kind = kind;
    return o;
  }
};

// A FIFO of operations linked through op::next.
struct op_queue {
  op* head = nullptr;
  op* tail = nullptr;

  [[nodiscard]] bool empty() const noexcept { return head == nullptr; }
  void push_front(op* o) noexcept {
    o->next = head;
    head = o;
    if (tail == nullptr) tail = o;
  }
  void push(op* o) noexcept {
    o->next = nullptr;
    if (tail == nullptr) {
      head = tail = o;
    } else {
      tail->next = o;
      tail = o;
    }
  }
  op* pop() noexcept {
    op* o = head;
    if (o != nullptr) {
      head = o->next;
      if (head == nullptr) tail = nullptr;
      o->next = nullptr;
    }
    return o;
  }
  // Unlinks the first operation `match` accepts, if any is queued here.
  template <class Match>
  op* remove_if(Match match) noexcept {
    op* prev = nullptr;
    for (op* o = head; o != nullptr; prev = o, o = o->next) {
      if (!match(o)) continue;
      (prev == nullptr ? head : prev->next) = o->next;
      if (tail == o) tail = prev;
      o->next = nullptr;
      return o;
    }
    return nullptr;
  }
  // Unlinks the operation completing `s`, if queued here.
  op* remove(const status_block* s) noexcept {
    return remove_if([s](const op* o) { return o->status == s; });
  }

};

[[nodiscard]] inline std::error_code system_error_code(int err) noexcept {
  return {err, std::system_category()};
}

}  // namespace detail

class ring {
 public:
  explicit ring(progress_executor& exec, ring_options options = {}) : exec_(exec) {
    if (options.entries == 0) {
      throw std::invalid_argument("ferry::uring::ring_options::entries must be at least 1");
    }
    // The kernel's own limit (IORING_MAX_ENTRIES), so that twice it still fits in 32 bits.
    const unsigned entries = std::min(options.entries, 32768u);
    // Made now, so that the destructor cannot fail for want of memory.
    closing_op_ = op::make(op_kind::shutdown);
    closed_ = attach(closing_op_);
    // Newest set-up first; each fallback drops what an older kernel refuses with EINVAL (deferred
    // task work: 6.1; SUBMIT_ALL: 5.18). ferry depends on neither.
    constexpr unsigned plain = IORING_SETUP_CLAMP | IORING_SETUP_CQSIZE;
    constexpr unsigned deferred = IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN |
                                  IORING_SETUP_TASKRUN_FLAG | IORING_SETUP_R_DISABLED;
    int r = -EINVAL;
    io_uring_params params{};
    for (const unsigned flags : {plain | IORING_SETUP_SUBMIT_ALL | deferred,
                                 plain | IORING_SETUP_SUBMIT_ALL, plain}) {
      if ((flags & deferred) != 0 && !options.defer_task_work) continue;
      params = io_uring_params{};
      params.flags = flags;
      params.cq_entries = std::max(4u, 2 * entries);  // room for cancels, socket work, the rest
      r = ::io_uring_queue_init_params(entries, &ring_, &params);
      if (r != -EINVAL) break;
    }
    if (r < 0) {
      release_closing_op();
      throw std::system_error(-r, std::system_category(),
                              "ferry::uring::ring: io_uring_queue_init_params(" +
                                  std::to_string(options.entries) + " entries)");
    }
    deferred_ = (params.flags & IORING_SETUP_DEFER_TASKRUN) != 0;
    limit_ = params.cq_entries;
    submit_batch_ = options.submit_batch;
    cancel_room_ = std::max(1u, limit_ / 8);
    const unsigned rest = limit_ - cancel_room_;
    socket_kind_room_ = std::max(1u, rest / 2);
    socket_room_ = std::max(2u, rest * 3 / 4);
    try {
      in_flight_.reserve(limit_);
      if (deferred_) {
        // Deferred completions make the ring's own descriptor no sign of work: the executor parks
        // on this eventfd, which the kernel signals when some are due.
        due_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        if (due_fd_ < 0) {
          throw std::system_error(errno, std::system_category(), "ferry::uring::ring: eventfd");
        }
        if (const int e = ::io_uring_register_eventfd(&ring_, due_fd_); e < 0) {
          throw std::system_error(-e, std::system_category(),
                                  "ferry::uring::ring: io_uring_register_eventfd");
        }
        ::io_uring_cq_eventfd_toggle(&ring_, false);  // switched on only to park (arm())
      }
      exec_.add_source(*this);
    } catch (...) {
      close_ring();
      release_closing_op();
      throw;
    }
    // On the executor thread, which issues every request: SIGPIPE blocked, and with deferred task
    // work the ring enabled (the thread that enables it becomes its one issuer).
    int e = 0;
    try {
      e = on_executor([this]() noexcept {
        block_sigpipe();
        if (!deferred_) return 0;
        return ::syscall(__NR_io_uring_register, ring_.ring_fd, IORING_REGISTER_ENABLE_RINGS,
                         nullptr, 0) < 0
                   ? -errno
                   : 0;
      });
    } catch (...) {
      exec_.remove_source(*this);
      close_ring();
      release_closing_op();
      throw;
    }
    if (e < 0) {
      exec_.remove_source(*this);
      close_ring();
      release_closing_op();
      throw std::system_error(-e, std::system_category(),
                              "ferry::uring::ring: enabling the ring on the executor thread");
    }
  }

  ring(const ring&) = delete;
  ring& operator=(const ring&) = delete;

  // Waits for everything the kernel still holds: operations in flight are cancelled and their own
  // completions awaited, so no buffer is written after this returns. Operations not yet given to
  // the kernel fail with ferry::errc::backend_shut_down. Every tcp_connection on this ring must be gone.
  ~ring() {
    if (exec_.on_executor_thread()) {
      // A continuation resumed inline may be inside this ring's own poll() (reap() holding taken
      // completions): nothing here could finish safely.
      std::fprintf(stderr,
                   "ferry: uring::ring destroyed on its progress executor's thread, from a "
                   "continuation resumed inline; destroy it from another thread\n");
      std::abort();
    }
    if (connections_.load(std::memory_order_acquire) != 0) {
      std::fprintf(stderr,
                   "ferry: uring::ring destroyed with %d tcp_connection(s) still open on it; "
                   "destroy connections before their ring\n",
                   connections_.load(std::memory_order_relaxed));
      std::abort();
    }
    if (deferred_) {
      // Only the issuer may wait for this ring's completions. The executor cancels what is in
      // flight and finishes it in its ordinary rounds, serving its other sources meanwhile; this
      // thread waits until nothing is left.
      op* o = std::exchange(closing_op_, nullptr);
      publish(o, o);
      (void)closed_.wait();
      exec_.remove_source(*this);
      // Anything published after the executor's last look is refused here, without a call into
      // the kernel; a continuation resumed by a refusal may publish more, so until none is left.
      do {
        take_incoming();
        run_calls(true);
      } while (!incoming_.empty());
    } else {
      exec_.remove_source(*this);
      shut_down();
      release_closing_op();
    }
    while (connections_head_ != nullptr) unlist(connections_head_);
    close_ring();
  }

  // Reads dst.size() bytes at `offset` (or current_position) into dst.
  [[nodiscard]] transfer read(file_ref file, std::span<std::byte> dst, std::uint64_t offset) {
    return submit_io(detail::op_kind::read, file, dst.data(), dst.size(), offset, -1);
  }

  // The same through a registered buffer: dst must lie inside `registered.memory`.
  [[nodiscard]] transfer read(file_ref file, std::span<std::byte> dst, std::uint64_t offset,
                              const fixed_buffer& registered) {
    if (const errc e = check_registered(dst.data(), dst.size(), registered); e != errc{}) {
      return make_completed_transfer(transfer_state::failed, e);
    }
    return submit_io(detail::op_kind::read, file, dst.data(), dst.size(), offset,
                     static_cast<int>(registered.index));
  }

  [[nodiscard]] transfer write(file_ref file, std::span<const std::byte> src, std::uint64_t offset) {
    return submit_io(detail::op_kind::write, file, const_cast<std::byte*>(src.data()), src.size(),
                     offset, -1);
  }

  [[nodiscard]] transfer write(file_ref file, std::span<const std::byte> src, std::uint64_t offset,
                               const fixed_buffer& registered) {
    if (const errc e = check_registered(src.data(), src.size(), registered); e != errc{}) {
      return make_completed_transfer(transfer_state::failed, e);
    }
    return submit_io(detail::op_kind::write, file, const_cast<std::byte*>(src.data()), src.size(),
                     offset, static_cast<int>(registered.index));
  }

  // Scatter: fills the iovecs in order from `offset`, as one transfer. The iovec array (not only
  // the memory it points to) must stay valid until the transfer is terminal.
  [[nodiscard]] transfer readv(file_ref file, std::span<const iovec> iov, std::uint64_t offset) {
    return submit_vectored(detail::op_kind::readv, file, iov, offset);
  }

  // Gather: writes the iovecs in order from `offset`, as one transfer.
  [[nodiscard]] transfer writev(file_ref file, std::span<const iovec> iov, std::uint64_t offset) {
    return submit_vectored(detail::op_kind::writev, file, iov, offset);
  }

  // Many blocks at once, one transfer each (out[i] for blocks[i]), published with one CAS and
  // submitted in calls of ring_options::submit_batch.
  void read_batch(file_ref file, std::span<const read_block> blocks, std::span<transfer> out) {
    batch_reads(file, blocks, out, nullptr);
  }

  // The same through a registered buffer, which every block must lie inside (a block that does not
  // fails alone, with errc::outside_registered_buffer).
  void read_batch(file_ref file, std::span<const read_block> blocks, std::span<transfer> out,
                  const fixed_buffer& registered) {
    batch_reads(file, blocks, out, &registered);
  }

  void write_batch(file_ref file, std::span<const write_block> blocks, std::span<transfer> out) {
    batch_writes(file, blocks, out, nullptr);
  }

  void write_batch(file_ref file, std::span<const write_block> blocks, std::span<transfer> out,
                   const fixed_buffer& registered) {
    batch_writes(file, blocks, out, &registered);
  }

  // Best effort: asks the kernel to cancel the operation completing `t`. If it is cancelled, `t`
  // turns cancelled when its own completion arrives (or at once if it never reached the kernel);
  // if it finished first, `t` keeps that result. A transfer from elsewhere is left alone.
  // Sends to one connection go out coalesced, several frames to one sendmsg: cancelling any of
  // them stops that sendmsg. Frames it sent whole succeed, a frame it cut part-way ends cancelled,
  // and untouched frames that were not cancelled are sent again. (A sendmsg that comes back short
  // completes the frames it sent whole at once, so a cancel of one of those is a no-op.) A cut
  // frame puts the stream out of step: the connection's later sends fail, and its write side is
  // shut down so that the peer's receive fails rather than wait for the rest of the frame.
  void cancel(const transfer& t) {
    if (t.status() == nullptr || t.done()) return;
    detail::op* c = detail::op::make(detail::op_kind::cancel);
    t.status()->add_transfer_ref();
    c->status = t.status();
    publish(c, c);
  }

  // Registers memory for IORING_OP_READ_FIXED / WRITE_FIXED (once per ring).
  [[nodiscard]] std::vector<fixed_buffer> register_buffers(
      std::span<const std::span<std::byte>> buffers) {
    std::vector<iovec> iov;
    iov.reserve(buffers.size());
    for (const auto& b : buffers) iov.push_back(iovec{b.data(), b.size()});
    const int r = on_executor([&]() noexcept {
      return ::io_uring_register_buffers(&ring_, iov.data(), static_cast<unsigned>(iov.size()));
    });
    if (r < 0) {
      throw std::system_error(-r, std::system_category(),
                              "ferry::uring::ring::register_buffers (" +
                                  std::to_string(buffers.size()) + " buffers)");
    }
    std::vector<fixed_buffer> out;
    out.reserve(buffers.size());
    for (std::size_t i = 0; i < buffers.size(); ++i) {
      out.push_back(fixed_buffer{static_cast<unsigned>(i), buffers[i]});
    }
    return out;
  }

  // Registers descriptors for IOSQE_FIXED_FILE (once per ring).
  [[nodiscard]] std::vector<fixed_file> register_files(std::span<const int> fds) {
    const int r = on_executor([&]() noexcept {
      return ::io_uring_register_files(&ring_, fds.data(), static_cast<unsigned>(fds.size()));
    });
    if (r < 0) {
      throw std::system_error(-r, std::system_category(),
                              "ferry::uring::ring::register_files (" + std::to_string(fds.size()) +
                                  " descriptors)");
    }
    std::vector<fixed_file> out;
    out.reserve(fds.size());
    for (std::size_t i = 0; i < fds.size(); ++i) out.push_back(fixed_file{static_cast<unsigned>(i)});
    return out;
  }

  // How many operations the kernel may hold at once (the completion queue's size).
  [[nodiscard]] unsigned in_flight_limit() const noexcept { return limit_; }

  // Whether the kernel defers completions to the executor's own calls (ring_options::defer_task_work
  // asked for it, and the kernel has it).
  [[nodiscard]] bool defers_task_work() const noexcept { return deferred_; }

  [[nodiscard]] ring_counters counters() const noexcept {
    ring_counters c;
    c.submitted = submitted_.load(std::memory_order_relaxed);
    c.submit_calls = submit_calls_.load(std::memory_order_relaxed);
    c.completed = completed_.load(std::memory_order_relaxed);
    c.resubmitted = resubmitted_.load(std::memory_order_relaxed);
    c.backlogged = backlogged_.load(std::memory_order_relaxed);
    return c;
  }

  [[nodiscard]] progress_executor& executor() const noexcept { return exec_; }

  // The executor's side: a completion source whose descriptor is readable when CQEs wait.
  std::size_t poll(std::size_t budget) noexcept {
    if (signalling_) {
      // Awake again: completions are found by looking, until the next park.
      ::io_uring_cq_eventfd_toggle(&ring_, false);
      signalling_ = false;
    }
    if (!incoming_.empty()) take_incoming();
    pump();
    flush();
    std::size_t handled = reap(budget);
    if (handled != 0) {
      pump();
      flush();
    }
    handled += run_calls();
    if (closing_ != nullptr) go_on_closing();
    // SQEs the kernel did not take (it was short of memory) must be retried, not slept on.
    return handled + (::io_uring_sq_ready(&ring_) != 0 ? 1 : 0);
  }

  [[nodiscard]] int park_fd() const noexcept { return deferred_ ? due_fd_ : ring_.ring_fd; }

  // The executor's side: whether the kernel holds anything but socket receives, so that the executor
  // spins for executor_options::in_flight_spin before parking. File reads and writes complete
  // within the device's latency; sends usually within moments (one to a peer that does not read, or
  // a read of a pipe, waits on that peer, and costs that spin after each completion meanwhile).
  // Receives are left out: a server keeps one posted on every connection, mostly waiting.
  [[nodiscard]] bool in_flight() const noexcept { return in_flight_.size() > receives_in_flight_; }

  // Before the executor sleeps on due_fd_. The kernel signals it only while it is switched on
  // (signalling costs a wake-up call in the kernel per completion run), and only when the first of
  // a run of deferred completions is queued, which may have come before the switch. So: switch it
  // on, clear it, then enter the kernel to run whatever it deferred, and look at the CQ. The kernel
  // queues work with a fully ordered exchange on its list, then reads the switch; this thread
  // writes the switch, then (barrier, system call) reads that list: on any CPU at least one sees
  // the other, so either the work shows in the CQ now or the kernel signals. (Reading the
  // IORING_SQ_TASKRUN flag alone would not be ordered on arm64.)
  // One call runs a limited number of items (20 since Linux 6.13) and keeps the rest, unsignalled,
  // with IORING_SQ_TASKRUN set again; items that post nothing (a socket receive that got part of
  // its bytes and waits again) can fill every call. So: go on while the flag says work is left,
  // up to a bound that covers everything in flight, since the flag can also be left set with
  // nothing queued, and a stale flag must not keep the executor awake.
  bool arm() noexcept {
    if (!deferred_) return true;
    ::io_uring_cq_eventfd_toggle(&ring_, true);
    signalling_ = true;
    ferry::detail::full_barrier();
    std::uint64_t count = 0;
    [[maybe_unused]] const ssize_t n = ::read(due_fd_, &count, sizeof count);
    for (unsigned i = 0; i < limit_ / 16 + 2; ++i) {
      (void)::io_uring_get_events(&ring_);
      if (::io_uring_cq_ready(&ring_) != 0) return false;
      if ((__atomic_load_n(ring_.sq.kflags, __ATOMIC_ACQUIRE) & IORING_SQ_TASKRUN) == 0) break;
    }
    return true;
  }

 private:
  friend class tcp_connection;
  using op = detail::op;
  using op_kind = detail::op_kind;

  static constexpr std::size_t max_chunk = std::size_t{1} << 30;  // an SQE's length is 32 bits

  // io_uring tries a write inline, on the issuing thread: to a pipe or socket whose reader has
  // gone, the kernel then sends that thread SIGPIPE, whose default action ends the process. Blocked
  // on the executor thread, it stays pending there and the write fails with EPIPE, as a transfer
  // should.
  static void block_sigpipe() noexcept {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGPIPE);
    ::pthread_sigmask(SIG_BLOCK, &set, nullptr);
  }

  // An SQE names a registered buffer in 16 bits (the kernel registers at most 16384).
  static constexpr unsigned max_buffer_index = 0xffff;

  static errc check_registered(const std::byte* p, std::size_t n,
                               const fixed_buffer& registered) noexcept {
    if (registered.index > max_buffer_index) return errc::bad_registered_index;
    const auto begin = reinterpret_cast<std::uintptr_t>(registered.memory.data());
    const auto end = begin + registered.memory.size();
    const auto at = reinterpret_cast<std::uintptr_t>(p);
    const bool inside = at >= begin && at <= end && n <= end - at;
    return inside ? errc{} : errc::outside_registered_buffer;
  }

  // Pairs an op with a new status; the op keeps the completer reference.
  static transfer attach(op* o) {
    detail::status_block* s = nullptr;
    try {
      s = detail::status_block::make();
    } catch (...) {
      op::pool::release(o);
      throw;
    }
    o->status = s;
    return transfer(ferry::detail::adopt, s);
  }

  transfer submit_io(op_kind kind, file_ref file, std::byte* buffer, std::size_t length,
                     std::uint64_t offset, int buffer_index) {
    if (length == 0) return make_completed_transfer(transfer_state::failed, ferry::errc::empty_buffer);
    op* o = op::make(kind);
    o->fd = file.descriptor();
    o->fixed_file = file.fixed();
    o->buffer = buffer;
    o->length = length;
    o->offset = offset;
    o->buffer_index = buffer_index;
    transfer t = attach(o);
    publish(o, o);
    return t;
  }

  transfer submit_vectored(op_kind kind, file_ref file, std::span<const iovec> iov,
                           std::uint64_t offset) {
    if (iov.size() > UINT32_MAX) {
      return make_completed_transfer(transfer_state::failed, errc::vector_too_large);
    }
    std::size_t total = 0;
    for (const iovec& v : iov) {
      if (v.iov_len > SIZE_MAX - total) {
        return make_completed_transfer(transfer_state::failed, errc::vector_too_large);
      }
      total += v.iov_len;
    }
    if (total == 0) return make_completed_transfer(transfer_state::failed, ferry::errc::empty_buffer);
    op* o = op::make(kind);
    o->fd = file.descriptor();
    o->fixed_file = file.fixed();
    o->iov = iov.data();
    o->iov_count = static_cast<std::uint32_t>(iov.size());
    o->length = total;
    o->offset = offset;
    transfer t = attach(o);
    publish(o, o);
    return t;
  }

  void batch_reads(file_ref file, std::span<const read_block> blocks, std::span<transfer> out,
                   const fixed_buffer* registered) {
    submit_batch(detail::op_kind::read, file, blocks.size(), out, registered, [&](std::size_t i) {
      return std::pair<std::byte*, std::size_t>{blocks[i].dst.data(), blocks[i].dst.size()};
    }, [&](std::size_t i) { return blocks[i].offset; });
  }

  void batch_writes(file_ref file, std::span<const write_block> blocks, std::span<transfer> out,
                    const fixed_buffer* registered) {
    submit_batch(detail::op_kind::write, file, blocks.size(), out, registered, [&](std::size_t i) {
      return std::pair<std::byte*, std::size_t>{const_cast<std::byte*>(blocks[i].src.data()),
                                                blocks[i].src.size()};
    }, [&](std::size_t i) { return blocks[i].offset; });
  }

  template <class Buffer, class Offset>
  void submit_batch(op_kind kind, file_ref file, std::size_t n, std::span<transfer> out,
                    const fixed_buffer* registered, Buffer buffer_of, Offset offset_of) {
    if (out.size() < n) {
      throw std::invalid_argument("ferry::uring::ring: batch output span holds " +
                                  std::to_string(out.size()) + " transfers for " +
                                  std::to_string(n) + " blocks");
    }
    // Linked newest first, so that the executor, which reverses the stack, sees them in order.
    op* newest = nullptr;
    op* oldest = nullptr;
    try {
      for (std::size_t i = 0; i < n; ++i) {
        const auto [data, length] = buffer_of(i);
        if (length == 0) {
          out[i] = make_completed_transfer(transfer_state::failed, ferry::errc::empty_buffer);
          continue;
        }
        if (registered != nullptr) {
          if (const errc e = check_registered(data, length, *registered); e != errc{}) {
            out[i] = make_completed_transfer(transfer_state::failed, e);
            continue;
          }
        }
        op* o = op::make(kind);
        o->fd = file.descriptor();
        o->fixed_file = file.fixed();
        o->buffer_index = registered == nullptr ? -1 : static_cast<int>(registered->index);
        o->buffer = data;
        o->length = length;
        o->offset = offset_of(i);
        out[i] = attach(o);
        o->next = newest;
        newest = o;
        if (oldest == nullptr) oldest = o;
      }
    } catch (...) {
      // Out of memory part-way: what was prepared still goes, so every handed-out transfer ends.
      if (newest != nullptr) publish(newest, oldest);
      throw;
    }
    if (newest != nullptr) publish(newest, oldest);
  }

  // Publishes a chain linked newest → oldest through op::next. The caller prepared everything: after
  // the CAS the executor owns the ops.
  void publish(op* newest, op* oldest) noexcept {
    incoming_.push(newest, oldest);
    exec_.notify();
  }

  // --- Executor thread from here on (or the destructor, once the source is removed). ---

  void take_incoming() noexcept {
    incoming_.take([this](op* o) { route(o); });
  }

  void route(op* o) noexcept {
    switch (o->kind) {
      case op_kind::cancel:
        handle_cancel(o);
        return;
      case op_kind::send:
        enqueue_send(o);
        return;
      case op_kind::receive:
        enqueue_receive(o);
        return;
      case op_kind::detach:
        detach(o);
        return;
      case op_kind::call:
        // Run by poll() once this round's completions are handled, never from inside reap().
        calls_.push(o);
        return;
      case op_kind::shutdown:
        shutting_down_ = true;
        closing_ = o;
        fail_backlogs();  // before any pump() of this round could hand them to the kernel
        return;
      default:
        start(o);
        return;
    }
  }

  // Issues `o` now if the ring has room for its kind, else queues it behind the others of its kind
  // (order is kept within each).
  void start(op* o) noexcept {
    if (shutting_down_) {
      finish_unstarted(o);
      return;
    }
    detail::op_queue& q = backlog_for(o);
    if (o->kind == op_kind::cancel) {  // cancels have room of their own, and a queue of their own
      if (!q.empty() || !issue(o)) {
        q.push(o);
        backlogged_.fetch_add(1, std::memory_order_relaxed);
      }
      return;
    }
    // With anything waiting, room that has just come back (a completion in this round) belongs to
    // the oldest waiter that fits it, not to whatever is started next: `o` takes its turn.
    if (file_backlog_.empty() && send_backlog_.empty() && receive_backlog_.empty() && issue(o)) {
      return;
    }
    o->ticket = ++tickets_;
    q.push(o);
    pump();
    if (q.tail == o) backlogged_.fetch_add(1, std::memory_order_relaxed);  // still waiting
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

  detail::op_queue& backlog_for(const op* o) noexcept {
    if (o->kind == op_kind::cancel) return cancel_backlog_;
    if (o->kind == op_kind::receive) return receive_backlog_;
    if (o->kind == op_kind::send) return send_backlog_;
    return file_backlog_;
  }

  // Cancels first (they have room of their own), then the other kinds in the order they arrived,
  // each as its share allows: no kind waits behind another (sends behind file I/O that keeps
  // coming, say, for ever). Popped before it is issued: issuing a stale cancel releases it.
  void pump() noexcept {
    while (op* o = cancel_backlog_.pop()) {
      if (!issue(o)) {
        cancel_backlog_.push_front(o);
        break;
      }
    }
    for (;;) {
      detail::op_queue* next = nullptr;
      for (detail::op_queue* q : {&file_backlog_, &send_backlog_, &receive_backlog_}) {
        if (q->empty() || !has_room(q->head->kind)) continue;
        if (next == nullptr || q->head->ticket < next->head->ticket) next = q;
      }
      if (next == nullptr) return;
      op* o = next->pop();
      if (!issue(o)) {
        next->push_front(o);
        return;
      }
    }
  }

  void fail_backlogs() noexcept {
    for (detail::op_queue* q :
         {&cancel_backlog_, &file_backlog_, &send_backlog_, &receive_backlog_}) {
      while (op* o = q->pop()) finish_unstarted(o);
    }
  }

  io_uring_sqe* next_sqe() noexcept {
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

  // Prepares an SQE for `o` if both the CQ bound and the SQ allow it.
  bool issue(op* o) noexcept {
    if (!has_room(o->kind)) return false;
    if (o->kind == op_kind::cancel) {
      // The target may have finished while this request waited in the backlog.
      // Found in in_flight_ before it is read: a finished target may be back in the pool.
      op* target = o->target;
      if (std::find(in_flight_.begin(), in_flight_.end(), target) == in_flight_.end() ||
          target->status != o->status) {
        release_cancel(o);
        return true;
      }
    }
    io_uring_sqe* sqe = next_sqe();
    if (sqe == nullptr) return false;
    prepare(sqe, o);
    ::io_uring_sqe_set_data(sqe, o);
    if (submit_batch_ != 0 && ::io_uring_sq_ready(&ring_) >= submit_batch_) flush();
    if (o->kind == op_kind::cancel) {
      ++cancels_in_flight_;
    } else {
      if (o->kind == op_kind::receive) ++receives_in_flight_;
      if (o->kind == op_kind::send) ++sends_in_flight_;
      o->slot = in_flight_.size();
      in_flight_.push_back(o);
    }
    return true;
  }

  // The CQ bound: cancels have room of their own; socket receives and sends, which may wait on a
  // peer indefinitely, never take more than half of the rest each and three quarters together, so
  // file I/O always gets in, and sends get in beside receives (and receives beside sends).
  bool has_room(op_kind kind) const noexcept {
    if (in_flight_.size() + cancels_in_flight_ >= limit_) return false;
    if (kind == op_kind::cancel) return cancels_in_flight_ < cancel_room_;
    if (in_flight_.size() >= limit_ - cancel_room_) return false;
    const bool socket_room = receives_in_flight_ + sends_in_flight_ < socket_room_;
    if (kind == op_kind::receive) return socket_room && receives_in_flight_ < socket_kind_room_;
    if (kind == op_kind::send) return socket_room && sends_in_flight_ < socket_kind_room_;
    return true;
  }

  void retire(op* o) noexcept {
    if (o->kind == op_kind::receive) --receives_in_flight_;
    if (o->kind == op_kind::send) --sends_in_flight_;
    op* last = in_flight_.back();
    in_flight_[o->slot] = last;
    last->slot = o->slot;
    in_flight_.pop_back();
  }

  std::uint64_t file_offset(const op* o, std::size_t advanced) const noexcept {
    return o->offset == current_position ? current_position : o->offset + advanced;
  }

  void prepare(io_uring_sqe* sqe, op* o) noexcept {
    const std::size_t left = std::min(o->length - o->done, max_chunk);
    const auto n = static_cast<unsigned>(left);
    switch (o->kind) {
      case op_kind::read:
        if (o->buffer_index >= 0) {
          ::io_uring_prep_read_fixed(sqe, o->fd, o->buffer + o->done, n, file_offset(o, o->done),
                                     o->buffer_index);
        } else {
          ::io_uring_prep_read(sqe, o->fd, o->buffer + o->done, n, file_offset(o, o->done));
        }
        break;
      case op_kind::write:
        if (o->buffer_index >= 0) {
          ::io_uring_prep_write_fixed(sqe, o->fd, o->buffer + o->done, n, file_offset(o, o->done),
                                      o->buffer_index);
        } else {
          ::io_uring_prep_write(sqe, o->fd, o->buffer + o->done, n, file_offset(o, o->done));
        }
        break;
      case op_kind::readv:
      case op_kind::writev:
        prepare_vectored(sqe, o);
        break;
      case op_kind::send:
        prepare_send(sqe, o);
        break;
      case op_kind::receive: {
        std::byte* at = o->receiving_payload ? o->buffer : reinterpret_cast<std::byte*>(&o->header);
        ::io_uring_prep_recv(sqe, o->fd, at + o->done, n, MSG_WAITALL);
        break;
      }
      case op_kind::cancel:
        ::io_uring_prep_cancel64(sqe, reinterpret_cast<std::uintptr_t>(o->target), 0);
        return;
      case op_kind::detach:  // routed before it could reach here
      case op_kind::call:
      case op_kind::shutdown:
        ::io_uring_prep_nop(sqe);
        return;
    }
    if (o->fixed_file) sqe->flags |= IOSQE_FIXED_FILE;
  }

  void prepare_vectored(io_uring_sqe* sqe, op* o) noexcept {
    const bool reading = o->kind == op_kind::readv;
    const std::uint64_t at = file_offset(o, o->done);
    if (o->iov_skip != 0) {
      // Part of one iovec is done: finish that one alone, then go on with the array.
      const iovec& v = o->iov[o->iov_at];
      auto* p = static_cast<std::byte*>(v.iov_base) + o->iov_skip;
      const auto n = static_cast<unsigned>(std::min(v.iov_len - o->iov_skip, max_chunk));
      if (reading) {
        ::io_uring_prep_read(sqe, o->fd, p, n, at);
      } else {
        ::io_uring_prep_write(sqe, o->fd, p, n, at);
      }
      return;
    }
    const unsigned count = std::min<unsigned>(o->iov_count - o->iov_at, IOV_MAX);
    if (reading) {
      ::io_uring_prep_readv(sqe, o->fd, o->iov + o->iov_at, count, at);
    } else {
      ::io_uring_prep_writev(sqe, o->fd, o->iov + o->iov_at, count, at);
    }
  }

  // The group's frames from where the kernel stopped: header and payload of each.
  static void prepare_send(io_uring_sqe* sqe, op* lead) noexcept {
    detail::connection_state* c = lead->connection;
    std::size_t skip = c->group_done;
    std::size_t count = 0;
    for (unsigned i = 0; i < c->send_group_size; ++i) {
      for (const iovec& part : c->send_group[i]->parts) {
        if (skip >= part.iov_len) {
          skip -= part.iov_len;
          continue;
        }
        c->send_live[count++] = iovec{static_cast<std::byte*>(part.iov_base) + skip, part.iov_len - skip};
        skip = 0;
      }
    }
    c->send_message = msghdr{};
    c->send_message.msg_iov = c->send_live;
    c->send_message.msg_iovlen = count;
    ::io_uring_prep_sendmsg(sqe, lead->fd, &c->send_message, MSG_NOSIGNAL | MSG_WAITALL);
  }

  std::size_t reap(std::size_t budget) noexcept {
    std::size_t handled = 0;
    io_uring_cqe* batch[64];
    while (handled < budget) {
      const auto want = static_cast<unsigned>(std::min<std::size_t>(64, budget - handled));
      const unsigned n = ::io_uring_peek_batch_cqe(&ring_, batch, want);
      if (n == 0) break;
      struct entry {
        std::uint64_t data;
        int res;
      } taken[64];
      for (unsigned i = 0; i < n; ++i) taken[i] = {batch[i]->user_data, batch[i]->res};
      // Give the entries back before completing anything: a completion may resume a coroutine
      // inline, which may submit more.
      ::io_uring_cq_advance(&ring_, n);
      for (unsigned i = 0; i < n; ++i) {
        if (taken[i].data == 0) {  // a cancel made by go_on_closing()
          --cancels_in_flight_;
          continue;
        }
        on_completion(reinterpret_cast<op*>(taken[i].data), taken[i].res);
        // Work submitted by a continuation resumed inline is prepared now, not after the rest of
        // the batch, and goes to the kernel as soon as it makes up a call of submit_batch (issue()
        // flushes then; poll() flushes what is left after the batch). A device given requests
        // early keeps more of them in flight; the next continuation's request, a moment later,
        // shares the call, which halves the calls where the CPU is the limit.
        if (!incoming_.empty()) take_incoming();
      }
      handled += n;
    }
    if (handled != 0) completed_.fetch_add(handled, std::memory_order_relaxed);
    return handled;
  }

  void on_completion(op* o, int res) noexcept {
    if (o->kind == op_kind::cancel) {
      --cancels_in_flight_;
      release_cancel(o);
      return;
    }
    retire(o);
    switch (o->kind) {
      case op_kind::send:
        on_send(o, res);
        return;
      case op_kind::receive:
        on_receive(o, res);
        return;
      default:
        on_file_io(o, res);
        return;
    }
  }

  // -ECANCELED, or -EINTR after a cancel request (the kernel interrupted a running request).
  static bool was_cancelled(const op* o, int res) noexcept {
    return res == -ECANCELED || (res == -EINTR && o->cancel_requested);
  }

  void on_file_io(op* o, int res) noexcept {
    if (res < 0) {
      if (was_cancelled(o, res)) return finish(o, transfer_state::cancelled, {});
      if (res == -EINTR && !shutting_down_) return resume(o);
      return finish(o, transfer_state::failed, detail::system_error_code(-res));
    }
    if (res == 0) {
      const bool reading = o->kind == op_kind::read || o->kind == op_kind::readv;
      return finish(o, transfer_state::failed,
                    reading ? make_error_code(errc::end_of_file) : detail::system_error_code(EIO));
    }
    advance(o, static_cast<std::size_t>(res));
    if (o->done == o->length) return finish(o, transfer_state::success, {});
    continue_partial(o);
  }

  void continue_partial(op* o) noexcept {
    if (o->cancel_requested) return finish(o, transfer_state::cancelled, {});
    if (shutting_down_) return finish(o, transfer_state::failed, make_error_code(ferry::errc::backend_shut_down));
    resubmitted_.fetch_add(1, std::memory_order_relaxed);
    resume(o);
  }

  static void advance(op* o, std::size_t n) noexcept {
    o->done += n;
    if (o->kind != op_kind::readv && o->kind != op_kind::writev) return;
    n += o->iov_skip;
    while (o->iov_at < o->iov_count && n >= o->iov[o->iov_at].iov_len) {
      n -= o->iov[o->iov_at].iov_len;
      ++o->iov_at;
    }
    o->iov_skip = n;
  }

  // --- Connections: one send and one receive in flight per connection, in submission order. ---

  void enqueue_send(op* o) noexcept {
    detail::connection_state* c = o->connection;
    list(c);
    if (c->send_tail == nullptr) {
      c->send_head = c->send_tail = o;
    } else {
      c->send_tail->next = o;
      c->send_tail = o;
    }
    if (!c->sending) next_send(c);
  }

  // Starts the next group: as many queued frames as fit, sent with one sendmsg.
  void next_send(detail::connection_state* c) noexcept {
    if (c->closing.load(std::memory_order_acquire)) return;  // detach cancels what is queued
    c->send_group_size = 0;
    c->group_length = 0;
    c->group_done = 0;
    while (c->send_group_size < detail::connection_state::max_send_group) {
      op* o = pop_front(c->send_head, c->send_tail);
      if (o == nullptr) break;
      if (c->send_error) {
        finish(o, transfer_state::failed, c->send_error);  // the ring's list keeps `c` alive
        continue;
      }
      c->send_group[c->send_group_size++] = o;
      c->group_length += o->length;
    }
    if (c->send_group_size == 0) return;
    c->sending = true;
    start(c->send_group[0]);
  }

  void on_send(op* lead, int res) noexcept {
    detail::connection_state* c = lead->connection;
    if (res > 0) {
      c->group_done += static_cast<std::size_t>(res);
      if (c->group_done == c->group_length) return end_send_group(c, false, {});
      if (!lead->cancel_requested && !shutting_down_) {
        resubmitted_.fetch_add(1, std::memory_order_relaxed);
        resume(finish_sent_frames(c));
        return;
      }
    } else if (res == -EINTR && !lead->cancel_requested && !shutting_down_) {
      resume(lead);
      return;
    }
    std::error_code ec;
    bool cancelled = false;
    if (res < 0 && !was_cancelled(lead, res)) {
      ec = detail::system_error_code(-res);
    } else if (res == 0) {
      ec = make_error_code(errc::connection_closed);
    } else if (lead->cancel_requested) {
      cancelled = true;
    } else {
      ec = make_error_code(ferry::errc::backend_shut_down);
    }
    end_send_group(c, cancelled, ec);
  }

  // A sendmsg came back short: the frames the kernel has wholly taken succeed now, not when the
  // rest of the group has gone (a peer that stops reading would hold them, and a cancel of one
  // could only stop the sendmsg, cutting the next frame). The first frame left leads what is left.
  // So a group's lead is never wholly sent, and the frames behind it are untouched.
  op* finish_sent_frames(detail::connection_state* c) noexcept {
    unsigned sent = 0;
    std::size_t sent_bytes = 0;
    while (sent_bytes + c->send_group[sent]->length <= c->group_done) {
      sent_bytes += c->send_group[sent]->length;
      ++sent;
    }
    // The frames left hold references to `c`, so finishing these cannot free it.
    for (unsigned i = 0; i < sent; ++i) finish(c->send_group[i], transfer_state::success, {});
    for (unsigned i = sent; i < c->send_group_size; ++i) c->send_group[i - sent] = c->send_group[i];
    c->send_group_size -= sent;
    c->group_done -= sent_bytes;
    c->group_length -= sent_bytes;
    return c->send_group[0];
  }

  // Ends the group in flight. Frames that went out whole succeed. If it was cut short: the frame cut
  // part-way ends with the cause, and since the stream is then out of step, so does every later one
  // on the connection; after an error, every frame left fails with it; after a cancel at a frame
  // boundary, the untouched frames that cancel() named end cancelled and the others go back to the
  // front of the queue (or end cancelled too, if the connection is closed or the ring shutting
  // down, since nothing would send them).
  void end_send_group(detail::connection_state* c, bool cancelled, std::error_code ec) noexcept {
    const bool go_on = c->listed && !shutting_down_;
    c->refs.fetch_add(1, std::memory_order_relaxed);  // finish() may drop the last other reference
    const std::error_code broken = make_error_code(errc::connection_broken);
    bool in_step = true;
    op* requeue_head = nullptr;
    op* requeue_tail = nullptr;
    std::size_t begin = 0;
    for (unsigned i = 0; i < c->send_group_size; ++i) {
      op* o = c->send_group[i];
      const std::size_t end = begin + o->length;
      if (end <= c->group_done) {
        finish(o, transfer_state::success, {});
      } else if (begin < c->group_done) {
        in_step = false;
        finish(o, cancelled ? transfer_state::cancelled : transfer_state::failed, ec);
      } else if (cancelled && in_step && !o->frame_cancel && go_on) {
        o->cancel_requested = false;  // the next group's SQE is a new one
        o->next = nullptr;
        (requeue_tail == nullptr ? requeue_head : requeue_tail->next) = o;
        requeue_tail = o;
      } else if (cancelled && in_step) {
        finish(o, transfer_state::cancelled, {});
      } else {
        finish(o, transfer_state::failed, in_step ? ec : broken);
      }
      begin = end;
    }
    c->send_group_size = 0;
    c->sending = false;
    if (!in_step) {
      // The peer has part of a frame and would wait for the rest of it for ever: end the stream,
      // so that its receive fails (connection_closed) and it knows. Receives here go on.
      c->send_error = broken;
      ::shutdown(c->fd, SHUT_WR);
    } else if (!cancelled && !c->send_error) {
      c->send_error = ec;
    }
    if (requeue_head != nullptr) {
      requeue_tail->next = c->send_head;
      c->send_head = requeue_head;
      if (c->send_tail == nullptr) c->send_tail = requeue_tail;
    }
    if (go_on) next_send(c);
    c->release();
  }

  void enqueue_receive(op* o) noexcept {
    detail::connection_state* c = o->connection;
    list(c);
    if (c->receive_tail == nullptr) {
      c->receive_head = c->receive_tail = o;
    } else {
      c->receive_tail->next = o;
      c->receive_tail = o;
    }
    if (!c->receiving) next_receive(c);
  }

  void next_receive(detail::connection_state* c) noexcept {
    if (c->closing.load(std::memory_order_acquire)) return;  // detach cancels what is queued
    while (op* o = pop_front(c->receive_head, c->receive_tail)) {
      if (c->receive_error) {
        finish(o, transfer_state::failed, c->receive_error);
        continue;
      }
      c->receiving = true;
      start(o);
      return;
    }
  }

  void on_receive(op* o, int res) noexcept {
    detail::connection_state* c = o->connection;
    const bool started = o->done != 0 || o->receiving_payload;
    std::error_code ec;
    transfer_state to = transfer_state::pending;
    if (was_cancelled(o, res)) {
      to = transfer_state::cancelled;
      if (started) c->receive_error = make_error_code(errc::connection_broken);
    } else if (res == -EINTR && !shutting_down_) {
      resume(o);
      return;
    } else if (res < 0) {
      to = transfer_state::failed;
      ec = detail::system_error_code(-res);
      c->receive_error = ec;
    } else if (res == 0) {
      to = transfer_state::failed;
      ec = make_error_code(errc::connection_closed);
      c->receive_error = ec;
    } else {
      o->done += static_cast<std::size_t>(res);
      if (o->done == o->length) {
        to = o->receiving_payload ? transfer_state::success : begin_payload(o, ec);
      }
      if (to == transfer_state::pending) {
        if (o->cancel_requested || shutting_down_) {
          c->receive_error = make_error_code(errc::connection_broken);
          to = o->cancel_requested ? transfer_state::cancelled : transfer_state::failed;
          if (!o->cancel_requested) ec = make_error_code(ferry::errc::backend_shut_down);
        } else {
          resume(o);
          return;
        }
      } else if (to == transfer_state::failed) {
        c->receive_error = make_error_code(errc::connection_broken);
      }
    }
    c->receiving = false;
    end_connection_op(o, to, ec);
  }

  // Ends a connection's active operation and starts its next one. While the connection is listed
  // the ring holds a reference, so it outlives finish(); once detached nothing is queued.
  void end_connection_op(op* o, transfer_state to, std::error_code ec) noexcept {
    detail::connection_state* c = o->connection;
    const bool go_on = c->listed && !shutting_down_;
    const bool sending = o->kind == op_kind::send;
    finish(o, to, ec);
    if (!go_on) return;
    if (sending) {
      next_send(c);
    } else {
      next_receive(c);
    }
  }

  // The header is in: check it and switch to the payload. Returns pending to go on receiving,
  // success for an empty block, failed (with `ec`) for a header that cannot be accepted.
  static transfer_state begin_payload(op* o, std::error_code& ec) noexcept {
    const detail::frame_header& h = o->header;
    if (h.magic != detail::frame_header::magic_value || h.reserved != 0) {
      ec = make_error_code(errc::bad_frame);
      return transfer_state::failed;
    }
    if (h.length > o->parts[1].iov_len) {
      ec = make_error_code(errc::block_too_large);
      return transfer_state::failed;
    }
    o->received->id = h.id;
    o->received->length = static_cast<std::size_t>(h.length);
    if (h.length == 0) return transfer_state::success;
    o->receiving_payload = true;
    o->buffer = static_cast<std::byte*>(o->parts[1].iov_base);
    o->length = static_cast<std::size_t>(h.length);
    o->done = 0;
    return transfer_state::pending;
  }

  static op* pop_front(op*& head, op*& tail) noexcept {
    op* o = head;
    if (o == nullptr) return nullptr;
    head = o->next;
    if (head == nullptr) tail = nullptr;
    o->next = nullptr;
    return o;
  }

  // --- Cancellation. ---

  void handle_cancel(op* c) noexcept {
    detail::status_block* s = c->status;
    if (s->state() != transfer_state::pending) return release_cancel(c);
    for (op* o : in_flight_) {
      if (o->status != s) continue;
      if (o->kind == op_kind::send) o->frame_cancel = true;  // the lead of its group
      if (o->cancel_requested) return release_cancel(c);
      o->cancel_requested = true;
      c->target = o;
      start(c);
      return;
    }
    op* o = file_backlog_.remove(s);
    if (o == nullptr) o = send_backlog_.remove(s);
    if (o == nullptr) o = receive_backlog_.remove(s);
    if (o != nullptr) {
      release_cancel(c);
      return cancel_backlogged(o);
    }
    for (detail::connection_state* conn = connections_head_; conn != nullptr;
         conn = conn->list_next) {
      o = unlink(conn->send_head, conn->send_tail, s);
      if (o == nullptr) o = unlink(conn->receive_head, conn->receive_tail, s);
      if (o != nullptr) {
        release_cancel(c);
        return finish(o, transfer_state::cancelled, {});
      }
    }
    // A frame behind the lead of a send group. Every group's lead is in flight or in the backlog,
    // whether or not close() has taken its connection off the list.
    detail::connection_state* group = nullptr;
    unsigned index = 0;
    auto look = [&](const op* lead) {
      detail::connection_state* conn = lead->connection;
      if (lead->kind != op_kind::send || !conn->sending || conn->send_group[0] != lead) return;
      for (unsigned i = 1; i < conn->send_group_size; ++i) {
        if (conn->send_group[i]->status == s) {
          group = conn;
          index = i;
        }
      }
    };
    for (const op* o : in_flight_) look(o);
    for (const op* o = send_backlog_.head; o != nullptr; o = o->next) look(o);
    if (group != nullptr) return cancel_group_frame(group, index, c);
    release_cancel(c);
  }

  // Frame i (not the lead) of the group `conn` is sending. No byte of it has gone out (the frames
  // before it have not all gone: finish_sent_frames). With the group waiting for room, it simply
  // leaves the group. With the group in the kernel, its bytes belong to the one sendmsg, which
  // stops: frames that went out whole succeed, untouched frames other than those cancelled are
  // sent again (end_send_group).
  void cancel_group_frame(detail::connection_state* conn, unsigned i, op* cancel) noexcept {
    op* frame = conn->send_group[i];
    op* lead = conn->send_group[0];
    frame->frame_cancel = true;
    const bool lead_in_kernel = lead->slot < in_flight_.size() && in_flight_[lead->slot] == lead;
    if (!lead_in_kernel) {
      release_cancel(cancel);
      for (unsigned k = i; k + 1 < conn->send_group_size; ++k) {
        conn->send_group[k] = conn->send_group[k + 1];
      }
      --conn->send_group_size;
      conn->group_length -= frame->length;
      return finish(frame, transfer_state::cancelled, {});
    }
    if (lead->cancel_requested) return release_cancel(cancel);  // the group is stopping already
    lead->cancel_requested = true;
    // The request names the lead, and carries the lead's transfer reference: issue() tells the
    // lead from an op recycled at the same address by its status.
    lead->status->add_transfer_ref();
    cancel->status->release_transfer_ref();
    cancel->status = lead->status;
    cancel->target = lead;
    start(cancel);
  }

  static op* unlink(op*& head, op*& tail, const detail::status_block* s) noexcept {
    detail::op_queue q{head, tail};
    op* o = q.remove(s);
    head = q.head;
    tail = q.tail;
    return o;
  }

  // Waiting for room in the ring: it never reached the kernel, or is between two parts of a short
  // transfer. A connection's operation in the backlog is its active one; if it had moved bytes,
  // the stream is out of step.
  void cancel_backlogged(op* o) noexcept {
    detail::connection_state* c = o->connection;
    if (c == nullptr) return finish(o, transfer_state::cancelled, {});
    if (o->kind == op_kind::send) {  // `o` leads the group
      o->frame_cancel = true;
      return end_send_group(c, true, {});
    }
    // A receive: if it had taken bytes of a frame, the stream is out of step.
    if ((o->done != 0 || o->receiving_payload) && !c->receive_error) {
      c->receive_error = make_error_code(errc::connection_broken);
    }
    c->receiving = false;
    c->refs.fetch_add(1, std::memory_order_relaxed);  // finish() may drop the last reference
    finish(o, transfer_state::cancelled, {});
    next_receive(c);
    c->release();
  }

  // --- The ring's list of connections that have had work: for cancel() and detach. ---

  void list(detail::connection_state* c) noexcept {
    if (c->listed) return;
    c->listed = true;
    c->refs.fetch_add(1, std::memory_order_relaxed);
    c->list_prev = nullptr;
    c->list_next = connections_head_;
    if (connections_head_ != nullptr) connections_head_->list_prev = c;
    connections_head_ = c;
  }

  // The handle is gone (its socket already shut down): queued operations never start.
  void detach(op* d) noexcept {
    detail::connection_state* c = d->connection;
    op::pool::release(d);
    // The handle's reference (the detach op carried it) and the list's, dropped together.
    c->release(unlink_connection(c) ? 2 : 1);
  }

  // The connection's send group or receive may be waiting for room in the ring (not started yet, or
  // between two parts). With the socket shut down it never starts again: it ends here, as queued
  // work does (frames already sent whole succeed), rather than going to the kernel later, on a
  // closed connection, with buffers its owner may already have freed.
  void end_waiting_for_room(detail::connection_state* c) noexcept {
    if (c->sending && send_backlog_.remove(c->send_group[0]->status) != nullptr) {
      for (unsigned i = 0; i < c->send_group_size; ++i) c->send_group[i]->frame_cancel = true;
      end_send_group(c, true, {});
    }
    if (!c->receiving) return;
    if (op* o = receive_backlog_.remove_if([c](const op* q) { return q->connection == c; })) {
      c->receiving = false;
      finish(o, transfer_state::cancelled, {});
    }
  }

  void unlist(detail::connection_state* c) noexcept {
    if (unlink_connection(c)) c->release();
  }

  // Cancels what is queued and takes `c` off the list; true if it was listed (the caller then owns
  // the list's reference).
  bool unlink_connection(detail::connection_state* c) noexcept {
    if (!c->listed) return false;
    end_waiting_for_room(c);
    while (op* o = pop_front(c->send_head, c->send_tail)) finish(o, transfer_state::cancelled, {});
    while (op* o = pop_front(c->receive_head, c->receive_tail)) {
      finish(o, transfer_state::cancelled, {});
    }
    (c->list_prev == nullptr ? connections_head_ : c->list_prev->list_next) = c->list_next;
    if (c->list_next != nullptr) c->list_next->list_prev = c->list_prev;
    c->listed = false;
    return true;
  }

  static void release_cancel(op* c) noexcept {
    c->status->release_transfer_ref();
    op::pool::release(c);
  }

  // --- Ending operations. ---

  void finish(op* o, transfer_state to, std::error_code ec) noexcept {
    detail::status_block* s = o->status;
    detail::connection_state* c = o->connection;
    op::pool::release(o);
    s->complete(to, ec);
    s->release_completer_ref();
    if (c != nullptr) c->release();
  }

  void finish_unstarted(op* o) noexcept {
    if (o->kind == op_kind::cancel) return release_cancel(o);
    if (o->kind == op_kind::send && o->connection->sending &&
        o->connection->send_group[0] == o) {
      // The lead of a send group: the whole group ends.
      return end_send_group(o->connection, false, make_error_code(ferry::errc::backend_shut_down));
    }
    finish(o, transfer_state::failed, make_error_code(ferry::errc::backend_shut_down));
  }

  // tcp.hpp: a connection's operations go through the same stack as everything else.
  void post(op* o) noexcept { publish(o, o); }

  // --- Work that must run on the executor thread (the ring's issuer, when deferred). ---

  // Runs f() on the executor thread and returns what it returned (0 or -errno); the calling thread
  // waits. On the executor thread itself it runs at once.
  template <class F>
  int on_executor(F f) {
    if (exec_.on_executor_thread()) return f();
    op* o = op::make(op_kind::call);
    o->call = [](void* fn) noexcept { return (*static_cast<F*>(fn))(); };
    o->call_argument = &f;
    transfer t = attach(o);
    publish(o, o);
    (void)t.wait();
    return t.state() == transfer_state::success ? 0 : -t.error().value();
  }

  // `refuse`: the ring is gone from the executor, and the kernel would refuse the call here.
  std::size_t run_calls(bool refuse = false) noexcept {
    std::size_t n = 0;
    while (op* o = calls_.pop()) {
      if (refuse) {
        finish(o, transfer_state::failed, make_error_code(ferry::errc::backend_shut_down));
        ++n;
        continue;
      }
      const int r = o->call(o->call_argument);
      finish(o, r < 0 ? transfer_state::failed : transfer_state::success,
             r < 0 ? detail::system_error_code(-r) : std::error_code{});
      ++n;
    }
    return n;
  }

  // Deferred: the executor's part of the destructor, a little each round (nothing here waits).
  // Refuses what is queued, asks the kernel to cancel what it holds, and once every completion is
  // back, lets the destructor go on.
  void go_on_closing() noexcept {
    // Refusals resume continuations inline, which may publish more: refused here, on this thread,
    // before the destructor goes on.
    if (!incoming_.empty()) take_incoming();
    fail_backlogs();
    cancel_everything();
    flush();
    if (!in_flight_.empty() || cancels_in_flight_ != 0 || !incoming_.empty()) return;
    op* o = std::exchange(closing_, nullptr);
    finish(o, transfer_state::success, {});
  }

  // One cancel per operation the kernel holds, as CQ room allows (every kernel has these;
  // CANCEL_ANY is 5.19+). Their completions carry user data 0.
  void cancel_everything() noexcept {
    for (op* o : in_flight_) {
      if (o->cancelled_at_shutdown) continue;
      if (in_flight_.size() + cancels_in_flight_ >= limit_) break;
      io_uring_sqe* sqe = next_sqe();
      if (sqe == nullptr) break;
      ::io_uring_prep_cancel64(sqe, reinterpret_cast<std::uintptr_t>(o), 0);
      ::io_uring_sqe_set_data64(sqe, 0);
      o->cancel_requested = true;
      o->cancelled_at_shutdown = true;
      ++cancels_in_flight_;
    }
  }

  // The plain set-up's destructor, once the executor no longer polls the ring: cancels everything
  // in flight and waits for every completion on this thread. Completing an operation may resume a
  // continuation inline here, which may submit more: that is taken (and refused) each time round,
  // until nothing is queued or in flight.
  void shut_down() noexcept {
    shutting_down_ = true;
    for (;;) {
      take_incoming();
      run_calls();
      fail_backlogs();
      if (in_flight_.empty() && cancels_in_flight_ == 0 && incoming_.empty()) break;
      cancel_everything();
      flush();
      if (in_flight_.empty() && cancels_in_flight_ == 0) continue;
      // Submits again what flush() could not hand over (the kernel was short of memory) in the
      // same call that waits, so that the wait is never for a cancel the kernel does not have.
      io_uring_cqe* cqe = nullptr;
      int r = ::io_uring_submit_and_wait(&ring_, 1);
      if (r >= 0) r = ::io_uring_peek_cqe(&ring_, &cqe);
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
      ::io_uring_cqe_seen(&ring_, cqe);
      if (data == 0) {
        --cancels_in_flight_;
      } else {
        on_completion(reinterpret_cast<detail::op*>(data), res);
      }
    }
  }

  // The destructor's op, when the destructor does not need it (or the constructor failed).
  void release_closing_op() noexcept {
    if (op* o = std::exchange(closing_op_, nullptr)) finish(o, transfer_state::success, {});
  }

  void close_ring() noexcept {
    ::io_uring_queue_exit(&ring_);
    if (due_fd_ >= 0) ::close(due_fd_);
    due_fd_ = -1;
  }

  progress_executor& exec_;
  io_uring ring_{};
  unsigned limit_ = 0;
  unsigned submit_batch_ = 2;
  bool deferred_ = false;  // SINGLE_ISSUER | DEFER_TASKRUN, the executor thread the issuer
  int due_fd_ = -1;        // deferred: the eventfd the kernel signals when completions are due
  bool signalling_ = false;  // deferred: due_fd_ switched on, for a park

  // Submitters push here; the executor takes the whole stack at once.
  ferry::detail::submission_stack<op> incoming_;

  // The executor thread's state.
  alignas(64) std::vector<op*> in_flight_;
  unsigned cancels_in_flight_ = 0;
  unsigned receives_in_flight_ = 0;
  unsigned sends_in_flight_ = 0;
  unsigned cancel_room_ = 1;   // CQ entries only cancels may use
  unsigned socket_kind_room_ = 1;  // the most socket receives, or sends, in flight at once
  unsigned socket_room_ = 2;       // the most socket receives and sends in flight together
  // Waiting for room, one queue per kind, so that no kind waits behind another's share.
  detail::op_queue file_backlog_;
  detail::op_queue send_backlog_;
  detail::op_queue receive_backlog_;
  detail::op_queue cancel_backlog_;
  detail::op_queue calls_;  // on_executor() calls taken, run at the end of the round
  op* closing_op_ = nullptr;  // made by the constructor for the destructor
  transfer closed_;           // its transfer: done once the executor has finished the ring
  op* closing_ = nullptr;     // the executor's: the destructor's op while it finishes the ring
  bool shutting_down_ = false;
  std::uint64_t tickets_ = 0;  // handed out in backlog arrival order

  detail::connection_state* connections_head_ = nullptr;

  // Open tcp_connection handles, checked by the destructor.
  std::atomic<int> connections_{0};

  std::atomic<std::uint64_t> submitted_{0};
  std::atomic<std::uint64_t> submit_calls_{0};
  std::atomic<std::uint64_t> completed_{0};
  std::atomic<std::uint64_t> resubmitted_{0};
  std::atomic<std::uint64_t> backlogged_{0};
};

}  // namespace ferry::uring

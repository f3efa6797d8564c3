#pragma once
// The io_uring backend: file reads and writes at offsets (KV offload to local NVMe), and the socket
// sends and receives under tcp.hpp, as transfers completed by the progress executor.
//
// Any thread submits; only the executor thread touches the ring itself, so the ring needs no
// locking at all. The parts, each in its own header under detail/:
//   op.hpp             the pooled operation, and the handlers each kind brings
//   admission.hpp      the bound on what is in flight (the CQ never overflows), the backlogs
//   engine.hpp         submission (publish, issue, batched io_uring_enter), reaping, finishing
//   file_io.hpp        file reads and writes: plain, registered, vectored, batched
//   send.hpp, receive.hpp, detach.hpp, connection_state.hpp   TCP connections (tcp.hpp)
//   cancellation.hpp   cancel(t)
//   executor_call.hpp  work that must run on the executor thread
//   teardown.hpp       finishing the ring when it is destroyed
//
// Task work. On a busy executor (one that never parks) the ring is set up, by default and from
// Linux 6.1 on, SINGLE_ISSUER | DEFER_TASKRUN with the executor thread as its one issuer: the kernel finishes completions only inside the executor's own
// io_uring_enter calls, never by interrupting it, and needs no cross-CPU wake-ups to do so. That
// ties every call into the ring to that thread: registrations run there (the calling thread waits
// for them), the executor cancels and collects what the ring still holds when it is destroyed (in
// its ordinary rounds, while the destructor's thread waits), and it parks on an eventfd the kernel
// signals when completions are due. An executor that parks (adaptive, park) gets the plain set-up:
// the kernel signals that eventfd lazily for deferred work, so a parked executor heard of a
// completion only a scheduler tick later. So does an older kernel (`defers_task_work()` tells); the
// plain ring's destructor does that work on its own thread.

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
#include <span>
#include <stdexcept>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include "ferry/detail/full_barrier.hpp"
#include "ferry/progress_executor.hpp"
#include "ferry/transfer.hpp"
#include "ferry/uring/detail/cancellation.hpp"
#include "ferry/uring/detail/detach.hpp"
#include "ferry/uring/detail/engine.hpp"
#include "ferry/uring/detail/executor_call.hpp"
#include "ferry/uring/detail/file_io.hpp"
#include "ferry/uring/detail/teardown.hpp"
#include "ferry/uring/errors.hpp"
#include "ferry/uring/frame.hpp"
#include "ferry/uring/options.hpp"

namespace ferry::uring {

/// An io_uring ring driven by the progress executor: file reads and writes at offsets, and the
/// ring tcp_connection and tcp_listener run on.
///
/// Any thread submits; only the executor thread touches the ring. Every transfer's buffer must stay
/// valid until the transfer is terminal; destroy the ring's connections before it.
class ring {
 public:
  /// Sets up the ring (see ring_options) and registers with `exec`, which must outlive it. Throws
  /// std::invalid_argument for zero entries, std::system_error when the kernel refuses the ring.
  explicit ring(progress_executor& exec, ring_options options = {}) : e_(exec) {
    if (options.entries == 0) {
      throw std::invalid_argument("ferry::uring::ring_options::entries must be at least 1");
    }
    // The kernel's own limit (IORING_MAX_ENTRIES), so that twice it still fits in 32 bits.
    const unsigned entries = std::min(options.entries, 32768u);
    // Made now, so that the destructor cannot fail for want of memory.
    e_.closing_op_ = detail::op::make(detail::shutdown_handlers);
    e_.closed_ = detail::engine::attach(e_.closing_op_);
    // Newest set-up first; each fallback drops what an older kernel refuses with EINVAL (deferred
    // task work: 6.1; SUBMIT_ALL: 5.18). ferry depends on neither.
    constexpr unsigned plain = IORING_SETUP_CLAMP | IORING_SETUP_CQSIZE;
    constexpr unsigned deferred = IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN |
                                  IORING_SETUP_TASKRUN_FLAG | IORING_SETUP_R_DISABLED;
    int r = -EINVAL;
    io_uring_params params{};
    // Deferred completions only for an executor that never parks (progress_mode::busy): a parked
    // issuer hears of them through the ring's eventfd, which the kernel signals lazily for deferred
    // task work (on Linux 6.18, a pipe read's completion reached a parked executor a scheduler tick
    // later: 8 ms a round trip, against 60 µs with the plain set-up).
    const bool may_defer =
        options.defer_task_work && exec.options().mode == progress_mode::busy;
    for (const unsigned flags : {plain | IORING_SETUP_SUBMIT_ALL | deferred,
                                 plain | IORING_SETUP_SUBMIT_ALL, plain}) {
      if ((flags & deferred) != 0 && !may_defer) continue;
      params = io_uring_params{};
      params.flags = flags;
      params.cq_entries = std::max(4u, 2 * entries);  // room for cancels, socket work, the rest
      r = ::io_uring_queue_init_params(entries, &e_.ring_, &params);
      if (r != -EINVAL) break;
    }
    if (r < 0) {
      detail::release_closing_op(e_);
      throw std::system_error(-r, std::system_category(),
                              "ferry::uring::ring: io_uring_queue_init_params(" +
                                  std::to_string(options.entries) + " entries)");
    }
    e_.deferred_ = (params.flags & IORING_SETUP_DEFER_TASKRUN) != 0;
    e_.bound(params.cq_entries);
    e_.submit_batch_ = options.submit_batch;
    try {
      if (options.metrics != nullptr) e_.meter(*options.metrics);
      e_.in_flight_.reserve(e_.limit_);
      if (e_.deferred_) {
        // Deferred completions make the ring's own descriptor no sign of work: the executor parks
        // on this eventfd, which the kernel signals when some are due.
        e_.due_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        if (e_.due_fd_ < 0) {
          throw std::system_error(errno, std::system_category(), "ferry::uring::ring: eventfd");
        }
        if (const int err = ::io_uring_register_eventfd(&e_.ring_, e_.due_fd_); err < 0) {
          throw std::system_error(-err, std::system_category(),
                                  "ferry::uring::ring: io_uring_register_eventfd");
        }
        ::io_uring_cq_eventfd_toggle(&e_.ring_, false);  // switched on only to park (arm())
      }
      e_.exec_.add_source(*this);
    } catch (...) {
      detail::close_ring(e_);
      detail::release_closing_op(e_);
      throw;
    }
    // On the executor thread, which issues every request: SIGPIPE blocked, and with deferred task
    // work the ring enabled (the thread that enables it becomes its one issuer).
    int err = 0;
    try {
      err = detail::on_executor(e_, [this]() noexcept {
        block_sigpipe();
        if (!e_.deferred_) return 0;
        return ::syscall(__NR_io_uring_register, e_.ring_.ring_fd, IORING_REGISTER_ENABLE_RINGS,
                         nullptr, 0) < 0
                   ? -errno
                   : 0;
      });
    } catch (...) {
      e_.exec_.remove_source(*this);
      detail::close_ring(e_);
      detail::release_closing_op(e_);
      throw;
    }
    if (err < 0) {
      e_.exec_.remove_source(*this);
      detail::close_ring(e_);
      detail::release_closing_op(e_);
      throw std::system_error(-err, std::system_category(),
                              "ferry::uring::ring: enabling the ring on the executor thread");
    }
  }

  ring(const ring&) = delete;
  ring& operator=(const ring&) = delete;

  /// Waits for everything the kernel still holds: operations in flight are cancelled and their own
  /// completions awaited, so no buffer is written after this returns. Operations not yet given to
  /// the kernel fail with ferry::errc::backend_shut_down. Every tcp_connection on this ring must be gone.
  ~ring() {
    if (e_.exec_.on_executor_thread()) {
      // A continuation resumed inline may be inside this ring's own poll() (reap() holding taken
      // completions): nothing here could finish safely.
      std::fprintf(stderr,
                   "ferry: uring::ring destroyed on its progress executor's thread, from a "
                   "continuation resumed inline; destroy it from another thread\n");
      std::abort();
    }
    if (e_.open_connections_.load(std::memory_order_acquire) != 0) {
      std::fprintf(stderr,
                   "ferry: uring::ring destroyed with %d tcp_connection(s) still open on it; "
                   "destroy connections before their ring\n",
                   e_.open_connections_.load(std::memory_order_relaxed));
      std::abort();
    }
    if (e_.deferred_) {
      // Only the issuer may wait for this ring's completions. The executor cancels what is in
      // flight and finishes it in its ordinary rounds, serving its other sources meanwhile; this
      // thread waits until nothing is left.
      detail::op* o = std::exchange(e_.closing_op_, nullptr);
      e_.publish(o, o);
      (void)e_.closed_.wait();
      e_.exec_.remove_source(*this);
      // Anything published after the executor's last look is refused here, without a call into
      // the kernel; a continuation resumed by a refusal may publish more, so until none is left.
      do {
        e_.take_incoming();
        detail::run_calls(e_, true);
      } while (!e_.incoming_.empty());
    } else {
      e_.exec_.remove_source(*this);
      detail::shut_down(e_);
      detail::release_closing_op(e_);
    }
    while (e_.connections_.front() != nullptr) detail::unlist(e_, e_.connections_.front());
    detail::close_ring(e_);
  }

  /// Reads dst.size() bytes at `offset` (or current_position) into dst. `transferred`, if given, is
  /// set to the bytes that landed before the transfer ended (read it once the transfer is terminal).
  /// A cancel that takes effect before any byte moved ends the transfer cancelled; after some did,
  /// it fails with errc::cancelled_part_way, since a stream read at its current position has then
  /// lost those bytes.
  [[nodiscard]] transfer read(file_ref file, std::span<std::byte> dst, std::uint64_t offset,
                              std::size_t* transferred = nullptr) {
    return detail::submit_io(e_, detail::read_handlers, file, dst.data(), dst.size(), offset, -1,
                             transferred);
  }

  /// The same through a registered buffer: dst must lie inside `registered.memory`.
  [[nodiscard]] transfer read(file_ref file, std::span<std::byte> dst, std::uint64_t offset,
                              const fixed_buffer& registered, std::size_t* transferred = nullptr) {
    if (const errc e = detail::check_registered(dst.data(), dst.size(), registered); e != errc{}) {
      return make_completed_transfer(transfer_state::failed, e);
    }
    return detail::submit_io(e_, detail::read_handlers, file, dst.data(), dst.size(), offset,
                             static_cast<int>(registered.index), transferred);
  }

  /// Writes src at `offset` (or current_position); `transferred` and a cancel as for read().
  [[nodiscard]] transfer write(file_ref file, std::span<const std::byte> src, std::uint64_t offset,
                               std::size_t* transferred = nullptr) {
    return detail::submit_io(e_, detail::write_handlers, file, const_cast<std::byte*>(src.data()),
                             src.size(), offset, -1, transferred);
  }

  /// The same through a registered buffer: src must lie inside `registered.memory`.
  [[nodiscard]] transfer write(file_ref file, std::span<const std::byte> src, std::uint64_t offset,
                               const fixed_buffer& registered, std::size_t* transferred = nullptr) {
    if (const errc e = detail::check_registered(src.data(), src.size(), registered); e != errc{}) {
      return make_completed_transfer(transfer_state::failed, e);
    }
    return detail::submit_io(e_, detail::write_handlers, file, const_cast<std::byte*>(src.data()),
                             src.size(), offset, static_cast<int>(registered.index), transferred);
  }

  /// Scatter: fills the iovecs in order from `offset`, as one transfer. The iovec array (not only
  /// the memory it points to) must stay valid until the transfer is terminal.
  [[nodiscard]] transfer readv(file_ref file, std::span<const iovec> iov, std::uint64_t offset,
                               std::size_t* transferred = nullptr) {
    return detail::submit_vectored(e_, detail::readv_handlers, file, iov, offset, transferred);
  }

  /// Gather: writes the iovecs in order from `offset`, as one transfer.
  [[nodiscard]] transfer writev(file_ref file, std::span<const iovec> iov, std::uint64_t offset,
                                std::size_t* transferred = nullptr) {
    return detail::submit_vectored(e_, detail::writev_handlers, file, iov, offset, transferred);
  }

  /// Many blocks at once, one transfer each (out[i] for blocks[i]), published with one CAS and
  /// submitted in calls of ring_options::submit_batch. A block's `transferred`, if given, says how
  /// many bytes landed once its transfer has ended, as read()'s does.
  void read_batch(file_ref file, std::span<const read_block> blocks, std::span<transfer> out) {
    detail::batch_reads(e_, file, blocks, out, nullptr);
  }

  /// The same through a registered buffer, which every block must lie inside (a block that does not
  /// fails alone, with errc::outside_registered_buffer).
  void read_batch(file_ref file, std::span<const read_block> blocks, std::span<transfer> out,
                  const fixed_buffer& registered) {
    detail::batch_reads(e_, file, blocks, out, &registered);
  }

  /// Many blocks written at once, one transfer each (out[i] for blocks[i]), as read_batch.
  void write_batch(file_ref file, std::span<const write_block> blocks, std::span<transfer> out) {
    detail::batch_writes(e_, file, blocks, out, nullptr);
  }

  /// The same through a registered buffer, which every block must lie inside.
  void write_batch(file_ref file, std::span<const write_block> blocks, std::span<transfer> out,
                   const fixed_buffer& registered) {
    detail::batch_writes(e_, file, blocks, out, &registered);
  }

  /// Best effort: asks the kernel to cancel the operation completing `t`. If it is cancelled, `t`
  /// turns cancelled when its own completion arrives (or at once if it never reached the kernel);
  /// if it finished first, `t` keeps that result. A transfer from elsewhere is left alone.
  /// Sends to one connection go out coalesced, several frames to one sendmsg: cancelling any of
  /// them stops that sendmsg. Frames it sent whole succeed, a frame it cut part-way ends cancelled,
  /// and untouched frames that were not cancelled are sent again. (A sendmsg that comes back short
  /// completes the frames it sent whole at once, so a cancel of one of those is a no-op.) A cut
  /// frame puts the stream out of step: the connection's later sends fail, and its write side is
  /// shut down so that the peer's receive fails rather than wait for the rest of the frame.
  void cancel(const transfer& t) { detail::request_cancel(e_, t); }

  /// Registers memory for IORING_OP_READ_FIXED / WRITE_FIXED (once per ring).
  [[nodiscard]] std::vector<fixed_buffer> register_buffers(
      std::span<const std::span<std::byte>> buffers) {
    std::vector<iovec> iov;
    iov.reserve(buffers.size());
    for (const auto& b : buffers) iov.push_back(iovec{b.data(), b.size()});
    const int r = detail::on_executor(e_, [&]() noexcept {
      return ::io_uring_register_buffers(&e_.ring_, iov.data(), static_cast<unsigned>(iov.size()));
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

  /// Registers descriptors for IOSQE_FIXED_FILE (once per ring).
  [[nodiscard]] std::vector<fixed_file> register_files(std::span<const int> fds) {
    const int r = detail::on_executor(e_, [&]() noexcept {
      return ::io_uring_register_files(&e_.ring_, fds.data(), static_cast<unsigned>(fds.size()));
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

  /// How many operations the kernel may hold at once (the completion queue's size).
  [[nodiscard]] unsigned in_flight_limit() const noexcept { return e_.limit_; }

  /// Whether the kernel defers completions to the executor's own calls (ring_options::defer_task_work
  /// asked for it, and the kernel has it).
  [[nodiscard]] bool defers_task_work() const noexcept { return e_.deferred_; }

  /// What the ring has done so far; any thread.
  [[nodiscard]] ring_counters counters() const noexcept { return e_.counters(); }

  /// The executor that drives the ring.
  [[nodiscard]] progress_executor& executor() const noexcept { return e_.exec_; }

  /// Submits what was published and reaps up to `budget` completions; returns how many things it
  /// handled (completion_source). Called by the executor only.
  /// The executor's side: a completion source whose descriptor is readable when CQEs wait.
  std::size_t poll(std::size_t budget) noexcept {
    if (e_.signalling_) {
      // Awake again: completions are found by looking, until the next park.
      ::io_uring_cq_eventfd_toggle(&e_.ring_, false);
      e_.signalling_ = false;
    }
    if (!e_.incoming_.empty()) e_.take_incoming();
    e_.pump();
    e_.flush();
    std::size_t handled = e_.reap(budget);
    if (handled != 0) {
      e_.pump();
      e_.flush();
    }
    handled += detail::run_calls(e_);
    if (e_.closing_ != nullptr) detail::go_on_closing(e_);
    // SQEs the kernel did not take (it was short of memory) must be retried, not slept on.
    return handled + (::io_uring_sq_ready(&e_.ring_) != 0 ? 1 : 0);
  }

  /// The descriptor the executor sleeps on: the ring's own, or with deferred task work the eventfd
  /// the kernel signals (parkable_source).
  [[nodiscard]] int park_fd() const noexcept { return e_.deferred_ ? e_.due_fd_ : e_.ring_.ring_fd; }

  /// The executor's side: whether the kernel holds anything but socket receives, so that the executor
  /// spins for executor_options::in_flight_spin before parking. File reads and writes complete
  /// within the device's latency; sends usually within moments (one to a peer that does not read, or
  /// a read of a pipe, waits on that peer, and costs that spin after each completion meanwhile).
  /// Receives are left out: a server keeps one posted on every connection, mostly waiting (and so
  /// are accepts and connects, counted with them).
  [[nodiscard]] bool in_flight() const noexcept {
    return e_.in_flight_.size() > e_.receives_in_flight_;
  }

  /// Readies the ring to wake a parking executor; false when completions are due already
  /// (armable_source).
  /// Before the executor sleeps on due_fd_. The kernel signals it only while it is switched on
  /// (signalling costs a wake-up call in the kernel per completion run), and only when the first of
  /// a run of deferred completions is queued, which may have come before the switch. So: switch it
  /// on, clear it, then enter the kernel to run whatever it deferred, and look at the CQ. The kernel
  /// queues work with a fully ordered exchange on its list, then reads the switch; this thread
  /// writes the switch, then (barrier, system call) reads that list: on any CPU at least one sees
  /// the other, so either the work shows in the CQ now or the kernel signals. (Reading the
  /// IORING_SQ_TASKRUN flag alone would not be ordered on arm64.)
  /// One call runs a limited number of items (20 since Linux 6.13) and keeps the rest, unsignalled,
  /// with IORING_SQ_TASKRUN set again; items that post nothing (a socket receive that got part of
  /// its bytes and waits again) can fill every call. So: go on while the flag says work is left,
  /// up to a bound that covers everything in flight, since the flag can also be left set with
  /// nothing queued, and a stale flag must not keep the executor awake.
  bool arm() noexcept {
    if (!e_.deferred_) return true;
    ::io_uring_cq_eventfd_toggle(&e_.ring_, true);
    e_.signalling_ = true;
    ferry::detail::full_barrier();
    std::uint64_t count = 0;
    [[maybe_unused]] const ssize_t n = ::read(e_.due_fd_, &count, sizeof count);
    for (unsigned i = 0; i < e_.limit_ / 16 + 2; ++i) {
      (void)::io_uring_get_events(&e_.ring_);
      if (::io_uring_cq_ready(&e_.ring_) != 0) return false;
      if ((__atomic_load_n(e_.ring_.sq.kflags, __ATOMIC_ACQUIRE) & IORING_SQ_TASKRUN) == 0) break;
    }
    return true;
  }

  /// The parts' way in (tcp.hpp composes its connections from it); nothing a user calls.
  [[nodiscard]] detail::engine& engine() noexcept { return e_; }

 private:
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

  detail::engine e_;
};

}  // namespace ferry::uring

#pragma once
// Making TCP connections through the io_uring ring, for tcp_connection::connect_async and
// tcp_listener::accept_async: a connect (IORING_OP_CONNECT, each address the host resolved to in
// turn) or an accept (IORING_OP_ACCEPT), each with its deadline linked to it in the kernel
// (IORING_OP_LINK_TIMEOUT, absolute on CLOCK_MONOTONIC, the steady clock), so that no timer of
// ferry's has to reach into the ring and a deadline holds even while the executor is busy.
//
// The socket made is handed over through the socket_setup, which the pending_connection and the
// operation share: the executor stores it before the transfer succeeds and the pending_connection
// takes it; one never taken (the pending_connection dropped) is closed by whichever of the two lets
// go of the socket_setup last.

#include <liburing.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <memory>
#include <system_error>
#include <vector>

#include <sys/socket.h>
#include <unistd.h>

#include "ferry/detail/socket.hpp"
#include "ferry/detail/timeout.hpp"
#include "ferry/errors.hpp"
#include "ferry/transfer.hpp"
#include "ferry/uring/detail/engine.hpp"
#include "ferry/uring/detail/op.hpp"
#include "ferry/uring/errors.hpp"

namespace ferry::uring::detail {

// A tcp_listener's socket, shared with the accepts waiting on it: closing the listener shuts the
// socket down, which ends them (-EINVAL), and `closed` says why.
struct listener_state {
  int fd = -1;
  std::atomic<bool> closed{false};

  ~listener_state() {
    if (fd >= 0) ::close(fd);
  }
};

struct socket_setup {
  // The pending_connection's reference and the operation's.
  std::atomic<int> refs{2};
  // A connect: the addresses to try, in order, the one being tried, and the socket options as
  // SO_SNDBUF and SO_RCVBUF values (0: the kernel's).
  std::vector<ferry::detail::resolved_address> addresses;
  std::size_t at = 0;
  int send_buffer = 0;
  int receive_buffer = 0;
  // An accept: the listener's socket.
  std::shared_ptr<listener_state> listener;
  // The socket made, until the pending_connection takes it (-1: none, or taken).
  std::atomic<int> made{-1};

  // The last reference closes a socket nobody took. Acquire-release: the executor's store of
  // `made` happens before its release, which the last one's acquire sees.
  void release() noexcept {
    if (refs.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      const int fd = made.exchange(-1);
      if (fd >= 0) ::close(fd);
      delete this;
    }
  }
};

// A new socket for the address being tried, with the options set; -errno if it cannot be made.
[[nodiscard]] inline int open_connect_socket(const socket_setup& s) noexcept {
  const int fd = ferry::detail::open_socket(s.addresses[s.at]);
  if (fd < 0) return -errno;
  const auto set = [fd](int name, int value) {
    return value == 0 || ::setsockopt(fd, SOL_SOCKET, name, &value, sizeof value) == 0;
  };
  if (!set(SO_SNDBUF, s.send_buffer) || !set(SO_RCVBUF, s.receive_buffer)) {
    const int err = errno;
    ::close(fd);
    return -err;
  }
  return fd;
}

// The deadline as the kernel's absolute CLOCK_MONOTONIC time (the steady clock on Linux). A look
// (zero) is a deadline of now: the connect or accept must happen at once or not at all.
template <class Rep, class Period>
void set_deadline(op* o, std::chrono::duration<Rep, Period> timeout) {
  const ferry::detail::timeout t = ferry::detail::make_timeout(timeout);
  if (t.is_forever()) return;
  const auto at = t.is_look() ? ferry::detail::clock::now() : t.deadline();
  const auto ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(at.time_since_epoch()).count();
  o->linked_deadline = true;
  o->deadline.tv_sec = ns / 1'000'000'000;
  o->deadline.tv_nsec = ns % 1'000'000'000;
}

[[nodiscard]] inline bool deadline_passed(const op* o) noexcept {
  if (!o->linked_deadline) return false;
  const auto now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                       ferry::detail::clock::now().time_since_epoch())
                       .count();
  return now >= o->deadline.tv_sec * 1'000'000'000LL + o->deadline.tv_nsec;
}

// Ends the operation: a socket made (`fd`, on success) is handed over, a connect's socket that did
// not connect is closed.
inline void end_setup(engine& e, op* o, transfer_state to, std::error_code ec,
                      int fd = -1) noexcept {
  socket_setup* s = o->setup;
  if (o->kind == op_kind::connect && to != transfer_state::success && o->fd >= 0) ::close(o->fd);
  // Published by the transfer's completion (release), which get() waits for.
  if (fd >= 0) s->made.store(fd, std::memory_order_relaxed);
  e.finish(o, to, ec);
  s->release();
}

// Ends `o` if it was stopped rather than failing on its own: by the ring shutting down, by a
// cancel(), or by its deadline. True if it has ended.
[[nodiscard]] inline bool ended_by_stop(engine& e, op* o, int res) noexcept {
  const bool interrupted = res == -ECANCELED || res == -EINTR;
  if (e.shutting_down_ && (interrupted || o->cancelled_at_shutdown)) {
    end_setup(e, o, transfer_state::failed, make_error_code(ferry::errc::backend_shut_down));
    return true;
  }
  if (!interrupted) return false;
  if (o->cancel_requested) {
    end_setup(e, o, transfer_state::cancelled, {});
    return true;
  }
  if (deadline_passed(o)) {
    end_setup(e, o, transfer_state::failed, make_error_code(errc::deadline_exceeded));
    return true;
  }
  if (res == -EINTR) return false;  // a signal: the caller goes on
  end_setup(e, o, transfer_state::cancelled, {});  // cancelled by someone else (not seen here)
  return true;
}

inline void prepare_connect(io_uring_sqe* sqe, op* o) noexcept {
  const ferry::detail::resolved_address& a = o->setup->addresses[o->setup->at];
  ::io_uring_prep_connect(sqe, o->fd, a.raw(), a.length);
}

// A connect's completion: connected, or on to the next address (a fresh socket: one whose connect
// failed cannot connect again), or failed with the last address's error.
inline void on_connect(engine& e, op* o, int res) noexcept {
  if (res == 0) return end_setup(e, o, transfer_state::success, {}, o->fd);
  if (ended_by_stop(e, o, res)) return;
  ::close(o->fd);
  o->fd = -1;
  if (e.shutting_down_) {
    return end_setup(e, o, transfer_state::failed, make_error_code(ferry::errc::backend_shut_down));
  }
  socket_setup* s = o->setup;
  int err = res == -EINTR ? 0 : -res;  // interrupted: the same address again
  if (err != 0) ++s->at;
  while (s->at < s->addresses.size()) {
    const int fd = open_connect_socket(*s);
    if (fd >= 0) {
      o->fd = fd;
      return e.resume(o);
    }
    err = -fd;
    ++s->at;
  }
  end_setup(e, o, transfer_state::failed, system_error_code(err));
}

inline void prepare_accept(io_uring_sqe* sqe, op* o) noexcept {
  ::io_uring_prep_accept(sqe, o->fd, nullptr, nullptr, SOCK_CLOEXEC);
}

// An accept's completion: a peer connected, or the listener was closed, or it failed. A peer that
// gave up before it was accepted (ECONNABORTED, EPROTO) or a signal: it waits again.
inline void on_accept(engine& e, op* o, int res) noexcept {
  if (res >= 0) return end_setup(e, o, transfer_state::success, {}, res);
  if (o->setup->listener->closed.load(std::memory_order_acquire)) {
    return end_setup(e, o, transfer_state::failed, make_error_code(errc::listener_closed));
  }
  if (ended_by_stop(e, o, res)) return;
  const bool again = res == -EINTR || res == -ECONNABORTED || res == -EPROTO;
  if (again && !e.shutting_down_) return e.resume(o);
  end_setup(e, o, transfer_state::failed, system_error_code(-res));
}

inline void refuse_setup(engine& e, op* o) noexcept {
  end_setup(e, o, transfer_state::failed, make_error_code(ferry::errc::backend_shut_down));
}

inline constexpr op_handlers connect_handlers{op_kind::connect, start_on_arrival, prepare_connect,
                                              on_connect, refuse_setup};
inline constexpr op_handlers accept_handlers{op_kind::accept, start_on_arrival, prepare_accept,
                                             on_accept, refuse_setup};

// Publishes a connect or an accept for `s` (whose first socket, for a connect, is `fd`); the
// transfer ends when the socket is made or cannot be. On failure to allocate, `s` is released for
// the operation and the exception goes on.
template <class Rep, class Period>
[[nodiscard]] transfer start_setup(engine& e, const op_handlers& kind, socket_setup* s, int fd,
                                   std::chrono::duration<Rep, Period> timeout) {
  op* o = nullptr;
  transfer t;
  try {
    o = op::make(kind);
    o->fd = fd;
    o->setup = s;
    set_deadline(o, timeout);
    t = engine::attach(o);  // releases `o` if it throws
  } catch (...) {
    s->release();
    throw;
  }
  e.publish(o, o);
  return t;
}

}  // namespace ferry::uring::detail

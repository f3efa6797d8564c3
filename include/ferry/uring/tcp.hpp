#pragma once
// TCP between two peers through the io_uring ring: framed blocks (block id, length, payload) sent
// and received as transfers. Where no RDMA fabric exists, this is how KV blocks move between a
// prefill and a decode machine.
//
// A frame is a 24-byte header followed by the payload (frame.hpp). Sends on one connection go out
// one at a time in the order they were called, and so do receives; a short send or receive is
// continued. A peer that closes or resets the connection fails the transfer in flight with
// errc::connection_closed or the system's ECONNRESET, and every later one on that side with the same
// error; nothing waits forever on a connection that is gone. A send cut part-way (by a cancel) shuts
// the connection's write side, so the peer's receive of that frame fails too instead of waiting;
// a receive that fails part-way (a frame too large, bytes that are not a frame) fails the
// connection's later receives, and the connection is best closed.
//
// How many receives and sends a ring has in flight at once is bounded (ring_options::entries):
// beyond that, they wait for one in flight to complete.
//
// Setting up: tcp_connection::connect and tcp_listener::accept block the calling thread;
// tcp_connection::connect_async and tcp_listener::accept_async go through the ring (IORING_OP_CONNECT,
// IORING_OP_ACCEPT) with a deadline the kernel keeps, and give a pending_connection to co_await.

#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <system_error>
#include <utility>

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include "ferry/detail/made_awaiter.hpp"
#include "ferry/detail/socket.hpp"
#include "ferry/transfer.hpp"
#include "ferry/uring/detail/connection_state.hpp"
#include "ferry/uring/detail/detach.hpp"
#include "ferry/uring/detail/engine.hpp"
#include "ferry/uring/detail/op.hpp"
#include "ferry/uring/detail/receive.hpp"
#include "ferry/uring/detail/send.hpp"
#include "ferry/uring/detail/socket_setup.hpp"
#include "ferry/uring/errors.hpp"
#include "ferry/uring/frame.hpp"
#include "ferry/uring/ring.hpp"

namespace ferry::uring {

/// Socket settings that must be in place before the handshake, which is why they are options of
/// tcp_connection::connect and tcp_listener rather than something to set on native_handle(). The
/// handshake fixes the window scale and the sender's segment size (at most half the largest window
/// the receiver has offered); a receive buffer shrunk on an established connection then offers
/// windows smaller than one segment, and the sender waits on the kernel's persist and retransmission
/// timers, 0.2 s or more each time (README, io_uring TCP).
struct tcp_options {
  /// SO_SNDBUF and SO_RCVBUF in bytes, as given to setsockopt; 0 leaves the kernel's default (and
  /// its automatic sizing). Linux doubles the value for its bookkeeping (getsockopt reports the
  /// double), clamps it to net.core.wmem_max / rmem_max and raises it to a small minimum; a value
  /// set turns off the automatic sizing of that buffer for the socket.
  int send_buffer = 0;
  int receive_buffer = 0;  ///< SO_RCVBUF in bytes, as send_buffer is SO_SNDBUF (0: the default)
};

namespace detail {

[[noreturn]] inline void throw_errno(int err, const std::string& what) {
  throw std::system_error(err, std::system_category(), what);
}

// A programming error, caught before any socket exists.
inline void check_tcp_options(const tcp_options& o, const char* who) {
  if (o.send_buffer < 0) {
    throw std::invalid_argument(std::string(who) + ": tcp_options::send_buffer is negative (" +
                                std::to_string(o.send_buffer) + ")");
  }
  if (o.receive_buffer < 0) {
    throw std::invalid_argument(std::string(who) + ": tcp_options::receive_buffer is negative (" +
                                std::to_string(o.receive_buffer) + ")");
  }
}

// On a socket not yet connected or listening; `where` (who and the address) heads the error.
inline void apply_tcp_options(int fd, const tcp_options& o, const std::string& where) {
  if (o.send_buffer != 0 &&
      ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &o.send_buffer, sizeof o.send_buffer) != 0) {
    throw_errno(errno, where + ": setsockopt(SO_SNDBUF, " + std::to_string(o.send_buffer) + ")");
  }
  if (o.receive_buffer != 0 &&
      ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &o.receive_buffer, sizeof o.receive_buffer) != 0) {
    throw_errno(errno, where + ": setsockopt(SO_RCVBUF, " + std::to_string(o.receive_buffer) + ")");
  }
}

using ferry::detail::connect_blocking;
using ferry::detail::for_each_address;
using ferry::detail::set_nodelay;

}  // namespace detail

class pending_connection;

/// A TCP connection on a ring: framed blocks (tcp_connection::send, tcp_connection::receive) as
/// transfers completed by the ring's executor.
///
/// Move-only. Closing or destroying it fails the send or receive in flight and cancels the queued
/// ones; every connection must be gone before its ring.
class tcp_connection {
 public:
  /// Adopts a connected stream socket (blocking mode).
  tcp_connection(ring& r, int connected_fd) : engine_(&r.engine()) {
    if (connected_fd < 0) {
      throw std::invalid_argument("ferry::uring::tcp_connection: descriptor " +
                                  std::to_string(connected_fd) + " is not a socket");
    }
    state_ = new detail::connection_state;
    state_->fd = connected_fd;
    if (engine_->metered()) {
      try {
        state_->peer = ferry::detail::peer_address(connected_fd);
      } catch (...) {
        delete state_;
        throw;
      }
    }
    engine_->connection_opened();
  }

  /// Takes over a socket just connected or accepted: TCP_NODELAY, and closed if adopting it fails.
  [[nodiscard]] static tcp_connection adopt_socket(ring& r, int fd) {
    detail::set_nodelay(fd);
    try {
      return tcp_connection(r, fd);
    } catch (...) {
      ::close(fd);
      throw;
    }
  }

  /// Connects to host:port, blocking until the connection is up or refused; `options` are set on
  /// the socket before it connects.
  [[nodiscard]] static tcp_connection connect(ring& r, const std::string& host, std::uint16_t port,
                                              const tcp_options& options = {}) {
    detail::check_tcp_options(options, "ferry::uring::tcp_connection::connect");
    const std::string where =
        "ferry::uring::tcp_connection::connect to " + host + ":" + std::to_string(port);
    const int fd =
        detail::for_each_address(host, port, 0, std::make_error_code(std::errc::invalid_argument),
                                 "ferry::uring", [&](int s, const ferry::detail::resolved_address& a) {
                                   detail::apply_tcp_options(s, options, where);
                                   return detail::connect_blocking(s, a.raw(), a.length);
                                 });
    if (fd < 0) detail::throw_errno(errno, where);
    return adopt_socket(r, fd);
  }

  /// Connects to host:port through the ring, to co_await: the calling thread does not wait for the
  /// connection (resolving a host name, not a numeric address, may block it while it is looked up).
  /// Each address the host resolves to is tried in turn, `options` set on each socket before it
  /// connects. The pending_connection fails with errc::deadline_exceeded if no connection is made
  /// within `timeout` (negative: no deadline), with the system's error (ECONNREFUSED, ...) of the
  /// last address tried, or cancelled by ring::cancel(pending.made()).
  template <class Rep = std::int64_t, class Period = std::nano>
  [[nodiscard]] static pending_connection connect_async(
      ring& r, const std::string& host, std::uint16_t port,
      std::chrono::duration<Rep, Period> timeout = std::chrono::seconds(10),
      const tcp_options& options = {});

  /// Takes over `other`'s connection, leaving it closed (is_open() false).
  tcp_connection(tcp_connection&& other) noexcept
      : engine_(other.engine_), state_(std::exchange(other.state_, nullptr)) {}
  /// Closes its own connection and takes over `other`'s.
  tcp_connection& operator=(tcp_connection&& other) noexcept {
    tcp_connection(std::move(other)).swap(*this);
    return *this;
  }
  tcp_connection(const tcp_connection&) = delete;
  tcp_connection& operator=(const tcp_connection&) = delete;

  /// Shuts the socket down: a send or receive in flight fails, queued ones (and one waiting for room
  /// in the ring) end cancelled, and the descriptor closes once the last of them has completed.
  ~tcp_connection() { close(); }

  /// Closes the connection now, as the destructor does; later sends and receives fail with
  /// errc::connection_closed.
  void close() noexcept {
    if (state_ == nullptr) return;
    // Release pairs with the acquire in detail::next_send/next_receive: once the shutdown fails the
    // operation in flight, nothing queued behind it starts.
    state_->closing.store(true, std::memory_order_release);
    ::shutdown(state_->fd, SHUT_RDWR);
    detail::op* d = nullptr;
    try {
      d = detail::op::make(detail::detach_handlers);
    } catch (...) {
      // Out of memory: the ring unlists the connection when it is destroyed instead.
    }
    if (d != nullptr) {
      d->connection = state_;  // takes over the handle's reference
      engine_->post(d);
    } else {
      state_->release();
    }
    state_ = nullptr;
    engine_->connection_closed();
  }

  /// Ends the connection at once for a reason the caller knows (a directory showed its peer restart
  /// or go; named_peer calls this, through a std::shared_ptr<tcp_connection>): the socket is shut
  /// down, and every send and receive on it, in flight, queued or made later, fails with `why`
  /// (errc::connection_closed when empty). The first reason stays. Does not wait; any thread. The
  /// handle stays open until closed or destroyed.
  void sever(std::error_code why) {
    if (state_ == nullptr) return;
    int none = 0;
    if (state_->sever_state.compare_exchange_strong(none, 1, std::memory_order_acq_rel)) {
      state_->sever_reason = why ? why : make_error_code(errc::connection_closed);
      state_->sever_state.store(2, std::memory_order_release);
    }
    ::shutdown(state_->fd, SHUT_RDWR);
    detail::op* s = detail::op::make(detail::sever_handlers);
    state_->refs.fetch_add(1, std::memory_order_relaxed);
    s->connection = state_;
    engine_->post(s);
  }

  /// Exchanges the two handles' connections.
  void swap(tcp_connection& other) noexcept {
    std::swap(engine_, other.engine_);
    std::swap(state_, other.state_);
  }

  /// Sends one framed block. `payload` must stay valid until the transfer is terminal.
  [[nodiscard]] transfer send(std::uint64_t block_id, std::span<const std::byte> payload) {
    if (state_ == nullptr) {
      return make_completed_transfer(transfer_state::failed, errc::connection_closed);
    }
    if (const std::error_code why = state_->severed()) {
      return make_completed_transfer(transfer_state::failed, why);
    }
    detail::op* o = detail::op::make(detail::send_handlers);
    o->fd = state_->fd;
    o->header = detail::encode_frame(block_id, payload.size());
    o->parts[0] = iovec{&o->header, sizeof o->header};
    o->parts[1] = iovec{const_cast<std::byte*>(payload.data()), payload.size()};
    o->length = sizeof o->header + payload.size();
    return post(o);
  }

  /// Receives the next framed block into the front of `dst` and writes its id and length to `out`.
  /// Both must stay valid until the transfer is terminal. A block larger than `dst` fails with
  /// errc::block_too_large (and the connection's receive side with it: the stream is out of step).
  [[nodiscard]] transfer receive(std::span<std::byte> dst, received_block& out) {
    if (state_ == nullptr) {
      return make_completed_transfer(transfer_state::failed, errc::connection_closed);
    }
    if (const std::error_code why = state_->severed()) {
      return make_completed_transfer(transfer_state::failed, why);
    }
    detail::op* o = detail::op::make(detail::receive_handlers);
    o->fd = state_->fd;
    o->parts[1] = iovec{dst.data(), dst.size()};
    o->received = &out;
    o->length = sizeof o->header;
    return post(o);
  }

  /// The socket's descriptor (-1 when closed); the connection still owns it.
  [[nodiscard]] int native_handle() const noexcept { return state_ == nullptr ? -1 : state_->fd; }
  /// False once closed or moved from.
  [[nodiscard]] bool is_open() const noexcept { return state_ != nullptr; }

 private:
  transfer post(detail::op* o) {
    transfer t = detail::engine::attach(o);
    state_->refs.fetch_add(1, std::memory_order_relaxed);
    o->connection = state_;
    engine_->post(o);
    return t;
  }

  detail::engine* engine_;
  detail::connection_state* state_ = nullptr;
};

/// A listening TCP socket: accept() and accept_async() give tcp_connection objects on a ring.
class tcp_listener {
 public:
  /// Listens on address:port; port 0 picks a free one (see port()). `options` are set on the
  /// listening socket before it listens, and the connections it accepts inherit them.
  explicit tcp_listener(const std::string& address = "127.0.0.1", std::uint16_t port = 0,
                        int backlog = 64, const tcp_options& options = {})
      : state_(std::make_shared<detail::listener_state>()) {
    detail::check_tcp_options(options, "ferry::uring::tcp_listener");
    const std::string where =
        "ferry::uring::tcp_listener on " + address + ":" + std::to_string(port);
    state_->fd = detail::for_each_address(
        address, port, AI_PASSIVE, std::make_error_code(std::errc::invalid_argument),
        "ferry::uring", [&](int s, const ferry::detail::resolved_address& a) {
          const int one = 1;
          ::setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
          detail::apply_tcp_options(s, options, where);
          return ::bind(s, a.raw(), a.length) == 0 && ::listen(s, backlog) == 0;
        });
    if (state_->fd < 0) detail::throw_errno(errno, where);
  }

  /// Takes over `other`'s socket.
  tcp_listener(tcp_listener&& other) noexcept = default;
  /// Stops listening on its own socket (as the destructor does) and takes over `other`'s.
  tcp_listener& operator=(tcp_listener&& other) noexcept {
    tcp_listener(std::move(other)).swap(*this);
    return *this;
  }
  tcp_listener(const tcp_listener&) = delete;
  tcp_listener& operator=(const tcp_listener&) = delete;

  /// Stops listening. An accept_async still waiting fails with errc::listener_closed.
  ~tcp_listener() {
    if (!state_) return;
    state_->closed.store(true, std::memory_order_release);
    // Ends the accepts the kernel holds (-EINVAL); the socket closes with the last of them.
    ::shutdown(state_->fd, SHUT_RDWR);
  }

  /// Exchanges the two listeners' sockets.
  void swap(tcp_listener& other) noexcept { state_.swap(other.state_); }

  /// The port it listens on (the one chosen, when given 0). Throws std::system_error if
  /// getsockname fails.
  [[nodiscard]] std::uint16_t port() const {
    sockaddr_storage addr{};
    socklen_t len = sizeof addr;
    if (::getsockname(native_handle(), reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
      detail::throw_errno(errno, "ferry::uring::tcp_listener::port: getsockname");
    }
    if (addr.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port);
    return ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  }

  /// Blocks until a peer connects. A peer that gave up before it was accepted is skipped.
  [[nodiscard]] tcp_connection accept(ring& r) {
    int fd = -1;
    do {
      fd = ::accept4(native_handle(), nullptr, nullptr, SOCK_CLOEXEC);
    } while (fd < 0 && (errno == EINTR || errno == ECONNABORTED || errno == EPROTO));
    if (fd < 0) detail::throw_errno(errno, "ferry::uring::tcp_listener::accept");
    return tcp_connection::adopt_socket(r, fd);
  }

  /// Accepts the next peer through the ring, to co_await: the calling thread does not wait. Fails
  /// with errc::deadline_exceeded if no peer connects within `timeout` (negative: no deadline), with
  /// errc::listener_closed if this listener is destroyed meanwhile, or cancelled by
  /// ring::cancel(pending.made()). Several may wait at once; each peer goes to one of them.
  template <class Rep = std::int64_t, class Period = std::nano>
  [[nodiscard]] pending_connection accept_async(
      ring& r, std::chrono::duration<Rep, Period> timeout = std::chrono::seconds(10));

  /// The listening socket's descriptor (-1 after a move); the listener owns it.
  [[nodiscard]] int native_handle() const noexcept { return state_ ? state_->fd : -1; }

 private:
  std::shared_ptr<detail::listener_state> state_;
};

/// A TCP connection being made through the ring (tcp_connection::connect_async,
/// tcp_listener::accept_async). co_await it in a coroutine (it resumes on the coroutine's scheduler
/// with the tcp_connection, or throws std::system_error naming what failed), use made() in a batch
/// wait beside other transfers, or get() it, which blocks. Dropped without being taken, it closes
/// the socket it made (or will make).
class pending_connection {
 public:
  /// Takes over `other`'s connection under way.
  pending_connection(pending_connection&& other) noexcept
      : ring_(other.ring_),
        setup_(std::exchange(other.setup_, nullptr)),
        made_(std::move(other.made_)),
        what_(std::move(other.what_)) {}
  /// Lets go of its own connection under way (a socket it made is closed) and takes `other`'s.
  pending_connection& operator=(pending_connection&& other) noexcept {
    if (this != &other) {
      let_go();
      ring_ = other.ring_;
      setup_ = std::exchange(other.setup_, nullptr);
      made_ = std::move(other.made_);
      what_ = std::move(other.what_);
    }
    return *this;
  }
  pending_connection(const pending_connection&) = delete;
  pending_connection& operator=(const pending_connection&) = delete;
  /// Drops the result: a socket made for it, now or later, is closed.
  ~pending_connection() { let_go(); }

  /// Ends when the connection is made or cannot be: for a batch wait beside other transfers.
  [[nodiscard]] const transfer& made() const noexcept { return made_; }

  /// Waits for the connection and takes it. Throws std::system_error naming what failed (its code:
  /// errc::deadline_exceeded, errc::listener_closed, ferry::errc::cancelled, the system's), or
  /// std::logic_error if it was taken already, and refuses to wait (std::errc::
  /// resource_deadlock_would_occur) on the ring's executor thread, which must make the connection.
  [[nodiscard]] tcp_connection get() {
    if (!made_.done()) {
      if (ring_->executor().on_executor_thread()) {
        throw std::system_error(std::make_error_code(std::errc::resource_deadlock_would_occur),
                                what_ + ": get() on the ring's executor thread would wait for ever; "
                                "co_await it instead");
      }
      (void)made_.wait();
    }
    if (made_.state() != transfer_state::success) throw std::system_error(made_.error(), what_);
    const int fd = setup_ == nullptr ? -1 : setup_->made.exchange(-1);
    if (fd < 0) throw std::logic_error(what_ + ": the connection was taken already");
    std::exchange(setup_, nullptr)->release();
    return tcp_connection::adopt_socket(*ring_, fd);
  }

  /// Resumes on the awaiting coroutine's scheduler with the connection, or throws as get() does.
  using awaiter = ferry::detail::made_awaiter<pending_connection>;
  ///@{
  /// `co_await` yields the tcp_connection, or throws std::system_error as get() does.
  [[nodiscard]] awaiter operator co_await() & { return awaiter(*this); }
  [[nodiscard]] awaiter operator co_await() && { return awaiter(*this); }
  ///@}

 private:
  friend class tcp_connection;
  friend class tcp_listener;

  // Publishes the connect or accept for `s` on `fd` (a connect's first socket, or the listener's).
  template <class Rep, class Period>
  pending_connection(ring& r, const detail::op_handlers& kind, detail::socket_setup* s, int fd,
                     std::chrono::duration<Rep, Period> timeout, std::string what)
      : ring_(&r), what_(std::move(what)) {
    try {
      made_ = detail::start_setup(r.engine(), kind, s, fd, timeout);  // owns the op's reference
    } catch (...) {
      if (kind.kind == detail::op_kind::connect) ::close(fd);  // an accept's is the listener's
      s->release();
      throw;
    }
    setup_ = s;
  }

  // Failed before anything was published.
  pending_connection(ring& r, std::error_code failed, std::string what)
      : ring_(&r), made_(make_completed_transfer(transfer_state::failed, failed)),
        what_(std::move(what)) {}

  // Dropped untaken: a socket made is closed by the last of this and the operation to let go
  // (detail::socket_setup::release).
  void let_go() noexcept {
    if (setup_ != nullptr) std::exchange(setup_, nullptr)->release();
  }

  ring* ring_;
  detail::socket_setup* setup_ = nullptr;
  transfer made_;
  std::string what_;
};

template <class Rep, class Period>
pending_connection tcp_connection::connect_async(ring& r, const std::string& host,
                                                 std::uint16_t port,
                                                 std::chrono::duration<Rep, Period> timeout,
                                                 const tcp_options& options) {
  detail::check_tcp_options(options, "ferry::uring::tcp_connection::connect_async");
  std::string what =
      "ferry::uring::tcp_connection::connect_async to " + host + ":" + std::to_string(port);
  auto addresses = ferry::detail::resolve(
      host, port, 0, std::make_error_code(std::errc::invalid_argument), "ferry::uring");
  auto* s = new detail::socket_setup;
  s->addresses = std::move(addresses);
  s->send_buffer = options.send_buffer;
  s->receive_buffer = options.receive_buffer;
  int err = EADDRNOTAVAIL;
  for (; s->at < s->addresses.size(); ++s->at) {
    const int fd = detail::open_connect_socket(*s);
    if (fd >= 0) {
      return pending_connection(r, detail::connect_handlers, s, fd, timeout, std::move(what));
    }
    err = -fd;
  }
  delete s;
  return pending_connection(r, detail::system_error_code(err), std::move(what));
}

template <class Rep, class Period>
pending_connection tcp_listener::accept_async(ring& r, std::chrono::duration<Rep, Period> timeout) {
  std::string what = "ferry::uring::tcp_listener::accept_async";
  if (!state_) {
    return pending_connection(r, make_error_code(errc::listener_closed), std::move(what));
  }
  auto* s = new detail::socket_setup;
  s->listener = state_;
  return pending_connection(r, detail::accept_handlers, s, state_->fd, timeout, std::move(what));
}

}  // namespace ferry::uring

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
// Setting up (listen, accept, connect) is blocking and happens once per peer; only the block
// traffic goes through the ring.

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
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

#include "ferry/detail/socket.hpp"
#include "ferry/transfer.hpp"
#include "ferry/uring/detail/connection_state.hpp"
#include "ferry/uring/detail/detach.hpp"
#include "ferry/uring/detail/engine.hpp"
#include "ferry/uring/detail/op.hpp"
#include "ferry/uring/detail/receive.hpp"
#include "ferry/uring/detail/send.hpp"
#include "ferry/uring/errors.hpp"
#include "ferry/uring/frame.hpp"
#include "ferry/uring/ring.hpp"

namespace ferry::uring {

// Socket settings that must be in place before the handshake, which is why they are options of
// tcp_connection::connect and tcp_listener rather than something to set on native_handle(). The
// handshake fixes the window scale and the sender's segment size (at most half the largest window
// the receiver has offered); a receive buffer shrunk on an established connection then offers
// windows smaller than one segment, and the sender waits on the kernel's persist and retransmission
// timers, 0.2 s or more each time (README, io_uring TCP).
struct tcp_options {
  // SO_SNDBUF and SO_RCVBUF in bytes, as given to setsockopt; 0 leaves the kernel's default (and
  // its automatic sizing). Linux doubles the value for its bookkeeping (getsockopt reports the
  // double), clamps it to net.core.wmem_max / rmem_max and raises it to a small minimum; a value
  // set turns off the automatic sizing of that buffer for the socket.
  int send_buffer = 0;
  int receive_buffer = 0;
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

class tcp_connection {
 public:
  // Adopts a connected stream socket (blocking mode).
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

  // Takes over a socket just connected or accepted: TCP_NODELAY, and closed if adopting it fails.
  [[nodiscard]] static tcp_connection adopt_socket(ring& r, int fd) {
    detail::set_nodelay(fd);
    try {
      return tcp_connection(r, fd);
    } catch (...) {
      ::close(fd);
      throw;
    }
  }

  // Connects to host:port, blocking until the connection is up or refused; `options` are set on
  // the socket before it connects.
  [[nodiscard]] static tcp_connection connect(ring& r, const std::string& host, std::uint16_t port,
                                              const tcp_options& options = {}) {
    detail::check_tcp_options(options, "ferry::uring::tcp_connection::connect");
    const std::string where =
        "ferry::uring::tcp_connection::connect to " + host + ":" + std::to_string(port);
    const int fd =
        detail::for_each_address(host, port, 0, std::make_error_code(std::errc::invalid_argument),
                                 "ferry::uring", [&](int s, const addrinfo& a) {
                                   detail::apply_tcp_options(s, options, where);
                                   return detail::connect_blocking(s, a.ai_addr, a.ai_addrlen);
                                 });
    if (fd < 0) detail::throw_errno(errno, where);
    return adopt_socket(r, fd);
  }

  tcp_connection(tcp_connection&& other) noexcept
      : engine_(other.engine_), state_(std::exchange(other.state_, nullptr)) {}
  tcp_connection& operator=(tcp_connection&& other) noexcept {
    tcp_connection(std::move(other)).swap(*this);
    return *this;
  }
  tcp_connection(const tcp_connection&) = delete;
  tcp_connection& operator=(const tcp_connection&) = delete;

  // Shuts the socket down: a send or receive in flight fails, queued ones (and one waiting for room
  // in the ring) end cancelled, and the descriptor closes once the last of them has completed.
  ~tcp_connection() { close(); }

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

  void swap(tcp_connection& other) noexcept {
    std::swap(engine_, other.engine_);
    std::swap(state_, other.state_);
  }

  // Sends one framed block. `payload` must stay valid until the transfer is terminal.
  [[nodiscard]] transfer send(std::uint64_t block_id, std::span<const std::byte> payload) {
    if (state_ == nullptr) {
      return make_completed_transfer(transfer_state::failed, errc::connection_closed);
    }
    detail::op* o = detail::op::make(detail::send_handlers);
    o->fd = state_->fd;
    o->header = detail::encode_frame(block_id, payload.size());
    o->parts[0] = iovec{&o->header, sizeof o->header};
    o->parts[1] = iovec{const_cast<std::byte*>(payload.data()), payload.size()};
    o->length = sizeof o->header + payload.size();
    return post(o);
  }

  // Receives the next framed block into the front of `dst` and writes its id and length to `out`.
  // Both must stay valid until the transfer is terminal. A block larger than `dst` fails with
  // errc::block_too_large (and the connection's receive side with it: the stream is out of step).
  [[nodiscard]] transfer receive(std::span<std::byte> dst, received_block& out) {
    if (state_ == nullptr) {
      return make_completed_transfer(transfer_state::failed, errc::connection_closed);
    }
    detail::op* o = detail::op::make(detail::receive_handlers);
    o->fd = state_->fd;
    o->parts[1] = iovec{dst.data(), dst.size()};
    o->received = &out;
    o->length = sizeof o->header;
    return post(o);
  }

  [[nodiscard]] int native_handle() const noexcept { return state_ == nullptr ? -1 : state_->fd; }
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

class tcp_listener {
 public:
  // Listens on address:port; port 0 picks a free one (see port()). `options` are set on the
  // listening socket before it listens, and the connections it accepts inherit them.
  explicit tcp_listener(const std::string& address = "127.0.0.1", std::uint16_t port = 0,
                        int backlog = 64, const tcp_options& options = {}) {
    detail::check_tcp_options(options, "ferry::uring::tcp_listener");
    const std::string where =
        "ferry::uring::tcp_listener on " + address + ":" + std::to_string(port);
    fd_ = detail::for_each_address(
        address, port, AI_PASSIVE, std::make_error_code(std::errc::invalid_argument),
        "ferry::uring", [&](int s, const addrinfo& a) {
          const int one = 1;
          ::setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
          detail::apply_tcp_options(s, options, where);
          return ::bind(s, a.ai_addr, a.ai_addrlen) == 0 && ::listen(s, backlog) == 0;
        });
    if (fd_ < 0) detail::throw_errno(errno, where);
  }

  tcp_listener(tcp_listener&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  tcp_listener& operator=(tcp_listener&& other) noexcept {
    std::swap(fd_, other.fd_);
    return *this;
  }
  tcp_listener(const tcp_listener&) = delete;
  tcp_listener& operator=(const tcp_listener&) = delete;
  ~tcp_listener() {
    if (fd_ >= 0) ::close(fd_);
  }

  [[nodiscard]] std::uint16_t port() const {
    sockaddr_storage addr{};
    socklen_t len = sizeof addr;
    if (::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
      detail::throw_errno(errno, "ferry::uring::tcp_listener::port: getsockname");
    }
    if (addr.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port);
    return ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  }

  // Blocks until a peer connects. A peer that gave up before it was accepted is skipped.
  [[nodiscard]] tcp_connection accept(ring& r) {
    int fd = -1;
    do {
      fd = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
    } while (fd < 0 && (errno == EINTR || errno == ECONNABORTED || errno == EPROTO));
    if (fd < 0) detail::throw_errno(errno, "ferry::uring::tcp_listener::accept");
    return tcp_connection::adopt_socket(r, fd);
  }

  [[nodiscard]] int native_handle() const noexcept { return fd_; }

 private:
  int fd_ = -1;
};

}  // namespace ferry::uring

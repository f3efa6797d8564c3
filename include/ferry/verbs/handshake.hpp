#pragma once
// Connecting two RC queue pairs over a TCP side channel. Each side creates its queue pair, sends what
// the other needs (queue pair number, PSN, LID, GID, path MTU, and the regions it lets the peer read
// and write, with their rkeys), brings its queue pair to RTS towards what it received, and then
// exchanges one "ready" byte, so that neither side posts before the other can receive. Blocking, with
// one deadline for the whole exchange; failures throw std::system_error saying which step failed.
//
// The wire format is fixed-size little-endian fields after a magic number and a version, so a peer
// that is not speaking it is told so instead of being misread.

#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "ferry/detail/socket.hpp"
#include "ferry/detail/timeout.hpp"
#include "ferry/verbs/device.hpp"
#include "ferry/verbs/errors.hpp"

namespace ferry::verbs {

/// A queue pair in RTS and the regions its peer exposed.
template <class P>
struct basic_connection {
  basic_queue_pair<P> qp;  ///< connected and in RTS; its peer has confirmed it is ready
  std::vector<remote_region> peer_regions;  ///< what the peer exposed, in its order
};

namespace detail {

inline constexpr std::uint32_t handshake_magic = 0x56595246;  // "FRYV" read as little-endian
inline constexpr std::uint32_t handshake_version = 2;
inline constexpr std::uint32_t max_exposed_regions = 4096;
inline constexpr std::size_t handshake_fixed_bytes = 4 + 4 + 4 + 4 + 2 + 1 + 1 + 1 + 16 + 4;
inline constexpr std::size_t handshake_region_bytes = 8 + 8 + 4 + 4;

using handshake_clock = std::chrono::steady_clock;

[[noreturn]] inline void handshake_error(const std::string& what) {
  throw std::system_error(make_error_code(errc::handshake_failed), "ferry::verbs handshake: " + what);
}

[[noreturn]] inline void handshake_system_error(int err, const std::string& what) {
  throw std::system_error(err, std::system_category(), "ferry::verbs handshake: " + what);
}

class socket_guard {
 public:
  explicit socket_guard(int fd = -1) noexcept : fd_(fd) {}
  socket_guard(socket_guard&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  socket_guard& operator=(socket_guard&& o) noexcept {
    std::swap(fd_, o.fd_);
    return *this;
  }
  ~socket_guard() {
    if (fd_ >= 0) ::close(fd_);
  }
  [[nodiscard]] int get() const noexcept { return fd_; }

 private:
  int fd_;
};

// Waits until `fd` is ready for `events` or the deadline passes (then throws ETIMEDOUT).
inline void wait_ready(int fd, short events, handshake_clock::time_point deadline, const char* what) {
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - handshake_clock::now());
    if (left.count() <= 0) handshake_system_error(ETIMEDOUT, std::string("timed out ") + what);
    pollfd p{fd, events, 0};
    const int n = ::poll(&p, 1, static_cast<int>(std::min<std::int64_t>(left.count() + 1, 1 << 30)));
    if (n > 0) return;
    if (n < 0 && errno != EINTR) handshake_system_error(errno, std::string("poll while ") + what);
  }
}

inline void send_all(int fd, std::span<const std::byte> bytes, handshake_clock::time_point deadline) {
  while (!bytes.empty()) {
    wait_ready(fd, POLLOUT, deadline, "sending to the peer");
    const ssize_t n = ::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) continue;
      handshake_system_error(errno, "send");
    }
    bytes = bytes.subspan(static_cast<std::size_t>(n));
  }
}

inline void receive_all(int fd, std::span<std::byte> bytes, handshake_clock::time_point deadline) {
  while (!bytes.empty()) {
    wait_ready(fd, POLLIN, deadline, "waiting for the peer");
    const ssize_t n = ::recv(fd, bytes.data(), bytes.size(), MSG_DONTWAIT);
    if (n == 0) handshake_error("the peer closed the side channel part-way through the handshake");
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) continue;
      handshake_system_error(errno, "recv");
    }
    bytes = bytes.subspan(static_cast<std::size_t>(n));
  }
}

class wire_writer {
 public:
  void u8(std::uint8_t v) { bytes_.push_back(static_cast<std::byte>(v)); }
  void u16(std::uint16_t v) { put(v, 2); }
  void u32(std::uint32_t v) { put(v, 4); }
  void u64(std::uint64_t v) { put(v, 8); }
  void raw(const void* p, std::size_t n) {
    const auto* b = static_cast<const std::byte*>(p);
    bytes_.insert(bytes_.end(), b, b + n);
  }
  [[nodiscard]] std::span<const std::byte> bytes() const noexcept { return bytes_; }

 private:
  void put(std::uint64_t v, int n) {
    for (int i = 0; i < n; ++i) bytes_.push_back(static_cast<std::byte>(v >> (8 * i)));
  }
  std::vector<std::byte> bytes_;
};

class wire_reader {
 public:
  explicit wire_reader(std::span<const std::byte> b) noexcept : bytes_(b) {}
  std::uint8_t u8() { return static_cast<std::uint8_t>(get(1)); }
  std::uint16_t u16() { return static_cast<std::uint16_t>(get(2)); }
  std::uint32_t u32() { return static_cast<std::uint32_t>(get(4)); }
  std::uint64_t u64() { return get(8); }
  void raw(void* p, std::size_t n) {
    std::memcpy(p, bytes_.data() + at_, n);
    at_ += n;
  }

 private:
  std::uint64_t get(int n) {
    std::uint64_t v = 0;
    for (int i = 0; i < n; ++i) v |= std::uint64_t(std::to_integer<std::uint8_t>(bytes_[at_++])) << (8 * i);
    return v;
  }
  std::span<const std::byte> bytes_;
  std::size_t at_ = 0;
};

// The whole exchange on a connected socket.
template <class P>
basic_connection<P> handshake(int fd, basic_device<P>& device, std::span<const remote_region> exposed,
                              const queue_pair_options& options,
                              handshake_clock::time_point deadline) {
  if (exposed.size() > max_exposed_regions) {
    handshake_error("cannot expose " + std::to_string(exposed.size()) + " regions (at most " +
                    std::to_string(max_exposed_regions) + ")");
  }
  queue_pair_options labelled = options;
  if (labelled.peer_name.empty()) labelled.peer_name = ferry::detail::peer_address(fd);
  basic_connection<P> c{basic_queue_pair<P>(device, labelled), {}};
  const endpoint_info mine = c.qp.local_info();
  wire_writer w;
  w.u32(handshake_magic);
  w.u32(handshake_version);
  w.u32(mine.qp_num);
  w.u32(mine.psn);
  w.u16(mine.lid);
  w.u8(mine.mtu);
  w.u8(mine.has_gid ? 1 : 0);
  w.u8(mine.max_rd_atomic);
  w.raw(mine.gid.raw, sizeof mine.gid.raw);
  w.u32(static_cast<std::uint32_t>(exposed.size()));
  for (const remote_region& r : exposed) {
    w.u64(r.address);
    w.u64(r.length);
    w.u32(r.rkey);
    w.u32(0);
  }
  send_all(fd, w.bytes(), deadline);

  std::array<std::byte, handshake_fixed_bytes> fixed{};
  receive_all(fd, fixed, deadline);
  wire_reader head(fixed);
  if (head.u32() != handshake_magic) {
    handshake_error("the peer is not speaking ferry's verbs handshake (bad magic number)");
  }
  if (const std::uint32_t v = head.u32(); v != handshake_version) {
    handshake_error("the peer speaks handshake version " + std::to_string(v) + ", this side " +
                    std::to_string(handshake_version));
  }
  endpoint_info theirs;
  theirs.qp_num = head.u32();
  theirs.psn = head.u32();
  theirs.lid = head.u16();
  theirs.mtu = head.u8();
  theirs.has_gid = head.u8() != 0;
  theirs.max_rd_atomic = head.u8();
  head.raw(theirs.gid.raw, sizeof theirs.gid.raw);
  const std::uint32_t count = head.u32();
  if (count > max_exposed_regions) {
    handshake_error("the peer announced " + std::to_string(count) + " regions (at most " +
                    std::to_string(max_exposed_regions) + ")");
  }
  std::vector<std::byte> rest(count * handshake_region_bytes);
  receive_all(fd, rest, deadline);
  wire_reader body(rest);
  c.peer_regions.resize(count);
  for (remote_region& r : c.peer_regions) {
    r.address = body.u64();
    r.length = body.u64();
    r.rkey = body.u32();
    (void)body.u32();
  }

  c.qp.connect(theirs);
  const std::byte ready{0x52};
  send_all(fd, std::span(&ready, 1), deadline);
  std::byte got{};
  receive_all(fd, std::span(&got, 1), deadline);
  if (got != ready) handshake_error("the peer did not confirm that its queue pair is ready");
  c.qp.mark_peer_connected();
  return c;
}

}  // namespace detail

/// Connects to a side_channel_listener at host:port and performs the handshake.
/// `exposed` are the regions the peer may read and write; one deadline, `timeout`, bounds it all.
/// Throws std::system_error naming the step that failed (errc::handshake_failed, or the errno of
/// a socket call: ETIMEDOUT at the deadline).
template <class P, class Rep = std::int64_t, class Period = std::milli>
[[nodiscard]] basic_connection<P> connect(basic_device<P>& device, const std::string& host,
                                          std::uint16_t port, std::span<const remote_region> exposed,
                                          queue_pair_options options = {},
                                          std::chrono::duration<Rep, Period> timeout =
                                              std::chrono::milliseconds(10000)) {
  const auto deadline = ferry::detail::deadline_after(timeout);
  const int fd = ferry::detail::for_each_address(
      host, port, 0, make_error_code(errc::handshake_failed), "ferry::verbs handshake",
      [&](int s, const ferry::detail::resolved_address& a) {
        if (!ferry::detail::set_nonblocking(s)) return false;
        if (::connect(s, a.raw(), a.length) == 0) return true;
        if (errno != EINPROGRESS) return false;
        detail::wait_ready(s, POLLOUT, deadline, "connecting the side channel");
        int err = 0;
        socklen_t len = sizeof err;
        ::getsockopt(s, SOL_SOCKET, SO_ERROR, &err, &len);
        errno = err;
        return err == 0;
      });
  if (fd < 0) {
    detail::handshake_system_error(
        errno, "connecting the side channel to " + host + ":" + std::to_string(port));
  }
  const detail::socket_guard s(fd);
  ferry::detail::set_nodelay(fd);
  return detail::handshake(fd, device, exposed, options, deadline);
}

/// The accepting side of the handshake's TCP side channel: accept() connects one peer at a time.
class side_channel_listener {
 public:
  /// Listens on `address`:`port` (port 0: any free port; see port()).
  explicit side_channel_listener(std::uint16_t port = 0, const std::string& address = "127.0.0.1") {
    detail::socket_guard s(ferry::detail::for_each_address(
        address, port, AI_PASSIVE | AI_NUMERICHOST, make_error_code(errc::handshake_failed),
        "ferry::verbs handshake", [](int fd, const ferry::detail::resolved_address& a) {
          const int one = 1;
          ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
          return ferry::detail::set_nonblocking(fd) && ::bind(fd, a.raw(), a.length) == 0 &&
                 ::listen(fd, 16) == 0;
        }));
    if (s.get() < 0) {
      detail::handshake_system_error(errno, "listening on " + address + ":" + std::to_string(port));
    }
    sockaddr_storage bound{};
    socklen_t len = sizeof bound;
    ::getsockname(s.get(), reinterpret_cast<sockaddr*>(&bound), &len);
    port_ = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6&>(bound).sin6_port
                                              : reinterpret_cast<sockaddr_in&>(bound).sin_port);
    socket_ = std::move(s);
  }

  /// The port it listens on (the one chosen, when given 0).
  [[nodiscard]] std::uint16_t port() const noexcept { return port_; }

  /// Accepts one peer and performs the handshake.
  /// Waits up to `timeout` for the peer and the whole exchange; throws as connect() does.
  template <class P, class Rep = std::int64_t, class Period = std::milli>
  [[nodiscard]] basic_connection<P> accept(basic_device<P>& device,
                                           std::span<const remote_region> exposed,
                                           queue_pair_options options = {},
                                           std::chrono::duration<Rep, Period> timeout =
                                               std::chrono::milliseconds(10000)) {
    const auto deadline = ferry::detail::deadline_after(timeout);
    for (;;) {
      detail::wait_ready(socket_.get(), POLLIN, deadline, "waiting for a peer to connect");
      detail::socket_guard s(::accept4(socket_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
      if (s.get() < 0) {
        if (errno == EAGAIN || errno == EINTR || errno == ECONNABORTED) continue;
        detail::handshake_system_error(errno, "accept");
      }
      ferry::detail::set_nodelay(s.get());
      return detail::handshake(s.get(), device, exposed, options, deadline);
    }
  }

 private:
  detail::socket_guard socket_;
  std::uint16_t port_ = 0;
};

}  // namespace ferry::verbs

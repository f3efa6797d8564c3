#pragma once
// Descriptor and TCP socket set-up, shared by the io_uring TCP connections, the verbs handshake's
// side channel and the verbs provider: resolving an address and trying each result, a blocking
// connect that survives signals, TCP_NODELAY, non-blocking mode, the peer's address as text.

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <system_error>
#include <vector>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

namespace ferry::detail {

[[nodiscard]] inline bool set_nonblocking(int fd) noexcept {
  const int flags = ::fcntl(fd, F_GETFL);
  return flags >= 0 && ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) == 0;
}

inline void set_nodelay(int fd) noexcept {
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

// The connected peer's IP address as text ("10.0.0.2", "::1"; an IPv4 peer of an IPv6 socket
// without its "::ffff:" prefix), or empty where there is none (not a connected IP socket).
[[nodiscard]] inline std::string peer_address(int fd) {
  sockaddr_storage a{};
  socklen_t len = sizeof a;
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) return {};
  char text[INET6_ADDRSTRLEN] = {};
  if (a.ss_family == AF_INET) {
    const auto* v4 = reinterpret_cast<const sockaddr_in*>(&a);
    if (::inet_ntop(AF_INET, &v4->sin_addr, text, sizeof text) == nullptr) return {};
  } else if (a.ss_family == AF_INET6) {
    const auto* v6 = reinterpret_cast<const sockaddr_in6*>(&a);
    if (IN6_IS_ADDR_V4MAPPED(&v6->sin6_addr)) {
      if (::inet_ntop(AF_INET, &v6->sin6_addr.s6_addr[12], text, sizeof text) == nullptr) return {};
    } else if (::inet_ntop(AF_INET6, &v6->sin6_addr, text, sizeof text) == nullptr) {
      return {};
    }
  } else {
    return {};
  }
  return text;
}

// A blocking connect(). One that a signal interrupts goes on in the background (POSIX), so it is
// waited for rather than reported as a failure; true once connected, else false with errno set.
[[nodiscard]] inline bool connect_blocking(int fd, const sockaddr* addr, socklen_t len) noexcept {
  if (::connect(fd, addr, len) == 0) return true;
  if (errno != EINTR) return false;
  pollfd p{fd, POLLOUT, 0};
  int r = 0;
  while ((r = ::poll(&p, 1, -1)) < 0 && errno == EINTR) {
  }
  if (r < 0) return false;
  int err = 0;
  socklen_t err_len = sizeof err;
  if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &err_len) != 0) return false;
  errno = err;
  return err == 0;
}

// One result of resolving a host and port: what socket() and connect() or bind() take.
struct resolved_address {
  sockaddr_storage address{};
  socklen_t length = 0;
  int family = 0;
  int type = 0;
  int protocol = 0;

  [[nodiscard]] const sockaddr* raw() const noexcept {
    return reinterpret_cast<const sockaddr*>(&address);
  }
};

// Resolves host:port (numeric or by name; `flags` are getaddrinfo's) into stream-socket addresses,
// in getaddrinfo's order. A failed resolution throws std::system_error with `resolve_error` and a
// message starting with `who`. A name (not a numeric address) may block while it is looked up.
[[nodiscard]] inline std::vector<resolved_address> resolve(const std::string& host,
                                                           std::uint16_t port, int flags,
                                                           std::error_code resolve_error,
                                                           const char* who) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = flags | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  const int rc = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &found);
  if (rc != 0) {
    throw std::system_error(resolve_error, std::string(who) + ": cannot resolve '" + host + "': " +
                                ::gai_strerror(rc));
  }
  const std::unique_ptr<addrinfo, void (*)(addrinfo*)> results(found, ::freeaddrinfo);
  std::vector<resolved_address> out;
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
    if (a->ai_addrlen > sizeof(sockaddr_storage)) continue;
    resolved_address r;
    std::memcpy(&r.address, a->ai_addr, a->ai_addrlen);
    r.length = a->ai_addrlen;
    r.family = a->ai_family;
    r.type = a->ai_socktype;
    r.protocol = a->ai_protocol;
    out.push_back(r);
  }
  return out;
}

// A new stream socket for `a` (close-on-exec), or -1 with errno set.
[[nodiscard]] inline int open_socket(const resolved_address& a) noexcept {
  return ::socket(a.family, a.type | SOCK_CLOEXEC, a.protocol);
}

// Resolves host:port (resolve()) and calls `use(fd, address)` on a new stream socket for each
// result until it returns true; that socket is returned, else -1 with errno set (by `use`, or by
// socket()). If `use` throws, the socket is closed.
template <class Use>
int for_each_address(const std::string& host, std::uint16_t port, int flags,
                     std::error_code resolve_error, const char* who, Use use) {
  int err = EADDRNOTAVAIL;
  for (const resolved_address& a : resolve(host, port, flags, resolve_error, who)) {
    const int fd = open_socket(a);
    if (fd < 0) {
      err = errno;
      continue;
    }
    bool used = false;
    try {
      used = use(fd, a);
    } catch (...) {
      ::close(fd);
      throw;
    }
    if (used) return fd;
    err = errno;
    ::close(fd);
  }
  errno = err;
  return -1;
}

}  // namespace ferry::detail

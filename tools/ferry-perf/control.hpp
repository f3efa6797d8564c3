#pragma once
// The control connection between initiator and target: text lines over a plain TCP socket, every
// read and write bounded by a deadline, so a peer that goes away ends the run instead of hanging it.
//   initiator: hello backend=... op=... threads=N slots=N block=N transport=...
//   target:    ready port=P          (or: error MESSAGE)
//   initiator: done
//   target:    cpu user_s=U system_s=S ops=N

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <system_error>

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

namespace ferry_perf {

struct control_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class control_socket {
 public:
  control_socket() = default;
  explicit control_socket(int fd) : fd_(fd) {}
  control_socket(control_socket&& o) noexcept : fd_(o.fd_), buffered_(std::move(o.buffered_)) { o.fd_ = -1; }
  control_socket& operator=(control_socket&& o) noexcept {
    std::swap(fd_, o.fd_);
    std::swap(buffered_, o.buffered_);
    return *this;
  }
  control_socket(const control_socket&) = delete;
  control_socket& operator=(const control_socket&) = delete;
  ~control_socket() {
    if (fd_ >= 0) ::close(fd_);
  }

  [[nodiscard]] int fd() const noexcept { return fd_; }

  static control_socket connect(const std::string& host, std::uint16_t port, std::chrono::milliseconds timeout) {
    addrinfo hints{};
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    const std::string service = std::to_string(port);
    if (const int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &res); rc != 0) {
      throw control_error("control connection to " + host + ":" + service + ": " + ::gai_strerror(rc));
    }
    std::string why = "no address";
    for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
      const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
      if (fd < 0) continue;
      if (::connect(fd, a->ai_addr, a->ai_addrlen) != 0 && errno != EINPROGRESS) {
        why = std::strerror(errno);
        ::close(fd);
        continue;
      }
      pollfd p{fd, POLLOUT, 0};
      const int n = ::poll(&p, 1, static_cast<int>(timeout.count()));
      int err = 0;
      socklen_t len = sizeof err;
      if (n == 1) ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
      if (n == 1 && err == 0) {
        ::freeaddrinfo(res);
        const int one = 1;
        ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        return control_socket(fd);
      }
      why = n == 0 ? "timed out" : std::strerror(err != 0 ? err : errno);
      ::close(fd);
    }
    ::freeaddrinfo(res);
    throw control_error("control connection to " + host + ":" + service + ": " + why);
  }

  void send_line(const std::string& line, std::chrono::milliseconds timeout) {
    const std::string text = line + "\n";
    std::size_t off = 0;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (off < text.size()) {
      const ssize_t n = ::send(fd_, text.data() + off, text.size() - off, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) {
        off += static_cast<std::size_t>(n);
        continue;
      }
      if (n < 0 && errno != EAGAIN && errno != EINTR) {
        throw control_error(std::string("control connection: send: ") + std::strerror(errno));
      }
      wait_for(POLLOUT, deadline, "send");
    }
  }

  // The next line, without its newline; throws control_error at the deadline or when the peer
  // closed the connection.
  std::string read_line(std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      if (const auto nl = buffered_.find('\n'); nl != std::string::npos) {
        std::string line = buffered_.substr(0, nl);
        buffered_.erase(0, nl + 1);
        return line;
      }
      char buf[4096];
      const ssize_t n = ::recv(fd_, buf, sizeof buf, MSG_DONTWAIT);
      if (n > 0) {
        buffered_.append(buf, static_cast<std::size_t>(n));
        if (buffered_.size() > 65536) throw control_error("control connection: line too long");
        continue;
      }
      if (n == 0) throw control_error("control connection closed by the peer");
      if (errno != EAGAIN && errno != EINTR) {
        throw control_error(std::string("control connection: receive: ") + std::strerror(errno));
      }
      wait_for(POLLIN, deadline, "receive");
    }
  }

 private:
  void wait_for(short events, std::chrono::steady_clock::time_point deadline, const char* what) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) throw control_error(std::string("control connection: ") + what + " timed out");
    pollfd p{fd_, events, 0};
    const int n = ::poll(&p, 1, static_cast<int>(left.count()) + 1);
    if (n < 0 && errno != EINTR) throw control_error(std::string("control connection: poll: ") + std::strerror(errno));
  }

  int fd_ = -1;
  std::string buffered_;
};

// "word key=value key=value": the word, then the pairs.
inline std::map<std::string, std::string> parse_fields(const std::string& line, std::string& word) {
  std::istringstream in(line);
  in >> word;
  std::map<std::string, std::string> out;
  std::string kv;
  while (in >> kv) {
    const auto eq = kv.find('=');
    if (eq != std::string::npos) out[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  return out;
}

// A listening socket for the control connections (non-blocking accept with a poll bound).
inline int listen_control(const std::string& host, std::uint16_t port) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  if (const int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &res); rc != 0) {
    throw control_error("listen on " + host + ":" + service + ": " + ::gai_strerror(rc));
  }
  std::string why = "no address";
  for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 16) == 0) {
      ::freeaddrinfo(res);
      return fd;
    }
    why = std::strerror(errno);
    ::close(fd);
  }
  ::freeaddrinfo(res);
  throw control_error("listen on " + host + ":" + service + ": " + why);
}

// -1 when nothing connected within `timeout`.
inline int accept_within(int listen_fd, std::chrono::milliseconds timeout) {
  pollfd p{listen_fd, POLLIN, 0};
  if (::poll(&p, 1, static_cast<int>(timeout.count())) != 1) return -1;
  const int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
  if (fd >= 0) {
    const int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  }
  return fd;
}

}  // namespace ferry_perf

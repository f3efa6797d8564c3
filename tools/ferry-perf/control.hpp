#pragma once
// The control connection between initiator and target: text lines over a plain TCP socket, every
// read and write bounded by a deadline, so a peer that goes away ends the run instead of hanging it.
//   initiator: hello backend=B op=read|write threads=N slots=N block=N transport=T duration=S
//              timeout=S check=0|1 [seed=N]
//   target:    ready port=P [check=1]        (or: error MESSAGE, and the run is refused)
//   initiator: done
//   target:    cpu user_s=U system_s=S ops=N
//   target:    check ok                      (or: check failed MESSAGE; only when check=1)
// Each side reads the other's lines strictly (control_line): every field it expects is there once,
// no other field is, and every number is read whole and range-checked, so a malformed or hostile
// line is refused with a message naming the field and its value.

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <map>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>

#include <arpa/inet.h>

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include "numbers.hpp"

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

  // A line break inside `line` (an error message's) would split it into two lines: sent as spaces.
  void send_line(const std::string& line, std::chrono::milliseconds timeout) {
    std::string text = line;
    for (char& ch : text) {
      if (ch == '\n' || ch == '\r') ch = ' ';
    }
    text += '\n';
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

// One line of the control protocol, "word key=value key=value", read strictly. Every accessor
// throws control_error naming the line's word, the field and its value when the field is missing or
// its value is not what the protocol allows.
class control_line {
 public:
  // A line that is not `word` followed by fields is refused; so is a field not in `keys`, a token
  // that is not key=value, or a key given twice.
  [[nodiscard]] static control_line parse(const std::string& line, const std::string& word,
                                          std::initializer_list<std::string_view> keys) {
    control_line out;
    std::istringstream in(line);
    in >> out.word_;
    if (out.word_ != word) throw control_error("expected a '" + word + "' line, not " + in_quotes(line));
    std::string token;
    while (in >> token) {
      const auto eq = token.find('=');
      if (eq == std::string::npos || eq == 0) {
        throw control_error(out.word_ + ": " + in_quotes(token) + " is not a field (key=value)");
      }
      const std::string key = token.substr(0, eq);
      bool known = false;
      for (std::string_view k : keys) known = known || k == key;
      if (!known) throw control_error(out.word_ + ": unknown field " + in_quotes(token));
      if (!out.fields_.emplace(key, token.substr(eq + 1)).second) {
        throw control_error(out.word_ + ": field '" + key + "' given twice");
      }
    }
    return out;
  }

  [[nodiscard]] bool has(const std::string& key) const { return fields_.count(key) != 0; }

  [[nodiscard]] const std::string& text(const std::string& key) const {
    const auto it = fields_.find(key);
    if (it == fields_.end()) throw control_error(word_ + ": field '" + key + "' is missing");
    return it->second;
  }

  // A whole number from lo to hi.
  [[nodiscard]] std::uint64_t whole(const std::string& key, std::uint64_t lo, std::uint64_t hi) const {
    const std::string& v = text(key);
    const std::optional<std::uint64_t> n = parse_whole(v);
    if (!n || *n < lo || *n > hi) {
      throw control_error(word_ + ": " + key + "=" + in_quotes(v) + " is not a whole number from " + std::to_string(lo) +
                          " to " + std::to_string(hi));
    }
    return *n;
  }

  // A finite number from lo to hi, of `unit`.
  [[nodiscard]] double real(const std::string& key, double lo, double hi, const char* unit) const {
    const std::string& v = text(key);
    const std::optional<double> n = parse_real(v);
    if (!n || *n < lo || *n > hi) {
      throw control_error(word_ + ": " + key + "=" + in_quotes(v) + " is not a number of " + unit + " from " +
                          format_real(lo) + " to " + format_real(hi));
    }
    return *n;
  }

  // One of `allowed`.
  [[nodiscard]] const std::string& one_of(const std::string& key,
                                          std::initializer_list<std::string_view> allowed) const {
    const std::string& v = text(key);
    std::string names;
    for (std::string_view a : allowed) {
      if (v == a) return v;
      names += (names.empty() ? "" : ", ") + std::string(a);
    }
    throw control_error(word_ + ": " + key + "=" + in_quotes(v) + " is not one of " + names);
  }

 private:
  std::string word_;
  std::map<std::string, std::string> fields_;
};

// The peer's address as a log line names it: "10.0.0.2:41234".
inline std::string peer_name(int fd) {
  sockaddr_storage a{};
  socklen_t len = sizeof a;
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) return "an unknown peer";
  char host[INET6_ADDRSTRLEN] = "?";
  unsigned port = 0;
  if (a.ss_family == AF_INET) {
    const auto* v4 = reinterpret_cast<const sockaddr_in*>(&a);
    ::inet_ntop(AF_INET, &v4->sin_addr, host, sizeof host);
    port = ntohs(v4->sin_port);
    return std::string(host) + ":" + std::to_string(port);
  }
  if (a.ss_family == AF_INET6) {
    const auto* v6 = reinterpret_cast<const sockaddr_in6*>(&a);
    ::inet_ntop(AF_INET6, &v6->sin6_addr, host, sizeof host);
    port = ntohs(v6->sin6_port);
    return "[" + std::string(host) + "]:" + std::to_string(port);
  }
  return "an unknown peer";
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

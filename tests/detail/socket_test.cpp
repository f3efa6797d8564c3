// detail/socket.hpp on loopback: resolving and trying each address, a blocking connect, socket modes.

#include <catch2/catch.hpp>

#include <cerrno>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <system_error>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <ferry/detail/socket.hpp>

namespace {

const std::error_code resolve_error = std::make_error_code(std::errc::invalid_argument);

// A listening socket on 127.0.0.1 and a port the kernel chose.
struct listener {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  std::uint16_t port = 0;
  listener() {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    REQUIRE(::listen(fd, 4) == 0);
    socklen_t len = sizeof a;
    REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0);
    port = ntohs(a.sin_port);
  }
  listener(const listener&) = delete;
  listener& operator=(const listener&) = delete;
  ~listener() { ::close(fd); }
};

int connect_to(const std::string& host, std::uint16_t port) {
  return ferry::detail::for_each_address(
      host, port, 0, resolve_error, "test", [](int fd, const ferry::detail::resolved_address& a) {
        return ferry::detail::connect_blocking(fd, a.raw(), a.length);
      });
}

}  // namespace

TEST_CASE("socket: for_each_address connects to a listener on 127.0.0.1, and set-up options stick",
          "[detail]") {
  listener l;
  const int fd = connect_to("127.0.0.1", l.port);
  REQUIRE(fd >= 0);
  const int peer = ::accept(l.fd, nullptr, nullptr);
  CHECK(peer >= 0);
  CHECK((::fcntl(fd, F_GETFD) & FD_CLOEXEC) != 0);

  ferry::detail::set_nodelay(fd);
  int nodelay = 0;
  socklen_t len = sizeof nodelay;
  REQUIRE(::getsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &nodelay, &len) == 0);
  CHECK(nodelay != 0);
  CHECK(ferry::detail::set_nonblocking(fd));
  CHECK((::fcntl(fd, F_GETFL) & O_NONBLOCK) != 0);
  CHECK_FALSE(ferry::detail::set_nonblocking(-1));
  ::close(peer);
  ::close(fd);
}

TEST_CASE("socket: a refused connect returns -1 with errno; a bad host throws naming the caller",
          "[detail]") {
  int port = 0;
  {
    listener l;  // a port that was just free, now closed
    port = l.port;
  }
  errno = 0;
  CHECK(connect_to("127.0.0.1", static_cast<std::uint16_t>(port)) == -1);
  CHECK(errno == ECONNREFUSED);
  try {
    (void)ferry::detail::for_each_address("no such host .invalid", 1, AI_NUMERICHOST, resolve_error,
                                          "tester", [](int, const ferry::detail::resolved_address&) { return true; });
    FAIL("resolved an impossible host");
  } catch (const std::system_error& e) {
    CHECK(e.code() == resolve_error);
    CHECK(std::string(e.what()).rfind("tester: cannot resolve 'no such host .invalid'", 0) == 0);
  }
}

TEST_CASE("socket: a throwing use closes the socket and passes the exception on", "[detail]") {
  int seen = -1;
  CHECK_THROWS_AS(ferry::detail::for_each_address(
                      "127.0.0.1", 1, 0, resolve_error, "test",
                      [&](int fd, const ferry::detail::resolved_address&) -> bool {
                        seen = fd;
                        throw std::runtime_error("no");
                      }),
                  std::runtime_error);
  REQUIRE(seen >= 0);
  CHECK(::fcntl(seen, F_GETFD) == -1);  // closed
  CHECK(errno == EBADF);
}

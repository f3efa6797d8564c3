// Framed blocks over real TCP sockets on loopback, through the io_uring ring.

#include <catch2/catch.hpp>

#include <cstring>
#include <thread>
#include <vector>

#include <csignal>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <ferry/uring/tcp.hpp>
#include <ferry/wait_all.hpp>

#include "helpers.hpp"
#include "uring_helpers.hpp"

using namespace ferry_test;
using ferry::transfer_state;
using ferry::verdict;
namespace uring = ferry::uring;

namespace {

// Both ends of one loopback connection on one ring.
struct connected_pair {
  uring::tcp_listener listener{"127.0.0.1", 0};
  uring::tcp_connection client;
  uring::tcp_connection server;

  explicit connected_pair(uring::ring& r)
      : client(uring::tcp_connection::connect(r, "127.0.0.1", listener.port())),
        server(listener.accept(r)) {}
};

// A plain socket connected to `port`, for a peer that does not speak through ferry.
int raw_connect(std::uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd < 0 || ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) return -1;
  return fd;
}

void write_all(int fd, const void* p, std::size_t n) {
  const auto* b = static_cast<const char*>(p);
  while (n != 0) {
    const ssize_t w = ::send(fd, b, n, MSG_NOSIGNAL);
    if (w <= 0) return;
    b += w;
    n -= static_cast<std::size_t>(w);
  }
}

}  // namespace

TEST_CASE("tcp: framed blocks arrive byte-exact, in order, with their ids", "[tcp][concurrency]") {
  FERRY_REQUIRE_URING();
  ferry::progress_executor exec;
  uring::ring r(exec);
  connected_pair c(r);
  const std::vector<std::size_t> sizes = {4096, 0, 1, 65536, 1 << 20, 4096 * 3 + 5};
  std::vector<std::vector<std::byte>> payloads;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    payloads.push_back(byte_pattern(sizes[i], static_cast<unsigned>(i)));
  }
  std::vector<std::vector<std::byte>> dst(sizes.size(), std::vector<std::byte>(1 << 20));
  std::vector<uring::received_block> got(sizes.size());
  std::vector<ferry::transfer> ts;
  // Receives posted first, sends after: both queue per connection, in order.
  for (std::size_t i = 0; i < sizes.size(); ++i) ts.push_back(c.server.receive(dst[i], got[i]));
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    ts.push_back(c.client.send(1000 + i, payloads[i]));
  }
  REQUIRE(ferry::wait_all(ts, hang_bound).verdict == verdict::success);
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    CHECK(got[i].id == 1000 + i);
    REQUIRE(got[i].length == sizes[i]);
    CHECK(std::equal(payloads[i].begin(), payloads[i].end(), dst[i].begin()));
  }
}

TEST_CASE("tcp: many blocks both ways at once", "[tcp][concurrency]") {
  FERRY_REQUIRE_URING();
  ferry::progress_executor exec;
  uring::ring r(exec);
  connected_pair c(r);
  constexpr std::size_t n = 200;
  constexpr std::size_t block = 64 << 10;
  const auto payload = byte_pattern(block, 77);
  std::vector<std::vector<std::byte>> a(n, std::vector<std::byte>(block));
  std::vector<std::vector<std::byte>> b(n, std::vector<std::byte>(block));
  std::vector<uring::received_block> ga(n), gb(n);
  std::vector<ferry::transfer> ts;
  for (std::size_t i = 0; i < n; ++i) {
    ts.push_back(c.server.receive(a[i], ga[i]));
    ts.push_back(c.client.receive(b[i], gb[i]));
  }
  std::thread other([&] {
    std::vector<ferry::transfer> sends;
    for (std::size_t i = 0; i < n; ++i) sends.push_back(c.server.send(i, payload));
    (void)ferry::wait_all(sends, hang_bound);
  });
  for (std::size_t i = 0; i < n; ++i) ts.push_back(c.client.send(i, payload));
  other.join();
  REQUIRE(ferry::wait_all(ts, hang_bound).verdict == verdict::success);
  for (std::size_t i = 0; i < n; ++i) {
    REQUIRE(ga[i].id == i);
    REQUIRE(gb[i].id == i);
    REQUIRE(a[i] == payload);
    REQUIRE(b[i] == payload);
  }
}

TEST_CASE("tcp: a peer process killed mid-block fails the receive and never hangs",
          "[tcp][concurrency]") {
  FERRY_REQUIRE_URING();
  ferry::progress_executor exec;
  uring::ring r(exec);
  uring::tcp_listener listener("127.0.0.1", 0);
  const std::uint16_t port = listener.port();
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    // The prefill peer: announces a 1 MiB block, sends 100 KiB of it, and dies.
    const int fd = raw_connect(port);
    uring::detail::frame_header h;
    h.id = 7;
    h.length = 1 << 20;
    write_all(fd, &h, sizeof h);
    std::vector<char> part(100 << 10, 'k');
    write_all(fd, part.data(), part.size());
    ::raise(SIGKILL);
  }
  uring::tcp_connection conn = listener.accept(r);
  std::vector<std::byte> dst(1 << 20);
  uring::received_block got;
  ferry::transfer t = conn.receive(dst, got);
  REQUIRE(t.wait_for(hang_bound) == transfer_state::failed);
  const bool closed = t.error() == ferry::errc::connection_closed ||
                      t.error() == std::error_code(ECONNRESET, std::system_category());
  CHECK(closed);
  CHECK(got.id == 7);  // the header did arrive
  // The connection's receive side stays failed: no later receive can wait forever.
  uring::received_block next;
  ferry::transfer later = conn.receive(dst, next);
  REQUIRE(later.wait_for(hang_bound) == transfer_state::failed);
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  CHECK(WIFSIGNALED(status));
}

TEST_CASE("tcp: a peer that closes between blocks, or sends garbage, or too much",
          "[tcp][concurrency]") {
  FERRY_REQUIRE_URING();
  ferry::progress_executor exec;
  uring::ring r(exec);
  uring::tcp_listener listener("127.0.0.1", 0);
  fd_guard peer(raw_connect(listener.port()));
  uring::tcp_connection conn = listener.accept(r);
  std::vector<std::byte> dst(4096);
  uring::received_block got;

  SECTION("closed at a block boundary") {
    ::shutdown(peer.get(), SHUT_WR);
    ferry::transfer t = conn.receive(dst, got);
    REQUIRE(t.wait_for(hang_bound) == transfer_state::failed);
    CHECK(t.error() == ferry::errc::connection_closed);
  }
  SECTION("bytes that are not a ferry frame") {
    const char junk[24] = "GET / HTTP/1.1\r\n\r\n";
    write_all(peer.get(), junk, sizeof junk);
    ferry::transfer t = conn.receive(dst, got);
    REQUIRE(t.wait_for(hang_bound) == transfer_state::failed);
    CHECK(t.error() == ferry::errc::bad_frame);
    ferry::transfer later = conn.receive(dst, got);
    REQUIRE(later.wait_for(hang_bound) == transfer_state::failed);
    CHECK(later.error() == ferry::errc::connection_broken);
  }
  SECTION("a block larger than the destination") {
    uring::detail::frame_header h;
    h.length = dst.size() + 1;
    write_all(peer.get(), &h, sizeof h);
    ferry::transfer t = conn.receive(dst, got);
    REQUIRE(t.wait_for(hang_bound) == transfer_state::failed);
    CHECK(t.error() == ferry::errc::block_too_large);
  }
  SECTION("sending to a peer that is gone is an error, not SIGPIPE") {
    peer.reset();
    const auto big = byte_pattern(4 << 20, 1);
    ferry::transfer first = conn.send(1, big);
    (void)first.wait_for(hang_bound);
    ferry::transfer second = conn.send(2, big);
    REQUIRE(second.wait_for(hang_bound) == transfer_state::failed);
    CHECK(second.error().value() != 0);
  }
}

TEST_CASE("tcp: cancelling a receive that has no data leaves the connection usable",
          "[tcp][concurrency]") {
  FERRY_REQUIRE_URING();
  ferry::progress_executor exec;
  uring::ring r(exec);
  connected_pair c(r);
  std::vector<std::byte> dst(100);
  uring::received_block got;
  ferry::transfer waiting = c.server.receive(dst, got);
  uring::received_block got2;
  ferry::transfer queued = c.server.receive(dst, got2);  // behind the first: never started
  CHECK(waiting.wait_for(20ms) == transfer_state::pending);
  r.cancel(queued);
  REQUIRE(queued.wait_for(hang_bound) == transfer_state::cancelled);
  r.cancel(waiting);
  REQUIRE(waiting.wait_for(hang_bound) == transfer_state::cancelled);

  const auto payload = byte_pattern(100, 2);
  REQUIRE(c.client.send(5, payload).wait_for(hang_bound) == transfer_state::success);
  uring::received_block got3;
  ferry::transfer again = c.server.receive(dst, got3);
  REQUIRE(again.wait_for(hang_bound) == transfer_state::success);
  CHECK(got3.id == 5);
  CHECK(dst == payload);
}

TEST_CASE("tcp: closing a connection ends its transfers", "[tcp][concurrency]") {
  FERRY_REQUIRE_URING();
  ferry::progress_executor exec;
  uring::ring r(exec);
  connected_pair c(r);
  std::vector<std::byte> dst(100);
  uring::received_block a, b;
  ferry::transfer in_flight = c.server.receive(dst, a);
  ferry::transfer queued = c.server.receive(dst, b);
  CHECK(in_flight.wait_for(20ms) == transfer_state::pending);
  c.server.close();
  CHECK(in_flight.wait_for(hang_bound) != transfer_state::pending);
  CHECK(queued.wait_for(hang_bound) != transfer_state::pending);
  CHECK(in_flight.state() != transfer_state::success);
  // A closed handle refuses new work with a clear error.
  ferry::transfer refused = c.server.receive(dst, a);
  CHECK(refused.error() == ferry::errc::connection_closed);
}

TEST_CASE("tcp: sends are never stuck behind receives that fill the ring", "[tcp][concurrency]") {
  FERRY_REQUIRE_URING();
  ferry::progress_executor exec;
  uring::ring r(exec, uring::ring_options{.entries = 1});
  uring::tcp_listener listener("127.0.0.1", 0);
  std::vector<uring::tcp_connection> clients, servers;
  constexpr std::size_t n = 6;
  for (std::size_t i = 0; i < n; ++i) {
    clients.push_back(uring::tcp_connection::connect(r, "127.0.0.1", listener.port()));
    servers.push_back(listener.accept(r));
  }
  std::vector<std::vector<std::byte>> dst(n, std::vector<std::byte>(64));
  std::vector<uring::received_block> got(n);
  std::vector<ferry::transfer> receives;
  for (std::size_t i = 0; i < n; ++i) receives.push_back(servers[i].receive(dst[i], got[i]));
  const auto payload = byte_pattern(64, 3);
  std::vector<ferry::transfer> sends;
  for (std::size_t i = 0; i < n; ++i) sends.push_back(clients[i].send(i, payload));
  REQUIRE(ferry::wait_all(sends, hang_bound).verdict == verdict::success);
  REQUIRE(ferry::wait_all(receives, hang_bound).verdict == verdict::success);
  for (std::size_t i = 0; i < n; ++i) CHECK(got[i].id == i);
}

TEST_CASE("tcp: cancelling sends stuck on a full socket ends every one, and the stream stays framed",
          "[tcp][concurrency]") {
  FERRY_REQUIRE_URING();
  ferry::progress_executor exec;
  uring::ring r(exec);
  connected_pair c(r);
  constexpr std::size_t n = 48;
  constexpr std::size_t block = 1 << 20;
  std::vector<std::vector<std::byte>> payloads;
  for (std::size_t i = 0; i < n; ++i) payloads.push_back(byte_pattern(block, static_cast<unsigned>(i)));
  // Nobody receives yet: the socket buffers fill and the sends stall, coalesced in groups.
  std::vector<ferry::transfer> sends;
  for (std::size_t i = 0; i < n; ++i) sends.push_back(c.client.send(i, payloads[i]));
  std::this_thread::sleep_for(50ms);
  for (const auto& t : sends) r.cancel(t);
  // Let the receiver drain the socket, so that whatever was not cancelled can finish.
  std::vector<std::byte> dst(block);
  std::size_t received = 0;
  bool intact = true;
  std::thread reader([&] {
    for (;;) {
      uring::received_block got;
      if (c.server.receive(dst, got).wait() != transfer_state::success) break;
      if (got.id != received || got.length != block ||
          !std::equal(dst.begin(), dst.end(), payloads[received].begin())) {
        intact = false;
      }
      ++received;
    }
  });
  REQUIRE(ferry::drain(sends, hang_bound).pending == 0);
  // Successes form a prefix; after them nothing succeeds.
  std::size_t succeeded = 0;
  while (succeeded < n && sends[succeeded].state() == transfer_state::success) ++succeeded;
  for (std::size_t i = succeeded; i < n; ++i) CHECK(sends[i].state() != transfer_state::success);
  c.client.close();
  reader.join();
  CHECK(intact);
  CHECK(received == succeeded);
}

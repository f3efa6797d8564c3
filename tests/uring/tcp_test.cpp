// Framed blocks over real TCP sockets on loopback, through the io_uring ring.

#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <optional>
#include <random>
#include <thread>
#include <vector>

#include <csignal>
#include <fcntl.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <ferry/metrics.hpp>
#include <ferry/uring/tcp.hpp>
#include <ferry/wait_all.hpp>

#include "helpers.hpp"
#include "uring/uring_helpers.hpp"

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

// SO_SNDBUF or SO_RCVBUF as the kernel reports it (on Linux, double what was set).
int socket_buffer(int fd, int option) {
  int bytes = 0;
  socklen_t len = sizeof bytes;
  REQUIRE(::getsockopt(fd, SOL_SOCKET, option, &bytes, &len) == 0);
  return bytes;
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

// Reads on pipes nobody writes to, as many as the ring holds: work submitted after them waits for
// room in the ring until release().
class stalled_reads {
 public:
  explicit stalled_reads(uring::ring& r) : buffer_(r.in_flight_limit()), pipes_(r.in_flight_limit()) {
    for (unsigned i = 0; i < r.in_flight_limit(); ++i) {
      reads_.push_back(r.read(pipes_.read_ends[i].get(), std::span(buffer_).subspan(i, 1),
                              uring::current_position));
    }
    REQUIRE(wait_until([&] { return r.counters().backlogged > 0; }));
  }
  ~stalled_reads() { release(); }

  // The reads end (the pipes report end of file) and the ring has room again.
  void release() {
    for (fd_guard& w : pipes_.write_ends) w.reset(-1);
    (void)ferry::drain(reads_, hang_bound);
  }

 private:
  std::vector<std::byte> buffer_;
  pipe_set pipes_;
  std::vector<ferry::transfer> reads_;
};

// Writes into a socket until its buffers are full, so that the next send stalls before its first
// byte; returns how many bytes that took.
std::size_t fill_socket(int fd) {
  const int flags = ::fcntl(fd, F_GETFL);
  ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
  std::size_t filled = 0;
  char chunk[4096] = {};
  for (std::size_t n = sizeof chunk; n != 0; n /= 2) {
    for (ssize_t w; (w = ::send(fd, chunk, n, MSG_NOSIGNAL)) > 0;) {
      filled += static_cast<std::size_t>(w);
    }
  }
  ::fcntl(fd, F_SETFL, flags);
  return filled;
}

// Reads and drops n bytes; false if the stream ended first. (No assertions: Catch asserts only on
// the main thread, and peers read on their own.)
bool read_exactly(int fd, std::size_t n) {
  std::vector<char> sink(std::min<std::size_t>(n, 1 << 20));
  for (std::size_t done = 0; done < n;) {
    const ssize_t r = ::read(fd, sink.data(), std::min(n - done, sink.size()));
    if (r <= 0) return false;
    done += static_cast<std::size_t>(r);
  }
  return true;
}

// The most one sendmsg moves (the kernel's MAX_RW_COUNT: INT_MAX rounded down to a page).
std::size_t max_rw_count() {
  return 0x7fffffffu & ~(static_cast<std::size_t>(::sysconf(_SC_PAGESIZE)) - 1);
}

// File reads that never let up: each read of `fd` into `b` at `offset` is followed at once by the
// next, on the executor (its continuation resumes inline, in the round its completion came in),
// until one fails or `stop` is set. Counts them in `reads`; `readers` goes down by one at the end.
struct relentless_reads {
  std::atomic<bool> stop{false};
  std::atomic<int> readers{0};
  std::atomic<long> reads{0};

  void start(uring::ring& r, int fd, std::span<std::byte> b, std::uint64_t offset) {
    readers.fetch_add(1);
    [](uring::ring& r, int fd, std::span<std::byte> b, std::uint64_t offset,
       relentless_reads& self) -> detached_inline {
      ferry::inline_scheduler on_executor;
      while (!self.stop.load()) {
        const transfer_state st = co_await ferry::resume_on(on_executor, r.read(fd, b, offset));
        if (st != transfer_state::success) break;
        self.reads.fetch_add(1);
      }
      self.readers.fetch_sub(1);
    }(r, fd, b, offset, *this);
  }
};

// A new connected pair of Unix stream sockets; whoever takes an end closes it.
class socket_pair {
 public:
  socket_pair() { REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds_) == 0); }
  [[nodiscard]] int first() const noexcept { return fds_[0]; }
  [[nodiscard]] int second() const noexcept { return fds_[1]; }

 private:
  int fds_[2] = {-1, -1};
};

// A ring of one entry held full by stalled reads, and three sends a, b1, b2 on a socket pair: a is
// cancelled while it waits for room, so b1 and b2 form the next group, which waits for room too.
// The sender owns the first socket; `peer`, the second, is the test's to own.
struct group_waiting_for_room {
  ferry::progress_executor exec;
  uring::ring r{exec, uring::ring_options{.entries = 1}};
  stalled_reads stall{r};
  socket_pair sockets;
  int peer = sockets.second();
  uring::tcp_connection sender{r, sockets.first()};
  std::vector<std::byte> pa = byte_pattern(100, 1), pb1 = byte_pattern(100, 2),
                         pb2 = byte_pattern(100, 3);
  ferry::transfer a = sender.send(1, pa);  // waits for room in the ring
  ferry::transfer b1 = sender.send(2, pb1);
  ferry::transfer b2 = sender.send(3, pb2);

  group_waiting_for_room() {
    CHECK(a.wait_for(20ms) == transfer_state::pending);
    const auto backlogged = r.counters().backlogged;
    r.cancel(a);
    REQUIRE(a.wait_for(hang_bound) == transfer_state::cancelled);
    // a turns cancelled just before the next group forms: wait for that group to take its place
    // in the backlog.
    REQUIRE(wait_until([&] { return r.counters().backlogged > backlogged; }));
  }
};

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

TEST_CASE("tcp: a receive waiting on its peer lets an adaptive executor sleep",
          "[tcp][concurrency]") {
  FERRY_REQUIRE_URING();
  std::vector<std::byte> dst(4096);  // before the ring, which may still write it when it goes
  uring::received_block got;
  ferry::progress_executor exec(spin_while_in_flight());  // receives must not count as in flight
  uring::ring r(exec);
  connected_pair c(r);
  ferry::transfer t = c.server.receive(dst, got);
  REQUIRE(wait_until([&] { return r.counters().submitted >= 1; }));
  // It may have parked already; a wake-up makes it go round and park again, unless it counts the
  // receive as I/O in flight and spins.
  const auto parks = exec.counters().parks;
  exec.notify();
  CHECK(wait_until([&] { return exec.counters().parks > parks; }));
  const auto payload = byte_pattern(4096, 9);
  REQUIRE(c.client.send(7, payload).wait_for(hang_bound) == transfer_state::success);
  REQUIRE(t.wait_for(hang_bound) == transfer_state::success);
  CHECK(got.id == 7);
  CHECK(std::equal(payload.begin(), payload.end(), dst.begin()));
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
  const bool closed = t.error() == ferry::uring::errc::connection_closed ||
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
    CHECK(t.error() == ferry::uring::errc::connection_closed);
  }
  SECTION("bytes that are not a ferry frame") {
    const char junk[24] = "GET / HTTP/1.1\r\n\r\n";
    write_all(peer.get(), junk, sizeof junk);
    ferry::transfer t = conn.receive(dst, got);
    REQUIRE(t.wait_for(hang_bound) == transfer_state::failed);
    CHECK(t.error() == ferry::uring::errc::bad_frame);
    ferry::transfer later = conn.receive(dst, got);
    REQUIRE(later.wait_for(hang_bound) == transfer_state::failed);
    CHECK(later.error() == ferry::uring::errc::connection_broken);
  }
  SECTION("a header whose reserved field is not zero") {
    uring::detail::frame_header h;
    h.reserved = 1;
    write_all(peer.get(), &h, sizeof h);
    ferry::transfer t = conn.receive(dst, got);
    REQUIRE(t.wait_for(hang_bound) == transfer_state::failed);
    CHECK(t.error() == ferry::uring::errc::bad_frame);
  }
  SECTION("a block larger than the destination") {
    uring::detail::frame_header h;
    h.length = dst.size() + 1;
    write_all(peer.get(), &h, sizeof h);
    ferry::transfer t = conn.receive(dst, got);
    REQUIRE(t.wait_for(hang_bound) == transfer_state::failed);
    CHECK(t.error() == ferry::uring::errc::block_too_large);
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

TEST_CASE("tcp: cancelling a send coalesced behind another in a stalled sendmsg ends it",
          "[tcp][concurrency]") {
  FERRY_REQUIRE_URING();
  ferry::progress_executor exec;
  uring::ring r(exec);
  int sv[2];
  REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
  const std::size_t filled = fill_socket(sv[0]);  // the peer reads nothing yet
  uring::tcp_connection sender(r, sv[0]);
  const auto pa = byte_pattern(100, 1), pb1 = byte_pattern(100, 2), pb2 = byte_pattern(100, 3);
  ferry::transfer a = sender.send(1, pa);  // in flight alone, stalled before its first byte
  ferry::transfer b1 = sender.send(2, pb1);
  ferry::transfer b2 = sender.send(3, pb2);
  CHECK(a.wait_for(20ms) == transfer_state::pending);
  r.cancel(a);  // at a frame boundary: b1 and b2 then go out together, in one stalled sendmsg
  REQUIRE(a.wait_for(hang_bound) == transfer_state::cancelled);
  CHECK(b2.wait_for(20ms) == transfer_state::pending);
  r.cancel(b2);  // second in that sendmsg: the kernel holds its bytes as part of b1's request
  REQUIRE(b2.wait_for(hang_bound) == transfer_state::cancelled);
  CHECK(b1.state() == transfer_state::pending);  // untouched and not cancelled: sent again

  // The peer drains the filler, then reads frames: b1's alone, whole.
  REQUIRE(read_exactly(sv[1], filled));
  uring::tcp_connection receiver(r, sv[1]);
  std::vector<std::byte> dst(100);
  uring::received_block got;
  REQUIRE(receiver.receive(dst, got).wait_for(hang_bound) == transfer_state::success);
  CHECK(got.id == 2);
  CHECK(dst == pb1);
  REQUIRE(b1.wait_for(hang_bound) == transfer_state::success);
  sender.close();
  CHECK(receiver.receive(dst, got).wait_for(hang_bound) == transfer_state::failed);
}

TEST_CASE("tcp: cancelling a send grouped behind another that waits for ring room ends it at once",
          "[tcp][concurrency]") {
  FERRY_REQUIRE_URING();
  group_waiting_for_room g;
  uring::tcp_connection receiver(g.r, g.peer);
  g.r.cancel(g.b2);  // nothing of it reached the kernel: it leaves the group
  REQUIRE(g.b2.wait_for(hang_bound) == transfer_state::cancelled);
  CHECK(g.b1.wait_for(20ms) == transfer_state::pending);

  g.stall.release();
  REQUIRE(g.b1.wait_for(hang_bound) == transfer_state::success);
  std::vector<std::byte> dst(100);
  uring::received_block got;
  REQUIRE(receiver.receive(dst, got).wait_for(hang_bound) == transfer_state::success);
  CHECK(got.id == 2);
  CHECK(dst == g.pb1);
  g.sender.close();
  CHECK(receiver.receive(dst, got).wait_for(hang_bound) == transfer_state::failed);
}

TEST_CASE("tcp: random cancels of stalled sends: every one ends, and the peer gets exactly the "
          "frames that succeeded, in order",
          "[tcp][concurrency]") {
  FERRY_REQUIRE_URING();
  ferry::progress_executor exec;
  std::mt19937 rng(7);
  for (int round = 0; round < 100; ++round) {
    // A ring with room for everything, or one so small that groups also wait in the backlog.
    uring::ring r(exec, uring::ring_options{.entries = rng() % 2 == 0 ? 1u : 64u});
    int sv[2];
    REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
    const std::size_t filled = fill_socket(sv[0]);
    const std::size_t n = 2 + rng() % 10;
    std::vector<std::vector<std::byte>> payloads;
    std::vector<ferry::transfer> sends;
    uring::tcp_connection sender(r, sv[0]);
    for (std::size_t i = 0; i < n; ++i) {
      payloads.push_back(byte_pattern(1 + rng() % (rng() % 3 != 0 ? 200 : 300000), round * 16 + i));
      sends.push_back(sender.send(i, payloads.back()));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % 3000));
    for (const auto& t : sends) {
      if (rng() % 2 == 0) continue;
      r.cancel(t);
      if (rng() % 4 == 0) std::this_thread::sleep_for(std::chrono::microseconds(rng() % 500));
    }
    std::vector<std::uint64_t> received;
    bool intact = true;
    std::thread peer([&, fd = sv[1]] {
      uring::tcp_connection receiver(r, fd);
      if (!read_exactly(fd, filled)) {
        intact = false;
        return;
      }
      std::vector<std::byte> dst(300000);
      for (;;) {
        uring::received_block got;
        if (receiver.receive(dst, got).wait_for(hang_bound) != transfer_state::success) break;
        if (got.id >= n || got.length != payloads[got.id].size() ||
            !std::equal(payloads[got.id].begin(), payloads[got.id].end(), dst.begin())) {
          intact = false;
        }
        received.push_back(got.id);
      }
    });
    REQUIRE(ferry::drain(sends, hang_bound).pending == 0);
    sender.close();
    peer.join();
    std::vector<std::uint64_t> succeeded;
    for (std::size_t i = 0; i < n; ++i) {
      if (sends[i].state() == transfer_state::success) succeeded.push_back(i);
    }
    REQUIRE(intact);
    REQUIRE(received == succeeded);
  }
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
  CHECK(refused.error() == ferry::uring::errc::connection_closed);
}

TEST_CASE("tcp: a severed connection fails what is in flight, queued and later with the reason "
          "given",
          "[tcp][concurrency]") {
  FERRY_REQUIRE_URING();
  ferry::progress_executor exec;
  uring::ring r(exec);
  int sv[2];
  REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
  const std::size_t filled = fill_socket(sv[0]);  // sends stall: the peer reads nothing
  (void)filled;
  auto conn = std::make_shared<uring::tcp_connection>(r, sv[0]);  // as named_peer holds it
  const auto payload = byte_pattern(100, 1);
  ferry::transfer send_in_flight = conn->send(1, payload);
  ferry::transfer send_queued = conn->send(2, payload);
  std::vector<std::byte> dst(100);
  uring::received_block a, b;
  ferry::transfer receive_in_flight = conn->receive(dst, a);
  ferry::transfer receive_queued = conn->receive(dst, b);
  CHECK(send_in_flight.wait_for(20ms) == transfer_state::pending);
  CHECK(receive_in_flight.state() == transfer_state::pending);
  const std::error_code why = std::make_error_code(std::errc::owner_dead);  // a directory's, say
  conn->sever(why);
  for (ferry::transfer* t : {&send_in_flight, &send_queued, &receive_in_flight, &receive_queued}) {
    REQUIRE(t->wait_for(hang_bound) == transfer_state::failed);
    CHECK(t->error() == why);
  }
  CHECK(conn->send(3, payload).error() == why);
  CHECK(conn->receive(dst, a).error() == why);
  conn->sever(std::make_error_code(std::errc::io_error));  // the first reason stays
  CHECK(conn->send(4, payload).error() == why);
  ::close(sv[1]);
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

TEST_CASE("tcp: a receive whose frame has arrived is not held up behind idle receives elsewhere",
          "[tcp][concurrency]") {
  // Room for one receive: `busy`'s waits in the kernel, `idle`'s (whose peer never sends) waits for
  // room. busy's header arrives; the rest of its frame must go on in the place it had. Queued
  // behind idle's receive, it would wait until idle's peer sends, which a peer waiting on this
  // frame never does.
  FERRY_REQUIRE_URING();
  ferry::progress_executor exec;
  uring::ring r(exec, uring::ring_options{.entries = 1});
  connected_pair busy(r), idle(r);
  std::vector<std::byte> busy_dst(100), idle_dst(100);
  uring::received_block busy_got, idle_got;
  const auto submitted = r.counters().submitted;
  ferry::transfer busy_receive = busy.server.receive(busy_dst, busy_got);
  REQUIRE(wait_until([&] { return r.counters().submitted > submitted; }));
  const auto backlogged = r.counters().backlogged;
  ferry::transfer idle_receive = idle.server.receive(idle_dst, idle_got);
  REQUIRE(wait_until([&] { return r.counters().backlogged > backlogged; }));

  const auto payload = byte_pattern(100, 4);
  REQUIRE(busy.client.send(1, payload).wait_for(hang_bound) == transfer_state::success);
  REQUIRE(busy_receive.wait_for(hang_bound) == transfer_state::success);
  CHECK(busy_dst == payload);
  CHECK(idle_receive.state() == transfer_state::pending);
  REQUIRE(idle.client.send(2, payload).wait_for(hang_bound) == transfer_state::success);
  REQUIRE(idle_receive.wait_for(hang_bound) == transfer_state::success);
  CHECK(idle_got.id == 2);
}

TEST_CASE("tcp: closing a connection ends its work that waits for room in the ring",
          "[tcp][concurrency]") {
  // Waiting for room, it never reached the kernel: close() must end it there, not leave it to go
  // out later on a closed socket, with buffers its owner has freed once close() and a drain said
  // everything had ended.
  FERRY_REQUIRE_URING();
  ferry::progress_executor exec;
  uring::ring r(exec, uring::ring_options{.entries = 1});
  SECTION("a receive") {
    connected_pair holder(r), closing(r);
    std::vector<std::byte> dst(100);
    uring::received_block got, held_got;
    const auto submitted = r.counters().submitted;
    ferry::transfer held = holder.server.receive(dst, held_got);  // the one receive slot
    REQUIRE(wait_until([&] { return r.counters().submitted > submitted; }));
    const auto backlogged = r.counters().backlogged;
    ferry::transfer waiting = closing.server.receive(dst, got);
    REQUIRE(wait_until([&] { return r.counters().backlogged > backlogged; }));
    closing.server.close();
    REQUIRE(waiting.wait_for(hang_bound) == transfer_state::cancelled);
    CHECK(held.state() == transfer_state::pending);
  }
  SECTION("a group of sends") {
    group_waiting_for_room g;
    fd_guard peer(g.peer);
    g.sender.close();
    REQUIRE(g.b1.wait_for(hang_bound) == transfer_state::cancelled);
    REQUIRE(g.b2.wait_for(hang_bound) == transfer_state::cancelled);
  }
}

TEST_CASE("tcp: frames a short sendmsg sent whole succeed at once, and cancelling one then "
          "leaves the frames behind it alone",
          "[tcp][concurrency]") {
  // One sendmsg moves at most MAX_RW_COUNT bytes. For the group [lead, next, big] it returns with
  // lead and next whole and `big` part-way, and the rest goes out in a second sendmsg, which stalls
  // here on a peer that has stopped reading. lead and next are done: they succeed then, and a cancel
  // of either must not stop that sendmsg, which would cut `big` (nobody cancelled it) and break
  // the connection.
  FERRY_REQUIRE_URING();
  ferry::progress_executor exec;
  uring::ring r(exec);
  socket_pair sockets;
  fd_guard peer_end(sockets.second());
  const std::size_t filled = fill_socket(sockets.first());
  uring::tcp_connection sender(r, sockets.first());
  const std::size_t max_rw = max_rw_count();
  constexpr std::size_t header = sizeof(uring::detail::frame_header);
  const std::size_t big_size = std::size_t{3} << 30;
  void* zeros = ::mmap(nullptr, big_size, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                       -1, 0);
  REQUIRE(zeros != MAP_FAILED);
  const auto small = byte_pattern(100, 1);
  ferry::transfer first = sender.send(0, small);  // stalls on the full socket, alone in its group
  ferry::transfer lead = sender.send(1, small);
  ferry::transfer next = sender.send(2, small);
  ferry::transfer big = sender.send(3, std::span(static_cast<const std::byte*>(zeros), big_size));
  std::atomic<int> step{0};
  std::atomic<bool> peer_ok{true};
  std::thread peer([&] {
    // The filler and the first frame; when told, one sendmsg's worth; when told again, the rest.
    if (!read_exactly(sockets.second(), filled + header + small.size())) peer_ok = false;
    while (step.load() < 1) std::this_thread::sleep_for(1ms);
    if (!read_exactly(sockets.second(), max_rw)) peer_ok = false;
    while (step.load() < 2) std::this_thread::sleep_for(1ms);
    if (!read_exactly(sockets.second(), 3 * header + 2 * small.size() + big_size - max_rw)) {
      peer_ok = false;
    }
  });
  struct peer_guard {
    std::thread& thread;
    std::atomic<int>& step;
    int fd;
    ~peer_guard() {
      if (!thread.joinable()) return;
      step = 2;
      ::shutdown(fd, SHUT_RDWR);
      thread.join();
    }
  } guard{peer, step, sockets.second()};
  REQUIRE(first.wait_for(hang_bound) == transfer_state::success);
  step = 1;
  // The first sendmsg comes back short; lead and next are done while the rest of big stalls.
  REQUIRE(lead.wait_for(hang_bound) == transfer_state::success);
  REQUIRE(next.wait_for(hang_bound) == transfer_state::success);
  CHECK(big.state() == transfer_state::pending);
  r.cancel(next);
  r.cancel(lead);
  CHECK(big.wait_for(100ms) == transfer_state::pending);
  step = 2;
  REQUIRE(big.wait_for(std::chrono::seconds(60)) == transfer_state::success);
  peer.join();
  REQUIRE(peer_ok);
  ::munmap(zeros, big_size);
}

TEST_CASE("tcp: a send waiting for its share of the ring is not starved by file I/O that keeps "
          "coming",
          "[tcp][concurrency]") {
  // A ring of one entry: one send may be in flight, and it stalls on a full socket; a second send
  // waits for room. File reads that resubmit themselves at once keep the file backlog full. When the
  // stalled send completes, the waiting send was there first and must get the room it leaves.
  FERRY_REQUIRE_URING();
  ferry::progress_executor exec;
  uring::ring r(exec, uring::ring_options{.entries = 1});
  socket_pair stalled_pair, free_pair;
  fd_guard stalled_peer(stalled_pair.second()), free_peer(free_pair.second());
  const std::size_t filled = fill_socket(stalled_pair.first());
  uring::tcp_connection stalled(r, stalled_pair.first()), waiting(r, free_pair.first());
  fd_guard zero(::open("/dev/zero", O_RDONLY | O_CLOEXEC));
  REQUIRE(zero.get() >= 0);
  const auto payload = byte_pattern(100, 7);
  const auto submitted = r.counters().submitted;
  ferry::transfer stalled_send = stalled.send(1, payload);
  REQUIRE(wait_until([&] { return r.counters().submitted > submitted; }));
  const auto backlogged = r.counters().backlogged;
  ferry::transfer waiting_send = waiting.send(2, payload);
  REQUIRE(wait_until([&] { return r.counters().backlogged > backlogged; }));

  relentless_reads file;
  std::vector<std::vector<std::byte>> buffers(16, std::vector<std::byte>(64));
  for (auto& b : buffers) file.start(r, zero.get(), b, 0);
  REQUIRE(wait_until([&] { return file.reads.load() > 1000; }));
  REQUIRE(read_exactly(stalled_pair.second(), filled));  // the stalled send goes out
  REQUIRE(stalled_send.wait_for(hang_bound) == transfer_state::success);
  const transfer_state waited = waiting_send.wait_for(hang_bound);
  file.stop.store(true);
  REQUIRE(wait_until([&] { return file.readers.load() == 0; }));
  REQUIRE(waited == transfer_state::success);
}

TEST_CASE("tcp: a frame cut part-way by a cancel ends the peer's receive instead of leaving it "
          "waiting",
          "[tcp][concurrency]") {
  FERRY_REQUIRE_URING();
  ferry::progress_executor exec;
  uring::ring r(exec);
  connected_pair c(r);
  const auto big = byte_pattern(64 << 20, 6);
  const auto submitted = r.counters().submitted;
  ferry::transfer cut = c.client.send(1, big);  // nobody reads yet: it stalls part-way
  // Once the sendmsg is in, the socket buffers hold part of the frame (the kernel's first attempt
  // runs inside the submitting call).
  REQUIRE(wait_until([&] { return r.counters().submitted > submitted; }));
  std::this_thread::sleep_for(10ms);
  r.cancel(cut);
  // Part of it reached the peer: not "cancelled", which means nothing happened.
  REQUIRE(cut.wait_for(hang_bound) == transfer_state::failed);
  CHECK(cut.error() == ferry::uring::errc::cancelled_part_way);
  ferry::transfer after = c.client.send(2, std::span(big).first(10));
  REQUIRE(after.wait_for(hang_bound) == transfer_state::failed);
  REQUIRE(after.error() == ferry::uring::errc::connection_broken);  // it was cut, not at a boundary

  // The peer has the header and part of the payload; the rest never comes, and it is told so.
  std::vector<std::byte> dst(big.size());
  uring::received_block got;
  ferry::transfer receive = c.server.receive(dst, got);
  REQUIRE(receive.wait_for(hang_bound) == transfer_state::failed);
  CHECK(receive.error() == ferry::uring::errc::connection_closed);
  CHECK(got.length == big.size());
  // The other direction is untouched.
  const auto reply = byte_pattern(100, 8);
  std::vector<std::byte> reply_dst(100);
  REQUIRE(c.server.send(3, reply).wait_for(hang_bound) == transfer_state::success);
  REQUIRE(c.client.receive(reply_dst, got).wait_for(hang_bound) == transfer_state::success);
  CHECK(reply_dst == reply);
}

TEST_CASE("tcp: room that comes back goes to the oldest waiter, not to the work started next",
          "[tcp][concurrency]") {
  // A ring of one entry, its room outside the cancel share all held by reads on pipes; a send waits
  // for room. Each read, once its byte arrives, completes and its coroutine reads again at once, on
  // the executor, in the same round that freed the room. The send was waiting first: it must get
  // that room, however many reads come after it.
  FERRY_REQUIRE_URING();
  ferry::progress_executor exec;
  uring::ring r(exec, uring::ring_options{.entries = 1});
  const unsigned n = r.in_flight_limit() - 1;  // the room besides the cancel share
  pipe_set fds(n);
  std::vector<fd_guard>& read_ends = fds.read_ends;
  std::vector<fd_guard>& write_ends = fds.write_ends;
  relentless_reads pipes;
  std::vector<std::vector<std::byte>> buffers(n, std::vector<std::byte>(1));
  const auto submitted = r.counters().submitted;
  for (unsigned i = 0; i < n; ++i) {
    pipes.start(r, read_ends[i].get(), buffers[i], uring::current_position);
  }
  REQUIRE(wait_until([&] { return r.counters().submitted >= submitted + n; }));
  socket_pair sockets;
  fd_guard peer(sockets.second());
  uring::tcp_connection conn(r, sockets.first());
  const auto backlogged = r.counters().backlogged;
  ferry::transfer send = conn.send(1, byte_pattern(100, 3));  // the peer has room: done once issued
  REQUIRE(wait_until([&] { return r.counters().backlogged > backlogged; }));
  for (int k = 0; k < 100 && send.state() == transfer_state::pending; ++k) {
    const long before = pipes.reads.load();
    REQUIRE(::write(write_ends[k % n].get(), "x", 1) == 1);
    REQUIRE(wait_until([&] { return pipes.reads.load() > before; }));
  }
  const transfer_state sent = send.wait_for(hang_bound);
  for (fd_guard& w : write_ends) w.reset(-1);  // the reads end (end of file), and their readers
  REQUIRE(wait_until([&] { return pipes.readers.load() == 0; }));
  CHECK(sent == transfer_state::success);
}

TEST_CASE("tcp: sends stalled on full sockets leave room in the ring for file I/O",
          "[tcp][concurrency]") {
  // A ring of one entry holds three operations besides cancels; sends take at most their share, so
  // however many connections have a send stuck on a peer that does not read, a read gets in.
  FERRY_REQUIRE_URING();
  ferry::progress_executor exec;
  uring::ring r(exec, uring::ring_options{.entries = 1});
  std::vector<socket_pair> sockets(r.in_flight_limit());
  std::vector<fd_guard> peers(sockets.size());
  std::vector<uring::tcp_connection> senders;
  std::vector<ferry::transfer> sends;
  const auto payload = byte_pattern(100, 2);
  for (std::size_t i = 0; i < sockets.size(); ++i) {
    const socket_pair& p = sockets[i];
    peers[i].reset(p.second());
    (void)fill_socket(p.first());
    senders.emplace_back(r, p.first());
    sends.push_back(senders.back().send(1, payload));
  }
  int pipe_fds[2];
  REQUIRE(::pipe2(pipe_fds, O_CLOEXEC) == 0);
  fd_guard rd(pipe_fds[0]), wr(pipe_fds[1]);
  REQUIRE(::write(wr.get(), "k", 1) == 1);
  std::vector<std::byte> one(1);
  ferry::transfer read = r.read(rd.get(), one, uring::current_position);
  REQUIRE(read.wait_for(hang_bound) == transfer_state::success);
  CHECK(one[0] == std::byte{'k'});
  for (const auto& t : sends) CHECK(t.state() == transfer_state::pending);
  peers.clear();  // the peers go: every stalled send fails
  REQUIRE(ferry::drain(sends, hang_bound).pending == 0);
}

namespace {

// A completion source that, when asked, holds the executor inside its poll() for a while.
struct executor_holder {
  std::atomic<int> hold_ms{0};
  std::atomic<bool> holding{false};
  std::size_t poll(std::size_t) noexcept {
    if (const int ms = hold_ms.exchange(0)) {
      holding = true;
      std::this_thread::sleep_for(std::chrono::milliseconds(ms));
      holding = false;
    }
    return 0;
  }
};

}  // namespace

TEST_CASE("tcp: a parking executor still finds a frame behind many receives that got part of one",
          "[tcp][concurrency]") {
  FERRY_REQUIRE_URING();
  // 200 receives get 10 bytes each (the kernel retries each, posting nothing) and one gets a whole
  // header, all while the executor is held. The kernel runs a limited number of such items per
  // call (20 since Linux 6.13) and does not signal the rest: parking after one call would leave
  // the frame's completion queued in the kernel, with nothing to wake the executor.
  ferry::progress_executor exec(ferry::executor_options{.mode = ferry::progress_mode::park});
  executor_holder holder;
  constexpr int partial = 200;
  std::vector<std::vector<std::byte>> bufs(partial + 1, std::vector<std::byte>(64));
  std::vector<uring::received_block> got(partial + 1);
  std::deque<fd_guard> peers;  // fd_guard does not move
  {
    uring::ring r(exec);
    exec.add_source(holder);
    std::vector<uring::tcp_connection> conns;
    for (int i = 0; i <= partial; ++i) {
      int sv[2];
      REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
      conns.emplace_back(r, sv[0]);
      peers.emplace_back(sv[1]);
    }
    std::vector<ferry::transfer> ts;
    for (int i = 0; i <= partial; ++i) ts.push_back(conns[i].receive(bufs[i], got[i]));
    REQUIRE(wait_until([&] { return r.counters().submitted >= partial + 1u; }));
    holder.hold_ms = 300;
    exec.notify();
    REQUIRE(wait_until([&] { return holder.holding.load(); }));
    const char part[10] = {};
    for (int i = 0; i < partial; ++i) REQUIRE(::write(peers[i].get(), part, sizeof part) == 10);
    uring::detail::frame_header h;
    h.id = 7;
    REQUIRE(::write(peers[partial].get(), &h, sizeof h) == sizeof h);
    REQUIRE(ts[partial].wait_for(hang_bound) == transfer_state::success);
    CHECK(got[partial].id == 7);
    conns.clear();
    peers.clear();
    CHECK(ferry::drain(ts, hang_bound).pending == 0);
    exec.remove_source(holder);
  }
}

TEST_CASE("tcp: with 16 KiB socket buffers, set before the handshake, rounds of sends and random "
          "cancels all complete, and the peer gets exactly the frames that succeeded, in order",
          "[tcp][concurrency]") {
  FERRY_REQUIRE_URING();
  // Buffers far below loopback's MSS (65483) move every frame of more than a few KiB in many
  // pieces, a sendmsg and a recv each waiting on the socket again and again (MSG_WAITALL), while
  // cancels stop them part-way or between frames. Set before the handshake (tcp_options), the
  // MSS it settles fits them. Set on an established connection instead, they leave the sender
  // holding segments too large for any window the receiver offers, moved only by the kernel's
  // persist and retransmission timers (README, io_uring TCP): 0.2 s or more per connection, on
  // plain sockets as much as here.
  constexpr int buffer_bytes = 16 << 10;
  const uring::tcp_options small{.send_buffer = buffer_bytes, .receive_buffer = buffer_bytes};
  ferry::progress_executor exec;
  uring::ring r(exec);
  std::mt19937 rng(23);
  for (int round = 0; round < 200; ++round) {
    uring::tcp_listener listener("127.0.0.1", 0, 64, small);
    uring::tcp_connection sender =
        uring::tcp_connection::connect(r, "127.0.0.1", listener.port(), small);
    uring::tcp_connection receiver = listener.accept(r);
    REQUIRE(socket_buffer(receiver.native_handle(), SO_RCVBUF) <= 2 * buffer_bytes);
    const std::size_t n = 2 + rng() % 10;
    std::vector<std::vector<std::byte>> payloads;
    for (std::size_t i = 0; i < n; ++i) {
      payloads.push_back(byte_pattern(1 + rng() % (rng() % 3 != 0 ? 200 : 300000), round * 16 + i));
    }
    std::vector<std::uint64_t> received;
    bool intact = true;
    bool hung = false;
    std::thread peer([&] {
      std::vector<std::byte> dst(300000);
      for (;;) {
        uring::received_block got;
        ferry::transfer t = receiver.receive(dst, got);
        const transfer_state st = t.wait_for(hang_bound);
        if (st == transfer_state::pending) hung = true;
        if (st != transfer_state::success) break;
        if (got.id >= n || got.length != payloads[got.id].size() ||
            !std::equal(payloads[got.id].begin(), payloads[got.id].end(), dst.begin())) {
          intact = false;
        }
        received.push_back(got.id);
      }
    });
    std::vector<ferry::transfer> sends;
    for (std::size_t i = 0; i < n; ++i) sends.push_back(sender.send(i, payloads[i]));
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % 3000));
    for (const auto& t : sends) {
      if (rng() % 2 == 0) r.cancel(t);
    }
    const bool sends_ended = ferry::drain(sends, hang_bound).pending == 0;
    sender.close();  // the peer's next receive fails: the round's end
    peer.join();
    REQUIRE(sends_ended);
    REQUIRE_FALSE(hung);
    std::vector<std::uint64_t> succeeded;
    for (std::size_t i = 0; i < n; ++i) {
      if (sends[i].state() == transfer_state::success) succeeded.push_back(i);
    }
    REQUIRE(intact);
    REQUIRE(received == succeeded);
  }
}

TEST_CASE("tcp: tcp_options set the socket buffers before the handshake, on the connecting socket "
          "and on the listener, whose accepted connections inherit them",
          "[tcp]") {
  FERRY_REQUIRE_URING();
  constexpr int buffer_bytes = 16 << 10;
  ferry::progress_executor exec;
  uring::ring r(exec);
  connected_pair defaults(r);
  const int default_send = socket_buffer(defaults.client.native_handle(), SO_SNDBUF);
  const int default_receive = socket_buffer(defaults.client.native_handle(), SO_RCVBUF);
  CAPTURE(default_send, default_receive);
  // The checks below tell a set buffer from an untouched one only if the defaults are larger.
  REQUIRE(default_send > 2 * buffer_bytes);
  REQUIRE(default_receive > 2 * buffer_bytes);
  const auto is_set = [&](int bytes) { return bytes > 0 && bytes <= 2 * buffer_bytes; };

  SECTION("both buffers on both sides") {
    const uring::tcp_options small{.send_buffer = buffer_bytes, .receive_buffer = buffer_bytes};
    uring::tcp_listener listener("127.0.0.1", 0, 64, small);
    uring::tcp_connection client =
        uring::tcp_connection::connect(r, "127.0.0.1", listener.port(), small);
    uring::tcp_connection server = listener.accept(r);
    for (const int fd : {client.native_handle(), server.native_handle()}) {
      CHECK(is_set(socket_buffer(fd, SO_SNDBUF)));
      CHECK(is_set(socket_buffer(fd, SO_RCVBUF)));
    }
  }
  SECTION("each field sets only its own buffer") {
    uring::tcp_listener listener("127.0.0.1", 0, 64,
                                 uring::tcp_options{.receive_buffer = buffer_bytes});
    uring::tcp_connection client = uring::tcp_connection::connect(
        r, "127.0.0.1", listener.port(), uring::tcp_options{.send_buffer = buffer_bytes});
    uring::tcp_connection server = listener.accept(r);
    CHECK(is_set(socket_buffer(client.native_handle(), SO_SNDBUF)));
    CHECK_FALSE(is_set(socket_buffer(client.native_handle(), SO_RCVBUF)));
    CHECK_FALSE(is_set(socket_buffer(server.native_handle(), SO_SNDBUF)));
    CHECK(is_set(socket_buffer(server.native_handle(), SO_RCVBUF)));
  }
}

TEST_CASE("tcp: a negative buffer size in tcp_options is rejected, naming the field", "[tcp]") {
  FERRY_REQUIRE_URING();
  ferry::progress_executor exec;
  uring::ring r(exec);
  uring::tcp_listener listener("127.0.0.1", 0);
  CHECK_THROWS_AS(uring::tcp_connection::connect(r, "127.0.0.1", listener.port(),
                                                 uring::tcp_options{.send_buffer = -1}),
                  std::invalid_argument);
  CHECK_THROWS_WITH(uring::tcp_connection::connect(r, "127.0.0.1", listener.port(),
                                                   uring::tcp_options{.send_buffer = -1}),
                    Catch::Contains("send_buffer"));
  CHECK_THROWS_WITH(uring::tcp_connection::connect(r, "127.0.0.1", listener.port(),
                                                   uring::tcp_options{.receive_buffer = -16384}),
                    Catch::Contains("receive_buffer"));
  const uring::tcp_options bad_receive{.receive_buffer = -1};
  CHECK_THROWS_AS(uring::tcp_listener("127.0.0.1", 0, 64, bad_receive), std::invalid_argument);
  CHECK_THROWS_WITH(uring::tcp_listener("127.0.0.1", 0, 64, bad_receive),
                    Catch::Contains("receive_buffer"));
  CHECK_THROWS_WITH(uring::tcp_listener("127.0.0.1", 0, 64, uring::tcp_options{.send_buffer = -1}),
                    Catch::Contains("send_buffer"));
}

namespace {

// A plain socket bound to `source` (an address in 127.0.0.0/8) and connected to 127.0.0.1:`port`.
int connect_from(const char* source, std::uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(fd >= 0);
  sockaddr_in from{};
  from.sin_family = AF_INET;
  REQUIRE(::inet_pton(AF_INET, source, &from.sin_addr) == 1);
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&from), sizeof from) == 0);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(port);
  to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof to) == 0);
  return fd;
}

}  // namespace

TEST_CASE("tcp: a metered ring records sends and receives per peer address, besides the totals",
          "[tcp]") {
  FERRY_REQUIRE_URING();
  ferry::metrics::registry metrics("uring");
  constexpr std::size_t blocks = 3;
  {
    ferry::progress_executor exec;
    uring::ring_options options;
    options.metrics = &metrics;
    uring::ring r(exec, options);
    uring::tcp_listener listener("127.0.0.1", 0);
    // Two hosts' connections (127.0.0.2 and 127.0.0.3) into one server: on the server's side each
    // peer is its own series; on the clients' side both connections are to one peer, 127.0.0.1.
    std::vector<uring::tcp_connection> clients;
    std::vector<uring::tcp_connection> servers;
    for (const char* source : {"127.0.0.2", "127.0.0.3"}) {
      clients.push_back(uring::tcp_connection::adopt_socket(r, connect_from(source, listener.port())));
      servers.push_back(listener.accept(r));
    }
    const std::vector<std::byte> payload = byte_pattern(1000, 5);
    std::vector<std::vector<std::byte>> dst(2 * blocks, std::vector<std::byte>(1000));
    std::vector<uring::received_block> got(2 * blocks);
    std::vector<ferry::transfer> ts;
    for (std::size_t c = 0; c < 2; ++c) {
      for (std::size_t i = 0; i < blocks; ++i) {
        ts.push_back(servers[c].receive(dst[c * blocks + i], got[c * blocks + i]));
        ts.push_back(clients[c].send(i, payload));
      }
    }
    REQUIRE(ferry::wait_all(ts, hang_bound).ok());
  }
  const ferry::metrics::snapshot s = metrics.snapshot();
  auto find = [&](const std::string& kind, const std::string& peer) { return find_series(s, kind, peer); };
  CHECK(find("send", "").succeeded == 2 * blocks);
  CHECK(find("receive", "").succeeded == 2 * blocks);
  const auto sends = find("send", "127.0.0.1");
  CHECK(sends.succeeded == 2 * blocks);
  CHECK(sends.bytes == 2 * blocks * 1000);
  for (const char* peer : {"127.0.0.2", "127.0.0.3"}) {
    const auto receives = find("receive", peer);
    CHECK(receives.succeeded == blocks);
    CHECK(receives.bytes == blocks * 1000);
    CHECK(receives.latency_sum_ns > 0);
  }
  for (const auto& o : s.operations) {
    CHECK_FALSE((o.kind == "send" && o.peer != "" && o.peer != "127.0.0.1"));
  }
}

TEST_CASE("tcp: an IPv6 peer is labelled by its address", "[tcp]") {
  FERRY_REQUIRE_URING();
  ferry::metrics::registry metrics("uring");
  {
    ferry::progress_executor exec;
    uring::ring_options options;
    options.metrics = &metrics;
    uring::ring r(exec, options);
    std::optional<uring::tcp_listener> listener;
    try {
      listener.emplace("::1", 0);
    } catch (const std::system_error& e) {
      WARN("no IPv6 loopback here (" << e.what() << "): not checked");
      return;
    }
    uring::tcp_connection client = uring::tcp_connection::connect(r, "::1", listener->port());
    uring::tcp_connection server = listener->accept(r);
    std::vector<std::byte> dst(16);
    uring::received_block got;
    const std::vector<std::byte> payload = byte_pattern(16, 1);
    std::vector<ferry::transfer> ts{server.receive(dst, got), client.send(1, payload)};
    REQUIRE(ferry::wait_all(ts, hang_bound).ok());
  }
  std::size_t labelled = 0;
  for (const auto& o : metrics.snapshot().operations) {
    if (!o.peer.empty()) {
      CHECK(o.peer == "::1");
      ++labelled;
    }
  }
  CHECK(labelled == 2);
}

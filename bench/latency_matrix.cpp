// The latency matrix: the depth-1 round trip of every real path ferry has here, in each executor
// mode, against a raw baseline of the same path measured in the same run.
//
//   ferry_latency_matrix [--quick] [--rounds N] [--passes N] [--paths file,tcp,ucx-tcp,ucx-shm,loopback]
//
// Paths and their round trips (block: 4 KiB and 64 KiB):
//   file      a read of one block at a random block-aligned offset of a file (O_DIRECT where the file
//             system takes it), awaited before the next. Raw: liburing, io_uring_submit_and_wait.
//   tcp       ferry's io_uring TCP: a framed block to a server process and the server's framed block
//             back. Raw: blocking sockets (TCP_NODELAY), write then read, the server read then write.
//   ucx-tcp,  a UCX get of one block from a server process's memory (the decode side pulling a KV
//   ucx-shm   block): over tcp the server's worker must run to answer, over shm the get is a copy the
//             initiator makes. Raw: ucp_get_nbx, the server's worker progressed in a busy loop (as
//             ucx_perftest does).
//   loopback  ferry's loopback backend copying one block on its executor. Raw: a copier thread that
//             spins on a request word, copies and publishes.
//
// Every ferry side, client and server, waits as an engine does: a coroutine co_awaits each transfer
// on a run_loop the thread drives (sync_wait), with the progress executor in the mode of the row, on
// both sides. CPU per round trip is each process's whole CPU time (user and system, every thread:
// the executor's too) over the measured rounds, divided by their number; the server's is its own.
// The servers are this program run again (posix_spawn of /proc/self/exe with --serve), so that each
// side is a process as it would be between two engines.
//
// Each runner (raw, busy, adaptive, park) of a path and block runs `--passes` times, the runners of
// a pass in a new order; the figures are medians over passes. The mean is shown beside p50 and p99:
// a stall of a scheduler tick in a few percent of round trips barely moves a p50 and shows in the
// mean. Targets (reported, never asserted): mean within 1.2x the raw baseline in busy mode, 2x in
// adaptive mode, 4x in park mode.

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <ferry/ferry.hpp>
#include <ferry/loopback.hpp>
#include <ferry/sync_wait.hpp>
#include <ferry/task.hpp>

#if FERRY_BENCH_URING
#include <liburing.h>

#include <ferry/uring/aligned_buffer.hpp>
#include <ferry/uring/ring.hpp>
#include <ferry/uring/tcp.hpp>
#endif
#if FERRY_BENCH_UCX
#include <ucp/api/ucp.h>

#include <ferry/ucx/worker.hpp>
#endif

extern char** environ;

namespace {

using namespace std::chrono_literals;
using clk = std::chrono::steady_clock;

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(clk::now().time_since_epoch()).count();
}

// This process's CPU time, user and system, every thread.
double process_cpu_ns() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return (static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) * 1e9) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e3;
}

[[noreturn]] void fail(const std::string& what) { throw std::runtime_error(what); }

void check(const ferry::transfer& t, const char* what) {
  if (t.state() != ferry::transfer_state::success) {
    fail(std::string(what) + ": " + t.error().message());
  }
}

ferry::progress_mode mode_named(const std::string& s) {
  if (s == "busy") return ferry::progress_mode::busy;
  if (s == "adaptive") return ferry::progress_mode::adaptive;
  if (s == "park") return ferry::progress_mode::park;
  fail("unknown executor mode '" + s + "'");
}

ferry::executor_options executor_in(const std::string& mode) {
  ferry::executor_options o;
  o.mode = mode_named(mode);
  return o;
}

std::string hex(std::span<const std::byte> b) {
  static const char* digits = "0123456789abcdef";
  std::string s;
  for (std::byte x : b) {
    s += digits[std::to_integer<unsigned>(x) >> 4];
    s += digits[std::to_integer<unsigned>(x) & 15];
  }
  return s;
}

std::vector<std::byte> unhex(const std::string& s) {
  std::vector<std::byte> b(s.size() / 2);
  for (std::size_t i = 0; i < b.size(); ++i) {
    b[i] = static_cast<std::byte>(std::stoul(s.substr(2 * i, 2), nullptr, 16));
  }
  return b;
}

// ---------------------------------------------------------------------------------- the rounds

// What one runner measured: each round trip, and CPU per round trip on each side (the server's is
// NaN where there is no server process).
struct measured {
  std::vector<double> rt_ns;
  double client_cpu_ns = 0;
  double server_cpu_ns = NAN;
};

// Measures `rounds` calls of `one` (each one round trip) after `warm` unmeasured ones; `go` and
// `stop` are called around the measured ones (they tell a server to start and stop counting).
template <class One, class Go, class Stop>
measured time_rounds(int warm, int rounds, One one, Go go, Stop stop) {
  for (int i = 0; i < warm; ++i) one();
  go();
  measured m;
  m.rt_ns.reserve(static_cast<std::size_t>(rounds));
  const double cpu0 = process_cpu_ns();
  for (int i = 0; i < rounds; ++i) {
    const std::int64_t t0 = now_ns();
    one();
    m.rt_ns.push_back(static_cast<double>(now_ns() - t0));
  }
  m.client_cpu_ns = (process_cpu_ns() - cpu0) / rounds;
  m.server_cpu_ns = stop() / rounds;
  return m;
}

template <class One>
measured time_rounds(int warm, int rounds, One one) {
  return time_rounds(warm, rounds, one, [] {}, [] { return NAN; });
}

// The same, for a ferry side: each round trip is `one()`'s task, awaited in a coroutine on a
// run_loop this thread drives, as an engine's coroutine would.
template <class One, class Go, class Stop>
measured time_task_rounds(int warm, int rounds, One one, Go go, Stop stop) {
  return ferry::sync_wait([&]() -> ferry::task<measured> {
    for (int i = 0; i < warm; ++i) co_await one();
    go();
    measured m;
    m.rt_ns.reserve(static_cast<std::size_t>(rounds));
    const double cpu0 = process_cpu_ns();
    for (int i = 0; i < rounds; ++i) {
      const std::int64_t t0 = now_ns();
      co_await one();
      m.rt_ns.push_back(static_cast<double>(now_ns() - t0));
    }
    m.client_cpu_ns = (process_cpu_ns() - cpu0) / rounds;
    m.server_cpu_ns = stop() / rounds;
    co_return m;
  }());
}

// ------------------------------------------------------------------------------ server processes

// A server: this program run again with --serve and its role. It answers one line on stdout
// ("ready ..."), starts counting its CPU time at "go" on its stdin and, at "stop", prints
// "cpu NANOSECONDS" and exits.
class server_process {
 public:
  explicit server_process(const std::vector<std::string>& role) {
    int in[2], out[2];
    if (::pipe2(in, O_CLOEXEC) != 0 || ::pipe2(out, O_CLOEXEC) != 0) fail("pipe2");
    posix_spawn_file_actions_t fa;
    ::posix_spawn_file_actions_init(&fa);
    ::posix_spawn_file_actions_adddup2(&fa, in[0], 0);
    ::posix_spawn_file_actions_adddup2(&fa, out[1], 1);
    std::vector<std::string> args{"ferry_latency_matrix", "--serve"};
    args.insert(args.end(), role.begin(), role.end());
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const int rc = ::posix_spawn(&pid_, "/proc/self/exe", &fa, nullptr, argv.data(), environ);
    ::posix_spawn_file_actions_destroy(&fa);
    ::close(in[0]);
    ::close(out[1]);
    to_ = in[1];
    from_ = out[0];
    if (rc != 0) fail("posix_spawn: " + std::string(std::strerror(rc)));
    ready_ = line();
    if (ready_.rfind("ready", 0) != 0) fail("server " + role[0] + " did not start: " + ready_);
  }
  server_process(const server_process&) = delete;
  server_process& operator=(const server_process&) = delete;
  ~server_process() {
    ::close(to_);
    ::close(from_);
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }

  // The words of the ready line after "ready".
  [[nodiscard]] std::vector<std::string> ready_words() const {
    std::vector<std::string> w;
    std::size_t at = 5;
    while (at < ready_.size()) {
      const std::size_t from = ready_.find_first_not_of(' ', at);
      if (from == std::string::npos) break;
      const std::size_t to = ready_.find(' ', from);
      w.push_back(ready_.substr(from, to - from));
      at = to;
    }
    return w;
  }

  void go() { say("go\n"); }

  // The server's CPU time between go and stop.
  double stop() {
    say("stop\n");
    const std::string l = line();
    if (l.rfind("cpu ", 0) != 0) fail("server did not report its CPU time: " + l);
    return std::stod(l.substr(4));
  }

 private:
  void say(const char* s) {
    if (::write(to_, s, std::strlen(s)) != static_cast<ssize_t>(std::strlen(s))) fail("server gone");
  }

  // One line, waiting at most 30 s for it.
  std::string line() {
    std::string l;
    const auto until = clk::now() + 30s;
    char c = 0;
    while (clk::now() < until) {
      pollfd p{from_, POLLIN, 0};
      if (::poll(&p, 1, 1000) != 1) continue;
      if (::read(from_, &c, 1) != 1) break;
      if (c == '\n') return l;
      l += c;
    }
    fail("no answer from the server process (" + l + ")");
  }

  pid_t pid_ = -1;
  int to_ = -1;
  int from_ = -1;
  std::string ready_;
};

// The server's side of that: the stdin lines, on a thread of their own, then _exit (nothing the
// server holds needs an orderly end, and some of it may be blocked in the kernel).
void serve_control() {
  std::thread([] {
    char buf[16];
    double cpu0 = 0;
    std::string got;
    for (;;) {
      const ssize_t n = ::read(0, buf, sizeof buf);
      if (n <= 0) ::_exit(0);
      got.append(buf, static_cast<std::size_t>(n));
      for (std::size_t nl; (nl = got.find('\n')) != std::string::npos; got.erase(0, nl + 1)) {
        const std::string l = got.substr(0, nl);
        if (l == "go") cpu0 = process_cpu_ns();
        if (l == "stop") {
          std::printf("cpu %.0f\n", process_cpu_ns() - cpu0);
          std::fflush(stdout);
          ::_exit(0);
        }
      }
    }
  }).detach();
}

void say_ready(const std::string& words) {
  std::printf("ready %s\n", words.c_str());
  std::fflush(stdout);
}

// ------------------------------------------------------------------------------------ loopback

measured loopback_ferry(const std::string& mode, std::size_t block, int warm, int rounds) {
  ferry::progress_executor exec(executor_in(mode));
  ferry::loopback_backend lb(exec);
  std::vector<std::byte> src(block, std::byte{3}), dst(block);
  return time_task_rounds(
      warm, rounds,
      [&]() -> ferry::task<> {
        ferry::transfer t = lb.copy(dst, src);
        (void)co_await t;
        check(t, "loopback copy");
      },
      [] {}, [] { return NAN; });
}

// A copier thread that spins on a request word, copies, and publishes: what the loopback backend
// is without ferry.
measured loopback_raw(std::size_t block, int warm, int rounds) {
  std::vector<std::byte> src(block, std::byte{3}), dst(block);
  std::atomic<int> word{0};  // 1: copy requested, 2: copied, 3: stop
  std::thread copier([&] {
    for (;;) {
      const int w = word.load(std::memory_order_acquire);
      if (w == 3) return;
      if (w == 1) {
        std::memcpy(dst.data(), src.data(), block);
        word.store(2, std::memory_order_release);
      }
    }
  });
  measured m = time_rounds(warm, rounds, [&] {
    word.store(1, std::memory_order_release);
    while (word.load(std::memory_order_acquire) != 2) {
    }
  });
  word.store(3, std::memory_order_release);
  copier.join();
  return m;
}

#if FERRY_BENCH_URING
// ---------------------------------------------------------------------------------------- file

struct bench_file {
  std::string path;
  int fd = -1;
  bool direct = false;
  std::size_t size = 0;

  explicit bench_file(std::size_t bytes) : size(bytes) {
    const char* dir = std::getenv("FERRY_BENCH_DIR");
    path = (dir != nullptr ? std::filesystem::path(dir) : std::filesystem::temp_directory_path()) /
           ("ferry-latency-matrix-" + std::to_string(::getpid()));
    const int w = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (w < 0) throw std::system_error(errno, std::system_category(), "create " + path);
    std::vector<char> chunk(1 << 20, 'f');
    for (std::size_t done = 0; done < bytes; done += chunk.size()) {
      if (::write(w, chunk.data(), chunk.size()) != static_cast<ssize_t>(chunk.size())) {
        ::close(w);
        throw std::system_error(errno, std::system_category(), "write " + path);
      }
    }
    ::fsync(w);
    ::close(w);
    fd = ::open(path.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
    direct = fd >= 0;
    if (!direct) fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw std::system_error(errno, std::system_category(), "open " + path);
  }
  bench_file(const bench_file&) = delete;
  bench_file& operator=(const bench_file&) = delete;
  ~bench_file() {
    ::close(fd);
    ::unlink(path.c_str());
  }
};

// Random block-aligned offsets, the same sequence for every runner.
struct offsets {
  offsets(const bench_file& f, std::size_t block) : blocks(f.size / block), block(block) {}
  std::uint64_t next() { return (rng() % blocks) * block; }
  std::uint64_t blocks, block;
  std::mt19937_64 rng{7};
};

measured file_ferry(const bench_file& f, const std::string& mode, std::size_t block, int warm,
                    int rounds) {
  ferry::progress_executor exec(executor_in(mode));
  ferry::uring::ring r(exec);
  ferry::uring::aligned_buffer buf(block);
  offsets at(f, block);
  return time_task_rounds(
      warm, rounds,
      [&]() -> ferry::task<> {
        ferry::transfer t = r.read(f.fd, buf.span(), at.next());
        (void)co_await t;
        check(t, "file read");
      },
      [] {}, [] { return NAN; });
}

measured file_raw(const bench_file& f, std::size_t block, int warm, int rounds) {
  io_uring ring{};
  if (const int e = ::io_uring_queue_init(8, &ring, 0); e < 0) {
    throw std::system_error(-e, std::system_category(), "io_uring_queue_init");
  }
  ferry::uring::aligned_buffer buf(block);
  offsets at(f, block);
  measured m = time_rounds(warm, rounds, [&] {
    io_uring_sqe* sqe = ::io_uring_get_sqe(&ring);
    ::io_uring_prep_read(sqe, f.fd, buf.span().data(), static_cast<unsigned>(block), at.next());
    ::io_uring_submit_and_wait(&ring, 1);
    io_uring_cqe* cqe = nullptr;
    ::io_uring_wait_cqe(&ring, &cqe);
    if (cqe->res != static_cast<int>(block)) fail("raw file read: " + std::to_string(cqe->res));
    ::io_uring_cqe_seen(&ring, cqe);
  });
  ::io_uring_queue_exit(&ring);
  return m;
}

// ----------------------------------------------------------------------------------------- tcp

void set_nodelay(int fd) {
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

bool write_all(int fd, const std::byte* p, std::size_t n) {
  while (n != 0) {
    const ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
    if (w <= 0) return false;
    p += w;
    n -= static_cast<std::size_t>(w);
  }
  return true;
}

bool read_all(int fd, std::byte* p, std::size_t n) {
  while (n != 0) {
    const ssize_t r = ::recv(fd, p, n, 0);
    if (r <= 0) return false;
    p += r;
    n -= static_cast<std::size_t>(r);
  }
  return true;
}

int listen_loopback(std::uint16_t& port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(fd, 4) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    fail("listen on 127.0.0.1");
  }
  port = ntohs(a.sin_port);
  return fd;
}

int connect_loopback(std::uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd < 0 || ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) fail("connect");
  set_nodelay(fd);
  return fd;
}

// --serve tcp-raw BLOCK: read a block, write it back, until the connection ends.
int serve_tcp_raw(std::size_t block) {
  std::uint16_t port = 0;
  const int l = listen_loopback(port);
  serve_control();
  say_ready(std::to_string(port));
  const int fd = ::accept4(l, nullptr, nullptr, SOCK_CLOEXEC);
  set_nodelay(fd);
  std::vector<std::byte> b(block);
  while (read_all(fd, b.data(), block) && write_all(fd, b.data(), block)) {
  }
  ::pause();
  return 0;
}

// --serve tcp-ferry MODE BLOCK: receive a framed block, send it back, until the connection ends.
int serve_tcp_ferry(const std::string& mode, std::size_t block) {
  ferry::progress_executor exec(executor_in(mode));
  ferry::uring::ring r(exec);
  ferry::uring::tcp_listener listener("127.0.0.1", 0);
  serve_control();
  say_ready(std::to_string(listener.port()));
  ferry::uring::tcp_connection c = listener.accept(r);
  std::vector<std::byte> b(block);
  ferry::sync_wait([&]() -> ferry::task<> {
    for (;;) {
      ferry::uring::received_block got{};
      ferry::transfer in = c.receive(b, got);
      (void)co_await in;
      if (in.state() != ferry::transfer_state::success) break;
      ferry::transfer out = c.send(got.id, std::span<const std::byte>(b).first(got.length));
      (void)co_await out;
      if (out.state() != ferry::transfer_state::success) break;
    }
  }());
  ::pause();
  return 0;
}

measured tcp_ferry(const std::string& mode, std::size_t block, int warm, int rounds) {
  server_process server({"tcp-ferry", mode, std::to_string(block)});
  const auto port = static_cast<std::uint16_t>(std::stoul(server.ready_words().at(0)));
  ferry::progress_executor exec(executor_in(mode));
  ferry::uring::ring r(exec);
  ferry::uring::tcp_connection c = ferry::uring::tcp_connection::connect(r, "127.0.0.1", port);
  std::vector<std::byte> out(block, std::byte{5}), in(block);
  std::uint64_t id = 0;
  measured m = time_task_rounds(
      warm, rounds,
      [&]() -> ferry::task<> {
        ferry::uring::received_block got{};
        ferry::transfer reply = c.receive(in, got);
        ferry::transfer sent = c.send(++id, out);
        (void)co_await sent;
        (void)co_await reply;
        check(sent, "tcp send");
        check(reply, "tcp receive");
      },
      [&] { server.go(); }, [&] { return server.stop(); });
  return m;
}

measured tcp_raw(std::size_t block, int warm, int rounds) {
  server_process server({"tcp-raw", std::to_string(block)});
  const int fd = connect_loopback(static_cast<std::uint16_t>(std::stoul(server.ready_words().at(0))));
  std::vector<std::byte> out(block, std::byte{5}), in(block);
  measured m = time_rounds(
      warm, rounds,
      [&] {
        if (!write_all(fd, out.data(), block) || !read_all(fd, in.data(), block)) fail("raw tcp");
      },
      [&] { server.go(); }, [&] { return server.stop(); });
  ::close(fd);
  return m;
}
#endif  // FERRY_BENCH_URING

#if FERRY_BENCH_UCX
// ----------------------------------------------------------------------------------------- ucx

void ucs_check(ucs_status_t s, const char* what) {
  if (s != UCS_OK) fail(std::string(what) + ": " + ::ucs_status_string(s));
}

// --serve ucx-ferry MODE TRANSPORT BYTES: a worker exposing a region, progressed by its executor.
int serve_ucx_ferry(const std::string& mode, const std::string& transport, std::size_t bytes) {
  ferry::progress_executor exec(executor_in(mode));
  ferry::ucx::worker_options o;
  o.transports = transport;
  ferry::ucx::worker w(exec, o);
  ferry::ucx::memory_region region = w.allocate(bytes);
  serve_control();
  say_ready(hex(w.address()) + " " + hex(region.describe().to_bytes()));
  for (;;) ::pause();
}

measured ucx_ferry(const std::string& mode, const std::string& transport, std::size_t block,
                   int warm, int rounds) {
  server_process server({"ucx-ferry", mode, transport, std::to_string(block)});
  const std::vector<std::string> words = server.ready_words();
  ferry::progress_executor exec(executor_in(mode));
  ferry::ucx::worker_options o;
  o.transports = transport;
  ferry::ucx::worker w(exec, o);
  ferry::ucx::endpoint ep = w.connect(unhex(words.at(0)));
  ferry::ucx::remote_memory remote =
      ep.import(ferry::ucx::remote_region::from_bytes(unhex(words.at(1))));
  std::vector<std::byte> local_bytes(block);
  ferry::ucx::memory_region local = w.register_memory(local_bytes);
  measured m = time_task_rounds(
      warm, rounds,
      [&]() -> ferry::task<> {
        ferry::transfer t = ep.get(local.slice(0, block), remote.slice(0, block), 10s);
        (void)co_await t;
        check(t, "ucx get");
      },
      [&] { server.go(); }, [&] { return server.stop(); });
  return m;
}

// Raw UCP with the settings ferry gives UCX (so that both get the same lanes).
struct raw_ucp {
  explicit raw_ucp(const std::string& transport) {
    ucp_config_t* cfg = nullptr;
    ucs_check(::ucp_config_read(nullptr, nullptr, &cfg), "ucp_config_read");
    ucs_check(::ucp_config_modify(cfg, "TLS", transport.c_str()), "TLS");
    if (transport == "shm") ucs_check(::ucp_config_modify(cfg, "MM_ERROR_HANDLING", "y"), "MM");
    ucs_check(::ucp_config_modify(cfg, "KEEPALIVE_INTERVAL", "1000ms"), "KEEPALIVE_INTERVAL");
    ucp_params_t p{};
    p.field_mask = UCP_PARAM_FIELD_FEATURES;
    p.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
    const ucs_status_t s = ::ucp_init(&p, cfg, &context);
    ::ucp_config_release(cfg);
    ucs_check(s, "ucp_init");
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;
    ucs_check(::ucp_worker_create(context, &wp, &worker), "ucp_worker_create");
  }
  ucp_mem_h map(void* address, std::size_t n) {
    ucp_mem_map_params_t m{};
    m.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                   UCP_MEM_MAP_PARAM_FIELD_FLAGS;
    m.address = address;
    m.length = n;
    m.flags = address == nullptr ? UCP_MEM_MAP_ALLOCATE : 0;
    ucp_mem_h h = nullptr;
    ucs_check(::ucp_mem_map(context, &m, &h), "ucp_mem_map");
    return h;
  }
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
};

// --serve ucx-raw TRANSPORT BYTES: a region, the worker progressed in a busy loop.
int serve_ucx_raw(const std::string& transport, std::size_t bytes) {
  raw_ucp u(transport);
  ucp_mem_h mem = u.map(nullptr, bytes);
  ucp_mem_attr_t a{};
  a.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS;
  ucs_check(::ucp_mem_query(mem, &a), "ucp_mem_query");
  void* packed = nullptr;
  std::size_t packed_bytes = 0;
  ucs_check(::ucp_rkey_pack(u.context, mem, &packed, &packed_bytes), "ucp_rkey_pack");
  ucp_address_t* address = nullptr;
  std::size_t address_bytes = 0;
  ucs_check(::ucp_worker_get_address(u.worker, &address, &address_bytes), "ucp_worker_get_address");
  const auto base = reinterpret_cast<std::uint64_t>(a.address);
  serve_control();
  say_ready(hex({reinterpret_cast<const std::byte*>(address), address_bytes}) + " " +
            hex({reinterpret_cast<const std::byte*>(packed), packed_bytes}) + " " +
            std::to_string(base));
  for (;;) ::ucp_worker_progress(u.worker);
}

void on_raw_done(void*, ucs_status_t status, void* user) {
  *static_cast<ucs_status_t*>(user) = status;
}

measured ucx_raw(const std::string& transport, std::size_t block, int warm, int rounds) {
  server_process server({"ucx-raw", transport, std::to_string(block)});
  const std::vector<std::string> words = server.ready_words();
  raw_ucp u(transport);
  const std::vector<std::byte> address = unhex(words.at(0));
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  ep.address = reinterpret_cast<const ucp_address_t*>(address.data());
  ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  ucp_ep_h e = nullptr;
  ucs_check(::ucp_ep_create(u.worker, &ep, &e), "ucp_ep_create");
  const std::vector<std::byte> packed = unhex(words.at(1));
  ucp_rkey_h rkey = nullptr;
  ucs_check(::ucp_ep_rkey_unpack(e, packed.data(), &rkey), "ucp_ep_rkey_unpack");
  const std::uint64_t base = std::stoull(words.at(2));
  std::vector<std::byte> local_bytes(block);
  ucp_mem_h local = u.map(local_bytes.data(), block);
  measured m = time_rounds(
      warm, rounds,
      [&] {
        ucs_status_t status = UCS_INPROGRESS;
        ucp_request_param_t p{};
        p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                         UCP_OP_ATTR_FIELD_MEMH;
        p.cb.send = &on_raw_done;
        p.user_data = &status;
        p.memh = local;
        const ucs_status_ptr_t r = ::ucp_get_nbx(e, local_bytes.data(), block, base, rkey, &p);
        if (UCS_PTR_IS_ERR(r)) ucs_check(UCS_PTR_STATUS(r), "ucp_get_nbx");
        if (r == nullptr) return;
        while (status == UCS_INPROGRESS) ::ucp_worker_progress(u.worker);
        ::ucp_request_free(r);
        ucs_check(status, "raw get");
      },
      [&] { server.go(); }, [&] { return server.stop(); });
  // The process ends soon after the matrix; the server is killed with its worker. Nothing here is
  // torn down gracefully: an orderly close would wait on a peer about to be killed.
  ::ucp_rkey_destroy(rkey);
  return m;
}
#endif  // FERRY_BENCH_UCX

// ---------------------------------------------------------------------------------------- table

struct stats {
  double p50 = 0, p99 = 0, mean = 0, client_cpu = 0, server_cpu = NAN;
};

stats stats_of(const measured& m) {
  std::vector<double> v = m.rt_ns;
  std::sort(v.begin(), v.end());
  stats s;
  if (v.empty()) return s;
  s.p50 = v[v.size() / 2];
  s.p99 = v[std::min(v.size() - 1, v.size() * 99 / 100)];
  double sum = 0;
  for (double x : v) sum += x;
  s.mean = sum / static_cast<double>(v.size());
  s.client_cpu = m.client_cpu_ns;
  s.server_cpu = m.server_cpu_ns;
  return s;
}

double median(std::vector<double> v) {
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

stats median_stats(const std::vector<stats>& passes) {
  const auto field = [&](double stats::*f) {
    std::vector<double> v;
    for (const stats& s : passes) v.push_back(s.*f);
    return median(v);
  };
  return {field(&stats::p50), field(&stats::p99), field(&stats::mean), field(&stats::client_cpu),
          field(&stats::server_cpu)};
}

std::string us(double ns) {
  if (std::isnan(ns)) return "-";
  char b[32];
  if (ns >= 1e6) {
    std::snprintf(b, sizeof b, "%.2f ms", ns / 1e6);
  } else {
    std::snprintf(b, sizeof b, "%.1f µs", ns / 1e3);
  }
  return b;
}

struct runner {
  std::string name;  // "raw" or an executor mode
  std::function<measured(int warm, int rounds)> run;
};

struct config {
  int rounds = 2000;
  int passes = 3;
  std::vector<std::string> paths{"file", "tcp", "ucx-tcp", "ucx-shm", "loopback"};
  std::vector<std::size_t> blocks{std::size_t{4} << 10, std::size_t{64} << 10};
};

const char* const modes[] = {"busy", "adaptive", "park"};

double target_for(const std::string& mode) {
  return mode == "busy" ? 1.2 : mode == "adaptive" ? 2.0 : 4.0;
}

int missed = 0;

void run_path(const std::string& path, const config& c) {
  const std::string raw_name = path == "file"   ? "raw liburing, submit_and_wait"
                               : path == "tcp"  ? "raw blocking sockets"
                               : path == "loopback" ? "raw spinning copier thread"
                                                    : "raw UCP get, busy server";
#if FERRY_BENCH_URING
  std::unique_ptr<bench_file> file;
  if (path == "file") file = std::make_unique<bench_file>(std::size_t{256} << 20);
#endif
  std::printf("\n### %s%s\n\n", path.c_str(),
#if FERRY_BENCH_URING
              file && !file->direct ? " (buffered: the file system refused O_DIRECT)" :
#endif
                                    "");
  std::printf("| block | runner | p50 | p99 | mean | mean / raw | CPU per round trip: client | "
              "CPU per round trip: server | target (mean) |\n|---|---|---|---|---|---|---|---|---|\n");
  for (std::size_t block : c.blocks) {
    std::vector<runner> runners;
    const std::size_t b = block;
    runners.push_back({"raw", [&, b](int w, int n) -> measured {
#if FERRY_BENCH_URING
                         if (path == "file") return file_raw(*file, b, w, n);
                         if (path == "tcp") return tcp_raw(b, w, n);
#endif
#if FERRY_BENCH_UCX
                         if (path == "ucx-tcp") return ucx_raw("tcp", b, w, n);
                         if (path == "ucx-shm") return ucx_raw("shm", b, w, n);
#endif
                         return loopback_raw(b, w, n);
                       }});
    for (const char* mode : modes) {
      const std::string m = mode;
      runners.push_back({m, [&, b, m](int w, int n) -> measured {
#if FERRY_BENCH_URING
                           if (path == "file") return file_ferry(*file, m, b, w, n);
                           if (path == "tcp") return tcp_ferry(m, b, w, n);
#endif
#if FERRY_BENCH_UCX
                           if (path == "ucx-tcp") return ucx_ferry(m, "tcp", b, w, n);
                           if (path == "ucx-shm") return ucx_ferry(m, "shm", b, w, n);
#endif
                           return loopback_ferry(m, b, w, n);
                         }});
    }
    std::vector<std::vector<stats>> passes(runners.size());
    std::vector<std::size_t> order(runners.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::mt19937 shuffler(2026);
    const int rounds = path == "file" ? std::max(50, c.rounds / 4) : c.rounds;
    const int warm = std::max(10, rounds / 10);
    for (int p = 0; p < c.passes; ++p) {
      std::shuffle(order.begin(), order.end(), shuffler);
      for (std::size_t i : order) passes[i].push_back(stats_of(runners[i].run(warm, rounds)));
    }
    const stats raw = median_stats(passes[0]);
    for (std::size_t i = 0; i < runners.size(); ++i) {
      const stats s = median_stats(passes[i]);
      std::string target = "-";
      double ratio = s.mean / raw.mean;
      if (i != 0) {
        const double limit = target_for(runners[i].name);
        char t[48];
        std::snprintf(t, sizeof t, "%.1fx: %s", limit, ratio <= limit ? "met" : "MISSED");
        target = t;
        if (ratio > limit) ++missed;
      }
      std::printf("| %zu KiB | %s | %s | %s | %s | %.2fx | %s | %s | %s |\n", block >> 10,
                  i == 0 ? raw_name.c_str() : ("ferry, " + runners[i].name).c_str(),
                  us(s.p50).c_str(), us(s.p99).c_str(), us(s.mean).c_str(), ratio,
                  us(s.client_cpu).c_str(), us(s.server_cpu).c_str(), target.c_str());
      std::fflush(stdout);
    }
  }
}

int serve(int argc, char** argv) {
  const std::string role = argc > 2 ? argv[2] : "";
  const auto arg = [&](int i) -> std::string {
    if (i >= argc) fail("--serve " + role + ": missing argument");
    return argv[i];
  };
#if FERRY_BENCH_URING
  if (role == "tcp-raw") return serve_tcp_raw(std::stoul(arg(3)));
  if (role == "tcp-ferry") return serve_tcp_ferry(arg(3), std::stoul(arg(4)));
#endif
#if FERRY_BENCH_UCX
  if (role == "ucx-ferry") return serve_ucx_ferry(arg(3), arg(4), std::stoul(arg(5)));
  if (role == "ucx-raw") return serve_ucx_raw(arg(3), std::stoul(arg(4)));
#endif
  fail("unknown server role '" + role + "'");
}

bool path_available(const std::string& p) {
#if !FERRY_BENCH_URING
  if (p == "file" || p == "tcp") return false;
#endif
#if !FERRY_BENCH_UCX
  if (p == "ucx-tcp" || p == "ucx-shm") return false;
#endif
  return p == "file" || p == "tcp" || p == "ucx-tcp" || p == "ucx-shm" || p == "loopback";
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::size_t from = 0;
  while (from <= s.size()) {
    const std::size_t to = std::min(s.find(',', from), s.size());
    if (to > from) out.push_back(s.substr(from, to - from));
    from = to + 1;
  }
  return out;
}

int whole_number(const char* option, const std::string& s, int least, int most) {
  std::size_t used = 0;
  long v = 0;
  try {
    v = std::stol(s, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != s.size() || v < least || v > most) {
    fail(std::string(option) + " must be a whole number from " + std::to_string(least) + " to " +
         std::to_string(most) + ", not '" + s + "'");
  }
  return static_cast<int>(v);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc > 1 && std::string(argv[1]) == "--serve") return serve(argc, argv);
    config c;
    bool rounds_given = false, passes_given = false, quick = false;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      const auto value = [&]() -> std::string {
        if (i + 1 >= argc) fail(a + " needs a value");
        return argv[++i];
      };
      if (a == "--quick") {
        quick = true;
      } else if (a == "--rounds") {
        c.rounds = whole_number("--rounds", value(), 10, 10'000'000);
        rounds_given = true;
      } else if (a == "--passes") {
        c.passes = whole_number("--passes", value(), 1, 1000);
        passes_given = true;
      } else if (a == "--paths") {
        c.paths = split(value());
        for (const std::string& p : c.paths) {
          if (p != "file" && p != "tcp" && p != "ucx-tcp" && p != "ucx-shm" && p != "loopback") {
            fail("--paths: unknown path '" + p + "' (file, tcp, ucx-tcp, ucx-shm, loopback)");
          }
        }
      } else {
        std::fprintf(stderr,
                     "usage: %s [--quick] [--rounds N] [--passes N] "
                     "[--paths file,tcp,ucx-tcp,ucx-shm,loopback]\n",
                     argv[0]);
        return 2;
      }
    }
    if (quick) {
      if (!rounds_given) c.rounds = 200;
      if (!passes_given) c.passes = 1;
    }
    std::printf("## Round-trip latency matrix (depth 1; %d round trips per runner per pass, %d "
                "pass%s, medians over passes; %u hardware threads)\n",
                c.rounds, c.passes, c.passes == 1 ? "" : "es", std::thread::hardware_concurrency());
    for (const std::string& p : c.paths) {
      if (!path_available(p)) {
        std::printf("\n### %s\n\nskipped: ferry was built without its library\n", p.c_str());
        continue;
      }
      run_path(p, c);
    }
    std::printf("\n%d target%s missed\n", missed, missed == 1 ? "" : "s");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ferry_latency_matrix: %s\n", e.what());
    return 1;
  }
  return 0;
}

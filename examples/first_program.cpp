// The program docs/first-program.md builds, piece by piece:
//
//   first_program [FILE]        (default: first_program.bin in the current directory)
//
// 1. An engine thread drives its own event loop (a ferry::run_loop), standing in for an inference
//    server's scheduler; one progress executor completes every transfer.
// 2. A coroutine on that loop writes 8 blocks of 64 KiB to FILE through io_uring (O_DIRECT where
//    the filesystem allows it), reads them back as one batch with a deadline and checks the bytes.
// 3. The program starts itself again as a peer process. The peer listens over UCX and exposes a
//    region; a second coroutine connects to it, puts the first block into that region and sends a
//    notification behind it. The peer checks that the bytes are there once the notification
//    arrives, and exits 0 when the parent hangs up.
//
// Every wait has a deadline. Exit status 0 means every step succeeded in time; any failure prints
// what failed and exits 1. FILE is removed at the end.

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <ferry/ferry.hpp>
#include <ferry/ucx.hpp>
#include <ferry/uring.hpp>

using namespace std::chrono_literals;

extern char** environ;

namespace {

constexpr std::size_t block_count = 8;
constexpr std::size_t block_bytes = 64 << 10;
constexpr std::uint64_t layer_ready = 42;  // the notification's value

// What block `b` holds, on disk and in the peer.
std::byte pattern(std::size_t b, std::size_t i) {
  return static_cast<std::byte>((b * 131 + i * 7 + i / 4096) & 0xff);
}

bool holds_block(std::span<const std::byte> bytes, std::size_t b) {
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    if (bytes[i] != pattern(b, i)) return false;
  }
  return true;
}

void report(const char* what, const ferry::batch_result& r) {
  std::fprintf(stderr, "first_program: %s: %s", what, ferry::to_string(r.verdict));
  if (r.first_failed) {
    std::fprintf(stderr, " (block %zu: %s)", *r.first_failed, r.error.message().c_str());
  }
  std::fprintf(stderr, "\n");
}

// The engine's own scheduler: a run_loop that a thread of its own drives, as an inference
// server's scheduler thread would. Coroutines started on it resume there, never on the progress
// executor's thread.
class engine_thread {
 public:
  engine_thread() : thread_([this] { loop_.run(); }) {}
  engine_thread(const engine_thread&) = delete;
  engine_thread& operator=(const engine_thread&) = delete;
  ~engine_thread() {
    loop_.stop();
    thread_.join();
  }

  // A handle that refers to the loop, for sync_wait from another thread.
  [[nodiscard]] ferry::any_scheduler scheduler() { return ferry::any_scheduler::reference(loop_); }

 private:
  ferry::run_loop loop_;
  std::thread thread_;
};

// Opens `path` with O_DIRECT where its filesystem allows it, else through the page cache (some
// filesystems refuse O_DIRECT with EINVAL: tmpfs before Linux 6.6, for one).
int open_file(const std::string& path, bool& direct) {
  direct = true;
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC | O_DIRECT, 0600);
  if (fd < 0 && errno == EINVAL) {
    direct = false;
    fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  }
  return fd;
}

// Writes every block, then reads them all back as one batch with one deadline.
ferry::task<bool> store_and_load(ferry::uring::ring& ring, int fd, std::span<const std::byte> out,
                                 std::span<std::byte> in) {
  std::vector<ferry::uring::write_block> to_write;
  std::vector<ferry::uring::read_block> to_read;
  for (std::size_t b = 0; b < block_count; ++b) {
    to_write.push_back({out.subspan(b * block_bytes, block_bytes), b * block_bytes});
    to_read.push_back({in.subspan(b * block_bytes, block_bytes), b * block_bytes});
  }

  std::vector<ferry::transfer> writes(block_count);
  ring.write_batch(fd, to_write, writes);
  const ferry::batch_result written = co_await ferry::when_all(writes, 5s);
  if (!written.ok()) {
    report("writing the blocks", written);
    co_return false;
  }
  std::printf("   wrote them: %s\n", ferry::to_string(written.verdict));

  std::vector<ferry::transfer> reads(block_count);
  ring.read_batch(fd, to_read, reads);
  // Resumes on the engine thread when the last read lands, any read fails, or 5 s pass.
  const ferry::batch_result loaded = co_await ferry::when_all(reads, 5s);
  if (!loaded.ok()) {
    report("reading the blocks back", loaded);
    co_return false;
  }

  std::size_t intact = 0;
  for (std::size_t b = 0; b < block_count; ++b) {
    if (holds_block(in.subspan(b * block_bytes, block_bytes), b)) ++intact;
  }
  std::printf("   read them back as one batch: %s, %zu of %zu blocks intact\n",
              ferry::to_string(loaded.verdict), intact, block_count);
  co_return intact == block_count;
}

// The peer process: a UCX worker of its own that listens, exposes a region and waits for a
// notification. Once it has one, the bytes put before it are in the region.
ferry::task<bool> serve(ferry::ucx::listener& listener, const ferry::ucx::memory_region& kv) {
  ferry::ucx::endpoint parent;
  try {
    parent = co_await listener.accept_async(20s);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "peer: %s\n", e.what());
    co_return false;
  }
  std::uint64_t value = 0;
  const ferry::transfer note = parent.receive_notification(value, 20s);
  const ferry::transfer_state s = co_await note;
  if (s != ferry::transfer_state::success) {
    std::fprintf(stderr, "peer: waiting for the notification: %s (%s)\n", ferry::to_string(s),
                 note.error().message().c_str());
    co_return false;
  }
  const bool intact = holds_block(kv.bytes(), 0);
  std::printf("   peer: notification %llu received; the block in its region is %s\n",
              static_cast<unsigned long long>(value), intact ? "intact" : "NOT what was sent");
  if (value != layer_ready) {
    std::fprintf(stderr, "peer: expected notification %llu\n",
                 static_cast<unsigned long long>(layer_ready));
  }
  co_return value == layer_ready && intact;
}

// Whether the other end of `channel` closed within `timeout`.
bool hung_up(int channel, std::chrono::milliseconds timeout) {
  pollfd p{channel, POLLIN, 0};
  char byte = 0;
  return ::poll(&p, 1, static_cast<int>(timeout.count())) == 1 && ::read(channel, &byte, 1) == 0;
}

int run_peer(int channel) {
  ferry::progress_executor exec;
  ferry::ucx::worker worker(exec);
  // Memory UCX allocates: a peer on the same host writes it directly over shared memory.
  const ferry::ucx::memory_region kv = worker.allocate(block_bytes);
  std::memset(kv.bytes().data(), 0, kv.bytes().size());
  ferry::ucx::listener listener = worker.listen("127.0.0.1", 0, std::span(&kv, 1));
  const std::uint16_t port = listener.port();
  std::printf("   peer (pid %d): listening on 127.0.0.1:%u, exposing %zu KiB\n",
              static_cast<int>(::getpid()), port, block_bytes >> 10);
  if (::write(channel, &port, sizeof port) != static_cast<ssize_t>(sizeof port)) {
    std::perror("peer: telling the port");
    return 1;
  }
  ferry::run_loop loop;  // the peer's engine: driven by this thread, inside sync_wait
  if (!ferry::sync_wait(loop, serve(listener, kv))) return 1;
  // Stay until the parent hangs up: on one host, ferry fails what a sender has not seen end when
  // its peer process exits, a notification whose acknowledgement is still on its way included.
  if (!hung_up(channel, 20s)) {
    std::fprintf(stderr, "peer: the parent did not hang up within 20 s\n");
    return 1;
  }
  return 0;
}

// Starts this program again as the peer, with one end of a socket pair as its fd 3: the peer
// writes its port there, and exits once the parent closes the other end.
struct peer_process {
  pid_t pid = -1;
  int channel = -1;  // the parent's end

  peer_process() = default;
  peer_process(const peer_process&) = delete;
  peer_process& operator=(const peer_process&) = delete;
  ~peer_process() {  // on a failure path: the peer must not outlive us
    hang_up();
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
  }

  void hang_up() {
    if (channel >= 0) ::close(channel);
    channel = -1;
  }
};

bool start_peer(peer_process& peer) {
  int ends[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, ends) != 0) {
    std::perror("first_program: socketpair");
    return false;
  }
  posix_spawn_file_actions_t actions;
  ::posix_spawn_file_actions_init(&actions);
  ::posix_spawn_file_actions_adddup2(&actions, ends[1], 3);  // dup2 clears O_CLOEXEC on fd 3
  char arg0[] = "first_program";
  char arg1[] = "--peer";
  char* argv[] = {arg0, arg1, nullptr};
  // posix_spawn, not fork: this process already runs threads (the executor's, the engine's).
  const int err = ::posix_spawn(&peer.pid, "/proc/self/exe", &actions, nullptr, argv, environ);
  ::posix_spawn_file_actions_destroy(&actions);
  ::close(ends[1]);
  peer.channel = ends[0];
  if (err != 0) {
    peer.pid = -1;
    std::fprintf(stderr, "first_program: starting the peer: %s\n", std::strerror(err));
    return false;
  }
  return true;
}

// The port the peer listens on; 0, with a message, if it did not tell within `timeout`.
std::uint16_t read_port(const peer_process& peer, std::chrono::milliseconds timeout) {
  pollfd p{peer.channel, POLLIN, 0};
  if (::poll(&p, 1, static_cast<int>(timeout.count())) != 1) {
    std::fprintf(stderr, "first_program: the peer did not tell its port within %lld ms\n",
                 static_cast<long long>(timeout.count()));
    return 0;
  }
  std::uint16_t port = 0;
  if (::read(peer.channel, &port, sizeof port) != static_cast<ssize_t>(sizeof port)) {
    std::fprintf(stderr, "first_program: the peer exited before telling its port\n");
    return 0;
  }
  return port;
}

// The peer's exit status (as waitpid reports it), or -1 if it has not exited within `timeout`.
int wait_for_exit(peer_process& peer, std::chrono::milliseconds timeout) {
  const auto until = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    int status = 0;
    const pid_t r = ::waitpid(peer.pid, &status, WNOHANG);
    if (r == peer.pid) {
      peer.pid = -1;
      return status;
    }
    if (r < 0 || std::chrono::steady_clock::now() >= until) return -1;
    std::this_thread::sleep_for(10ms);
  }
}

// Connects to the peer, puts the first block into its region and sends a notification behind it.
ferry::task<bool> put_and_notify(ferry::ucx::worker& worker,
                                 const ferry::ucx::memory_region& source, std::uint16_t port) {
  ferry::ucx::endpoint peer;
  try {
    // The handshake, awaited: resumes on the engine thread with the endpoint, or throws.
    const std::span<const ferry::ucx::memory_region> expose_nothing;
    peer = co_await worker.connect_async("127.0.0.1", port, expose_nothing, 10s);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "first_program: %s\n", e.what());
    co_return false;
  }
  std::printf("   connected to the peer over UCX\n");

  const std::vector<ferry::ucx::remote_memory> regions = peer.peer_regions();
  // Ends once the bytes are in the peer's memory (or fails by its deadline).
  const ferry::transfer put =
      peer.put(source.slice(0, block_bytes), regions.at(0).slice(0, block_bytes), 10s);
  const ferry::transfer_state landed = co_await put;
  if (landed != ferry::transfer_state::success) {
    std::fprintf(stderr, "first_program: put: %s (%s)\n", ferry::to_string(landed),
                 put.error().message().c_str());
    co_return false;
  }
  std::printf("   put %zu KiB into the peer's region: landed\n", block_bytes >> 10);

  // Sent once every earlier put on this endpoint has landed; ends once the peer holds it.
  const ferry::transfer note = peer.send_notification(layer_ready, 10s);
  const ferry::transfer_state sent = co_await note;
  if (sent != ferry::transfer_state::success) {
    std::fprintf(stderr, "first_program: notification: %s (%s)\n", ferry::to_string(sent),
                 note.error().message().c_str());
    co_return false;
  }
  peer.close();  // flushes, then closes: bounded by worker_options::close_timeout (5 s)
  co_return true;
}

int run_parent(const std::string& path) {
  // Memory first: declared before the ring and the worker, it outlives every operation on it,
  // even one still in flight when a deadline passed (their destructors wait those out).
  ferry::uring::aligned_buffer written(block_count * block_bytes);  // 4 KiB aligned, for O_DIRECT
  ferry::uring::aligned_buffer loaded(block_count * block_bytes);
  for (std::size_t b = 0; b < block_count; ++b) {
    for (std::size_t i = 0; i < block_bytes; ++i) {
      written.data()[b * block_bytes + i] = pattern(b, i);
    }
  }

  ferry::progress_executor exec;    // the one thread that polls every completion source
  ferry::uring::ring ring(exec);    // io_uring, for the file
  ferry::ucx::worker worker(exec);  // UCX, for the peer
  engine_thread engine;             // the engine's own event loop, on a thread of its own
  ferry::any_scheduler on_engine = engine.scheduler();
  std::printf("1. engine thread running its own run_loop; one progress executor\n");

  bool direct = true;
  const int fd = open_file(path, direct);
  if (fd < 0) {
    std::fprintf(stderr, "first_program: opening %s: %s\n", path.c_str(), std::strerror(errno));
    return 1;
  }
  std::printf("2. writing %zu blocks of %zu KiB to %s through io_uring (%s)\n", block_count,
              block_bytes >> 10, path.c_str(),
              direct ? "O_DIRECT" : "page cache: this filesystem refuses O_DIRECT");
  const bool stored =
      ferry::sync_wait(on_engine, store_and_load(ring, fd, written.span(), loaded.span()));
  ::close(fd);
  ::unlink(path.c_str());
  if (!stored) return 1;

  // The block read back from the file is what goes to the peer. On every early return from here
  // on, ~peer_process kills the peer and reaps it.
  const ferry::ucx::memory_region source = worker.register_memory(loaded.subspan(0, block_bytes));
  std::printf("3. starting a peer process\n");
  peer_process peer;
  if (!start_peer(peer)) return 1;
  const std::uint16_t port = read_port(peer, 10s);
  if (port == 0) return 1;
  if (!ferry::sync_wait(on_engine, put_and_notify(worker, source, port))) return 1;
  peer.hang_up();  // the peer may exit now
  const int status = wait_for_exit(peer, 20s);
  if (status == -1) {
    std::fprintf(stderr, "first_program: the peer did not exit within 20 s\n");
    return 1;
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    std::fprintf(stderr, "first_program: the peer failed (%s %d)\n",
                 WIFEXITED(status) ? "exit status" : "signal",
                 WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
    return 1;
  }
  std::printf("4. notification %llu acknowledged; the peer exited 0\n",
              static_cast<unsigned long long>(layer_ready));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // Line-buffered, so that this process's lines and the peer's come out in order through a pipe.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  try {
    if (argc == 2 && std::strcmp(argv[1], "--peer") == 0) return run_peer(3);
    if (argc > 2) {
      std::fprintf(stderr, "usage: %s [FILE]\n", argv[0]);
      return 2;
    }
    return run_parent(argc == 2 ? argv[1] : "first_program.bin");
  } catch (const std::exception& e) {  // a backend that could not start (no io_uring, ...)
    std::fprintf(stderr, "first_program: %s\n", e.what());
    return 1;
  }
}

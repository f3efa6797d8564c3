// io_uring file reads and TCP blocks: ferry next to a raw liburing loop, fio's io_uring engine and
// plain blocking sockets, on the same file, flags and sizes, in one run.

#include <liburing.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <coroutine>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/resource.h>
#include <sys/uio.h>
#include <unistd.h>

#include <ferry/metrics.hpp>
#include <ferry/run_loop.hpp>
#include <ferry/uring/aligned_buffer.hpp>
#include <ferry/uring/ring.hpp>
#include <ferry/uring/tcp.hpp>

#include "bench.hpp"
#include "harness.hpp"

namespace ferry_bench {
namespace {

using clock_type = std::chrono::steady_clock;
namespace uring = ferry::uring;

constexpr std::size_t page = 4096;

struct workload {
  const char* name;
  std::size_t block;
  unsigned depth;
  bool random;
};

// Offsets every runner draws the same way: uniformly over whole blocks (random) or in order.
class offsets {
 public:
  offsets(std::size_t file_size, std::size_t block, bool random, unsigned seed)
      : blocks_(file_size / block), block_(block), random_(random), rng_(seed) {}
  std::uint64_t next() {
    const std::uint64_t b = random_ ? rng_() % blocks_ : next_++ % blocks_;
    return b * block_;
  }

 private:
  std::uint64_t blocks_, block_;
  bool random_;
  std::uint64_t next_ = 0;
  std::mt19937_64 rng_;
};

// How the runners read the file: O_DIRECT from the device (buffered where the file system refuses
// O_DIRECT), or buffered from the page cache, which the file is read into first, so that every read
// is a copy the kernel makes inside the call that submits it and the CPU, not the disk, is the limit.
enum class file_mode { direct, cached };

struct test_file {
  std::string path;
  int fd = -1;
  bool direct = false;
  std::size_t size = 0;

  test_file(std::size_t bytes, file_mode mode = file_mode::direct) : size(bytes) {
    const char* dir = std::getenv("FERRY_BENCH_DIR");
    path = (dir != nullptr ? std::filesystem::path(dir) : std::filesystem::temp_directory_path()) /
           ("ferry-bench-" + std::to_string(::getpid()) +
            (mode == file_mode::cached ? "-cached" : ""));
    const int w = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (w < 0) throw std::system_error(errno, std::system_category(), "create " + path);
    std::vector<char> chunk(1 << 20);
    for (std::size_t i = 0; i < chunk.size(); ++i) chunk[i] = static_cast<char>(i * 7);
    for (std::size_t done = 0; done < bytes; done += chunk.size()) {
      if (::write(w, chunk.data(), chunk.size()) != static_cast<ssize_t>(chunk.size())) {
        throw std::system_error(errno, std::system_category(), "write " + path);
      }
    }
    ::fsync(w);
    ::close(w);
    if (mode == file_mode::direct) fd = ::open(path.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
    direct = fd >= 0;
    if (!direct) fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw std::system_error(errno, std::system_category(), "open " + path);
    if (mode == file_mode::cached) {
      for (std::size_t at = 0; at < bytes; at += chunk.size()) {
        if (::pread(fd, chunk.data(), chunk.size(), static_cast<off_t>(at)) <= 0) break;
      }
    }
  }
  ~test_file() {
    ::close(fd);
    ::unlink(path.c_str());
  }
};

// CPU time this process has used, user and system, in seconds.
double process_cpu_seconds() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}

// Runs `runner` and adds the CPUs it kept busy (CPU seconds per wall second) to `cpus`.
template <class Runner>
double with_cpu(std::vector<double>& cpus, Runner runner) {
  const double cpu0 = process_cpu_seconds();
  const auto t0 = clock_type::now();
  const double rate = runner();
  const double wall = std::chrono::duration<double>(clock_type::now() - t0).count();
  cpus.push_back((process_cpu_seconds() - cpu0) / wall);
  return rate;
}

// ---- ferry, coroutines: `depth` coroutines on a run_loop, each awaiting one read at a time. ----

struct loop_coroutine {
  struct promise_type {
    ferry::run_loop& loop;
    template <class... Args>
    promise_type(ferry::run_loop& l, Args&&...) : loop(l) {}
    ferry::run_loop& get_scheduler() noexcept { return loop; }
    loop_coroutine get_return_object() noexcept { return {}; }
    std::suspend_never initial_suspend() noexcept { return {}; }
    std::suspend_never final_suspend() noexcept { return {}; }
    void return_void() noexcept {}
    void unhandled_exception() noexcept { std::terminate(); }
  };
};

loop_coroutine reader(ferry::run_loop& loop, uring::ring& r, int fd, std::span<std::byte> buf,
                      offsets& where, clock_type::time_point until, std::uint64_t& done,
                      std::uint64_t& errors, unsigned& running) {
  while (clock_type::now() < until) {
    const ferry::transfer_state s = co_await r.read(fd, buf, where.next());
    if (s == ferry::transfer_state::success) {
      ++done;
    } else {
      ++errors;
    }
  }
  if (--running == 0) loop.stop();
}

double ferry_coroutines(uring::ring& r, const test_file& f, const workload& w, double seconds,
                        std::chrono::nanoseconds loop_spin = ferry::run_loop::default_spin,
                        std::chrono::nanoseconds loop_max_spin = ferry::run_loop::default_max_spin) {
  ferry::run_loop loop(loop_spin, loop_max_spin);
  uring::aligned_buffer bufs(w.block * w.depth);
  offsets where(f.size, w.block, w.random, 1);
  std::uint64_t done = 0, errors = 0;
  unsigned running = w.depth;
  const auto start = clock_type::now();
  const auto until = start + std::chrono::duration<double>(seconds);
  for (unsigned i = 0; i < w.depth; ++i) {
    reader(loop, r, f.fd, bufs.subspan(i * w.block, w.block), where,
           std::chrono::time_point_cast<clock_type::duration>(until), done, errors, running);
  }
  loop.run();
  const double elapsed = std::chrono::duration<double>(clock_type::now() - start).count();
  if (errors != 0) full_printf("  (ferry coroutines: %llu reads failed)\n", (unsigned long long)errors);
  return static_cast<double>(done) / elapsed;
}

// A coroutine that continues on whichever thread completed what it awaited (here: an executor).
struct inline_coroutine {
  struct promise_type {
    ferry::inline_scheduler get_scheduler() const noexcept { return {}; }
    inline_coroutine get_return_object() noexcept { return {}; }
    std::suspend_never initial_suspend() noexcept { return {}; }
    std::suspend_never final_suspend() noexcept { return {}; }
    void return_void() noexcept {}
    void unhandled_exception() noexcept { std::terminate(); }
  };
};

inline_coroutine inline_reader(uring::ring& r, int fd, std::span<std::byte> buf, offsets& where,
                               clock_type::time_point until, std::atomic<std::uint64_t>& done,
                               std::atomic<unsigned>& running) {
  while (clock_type::now() < until) {
    // Not inside the if: g++ 12 miscompiles a co_await in a condition (see the README).
    const ferry::transfer_state s = co_await r.read(fd, buf, where.next());
    if (s == ferry::transfer_state::success) done.fetch_add(1, std::memory_order_relaxed);
  }
  running.fetch_sub(1, std::memory_order_release);
}

// ---- ferry, coroutines continuing on the executor's thread (inline_scheduler): one thread does
// everything, as fio and the raw loop do. ----

double ferry_inline(uring::ring& r, const test_file& f, const workload& w, double seconds) {
  uring::aligned_buffer bufs(w.block * w.depth);
  // One generator each: the first reads are drawn here while earlier coroutines already run on
  // the executor.
  std::vector<offsets> where;
  for (unsigned i = 0; i < w.depth; ++i) where.emplace_back(f.size, w.block, w.random, 1 + i);
  std::atomic<std::uint64_t> done{0};
  std::atomic<unsigned> running{w.depth};
  const auto start = clock_type::now();
  const auto until = std::chrono::time_point_cast<clock_type::duration>(
      start + std::chrono::duration<double>(seconds));
  for (unsigned i = 0; i < w.depth; ++i) {
    inline_reader(r, f.fd, bufs.subspan(i * w.block, w.block), where[i], until, done, running);
  }
  while (running.load(std::memory_order_acquire) != 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  return static_cast<double>(done.load()) /
         std::chrono::duration<double>(clock_type::now() - start).count();
}

// ---- ferry, blocking: one thread keeps `depth` reads in flight and waits on the oldest. ----

double ferry_blocking(uring::ring& r, const test_file& f, const workload& w, double seconds) {
  uring::aligned_buffer bufs(w.block * w.depth);
  offsets where(f.size, w.block, w.random, 1);
  std::vector<ferry::transfer> window(w.depth);
  std::uint64_t done = 0;
  const auto start = clock_type::now();
  const auto until = start + std::chrono::duration_cast<clock_type::duration>(
                                 std::chrono::duration<double>(seconds));
  for (unsigned i = 0; i < w.depth; ++i) {
    window[i] = r.read(f.fd, bufs.subspan(i * w.block, w.block), where.next());
  }
  for (std::uint64_t k = 0;; ++k) {
    const unsigned i = static_cast<unsigned>(k % w.depth);
    if (window[i].wait() == ferry::transfer_state::success) ++done;
    if (clock_type::now() >= until) break;
    window[i] = r.read(f.fd, bufs.subspan(i * w.block, w.block), where.next());
  }
  for (auto& t : window) (void)t.wait();
  return static_cast<double>(done) / std::chrono::duration<double>(clock_type::now() - start).count();
}

// ---- Raw liburing loops written for this benchmark, on a ring set up as ferry sets up its own: one
// thread reaps a batch and refills it, either with one submission call for the whole batch or with
// one call per read, as fio's io_uring engine does. ----

enum class raw_submit { batched, per_read };

// The set-up ferry's ring gets (ring.hpp): the kernel's completion work deferred to this thread's
// own io_uring_enter calls where it has that (6.1 on), else plain.
bool init_like_ferry(io_uring& ring, unsigned entries) {
  io_uring_params p{};
  p.flags = IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN | IORING_SETUP_TASKRUN_FLAG;
  if (::io_uring_queue_init_params(entries, &ring, &p) == 0) return true;
  return ::io_uring_queue_init(entries, &ring, 0) == 0;
}

double raw_liburing(const test_file& f, const workload& w, double seconds, raw_submit how) {
  io_uring ring;
  if (!init_like_ferry(ring, std::max(w.depth, 8u))) return 0;
  uring::aligned_buffer bufs(w.block * w.depth);
  offsets where(f.size, w.block, w.random, 1);
  auto prep = [&](unsigned slot) {
    io_uring_sqe* sqe = ::io_uring_get_sqe(&ring);
    ::io_uring_prep_read(sqe, f.fd, bufs.data() + slot * w.block, static_cast<unsigned>(w.block),
                         where.next());
    ::io_uring_sqe_set_data64(sqe, slot);
    if (how == raw_submit::per_read) ::io_uring_submit(&ring);
  };
  for (unsigned i = 0; i < w.depth; ++i) prep(i);
  std::uint64_t done = 0;
  unsigned in_flight = w.depth;
  const auto start = clock_type::now();
  const auto until = start + std::chrono::duration_cast<clock_type::duration>(
                                 std::chrono::duration<double>(seconds));
  bool stopping = false;
  while (in_flight != 0) {
    ::io_uring_submit_and_wait(&ring, 1);
    io_uring_cqe* cqes[256];
    const unsigned n = ::io_uring_peek_batch_cqe(&ring, cqes, 256);
    if (!stopping && clock_type::now() >= until) stopping = true;
    for (unsigned i = 0; i < n; ++i) {
      if (cqes[i]->res == static_cast<int>(w.block)) ++done;
      if (stopping) {
        --in_flight;
      } else {
        prep(static_cast<unsigned>(cqes[i]->user_data));
      }
    }
    ::io_uring_cq_advance(&ring, n);
  }
  const double rate =
      static_cast<double>(done) / std::chrono::duration<double>(clock_type::now() - start).count();
  ::io_uring_queue_exit(&ring);
  return rate;
}

// ---- fio's io_uring engine on the same file; 0 when fio is not installed. ----

// `cpu`, when given, receives the CPUs fio's job kept busy (its usr_cpu + sys_cpu, per cent of one).
// fio drops the file's cached pages before a job unless told not to (--invalidate=0); the other
// runners read whatever the cache holds, and so does fio here.
double fio_iops(const test_file& f, const workload& w, double seconds, double* cpu = nullptr) {
  const std::string cmd =
      "fio --name=ferry --filename=" + f.path + " --size=" + std::to_string(f.size) +
      " --rw=" + (w.random ? "randread" : "read") + " --bs=" + std::to_string(w.block) +
      " --iodepth=" + std::to_string(w.depth) + " --ioengine=io_uring --direct=" +
      (f.direct ? "1" : "0") + " --time_based --runtime=" +
      std::to_string(std::max(1, static_cast<int>(seconds + 0.5))) +
      " --randrepeat=0 --norandommap --invalidate=0 --output-format=json 2>/dev/null";
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return 0;
  std::string out;
  char chunk[4096];
  while (std::size_t n = std::fread(chunk, 1, sizeof chunk, p)) out.append(chunk, n);
  if (::pclose(p) != 0) return 0;
  const std::size_t read = out.find("\"read\" :");
  if (read == std::string::npos) return 0;
  const std::size_t iops = out.find("\"iops\" :", read);
  if (iops == std::string::npos) return 0;
  if (cpu != nullptr) {
    const std::size_t usr = out.find("\"usr_cpu\" :");
    const std::size_t sys = out.find("\"sys_cpu\" :");
    if (usr != std::string::npos && sys != std::string::npos) {
      *cpu = (std::strtod(out.c_str() + usr + 11, nullptr) +
              std::strtod(out.c_str() + sys + 11, nullptr)) /
             100;
    }
  }
  return std::strtod(out.c_str() + iops + 8, nullptr);
}

bool have_fio() { return std::system("fio --version >/dev/null 2>&1") == 0; }

// ---- TCP: framed blocks one way over loopback, ferry against blocking sockets. ----

inline_coroutine keep_sending(uring::tcp_connection& c, std::span<const std::byte> payload,
                              const std::atomic<bool>& stop, std::atomic<unsigned>& running) {
  for (std::uint64_t k = 0; !stop.load(std::memory_order_relaxed); ++k) {
    const ferry::transfer_state s = co_await c.send(k, payload);
    if (s != ferry::transfer_state::success) break;
  }
  running.fetch_sub(1, std::memory_order_release);
}

inline_coroutine keep_receiving(uring::tcp_connection& c, std::span<std::byte> dst,
                                std::atomic<std::uint64_t>& bytes, std::atomic<unsigned>& running) {
  for (;;) {
    uring::received_block got;
    const ferry::transfer_state s = co_await c.receive(dst, got);
    if (s != ferry::transfer_state::success) break;
    bytes.fetch_add(got.length, std::memory_order_relaxed);
  }
  running.fetch_sub(1, std::memory_order_release);
}

// Each end has its own executor and ring, as a prefill and a decode machine would, and its
// coroutines continue on that executor (inline_scheduler), so the process runs two busy threads,
// like the blocking pair it is compared with. `window` sends and receives are in flight at once.
// `metrics`, when given, is recorded into by both rings (per kind, and per peer for the sends and
// receives).
double ferry_tcp(std::size_t block, double seconds, ferry::metrics::registry* metrics = nullptr) {
  ferry::progress_executor send_exec, receive_exec;
  uring::ring_options ro;
  ro.metrics = metrics;
  uring::ring send_ring(send_exec, ro), receive_ring(receive_exec, ro);
  uring::tcp_listener listener("127.0.0.1", 0);
  auto client = uring::tcp_connection::connect(send_ring, "127.0.0.1", listener.port());
  auto server = listener.accept(receive_ring);
  constexpr unsigned window = 4;
  std::vector<std::byte> payload(block, std::byte{7});
  std::vector<std::vector<std::byte>> dst(window, std::vector<std::byte>(block));
  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> bytes{0};
  std::atomic<unsigned> senders{window}, receivers{window};
  for (unsigned i = 0; i < window; ++i) keep_receiving(server, dst[i], bytes, receivers);
  const auto start = clock_type::now();
  for (unsigned i = 0; i < window; ++i) keep_sending(client, payload, stop, senders);
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  const std::uint64_t moved = bytes.load(std::memory_order_relaxed);
  const double elapsed = std::chrono::duration<double>(clock_type::now() - start).count();
  stop = true;
  while (senders.load(std::memory_order_acquire) != 0) std::this_thread::yield();
  client.close();  // the receivers see the connection end and finish
  while (receivers.load(std::memory_order_acquire) != 0) std::this_thread::yield();
  return static_cast<double>(moved) / elapsed;
}

bool send_all(int fd, const iovec* iov, int n) {
  iovec v[2] = {iov[0], iov[1]};
  msghdr m{};
  m.msg_iov = v;
  m.msg_iovlen = static_cast<std::size_t>(n);
  while (m.msg_iovlen != 0) {
    ssize_t w = ::sendmsg(fd, &m, MSG_NOSIGNAL);
    if (w <= 0) return false;
    while (m.msg_iovlen != 0 && static_cast<std::size_t>(w) >= m.msg_iov->iov_len) {
      w -= static_cast<ssize_t>(m.msg_iov->iov_len);
      ++m.msg_iov;
      --m.msg_iovlen;
    }
    if (m.msg_iovlen != 0) {
      m.msg_iov->iov_base = static_cast<char*>(m.msg_iov->iov_base) + w;
      m.msg_iov->iov_len -= static_cast<std::size_t>(w);
    }
  }
  return true;
}

bool recv_all(int fd, void* p, std::size_t n) {
  auto* b = static_cast<char*>(p);
  while (n != 0) {
    const ssize_t r = ::recv(fd, b, n, 0);
    if (r <= 0) return false;
    b += r;
    n -= static_cast<std::size_t>(r);
  }
  return true;
}

double plain_tcp(std::size_t block, double seconds) {
  uring::tcp_listener listener("127.0.0.1", 0);
  const int cfd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(listener.port());
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(cfd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) return 0;
  const int sfd = ::accept4(listener.native_handle(), nullptr, nullptr, SOCK_CLOEXEC);
  uring::detail::set_nodelay(cfd);
  uring::detail::set_nodelay(sfd);
  std::vector<std::byte> payload(block, std::byte{7});
  std::atomic<bool> stop{false};
  std::thread sender([&] {
    uring::detail::frame_header h;
    h.length = block;
    for (std::uint64_t k = 0; !stop.load(std::memory_order_relaxed); ++k) {
      h.id = k;
      const iovec iov[2] = {{&h, sizeof h}, {payload.data(), payload.size()}};
      if (!send_all(cfd, iov, 2)) break;
    }
    ::shutdown(cfd, SHUT_WR);
  });
  std::vector<std::byte> dst(block);
  std::uint64_t bytes = 0;
  const auto start = clock_type::now();
  const auto until = start + std::chrono::duration_cast<clock_type::duration>(
                                 std::chrono::duration<double>(seconds));
  uring::detail::frame_header h;
  while (clock_type::now() < until) {
    if (!recv_all(sfd, &h, sizeof h) || !recv_all(sfd, dst.data(), h.length)) break;
    bytes += h.length;
  }
  const double elapsed = std::chrono::duration<double>(clock_type::now() - start).count();
  stop = true;
  while (recv_all(sfd, dst.data(), std::min<std::size_t>(dst.size(), sizeof h))) {
  }
  sender.join();
  ::close(cfd);
  ::close(sfd);
  return static_cast<double>(bytes) / elapsed;
}

std::string rate(double per_second) {
  char b[64];
  if (per_second >= 1e9) {
    std::snprintf(b, sizeof b, "%.2f G", per_second / 1e9);
  } else if (per_second >= 1e6) {
    std::snprintf(b, sizeof b, "%.2f M", per_second / 1e6);
  } else {
    std::snprintf(b, sizeof b, "%.1f k", per_second / 1e3);
  }
  return b;
}

double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// Per-pass ratios as their median to two places, `opening`, then their range and ")":
// "0.97x (passes 0.90-1.05)" with opening "x (passes ".
// The median of per-pass ratios as "1.08x", for the quick summary; "-" if no pass had a baseline.
std::string median_ratio(const std::vector<double>& v) {
  if (v.empty()) return "-";
  char out[32];
  std::snprintf(out, sizeof out, "%.2fx", median_of(v));
  return out;
}

std::string median_and_range(std::vector<double> v, const char* opening) {
  std::sort(v.begin(), v.end());
  char out[96];
  std::snprintf(out, sizeof out, "%.2f%s%.2f-%.2f)", median_of(v), opening,
                v.empty() ? 0.0 : v.front(), v.empty() ? 0.0 : v.back());
  return out;
}

// Why io_uring cannot be used here, or an empty string.
std::string uring_unavailable() {
  io_uring probe{};
  const int r = ::io_uring_queue_init(4, &probe, 0);
  if (r < 0) return std::strerror(-r);
  ::io_uring_queue_exit(&probe);
  return {};
}

}  // namespace

// QD 32 from the page cache: each read is a 4 KiB copy the kernel makes inside the call that
// submits it, so what a runner spends per read, in system calls above all, sets its rate. ferry
// runs with the default ring (calls of at most two requests, so that a disk gets each request at
// once) and with submit_batch = 0 (everything an executor round prepared in one call).
void run_uring_cached(const options& opt, bool fio) {
  const double seconds = opt.quick ? 0.2 : 1.0;
  const int passes = opt.quick ? 1 : 5;
  test_file f(opt.quick ? (64u << 20) : (256u << 20), file_mode::cached);
  const workload w{"4 KiB random, QD 32, page cache", page, 32, true};
  ferry::progress_executor exec, unbatched_exec;
  uring::ring r(exec, uring::ring_options{.entries = 256});
  uring::ring unbatched(unbatched_exec, uring::ring_options{.entries = 256, .submit_batch = 0});
  std::vector<double> co, inl, inl_all, raw, raw_each, fi;
  std::vector<double> co_fio, inl_fio, inl_all_fio, inl_raw, inl_all_raw, raw_fio;
  double c = 0, i = 0, ia = 0, rr = 0, re = 0, ff = 0;
  in_shuffled_passes(
      fio ? 6 : 5, passes,
      [&](std::size_t runner) {
        switch (runner) {
          case 0: c = ferry_coroutines(r, f, w, seconds); break;
          case 1: i = ferry_inline(r, f, w, seconds); break;
          case 2: ia = ferry_inline(unbatched, f, w, seconds); break;
          case 3: rr = raw_liburing(f, w, seconds, raw_submit::batched); break;
          case 4: re = raw_liburing(f, w, seconds, raw_submit::per_read); break;
          default: ff = fio_iops(f, w, seconds); break;
        }
      },
      [&] {
        co.push_back(c);
        inl.push_back(i);
        inl_all.push_back(ia);
        raw.push_back(rr);
        raw_each.push_back(re);
        if (rr > 0) {
          inl_raw.push_back(i / rr);
          inl_all_raw.push_back(ia / rr);
        }
        if (ff > 0) {
          fi.push_back(ff);
          co_fio.push_back(c / ff);
          inl_fio.push_back(i / ff);
          inl_all_fio.push_back(ia / ff);
          raw_fio.push_back(re / ff);
        }
      });
  const auto ratio = [](const std::vector<double>& v) { return median_and_range(v, " ("); };
  full_printf("\n## io_uring 4 KiB random reads at QD 32 from the page cache (%zu MiB file read "
              "into the cache first, buffered; medians over %d passes of %.1f s per runner; ratios "
              "are medians of the ratios within each pass, with their range)\n\n",
              f.size >> 20, passes, seconds);
  full_printf("| ferry co_await, engine thread | ferry co_await, executor thread | the same, "
              "submit_batch 0 | raw liburing, batched | raw liburing, per read | fio io_uring "
              "|\n|---|---|---|---|---|---|\n| %s IOPS | %s IOPS | %s IOPS | %s IOPS | %s IOPS | %s |\n",
              rate(median_of(co)).c_str(), rate(median_of(inl)).c_str(),
              rate(median_of(inl_all)).c_str(), rate(median_of(raw)).c_str(),
              rate(median_of(raw_each)).c_str(),
              fio ? (rate(median_of(fi)) + " IOPS").c_str() : "-");
  full_printf("\n| ratio | engine thread | executor thread | executor thread, submit_batch 0 | raw "
              "per read |\n|---|---|---|---|---|\n");
  if (fio) {
    full_printf("| / fio | %s | %s | %s | %s |\n", ratio(co_fio).c_str(), ratio(inl_fio).c_str(),
                ratio(inl_all_fio).c_str(), ratio(raw_fio).c_str());
  }
  full_printf("| / raw batched | | %s | %s | |\n", ratio(inl_raw).c_str(),
              ratio(inl_all_raw).c_str());
  report_figure({"4 KiB page-cache reads, QD 32, executor thread", rate(median_of(inl)) + " IOPS",
                 rate(median_of(raw)) + " IOPS", "raw liburing",
                 median_ratio(inl_raw), "-"});
}

void run_uring(const options& opt) {
  if (const std::string why = uring_unavailable(); !why.empty()) {
    full_printf("\n## io_uring\n\nskipped: io_uring is not available here (%s)\n", why.c_str());
    note("io_uring file reads: not measured, io_uring is not available here (" + why + ")");
    return;
  }
  const double seconds = opt.quick ? 0.2 : 1.0;
  const int passes = opt.quick ? 1 : 3;
  // The row the targets are read from gets more passes: on a shared machine fio alone moves by
  // up to 30% from one second to the next.
  const int target_passes = opt.quick ? 1 : 11;
  test_file f(opt.quick ? (64u << 20) : (512u << 20));
  const bool fio = have_fio();
  full_printf("\n## io_uring file reads (%s, %zu MiB file, %s; medians over %d passes of %.1f s per "
              "runner, %d for QD 32, each pass in a new order; ratios are medians of the ratios "
              "within each pass)\n\n",
              f.direct ? "O_DIRECT" : "buffered: the file system refused O_DIRECT", f.size >> 20,
              fio ? "fio found" : "fio not installed", passes, seconds, target_passes);
  full_printf("| workload | ferry co_await, engine thread | ferry co_await, executor thread | "
              "ferry wait() | raw liburing, batched | raw liburing, per read | fio io_uring | "
              "ferry / raw batched (engine / executor) | ferry / raw per read (engine / executor) "
              "| ferry / fio (engine / executor) |\n|---|---|---|---|---|---|---|---|---|---|\n");
  const workload loads[] = {
      {"4 KiB random, QD 1", page, 1, true},
      {"4 KiB random, QD 32", page, 32, true},
      {"4 KiB random, QD 128", page, 128, true},
      {"1 MiB sequential, QD 4", 1 << 20, 4, false},
  };
  ferry::progress_executor exec;
  uring::ring r(exec, uring::ring_options{.entries = 256});
  // The QD 32 row also runs the same runners under other idle spins. Reads there finish in bursts
  // about 250 us apart, longer than the executor's 50 us spin_budget: by default it spins through
  // the gaps anyway while reads are out (in_flight_spin, 500 us), and the engine thread's run_loop
  // has grown its spin (50 us at first, up to 500 us) to meet them too. `parking_r`'s executor parks
  // after 50 us even with reads out, as it did before in_flight_spin, so each burst starts with
  // waking it; `fixed_loop_spin` keeps the run_loop's spin at 50 us, as it was before it adapted, so
  // that each burst starts with waking the engine thread.
  ferry::executor_options parking_options;
  parking_options.in_flight_spin = parking_options.spin_budget;
  ferry::progress_executor parking_exec(parking_options);
  uring::ring parking_r(parking_exec, uring::ring_options{.entries = 256});
  const auto fixed_loop_spin = ferry::run_loop::default_spin;
  // What the QD 32 row also records: each set-up's runners (engine thread, executor thread), their
  // ratios to fio in the same pass, and the CPUs each kept busy.
  struct spin_row {
    std::vector<double> co, inl, co_fio, inl_fio, co_cpu, inl_cpu;
  };
  spin_row defaults, parking, fixed_loop;
  std::vector<double> fio_cpu;
  std::string spin_table;  // printed under the main table
  for (const workload& w : loads) {
    std::vector<double> co, inl, blocking, raw, raw_each, fi;
    // Per pass, each ferry runner against the baselines that ran in the same pass: the machine's
    // speed drifts from second to second, and a ratio of two runners a few seconds apart cancels
    // most of it.
    std::vector<double> co_raw, inl_raw, co_raw_each, inl_raw_each, co_fio, inl_fio;
    const bool target_row = w.depth == 32 && w.random;
    const int n = target_row ? target_passes : passes;
    // Every runner sets its result once per pass, so none is carried over from the pass before.
    double c = 0, i = 0, b = 0, rr = 0, re = 0, ff = 0, pc = 0, pi = 0, lc = 0;
    // The runners go in a new shuffled order every pass, so that none always runs right after
    // fio's process, next to the same neighbour, or first after a quiet spell.
    in_shuffled_passes(
        target_row ? 9 : 6, n,
        [&](std::size_t runner) {
          switch (runner) {
            case 0:
              c = target_row ? with_cpu(defaults.co_cpu,
                                        [&] { return ferry_coroutines(r, f, w, seconds); })
                             : ferry_coroutines(r, f, w, seconds);
              break;
            case 1:
              i = target_row ? with_cpu(defaults.inl_cpu,
                                        [&] { return ferry_inline(r, f, w, seconds); })
                             : ferry_inline(r, f, w, seconds);
              break;
            case 2: b = ferry_blocking(r, f, w, seconds); break;
            case 3: rr = raw_liburing(f, w, seconds, raw_submit::batched); break;
            case 4: re = raw_liburing(f, w, seconds, raw_submit::per_read); break;
            case 5: {
              double cpu = 0;
              ff = fio ? fio_iops(f, w, seconds, &cpu) : 0;
              if (target_row && ff > 0) fio_cpu.push_back(cpu);
              break;
            }
            case 6:
              pc = with_cpu(parking.co_cpu,
                            [&] { return ferry_coroutines(parking_r, f, w, seconds); });
              break;
            case 7:
              pi = with_cpu(parking.inl_cpu, [&] { return ferry_inline(parking_r, f, w, seconds); });
              break;
            default:
              lc = with_cpu(fixed_loop.co_cpu, [&] {
                return ferry_coroutines(r, f, w, seconds, fixed_loop_spin, fixed_loop_spin);
              });
              break;
          }
        },
        [&] {
          co.push_back(c);
          inl.push_back(i);
          blocking.push_back(b);
          raw.push_back(rr);
          raw_each.push_back(re);
          if (ff > 0) fi.push_back(ff);  // a failed fio run says nothing about fio
          if (rr > 0) {
            co_raw.push_back(c / rr);
            inl_raw.push_back(i / rr);
          }
          if (re > 0) {
            co_raw_each.push_back(c / re);
            inl_raw_each.push_back(i / re);
          }
          if (ff > 0) {
            co_fio.push_back(c / ff);
            inl_fio.push_back(i / ff);
          }
          if (target_row) {
            defaults.co.push_back(c);
            defaults.inl.push_back(i);
            parking.co.push_back(pc);
            parking.inl.push_back(pi);
            fixed_loop.co.push_back(lc);
            if (ff > 0) {
              defaults.co_fio.push_back(c / ff);
              defaults.inl_fio.push_back(i / ff);
              parking.co_fio.push_back(pc / ff);
              parking.inl_fio.push_back(pi / ff);
              fixed_loop.co_fio.push_back(lc / ff);
            }
          }
        });
    const bool big = w.block >= (1u << 20);
    auto show = [&](double v) {
      return big ? rate(v * static_cast<double>(w.block)) + "B/s" : rate(v) + " IOPS";
    };
    // A median to two places: of per-pass ratios, or of CPUs kept busy.
    auto median_text = [](const std::vector<double>& v) {
      char out[32];
      std::snprintf(out, sizeof out, "%.2f", median_of(v));
      return std::string(out);
    };
    full_printf("| %s | %s | %s | %s | %s | %s | %s | %s / %s | %s / %s | %s / %s |\n", w.name,
                show(median_of(co)).c_str(), show(median_of(inl)).c_str(),
                show(median_of(blocking)).c_str(), show(median_of(raw)).c_str(),
                show(median_of(raw_each)).c_str(), fio ? show(median_of(fi)).c_str() : "-",
                median_text(co_raw).c_str(), median_text(inl_raw).c_str(),
                median_text(co_raw_each).c_str(), median_text(inl_raw_each).c_str(),
                fio ? median_text(co_fio).c_str() : "-", fio ? median_text(inl_fio).c_str() : "-");
    if (target_row) {
      auto spread = [](const std::vector<double>& paired) {
        return median_and_range(paired, "x (passes ");
      };
      report_target("io_uring 4 KiB random reads, QD 32, co_await on an engine thread: >= 95% of "
                    "raw liburing", spread(co_raw), !co_raw.empty() && median_of(co_raw) >= 0.95);
      report_target("io_uring 4 KiB random reads, QD 32, co_await on the executor: >= 95% of raw "
                    "liburing", spread(inl_raw), !inl_raw.empty() && median_of(inl_raw) >= 0.95);
      // The same target against the raw loop that submits each read on its own, which is the
      // faster of the two on a disk that starts each request as it arrives.
      report_target("io_uring 4 KiB random reads, QD 32, co_await on an engine thread: >= 95% of "
                    "raw liburing submitting per read", spread(co_raw_each),
                    !co_raw_each.empty() && median_of(co_raw_each) >= 0.95);
      report_target("io_uring 4 KiB random reads, QD 32, co_await on the executor: >= 95% of raw "
                    "liburing submitting per read", spread(inl_raw_each),
                    !inl_raw_each.empty() && median_of(inl_raw_each) >= 0.95);
      if (fio) {
        report_target("io_uring 4 KiB random reads, QD 32, co_await on an engine thread: >= 100% "
                      "of fio", spread(co_fio), !co_fio.empty() && median_of(co_fio) >= 1.0);
        report_target("io_uring 4 KiB random reads, QD 32, co_await on the executor: >= 100% of "
                      "fio", spread(inl_fio), !inl_fio.empty() && median_of(inl_fio) >= 1.0);
      }
      // The quick summary's rows: each runner against fio (CPU per read from the CPUs each kept
      // busy over its rate) and the executor thread against the raw loop.
      const auto per_read = [](const std::vector<double>& cpus, const std::vector<double>& rates) {
        const double per_second = median_of(rates);
        return cpus.empty() || per_second <= 0 ? 0.0 : median_of(cpus) / per_second * 1e9;
      };
      const std::string reads =
          std::string("4 KiB ") + (f.direct ? "O_DIRECT" : "buffered") + " reads, QD 32, ";
      const double fio_cpu_per_read = per_read(fio_cpu, fi);
      const double executor_cpu = per_read(defaults.inl_cpu, inl);
      const double engine_cpu = per_read(defaults.co_cpu, co);
      if (fio) {
        report_figure({reads + "executor thread", show(median_of(inl)), show(median_of(fi)), "fio",
                       median_ratio(inl_fio), cpu_pair(executor_cpu, fio_cpu_per_read)});
        report_figure({reads + "engine thread", show(median_of(co)), show(median_of(fi)), "fio",
                       median_ratio(co_fio), cpu_pair(engine_cpu, fio_cpu_per_read)});
      } else {
        note("fio: not installed, so the io_uring reads are compared with raw liburing only");
      }
      report_figure({reads + "executor thread", show(median_of(inl)), show(median_of(raw)),
                     "raw liburing", median_ratio(inl_raw), cpu_pair(executor_cpu, 0)});
      if (!fio) {
        report_figure({reads + "engine thread", show(median_of(co)), show(median_of(raw)),
                       "raw liburing", median_ratio(co_raw), cpu_pair(engine_cpu, 0)});
      }
      char line[512];
      std::snprintf(line, sizeof line,
                    "\nQD 32 under other idle spins, in the same passes; CPUs is the process's CPU "
                    "time per second of the run:\n\n| idle spins | engine thread | executor "
                    "thread | engine / fio | executor / fio | CPUs (engine / executor) |\n"
                    "|---|---|---|---|---|---|\n");
      spin_table = line;
      auto add_row = [&](const char* name, const spin_row& row) {
        auto text = [&](const std::vector<double>& v, bool ratio) {
          if (v.empty() || (ratio && !fio)) return std::string("-");
          return ratio ? median_text(v) : show(median_of(v));
        };
        std::snprintf(line, sizeof line, "| %s | %s | %s | %s | %s | %s / %s |\n", name,
                      text(row.co, false).c_str(), text(row.inl, false).c_str(),
                      text(row.co_fio, true).c_str(), text(row.inl_fio, true).c_str(),
                      row.co_cpu.empty() ? "-" : median_text(row.co_cpu).c_str(),
                      row.inl_cpu.empty() ? "-" : median_text(row.inl_cpu).c_str());
        spin_table += line;
      };
      std::snprintf(line, sizeof line,
                    "default: executor %lld us, %lld us while reads are out; run_loop %lld-%lld us",
                    static_cast<long long>(ferry::executor_options{}.spin_budget.count() / 1000),
                    static_cast<long long>(ferry::executor_options{}.in_flight_spin.count() / 1000),
                    static_cast<long long>(ferry::run_loop::default_spin.count() / 1000),
                    static_cast<long long>(ferry::run_loop::default_max_spin.count() / 1000));
      const std::string default_name = line;
      add_row(default_name.c_str(), defaults);
      std::snprintf(line, sizeof line, "executor %lld us even while reads are out",
                    static_cast<long long>(parking_options.in_flight_spin.count() / 1000));
      const std::string parking_name = line;
      add_row(parking_name.c_str(), parking);
      std::snprintf(line, sizeof line, "run_loop fixed at %lld us",
                    static_cast<long long>(fixed_loop_spin.count() / 1000));
      const std::string fixed_name = line;
      add_row(fixed_name.c_str(), fixed_loop);
      if (fio) {
        std::snprintf(line, sizeof line, "\nfio's job kept %s CPUs busy in the same passes.\n",
                      median_text(fio_cpu).c_str());
        spin_table += line;
      }
    }
  }
  full_printf("%s", spin_table.c_str());
  run_uring_cached(opt, fio);
}

// How the disk's throughput grows with queue depth, for fio and ferry's two coroutine runners.
// Where it stops growing is the most any program gets from this disk: a depth at which fio is
// already there leaves ferry nothing to gain on it but a tie.
void run_uring_depth(const options& opt) {
  if (const std::string why = uring_unavailable(); !why.empty()) {
    full_printf("\n## io_uring depth sweep\n\nskipped: io_uring is not available here (%s)\n",
                why.c_str());
    note("io_uring depth sweep: not measured, io_uring is not available here (" + why + ")");
    return;
  }
  const double seconds = opt.quick ? 0.2 : 1.0;
  const int passes = opt.quick ? 1 : 5;
  test_file f(opt.quick ? (64u << 20) : (512u << 20));
  const bool fio = have_fio();
  const unsigned depths[] = {1, 4, 8, 16, 32, 64, 128};
  constexpr std::size_t n_depths = std::size(depths);
  constexpr std::size_t runners = 3;  // engine thread, executor thread, fio
  full_printf("\n## io_uring 4 KiB random reads by queue depth (%s, %zu MiB file, %s; medians over "
              "%d passes of %.1f s per runner and depth, each pass in a new order)\n\n"
              "| depth | ferry co_await, engine thread | ferry co_await, executor thread | fio "
              "io_uring | ferry / fio (engine / executor) |\n|---|---|---|---|---|\n",
              f.direct ? "O_DIRECT" : "buffered: the file system refused O_DIRECT", f.size >> 20,
              fio ? "fio found" : "fio not installed", passes, seconds);
  if (!fio) note("io_uring depth sweep: fio not installed, so no figures (it compares with fio)");
  ferry::progress_executor exec;
  uring::ring r(exec, uring::ring_options{.entries = 256});
  double last[n_depths][runners] = {};
  std::vector<double> iops[n_depths][runners], co_fio[n_depths], inl_fio[n_depths];
  in_shuffled_passes(
      n_depths * runners, passes,
      [&](std::size_t i) {
        const workload w{"", page, depths[i / runners], true};
        double& out = last[i / runners][i % runners];
        switch (i % runners) {
          case 0: out = ferry_coroutines(r, f, w, seconds); break;
          case 1: out = ferry_inline(r, f, w, seconds); break;
          default: out = fio ? fio_iops(f, w, seconds) : 0; break;
        }
      },
      [&] {
        for (std::size_t d = 0; d < n_depths; ++d) {
          for (std::size_t k = 0; k < runners; ++k) {
            if (last[d][k] > 0) iops[d][k].push_back(last[d][k]);
          }
          if (last[d][2] > 0) {
            co_fio[d].push_back(last[d][0] / last[d][2]);
            inl_fio[d].push_back(last[d][1] / last[d][2]);
          }
        }
      });
  for (std::size_t d = 0; d < n_depths; ++d) {
    char ratios[64] = "-";
    if (fio) {
      std::snprintf(ratios, sizeof ratios, "%.2f / %.2f", median_of(co_fio[d]),
                    median_of(inl_fio[d]));
    }
    if (fio) {
      report_figure({"4 KiB random reads, QD " + std::to_string(depths[d]) + ", executor thread",
                     rate(median_of(iops[d][1])) + " IOPS", rate(median_of(iops[d][2])) + " IOPS",
                     "fio", median_ratio(inl_fio[d]), "-"});
    }
    full_printf("| %u | %s IOPS | %s IOPS | %s | %s |\n", depths[d],
                rate(median_of(iops[d][0])).c_str(), rate(median_of(iops[d][1])).c_str(),
                fio ? (rate(median_of(iops[d][2])) + " IOPS").c_str() : "-", ratios);
  }
}

void run_tcp(const options& opt) {
  const double seconds = opt.quick ? 0.2 : 1.0;
  const int passes = opt.quick ? 1 : 3;
  full_printf("\n## TCP over loopback, framed blocks one way (median of %d interleaved %.1f s "
              "passes)\n\n| block | ferry (ring) | blocking sockets | ferry / sockets |\n"
              "|---|---|---|---|\n",
              passes, seconds);
  for (const std::size_t block : {std::size_t{64} << 10, std::size_t{1} << 20}) {
    std::vector<double> fe, pl;
    for (int p = 0; p < passes; ++p) {
      fe.push_back(ferry_tcp(block, seconds));
      pl.push_back(plain_tcp(block, seconds));
    }
    const double a = median_of(fe), b = median_of(pl);
    char ratio[32];
    std::snprintf(ratio, sizeof ratio, "%.2f", b > 0 ? a / b : 0.0);
    full_printf("| %zu KiB | %sB/s | %sB/s | %s |\n", block >> 10, rate(a).c_str(), rate(b).c_str(),
                ratio);
    report_target("TCP " + std::to_string(block >> 10) + " KiB blocks: ferry >= 90% of sockets",
                  std::string(ratio) + "x", b > 0 && a >= 0.9 * b);
    report_figure({"framed TCP over loopback, " + std::to_string(block >> 10) + " KiB blocks",
                   rate(a) + "B/s", rate(b) + "B/s", "blocking sockets", ratio_text(a, b), "-"});
  }
}

// What recording metrics costs (ring_options::metrics): the same work through a ring with a
// registry and one without, interleaved in shuffled passes. 4 KiB page-cache reads at QD 32 are the
// cheapest operations a ring runs (about a microsecond each), so recording shows most there; TCP
// 4 KiB blocks over loopback also take the per-peer path.
void run_metrics(const options& opt) {
  const double seconds = opt.quick ? 0.2 : 1.0;
  const int passes = opt.quick ? 1 : 7;
  test_file f(opt.quick ? (64u << 20) : (256u << 20), file_mode::cached);
  const workload w{"4 KiB random, QD 32, page cache", page, 32, true};
  ferry::metrics::registry file_metrics("uring", "bench-file");
  ferry::progress_executor off_exec, on_exec;
  uring::ring off(off_exec, uring::ring_options{.entries = 256});
  uring::ring on(on_exec, uring::ring_options{.entries = 256, .metrics = &file_metrics});
  constexpr std::size_t tcp_block = 4096;
  std::vector<double> read_on, read_off, read_ratio, cpu_on, cpu_off, tcp_on, tcp_off, tcp_ratio;
  double a = 0, b = 0, c = 0, d = 0;
  in_shuffled_passes(
      4, passes,
      [&](std::size_t runner) {
        switch (runner) {
          case 0: a = with_cpu(cpu_on, [&] { return ferry_coroutines(on, f, w, seconds); }); break;
          case 1: b = with_cpu(cpu_off, [&] { return ferry_coroutines(off, f, w, seconds); }); break;
          case 2: {
            ferry::metrics::registry tcp_metrics("uring", "bench-tcp");
            c = ferry_tcp(tcp_block, seconds, &tcp_metrics);
            break;
          }
          default: d = ferry_tcp(tcp_block, seconds); break;
        }
      },
      [&] {
        read_on.push_back(a);
        read_off.push_back(b);
        if (b > 0) read_ratio.push_back(a / b);
        tcp_on.push_back(c);
        tcp_off.push_back(d);
        if (d > 0) tcp_ratio.push_back(c / d);
      });
  // CPU per read: the CPUs the process kept busy over the reads per second.
  const auto per_op = [](const std::vector<double>& cpus, const std::vector<double>& rates) {
    return median_of(rates) > 0 ? human_ns(median_of(cpus) / median_of(rates) * 1e9) : std::string("-");
  };
  full_printf("\n## Metrics on against off (ring_options::metrics; medians over %d shuffled passes of %.1f s; "
              "ratios are medians of each pass's on/off, with their range)\n\n"
              "| work | metrics on | metrics off | on / off | CPU per op on | CPU per op off |\n"
              "|---|---|---|---|---|---|\n",
              passes, seconds);
  full_printf("| 4 KiB page-cache reads, QD 32 | %s IOPS | %s IOPS | %s | %s | %s |\n",
              rate(median_of(read_on)).c_str(), rate(median_of(read_off)).c_str(),
              median_and_range(read_ratio, " (").c_str(), per_op(cpu_on, read_on).c_str(),
              per_op(cpu_off, read_off).c_str());
  full_printf("| TCP 4 KiB blocks over loopback (sends and receives, per peer too) | %sB/s | %sB/s | %s | - | - |\n",
              rate(median_of(tcp_on)).c_str(), rate(median_of(tcp_off)).c_str(),
              median_and_range(tcp_ratio, " (").c_str());
  // The ratios above swing by more than the cost on a shared VM, so the recording itself is also
  // timed, in a loop on this thread's CPU clock: at most what a metered ring adds to an operation
  // (a clock read when it is published and one when it ends, which the ring shares among the
  // operations published or reaped together, and the counters' and histogram's additions).
  ferry::metrics::registry solo("uring", "bench-record");
  ferry::metrics::op_metrics& m = solo.operation("read");
  constexpr int records = 1'000'000;
  std::vector<double> record_ns;
  for (int p = 0; p < 5; ++p) {
    const std::int64_t t0 = thread_cpu_ns();
    for (int i = 0; i < records; ++i) {
      const std::uint64_t started = ferry::metrics::now_ns();
      m.record(ferry::metrics::now_ns() - started, 4096, (i & 1023) != 0);
    }
    record_ns.push_back(static_cast<double>(thread_cpu_ns() - t0) / records);
  }
  const double cost = median_of(record_ns);
  const double read_cpu_ns = median_of(read_off) > 0 ? median_of(cpu_off) / median_of(read_off) * 1e9 : 0;
  const double share = read_cpu_ns > 0 ? cost / read_cpu_ns : 0;
  full_printf("\nRecording one operation: %s of CPU (median of 5 loops of %d), %.1f%% of the CPU a "
              "page-cache read costs without metrics (%s).\n",
              human_ns(cost).c_str(), records, share * 100, human_ns(read_cpu_ns).c_str());
  char measured[64];
  std::snprintf(measured, sizeof measured, "%.1f%% (%s of %s)", share * 100, human_ns(cost).c_str(),
                human_ns(read_cpu_ns).c_str());
  report_target("recording metrics <= 3% of a page-cache read's CPU", measured, read_cpu_ns > 0 && share <= 0.03);
  char share_text[32];
  std::snprintf(share_text, sizeof share_text, "%.1f%%", share * 100);
  report_figure({"recording metrics, CPU per operation", human_ns(cost), human_ns(read_cpu_ns),
                 "a page-cache read", read_cpu_ns > 0 ? share_text : "-", "-"});
}

}  // namespace ferry_bench

// ferry-perf: ferry's transfers measured between two machines (or two network namespaces), as an
// inference server uses them: blocks awaited in batches with a deadline, over io_uring TCP, UCX or
// RDMA verbs, and io_uring file reads and writes on one host. usage: ferry-perf --help (cli.hpp).
//
// The verbs backend runs on FERRY_PERF_VERBS_PROVIDER, libibverbs unless a build says otherwise: the
// test tests/tools/ferry_perf_fake_verbs.cpp compiles this file on the fake adapter
// (ferry/testing/verbs.hpp), with FERRY_PERF_NO_MAIN, and runs target and initiator in one process.

#include <sys/resource.h>
#include <sys/utsname.h>

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <memory>
#include <mutex>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <ferry/ferry.hpp>
#include <ferry/metrics.hpp>
#if FERRY_PERF_HAVE_URING
#include <ferry/uring.hpp>
#endif
#if FERRY_PERF_HAVE_UCX
#include <ferry/ucx.hpp>
#endif
#if FERRY_PERF_HAVE_VERBS
#include <ferry/verbs.hpp>
#ifndef FERRY_PERF_VERBS_PROVIDER
#define FERRY_PERF_VERBS_PROVIDER ferry::verbs::real_provider
#endif
#ifndef FERRY_PERF_VERBS_PROVIDER_NAME
#define FERRY_PERF_VERBS_PROVIDER_NAME "libibverbs"
#endif
#endif

#include "by_name.hpp"
#include "check.hpp"
#include "cli.hpp"
#include "control.hpp"
#include "report.hpp"

namespace ferry_perf {
namespace {

using clk = std::chrono::steady_clock;
using namespace std::chrono_literals;

// tcp frames: a block's id is its stream (check.hpp: the thread and its slot); a read request, an
// empty frame, has this bit set too and asks the target for that block.
constexpr std::uint64_t read_request = std::uint64_t{1} << 63;
constexpr std::uint64_t slot_mask = (std::uint64_t{1} << 40) - 1;

// --check for one block size's run: the seed its data is made from (check.hpp).
struct check_plan {
  bool on = false;
  std::uint64_t seed = 0;
};

check_plan plan_check(const config& c) {
  check_plan p;
  p.on = c.check;
  if (p.on) {
    std::random_device rd;
    p.seed = (static_cast<std::uint64_t>(rd()) << 32) ^ rd();
  }
  return p;
}

// Time allowed for filling or verifying `bytes` with --check, on top of the usual deadlines: at
// 50 MB/s, well below what one core fills or compares, so that only a stuck side misses it.
std::chrono::milliseconds check_allowance(std::uint64_t bytes) {
  return std::chrono::milliseconds(bytes / 50'000);
}

// A thread's slots, `block` bytes apart, each filled with its stream's pattern.
void fill_slots(std::span<std::byte> memory, std::size_t block, std::size_t thread, std::uint64_t seed) {
  for (std::size_t i = 0; (i + 1) * block <= memory.size(); ++i) {
    fill_pattern(memory.subspan(i * block, block), seed, slot_stream(thread, i));
  }
}

std::string block_name(std::size_t thread, std::size_t slot) {
  return "thread " + std::to_string(thread) + " block " + std::to_string(slot);
}

// Slots [first, first + n) of a thread's memory, `size` bytes each, compared with their streams'
// pattern; each is spoiled after its check, so that the next read into it must write every byte
// again. Empty when every byte matched, else where the first mismatch was.
std::string verify_slots(std::span<std::byte> memory, std::size_t block, std::size_t thread, std::uint64_t seed,
                         std::size_t first, std::size_t n, std::size_t size) {
  for (std::size_t i = first; i < first + n; ++i) {
    const std::span<std::byte> b = memory.subspan(i * block, size);
    if (const auto bad = find_mismatch(b, seed, slot_stream(thread, i))) {
      return describe_mismatch(block_name(thread, i), *bad, size);
    }
    spoil(b);
  }
  return {};
}

cpu_times rusage_of(int who) {
  rusage u{};
  ::getrusage(who, &u);
  return {static_cast<double>(u.ru_utime.tv_sec) + static_cast<double>(u.ru_utime.tv_usec) * 1e-6,
          static_cast<double>(u.ru_stime.tv_sec) + static_cast<double>(u.ru_stime.tv_usec) * 1e-6};
}
cpu_times minus(const cpu_times& a, const cpu_times& b) { return {a.user_s - b.user_s, a.system_s - b.system_s}; }

std::chrono::nanoseconds seconds(double s) {
  return std::chrono::nanoseconds(static_cast<std::int64_t>(s * 1e9));
}

ferry::progress_mode mode_of(const std::string& m) {
  if (m == "busy") return ferry::progress_mode::busy;
  if (m == "park") return ferry::progress_mode::park;
  return ferry::progress_mode::adaptive;
}

bool backend_built(const std::string& b) {
  if (b == "tcp" || b == "file") return FERRY_PERF_HAVE_URING != 0;
  if (b == "ucx") return FERRY_PERF_HAVE_UCX != 0;
  if (b == "verbs") return FERRY_PERF_HAVE_VERBS != 0;
  return false;
}

void check_backend(const std::string& b) {
  if (!backend_built(b)) {
    throw usage_error("--backend " + b + ": this ferry-perf was built without it (its library was "
                      "not found when ferry was configured)");
  }
}

// Ends the process if a run outlives its deadline: whatever is stuck, the initiator never hangs.
class watchdog {
 public:
  watchdog() : thread_([this] { run(); }) {}
  ~watchdog() {
    {
      std::lock_guard l(m_);
      quit_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void arm(clk::duration d, std::string what) {
    std::lock_guard l(m_);
    deadline_ = clk::now() + d;
    what_ = std::move(what);
    armed_ = true;
    cv_.notify_all();
  }
  void disarm() {
    std::lock_guard l(m_);
    armed_ = false;
  }

 private:
  void run() {
    std::unique_lock l(m_);
    while (!quit_) {
      if (!armed_) {
        cv_.wait(l);
        continue;
      }
      if (cv_.wait_until(l, deadline_) == std::cv_status::timeout && armed_ && clk::now() >= deadline_) {
        std::fprintf(stderr, "\nferry-perf: %s did not finish by its deadline; giving up\n", what_.c_str());
        std::fflush(stderr);
        std::_Exit(1);
      }
    }
  }
  std::mutex m_;
  std::condition_variable cv_;
  clk::time_point deadline_{};
  std::string what_;
  bool armed_ = false;
  bool quit_ = false;
  std::thread thread_;
};

// ---- the initiator's side of a backend: one per submitting thread

class channel {
 public:
  virtual ~channel() = default;
  // Blocks [first, first + n) of this thread's slots, `size` bytes each: appends their transfers
  // (a block is done when all of its transfers are).
  virtual void submit(std::size_t first, std::size_t n, std::size_t size, std::vector<ferry::transfer>& out) = 0;
  // --check, once blocks [first, first + n) are done: a read compares what it got with the pattern
  // (and spoils the slots for the next read). Empty when they matched or there is nothing to check
  // here (a write is checked where it lands), else what did not match.
  [[nodiscard]] virtual std::string verify(std::size_t /*first*/, std::size_t /*n*/, std::size_t /*size*/) {
    return {};
  }
};

#if FERRY_PERF_HAVE_URING
class tcp_channel final : public channel {
 public:
  tcp_channel(ferry::uring::tcp_connection conn, bool write, std::size_t slots, std::size_t block, std::size_t thread,
              check_plan check)
      : conn_(std::move(conn)), write_(write), block_(block), thread_(thread), check_(check), data_(slots * block),
        acks_(slots * 8), got_(slots) {
    if (check_.on && write_) fill_slots(data_, block_, thread_, check_.seed);
  }
  ~tcp_channel() override { conn_.close(); }
  void submit(std::size_t first, std::size_t n, std::size_t size, std::vector<ferry::transfer>& out) override {
    for (std::size_t i = first; i < first + n; ++i) {
      const std::span<std::byte> slot(data_.data() + i * block_, size);
      if (write_) {
        out.push_back(conn_.send(slot_stream(thread_, i), slot));
        out.push_back(conn_.receive(std::span(acks_.data() + i * 8, 8), got_[i]));
      } else {
        out.push_back(conn_.send(read_request | slot_stream(thread_, i), {}));
        out.push_back(conn_.receive(slot, got_[i]));
      }
    }
  }
  std::string verify(std::size_t first, std::size_t n, std::size_t size) override {
    if (!check_.on || write_) return {};
    for (std::size_t i = first; i < first + n; ++i) {
      if (got_[i].length != size || got_[i].id != (read_request | slot_stream(thread_, i))) {
        return "check failed: " + block_name(thread_, i) + ": the target answered with frame " +
               std::to_string(got_[i].id) + " of " + std::to_string(got_[i].length) + " bytes, not " +
               std::to_string(read_request | slot_stream(thread_, i)) + " of " + std::to_string(size);
      }
    }
    if (std::string bad = verify_slots(data_, block_, thread_, check_.seed, first, n, size); !bad.empty()) {
      return "check failed: " + bad;
    }
    return {};
  }

 private:
  ferry::uring::tcp_connection conn_;
  bool write_;
  std::size_t block_;
  std::size_t thread_;
  check_plan check_;
  std::vector<std::byte> data_;
  std::vector<std::byte> acks_;
  std::vector<ferry::uring::received_block> got_;
};

// A thread's share of the file, [base, base + region): blocks at random block-aligned offsets in it.
// With --check the bytes are the file's pattern at their offset (check.hpp): a write fills its
// slot for the offset it goes to and marks that place written; a read is compared at that offset.
class file_channel final : public channel {
 public:
  file_channel(ferry::uring::ring& r, int fd, bool write, std::size_t slots, std::size_t block,
               std::uint64_t region_offset, std::uint64_t region_bytes, unsigned seed, check_plan check)
      : ring_(r), fd_(fd), write_(write), block_(block), data_(slots * block),
        base_(region_offset), region_(region_bytes), rng_(seed), check_(check), offsets_(slots) {}
  void submit(std::size_t first, std::size_t n, std::size_t size, std::vector<ferry::transfer>& out) override {
    const std::uint64_t positions = std::max<std::uint64_t>(1, region_ / size);
    std::uniform_int_distribution<std::uint64_t> pick(0, positions - 1);
    if (check_.on && write_ && written_.empty()) written_.resize(positions);
    const std::size_t at = out.size();
    out.resize(at + n);
    if (write_) {
      wblocks_.clear();
      for (std::size_t i = first; i < first + n; ++i) {
        const std::uint64_t position = pick(rng_);
        const std::uint64_t offset = base_ + position * size;
        if (check_.on) {
          fill_pattern(data_.subspan(i * block_, size), check_.seed, file_stream, offset);
          written_[position] = true;
        }
        wblocks_.push_back({data_.subspan(i * block_, size), offset});
      }
      ring_.write_batch(fd_, wblocks_, std::span(out).subspan(at, n));
    } else {
      rblocks_.clear();
      for (std::size_t i = first; i < first + n; ++i) {
        offsets_[i] = base_ + pick(rng_) * size;
        rblocks_.push_back({data_.subspan(i * block_, size), offsets_[i]});
      }
      ring_.read_batch(fd_, rblocks_, std::span(out).subspan(at, n));
    }
  }
  std::string verify(std::size_t first, std::size_t n, std::size_t size) override {
    if (!check_.on || write_) return {};
    for (std::size_t i = first; i < first + n; ++i) {
      const std::span<std::byte> b = data_.subspan(i * block_, size);
      if (const auto bad = find_mismatch(b, check_.seed, file_stream, offsets_[i])) {
        return "check failed: " +
               describe_mismatch("the block read at file offset " + std::to_string(offsets_[i]), *bad, size);
      }
      spoil(b);
    }
    return {};
  }
  // --check, writes, after the run: every place written read back through `plain_fd` (the file
  // without O_DIRECT, which needs no alignment) and compared with the pattern.
  [[nodiscard]] std::string verify_written(int plain_fd, std::size_t size) const {
    std::vector<std::byte> b(size);
    for (std::uint64_t position = 0; position < written_.size(); ++position) {
      if (!written_[position]) continue;
      const std::uint64_t offset = base_ + position * size;
      std::size_t got = 0;
      while (got < size) {
        const ssize_t r = ::pread(plain_fd, b.data() + got, size - got, static_cast<off_t>(offset + got));
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
          return "check failed: reading back the block written at file offset " + std::to_string(offset) + ": " +
                 (r < 0 ? std::strerror(errno) : "the file ends before it");
        }
        got += static_cast<std::size_t>(r);
      }
      if (const auto bad = find_mismatch(b, check_.seed, file_stream, offset)) {
        return "check failed: " +
               describe_mismatch("the block written at file offset " + std::to_string(offset), *bad, size);
      }
    }
    return {};
  }

 private:
  ferry::uring::ring& ring_;
  int fd_;
  bool write_;
  std::size_t block_;
  ferry::uring::aligned_buffer data_;
  std::uint64_t base_;
  std::uint64_t region_;
  std::mt19937_64 rng_;
  check_plan check_;
  std::vector<std::uint64_t> offsets_;  // reads: where each slot's block was read from
  std::vector<bool> written_;           // writes: the block-aligned places written, by position
  std::vector<ferry::uring::read_block> rblocks_;
  std::vector<ferry::uring::write_block> wblocks_;
};
#endif

// The one-sided backends' channel: a thread's slot i is block i of its local region and block i of
// its share of the target's region (from `remote_base`); a batch goes out as one batch call. With
// --check, writes go out of slots filled with their pattern once, and reads are compared here.
template <class Block>
class one_sided_channel : public channel {
 public:
  void submit(std::size_t first, std::size_t n, std::size_t size, std::vector<ferry::transfer>& out) final {
    blocks_.clear();
    for (std::size_t i = first; i < first + n; ++i) blocks_.push_back(block_at(i * block_, base_ + i * block_, size));
    const std::size_t at = out.size();
    out.resize(at + n);
    post(blocks_, std::span(out).subspan(at, n));
  }
  std::string verify(std::size_t first, std::size_t n, std::size_t size) final {
    if (!check_.on || write_) return {};
    if (std::string bad = verify_slots(local_, block_, thread_, check_.seed, first, n, size); !bad.empty()) {
      return "check failed: " + bad;
    }
    return {};
  }

 protected:
  one_sided_channel(std::uint64_t remote_base, std::size_t block, bool write, std::size_t thread, check_plan check)
      : write_(write), base_(remote_base), block_(block), thread_(thread), check_(check) {}
  // The local region, once the derived channel holds it.
  void use_local(std::span<std::byte> memory) {
    local_ = memory;
    if (check_.on && write_) fill_slots(local_, block_, thread_, check_.seed);
  }
  virtual Block block_at(std::size_t local_offset, std::uint64_t remote_offset, std::size_t size) = 0;
  virtual void post(std::span<const Block> blocks, std::span<ferry::transfer> out) = 0;

  bool write_;

 private:
  std::uint64_t base_;
  std::size_t block_;
  std::size_t thread_;
  check_plan check_;
  std::span<std::byte> local_;
  std::vector<Block> blocks_;
};

#if FERRY_PERF_HAVE_UCX
class ucx_channel final : public one_sided_channel<ferry::ucx::rma_block> {
 public:
  ucx_channel(ferry::ucx::endpoint ep, ferry::ucx::memory_region local, ferry::ucx::remote_memory remote,
              std::uint64_t remote_base, bool write, ferry::ucx::put_completion completion, std::size_t block,
              ferry::detail::clock::duration timeout, std::size_t thread, check_plan check)
      : one_sided_channel(remote_base, block, write, thread, check), ep_(std::move(ep)), local_(std::move(local)),
        remote_(remote), completion_(completion), timeout_(timeout) {
    use_local(local_.bytes());
  }

 private:
  ferry::ucx::rma_block block_at(std::size_t local_offset, std::uint64_t remote_offset, std::size_t size) override {
    return {local_.slice(local_offset, size), remote_.slice(remote_offset, size)};
  }
  void post(std::span<const ferry::ucx::rma_block> blocks, std::span<ferry::transfer> out) override {
    if (write_) {
      ep_.put_batch(blocks, out, timeout_, completion_);
    } else {
      ep_.get_batch(blocks, out, timeout_);
    }
  }

  ferry::ucx::endpoint ep_;
  ferry::ucx::memory_region local_;
  ferry::ucx::remote_memory remote_;
  ferry::ucx::put_completion completion_;
  ferry::detail::clock::duration timeout_;
};
#endif

#if FERRY_PERF_HAVE_VERBS
using verbs_provider = FERRY_PERF_VERBS_PROVIDER;
using verbs_device = ferry::verbs::basic_device<verbs_provider>;
using verbs_region = ferry::verbs::basic_memory_region<verbs_provider>;
using verbs_connection = ferry::verbs::basic_connection<verbs_provider>;

// Queue pairs deep enough for a thread's blocks in flight (up to 4096 work requests; beyond that a
// submitting thread waits for room, and a batch larger than the queue goes out in parts: see
// verbs_channel::post), admission bounded by the run's deadline rather than failing at once.
ferry::verbs::queue_pair_options verbs_queue_pair(std::size_t slots, double timeout_s) {
  ferry::verbs::queue_pair_options o;
  o.send_depth = static_cast<std::uint32_t>(std::clamp<std::size_t>(slots, 16, 4096));
  o.admission_timeout = seconds(timeout_s);
  return o;
}

// A completion queue with room for every queue pair of the run (send depth, a peer check, receives).
ferry::verbs::device_options verbs_device_options(const config& c, std::size_t queue_pairs,
                                                  const ferry::verbs::queue_pair_options& qp,
                                                  ferry::metrics::registry* reg) {
  ferry::verbs::device_options o;
  o.name = c.device;
  o.gid_index = c.gid_index;
  o.completion_queue_entries = static_cast<int>(queue_pairs * (qp.send_depth + 1 + qp.receive_depth) + 64);
  o.metrics = reg;
  return o;
}

class verbs_channel final : public one_sided_channel<ferry::verbs::basic_rdma_block<verbs_provider>> {
 public:
  verbs_channel(verbs_connection conn, verbs_region local, std::uint64_t remote_base, bool write, std::size_t block,
                std::chrono::nanoseconds timeout, std::size_t thread, check_plan check)
      : one_sided_channel(remote_base, block, write, thread, check), conn_(std::move(conn)), local_(std::move(local)),
        remote_(conn_.peer_regions.at(0)), timeout_(timeout) {
    use_local(local_.bytes());
  }

 private:
  using block_type = ferry::verbs::basic_rdma_block<verbs_provider>;
  block_type block_at(std::size_t local_offset, std::uint64_t remote_offset, std::size_t size) override {
    return {local_.slice(local_offset, size), remote_.slice(remote_offset, size)};
  }
  // A batch larger than the send queue (a kv layer of more than 4096 blocks) goes out as several
  // batch calls of at most send_depth() work requests; the layer's when_all awaits them all.
  void post(std::span<const block_type> blocks, std::span<ferry::transfer> out) override {
    const std::size_t most = conn_.qp.send_depth();
    for (std::size_t at = 0; at < blocks.size(); at += most) {
      const std::size_t n = std::min(most, blocks.size() - at);
      if (write_) {
        conn_.qp.write_batch(blocks.subspan(at, n), out.subspan(at, n), timeout_);
      } else {
        conn_.qp.read_batch(blocks.subspan(at, n), out.subspan(at, n), timeout_);
      }
    }
  }

  verbs_connection conn_;
  verbs_region local_;
  ferry::verbs::remote_region remote_;
  std::chrono::nanoseconds timeout_;
};
#endif

// ---- the measuring loop, one per thread

struct thread_result {
  std::uint64_t ops = 0;
  cpu_times cpu;
  std::vector<double> latency_us;
  std::vector<double> step_us;
  std::vector<std::vector<double>> layer_ready_us;  // [layer][step]
  std::string error;
};

struct run_shape {
  std::string workload;
  std::size_t size = 0;
  std::size_t batch = 1;
  std::size_t depth = 1;
  std::size_t layers = 1;
  std::size_t requests = 1;
  clk::duration duration{};
  std::chrono::nanoseconds timeout{};
};

// What went wrong with a batch, once: "transfer 3 of a batch of 8: Connection reset by peer", "a
// batch of 8 transfers timed out after 2 s with 3 pending". The caller's message says that the run
// failed.
std::string describe(const ferry::batch_result& r, const std::vector<ferry::transfer>& members,
                     std::chrono::nanoseconds timeout) {
  const std::string batch = "a batch of " + std::to_string(members.size());
  if (r.verdict == ferry::verdict::timed_out) {
    return batch + " transfers timed out after " + format_real(std::chrono::duration<double>(timeout).count()) +
           " s with " + std::to_string(r.pending) + " pending";
  }
  if (r.first_failed) return "transfer " + std::to_string(*r.first_failed) + " of " + batch + ": " + r.error.message();
  return std::string("the batch's verdict is ") + ferry::to_string(r.verdict);
}

// The batches' deadlines are served by the process-wide timer thread rather than the executor's:
// the executor is destroyed right after each block size's run, and a when_all that has resumed can
// still be unlinking its timer there (the executor then aborts: timers still armed).
ferry::task<void> measure(channel& ch, const run_shape& s,
                          std::atomic<std::uint64_t>& progress, std::atomic<bool>& stop, thread_result& out) {
  const auto until = clk::now() + s.duration;
  if (s.workload == "kv") {
    const std::size_t per_layer = s.requests * s.batch;
    std::vector<std::vector<ferry::transfer>> layers(s.layers);
    out.layer_ready_us.resize(s.layers);
    while (clk::now() < until && !stop.load(std::memory_order_relaxed)) {
      const auto start = clk::now();
      for (std::size_t l = 0; l < s.layers; ++l) {
        layers[l].clear();
        ch.submit(l * per_layer, per_layer, s.size, layers[l]);
      }
      for (std::size_t l = 0; l < s.layers; ++l) {
        const ferry::batch_result r = co_await ferry::when_all(std::span<const ferry::transfer>(layers[l]), s.timeout);
        if (!r.ok()) {
          out.error = "kv layer " + std::to_string(l) + ", " + describe(r, layers[l], s.timeout);
          break;
        }
        // The layer was ready when the coroutine resumed: a check of its blocks comes after it.
        const double ready_us = std::chrono::duration<double, std::micro>(clk::now() - start).count();
        if (std::string bad = ch.verify(l * per_layer, per_layer, s.size); !bad.empty()) {
          out.error = std::move(bad);
          break;
        }
        out.layer_ready_us[l].push_back(ready_us);
        out.ops += per_layer;
        progress.fetch_add(per_layer, std::memory_order_relaxed);
      }
      if (!out.error.empty()) break;
      out.step_us.push_back(std::chrono::duration<double, std::micro>(clk::now() - start).count());
    }
    for (auto& l : layers) (void)ferry::drain(std::span<const ferry::transfer>(l), s.timeout);
    co_return;
  }
  const bool latency = s.workload == "latency";
  std::vector<std::vector<ferry::transfer>> inflight(s.depth);
  std::vector<clk::time_point> started(s.depth);
  for (std::size_t d = 0; d < s.depth; ++d) {
    started[d] = clk::now();
    ch.submit(d * s.batch, s.batch, s.size, inflight[d]);
  }
  for (std::size_t i = 0;; i = (i + 1) % s.depth) {
    auto& b = inflight[i];
    if (b.empty()) break;
    const ferry::batch_result r = co_await ferry::when_all(std::span<const ferry::transfer>(b), s.timeout);
    if (!r.ok()) {
      out.error = describe(r, b, s.timeout);
      break;
    }
    // The latency ends when the coroutine resumes: a check of the block comes after it.
    if (latency && out.latency_us.size() < 2'000'000) {
      out.latency_us.push_back(std::chrono::duration<double, std::micro>(clk::now() - started[i]).count());
    }
    if (std::string bad = ch.verify(i * s.batch, s.batch, s.size); !bad.empty()) {
      out.error = std::move(bad);
      break;
    }
    out.ops += s.batch;
    progress.fetch_add(s.batch, std::memory_order_relaxed);
    b.clear();
    if (clk::now() < until && !stop.load(std::memory_order_relaxed)) {
      started[i] = clk::now();
      ch.submit(i * s.batch, s.batch, s.size, b);
    }
  }
  for (auto& b : inflight) (void)ferry::drain(std::span<const ferry::transfer>(b), s.timeout);
}

// Runs every thread's loop on its channel and fills the point's figures.
void run_threads(std::vector<std::unique_ptr<channel>>& channels,
                 const run_shape& s, point_result& p) {
  std::atomic<std::uint64_t> progress{0};
  std::atomic<bool> stop{false};
  std::vector<thread_result> results(channels.size());
  const cpu_times before = rusage_of(RUSAGE_SELF);
  const auto start = clk::now();
  std::vector<std::thread> threads;
  for (std::size_t t = 0; t < channels.size(); ++t) {
    threads.emplace_back([&, t] {
      const cpu_times mine = rusage_of(RUSAGE_THREAD);
      try {
        ferry::run_loop loop;
        ferry::sync_wait(loop, measure(*channels[t], s, progress, stop, results[t]));
      } catch (const std::exception& e) {
        results[t].error = e.what();
      }
      if (!results[t].error.empty()) stop.store(true);
      results[t].cpu = minus(rusage_of(RUSAGE_THREAD), mine);
    });
  }
  const bool tty = ::isatty(2) != 0;
  std::atomic<bool> finished{false};
  std::thread ticker([&] {
    std::uint64_t last = 0;
    auto last_t = clk::now();
    while (!finished.load()) {
      std::this_thread::sleep_for(200ms);
      if (!tty) continue;
      const auto now = clk::now();
      const std::uint64_t ops = progress.load();
      const double dt = std::chrono::duration<double>(now - last_t).count();
      if (dt < 0.5) continue;
      std::fprintf(stderr, "\r  %-6s %9.1f MB/s %9.0f ops/s  %5.1f/%.1f s ", size_name(s.size).c_str(),
                   static_cast<double>(ops - last) * static_cast<double>(s.size) / dt / 1e6,
                   static_cast<double>(ops - last) / dt, std::chrono::duration<double>(now - start).count(),
                   std::chrono::duration<double>(s.duration).count());
      std::fflush(stderr);
      last = ops;
      last_t = now;
    }
    if (tty) std::fprintf(stderr, "\r%70s\r", "");
  });
  for (auto& t : threads) t.join();
  finished.store(true);
  ticker.join();
  p.seconds = std::chrono::duration<double>(clk::now() - start).count();
  p.initiator_process = minus(rusage_of(RUSAGE_SELF), before);
  std::vector<std::vector<double>> ready(s.layers);
  for (auto& r : results) {
    p.ops += r.ops;
    p.initiator_threads.user_s += r.cpu.user_s;
    p.initiator_threads.system_s += r.cpu.system_s;
    p.latency_us.insert(p.latency_us.end(), r.latency_us.begin(), r.latency_us.end());
    p.step_us.insert(p.step_us.end(), r.step_us.begin(), r.step_us.end());
    for (std::size_t l = 0; l < r.layer_ready_us.size() && l < ready.size(); ++l) {
      ready[l].insert(ready[l].end(), r.layer_ready_us[l].begin(), r.layer_ready_us[l].end());
    }
    if (p.error.empty() && !r.error.empty()) p.error = r.error;
  }
  p.bytes = p.ops * s.size;
  std::sort(p.latency_us.begin(), p.latency_us.end());
  std::sort(p.step_us.begin(), p.step_us.end());
  if (s.workload == "kv") {
    for (auto& l : ready) {
      std::sort(l.begin(), l.end());
      p.layer_ready_us.push_back(quantile(l, 0.5));
    }
  }
}

run_shape shape_of(const config& c, std::size_t size) {
  return {c.workload, size, c.batch, c.depth, c.layers, c.requests,
          std::chrono::duration_cast<clk::duration>(seconds(c.duration)), seconds(c.timeout)};
}

ferry::executor_options executor_of(const config& c) {
  ferry::executor_options o;
  o.mode = mode_of(c.executor);
  return o;
}

std::chrono::milliseconds ms(double s) { return std::chrono::milliseconds(static_cast<std::int64_t>(s * 1000)); }

// ---- initiator

point_result initiator_point(const config& c, std::size_t size, ferry::metrics::registry* reg) {
  point_result p;
  p.block = size;
  std::string host;
  std::uint16_t port = 0;
  split_host_port(c.connect, "--connect", host, port);
  const auto tmo = ms(c.timeout);
  control_socket ctl = control_socket::connect(host, port, tmo);
  const std::size_t slots = slots_per_thread(c);
  const check_plan check = plan_check(c);
  // The target fills its memory with the pattern before it answers, and checks it after the run.
  const auto check_time = check.on ? check_allowance(std::uint64_t{c.threads} * slots * size) : 0ms;
  std::string hello = "hello backend=" + c.backend + " op=" + c.op + " threads=" + std::to_string(c.threads) +
                      " slots=" + std::to_string(slots) + " block=" + std::to_string(size) + " transport=" +
                      c.transport + " duration=" + format_real(c.duration) + " timeout=" + format_real(c.timeout) +
                      " check=" + (check.on ? "1 seed=" + std::to_string(check.seed) : "0");
  ctl.send_line(hello, tmo);
  const std::string reply = ctl.read_line(tmo + check_time);
  if (reply.rfind("error ", 0) == 0) throw control_error("the target refused the run: " + reply.substr(6));
  const control_line ready = control_line::parse(reply, "ready", {"port", "check"});
  const auto data_port = static_cast<std::uint16_t>(ready.whole("port", 1, 65535));
  // A target that does not say it checks (one older than --check) would let every run pass.
  if (check.on && !(ready.has("check") && ready.text("check") == "1")) {
    throw control_error("the target did not agree to check the data (its answer: " + in_quotes(reply) + ")");
  }
  const run_shape shape = shape_of(c, size);
  ferry::progress_executor exec(executor_of(c));
  const bool write = c.op == "write";
  if (c.backend == "tcp") {
#if FERRY_PERF_HAVE_URING
    ferry::uring::ring_options ro;
    ro.metrics = c.metrics ? reg : nullptr;
    ferry::uring::ring ring(exec, ro);
    {
      std::vector<std::unique_ptr<channel>> channels;
      for (std::size_t t = 0; t < c.threads; ++t) {
        channels.push_back(std::make_unique<tcp_channel>(
            ferry::uring::tcp_connection::connect(ring, host, data_port), write, slots, size, t, check));
      }
      run_threads(channels, shape, p);
    }
#endif
  } else if (c.backend == "ucx") {
#if FERRY_PERF_HAVE_UCX
    ferry::ucx::worker_options wo;
    wo.transports = c.transport;
    wo.metrics = c.metrics ? reg : nullptr;
    ferry::ucx::worker worker(exec, wo);
    {
      std::vector<std::unique_ptr<channel>> channels;
      for (std::size_t t = 0; t < c.threads; ++t) {
        ferry::ucx::endpoint ep = worker.connect(host, data_port, {}, seconds(c.timeout));
        const auto regions = ep.peer_regions();
        if (regions.empty()) throw control_error("the target exposed no memory region");
        ferry::ucx::memory_region local = worker.allocate(slots * size);
        const auto completion = c.put_completion == "landed" ? ferry::ucx::put_completion::landed
                                                             : ferry::ucx::put_completion::source_reusable;
        channels.push_back(std::make_unique<ucx_channel>(ep, std::move(local), regions[0], t * slots * size, write,
                                                         completion, size, seconds(c.timeout), t, check));
      }
      run_threads(channels, shape, p);
    }
#endif
  } else if (c.backend == "verbs") {
#if FERRY_PERF_HAVE_VERBS
    const ferry::verbs::queue_pair_options qp = verbs_queue_pair(slots, c.timeout);
    verbs_device device(exec, verbs_device_options(c, c.threads, qp, c.metrics ? reg : nullptr));
    {
      std::vector<std::unique_ptr<channel>> channels;
      for (std::size_t t = 0; t < c.threads; ++t) {
        verbs_connection conn = ferry::verbs::connect(device, host, data_port, std::span<const ferry::verbs::remote_region>(),
                                                      qp, seconds(c.timeout));
        if (conn.peer_regions.empty()) throw control_error("the target exposed no memory region");
        verbs_region local = verbs_region::allocate(device, slots * size);
        channels.push_back(std::make_unique<verbs_channel>(std::move(conn), std::move(local), t * slots * size, write,
                                                           size, seconds(c.timeout), t, check));
      }
      run_threads(channels, shape, p);
    }
#endif
  }
  // The data connections are closed: the target's side of them has ended.
  try {
    ctl.send_line("done", tmo);
    const control_line cpu = control_line::parse(ctl.read_line(tmo + ms(5)), "cpu", {"user_s", "system_s", "ops"});
    // A year of CPU time, and 2^53 blocks (exact as a double, as JSON readers hold numbers), bound
    // figures that no real run reaches.
    constexpr double most_cpu_s = 86400.0 * 365;
    p.target_process = {cpu.real("user_s", 0, most_cpu_s, "seconds"), cpu.real("system_s", 0, most_cpu_s, "seconds")};
    p.target_ops = cpu.whole("ops", 0, std::uint64_t{1} << 53);
    p.target_reported = true;
  } catch (const std::exception& e) {
    if (p.error.empty()) p.error = std::string("the target did not report its CPU time: ") + e.what();
  }
  if (check.on && p.target_reported) {
    try {
      const std::string verdict = ctl.read_line(tmo + ms(5) + check_time);
      if (verdict == "check ok") {
        p.checked = p.error.empty();
      } else if (verdict.rfind("check failed ", 0) == 0) {
        if (p.error.empty()) p.error = "check failed on the target: " + verdict.substr(13);
      } else {
        throw control_error("its report is not 'check ok' or 'check failed', but " + in_quotes(verdict));
      }
    } catch (const std::exception& e) {
      if (p.error.empty()) p.error = std::string("the target did not report its check: ") + e.what();
    }
  }
  return p;
}

// ---- file

// The test hook (check.hpp): byte `offset` of the file flipped, where a checked run must find it.
void corrupt_file_byte(int fd, std::uint64_t offset, const std::string& path) {
  unsigned char b = 0;
  if (::pread(fd, &b, 1, static_cast<off_t>(offset)) != 1) {
    throw std::runtime_error("FERRY_PERF_TEST_CORRUPT: " + path + " has no byte " + std::to_string(offset));
  }
  b = static_cast<unsigned char>(~b);
  if (::pwrite(fd, &b, 1, static_cast<off_t>(offset)) != 1 || ::fsync(fd) != 0) {
    throw std::system_error(errno, std::system_category(), "FERRY_PERF_TEST_CORRUPT: writing " + path);
  }
}

point_result file_point(const config& c, std::size_t size, ferry::metrics::registry* reg) {
  point_result p;
  p.block = size;
#if FERRY_PERF_HAVE_URING
  const int flags = O_RDWR | O_CREAT | O_CLOEXEC | (c.direct ? O_DIRECT : 0);
  const int fd = ::open(c.path.c_str(), flags, 0644);
  if (fd < 0) throw std::system_error(errno, std::system_category(), "open " + c.path);
  struct closer {
    int fd;
    ~closer() {
      if (fd >= 0) ::close(fd);
    }
  } close_fd{fd};
  if (c.file_size < size * c.threads) throw usage_error("--file-size is smaller than one block per thread");
  const check_plan check = plan_check(c);
  const std::uint64_t share = c.file_size / c.threads / size * size;
  // --check on writes marks each place written, one bit per block-aligned place of a thread's share.
  if (check.on && c.op == "write" && share / size > (std::uint64_t{1} << 32)) {
    throw usage_error("--check: a thread's share of --file-size holds more than 2^32 blocks of " + size_name(size) +
                      "; use a smaller --file-size or larger blocks");
  }
  // The whole file exists before a read of it: a read past its end would fail as end_of_file. A
  // checked read needs the file to hold this run's pattern, every byte of it.
  struct stat st{};
  ::fstat(fd, &st);
  const bool fill_with_pattern = check.on && c.op == "read";
  if (static_cast<std::size_t>(st.st_size) < c.file_size || fill_with_pattern) {
    ferry::uring::aligned_buffer chunk(std::size_t{1} << 20);
    for (std::size_t i = 0; i < chunk.size(); ++i) chunk.data()[i] = static_cast<std::byte>(i * 7);
    for (std::size_t off = 0; off < c.file_size; off += chunk.size()) {
      const std::size_t n = std::min(chunk.size(), c.file_size - off);
      if (fill_with_pattern) fill_pattern(chunk.span(), check.seed, file_stream, off);
      if (::pwrite(fd, chunk.data(), c.direct ? chunk.size() : n, static_cast<off_t>(off)) < 0) {
        throw std::system_error(errno, std::system_category(), "filling " + c.path);
      }
    }
    if (::ftruncate(fd, static_cast<off_t>(c.file_size)) != 0 || ::fsync(fd) != 0) {
      throw std::system_error(errno, std::system_category(), "sizing " + c.path);
    }
  }
  // Read back and corrupted (the test hook) without O_DIRECT, which would need aligned buffers.
  int plain_fd = -1;
  if (check.on) {
    plain_fd = ::open(c.path.c_str(), O_RDWR | O_CLOEXEC);
    if (plain_fd < 0) throw std::system_error(errno, std::system_category(), "open " + c.path);
  }
  const closer close_plain{plain_fd};
  const corruption corrupt = check.on ? corruption_for_tests() : corruption{};
  if (corrupt.on && c.op == "read") corrupt_file_byte(plain_fd, corrupt.offset, c.path);
  ferry::progress_executor exec(executor_of(c));
  ferry::uring::ring_options ro;
  ro.metrics = c.metrics ? reg : nullptr;
  // The ring takes at most 32768 entries: clamped before the cast, which would wrap.
  ro.entries = static_cast<unsigned>(std::clamp<std::size_t>(slots_per_thread(c) * c.threads, 256, 32768));
  ferry::uring::ring ring(exec, ro);
  std::vector<std::unique_ptr<channel>> channels;
  for (std::size_t t = 0; t < c.threads; ++t) {
    channels.push_back(std::make_unique<file_channel>(ring, fd, c.op == "write", slots_per_thread(c), size, t * share,
                                                      share, static_cast<unsigned>(t + 1), check));
  }
  run_threads(channels, shape_of(c, size), p);
  if (check.on && c.op == "write" && p.error.empty()) {
    if (corrupt.on) corrupt_file_byte(plain_fd, corrupt.offset, c.path);
    for (const auto& ch : channels) {
      p.error = static_cast<const file_channel&>(*ch).verify_written(plain_fd, size);
      if (!p.error.empty()) break;
    }
  }
  p.checked = check.on && p.error.empty();
#else
  (void)c;
  (void)reg;
#endif
  return p;
}

// ---- target

// A run as the initiator's hello asks for it.
struct run_request {
  std::string backend;
  bool write = true;
  std::size_t threads = 1;
  std::size_t slots = 1;  // per thread
  std::size_t block = 1;
  std::string transport;
  double duration = 0;
  double timeout = 0;
  check_plan check;
};

// A run the target will not serve: it answers "error WHY", logs WHY, and serves the next.
struct refusal : control_error {
  using control_error::control_error;
};

// The hello read strictly: a field missing, malformed or out of range, a run larger than the target
// gives or of another backend is refused, naming the field and its value.
run_request read_hello(const std::string& line, const config& c) {
  run_request r;
  try {
    if (line.rfind("hello", 0) != 0) {
      throw control_error("not a ferry-perf initiator: its first line is " + in_quotes(line));
    }
    const control_line h = control_line::parse(line, "hello",
                                               {"backend", "op", "threads", "slots", "block", "transport",
                                                "duration", "timeout", "check", "seed"});
    r.backend = h.one_of("backend", {"tcp", "ucx", "verbs"});
    r.write = h.one_of("op", {"read", "write"}) == "write";
    r.threads = h.whole("threads", 1, 64);
    r.slots = h.whole("slots", 1, most_buffer_bytes);
    r.block = h.whole("block", 1, most_buffer_bytes);
    r.transport = h.text("transport");
    if (!is_transport_list(r.transport)) {
      throw control_error("hello: transport=" + in_quotes(r.transport) + " is not a UCX transport list");
    }
    r.duration = h.real("duration", 0.001, 86400, "seconds");
    r.timeout = h.real("timeout", 0.001, 86400, "seconds");
    r.check.on = h.one_of("check", {"0", "1"}) == "1";
    if (r.check.on) r.check.seed = h.whole("seed", 0, ~std::uint64_t{0});
    if (!r.check.on && h.has("seed")) throw control_error("hello: a seed without check=1");
  } catch (const refusal&) {
    throw;
  } catch (const control_error& e) {
    throw refusal(e.what());
  }
  // Each factor checked against what is left, so that no product of the initiator's numbers wraps.
  if (r.slots > most_buffer_bytes / r.block || r.threads > most_buffer_bytes / (r.slots * r.block)) {
    throw refusal("the run asks for more memory than the target gives (8 GiB): " + std::to_string(r.threads) +
                  " threads of " + std::to_string(r.slots) + " blocks of " + std::to_string(r.block) + " bytes");
  }
  if (r.backend != c.backend) throw refusal("this target serves --backend " + c.backend + ", not " + r.backend);
  return r;
}

// What a target counts and finds while it serves a run, from every serving thread.
class session_stats {
 public:
  std::atomic<std::uint64_t> ops{0};

  // The first thing found wrong with the data (--check) or the frames; later ones are dropped.
  void found(std::string what) {
    std::lock_guard l(m_);
    if (first_.empty()) first_ = std::move(what);
  }
  [[nodiscard]] std::string first_found() const {
    std::lock_guard l(m_);
    return first_;
  }

 private:
  mutable std::mutex m_;
  std::string first_;
};

// Flips byte `offset` of a block (the test hook, check.hpp); offsets past its end wrap into it.
void corrupt_block(std::span<std::byte> block, std::uint64_t offset) {
  block[static_cast<std::size_t>(offset % block.size())] ^= std::byte{0xff};
}

// --check on a one-sided target's region (or a tcp target's blocks to serve), threads × slots
// blocks: for a read run it holds the pattern the initiator compares with; for a write run the
// pattern spoiled, so that a block no write reached fails the check after the run.
void prepare_region(std::span<std::byte> region, const run_request& run, corruption corrupt) {
  const std::size_t share = run.slots * run.block;
  for (std::size_t t = 0; t < run.threads; ++t) {
    fill_slots(region.subspan(t * share, share), run.block, t, run.check.seed);
    if (run.write) spoil(region.subspan(t * share, share));
  }
  if (corrupt.on && !run.write) corrupt_block(region.first(run.block), corrupt.offset);
}

// After a write run: every block of the region compared with what its thread's slot wrote.
std::string verify_region(std::span<std::byte> region, const run_request& run, corruption corrupt) {
  if (corrupt.on) corrupt_block(region.first(run.block), corrupt.offset);
  const std::size_t share = run.slots * run.block;
  for (std::size_t t = 0; t < run.threads; ++t) {
    std::string bad =
        verify_slots(region.subspan(t * share, share), run.block, t, run.check.seed, 0, run.slots, run.block);
    if (!bad.empty()) return bad;
  }
  return {};
}

#if FERRY_PERF_HAVE_URING
// Serves one data connection: receives kept posted in every slot, in order; each write is
// acknowledged with an empty frame (after its check, with --check), each read request answered
// with its block: from `served` (the pattern, with --check) or a block of zeros. A frame that names
// no block of the run, or is of the other operation, ends the connection.
void serve_tcp(ferry::uring::tcp_connection& conn, const run_request& run, std::span<const std::byte> served,
               corruption corrupt, std::atomic<bool>& stop, session_stats& stats) {
  const std::size_t slots = run.slots;
  const std::size_t block = run.block;
  // A read's request frames are empty: receive buffers only for a write run.
  const std::size_t rx_block = run.write ? block : 0;
  std::vector<std::byte> rx(slots * rx_block);
  const std::vector<std::byte> zeros(run.write || run.check.on ? 0 : block);
  std::vector<ferry::uring::received_block> got(slots);
  std::vector<ferry::transfer> receives(slots);
  std::vector<ferry::transfer> sends;
  for (std::size_t i = 0; i < slots; ++i) {
    receives[i] = conn.receive(std::span(rx.data() + i * rx_block, rx_block), got[i]);
  }
  for (std::size_t i = 0;; i = (i + 1) % slots) {
    ferry::transfer_state st = ferry::transfer_state::pending;
    while (st == ferry::transfer_state::pending && !stop.load(std::memory_order_relaxed)) {
      st = receives[i].wait_for(100ms);
    }
    if (st != ferry::transfer_state::success) break;
    const std::uint64_t id = got[i].id;
    const bool read = (id & read_request) != 0;
    const std::size_t thread = static_cast<std::size_t>((id & ~read_request) >> 40);
    const std::size_t slot = static_cast<std::size_t>(id & slot_mask);
    if (thread >= run.threads || slot >= slots || read == run.write) {
      stats.found("a frame with id " + std::to_string(id) + " (" + (read ? "a read of " : "a write of ") +
                  block_name(thread, slot) + ") in a " + (run.write ? "write" : "read") + " run of " +
                  std::to_string(run.threads) + " threads of " + std::to_string(slots) + " blocks");
      break;
    }
    if (read) {
      sends.push_back(conn.send(id, run.check.on ? served.subspan((thread * slots + slot) * block, block)
                                                 : std::span<const std::byte>(zeros)));
    } else {
      if (run.check.on) {
        const std::span<std::byte> b(rx.data() + i * block, block);
        if (corrupt.on && thread == 0 && slot == 0) {
          corrupt_block(b, corrupt.offset);
          corrupt.on = false;
        }
        if (got[i].length != block) {
          stats.found(block_name(thread, slot) + ": " + std::to_string(got[i].length) + " bytes arrived, not " +
                      std::to_string(block));
        } else if (const auto bad = find_mismatch(b, run.check.seed, slot_stream(thread, slot))) {
          stats.found(describe_mismatch(block_name(thread, slot), *bad, block));
        }
        spoil(b);  // the next frame into this slot must write every byte again
      }
      sends.push_back(conn.send(id, {}));
    }
    stats.ops.fetch_add(1, std::memory_order_relaxed);
    receives[i] = conn.receive(std::span(rx.data() + i * rx_block, rx_block), got[i]);
    if (sends.size() > 4 * slots) {
      std::erase_if(sends, [](const ferry::transfer& t) { return t.done(); });
    }
  }
  conn.close();
  (void)ferry::drain(std::span<const ferry::transfer>(sends), 2s);
  (void)ferry::drain(std::span<const ferry::transfer>(receives), 2s);
}
#endif

// One run served: false when the initiator went away before saying it was done, or --check found
// a mismatch. A run refused throws refusal; one that fails to start throws what failed.
bool target_session(const config& c, control_socket& ctl, const std::string& host, const std::string& peer) {
  const auto tmo = ms(c.timeout);
  const run_request run = read_hello(ctl.read_line(tmo), c);
  const corruption corrupt = run.check.on ? corruption_for_tests() : corruption{};
  const std::string checking = run.check.on ? " check=1" : "";
  // With --check the initiator fills its buffers as it connects each thread: its connections may
  // come that much later.
  const auto setup = run.check.on ? check_allowance(std::uint64_t{run.threads} * run.slots * run.block) : 0ms;
  session_stats stats;
  const cpu_times before = rusage_of(RUSAGE_SELF);
  ferry::progress_executor exec(executor_of(c));
  // The initiator says "done" after its run, or goes away; both end the session.
  bool initiator_done = false;
  auto wait_done = [&] {
    try {
      const std::string line = ctl.read_line(ms(run.duration + 4 * run.timeout + 30));
      if (line != "done") throw control_error("its line after the run is not 'done' but " + in_quotes(line));
      initiator_done = true;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "ferry-perf target: the run from %s ended without the initiator's done: %s\n", peer.c_str(),
                   e.what());
    }
  };
  // The CPU time excludes the check after the run, which is not what a transfer costs.
  auto report_cpu = [&] {
    const cpu_times used = minus(rusage_of(RUSAGE_SELF), before);
    try {
      ctl.send_line("cpu user_s=" + format_real(used.user_s) + " system_s=" + format_real(used.system_s) +
                        " ops=" + std::to_string(stats.ops.load()),
                    tmo);
    } catch (const std::exception&) {
    }
  };
  // With --check, after the run: "check ok", or the first mismatch, which also goes to the log.
  bool check_passed = true;
  auto report_check = [&](const std::string& mismatch) {
    if (!run.check.on || !initiator_done) return;
    check_passed = mismatch.empty();
    if (!check_passed) {
      std::fprintf(stderr, "ferry-perf target: the run from %s failed its check: %s\n", peer.c_str(), mismatch.c_str());
    }
    try {
      ctl.send_line(check_passed ? std::string("check ok") : "check failed " + mismatch, tmo);
    } catch (const std::exception&) {
    }
  };
  if (run.backend == "tcp") {
#if FERRY_PERF_HAVE_URING
    std::vector<std::byte> served;
    if (run.check.on && !run.write) {
      served.resize(run.threads * run.slots * run.block);
      prepare_region(served, run, corrupt);
    }
    ferry::uring::ring ring(exec);
    ferry::uring::tcp_listener listener(host, 0);
    ctl.send_line("ready port=" + std::to_string(listener.port()) + checking, tmo);
    std::vector<ferry::uring::tcp_connection> conns;
    for (std::size_t t = 0; t < run.threads; ++t) {
      pollfd pf{listener.native_handle(), POLLIN, 0};
      if (::poll(&pf, 1, static_cast<int>((tmo + setup).count())) != 1) {
        throw control_error("the initiator's data connections did not arrive");
      }
      conns.push_back(listener.accept(ring));
    }
    std::atomic<bool> stop{false};
    std::vector<std::thread> servers;
    for (auto& conn : conns) {
      servers.emplace_back([&] { serve_tcp(conn, run, served, corrupt, stop, stats); });
    }
    wait_done();
    stop.store(true);
    for (auto& s : servers) s.join();
    conns.clear();
    report_cpu();
    report_check(stats.first_found());
#endif
  } else if (run.backend == "ucx") {
#if FERRY_PERF_HAVE_UCX
    ferry::ucx::worker_options wo;
    wo.transports = run.transport;
    ferry::ucx::worker worker(exec, wo);
    const ferry::ucx::memory_region region = worker.allocate(run.threads * run.slots * run.block);
    if (run.check.on) prepare_region(region.bytes(), run, corrupt);
    {
      ferry::ucx::listener listener = worker.listen(host, 0, std::span(&region, 1));
      ctl.send_line("ready port=" + std::to_string(listener.port()) + checking, tmo);
      std::vector<ferry::ucx::endpoint> eps;
      for (std::size_t t = 0; t < run.threads; ++t) eps.push_back(listener.accept(seconds(run.timeout) + setup));
      wait_done();
      report_cpu();
      report_check(run.write && initiator_done ? verify_region(region.bytes(), run, corrupt) : "");
    }
#endif
  } else if (run.backend == "verbs") {
#if FERRY_PERF_HAVE_VERBS
    // One-sided: the initiator's WRITEs and READs land in this region without this side's software;
    // the target only keeps the queue pairs up until the initiator says it is done.
    const ferry::verbs::queue_pair_options qp = verbs_queue_pair(run.slots, run.timeout);
    verbs_device device(exec, verbs_device_options(c, run.threads, qp, nullptr));
    const verbs_region region = verbs_region::allocate(device, run.threads * run.slots * run.block);
    if (run.check.on) prepare_region(region.bytes(), run, corrupt);
    {
      ferry::verbs::side_channel_listener listener(0, host);
      ctl.send_line("ready port=" + std::to_string(listener.port()) + checking, tmo);
      const ferry::verbs::remote_region exposed[] = {region.remote()};
      std::vector<verbs_connection> conns;
      for (std::size_t t = 0; t < run.threads; ++t) {
        conns.push_back(listener.accept(device, std::span<const ferry::verbs::remote_region>(exposed), qp,
                                        seconds(run.timeout) + setup));
      }
      wait_done();
      report_cpu();
      report_check(run.write && initiator_done ? verify_region(region.bytes(), run, corrupt) : "");
    }
#endif
  }
  return initiator_done && check_passed;
}

// SIGTERM or SIGINT to a target that published its name: it stops serving and withdraws the name.
volatile std::sig_atomic_t target_stop_requested = 0;
extern "C" inline void request_target_stop(int) { target_stop_requested = 1; }

// Serves runs until stopped; with --once, one run, and then the exit status says how it went. Every
// run refused or failed is one line of the log, naming the initiator and why.
int run_target(const config& c) {
  std::string host;
  std::uint16_t port = 0;
  split_host_port(c.listen, "--listen", host, port, !c.publish.empty());
  const int lfd = listen_control(host, port);
  std::fprintf(stderr, "ferry-perf target: %s on %s\n", c.backend.c_str(), c.listen.c_str());
  // Published for as long as it serves: the name goes (withdrawn) when it returns, and one lease
  // after it dies.
  std::unique_ptr<published_target> published;
  if (!c.publish.empty()) {
    sockaddr_storage a{};
    socklen_t n = sizeof a;
    ::getsockname(lfd, reinterpret_cast<sockaddr*>(&a), &n);
    const std::uint16_t bound = ntohs(a.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6&>(a).sin6_port
                                                               : reinterpret_cast<sockaddr_in&>(a).sin_port);
    published = publish_target(c, host, bound);
    struct sigaction sa{};
    sa.sa_handler = &request_target_stop;
    ::sigaction(SIGTERM, &sa, nullptr);
    ::sigaction(SIGINT, &sa, nullptr);
  }
  for (;;) {
    const int fd = accept_within(lfd, 1000ms);
    if (target_stop_requested != 0) {
      if (fd >= 0) ::close(fd);
      ::close(lfd);
      std::fprintf(stderr, "ferry-perf target: stopped; withdrawing %s\n", c.publish.c_str());
      return 0;
    }
    if (fd < 0) continue;
    control_socket ctl(fd);
    const std::string peer = peer_name(fd);
    bool served = false;
    std::string why;
    try {
      served = target_session(c, ctl, host, peer);
    } catch (const refusal& e) {
      why = e.what();
      std::fprintf(stderr, "ferry-perf target: refused a run from %s: %s\n", peer.c_str(), e.what());
    } catch (const std::exception& e) {
      why = e.what();
      std::fprintf(stderr, "ferry-perf target: the run from %s failed: %s\n", peer.c_str(), e.what());
    }
    if (!why.empty()) {
      try {
        ctl.send_line("error " + why, 1s);
      } catch (...) {
      }
    }
    if (c.once) {
      ::close(lfd);
      return served ? 0 : 1;
    }
  }
}

std::string environment_json(const config& c) {
  utsname u{};
  ::uname(&u);
  std::ostringstream o;
  o << "{\"ferry_version\":" << json_string(FERRY_VERSION) << ",\"ferry_perf_version\":" << json_string(FERRY_VERSION)
    << ",\"compiler\":" << json_string(__VERSION__) << ",\"kernel\":" << json_string(std::string(u.sysname) + " " + u.release)
    << ",\"host\":" << json_string(u.nodename) << ",\"cpus\":" << std::thread::hardware_concurrency();
#if FERRY_PERF_HAVE_UCX
  if (c.backend == "ucx" && c.mode != "file") {
    unsigned maj = 0, min = 0, rel = 0;
    ::ucp_get_version(&maj, &min, &rel);
    o << ",\"ucx_version\":" << json_string(std::to_string(maj) + "." + std::to_string(min) + "." + std::to_string(rel));
  }
#endif
#if FERRY_PERF_HAVE_VERBS
  if (c.backend == "verbs" && c.mode != "file") o << ",\"verbs_provider\":" << json_string(FERRY_PERF_VERBS_PROVIDER_NAME);
#endif
  (void)c;
  o << "}";
  return o.str();
}

std::string metrics_json(const ferry::metrics::registry& reg) {
  const ferry::metrics::snapshot s = reg.snapshot();
  std::ostringstream o;
  o << "{\"backend\":" << json_string(s.backend) << ",\"operations\":[";
  bool first = true;
  for (const auto& op : s.operations) {
    if (op.count() == 0) continue;
    o << (first ? "" : ",") << "{\"op\":" << json_string(op.kind) << ",\"peer\":" << json_string(op.peer)
      << ",\"succeeded\":" << op.succeeded << ",\"failed\":" << op.failed << ",\"bytes\":" << op.bytes
      << ",\"latency_sum_ns\":" << op.latency_sum_ns << ",\"latency_ns\":{\"p50\":" << op.quantile(0.5).count()
      << ",\"p90\":" << op.quantile(0.9).count() << ",\"p99\":" << op.quantile(0.99).count()
      << ",\"p999\":" << op.quantile(0.999).count() << "}}";
    first = false;
  }
  o << "]}";
  return o.str();
}

int run_measurements(const config& c) {
  ferry::metrics::registry reg(c.mode == "file" ? "uring" : c.backend == "tcp" ? "uring" : c.backend);
  std::vector<point_result> points;
  watchdog dog;
  std::printf("ferry-perf %s: %s %s, %s, batch %zu, depth %zu, threads %zu, executor %s, %.1f s per size%s\n",
              c.mode.c_str(), c.mode == "file" ? "file" : c.backend.c_str(), c.op.c_str(), c.workload.c_str(),
              c.batch, c.depth, c.threads, c.executor.c_str(), c.duration,
              c.check ? ", every byte checked (--check)" : "");
  print_table_header(c);
  int status = 0;
  for (std::size_t size : c.sizes) {
    // --check fills and verifies buffers on both sides (a checked file is filled and read back).
    const auto check_time = c.check ? check_allowance(2 * (std::uint64_t{c.threads} * slots_per_thread(c) * size +
                                                          (c.mode == "file" ? c.file_size : 0)))
                                    : 0ms;
    dog.arm(seconds(c.duration + 6 * c.timeout + 30) + check_time, "the " + size_name(size) + " run");
    point_result p;
    try {
      p = c.mode == "file" ? file_point(c, size, &reg) : initiator_point(c, size, &reg);
    } catch (const usage_error&) {
      throw;
    } catch (const std::exception& e) {
      p.block = size;
      p.error = e.what();
    }
    dog.disarm();
    // A failed run's figures are not results: no row, one line saying what failed (the JSON keeps
    // them, with the error).
    if (p.error.empty()) {
      print_row(c, p);
    } else {
      std::fflush(stdout);
      std::fprintf(stderr, "ferry-perf: %s run failed: %s\n", size_name(size).c_str(), p.error.c_str());
    }
    points.push_back(std::move(p));
    if (!points.back().error.empty()) {
      status = 1;
      break;
    }
  }
  if (!c.json.empty()) write_json(c.json, c, environment_json(c), points, metrics_json(reg));
  if (!c.plot.empty()) write_svg(c.plot, c, points);
  if (!c.prometheus.empty()) {
    std::ofstream f(c.prometheus);
    ferry::metrics::write_prometheus(f, reg);
    if (!f) throw std::runtime_error("cannot write " + c.prometheus);
  }
  return status;
}

}  // namespace

// The whole program: what main() returns.
int run(int argc, char** argv) {
  ::signal(SIGPIPE, SIG_IGN);
  if (argc >= 2 && (std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h" ||
                    std::string(argv[1]) == "help")) {
    std::fputs(usage_text(), stdout);
    return 0;
  }
  try {
    const config c = parse(argc, argv);
    check_backend(c.mode == "file" ? "file" : c.backend);
    if (c.mode == "target") return run_target(c);
    if (!c.find.empty()) {
      config found = c;
      found.connect = find_target(c);
      std::fprintf(stderr, "ferry-perf initiator: %s is at %s\n", c.find.c_str(), found.connect.c_str());
      return run_measurements(found);
    }
    return run_measurements(c);
  } catch (const usage_error& e) {
    std::fprintf(stderr, "ferry-perf: %s\n\n%s", e.what(), usage_text());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ferry-perf: %s\n", e.what());
    return 1;
  }
}

}  // namespace ferry_perf

#ifndef FERRY_PERF_NO_MAIN
int main(int argc, char** argv) { return ferry_perf::run(argc, argv); }
#endif

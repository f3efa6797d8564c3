// KV pull and push of one engine step over UCX (kv/connector.hpp over kv/ucx_link.hpp), producer
// and consumer in processes of their own, against a baseline that moves the same bytes as a
// connector without coalescing would: one raw ferry::ucx get_batch / put_batch per layer of one
// block per block pair and tensor, no plan, no tracker.
//
//   ferry_kv_connector_bench [--quick] [--blocks N] [--passes N] [tcp] [shm]
//
// One step: 32 layers, 16 requests of --blocks blocks (default 2) of 16 tokens, 8 KV heads x 128,
// fp16, kv_split layout (K's blocks then V's, every layer in one region) on both sides, TP 1 -> 1.
// A block of one tensor is 32 KiB, so a step moves 32 x 16 x blocks x 2 x 32 KiB (64 MiB at 2
// blocks). Each side's cache has twice the blocks a step moves; block ids are handed out in runs of
// 1 to 64 consecutive ids, shuffled, on each side (kv_plan_bench's allocator), a new table each pass.
//
// The consumer (decode) is this process; the producer (prefill) is this program run again
// (posix_spawn of /proc/self/exe with --producer), driven over a pipe. Both sides describe
// themselves with the KV handshake (kv::encode / decode), connect once by host and port, and run
// their KV work on an engine thread of their own (a run_loop), with the progress executor in its
// default (adaptive) mode. The baseline posts on the kv::ucx_link's own endpoint (a copy of the
// handle): ferry hands a peer's notifications to one endpoint per peer worker, so a second
// connection between the same two workers would not get them.
//
//   pull      the consumer plans every request, kv::pull()s them into a load_tracker (one
//             get_batch per request and layer) and awaits every layer; then releases them to the
//             producer (release_to, serve_releases, release_ledger), outside the timing.
//             Baseline: one get_batch per layer of every block pair and tensor, then when_all.
//   push      the consumer expects every request (push_receiver, load_tracker); the producer plans
//             them, writes layer by layer (pushed_request::layer_computed for every request, layer
//             after layer: one put_batch per request and layer) and finish()es each (its writes
//             landed, then one notification). Baseline: one put_batch per layer of every block
//             pair and tensor, when_all, then one notification per request; the consumer's receive
//             loop counts those as not expected (push_receiver::stale), and the consumer learns
//             that the bytes landed from the producer's answer, sent once every notification was
//             acknowledged (a notification succeeds only once the receiving process holds it).
//
// Step time is measured by the side that posts (the consumer for pull, the producer for push), from
// the first post until every transfer (and, for push, every notification) has ended; planning is
// not in it and is reported on its own. CPU time is each process's whole CPU time
// (CLOCK_PROCESS_CPUTIME_ID: every thread, the executor's too) over the measured part, per layer;
// the passive side's is taken between "go" and "stop" messages around the step. Every step, warm-up
// included, is checked: the consumer's region is cleared before it, and afterwards compared with the
// plans applied by memcpy (kv::apply_plan) to a copy of the producer's bytes, which the consumer
// regenerates from the seed the producer was given. Each pass runs connector and baseline of a mode
// back to back, in alternating order; figures are medians over passes. Every wait has a deadline.

#include <time.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <ferry/ferry.hpp>
#include <ferry/kv.hpp>
#include <ferry/kv/ucx_link.hpp>
#include <ferry/spawn.hpp>
#include <ferry/sync_wait.hpp>
#include <ferry/ucx.hpp>

extern char** environ;

namespace {

namespace kv = ferry::kv;
namespace ucx = ferry::ucx;
using namespace std::chrono_literals;
using clk = std::chrono::steady_clock;

// Bounds every transfer, tracker wait and notification; a line from the other process is awaited
// at most `line_bound`.
constexpr auto hang_bound = 30s;
constexpr auto line_bound = 120s;

[[noreturn]] void fail(const std::string& what) { throw std::runtime_error(what); }

double cpu_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e9 + static_cast<double>(ts.tv_nsec);
}

double ns_since(clk::time_point t0) {
  return std::chrono::duration<double, std::nano>(clk::now() - t0).count();
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

std::vector<std::string> words(const std::string& line) {
  std::vector<std::string> out;
  std::size_t at = 0;
  while (at < line.size()) {
    const std::size_t from = line.find_first_not_of(' ', at);
    if (from == std::string::npos) break;
    const std::size_t to = line.find(' ', from);
    out.push_back(line.substr(from, to - from));
    at = to;
  }
  return out;
}

// ----------------------------------------------------------------------------------- the shape

struct shape {
  std::uint32_t layers = 32;
  std::uint32_t requests = 16;
  std::uint32_t blocks = 2;  // per request
  [[nodiscard]] std::uint32_t cache_blocks() const { return 2 * requests * blocks; }
};

constexpr std::uint32_t block_size = 16;
constexpr std::uint32_t kv_heads = 8;
constexpr std::uint32_t head_size = 128;
constexpr std::uint32_t element_size = 2;
constexpr std::uint64_t tensor_block_bytes =
    std::uint64_t{block_size} * kv_heads * head_size * element_size;

kv::cache_layout layout_for(const shape& s) {
  kv::paged_shape p;
  p.layers = s.layers;
  p.blocks = s.cache_blocks();
  p.block_size = block_size;
  p.total_heads = kv_heads;
  p.tp_size = 1;
  p.head_size = head_size;
  p.element_size = element_size;
  p.region_per_layer = false;  // every layer in region 0
  return kv::cache_layout::kv_split(p);
}

kv::engine_description describe(const std::string& id, const kv::cache_layout& layout,
                                 const ucx::memory_region& region) {
  kv::engine_description d;
  d.engine_id = id;
  d.incarnation = 1;
  d.tp = {0, 1};
  d.layout = layout;
  d.regions.push_back(region.describe().to_bytes());
  return d;
}

// The producer's bytes: a counter-based stream from `seed`, so that the consumer can make a copy.
void fill(std::span<std::byte> bytes, std::uint64_t seed) {
  for (std::size_t i = 0; i + 8 <= bytes.size(); i += 8) {
    std::uint64_t z = seed + 0x9e3779b97f4a7c15ull * (i / 8 + 1);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    std::memcpy(bytes.data() + i, &z, 8);
  }
}

// Every block id of a cache in the order an allocator hands them out: runs of 1 to 64 consecutive
// ids, the runs shuffled.
std::vector<std::uint32_t> allocation_order(std::uint32_t cache_blocks, std::mt19937& rng) {
  std::vector<std::vector<std::uint32_t>> runs;
  for (std::uint32_t next = 0; next < cache_blocks;) {
    const std::uint32_t n = std::min(cache_blocks - next,
                                     std::uniform_int_distribution<std::uint32_t>(1, 64)(rng));
    runs.emplace_back();
    for (std::uint32_t i = 0; i < n; ++i) runs.back().push_back(next + i);
    next += n;
  }
  std::shuffle(runs.begin(), runs.end(), rng);
  std::vector<std::uint32_t> out;
  for (const auto& r : runs) out.insert(out.end(), r.begin(), r.end());
  return out;
}

// One step's block tables, per request: the same on both sides for the same table number.
struct tables {
  tables(const shape& s, std::uint32_t table) {
    std::mt19937 rng(38 + table);
    const auto src_order = allocation_order(s.cache_blocks(), rng);
    const auto dst_order = allocation_order(s.cache_blocks(), rng);
    for (std::uint32_t r = 0; r < s.requests; ++r) {
      const auto at = static_cast<std::ptrdiff_t>(r) * s.blocks;
      src.emplace_back(src_order.begin() + at, src_order.begin() + at + s.blocks);
      dst.emplace_back(dst_order.begin() + at, dst_order.begin() + at + s.blocks);
    }
  }
  [[nodiscard]] kv::block_pairs pairs(std::size_t r) const { return {src[r], dst[r]}; }
  std::vector<std::vector<std::uint32_t>> src, dst;
};

// Plans every request into `plans` (reused); returns the nanoseconds it took.
double plan_step(const kv::transfer_planner& planner, const tables& t,
                 std::vector<kv::transfer_plan>& plans) {
  const auto t0 = clk::now();
  for (std::size_t r = 0; r < plans.size(); ++r) {
    const kv::block_pairs g = t.pairs(r);
    planner.plan(std::span(&g, 1), plans[r]);
  }
  return ns_since(t0);
}

std::uint64_t ranges_of(const std::vector<kv::transfer_plan>& plans) {
  std::uint64_t n = 0;
  for (const auto& p : plans) n += p.ranges;
  return n;
}

// The baseline's blocks of one layer: one per request, block pair and tensor, whole blocks.
void baseline_blocks(const kv::cache_layout& local, const kv::cache_layout& remote_layout,
                     const ucx::memory_region& region, const ucx::remote_memory& remote,
                     const tables& t, std::size_t layer, bool local_is_source,
                     std::vector<ucx::rma_block>& out) {
  out.clear();
  const kv::layer_layout& mine = local.layers[layer];
  const kv::layer_layout& theirs = remote_layout.layers[layer];
  for (std::size_t r = 0; r < t.src.size(); ++r) {
    for (std::size_t i = 0; i < t.src[r].size(); ++i) {
      const std::uint32_t my_block = local_is_source ? t.src[r][i] : t.dst[r][i];
      const std::uint32_t their_block = local_is_source ? t.dst[r][i] : t.src[r][i];
      for (std::size_t k = 0; k < mine.tensors.size(); ++k) {
        const kv::tensor_layout& a = mine.tensors[k];
        const kv::tensor_layout& b = theirs.tensors[k];
        out.push_back({region.slice(a.offset + my_block * a.block_stride, tensor_block_bytes),
                       remote.slice(b.offset + their_block * b.block_stride, tensor_block_bytes)});
      }
    }
  }
}

// ------------------------------------------------------------------------------- engine thread

// An engine's thread: a run_loop that KV work runs on; run() blocks the caller until a task ends.
class engine_thread {
 public:
  engine_thread() : thread_([this] { loop_.run(); }) {}
  engine_thread(const engine_thread&) = delete;
  engine_thread& operator=(const engine_thread&) = delete;
  ~engine_thread() {
    loop_.stop();
    thread_.join();
  }
  ferry::run_loop& loop() { return loop_; }
  template <class T>
  T run(ferry::task<T> t) {
    ferry::any_scheduler s = ferry::any_scheduler::reference(loop_);
    return ferry::sync_wait(s, std::move(t));
  }

 private:
  ferry::run_loop loop_;
  std::thread thread_;
};

ucx::worker_options over(const std::string& transport) {
  ucx::worker_options o;
  o.transports = transport;
  o.close_timeout = 1s;
  return o;
}

void check(const ferry::batch_result& r, const char* what) {
  if (!r.ok()) fail(std::string(what) + ": " + r.error.message());
}

void check(const ferry::transfer& t, const char* what) {
  if (t.state() != ferry::transfer_state::success) {
    fail(std::string(what) + ": " + t.error().message());
  }
}

// --------------------------------------------------------------------------------- the lines

// One line from `fd`, waiting at most `bound`.
std::string read_line(int fd, std::string& buffered, std::chrono::seconds bound, const char* who) {
  const auto until = clk::now() + bound;
  for (;;) {
    if (const std::size_t nl = buffered.find('\n'); nl != std::string::npos) {
      std::string l = buffered.substr(0, nl);
      buffered.erase(0, nl + 1);
      return l;
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - clk::now());
    if (left.count() <= 0) fail(std::string("no line from the ") + who + " in time");
    pollfd p{fd, POLLIN, 0};
    const int n = ::poll(&p, 1, static_cast<int>(std::min<std::int64_t>(left.count(), 1000)));
    if (n < 0 && errno != EINTR) fail("poll");
    if (n <= 0) continue;
    char buf[4096];
    const ssize_t got = ::read(fd, buf, sizeof buf);
    if (got <= 0) fail(std::string("the ") + who + " is gone (" + buffered + ")");
    buffered.append(buf, static_cast<std::size_t>(got));
  }
}

void write_all(int fd, const std::string& s) {
  std::size_t at = 0;
  while (at < s.size()) {
    const ssize_t n = ::write(fd, s.data() + at, s.size() - at);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) fail("the other process is gone");
    at += static_cast<std::size_t>(n);
  }
}

// ---------------------------------------------------------------------------------- producer

// --producer TRANSPORT LAYERS REQUESTS BLOCKS SEED: the prefill engine. Prints "ready PORT
// HANDSHAKE", reads "peer HANDSHAKE", accepts the consumer's connection, prints "linked", then
// answers commands on stdin, one line each:
//   go [BASE]          counts CPU from now (and expects requests BASE.. in the ledger) -> "ok"
//   stop               -> "cpu NS"
//   freed              waits until every expected request was released -> "freed N OF"
//   push TABLE BASE    pushes table TABLE as requests BASE.. -> "pushed NS CPU_NS PLAN_NS RANGES"
//   bpush TABLE BASE   the baseline's push -> "pushed NS CPU_NS 0 DESCRIPTORS"
//   quit               closes everything -> "bye", and exits
struct producer {
  // The answers go to a copy of stdout; stdout itself becomes stderr, so that nothing else written
  // there (a UCX warning) can break a line of the protocol.
  static int protocol_out() {
    const int fd = ::dup(1);
    if (fd < 0 || ::dup2(2, 1) < 0) fail("dup");
    return fd;
  }

  producer(const std::string& transport, const shape& s, std::uint64_t seed)
      : s(s), worker(exec, over(transport)), layout(layout_for(s)) {
    region = worker.allocate(layout.bytes_needed(0));
    fill(region.bytes(), seed);
  }

  std::string next() { return read_line(0, in, line_bound + 180s, "consumer"); }
  void say(const std::string& l) const { write_all(out, l + "\n"); }

  int serve() {
    ucx::memory_region exposed = region;
    std::optional<ucx::listener> l(worker.listen("127.0.0.1", 0, std::span(&exposed, 1)));
    const kv::engine_description me = describe("prefill", layout, region);
    say("ready " + std::to_string(l->port()) + " " + hex(kv::encode(me)));
    const std::vector<std::string> peer_line = words(next());
    if (peer_line.size() != 2 || peer_line[0] != "peer") fail("expected the consumer's handshake");
    const kv::engine_description peer = kv::decode(unhex(peer_line[1]));
    kv::check_compatible(me, peer);
    peer_layout = peer.layout;
    planner.emplace(layout, me.tp, peer.layout, peer.tp);
    link.emplace(kv::ucx_link::to_peer(l->accept(hang_bound), {region}, peer));
    raw = link->endpoint();  // the same connection: notifications go to one endpoint per peer
    raw_remote = raw.import(ucx::remote_region::from_bytes(peer.regions.at(0)));
    l.reset();
    ferry::spawn(thread.loop(), kv::serve_releases(*link, ledger, 0),
                 [this](std::exception_ptr) noexcept { served.store(true); });
    say("linked");

    double cpu0 = 0;
    std::vector<kv::transfer_plan> plans(s.requests);
    for (;;) {
      const std::vector<std::string> w = words(next());
      if (w.empty()) continue;
      if (w[0] == "go") {
        if (w.size() == 2) {
          const std::uint64_t base = std::stoull(w[1]);
          for (std::uint32_t r = 0; r < s.requests; ++r) (void)ledger.expect(base + r, 1);
          expected += s.requests;
        }
        cpu0 = cpu_ns();
        say("ok");
      } else if (w[0] == "stop") {
        say("cpu " + std::to_string(cpu_ns() - cpu0));
      } else if (w[0] == "freed") {
        const auto until = clk::now() + hang_bound;
        while (freed.load() < expected && clk::now() < until) std::this_thread::sleep_for(100us);
        say("freed " + std::to_string(freed.load()) + " " + std::to_string(expected));
      } else if ((w[0] == "push" || w[0] == "bpush") && w.size() == 3) {
        const tables t(s, static_cast<std::uint32_t>(std::stoul(w[1])));
        const std::uint64_t base = std::stoull(w[2]);
        if (w[0] == "push") {
          const double plan_ns = plan_step(*planner, t, plans);
          const auto [ns, cpu] = thread.run(push(plans, base));
          say("pushed " + std::to_string(ns) + " " + std::to_string(cpu) + " " +
              std::to_string(plan_ns) + " " + std::to_string(ranges_of(plans)));
        } else {
          const auto [ns, cpu] = thread.run(baseline_push(t, base));
          say("pushed " + std::to_string(ns) + " " + std::to_string(cpu) + " 0 " +
              std::to_string(descriptors * s.layers));
        }
      } else if (w[0] == "quit") {
        link->endpoint().close();
        const auto until = clk::now() + hang_bound;
        while (!served.load() && clk::now() < until) std::this_thread::sleep_for(1ms);
        say("bye");
        return 0;
      } else {
        fail("unknown command '" + w[0] + "'");
      }
    }
  }

  struct measured {
    double ns = 0;
    double cpu = 0;
  };

  ferry::task<measured> push(const std::vector<kv::transfer_plan>& plans, std::uint64_t base) {
    std::vector<std::unique_ptr<kv::pushed_request<kv::ucx_link>>> p;
    for (std::uint32_t r = 0; r < s.requests; ++r) {
      p.push_back(std::make_unique<kv::pushed_request<kv::ucx_link>>(*link, base + r, plans[r],
                                                                       hang_bound));
    }
    const double c0 = cpu_ns();
    const auto t0 = clk::now();
    for (std::uint32_t layer = 0; layer < s.layers; ++layer) {
      for (auto& q : p) q->layer_computed(layer);
    }
    for (auto& q : p) {
      const ferry::batch_result r = co_await q->finish();
      check(r, "push: a request's writes");
    }
    for (auto& q : p) {
      const ferry::transfer_state st = co_await q->notice();
      (void)st;
      check(q->notice(), "push: a request's notification");
    }
    co_return measured{ns_since(t0), cpu_ns() - c0};
  }

  ferry::task<measured> baseline_push(const tables& t, std::uint64_t base) {
    std::vector<ucx::rma_block> blocks;
    const std::size_t per_layer = std::size_t{s.requests} * s.blocks * 2;
    std::vector<ferry::transfer> writes(per_layer * s.layers);
    std::vector<ferry::transfer> notes(s.requests);
    const double c0 = cpu_ns();
    const auto t0 = clk::now();
    for (std::uint32_t layer = 0; layer < s.layers; ++layer) {
      baseline_blocks(layout, peer_layout, region, raw_remote, t, layer, true, blocks);
      raw.put_batch(blocks, std::span(writes).subspan(layer * per_layer, per_layer), hang_bound);
    }
    const ferry::batch_result r = co_await ferry::when_all(writes, hang_bound);
    check(r, "baseline push: the writes");
    for (std::uint32_t q = 0; q < s.requests; ++q) {
      notes[q] = raw.send_notification(base + q, hang_bound);
    }
    const ferry::batch_result n = co_await ferry::when_all(notes, hang_bound);
    check(n, "baseline push: the notifications");
    const measured m{ns_since(t0), cpu_ns() - c0};
    descriptors = blocks.size();
    co_return m;
  }

  shape s;
  std::string in;
  int out = protocol_out();
  ferry::progress_executor exec;
  ucx::worker worker;
  kv::cache_layout layout;
  kv::cache_layout peer_layout;
  ucx::memory_region region;
  std::optional<kv::transfer_planner> planner;
  std::atomic<std::uint64_t> freed{0};
  std::uint64_t expected = 0;
  kv::release_ledger ledger{[this](kv::transfer_id) { freed.fetch_add(1); }};
  std::optional<kv::ucx_link> link;
  ucx::endpoint raw;
  ucx::remote_memory raw_remote;
  std::size_t descriptors = 0;
  std::atomic<bool> served{false};
  engine_thread thread;  // last: stopped first, before what its tasks use goes
};

// --------------------------------------------------------------------------------- consumer

// The producer process: this program again with --producer.
class producer_process {
 public:
  explicit producer_process(const std::vector<std::string>& args_in) {
    int in[2], out[2];
    if (::pipe2(in, O_CLOEXEC) != 0 || ::pipe2(out, O_CLOEXEC) != 0) fail("pipe2");
    posix_spawn_file_actions_t fa;
    ::posix_spawn_file_actions_init(&fa);
    ::posix_spawn_file_actions_adddup2(&fa, in[0], 0);
    ::posix_spawn_file_actions_adddup2(&fa, out[1], 1);
    std::vector<std::string> args{"ferry_kv_connector_bench", "--producer"};
    args.insert(args.end(), args_in.begin(), args_in.end());
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
  }
  producer_process(const producer_process&) = delete;
  producer_process& operator=(const producer_process&) = delete;
  ~producer_process() {
    ::close(to_);
    ::close(from_);
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }

  void say(const std::string& l) { write_all(to_, l + "\n"); }
  std::vector<std::string> answer(const char* expect) {
    const std::string l = read_line(from_, buffered_, line_bound, "producer");
    std::vector<std::string> w = words(l);
    if (w.empty() || w[0] != expect) fail("the producer said '" + l + "', not " + expect);
    return w;
  }

  // Waits (bounded) for the producer to exit by itself; true when it did, with status 0.
  bool exited() {
    const auto until = clk::now() + 10s;
    while (clk::now() < until) {
      int status = 0;
      const pid_t r = ::waitpid(pid_, &status, WNOHANG);
      if (r == pid_) {
        pid_ = -1;
        return WIFEXITED(status) && WEXITSTATUS(status) == 0;
      }
      std::this_thread::sleep_for(5ms);
    }
    return false;
  }

 private:
  pid_t pid_ = -1;
  int to_ = -1;
  int from_ = -1;
  std::string buffered_;
};

enum class mode { pull, push };
enum class sender { connector, baseline };

struct sample {
  double step_ns = 0;
  double consumer_cpu_ns = 0;
  double producer_cpu_ns = 0;
  double plan_ns = 0;
  double posted = 0;  // ranges or descriptors in the step
};

struct consumer {
  consumer(const std::string& transport, const shape& s, std::uint64_t seed)
      : s(s), worker(exec, over(transport)), layout(layout_for(s)),
        proc({transport, std::to_string(s.layers), std::to_string(s.requests),
              std::to_string(s.blocks), std::to_string(seed)}) {
    region = worker.allocate(layout.bytes_needed(0));
    const std::vector<std::string> ready = proc.answer("ready");
    if (ready.size() != 3) fail("the producer's ready line is short");
    const kv::engine_description peer = kv::decode(unhex(ready[2]));
    const kv::engine_description me = describe("decode", layout, region);
    kv::check_compatible(peer, me);
    peer_layout = peer.layout;
    planner.emplace(peer.layout, peer.tp, layout, me.tp);
    proc.say("peer " + hex(kv::encode(me)));
    const auto port = static_cast<std::uint16_t>(std::stoul(ready[1]));
    link.emplace(kv::ucx_link::to_peer(
        worker.connect("127.0.0.1", port, std::span(&region, 1), hang_bound), {region}, peer));
    raw = link->endpoint();  // the same connection: notifications go to one endpoint per peer
    raw_remote = raw.import(ucx::remote_region::from_bytes(peer.regions.at(0)));
    (void)proc.answer("linked");
    ferry::spawn(thread.loop(), receiver.receive(*link),
                 [this](std::exception_ptr) noexcept { receive_ended.store(true); });
    // The producer's bytes, made again from its seed: what every check compares against.
    producer_bytes.resize(peer_layout.bytes_needed(0));
    fill(producer_bytes, seed);
    expected.resize(region.bytes().size());
  }

  // Closes the links (the receive loop ends), lets the producer go, and waits for it.
  void finish() {
    // Every baseline push's notifications reached the receive loop, which expected none of them.
    const auto until = clk::now() + hang_bound;
    while (clk::now() < until) {
      const std::uint64_t stale = thread.run([](consumer& c) -> ferry::task<std::uint64_t> {
        co_return c.receiver.stale();
      }(*this));
      if (stale == baseline_notices) break;
      if (stale > baseline_notices) fail("push: notifications the receive loop did not expect");
      std::this_thread::sleep_for(1ms);
    }
    link->endpoint().close();
    while (!receive_ended.load() && clk::now() < until) std::this_thread::sleep_for(1ms);
    if (!receive_ended.load()) fail("the push receive loop did not end");
    proc.say("quit");
    (void)proc.answer("bye");
    if (!proc.exited()) fail("the producer did not exit cleanly");
  }

  // One step of `m` by `who` on table `table`; checks the bytes that landed.
  sample step(mode m, sender who, std::uint32_t table) {
    const tables t(s, table);
    std::memset(region.bytes().data(), 0, region.bytes().size());
    const std::uint64_t base = next_id;
    next_id += s.requests;
    sample out;
    if (m == mode::pull) {
      if (who == sender::connector) {
        out.plan_ns = plan_step(*planner, t, plans);
        out.posted = static_cast<double>(ranges_of(plans));
        proc.say("go " + std::to_string(base));
      } else {
        proc.say("go");
      }
      (void)proc.answer("ok");
      const measured r = thread.run(who == sender::connector ? pull(t, base) : baseline_pull(t));
      proc.say("stop");
      out.producer_cpu_ns = std::stod(proc.answer("cpu").at(1));
      out.step_ns = r.ns;
      out.consumer_cpu_ns = r.cpu;
      if (who == sender::connector) {
        (void)thread.run(release());  // outside the timing: the producer's ledger frees the blocks
        proc.say("freed");
        const std::vector<std::string> f = proc.answer("freed");
        if (f.at(1) != f.at(2)) fail("pull: the producer freed " + f[1] + " of " + f[2]);
      } else {
        out.posted = static_cast<double>(descriptors * s.layers);
      }
    } else {
      if (who == sender::connector) (void)thread.run(expect_push(t, base));
      const double c0 = cpu_ns();
      proc.say((who == sender::connector ? "push " : "bpush ") + std::to_string(table) + " " +
               std::to_string(base));
      if (who == sender::connector) (void)thread.run(await_push());
      // The baseline's notifications succeed only once this process holds them: the producer's
      // answer says its bytes landed. The receive loop counts them as not expected.
      const std::vector<std::string> w = proc.answer("pushed");
      out.consumer_cpu_ns = cpu_ns() - c0;
      if (who == sender::baseline) baseline_notices += s.requests;
      out.step_ns = std::stod(w.at(1));
      out.producer_cpu_ns = std::stod(w.at(2));
      out.plan_ns = std::stod(w.at(3));
      out.posted = std::stod(w.at(4));
    }
    verify(t, std::string(m == mode::pull ? "pull" : "push") +
                  (who == sender::connector ? " (connector)" : " (baseline)"));
    return out;
  }

  // The consumer's region against the plans applied by memcpy to a copy of the producer's bytes.
  void verify(const tables& t, const std::string& what) {
    (void)plan_step(*planner, t, plans);
    std::memset(expected.data(), 0, expected.size());
    const std::span<const std::byte> src[] = {producer_bytes};
    const std::span<std::byte> dst[] = {expected};
    std::uint64_t bytes = 0;
    for (const kv::transfer_plan& p : plans) {
      kv::apply_plan(p, src, dst);
      bytes += p.bytes;
    }
    if (bytes != std::uint64_t{s.layers} * s.requests * s.blocks * 2 * tensor_block_bytes) {
      fail(what + ": the plans move " + std::to_string(bytes) +
           " bytes, not every block pair's");
    }
    if (std::memcmp(expected.data(), region.bytes().data(), expected.size()) != 0) {
      fail(what + ": the consumer's region differs from the plan applied by memcpy");
    }
    ++verified;
  }

  struct measured {
    double ns = 0;
    double cpu = 0;
  };

  ferry::task<measured> pull(const tables& t, std::uint64_t base) {
    pull_tracker.begin_step();
    kv::request_options o;
    o.abort_timeout = hang_bound;
    const double c0 = cpu_ns();
    const auto t0 = clk::now();
    for (std::uint32_t r = 0; r < s.requests; ++r) {
      const auto h = pull_tracker.add_request(base + r, o);
      const kv::block_pairs g = t.pairs(r);
      kv::pull(*link, plans[r], layout, std::span(&g, 1), pull_tracker, h, hang_bound);
      pull_tracker.seal(h);
    }
    for (std::uint32_t layer = 0; layer < s.layers; ++layer) {
      const ferry::batch_result r = co_await pull_tracker.when_layer(layer, hang_bound);
      check(r, "pull: a layer");
    }
    const measured m{ns_since(t0), cpu_ns() - c0};
    for (std::uint32_t r = 0; r < s.requests; ++r) {
      if (pull_tracker.verdict(base + r) != kv::request_verdict::success) {
        fail("pull: a request's verdict is " +
             std::string(kv::to_string(pull_tracker.verdict(base + r))));
      }
    }
    co_return m;
  }

  ferry::task<int> release() {
    const auto finished = pull_tracker.take_finished();
    if (finished.size() != s.requests) fail("pull: the tracker let go of too few requests");
    co_return 0;
  }

  ferry::task<measured> baseline_pull(const tables& t) {
    std::vector<ucx::rma_block> blocks;
    const std::size_t per_layer = std::size_t{s.requests} * s.blocks * 2;
    std::vector<ferry::transfer> reads(per_layer * s.layers);
    const double c0 = cpu_ns();
    const auto t0 = clk::now();
    for (std::uint32_t layer = 0; layer < s.layers; ++layer) {
      baseline_blocks(layout, peer_layout, region, raw_remote, t, layer, false, blocks);
      raw.get_batch(blocks, std::span(reads).subspan(layer * per_layer, per_layer), hang_bound);
    }
    const ferry::batch_result r = co_await ferry::when_all(reads, hang_bound);
    check(r, "baseline pull");
    const measured m{ns_since(t0), cpu_ns() - c0};
    descriptors = blocks.size();
    co_return m;
  }

  ferry::task<int> expect_push(const tables& t, std::uint64_t base) {
    push_tracker.begin_step();
    kv::request_options o;
    o.abort_timeout = hang_bound;
    for (std::uint32_t r = 0; r < s.requests; ++r) {
      const auto h = push_tracker.add_request(base + r, o);
      const kv::block_pairs g = t.pairs(r);
      receiver.expect(push_tracker, h, base + r, layout, std::span(&g, 1));
      push_tracker.seal(h);
    }
    co_return 0;
  }

  ferry::task<int> await_push() {
    for (std::uint32_t layer = 0; layer < s.layers; ++layer) {
      const ferry::batch_result r = co_await push_tracker.when_layer(layer, hang_bound);
      check(r, "push: a layer");
    }
    const auto finished = push_tracker.take_finished();
    if (finished.size() != s.requests) fail("push: the tracker let go of too few requests");
    for (const auto& f : finished) {
      if (f.verdict != kv::request_verdict::success) fail("push: a request did not succeed");
    }
    co_return 0;
  }

  shape s;
  ferry::progress_executor exec;
  ucx::worker worker;
  kv::cache_layout layout;
  kv::cache_layout peer_layout;
  producer_process proc;
  ucx::memory_region region;
  std::optional<kv::transfer_planner> planner;
  std::vector<kv::transfer_plan> plans = std::vector<kv::transfer_plan>(s.requests);
  std::vector<std::byte> producer_bytes;
  std::vector<std::byte> expected;
  std::optional<kv::ucx_link> link;
  ucx::endpoint raw;
  ucx::remote_memory raw_remote;
  std::size_t descriptors = 0;
  std::uint64_t baseline_notices = 0;
  std::uint64_t next_id = 1;
  int verified = 0;
  std::atomic<bool> receive_ended{false};
  kv::push_receiver receiver;
  // Tells the producer a pulled request is done with (kv::release_to over the link).
  kv::load_tracker pull_tracker{[this](kv::request_id id, kv::request_verdict v) {
    kv::release_to(*link, hang_bound)(id, v);
  }};
  kv::load_tracker push_tracker{{}, [this](const ferry::transfer& t) { receiver.cancel(t); }};
  engine_thread thread;  // last: stopped first, before what its tasks use goes
};

// ------------------------------------------------------------------------------------- main

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

std::string duration(double ns) {
  char b[32];
  if (ns >= 1e6) {
    std::snprintf(b, sizeof b, "%.2f ms", ns / 1e6);
  } else {
    std::snprintf(b, sizeof b, "%.1f µs", ns / 1e3);
  }
  return b;
}

struct config {
  shape s;
  int passes = 5;
  std::vector<std::string> transports;
};

struct row {
  std::string transport;
  mode m;
  sender who;
  std::vector<sample> samples;
};

void run(const std::string& transport, const config& c, std::vector<row>& rows, int& checked) {
  consumer con(transport, c.s, 0x5eed0000ull + rows.size());
  const mode modes[] = {mode::pull, mode::push};
  const sender senders[] = {sender::connector, sender::baseline};
  const std::size_t first = rows.size();
  for (mode m : modes) {
    for (sender who : senders) rows.push_back({transport, m, who, {}});
  }
  // Warm-up: one step of each, checked, not counted.
  for (mode m : modes) {
    for (sender who : senders) (void)con.step(m, who, 1000);
  }
  for (int p = 0; p < c.passes; ++p) {
    for (std::size_t mi = 0; mi < 2; ++mi) {
      for (std::size_t k = 0; k < 2; ++k) {
        const std::size_t wi = (static_cast<std::size_t>(p) + k) % 2;  // alternating order
        rows[first + mi * 2 + wi].samples.push_back(
            con.step(modes[mi], senders[wi], static_cast<std::uint32_t>(p)));
      }
    }
  }
  con.finish();
  checked += con.verified;
}

void print(const config& c, const std::vector<row>& rows, int checked) {
  const double step_bytes = static_cast<double>(c.s.layers) * c.s.requests * c.s.blocks * 2 *
                            static_cast<double>(tensor_block_bytes);
  std::printf("kv pull and push over UCX: %u layers, %u requests x %u blocks of %u tokens, %u KV "
              "heads x %u fp16, kv_split, TP 1 -> 1; %.1f MiB per step; %d passes, medians; "
              "%d steps checked byte for byte\n\n",
              c.s.layers, c.s.requests, c.s.blocks, block_size, kv_heads, head_size,
              step_bytes / (1 << 20), c.passes, checked);
  std::printf("| transport | mode | sender | step | step min - max | GB/s | ranges / layer | "
              "batches / layer | consumer CPU / layer | producer CPU / layer | planning / step | "
              "step / baseline |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const row& r = rows[i];
    const auto field = [&](const row& of, double sample::*f) {
      std::vector<double> v;
      for (const sample& x : of.samples) v.push_back(x.*f);
      return median(v);
    };
    const row& base = rows[r.who == sender::connector ? i + 1 : i];
    const double step = field(r, &sample::step_ns);
    const double posted = field(r, &sample::posted);
    double lo = step, hi = step;
    for (const sample& x : r.samples) {
      lo = std::min(lo, x.step_ns);
      hi = std::max(hi, x.step_ns);
    }
    std::printf("| %s | %s | %s | %s | %s - %s | %.2f | %.1f | %u | %s | %s | %s | %.2fx |\n",
                r.transport.c_str(), r.m == mode::pull ? "pull" : "push",
                r.who == sender::connector ? "connector" : "baseline", duration(step).c_str(),
                duration(lo).c_str(), duration(hi).c_str(), step_bytes / step, posted / c.s.layers,
                r.who == sender::connector ? c.s.requests : 1u,
                duration(field(r, &sample::consumer_cpu_ns) / c.s.layers).c_str(),
                duration(field(r, &sample::producer_cpu_ns) / c.s.layers).c_str(),
                r.who == sender::connector ? duration(field(r, &sample::plan_ns)).c_str() : "-",
                step / field(base, &sample::step_ns));
  }
  std::printf("\nstep: from the first post to the last transfer (push: and notification) ended, on "
              "the side that posts\n(median; min - max over the passes); GB/s: the step's bytes "
              "(1e9) over the median step;\nranges / layer: what the step posts per layer (connector: "
              "the plans' ranges; baseline: one per block\npair and tensor); batches / layer: "
              "get_batch or put_batch calls per layer; CPU: whole process over\nthe step, per "
              "layer; planning: every request's plan, on the side that posts, not in the step.\n");
  std::fflush(stdout);
}

int usage(const char* argv0) {
  std::fprintf(stderr, "usage: %s [--quick] [--blocks N] [--passes N] [tcp] [shm]\n", argv0);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  // A peer process that is gone fails a write to its pipe (EPIPE) rather than killing this one.
  ::signal(SIGPIPE, SIG_IGN);
  try {
    if (argc == 7 && std::string(argv[1]) == "--producer") {
      shape s;
      s.layers = static_cast<std::uint32_t>(std::stoul(argv[3]));
      s.requests = static_cast<std::uint32_t>(std::stoul(argv[4]));
      s.blocks = static_cast<std::uint32_t>(std::stoul(argv[5]));
      producer p(argv[2], s, std::stoull(argv[6]));
      return p.serve();
    }
    config c;
    bool quick = false;
    std::optional<std::uint32_t> blocks;
    std::optional<int> passes;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--quick") {
        quick = true;
      } else if ((a == "--blocks" || a == "--passes") && i + 1 < argc) {
        const unsigned long n = std::stoul(argv[++i]);
        if (n == 0 || n > 4096) return usage(argv[0]);
        if (a == "--blocks") blocks = static_cast<std::uint32_t>(n);
        if (a == "--passes") passes = static_cast<int>(n);
      } else if (a == "tcp" || a == "shm") {
        c.transports.push_back(a);
      } else {
        return usage(argv[0]);
      }
    }
    if (c.transports.empty()) c.transports = {"tcp", "shm"};
    if (quick) {
      c.s.layers = 8;
      c.passes = 2;
    }
    if (blocks) c.s.blocks = *blocks;
    if (passes) c.passes = *passes;
    std::vector<row> rows;
    int checked = 0;
    for (const std::string& t : c.transports) run(t, c, rows, checked);
    print(c, rows, checked);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ferry_kv_connector_bench%s: %s\n",
                 argc > 1 && std::string(argv[1]) == "--producer" ? " (producer)" : "", e.what());
    std::fflush(stderr);
    // Nothing is torn down in order after a failure: a peer may be gone or hung.
    std::_Exit(1);
  }
}

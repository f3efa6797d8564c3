// Disaggregated prefill and decode over UCX between processes, with heterogeneous tensor
// parallelism. Every tensor-parallel rank is a process of its own, an engine: a progress executor,
// a UCX worker, an engine thread (a run_loop), and its KV cache in memory the worker allocated,
// described by a kv::cache_layout for that rank (K and V split, 8 KV heads of 64 fp16 elements,
// 8 layers, 64 blocks of 16 tokens). Two scenarios, one after the other:
//
//   2to1   2 prefill ranks -> 1 decode rank: the decode rank reads heads 0-3 from prefill rank 0
//          and heads 4-7 from prefill rank 1
//   1to2   1 prefill rank -> 2 decode ranks: each decode rank reads its half of the heads
//
//   disaggregated [2to1 | 1to2]      (both when no argument is given)
//
// This process is the coordinator. It starts every rank as a copy of itself (posix_spawn of
// /proc/self/exe) with a socket of its own as fd 3 and passes bytes between them. Each rank
// publishes its handshake, kv::encode of its engine_description (its TP position, its cache layout,
// its region's descriptor, memory_region::describe().to_bytes()); a prefill rank adds the port each
// decode rank connects to. The coordinator hands each decode rank the prefill ranks' handshakes and
// each prefill rank the decode ranks'. That hand-over is where a directory service comes in (the
// next step); besides it only commands, log lines and "done" pass through the coordinator.
//
// Each decode rank connects to the prefill ranks it reads from (kv::tp_source_ranks), checks that
// their caches can move into its own (kv::check_compatible) and keeps a kv::transfer_planner per
// source rank. Then:
//   - Pull, requests 1 and 2. Prefill computes every layer first. Decode reads every layer with
//     kv::pull into its load_tracker, awaits each layer (when_layer) and releases the request
//     through kv::release_to. Each prefill rank's kv::serve_releases acknowledges the release in
//     its release_ledger, which frees the blocks once every decode rank reading them released.
//   - Push, requests 3 and 4. Decode expects them (a kv::push_receiver per source rank: one
//     transfer per layer, ended by that rank's notice). Prefill runs its "forward pass": per layer
//     it writes the layer's K and V and pushes that layer at once (pushed_request::layer_computed).
//     finish() then sends the notice that ends the request on the decode side, and prefill frees
//     the blocks.
// The bytes prefill writes are a pattern of (request, layer, K or V, global head, token, element).
// Every decode rank checks byte for byte that every head slice of every block it received holds
// what the prefill rank holding that head wrote. The expected bytes come from the global head
// index, so a slice of the wrong head or from the wrong rank fails. It also checks that every
// other block still holds the poison it was filled with.
//
// Output: each line is one process's, labelled. The ranks send their lines to the coordinator,
// which prints them whole in the order they arrive, so lines never mix. Every wait has a deadline.
// Exit status 0 only when every rank verified what it received and exited 0, and every prefill
// rank freed every request exactly once (the pulled ones through its ledger).

#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include <ferry/ferry.hpp>
#include <ferry/kv.hpp>
#include <ferry/kv/ucx_link.hpp>
#include <ferry/ucx.hpp>

extern char** environ;

namespace {

namespace kv = ferry::kv;
namespace ucx = ferry::ucx;
using namespace std::chrono_literals;
using clock_type = std::chrono::steady_clock;

// ------------------------------------------------------------------------------------------------
// The model, its caches, the requests and the bytes prefill computes

constexpr std::uint32_t model_layers = 8;
constexpr std::uint32_t kv_heads = 8;
constexpr std::uint32_t head_size = 64;     // elements of one head
constexpr std::uint32_t element_bytes = 2;  // fp16
constexpr std::uint32_t cache_blocks = 64;
constexpr std::uint32_t block_tokens = 16;
constexpr std::byte poison{0xee};  // a decode rank's cache before anything lands in it

constexpr auto transfer_deadline = 5s;  // each read, write, notice and layer wait
constexpr auto connect_deadline = 10s;  // a UCX connection, its hellos included
constexpr auto channel_deadline = 20s;  // a message between the coordinator and a rank
constexpr auto exit_deadline = 10s;     // a rank's process exiting once told to

double ms_between(clock_type::time_point from, clock_type::time_point to) {
  return std::chrono::duration<double, std::milli>(to - from).count();
}

// One rank's cache, every layer in region 0, K's blocks then V's: [2, blocks, 16, heads, 64].
kv::cache_layout layout_for(kv::tp_shard tp) {
  kv::paged_shape s;
  s.layers = model_layers;
  s.blocks = cache_blocks;
  s.block_size = block_tokens;
  s.total_heads = kv_heads;
  s.tp_size = tp.size;
  s.head_size = head_size;
  s.element_size = element_bytes;
  s.region_per_layer = false;
  kv::cache_layout layout = kv::cache_layout::kv_split(s);
  layout.check(tp);
  return layout;
}

enum class mode : std::uint8_t { pull, push };

struct request {
  kv::request_id id = 0;
  mode how = mode::pull;
  // Block ids in every prefill rank's cache (the ranks of one engine share a block table) and in
  // every decode rank's; full blocks of 16 tokens.
  std::vector<std::uint32_t> prefill_blocks;
  std::vector<std::uint32_t> decode_blocks;
};

// What the two engines' schedulers gave each request. In a server the prefill side's block ids
// travel with the request to decode (vLLM's kv_transfer_params); here the coordinator sends both
// tables with each command. Some runs are consecutive on both sides, some not.
std::vector<request> schedule() {
  return {
      {1, mode::pull, {4, 5, 6}, {10, 11, 12}},
      {2, mode::pull, {20, 21, 9, 30, 31}, {40, 41, 42, 3, 7}},
      {3, mode::push, {12, 13, 14, 15}, {20, 22, 24, 26}},
      {4, mode::push, {50, 33}, {60, 61}},
  };
}

std::vector<request> requests_of(mode m) {
  std::vector<request> out;
  for (request& r : schedule()) {
    if (r.how == m) out.push_back(std::move(r));
  }
  return out;
}

std::string ids_of(const std::vector<request>& rs) {
  std::string s;
  for (const request& r : rs) s += (s.empty() ? "" : ", ") + std::to_string(r.id);
  return s;
}

std::string list(std::span<const std::uint32_t> ids) {
  std::string s;
  for (std::uint32_t id : ids) s += (s.empty() ? "" : " ") + std::to_string(id);
  return s;
}

std::string heads_text(kv::head_range h) {
  return "heads " + std::to_string(h.first) + "-" + std::to_string(h.first + h.count - 1);
}

constexpr std::uint64_t mix(std::uint64_t x) noexcept {  // splitmix64's finaliser
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// What prefill computes for element `dim` of global head `head`, token `token` of request `r`, in
// tensor `tensor` (0 K, 1 V) of layer `layer`. Every field has its own bits of the key.
std::uint16_t element(kv::request_id r, std::uint32_t layer, std::uint32_t tensor,
                      std::uint32_t head, std::uint32_t token, std::uint32_t dim) {
  const std::uint64_t key = (std::uint64_t{r} << 48) | (std::uint64_t{layer} << 40) |
                            (std::uint64_t{tensor} << 36) | (std::uint64_t{head} << 24) |
                            (std::uint64_t{token} << 8) | dim;
  return static_cast<std::uint16_t>(mix(key));
}
static_assert(model_layers <= 256 && kv_heads <= 4096 && head_size <= 256 &&
              cache_blocks * block_tokens <= 65536 && element_bytes == sizeof(std::uint16_t));

// Where an element is, for messages.
struct element_at {
  std::uint32_t layer, tensor, block, token, head, dim;
};

// Calls f(address, value, where) for every element this rank holds of layer `layer` in a
// request's blocks (`blocks`: this rank's block ids), `held` being the heads it holds; stops at the
// first call that returns false and returns false then.
template <class F>
bool for_each_element(const kv::cache_layout& layout, std::span<std::byte> region,
                      kv::head_range held, const request& r, std::span<const std::uint32_t> blocks,
                      std::uint32_t layer, F&& f) {
  const std::vector<kv::tensor_layout>& tensors = layout.layers[layer].tensors;
  for (std::uint32_t k = 0; k < tensors.size(); ++k) {
    const kv::tensor_layout& t = tensors[k];
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      for (std::uint32_t tok = 0; tok < t.block_size; ++tok) {
        for (std::uint32_t h = 0; h < t.heads; ++h) {
          std::byte* head = region.data() + t.offset + blocks[i] * t.block_stride +
                            tok * t.token_stride + h * t.head_stride;
          const std::uint32_t token = static_cast<std::uint32_t>(i) * t.block_size + tok;
          for (std::uint32_t d = 0; d < t.head_size; ++d) {
            const element_at at{layer, k, blocks[i], token, held.first + h, d};
            if (!f(head + d * t.element_size, element(r.id, layer, k, held.first + h, token, d),
                   at)) {
              return false;
            }
          }
        }
      }
    }
  }
  return true;
}

// ------------------------------------------------------------------------------------------------
// The channel between the coordinator and each rank: a SOCK_SEQPACKET socket pair, so that every
// message arrives whole. A message is one byte of kind, then its body.

enum class kind : std::uint8_t {
  log = 1,  // rank -> coordinator: one line to print
  hello,    // rank -> coordinator: what it publishes (see published)
  peers,    // coordinator -> rank: what the ranks on the other side published
  command,  // coordinator -> rank: a command and the requests it is about
  done,     // rank -> coordinator: the command (or a step of it) ended; ok or not
  freed,    // prefill rank -> coordinator: it freed a request's blocks
};

enum class command : std::uint8_t { prefill, pull, push, quit };

class writer {
 public:
  template <class T>
  writer& put(T v) {
    const auto* p = reinterpret_cast<const std::byte*>(&v);
    bytes_.insert(bytes_.end(), p, p + sizeof v);
    return *this;
  }
  writer& put_bytes(std::span<const std::byte> b) {
    put(static_cast<std::uint32_t>(b.size()));
    bytes_.insert(bytes_.end(), b.begin(), b.end());
    return *this;
  }
  writer& put_ids(std::span<const std::uint32_t> ids) {
    put(static_cast<std::uint32_t>(ids.size()));
    for (std::uint32_t id : ids) put(id);
    return *this;
  }
  [[nodiscard]] const std::vector<std::byte>& bytes() const noexcept { return bytes_; }

 private:
  std::vector<std::byte> bytes_;
};

class reader {
 public:
  explicit reader(std::span<const std::byte> b) : bytes_(b) {}
  template <class T>
  T get() {
    T v;
    std::memcpy(&v, take(sizeof v).data(), sizeof v);
    return v;
  }
  std::vector<std::byte> get_bytes() {
    const auto n = get<std::uint32_t>();
    const auto b = take(n);
    return {b.begin(), b.end()};
  }
  std::vector<std::uint32_t> get_ids() {
    std::vector<std::uint32_t> ids(get<std::uint32_t>());
    for (std::uint32_t& id : ids) id = get<std::uint32_t>();
    return ids;
  }
  [[nodiscard]] std::span<const std::byte> rest() const { return bytes_.subspan(at_); }

 private:
  std::span<const std::byte> take(std::size_t n) {
    if (bytes_.size() - at_ < n) throw std::runtime_error("a message ends too early");
    const auto out = bytes_.subspan(at_, n);
    at_ += n;
    return out;
  }
  std::span<const std::byte> bytes_;
  std::size_t at_ = 0;
};

struct message {
  kind what{};
  std::vector<std::byte> body;
};

bool send_message(int fd, kind k, std::span<const std::byte> body) {
  std::vector<std::byte> m(1 + body.size());
  m[0] = static_cast<std::byte>(k);
  std::copy(body.begin(), body.end(), m.begin() + 1);
  return ::send(fd, m.data(), m.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(m.size());
}

// The next message on `fd` by `deadline`; nullopt, with `why` said, on a timeout, a hang-up or an
// error.
std::optional<message> receive_message(int fd, clock_type::time_point deadline, std::string& why) {
  for (;;) {
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - clock_type::now());
    if (left.count() <= 0) {
      why = "nothing came in time";
      return std::nullopt;
    }
    pollfd p{fd, POLLIN, 0};
    const int n = ::poll(&p, 1, static_cast<int>(left.count()));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      why = std::string("poll: ") + std::strerror(errno);
      return std::nullopt;
    }
    if (n == 0) continue;  // the deadline is checked above
    // A packet's real length, whatever the buffer: MSG_TRUNC on a SOCK_SEQPACKET socket.
    const ssize_t size = ::recv(fd, nullptr, 0, MSG_PEEK | MSG_TRUNC);
    if (size <= 0) {
      why = size == 0 ? "hung up" : std::string("recv: ") + std::strerror(errno);
      return std::nullopt;
    }
    std::vector<std::byte> packet(static_cast<std::size_t>(size));
    if (::recv(fd, packet.data(), packet.size(), 0) != size) {
      why = std::string("recv: ") + std::strerror(errno);
      return std::nullopt;
    }
    return message{static_cast<kind>(packet[0]), {packet.begin() + 1, packet.end()}};
  }
}

// What a rank publishes: its handshake, and for a prefill rank the port decode rank d connects to
// (ports[d]: a listener per decode rank, so that it knows which rank each endpoint is).
struct published {
  std::vector<std::uint16_t> ports;
  std::vector<std::byte> handshake;  // kv::encode(engine_description)
};

std::vector<std::byte> encode_published(const published& p) {
  writer w;
  w.put(static_cast<std::uint32_t>(p.ports.size()));
  for (std::uint16_t port : p.ports) w.put(port);
  w.put_bytes(p.handshake);
  return w.bytes();
}

published decode_published(std::span<const std::byte> bytes) {
  reader r(bytes);
  published p;
  p.ports.resize(r.get<std::uint32_t>());
  for (std::uint16_t& port : p.ports) port = r.get<std::uint16_t>();
  p.handshake = r.get_bytes();
  return p;
}

std::vector<std::byte> encode_command(command c, const std::vector<request>& rs) {
  writer w;
  w.put(c).put(static_cast<std::uint32_t>(rs.size()));
  for (const request& r : rs) {
    w.put(r.id).put(r.how).put_ids(r.prefill_blocks).put_ids(r.decode_blocks);
  }
  return w.bytes();
}

std::pair<command, std::vector<request>> decode_command(std::span<const std::byte> bytes) {
  reader r(bytes);
  const auto c = r.get<command>();
  std::vector<request> rs(r.get<std::uint32_t>());
  for (request& q : rs) {
    q.id = r.get<kv::request_id>();
    q.how = r.get<mode>();
    q.prefill_blocks = r.get_ids();
    q.decode_blocks = r.get_ids();
  }
  return {c, std::move(rs)};
}

// ------------------------------------------------------------------------------------------------
// A rank's side of the channel (fd 3). Lines come from the main thread, the engine thread and the
// ledger's free callback; each is one message.

constexpr int rank_channel = 3;
std::mutex rank_channel_mutex;

void tell(kind k, std::span<const std::byte> body) {
  const std::lock_guard lock(rank_channel_mutex);
  if (!send_message(rank_channel, k, body)) {
    // The coordinator is gone: nobody is left to tell, and nothing is worth finishing.
    std::_Exit(1);
  }
}

[[gnu::format(printf, 1, 2)]] void say(const char* format, ...) {
  char line[1024];
  va_list args;
  va_start(args, format);
  const int n = std::vsnprintf(line, sizeof line, format, args);
  va_end(args);
  const std::size_t length = std::min<std::size_t>(n < 0 ? 0 : n, sizeof line - 1);
  tell(kind::log, std::as_bytes(std::span(line, length)));
}

void done(bool ok) {
  const std::byte b{static_cast<unsigned char>(ok ? 1 : 0)};
  tell(kind::done, std::span(&b, 1));
}

// Says why, tells the coordinator, and ends the process at once: a rank whose coroutines may still
// use its links has nothing worth unwinding (the coordinator then stops every rank).
[[noreturn]] void fail(const std::string& why) {
  say("FAILED: %s", why.c_str());
  done(false);
  std::_Exit(1);
}

message await_message(kind expected) {
  std::string why;
  std::optional<message> m = receive_message(rank_channel, clock_type::now() + channel_deadline, why);
  if (!m) fail("waiting for the coordinator: " + why);
  if (m->what != expected) fail("the coordinator sent an unexpected message");
  return std::move(*m);
}

// After the last "done": waits for the coordinator to hang up, so that no rank exits while a peer
// may still be closing its endpoint to it.
void await_hang_up() {
  std::string why;
  if (receive_message(rank_channel, clock_type::now() + channel_deadline, why)) {
    std::_Exit(1);  // nothing more should come
  }
}

// ------------------------------------------------------------------------------------------------
// An engine: what every rank's process has.

// The engine's own scheduler, a run_loop on a thread of its own (an inference server's scheduler
// thread). The tracker, the links and the connector's coroutines live on it.
class engine_thread {
 public:
  engine_thread() : thread_([this] { loop_.run(); }) {}
  engine_thread(const engine_thread&) = delete;
  engine_thread& operator=(const engine_thread&) = delete;
  ~engine_thread() {
    loop_.stop();
    thread_.join();
  }
  [[nodiscard]] ferry::run_loop& loop() noexcept { return loop_; }

 private:
  ferry::run_loop loop_;
  std::thread thread_;
};

ucx::worker_options worker_options() {
  ucx::worker_options o;  // tcp and shared memory, as UCX chooses
  o.close_timeout = 2s;
  return o;
}

struct engine {
  engine(std::string id, kv::tp_shard tp)
      : id(std::move(id)),
        tp(tp),
        worker(exec, worker_options()),
        layout(layout_for(tp)),
        held(kv::heads_held(kv_heads, tp)),
        region(worker.allocate(layout.bytes_needed(0))) {}

  // What it tells its peers. A restarted process is another incarnation: its pid stands in.
  [[nodiscard]] kv::engine_description describe() const {
    kv::engine_description d;
    d.engine_id = id;
    d.incarnation = static_cast<std::uint64_t>(::getpid());
    d.tp = tp;
    d.layout = layout;
    d.regions.push_back(region.describe().to_bytes());
    return d;
  }

  // Runs `t` on the engine thread, this thread waiting for it (every wait inside has a deadline).
  template <class T>
  T run(ferry::task<T> t) {
    ferry::any_scheduler s = ferry::any_scheduler::reference(thread.loop());
    return ferry::sync_wait(s, std::move(t));
  }

  void say_up(const char* role) {
    say("%s rank %u of %u up (pid %d): %s of %u; cache %u layers x K,V x %u blocks x %u tokens x "
        "%u heads x %u fp16 = %zu KiB in one region UCX allocated",
        role, tp.rank, tp.size, static_cast<int>(::getpid()), heads_text(held).c_str(), kv_heads,
        model_layers, cache_blocks, block_tokens, held.count, head_size,
        region.bytes().size() >> 10);
  }

  std::string id;
  kv::tp_shard tp;
  ferry::progress_executor exec;
  ucx::worker worker;
  kv::cache_layout layout;
  kv::head_range held;
  ucx::memory_region region;
  engine_thread thread;  // first to go: stops the loop before the links and the worker go
};

// Waits (polling, from the main thread) until every flag holds; false past the deadline.
template <class Flags>
bool all_set(const Flags& flags, std::chrono::milliseconds bound) {
  const auto until = clock_type::now() + bound;
  for (;;) {
    if (std::all_of(flags.begin(), flags.end(), [](const auto& f) { return f->load(); })) {
      return true;
    }
    if (clock_type::now() >= until) return false;
    std::this_thread::sleep_for(1ms);
  }
}

// How the loops on a rank's links ended once it closed them: "their loops ended with it" when
// each ended for that reason, else each one's error.
template <class Peer>
std::string loops_ended(const std::vector<std::unique_ptr<Peer>>& peers,
                        std::error_code Peer::*error) {
  std::string other;
  for (const auto& p : peers) {
    if ((*p).*error != ucx::errc::endpoint_closed) other += ", " + ((*p).*error).message();
  }
  return other.empty() ? "their loops ended with them" : "loops ended: " + other.substr(2);
}

// ------------------------------------------------------------------------------------------------
// A prefill rank

// A decode rank that reads from this prefill rank.
struct consumer {
  std::uint32_t rank = 0;
  kv::engine_description peer;
  kv::head_range heads;  // the heads it reads from here
  std::optional<kv::ucx_link> link;
  std::optional<kv::transfer_planner> planner;  // this rank's cache into the consumer's
  std::atomic<bool> serve_ended{false};
  std::error_code serve_error;
};

class prefill_rank {
 public:
  prefill_rank(kv::tp_shard tp, std::uint32_t decode_size)
      : e_("prefill-" + std::to_string(tp.rank), tp),
        decode_size_(decode_size),
        ledger_([this](kv::transfer_id id) { freed(id, "its ledger"); }) {}

  int run() {
    try {
      return script();
    } catch (const std::exception& e) {
      fail(e.what());  // here, with every member alive: nothing is unwound past this point
    }
  }

 private:
  int script() {
    e_.say_up("prefill");
    // The rest of the cache holds bytes of this rank's own, none of them the pattern.
    std::memset(e_.region.bytes().data(), 0xa0 + static_cast<int>(e_.tp.rank),
                e_.region.bytes().size());
    publish();
    connect(await_message(kind::peers));
    done(true);
    for (;;) {
      const auto [c, requests] = decode_command(await_message(kind::command).body);
      switch (c) {
        case command::prefill:
          prefill_everything(requests);
          break;
        case command::push:
          if (!e_.run(forward_and_push(requests))) fail("pushing requests " + ids_of(requests));
          break;
        case command::quit:
          done(quit());
          await_hang_up();
          return 0;
        case command::pull:
          fail("prefill ranks are not told to pull");
      }
      done(true);
    }
  }

  // A listener per decode rank (it tells each its own port), and the handshake.
  void publish() {
    published me;
    for (std::uint32_t d = 0; d < decode_size_; ++d) {
      listeners_.push_back(e_.worker.listen("127.0.0.1", 0, {}));
      me.ports.push_back(listeners_.back().port());
    }
    me.handshake = kv::encode(e_.describe());
    tell(kind::hello, encode_published(me));
  }

  // Accepts every decode rank that reads from this one, with its handshake.
  void connect(const message& peers) {
    reader r(peers.body);
    const auto count = r.get<std::uint32_t>();
    std::vector<ucx::pending_endpoint> accepting;
    const kv::engine_description me = e_.describe();
    for (std::uint32_t d = 0; d < count; ++d) {
      const published p = decode_published(r.get_bytes());
      kv::engine_description peer = kv::decode(p.handshake);  // checked, layout included
      const std::vector<std::uint32_t> sources =
          kv::tp_source_ranks(peer.layout, e_.tp.size, peer.tp);
      if (!std::binary_search(sources.begin(), sources.end(), e_.tp.rank)) continue;
      kv::check_compatible(me, peer);  // this rank's blocks can move into the peer's
      auto c = std::make_unique<consumer>();
      c->rank = peer.tp.rank;
      c->heads = kv::heads_read(kv_heads, true, e_.tp, peer.tp);
      c->peer = std::move(peer);
      accepting.push_back(listeners_.at(c->rank).accept_async(connect_deadline));
      consumers_.push_back(std::move(c));
    }
    for (std::size_t i = 0; i < consumers_.size(); ++i) {
      consumer& c = *consumers_[i];
      // Its regions come from its handshake: to_peer imports each descriptor on the endpoint.
      c.link.emplace(kv::ucx_link::to_peer(accepting[i].get(), {e_.region}, c.peer));
      c.planner.emplace(e_.layout, e_.tp, c.peer.layout, c.peer.tp);
      say("decode rank %u connected: handshake %s (incarnation %llu), TP %u/%u, %zu layers, "
          "compatible; it reads %s from here",
          c.rank, c.peer.engine_id.c_str(), static_cast<unsigned long long>(c.peer.incarnation),
          c.peer.tp.rank, c.peer.tp.size, c.peer.layout.layers.size(), heads_text(c.heads).c_str());
      ferry::spawn(e_.thread.loop(), serve(c),
                   [&c](std::exception_ptr) noexcept { c.serve_ended.store(true); });
    }
    listeners_.clear();  // every rank that reads from here is connected
  }

  // Acknowledges each release the consumer sends in the ledger, until its link closes.
  ferry::task<void> serve(consumer& c) {
    c.serve_error = co_await kv::serve_releases(*c.link, ledger_, c.rank);
  }

  void freed(kv::request_id id, const char* by) {
    {
      const std::lock_guard lock(freed_mutex_);
      freed_.insert(id);
    }
    say("request %llu: blocks freed (by %s)", static_cast<unsigned long long>(id), by);
    writer w;
    w.put(id);
    tell(kind::freed, w.bytes());
  }

  std::string consumer_names() const {
    std::string s;
    for (const auto& c : consumers_) s += (s.empty() ? "" : ", ") + std::to_string(c->rank);
    return s;
  }

  void compute_layer(const request& r, std::uint32_t layer) {
    (void)for_each_element(e_.layout, e_.region.bytes(), e_.held, r, r.prefill_blocks, layer,
                           [](std::byte* at, std::uint16_t value, const element_at&) {
                             std::memcpy(at, &value, sizeof value);
                             return true;
                           });
  }

  // Pull: every layer computed now; the ledger frees the blocks once every reader released them.
  void prefill_everything(const std::vector<request>& requests) {
    for (const request& r : requests) {
      for (std::uint32_t layer = 0; layer < model_layers; ++layer) compute_layer(r, layer);
      (void)ledger_.expect(r.id, static_cast<std::uint32_t>(consumers_.size()));
      say("request %llu: computed all %u layers into blocks [%s]; the ledger frees them once "
          "decode rank(s) %s released it",
          static_cast<unsigned long long>(r.id), model_layers, list(r.prefill_blocks).c_str(),
          consumer_names().c_str());
    }
  }

  // Push: the forward pass computes each layer and pushes it at once to every consumer.
  ferry::task<bool> forward_and_push(std::vector<request> requests) {
    std::vector<std::unique_ptr<kv::transfer_plan>> plans;  // must outlive the pushes
    std::vector<std::unique_ptr<kv::pushed_request<kv::ucx_link>>> pushes;
    std::vector<const request*> of_push;
    std::vector<const consumer*> to;
    for (const request& r : requests) {
      for (const auto& c : consumers_) {
        const kv::block_pairs group{r.prefill_blocks, r.decode_blocks};
        plans.push_back(std::make_unique<kv::transfer_plan>(c->planner->plan(std::span(&group, 1))));
        pushes.push_back(std::make_unique<kv::pushed_request<kv::ucx_link>>(
            *c->link, r.id, *plans.back(), transfer_deadline));
        of_push.push_back(&r);
        to.push_back(c.get());
        say("request %llu -> decode rank %u: blocks [%s] -> [%s], %s: %llu ranges, %llu bytes "
            "over %u layers",
            static_cast<unsigned long long>(r.id), c->rank, list(r.prefill_blocks).c_str(),
            list(r.decode_blocks).c_str(), heads_text(c->heads).c_str(),
            static_cast<unsigned long long>(plans.back()->ranges),
            static_cast<unsigned long long>(plans.back()->bytes), model_layers);
      }
    }
    const auto start = clock_type::now();
    for (std::uint32_t layer = 0; layer < model_layers; ++layer) {
      for (const request& r : requests) compute_layer(r, layer);
      std::string moved;
      for (std::size_t i = 0; i < pushes.size(); ++i) {
        pushes[i]->layer_computed(layer);
        std::uint64_t bytes = 0;
        for (const kv::byte_range& b : plans[i]->layers[layer]) bytes += b.length;
        moved += (moved.empty() ? "" : "; ") + std::string("request ") +
                 std::to_string(of_push[i]->id) + " -> decode " + std::to_string(to[i]->rank) +
                 ": " + std::to_string(plans[i]->layers[layer].size()) + " ranges, " +
                 std::to_string(bytes) + " B";
      }
      say("layer %u computed and pushed (+%.2f ms): %s", layer, ms_between(start, clock_type::now()),
          moved.c_str());
    }
    bool ok = true;
    for (std::size_t i = 0; i < pushes.size(); ++i) {
      const ferry::batch_result written = co_await pushes[i]->finish();
      const ferry::transfer_state noticed = co_await pushes[i]->notice();
      say("request %llu -> decode rank %u: %zu writes %s, notice %s (+%.2f ms)",
          static_cast<unsigned long long>(of_push[i]->id), to[i]->rank,
          pushes[i]->writes().size(), written.ok() ? "landed" : "FAILED",
          ferry::to_string(noticed), ms_between(start, clock_type::now()));
      if (!written.ok() || noticed != ferry::transfer_state::success) ok = false;
    }
    // Every write is terminal (finish waited for them): the source blocks are free again.
    for (const request& r : requests) freed(r.id, "the forward pass: its writes all ended");
    co_return ok;
  }

  bool quit() {
    for (const auto& c : consumers_) c->link->endpoint().close();
    std::vector<const std::atomic<bool>*> ended;
    for (const auto& c : consumers_) ended.push_back(&c->serve_ended);
    if (!all_set(ended, 5000ms)) {
      say("FAILED: a release loop did not end within 5 s of its link closing");
      return false;
    }
    bool ok = ledger_.open() == 0 && ledger_.early() == 0;
    std::multiset<kv::request_id> frees;
    {
      const std::lock_guard lock(freed_mutex_);
      frees = freed_;
    }
    for (const request& r : schedule()) ok = ok && frees.count(r.id) == 1;
    ok = ok && frees.size() == schedule().size();
    say("closed its %zu link(s), %s; ledger: %zu open, %zu early; %zu requests freed, each "
        "once: %s",
        consumers_.size(), loops_ended(consumers_, &consumer::serve_error).c_str(), ledger_.open(),
        ledger_.early(), frees.size(), ok ? "yes" : "NO");
    return ok;
  }

  engine e_;
  std::uint32_t decode_size_;
  std::vector<ucx::listener> listeners_;
  std::vector<std::unique_ptr<consumer>> consumers_;
  std::mutex freed_mutex_;
  std::multiset<kv::request_id> freed_;
  kv::release_ledger ledger_;  // first to go: its callback uses the members above
};

// ------------------------------------------------------------------------------------------------
// A decode rank

// A prefill rank this decode rank reads from.
struct source {
  std::uint32_t rank = 0;
  kv::engine_description peer;
  kv::head_range heads;  // the heads read from it
  std::optional<kv::ucx_link> link;
  std::optional<kv::transfer_planner> planner;  // its cache into this rank's
  kv::push_receiver receiver;                   // its push notices
  std::atomic<bool> receive_ended{false};
  std::error_code receive_error;
};

class decode_rank {
 public:
  decode_rank(kv::tp_shard tp, std::uint32_t prefill_size)
      : e_("decode-" + std::to_string(tp.rank), tp),
        prefill_size_(prefill_size),
        // Pulled requests are released to every source rank; pushed ones need no release (the
        // producer frees them once its writes ended).
        tracker_(
            [this](kv::request_id id, kv::request_verdict v) {
              if (!pulled_.contains(id)) return;
              for (const auto& release : releases_) release(id, v);
            },
            // A pushed request whose notice does not come in time is cancelled by its receiver.
            [this](const ferry::transfer& t) {
              for (const auto& s : sources_) s->receiver.cancel(t);
            }) {}

  int run() {
    try {
      return script();
    } catch (const std::exception& e) {
      fail(e.what());  // here, with every member alive: nothing is unwound past this point
    }
  }

 private:
  int script() {
    e_.say_up("decode");
    std::memset(e_.region.bytes().data(), static_cast<int>(poison), e_.region.bytes().size());
    tell(kind::hello, encode_published({{}, kv::encode(e_.describe())}));
    connect(await_message(kind::peers));
    done(true);
    for (;;) {
      const auto [c, requests] = decode_command(await_message(kind::command).body);
      switch (c) {
        case command::pull:
          if (!e_.run(pull(requests))) fail("pulling requests " + ids_of(requests));
          verify(requests);
          break;
        case command::push: {
          (void)e_.run(expect_pushes(requests));
          const auto expected_at = clock_type::now();
          done(true);  // the coordinator now lets prefill push
          if (!e_.run(await_pushes(requests, expected_at))) {
            fail("receiving pushed requests " + ids_of(requests));
          }
          verify(requests);
          break;
        }
        case command::quit:
          done(quit());
          await_hang_up();
          return 0;
        case command::prefill:
          fail("decode ranks are not told to prefill");
      }
      done(true);
    }
  }

  // Connects to every prefill rank it reads from, by its handshake.
  void connect(const message& peers) {
    reader r(peers.body);
    std::vector<published> prefill(r.get<std::uint32_t>());
    for (published& p : prefill) p = decode_published(r.get_bytes());
    const kv::engine_description me = e_.describe();
    const std::vector<kv::tp_source> shares =
        kv::tp_sources(kv_heads, true, prefill_size_, e_.tp);
    for (const std::uint32_t s : kv::tp_source_ranks(e_.layout, prefill_size_, e_.tp)) {
      auto src = std::make_unique<source>();
      src->rank = s;
      src->peer = kv::decode(prefill.at(s).handshake);  // checked, layout included
      kv::check_compatible(src->peer, me);              // its blocks can move into mine
      for (const kv::tp_source& t : shares) {
        if (t.src_rank == s) src->heads = t.heads;
      }
      const std::uint16_t port = prefill.at(s).ports.at(e_.tp.rank);
      ucx::endpoint ep = e_.worker.connect("127.0.0.1", port, {}, connect_deadline);
      src->link.emplace(kv::ucx_link::to_peer(std::move(ep), {e_.region}, src->peer));
      src->planner.emplace(src->peer.layout, src->peer.tp, e_.layout, e_.tp);
      releases_.push_back(kv::release_to(*src->link, transfer_deadline));
      say("connected to prefill rank %u on 127.0.0.1:%u: handshake %s (incarnation %llu), TP "
          "%u/%u, %zu layers, %zu region(s), compatible; reading %s from it",
          s, port, src->peer.engine_id.c_str(),
          static_cast<unsigned long long>(src->peer.incarnation), src->peer.tp.rank,
          src->peer.tp.size, src->peer.layout.layers.size(), src->peer.regions.size(),
          heads_text(src->heads).c_str());
      source& ref = *src;
      sources_.push_back(std::move(src));
      ferry::spawn(e_.thread.loop(), receive(ref),
                   [&ref](std::exception_ptr) noexcept { ref.receive_ended.store(true); });
    }
  }

  // Takes the source's push notices, until its link closes.
  ferry::task<void> receive(source& s) { s.receive_error = co_await s.receiver.receive(*s.link); }

  // What moved, per layer and source rank.
  struct moved {
    std::uint64_t ranges = 0;
    std::uint64_t bytes = 0;
  };
  using per_layer = std::vector<std::vector<moved>>;  // [layer][source]

  std::string layer_text(const per_layer& m, std::uint32_t layer) const {
    std::string s;
    for (std::size_t i = 0; i < sources_.size(); ++i) {
      s += (s.empty() ? "" : "; ") + std::string("from prefill ") +
           std::to_string(sources_[i]->rank) + " (" + heads_text(sources_[i]->heads) +
           "): " + std::to_string(m[layer][i].ranges) + " ranges, " +
           std::to_string(m[layer][i].bytes) + " B";
    }
    return s;
  }

  // The plan from each source for `r`, said and added to `m`.
  std::vector<kv::transfer_plan> plan(const request& r, const char* how, per_layer& m) {
    std::vector<kv::transfer_plan> plans;
    const kv::block_pairs group{r.prefill_blocks, r.decode_blocks};
    for (std::size_t i = 0; i < sources_.size(); ++i) {
      plans.push_back(sources_[i]->planner->plan(std::span(&group, 1)));
      const kv::transfer_plan& p = plans.back();
      for (std::uint32_t layer = 0; layer < model_layers; ++layer) {
        m[layer][i].ranges += p.layers[layer].size();
        for (const kv::byte_range& b : p.layers[layer]) m[layer][i].bytes += b.length;
      }
      say("request %llu (%s): prefill blocks [%s] -> decode blocks [%s]; from prefill %u, %s: "
          "%llu ranges, %llu bytes (%zu ranges of %llu B a layer)",
          static_cast<unsigned long long>(r.id), how, list(r.prefill_blocks).c_str(),
          list(r.decode_blocks).c_str(), sources_[i]->rank, heads_text(sources_[i]->heads).c_str(),
          static_cast<unsigned long long>(p.ranges), static_cast<unsigned long long>(p.bytes),
          p.layers[0].size(),
          static_cast<unsigned long long>(p.layers[0].empty() ? 0 : p.layers[0][0].length));
    }
    return plans;
  }

  // Pull: reads every layer from every source, awaits each layer, releases.
  ferry::task<bool> pull(std::vector<request> requests) {
    tracker_.begin_step();
    per_layer m(model_layers, std::vector<moved>(sources_.size()));
    const auto start = clock_type::now();
    for (const request& r : requests) {
      pulled_.insert(r.id);
      const std::vector<kv::transfer_plan> plans = plan(r, "pull", m);
      kv::request_options o;
      o.abort_timeout = transfer_deadline;
      const auto h = tracker_.add_request(r.id, o);
      const kv::block_pairs group{r.prefill_blocks, r.decode_blocks};
      for (std::size_t i = 0; i < sources_.size(); ++i) {
        kv::pull(*sources_[i]->link, plans[i], e_.layout, std::span(&group, 1), tracker_, h,
                 transfer_deadline);
      }
      tracker_.seal(h);
    }
    bool ok = true;
    for (std::uint32_t layer = 0; layer < model_layers; ++layer) {
      // The forward pass would compute this layer now, while later ones still stream in.
      const ferry::batch_result b = co_await tracker_.when_layer(layer, transfer_deadline);
      say("layer %u %s (+%.2f ms), requests %s: %s", layer, b.ok() ? "ready" : "FAILED",
          ms_between(start, clock_type::now()), ids_of(requests).c_str(),
          layer_text(m, layer).c_str());
      if (!b.ok()) {
        say("  %s: %s", ferry::to_string(b.verdict), b.error.message().c_str());
        ok = false;
      }
    }
    co_return finish(requests, "released to every source rank") && ok;
  }

  // Hands back the step's requests (a pulled one's release goes out here): each must succeed.
  bool finish(const std::vector<request>& requests, const char* then) {
    const std::vector<kv::finished_request> finished = tracker_.take_finished();
    bool ok = finished.size() == requests.size();
    for (const kv::finished_request& f : finished) {
      say("request %llu: %s, %s", static_cast<unsigned long long>(f.id), kv::to_string(f.verdict),
          then);
      ok = ok && f.verdict == kv::request_verdict::success;
    }
    const std::vector<kv::block_id> failed = tracker_.drain_failed_blocks();
    return ok && failed.empty();
  }

  // Push: one transfer per layer and source rank, ended by that rank's notice.
  ferry::task<bool> expect_pushes(std::vector<request> requests) {
    tracker_.begin_step();
    per_layer m(model_layers, std::vector<moved>(sources_.size()));
    for (const request& r : requests) {
      (void)plan(r, "push, as prefill will write it", m);
      kv::request_options o;
      o.abort_timeout = transfer_deadline;  // a notice that never comes fails it by then
      const auto h = tracker_.add_request(r.id, o);
      const kv::block_pairs group{r.prefill_blocks, r.decode_blocks};
      for (const auto& s : sources_) {
        s->receiver.expect(tracker_, h, r.id, e_.layout, std::span(&group, 1));
      }
      tracker_.seal(h);
    }
    pushed_ = std::move(m);
    say("expecting requests %s: one transfer per layer from each source rank, ended by its notice",
        ids_of(requests).c_str());
    co_return true;
  }

  ferry::task<bool> await_pushes(std::vector<request> requests, clock_type::time_point start) {
    bool ok = true;
    for (std::uint32_t layer = 0; layer < model_layers; ++layer) {
      const ferry::batch_result b = co_await tracker_.when_layer(layer, transfer_deadline);
      say("layer %u %s (+%.2f ms), requests %s: %s", layer, b.ok() ? "ready" : "FAILED",
          ms_between(start, clock_type::now()), ids_of(requests).c_str(),
          layer_text(pushed_, layer).c_str());
      if (!b.ok()) {
        say("  %s: %s", ferry::to_string(b.verdict), b.error.message().c_str());
        ok = false;
      }
    }
    // Every layer is terminal by now (or the wait failed): take_finished hands every request back.
    co_return finish(requests, "every source rank's notice said landed") && ok;
  }

  // Every head slice of every block received holds what the rank holding that head wrote, and
  // every block never received still holds the poison.
  void verify(const std::vector<request>& requests) {
    std::uint64_t checked = 0;
    for (const request& r : requests) {
      received_.insert(r.decode_blocks.begin(), r.decode_blocks.end());
      for (std::uint32_t layer = 0; layer < model_layers; ++layer) {
        std::string wrong;
        const bool same = for_each_element(
            e_.layout, e_.region.bytes(), e_.held, r, r.decode_blocks, layer,
            [&](std::byte* at, std::uint16_t value, const element_at& where) {
              std::uint16_t got = 0;
              std::memcpy(&got, at, sizeof got);
              ++checked;
              if (got == value) return true;
              wrong = "request " + std::to_string(r.id) + " layer " + std::to_string(where.layer) +
                      (where.tensor == 0 ? " K" : " V") + " block " + std::to_string(where.block) +
                      " token " + std::to_string(where.token) + " head " +
                      std::to_string(where.head) + " (prefill rank " +
                      std::to_string(writer_of(where.head)) + "'s) element " +
                      std::to_string(where.dim) + ": " + std::to_string(got) + ", expected " +
                      std::to_string(value);
              return false;
            });
        if (!same) fail("wrong bytes: " + wrong);
      }
    }
    // The blocks never received: whole blocks of every tensor, the poison in every byte.
    std::uint64_t untouched = 0;
    for (const kv::layer_layout& layer : e_.layout.layers) {
      for (const kv::tensor_layout& t : layer.tensors) {
        const std::uint64_t extent =
            (t.block_size - 1) * t.token_stride + (t.heads - 1) * t.head_stride + t.head_bytes();
        for (std::uint32_t b = 0; b < t.blocks; ++b) {
          if (received_.contains(b)) continue;
          const auto bytes = e_.region.bytes().subspan(t.offset + b * t.block_stride, extent);
          if (std::any_of(bytes.begin(), bytes.end(), [](std::byte x) { return x != poison; })) {
            fail("block " + std::to_string(b) + ", which no request had, was written");
          }
          untouched += extent;
        }
      }
    }
    std::string by;
    for (const auto& s : sources_) {
      by += (by.empty() ? "" : ", ") + heads_text(s->heads) + " as prefill " +
            std::to_string(s->rank) + " wrote them";
    }
    say("verified byte for byte: requests %s, %llu fp16 elements (%s); the %zu blocks no "
        "request had still hold the poison (%llu KiB)",
        ids_of(requests).c_str(), static_cast<unsigned long long>(checked), by.c_str(),
        cache_blocks - received_.size(), static_cast<unsigned long long>(untouched >> 10));
  }

  // The prefill rank that holds global head `head` (and so wrote it).
  std::uint32_t writer_of(std::uint32_t head) const {
    for (const auto& s : sources_) {
      if (head >= s->heads.first && head < s->heads.first + s->heads.count) return s->rank;
    }
    return ~0u;
  }

  bool quit() {
    for (const auto& s : sources_) s->link->endpoint().close();  // ends the receive loops
    std::vector<const std::atomic<bool>*> ended;
    for (const auto& s : sources_) ended.push_back(&s->receive_ended);
    if (!all_set(ended, 5000ms)) {
      say("FAILED: a receive loop did not end within 5 s of its link closing");
      return false;
    }
    return e_.run(checks_at_quit());
  }

  ferry::task<bool> checks_at_quit() {
    std::size_t expected = 0;
    std::uint64_t stale = 0;
    for (const auto& s : sources_) {
      expected += s->receiver.expected();
      stale += s->receiver.stale();
    }
    const bool ok = tracker_.tracked() == 0 && expected == 0 && stale == 0;
    say("closed its %zu link(s), %s; %zu requests tracked, %zu pushes still expected, %llu stale "
        "notices",
        sources_.size(), loops_ended(sources_, &source::receive_error).c_str(), tracker_.tracked(),
        expected, static_cast<unsigned long long>(stale));
    co_return ok;
  }

  engine e_;
  std::uint32_t prefill_size_;
  std::vector<std::unique_ptr<source>> sources_;
  std::vector<kv::load_tracker::release_fn> releases_;  // one per source, by kv::release_to
  std::set<kv::request_id> pulled_;                     // requests to release to prefill
  std::set<std::uint32_t> received_;                    // decode blocks requests had
  per_layer pushed_;                                    // what the pushes move, per layer
  kv::load_tracker tracker_;                            // first to go: it calls the above
};

// ------------------------------------------------------------------------------------------------
// The coordinator

void line(const std::string& label, const std::string& text) {
  std::printf("%-12s| %s\n", label.c_str(), text.c_str());
}

[[gnu::format(printf, 1, 2)]] void note(const char* format, ...) {
  char text[1024];
  va_list args;
  va_start(args, format);
  std::vsnprintf(text, sizeof text, format, args);
  va_end(args);
  line("coordinator", text);
}

struct rank_process {
  std::string label;  // "prefill 0/2"
  bool prefill = false;
  std::uint32_t rank = 0;
  pid_t pid = -1;
  int channel = -1;  // the coordinator's end
  std::optional<std::vector<std::byte>> published;
  int dones = 0;
  std::multiset<kv::request_id> freed;
};

class scenario {
 public:
  scenario(std::uint32_t prefill_size, std::uint32_t decode_size)
      : prefill_size_(prefill_size), decode_size_(decode_size) {}
  scenario(const scenario&) = delete;
  scenario& operator=(const scenario&) = delete;

  // On every path: no rank outlives the coordinator.
  ~scenario() {
    for (rank_process& p : ranks_) {
      if (p.channel >= 0) ::close(p.channel);
      if (p.pid > 0) {
        ::kill(p.pid, SIGKILL);
        ::waitpid(p.pid, nullptr, 0);
      }
    }
  }

  bool run() {
    note("== %u prefill rank(s) -> %u decode rank(s) ==", prefill_size_, decode_size_);
    for (std::uint32_t p = 0; p < prefill_size_; ++p) {
      if (!start(true, p)) return false;
    }
    for (std::uint32_t d = 0; d < decode_size_; ++d) {
      if (!start(false, d)) return false;
    }
    if (!pump([&] { return every([](const rank_process& p) { return p.published.has_value(); }); },
              "every rank's handshake")) {
      return false;
    }
    for (const rank_process& p : ranks_) {
      note("%s published %zu bytes: its engine_description%s", p.label.c_str(),
           p.published->size(), p.prefill ? " and a port per decode rank" : "");
    }
    // This is where a directory comes in (the next issue): ranks would publish to it and look
    // their peers up there. Here the coordinator hands the bytes over itself.
    note("handing each decode rank the prefill ranks' handshakes and each prefill rank the "
         "decode ranks' (where a directory would serve them)");
    for (rank_process& p : ranks_) {
      writer w;
      w.put(p.prefill ? decode_size_ : prefill_size_);
      for (const rank_process& q : ranks_) {
        if (q.prefill != p.prefill) w.put_bytes(*q.published);
      }
      if (!send_message(p.channel, kind::peers, w.bytes())) return broken(p, "sending the peers");
    }
    if (!all_done(true, 1) || !all_done(false, 1)) return false;

    const std::vector<request> pulled = requests_of(mode::pull);
    note("pull: prefill computes requests %s, then every decode rank pulls them",
         ids_of(pulled).c_str());
    if (!command_all(true, command::prefill, pulled) || !all_done(true, 2)) return false;
    if (!command_all(false, command::pull, pulled) || !all_done(false, 2)) return false;
    if (!all_freed(pulled)) return false;

    const std::vector<request> pushed = requests_of(mode::push);
    note("push: every decode rank expects requests %s, then prefill computes and pushes them "
         "layer by layer",
         ids_of(pushed).c_str());
    if (!command_all(false, command::push, pushed) || !all_done(false, 3)) return false;
    if (!command_all(true, command::push, pushed)) return false;
    if (!all_done(true, 3) || !all_done(false, 4) || !all_freed(pushed)) return false;

    note("quit: every rank closes its links and checks what it holds");
    if (!command_all(true, command::quit, {}) || !command_all(false, command::quit, {})) {
      return false;
    }
    if (!all_done(true, 4) || !all_done(false, 5)) return false;
    return reap();
  }

 private:
  bool start(bool prefill, std::uint32_t rank) {
    rank_process p;
    p.prefill = prefill;
    p.rank = rank;
    p.label = std::string(prefill ? "prefill " : "decode ") + std::to_string(rank) + "/" +
              std::to_string(prefill ? prefill_size_ : decode_size_);
    int ends[2];
    if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, ends) != 0) {
      note("FAILED: socketpair: %s", std::strerror(errno));
      return false;
    }
    posix_spawn_file_actions_t actions;
    ::posix_spawn_file_actions_init(&actions);
    ::posix_spawn_file_actions_adddup2(&actions, ends[1], rank_channel);  // clears O_CLOEXEC
    std::string args[] = {"disaggregated",
                          "--rank",
                          prefill ? "prefill" : "decode",
                          std::to_string(rank),
                          std::to_string(prefill ? prefill_size_ : decode_size_),
                          std::to_string(prefill ? decode_size_ : prefill_size_)};
    char* argv[std::size(args) + 1];
    for (std::size_t i = 0; i < std::size(args); ++i) argv[i] = args[i].data();
    argv[std::size(args)] = nullptr;
    // posix_spawn, not fork: this process runs threads (a rank's executor and engine threads).
    const int err = ::posix_spawn(&p.pid, "/proc/self/exe", &actions, nullptr, argv, environ);
    ::posix_spawn_file_actions_destroy(&actions);
    ::close(ends[1]);
    p.channel = ends[0];
    if (err != 0) {
      p.pid = -1;
      ranks_.push_back(std::move(p));
      note("FAILED: starting %s: %s", ranks_.back().label.c_str(), std::strerror(err));
      return false;
    }
    ranks_.push_back(std::move(p));
    return true;
  }

  template <class Pred>
  bool every(Pred pred) const {
    return std::all_of(ranks_.begin(), ranks_.end(), pred);
  }

  bool broken(const rank_process& p, const std::string& why) {
    note("FAILED: %s: %s", p.label.c_str(), why.c_str());
    return false;
  }

  // Reads every rank's messages, printing their lines as they come, until `until()` holds; false
  // when a rank fails, hangs up or says nothing in time.
  template <class Pred>
  bool pump(Pred until, const char* waiting_for) {
    const auto deadline = clock_type::now() + channel_deadline;
    while (!until()) {
      std::vector<pollfd> fds;
      for (const rank_process& p : ranks_) fds.push_back({p.channel, POLLIN, 0});
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - clock_type::now());
      if (left.count() <= 0) {
        note("FAILED: waiting for %s: nothing within %lld s", waiting_for,
             static_cast<long long>(channel_deadline.count()));
        return false;
      }
      const int n = ::poll(fds.data(), fds.size(), static_cast<int>(left.count()));
      if (n < 0 && errno != EINTR) {
        note("FAILED: poll: %s", std::strerror(errno));
        return false;
      }
      for (std::size_t i = 0; n > 0 && i < fds.size(); ++i) {
        if (fds[i].revents == 0) continue;
        rank_process& p = ranks_[i];
        std::string why;
        std::optional<message> m = receive_message(p.channel, clock_type::now() + 1s, why);
        if (!m) return broken(p, why + " while the coordinator waited for " + waiting_for);
        if (!handle(p, *m)) return false;
      }
    }
    return true;
  }

  bool handle(rank_process& p, const message& m) {
    switch (m.what) {
      case kind::log:
        line(p.label, std::string(reinterpret_cast<const char*>(m.body.data()), m.body.size()));
        return true;
      case kind::hello:
        p.published = m.body;
        return true;
      case kind::done:
        ++p.dones;
        return m.body.size() == 1 && m.body[0] == std::byte{1} ? true : broken(p, "it failed");
      case kind::freed: {
        const auto id = reader(m.body).get<kv::request_id>();
        p.freed.insert(id);
        if (p.freed.count(id) > 1) return broken(p, "it freed a request twice");
        return true;
      }
      default:
        return broken(p, "it sent a message of unknown kind");
    }
  }

  bool command_all(bool prefill, command c, const std::vector<request>& rs) {
    const std::vector<std::byte> body = encode_command(c, rs);
    for (const rank_process& p : ranks_) {
      if (p.prefill == prefill && !send_message(p.channel, kind::command, body)) {
        return broken(p, "sending it a command");
      }
    }
    return true;
  }

  // Every rank of one side has said "done" `n` times in all.
  bool all_done(bool prefill, int n) {
    return pump(
        [&] {
          return every([&](const rank_process& p) { return p.prefill != prefill || p.dones >= n; });
        },
        prefill ? "the prefill ranks" : "the decode ranks");
  }

  // Every prefill rank freed each of `rs`' blocks.
  bool all_freed(const std::vector<request>& rs) {
    const bool ok = pump(
        [&] {
          return every([&](const rank_process& p) {
            return !p.prefill || std::all_of(rs.begin(), rs.end(), [&](const request& r) {
              return p.freed.contains(r.id);
            });
          });
        },
        "the prefill ranks to free the requests' blocks");
    if (ok) note("every prefill rank freed requests %s", ids_of(rs).c_str());
    return ok;
  }

  // Hangs up on every rank and waits for each to exit 0.
  bool reap() {
    for (rank_process& p : ranks_) {
      ::close(p.channel);
      p.channel = -1;
    }
    const auto until = clock_type::now() + exit_deadline;
    bool ok = true;
    for (rank_process& p : ranks_) {
      int status = 0;
      pid_t r = 0;
      while ((r = ::waitpid(p.pid, &status, WNOHANG)) == 0 && clock_type::now() < until) {
        std::this_thread::sleep_for(5ms);
      }
      if (r != p.pid) {
        ok = broken(p, "it did not exit in time");
        continue;
      }
      p.pid = -1;
      if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        ok = broken(p, WIFEXITED(status) ? "exit status " + std::to_string(WEXITSTATUS(status))
                                         : "signal " + std::to_string(WTERMSIG(status)));
      }
    }
    if (ok) note("every rank exited 0");
    return ok;
  }

  std::uint32_t prefill_size_;
  std::uint32_t decode_size_;
  std::vector<rank_process> ranks_;
};

int run_coordinator(bool two_to_one, bool one_to_two) {
  const auto start = clock_type::now();
  note("a model with %u layers, %u KV heads of %u fp16 elements; each rank's cache K,V split, %u "
       "blocks of %u tokens",
       model_layers, kv_heads, head_size, cache_blocks, block_tokens);
  for (const request& r : schedule()) {
    note("request %llu, %s: %zu blocks, prefill [%s] -> decode [%s]",
         static_cast<unsigned long long>(r.id), r.how == mode::pull ? "pull" : "push",
         r.prefill_blocks.size(), list(r.prefill_blocks).c_str(), list(r.decode_blocks).c_str());
  }
  bool ok = true;
  if (two_to_one) ok = scenario(2, 1).run();
  if (ok && one_to_two) ok = scenario(1, 2).run();
  note("%s in %.0f ms", ok ? "every rank verified what it received, every block was freed once"
                           : "FAILED",
       ms_between(start, clock_type::now()));
  return ok ? 0 : 1;
}

int run_rank(const std::string& role, std::uint32_t rank, std::uint32_t size,
             std::uint32_t peer_size) {
  try {
    if (role == "prefill") return prefill_rank({rank, size}, peer_size).run();
    return decode_rank({rank, size}, peer_size).run();
  } catch (const std::exception& e) {
    fail(e.what());  // ends the process here: nothing is unwound past this point
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  try {
    if (argc == 6 && std::strcmp(argv[1], "--rank") == 0) {
      return run_rank(argv[2], static_cast<std::uint32_t>(std::stoul(argv[3])),
                      static_cast<std::uint32_t>(std::stoul(argv[4])),
                      static_cast<std::uint32_t>(std::stoul(argv[5])));
    }
    const std::string which = argc == 2 ? argv[1] : "";
    if (argc > 2 || (argc == 2 && which != "2to1" && which != "1to2")) {
      std::fprintf(stderr, "usage: %s [2to1 | 1to2]\n", argv[0]);
      return 2;
    }
    return run_coordinator(which != "1to2", which != "2to1");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "disaggregated: %s\n", e.what());
    return 1;
  }
}

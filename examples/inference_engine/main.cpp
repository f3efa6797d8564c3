// A decode engine loading a step's KV cache from a prefill process, layer by layer.
//
// The decode engine has its own scheduler: a run_loop driven by its engine thread. Its pretend
// forward pass over 32 layers co_awaits each layer's loads (across every request of the step, with
// one deadline) while later layers still stream in. The prefill process sends the blocks over TCP
// through io_uring (in-process loopback copies stand in where io_uring is not built), and frees each
// request's source blocks once the decode side releases it (kv::release_ledger). With --ucx, decode
// instead reads every block out of the prefill process's memory with one-sided UCX gets (over tcp
// on 127.0.0.1, connected by host and port) and tells prefill of each release with a notification.
//
// Four requests, two of them with a load failure injected (ferry::fault_injector):
//   request 0: attention only                      -> success
//   request 1: attention only, layer 11 fails       -> its blocks are reported for recompute
//   request 2: hybrid (every 4th layer is a KDA layer posting conv and ssm state) -> success
//   request 3: hybrid, a KDA layer's ssm state fails -> kv::transfer_error, the request is aborted
//
// Exit status 0 when every outcome is the expected one.

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <span>
#include <string>
#include <vector>

#include <ferry/ferry.hpp>
#include <ferry/testing.hpp>
#include <ferry/kv.hpp>

#if FERRY_EXAMPLE_URING
#include <sys/wait.h>
#include <unistd.h>

#include <ferry/uring/tcp.hpp>
#endif

#if FERRY_EXAMPLE_UCX
#include <sys/wait.h>
#include <unistd.h>

#include <ferry/ucx.hpp>
#endif

using namespace std::chrono_literals;
namespace kv = ferry::kv;

namespace {

constexpr std::size_t layers = 32;
constexpr std::size_t block_bytes = 16 << 10;
constexpr std::size_t failing_attention_layer = 11;
constexpr std::size_t failing_kda_layer = 7;  // layer 7 is a KDA layer (7 % 4 == 3)

struct request_plan {
  kv::request_id id;
  bool hybrid;
  bool fail;  // inject a load failure
};
const request_plan requests[] = {{0, false, false}, {1, false, true}, {2, true, false}, {3, true, true}};

// One KV transfer of the step, in the order prefill sends them: layer by layer, so that the early
// layers arrive first.
struct load {
  kv::request_id request;
  std::size_t layer;
  std::size_t part;  // a KDA layer has two: conv state, ssm state
  kv::block_id block;
  bool inject_failure;
};

bool is_kda(const request_plan& r, std::size_t layer) { return r.hybrid && layer % 4 == 3; }

std::vector<load> plan_step() {
  std::vector<load> plan;
  for (std::size_t layer = 0; layer < layers; ++layer) {
    for (const request_plan& r : requests) {
      const std::size_t parts = is_kda(r, layer) ? 2 : 1;
      for (std::size_t p = 0; p < parts; ++p) {
        const bool fail = r.fail && (r.hybrid ? layer == failing_kda_layer && p == 1
                                              : layer == failing_attention_layer);
        plan.push_back({r.id, layer, p, static_cast<kv::block_id>(plan.size()), fail});
      }
    }
  }
  return plan;
}

// What prefill computed for a block, and what decode checks when it "computes" the layer.
std::byte kv_byte(kv::block_id block, std::size_t i) {
  return static_cast<std::byte>((block * 2654435761u + i * 2246822519u) >> 11);
}

void fill_block(std::span<std::byte> b, kv::block_id block) {
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = kv_byte(block, i);
}

bool check_block(std::span<const std::byte> b, kv::block_id block) {
  for (std::size_t i = 0; i < b.size(); ++i) {
    if (b[i] != kv_byte(block, i)) return false;
  }
  return true;
}

// ---- The decode engine ----

struct outcome {
  std::map<kv::request_id, std::string> released;
  std::vector<kv::block_id> recompute;
  std::vector<kv::request_id> aborted;
  bool bytes_ok = true;
};

class decode_engine {
 public:
  // post(load, dst) starts one load into `dst`; release(id) tells the producer.
  template <class Post, class Release>
  decode_engine(ferry::progress_executor& exec, const std::vector<load>& plan, Post post,
                Release release)
      : plan_(plan),
        kv_(plan.size() * block_bytes),
        tracker_([release](kv::request_id id, kv::request_verdict v) { release(id, v); }),
        injector_(exec, ferry::fault_profile{.failure_rate = 1.0}) {
    tracker_.begin_step();
    std::map<kv::request_id, kv::load_tracker::request_handle> handles;
    for (const request_plan& r : requests) {
      handles.emplace(r.id, tracker_.add_request(r.id, kv::request_options{.hybrid = r.hybrid}));
    }
    for (const load& l : plan_) {
      ferry::transfer t = post(l, block(l.block));
      if (l.inject_failure) t = injector_.wrap(std::move(t));  // the data moves; the load "fails"
      const kv::block_id dst[] = {l.block};
      tracker_.add(handles.at(l.request), l.layer, std::move(t), dst);
    }
    for (auto& [id, h] : handles) tracker_.seal(h);
  }

  // The forward pass: layer L computes as soon as its loads are in, while L+1... stream in.
  ferry::task<outcome> forward_pass() {
    outcome out;
    const auto start = std::chrono::steady_clock::now();
    std::map<kv::request_id, bool> broken;
    for (std::size_t layer = 0; layer < layers; ++layer) {
      const ferry::batch_result r = co_await tracker_.when_layer(layer, 10s);
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() -
                                                                  start).count();
      if (layer % 4 == 0 || !r.ok()) {
        std::printf("decode: layer %2zu %s at %6.2f ms, %3zu loads of later layers still in flight\n",
                    layer, r.ok() ? "loaded" : "FAILED", ms, in_flight_after(layer));
      }
      if (!r.ok()) {
        // Failed as soon as any member failed; let its siblings finish before looking at them.
        (void)ferry::drain(tracker_.layer_transfers(layer), 10s);
        for (std::size_t i = 0; i < plan_.size(); ++i) {
          const load& l = plan_[i];
          if (l.layer != layer) continue;
          const ferry::transfer& t = transfer_of(i);
          if (t.state() != ferry::transfer_state::success) {
            std::printf("decode:   request %llu, layer %zu part %zu: %s\n",
                        static_cast<unsigned long long>(l.request), l.layer, l.part,
                        t.error().message().c_str());
            broken[l.request] = true;
          }
        }
      }
      // "Compute" the layer for every request whose loads so far are good.
      for (const load& l : plan_) {
        if (l.layer != layer || broken[l.request]) continue;
        if (!check_block(block(l.block), l.block)) out.bytes_ok = false;
      }
    }
    // Hand back finished requests; a hybrid one that failed raises before anything changes.
    for (;;) {
      try {
        for (const kv::finished_request& f : tracker_.take_finished()) {
          out.released[f.id] = std::string(kv::to_string(f.verdict)) + (f.aborted ? " (aborted)" : "");
        }
        if (tracker_.tracked() == 0) break;
        (void)tracker_.drain_step(10s);
      } catch (const kv::transfer_error& e) {
        std::printf("decode: %s\n", e.what());
        tracker_.abort_request(e.request());
        out.aborted.push_back(e.request());
      }
    }
    out.recompute = tracker_.drain_failed_blocks();
    co_return out;
  }

 private:
  std::span<std::byte> block(kv::block_id b) { return {kv_.data() + b * block_bytes, block_bytes}; }

  // The tracker's transfer for plan entry i (layer lists hold them in posting order).
  const ferry::transfer& transfer_of(std::size_t i) const {
    const load& l = plan_[i];
    std::size_t k = 0;
    for (std::size_t j = 0; j < i; ++j) k += plan_[j].layer == l.layer ? 1 : 0;
    return tracker_.layer_transfers(l.layer)[k];
  }

  std::size_t in_flight_after(std::size_t layer) const {
    std::size_t n = 0;
    for (std::size_t l = layer + 1; l < layers; ++l) {
      for (const ferry::transfer& t : tracker_.layer_transfers(l)) n += t.done() ? 0 : 1;
    }
    return n;
  }

  const std::vector<load>& plan_;
  std::vector<std::byte> kv_;
  kv::load_tracker tracker_;
  ferry::fault_injector injector_;
};

bool report(const outcome& out) {
  std::printf("decode: released");
  for (const auto& [id, v] : out.released) {
    std::printf(" request %llu: %s;", static_cast<unsigned long long>(id), v.c_str());
  }
  std::printf("\ndecode: recompute blocks");
  for (kv::block_id b : out.recompute) std::printf(" %llu", static_cast<unsigned long long>(b));
  std::printf(" (request 1, layer %zu)\n", failing_attention_layer);
  const bool expected = out.bytes_ok && out.released.size() == 4 &&
                        out.released.at(0) == "success" && out.released.at(1) == "failed" &&
                        out.released.at(2) == "success" &&
                        out.released.at(3) == "failed (aborted)" && out.recompute.size() == 1 &&
                        out.aborted == std::vector<kv::request_id>{3};
  std::printf("decode: %s\n", expected ? "every outcome as expected" : "UNEXPECTED OUTCOME");
  return expected;
}

// Runs the decode engine on this thread's run_loop and reports.
template <class Post, class Release>
bool decode(ferry::progress_executor& exec, const std::vector<load>& plan, Post post,
            Release release) {
  decode_engine engine(exec, plan, post, release);
  ferry::run_loop engine_loop;  // the engine's own scheduler, driven by this thread
  return report(ferry::sync_wait(engine_loop, engine.forward_pass()));
}

#if FERRY_EXAMPLE_URING

namespace uring = ferry::uring;

// The prefill process: sends every block in plan order, then frees each request's source blocks
// once the decode side has released it.
int prefill(const std::vector<load>& plan, std::uint16_t port) {
  ferry::progress_executor exec;
  uring::ring ring(exec);
  uring::tcp_connection conn = uring::tcp_connection::connect(ring, "127.0.0.1", port);
  std::vector<std::byte> source(plan.size() * block_bytes);
  std::vector<ferry::transfer> sends;
  std::map<kv::request_id, bool> freed;
  kv::release_ledger ledger([&](kv::transfer_id id) { freed[id] = true; });
  for (const request_plan& r : requests) (void)ledger.expect(r.id, 1);  // one decode rank
  for (const load& l : plan) {
    const std::span<std::byte> b(source.data() + l.block * block_bytes, block_bytes);
    fill_block(b, l.block);
    sends.push_back(conn.send(l.block, b));
  }
  // Releases come back on the same connection as empty blocks whose id is the request.
  std::byte none[1];
  for (std::size_t n = 0; n < std::size(requests); ++n) {
    uring::received_block got;
    if (conn.receive(std::span(none, 0), got).wait() != ferry::transfer_state::success) break;
    (void)ledger.acknowledge(got.id, 0);
  }
  (void)ferry::drain(sends, 10s);
  std::printf("prefill: sent %zu blocks; freed the source blocks of %zu requests\n", sends.size(),
              freed.size());
  return freed.size() == std::size(requests) ? 0 : 1;
}

int run(const std::vector<load>& plan) {
  uring::tcp_listener listener("127.0.0.1", 0);
  const std::uint16_t port = listener.port();
  std::fflush(stdout);
  const pid_t child = ::fork();  // before either process starts a thread
  if (child < 0) return 1;
  if (child == 0) {
    const int rc = prefill(plan, port);
    std::fflush(stdout);
    std::_Exit(rc);
  }
  std::printf("decode: prefill is process %d, over TCP through io_uring\n", static_cast<int>(child));
  bool ok = false;
  {
    ferry::progress_executor exec;
    uring::ring ring(exec);
    uring::tcp_connection conn = listener.accept(ring);
    std::vector<uring::received_block> got(plan.size());
    std::vector<ferry::transfer> releases;
    ok = decode(
        exec, plan,
        [&](const load& l, std::span<std::byte> dst) { return conn.receive(dst, got[l.block]); },
        [&](kv::request_id id, kv::request_verdict) { releases.push_back(conn.send(id, {})); });
    ok = ferry::drain(releases, 10s).ok() && ok;
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  return ok && WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
}

#else

// Without io_uring, "prefill" is this process's memory and the loads are loopback copies.
int run(const std::vector<load>& plan) {
  std::printf("decode: built without io_uring; prefill's blocks come through loopback copies\n");
  std::vector<std::byte> source(plan.size() * block_bytes);
  for (const load& l : plan) fill_block({source.data() + l.block * block_bytes, block_bytes}, l.block);
  std::size_t freed = 0;
  kv::release_ledger ledger([&](kv::transfer_id) { ++freed; });
  for (const request_plan& r : requests) (void)ledger.expect(r.id, 1);
  ferry::progress_executor exec;
  ferry::loopback_backend lb(exec);
  const bool ok = decode(
      exec, plan,
      [&](const load& l, std::span<std::byte> dst) {
        return lb.copy(dst, std::span<const std::byte>(source.data() + l.block * block_bytes,
                                                       block_bytes));
      },
      [&](kv::request_id id, kv::request_verdict) { (void)ledger.acknowledge(id, 0); });
  std::printf("prefill: freed the source blocks of %zu requests\n", freed);
  return ok && freed == std::size(requests) ? 0 : 1;
}

#endif

#if FERRY_EXAMPLE_UCX

namespace ucx = ferry::ucx;

ucx::worker_options tcp_only() {
  ucx::worker_options o;
  o.transports = "tcp";
  return o;
}

// The prefill process: its KV blocks sit in memory UCX allocated, exposed to whoever connects; it
// frees each request's blocks when decode's notification says the request is released.
int prefill_ucx(const std::vector<load>& plan, int port_out) {
  ferry::progress_executor exec;
  ucx::worker w(exec, tcp_only());
  ucx::memory_region source = w.allocate(plan.size() * block_bytes);
  for (const load& l : plan) fill_block(source.bytes().subspan(l.block * block_bytes, block_bytes), l.block);
  const ucx::memory_region expose[] = {source};
  ucx::listener l = w.listen("127.0.0.1", 0, expose);
  const std::uint16_t port = l.port();
  (void)!::write(port_out, &port, sizeof port);
  ::close(port_out);
  ucx::endpoint decode_side = l.accept(10s);
  std::size_t freed = 0;
  kv::release_ledger ledger([&](kv::transfer_id) { ++freed; });
  for (const request_plan& r : requests) (void)ledger.expect(r.id, 1);
  for (std::size_t n = 0; n < std::size(requests); ++n) {
    std::uint64_t id = 0;
    if (decode_side.receive_notification(id, 10s).wait() != ferry::transfer_state::success) break;
    (void)ledger.acknowledge(id, 0);
  }
  std::printf("prefill: exposed %zu blocks; freed the source blocks of %zu requests\n", plan.size(),
              freed);
  return freed == std::size(requests) ? 0 : 1;
}

int run_ucx(const std::vector<load>& plan) {
  int pipe_fds[2];
  if (::pipe(pipe_fds) != 0) return 1;
  std::fflush(stdout);
  const pid_t child = ::fork();  // before either process starts a thread
  if (child < 0) return 1;
  if (child == 0) {
    ::close(pipe_fds[0]);
    const int rc = prefill_ucx(plan, pipe_fds[1]);
    std::fflush(stdout);
    std::_Exit(rc);
  }
  ::close(pipe_fds[1]);
  std::uint16_t port = 0;
  const bool got_port = ::read(pipe_fds[0], &port, sizeof port) == sizeof port;
  ::close(pipe_fds[0]);
  bool ok = false;
  if (got_port) {
    std::printf("decode: prefill is process %d, over UCX (tcp) on 127.0.0.1:%u\n",
                static_cast<int>(child), static_cast<unsigned>(port));
    ferry::progress_executor exec;
    ucx::worker w(exec, tcp_only());
    ucx::endpoint prefill_side = w.connect("127.0.0.1", port, {}, 10s);
    const ucx::remote_memory remote = prefill_side.peer_regions().at(0);
    std::vector<ferry::transfer> releases;
    ok = decode(
        exec, plan,
        [&](const load& l, std::span<std::byte> dst) {
          // Each get holds its registration until it ends.
          const ucx::memory_region r = w.register_memory(dst);
          return prefill_side.get(r.slice(0, dst.size()),
                                  remote.slice(l.block * block_bytes, block_bytes), 10s);
        },
        [&](kv::request_id id, kv::request_verdict) {
          releases.push_back(prefill_side.send_notification(id, 10s));
        });
    ok = ferry::drain(releases, 10s).ok() && ok;
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  return ok && WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
}

#endif

}  // namespace

int main(int argc, char** argv) {
  const std::vector<load> plan = plan_step();
  const bool over_ucx = argc > 1 && std::string(argv[1]) == "--ucx";
  if (argc > 2 || (argc == 2 && !over_ucx)) {
    std::fprintf(stderr, "usage: %s [--ucx]\n", argv[0]);
    return 2;
  }
  std::printf("decode: %zu requests x %zu layers, %zu KV loads of %zu KiB\n", std::size(requests),
              layers, plan.size(), block_bytes >> 10);
  if (over_ucx) {
#if FERRY_EXAMPLE_UCX
    return run_ucx(plan);
#else
    std::fprintf(stderr, "%s: built without the UCX backend (Debian: libucx-dev)\n", argv[0]);
    return 2;
#endif
  }
  return run(plan);
}

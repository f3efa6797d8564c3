// A decode engine loading a step's KV cache from a prefill process, layer by layer, saying what it
// does as it goes and checking, at the end, each promise of the kv layer it relies on.
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
// What it prints: what is about to happen, then the step's events from both processes in the order
// they happened, then each promise and whether it held. Each process logs its events with the time
// on one clock (steady_clock is CLOCK_MONOTONIC, which a forked child shares with its parent); only
// decode prints, once the step is over: prefill hands its log back through a pipe, and the two logs
// are merged in time order. So the order of the lines is the order of the events whether stdout is
// a terminal, a file or a pipe.
//
// Exit status 0 when every outcome is the expected one and every promise held.

#include <algorithm>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <map>
#include <span>
#include <string>
#include <vector>

#include <ferry/ferry.hpp>
#include <ferry/testing.hpp>
#include <ferry/kv.hpp>

#if FERRY_EXAMPLE_URING || FERRY_EXAMPLE_UCX
#include <sys/wait.h>
#include <unistd.h>
#endif

#if FERRY_EXAMPLE_URING
#include <ferry/uring/tcp.hpp>
#endif

#if FERRY_EXAMPLE_UCX
#include <ferry/ucx.hpp>
#endif

using namespace std::chrono_literals;
namespace kv = ferry::kv;

namespace {

constexpr std::size_t layers = 32;
constexpr std::size_t block_bytes = 16 << 10;
constexpr std::size_t failing_attention_layer = 11;
constexpr std::size_t failing_kda_layer = 7;  // layer 7 is a KDA layer (7 % 4 == 3)
constexpr auto layer_deadline = 10s;

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

const request_plan& plan_of(kv::request_id id) {
  for (const request_plan& r : requests) {
    if (r.id == id) return r;
  }
  return requests[0];
}

const char* part_name(const load& l) {
  if (!is_kda(plan_of(l.request), l.layer)) return "attention block";
  return l.part == 0 ? "conv state" : "ssm state";
}

std::size_t loads_of(const std::vector<load>& plan, kv::request_id id) {
  return static_cast<std::size_t>(
      std::count_if(plan.begin(), plan.end(), [&](const load& l) { return l.request == id; }));
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

// ---- The log ----

// Set in main before anything else; prefill, forked later, inherits it.
std::chrono::steady_clock::time_point start_time;

double ms_now() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start_time)
      .count();
}

struct event {
  double ms;
  std::string who;   // "decode" or "prefill"
  std::string text;  // one line
};

std::vector<event> events;  // this process's log

void log_event(const char* who, const char* format, va_list args) {
  const double ms = ms_now();
  char text[512];
  std::vsnprintf(text, sizeof text, format, args);
  events.push_back({ms, who, text});
}

[[gnu::format(printf, 1, 2)]] void decode_log(const char* format, ...) {
  va_list args;
  va_start(args, format);
  log_event("decode", format, args);
  va_end(args);
}

[[gnu::format(printf, 1, 2)]] void prefill_log(const char* format, ...) {
  va_list args;
  va_start(args, format);
  log_event("prefill", format, args);
  va_end(args);
}

// When prefill freed a request's source blocks.
struct freed_request {
  double ms = 0;
  std::size_t blocks = 0;
};

// What prefill hands back: its log and what it freed.
struct prefill_report {
  bool received = false;  // false: prefill never reported (it failed before it could)
  std::vector<event> events;
  std::map<kv::request_id, freed_request> freed;
};

// ---- The decode engine ----

struct release_record {
  double ms = 0;
  std::size_t count = 0;         // releases of this request (the promise: exactly one)
  std::size_t loads = 0;         // the request's loads
  std::size_t not_ended = 0;     // of those, not yet terminal when it was released
  std::string verdict;
};

struct failed_layer {
  std::size_t layer;
  double gap_ms;  // after the wait before it returned (after the forward pass began, for layer 0)
  ferry::verdict verdict;
};

// What a layer's wait is timed from: the wait before it, or the start of the forward pass.
std::string timed_from(std::size_t layer) {
  if (layer == 0) return "the forward pass began";
  return "layer " + std::to_string(layer - 1) + "'s";
}

struct outcome {
  std::map<kv::request_id, std::string> released;  // verdict, " (aborted)" where aborted
  std::map<kv::request_id, release_record> releases;
  std::vector<kv::block_id> recompute;
  bool recompute_again_empty = false;
  std::vector<kv::request_id> aborted;
  std::vector<failed_layer> failed_layers;
  std::size_t raises = 0;
  bool raise_changed_nothing = true;  // tracked and released the same before and after each raise
  std::size_t blocks_checked = 0;
  bool bytes_ok = true;
};

class decode_engine {
 public:
  // post(load, dst) starts one load into `dst`; release(id) tells the producer.
  template <class Post, class Release>
  decode_engine(ferry::progress_executor& exec, const std::vector<load>& plan, Post post,
                Release release, const char* how)
      : plan_(plan),
        kv_(plan.size() * block_bytes),
        tracker_([this, release](kv::request_id id, kv::request_verdict v) {
          on_release(id, v);
          release(id, v);
        }),
        injector_(exec, ferry::fault_profile{.failure_rate = 1.0}) {
    tracker_.begin_step();
    std::map<kv::request_id, kv::load_tracker::request_handle> handles;
    for (const request_plan& r : requests) {
      handles.emplace(r.id, tracker_.add_request(r.id, kv::request_options{.hybrid = r.hybrid}));
    }
    std::size_t wrapped = 0;
    for (const load& l : plan_) {
      ferry::transfer t = post(l, block(l.block));
      if (l.inject_failure) {
        t = injector_.wrap(std::move(t));  // the data moves; the load "fails"
        ++wrapped;
      }
      const kv::block_id dst[] = {l.block};
      tracker_.add(handles.at(l.request), l.layer, std::move(t), dst);
    }
    for (auto& [id, h] : handles) tracker_.seal(h);
    decode_log("posted %zu loads, %s; %zu wrapped by the fault injector", plan_.size(), how,
               wrapped);
  }

  // The forward pass: layer L computes as soon as its loads are in, while L+1... stream in.
  ferry::task<outcome> forward_pass() {
    std::map<kv::request_id, bool> broken;
    double previous_ms = ms_now();
    for (std::size_t layer = 0; layer < layers; ++layer) {
      const ferry::batch_result r = co_await tracker_.when_layer(layer, layer_deadline);
      const double now = ms_now();
      const double gap = now - previous_ms;
      previous_ms = now;
      const std::size_t later = in_flight_after(layer);
      if (!r.ok()) {
        out_.failed_layers.push_back({layer, gap, r.verdict});
        decode_log("layer %2zu FAILED: its wait returned '%s' %.2f ms after %s (deadline %lld s)",
                   layer, ferry::to_string(r.verdict), gap, timed_from(layer).c_str(),
                   static_cast<long long>(std::chrono::seconds(layer_deadline).count()));
        // Failed as soon as any member failed; let its siblings finish before looking at them.
        (void)ferry::drain(tracker_.layer_transfers(layer), layer_deadline);
        for (std::size_t i = 0; i < plan_.size(); ++i) {
          const load& l = plan_[i];
          if (l.layer != layer) continue;
          const ferry::transfer& t = transfer_of(i);
          if (t.state() != ferry::transfer_state::success) {
            decode_log("  failed: request %llu, layer %zu, %s (%s)",
                       static_cast<unsigned long long>(l.request), l.layer, part_name(l),
                       t.error().message().c_str());
            broken[l.request] = true;
          }
        }
      } else if (layer % 4 == 0 || layer + 1 == layers) {
        decode_log("layer %2zu loaded for every request, computed; %3zu later loads still running",
                   layer, later);
      }
      // "Compute" the layer for every request whose loads so far are good.
      for (const load& l : plan_) {
        if (l.layer != layer || broken[l.request]) continue;
        ++out_.blocks_checked;
        if (!check_block(block(l.block), l.block)) out_.bytes_ok = false;
      }
    }
    decode_log("forward pass over all %zu layers done; take_finished hands back finished requests",
               layers);
    // Hand back finished requests; a hybrid one that failed raises before anything changes.
    for (;;) {
      const std::size_t tracked_before = tracker_.tracked();
      const std::size_t released_before = released_count_;
      try {
        for (const kv::finished_request& f : tracker_.take_finished()) {
          out_.released[f.id] = std::string(kv::to_string(f.verdict)) + (f.aborted ? " (aborted)" : "");
        }
        if (tracker_.tracked() == 0) break;
        (void)tracker_.drain_step(layer_deadline);
      } catch (const kv::transfer_error& e) {
        ++out_.raises;
        const bool unchanged =
            tracker_.tracked() == tracked_before && released_count_ == released_before;
        out_.raise_changed_nothing = out_.raise_changed_nothing && unchanged;
        decode_log("take_finished raised kv::transfer_error: hybrid request %llu, layer %zu %s",
                   static_cast<unsigned long long>(e.request()), e.layer(),
                   e.timed_out() ? "timed out" : "failed");
        decode_log("  %s: %zu requests still tracked, %zu released; decode aborts request %llu",
                   unchanged ? "nothing changed" : "SOMETHING CHANGED", tracker_.tracked(),
                   released_count_, static_cast<unsigned long long>(e.request()));
        tracker_.abort_request(e.request());
        out_.aborted.push_back(e.request());
      }
    }
    out_.recompute = tracker_.drain_failed_blocks();
    out_.recompute_again_empty = tracker_.drain_failed_blocks().empty();
    std::string blocks;
    for (kv::block_id b : out_.recompute) {
      for (const load& l : plan_) {
        if (l.block != b) continue;
        char one[96];
        std::snprintf(one, sizeof one, "%s%llu (request %llu, layer %zu)",
                      blocks.empty() ? "" : ", ", static_cast<unsigned long long>(b),
                      static_cast<unsigned long long>(l.request), l.layer);
        blocks += one;
      }
    }
    decode_log("blocks to recompute: %s; asking again returns %s",
               blocks.empty() ? "none" : blocks.c_str(),
               out_.recompute_again_empty ? "none" : "SOME AGAIN");
    co_return out_;
  }

 private:
  // The tracker is about to tell prefill that request `id` is released: note whether every one of
  // its loads has ended, and how many times it has been released.
  void on_release(kv::request_id id, kv::request_verdict v) {
    release_record& r = out_.releases[id];
    r.ms = ms_now();
    ++r.count;
    ++released_count_;
    r.loads = 0;
    r.not_ended = 0;
    for (std::size_t i = 0; i < plan_.size(); ++i) {
      if (plan_[i].request != id) continue;
      ++r.loads;
      r.not_ended += transfer_of(i).done() ? 0 : 1;
    }
    r.verdict = kv::to_string(v);
    if (std::find(out_.aborted.begin(), out_.aborted.end(), id) != out_.aborted.end()) {
      r.verdict += ", aborted";
    }
    decode_log("released request %llu to prefill (%s): %zu of its %zu loads had ended",
               static_cast<unsigned long long>(id), r.verdict.c_str(), r.loads - r.not_ended,
               r.loads);
  }

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
  outcome out_;
  std::size_t released_count_ = 0;
  kv::load_tracker tracker_;
  ferry::fault_injector injector_;
};

// Runs the decode engine on this thread's run_loop.
template <class Post, class Release>
outcome decode(ferry::progress_executor& exec, const std::vector<load>& plan, Post post,
               Release release, const char* how) {
  decode_engine engine(exec, plan, post, release, how);
  ferry::run_loop engine_loop;  // the engine's own scheduler, driven by this thread
  return ferry::sync_wait(engine_loop, engine.forward_pass());
}

// What a run hands back to be printed.
struct step_result {
  outcome decode;
  prefill_report prefill;
  bool transport_ok = true;  // the connection, the release messages, prefill's exit status
};

// ---- Prefill in a process of its own: its report travels back through a pipe ----

#if FERRY_EXAMPLE_URING || FERRY_EXAMPLE_UCX

// One line per event ("E ms who text") and per freed request ("F id ms blocks").
void write_report(int fd, const prefill_report& r) {
  std::string out;
  char line[640];
  for (const event& e : r.events) {
    std::snprintf(line, sizeof line, "E %.6f %s %s\n", e.ms, e.who.c_str(), e.text.c_str());
    out += line;
  }
  for (const auto& [id, f] : r.freed) {
    std::snprintf(line, sizeof line, "F %llu %.6f %zu\n", static_cast<unsigned long long>(id), f.ms,
                  f.blocks);
    out += line;
  }
  for (std::size_t done = 0; done < out.size();) {
    const ssize_t n = ::write(fd, out.data() + done, out.size() - done);
    if (n <= 0) break;
    done += static_cast<std::size_t>(n);
  }
}

// Reads until prefill closes its end (it exits).
prefill_report read_report(int fd) {
  std::string in;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n <= 0) break;
    in.append(buf, static_cast<std::size_t>(n));
  }
  prefill_report r;
  std::size_t at = 0;
  while (at < in.size()) {
    const std::size_t end = std::min(in.find('\n', at), in.size());
    const std::string line = in.substr(at, end - at);
    at = end + 1;
    r.received = true;
    if (line.rfind("E ", 0) == 0) {
      char* rest = nullptr;
      const double ms = std::strtod(line.c_str() + 2, &rest);
      std::string tail = rest != nullptr ? std::string(rest) : std::string();
      if (!tail.empty() && tail.front() == ' ') tail.erase(0, 1);
      const std::size_t space = tail.find(' ');
      r.events.push_back({ms, tail.substr(0, space),
                          space == std::string::npos ? std::string() : tail.substr(space + 1)});
    } else if (line.rfind("F ", 0) == 0) {
      unsigned long long id = 0;
      double ms = 0;
      std::size_t blocks = 0;
      if (std::sscanf(line.c_str(), "F %llu %lf %zu", &id, &ms, &blocks) == 3) {
        r.freed[id] = {ms, blocks};
      }
    }
  }
  return r;
}

// Runs `body` (prefill) in a child process that reports through a pipe, and `parent(child_pid)`
// (decode) here. Forks before either process starts a thread.
template <class Child, class Parent>
step_result in_two_processes(Child body, Parent parent) {
  step_result result;
  int report[2];
  if (::pipe(report) != 0) {
    result.transport_ok = false;
    return result;
  }
  std::fflush(stdout);
  const pid_t child = ::fork();
  if (child < 0) {
    result.transport_ok = false;
    return result;
  }
  if (child == 0) {
    ::close(report[0]);
    events.clear();
    prefill_report mine;
    int rc = 1;
    try {
      rc = body(mine);
    } catch (const std::exception& e) {
      prefill_log("failed: %s", e.what());
    }
    mine.events = events;
    write_report(report[1], mine);
    ::close(report[1]);
    std::_Exit(rc);
  }
  ::close(report[1]);
  result.transport_ok = parent(child, result.decode);
  result.prefill = read_report(report[0]);
  ::close(report[0]);
  int status = 0;
  ::waitpid(child, &status, 0);
  result.transport_ok = result.transport_ok && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  return result;
}

// Prefill's side of the release protocol: a release ledger whose free callback records when each
// request's source blocks were freed.
struct prefill_ledger {
  prefill_report& report;
  const std::vector<load>& plan;
  kv::release_ledger ledger{[this](kv::transfer_id id) {
    const std::size_t blocks = loads_of(plan, id);
    report.freed[id] = {ms_now(), blocks};
    prefill_log("decode's release of request %llu arrived: the release ledger freed its %zu source "
                "blocks",
                static_cast<unsigned long long>(id), blocks);
  }};

  prefill_ledger(prefill_report& r, const std::vector<load>& p) : report(r), plan(p) {
    for (const request_plan& q : requests) (void)ledger.expect(q.id, 1);  // one decode rank
  }
};

#endif

#if FERRY_EXAMPLE_URING

namespace uring = ferry::uring;

// The prefill process: sends every block in plan order, then frees each request's source blocks
// once the decode side has released it.
int prefill(const std::vector<load>& plan, std::uint16_t port, prefill_report& report) {
  ferry::progress_executor exec;
  uring::ring ring(exec);
  uring::tcp_connection conn = uring::tcp_connection::connect(ring, "127.0.0.1", port);
  prefill_log("connected to decode; writing and sending %zu blocks, layer 0 of every request "
              "first",
              plan.size());
  std::vector<std::byte> source(plan.size() * block_bytes);
  std::vector<ferry::transfer> sends;
  prefill_ledger ledger(report, plan);
  for (const load& l : plan) {
    const std::span<std::byte> b(source.data() + l.block * block_bytes, block_bytes);
    fill_block(b, l.block);
    sends.push_back(conn.send(l.block, b));
  }
  prefill_log("posted the last of the %zu sends", plan.size());
  const ferry::batch_result sent = ferry::drain(sends, 10s);
  if (sent.ok()) {
    prefill_log("saw all %zu sends done (the kernel had taken every block's bytes)", sends.size());
  } else {
    prefill_log("sends did not all succeed: %s", ferry::to_string(sent.verdict));
  }
  // Releases come back on the same connection as empty blocks whose id is the request.
  std::byte none[1];
  for (std::size_t n = 0; n < std::size(requests); ++n) {
    uring::received_block got;
    if (conn.receive(std::span(none, 0), got).wait() != ferry::transfer_state::success) break;
    (void)ledger.ledger.acknowledge(got.id, 0);
  }
  return sent.ok() && report.freed.size() == std::size(requests) ? 0 : 1;
}

step_result run(const std::vector<load>& plan) {
  uring::tcp_listener listener("127.0.0.1", 0);
  const std::uint16_t port = listener.port();
  return in_two_processes(
      [&](prefill_report& report) { return prefill(plan, port, report); },
      [&](pid_t child, outcome& out) {
        ferry::progress_executor exec;
        uring::ring ring(exec);
        uring::tcp_connection conn = listener.accept(ring);
        decode_log("prefill (process %d) connected over TCP 127.0.0.1:%u, through io_uring",
                   static_cast<int>(child), static_cast<unsigned>(port));
        std::vector<uring::received_block> got(plan.size());
        std::vector<ferry::transfer> releases;
        out = decode(
            exec, plan,
            [&](const load& l, std::span<std::byte> dst) { return conn.receive(dst, got[l.block]); },
            [&](kv::request_id id, kv::request_verdict) { releases.push_back(conn.send(id, {})); },
            "an io_uring TCP receive each");
        return ferry::drain(releases, 10s).ok();
      });
}

constexpr bool prefill_in_a_process = true;

// How the blocks travel, for the introduction.
std::string transport_text() {
  char text[512];
  std::snprintf(text, sizeof text,
                "  Prefill (a child process) has computed the KV cache of %zu requests x %zu model "
                "layers and\n  sends it over TCP on 127.0.0.1 through io_uring; decode (this "
                "process) receives each block\n  into its own memory as one ferry transfer, "
                "tracked per request and per layer by\n  ferry::kv::load_tracker.\n",
                std::size(requests), layers);
  return text;
}

#else

// Without io_uring, "prefill" is this process's memory and the loads are loopback copies.
step_result run(const std::vector<load>& plan) {
  step_result result;
  std::vector<std::byte> source(plan.size() * block_bytes);
  for (const load& l : plan) fill_block({source.data() + l.block * block_bytes, block_bytes}, l.block);
  kv::release_ledger ledger([&](kv::transfer_id id) {
    const std::size_t blocks = loads_of(plan, id);
    result.prefill.freed[id] = {ms_now(), blocks};
    prefill_log("decode's release of request %llu arrived: the release ledger freed its %zu source "
                "blocks",
                static_cast<unsigned long long>(id), blocks);
  });
  for (const request_plan& r : requests) (void)ledger.expect(r.id, 1);
  result.prefill.received = true;
  ferry::progress_executor exec;
  ferry::loopback_backend lb(exec);
  result.decode = decode(
      exec, plan,
      [&](const load& l, std::span<std::byte> dst) {
        return lb.copy(dst, std::span<const std::byte>(source.data() + l.block * block_bytes,
                                                       block_bytes));
      },
      [&](kv::request_id id, kv::request_verdict) { (void)ledger.acknowledge(id, 0); },
      "a loopback copy each");
  return result;
}

constexpr bool prefill_in_a_process = false;

// How the blocks travel, for the introduction.
std::string transport_text() {
  char text[512];
  std::snprintf(text, sizeof text,
                "  Prefill has computed the KV cache of %zu requests x %zu model layers. Built "
                "without\n  io_uring, its blocks sit in this process and loopback copies stand "
                "in for the network:\n  decode copies each block into its own memory as one ferry "
                "transfer, tracked per request\n  and per layer by ferry::kv::load_tracker.\n",
                std::size(requests), layers);
  return text;
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
int prefill_ucx(const std::vector<load>& plan, int port_out, prefill_report& report) {
  ferry::progress_executor exec;
  ucx::worker w(exec, tcp_only());
  ucx::memory_region source = w.allocate(plan.size() * block_bytes);
  for (const load& l : plan) fill_block(source.bytes().subspan(l.block * block_bytes, block_bytes), l.block);
  const ucx::memory_region expose[] = {source};
  ucx::listener l = w.listen("127.0.0.1", 0, expose);
  const std::uint16_t port = l.port();
  prefill_log("wrote all %zu blocks into memory registered with UCX, exposed on 127.0.0.1:%u",
              plan.size(), static_cast<unsigned>(port));
  (void)!::write(port_out, &port, sizeof port);
  ::close(port_out);
  ucx::endpoint decode_side = l.accept(10s);
  prefill_log("decode connected; it reads the blocks itself, prefill only waits for releases");
  prefill_ledger ledger(report, plan);
  for (std::size_t n = 0; n < std::size(requests); ++n) {
    std::uint64_t id = 0;
    if (decode_side.receive_notification(id, 10s).wait() != ferry::transfer_state::success) break;
    (void)ledger.ledger.acknowledge(id, 0);
  }
  return report.freed.size() == std::size(requests) ? 0 : 1;
}

step_result run_ucx(const std::vector<load>& plan) {
  int port_pipe[2];
  if (::pipe(port_pipe) != 0) {
    step_result failed;
    failed.transport_ok = false;
    return failed;
  }
  return in_two_processes(
      [&](prefill_report& report) {
        ::close(port_pipe[0]);
        return prefill_ucx(plan, port_pipe[1], report);
      },
      [&](pid_t child, outcome& out) {
        ::close(port_pipe[1]);
        std::uint16_t port = 0;
        const bool got_port = ::read(port_pipe[0], &port, sizeof port) == sizeof port;
        ::close(port_pipe[0]);
        if (!got_port) return false;
        ferry::progress_executor exec;
        ucx::worker w(exec, tcp_only());
        ucx::endpoint prefill_side = w.connect("127.0.0.1", port, {}, 10s);
        decode_log("connected to prefill (process %d) over UCX (tcp) on 127.0.0.1:%u",
                   static_cast<int>(child), static_cast<unsigned>(port));
        const ucx::remote_memory remote = prefill_side.peer_regions().at(0);
        std::vector<ferry::transfer> releases;
        out = decode(
            exec, plan,
            [&](const load& l, std::span<std::byte> dst) {
              // Each get holds its registration until it ends.
              const ucx::memory_region r = w.register_memory(dst);
              return prefill_side.get(r.slice(0, dst.size()),
                                      remote.slice(l.block * block_bytes, block_bytes), 10s);
            },
            [&](kv::request_id id, kv::request_verdict) {
              releases.push_back(prefill_side.send_notification(id, 10s));
            },
            "a one-sided UCX get each");
        return ferry::drain(releases, 10s).ok();
      });
}

// How the blocks travel, for the introduction.
std::string ucx_transport_text() {
  char text[512];
  std::snprintf(text, sizeof text,
                "  Prefill (a child process) has computed the KV cache of %zu requests x %zu model "
                "layers and\n  exposes it through UCX; decode (this process) reads each block into "
                "its own memory with\n  a one-sided UCX get over tcp on 127.0.0.1, as one ferry "
                "transfer, tracked per request and\n  per layer by ferry::kv::load_tracker.\n",
                std::size(requests), layers);
  return text;
}

#endif

// ---- What is printed ----

// `transport` is one of the transport_text()s above; `two_processes` whether prefill runs in a
// process of its own.
void print_intro(const std::vector<load>& plan, const std::string& transport, bool two_processes) {
  const std::size_t n = std::size(requests);
  std::string hybrid;
  std::size_t hybrids = 0;
  for (const request_plan& r : requests) {
    if (!r.hybrid) continue;
    hybrid += (hybrid.empty() ? "" : " and ") + std::to_string(r.id);
    ++hybrids;
  }
  std::vector<std::size_t> kda;
  for (std::size_t layer = 0; layer < layers; ++layer) {
    if (is_kda({0, true, false}, layer)) kda.push_back(layer);
  }
  std::printf("ferry demo: one step of an LLM server's decode engine, loading KV cache from "
              "prefill.\n");
  std::printf("%s", transport.c_str());
  std::printf("  Where \"%zu KV loads\" comes from: one %zu KiB block per request and layer (%zu x "
              "%zu = %zu),\n  plus %zu: request%s %s %s hybrid, and %zu of %s layers (%zu, %zu, "
              "..., %zu) are KDA layers,\n  which load two blocks, conv state and ssm state, "
              "instead of one.\n",
              plan.size(), block_bytes >> 10, n, layers, n * layers, plan.size() - n * layers,
              hybrids == 1 ? "" : "s", hybrid.c_str(), hybrids == 1 ? "is" : "are", kda.size(),
              hybrids == 1 ? "its" : "their", kda[0], kda[1], kda.back());
  std::printf("  Decode computes each layer, for every request, as soon as that layer's loads are "
              "in; later\n  layers may still be loading then (the timeline counts them). A "
              "request with a failed load\n  is not computed further.\n");
  std::printf("  Two loads fail on purpose (ferry::fault_injector: the bytes arrive, the load "
              "reports a failure):\n");
  for (const request_plan& r : requests) {
    if (!r.fail) continue;
    if (r.hybrid) {
      std::printf("    request %llu, layer %zu, ssm state (hybrid): recurrent state cannot be "
                  "recomputed from a\n      prefix, so kv::transfer_error is expected; decode then "
                  "aborts request %llu\n",
                  static_cast<unsigned long long>(r.id), failing_kda_layer,
                  static_cast<unsigned long long>(r.id));
    } else {
      std::printf("    request %llu, layer %zu (attention only): its block is expected to be "
                  "reported for recompute\n",
                  static_cast<unsigned long long>(r.id), failing_attention_layer);
    }
  }
  std::printf("  The kv layer's promises, checked at the end:\n"
              "    1. a failure is noticed at once: a layer's wait returns on it, not at its "
              "deadline\n"
              "    2. a request is released to prefill once, and only when every one of its loads "
              "has ended\n"
              "    3. a failed attention request's blocks are reported for recompute, once\n"
              "    4. a failed hybrid request raises kv::transfer_error before anything changes\n"
              "    5. prefill frees a request's source blocks only after decode has released it\n");
  std::printf("\nWhat happened, in time order (ms since the start%s;\nevery 4th layer, the last "
              "and every failure shown; printed when the step is over):\n",
              two_processes ? ", on one clock for both processes" : "");
}

void print_timeline(const step_result& r) {
  std::vector<event> all = events;
  all.insert(all.end(), r.prefill.events.begin(), r.prefill.events.end());
  std::stable_sort(all.begin(), all.end(),
                   [](const event& a, const event& b) { return a.ms < b.ms; });
  for (const event& e : all) {
    std::printf("%8.2f  %-7s  %s\n", e.ms, e.who.c_str(), e.text.c_str());
  }
  if (!r.prefill.received) std::printf("          prefill  sent no report: it failed early\n");
}

// What each request's release should say: the verdict, " (aborted)" where decode aborts it.
std::string expected_release(const request_plan& r) {
  if (!r.fail) return "success";
  return r.hybrid ? "failed (aborted)" : "failed";
}

// Prints each promise and whether it held; returns whether every outcome is the expected one.
bool print_summary(const std::vector<load>& plan, const step_result& r) {
  const outcome& out = r.decode;
  std::printf("\nWhat the run showed:\n");
  bool all_held = true;
  const auto line = [&](bool held, const std::string& text) {
    all_held = all_held && held;
    std::printf("  %-8s %s\n", held ? "held" : "NOT HELD", text.c_str());
  };
  char buf[512];
  // The loads made to fail, and which requests they belong to.
  std::vector<std::size_t> failing_layers;
  std::vector<kv::block_id> expected_recompute;
  std::vector<kv::request_id> expected_aborted;
  std::string recompute_where;
  for (const load& l : plan) {
    if (!l.inject_failure) continue;
    failing_layers.push_back(l.layer);
    if (plan_of(l.request).hybrid) {
      expected_aborted.push_back(l.request);
    } else {
      expected_recompute.push_back(l.block);
      std::snprintf(buf, sizeof buf, "%srequest %llu, layer %zu",
                    recompute_where.empty() ? "" : "; ", static_cast<unsigned long long>(l.request),
                    l.layer);
      recompute_where += buf;
    }
  }
  std::sort(failing_layers.begin(), failing_layers.end());

  // 1. The failed layers are those with an injected failure, each reported failed, not timed out.
  bool noticed = out.failed_layers.size() == failing_layers.size();
  std::string gaps;
  for (std::size_t i = 0; i < out.failed_layers.size(); ++i) {
    const failed_layer& f = out.failed_layers[i];
    noticed = noticed && f.verdict == ferry::verdict::failed && f.layer == failing_layers[i];
    if (gaps.empty()) {
      std::snprintf(buf, sizeof buf, "layer %zu's wait returned '%s'\n           %.2f ms after %s",
                    f.layer, ferry::to_string(f.verdict), f.gap_ms, timed_from(f.layer).c_str());
    } else {
      std::snprintf(buf, sizeof buf, ", layer %zu's '%s' %.2f ms after %s", f.layer,
                    ferry::to_string(f.verdict), f.gap_ms, timed_from(f.layer).c_str());
    }
    gaps += buf;
  }
  std::snprintf(buf, sizeof buf, "1. failures noticed at once, not at the %lld s deadline: %s",
                static_cast<long long>(std::chrono::seconds(layer_deadline).count()),
                gaps.empty() ? "no layer failed" : gaps.c_str());
  line(noticed, buf);

  // 2. One release per request, each with every load ended.
  bool once = out.releases.size() == std::size(requests);
  std::size_t not_ended = 0;
  for (const auto& [id, rel] : out.releases) {
    once = once && rel.count == 1;
    not_ended += rel.not_ended;
  }
  std::snprintf(buf, sizeof buf,
                "2. released once, when every load had ended: %zu of %zu requests released, %s;\n"
                "           %zu loads still running at any release",
                out.releases.size(), std::size(requests),
                once ? "each exactly once" : "NOT EACH EXACTLY ONCE", not_ended);
  line(once && not_ended == 0, buf);

  // 3. Exactly the failed attention loads' blocks, and only once.
  std::string blocks;
  for (kv::block_id b : out.recompute) blocks += (blocks.empty() ? "" : ", ") + std::to_string(b);
  std::snprintf(buf, sizeof buf,
                "3. recompute reported once: block %s (the failed load: %s);\n           asking "
                "again returned %s",
                blocks.empty() ? "none" : blocks.c_str(), recompute_where.c_str(),
                out.recompute_again_empty ? "none" : "some again");
  line(out.recompute == expected_recompute && out.recompute_again_empty, buf);

  // 4. The hybrid failure raised, changed nothing, and the aborted request was then released.
  std::string aborted_text;
  bool aborted_released = !expected_aborted.empty();
  for (kv::request_id id : expected_aborted) {
    const auto it = out.released.find(id);
    aborted_released =
        aborted_released && it != out.released.end() && it->second == "failed (aborted)";
    aborted_text += (aborted_text.empty() ? "" : ", ") +
                    ("request " + std::to_string(id) + " as " +
                     (it == out.released.end() ? std::string("nothing") : it->second));
  }
  std::snprintf(buf, sizeof buf,
                "4. kv::transfer_error raised %s for the failed hybrid request, %s;\n           "
                "aborted, it was released: %s",
                out.raises == 1 ? "once" : (std::to_string(out.raises) + " times").c_str(),
                out.raise_changed_nothing ? "with nothing changed" : "AFTER A CHANGE",
                aborted_text.empty() ? "none" : aborted_text.c_str());
  line(out.raises >= 1 && out.raise_changed_nothing && aborted_released &&
           out.aborted == expected_aborted,
       buf);

  // 5. Prefill freed every request's blocks, each after decode released it (one clock).
  bool after = r.prefill.freed.size() == std::size(requests);
  double least = 1e300, most = 0;
  for (const auto& [id, f] : r.prefill.freed) {
    const auto rel = out.releases.find(id);
    if (rel == out.releases.end()) {
      after = false;
      continue;
    }
    const double lag = f.ms - rel->second.ms;
    after = after && lag >= 0;
    least = std::min(least, lag);
    most = std::max(most, lag);
  }
  if (r.prefill.freed.empty()) least = most = 0;
  std::snprintf(buf, sizeof buf,
                "5. prefill freed blocks only after their release: %zu of %zu requests, each "
                "%.2f-%.2f ms after\n           decode released it",
                r.prefill.freed.size(), std::size(requests), least, most);
  line(after, buf);

  std::snprintf(buf, sizeof buf,
                "and each of the %zu blocks decode computed with held the bytes prefill wrote",
                out.blocks_checked);
  line(out.bytes_ok, buf);

  bool expected = out.released.size() == std::size(requests);
  std::string verdicts;
  for (const request_plan& q : requests) {
    const auto it = out.released.find(q.id);
    const std::string got = it == out.released.end() ? std::string("not released") : it->second;
    expected = expected && got == expected_release(q);
    verdicts += (verdicts.empty() ? "" : ", ") + ("request " + std::to_string(q.id) + " " + got);
  }
  const bool ok = expected && all_held && r.transport_ok;
  std::printf("%s: %s\n", ok ? "every outcome as expected" : "UNEXPECTED OUTCOME",
              verdicts.c_str());
  if (!r.transport_ok) {
    std::printf("(the connection, the release messages or the prefill process failed)\n");
  }
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  start_time = std::chrono::steady_clock::now();
  const std::vector<load> plan = plan_step();
  const bool over_ucx = argc > 1 && std::string(argv[1]) == "--ucx";
  if (argc > 2 || (argc == 2 && !over_ucx)) {
    std::fprintf(stderr, "usage: %s [--ucx]\n", argv[0]);
    return 2;
  }
  // Every line goes out as it is finished, to a file or a pipe as to a terminal.
  std::setvbuf(stdout, nullptr, _IOLBF, BUFSIZ);
  step_result result;
  if (over_ucx) {
#if FERRY_EXAMPLE_UCX
    print_intro(plan, ucx_transport_text(), true);
    result = run_ucx(plan);
#else
    std::fprintf(stderr, "%s: built without the UCX backend (Debian: libucx-dev)\n", argv[0]);
    return 2;
#endif
  } else {
    print_intro(plan, transport_text(), prefill_in_a_process);
    result = run(plan);
  }
  print_timeline(result);
  return print_summary(plan, result) ? 0 : 1;
}

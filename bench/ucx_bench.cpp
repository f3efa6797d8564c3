// ferry's UCX backend against a raw UCP loop on the same transport, in one process. Each run has
// two sides, an initiator and a target: for ferry each side is a ucx::worker on its own
// progress_executor (as two processes would have); for the raw loop one UCP context holds two
// workers, the initiator's progressed by the measuring thread and the target's by a thread of its
// own (over tcp a put is emulated by the target's progress; the thread spins, yielding when idle).
// Both use peer error handling and the settings ferry gives UCX, so both get the same lanes.
//
//   ferry_ucx_bench [--quick] [tcp] [shm]
//
// Over shm the target memory comes from UCX's allocator on both sides: RMA into plain user memory
// is emulated over active messages there, into a UCX segment it is a direct copy.
// CPU time is the whole process's (CLOCK_PROCESS_CPUTIME_ID): the executors' and the raw target's
// progress threads count, as they would in the two processes they stand for.

#include <ucp/api/ucp.h>

#include <time.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <ferry/ferry.hpp>
#include <ferry/ucx.hpp>

namespace ucx = ferry::ucx;

namespace {

using clk = std::chrono::steady_clock;
using namespace std::chrono_literals;

double cpu_seconds() {
  timespec ts{};
  ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

struct config {
  bool quick = false;
  std::vector<std::size_t> sizes;
  std::chrono::milliseconds per_point{1000};
  std::size_t budget = std::size_t{4} << 30;  // bytes per point, whichever of the two ends first
  std::size_t window = 16;
  std::size_t region = std::size_t{64} << 20;
  int latency_ops = 20000;
};

enum class op { put_landed, put_batch_landed, put_reusable, get };

const char* name(op o) {
  switch (o) {
    case op::put_landed: return "put (landed)";
    case op::put_batch_landed: return "put_batch of a window (landed)";
    case op::put_reusable: return "put (source_reusable)";
    case op::get: return "get";
  }
  return "?";
}

struct point {
  double mbps = 0;
  double cpu_us = 0;  // CPU time per operation
  std::size_t ops = 0;
};

point make_point(std::size_t ops, std::size_t block, clk::duration wall, double cpu) {
  const double s = std::chrono::duration<double>(wall).count();
  return {static_cast<double>(ops * block) / s / 1e6, cpu / static_cast<double>(ops) * 1e6, ops};
}

struct latency {
  double median_us = 0;
  double p99_us = 0;
  double cpu_us = 0;
};

latency make_latency(std::vector<double>& us, double cpu) {
  std::sort(us.begin(), us.end());
  const auto at = [&](double q) {
    return us[std::min(us.size() - 1, static_cast<std::size_t>(q * static_cast<double>(us.size())))];
  };
  return {at(0.5), at(0.99), cpu / static_cast<double>(us.size()) * 1e6};
}

double micros(clk::duration d) { return std::chrono::duration<double, std::micro>(d).count(); }

// ---------------------------------------------------------------------------------------- ferry

struct ferry_side {
  explicit ferry_side(const std::string& transports) : worker(exec, options(transports)) {}
  static ucx::worker_options options(const std::string& transports) {
    ucx::worker_options o;
    o.transports = transports;
    return o;
  }
  ferry::progress_executor exec;
  ucx::worker worker;
};

struct ferry_pair {
  ferry_pair(const std::string& transports, std::size_t bytes)
      : initiator(transports), target(transports) {
    to_target = initiator.worker.connect(target.worker.address());
    to_initiator = target.worker.connect(initiator.worker.address());
    local_bytes.assign(bytes, std::byte{1});
    local = initiator.worker.register_memory(local_bytes);
    if (transports == "shm") {
      target_region = target.worker.allocate(bytes);
    } else {
      target_bytes.assign(bytes, std::byte{0});
      target_region = target.worker.register_memory(target_bytes);
    }
    remote = to_target.import(ucx::remote_region::from_bytes(target_region.describe().to_bytes()));
  }
  ferry_side initiator, target;
  ucx::endpoint to_target, to_initiator;
  std::vector<std::byte> local_bytes, target_bytes;
  ucx::memory_region local, target_region;
  ucx::remote_memory remote;
};

void check(ferry::transfer& t, const char* what) {
  (void)t.wait();
  if (t.state() != ferry::transfer_state::success) {
    throw std::runtime_error(std::string("ferry ") + what + ": " + t.error().message());
  }
}

ferry::transfer ferry_post(ferry_pair& p, op o, std::size_t offset, std::size_t n) {
  const ucx::local_slice l = p.local.slice(offset, n);
  const ucx::remote_slice r = p.remote.slice(offset, n);
  switch (o) {
    case op::put_landed:
    case op::put_batch_landed: return p.to_target.put(l, r, 60s);
    case op::put_reusable: return p.to_target.put(l, r, 60s, ucx::put_completion::source_reusable);
    case op::get: return p.to_target.get(l, r, 60s);
  }
  throw std::logic_error("op");
}

// A sliding window: the oldest request is waited for and replaced while time and budget last. A
// batch is a window at a time, flushed once, as the raw loop's landed puts are.
point ferry_bandwidth(ferry_pair& p, op o, std::size_t block, const config& c) {
  const std::size_t slots = c.region / block;
  std::vector<ferry::transfer> ring(c.window);
  const auto t0 = clk::now();
  const double c0 = cpu_seconds();
  const auto end = t0 + c.per_point;
  std::size_t posted = 0, done = 0;
  if (o == op::put_batch_landed) {
    std::vector<ucx::rma_block> blocks(c.window);
    do {
      for (std::size_t i = 0; i < c.window; ++i, ++posted) {
        const std::size_t off = (posted % slots) * block;
        blocks[i] = {p.local.slice(off, block), p.remote.slice(off, block)};
      }
      p.to_target.put_batch(blocks, ring, 60s, ucx::put_completion::landed);
      for (ferry::transfer& t : ring) check(t, name(o));
      done = posted;
    } while ((posted + c.window) * block <= c.budget && clk::now() < end);
    return make_point(done, block, clk::now() - t0, cpu_seconds() - c0);
  }
  for (; posted < c.window; ++posted) ring[posted] = ferry_post(p, o, (posted % slots) * block, block);
  while (done < posted) {
    check(ring[done % c.window], name(o));
    ++done;
    if ((posted + 1) * block <= c.budget && clk::now() < end) {
      ring[posted % c.window] = ferry_post(p, o, (posted % slots) * block, block);
      ++posted;
    }
  }
  return make_point(done, block, clk::now() - t0, cpu_seconds() - c0);
}

latency ferry_latency(ferry_pair& p, const config& c) {
  std::vector<double> us;
  us.reserve(static_cast<std::size_t>(c.latency_ops));
  const double c0 = cpu_seconds();
  for (int i = 0; i < c.latency_ops; ++i) {
    const auto t0 = clk::now();
    ferry::transfer t = ferry_post(p, op::put_landed, 0, 8);
    check(t, "latency put");
    us.push_back(micros(clk::now() - t0));
  }
  return make_latency(us, cpu_seconds() - c0);
}

// A notification at depth 1: the receiver's wait is posted first; the figure is from the send until
// the sender's transfer has ended (it ends once the receiver holds the notification).
latency ferry_notify_latency(ferry_pair& p, const config& c) {
  std::vector<double> us;
  us.reserve(static_cast<std::size_t>(c.latency_ops));
  const double c0 = cpu_seconds();
  for (int i = 0; i < c.latency_ops; ++i) {
    std::uint64_t v = 0;
    ferry::transfer w = p.to_initiator.receive_notification(v, 60s);
    const auto t0 = clk::now();
    ferry::transfer n = p.to_target.send_notification(static_cast<std::uint64_t>(i), 60s);
    check(n, "notification");
    us.push_back(micros(clk::now() - t0));
    check(w, "notification wait");
  }
  return make_latency(us, cpu_seconds() - c0);
}

// ------------------------------------------------------------------------------------------ raw

void ucs_check(ucs_status_t s, const char* what) {
  if (s != UCS_OK) throw std::runtime_error(std::string(what) + ": " + ::ucs_status_string(s));
}

struct raw_op {
  ucs_status_t status = UCS_INPROGRESS;
  void* request = nullptr;
};

void on_raw_done(void*, ucs_status_t status, void* user) { static_cast<raw_op*>(user)->status = status; }

void on_raw_error(void*, ucp_ep_h, ucs_status_t status) {
  std::fprintf(stderr, "raw UCP endpoint error: %s\n", ::ucs_status_string(status));
}

class raw_pair {
 public:
  raw_pair(const std::string& transports, std::size_t bytes) {
    ucp_config_t* cfg = nullptr;
    ucs_check(::ucp_config_read(nullptr, nullptr, &cfg), "ucp_config_read");
    ucs_check(::ucp_config_modify(cfg, "TLS", transports.c_str()), "TLS");
    if (transports.find("shm") != std::string::npos) {
      ucs_check(::ucp_config_modify(cfg, "MM_ERROR_HANDLING", "y"), "MM_ERROR_HANDLING");
    }
    ucs_check(::ucp_config_modify(cfg, "KEEPALIVE_INTERVAL", "1000ms"), "KEEPALIVE_INTERVAL");
    ucp_params_t p{};
    p.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
    p.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
    p.mt_workers_shared = 1;
    const ucs_status_t s = ::ucp_init(&p, cfg, &context_);
    ::ucp_config_release(cfg);
    ucs_check(s, "ucp_init");
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;
    ucs_check(::ucp_worker_create(context_, &wp, &initiator_), "ucp_worker_create");
    ucs_check(::ucp_worker_create(context_, &wp, &target_), "ucp_worker_create");

    ucp_address_t* address = nullptr;
    std::size_t address_bytes = 0;
    ucs_check(::ucp_worker_get_address(target_, &address, &address_bytes), "ucp_worker_get_address");
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.address = address;
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = &on_raw_error;
    ep.err_handler.arg = nullptr;
    const ucs_status_t es = ::ucp_ep_create(initiator_, &ep, &ep_);
    ::ucp_worker_release_address(target_, address);
    ucs_check(es, "ucp_ep_create");

    local_bytes_.assign(bytes, std::byte{1});
    local_ = map(local_bytes_.data(), bytes);
    if (transports == "shm") {
      target_mem_ = map(nullptr, bytes);
      ucp_mem_attr_t a{};
      a.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS;
      ucs_check(::ucp_mem_query(target_mem_, &a), "ucp_mem_query");
      target_base_ = reinterpret_cast<std::uint64_t>(a.address);
    } else {
      target_bytes_.assign(bytes, std::byte{0});
      target_mem_ = map(target_bytes_.data(), bytes);
      target_base_ = reinterpret_cast<std::uint64_t>(target_bytes_.data());
    }
    void* packed = nullptr;
    std::size_t packed_bytes = 0;
    ucs_check(::ucp_rkey_pack(context_, target_mem_, &packed, &packed_bytes), "ucp_rkey_pack");
    const ucs_status_t ks = ::ucp_ep_rkey_unpack(ep_, packed, &rkey_);
    ::ucp_rkey_buffer_release(packed);
    ucs_check(ks, "ucp_ep_rkey_unpack");
    // Spins, but lets the initiator's thread run when the target has nothing to do: with two
    // busy threads on a small machine a descheduled initiator would cost more than the target.
    progress_ = std::thread([this] {
      while (!stop_.load(std::memory_order_relaxed)) {
        if (::ucp_worker_progress(target_) == 0) std::this_thread::yield();
      }
    });
  }

  raw_pair(const raw_pair&) = delete;
  raw_pair& operator=(const raw_pair&) = delete;

  ~raw_pair() {
    ::ucp_rkey_destroy(rkey_);
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_EP_CLOSE_FLAG_FORCE;
    const ucs_status_ptr_t r = ::ucp_ep_close_nbx(ep_, &p);
    if (r != nullptr && !UCS_PTR_IS_ERR(r)) {
      while (::ucp_request_check_status(r) == UCS_INPROGRESS) ::ucp_worker_progress(initiator_);
      ::ucp_request_free(r);
    }
    stop_.store(true);
    progress_.join();
    ::ucp_mem_unmap(context_, local_);
    ::ucp_mem_unmap(context_, target_mem_);
    ::ucp_worker_destroy(initiator_);
    ::ucp_worker_destroy(target_);
    ::ucp_cleanup(context_);
  }

  void put(raw_op& o, std::size_t offset, std::size_t n) {
    start(o, ::ucp_put_nbx(ep_, local_bytes_.data() + offset, n, target_base_ + offset, rkey_,
                           params(o, true)), "ucp_put_nbx");
  }
  void get(raw_op& o, std::size_t offset, std::size_t n) {
    start(o, ::ucp_get_nbx(ep_, local_bytes_.data() + offset, n, target_base_ + offset, rkey_,
                           params(o, true)), "ucp_get_nbx");
  }
  void flush(raw_op& o) { start(o, ::ucp_ep_flush_nbx(ep_, params(o, false)), "ucp_ep_flush_nbx"); }

  void wait(raw_op& o) {
    while (o.status == UCS_INPROGRESS) ::ucp_worker_progress(initiator_);
    if (o.request != nullptr) ::ucp_request_free(o.request);
    o.request = nullptr;
    ucs_check(o.status, "raw UCP request");
  }

 private:
  ucp_mem_h map(void* address, std::size_t n) {
    ucp_mem_map_params_t m{};
    m.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                   UCP_MEM_MAP_PARAM_FIELD_FLAGS;
    m.address = address;
    m.length = n;
    m.flags = address == nullptr ? UCP_MEM_MAP_ALLOCATE : 0;
    ucp_mem_h h = nullptr;
    ucs_check(::ucp_mem_map(context_, &m, &h), "ucp_mem_map");
    return h;
  }

  const ucp_request_param_t* params(raw_op& o, bool memh) {
    param_ = {};
    param_.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    if (memh) {
      param_.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
      param_.memh = local_;
    }
    param_.cb.send = &on_raw_done;
    param_.user_data = &o;
    o.status = UCS_INPROGRESS;
    o.request = nullptr;
    return &param_;
  }

  static void start(raw_op& o, ucs_status_ptr_t r, const char* what) {
    if (r == nullptr) {
      o.status = UCS_OK;
    } else if (UCS_PTR_IS_ERR(r)) {
      ucs_check(UCS_PTR_STATUS(r), what);
    } else {
      o.request = r;
    }
  }

  ucp_context_h context_ = nullptr;
  ucp_worker_h initiator_ = nullptr, target_ = nullptr;
  ucp_ep_h ep_ = nullptr;
  ucp_mem_h local_ = nullptr, target_mem_ = nullptr;
  ucp_rkey_h rkey_ = nullptr;
  std::uint64_t target_base_ = 0;
  std::vector<std::byte> local_bytes_, target_bytes_;
  ucp_request_param_t param_{};
  std::atomic<bool> stop_{false};
  std::thread progress_;
};

// Landed puts (single or batched on ferry's side): a window of puts, then one flush for it (what
// "in the peer's memory" costs in UCP). Reusable puts and gets: a sliding window, as ferry's.
point raw_bandwidth(raw_pair& p, op o, std::size_t block, const config& c) {
  const std::size_t slots = c.region / block;
  std::vector<raw_op> ring(c.window);
  const auto t0 = clk::now();
  const double c0 = cpu_seconds();
  const auto end = t0 + c.per_point;
  std::size_t posted = 0, done = 0;
  if (o == op::put_landed || o == op::put_batch_landed) {
    raw_op f;
    do {
      for (std::size_t i = 0; i < c.window; ++i, ++posted) p.put(ring[i], (posted % slots) * block, block);
      p.flush(f);
      p.wait(f);
      for (raw_op& r : ring) p.wait(r);
      done = posted;
    } while ((posted + c.window) * block <= c.budget && clk::now() < end);
    return make_point(done, block, clk::now() - t0, cpu_seconds() - c0);
  }
  const auto post = [&](raw_op& r, std::size_t k) {
    if (o == op::get) {
      p.get(r, (k % slots) * block, block);
    } else {
      p.put(r, (k % slots) * block, block);
    }
  };
  for (; posted < c.window; ++posted) post(ring[posted], posted);
  while (done < posted) {
    p.wait(ring[done % c.window]);
    ++done;
    if ((posted + 1) * block <= c.budget && clk::now() < end) {
      post(ring[posted % c.window], posted);
      ++posted;
    }
  }
  const point out = make_point(done, block, clk::now() - t0, cpu_seconds() - c0);
  raw_op f;  // outside the timing: leaves nothing in flight for the next point
  p.flush(f);
  p.wait(f);
  return out;
}

latency raw_latency(raw_pair& p, const config& c) {
  std::vector<double> us;
  us.reserve(static_cast<std::size_t>(c.latency_ops));
  const double c0 = cpu_seconds();
  raw_op put, flush;
  for (int i = 0; i < c.latency_ops; ++i) {
    const auto t0 = clk::now();
    p.put(put, 0, 8);
    p.flush(flush);
    p.wait(flush);
    p.wait(put);
    us.push_back(micros(clk::now() - t0));
  }
  return make_latency(us, cpu_seconds() - c0);
}

// ----------------------------------------------------------------------------------------- main

std::string size_name(std::size_t n) {
  if (n >= (std::size_t{1} << 20)) return std::to_string(n >> 20) + " MiB";
  if (n >= 1024) return std::to_string(n >> 10) + " KiB";
  return std::to_string(n) + " B";
}

void run(const std::string& transports, const config& c) {
  const op ops[] = {op::put_landed, op::put_batch_landed, op::put_reusable, op::get};
  std::vector<point> ferry_points, raw_points;
  latency fl, rl, fn;
  {
    ferry_pair p(transports, c.region);
    for (int i = 0; i < 16; ++i) {  // connects the lanes before anything is timed
      ferry::transfer t = ferry_post(p, op::put_landed, 0, 8);
      check(t, "warm-up");
    }
    for (op o : ops) {
      for (std::size_t s : c.sizes) ferry_points.push_back(ferry_bandwidth(p, o, s, c));
    }
    fl = ferry_latency(p, c);
    fn = ferry_notify_latency(p, c);
  }
  {
    raw_pair p(transports, c.region);
    raw_op put, flush;
    for (int i = 0; i < 16; ++i) {
      p.put(put, 0, 8);
      p.flush(flush);
      p.wait(flush);
      p.wait(put);
    }
    for (op o : ops) {
      for (std::size_t s : c.sizes) raw_points.push_back(raw_bandwidth(p, o, s, c));
    }
    rl = raw_latency(p, c);
  }
  std::printf("\n### %s, window %zu\n\n", transports.c_str(), c.window);
  std::printf("| operation | block | ferry MB/s | ferry CPU µs/op | raw UCP MB/s | raw CPU µs/op | "
              "ferry/raw |\n|---|---|---|---|---|---|---|\n");
  std::size_t k = 0;
  for (op o : ops) {
    for (std::size_t s : c.sizes) {
      const point& f = ferry_points[k];
      const point& r = raw_points[k];
      ++k;
      std::printf("| %s | %s | %.0f | %.1f | %.0f | %.1f | %.2f |\n", name(o), size_name(s).c_str(),
                  f.mbps, f.cpu_us, r.mbps, r.cpu_us, f.mbps / r.mbps);
    }
  }
  std::printf("\n| 8 B put, depth 1 (%d ops) | median µs | p99 µs | CPU µs/op |\n|---|---|---|---|\n",
              c.latency_ops);
  std::printf("| ferry put (landed) → wait() | %.1f | %.1f | %.1f |\n", fl.median_us, fl.p99_us,
              fl.cpu_us);
  std::printf("| raw ucp_put_nbx + ucp_ep_flush_nbx | %.1f | %.1f | %.1f |\n", rl.median_us,
              rl.p99_us, rl.cpu_us);
  std::printf("| ferry/raw | %.2f | %.2f | %.2f |\n", fl.median_us / rl.median_us,
              fl.p99_us / rl.p99_us, fl.cpu_us / rl.cpu_us);
  std::printf("\n| notification, depth 1 (%d ops) | median µs | p99 µs | CPU µs/op |\n"
              "|---|---|---|---|\n| ferry send_notification → its transfer ends | %.1f | %.1f | "
              "%.1f |\n",
              c.latency_ops, fn.median_us, fn.p99_us, fn.cpu_us);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  config c;
  std::vector<std::string> transports;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") {
      c.quick = true;
    } else if (a == "tcp" || a == "shm") {
      transports.push_back(a);
    } else {
      std::fprintf(stderr, "usage: %s [--quick] [tcp] [shm]\n", argv[0]);
      return 2;
    }
  }
  if (transports.empty()) transports = {"tcp", "shm"};
  if (c.quick) {
    c.sizes = {std::size_t{4} << 10, std::size_t{1} << 20};
    c.per_point = 200ms;
    c.region = std::size_t{16} << 20;
    c.latency_ops = 2000;
  } else {
    c.sizes = {std::size_t{4} << 10, std::size_t{64} << 10, std::size_t{1} << 20, std::size_t{16} << 20};
  }
  try {
    for (const std::string& t : transports) run(t, c);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ferry_ucx_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}

// The verbs backend against the in-process fake adapter (there is no RDMA device here): work requests
// posted and completed per second through one progress executor, and the time from the adapter
// pushing one small WRITE's completion to its blocked waiter running (completion → resume). The baseline, in the same run on the same
// fake, is how engines commonly wait today: a poller thread drains the CQ and signals a condition
// variable per request, and the submitter posts every work request signalled and waits on its
// members one by one.
//
// Both sides pay the same fake adapter (a thread copying memory and pushing completions), so the
// ratios compare the completion paths; the absolute figures are the fake's, not a NIC's. Where a
// real adapter exists, run_verbs_hardware repeats the comparison on it.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <ferry/ferry.hpp>
#include <ferry/verbs/device.hpp>
#include <ferry/testing/verbs.hpp>
#include <ferry/verbs/provider.hpp>

#include "bench.hpp"
#include "harness.hpp"

namespace ferry_bench {
namespace {

namespace fv = ferry::verbs;
using fabric = fv::fake::fabric;

constexpr std::size_t block_bytes = 64;
constexpr std::size_t batch_size = 32;
constexpr std::size_t window_batches = 8;  // 256 work requests in flight
constexpr std::uint32_t send_depth = 512;
constexpr std::size_t region_bytes = batch_size * window_batches * block_bytes;

void require(bool ok, const char* what) {
  if (!ok) throw std::runtime_error(std::string("verbs bench: ") + what);
}

// ferry's side: two adapters (or one, twice) on one executor, a connected queue pair.
template <class P>
struct ferry_side {
  ferry_side(ferry::progress_executor& exec, const char* a_name, const char* b_name)
      : a(exec, fv::device_options{a_name, 1, 0, 4096}),
        b(exec, fv::device_options{b_name, 1, 0, 4096}),
        a_mem(fv::basic_memory_region<P>::allocate(a, region_bytes)),
        b_mem(fv::basic_memory_region<P>::allocate(b, region_bytes)),
        a_qp(a, options()),
        b_qp(b, options()) {
    a_qp.connect(b_qp.local_info());
    b_qp.connect(a_qp.local_info());
  }
  static fv::queue_pair_options options() {
    fv::queue_pair_options o;
    o.send_depth = send_depth;
    o.receive_depth = 16;
    return o;
  }
  fv::basic_device<P> a;
  fv::basic_device<P> b;
  fv::basic_memory_region<P> a_mem;
  fv::basic_memory_region<P> b_mem;
  fv::basic_queue_pair<P> a_qp;
  fv::basic_queue_pair<P> b_qp;
};

// The baseline: the same verbs calls, a poller thread and a condition variable per request.
template <class P>
class cv_baseline {
  using provider = P;

 public:
  cv_baseline(const char* a_name, const char* b_name)
      : memory_a_(region_bytes), memory_b_(region_bytes), done_(send_depth) {
    a_ = open(a_name, memory_a_.data());
    b_ = open(b_name, memory_b_.data());
    connect(a_, b_);
    connect(b_, a_);
    poller_ = std::thread([this] { poll(); });
  }
  ~cv_baseline() {
    {
      std::lock_guard lock(mutex_);
      stop_.store(true);
    }
    cv_.notify_all();
    poller_.join();
    for (side* s : {&a_, &b_}) {
      provider::destroy_qp(s->qp);
      provider::destroy_cq(s->cq);
      provider::dereg_mr(s->mr);
      provider::dealloc_pd(s->pd);
      provider::close_device(s->ctx);
    }
  }

  // Posts `n` WRITEs, every one signalled, as one chain; slot i is request (first + i) % depth.
  void post(std::size_t first, std::size_t n) {
    std::vector<ibv_sge> sge(n);
    std::vector<ibv_send_wr> wr(n);
    for (std::size_t i = 0; i < n; ++i) {
      const std::size_t slot = (first + i) % send_depth;
      {
        std::lock_guard lock(mutex_);
        done_[slot] = false;
      }
      const std::size_t at = ((first + i) % (region_bytes / block_bytes)) * block_bytes;
      sge[i] = {reinterpret_cast<std::uintptr_t>(memory_a_.data() + at), block_bytes,
                provider::lkey(a_.mr)};
      wr[i].wr_id = slot;
      wr[i].sg_list = &sge[i];
      wr[i].num_sge = 1;
      wr[i].opcode = IBV_WR_RDMA_WRITE;
      wr[i].send_flags = IBV_SEND_SIGNALED;
      wr[i].wr.rdma.remote_addr = reinterpret_cast<std::uintptr_t>(memory_b_.data() + at);
      wr[i].wr.rdma.rkey = provider::rkey(b_.mr);
      wr[i].next = i + 1 < n ? &wr[i + 1] : nullptr;
    }
    ibv_send_wr* bad = nullptr;
    require(provider::post_send(a_.qp, wr.data(), &bad) == 0, "baseline post_send");
  }

  // The poller spins only while the baseline is measured, so that it never takes a core from ferry.
  void start() {
    {
      std::lock_guard lock(mutex_);
      running_ = true;
    }
    cv_.notify_all();
  }
  void stop() {
    std::lock_guard lock(mutex_);
    running_ = false;
  }

  // Waits for requests first .. first + n - 1, one member at a time.
  void wait(std::size_t first, std::size_t n) {
    for (std::size_t i = 0; i < n; ++i) {
      const std::size_t slot = (first + i) % send_depth;
      std::unique_lock lock(mutex_);
      cv_.wait(lock, [&] { return done_[slot]; });
    }
  }

 private:
  struct side {
    typename P::context_handle ctx{};
    typename P::pd_handle pd{};
    typename P::mr_handle mr{};
    typename P::cq_handle cq{};
    typename P::qp_handle qp{};
    std::uint16_t lid = 0;
    ibv_mtu mtu = IBV_MTU_1024;
    bool has_gid = false;
    ibv_gid gid{};
  };

  static side open(const char* name, std::byte* memory) {
    side s;
    s.ctx = provider::open_device(name);
    require(s.ctx != nullptr, "baseline open_device");
    ibv_port_attr port{};
    provider::query_port(s.ctx, 1, port);
    s.lid = port.lid;
    s.mtu = port.active_mtu;
    s.has_gid = port.link_layer == IBV_LINK_LAYER_ETHERNET && provider::query_gid(s.ctx, 1, 0, s.gid) == 0;
    s.pd = provider::alloc_pd(s.ctx);
    s.mr = provider::reg_mr(s.pd, memory, region_bytes, fv::default_region_access);
    s.cq = provider::create_cq(s.ctx, 2 * send_depth, nullptr);
    ibv_qp_cap cap{};
    cap.max_send_wr = send_depth;
    cap.max_recv_wr = 1;
    cap.max_send_sge = 1;
    cap.max_recv_sge = 1;
    s.qp = provider::create_qp(s.pd, s.cq, s.cq, cap);
    require(s.pd != nullptr && s.mr != nullptr && s.cq != nullptr && s.qp != nullptr,
            "baseline set-up");
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_INIT;
    attr.port_num = 1;
    attr.qp_access_flags = fv::default_region_access;
    require(provider::modify_qp(s.qp, attr,
                                IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS) == 0,
            "baseline INIT");
    return s;
  }

  static void connect(side& from, const side& to) {
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_RTR;
    attr.path_mtu = std::min(from.mtu, to.mtu);
    attr.dest_qp_num = provider::qp_num(to.qp);
    attr.max_dest_rd_atomic = 16;
    attr.min_rnr_timer = 12;
    attr.ah_attr.dlid = to.lid;
    attr.ah_attr.port_num = 1;
    if (to.has_gid) {
      attr.ah_attr.is_global = 1;
      attr.ah_attr.grh.dgid = to.gid;
      attr.ah_attr.grh.hop_limit = 64;
    }
    require(provider::modify_qp(from.qp, attr,
                                IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                                    IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
                                    IBV_QP_MIN_RNR_TIMER) == 0,
            "baseline RTR");
    attr = ibv_qp_attr{};
    attr.qp_state = IBV_QPS_RTS;
    attr.timeout = 14;
    attr.retry_cnt = 7;
    attr.rnr_retry = 7;
    attr.max_rd_atomic = 16;
    require(provider::modify_qp(from.qp, attr,
                                IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                                    IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC) == 0,
            "baseline RTS");
  }

  void poll() {
    ibv_wc wc[32];
    while (!stop_.load(std::memory_order_relaxed)) {
      const int n = provider::poll_cq(a_.cq, 32, wc);
      if (n <= 0) {
        std::unique_lock lock(mutex_);
        cv_.wait(lock, [&] { return running_ || stop_.load(std::memory_order_relaxed); });
        continue;
      }
      {
        std::lock_guard lock(mutex_);
        for (int i = 0; i < n; ++i) done_[wc[i].wr_id] = true;
      }
      cv_.notify_all();
    }
  }

  std::vector<std::byte> memory_a_;
  std::vector<std::byte> memory_b_;
  side a_;
  side b_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<char> done_;
  bool running_ = false;
  std::atomic<bool> stop_{false};
  std::thread poller_;
};

// Work requests per second, ferry: batches of 32 posted as one unit, a window of 8 batches.
template <class P>
double ferry_rate(ferry_side<P>& s, std::size_t total) {
  using block = fv::basic_rdma_block<P>;
  std::vector<block> blocks(batch_size);
  std::deque<std::vector<ferry::transfer>> window;
  const auto t0 = now_ns();
  for (std::size_t posted = 0; posted < total; posted += batch_size) {
    if (window.size() == window_batches) {
      require(ferry::wait_all(window.front(), std::chrono::seconds(10)).ok(), "ferry batch failed");
      window.pop_front();
    }
    const std::size_t base = (posted % (region_bytes / block_bytes));
    for (std::size_t i = 0; i < batch_size; ++i) {
      const std::size_t at = ((base + i) % (region_bytes / block_bytes)) * block_bytes;
      blocks[i] = {s.a_mem.slice(at, block_bytes), s.b_mem.remote().slice(at, block_bytes)};
    }
    std::vector<ferry::transfer> out(batch_size);
    s.a_qp.write_batch(std::span<const block>(blocks), std::span<ferry::transfer>(out));
    window.push_back(std::move(out));
  }
  for (auto& b : window) require(ferry::wait_all(b, std::chrono::seconds(10)).ok(), "ferry batch failed");
  return static_cast<double>(total) * 1e9 / static_cast<double>(now_ns() - t0);
}

template <class P>
double baseline_rate(cv_baseline<P>& c, std::size_t total) {
  std::deque<std::size_t> window;
  const auto t0 = now_ns();
  for (std::size_t posted = 0; posted < total; posted += batch_size) {
    if (window.size() == window_batches) {
      c.wait(window.front(), batch_size);
      window.pop_front();
    }
    c.post(posted, batch_size);
    window.push_back(posted);
  }
  for (std::size_t first : window) c.wait(first, batch_size);
  return static_cast<double>(total) * 1e9 / static_cast<double>(now_ns() - t0);
}

}  // namespace

void run_verbs(const options& opt) {
  fabric& f = fabric::instance();
  for (const char* name : {"bench_ferry_a", "bench_ferry_b", "bench_busy_a", "bench_busy_b",
                           "bench_cv_a", "bench_cv_b"}) {
    f.add_device(name);
  }
  const std::size_t total = opt.quick ? 20'000 : 200'000;
  const int rounds = opt.quick ? 3 : 7;
  const int samples = opt.quick ? 500 : 5000;

  ferry::progress_executor exec;
  std::vector<double> ferry_rates, base_rates, ferry_rtt, busy_rtt, base_rtt;
  {
    ferry_side<fv::fake::provider> s(exec, "bench_ferry_a", "bench_ferry_b");
    cv_baseline<fv::fake::provider> c("bench_cv_a", "bench_cv_b");
    for (int r = 0; r < rounds; ++r) {
      // Interleaved, so that a noisy moment on this shared machine hits both sides alike.
      ferry_rates.push_back(ferry_rate(s, total));
      c.start();
      base_rates.push_back(baseline_rate(c, total));
      c.stop();
    }
    // Completion → resume: the request is posted while the fake adapter is paused, so that the
    // waiter is already waiting when the adapter, let go, executes it and pushes its completion;
    // the time runs from that push (the fake records it) until the waiter runs. Blocks of 50 per
    // side, alternating, for the same reason as above.
    const auto release = [&](std::uint64_t posted_before) {
      while (f.posted_send_wrs() == posted_before) std::this_thread::yield();
      f.resume();
    };
    const auto since_push = [&] {
      const auto woke = bench_clock::now();
      return static_cast<double>(
          std::chrono::duration_cast<std::chrono::nanoseconds>(woke - f.last_completion_pushed_at())
              .count());
    };
    const auto ferry_sample = [&](ferry_side<fv::fake::provider>& side, std::vector<double>& into) {
      f.pause();
      const std::uint64_t before = f.posted_send_wrs();
      ferry::transfer t =
          side.a_qp.write(side.a_mem.slice(0, block_bytes), side.b_mem.remote().slice(0, block_bytes));
      release(before);
      require(t.wait() == ferry::transfer_state::success, "ferry write failed");
      into.push_back(since_push());
    };
    for (int i = 0; i < samples; i += 50) {
      for (int k = 0; k < 50; ++k) ferry_sample(s, ferry_rtt);
      {
        // A busy-polling executor, like the baseline's poller; it exists only for its own block,
        // so that its spinning never takes a core from the other side.
        ferry::executor_options busy;
        busy.mode = ferry::progress_mode::busy;
        ferry::progress_executor spinning(busy);
        ferry_side<fv::fake::provider> hot(spinning, "bench_busy_a", "bench_busy_b");
        for (int k = 0; k < 50; ++k) ferry_sample(hot, busy_rtt);
      }
      c.start();
      for (int k = 0; k < 50; ++k) {
        f.pause();
        const std::uint64_t before = f.posted_send_wrs();
        c.post(static_cast<std::size_t>(i + k), 1);
        release(before);
        c.wait(static_cast<std::size_t>(i + k), 1);
        base_rtt.push_back(since_push());
      }
      c.stop();
    }
  }
  const auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const double fr = median(ferry_rates);
  const double br = median(base_rates);
  const summary fl = summarize(ferry_rtt);
  const summary bl = summarize(base_rtt);
  const summary hl = summarize(busy_rtt);
  full_printf("\n## RDMA verbs against the in-process fake adapter (no RDMA device here)\n\n");
  full_printf("%zu WRITEs of %zu B per round, batches of %zu, %zu in flight; median of %d rounds. "
              "Completion → resume: one %zu B WRITE, timed from the fake adapter pushing its "
              "completion to the blocked waiter running, %d samples.\n\n",
              total, block_bytes, batch_size, batch_size * window_batches, rounds, block_bytes,
              samples);
  full_printf("| | work requests / s | completion → resume p50 | p99 |\n|---|---|---|---|\n");
  full_printf("| ferry: batch posted as one unit; adaptive executor (the default: parks after 50 us "
              "idle) | %.2f M | %s | %s |\n",
              fr / 1e6, human_ns(fl.p50).c_str(), human_ns(fl.p99).c_str());
  full_printf("| ferry: busy-polling executor | | %s | %s |\n", human_ns(hl.p50).c_str(),
              human_ns(hl.p99).c_str());
  full_printf("| baseline: all signalled, poller + condition variable, member by member | %.2f M | "
              "%s | %s |\n",
              br / 1e6, human_ns(bl.p50).c_str(), human_ns(bl.p99).c_str());
  full_printf("\nratios: throughput %.2fx the baseline; completion → resume %.2fx the baseline's "
              "with the adaptive executor, %.2fx with the busy one (lower is better)\n",
              fr / br, fl.p50 / bl.p50, hl.p50 / bl.p50);
  char measured[96];
  std::snprintf(measured, sizeof measured, "%.2fx (%.2f M vs %.2f M WR/s, fake adapter)", fr / br,
                fr / 1e6, br / 1e6);
  report_target("verbs: WRs/s through one executor >= the cv baseline's", measured, fr >= br);
  std::snprintf(measured, sizeof measured, "%s vs %s (%.2fx, fake adapter)", human_ns(hl.p50).c_str(),
                human_ns(bl.p50).c_str(), hl.p50 / bl.p50);
  // Like against like: the baseline's poller never sleeps, nor does a busy executor. An adaptive
  // executor that has parked pays one wake-up more, to give its core back while idle.
  report_target("verbs: completion → resume <= the cv baseline's (both polling threads spinning)",
                measured, hl.p50 <= bl.p50);
  char rates[2][32];
  std::snprintf(rates[0], sizeof rates[0], "%.2f M/s", fr / 1e6);
  std::snprintf(rates[1], sizeof rates[1], "%.2f M/s", br / 1e6);
  report_figure({"RDMA WRITEs/s, fake adapter", rates[0], rates[1], "poller + cond. var.",
                 ratio_text(fr, br), "-"});
  report_figure({"RDMA resume after completion, fake adapter", human_ns(fl.p50), human_ns(bl.p50),
                 "poller + cond. var.", ratio_text(fl.p50, bl.p50), "-"});
}

// The same comparison on a real adapter, where one exists (FERRY_VERBS_DEVICE names it; default:
// the first): both queue pairs of each side on that adapter, looped back. No pause is possible on
// hardware, so latency is the round trip of one small WRITE, post to resume.
void run_verbs_hardware(const options& opt) {
  std::vector<std::string> names;
  try {
    names = fv::real_provider::device_names();
  } catch (const std::exception&) {
  }
  if (names.empty()) {
    full_printf("\n## RDMA verbs on hardware\n\nskipped: no RDMA device on this machine\n");
    note("RDMA verbs on hardware: not measured, no RDMA device here (the RDMA rows use ferry's "
         "fake adapter).");
    return;
  }
  const char* chosen = std::getenv("FERRY_VERBS_DEVICE");
  const std::string name = chosen != nullptr ? chosen : names.front();
  const std::size_t total = opt.quick ? 100'000 : 2'000'000;
  const int rounds = opt.quick ? 3 : 7;
  const int samples = opt.quick ? 1000 : 20000;
  std::vector<double> ferry_rates, base_rates, ferry_rtt, base_rtt;
  {
    ferry::progress_executor exec;
    ferry_side<fv::real_provider> s(exec, name.c_str(), name.c_str());
    cv_baseline<fv::real_provider> c(name.c_str(), name.c_str());
    for (int r = 0; r < rounds; ++r) {
      ferry_rates.push_back(ferry_rate(s, total));
      c.start();
      base_rates.push_back(baseline_rate(c, total));
      c.stop();
    }
    for (int i = 0; i < samples; i += 100) {
      for (int k = 0; k < 100; ++k) {
        const auto t0 = now_ns();
        ferry::transfer t =
            s.a_qp.write(s.a_mem.slice(0, block_bytes), s.b_mem.remote().slice(0, block_bytes));
        require(t.wait() == ferry::transfer_state::success, "ferry write failed");
        ferry_rtt.push_back(static_cast<double>(now_ns() - t0));
      }
      c.start();
      for (int k = 0; k < 100; ++k) {
        const auto t0 = now_ns();
        c.post(static_cast<std::size_t>(i + k), 1);
        c.wait(static_cast<std::size_t>(i + k), 1);
        base_rtt.push_back(static_cast<double>(now_ns() - t0));
      }
      c.stop();
    }
  }
  const summary fl = summarize(ferry_rtt);
  const summary bl = summarize(base_rtt);
  const double fr = summarize(ferry_rates).p50;
  const double br = summarize(base_rates).p50;
  full_printf("\n## RDMA verbs on %s (hardware)\n\n", name.c_str());
  full_printf("| | work requests / s | round trip p50 | p99 |\n|---|---|---|---|\n");
  full_printf("| ferry | %.2f M | %s | %s |\n", fr / 1e6, human_ns(fl.p50).c_str(),
              human_ns(fl.p99).c_str());
  full_printf("| baseline (poller + condition variable) | %.2f M | %s | %s |\n", br / 1e6,
              human_ns(bl.p50).c_str(), human_ns(bl.p99).c_str());
  full_printf("\nratios: throughput %.2fx, round trip %.2fx\n", fr / br, fl.p50 / bl.p50);
  char rates[2][32];
  std::snprintf(rates[0], sizeof rates[0], "%.2f M/s", fr / 1e6);
  std::snprintf(rates[1], sizeof rates[1], "%.2f M/s", br / 1e6);
  report_figure({"RDMA WRITEs/s on " + name, rates[0], rates[1], "poller + cond. var.",
                 ratio_text(fr, br), "-"});
  report_figure({"RDMA WRITE round trip p50 on " + name, human_ns(fl.p50), human_ns(bl.p50),
                 "poller + cond. var.", ratio_text(fl.p50, bl.p50), "-"});
}

}  // namespace ferry_bench

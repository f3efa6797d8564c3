#pragma once
// Shared by the verbs tests: the backend over the in-process fake adapter (<ferry/testing/verbs.hpp>),
// and a rig of two fake adapters with a region and a connected queue pair on each.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <ferry/ferry.hpp>
#include <ferry/metrics.hpp>
#include <ferry/verbs/device.hpp>
#include <ferry/testing/verbs.hpp>

#include "helpers.hpp"

namespace ferry_test::verbs {

namespace fv = ferry::verbs;
using ferry::transfer;
using ferry::transfer_state;
using ferry_test::hang_bound;
using provider = fv::fake::provider;
using device = fv::basic_device<provider>;
using region = fv::basic_memory_region<provider>;
using queue_pair = fv::basic_queue_pair<provider>;
using block = fv::basic_rdma_block<provider>;
using fabric = fv::fake::fabric;

// A fake adapter of its own for each use: an injected fatal event then touches nothing else.
inline std::string fresh_device(const char* what) {
  static std::atomic<int> n{0};
  std::string name = std::string("ferry_") + what + "_" + std::to_string(n++);
  fabric::instance().add_device(name);
  return name;
}

// Two fake adapters on one executor with a region each; `a` records into `metrics`.
struct metered_devices {
  metered_devices(ferry::metrics::registry& metrics, const char* what)
      : a(exec, options(metrics, what)), b(exec, fv::device_options{fresh_device(what), 1, 0, 4096}) {}

  static fv::device_options options(ferry::metrics::registry& metrics, const char* what) {
    fv::device_options o{fresh_device(what), 1, 0, 4096};
    o.metrics = &metrics;
    return o;
  }

  ferry::progress_executor exec;
  device a;
  device b;
  region a_mem = region::allocate(a, 1 << 16);
  region b_mem = region::allocate(b, 1 << 16);
};

// Pauses the fake adapter for the scope: nothing is executed and no completion arrives.
struct paused_fabric {
  paused_fabric() { fabric::instance().pause(); }
  ~paused_fabric() { resume(); }
  paused_fabric(const paused_fabric&) = delete;
  paused_fabric& operator=(const paused_fabric&) = delete;
  void resume() {
    if (paused_) fabric::instance().resume();
    paused_ = false;
  }
  bool paused_ = true;
};

inline void fill_pattern(std::span<std::byte> bytes, std::uint32_t seed) {
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    bytes[i] = static_cast<std::byte>((i * 2654435761u + seed) >> 13);
  }
}

inline bool has_pattern(std::span<const std::byte> bytes, std::uint32_t seed) {
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    if (bytes[i] != static_cast<std::byte>((i * 2654435761u + seed) >> 13)) return false;
  }
  return true;
}

struct rig_options {
  fv::queue_pair_options qp;
  std::size_t bytes = std::size_t{1} << 20;
  ferry::executor_options exec;
  int cq_entries = 8192;
  bool two_executors = false;  // each device on its own executor
};

// Two fake adapters, a region on each and a connected queue pair between them. Members are
// destroyed in reverse: queue pairs, regions, devices, then the executors.
struct rig {
  explicit rig(rig_options o = {})
      : exec_a(std::make_unique<ferry::progress_executor>(o.exec)),
        exec_b(o.two_executors ? std::make_unique<ferry::progress_executor>(o.exec) : nullptr),
        a(std::make_unique<device>(*exec_a, fv::device_options{fresh_device("a"), 1, 0, o.cq_entries})),
        b(std::make_unique<device>(o.two_executors ? *exec_b : *exec_a,
                                   fv::device_options{fresh_device("b"), 1, 0, o.cq_entries})),
        a_mem(std::make_unique<region>(region::allocate(*a, o.bytes))),
        b_mem(std::make_unique<region>(region::allocate(*b, o.bytes))),
        a_qp(std::make_unique<queue_pair>(*a, o.qp)),
        b_qp(std::make_unique<queue_pair>(*b, o.qp)) {
    a_qp->connect(b_qp->local_info());
    b_qp->connect(a_qp->local_info());
  }
  explicit rig(fv::queue_pair_options qp) : rig(with(qp)) {}

  static rig_options with(fv::queue_pair_options qp, std::size_t bytes = std::size_t{1} << 20) {
    rig_options o;
    o.qp = qp;
    o.bytes = bytes;
    return o;
  }

  std::unique_ptr<ferry::progress_executor> exec_a;
  std::unique_ptr<ferry::progress_executor> exec_b;
  std::unique_ptr<device> a;
  std::unique_ptr<device> b;
  std::unique_ptr<region> a_mem;
  std::unique_ptr<region> b_mem;
  std::unique_ptr<queue_pair> a_qp;
  std::unique_ptr<queue_pair> b_qp;
};

// Posts `n` 64-byte WRITEs from a's region to b's, block i at offset 64 i on both sides.
inline std::vector<transfer> post_writes(rig& r, int n) {
  std::vector<transfer> out;
  for (int i = 0; i < n; ++i) {
    const std::size_t at = static_cast<std::size_t>(i) * 64;
    out.push_back(r.a_qp->write(r.a_mem->slice(at, 64), r.b_mem->remote().slice(at, 64)));
  }
  return out;
}

// True when every transfer of `ts` ends in `want` within the hang bound.
inline bool all_end(std::span<const transfer> ts, transfer_state want) {
  for (const transfer& t : ts) {
    if (t.wait_for(hang_bound) != want) return false;
  }
  return true;
}

// Awaits `t` resuming inline and then holds the executor thread (inside the device's poll) until
// `stage` becomes 2.
inline ferry_test::detached_inline hold_executor(transfer t, std::atomic<int>& stage) {
  ferry::inline_scheduler here;
  (void)co_await ferry::resume_on(here, t);
  stage = 1;
  while (stage.load() != 2) std::this_thread::yield();
  stage = 3;
}

}  // namespace ferry_test::verbs

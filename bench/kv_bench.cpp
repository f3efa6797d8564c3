// The inference-server layer's bookkeeping per engine step: 256 requests x 80 layers x 2 transfers
// registered, every request's verdict asked, every layer waited on, finished requests handed back.
// Compared, in the same run, with one bare poll_all over the same transfers.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include <ferry/kv.hpp>
#include <ferry/poll_all.hpp>

#include "bench.hpp"
#include "harness.hpp"

namespace ferry_bench {

void run_kv(const options& opt) {
  constexpr std::size_t requests = 256;
  constexpr std::size_t layers = 80;
  constexpr std::size_t per_layer = 2;  // a KDA layer's conv and ssm state, say
  constexpr std::size_t per_step = requests * layers * per_layer;
  const int steps = opt.quick ? 20 : 200;

  // The step's transfers, already complete, so that only bookkeeping is timed.
  std::vector<ferry::transfer> all;
  all.reserve(per_step);
  for (std::size_t i = 0; i < per_step; ++i) {
    all.push_back(ferry::make_completed_transfer(ferry::transfer_state::success));
  }
  std::size_t released = 0;
  ferry::kv::load_tracker tracker([&](ferry::kv::request_id, ferry::kv::request_verdict) { ++released; });

  std::vector<double> tracked_ns, bare_ns;
  std::size_t checksum = 0;
  for (int step = 0; step < steps; ++step) {
    const auto t0 = now_ns();
    tracker.begin_step();
    for (std::size_t r = 0; r < requests; ++r) {
      const ferry::kv::request_id id = static_cast<ferry::kv::request_id>(step) * requests + r;
      auto h = tracker.add_request(id);
      for (std::size_t l = 0; l < layers; ++l) {
        for (std::size_t k = 0; k < per_layer; ++k) {
          const std::size_t i = (r * layers + l) * per_layer + k;
          const ferry::kv::block_id block[2] = {2 * i, 2 * i + 1};
          tracker.add(h, l, all[i], block);
        }
      }
      tracker.seal(h);
    }
    for (std::size_t r = 0; r < requests; ++r) {
      const ferry::kv::request_id id = static_cast<ferry::kv::request_id>(step) * requests + r;
      checksum += static_cast<std::size_t>(tracker.verdict(id));
    }
    for (std::size_t l = 0; l < layers; ++l) {
      checksum += static_cast<std::size_t>(tracker.wait_layer(l, std::chrono::seconds(1)).verdict);
    }
    checksum += tracker.take_finished().size();
    checksum += tracker.drain_failed_blocks().size();
    const auto t1 = now_ns();
    checksum += ferry::poll_all(all).pending;
    const auto t2 = now_ns();
    tracked_ns.push_back(static_cast<double>(t1 - t0));
    bare_ns.push_back(static_cast<double>(t2 - t1));
  }
  std::sort(tracked_ns.begin(), tracked_ns.end());
  std::sort(bare_ns.begin(), bare_ns.end());
  const double step_ns = tracked_ns[tracked_ns.size() / 2];
  const double bare = bare_ns[bare_ns.size() / 2];
  const double per_transfer = step_ns / static_cast<double>(per_step);
  full_printf("\n## KV load tracking, per engine step (%zu requests x %zu layers x %zu transfers = "
              "%zu transfers; median of %d steps)\n\n",
              requests, layers, per_layer, per_step, steps);
  full_printf("| | per step | per transfer |\n|---|---|---|\n");
  full_printf("| load_tracker: register, seal, verdicts, %zu layer waits, hand back | %s | %.1f ns |\n",
              layers, human_ns(step_ns).c_str(), per_transfer);
  full_printf("| bare poll_all over the same transfers | %s | %.1f ns |\n", human_ns(bare).c_str(),
              bare / static_cast<double>(per_step));
  full_printf("\n(%zu requests released; checksum %zu)\n", released, checksum);
  char measured[64];
  std::snprintf(measured, sizeof measured, "%.1f ns per transfer", per_transfer);
  report_target("KV bookkeeping <= 100 ns per transfer", measured, per_transfer <= 100.0);
  const double bare_per_transfer = bare / static_cast<double>(per_step);
  const auto measured_ns = [](double ns) {
    char out[32];
    std::snprintf(out, sizeof out, "%.1f ns", ns);
    return std::string(out);
  };
  report_figure({"kv bookkeeping per transfer", measured_ns(per_transfer),
                 measured_ns(bare_per_transfer), "bare poll_all",
                 ratio_text(per_transfer, bare_per_transfer), "-"});
}

}  // namespace ferry_bench

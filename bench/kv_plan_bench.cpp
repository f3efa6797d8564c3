// Transfer planning for one engine step: 32 layers, 16 requests of 512 blocks (16 tokens, 8 KV
// heads x 128 dims, fp16), block ids allocated in runs of 1 to 64 on each side. For each layout
// and tensor-parallel pair it prints the planning time per step (every request, every source rank
// the decode rank reads), the time per block, and the ranges per layer beside the one descriptor
// per block, tensor and source rank that a connector posting per block would send.
//
// Usage: ferry_kv_plan_bench [--quick]

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include <ferry/kv/layout.hpp>
#include <ferry/kv/plan.hpp>

namespace {

namespace kv = ferry::kv;
using bench_clock = std::chrono::steady_clock;

constexpr std::uint32_t layers = 32;
constexpr std::uint32_t requests = 16;
constexpr std::uint32_t blocks_per_request = 512;
constexpr std::uint32_t cache_blocks = 12000;

// Every block id of a cache, in the order an allocator hands them out: runs of 1 to 64
// consecutive ids, the runs shuffled.
std::vector<std::uint32_t> allocation_order(std::mt19937& rng) {
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

struct step {
  std::vector<std::vector<std::uint32_t>> src, dst;  // per request
};

step make_step(std::mt19937& rng) {
  const auto src = allocation_order(rng);
  const auto dst = allocation_order(rng);
  step s;
  for (std::uint32_t r = 0; r < requests; ++r) {
    const auto at = static_cast<std::ptrdiff_t>(r * blocks_per_request);
    s.src.emplace_back(src.begin() + at, src.begin() + at + blocks_per_request);
    s.dst.emplace_back(dst.begin() + at, dst.begin() + at + blocks_per_request);
  }
  return s;
}

struct layout_case {
  const char* name;
  std::function<kv::cache_layout(const kv::paged_shape&)> build;
  std::uint32_t src_tp;
  std::uint32_t dst_tp;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--quick") {
      quick = true;
    } else {
      std::fprintf(stderr, "usage: %s [--quick]\n", argv[0]);
      return 2;
    }
  }
  const int steps = quick ? 5 : 200;
  std::mt19937 rng(38);
  const step work = make_step(rng);

  const layout_case cases[] = {
      {"kv_split 1->1", kv::cache_layout::kv_split, 1, 1},
      {"kv_interleaved 1->1", kv::cache_layout::kv_interleaved, 1, 1},
      {"cross_layer 1->1", kv::cache_layout::cross_layer, 1, 1},
      {"head_major 2->1", kv::cache_layout::head_major, 2, 1},
      {"kv_split 2->1", kv::cache_layout::kv_split, 2, 1},
      {"head_major 1->2", kv::cache_layout::head_major, 1, 2},
  };
  std::printf("kv transfer planning: %u layers, %u requests x %u blocks of 16 tokens, "
              "8 KV heads x 128 fp16; %d steps, median\n\n",
              layers, requests, blocks_per_request, steps);
  std::printf("%-20s %7s %11s %11s %7s %10s %9s\n", "layout, TP src->dst", "sources",
              "ranges/lay", "per-block", "ratio", "us/step", "ns/block");
  for (const layout_case& c : cases) {
    const auto shape_for = [&](std::uint32_t tp) {
      return kv::paged_shape{.layers = layers, .blocks = cache_blocks, .block_size = 16,
                             .total_heads = 8, .tp_size = tp, .head_size = 128,
                             .element_size = 2};
    };
    const kv::cache_layout src = c.build(shape_for(c.src_tp));
    const kv::cache_layout dst = c.build(shape_for(c.dst_tp));
    const kv::tp_shard dst_tp{0, c.dst_tp};
    std::vector<kv::transfer_planner> planners;
    for (std::uint32_t s : kv::tp_source_ranks(dst, c.src_tp, dst_tp)) {
      planners.emplace_back(src, kv::tp_shard{s, c.src_tp}, dst, dst_tp);
    }
    // One plan per request and source rank, reused step after step.
    std::vector<kv::transfer_plan> plans(requests * planners.size());
    std::vector<double> step_ns;
    std::uint64_t ranges = 0;
    for (int i = 0; i < steps; ++i) {
      const auto t0 = bench_clock::now();
      ranges = 0;
      for (std::uint32_t r = 0; r < requests; ++r) {
        const kv::block_pairs pairs[] = {{work.src[r], work.dst[r]}};
        for (std::size_t p = 0; p < planners.size(); ++p) {
          kv::transfer_plan& plan = plans[r * planners.size() + p];
          planners[p].plan(pairs, plan);
          ranges += plan.ranges;
        }
      }
      step_ns.push_back(std::chrono::duration<double, std::nano>(bench_clock::now() - t0).count());
    }
    const double ns = median(step_ns);
    const double per_layer = static_cast<double>(ranges) / layers;
    const double per_block =
        2.0 * requests * blocks_per_request * static_cast<double>(planners.size());
    std::printf("%-20s %7zu %11.0f %11.0f %6.1fx %10.1f %9.2f\n", c.name, planners.size(),
                per_layer, per_block, per_block / per_layer, ns / 1e3,
                ns / (requests * blocks_per_request));
  }
  std::printf("\nranges/lay: ranges per layer per step; per-block: one per block, tensor and "
              "source rank;\nns/block: planning time per block of a request, all %u layers and "
              "sources.\n",
              layers);
  return 0;
}

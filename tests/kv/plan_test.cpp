// Transfer plans: on random layouts, block tables and tensor-parallel pairs a plan moves exactly
// the bytes a copy one token and one head at a time moves; a destination rank's sources together
// supply each of its heads once; runs are coalesced; and bad input is refused by name.

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include <ferry/kv/layout.hpp>
#include <ferry/kv/plan.hpp>

#include "kv/random_layouts.hpp"

namespace kv = ferry::kv;
using kv_test::table;

namespace {

// The tensor-parallel pairs (source size, destination size) the random cases draw from: equal,
// prefill larger (a decode rank reads several), decode larger (several read one), and sizes past
// a layer's head count (replicated heads).
constexpr std::pair<std::uint32_t, std::uint32_t> tp_pairs[] = {
    {1, 1}, {2, 1}, {1, 2}, {4, 2}, {2, 4}, {8, 2}, {2, 8}, {4, 4}, {8, 8}, {8, 1}, {1, 8}};

std::vector<std::uint32_t> ids(std::uint32_t first, std::uint32_t n) {
  std::vector<std::uint32_t> out(n);
  for (std::uint32_t i = 0; i < n; ++i) out[i] = first + i;
  return out;
}

std::size_t ranges_in(const kv::transfer_plan& p, std::size_t layer) {
  return p.layers[layer].size();
}

std::uint64_t expected_bytes(const kv::cache_layout& dst, std::uint32_t src_size, kv::tp_shard src,
                             kv::tp_shard dst_tp, const std::vector<table>& tables) {
  std::uint64_t n = 0;
  kv_test::for_each_vector(dst, src_size, dst_tp, tables,
                           [&](std::size_t l, std::size_t i, std::uint32_t, std::uint32_t,
                               std::uint32_t, std::uint32_t, std::uint32_t from, std::uint32_t) {
                             if (from == src.rank) n += dst.layers[l].tensors[i].head_bytes();
                           });
  return n;
}

template <class F>
std::string error_of(F&& f, kv::errc expected) {
  try {
    f();
  } catch (const std::system_error& e) {
    if (e.code() != expected) return std::string("wrong code: ") + e.what();
    return e.what();
  }
  return "accepted";
}

}  // namespace

TEST_CASE("kv plan: each head a destination rank holds comes from exactly one source rank",
          "[kv]") {
  for (std::uint32_t heads : {1u, 2u, 4u, 8u, 16u}) {
    for (std::uint32_t src_size : {1u, 2u, 4u, 8u, 16u}) {
      for (std::uint32_t dst_size : {1u, 2u, 4u, 8u, 16u}) {
        for (std::uint32_t d = 0; d < dst_size; ++d) {
          const kv::tp_shard dst{d, dst_size};
          INFO(heads << " heads, " << src_size << " -> " << dst_size << ", destination rank " << d);
          const auto sources = kv::tp_sources(heads, true, src_size, dst);
          const kv::head_range held = kv::heads_held(heads, dst);
          std::uint32_t next = held.first;
          for (const kv::tp_source& s : sources) {
            CHECK(s.heads.first == next);
            CHECK(s.heads.count > 0);
            next = s.heads.first + s.heads.count;
            CHECK(kv::heads_read(heads, true, {s.src_rank, src_size}, dst) == s.heads);
          }
          CHECK(next == held.first + held.count);
          for (std::uint32_t s = 0; s < src_size; ++s) {
            bool listed = false;
            for (const auto& src : sources) listed = listed || src.src_rank == s;
            if (!listed) CHECK(kv::heads_read(heads, true, {s, src_size}, dst).count == 0);
          }
          if (src_size == dst_size) {
            REQUIRE(sources.size() == 1);
            CHECK(sources[0].src_rank == d);  // identical TP: rank d reads rank d
          }
          // An unsharded layer (an MLA latent) comes whole from one rank.
          const auto whole = kv::tp_sources(1, false, src_size, dst);
          REQUIRE(whole.size() == 1);
          CHECK(whole[0] == kv::tp_source{d % src_size, {0, 1}});
        }
      }
    }
  }
  // A few by hand.
  using sources = std::vector<kv::tp_source>;
  CHECK(kv::tp_sources(8, true, 2, {0, 1}) == sources{{0, {0, 4}}, {1, {4, 4}}});
  CHECK(kv::tp_sources(8, true, 1, {1, 2}) == sources{{0, {4, 4}}});
  CHECK(kv::tp_sources(8, true, 4, {1, 2}) == sources{{2, {4, 2}}, {3, {6, 2}}});
  CHECK(kv::tp_sources(2, true, 4, {0, 1}) == sources{{0, {0, 1}}, {2, {1, 1}}});
  CHECK(kv::tp_sources(2, true, 8, {5, 8}) == sources{{5, {1, 1}}});
  CHECK(kv::tp_sources(2, true, 8, {1, 2}) == sources{{5, {1, 1}}});
  CHECK(kv::tp_source_ranks(kv::cache_layout::kv_split({.total_heads = 8, .tp_size = 2}), 4,
                            {1, 2}) == std::vector<std::uint32_t>{2, 3});
  CHECK(kv::tp_source_ranks(kv::cache_layout::mla({.head_size = 8}), 4, {6, 8}) ==
        std::vector<std::uint32_t>{2});
  CHECK_THAT(error_of([] { (void)kv::tp_sources(8, true, 3, {0, 1}); }, kv::errc::bad_parallelism),
             Catch::Contains("size 3 does not divide 8 heads"));
  CHECK_THAT(error_of([] { (void)kv::tp_sources(1, false, 2, {2, 2}); }, kv::errc::bad_parallelism),
             Catch::Contains("rank 2 is not below its size 2"));
}

TEST_CASE("kv plan: random layouts, block tables and TP pairs move exactly what a per-token, "
          "per-head copy moves",
          "[kv]") {
  kv_test::rng_t rng(Catch::rngSeed() + 21);
  int replicated = 0;
  for (int round = 0; round < 600; ++round) {
    const auto k = static_cast<kv_test::kind>(round % 3);
    const kv_test::model m = kv_test::random_model(rng, k);
    const auto [src_size, dst_size] =
        tp_pairs[kv_test::uniform(rng, 0, std::size(tp_pairs) - 1)];
    const kv::tp_shard src_tp{kv_test::uniform(rng, 0, src_size - 1), src_size};
    const kv::tp_shard dst_tp{kv_test::uniform(rng, 0, dst_size - 1), dst_size};
    std::vector<std::uint32_t> src_blocks, dst_blocks;
    std::vector<table> tables;
    for (std::uint32_t g = 0; g < m.groups; ++g) {
      src_blocks.push_back(kv_test::uniform(rng, 4, 24));
      dst_blocks.push_back(kv_test::uniform(rng, 4, 24));
      tables.push_back(kv_test::random_table(rng, src_blocks[g], dst_blocks[g]));
    }
    const kv::cache_layout src = kv_test::random_layout(rng, m, src_size, src_blocks);
    const kv::cache_layout dst = kv_test::random_layout(rng, m, dst_size, dst_blocks);
    for (const auto& l : m.layers) replicated += l.sharded && l.total_heads < src_size;
    INFO("round " << round << ": " << kv_test::name(k) << ", rank " << src_tp.rank << " of "
                  << src_size << " -> rank " << dst_tp.rank << " of " << dst_size);

    const auto pairs = kv_test::pairs_of(tables);
    const kv::transfer_planner planner(src, src_tp, dst, dst_tp);
    const kv::transfer_plan plan = planner.plan(pairs);
    const kv_test::memory from = kv_test::random_bytes(rng, src);
    kv_test::memory planned = kv_test::zeroed(dst);
    kv::apply_plan(plan, kv_test::const_spans(from), kv_test::spans(planned));
    kv_test::memory naive = kv_test::zeroed(dst);
    kv_test::naive_copy(src, src_tp, from, dst, dst_tp, naive, tables);
    REQUIRE(kv_test::first_difference(planned, naive).empty());

    // Nothing moved twice, nothing else moved, no empty range, and no more ranges than a block
    // pair's worth per pair.
    REQUIRE(plan.bytes == expected_bytes(dst, src_size, src_tp, dst_tp, tables));
    std::uint64_t ranges = 0;
    for (std::size_t l = 0; l < plan.layers.size(); ++l) {
      ranges += plan.layers[l].size();
      for (const auto& r : plan.layers[l]) REQUIRE(r.length > 0);
      REQUIRE(plan.layers[l].size() <=
              tables[src.layers[l].group].src.size() * planner.ranges_per_block(l));
    }
    REQUIRE(plan.ranges == ranges);
  }
  CHECK(replicated > 20);  // the H < R cases were drawn
}

TEST_CASE("kv plan: a destination rank's sources together write every head it holds, once",
          "[kv]") {
  // Every source rank holds the model's values for its heads (replicas alike) amid random bytes;
  // after the plans from every rank tp_source_ranks names, the destination holds the model's
  // values at each of its heads of each mapped block, and zeros everywhere else.
  kv_test::rng_t rng(Catch::rngSeed() + 22);
  const auto value = [](std::size_t l, std::size_t i, std::uint32_t block, std::uint32_t token,
                        std::uint32_t head, std::uint64_t x) {
    std::uint64_t h = 1469598103934665603ull;
    for (std::uint64_t v : {std::uint64_t{l}, std::uint64_t{i}, std::uint64_t{block},
                            std::uint64_t{token}, std::uint64_t{head}, x}) {
      h = (h ^ v) * 1099511628211ull;
    }
    return static_cast<std::byte>((h >> 29) | 1);  // never 0, so a missed byte shows
  };
  for (int round = 0; round < 200; ++round) {
    const auto k = static_cast<kv_test::kind>(round % 3);
    const kv_test::model m = kv_test::random_model(rng, k);
    const auto [src_size, dst_size] =
        tp_pairs[kv_test::uniform(rng, 0, std::size(tp_pairs) - 1)];
    const kv::tp_shard dst_tp{kv_test::uniform(rng, 0, dst_size - 1), dst_size};
    std::vector<std::uint32_t> src_blocks, dst_blocks;
    std::vector<table> tables;
    for (std::uint32_t g = 0; g < m.groups; ++g) {
      src_blocks.push_back(kv_test::uniform(rng, 4, 16));
      dst_blocks.push_back(kv_test::uniform(rng, 4, 16));
      tables.push_back(kv_test::random_table(rng, src_blocks[g], dst_blocks[g]));
    }
    const auto pairs = kv_test::pairs_of(tables);
    const kv::cache_layout dst = kv_test::random_layout(rng, m, dst_size, dst_blocks);
    INFO("round " << round << ": " << kv_test::name(k) << ", " << src_size << " -> rank "
                  << dst_tp.rank << " of " << dst_size);

    kv_test::memory got = kv_test::zeroed(dst);
    std::uint64_t bytes = 0;
    for (std::uint32_t s : kv::tp_source_ranks(dst, src_size, dst_tp)) {
      const kv::tp_shard src_tp{s, src_size};
      // Each source rank has a layout of its own (same model, its own strides and regions).
      const kv::cache_layout src = kv_test::random_layout(rng, m, src_size, src_blocks);
      kv_test::memory from = kv_test::random_bytes(rng, src);
      for (std::size_t l = 0; l < src.layers.size(); ++l) {
        const kv::layer_layout& layer = src.layers[l];
        for (std::size_t i = 0; i < layer.tensors.size(); ++i) {
          const kv::tensor_layout& t = layer.tensors[i];
          const std::uint32_t first =
              layer.heads_sharded ? kv_test::first_head(layer.total_heads, s, src_size) : 0;
          for (std::uint32_t b = 0; b < t.blocks; ++b) {
            for (std::uint32_t tok = 0; tok < t.block_size; ++tok) {
              for (std::uint32_t h = 0; h < t.heads; ++h) {
                for (std::uint64_t x = 0; x < t.head_bytes(); ++x) {
                  from[t.region][kv_test::address(t, b, tok, h) + x] =
                      value(l, i, b, tok, first + h, x);
                }
              }
            }
          }
        }
      }
      const kv::transfer_plan plan = kv::plan_transfer(src, src_tp, dst, dst_tp, pairs);
      bytes += plan.bytes;
      kv::apply_plan(plan, kv_test::const_spans(from), kv_test::spans(got));
    }
    kv_test::memory want = kv_test::zeroed(dst);
    std::uint64_t want_bytes = 0;
    kv_test::for_each_vector(
        dst, src_size, dst_tp, tables,
        [&](std::size_t l, std::size_t i, std::uint32_t sb, std::uint32_t db, std::uint32_t tok,
            std::uint32_t g, std::uint32_t, std::uint32_t hd) {
          const kv::tensor_layout& t = dst.layers[l].tensors[i];
          for (std::uint64_t x = 0; x < t.head_bytes(); ++x) {
            want[t.region][kv_test::address(t, db, tok, hd) + x] = value(l, i, sb, tok, g, x);
          }
          want_bytes += t.head_bytes();
        });
    REQUIRE(kv_test::first_difference(got, want).empty());
    REQUIRE(bytes == want_bytes);  // no byte written by two sources
  }
}

TEST_CASE("kv plan: contiguous runs become one range per run and tensor; heads a reader takes "
          "from a head-major block are one range per block",
          "[kv]") {
  const kv::paged_shape shape{.layers = 4, .blocks = 64, .block_size = 16, .total_heads = 8,
                              .tp_size = 1, .head_size = 128, .element_size = 2};
  auto half = shape;
  half.tp_size = 2;
  constexpr std::uint64_t block = 16 * 8 * 128 * 2;
  // Two runs: 10 blocks (3..12 -> 20..29), then 5 blocks (40..44 -> 0..4).
  std::vector<std::uint32_t> src = ids(3, 10), dst = ids(20, 10);
  for (std::uint32_t v : ids(40, 5)) src.push_back(v);
  for (std::uint32_t v : ids(0, 5)) dst.push_back(v);
  const std::vector<kv::block_pairs> runs{{src, dst}};
  const std::size_t pairs = src.size();

  SECTION("K and V split, same TP: one range per run per tensor") {
    const auto l = kv::cache_layout::kv_split(shape);
    const kv::transfer_planner planner(l, {}, l, {});
    CHECK(planner.ranges_per_block(0) == 2);
    const auto p = planner.plan(runs);
    for (std::size_t i = 0; i < 4; ++i) CHECK(ranges_in(p, i) == 4);
    CHECK(p.ranges == 16);
    CHECK(p.bytes == 4 * 2 * pairs * block);
    CHECK(p.layers[0][0].length % block == 0);
  }
  SECTION("K and V interleaved per block, same TP: K and V of a run are one range") {
    const auto l = kv::cache_layout::kv_interleaved(shape);
    const kv::transfer_planner planner(l, {}, l, {});
    CHECK(planner.ranges_per_block(0) == 1);
    const auto p = planner.plan(runs);
    CHECK(ranges_in(p, 0) == 2);
    CHECK(p.layers[0][0].length + p.layers[0][1].length == 2 * pairs * block);
  }
  SECTION("cross-layer, same TP: a layer's K and V of a block are one range") {
    const auto l = kv::cache_layout::cross_layer(shape);
    const auto p = kv::plan_transfer(l, {}, l, {}, runs);
    CHECK(ranges_in(p, 3) == pairs);
    CHECK(p.layers[3][0].length == 2 * block);
  }
  SECTION("MLA: one range per run, from one source rank") {
    const auto l = kv::cache_layout::mla(shape);
    // Destination rank 1 of 2 reads its latent from source rank 1 of 4, and from no other.
    const auto p = kv::plan_transfer(l, {1, 4}, l, {1, 2}, runs);
    CHECK(ranges_in(p, 0) == 2);
    CHECK(kv::plan_transfer(l, {0, 4}, l, {1, 2}, runs).ranges == 0);
    CHECK(kv::plan_transfer(l, {3, 4}, l, {1, 2}, runs).ranges == 0);
  }
  SECTION("head-major, TP 2 -> 1: the source's half of the heads is one range per block") {
    const auto src_layout = kv::cache_layout::head_major(half);
    const auto dst_layout = kv::cache_layout::head_major(shape);
    for (std::uint32_t r = 0; r < 2; ++r) {
      const auto p = kv::plan_transfer(src_layout, {r, 2}, dst_layout, {}, runs);
      CHECK(ranges_in(p, 0) == 2 * pairs);
      CHECK(p.layers[0][0].length == block / 2);
    }
  }
  SECTION("head-major, TP 1 -> 2: each destination rank reads its half, one range per block") {
    const auto src_layout = kv::cache_layout::head_major(shape);
    const auto dst_layout = kv::cache_layout::head_major(half);
    const auto p = kv::plan_transfer(src_layout, {}, dst_layout, {1, 2}, runs);
    // Contiguous on the destination across a run, but not on the source, whose blocks hold every
    // head: one range per block.
    CHECK(ranges_in(p, 0) == 2 * pairs);
    CHECK(p.layers[0][0].length == block / 2);
  }
  SECTION("token-major, TP 2 -> 1: one range per token, the layout's cost") {
    const auto src_layout = kv::cache_layout::kv_split(half);
    const auto dst_layout = kv::cache_layout::kv_split(shape);
    const auto p = kv::plan_transfer(src_layout, {1, 2}, dst_layout, {}, runs);
    CHECK(ranges_in(p, 0) == 2 * pairs * 16);
    CHECK(p.layers[0][0].length == 4 * 128 * 2);
  }
  SECTION("shuffled ids: one range per block and tensor") {
    const std::vector<std::uint32_t> s{9, 2, 30, 7, 8}, d{1, 50, 3, 12, 11};
    const std::vector<kv::block_pairs> shuffled{{s, d}};
    const auto l = kv::cache_layout::kv_split(shape);
    CHECK(ranges_in(kv::plan_transfer(l, {}, l, {}, shuffled), 0) == 10);
  }
}

TEST_CASE("kv plan: planning again into the same plan gives the same plan", "[kv]") {
  const auto l = kv::cache_layout::kv_split({.layers = 2, .blocks = 32, .block_size = 4,
                                             .total_heads = 2, .head_size = 8});
  const kv::transfer_planner planner(l, {}, l, {});
  const auto a = ids(0, 8), b = ids(16, 8);
  kv::transfer_plan p;
  planner.plan(std::vector<kv::block_pairs>{{a, b}}, p);
  const kv::transfer_plan first = p;
  planner.plan(std::vector<kv::block_pairs>{{b, a}}, p);
  planner.plan(std::vector<kv::block_pairs>{{a, b}}, p);
  CHECK(p.layers == first.layers);
  CHECK(p.ranges == first.ranges);
  CHECK(p.bytes == first.bytes);
  planner.plan(std::vector<kv::block_pairs>{{}}, p);  // a request with no blocks
  CHECK(p.ranges == 0);
  CHECK(p.bytes == 0);
  CHECK(p.layers.size() == 2);
  CHECK(p.layers[1].empty());
}

TEST_CASE("kv plan: layouts that cannot exchange blocks are refused, naming what differs", "[kv]") {
  const kv::paged_shape shape{.layers = 2, .blocks = 8, .block_size = 16, .total_heads = 4,
                              .head_size = 64, .element_size = 2};
  const auto base = kv::cache_layout::kv_split(shape);
  const auto refused = [&](const kv::cache_layout& other, const char* says,
                           kv::errc code = kv::errc::incompatible_layouts,
                           kv::tp_shard other_tp = {}) {
    CHECK_THAT(error_of([&] { kv::check_compatible(base, {}, other, other_tp); }, code),
               Catch::Contains(says));
    CHECK_THAT(error_of([&] { (void)kv::transfer_planner(base, {}, other, other_tp); }, code),
               Catch::Contains(says));
  };
  auto s = shape;
  s.head_size = 128;
  refused(kv::cache_layout::kv_split(s), "layer 0 tensor 0 head_size: source 64, destination 128");
  s = shape;
  s.element_size = 1;
  refused(kv::cache_layout::kv_split(s), "element_size: source 2, destination 1");
  s = shape;
  s.block_size = 32;
  refused(kv::cache_layout::kv_split(s), "block_size: source 16, destination 32");
  s = shape;
  s.layers = 3;
  refused(kv::cache_layout::kv_split(s), "layer count: source 2, destination 3");
  s = shape;
  s.total_heads = 8;
  s.tp_size = 2;
  refused(kv::cache_layout::kv_split(s), "layer 0 total_heads: source 4, destination 8",
          kv::errc::incompatible_layouts, {1, 2});
  refused(kv::cache_layout::mla(shape), "layer 0 heads_sharded: source 1, destination 0");
  auto other = base;
  other.layers[1].group = 1;
  refused(other, "layer 1 group: source 0, destination 1");
  other = base;
  other.layers[1].tensors.pop_back();
  refused(other, "layer 1 tensor count: source 2, destination 1");
  // Strides, offsets, regions and block counts may differ.
  s = shape;
  s.blocks = 100;
  s.region_per_layer = false;
  CHECK_NOTHROW(kv::check_compatible(base, {}, kv::cache_layout::head_major(s), {}));
  // Each side is checked, and said which.
  other = base;
  other.layers[0].tensors[0].blocks = 0;
  refused(other, "destination cache layout layer 0 tensor 0: blocks is 0", kv::errc::bad_layout);
  CHECK_THAT(error_of([&] { kv::check_compatible(base, {0, 3}, base, {}); },
                      kv::errc::bad_parallelism),
             Catch::Contains("source cache layout layer 0 has 4 heads, which tensor-parallel size "
                             "3 cannot split"));
  CHECK_THAT(error_of([&] { kv::check_compatible(base, {0, 2}, base, {}); },
                      kv::errc::bad_parallelism),
             Catch::Contains("source cache layout layer 0 tensor 0: heads is 4, but a rank of 2 "
                             "holds 2"));
}

TEST_CASE("kv plan: a block table that does not fit the layouts is refused, naming group and pair",
          "[kv]") {
  auto l = kv::cache_layout::kv_split({.layers = 2, .blocks = 8, .block_size = 4, .head_size = 8});
  l.append(kv::cache_layout::recurrent_state({.layers = 1, .blocks = 3, .group = 1,
                                              .first_region = 2}));
  const kv::transfer_planner planner(l, {}, l, {});
  CHECK(planner.group_count() == 2);
  CHECK(planner.layer_count() == 3);
  const std::vector<std::uint32_t> a{0, 1, 7}, b{2, 3}, c{0, 8, 1}, state{2}, past{3};
  const auto refused = [&](std::vector<kv::block_pairs> groups, const char* says) {
    CHECK_THAT(error_of([&] { (void)planner.plan(groups); }, kv::errc::bad_block_table),
               Catch::Contains(says));
  };
  refused({{a, a}}, "got 1 block tables; the layouts have 2 groups");
  refused({{a, b}, {state, state}}, "group 0 has 3 source block ids but 2 destination block ids");
  refused({{c, a}, {state, state}}, "group 0 pair 1: source block 8 is not below the source's 8");
  refused({{a, c}, {state, state}}, "group 0 pair 1: destination block 8 is not below");
  refused({{a, a}, {past, state}}, "group 1 pair 0: source block 3 is not below the source's 3");
  CHECK(planner.plan(std::vector<kv::block_pairs>{{a, a}, {state, state}}).ranges > 0);
}

TEST_CASE("kv plan: apply_plan refuses a range outside the memory given for its region", "[kv]") {
  kv::transfer_plan p;
  p.layers.push_back(
      {{.src_region = 0, .dst_region = 0, .src_offset = 0, .dst_offset = 0, .length = 8},
       {.src_region = 1, .dst_region = 0, .src_offset = 4, .dst_offset = 8, .length = 8}});
  std::vector<std::byte> a(16, std::byte{1}), b(12, std::byte{2}), c(16);
  using sources = std::vector<std::span<const std::byte>>;
  using targets = std::vector<std::span<std::byte>>;
  kv::apply_plan(p, sources{a, b}, targets{c});
  std::vector<std::byte> want(16, std::byte{1});
  std::fill(want.begin() + 8, want.end(), std::byte{2});
  CHECK(c == want);

  std::vector<std::byte> untouched(16);
  b.resize(11);
  CHECK_THAT(
      error_of(
          [&] {
            kv::apply_plan(p, sources{a, b}, targets{untouched});
          },
          kv::errc::region_out_of_range),
      Catch::Contains("layer 0 range 1 needs bytes [4, 12) of source region 1, which has 11"));
  CHECK(untouched == std::vector<std::byte>(16));  // range 0 was not copied either
  CHECK_THAT(error_of([&] { kv::apply_plan(p, sources{a}, targets{untouched}); },
                      kv::errc::region_out_of_range),
             Catch::Contains("reads source region 1, but 1 source regions were given"));
  b.resize(12);
  p.layers[0][1].dst_offset = 9;
  CHECK_THAT(error_of([&] { kv::apply_plan(p, sources{a, b}, targets{untouched}); },
                      kv::errc::region_out_of_range),
             Catch::Contains("needs bytes [9, 17) of destination region 0, which has 16"));
}

// Cache layouts as data: the named constructors build what their shapes say, check() accepts
// every sound layout and refuses every unsound one with a message naming the layer, the tensor and
// the field, and no layout it accepts lets two elements share a byte.

#include <catch2/catch.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <set>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include <ferry/kv/layout.hpp>

#include "kv/random_layouts.hpp"

namespace kv = ferry::kv;

namespace {

// The layout's check() error: its code and message ("" and no code when it passes).
std::pair<std::error_code, std::string> check_of(const kv::cache_layout& l) {
  try {
    l.check();
  } catch (const std::system_error& e) {
    return {e.code(), e.what()};
  }
  return {};
}

kv::cache_layout one_tensor(kv::tensor_layout t) {
  kv::cache_layout l;
  l.layers.push_back({0, t.heads, true, {t}});
  return l;
}

// 4 blocks of 2 tokens of 2 heads of 4 fp16 elements, token-major, packed: 64 bytes a block.
kv::tensor_layout small() {
  return {.region = 0, .offset = 0, .element_size = 2, .blocks = 4, .block_size = 2, .heads = 2,
          .head_size = 4, .block_stride = 32, .token_stride = 16, .head_stride = 8};
}

}  // namespace

TEST_CASE("kv layout: the named constructors build the layouts their shapes name", "[kv]") {
  const kv::paged_shape shape{.layers = 3, .blocks = 10, .block_size = 16, .total_heads = 8,
                              .tp_size = 2, .head_size = 128, .element_size = 2};
  constexpr std::uint64_t vector = 256;               // 128 fp16 elements
  constexpr std::uint64_t block = 16 * 4 * vector;    // 16 tokens x 4 heads (8 over TP 2)

  SECTION("K and V split: [2, blocks, block_size, heads, head_size], a region per layer") {
    const auto l = kv::cache_layout::kv_split(shape);
    REQUIRE(l.layers.size() == 3);
    for (std::uint32_t i = 0; i < 3; ++i) {
      const auto& layer = l.layers[i];
      CHECK(layer.total_heads == 8);
      CHECK(layer.heads_sharded);
      REQUIRE(layer.tensors.size() == 2);
      CHECK(layer.tensors[0] == kv::tensor_layout{i, 0, 2, 10, 16, 4, 128, block, 4 * vector,
                                                  vector});
      CHECK(layer.tensors[1].offset == 10 * block);
      CHECK(l.bytes_needed(i) == 20 * block);
    }
    CHECK(l.region_count() == 3);
    CHECK(l.group_count() == 1);
    CHECK(l.bytes_needed(3) == 0);
  }
  SECTION("K and V interleaved per block: [blocks, 2, block_size, heads, head_size]") {
    const auto l = kv::cache_layout::kv_interleaved(shape);
    CHECK(l.layers[0].tensors[0].block_stride == 2 * block);
    CHECK(l.layers[0].tensors[1].offset == block);
    CHECK(l.bytes_needed(0) == 20 * block);
  }
  SECTION("head-major blocks: [blocks, heads, block_size, head_size] for K and for V") {
    const auto l = kv::cache_layout::head_major(shape);
    const auto& k = l.layers[1].tensors[0];
    CHECK(k.head_stride == 16 * vector);
    CHECK(k.token_stride == vector);
    CHECK(k.block_stride == block);
    CHECK(l.layers[1].tensors[1].offset == 10 * block);
  }
  SECTION("MLA: one latent per token, the same on every rank") {
    auto s = shape;
    s.head_size = 576;
    s.region_per_layer = false;
    const auto l = kv::cache_layout::mla(s);
    REQUIRE(l.layers[2].tensors.size() == 1);
    CHECK_FALSE(l.layers[2].heads_sharded);
    CHECK(l.layers[2].total_heads == 1);
    CHECK(l.layers[2].tensors[0].heads == 1);
    CHECK(l.layers[2].tensors[0].block_stride == 16 * 576 * 2);
    CHECK(l.layers[2].tensors[0].offset == 2 * 10 * 16 * 576 * 2);  // layers back to back
    CHECK(l.region_count() == 1);
    l.check(kv::tp_shard{3, 4});  // any rank holds the whole latent
  }
  SECTION("cross-layer: [blocks, layers, 2, block_size, heads, head_size] in one region") {
    const auto l = kv::cache_layout::cross_layer(shape);
    for (std::uint32_t i = 0; i < 3; ++i) {
      CHECK(l.layers[i].tensors[0].block_stride == 6 * block);
      CHECK(l.layers[i].tensors[0].offset == 2 * i * block);
      CHECK(l.layers[i].tensors[1].offset == (2 * i + 1) * block);
    }
    CHECK(l.region_count() == 1);
    CHECK(l.bytes_needed(0) == 10 * 6 * block);
  }
  SECTION("hybrid: attention layers beside recurrent-state layers with their own block numbering") {
    auto l = kv::cache_layout::kv_split(shape);
    l.append(kv::cache_layout::recurrent_state({.layers = 2, .blocks = 5, .total_heads = 16,
                                                .tp_size = 2, .head_sizes = {3 * 64, 64 * 128},
                                                .group = 1, .first_region = 3}));
    l.check(kv::tp_shard{1, 2});
    REQUIRE(l.layers.size() == 5);
    CHECK(l.group_count() == 2);
    const auto& conv = l.layers[3].tensors[0];
    const auto& ssm = l.layers[3].tensors[1];
    CHECK(conv.region == 3);
    CHECK(l.layers[4].tensors[0].region == 4);
    CHECK(conv.heads == 8);
    CHECK(conv.block_size == 1);
    CHECK(conv.block_stride == 8 * 3 * 64 * 2);
    CHECK(ssm.offset == 5 * conv.block_stride);
    CHECK(l.bytes_needed(3) == 5 * 8 * (3 * 64 + 64 * 128) * 2);
  }
  SECTION("every constructor's layout passes check(tp) for its rank") {
    for (std::uint32_t r = 0; r < 2; ++r) {
      kv::cache_layout::kv_split(shape).check({r, 2});
      kv::cache_layout::kv_interleaved(shape).check({r, 2});
      kv::cache_layout::head_major(shape).check({r, 2});
      kv::cache_layout::cross_layer(shape).check({r, 2});
    }
  }
}

TEST_CASE("kv layout: heads are split evenly, or replicated when there are fewer than ranks",
          "[kv]") {
  CHECK(kv::heads_held(8, {0, 1}) == kv::head_range{0, 8});
  CHECK(kv::heads_held(8, {1, 2}) == kv::head_range{4, 4});
  CHECK(kv::heads_held(8, {7, 8}) == kv::head_range{7, 1});
  CHECK(kv::heads_held(2, {0, 8}) == kv::head_range{0, 1});
  CHECK(kv::heads_held(2, {3, 8}) == kv::head_range{0, 1});
  CHECK(kv::heads_held(2, {4, 8}) == kv::head_range{1, 1});
  CHECK(kv::heads_held(1, {5, 8}) == kv::head_range{0, 1});
  const auto refused = [](std::uint32_t heads, kv::tp_shard tp, const char* says) {
    INFO(heads << " heads, rank " << tp.rank << " of " << tp.size);
    try {
      (void)kv::heads_held(heads, tp);
      FAIL("accepted");
    } catch (const std::system_error& e) {
      CHECK(e.code() == kv::errc::bad_parallelism);
      CHECK_THAT(e.what(), Catch::Contains(says));
    }
  };
  refused(8, {0, 3}, "tensor-parallel size 3 does not divide 8 heads");
  refused(4, {0, 6}, "4 heads do not divide tensor-parallel size 6");
  refused(8, {2, 2}, "rank 2 is not below its size 2");
  refused(8, {0, 0}, "rank 0 is not below its size 0");
  refused(0, {0, 1}, "0 heads");
}

TEST_CASE("kv layout: check() refuses a bad layout with a message naming the layer, tensor and "
          "field",
          "[kv]") {
  const auto refused = [](const kv::cache_layout& l, const char* says) {
    const auto [code, what] = check_of(l);
    INFO(what);
    CHECK(code == kv::errc::bad_layout);
    CHECK_THAT(what, Catch::Contains(says));
  };
  CHECK(check_of(one_tensor(small())).first == std::error_code{});

  SECTION("zero and out-of-bound sizes") {
    auto t = small();
    t.blocks = 0;
    refused(one_tensor(t), "layer 0 tensor 0: blocks is 0");
    t = small();
    t.element_size = 0;
    refused(one_tensor(t), "element_size is 0");
    t.element_size = 17;
    refused(one_tensor(t), "element_size is 17, over the limit 16");
    t = small();
    t.block_size = 0;
    refused(one_tensor(t), "block_size is 0");
    t = small();
    t.head_size = 0;
    refused(one_tensor(t), "head_size is 0");
    t = small();
    t.heads = 0;
    refused(one_tensor(t), "heads is 0");
    t = small();
    t.region = 4096;
    refused(one_tensor(t), "region is 4096, not below 4096");
    t = small();
    t.block_size = 4096;
    t.heads = 512;
    auto l = one_tensor(t);
    l.layers[0].total_heads = 512;
    refused(l, "block_size 4096 times heads 512 is over the limit");
  }
  SECTION("strides that let elements overlap name the stride") {
    auto t = small();
    t.head_stride = 7;  // a head is 8 bytes
    refused(one_tensor(t), "head_stride 7 is smaller than the 8 bytes");
    t = small();
    t.token_stride = 12;  // two heads span 16 bytes
    refused(one_tensor(t), "token_stride 12 is smaller than the 16 bytes");
    t = small();
    t.block_stride = 31;
    refused(one_tensor(t), "block_stride 31 is smaller than the 32 bytes");
    t = small();
    t.token_stride = 8;  // the same as head_stride: token 1 head 0 is token 0 head 1
    refused(one_tensor(t), "is smaller than");
    t = small();
    t.block_stride = 0;
    refused(one_tensor(t), "block_stride 0 is smaller than");
  }
  SECTION("a stride whose count is 1 is never used") {
    auto t = small();
    t.blocks = 1;
    t.block_stride = 0;
    CHECK(check_of(one_tensor(t)).first == std::error_code{});
    t.heads = 1;
    t.head_stride = 3;
    auto l = one_tensor(t);
    CHECK(check_of(l).first == std::error_code{});
  }
  SECTION("arithmetic past 2^64 bytes") {
    auto t = small();
    t.offset = std::numeric_limits<std::uint64_t>::max() - 100;
    refused(one_tensor(t), "offset 18446744073709551515 puts the tensor past 2^64 bytes");
    t = small();
    t.blocks = std::numeric_limits<std::uint32_t>::max();
    t.block_stride = std::uint64_t{1} << 33;
    refused(one_tensor(t), "block_stride 8589934592 puts the tensor past 2^64 bytes");
  }
  SECTION("two tensors of one group sharing bytes of a region") {
    kv::cache_layout l = one_tensor(small());
    auto v = small();
    v.offset = 4 * 32 - 1;  // its first byte is K's last
    l.layers[0].tensors.push_back(v);
    refused(l, "layer 0 tensor 0 and layer 0 tensor 1 share bytes of region 0");
    l.layers[0].tensors[1].offset = 4 * 32;
    CHECK(check_of(l).first == std::error_code{});
    // Interleaved per block: V inside K's block stride, off by one byte.
    auto k = small();
    k.block_stride = 64;
    v = k;
    v.offset = 31;
    l.layers[0].tensors = {k, v};
    refused(l, "share bytes of region 0");
    l.layers[0].tensors[1].offset = 32;
    CHECK(check_of(l).first == std::error_code{});
    // Another layer in the same region and group.
    l.layers.push_back(l.layers[0]);
    refused(l, "layer 0 tensor 0 and layer 1 tensor 0 share bytes of region 0");
    // In another region, or in another group (a hybrid allocator's shared pool), they may.
    l.layers[1].group = 1;
    CHECK(check_of(l).first == std::error_code{});
    l.layers[1].group = 0;
    for (auto& t : l.layers[1].tensors) t.region = 1;
    CHECK(check_of(l).first == std::error_code{});
  }
  SECTION("counts: layers, tensors, groups, heads") {
    refused(kv::cache_layout{}, "has no layers");
    auto l = one_tensor(small());
    l.layers[0].tensors.clear();
    refused(l, "layer 0 has no tensors");
    l = one_tensor(small());
    l.layers[0].group = 64;
    refused(l, "layer 0 group is 64, not below 64");
    l = one_tensor(small());
    l.layers[0].total_heads = 0;
    refused(l, "layer 0 total_heads is 0");
    l = one_tensor(small());
    l.layers[0].total_heads = 1;
    refused(l, "layer 0 tensor 0: heads is 2, more than the layer's 1 total_heads");
    l = one_tensor(small());
    l.layers[0].heads_sharded = false;
    l.layers[0].total_heads = 4;
    refused(l, "heads is 2, but its layer is not sharded");
    l = one_tensor(small());
    auto t = small();
    t.offset = 1000;
    t.heads = 1;
    l.layers[0].tensors.push_back(t);
    refused(l, "layer 0 tensor 1: heads is 1, but tensor 0 of the layer holds 2");
    t.heads = 2;
    t.block_size = 1;
    l.layers[0].tensors[1] = t;
    refused(l, "layer 0 tensor 1: block_size is 1, but tensor 0 of the layer has 2");
    l = one_tensor(small());
    for (int i = 0; i < 64; ++i) {
      auto more = small();
      more.region = 1 + static_cast<std::uint32_t>(i);
      l.layers[0].tensors.push_back(more);
    }
    refused(l, "layer 0 has 65 tensors, over the limit 64");
    l = one_tensor(small());
    l.layers.resize(1025, l.layers[0]);
    for (std::uint32_t i = 0; i < l.layers.size(); ++i) l.layers[i].tensors[0].region = i % 4000;
    refused(l, "has 1025 layers, over the limit 1024");
    l.layers.resize(200);
    for (auto& layer : l.layers) layer.tensors.resize(41, layer.tensors[0]);
    refused(l, "has 8200 tensors, over the limit 8192");
  }
  SECTION("check(tp): each sharded layer holds its rank's share of the heads") {
    auto l = one_tensor(small());  // 2 heads
    l.layers[0].total_heads = 8;
    l.check({0, 4});
    try {
      l.check({0, 2});
      FAIL("accepted");
    } catch (const std::system_error& e) {
      CHECK(e.code() == kv::errc::bad_parallelism);
      CHECK_THAT(e.what(), Catch::Contains("layer 0 tensor 0: heads is 2, but a rank of 2 holds 4 "
                                           "of the layer's 8 heads"));
    }
    try {
      l.check({0, 3});
      FAIL("accepted");
    } catch (const std::system_error& e) {
      CHECK(e.code() == kv::errc::bad_parallelism);
      CHECK_THAT(e.what(), Catch::Contains("layer 0 has 8 heads, which tensor-parallel size 3 "
                                           "cannot split"));
    }
    CHECK_THROWS_WITH(l.check({4, 4}), Catch::Contains("rank 4, not below its size 4"));
  }
  SECTION("a named constructor refuses a shape it cannot build") {
    CHECK_THROWS_WITH(kv::cache_layout::kv_split({.layers = 2, .blocks = 0}),
                      Catch::Contains("layer 0 tensor 0: blocks is 0"));
    CHECK_THROWS_WITH(kv::cache_layout::kv_split({.total_heads = 8, .tp_size = 3}),
                      Catch::Contains("does not divide 8 heads"));
    CHECK_THROWS_WITH(kv::cache_layout::cross_layer({.layers = 2000}),
                      Catch::Contains("over the limit 1024"));
    CHECK_THROWS_WITH(
        kv::cache_layout::kv_split({.layers = 2, .blocks = 0xffffffffu, .block_size = 65536,
                                    .total_heads = 16, .head_size = 1u << 24, .element_size = 16}),
        Catch::Contains("more than 2^64 bytes"));
  }
}

TEST_CASE("kv layout: no layout check() accepts lets two elements of one group share a byte",
          "[kv]") {
  // Small random tensors, two at a time in one region: whenever check() accepts the pair, every
  // byte of every element is counted and none is counted twice.
  kv_test::rng_t rng(Catch::rngSeed() + 11);
  int accepted = 0;
  int refused = 0;
  for (int round = 0; round < 3000; ++round) {
    kv::cache_layout l;
    l.layers.push_back({0, 2, true, {}});
    for (int i = 0; i < 2; ++i) {
      kv::tensor_layout t;
      t.element_size = kv_test::uniform(rng, 1, 2);
      t.blocks = kv_test::uniform(rng, 1, 4);
      t.block_size = kv_test::uniform(rng, 1, 3);
      t.heads = 2;
      t.head_size = kv_test::uniform(rng, 1, 3);
      t.offset = kv_test::uniform(rng, 0, 60);
      if (kv_test::uniform(rng, 0, 2) == 0) {
        t.block_stride = kv_test::uniform(rng, 0, 60);
        t.token_stride = kv_test::uniform(rng, 0, 20);
        t.head_stride = kv_test::uniform(rng, 0, 20);
      } else {
        // Sound strides, nested in a random order with random padding.
        std::array<std::uint64_t, 3> counts{t.blocks, t.block_size, t.heads};
        std::array<std::uint64_t*, 3> strides{&t.block_stride, &t.token_stride, &t.head_stride};
        for (std::size_t j = 3; j-- > 1;) {
          const std::size_t k = kv_test::uniform(rng, 0, static_cast<std::uint32_t>(j));
          std::swap(counts[j], counts[k]);
          std::swap(strides[j], strides[k]);
        }
        (void)kv_test::nest(rng, t.head_bytes(), counts, strides);
      }
      if (i == 1 && kv_test::uniform(rng, 0, 1) == 1) {
        // Often the same block stride as the first, as interleaved layouts have.
        t.block_stride = l.layers[0].tensors[0].block_stride;
        t.block_size = l.layers[0].tensors[0].block_size;
      }
      t.block_size = l.layers[0].tensors.empty() ? t.block_size : l.layers[0].tensors[0].block_size;
      l.layers[0].tensors.push_back(t);
    }
    if (!check_of(l).second.empty()) {
      ++refused;
      continue;
    }
    ++accepted;
    std::set<std::uint64_t> bytes;
    std::size_t counted = 0;
    for (const auto& t : l.layers[0].tensors) {
      for (std::uint32_t b = 0; b < t.blocks; ++b) {
        for (std::uint32_t tok = 0; tok < t.block_size; ++tok) {
          for (std::uint32_t h = 0; h < t.heads; ++h) {
            for (std::uint64_t x = 0; x < t.head_bytes(); ++x) {
              bytes.insert(kv_test::address(t, b, tok, h) + x);
              ++counted;
            }
          }
        }
      }
    }
    INFO("round " << round);
    REQUIRE(bytes.size() == counted);
  }
  CHECK(accepted > 300);
  CHECK(refused > 300);
}

TEST_CASE("kv layout: random layouts of every kind pass check(tp)", "[kv]") {
  kv_test::rng_t rng(Catch::rngSeed() + 12);
  for (int round = 0; round < 300; ++round) {
    const auto k = static_cast<kv_test::kind>(round % 3);
    const kv_test::model m = kv_test::random_model(rng, k);
    const std::uint32_t tp = kv_test::pick(rng, {1u, 2u, 4u, 8u});
    std::vector<std::uint32_t> blocks{kv_test::uniform(rng, 1, 20), kv_test::uniform(rng, 1, 20)};
    const kv::cache_layout l = kv_test::random_layout(rng, m, tp, blocks);
    INFO("round " << round << " " << kv_test::name(k) << " tp " << tp);
    l.check({tp - 1, tp});
  }
}

TEST_CASE("kv layout: the codes layouts, plans and handshakes raise say what they mean", "[kv]") {
  const std::pair<kv::errc, const char*> codes[] = {
      {kv::errc::bad_layout, "cache layout is not valid"},
      {kv::errc::bad_parallelism, "tensor-parallel rank and size cannot split the layer's heads"},
      {kv::errc::incompatible_layouts, "cache layouts cannot exchange blocks"},
      {kv::errc::bad_block_table, "block table names a block outside its layout, or is malformed"},
      {kv::errc::region_out_of_range, "byte range falls outside the memory given for its region"},
      {kv::errc::bad_engine_description, "not a valid engine description"},
  };
  for (const auto& [code, text] : codes) {
    const std::error_code ec = code;
    CHECK(ec.category() == kv::error_category());
    CHECK(ec.message() == text);
  }
}

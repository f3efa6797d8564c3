// The handshake: an engine description survives encode and decode for every layout kind, and
// every malformed record (cut short anywhere, any bit flipped, counts past their limits, another
// magic or version, a description that fails its check) is refused with a message saying what was
// wrong, never a crash or an allocation sized by the peer.

#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <system_error>
#include <vector>

#include <ferry/kv/handshake.hpp>

#include "kv/random_layouts.hpp"

namespace kv = ferry::kv;

namespace {

using bytes = std::vector<std::byte>;

kv::engine_description describe(kv::cache_layout layout, kv::tp_shard tp = {}) {
  kv::engine_description d;
  d.engine_id = "prefill-0.rank-" + std::to_string(tp.rank);
  d.incarnation = 0x1122334455667788u;
  d.tp = tp;
  d.layout = std::move(layout);
  for (std::uint32_t r = 0; r < d.layout.region_count(); ++r) {
    bytes descriptor(5 + r % 3);
    for (std::size_t i = 0; i < descriptor.size(); ++i) {
      descriptor[i] = static_cast<std::byte>(r * 31 + i);
    }
    d.regions.push_back(descriptor);
  }
  return d;
}

// The decode error's message; "decoded" when the bytes were accepted.
std::string decode_error(std::span<const std::byte> b) {
  try {
    (void)kv::decode(b);
  } catch (const std::system_error& e) {
    if (e.code() != kv::errc::bad_engine_description) return std::string("wrong code: ") + e.what();
    return e.what();
  }
  return "decoded";
}

// The test's own statement of the record's frame: little-endian fields, the length at byte 8, an
// FNV-1a checksum of everything before the last four bytes.
std::uint32_t fnv1a(std::span<const std::byte> b) {
  std::uint32_t h = 2166136261u;
  for (std::byte x : b) {
    h ^= static_cast<std::uint32_t>(x);
    h *= 16777619u;
  }
  return h;
}

void put32(bytes& b, std::size_t at, std::uint32_t v) {
  for (std::size_t i = 0; i < 4; ++i) b[at + i] = static_cast<std::byte>((v >> (8 * i)) & 0xff);
}

std::uint32_t get32(const bytes& b, std::size_t at) {
  std::uint32_t v = 0;
  for (std::size_t i = 0; i < 4; ++i) v |= static_cast<std::uint32_t>(b[at + i]) << (8 * i);
  return v;
}

// Makes the length and the checksum right again after an edit.
bytes reseal(bytes b) {
  put32(b, 8, static_cast<std::uint32_t>(b.size()));
  put32(b, b.size() - 4, fnv1a(std::span(b).first(b.size() - 4)));
  return b;
}

// Where the fields of a description with a short id are (see the format in handshake.hpp).
constexpr std::size_t id_length_at = 12;

std::size_t layer_count_at(const kv::engine_description& d) {
  return id_length_at + 4 + d.engine_id.size() + 8 + 4 + 4;
}

constexpr std::size_t layer_head = 4 + 4 + 1 + 4;
constexpr std::size_t tensor_bytes = 4 + 8 + 4 * 5 + 8 * 3;

}  // namespace

TEST_CASE("kv handshake: every layout kind survives encode and decode", "[kv]") {
  const kv::paged_shape shape{.layers = 3, .blocks = 100, .block_size = 16, .total_heads = 8,
                              .tp_size = 2, .head_size = 128, .element_size = 2};
  std::vector<kv::engine_description> all{
      describe(kv::cache_layout::kv_split(shape), {1, 2}),
      describe(kv::cache_layout::kv_interleaved(shape), {0, 2}),
      describe(kv::cache_layout::head_major(shape), {1, 2}),
      describe(kv::cache_layout::mla({.layers = 61, .blocks = 1000, .head_size = 576}), {5, 8}),
      describe(kv::cache_layout::cross_layer(shape), {1, 2}),
      describe(kv::cache_layout::kv_split(shape).append(kv::cache_layout::recurrent_state(
                   {.layers = 4, .blocks = 30, .total_heads = 16, .tp_size = 2,
                    .head_sizes = {3 * 64, 64 * 128}, .group = 1, .first_region = 3})),
               {0, 2}),
  };
  kv_test::rng_t rng(Catch::rngSeed() + 31);
  for (int i = 0; i < 60; ++i) {
    const auto k = static_cast<kv_test::kind>(i % 3);
    const std::uint32_t tp = kv_test::pick(rng, {1u, 2u, 4u, 8u});
    all.push_back(describe(kv_test::random_layout(rng, kv_test::random_model(rng, k), tp,
                                                  {kv_test::uniform(rng, 1, 50),
                                                   kv_test::uniform(rng, 1, 50)}),
                           {kv_test::uniform(rng, 0, tp - 1), tp}));
  }
  for (std::size_t i = 0; i < all.size(); ++i) {
    INFO("description " << i);
    const bytes b = kv::encode(all[i]);
    const kv::engine_description back = kv::decode(b);
    CHECK(back == all[i]);
    CHECK(kv::encode(back) == b);
  }
  // Region descriptors are opaque bytes: empty ones and 64 KiB ones travel too.
  auto d = all[0];
  d.regions[0].clear();
  d.regions[1].assign(65536, std::byte{0xab});
  CHECK(kv::decode(kv::encode(d)) == d);
}

TEST_CASE("kv handshake: a record cut short at any length is refused", "[kv]") {
  const bytes b = kv::encode(describe(kv::cache_layout::kv_interleaved(
      {.layers = 2, .blocks = 8, .total_heads = 2, .head_size = 64})));
  for (std::size_t n = 0; n < b.size(); ++n) {
    INFO("first " << n << " of " << b.size() << " bytes");
    const std::string why = decode_error(std::span(b).first(n));
    if (n < 16) {
      CHECK_THAT(why, Catch::Contains("is " + std::to_string(n) +
                                      " bytes, shorter than its 16-byte frame"));
    } else {
      CHECK_THAT(why, Catch::Contains("says it is " + std::to_string(b.size()) + " bytes, but " +
                                      std::to_string(n) + " were given (truncated)"));
    }
  }
  bytes longer = b;
  longer.push_back(std::byte{0});
  CHECK_THAT(decode_error(longer), Catch::Contains("were given"));
}

TEST_CASE("kv handshake: any bit flipped is refused, naming the part it hit", "[kv]") {
  const bytes b = kv::encode(describe(kv::cache_layout::mla({.layers = 3, .blocks = 8,
                                                             .head_size = 32})));
  for (std::size_t at = 0; at < b.size(); ++at) {
    for (int bit = 0; bit < 8; ++bit) {
      bytes flipped = b;
      flipped[at] ^= static_cast<std::byte>(1 << bit);
      INFO("byte " << at << " bit " << bit);
      const std::string why = decode_error(flipped);
      if (at < 4) {
        CHECK_THAT(why, Catch::Contains("does not start with the magic"));
      } else if (at < 6) {
        CHECK_THAT(why, Catch::Contains("is of format version"));
      } else if (at < 8) {
        CHECK_THAT(why, Catch::Contains("reserved header field"));
      } else if (at < 12) {
        CHECK_THAT(why, Catch::Contains("says it is"));
      } else {
        CHECK_THAT(why, Catch::Contains("checksum does not match"));
      }
    }
  }
}

TEST_CASE("kv handshake: another magic or a later format version is refused as such", "[kv]") {
  const bytes b = kv::encode(describe(kv::cache_layout::kv_split({.blocks = 4})));
  bytes other = b;
  other[0] = std::byte{'X'};
  CHECK_THAT(decode_error(reseal(other)),
             Catch::Contains("engine description does not start with the magic \"FKVD\""));
  bytes later = b;
  later[4] = std::byte{2};
  // Checked before the checksum: a later format may frame its bytes differently.
  CHECK_THAT(decode_error(later), Catch::Contains("is of format version 2; this ferry reads "
                                                  "version 1"));
  later[4] = std::byte{0};
  CHECK_THAT(decode_error(reseal(later)), Catch::Contains("is of format version 0"));
  bytes huge = b;
  put32(huge, 8, (1u << 20) + 1);
  CHECK_THAT(decode_error(huge),
             Catch::Contains("says it is 1048577 bytes, over the limit 1048576"));
}

TEST_CASE("kv handshake: counts past their limits are refused before anything is allocated",
          "[kv]") {
  const kv::engine_description d =
      describe(kv::cache_layout::kv_split({.layers = 2, .blocks = 4, .head_size = 8}));
  const bytes b = kv::encode(d);
  const std::size_t layers_at = layer_count_at(d);
  const std::size_t tensors_at = layers_at + 4 + layer_head - 4;
  const std::size_t regions_at = layers_at + 4 + 2 * (layer_head + 2 * tensor_bytes);
  REQUIRE(get32(b, layers_at) == 2);
  REQUIRE(get32(b, tensors_at) == 2);
  REQUIRE(get32(b, regions_at) == 2);
  REQUIRE(get32(b, regions_at + 4) == 5);

  const auto patched = [&](std::size_t at, std::uint32_t v) {
    bytes p = b;
    put32(p, at, v);
    return decode_error(reseal(p));
  };
  CHECK_THAT(patched(id_length_at, 257),
             Catch::Contains("engine id length is 257, over the limit 256"));
  CHECK_THAT(patched(layers_at, 0xffffffffu),
             Catch::Contains("layer count is 4294967295, over the limit 1024"));
  // The region descriptors read as a third layer, whose tensor count is absurd.
  CHECK_THAT(patched(layers_at, 1024), Catch::Contains("layer 2 tensor count is"));
  CHECK_THAT(patched(tensors_at, 65), Catch::Contains("layer 0 tensor count is 65, over the limit "
                                                      "64"));
  CHECK_THAT(patched(regions_at, 4097),
             Catch::Contains("region count is 4097, over the limit 4096"));
  CHECK_THAT(patched(regions_at, 3), Catch::Contains("ends inside region 2 descriptor length"));
  CHECK_THAT(patched(regions_at + 4, 65537),
             Catch::Contains("region 0 descriptor length is 65537, over the limit 65536"));
  CHECK_THAT(patched(regions_at + 4, 65536),
             Catch::Contains("ends inside region 0 descriptor (byte"));
  CHECK_THAT(patched(regions_at, 1), Catch::Contains("has 10 bytes after its last field"));
  // Cut off inside the id, with the frame made right: 4 of its 16 bytes are there.
  bytes cut(b.begin(), b.begin() + 20);
  cut.resize(24);
  CHECK_THAT(decode_error(reseal(cut)), Catch::Contains("ends inside engine id (byte 16 of 20)"));
}

TEST_CASE("kv handshake: well-framed fields that make no valid description are refused by name",
          "[kv]") {
  const kv::engine_description d = describe(
      kv::cache_layout::kv_split({.layers = 2, .blocks = 4, .total_heads = 4, .tp_size = 2,
                                  .head_size = 8}),
      {1, 2});
  const bytes b = kv::encode(d);
  const std::size_t layers_at = layer_count_at(d);
  const std::size_t first_layer = layers_at + 4;
  const std::size_t first_tensor = first_layer + layer_head;
  const auto patched = [&](std::size_t at, std::uint32_t v, std::size_t width = 4) {
    bytes p = b;
    for (std::size_t i = 0; i < width; ++i)
      p[at + i] = static_cast<std::byte>((v >> (8 * i)) & 0xff);
    return decode_error(reseal(p));
  };
  CHECK_THAT(patched(first_layer + 8, 2, 1),
             Catch::Contains("layer 0 heads_sharded is 2, not 0 or 1"));
  CHECK_THAT(patched(first_tensor + 16, 0),  // blocks
             Catch::Contains("engine description cache layout layer 0 tensor 0: blocks is 0"));
  CHECK_THAT(patched(first_tensor, 7),  // region
             Catch::Contains("layer 0 tensor 0 is in region 7, but the description has 2 region "
                             "descriptors"));
  CHECK_THAT(patched(first_tensor + 12, 17), Catch::Contains("element_size is 17"));
  CHECK_THAT(patched(first_tensor + 40, 1),  // token_stride
             Catch::Contains("layer 0 tensor 0: token_stride 1 is smaller than"));
  CHECK_THAT(patched(layers_at - 8, 2),  // tp rank
             Catch::Contains("tensor-parallel rank 2 of size 2 is out of range"));
  CHECK_THAT(patched(layers_at - 4, 4),  // tp size: 4 heads over 4 ranks is 1 each, not 2
             Catch::Contains("layer 0 tensor 0: heads is 2, but a rank of 4 holds 1"));
  CHECK_THAT(patched(layers_at - 4, 3), Catch::Contains("tensor-parallel size 3 cannot split"));
  // The same checks refuse to encode what could not be decoded.
  auto bad = d;
  bad.engine_id.clear();
  CHECK_THROWS_WITH(kv::encode(bad), Catch::Contains("engine id is empty"));
  bad.engine_id.assign(257, 'x');
  CHECK_THROWS_WITH(kv::encode(bad), Catch::Contains("engine id is 257 bytes, over the limit 256"));
  bad = d;
  bad.regions.pop_back();
  CHECK_THROWS_WITH(kv::encode(bad), Catch::Contains("is in region 1, but the description has 1"));
  bad = d;
  bad.regions[0].resize(65537);
  CHECK_THROWS_WITH(kv::encode(bad), Catch::Contains("region 0 descriptor is 65537 bytes"));
  bad = d;
  bad.regions.resize(4097);
  CHECK_THROWS_WITH(kv::encode(bad), Catch::Contains("4097 region descriptors, over the limit"));
  bad = d;
  bad.tp = {0, 0};
  CHECK_THROWS_AS(kv::encode(bad), std::system_error);
  // A whole record over 1 MiB: 20 regions of 60 KiB.
  bad = d;
  bad.regions.assign(20, bytes(60000));
  CHECK_THROWS_WITH(kv::encode(bad), Catch::Contains("over the limit 1048576"));
}

TEST_CASE("kv handshake: random corruption is decoded to a valid description or refused cleanly",
          "[kv]") {
  // Edits that keep the frame right (resealed), so that they reach the field checks: random bytes
  // overwritten, bytes cut out or added. Whatever decodes must pass its own check and encode back
  // to the same bytes.
  kv_test::rng_t rng(Catch::rngSeed() + 32);
  const bytes b = kv::encode(describe(
      kv::cache_layout::kv_split({.layers = 3, .blocks = 6, .total_heads = 2, .head_size = 4})
          .append(kv::cache_layout::recurrent_state({.layers = 1, .blocks = 2, .group = 1,
                                                     .first_region = 3})),
      {}));
  int decoded = 0;
  for (int round = 0; round < 4000; ++round) {
    bytes p = b;
    const std::uint32_t edits = kv_test::uniform(rng, 1, 4);
    for (std::uint32_t e = 0; e < edits; ++e) {
      const std::uint32_t at = kv_test::uniform(rng, 12, static_cast<std::uint32_t>(p.size()) - 5);
      switch (kv_test::uniform(rng, 0, 3)) {
        case 0: p[at] = static_cast<std::byte>(rng()); break;
        case 1: p[at] = static_cast<std::byte>(kv_test::pick(rng, {0u, 1u, 0xffu, 0x40u})); break;
        case 2: p.erase(p.begin() + at); break;
        default: p.insert(p.begin() + at, static_cast<std::byte>(rng())); break;
      }
    }
    p = reseal(p);
    INFO("round " << round);
    try {
      const kv::engine_description d = kv::decode(p);
      ++decoded;
      CHECK_NOTHROW(d.check());
      CHECK(kv::encode(d) == p);
    } catch (const std::system_error& e) {
      REQUIRE(e.code() == kv::errc::bad_engine_description);
      REQUIRE(std::string(e.what()).rfind("ferry::kv: engine description ", 0) == 0);
    }
  }
  CHECK(decoded > 0);  // some edits (an offset, a descriptor byte) leave a valid description
}

TEST_CASE("kv handshake: engines that cannot exchange blocks are told apart by what differs",
          "[kv]") {
  const kv::paged_shape shape{.layers = 2, .blocks = 8, .block_size = 16, .total_heads = 8,
                              .tp_size = 2, .head_size = 128, .element_size = 2};
  const auto prefill = describe(kv::cache_layout::kv_split(shape), {1, 2});
  auto decode_shape = shape;
  decode_shape.tp_size = 1;
  decode_shape.blocks = 64;
  const auto decoder = describe(kv::cache_layout::head_major(decode_shape), {0, 1});
  CHECK_NOTHROW(kv::check_compatible(prefill, decoder));
  CHECK_NOTHROW(kv::check_compatible(kv::decode(kv::encode(prefill)),
                                     kv::decode(kv::encode(decoder))));
  const auto differs = [&](kv::engine_description other, const char* says,
                           kv::errc code = kv::errc::incompatible_layouts) {
    try {
      kv::check_compatible(prefill, other);
      FAIL("compatible");
    } catch (const std::system_error& e) {
      CHECK(e.code() == code);
      CHECK_THAT(e.what(), Catch::Contains(says));
    }
  };
  auto s = decode_shape;
  s.head_size = 64;
  differs(describe(kv::cache_layout::head_major(s)), "head_size: source 128, destination 64");
  s = decode_shape;
  s.element_size = 1;
  differs(describe(kv::cache_layout::head_major(s)), "element_size: source 2, destination 1");
  s = decode_shape;
  s.block_size = 32;
  differs(describe(kv::cache_layout::head_major(s)), "block_size: source 16, destination 32");
  s = decode_shape;
  s.layers = 3;
  differs(describe(kv::cache_layout::head_major(s)), "layer count: source 2, destination 3");
  s = decode_shape;
  s.total_heads = 4;
  differs(describe(kv::cache_layout::head_major(s)), "total_heads: source 8, destination 4");
  // A position whose size cannot split the heads (a description built by hand, unchecked).
  auto odd = decoder;
  odd.tp = {0, 3};
  differs(odd, "destination cache layout layer 0 has 8 heads, which tensor-parallel size 3 cannot "
               "split",
          kv::errc::bad_parallelism);
}

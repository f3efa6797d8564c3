#pragma once
// --check: the data a run moves, made so that either side can fill or verify a block knowing only
// the run's seed, the stream the block belongs to and where in it the block lies.
//
// A stream is one block slot of one submitting thread (tcp, ucx, verbs: the thread's slot i is
// stream (thread << 40) | i, written with the same bytes every time it is written), or a whole file
// (file: the bytes depend on their offset in the file only, so that two writes to one place in
// flight together carry the same bytes and the file's content stays defined). Byte p of a stream is
// byte p % 8 (least significant first) of a 64-bit mix of (seed, stream, p / 8); the seed is drawn
// afresh for every block size's run, so data left over from an earlier run does not pass.

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <span>
#include <string>

#include "numbers.hpp"

namespace ferry_perf {

[[nodiscard]] constexpr std::uint64_t slot_stream(std::size_t thread, std::size_t slot) noexcept {
  return (static_cast<std::uint64_t>(thread) << 40) | slot;
}
constexpr std::uint64_t file_stream = ~std::uint64_t{0};

// splitmix64's finaliser over the three inputs: neighbouring words, slots and seeds differ in about
// half their bits.
[[nodiscard]] constexpr std::uint64_t pattern_word(std::uint64_t seed, std::uint64_t stream,
                                                  std::uint64_t index) noexcept {
  std::uint64_t z = seed + stream * 0x9e3779b97f4a7c15ULL + (index + 1) * 0xd1b54a32d192ed03ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Calls f(offset in `n` bytes, the pattern's bytes from there, how many) word by word.
template <class F>
void for_each_pattern_piece(std::size_t n, std::uint64_t seed, std::uint64_t stream, std::uint64_t first, F&& f) {
  std::size_t i = 0;
  while (i < n) {
    const std::uint64_t p = first + i;
    const std::uint64_t w = pattern_word(seed, stream, p / 8);
    unsigned char bytes[8];
    if constexpr (std::endian::native == std::endian::little) {
      std::memcpy(bytes, &w, 8);
    } else {
      for (unsigned b = 0; b < 8; ++b) bytes[b] = static_cast<unsigned char>(w >> (8 * b));
    }
    const std::size_t skip = static_cast<std::size_t>(p % 8);
    const std::size_t k = std::min<std::size_t>(8 - skip, n - i);
    if (!f(i, bytes + skip, k)) return;
    i += k;
  }
}

// `out` gets bytes [first, first + out.size()) of the stream.
inline void fill_pattern(std::span<std::byte> out, std::uint64_t seed, std::uint64_t stream, std::uint64_t first = 0) {
  for_each_pattern_piece(out.size(), seed, stream, first, [&](std::size_t at, const unsigned char* p, std::size_t k) {
    std::memcpy(out.data() + at, p, k);
    return true;
  });
}

// Every byte flipped: afterwards no byte of `bytes` is what it was, so a block filled with a
// pattern and then spoiled fails its check unless something writes it again.
inline void spoil(std::span<std::byte> bytes) noexcept {
  for (std::byte& b : bytes) b = ~b;
}

struct mismatch {
  std::size_t offset = 0;  // in the block
  unsigned expected = 0;
  unsigned found = 0;
};

// The first byte of `got` that is not bytes [first, ...) of the stream.
[[nodiscard]] inline std::optional<mismatch> find_mismatch(std::span<const std::byte> got, std::uint64_t seed,
                                                           std::uint64_t stream, std::uint64_t first = 0) {
  std::optional<mismatch> bad;
  for_each_pattern_piece(got.size(), seed, stream, first, [&](std::size_t at, const unsigned char* p, std::size_t k) {
    if (std::memcmp(got.data() + at, p, k) == 0) return true;
    for (std::size_t j = 0; j < k; ++j) {
      const auto g = static_cast<unsigned char>(got[at + j]);
      if (g != p[j]) {
        bad = mismatch{at + j, p[j], g};
        return false;
      }
    }
    return false;
  });
  return bad;
}

// "thread 0 block 3: byte 17 of 4096 is 0xa5, expected 0x5a": `where` names the block.
[[nodiscard]] inline std::string describe_mismatch(const std::string& where, const mismatch& m, std::size_t size) {
  char buf[96];
  std::snprintf(buf, sizeof buf, ": byte %zu of %zu is 0x%02x, expected 0x%02x", m.offset, size, m.found, m.expected);
  return where + buf;
}

// The test hook FERRY_PERF_TEST_CORRUPT=OFFSET: on the side that holds the data (the target, or
// ferry-perf file), --check runs flip byte OFFSET of thread 0's block 0 (file: of the file) once,
// where the other side's check must then find it. Only the tests set it.
struct corruption {
  bool on = false;
  std::uint64_t offset = 0;
};

[[nodiscard]] inline corruption corruption_for_tests() {
  const char* v = std::getenv("FERRY_PERF_TEST_CORRUPT");
  const std::optional<std::uint64_t> offset = v == nullptr ? std::nullopt : parse_whole(v);
  return offset ? corruption{true, *offset} : corruption{};
}

}  // namespace ferry_perf

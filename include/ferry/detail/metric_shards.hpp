#pragma once
// metrics.hpp's storage: log-linear latency buckets and per-thread shards of relaxed atomics.
//
// Buckets: eight per power of two. A value v (nanoseconds) goes to the bucket of v - 1, so that each
// bucket covers (lower, upper] and a bound that is a power of two includes the value equal to it, as
// a Prometheus "le" bucket does. Values 0..8 have a bucket each; above, the bucket is the octave of
// v - 1 and its next three bits. The last bucket takes everything from 2^40 ns (about 18 minutes).

#include <array>
#include <atomic>
#include <bit>
#include <cstddef>
#include <cstdint>

namespace ferry::metrics::detail {

inline constexpr unsigned sub_bucket_bits = 3;
inline constexpr std::uint64_t sub_buckets = std::uint64_t{1} << sub_bucket_bits;
inline constexpr unsigned last_octave = 39;
inline constexpr std::size_t latency_buckets =
    sub_buckets + (last_octave - sub_bucket_bits + 1) * sub_buckets;

// The exported bounds: 2^8 ns (256 ns) to 2^36 ns (about 69 s).
inline constexpr unsigned export_first_power = 8;
inline constexpr unsigned export_last_power = 36;

[[nodiscard]] constexpr std::size_t bucket_of(std::uint64_t v) noexcept {
  const std::uint64_t x = v == 0 ? 0 : v - 1;
  if (x < sub_buckets) return static_cast<std::size_t>(x);
  const unsigned octave = 63u - static_cast<unsigned>(std::countl_zero(x));
  if (octave > last_octave) return latency_buckets - 1;
  const std::uint64_t sub = (x >> (octave - sub_bucket_bits)) & (sub_buckets - 1);
  return static_cast<std::size_t>(sub_buckets + (octave - sub_bucket_bits) * sub_buckets + sub);
}

// The largest value bucket `i` holds (for the last bucket: where it starts to hold everything).
[[nodiscard]] constexpr std::uint64_t bucket_upper_ns(std::size_t i) noexcept {
  if (i < sub_buckets) return i + 1;
  const std::uint64_t octave = (i - sub_buckets) / sub_buckets + sub_bucket_bits;
  const std::uint64_t sub = (i - sub_buckets) % sub_buckets;
  return (sub_buckets + sub + 1) << (octave - sub_bucket_bits);
}

static_assert(bucket_of(1) == 0 && bucket_of(8) == 7 && bucket_of(9) == 8);
static_assert(bucket_upper_ns(bucket_of(256)) == 256 && bucket_of(257) == bucket_of(256) + 1);

inline constexpr std::size_t metric_shard_count = 8;

// One thread's share (threads beyond metric_shard_count share shards). Cache-line aligned, so that
// two shards' additions never contend for one line.
struct alignas(64) metric_shard {
  std::atomic<std::uint64_t> succeeded{0};
  std::atomic<std::uint64_t> failed{0};
  std::atomic<std::uint64_t> bytes{0};
  std::atomic<std::uint64_t> latency_sum_ns{0};
  std::array<std::atomic<std::uint64_t>, latency_buckets> latency{};
};

// Threads take shards in the order they first record; a backend's completions mostly come from its
// one executor thread, which then has a shard to itself.
[[nodiscard]] inline std::size_t this_thread_shard() noexcept {
  static std::atomic<std::size_t> next{0};
  thread_local const std::size_t mine =
      next.fetch_add(1, std::memory_order_relaxed) % metric_shard_count;
  return mine;
}

}  // namespace ferry::metrics::detail

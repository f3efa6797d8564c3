#pragma once
// Transfer plans: from a source engine's cache layout and a destination's, their tensor-parallel
// positions and a request's block pairs, the byte ranges to move, per layer, as plain data that any
// backend (or memcpy) can carry out.
//
// Heterogeneous tensor parallelism: a destination rank reads each head it holds from exactly one
// source rank. When the source splits the heads (at least as many heads as ranks) that is the rank
// holding it; when the source replicates them (fewer heads than ranks), head g is on R/H ranks and
// destination rank d reads replica d mod (R/H), so that identical TP pairs rank d with rank d and
// the readers spread over the replicas. A layer that is not sharded (an MLA latent) is read whole
// from source rank d mod R. tp_sources says which source ranks a destination rank reads from, and
// which heads; a plan covers one (source rank, destination rank) pair.
//
// Cost: a transfer_planner checks the two layouts and works out, once, the byte ranges of one block
// pair of each layer (coalesced across tokens, heads and tensors). Planning a request then finds
// its runs of consecutive block pairs once, and per layer either emits one range per run (whole
// contiguous blocks) or makes one pass over the pairs, extending a range while consecutive blocks
// stay contiguous on both sides. Nothing is allocated per block: the plan's vectors (which keep
// their capacity when a plan is planned into again) and a scratch list per group and call.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "ferry/kv/errors.hpp"
#include "ferry/kv/layout.hpp"

namespace ferry::kv {

/// Bytes to move: `length` bytes from `src_offset` of the source's region `src_region` to
/// `dst_offset` of the destination's region `dst_region`. 32 bytes, without padding: a plan of a
/// million ranges is 32 MB.
struct byte_range {
  std::uint32_t src_region = 0;  ///< the source's region (its layout's region number)
  std::uint32_t dst_region = 0;  ///< the destination's region
  std::uint64_t src_offset = 0;  ///< the first byte in the source's region
  std::uint64_t dst_offset = 0;  ///< the first byte in the destination's region
  std::uint64_t length = 0;      ///< bytes, never 0 in a plan

  /// Member-wise equality.
  friend bool operator==(const byte_range&, const byte_range&) = default;
};

/// What to move for one request between one source rank and one destination rank.
struct transfer_plan {
  /// Per layer (the layouts' layer order), its ranges; empty for a layer this source rank does
  /// not supply (another rank holds its heads, or the request has no blocks in its group).
  /// Within a layer no two ranges share a destination byte, and their order is unspecified.
  std::vector<std::vector<byte_range>> layers;
  std::uint64_t ranges = 0;  ///< ranges in all layers
  std::uint64_t bytes = 0;   ///< bytes in all layers
};

/// One group's block pairs: source block src[i] goes to destination block dst[i]. Destination ids
/// should be distinct (a repeated one is written once per pair, in no set order); source ids may
/// repeat.
struct block_pairs {
  std::span<const std::uint32_t> src;  ///< source block ids
  std::span<const std::uint32_t> dst;  ///< destination block ids, as many as src
};

/// A source rank a destination rank reads from, and which of a layer's heads.
struct tp_source {
  std::uint32_t src_rank = 0;  ///< the source's tensor-parallel rank
  head_range heads;            ///< the heads read from it (global ids; all of an unsharded layer)

  /// Member-wise equality.
  friend bool operator==(const tp_source&, const tp_source&) = default;
};

/// The heads of a layer (global ids) that destination rank `dst` reads from source rank `src`;
/// count 0 when none. For an unsharded layer, all `total_heads` from rank dst.rank % src.size and
/// none from the others. Throws std::system_error (errc::bad_parallelism) for ranks not below
/// their sizes or sizes that cannot split the heads (heads_held).
[[nodiscard]] inline head_range heads_read(std::uint32_t total_heads, bool heads_sharded,
                                           tp_shard src, tp_shard dst) {
  if (!heads_sharded) {
    for (const tp_shard& tp : {src, dst}) {
      if (tp.size == 0 || tp.rank >= tp.size) (void)heads_held(1, tp);  // throws, naming it
    }
    if (src.rank != dst.rank % src.size) return {};
    return {0, total_heads};
  }
  const head_range held = heads_held(total_heads, src);
  const head_range wanted = heads_held(total_heads, dst);
  const std::uint32_t lo = std::max(held.first, wanted.first);
  const std::uint32_t hi = std::min(held.first + held.count, wanted.first + wanted.count);
  if (lo >= hi) return {};
  if (total_heads < src.size) {
    // The head is replicated on `replicas` consecutive source ranks: read the one chosen for dst.
    const std::uint32_t replicas = src.size / total_heads;
    if (src.rank != held.first * replicas + dst.rank % replicas) return {};
  }
  return {lo, hi - lo};
}

/// Which source ranks (of `src_size`) destination rank `dst` reads a layer from, and which heads
/// from each, in ascending head order; together they are exactly the heads dst holds. Throws as
/// heads_read.
[[nodiscard]] inline std::vector<tp_source> tp_sources(std::uint32_t total_heads,
                                                       bool heads_sharded, std::uint32_t src_size,
                                                       tp_shard dst) {
  std::vector<tp_source> out;
  if (!heads_sharded) {
    (void)heads_read(total_heads, false, {0, src_size}, dst);  // checks the ranks
    out.push_back({dst.rank % src_size, {0, total_heads}});
    return out;
  }
  (void)heads_held(total_heads, {0, src_size});  // checks the source's size
  const head_range wanted = heads_held(total_heads, dst);
  if (total_heads >= src_size) {
    const std::uint32_t per_rank = total_heads / src_size;
    for (std::uint32_t s = wanted.first / per_rank; s * per_rank < wanted.first + wanted.count;
         ++s) {
      out.push_back({s, heads_read(total_heads, true, {s, src_size}, dst)});
    }
  } else {
    const std::uint32_t replicas = src_size / total_heads;
    for (std::uint32_t g = wanted.first; g < wanted.first + wanted.count; ++g) {
      out.push_back({g * replicas + dst.rank % replicas, {g, 1}});
    }
  }
  return out;
}

/// Every source rank (of `src_size`) that destination rank `dst` reads any layer of `dst_layout`
/// from, ascending: the peers it needs a plan, and a handshake, for.
[[nodiscard]] inline std::vector<std::uint32_t> tp_source_ranks(const cache_layout& dst_layout,
                                                                std::uint32_t src_size,
                                                                tp_shard dst) {
  std::vector<std::uint32_t> ranks;
  for (const auto& layer : dst_layout.layers) {
    for (const tp_source& s : tp_sources(layer.total_heads, layer.heads_sharded, src_size, dst)) {
      ranks.push_back(s.src_rank);
    }
  }
  std::sort(ranks.begin(), ranks.end());
  ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
  return ranks;
}

}  // namespace ferry::kv

namespace ferry::detail::kv {

using ferry::kv::cache_layout;
using ferry::kv::errc;
using ferry::kv::layer_layout;
using ferry::kv::tensor_layout;
using ferry::kv::tp_shard;

[[nodiscard]] inline std::string layout_difference(const cache_layout& src,
                                                   const cache_layout& dst) {
  const auto differs = [](const std::string& what, std::uint64_t s, std::uint64_t d) {
    return what + ": source " + std::to_string(s) + ", destination " + std::to_string(d);
  };
  if (src.layers.size() != dst.layers.size()) {
    return differs("layer count", src.layers.size(), dst.layers.size());
  }
  for (std::size_t l = 0; l < src.layers.size(); ++l) {
    const layer_layout& s = src.layers[l];
    const layer_layout& d = dst.layers[l];
    const std::string at = "layer " + std::to_string(l);
    if (s.group != d.group) return differs(at + " group", s.group, d.group);
    if (s.heads_sharded != d.heads_sharded) {
      return differs(at + " heads_sharded", s.heads_sharded, d.heads_sharded);
    }
    if (s.total_heads != d.total_heads) {
      return differs(at + " total_heads", s.total_heads, d.total_heads);
    }
    if (s.tensors.size() != d.tensors.size()) {
      return differs(at + " tensor count", s.tensors.size(), d.tensors.size());
    }
    for (std::size_t i = 0; i < s.tensors.size(); ++i) {
      const tensor_layout& st = s.tensors[i];
      const tensor_layout& dt = d.tensors[i];
      const std::string t = at + " tensor " + std::to_string(i);
      if (st.block_size != dt.block_size) {
        return differs(t + " block_size", st.block_size, dt.block_size);
      }
      if (st.head_size != dt.head_size)
        return differs(t + " head_size", st.head_size, dt.head_size);
      if (st.element_size != dt.element_size) {
        return differs(t + " element_size", st.element_size, dt.element_size);
      }
    }
  }
  return {};
}

inline void check_side(const cache_layout& layout, tp_shard tp, const char* side) {
  if (std::string why = layout_problem(layout); !why.empty()) {
    throw std::system_error(make_error_code(errc::bad_layout),
                            std::string("ferry::kv: ") + side + " cache layout " + why);
  }
  if (std::string why = parallelism_problem(layout, tp); !why.empty()) {
    throw std::system_error(make_error_code(errc::bad_parallelism),
                            std::string("ferry::kv: ") + side + " cache layout " + why);
  }
}

}  // namespace ferry::detail::kv

namespace ferry::kv {

/// Throws std::system_error unless blocks can move from `src` (at tensor-parallel position
/// `src_tp`) to `dst` (at `dst_tp`): each side checked (errc::bad_layout, errc::bad_parallelism,
/// the message saying which side), then errc::incompatible_layouts naming the first difference:
/// the layer count, or a layer's group, heads_sharded, total_heads or tensor count, or a tensor's
/// block_size, head_size or element_size. Block counts, strides, offsets and regions may differ.
inline void check_compatible(const cache_layout& src, tp_shard src_tp, const cache_layout& dst,
                             tp_shard dst_tp) {
  detail::kv::check_side(src, src_tp, "source");
  detail::kv::check_side(dst, dst_tp, "destination");
  if (std::string why = detail::kv::layout_difference(src, dst); !why.empty()) {
    throw std::system_error(make_error_code(errc::incompatible_layouts),
                            "ferry::kv: the cache layouts differ in " + why);
  }
}

/// Plans transfers between one source rank and one destination rank: checks their layouts once
/// (check_compatible) and keeps, per layer, the coalesced byte ranges of one block pair, so that
/// planning a request costs one pass over its block pairs. Immutable once built: plan() may be
/// called from several threads at once.
class transfer_planner {
 public:
  /// A planner from `src` at `src_tp` to `dst` at `dst_tp`. Throws as check_compatible.
  transfer_planner(const cache_layout& src, tp_shard src_tp, const cache_layout& dst,
                   tp_shard dst_tp) {
    check_compatible(src, src_tp, dst, dst_tp);
    group_count_ = std::max(src.group_count(), dst.group_count());
    src_blocks_.assign(group_count_, std::numeric_limits<std::uint32_t>::max());
    dst_blocks_.assign(group_count_, std::numeric_limits<std::uint32_t>::max());
    std::vector<keyed_range> scratch;
    for (std::size_t l = 0; l < src.layers.size(); ++l) {
      const layer_layout& sl = src.layers[l];
      const layer_layout& dl = dst.layers[l];
      for (std::size_t i = 0; i < sl.tensors.size(); ++i) {
        src_blocks_[sl.group] = std::min(src_blocks_[sl.group], sl.tensors[i].blocks);
        dst_blocks_[dl.group] = std::min(dst_blocks_[dl.group], dl.tensors[i].blocks);
      }
      layers_.push_back({sl.group, static_cast<std::uint32_t>(classes_.size()), 0});
      const head_range share = heads_read(sl.total_heads, sl.heads_sharded, src_tp, dst_tp);
      if (share.count == 0) continue;
      const std::uint32_t src_first =
          sl.heads_sharded ? share.first - heads_held(sl.total_heads, src_tp).first : 0;
      const std::uint32_t dst_first =
          sl.heads_sharded ? share.first - heads_held(sl.total_heads, dst_tp).first : 0;
      scratch.clear();
      for (std::size_t i = 0; i < sl.tensors.size(); ++i) {
        block_ranges(sl.tensors[i], src_first, dl.tensors[i], dst_first, share.count, scratch);
      }
      add_classes(scratch);
      layers_.back().class_count =
          static_cast<std::uint32_t>(classes_.size()) - layers_.back().first_class;
    }
  }

  /// The plan for one request: `groups[g]` holds its block pairs of group g, one entry per group
  /// of the layouts (group_count()). Throws std::system_error (errc::bad_block_table) naming the
  /// group and pair when the count of tables is wrong, a table's two lists differ in length, or
  /// an id is not below the blocks its side has in that group.
  [[nodiscard]] transfer_plan plan(std::span<const block_pairs> groups) const {
    transfer_plan out;
    plan(groups, out);
    return out;
  }

  /// As plan(groups), into `out`, whose vectors keep their capacity: planning step after step
  /// into the same plan allocates nothing once it has grown.
  void plan(std::span<const block_pairs> groups, transfer_plan& out) const {
    check_tables(groups);
    // Each group's runs of pairs consecutive on both sides, found once for every layer.
    std::vector<std::vector<block_run>> runs(groups.size());
    for (std::size_t g = 0; g < groups.size(); ++g) {
      const block_pairs& p = groups[g];
      for (std::size_t i = 0; i < p.src.size(); ++i) {
        if (!runs[g].empty() &&
            std::uint64_t{runs[g].back().src} + runs[g].back().count == p.src[i] &&
            std::uint64_t{runs[g].back().dst} + runs[g].back().count == p.dst[i]) {
          ++runs[g].back().count;
        } else {
          runs[g].push_back({p.src[i], p.dst[i], 1});
        }
      }
    }
    out.layers.resize(layers_.size());
    out.ranges = 0;
    out.bytes = 0;
    std::vector<byte_range> open(widest_class_);
    for (std::size_t l = 0; l < layers_.size(); ++l) {
      std::vector<byte_range>& ranges = out.layers[l];
      ranges.clear();
      const layer_entry& layer = layers_[l];
      for (std::uint32_t c = layer.first_class; c < layer.first_class + layer.class_count; ++c) {
        emit(classes_[c], groups[layer.group], runs[layer.group], open, ranges);
      }
      out.ranges += ranges.size();
      for (const byte_range& r : ranges) out.bytes += r.length;
    }
  }

  /// How many block tables plan() takes: one per group of the layouts.
  [[nodiscard]] std::uint32_t group_count() const noexcept { return group_count_; }

  /// The layers the layouts have.
  [[nodiscard]] std::size_t layer_count() const noexcept { return layers_.size(); }

  /// The ranges one isolated block pair of layer `layer` becomes (0 when this source rank supplies
  /// none of it): what a plan would hold per block without coalescing across blocks. Throws
  /// std::out_of_range for a layer past layer_count().
  [[nodiscard]] std::size_t ranges_per_block(std::size_t layer) const {
    std::size_t n = 0;
    const layer_entry& e = layers_.at(layer);
    for (std::uint32_t c = e.first_class; c < e.first_class + e.class_count; ++c) {
      n += classes_[c].count;
    }
    return n;
  }

 private:
  // A layer's ranges of one block pair, grouped by the two block strides they move with: ranges
  // [first, first + count) of entries_ are at block 0, and block pair (s, d) shifts them by
  // s * src_stride and d * dst_stride.
  struct stride_class {
    std::uint64_t src_stride = 0;
    std::uint64_t dst_stride = 0;
    std::uint32_t first = 0;
    std::uint32_t count = 0;
  };
  struct layer_entry {
    std::uint32_t group = 0;
    std::uint32_t first_class = 0;
    std::uint32_t class_count = 0;
  };
  struct keyed_range {
    std::uint64_t src_stride;
    std::uint64_t dst_stride;
    byte_range range;
  };

  [[nodiscard]] static bool continues(const byte_range& a, const byte_range& b) noexcept {
    return a.src_region == b.src_region && a.dst_region == b.dst_region &&
           a.src_offset + a.length == b.src_offset && a.dst_offset + a.length == b.dst_offset;
  }

  // Block 0's ranges of one tensor pair, heads [src_first, src_first + heads) of the source
  // moving to [dst_first, ...) of the destination, every token; merged where both sides run on.
  static void block_ranges(const tensor_layout& s, std::uint32_t src_first, const tensor_layout& d,
                           std::uint32_t dst_first, std::uint32_t heads,
                           std::vector<keyed_range>& out) {
    const std::uint64_t vector = s.head_bytes();
    const auto at = [&](std::uint32_t token, std::uint32_t head) {
      return byte_range{
          .src_region = s.region,
          .dst_region = d.region,
          .src_offset = s.offset + token * s.token_stride + (src_first + head) * s.head_stride,
          .dst_offset = d.offset + token * d.token_stride + (dst_first + head) * d.head_stride,
          .length = vector};
    };
    const auto add = [&](const byte_range& r) {
      if (!out.empty() && out.back().src_stride == s.block_stride &&
          out.back().dst_stride == d.block_stride && continues(out.back().range, r)) {
        out.back().range.length += r.length;
      } else {
        out.push_back({s.block_stride, d.block_stride, r});
      }
    };
    // Token-major layouts merge here as the ranges come; add_classes sorts and merges the rest.
    for (std::uint32_t t = 0; t < s.block_size; ++t) {
      for (std::uint32_t h = 0; h < heads; ++h) add(at(t, h));
    }
  }

  // Groups a layer's ranges by their block strides, merging ranges of different tensors that run
  // on (K then V of one block, in an interleaved or cross-layer layout).
  void add_classes(std::vector<keyed_range>& ranges) {
    std::sort(ranges.begin(), ranges.end(), [](const keyed_range& a, const keyed_range& b) {
      if (a.src_stride != b.src_stride) return a.src_stride < b.src_stride;
      if (a.dst_stride != b.dst_stride) return a.dst_stride < b.dst_stride;
      if (a.range.src_region != b.range.src_region) return a.range.src_region < b.range.src_region;
      return a.range.src_offset < b.range.src_offset;
    });
    for (std::size_t i = 0; i < ranges.size();) {
      stride_class c{ranges[i].src_stride, ranges[i].dst_stride,
                     static_cast<std::uint32_t>(entries_.size()), 0};
      for (; i < ranges.size() && ranges[i].src_stride == c.src_stride &&
             ranges[i].dst_stride == c.dst_stride;
           ++i) {
        if (entries_.size() > c.first && continues(entries_.back(), ranges[i].range)) {
          entries_.back().length += ranges[i].range.length;
        } else {
          entries_.push_back(ranges[i].range);
        }
      }
      c.count = static_cast<std::uint32_t>(entries_.size()) - c.first;
      widest_class_ = std::max<std::size_t>(widest_class_, c.count);
      classes_.push_back(c);
    }
  }

  void check_tables(std::span<const block_pairs> groups) const {
    const auto refuse = [](const std::string& why) {
      throw std::system_error(make_error_code(errc::bad_block_table), "ferry::kv: " + why);
    };
    if (groups.size() != group_count_) {
      refuse("got " + std::to_string(groups.size()) + " block tables; the layouts have " +
             std::to_string(group_count_) + " groups, one table each");
    }
    for (std::size_t g = 0; g < groups.size(); ++g) {
      const block_pairs& p = groups[g];
      const std::string group = "group " + std::to_string(g);
      if (p.src.size() != p.dst.size()) {
        refuse(group + " has " + std::to_string(p.src.size()) + " source block ids but " +
               std::to_string(p.dst.size()) + " destination block ids");
      }
      for (std::size_t i = 0; i < p.src.size(); ++i) {
        const auto beyond = [&](const char* side, std::uint32_t id, std::uint32_t blocks) {
          refuse(group + " pair " + std::to_string(i) + ": " + side + " block " +
                 std::to_string(id) + " is not below the " + side + "'s " + std::to_string(blocks) +
                 " blocks");
        };
        if (p.src[i] >= src_blocks_[g]) beyond("source", p.src[i], src_blocks_[g]);
        if (p.dst[i] >= dst_blocks_[g]) beyond("destination", p.dst[i], dst_blocks_[g]);
      }
    }
  }

  // Pairs (src + k, dst + k) for k below count.
  struct block_run {
    std::uint32_t src = 0;
    std::uint32_t dst = 0;
    std::uint32_t count = 0;
  };

  // The class's ranges, shifted to every block pair. When each fills its block stride on both
  // sides (whole blocks of a contiguous layout), a run of consecutive pairs continues it exactly:
  // one range per run and entry. Otherwise each range stays open while the next pair continues
  // it on both sides, and is written out when one does not (pair by pair, which measured faster
  // than entry by entry).
  void emit(const stride_class& c, const block_pairs& pairs, std::span<const block_run> runs,
            std::span<byte_range> open, std::vector<byte_range>& out) const {
    const std::span<const byte_range> block(entries_.data() + c.first, c.count);
    const bool whole_blocks = std::all_of(block.begin(), block.end(), [&](const byte_range& e) {
      return e.length == c.src_stride && e.length == c.dst_stride;
    });
    if (whole_blocks) {
      for (const byte_range& e : block) {
        for (const block_run& r : runs) {
          out.push_back({.src_region = e.src_region,
                         .dst_region = e.dst_region,
                         .src_offset = e.src_offset + r.src * c.src_stride,
                         .dst_offset = e.dst_offset + r.dst * c.dst_stride,
                         .length = r.count * e.length});
        }
      }
      return;
    }
    for (std::size_t i = 0; i < pairs.src.size(); ++i) {
      const std::uint64_t src_shift = pairs.src[i] * c.src_stride;
      const std::uint64_t dst_shift = pairs.dst[i] * c.dst_stride;
      for (std::size_t j = 0; j < block.size(); ++j) {
        const std::uint64_t s = block[j].src_offset + src_shift;
        const std::uint64_t d = block[j].dst_offset + dst_shift;
        byte_range& run = open[j];
        if (run.length != 0 && run.src_offset + run.length == s &&
            run.dst_offset + run.length == d) {
          run.length += block[j].length;
        } else {
          if (run.length != 0) out.push_back(run);
          run = {.src_region = block[j].src_region,
                 .dst_region = block[j].dst_region,
                 .src_offset = s,
                 .dst_offset = d,
                 .length = block[j].length};
        }
      }
    }
    for (std::size_t j = 0; j < block.size(); ++j) {
      if (open[j].length != 0) out.push_back(open[j]);
      open[j].length = 0;
    }
  }

  std::vector<layer_entry> layers_;
  std::vector<stride_class> classes_;
  std::vector<byte_range> entries_;
  std::vector<std::uint32_t> src_blocks_;  // per group: ids are below this on the source side
  std::vector<std::uint32_t> dst_blocks_;
  std::uint32_t group_count_ = 0;
  std::size_t widest_class_ = 0;  // entries in the largest class: the ranges emit keeps open
};

/// transfer_planner(src, src_tp, dst, dst_tp).plan(groups): the plan for one request between one
/// source rank and one destination rank. A connector planning step after step keeps the planner.
[[nodiscard]] inline transfer_plan plan_transfer(const cache_layout& src, tp_shard src_tp,
                                                 const cache_layout& dst, tp_shard dst_tp,
                                                 std::span<const block_pairs> groups) {
  return transfer_planner(src, src_tp, dst, dst_tp).plan(groups);
}

/// Carries out `plan` with memcpy: `src[r]` is the source's region r, `dst[r]` the destination's
/// (host memory; a region's buffer must not overlap another's). Every range is checked before
/// any is copied: std::system_error (errc::region_out_of_range) names the layer and range that
/// reach a region not given or past its end. For tests, and for a user's own fallback path.
inline void apply_plan(const transfer_plan& plan, std::span<const std::span<const std::byte>> src,
                       std::span<const std::span<std::byte>> dst) {
  const auto check = [](std::size_t layer, std::size_t index, const char* side,
                        std::uint32_t region, std::uint64_t offset, std::uint64_t length,
                        std::size_t regions, std::size_t size) {
    std::string why;
    if (region >= regions) {
      why = "reads " + std::string(side) + " region " + std::to_string(region) + ", but " +
            std::to_string(regions) + " " + side + " regions were given";
    } else if (offset > size || length > size - offset) {
      why = "needs bytes [" + std::to_string(offset) + ", " + std::to_string(offset + length) +
            ") of " + side + " region " + std::to_string(region) + ", which has " +
            std::to_string(size);
    }
    if (!why.empty()) {
      throw std::system_error(make_error_code(errc::region_out_of_range),
                              "ferry::kv: layer " + std::to_string(layer) + " range " +
                                  std::to_string(index) + " " + why);
    }
  };
  for (std::size_t l = 0; l < plan.layers.size(); ++l) {
    for (std::size_t i = 0; i < plan.layers[l].size(); ++i) {
      const byte_range& r = plan.layers[l][i];
      check(l, i, "source", r.src_region, r.src_offset, r.length, src.size(),
            r.src_region < src.size() ? src[r.src_region].size() : 0);
      check(l, i, "destination", r.dst_region, r.dst_offset, r.length, dst.size(),
            r.dst_region < dst.size() ? dst[r.dst_region].size() : 0);
    }
  }
  for (const auto& layer : plan.layers) {
    for (const byte_range& r : layer) {
      if (r.length == 0) continue;
      std::memcpy(dst[r.dst_region].data() + r.dst_offset, src[r.src_region].data() + r.src_offset,
                  r.length);
    }
  }
}

}  // namespace ferry::kv

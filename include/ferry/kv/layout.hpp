#pragma once
// Where one engine's paged KV cache lives in registered memory, as plain data: per layer, the
// tensors (K and V, an MLA latent, a recurrent state's parts) with their region, offset, element
// size and byte strides. A Python caller describes a tensor it already has from its data pointer's
// offset in the registered region and its strides; the named constructors build the common
// layouts. The layout is one tensor-parallel rank's: a tensor holds that rank's heads.
//
// Element (block b, token t, head h, dim 0) of a tensor is at byte
//     offset + b * block_stride + t * token_stride + h * head_stride
// of its region, and a head's head_size elements follow contiguously. Every layout is checked
// (check()) before anything uses it: sizes non-zero and bounded, no arithmetic past 2^64, and no
// two elements sharing a byte, within a tensor or between tensors of one group in one region.
// Tensors of different groups may share memory: a hybrid allocator gives them one pool and keeps
// their block ids apart, which a layout cannot see.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <system_error>
#include <vector>

#include "ferry/kv/errors.hpp"

namespace ferry::kv {

/// The bounds a cache_layout is checked against (cache_layout::check). Generous for any model
/// served today; they bound what a peer's handshake can make this process allocate or compute.
struct layout_limits {
  static constexpr std::uint32_t layers = 1024;                  ///< layers in a layout
  static constexpr std::uint32_t tensors_per_layer = 64;         ///< tensors in one layer
  static constexpr std::uint32_t tensors = 8192;                 ///< tensors in all layers together
  static constexpr std::uint32_t regions = 4096;                 ///< region numbers are below this
  static constexpr std::uint32_t groups = 64;                    ///< group numbers are below this
  static constexpr std::uint32_t heads = 65536;                  ///< heads of a layer or a tensor
  static constexpr std::uint32_t block_size = 65536;             ///< tokens in a block
  static constexpr std::uint32_t head_size = 1u << 24;           ///< elements of one head
  static constexpr std::uint32_t element_size = 16;              ///< bytes of one element
  static constexpr std::uint64_t tokens_times_heads = 1u << 20;  ///< block_size * heads
};

/// A tensor-parallel position: rank `rank` of `size` ranks.
struct tp_shard {
  std::uint32_t rank = 0;  ///< this rank, below size
  std::uint32_t size = 1;  ///< ranks the layer's heads are split across

  /// Member-wise equality.
  friend bool operator==(const tp_shard&, const tp_shard&) = default;
};

/// A run of heads, numbered in the model (global head ids, before the split across ranks).
struct head_range {
  std::uint32_t first = 0;  ///< the first head
  std::uint32_t count = 0;  ///< how many; 0 for none

  /// Member-wise equality.
  friend bool operator==(const head_range&, const head_range&) = default;
};

/// The heads rank `tp.rank` holds of a layer with `total_heads` heads split across `tp.size` ranks.
/// With at least as many heads as ranks, the heads are split evenly: rank r holds
/// [r*H/R, (r+1)*H/R). With fewer, each head is replicated on R/H consecutive ranks: rank r holds
/// head r*H/R alone. Throws std::system_error (errc::bad_parallelism) when the rank is not below
/// the size, or when neither of H and R divides the other.
[[nodiscard]] inline head_range heads_held(std::uint32_t total_heads, tp_shard tp) {
  const auto refuse = [&](const std::string& why) {
    throw std::system_error(make_error_code(errc::bad_parallelism), "ferry::kv: " + why);
  };
  if (tp.size == 0 || tp.rank >= tp.size) {
    refuse("tensor-parallel rank " + std::to_string(tp.rank) + " is not below its size " +
           std::to_string(tp.size));
  }
  if (total_heads == 0) refuse("a layer with 0 heads cannot be split across ranks");
  if (total_heads >= tp.size) {
    if (total_heads % tp.size != 0) {
      refuse("tensor-parallel size " + std::to_string(tp.size) + " does not divide " +
             std::to_string(total_heads) + " heads");
    }
    const std::uint32_t per_rank = total_heads / tp.size;
    return {tp.rank * per_rank, per_rank};
  }
  if (tp.size % total_heads != 0) {
    refuse(std::to_string(total_heads) + " heads do not divide tensor-parallel size " +
           std::to_string(tp.size) + ", so they cannot be replicated evenly");
  }
  return {tp.rank / (tp.size / total_heads), 1};
}

/// One tensor of a layer in one rank's registered memory: `blocks` blocks of `block_size` tokens,
/// each token holding `heads` heads of `head_size` contiguous elements. Element (block b, token t,
/// head h, dim 0) is at byte `offset + b*block_stride + t*token_stride + h*head_stride` of region
/// `region`. A stride whose count is 1 (block_size 1, heads 1) is never used.
struct tensor_layout {
  std::uint32_t region = 0;        ///< the registered region holding it (an index, below 4096)
  std::uint64_t offset = 0;        ///< bytes from the region's start to block 0, token 0, head 0
  std::uint32_t element_size = 2;  ///< bytes of one element (2 for fp16 or bf16, 1 for fp8)
  std::uint32_t blocks = 0;        ///< blocks in the cache; block ids are below this
  std::uint32_t block_size = 0;    ///< tokens in a block (1 for a recurrent state: one per block)
  std::uint32_t heads = 0;         ///< heads this rank holds (its share of the layer's total)
  std::uint32_t head_size = 0;     ///< elements of one head of one token, contiguous
  std::uint64_t block_stride = 0;  ///< bytes from block b to block b + 1
  std::uint64_t token_stride = 0;  ///< bytes from token t to token t + 1 of a block
  std::uint64_t head_stride = 0;   ///< bytes from head h to head h + 1 of a token

  /// Bytes of one head of one token: head_size * element_size.
  [[nodiscard]] constexpr std::uint64_t head_bytes() const noexcept {
    return static_cast<std::uint64_t>(head_size) * element_size;
  }

  /// Member-wise equality.
  friend bool operator==(const tensor_layout&, const tensor_layout&) = default;
};

/// One layer of the cache: its tensors and how its heads are split across tensor-parallel ranks.
struct layer_layout {
  /// The block group it belongs to: layers of one group share a block numbering, and a request
  /// has one block table per group (attention layers in one group, a hybrid model's recurrent
  /// state layers in another). Below 64.
  std::uint32_t group = 0;
  /// The layer's heads in the model, before the split across tensor-parallel ranks (the KV heads
  /// of an attention layer, the state heads of a recurrent one). Per layer, not per cache: a
  /// hybrid model's attention and state layers have different counts.
  std::uint32_t total_heads = 1;
  /// True when the heads are split across ranks (see heads_held); false when every rank holds all
  /// of them (an MLA latent: one head, the same on every rank), so that a reader takes the whole
  /// layer from one rank.
  bool heads_sharded = true;
  /// The layer's tensors in a fixed order that both engines share: K then V; the latent; the
  /// parts of a recurrent state.
  std::vector<tensor_layout> tensors;

  /// Member-wise equality.
  friend bool operator==(const layer_layout&, const layer_layout&) = default;
};

/// The shape of a paged attention cache, for cache_layout's named constructors.
struct paged_shape {
  std::uint32_t layers = 1;        ///< attention layers
  std::uint32_t blocks = 1;        ///< blocks per layer
  std::uint32_t block_size = 16;   ///< tokens per block
  std::uint32_t total_heads = 1;   ///< KV heads of the model, before the tensor-parallel split
  std::uint32_t tp_size = 1;       ///< ranks the heads are split across (heads_held)
  std::uint32_t head_size = 128;   ///< elements per head (for MLA: the latent's size)
  std::uint32_t element_size = 2;  ///< bytes per element
  std::uint32_t group = 0;         ///< the layers' block group
  /// The region of layer 0: with region_per_layer, layer l is alone in region first_region + l,
  /// at offset 0; without, every layer is in first_region, one after another.
  std::uint32_t first_region = 0;
  bool region_per_layer = true;  ///< one region per layer (see first_region)
};

/// The shape of a recurrent state (Mamba-style), for cache_layout::recurrent_state: per layer, one
/// tensor per entry of head_sizes, each `[blocks, heads, head_size]` (a block is one request's
/// state: block_size 1), one after another in the layer's memory.
struct state_shape {
  std::uint32_t layers = 1;                  ///< recurrent layers
  std::uint32_t blocks = 1;                  ///< state blocks per layer
  std::uint32_t total_heads = 1;             ///< state heads of the model, before the split
  std::uint32_t tp_size = 1;                 ///< ranks the heads are split across (heads_held)
  bool heads_sharded = true;                 ///< false: every rank holds every head
  std::vector<std::uint32_t> head_sizes{1};  ///< elements per head of each tensor (conv, SSM, ...)
  std::uint32_t element_size = 2;            ///< bytes per element
  std::uint32_t group = 1;                   ///< the layers' block group (apart from attention's)
  std::uint32_t first_region = 0;            ///< as paged_shape::first_region
  bool region_per_layer = true;              ///< as paged_shape::region_per_layer
};

class cache_layout;

}  // namespace ferry::kv

// The checks, below. Internals live in ferry::detail::kv rather than ferry::kv::detail: the other
// kv headers name the core's internals as `detail::...` from inside ferry::kv.
namespace ferry::detail::kv {
[[nodiscard]] inline std::string layout_problem(const ferry::kv::cache_layout& layout);
[[nodiscard]] inline std::string parallelism_problem(const ferry::kv::cache_layout& layout,
                                                     ferry::kv::tp_shard tp);
}  // namespace ferry::detail::kv

namespace ferry::kv {

/// One tensor-parallel rank's paged cache: every layer's tensors in registered memory, as data.
/// Build one with a named constructor or by filling `layers`; check() it before use (the
/// constructors, the planner and the handshake do).
class cache_layout {
 public:
  /// The layers, in the model's order; a transfer plan's layer l is layers[l].
  std::vector<layer_layout> layers;

  /// K and V as two tensors per layer, `[2, blocks, block_size, heads, head_size]`: K's blocks,
  /// then V's (vLLM's FlashAttention layout).
  [[nodiscard]] static cache_layout kv_split(const paged_shape& shape) {
    return paged(shape, kv_placement::split, order::token_major);
  }

  /// K and V interleaved per block, `[blocks, 2, block_size, heads, head_size]`: block b's K,
  /// then its V (FlashInfer's layout).
  [[nodiscard]] static cache_layout kv_interleaved(const paged_shape& shape) {
    return paged(shape, kv_placement::interleaved, order::token_major);
  }

  /// Head-major blocks, K and V each `[blocks, heads, block_size, head_size]`, K's blocks then
  /// V's: a head's tokens are contiguous, so a reader taking some of the heads moves one range
  /// per block (the layout heterogeneous tensor parallelism wants).
  [[nodiscard]] static cache_layout head_major(const paged_shape& shape) {
    return paged(shape, kv_placement::split, order::head_major);
  }

  /// MLA: one latent per token, `[blocks, block_size, head_size]` (head_size: the latent's size),
  /// the same on every rank (heads_sharded false). shape.total_heads and shape.tp_size are unused.
  [[nodiscard]] static cache_layout mla(const paged_shape& shape) {
    paged_shape one = shape;
    one.total_heads = 1;
    one.tp_size = 1;
    cache_layout out = paged(one, kv_placement::latent, order::token_major);
    for (auto& layer : out.layers) layer.heads_sharded = false;
    out.check();
    return out;
  }

  /// Every layer of a block together, in one region (shape.first_region):
  /// `[blocks, layers, 2, block_size, heads, head_size]`. A block of every layer is one
  /// contiguous piece of memory; shape.region_per_layer is unused.
  [[nodiscard]] static cache_layout cross_layer(const paged_shape& shape) {
    const std::uint32_t heads = heads_held(shape.total_heads, {0, shape.tp_size}).count;
    const std::uint64_t vector = mul(shape.head_size, shape.element_size);
    const std::uint64_t token = mul(vector, heads);
    const std::uint64_t block = mul(token, shape.block_size);
    const std::uint64_t stride = mul(mul(block, 2), shape.layers);
    cache_layout out;
    out.layers.reserve(std::min(shape.layers, layout_limits::layers + 1));
    for (std::uint32_t l = 0; l < shape.layers && l <= layout_limits::layers; ++l) {
      layer_layout layer{shape.group, shape.total_heads, true, {}};
      for (std::uint64_t which = 0; which < 2; ++which) {
        layer.tensors.push_back({shape.first_region, mul(block, 2 * l + which), shape.element_size,
                                 shape.blocks, shape.block_size, heads, shape.head_size, stride,
                                 token, vector});
      }
      out.layers.push_back(std::move(layer));
    }
    out.check();
    return out;
  }

  /// A recurrent state's layers (Mamba-style), each tensor `[blocks, heads, head_size]` with one
  /// token per block. Add them beside attention layers with append().
  [[nodiscard]] static cache_layout recurrent_state(const state_shape& shape) {
    const std::uint32_t heads = shape.heads_sharded
                                    ? heads_held(shape.total_heads, {0, shape.tp_size}).count
                                    : shape.total_heads;
    std::uint64_t layer_bytes = 0;
    for (std::uint32_t size : shape.head_sizes) {
      layer_bytes = add(layer_bytes, mul(mul(mul(size, shape.element_size), heads), shape.blocks));
    }
    cache_layout out;
    out.layers.reserve(std::min(shape.layers, layout_limits::layers + 1));
    for (std::uint32_t l = 0; l < shape.layers && l <= layout_limits::layers; ++l) {
      layer_layout layer{shape.group, shape.total_heads, shape.heads_sharded, {}};
      std::uint64_t at = shape.region_per_layer ? 0 : mul(layer_bytes, l);
      for (std::uint32_t size : shape.head_sizes) {
        const std::uint64_t vector = mul(size, shape.element_size);
        const std::uint64_t block = mul(vector, heads);
        layer.tensors.push_back({region_of(shape.first_region, shape.region_per_layer, l), at,
                                 shape.element_size, shape.blocks, 1, heads, size, block, block,
                                 vector});
        at = add(at, mul(block, shape.blocks));
      }
      out.layers.push_back(std::move(layer));
    }
    out.check();
    return out;
  }

  /// Adds `more`'s layers after this layout's (a hybrid model's state layers beside its attention
  /// layers; reorder `layers` to interleave them as the model does). Returns *this, unchecked.
  cache_layout& append(const cache_layout& more) {
    layers.insert(layers.end(), more.layers.begin(), more.layers.end());
    return *this;
  }

  /// Throws std::system_error (errc::bad_layout) whose message names the layer, the tensor and
  /// the field at fault: no layers or tensors; a count that is zero or over layout_limits; a
  /// tensor of an unsharded layer not holding all its heads; strides that make two elements of a
  /// tensor share a byte; two tensors of one group sharing a byte of one region; arithmetic past
  /// 2^64 bytes.
  void check() const {
    if (std::string why = detail::kv::layout_problem(*this); !why.empty()) {
      throw std::system_error(make_error_code(errc::bad_layout), "ferry::kv: cache layout " + why);
    }
  }

  /// check(), and that each sharded layer's tensors hold the heads rank `tp.rank` of `tp.size`
  /// holds (heads_held); throws std::system_error with errc::bad_parallelism for that.
  void check(tp_shard tp) const {
    check();
    if (std::string why = detail::kv::parallelism_problem(*this, tp); !why.empty()) {
      throw std::system_error(make_error_code(errc::bad_parallelism),
                              "ferry::kv: cache layout " + why);
    }
  }

  /// Bytes region `region` must have: one past the last byte any tensor in it uses; 0 when no
  /// tensor is in it. Meaningful for a checked layout (no overflow).
  [[nodiscard]] std::uint64_t bytes_needed(std::uint32_t region) const noexcept {
    std::uint64_t needed = 0;
    for (const auto& layer : layers) {
      for (const auto& t : layer.tensors) {
        if (t.region == region) needed = std::max(needed, end_of(t));
      }
    }
    return needed;
  }

  /// One more than the highest region number any tensor uses (0 for no tensors).
  [[nodiscard]] std::uint32_t region_count() const noexcept {
    std::uint32_t n = 0;
    for (const auto& layer : layers) {
      for (const auto& t : layer.tensors) n = std::max(n, t.region + 1);
    }
    return n;
  }

  /// One more than the highest group number any layer uses: how many block tables a request has.
  [[nodiscard]] std::uint32_t group_count() const noexcept {
    std::uint32_t n = 0;
    for (const auto& layer : layers) n = std::max(n, layer.group + 1);
    return n;
  }

  /// Member-wise equality.
  friend bool operator==(const cache_layout&, const cache_layout&) = default;

 private:
  enum class kv_placement { split, interleaved, latent };
  enum class order { token_major, head_major };

  // One past the last byte of `t` (for a checked tensor: no overflow).
  [[nodiscard]] static std::uint64_t end_of(const tensor_layout& t) noexcept {
    return t.offset + (t.blocks - 1) * t.block_stride +
           (t.block_size - 1) * (t.block_size > 1 ? t.token_stride : 0) +
           (t.heads - 1) * (t.heads > 1 ? t.head_stride : 0) + t.head_bytes();
  }

  [[noreturn]] static void too_large() {
    throw std::system_error(make_error_code(errc::bad_layout),
                            "ferry::kv: cache layout shape needs more than 2^64 bytes");
  }
  [[nodiscard]] static std::uint64_t mul(std::uint64_t a, std::uint64_t b) {
    if (a != 0 && b > std::numeric_limits<std::uint64_t>::max() / a) too_large();
    return a * b;
  }
  [[nodiscard]] static std::uint64_t add(std::uint64_t a, std::uint64_t b) {
    if (b > std::numeric_limits<std::uint64_t>::max() - a) too_large();
    return a + b;
  }
  [[nodiscard]] static std::uint32_t region_of(std::uint32_t first, bool per_layer,
                                               std::uint32_t layer) noexcept {
    // Past the region limit check() refuses it; saturate rather than wrap into a valid number.
    if (!per_layer) return first;
    return layer > std::numeric_limits<std::uint32_t>::max() - first
               ? std::numeric_limits<std::uint32_t>::max()
               : first + layer;
  }

  [[nodiscard]] static cache_layout paged(const paged_shape& s, kv_placement placement, order o) {
    const std::uint32_t heads = heads_held(s.total_heads, {0, s.tp_size}).count;
    const std::uint64_t vector = mul(s.head_size, s.element_size);
    const std::uint64_t block = mul(mul(vector, heads), s.block_size);
    const std::uint64_t token_stride = o == order::token_major ? mul(vector, heads) : vector;
    const std::uint64_t head_stride = o == order::token_major ? vector : mul(vector, s.block_size);
    const std::uint32_t tensors = placement == kv_placement::latent ? 1 : 2;
    const std::uint64_t layer_bytes = mul(mul(block, tensors), s.blocks);
    const std::uint64_t block_stride =
        placement == kv_placement::interleaved ? mul(block, 2) : block;
    cache_layout out;
    out.layers.reserve(std::min(s.layers, layout_limits::layers + 1));
    for (std::uint32_t l = 0; l < s.layers && l <= layout_limits::layers; ++l) {
      layer_layout layer{s.group, s.total_heads, true, {}};
      const std::uint64_t base = s.region_per_layer ? 0 : mul(layer_bytes, l);
      for (std::uint32_t kv = 0; kv < tensors; ++kv) {
        const std::uint64_t at = placement == kv_placement::interleaved
                                     ? add(base, mul(block, kv))
                                     : add(base, mul(mul(block, s.blocks), kv));
        layer.tensors.push_back({region_of(s.first_region, s.region_per_layer, l), at,
                                 s.element_size, s.blocks, s.block_size, heads, s.head_size,
                                 block_stride, token_stride, head_stride});
      }
      out.layers.push_back(std::move(layer));
    }
    if (placement != kv_placement::latent) out.check();
    return out;
  }
};

}  // namespace ferry::kv

namespace ferry::detail::kv {

using ferry::kv::cache_layout;
using ferry::kv::layer_layout;
using ferry::kv::layout_limits;
using ferry::kv::tensor_layout;
using ferry::kv::tp_shard;

// A tensor's elements as a family of `count` pieces `stride` apart, each piece `width` bytes from
// its start (holes inside a piece are counted as used: a conservative view).
struct footprint {
  std::uint64_t base = 0;
  std::uint64_t stride = 0;
  std::uint64_t count = 1;
  std::uint64_t width = 0;
  std::uint64_t end = 0;  // one past the last byte
  std::uint32_t layer = 0;
  std::uint32_t tensor = 0;
  std::uint32_t group = 0;
  std::uint32_t region = 0;
};

// Checks one tensor's sizes and strides; fills `fp` when they are sound, else says what is wrong.
[[nodiscard]] inline std::string tensor_problem(const tensor_layout& t, footprint& fp) {
  using limits = layout_limits;
  const auto bounded = [](const char* field, std::uint64_t v, std::uint64_t most) -> std::string {
    if (v == 0) return std::string(field) + " is 0";
    if (v > most) {
      return std::string(field) + " is " + std::to_string(v) + ", over the limit " +
             std::to_string(most);
    }
    return {};
  };
  if (t.region >= limits::regions) {
    return "region is " + std::to_string(t.region) + ", not below " +
           std::to_string(limits::regions);
  }
  for (std::string why : {bounded("element_size", t.element_size, limits::element_size),
                          bounded("blocks", t.blocks, std::numeric_limits<std::uint32_t>::max()),
                          bounded("block_size", t.block_size, limits::block_size),
                          bounded("heads", t.heads, limits::heads),
                          bounded("head_size", t.head_size, limits::head_size)}) {
    if (!why.empty()) return why;
  }
  if (static_cast<std::uint64_t>(t.block_size) * t.heads > limits::tokens_times_heads) {
    return "block_size " + std::to_string(t.block_size) + " times heads " +
           std::to_string(t.heads) + " is over the limit " +
           std::to_string(limits::tokens_times_heads);
  }
  // The dimensions with more than one index, innermost (smallest stride) first: each stride must
  // clear everything inside it, which is the usual condition for a strided array not to overlap
  // itself.
  struct dim {
    const char* name;
    std::uint64_t count;
    std::uint64_t stride;
  };
  dim dims[3] = {{"block_stride", t.blocks, t.block_stride},
                 {"token_stride", t.block_size, t.token_stride},
                 {"head_stride", t.heads, t.head_stride}};
  std::sort(std::begin(dims), std::end(dims),
            [](const dim& a, const dim& b) { return a.stride < b.stride; });
  std::uint64_t span = t.head_bytes();
  fp.stride = 0;
  fp.count = 1;
  fp.width = span;
  for (const dim& d : dims) {
    if (d.count == 1) continue;
    if (d.stride < span) {
      return std::string(d.name) + " " + std::to_string(d.stride) + " is smaller than the " +
             std::to_string(span) + " bytes the dimensions inside it span, so elements overlap";
    }
    const std::uint64_t steps = d.count - 1;
    if (d.stride > (std::numeric_limits<std::uint64_t>::max() - span) / steps) {
      return std::string(d.name) + " " + std::to_string(d.stride) +
             " puts the tensor past 2^64 bytes";
    }
    fp.width = span;  // the span inside the outermost dimension, once the loop ends
    fp.stride = d.stride;
    fp.count = d.count;
    span += steps * d.stride;
  }
  if (span > std::numeric_limits<std::uint64_t>::max() - t.offset) {
    return "offset " + std::to_string(t.offset) + " puts the tensor past 2^64 bytes";
  }
  fp.base = t.offset;
  fp.end = t.offset + span;
  return {};
}

// Whether two footprints share a byte, judged exactly for pieces of one stride and conservatively
// (any bounding overlap) otherwise.
[[nodiscard]] inline bool may_overlap(footprint a, footprint b) noexcept {
  if (a.base > b.base) std::swap(a, b);
  if (b.base >= a.end) return false;
  if (a.count == 1 || b.count == 1) {
    // One piece against a family: the single piece may take the other's stride.
    if (a.count == 1 && b.count == 1) return true;
    if (a.count == 1) a.stride = b.stride;
    if (b.count == 1) b.stride = a.stride;
  }
  if (a.stride != b.stride) return true;
  // Pieces i of a and j of b meet when (i - j) * stride lies strictly between d - a.width and
  // d + b.width, d = b.base - a.base >= 0. The smallest such k = i - j is the one to try.
  const std::uint64_t d = b.base - a.base;
  if (d < a.width) return true;
  const std::uint64_t k = (d - a.width) / a.stride + 1;
  return k <= a.count - 1 && k * a.stride < d + b.width;
}

[[nodiscard]] inline std::string where(std::size_t layer, std::size_t tensor) {
  return "layer " + std::to_string(layer) + " tensor " + std::to_string(tensor);
}

inline std::string layout_problem(const cache_layout& layout) {
  using limits = layout_limits;
  if (layout.layers.empty()) return "has no layers";
  if (layout.layers.size() > limits::layers) {
    return "has " + std::to_string(layout.layers.size()) + " layers, over the limit " +
           std::to_string(limits::layers);
  }
  std::size_t total = 0;
  for (const auto& layer : layout.layers) total += layer.tensors.size();
  if (total > limits::tensors) {
    return "has " + std::to_string(total) + " tensors, over the limit " +
           std::to_string(limits::tensors);
  }
  std::vector<footprint> prints;
  prints.reserve(total);
  for (std::size_t l = 0; l < layout.layers.size(); ++l) {
    const layer_layout& layer = layout.layers[l];
    const std::string at = "layer " + std::to_string(l);
    if (layer.tensors.empty()) return at + " has no tensors";
    if (layer.tensors.size() > limits::tensors_per_layer) {
      return at + " has " + std::to_string(layer.tensors.size()) + " tensors, over the limit " +
             std::to_string(limits::tensors_per_layer);
    }
    if (layer.group >= limits::groups) {
      return at + " group is " + std::to_string(layer.group) + ", not below " +
             std::to_string(limits::groups);
    }
    if (layer.total_heads == 0 || layer.total_heads > limits::heads) {
      return at + " total_heads is " + std::to_string(layer.total_heads) + " (must be 1 to " +
             std::to_string(limits::heads) + ")";
    }
    for (std::size_t i = 0; i < layer.tensors.size(); ++i) {
      const tensor_layout& t = layer.tensors[i];
      footprint fp;
      if (std::string why = tensor_problem(t, fp); !why.empty()) return where(l, i) + ": " + why;
      if (!layer.heads_sharded && t.heads != layer.total_heads) {
        return where(l, i) + ": heads is " + std::to_string(t.heads) +
               ", but its layer is not sharded (heads_sharded false), so it holds all " +
               std::to_string(layer.total_heads) + " of the layer's heads";
      }
      if (t.heads > layer.total_heads) {
        return where(l, i) + ": heads is " + std::to_string(t.heads) + ", more than the layer's " +
               std::to_string(layer.total_heads) + " total_heads";
      }
      if (t.heads != layer.tensors[0].heads) {
        return where(l, i) + ": heads is " + std::to_string(t.heads) +
               ", but tensor 0 of the layer holds " + std::to_string(layer.tensors[0].heads) +
               " (a layer's tensors share one split)";
      }
      if (t.block_size != layer.tensors[0].block_size) {
        return where(l, i) + ": block_size is " + std::to_string(t.block_size) +
               ", but tensor 0 of the layer has " + std::to_string(layer.tensors[0].block_size);
      }
      fp.layer = static_cast<std::uint32_t>(l);
      fp.tensor = static_cast<std::uint32_t>(i);
      fp.group = layer.group;
      fp.region = t.region;
      prints.push_back(fp);
    }
  }
  // Tensors of one group in one region must not share a byte. Sorted by start, each tensor is
  // compared with those before it that still reach past its start.
  std::sort(prints.begin(), prints.end(), [](const footprint& a, const footprint& b) {
    if (a.group != b.group) return a.group < b.group;
    if (a.region != b.region) return a.region < b.region;
    if (a.base != b.base) return a.base < b.base;
    return a.layer != b.layer ? a.layer < b.layer : a.tensor < b.tensor;
  });
  std::vector<const footprint*> open;
  for (std::size_t i = 0; i < prints.size(); ++i) {
    const footprint& p = prints[i];
    if (i > 0 && (prints[i - 1].group != p.group || prints[i - 1].region != p.region)) {
      open.clear();
    }
    std::erase_if(open, [&](const footprint* q) { return q->end <= p.base; });
    for (const footprint* q : open) {
      if (may_overlap(*q, p)) {
        return where(q->layer, q->tensor) + " and " + where(p.layer, p.tensor) +
               " share bytes of region " + std::to_string(p.region) + " (both in group " +
               std::to_string(p.group) + ")";
      }
    }
    open.push_back(&p);
  }
  return {};
}

inline std::string parallelism_problem(const cache_layout& layout, tp_shard tp) {
  if (tp.size == 0 || tp.rank >= tp.size) {
    return "is for tensor-parallel rank " + std::to_string(tp.rank) + ", not below its size " +
           std::to_string(tp.size);
  }
  for (std::size_t l = 0; l < layout.layers.size(); ++l) {
    const layer_layout& layer = layout.layers[l];
    if (!layer.heads_sharded) continue;
    const std::uint32_t h = layer.total_heads;
    if (h >= tp.size ? h % tp.size != 0 : tp.size % h != 0) {
      return "layer " + std::to_string(l) + " has " + std::to_string(h) +
             " heads, which tensor-parallel size " + std::to_string(tp.size) +
             " cannot split (one must divide the other)";
    }
    const std::uint32_t held = h >= tp.size ? h / tp.size : 1;
    for (std::size_t i = 0; i < layer.tensors.size(); ++i) {
      if (layer.tensors[i].heads != held) {
        return where(l, i) + ": heads is " + std::to_string(layer.tensors[i].heads) +
               ", but a rank of " + std::to_string(tp.size) + " holds " + std::to_string(held) +
               " of the layer's " + std::to_string(h) + " heads";
      }
    }
  }
  return {};
}

}  // namespace ferry::detail::kv

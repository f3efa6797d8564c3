#pragma once
// Random cache layouts for the kv layout, plan and handshake tests, the block tables to move
// between them, and the reference the plans are checked against: a copy one token and one head at
// a time, which decides for itself which source rank supplies each head.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <ferry/kv/layout.hpp>
#include <ferry/kv/plan.hpp>

namespace kv_test {

namespace kv = ferry::kv;
using rng_t = std::mt19937_64;
using memory = std::vector<std::vector<std::byte>>;  // one buffer per region

inline std::uint32_t uniform(rng_t& rng, std::uint32_t lo, std::uint32_t hi) {
  return std::uniform_int_distribution<std::uint32_t>(lo, hi)(rng);
}

template <class T>
T pick(rng_t& rng, std::initializer_list<T> choices) {
  return *(choices.begin() + uniform(rng, 0, static_cast<std::uint32_t>(choices.size() - 1)));
}

// What two compatible layouts share, per layer.
struct layer_model {
  std::uint32_t group = 0;
  std::uint32_t total_heads = 1;
  bool sharded = true;
  std::uint32_t block_size = 1;
  std::uint32_t element_size = 2;
  std::vector<std::uint32_t> head_sizes;  // one per tensor
};

enum class kind { attention, mla, hybrid };

inline const char* name(kind k) {
  switch (k) {
    case kind::attention: return "attention";
    case kind::mla: return "mla";
    case kind::hybrid: return "hybrid";
  }
  return "?";
}

struct model {
  std::vector<layer_model> layers;
  std::uint32_t groups = 1;
};

inline model random_model(rng_t& rng, kind k) {
  model m;
  const std::uint32_t element_size = pick(rng, {1u, 2u, 4u});
  const std::uint32_t attention_layers = uniform(rng, 1, 4);
  if (k == kind::mla) {
    const std::uint32_t latent = uniform(rng, 1, 24);
    const std::uint32_t block_size = uniform(rng, 1, 8);
    for (std::uint32_t l = 0; l < attention_layers; ++l) {
      m.layers.push_back({0, 1, false, block_size, element_size, {latent}});
    }
    return m;
  }
  const std::uint32_t heads = pick(rng, {1u, 2u, 4u, 8u});
  const std::uint32_t head_size = uniform(rng, 1, 12);
  const std::uint32_t block_size = uniform(rng, 1, 8);
  for (std::uint32_t l = 0; l < attention_layers; ++l) {
    m.layers.push_back({0, heads, true, block_size, element_size, {head_size, head_size}});
  }
  if (k == kind::hybrid) {
    m.groups = 2;
    const std::uint32_t state_heads = pick(rng, {1u, 2u, 4u, 8u});
    std::vector<std::uint32_t> sizes{uniform(rng, 1, 20)};
    if (uniform(rng, 0, 1) == 1) sizes.push_back(uniform(rng, 1, 20));
    const std::uint32_t state_layers = uniform(rng, 1, 3);
    for (std::uint32_t l = 0; l < state_layers; ++l) {
      m.layers.push_back({1, state_heads, true, 1, element_size, sizes});
    }
    std::shuffle(m.layers.begin(), m.layers.end(), rng);  // a hybrid model interleaves them
  }
  return m;
}

inline std::uint32_t heads_of(const layer_model& l, std::uint32_t tp_size) {
  if (!l.sharded) return l.total_heads;
  return l.total_heads >= tp_size ? l.total_heads / tp_size : 1;
}

inline std::uint64_t padding(rng_t& rng) {
  return uniform(rng, 0, 1) == 0 ? 0 : uniform(rng, 1, 9);
}

// Strides for dimensions listed outermost first, each clearing everything inside it plus a random
// pad; returns the span of the whole.
inline std::uint64_t nest(rng_t& rng, std::uint64_t vector, std::span<const std::uint64_t> counts,
                          std::span<std::uint64_t*> strides) {
  std::uint64_t span = vector;
  for (std::size_t i = counts.size(); i-- > 0;) {
    *strides[i] = span + padding(rng);
    span += (counts[i] - 1) * *strides[i];
  }
  return span;
}

// A random layout of model `m` for a rank of `tp_size`, with `blocks[g]` blocks in group g.
// Tensors land in one of a few regions at random gaps; each group's tensors are either laid out
// apart (dimensions in any order, blocks need not be outermost), interleaved per block within a
// layer ([blocks, tensors, ...]) or across the group's layers ([blocks, layers, tensors, ...]).
inline kv::cache_layout random_layout(rng_t& rng, const model& m, std::uint32_t tp_size,
                                      const std::vector<std::uint32_t>& blocks) {
  kv::cache_layout out;
  const std::uint32_t regions = uniform(rng, 1, 3);
  std::vector<std::uint64_t> cursor(regions, 0);
  const auto place = [&](std::uint32_t region, std::uint64_t span) {
    const std::uint64_t at = cursor[region] + padding(rng);
    cursor[region] = at + span;
    return at;
  };
  for (const layer_model& lm : m.layers) {
    kv::layer_layout layer{lm.group, lm.total_heads, lm.sharded, {}};
    for (std::uint32_t hs : lm.head_sizes) {
      kv::tensor_layout t;
      t.element_size = lm.element_size;
      t.blocks = blocks[lm.group];
      t.block_size = lm.block_size;
      t.heads = heads_of(lm, tp_size);
      t.head_size = hs;
      layer.tensors.push_back(t);
    }
    out.layers.push_back(std::move(layer));
  }
  // The token and head dimensions of a block, in a random order: returns the block's span.
  const auto block_inside = [&](kv::tensor_layout& t) {
    std::array<std::uint64_t, 2> counts{t.block_size, t.heads};
    std::array<std::uint64_t*, 2> strides{&t.token_stride, &t.head_stride};
    if (uniform(rng, 0, 1) == 1) {
      std::swap(counts[0], counts[1]);
      std::swap(strides[0], strides[1]);
    }
    return nest(rng, t.head_bytes(), counts, strides);
  };
  for (std::uint32_t g = 0; g < m.groups; ++g) {
    const int style = static_cast<int>(uniform(rng, 0, 2));
    std::vector<kv::tensor_layout*> page;  // tensors sharing one block page
    const auto lay_page = [&]() {
      if (page.empty()) return;
      const std::uint32_t region = uniform(rng, 0, regions - 1);
      std::uint64_t at = 0;
      for (kv::tensor_layout* t : page) {
        const std::uint64_t span = block_inside(*t);
        t->offset = at;
        t->region = region;
        at += span + padding(rng);
      }
      const std::uint64_t stride = at + padding(rng);
      const std::uint64_t base = place(region, (page.front()->blocks - 1) * stride + at);
      for (kv::tensor_layout* t : page) {
        t->offset += base;
        t->block_stride = stride;
      }
      page.clear();
    };
    for (auto& layer : out.layers) {
      if (layer.group != g) continue;
      for (auto& t : layer.tensors) {
        if (style == 0) {
          std::array<std::uint64_t, 3> counts{t.blocks, t.block_size, t.heads};
          std::array<std::uint64_t*, 3> strides{&t.block_stride, &t.token_stride, &t.head_stride};
          std::array<std::size_t, 3> order{0, 1, 2};
          std::shuffle(order.begin(), order.end(), rng);
          std::array<std::uint64_t, 3> c{};
          std::array<std::uint64_t*, 3> s{};
          for (std::size_t i = 0; i < 3; ++i) {
            c[i] = counts[order[i]];
            s[i] = strides[order[i]];
          }
          t.region = uniform(rng, 0, regions - 1);
          t.offset = place(t.region, nest(rng, t.head_bytes(), c, s));
        } else {
          page.push_back(&t);
        }
      }
      if (style == 1) lay_page();
    }
    if (style == 2) lay_page();
  }
  return out;
}

// A block table: `n` ids below `src_blocks` and below `dst_blocks`, distinct on each side, in one
// of three shapes: one run on both sides, sorted (runs where the ids are dense) or shuffled.
struct table {
  std::vector<std::uint32_t> src;
  std::vector<std::uint32_t> dst;
};

inline std::vector<std::uint32_t> some_ids(rng_t& rng, std::uint32_t blocks, std::uint32_t n,
                                           int shape) {
  std::vector<std::uint32_t> ids(blocks);
  std::iota(ids.begin(), ids.end(), 0u);
  if (shape == 0) {
    const std::uint32_t start = uniform(rng, 0, blocks - n);
    return {ids.begin() + start, ids.begin() + start + n};
  }
  std::shuffle(ids.begin(), ids.end(), rng);
  ids.resize(n);
  if (shape == 1) std::sort(ids.begin(), ids.end());
  return ids;
}

inline table random_table(rng_t& rng, std::uint32_t src_blocks, std::uint32_t dst_blocks) {
  const std::uint32_t n = uniform(rng, 0, std::min(src_blocks, dst_blocks));
  const int shape = static_cast<int>(uniform(rng, 0, 2));
  return {some_ids(rng, src_blocks, n, shape), some_ids(rng, dst_blocks, n, shape)};
}

inline std::vector<kv::block_pairs> pairs_of(const std::vector<table>& tables) {
  std::vector<kv::block_pairs> out;
  for (const table& t : tables) out.push_back({t.src, t.dst});
  return out;
}

inline memory zeroed(const kv::cache_layout& layout) {
  memory m(layout.region_count());
  for (std::uint32_t r = 0; r < m.size(); ++r) m[r].resize(layout.bytes_needed(r));
  return m;
}

inline memory random_bytes(rng_t& rng, const kv::cache_layout& layout) {
  memory m = zeroed(layout);
  for (auto& region : m) {
    for (auto& b : region) b = static_cast<std::byte>(rng());
  }
  return m;
}

inline std::vector<std::span<const std::byte>> const_spans(const memory& m) {
  return {m.begin(), m.end()};
}

inline std::vector<std::span<std::byte>> spans(memory& m) { return {m.begin(), m.end()}; }

// The reference's own statement of who holds what: the first global head rank `rank` of `size`
// holds, and which source rank destination rank `dst_rank` reads global head `g` from.
inline std::uint32_t first_head(std::uint32_t heads, std::uint32_t rank, std::uint32_t size) {
  return heads >= size ? rank * (heads / size) : rank / (size / heads);
}

inline std::uint32_t supplier(const kv::layer_layout& l, std::uint32_t src_size,
                              std::uint32_t dst_rank, std::uint32_t g) {
  const std::uint32_t h = l.total_heads;
  if (!l.heads_sharded) return dst_rank % src_size;
  if (h >= src_size) return g / (h / src_size);
  return g * (src_size / h) + dst_rank % (src_size / h);
}

inline std::uint64_t address(const kv::tensor_layout& t, std::uint64_t block, std::uint64_t token,
                             std::uint64_t head) {
  return t.offset + block * t.block_stride + token * t.token_stride + head * t.head_stride;
}

// Calls f(layer, tensor, src block, dst block, token, global head, src local head, dst local head)
// for every head vector the destination rank holds of every block pair, whichever source holds it.
template <class F>
void for_each_vector(const kv::cache_layout& dst, std::uint32_t src_size, kv::tp_shard dst_tp,
                     const std::vector<table>& tables, F&& f) {
  for (std::size_t l = 0; l < dst.layers.size(); ++l) {
    const kv::layer_layout& layer = dst.layers[l];
    for (std::size_t i = 0; i < layer.tensors.size(); ++i) {
      const kv::tensor_layout& t = layer.tensors[i];
      const table& tab = tables[layer.group];
      for (std::size_t k = 0; k < tab.src.size(); ++k) {
        for (std::uint32_t tok = 0; tok < t.block_size; ++tok) {
          for (std::uint32_t hd = 0; hd < t.heads; ++hd) {
            const std::uint32_t g =
                layer.heads_sharded
                    ? first_head(layer.total_heads, dst_tp.rank, dst_tp.size) + hd
                    : hd;
            f(l, i, tab.src[k], tab.dst[k], tok, g, supplier(layer, src_size, dst_tp.rank, g), hd);
          }
        }
      }
    }
  }
}

// The copy a plan between source rank src_tp and destination rank dst_tp must equal: every head
// vector the destination holds and src_tp.rank supplies, one at a time.
inline void naive_copy(const kv::cache_layout& src, kv::tp_shard src_tp, const memory& from,
                       const kv::cache_layout& dst, kv::tp_shard dst_tp, memory& to,
                       const std::vector<table>& tables) {
  for_each_vector(dst, src_tp.size, dst_tp, tables,
                  [&](std::size_t l, std::size_t i, std::uint32_t sb, std::uint32_t db,
                      std::uint32_t tok, std::uint32_t g, std::uint32_t from_rank,
                      std::uint32_t hd) {
                    if (from_rank != src_tp.rank) return;
                    const kv::layer_layout& sl = src.layers[l];
                    const kv::tensor_layout& st = sl.tensors[i];
                    const kv::tensor_layout& dt = dst.layers[l].tensors[i];
                    const std::uint32_t hs =
                        sl.heads_sharded
                            ? g - first_head(sl.total_heads, src_tp.rank, src_tp.size)
                            : hd;
                    std::memcpy(to[dt.region].data() + address(dt, db, tok, hd),
                                from[st.region].data() + address(st, sb, tok, hs),
                                dt.head_bytes());
                  });
}

// "" when equal, else where the first difference is.
inline std::string first_difference(const memory& a, const memory& b) {
  if (a.size() != b.size()) return "region counts differ";
  for (std::size_t r = 0; r < a.size(); ++r) {
    if (a[r].size() != b[r].size()) return "region " + std::to_string(r) + " sizes differ";
    const auto m = std::mismatch(a[r].begin(), a[r].end(), b[r].begin());
    if (m.first != a[r].end()) {
      return "region " + std::to_string(r) + " byte " +
             std::to_string(m.first - a[r].begin()) + " differs";
    }
  }
  return {};
}

}  // namespace kv_test

#pragma once
// The handshake: what an engine (one tensor-parallel rank) tells a peer about itself, as a
// versioned, bounded, checked binary record that the user carries on a channel of their own. It
// holds the engine's id and incarnation, its tensor-parallel position, its cache layout and one
// opaque descriptor per registered region (for UCX, ucx::remote_region::to_bytes(); the kv layer
// keeps them as bytes and includes no backend).
//
// The record, every integer little-endian:
//
//     header   u32 magic "FKVD", u16 format version (1), u16 reserved (0), u32 record length
//     engine   u32 id length, id bytes, u64 incarnation, u32 tp rank, u32 tp size
//     layout   u32 layer count; per layer: u32 group, u32 total_heads, u8 heads_sharded,
//              u32 tensor count; per tensor: u32 region, u64 offset, u32 element_size, u32 blocks,
//              u32 block_size, u32 heads, u32 head_size, u64 block_stride, u64 token_stride,
//              u64 head_stride
//     regions  u32 region count; per region: u32 length, bytes
//     trailer  u32 FNV-1a of every byte before it
//
// decode() checks the magic and the version first (so bytes of another kind, or of a later
// format, say so rather than "checksum"), then the length and the checksum, then every count
// against its limit before anything is allocated for it, then the description itself, layout
// included. Anything malformed is refused with std::system_error (errc::bad_engine_description)
// whose message names what was wrong; nothing a peer sends reaches the planner unchecked.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <system_error>
#include <vector>

#include "ferry/kv/errors.hpp"
#include "ferry/kv/layout.hpp"
#include "ferry/kv/plan.hpp"

namespace ferry::kv {

/// The bounds an engine description is checked against, beside layout_limits.
struct description_limits {
  static constexpr std::uint32_t engine_id_bytes = 256;             ///< bytes of the engine id
  static constexpr std::uint32_t tp_size = 65536;                   ///< tensor-parallel size
  static constexpr std::uint32_t regions = layout_limits::regions;  ///< region descriptors
  static constexpr std::uint32_t region_bytes = 65536;     ///< bytes of one region descriptor
  static constexpr std::uint32_t record_bytes = 1u << 20;  ///< bytes of the whole record
};

/// The format version encode() writes and decode() reads.
inline constexpr std::uint16_t description_format_version = 1;

/// What an engine (one tensor-parallel rank) tells its peers: who it is, where its KV cache is,
/// and how to reach the memory.
struct engine_description {
  /// The engine's name among its peers: non-empty, at most 256 bytes.
  std::string engine_id;
  /// Which life of the engine this is: a restarted engine comes back with another one, so a peer
  /// can tell it from the engine it knew.
  std::uint64_t incarnation = 0;
  /// Its tensor-parallel position; the layout holds this rank's heads (cache_layout::check(tp)).
  tp_shard tp;
  /// Its cache, as this rank holds it.
  cache_layout layout;
  /// One opaque descriptor per region the layout names (index = region number): what the
  /// backend needs to reach it, e.g. ucx::remote_region::to_bytes(). At most 64 KiB each.
  std::vector<std::vector<std::byte>> regions;

  /// Throws std::system_error (errc::bad_engine_description) naming what is wrong: an empty or
  /// overlong id, a tensor-parallel position out of range, too many or too large region
  /// descriptors, a tensor in a region with no descriptor, or a layout that fails
  /// cache_layout::check(tp) (whose message follows).
  void check() const;

  /// Member-wise equality.
  friend bool operator==(const engine_description&, const engine_description&) = default;
};

}  // namespace ferry::kv

namespace ferry::detail::kv {

using ferry::kv::description_limits;
using ferry::kv::engine_description;
using ferry::kv::errc;

inline constexpr std::uint32_t description_magic = 0x44564b46;  // "FKVD" in little-endian order
inline constexpr std::size_t description_header = 12;
inline constexpr std::size_t description_trailer = 4;

[[nodiscard]] inline std::uint32_t description_checksum(std::span<const std::byte> bytes) noexcept {
  std::uint32_t h = 2166136261u;
  for (std::byte b : bytes) {
    h ^= static_cast<std::uint32_t>(b);
    h *= 16777619u;
  }
  return h;
}

[[nodiscard]] inline std::string description_problem(const engine_description& d) {
  using limits = description_limits;
  if (d.engine_id.empty()) return "engine id is empty";
  if (d.engine_id.size() > limits::engine_id_bytes) {
    return "engine id is " + std::to_string(d.engine_id.size()) + " bytes, over the limit " +
           std::to_string(limits::engine_id_bytes);
  }
  if (d.tp.size == 0 || d.tp.size > limits::tp_size || d.tp.rank >= d.tp.size) {
    return "tensor-parallel rank " + std::to_string(d.tp.rank) + " of size " +
           std::to_string(d.tp.size) + " is out of range (size 1 to " +
           std::to_string(limits::tp_size) + ", rank below it)";
  }
  if (d.regions.size() > limits::regions) {
    return "has " + std::to_string(d.regions.size()) + " region descriptors, over the limit " +
           std::to_string(limits::regions);
  }
  for (std::size_t r = 0; r < d.regions.size(); ++r) {
    if (d.regions[r].size() > limits::region_bytes) {
      return "region " + std::to_string(r) + " descriptor is " +
             std::to_string(d.regions[r].size()) + " bytes, over the limit " +
             std::to_string(limits::region_bytes);
    }
  }
  if (std::string why = layout_problem(d.layout); !why.empty()) return "cache layout " + why;
  if (std::string why = parallelism_problem(d.layout, d.tp); !why.empty()) {
    return "cache layout " + why;
  }
  for (std::size_t l = 0; l < d.layout.layers.size(); ++l) {
    const auto& tensors = d.layout.layers[l].tensors;
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      if (tensors[i].region >= d.regions.size()) {
        return "cache layout " + where(l, i) + " is in region " +
               std::to_string(tensors[i].region) + ", but the description has " +
               std::to_string(d.regions.size()) + " region descriptors";
      }
    }
  }
  return {};
}

[[noreturn]] inline void refuse_description(const std::string& why) {
  throw std::system_error(make_error_code(errc::bad_engine_description),
                          "ferry::kv: engine description " + why);
}

class description_writer {
 public:
  void u8(std::uint8_t v) { bytes_.push_back(std::byte{v}); }
  void u16(std::uint16_t v) { little(v, 2); }
  void u32(std::uint32_t v) { little(v, 4); }
  void u64(std::uint64_t v) { little(v, 8); }
  void sized(std::span<const std::byte> b) {
    u32(static_cast<std::uint32_t>(b.size()));
    bytes_.insert(bytes_.end(), b.begin(), b.end());
  }
  [[nodiscard]] std::size_t size() const noexcept { return bytes_.size(); }
  // Writes the record length into the header and appends the checksum.
  [[nodiscard]] std::vector<std::byte> finish() {
    const auto length = static_cast<std::uint32_t>(bytes_.size() + description_trailer);
    for (std::size_t i = 0; i < 4; ++i) {
      bytes_[8 + i] = static_cast<std::byte>((length >> (8 * i)) & 0xff);
    }
    u32(description_checksum(bytes_));
    return std::move(bytes_);
  }

 private:
  void little(std::uint64_t v, std::size_t n) {
    for (std::size_t i = 0; i < n; ++i)
      bytes_.push_back(static_cast<std::byte>((v >> (8 * i)) & 0xff));
  }
  std::vector<std::byte> bytes_;
};

// Reads fields in order; running out names the field (and the layer, tensor or region it is in).
class description_reader {
 public:
  // `bytes` start at byte `base` of the record (for messages).
  explicit description_reader(std::span<const std::byte> bytes, std::size_t base = 0)
      : bytes_(bytes), base_(base) {}

  std::uint8_t u8(const char* field) { return static_cast<std::uint8_t>(little(1, field)); }
  std::uint16_t u16(const char* field) { return static_cast<std::uint16_t>(little(2, field)); }
  std::uint32_t u32(const char* field) { return static_cast<std::uint32_t>(little(4, field)); }
  std::uint64_t u64(const char* field) { return little(8, field); }
  // A count, refused past `most` before anything is allocated for it.
  std::uint32_t count(const char* field, std::uint32_t most) {
    const std::uint32_t n = u32(field);
    if (n > most) {
      refuse_description(context() + field + " is " + std::to_string(n) + ", over the limit " +
                         std::to_string(most));
    }
    return n;
  }
  std::span<const std::byte> bytes(std::size_t n, const char* field) {
    if (bytes_.size() - at_ < n) truncated(field);
    const auto out = bytes_.subspan(at_, n);
    at_ += n;
    return out;
  }
  void done() const {
    if (at_ != bytes_.size()) {
      refuse_description("has " + std::to_string(bytes_.size() - at_) +
                         " bytes after its last field");
    }
  }
  // Where the fields being read belong, for messages.
  void in(const char* part, std::size_t index) {
    part_ = part;
    index_ = index;
  }
  void in_layer(std::size_t layer) {
    in("layer", layer);
    layer_ = layer;
  }
  void out() { part_ = nullptr; }

 private:
  std::uint64_t little(std::size_t n, const char* field) {
    if (bytes_.size() - at_ < n) truncated(field);
    std::uint64_t v = 0;
    for (std::size_t i = 0; i < n; ++i) {
      v |= static_cast<std::uint64_t>(bytes_[at_ + i]) << (8 * i);
    }
    at_ += n;
    return v;
  }
  [[nodiscard]] std::string context() const {
    if (part_ == nullptr) return {};
    std::string s = std::string(part_) + " " + std::to_string(index_) + " ";
    if (std::string(part_) == "tensor") s = "layer " + std::to_string(layer_) + " " + s;
    return s;
  }
  [[noreturn]] void truncated(const char* field) const {
    refuse_description("ends inside " + context() + field + " (byte " +
                       std::to_string(base_ + at_) + " of " +
                       std::to_string(base_ + bytes_.size()) + ")");
  }
  std::span<const std::byte> bytes_;
  std::size_t base_ = 0;
  std::size_t at_ = 0;
  const char* part_ = nullptr;
  std::size_t index_ = 0;
  std::size_t layer_ = 0;
};

}  // namespace ferry::detail::kv

namespace ferry::kv {

inline void engine_description::check() const {
  if (std::string why = detail::kv::description_problem(*this); !why.empty()) {
    detail::kv::refuse_description(why);
  }
}

/// The description as a record to send to a peer (decode reads it back). Throws
/// std::system_error (errc::bad_engine_description) for a description that fails check() or
/// whose record would exceed description_limits::record_bytes: what is sent can be decoded.
[[nodiscard]] inline std::vector<std::byte> encode(const engine_description& d) {
  d.check();
  detail::kv::description_writer w;
  w.u32(detail::kv::description_magic);
  w.u16(description_format_version);
  w.u16(0);
  w.u32(0);  // the record length, filled in by finish()
  w.sized(std::as_bytes(std::span(d.engine_id)));
  w.u64(d.incarnation);
  w.u32(d.tp.rank);
  w.u32(d.tp.size);
  w.u32(static_cast<std::uint32_t>(d.layout.layers.size()));
  for (const layer_layout& layer : d.layout.layers) {
    w.u32(layer.group);
    w.u32(layer.total_heads);
    w.u8(layer.heads_sharded ? 1 : 0);
    w.u32(static_cast<std::uint32_t>(layer.tensors.size()));
    for (const tensor_layout& t : layer.tensors) {
      w.u32(t.region);
      w.u64(t.offset);
      w.u32(t.element_size);
      w.u32(t.blocks);
      w.u32(t.block_size);
      w.u32(t.heads);
      w.u32(t.head_size);
      w.u64(t.block_stride);
      w.u64(t.token_stride);
      w.u64(t.head_stride);
    }
  }
  w.u32(static_cast<std::uint32_t>(d.regions.size()));
  for (const auto& region : d.regions) w.sized(region);
  if (w.size() + detail::kv::description_trailer > description_limits::record_bytes) {
    detail::kv::refuse_description(
        "encodes to " + std::to_string(w.size() + detail::kv::description_trailer) +
        " bytes, over the limit " + std::to_string(description_limits::record_bytes));
  }
  return w.finish();
}

/// The description a peer's encode() wrote, checked (engine_description::check). Throws
/// std::system_error (errc::bad_engine_description) naming what is wrong with bytes that are not
/// one: too short for the frame, another magic, another format version, a length that is not the
/// number of bytes given, a checksum that does not match, a count over its limit, a field cut
/// off, bytes after the last field, or a description that fails its check.
[[nodiscard]] inline engine_description decode(std::span<const std::byte> bytes) {
  using limits = description_limits;
  constexpr std::size_t frame = detail::kv::description_header + detail::kv::description_trailer;
  if (bytes.size() < frame) {
    detail::kv::refuse_description("is " + std::to_string(bytes.size()) +
                                   " bytes, shorter than its " + std::to_string(frame) +
                                   "-byte frame");
  }
  detail::kv::description_reader head(bytes.first(detail::kv::description_header));
  if (head.u32("magic") != detail::kv::description_magic) {
    detail::kv::refuse_description(
        "does not start with the magic \"FKVD\": not an engine description");
  }
  if (const std::uint16_t v = head.u16("version"); v != description_format_version) {
    detail::kv::refuse_description("is of format version " + std::to_string(v) +
                                   "; this ferry reads version " +
                                   std::to_string(description_format_version));
  }
  if (const std::uint16_t reserved = head.u16("reserved"); reserved != 0) {
    detail::kv::refuse_description("has reserved header field " + std::to_string(reserved) +
                                   ", not 0");
  }
  const std::uint32_t length = head.u32("length");
  if (length > limits::record_bytes) {
    detail::kv::refuse_description("says it is " + std::to_string(length) +
                                   " bytes, over the limit " +
                                   std::to_string(limits::record_bytes));
  }
  if (length != bytes.size()) {
    detail::kv::refuse_description("says it is " + std::to_string(length) + " bytes, but " +
                                   std::to_string(bytes.size()) + " were given" +
                                   (length > bytes.size() ? " (truncated)" : ""));
  }
  const auto body = bytes.first(bytes.size() - detail::kv::description_trailer);
  detail::kv::description_reader trailer(bytes.last(detail::kv::description_trailer));
  if (trailer.u32("checksum") != detail::kv::description_checksum(body)) {
    detail::kv::refuse_description("checksum does not match its bytes: corrupted");
  }

  detail::kv::description_reader r(body.subspan(detail::kv::description_header),
                                   detail::kv::description_header);
  engine_description d;
  const std::uint32_t id_bytes = r.count("engine id length", limits::engine_id_bytes);
  const auto id = r.bytes(id_bytes, "engine id");
  d.engine_id.assign(reinterpret_cast<const char*>(id.data()), id.size());
  d.incarnation = r.u64("incarnation");
  d.tp.rank = r.u32("tp rank");
  d.tp.size = r.u32("tp size");
  const std::uint32_t layers = r.count("layer count", layout_limits::layers);
  d.layout.layers.reserve(layers);
  for (std::uint32_t l = 0; l < layers; ++l) {
    r.in_layer(l);
    layer_layout layer;
    layer.group = r.u32("group");
    layer.total_heads = r.u32("total_heads");
    const std::uint8_t sharded = r.u8("heads_sharded");
    if (sharded > 1) {
      detail::kv::refuse_description("layer " + std::to_string(l) + " heads_sharded is " +
                                     std::to_string(sharded) + ", not 0 or 1");
    }
    layer.heads_sharded = sharded == 1;
    const std::uint32_t tensors = r.count("tensor count", layout_limits::tensors_per_layer);
    layer.tensors.reserve(tensors);
    for (std::uint32_t i = 0; i < tensors; ++i) {
      r.in("tensor", i);
      tensor_layout t;
      t.region = r.u32("region");
      t.offset = r.u64("offset");
      t.element_size = r.u32("element_size");
      t.blocks = r.u32("blocks");
      t.block_size = r.u32("block_size");
      t.heads = r.u32("heads");
      t.head_size = r.u32("head_size");
      t.block_stride = r.u64("block_stride");
      t.token_stride = r.u64("token_stride");
      t.head_stride = r.u64("head_stride");
      layer.tensors.push_back(t);
    }
    d.layout.layers.push_back(std::move(layer));
  }
  r.out();
  const std::uint32_t regions = r.count("region count", limits::regions);
  d.regions.reserve(regions);
  for (std::uint32_t i = 0; i < regions; ++i) {
    r.in("region", i);
    const std::uint32_t n = r.count("descriptor length", limits::region_bytes);
    const auto b = r.bytes(n, "descriptor");
    d.regions.emplace_back(b.begin(), b.end());
  }
  r.out();
  r.done();
  d.check();
  return d;
}

/// Throws std::system_error unless `src`'s blocks can move to `dst`: check_compatible on their
/// layouts at their tensor-parallel positions (errc::incompatible_layouts naming what differs:
/// layer count, group, heads_sharded, total_heads, tensor count, block_size, head_size,
/// element_size; errc::bad_parallelism for a position that cannot split a layer's heads).
inline void check_compatible(const engine_description& src, const engine_description& dst) {
  check_compatible(src.layout, src.tp, dst.layout, dst.tp);
}

}  // namespace ferry::kv

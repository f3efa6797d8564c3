#pragma once
// What a peer hands over, as bytes the user carries on a channel of their own: a region of its
// registered memory (address, length and UCX's packed remote key), and how to reach its worker.
// Both serialise to a small framed record (magic, version, the UCX version, length, checksum), so
// bytes that are not one, or that come from a UCX whose formats differ, are refused with
// errc::bad_descriptor instead of reaching UCX, which does not check them.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

#include "ferry/ucx/detail/wire.hpp"
#include "ferry/ucx/errors.hpp"

namespace ferry::ucx {

namespace detail {

inline constexpr std::uint32_t region_magic = 0x47525846;   // "FXRG"
inline constexpr std::uint32_t address_magic = 0x41575846;  // "FXWA"
inline constexpr std::uint16_t descriptor_version = 2;

inline std::uint32_t fnv1a(std::span<const std::byte> bytes) noexcept {
  std::uint32_t h = 2166136261u;
  for (std::byte b : bytes) {
    h ^= static_cast<std::uint32_t>(b);
    h *= 16777619u;
  }
  return h;
}

// Little helpers for a framed record: fields in host order (peers share the byte order: UCX's own
// packed keys and addresses assume it too). The head is the magic, the format version and the UCX
// version.
class record_writer {
 public:
  explicit record_writer(std::uint32_t magic) {
    put(magic);
    put(descriptor_version);
    put(ucx_version::here());
  }
  template <class T>
  void put(const T& v) {
    const auto* p = reinterpret_cast<const std::byte*>(&v);
    bytes_.insert(bytes_.end(), p, p + sizeof v);
  }
  void put_bytes(std::span<const std::byte> b) { bytes_.insert(bytes_.end(), b.begin(), b.end()); }
  std::vector<std::byte> finish() {
    const std::uint32_t sum = fnv1a(bytes_);
    put(sum);
    return std::move(bytes_);
  }

 private:
  std::vector<std::byte> bytes_;
};

class record_reader {
 public:
  record_reader(std::span<const std::byte> bytes, std::uint32_t magic, const char* what)
      : bytes_(bytes), what_(what) {
    std::uint32_t sum = 0;
    if (bytes.size() < sizeof(std::uint32_t) * 2 + sizeof(std::uint16_t)) fail("too short");
    std::memcpy(&sum, bytes.data() + bytes.size() - sizeof sum, sizeof sum);
    if (sum != fnv1a(bytes.first(bytes.size() - sizeof sum))) fail("checksum does not match");
    bytes_ = bytes.first(bytes.size() - sizeof sum);
    if (get<std::uint32_t>() != magic) fail("wrong magic");
    if (const auto v = get<std::uint16_t>(); v != descriptor_version) {
      fail(("is of format version " + std::to_string(v) + "; this ferry reads version " +
            std::to_string(descriptor_version))
               .c_str());
    }
    const auto theirs = get<ucx_version>();
    if (const ucx_version ours = ucx_version::here(); !ours.compatible(theirs)) {
      fail(("comes from UCX " + theirs.text() + ", whose keys and addresses UCX " + ours.text() +
            " cannot read (major and minor versions must match)")
               .c_str());
    }
  }
  template <class T>
  T get() {
    T v{};
    if (bytes_.size() < sizeof v) fail("truncated");
    std::memcpy(&v, bytes_.data(), sizeof v);
    bytes_ = bytes_.subspan(sizeof v);
    return v;
  }
  std::vector<std::byte> get_bytes(std::size_t n) {
    if (bytes_.size() < n) fail("truncated");
    std::vector<std::byte> out(bytes_.begin(), bytes_.begin() + static_cast<std::ptrdiff_t>(n));
    bytes_ = bytes_.subspan(n);
    return out;
  }
  void done() {
    if (!bytes_.empty()) fail("has trailing bytes");
  }

 private:
  [[noreturn]] void fail(const std::string& why) const {
    throw std::system_error(make_error_code(errc::bad_descriptor),
                            std::string("ferry::ucx: ") + what_ + " " + why);
  }
  std::span<const std::byte> bytes_;
  const char* what_;
};

}  // namespace detail

/// A range of a peer's region.
struct remote_slice {
  std::uint64_t address = 0;  ///< the first byte, in the peer's address space
  std::uint64_t length = 0;   ///< bytes
  std::size_t region = 0;  ///< index into the endpoint's peer regions (see endpoint::peer_regions)
};

/// A peer's registered region: where it is in the peer's address space and its packed remote key.
struct remote_region {
  std::uint64_t address = 0;  ///< the region's first byte, in the peer's address space
  std::uint64_t length = 0;   ///< bytes
  std::vector<std::byte> packed_key;  ///< UCX's packed remote key (ucp_rkey_pack)

  /// The region as a descriptor to send to a peer (from_bytes reads it back).
  [[nodiscard]] std::vector<std::byte> to_bytes() const {
    detail::record_writer w(detail::region_magic);
    w.put(address);
    w.put(length);
    w.put(static_cast<std::uint32_t>(packed_key.size()));
    w.put_bytes(packed_key);
    return w.finish();
  }

  /// The region a peer's to_bytes() described, checked (check()).
  /// Throws std::system_error (errc::bad_descriptor) for bytes that are not a region descriptor.
  [[nodiscard]] static remote_region from_bytes(std::span<const std::byte> bytes) {
    detail::record_reader r(bytes, detail::region_magic, "remote region descriptor");
    remote_region out;
    out.address = r.get<std::uint64_t>();
    out.length = r.get<std::uint64_t>();
    const auto key_bytes = r.get<std::uint32_t>();
    if (key_bytes == 0 || key_bytes > 4096) {
      throw std::system_error(make_error_code(errc::bad_descriptor),
                              "ferry::ucx: remote region descriptor has a packed key of " +
                                  std::to_string(key_bytes) + " bytes");
    }
    out.packed_key = r.get_bytes(key_bytes);
    r.done();
    out.check();
    return out;
  }

  /// Throws std::system_error (errc::bad_descriptor) naming what is wrong with a region that UCX
  /// could not safely take: an empty range, one that wraps the address space, or a packed key whose
  /// structure is not UCX's. endpoint::import checks every region with it.
  void check() const {
    const auto refuse = [](const std::string& why) {
      throw std::system_error(make_error_code(errc::bad_descriptor),
                              "ferry::ucx: remote region " + why);
    };
    if (length == 0) refuse("has no bytes");
    if (address + length < address) refuse("wraps past the end of the address space");
    if (const std::string why = detail::packed_key_problem(packed_key); !why.empty()) {
      refuse("has a packed key that " + why);
    }
  }
};

}  // namespace ferry::ucx

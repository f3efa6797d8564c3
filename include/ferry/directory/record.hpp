#pragma once
// What the directory stores under a name, and the checks every byte read back goes through.
//
// A publication is stored as an envelope around the publisher's bytes, so that a reader can tell a
// ferry record from anything else under the same key and knows the publisher's incarnation:
//
//   offset  size  field
//   0       8     magic "FERRYDR1"
//   8       8     incarnation (little-endian, > 0)
//   16      4     length of the value that follows (little-endian)
//   20      4     checksum: FNV-1a (32 bits) of the bytes before it and of the value
//   24      n     the value (the publisher's bytes: a KV engine description, say)
//
// Bytes read from the directory come from other processes (or from whoever else writes to that etcd)
// and are hostile until decode_record has checked them: wrong magic, a cut or altered envelope, a
// length that disagrees, an incarnation of 0 and a value over the reader's limit are all refused with
// a message that says which.

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "ferry/directory/errors.hpp"

namespace ferry {

/// The longest name (or watched prefix) a directory takes, in bytes.
inline constexpr std::size_t max_directory_name_bytes = 255;

/// The largest value a directory takes by default (directory_options::max_record_bytes).
inline constexpr std::size_t default_max_record_bytes = 512 * 1024;

/// What is published under a name: the publisher's bytes and its incarnation.
struct directory_record {
  std::string name;              ///< the name it is published under
  std::uint64_t incarnation = 0;  ///< grows with each publication under the name; never 0
  std::vector<std::byte> value;  ///< the publisher's bytes (a KV engine description, say)
};

/// A change under a watched name or prefix.
struct directory_event {
  /// What happened to the name.
  enum class kind : std::uint8_t {
    published,  ///< a record was published (a new incarnation, or the same one updated)
    gone,       ///< the name was withdrawn or its lease expired
  };
  kind what = kind::published;  ///< what happened
  /// published: the record now under the name. gone: the name, and the incarnation that went (0
  /// when the directory could not tell which).
  directory_record record;
};

/// One name's outcome in a lookup of many.
struct lookup_result {
  std::string name;                       ///< the name looked up
  std::optional<directory_record> record;  ///< set when a record was found and passed its checks
  std::error_code error;  ///< why not: directory_errc::not_found, bad_record, record_too_large, ...
  std::string message;    ///< the error in words, naming the name and what was wrong
};

namespace detail {

inline constexpr std::array<char, 8> record_magic = {'F', 'E', 'R', 'R', 'Y', 'D', 'R', '1'};
inline constexpr std::size_t record_header_bytes = 24;

[[nodiscard]] inline std::uint32_t fnv1a(std::span<const std::byte> bytes,
                                         std::uint32_t h = 2166136261u) noexcept {
  for (const std::byte b : bytes) {
    h ^= static_cast<std::uint8_t>(b);
    h *= 16777619u;
  }
  return h;
}

inline void put_le(std::byte* p, std::uint64_t v, std::size_t n) noexcept {
  for (std::size_t i = 0; i < n; ++i) p[i] = static_cast<std::byte>((v >> (8 * i)) & 0xffu);
}

[[nodiscard]] inline std::uint64_t get_le(const std::byte* p, std::size_t n) noexcept {
  std::uint64_t v = 0;
  for (std::size_t i = 0; i < n; ++i) v |= static_cast<std::uint64_t>(p[i]) << (8 * i);
  return v;
}

[[nodiscard]] inline bool name_char(char c) noexcept {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
         c == '_' || c == '-' || c == ':' || c == '/';
}

}  // namespace detail

/// Why `name` cannot be a directory name (empty when it can): a name is 1 to 255 bytes, each a
/// letter, a digit, a dot, an underscore, a hyphen, a colon or a slash. With `prefix` true the empty
/// string is allowed (a watch on every name).
[[nodiscard]] inline std::string check_directory_name(std::string_view name, bool prefix = false) {
  if (name.empty() && !prefix) return "a name may not be empty";
  if (name.size() > max_directory_name_bytes) {
    return "a name is at most " + std::to_string(max_directory_name_bytes) + " bytes; this one has " +
           std::to_string(name.size());
  }
  for (std::size_t i = 0; i < name.size(); ++i) {
    if (!detail::name_char(name[i])) {
      return "byte " + std::to_string(i) + " (value " +
             std::to_string(static_cast<unsigned char>(name[i])) +
             ") is not allowed in a name (A-Z a-z 0-9 . _ - : /)";
    }
  }
  return {};
}

/// The envelope of `value` at `incarnation` (see the top of this header).
[[nodiscard]] inline std::vector<std::byte> encode_record(std::uint64_t incarnation,
                                                          std::span<const std::byte> value) {
  std::vector<std::byte> out(detail::record_header_bytes + value.size());
  std::memcpy(out.data(), detail::record_magic.data(), detail::record_magic.size());
  detail::put_le(out.data() + 8, incarnation, 8);
  detail::put_le(out.data() + 16, value.size(), 4);
  std::uint32_t h = detail::fnv1a(std::span<const std::byte>(out.data(), 20));
  h = detail::fnv1a(value, h);
  detail::put_le(out.data() + 20, h, 4);
  if (!value.empty()) std::memcpy(out.data() + detail::record_header_bytes, value.data(), value.size());
  return out;
}

/// `bytes` read under `name` checked and opened, or the reason they are refused: `error` set to
/// directory_errc::bad_record or record_too_large and `message` naming the name and what was wrong.
[[nodiscard]] inline lookup_result decode_record(std::string name, std::span<const std::byte> bytes,
                                                 std::size_t max_record_bytes) {
  lookup_result r;
  r.name = std::move(name);
  auto refuse = [&](directory_errc e, const std::string& why) {
    r.error = make_error_code(e);
    r.message = "ferry directory: the record under '" + r.name + "' " + why;
    return r;
  };
  if (bytes.size() > detail::record_header_bytes + max_record_bytes) {
    return refuse(directory_errc::record_too_large,
                  "is " + std::to_string(bytes.size()) + " bytes, over the limit of " +
                      std::to_string(max_record_bytes) + " bytes of value");
  }
  if (bytes.size() < detail::record_header_bytes) {
    return refuse(directory_errc::bad_record, "is " + std::to_string(bytes.size()) +
                                                  " bytes, shorter than a record's 24-byte header");
  }
  if (std::memcmp(bytes.data(), detail::record_magic.data(), detail::record_magic.size()) != 0) {
    return refuse(directory_errc::bad_record, "does not start with the magic FERRYDR1");
  }
  const std::uint64_t incarnation = detail::get_le(bytes.data() + 8, 8);
  const std::uint64_t length = detail::get_le(bytes.data() + 16, 4);
  if (length != bytes.size() - detail::record_header_bytes) {
    return refuse(directory_errc::bad_record,
                  "says its value is " + std::to_string(length) + " bytes but " +
                      std::to_string(bytes.size() - detail::record_header_bytes) + " follow");
  }
  const auto value = bytes.subspan(detail::record_header_bytes);
  std::uint32_t h = detail::fnv1a(bytes.first(20));
  h = detail::fnv1a(value, h);
  if (h != detail::get_le(bytes.data() + 20, 4)) {
    return refuse(directory_errc::bad_record, "fails its checksum (altered or cut)");
  }
  if (incarnation == 0) return refuse(directory_errc::bad_record, "has incarnation 0");
  r.record = directory_record{r.name, incarnation, {value.begin(), value.end()}};
  return r;
}

}  // namespace ferry

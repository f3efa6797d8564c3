#pragma once
// The TCP wire format of one framed block: a 24-byte header (magic "FRY1", reserved, block id,
// payload length; little-endian, the byte order of every host ferry runs on) followed by the
// payload. A send writes the header as it lies in memory, a receive reads it back the same way and
// checks it before it takes the payload.

#include <cstddef>
#include <cstdint>

#include "ferry/uring/errors.hpp"

namespace ferry::uring {

/// What a received framed block carried (tcp.hpp).
struct received_block {
  std::uint64_t id = 0;  ///< the block id the sender gave it
  std::size_t length = 0;  ///< the payload's length in bytes, written to the front of the buffer
};

namespace detail {

// The wire header of one framed block.
struct frame_header {
  static constexpr std::uint32_t magic_value = 0x31595246;  // "FRY1" read as little-endian
  std::uint32_t magic = magic_value;
  std::uint32_t reserved = 0;
  std::uint64_t id = 0;
  std::uint64_t length = 0;
};
static_assert(sizeof(frame_header) == 24);

// The header a send puts before a payload of `length` bytes of block `id`.
[[nodiscard]] constexpr frame_header encode_frame(std::uint64_t id, std::size_t length) noexcept {
  frame_header h;
  h.id = id;
  h.length = length;
  return h;
}

// Whether a header just received can be accepted for a destination of `capacity` bytes: errc{} if
// so, bad_frame for bytes that are not a ferry header, block_too_large for a payload that does not
// fit.
[[nodiscard]] constexpr errc check_frame(const frame_header& h, std::size_t capacity) noexcept {
  if (h.magic != frame_header::magic_value || h.reserved != 0) return errc::bad_frame;
  if (h.length > capacity) return errc::block_too_large;
  return errc{};
}

}  // namespace detail
}  // namespace ferry::uring

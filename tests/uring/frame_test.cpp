// The TCP wire format (frame.hpp): what a send puts before a payload, and which received headers
// a receive accepts.

#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

#include <ferry/uring/frame.hpp>

namespace uring = ferry::uring;
using uring::detail::check_frame;
using uring::detail::encode_frame;
using uring::detail::frame_header;

TEST_CASE("frame: a header is 24 bytes: magic FRY1, reserved zero, id and length little-endian",
          "[tcp]") {
  const frame_header h = encode_frame(0x0102030405060708u, 0x1122);
  unsigned char bytes[sizeof h];
  std::memcpy(bytes, &h, sizeof h);
  CHECK(sizeof h == 24);
  CHECK(std::memcmp(bytes, "FRY1", 4) == 0);
  CHECK(bytes[4] == 0);
  CHECK(bytes[7] == 0);
  CHECK(bytes[8] == 0x08);   // id, low byte first
  CHECK(bytes[15] == 0x01);
  CHECK(bytes[16] == 0x22);  // length, low byte first
  CHECK(bytes[17] == 0x11);
  CHECK(bytes[23] == 0);
}

TEST_CASE("frame: a header a send encodes is accepted by a receive whose buffer holds the payload",
          "[tcp]") {
  CHECK(check_frame(encode_frame(7, 0), 0) == uring::errc{});
  CHECK(check_frame(encode_frame(7, 4096), 4096) == uring::errc{});
  CHECK(check_frame(encode_frame(7, 100), 4096) == uring::errc{});
  constexpr std::size_t most = std::numeric_limits<std::size_t>::max();
  CHECK(check_frame(encode_frame(std::numeric_limits<std::uint64_t>::max(), most), most) ==
        uring::errc{});
}

TEST_CASE("frame: a payload larger than the receive's buffer is block_too_large", "[tcp]") {
  CHECK(check_frame(encode_frame(1, 4097), 4096) == uring::errc::block_too_large);
  CHECK(check_frame(encode_frame(1, 1), 0) == uring::errc::block_too_large);
}

TEST_CASE("frame: bytes that are not a ferry header are bad_frame, whatever their length says",
          "[tcp]") {
  frame_header wrong_magic = encode_frame(1, 8);
  wrong_magic.magic = 0x32595246;  // "FRY2"
  CHECK(check_frame(wrong_magic, 4096) == uring::errc::bad_frame);
  frame_header reserved_set = encode_frame(1, 8);
  reserved_set.reserved = 1;
  CHECK(check_frame(reserved_set, 4096) == uring::errc::bad_frame);
  frame_header garbage;
  unsigned char noise[sizeof garbage];
  std::memset(noise, 0xab, sizeof noise);
  std::memcpy(static_cast<void*>(&garbage), noise, sizeof noise);
  CHECK(check_frame(garbage, 0) == uring::errc::bad_frame);  // before its length is looked at
}

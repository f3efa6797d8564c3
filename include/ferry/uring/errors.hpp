#pragma once
// The io_uring backend's own error codes: what it decides about file reads and writes and about
// framed TCP blocks. Errors the kernel returns are errno values in std::system_category.

#include <system_error>

#include "ferry/detail/error_category.hpp"

namespace ferry::uring {

/// The io_uring backend's own error codes (category "ferry.uring"); describe() words each one.
enum class errc : int {
  end_of_file = 1,
  outside_registered_buffer,
  bad_registered_index,
  vector_too_large,
  connection_closed,
  connection_broken,
  block_too_large,
  bad_frame,
  cancelled_part_way,
  deadline_exceeded,
  listener_closed,
};

/// The message for `e` (what error_code::message() says); nullptr for a value that is no errc.
[[nodiscard]] constexpr const char* describe(errc e) noexcept {
  switch (e) {
    case errc::end_of_file:
      return "file ended before the read filled its buffer (partial data is not a success)";
    case errc::outside_registered_buffer:
      return "buffer does not lie inside the registered (fixed) buffer it names";
    case errc::bad_registered_index:
      return "registered (fixed) buffer index is larger than io_uring can name (65535)";
    case errc::vector_too_large:
      return "vectored transfer has more than 2^32 - 1 iovecs, or lengths whose sum overflows";
    case errc::connection_closed: return "peer closed the connection before the block was complete";
    case errc::connection_broken:
      return "an earlier transfer on this connection failed part-way, so its byte stream is out "
             "of step and no later block can be framed";
    case errc::block_too_large: return "received block is larger than the destination buffer";
    case errc::bad_frame:
      return "received bytes are not a ferry block header (the peer is not speaking ferry's framing)";
    case errc::cancelled_part_way:
      return "cancelled after part of the data had been read or written: those bytes left (or "
             "reached) the file or stream and the rest did not, so a stream read at its current "
             "position has lost them (the transferred count says how many)";
    case errc::deadline_exceeded:
      return "deadline passed before the connection was made (connect) or a peer connected "
             "(accept)";
    case errc::listener_closed:
      return "the tcp_listener was closed while the accept waited for a peer";
  }
  return nullptr;
}

/// The category of ferry::uring::errc, named "ferry.uring".
[[nodiscard]] inline const std::error_category& error_category() noexcept {
  return ferry::detail::error_category_of<errc, describe>("ferry.uring");
}

/// `e` as a std::error_code in error_category().
[[nodiscard]] inline std::error_code make_error_code(errc e) noexcept {
  return {static_cast<int>(e), error_category()};
}

}  // namespace ferry::uring

/// Makes ferry::uring::errc an error-code enum: it converts to std::error_code and compares with one.
template <>
struct std::is_error_code_enum<ferry::uring::errc> : std::true_type {};

#pragma once
// The core's own error conditions: what the core decides about a transfer (an empty handle, an
// abandoned completer, a backend gone) and what the loopback backend and posting with backoff
// report. Backends report errno values in std::system_category, and each layer owns the codes it
// decides itself: ferry::uring::errc (files and TCP), ferry::verbs::errc, ferry::kv::errc (the
// inference-server layer) and ferry::testing::errc (the test doubles).

#include "ferry/detail/config.hpp"

#include <system_error>

#include "ferry/detail/error_category.hpp"

namespace ferry {

/// The core's error codes (category "ferry"); a std::error_code compares equal to them directly.
enum class errc : int {
  empty_transfer = 1,     ///< The transfer handle is empty (default-constructed or moved-from).
  abandoned,              ///< Every completer was destroyed before the transfer completed.
  cancelled,              ///< The transfer was cancelled before it completed.
  destination_too_small,  ///< A copy's destination is smaller than the bytes to copy.
  source_too_small,       ///< A copy's source is smaller than the bytes to copy.
  overlapping_buffers,    ///< A copy's source and destination overlap.
  backend_shut_down,      ///< The backend was destroyed while the transfer was still queued.
  unspecified_failure,    ///< completer::fail was given an empty error_code.
  batch_too_large,        ///< A batch has more members than one wait can track (2^32 - 1).
  empty_buffer,           ///< The buffer to read into or write from is empty.
  submission_queue_full,  ///< The backend's submission queue stayed full until the deadline.
};

/// The message for `e` (what error_code::message() says); nullptr for a value that is no errc.
[[nodiscard]] constexpr const char* describe(errc e) noexcept {
  switch (e) {
    case errc::empty_transfer: return "transfer handle is empty (default-constructed or moved-from)";
    case errc::abandoned: return "every completer of the transfer was destroyed before it completed";
    case errc::cancelled: return "transfer was cancelled before it completed";
    case errc::destination_too_small:
      return "destination span is smaller than the number of bytes to copy";
    case errc::source_too_small: return "source span is smaller than the number of bytes to copy";
    case errc::overlapping_buffers: return "source and destination of a copy overlap";
    case errc::backend_shut_down: return "backend was destroyed while the transfer was still queued";
    case errc::unspecified_failure:
      return "transfer failed without an error code (completer::fail got an empty error_code)";
    case errc::batch_too_large:
      return "batch has more members than ferry can track in one wait (2^32 - 1)";
    case errc::empty_buffer: return "buffer to read into or write from is empty";
    case errc::submission_queue_full:
      return "backend's submission queue stayed full until the request's deadline";
  }
  return nullptr;
}

/// The category of ferry::errc, named "ferry"; one instance for the whole program.
[[nodiscard]] inline const std::error_category& error_category() noexcept {
  return detail::error_category_of<errc, describe>("ferry");
}

/// `e` as a std::error_code in error_category() (found by argument-dependent lookup).
[[nodiscard]] inline std::error_code make_error_code(errc e) noexcept {
  return {static_cast<int>(e), error_category()};
}

}  // namespace ferry

/// Makes ferry::errc an error-code enum: it converts to std::error_code and compares with one.
template <>
struct std::is_error_code_enum<ferry::errc> : std::true_type {};

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

enum class errc : int {
  empty_transfer = 1,
  abandoned,
  cancelled,
  destination_too_small,
  source_too_small,
  overlapping_buffers,
  backend_shut_down,
  unspecified_failure,
  batch_too_large,
  empty_buffer,
  submission_queue_full,
};

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

[[nodiscard]] inline const std::error_category& error_category() noexcept {
  return detail::error_category_of<errc, describe>("ferry");
}

[[nodiscard]] inline std::error_code make_error_code(errc e) noexcept {
  return {static_cast<int>(e), error_category()};
}

}  // namespace ferry

template <>
struct std::is_error_code_enum<ferry::errc> : std::true_type {};

#pragma once
// ferry's own error conditions. Backends report errno values in std::system_category; everything
// ferry itself decides (an empty handle, an abandoned completer, an injected fault) is a ferry::errc.

#include <string>
#include <system_error>

namespace ferry {

enum class errc : int {
  empty_transfer = 1,
  abandoned,
  cancelled,
  injected_fault,
  destination_too_small,
  source_too_small,
  overlapping_buffers,
  backend_shut_down,
  unspecified_failure,
  batch_too_large,
  empty_buffer,
  end_of_file,
  connection_closed,
  connection_broken,
  block_too_large,
  bad_frame,
  outside_registered_buffer,
  empty_request,
  submission_queue_full,
  bad_registered_index,
  vector_too_large,
};

namespace detail {

class error_category_impl final : public std::error_category {
 public:
  [[nodiscard]] const char* name() const noexcept override { return "ferry"; }

  [[nodiscard]] std::string message(int value) const override {
    switch (static_cast<errc>(value)) {
      case errc::empty_transfer:
        return "transfer handle is empty (default-constructed or moved-from)";
      case errc::abandoned:
        return "every completer of the transfer was destroyed before it completed";
      case errc::cancelled:
        return "transfer was cancelled before it completed";
      case errc::injected_fault:
        return "failure injected by ferry::fault_injector";
      case errc::destination_too_small:
        return "destination span is smaller than the number of bytes to copy";
      case errc::source_too_small:
        return "source span is smaller than the number of bytes to copy";
      case errc::overlapping_buffers:
        return "source and destination of a copy overlap";
      case errc::backend_shut_down:
        return "backend was destroyed while the transfer was still queued";
      case errc::unspecified_failure:
        return "transfer failed without an error code (completer::fail got an empty error_code)";
      case errc::batch_too_large:
        return "batch has more members than ferry can track in one wait (2^32 - 1)";
      case errc::empty_buffer:
        return "buffer to read into or write from is empty";
      case errc::end_of_file:
        return "file ended before the read filled its buffer (partial data is not a success)";
      case errc::connection_closed:
        return "peer closed the connection before the block was complete";
      case errc::connection_broken:
        return "an earlier transfer on this connection failed part-way, so its byte stream is out "
               "of step and no later block can be framed";
      case errc::block_too_large:
        return "received block is larger than the destination buffer";
      case errc::bad_frame:
        return "received bytes are not a ferry block header (the peer is not speaking ferry's framing)";
      case errc::outside_registered_buffer:
        return "buffer does not lie inside the registered (fixed) buffer it names";
      case errc::empty_request:
        return "request was sealed with no transfers, so it cannot be a completed load";
      case errc::submission_queue_full:
        return "backend's submission queue stayed full until the request's deadline";
      case errc::bad_registered_index:
        return "registered (fixed) buffer index is larger than io_uring can name (65535)";
      case errc::vector_too_large:
        return "vectored transfer has more than 2^32 - 1 iovecs, or lengths whose sum overflows";
    }
    return "unknown ferry error " + std::to_string(value);
  }
};

}  // namespace detail

[[nodiscard]] inline const std::error_category& error_category() noexcept {
  static const detail::error_category_impl category;
  return category;
}

[[nodiscard]] inline std::error_code make_error_code(errc e) noexcept {
  return {static_cast<int>(e), error_category()};
}

}  // namespace ferry

template <>
struct std::is_error_code_enum<ferry::errc> : std::true_type {};

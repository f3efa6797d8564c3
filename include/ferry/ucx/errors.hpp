#pragma once
// The UCX backend's error codes. A request UCX failed carries its ucs_status_t in ucs_category(), so
// the code reads as UCX's own text ("Endpoint timeout", "Connection reset by remote peer"). What the
// backend itself decides is a ferry::ucx::errc.

#include <ucs/type/status.h>

#include <string>
#include <system_error>

#include "ferry/detail/error_category.hpp"

namespace ferry::ucx {

/// The UCX backend's own error codes (category "ferry::ucx").
enum class errc : int {
  deadline_exceeded = 1,  ///< the request's deadline passed: its endpoint was closed to end it
  endpoint_closed,        ///< the endpoint was closed (by close(), or to end another request)
  outside_region,         ///< a local or remote range is not inside its region
  length_mismatch,        ///< local and remote ranges differ in length
  bad_descriptor,         ///< bytes that are not a ferry UCX descriptor (region or worker address)
  handshake_failed,       ///< connecting by host and port did not complete the region exchange
  peer_gone,              ///< the peer's process has exited (a same-host peer, checked by pid)
  worker_closed,          ///< the worker was destroyed while the request was queued
  not_executor_safe,      ///< a blocking call made on the executor's own thread
  peer_unresponsive,      ///< the peer left a liveness ping unanswered (a stopped or hung process)
  notification_refused,   ///< the receiver already held max_unclaimed_notifications of ours
  memory_type_unsupported,  ///< registering memory of a type (GPU memory) this UCX was built without
};

/// The message for `e` (what error_code::message() says); nullptr for a value that is no errc.
[[nodiscard]] constexpr const char* describe(errc e) noexcept {
  switch (e) {
    case errc::deadline_exceeded:
      return "deadline passed before UCX completed the request; its endpoint was force-closed so "
             "that UCX let go of the request's buffers";
    case errc::endpoint_closed:
      return "endpoint was closed (by close(), or force-closed to end a request whose deadline "
             "passed) before the request completed";
    case errc::outside_region: return "range is not inside its memory region";
    case errc::length_mismatch: return "local and remote ranges of a get or put differ in length";
    case errc::bad_descriptor:
      return "bytes are not a ferry UCX descriptor (wrong magic, version, length or checksum)";
    case errc::handshake_failed:
      return "connecting by host and port did not complete the exchange of regions with the peer";
    case errc::peer_gone:
      return "the peer's process has exited (on this host ferry watches its pid, since shared "
             "memory reports success into a dead peer's segment)";
    case errc::worker_closed: return "UCX worker was destroyed while the request was still queued";
    case errc::not_executor_safe:
      return "blocking UCX call made on the progress executor's own thread, which must progress "
             "the worker for it to finish";
    case errc::peer_unresponsive:
      return "the peer did not answer liveness pings within the liveness timeout while a "
             "notification wait was pending (a stopped or hung process); its endpoint was closed";
    case errc::notification_refused:
      return "the receiver refused the notification: it already held "
             "worker_options::max_unclaimed_notifications from this sender that nobody had taken";
    case errc::memory_type_unsupported:
      return "memory of this type (GPU memory) cannot be registered: the UCX in use was built "
             "without support for it, and ferry does not stage device memory through host memory";
  }
  return nullptr;
}

/// The category of ferry::ucx::errc, named "ferry::ucx".
[[nodiscard]] inline const std::error_category& ucx_category() noexcept {
  return ferry::detail::error_category_of<errc, describe>("ferry::ucx");
}

/// `e` as a std::error_code in ucx_category().
[[nodiscard]] inline std::error_code make_error_code(errc e) noexcept {
  return {static_cast<int>(e), ucx_category()};
}

namespace detail {

class ucs_category_impl final : public std::error_category {
 public:
  [[nodiscard]] const char* name() const noexcept override { return "ucs_status"; }
  [[nodiscard]] std::string message(int value) const override {
    return std::string("UCX: ") + ::ucs_status_string(static_cast<ucs_status_t>(value));
  }
};

}  // namespace detail

/// The category of UCX's own status codes ("ucs_status"), whose messages are UCX's text.
/// ucs_status_t values, as UCX reports them (negative).
[[nodiscard]] inline const std::error_category& ucs_category() noexcept {
  static const detail::ucs_category_impl category;
  return category;
}

/// UCX's status `s` as a std::error_code in ucs_category(); its message is UCX's own text.
[[nodiscard]] inline std::error_code status_error(ucs_status_t s) noexcept {
  return {static_cast<int>(s), ucs_category()};
}

}  // namespace ferry::ucx

/// Makes ferry::ucx::errc an error-code enum: it converts to std::error_code and compares with one.
template <>
struct std::is_error_code_enum<ferry::ucx::errc> : std::true_type {};

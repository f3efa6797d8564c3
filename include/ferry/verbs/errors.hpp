#pragma once
// The verbs backend's error codes. A work completion that failed carries its ibv_wc_status in
// work_completion_category(), so the code names the status the adapter reported (IBV_WC_REM_ACCESS_ERR
// and so on). Everything the backend itself decides is a ferry::verbs::errc.

#include <infiniband/verbs.h>

#include <string>
#include <system_error>

#include "ferry/detail/error_category.hpp"

namespace ferry::verbs {

/// The verbs backend's own error codes (category "ferry.verbs").
enum class errc : int {
  queue_pair_error = 1,   ///< the queue pair is in the error state
  queue_pair_fatal,       ///< IBV_EVENT_QP_FATAL (or a request/access error event) on the queue pair
  completion_queue_error, ///< IBV_EVENT_CQ_ERR: the completion queue overran or failed
  device_fatal,           ///< IBV_EVENT_DEVICE_FATAL
  port_down,              ///< IBV_EVENT_PORT_ERR on the queue pair's port
  deadline_exceeded,      ///< the request's deadline passed before its completion arrived
  batch_exceeds_send_queue,  ///< a batch needs more work requests than the send queue ever holds
  outside_local_region,   ///< a local slice is in no region registered on the device
  length_mismatch,        ///< the local and remote slices differ in length
  message_too_large,      ///< a slice is larger than max_message_bytes (2 GiB)
  queue_pair_closed,      ///< the queue pair was closed before the request completed
  not_connected,          ///< the queue pair is not connected to a peer yet
  handshake_failed,       ///< the handshake over the TCP side channel failed
  queue_pair_timed_out,   ///< a request's deadline passed in the adapter: the queue pair was flushed
  peer_unreachable,       ///< the peer did not answer (IBV_WC_RETRY_EXC_ERR): a check or a request
  bad_notification,       ///< a received message is not a ferry notification
  severed,                ///< queue_pair::sever ended it; its transfers fail with the reason given
};

namespace detail {

[[nodiscard]] inline const char* wc_status_name(int status) noexcept {
  switch (status) {
    case IBV_WC_SUCCESS: return "IBV_WC_SUCCESS";
    case IBV_WC_LOC_LEN_ERR: return "IBV_WC_LOC_LEN_ERR: local length error";
    case IBV_WC_LOC_QP_OP_ERR: return "IBV_WC_LOC_QP_OP_ERR: local queue pair operation error";
    case IBV_WC_LOC_EEC_OP_ERR: return "IBV_WC_LOC_EEC_OP_ERR: local EE context operation error";
    case IBV_WC_LOC_PROT_ERR: return "IBV_WC_LOC_PROT_ERR: local protection error (bad lkey or address)";
    case IBV_WC_WR_FLUSH_ERR:
      return "IBV_WC_WR_FLUSH_ERR: work request flushed (the queue pair is in the error state)";
    case IBV_WC_MW_BIND_ERR: return "IBV_WC_MW_BIND_ERR: memory window bind error";
    case IBV_WC_BAD_RESP_ERR: return "IBV_WC_BAD_RESP_ERR: bad response error";
    case IBV_WC_LOC_ACCESS_ERR: return "IBV_WC_LOC_ACCESS_ERR: local access error";
    case IBV_WC_REM_INV_REQ_ERR: return "IBV_WC_REM_INV_REQ_ERR: remote invalid request error";
    case IBV_WC_REM_ACCESS_ERR:
      return "IBV_WC_REM_ACCESS_ERR: remote access error (bad rkey, range or access rights)";
    case IBV_WC_REM_OP_ERR: return "IBV_WC_REM_OP_ERR: remote operation error";
    case IBV_WC_RETRY_EXC_ERR: return "IBV_WC_RETRY_EXC_ERR: transport retry counter exceeded";
    case IBV_WC_RNR_RETRY_EXC_ERR: return "IBV_WC_RNR_RETRY_EXC_ERR: receiver-not-ready retry counter exceeded";
    case IBV_WC_LOC_RDD_VIOL_ERR: return "IBV_WC_LOC_RDD_VIOL_ERR: local RDD violation error";
    case IBV_WC_REM_INV_RD_REQ_ERR: return "IBV_WC_REM_INV_RD_REQ_ERR: remote invalid RD request";
    case IBV_WC_REM_ABORT_ERR: return "IBV_WC_REM_ABORT_ERR: remote aborted error";
    case IBV_WC_INV_EECN_ERR: return "IBV_WC_INV_EECN_ERR: invalid EE context number";
    case IBV_WC_INV_EEC_STATE_ERR: return "IBV_WC_INV_EEC_STATE_ERR: invalid EE context state";
    case IBV_WC_FATAL_ERR: return "IBV_WC_FATAL_ERR: fatal error";
    case IBV_WC_RESP_TIMEOUT_ERR: return "IBV_WC_RESP_TIMEOUT_ERR: response timeout error";
    case IBV_WC_GENERAL_ERR: return "IBV_WC_GENERAL_ERR: general error";
    case IBV_WC_TM_ERR: return "IBV_WC_TM_ERR: tag matching error";
    case IBV_WC_TM_RNDV_INCOMPLETE: return "IBV_WC_TM_RNDV_INCOMPLETE: tag matching rendezvous incomplete";
  }
  return nullptr;
}

class work_completion_category_impl final : public std::error_category {
 public:
  [[nodiscard]] const char* name() const noexcept override { return "ibv_wc_status"; }
  [[nodiscard]] std::string message(int value) const override {
    if (const char* s = wc_status_name(value)) return s;
    return "unknown ibv_wc_status " + std::to_string(value);
  }
};

}  // namespace detail

/// The category of a failed work completion's ibv_wc_status ("ibv_wc_status"): its message names
/// the status (IBV_WC_REM_ACCESS_ERR and so on).
[[nodiscard]] inline const std::error_category& work_completion_category() noexcept {
  static const detail::work_completion_category_impl category;
  return category;
}

/// The message for `e` (what error_code::message() says); nullptr for a value that is no errc.
[[nodiscard]] constexpr const char* describe(errc e) noexcept {
  switch (e) {
    case errc::queue_pair_error:
      return "queue pair is in the error state (an earlier work request failed, or it was moved "
             "to error), so nothing more can be posted on it";
    case errc::queue_pair_fatal:
      return "asynchronous event IBV_EVENT_QP_FATAL (or a request or access error event) on the "
             "queue pair";
    case errc::completion_queue_error:
      return "asynchronous event IBV_EVENT_CQ_ERR: the completion queue failed";
    case errc::device_fatal:
      return "asynchronous event IBV_EVENT_DEVICE_FATAL: the RDMA device failed";
    case errc::port_down:
      return "asynchronous event IBV_EVENT_PORT_ERR: the queue pair's port went down";
    case errc::deadline_exceeded:
      return "deadline passed before the work completion arrived (a request the adapter held was "
             "taken back by moving its queue pair to the error state)";
    case errc::batch_exceeds_send_queue:
      return "batch has more work requests than the queue pair's send queue can ever hold";
    case errc::outside_local_region:
      return "local slice belongs to no memory region registered on this queue pair's device";
    case errc::length_mismatch:
      return "local and remote slices of a READ or WRITE differ in length";
    case errc::message_too_large:
      return "slice is larger than the largest RDMA message (2 GiB)";
    case errc::queue_pair_closed:
      return "queue pair was closed before the request completed";
    case errc::not_connected:
      return "queue pair is not connected to a peer yet";
    case errc::handshake_failed:
      return "connection handshake over the TCP side channel failed";
    case errc::queue_pair_timed_out:
      return "a request's deadline passed while the adapter held it, so the queue pair was moved "
             "to the error state to take it back; nothing more can be posted on it";
    case errc::peer_unreachable:
      return "the peer did not answer (a request, or a check that it is still there, failed with "
             "IBV_WC_RETRY_EXC_ERR): its queue pair or process has gone, it is not connected "
             "yet, or the path to it is down; nothing more can be posted on the queue pair";
    case errc::bad_notification:
      return "received message is not a ferry notification (a peer not speaking ferry's protocol)";
    case errc::severed:
      return "the queue pair was severed (its peer restarted or went, as a directory showed)";
  }
  return nullptr;
}

/// The category of ferry::verbs::errc, named "ferry.verbs".
[[nodiscard]] inline const std::error_category& error_category() noexcept {
  return ferry::detail::error_category_of<errc, describe>("ferry.verbs");
}

/// `e` as a std::error_code in error_category().
[[nodiscard]] inline std::error_code make_error_code(errc e) noexcept {
  return {static_cast<int>(e), error_category()};
}

/// The error a failed work completion carries.
[[nodiscard]] inline std::error_code make_error_code(ibv_wc_status status) noexcept {
  return {static_cast<int>(status), work_completion_category()};
}

}  // namespace ferry::verbs

/// Makes ferry::verbs::errc an error-code enum: it converts to std::error_code and compares with one.
template <>
struct std::is_error_code_enum<ferry::verbs::errc> : std::true_type {};

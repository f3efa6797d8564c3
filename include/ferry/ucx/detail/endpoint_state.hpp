#pragma once
// One endpoint's state, and its lifecycle as one phase with every transition made in one place.
//
//   phase       UCX's endpoint              requests                      a UCS_OK from UCX
//   ----------  --------------------------  ----------------------------  ----------------------
//   created     not yet made                refused                       -
//   open        carries requests            accepted                      ends a member success
//   closing     a close is flushing it      refused (endpoint_closed);    ends a member success
//                                           those out end as they would
//   closed      closed by UCX after a       refused                       ends a member success:
//               flush (no force-close)                                    UCX flushed before it
//   broken      UCX failed it, or ferry     refused with why it broke     never trusted: the
//               force-closed it                                           member fails
//
//   transition             made by                                 who can race it
//   ---------------------  --------------------------------------  -----------------------------------
//   created -> open        make_endpoint (the executor), once      nothing: UCX calls back on the
//                          UCX made it                             executor thread only
//   open -> closing        start_close (executor)                  nothing
//   closing -> closed      close_go_on, without peer error         nothing
//                          handling (UCX cannot force-close)
//   any but broken ->      force_close: UCX's error handler, a     a UCX callback inside the call
//     broken               deadline, a close's timeout or end,     that force-closes (UCX fails an
//                          the liveness check, the worker going    endpoint from inside ucp_put_nbx):
//                                                                  force_close is re-entrant and
//                                                                  acts once (the phase says so)
//
// No phase goes back, and broken is final. Every transition runs on the executor thread (UCX runs in
// single-thread mode and calls back only inside the executor's progress); submitters only read
// failure(), which is written before the phase leaves open and read with acquire.
//
// Why `broken` distrusts UCS_OK: after a force-close UCX calls back most requests with
// UCS_ERR_CANCELED, but a flush whose puts had completed locally may be called back later, when the
// worker is destroyed, with UCS_OK, although none of its bytes reached the peer. So once an endpoint
// has broken, no member on it ends success.

#include <ucp/api/ucp.h>

#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <system_error>
#include <vector>

#include "ferry/metrics.hpp"
#include "ferry/ucx/detail/wire.hpp"
#include "ferry/ucx/errors.hpp"
#include "ferry/ucx/remote.hpp"

namespace ferry::ucx::detail {

class engine;
struct request;

enum class endpoint_phase : std::uint8_t { created, open, closing, closed, broken };

// The table above, as the one test every transition passes.
[[nodiscard]] constexpr bool legal_transition(endpoint_phase from, endpoint_phase to) noexcept {
  using enum endpoint_phase;
  switch (to) {
    case open: return from == created;
    case closing: return from == open;
    case closed: return from == closing;
    case broken: return from != broken;
    case created: return false;
  }
  return false;
}

struct imported_region {
  std::uint64_t address = 0;
  std::uint64_t length = 0;
  ucp_rkey_h rkey = nullptr;  // unpacked on the executor at import, destroyed with the endpoint
};

struct endpoint_state {
  engine* eng = nullptr;
  ucp_ep_h ep = nullptr;  // null once UCX has been told to close it
  peer_identity peer;
  // A peer in this process's PID namespace on this host: open until the state goes, so that a
  // request ending after the endpoint broke still sees whether the peer has exited.
  int peer_pidfd = -1;
  std::vector<imported_region> regions;  // executor only after connect
  std::deque<std::uint64_t> notifications;  // arrived, not yet taken; bounded
  std::uint64_t notifications_refused = 0;  // past the bound (executor; read by the stats call)
  std::deque<request*> notification_waiters;
  std::size_t in_flight = 0;  // UCX requests out on this endpoint, not abandoned
  std::size_t held = 0;       // ferry requests of this endpoint with a UCX request out
  std::uint64_t sends = 0;    // puts, gets and notification messages handed to UCX
  std::vector<request*> close_waiters;  // later closes, which end with the first
  bool ping_out = false;  // a liveness ping not yet answered, sent at ping_sent
  std::chrono::steady_clock::time_point ping_sent{};
  // With a metrics registry: the peer's label ("worker-<id>") and its series for put and get,
  // made at its first recorded operation.
  std::string metrics_peer;
  std::array<metrics::op_metrics*, 2> peer_metrics{};
  // The peer's regions as the handshake or import() gave them, for submitters' range checks:
  // written before the handle that reads them is handed out.
  std::vector<remote_region> peer_regions;

  endpoint_state() = default;
  endpoint_state(const endpoint_state&) = delete;
  endpoint_state& operator=(const endpoint_state&) = delete;
  ~endpoint_state() {
    if (peer_pidfd >= 0) ::close(peer_pidfd);
  }

  [[nodiscard]] endpoint_phase phase() const noexcept { return phase_; }
  [[nodiscard]] bool carries_requests() const noexcept { return phase_ == endpoint_phase::open; }
  // A UCS_OK from UCX on this endpoint says what it seems to (see the table).
  [[nodiscard]] bool trusts_success() const noexcept { return phase_ != endpoint_phase::broken; }

  // The one place the phase changes; false (and no change) when the table does not allow it.
  // `why` is recorded first when the endpoint stops carrying requests (the first reason stays).
  bool move_to(endpoint_phase to, std::error_code why = {}) noexcept {
    if (!legal_transition(phase_, to)) return false;
    if (to != endpoint_phase::open) fail(why ? why : make_error_code(errc::endpoint_closed));
    phase_ = to;
    return true;
  }

  // Why the endpoint can carry nothing more (empty while it can). Written on the executor.
  void fail(std::error_code ec) {
    std::lock_guard lock(failure_mutex_);
    if (!failure_) failure_ = ec;
    // Release pairs with failure()'s acquire: the reason is seen with the flag.
    failed_.store(true, std::memory_order_release);
  }
  [[nodiscard]] std::error_code failure() const {
    if (!failed_.load(std::memory_order_acquire)) return {};
    std::lock_guard lock(failure_mutex_);
    return failure_;
  }

 private:
  endpoint_phase phase_ = endpoint_phase::created;
  mutable std::mutex failure_mutex_;
  std::error_code failure_;
  std::atomic<bool> failed_{false};
};

// A listener by host and port (connection.hpp): ferry's own TCP socket.
struct listener_state {
  engine* eng = nullptr;
  int fd = -1;  // -1 once closed
  std::uint16_t port = 0;
  std::vector<remote_region> expose;  // what accepted peers are told
  std::deque<std::shared_ptr<endpoint_state>> ready;  // connected, not yet accepted
  std::deque<request*> accept_waiters;
};

}  // namespace ferry::ucx::detail

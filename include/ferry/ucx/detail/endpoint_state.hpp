#pragma once
// One endpoint's state. The executor owns everything but the failure record, which submitters read
// to refuse requests on an endpoint that can no longer carry them.

#include <ucp/api/ucp.h>

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
#include "ferry/ucx/remote.hpp"

namespace ferry::ucx::detail {

class engine;
struct request;

// What a peer told about itself: its worker, and where it runs (a same-host peer is checked by pid).
struct peer_identity {
  std::uint64_t worker_id = 0;
  std::uint64_t host_id = 0;
  std::uint32_t pid = 0;
};

struct imported_region {
  std::uint64_t address = 0;
  std::uint64_t length = 0;
  std::vector<std::byte> packed_key;
  ucp_rkey_h rkey = nullptr;  // unpacked on the executor at first use, destroyed with the endpoint
};

struct endpoint_state {
  engine* eng = nullptr;
  ucp_ep_h ep = nullptr;  // null once closed
  peer_identity peer;
  int peer_pidfd = -1;  // same-host peers only
  bool handshaken = false;
  request* connect_waiter = nullptr;  // connect by host and port, until the peer's hello
  std::shared_ptr<struct listener_state> accepted_by;
  std::vector<imported_region> regions;  // executor only after connect
  std::deque<std::uint64_t> notifications;
  std::deque<request*> notification_waiters;
  std::size_t in_flight = 0;  // UCX requests out on this endpoint
  std::uint64_t sends = 0;    // puts, gets and notification messages handed to UCX
  bool closing = false;                 // a close is flushing it (engine::start_close)
  bool close_due = false;               // a request's deadline passed: poll() force-closes it
  std::vector<request*> close_waiters;  // later closes, which end with that one
  bool ping_out = false;      // a liveness ping not yet answered, sent at ping_sent
  std::chrono::steady_clock::time_point ping_sent{};
  // With a metrics registry: the peer's label ("worker-<id>") and its series for put and get,
  // made at its first recorded operation.
  std::string metrics_peer;
  std::array<metrics::op_metrics*, 2> peer_metrics{};

  // Why the endpoint can carry nothing more (empty while it can). Written once, on the executor.
  void fail(std::error_code ec) {
    std::lock_guard lock(failure_mutex_);
    if (!failure_) failure_ = ec;
    failed_.store(true, std::memory_order_release);
  }
  [[nodiscard]] std::error_code failure() const {
    if (!failed_.load(std::memory_order_acquire)) return {};
    std::lock_guard lock(failure_mutex_);
    return failure_;
  }

  // The peer's regions as the handshake or import() gave them, for submitters' range checks:
  // written before the handle that reads them is handed out.
  std::vector<remote_region> peer_regions;

 private:
  mutable std::mutex failure_mutex_;
  std::error_code failure_;
  std::atomic<bool> failed_{false};
};

struct listener_state {
  engine* eng = nullptr;
  ucp_listener_h listener = nullptr;
  std::uint16_t port = 0;
  std::vector<std::byte> hello;  // what accepted peers are told
  std::deque<std::shared_ptr<endpoint_state>> ready;
  std::deque<request*> accept_waiters;
  std::vector<std::shared_ptr<endpoint_state>> handshaking;
};

}  // namespace ferry::ucx::detail

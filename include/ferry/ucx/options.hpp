#pragma once
// How a UCX worker is configured, in code: UCX reads its UCX_* environment variables first, and
// these override them.

#include <chrono>
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

namespace ferry::metrics {
class registry;
}  // namespace ferry::metrics

namespace ferry::ucx {

/// How a UCX worker is configured; UCX reads its UCX_* environment variables first, and these
/// override them.
struct worker_options {
  /// UCX's TLS setting: "tcp", "shm", "tcp,shm", "all", ...
  std::string transports = "tcp,shm";
  /// UCX's NET_DEVICES (e.g. "lo", "mlx5_0:1"); empty leaves UCX's choice.
  std::string devices;
  /// Peer failure handling on every endpoint (UCP_ERR_HANDLING_MODE_PEER): a peer that dies fails
  /// the requests it strands instead of leaving them pending, and a request's deadline can
  /// force-close its endpoint. With it, shared memory needs MM_ERROR_HANDLING=y (set here unless the
  /// extra settings below say otherwise), or UCX refuses every shared-memory lane.
  bool peer_error_handling = true;
  /// UCX's KEEPALIVE_INTERVAL: how soon a dead peer is noticed where nothing else tells (shared
  /// memory: UCX's default is 20 s). 0 leaves UCX's default.
  std::chrono::milliseconds keepalive = std::chrono::seconds(1);
  /// While a receive_notification is pending with nothing else out on its endpoint, the peer is
  /// pinged every liveness_interval; one that leaves a ping unanswered for liveness_timeout (a
  /// stopped or hung process, which UCX's keepalive does not notice) has its endpoint closed, and
  /// the wait fails with errc::peer_unresponsive. 0 turns the check off.
  std::chrono::milliseconds liveness_interval = std::chrono::seconds(1);
  /// How long a liveness ping may go unanswered before the peer's endpoint is closed.
  std::chrono::milliseconds liveness_timeout = std::chrono::seconds(10);
  /// How long closing an endpoint (endpoint::close(), its last handle going, its worker going) waits
  /// for what is out on it to end and for the peer to have read what was sent, before it
  /// force-closes it. 0: force-close at once (UCX 1.13 may then abort a tcp peer that still had
  /// puts to acknowledge: docs/ucx.md).
  std::chrono::milliseconds close_timeout = std::chrono::seconds(5);
  /// Notifications that arrived from one peer and that no receive_notification has taken yet are
  /// kept up to this many (1 to 2^24); past it a notification is refused: its sender's transfer
  /// fails with errc::notification_refused and worker::notifications_refused() counts it.
  std::size_t max_unclaimed_notifications = 65536;
  /// How long a peer that connected to a listener may take to send its hello (connection.hpp)
  /// before the connection is dropped.
  std::chrono::milliseconds handshake_timeout = std::chrono::seconds(10);
  /// Any other UCX setting, by its name without the UCX_ prefix ("RNDV_THRESH", "8k").
  std::vector<std::pair<std::string, std::string>> settings;
  /// Where the worker records each get and put that ends, per kind and per peer (metrics.hpp); it
  /// must outlive the worker. Null: nothing is recorded, at the cost of one test per request.
  ferry::metrics::registry* metrics = nullptr;
};

/// What a get or put's transfer waits for.
enum class put_completion {
  landed,           ///< the data is in the peer's memory (the put, then a flush of the endpoint)
  source_reusable,  ///< only that the source buffer may be reused: faster, says nothing of the peer
};

}  // namespace ferry::ucx

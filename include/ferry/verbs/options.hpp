#pragma once
// What a device and a queue pair are opened with, and what a device counts.

#include <chrono>
#include <cstdint>
#include <string>

namespace ferry::metrics {
class registry;
}  // namespace ferry::metrics

namespace ferry::verbs {

/// What a verbs device is opened with (basic_device's constructor).
struct device_options {
  std::string name;              ///< the device to open; empty: the first one found
  std::uint8_t port = 1;         ///< the port its queue pairs use
  int gid_index = 0;             ///< the source GID when the port's link layer is Ethernet (RoCE)
  /// The size of the device's one completion queue, shared by all its queue pairs' requests.
  int completion_queue_entries = 4096;
  /// Where the device records each READ and WRITE that ends (metrics.hpp); it must outlive the
  /// device. Null: nothing is recorded, at the cost of one test per request.
  ferry::metrics::registry* metrics = nullptr;
};

/// What a queue pair is made with (basic_queue_pair's constructor).
struct queue_pair_options {
  std::uint32_t send_depth = 256;     ///< work requests in flight at once
  std::uint32_t receive_depth = 64;   ///< notifications that may have arrived and not yet been taken
  /// Inline data asked of the adapter per work request (at least 8: notifications go inline).
  std::uint32_t max_inline_data = 64;
  std::uint8_t max_rd_atomic = 16;    ///< RDMA READs in flight at once, each way
  /// How long read() and write() back off while the send queue is full before the transfer fails
  /// with errc::submission_queue_full (try_read and try_write return nullopt at once instead).
  std::chrono::nanoseconds admission_timeout = std::chrono::milliseconds(100);
  /// How long a broken queue pair (deadline, close, fatal event, error completion) waits for the
  /// adapter to flush back what it holds. A request ends when its flush arrives, when the adapter
  /// no longer touches its memory; one still held after this fails anyway (its region stays
  /// registered until the flush or the queue pair's end), so that an adapter that never flushes
  /// cannot hang a wait.
  std::chrono::nanoseconds flush_timeout = std::chrono::seconds(1);
  /// How often a queue pair with a receive_notification waiting, and nothing else in flight, checks
  /// that its peer is still there. RC tells of a peer that has gone (its process killed, its queue
  /// pair destroyed) only when something is sent to it, so a wait for its next notification would
  /// otherwise wait for ever. The check is a zero-length RDMA WRITE, which the peer's adapter answers
  /// without its software; when it fails (IBV_WC_RETRY_EXC_ERR, once the adapter's retries run out)
  /// the waits fail with errc::peer_unreachable. Checks start once the peer is known to be
  /// connected (the handshake, mark_peer_connected, or anything that came back from it), go out only
  /// while nothing else is in flight, and take no request's send-queue credit. Zero turns them off.
  std::chrono::nanoseconds peer_check = std::chrono::seconds(1);
  /// How the peer is labelled in the device's metrics (device_options::metrics), where its writes
  /// and reads are also counted per peer. The handshake (handshake.hpp) fills an empty one with the
  /// side channel's peer address; empty after that (a queue pair connected by hand without one):
  /// its requests count only in the totals.
  std::string peer_name;
};

/// What a verbs device has done since it was opened (basic_device::counters()).
struct device_counters {
  std::uint64_t work_requests_posted = 0;  ///< peer checks included
  std::uint64_t post_calls = 0;  ///< ibv_post_send calls: doorbells
  std::uint64_t completions = 0;  ///< work completions reaped (counted before their transfers end)
  std::uint64_t async_events = 0;  ///< asynchronous events taken from the device
  std::uint64_t flushes_overdue = 0;  ///< broken queue pairs the adapter did not flush in time
  std::uint64_t peer_checks = 0;      ///< zero-length WRITEs sent to check a peer is still there
};

}  // namespace ferry::verbs

#pragma once
// A queue pair's state as the device keeps it: what submitters read (credits, the reason it broke,
// its lifecycle), and, the executor's alone, what it holds (unposted members, posted units,
// notification waits and arrivals, its receive buffers) and the device lists it is on.

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <system_error>
#include <vector>

#include <infiniband/verbs.h>

#include "ferry/detail/op_queue.hpp"
#include "ferry/detail/timer_service.hpp"
#include "ferry/verbs/errors.hpp"
#include "ferry/verbs/detail/op.hpp"
#include "ferry/verbs/detail/qp_lifecycle.hpp"

namespace ferry::metrics {
class op_metrics;
}  // namespace ferry::metrics

namespace ferry::verbs {

template <class P>
class basic_device;

}  // namespace ferry::verbs

namespace ferry::verbs::detail {

// One posted receive for notifications; wr_id is its address with the low bit set, which tells it
// apart from a send's op (ops are aligned).
template <class P>
struct receive_slot {
  qp_state<P>* qp = nullptr;
  std::uint64_t value = 0;  // the received payload lands here (registered memory)
  ibv_sge sge{};
  ibv_recv_wr wr{};
};

// A queue pair's timer: its flush guard (queue_pair_options::flush_timeout) or its peer check
// (queue_pair_options::peer_check). The node comes first, so that a fired timer finds its queue pair.
template <class P>
struct qp_timer {
  ferry::detail::timer_node timer;
  qp_state<P>* qp = nullptr;
  bool armed = false;
  bool fired = false;  // and listed in the device's list for it (overdue_ or checks_due_)
  qp_timer* fired_next = nullptr;
};

template <class P>
struct qp_state {
  basic_device<P>* device = nullptr;
  typename P::qp_handle qp{};
  std::uint32_t qp_num = 0;
  std::uint32_t psn = 0;
  std::uint32_t send_depth = 0;
  std::uint32_t max_inline = 0;
  std::uint8_t max_rd_atomic = 0;
  std::chrono::nanoseconds admission_timeout{};
  std::chrono::nanoseconds flush_timeout{};
  std::chrono::nanoseconds peer_check{};
  // The peer's label in the device's metrics (queue_pair_options::peer_name; empty: none), and its
  // figures for writes and reads (op_kind's order), the executor's, looked up at the first of each.
  std::string peer;
  ferry::metrics::op_metrics* peer_metrics[2] = {};
  qp_timer<P> guard;  // the flush timeout
  qp_timer<P> check;  // the next peer check
  // Free send-queue slots: submitters take them, the executor gives them back when a unit ends.
  alignas(64) std::atomic<std::int64_t> credits{0};
  // 0 while usable; else the verbs::errc that ended it (read by submitters to fail fast). Set
  // before the lifecycle moves to broken, so that whoever sees broken finds the reason.
  std::atomic<int> broken{0};
  // When broken is errc::severed: the reason queue_pair::sever gave. Written by the executor before
  // broken is set (release), read only after broken is seen severed (acquire).
  std::error_code sever_reason;

  // Why the queue pair can carry nothing more, given broken's value `b` (not 0).
  [[nodiscard]] std::error_code broken_error(int b) const noexcept {
    return b == static_cast<int>(errc::severed) ? sever_reason : make_error_code(static_cast<errc>(b));
  }
  qp_lifecycle lifecycle;  // created, connected, broken, closing: qp_lifecycle.hpp
  // The peer is known to be connected too: the handshake said so, the user did
  // (mark_peer_connected), or something came back from it. Only then are peer checks sent. Not a
  // lifecycle state: it is what is known of the other side, and holds in any of them.
  std::atomic<bool> peer_up{false};
  op_body<P>* close_op = nullptr;  // made up front, so that closing cannot fail

  // The executor's from here on.
  ferry::detail::op_queue<op_body<P>> pending;  // members not yet posted, in order
  op_body<P>* posted_head = nullptr;  // units with members in the adapter
  op_body<P>* posted_tail = nullptr;
  ferry::detail::op_queue<op_body<P>> waiters;  // receive_notification requests, in order
  std::vector<receive_slot<P>*> arrived;  // notifications not yet taken, in order (a FIFO)
  std::size_t arrived_at = 0;
  std::unique_ptr<receive_slot<P>[]> slots;
  std::uint32_t slot_count = 0;
  typename P::mr_handle slots_mr{};
  std::uint32_t receives_posted = 0;
  std::int64_t cq_reserved = 0;  // completion queue entries promised to it
  // Which of the device's lists hold it (executor only): memberships, not lifecycle states.
  bool listed_pending = false;
  qp_state* all_prev = nullptr;  // the device's queue pairs
  qp_state* all_next = nullptr;
  qp_state* pending_next = nullptr;  // the device's queue pairs with members to post
  qp_state* doomed_next = nullptr;   // closing queue pairs to look at after a completion batch
  qp_state* expiry_next = nullptr;
  bool expiry_listed = false;
  bool doomed = false;
};

template <class P>
[[nodiscard]] std::uint32_t initial_psn(const qp_state<P>* s) noexcept {
  return static_cast<std::uint32_t>(reinterpret_cast<std::uintptr_t>(s) >> 6) & 0xffffff;
}

}  // namespace ferry::verbs::detail

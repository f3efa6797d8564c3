#pragma once
// Making a queue pair: checking its options, reserving its completion queue entries, creating it
// in INIT with its receives posted, telling the executor of it (the `open` op), and later
// connecting it (INIT -> RTR -> RTS). On the creating and connecting threads, under the device's
// set-up lock where it shares the completion queue's room.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <system_error>

#include <infiniband/verbs.h>

#include "ferry/verbs/detail/op.hpp"
#include "ferry/verbs/detail/queue_pair_state.hpp"
#include "ferry/verbs/options.hpp"
#include "ferry/verbs/remote.hpp"

namespace ferry::verbs::detail {

// Set-up of the device's queue pairs: a part of basic_device<P> (device.hpp), which derives from it
// privately; it reaches the device and the other parts through self().
template <class P>
struct qp_setup {
  using op_body = verbs::detail::op_body<P>;
  using op = verbs::detail::op<P>;
  using qp_state = verbs::detail::qp_state<P>;
  using receive_slot = verbs::detail::receive_slot<P>;

  [[nodiscard]] basic_device<P>& self() noexcept { return static_cast<basic_device<P>&>(*this); }
  [[nodiscard]] const basic_device<P>& self() const noexcept {
    return static_cast<const basic_device<P>&>(*this);
  }

  // Creates an RC queue pair in INIT with its receives posted. The executor learns of it through
  // the `open` op, published before any request on it can be.
  qp_state* create_queue_pair(const queue_pair_options& o) {
    if (o.max_rd_atomic == 0) {
      throw std::invalid_argument(
          "ferry::verbs::queue_pair_options::max_rd_atomic must be at least 1");
    }
    if (o.send_depth == 0) {
      throw std::invalid_argument(
          "ferry::verbs::queue_pair_options::send_depth must be at least 1");
    }
    if (o.receive_depth == 0) {
      throw std::invalid_argument(
          "ferry::verbs::queue_pair_options::receive_depth must be at least 1");
    }
    if (o.flush_timeout < std::chrono::nanoseconds::zero()) {
      throw std::invalid_argument(
          "ferry::verbs::queue_pair_options::flush_timeout must not be negative");
    }
    if (o.peer_check < std::chrono::nanoseconds::zero()) {
      throw std::invalid_argument(
          "ferry::verbs::queue_pair_options::peer_check must not be negative");
    }
    // A peer check goes out only on an idle queue pair and takes no request's credit, so a request
    // can find the send queue full while one is out (post_pending retries once it completes); its
    // completion has an entry of its own.
    const std::int64_t check_entry = o.peer_check > std::chrono::nanoseconds::zero() ? 1 : 0;
    const std::int64_t needs = std::int64_t{o.send_depth} + check_entry + o.receive_depth;
    {
      std::lock_guard lock(self().setup_mutex_);
      if (needs > self().cq_room_) {
        throw std::length_error(
            "ferry::verbs: a queue pair of send depth " + std::to_string(o.send_depth) +
            " and receive depth " + std::to_string(o.receive_depth) +
            (check_entry != 0 ? " (and one for peer checks)" : "") + " needs " +
            std::to_string(needs) + " completion queue entries, and only " +
            std::to_string(self().cq_room_) + " of the device's " +
            std::to_string(self().options_.completion_queue_entries) + " are left");
      }
      self().cq_room_ -= needs;
    }
    auto s = std::make_unique<qp_state>();
    s->device = &self();
    try {
      ibv_qp_cap cap{};
      cap.max_send_wr = o.send_depth;
      cap.max_recv_wr = o.receive_depth;
      cap.max_send_sge = 1;
      cap.max_recv_sge = 1;
      cap.max_inline_data = std::max<std::uint32_t>(o.max_inline_data, sizeof(std::uint64_t));
      s->qp = P::create_qp(self().pd_, self().cq_, self().cq_, cap);
      if (!s->qp) throw self().system_error("ibv_create_qp");
      s->qp_num = P::qp_num(s->qp);
      s->psn = detail::initial_psn(s.get());
      // What the device granted: a provider may clamp the request.
      s->send_depth = std::min(o.send_depth, cap.max_send_wr);
      s->max_inline = cap.max_inline_data;
      s->max_rd_atomic = o.max_rd_atomic;
      s->admission_timeout = o.admission_timeout;
      s->flush_timeout = o.flush_timeout;
      s->peer_check = o.peer_check;
      s->peer = o.peer_name;
      s->guard.qp = s.get();
      s->check.qp = s.get();
      s->cq_reserved = needs;
      s->credits.store(s->send_depth, std::memory_order_relaxed);

      ibv_qp_attr attr{};
      attr.qp_state = IBV_QPS_INIT;
      attr.pkey_index = 0;
      attr.port_num = self().options_.port;
      attr.qp_access_flags =
          IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
      if (const int r = P::modify_qp(
              s->qp, attr, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
          r != 0) {
        throw std::system_error(r, std::system_category(), "ferry::verbs: ibv_modify_qp(INIT)");
      }

      s->slot_count = std::min(o.receive_depth, cap.max_recv_wr);
      s->slots = std::make_unique<receive_slot[]>(s->slot_count);
      s->arrived.resize(s->slot_count);
      s->slots_mr = P::reg_mr(self().pd_, s->slots.get(), sizeof(receive_slot) * s->slot_count,
                              IBV_ACCESS_LOCAL_WRITE);
      if (!s->slots_mr) throw self().system_error("ibv_reg_mr(receive buffers)");
      for (std::uint32_t i = 0; i < s->slot_count; ++i) {
        receive_slot& slot = s->slots[i];
        slot.qp = s.get();
        slot.sge.addr = reinterpret_cast<std::uintptr_t>(&slot.value);
        slot.sge.length = sizeof slot.value;
        slot.sge.lkey = P::lkey(s->slots_mr);
        slot.wr.wr_id = reinterpret_cast<std::uintptr_t>(&slot) | 1;
        slot.wr.sg_list = &slot.sge;
        slot.wr.num_sge = 1;
        ibv_recv_wr* bad = nullptr;
        if (const int r = P::post_recv(s->qp, &slot.wr, &bad); r != 0) {
          throw std::system_error(r, std::system_category(), "ferry::verbs: ibv_post_recv");
        }
        ++s->receives_posted;
      }
      s->close_op = op::make(op_kind::close);
      s->close_op->qp = s.get();
      op_body* open_op = op::make(op_kind::open);
      open_op->qp = s.get();
      self().queue_pairs_.fetch_add(1, std::memory_order_relaxed);
      self().publish(open_op);
    } catch (...) {
      if (s->close_op != nullptr) op::free(s->close_op);
      if (s->qp) P::destroy_qp(s->qp);
      if (s->slots_mr) P::dereg_mr(s->slots_mr);
      std::lock_guard lock(self().setup_mutex_);
      self().cq_room_ += needs;
      throw;
    }
    return s.release();
  }

  [[nodiscard]] endpoint_info local_info(const qp_state* s) const noexcept {
    endpoint_info info;
    info.qp_num = s->qp_num;
    info.psn = s->psn;
    info.lid = self().lid_;
    info.mtu = self().mtu_;
    info.has_gid = self().has_gid_;
    info.gid = self().gid_;
    info.max_rd_atomic = s->max_rd_atomic;
    return info;
  }

  // INIT → RTR → RTS towards `remote`. Throws std::system_error naming the step that failed.
  void connect(qp_state* s, const endpoint_info& remote) {
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_RTR;
    attr.path_mtu = static_cast<ibv_mtu>(std::min(self().mtu_, remote.mtu));
    attr.dest_qp_num = remote.qp_num;
    attr.rq_psn = remote.psn;
    attr.max_dest_rd_atomic = s->max_rd_atomic;
    attr.min_rnr_timer = 12;
    attr.ah_attr.dlid = remote.lid;
    attr.ah_attr.port_num = self().options_.port;
    if (remote.has_gid) {
      attr.ah_attr.is_global = 1;
      attr.ah_attr.grh.dgid = remote.gid;
      attr.ah_attr.grh.sgid_index = static_cast<std::uint8_t>(self().options_.gid_index);
      attr.ah_attr.grh.hop_limit = 64;
    }
    if (const int r =
            P::modify_qp(s->qp, attr,
                         IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                             IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
        r != 0) {
      throw std::system_error(r, std::system_category(),
                              "ferry::verbs: ibv_modify_qp(RTR) towards queue pair " +
                                  std::to_string(remote.qp_num) + " at LID " +
                                  std::to_string(remote.lid));
    }
    attr = ibv_qp_attr{};
    attr.qp_state = IBV_QPS_RTS;
    attr.timeout = 14;  // 4.096 µs × 2^14 ≈ 67 ms per transport retry
    attr.retry_cnt = 7;
    attr.rnr_retry = 7;  // the peer not ready to receive a notification: retry without limit
    attr.sq_psn = s->psn;
    // No more READs out at once than the peer accepts: beyond that it would answer with an
    // invalid-request NAK, and the queue pair would go to the error state. (A peer that accepts
    // none can still be written to; a READ towards it fails.)
    attr.max_rd_atomic = std::min(s->max_rd_atomic, remote.max_rd_atomic);
    if (const int r = P::modify_qp(s->qp, attr,
                                   IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                                       IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC);
        r != 0) {
      throw std::system_error(r, std::system_category(), "ferry::verbs: ibv_modify_qp(RTS)");
    }
    // created -> connected. Lost only to the executor breaking it meanwhile: it stays broken, and
    // requests on it fail with the reason.
    (void)s->lifecycle.connect();
  }
};

}  // namespace ferry::verbs::detail

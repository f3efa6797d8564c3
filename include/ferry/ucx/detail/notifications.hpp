#pragma once
// Active messages between ferry workers: notifications and their acknowledgements, and the routing
// of every message ferry receives (liveness pings go to their part). A part of engine
// (engine.hpp). Executor thread only.
//
// A notification is a flush of its endpoint (every put sent before it has landed), then an active
// message carrying a sequence number, then the receiver's acknowledgement naming that number: the
// sender's transfer succeeds only once the receiving process holds the notification (queued for
// receive_notification or handed to a waiting one), so a sender may exit the moment it sees
// success. UCX ending the message's send means only that it left this process's buffers (a sender
// that exited then lost it). A receiver keeps at most max_unclaimed_notifications per peer that
// nobody has taken; past it, it acknowledges with a refusal (errc::notification_refused at the
// sender) and counts it.

#include <ucp/api/ucp.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <new>
#include <span>
#include <system_error>
#include <utility>

#include "ferry/ucx/detail/endpoint_state.hpp"
#include "ferry/ucx/detail/request.hpp"
#include "ferry/ucx/detail/wire.hpp"
#include "ferry/ucx/errors.hpp"

namespace ferry::ucx::detail {

template <class E>
struct notifications {
  [[nodiscard]] E& self() noexcept { return static_cast<E&>(*this); }

  // ---- sending
  void start_notify(request* r) noexcept {
    E& s = self();
    if (const std::error_code ec = s.refusal(r)) return s.finish_all(r, ec);
    s.arm_deadline(r);
    r->members[0].outstanding = 1;
    // Pinned: the flush may end at once and the message go out inside this call, and UCX may fail
    // the endpoint inside that send (force_close ends the notification), freeing `r` under us.
    ++r->pins;
    s.start_flush(r);
    --r->pins;
    s.maybe_destroy(r);
  }

  // The notification's flush ended: its message goes out, and its member waits for the send and
  // the acknowledgement.
  void notify_flushed(request* r, ucs_status_t st) noexcept {
    E& s = self();
    member& m = r->members[0];
    endpoint_state& e = *r->endpoint;
    if (st != UCS_OK || e.ep == nullptr) return s.member_step(m, st != UCS_OK ? st : UCS_ERR_CANCELED);
    r->sequence = s.next_sequence_++;
    try {
      s.acks_due_.emplace(r->sequence, r);
    } catch (...) {
      r->sequence = 0;
      m.failure = make_error_code(std::errc::not_enough_memory);
      return s.member_step(m, UCS_OK);
    }
    // UCX may read the header after the call returns: it lives in the request.
    am_header h;
    h.kind = am_kind::notification;
    h.sender = s.self_;
    h.value = r->value;
    h.sequence = r->sequence;
    static_assert(sizeof(am_header) <= sizeof(r->header));
    std::memcpy(r->header, &h, sizeof h);
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                     UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_AM_SEND_FLAG_REPLY;  // the receiver acknowledges on the reply endpoint
    p.cb.send = &E::on_member_done;
    p.user_data = &m;
    m.outstanding = 2;  // the send, and the acknowledgement
    const ucs_status_ptr_t sp =
        ::ucp_am_send_nbx(e.ep, am_id, r->header, sizeof(am_header), nullptr, 0, &p);
    s.track(e, sp, m);
  }

  // The receiver's acknowledgement of notification `sequence`, from worker `from`.
  void acknowledged(std::uint64_t from, std::uint64_t sequence, bool refused) noexcept {
    E& s = self();
    const auto it = s.acks_due_.find(sequence);
    if (it == s.acks_due_.end()) return;  // ended already (deadline, close)
    request* r = it->second;
    if (!r->endpoint || r->endpoint->peer.worker_id != from) return;  // not from its receiver
    member& m = r->members[0];
    if (refused && !m.failure) m.failure = make_error_code(errc::notification_refused);
    s.member_step(m, UCS_OK);
  }

  // Whether a notification on `e` still waits for its acknowledgement.
  [[nodiscard]] bool acks_due_on(const endpoint_state& e) const noexcept {
    for (const auto& [seq, r] : static_cast<const E&>(*this).acks_due_) {
      if (r->endpoint.get() == &e) return true;
    }
    return false;
  }

  // Fails the notifications on `e` still waiting for their acknowledgements.
  void fail_acks_due(endpoint_state& e) noexcept {
    E& s = self();
    for (auto it = s.acks_due_.begin(); it != s.acks_due_.end();) {
      request* r = it->second;
      ++it;  // end_member erases r's entry
      if (r->endpoint.get() != &e) continue;
      member& m = r->members[0];
      if (m.status == nullptr) continue;
      if (!m.failure) {
        m.failure = r->deadline_passed ? make_error_code(errc::deadline_exceeded)
                    : e.failure()      ? e.failure()
                                       : make_error_code(errc::endpoint_closed);
      }
      m.outstanding = 1;
      s.end_member(m);
    }
  }

  // ---- receiving
  void start_wait(request* r) noexcept {
    E& s = self();
    endpoint_state* e = r->endpoint.get();
    if (e == nullptr) return s.finish_all(r, make_error_code(errc::endpoint_closed));
    if (!e->notifications.empty()) {
      *r->value_out = e->notifications.front();
      e->notifications.pop_front();
      return s.finish_all(r, {});
    }
    if (const std::error_code ec = s.refusal(r)) return s.finish_all(r, ec);
    try {
      e->notification_waiters.push_back(r);
    } catch (...) {
      return s.finish_all(r, make_error_code(std::errc::not_enough_memory));
    }
    s.arm_deadline(r);
    s.arm_liveness();
  }

  // A notification from a peer we have an endpoint to: to a waiter, or queued within the bound.
  // False when refused.
  bool deliver(endpoint_state& e, std::uint64_t value) noexcept {
    E& s = self();
    if (!e.notification_waiters.empty()) {
      request* r = e.notification_waiters.front();
      e.notification_waiters.pop_front();
      *r->value_out = value;
      s.finish_all(r, {});
      return true;
    }
    return keep(e.notifications, value, e.notifications_refused);
  }

  bool keep(std::deque<std::uint64_t>& q, std::uint64_t value, std::uint64_t& refused) noexcept {
    E& s = self();
    if (q.size() >= s.max_unclaimed_) {
      ++refused;
      s.notifications_refused_.fetch_add(1, std::memory_order_relaxed);
      return false;
    }
    try {
      q.push_back(value);
      return true;
    } catch (...) {
      ++refused;
      s.notifications_refused_.fetch_add(1, std::memory_order_relaxed);
      return false;
    }
  }

  // A notification from worker `from`: delivered, or kept until an endpoint to it is made (the
  // peer connected to us first), within the bound and for at most max_early_peers peers.
  bool notification_arrived(std::uint64_t from, std::uint64_t value) noexcept {
    E& s = self();
    if (auto it = s.by_worker_.find(from); it != s.by_worker_.end()) {
      return deliver(*it->second, value);
    }
    try {
      auto it = s.early_notifications_.find(from);
      if (it == s.early_notifications_.end()) {
        if (s.early_notifications_.size() >= E::max_early_peers) {
          s.notifications_refused_.fetch_add(1, std::memory_order_relaxed);
          return false;
        }
        it = s.early_notifications_.try_emplace(from).first;
      }
      return keep(it->second.values, value, it->second.refused);
    } catch (...) {
      s.notifications_refused_.fetch_add(1, std::memory_order_relaxed);
      return false;
    }
  }

  // Sends the acknowledgement of `sequence` on `ep`. Its header is UCX's to read until the send
  // ends, so it lives on the heap until then.
  void send_ack(ucp_ep_h ep, std::uint64_t sequence, bool refused) noexcept {
    E& s = self();
    if (ep == nullptr) return;  // no way back: the sender's deadline ends its transfer
    auto* h = new (std::nothrow) am_header;
    if (h == nullptr) return;
    h->kind = am_kind::ack;
    h->sender = s.self_;
    h->sequence = sequence;
    h->flags = refused ? ack_refused : 0;
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.send = [](void* ucx_request, ucs_status_t, void* user) noexcept {
      ::ucp_request_free(ucx_request);
      delete static_cast<am_header*>(user);
    };
    p.user_data = h;
    const ucs_status_ptr_t sp = ::ucp_am_send_nbx(ep, am_id, h, sizeof *h, nullptr, 0, &p);
    if (sp == nullptr || UCS_PTR_IS_ERR(sp)) delete h;
  }

  // ---- every active message ferry receives
  static ucs_status_t on_active_message(void* arg, const void* header, std::size_t header_bytes,
                                        void* data, std::size_t data_bytes,
                                        const ucp_am_recv_param_t* param) noexcept {
    E& s = *static_cast<E*>(arg);
    if (header_bytes != sizeof(am_header)) return UCS_OK;  // not ours: dropped
    am_header h;
    std::memcpy(&h, header, sizeof h);
    if (h.magic != am_magic) return UCS_OK;
    if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0) return UCS_OK;  // never sent so
    const ucp_ep_h reply =
        (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) != 0 ? param->reply_ep : nullptr;
    (void)data;
    (void)data_bytes;  // ferry's messages carry everything in their header
    switch (h.kind) {
      case am_kind::notification: {
        const bool kept = s.notification_arrived(h.sender.worker_id, h.value);
        ucp_ep_h back = reply;
        if (back == nullptr) {
          if (auto it = s.by_worker_.find(h.sender.worker_id); it != s.by_worker_.end()) {
            back = it->second->ep;
          }
        }
        s.send_ack(back, h.sequence, !kept);
        return UCS_OK;
      }
      case am_kind::ack:
        s.acknowledged(h.sender.worker_id, h.sequence, (h.flags & ack_refused) != 0);
        return UCS_OK;
      case am_kind::ping:
      case am_kind::pong:
        s.liveness_message(h);
        return UCS_OK;
    }
    return UCS_OK;  // a kind this version does not know: dropped
  }
};

}  // namespace ferry::ucx::detail

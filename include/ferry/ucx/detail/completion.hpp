#pragma once
// How a request's members end, and when the request itself goes. A part of engine (engine.hpp),
// which derives from it; it reaches the engine and the other parts through self(). Executor thread
// only (or ~engine, once the executor has let go of the worker).
//
// A member ends success only when every part of it ended UCS_OK (its put or get, the flush that
// makes a landed put batch land, a notification's acknowledgement) and none of these holds:
//   - its request's deadline passed (a UCS_OK that UCX reports after the deadline is late news);
//   - its endpoint broke before the last part ended (endpoint_state.hpp: after a force-close UCX
//     may call a flush back UCS_OK when the worker goes, for bytes that never left);
//   - its peer runs in this PID namespace on this host and has exited (shared memory reports
//     success into a dead peer's segment).
// Otherwise it fails with the first reason found, in that order after UCX's own failure.
//
// Abandoning. After a force-close, UCX 1.13 does not call back every request it held (over shared
// memory some gets and flushes stay with it until the worker goes). Those requests are abandoned:
// their members end now, failed, and the request stays allocated, holding its regions registered,
// until UCX calls it back or the worker is destroyed. Until then UCX may still read an abandoned
// put's source or write an abandoned get's destination (worker::requests_held_by_ucx() counts
// them).

#include <ucp/api/ucp.h>

#include <cstddef>
#include <cstdint>
#include <system_error>
#include <utility>

#include "ferry/detail/status_block.hpp"
#include "ferry/metrics.hpp"
#include "ferry/transfer_state.hpp"
#include "ferry/ucx/detail/endpoint_state.hpp"
#include "ferry/ucx/detail/request.hpp"
#include "ferry/ucx/errors.hpp"

namespace ferry::ucx::detail {

template <class E>
struct completion {
  [[nodiscard]] E& self() noexcept { return static_cast<E&>(*this); }

  // ---- what UCX holds of a request
  // A UCX request of `r` is out (the engine's held list has every request with one out).
  void hold(request* r) noexcept {
    if (r->ucx_out++ != 0) return;
    E& s = self();
    r->held = true;
    ++r->endpoint->held;
    r->held_prev = nullptr;
    r->held_next = s.held_;
    if (s.held_ != nullptr) s.held_->held_prev = r;
    s.held_ = r;
  }

  // UCX called back one of `r`'s requests. The last one frees `r` once its members have ended.
  void let_go(request* r) noexcept {
    if (--r->ucx_out != 0) return;
    E& s = self();
    if (r->held_prev != nullptr) r->held_prev->held_next = r->held_next;
    if (r->held_next != nullptr) r->held_next->held_prev = r->held_prev;
    if (s.held_ == r) s.held_ = r->held_next;
    r->held = false;
    --r->endpoint->held;
    if (r->abandoned) {
      --s.abandoned_;
      s.abandoned_count_.store(s.abandoned_, std::memory_order_relaxed);
    }
    s.release_keys_when_idle(*r->endpoint);
    maybe_destroy(r);
  }

  // One of `r`'s UCX requests is out: counted in flight (its endpoint's and the engine's) until
  // UCX calls it back or `r` is abandoned.
  void count_in_flight(request* r) noexcept {
    if (r->abandoned) return;
    ++r->counted;
    ++r->endpoint->in_flight;
    ++self().in_flight_;
  }

  // A UCX callback's bookkeeping for one of `r`'s requests.
  void ucx_called_back(request* r) noexcept {
    if (r->counted == 0) return;  // abandoned: no longer counted
    --r->counted;
    --r->endpoint->in_flight;
    --self().in_flight_;
  }

  // The outcome of an nbx call for member `m`: done now (null), failed now, or a request whose
  // callback follows.
  void track(endpoint_state& e, ucs_status_ptr_t sp, member& m) noexcept {
    ++e.sends;  // done locally or not: a close's flush must come after it (close_go_on)
    if (sp == nullptr) return member_step(m, UCS_OK);
    if (UCS_PTR_IS_ERR(sp)) return member_step(m, UCS_PTR_STATUS(sp));
    request* r = m.owner;
    hold(r);
    count_in_flight(r);
    // UCX failed the endpoint inside this very call (its error handler ran and force-closed it)
    // before `r` was held: what UCX will not call back is abandoned now, like the rest.
    if (e.phase() == endpoint_phase::broken) abandon(r, e.failure());
  }

  static void on_member_done(void* ucx_request, ucs_status_t st, void* user) noexcept {
    auto& m = *static_cast<member*>(user);
    request* r = m.owner;
    E& s = *static_cast<E*>(r->eng);
    s.ucx_called_back(r);
    ::ucp_request_free(ucx_request);
    s.member_step(m, st);
    s.let_go(r);
  }

  // ---- the flush that ends a landed put batch (and comes before a notification or a close)
  void start_flush(request* r) noexcept {
    endpoint_state& e = *r->endpoint;
    r->flushes = 1;
    if (e.ep == nullptr) return flush_ended(r, UCS_ERR_CANCELED);
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.send = &on_flush_done;
    p.user_data = r;
    const ucs_status_ptr_t sp = ::ucp_ep_flush_nbx(e.ep, &p);
    if (sp == nullptr) return flush_ended(r, UCS_OK);
    if (UCS_PTR_IS_ERR(sp)) return flush_ended(r, UCS_PTR_STATUS(sp));
    hold(r);
    count_in_flight(r);
    if (e.phase() == endpoint_phase::broken) abandon(r, e.failure());
  }

  static void on_flush_done(void* ucx_request, ucs_status_t st, void* user) noexcept {
    auto* r = static_cast<request*>(user);
    E& s = *static_cast<E*>(r->eng);
    s.ucx_called_back(r);
    ::ucp_request_free(ucx_request);
    // An abandoned request has ended already: a flush called back later changes nothing.
    if (!r->abandoned) s.flush_ended(r, st);
    s.let_go(r);
  }

  void flush_ended(request* r, ucs_status_t st) noexcept {
    r->flushes = 0;
    if (r->kind == request_kind::notify) return self().notify_flushed(r, st);
    if (r->kind == request_kind::close) return self().close_flushed(r);
    // The flush is one part of each member still waiting. `r` is not freed inside this loop: the
    // caller holds it (a UCX request of its own, or start_rma's guard).
    for (member& m : r->members) {
      if (m.status != nullptr && m.outstanding > 0) member_step(m, st);
    }
  }

  // ---- members
  // One of a member's parts ended with `st`.
  void member_step(member& m, ucs_status_t st) noexcept {
    if (st != UCS_OK && !m.failure) m.failure = failure_for(*m.owner, st);
    if (--m.outstanding > 0) return;
    end_member(m);
  }

  // What a request ended by UCX with `st` failed of: its own deadline, its endpoint's failure
  // (a close, a peer that went), or UCX's status.
  std::error_code failure_for(request& r, ucs_status_t st) const {
    if (r.deadline_passed) return make_error_code(errc::deadline_exceeded);
    if (r.endpoint) {
      if (const std::error_code f = r.endpoint->failure()) {
        if (st == UCS_ERR_CANCELED || r.endpoint->phase() == endpoint_phase::broken) return f;
      }
      if (st == UCS_ERR_CANCELED) return make_error_code(errc::endpoint_closed);
      // A watched peer that has exited: UCX may fail its requests ("Endpoint timeout",
      // "Connection reset") before it calls the endpoint's error handler, which says peer_gone.
      if (E::peer_exited(r)) return make_error_code(errc::peer_gone);
    }
    return status_error(st);
  }

  // Why a member whose parts all ended UCS_OK still did not succeed (the list at the top); empty
  // when it did.
  std::error_code doubt(request& r) noexcept {
    if (r.kind != request_kind::put && r.kind != request_kind::get &&
        r.kind != request_kind::notify) {
      return {};
    }
    if (r.deadline_passed) return make_error_code(errc::deadline_exceeded);
    if (r.endpoint && !r.endpoint->trusts_success()) {
      const std::error_code f = r.endpoint->failure();
      return f ? f : make_error_code(errc::endpoint_closed);
    }
    if (self().peer_exited(r)) {
      self().close_soon(*r.endpoint, make_error_code(errc::peer_gone));
      return make_error_code(errc::peer_gone);
    }
    return {};
  }

  void end_member(member& m) noexcept {
    request* r = m.owner;
    ferry::detail::status_block* s = std::exchange(m.status, nullptr);
    if (s == nullptr) return;  // ended already: abandoned
    std::error_code ec = m.failure;
    if (!ec) ec = doubt(*r);
    if (r->published_ns != 0) record(*r, m.length, !ec);
    if (r->kind == request_kind::notify && r->sequence != 0) self().acks_due_.erase(r->sequence);
    s->complete(ec ? transfer_state::failed : transfer_state::success, ec);
    s->release_completer_ref();
    --r->members_left;
    maybe_destroy(r);
  }

  // Ends every member still pending with `ec` (success when empty).
  void finish_all(request* r, std::error_code ec) noexcept {
    ++r->pins;  // ending the last member must not free `r` inside the loop
    for (member& m : r->members) {
      if (m.status == nullptr) continue;
      m.failure = ec;
      m.outstanding = 1;
      end_member(m);
    }
    --r->pins;
    maybe_destroy(r);
  }

  // Ends `r`'s members now, failed with `why` (or its deadline), while UCX still holds some of its
  // requests: they are no longer counted in flight, and `r` stays until UCX lets go of it.
  void abandon(request* r, std::error_code why) noexcept {
    if (r->abandoned) return;
    E& s = self();
    r->abandoned = true;
    r->endpoint->in_flight -= r->counted;
    s.in_flight_ -= r->counted;
    r->counted = 0;
    if (r->ucx_out != 0) {
      ++s.abandoned_;
      s.abandoned_count_.store(s.abandoned_, std::memory_order_relaxed);
    }
    if (r->kind == request_kind::close) return s.close_done(r);
    finish_all(r, r->deadline_passed ? make_error_code(errc::deadline_exceeded) : why);
  }

  void maybe_destroy(request* r) noexcept {
    if (r->members_left != 0 || r->ucx_out != 0 || r->pins != 0 || r->deadline_listed) return;
    destroy(r);
  }

  // Not inlined: g++ 12's -Wuse-after-free would otherwise follow the delete into callers that
  // hold a pin on `r` (so that it cannot happen there) and warn of their later uses.
  [[gnu::noinline]] void destroy(request* r) noexcept {
    if (r->has_deadline) {
      (void)self().exec_.timers().cancel(r->timer);
      self().disarmed(r);
    }
    delete r;
  }

  // A put or get member ended: in the kind's figures, and in its peer's, which its endpoint keeps
  // (so that a server whose peers come and go keeps no figures of endpoints it has closed).
  void record(request& r, std::uint64_t bytes, bool succeeded) noexcept {
    const auto kind = static_cast<std::size_t>(r.kind);  // put 0, get 1: meter_'s order
    static_assert(static_cast<std::size_t>(request_kind::put) == 0 &&
                  static_cast<std::size_t>(request_kind::get) == 1);
    ferry::metrics::op_metrics* no_peer = nullptr;
    endpoint_state* e = r.endpoint.get();
    auto& meter = self().meter_;
    if (e == nullptr || e->peer.worker_id == 0 || kind >= e->peer_metrics.size()) {
      return meter.record_cached(kind, r.published_ns, bytes, succeeded, no_peer, {});
    }
    if (e->metrics_peer.empty()) {
      try {
        e->metrics_peer = "worker-" + std::to_string(e->peer.worker_id);
      } catch (...) {
        // Out of memory: this operation counts only in the kind's figures.
      }
    }
    meter.record_cached(kind, r.published_ns, bytes, succeeded, e->peer_metrics[kind],
                        e->metrics_peer);
  }
};

}  // namespace ferry::ucx::detail

#pragma once
// An endpoint's end: a graceful close (endpoint::close(), its last handle, its worker), a
// force-close (UCX's error handler, a request's deadline, a close's timeout, the liveness check),
// and the deadlines of requests out in UCX. A part of engine (engine.hpp). Executor thread only.
//
// A graceful close refuses new requests at once (open -> closing), then flushes the endpoint: the
// requests already out end as they would have, and the peer has read everything sent on it before
// the connection goes. Over tcp UCX emulates a put: the peer copies it and sends an
// acknowledgement back, and UCX 1.13 aborts the peer's process when that acknowledgement finds the
// connection gone (puts that ended source_reusable may not even have been read yet). The flush is
// bounded by close_timeout; then, or once the flush has ended, the endpoint is force-closed.
//
// A force-close (-> broken) has UCX call back every request it will at once, then abandons what
// UCX kept (completion.hpp), so that every request on the endpoint has ended when it returns.
//
// Deadlines. UCX cannot take back one request: a request whose deadline passes while UCX holds it
// force-closes its endpoint, which ends every request on it. Not inside the timer round (that would
// free requests whose timers fired in the same round and are still to be called) nor inside a UCX
// callback (UCX must not be asked to close an endpoint there): the timer lists the request, and the
// executor's next poll() acts on it before it progresses UCX (run_deferred). A request whose
// endpoint is already closed is abandoned instead: its deadline ends it all the same.

#include <ucp/api/ucp.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <memory>
#include <system_error>
#include <utility>
#include <vector>

#include "ferry/detail/timer_service.hpp"
#include "ferry/errors.hpp"
#include "ferry/ucx/detail/endpoint_state.hpp"
#include "ferry/ucx/detail/request.hpp"
#include "ferry/ucx/errors.hpp"

namespace ferry::ucx::detail {

template <class E>
struct closing {
  [[nodiscard]] E& self() noexcept { return static_cast<E&>(*this); }

  // ---- force-close
  // Ends `e` (-> broken, `why` its reason): UCX force-closes it and calls back what it will, every
  // request UCX kept is abandoned, every wait on it fails. Re-entrant and idempotent: UCX can fail
  // the endpoint from inside a call this makes.
  void force_close(endpoint_state& e, std::error_code why) noexcept {
    E& s = self();
    if (!e.move_to(endpoint_phase::broken, s.reason(e, why))) return;
    // Kept alive through the callbacks below, which may drop the last other reference.
    const std::shared_ptr<endpoint_state> keep = s.find_endpoint(e);
    if (ucp_ep_h ep = std::exchange(e.ep, nullptr); ep != nullptr) {
      ucp_request_param_t p{};
      p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      // Without peer error handling UCX refuses a force-close: the endpoint is closed after a
      // flush instead, and its requests end when UCX ends them or are abandoned below.
      p.flags = s.peer_errors_ ? UCP_EP_CLOSE_FLAG_FORCE : 0;
      const ucs_status_ptr_t sp = ::ucp_ep_close_nbx(ep, &p);
      if (sp != nullptr && !UCS_PTR_IS_ERR(sp)) {
        if (s.peer_errors_) {
          // Not seen with FORCE in UCX 1.13; progress until it ends rather than leak it.
          for (int i = 0; i < 1000 && ::ucp_request_check_status(sp) == UCS_INPROGRESS; ++i) {
            ::ucp_worker_progress(s.worker_);
          }
        }
        ::ucp_request_free(sp);  // a flushing close: UCX releases it when it ends
      }
    }
    // What UCX did not call back above it may never call back: abandoned, so that it ends now.
    for (request* r = s.held_; r != nullptr;) {
      request* next = r->held_next;  // abandon() does not unlink or free a held request
      if (r->endpoint.get() == &e) s.abandon(r, e.failure());
      r = next;
    }
    s.fail_acks_due(e);
    while (!e.notification_waiters.empty()) {
      request* r = e.notification_waiters.front();
      e.notification_waiters.pop_front();
      s.finish_all(r, e.failure());
    }
    for (request* r : std::exchange(e.close_waiters, {})) s.finish_all(r, {});
    release_keys_when_idle(e);
    s.forget_endpoint(e);
  }

  // An endpoint's keys, once it is closed and UCX holds no request of it (one UCX still holds may
  // use them): kept until then, released by the last request's let_go.
  void release_keys_when_idle(endpoint_state& e) noexcept {
    if (e.ep != nullptr || e.held != 0) return;
    for (imported_region& ir : e.regions) {
      if (ir.rkey != nullptr) ::ucp_rkey_destroy(ir.rkey);
      ir.rkey = nullptr;
    }
  }

  // UCX's error handler: the peer died or the link went.
  static void on_endpoint_error(void* arg, ucp_ep_h, ucs_status_t st) noexcept {
    auto& e = *static_cast<endpoint_state*>(arg);
    static_cast<E*>(e.eng)->force_close(e, status_error(st));
  }

  // Force-closes `e` at the executor's next poll (from inside a UCX callback, where UCX must not be
  // asked to close an endpoint).
  void close_soon(endpoint_state& e, std::error_code why) noexcept {
    E& s = self();
    if (e.phase() == endpoint_phase::broken) return;
    try {
      if (std::shared_ptr<endpoint_state> keep = s.find_endpoint(e)) {
        s.closes_due_.emplace_back(std::move(keep), why);
      }
    } catch (...) {
      // No memory to list it: each request on it still fails at its end (doubt).
    }
  }

  // ---- graceful close
  void start_close(request* r) noexcept {
    E& s = self();
    const std::shared_ptr<endpoint_state>& e = r->endpoint;
    if (!e || e->ep == nullptr) {
      // Already handed to UCX (closed without force): what is out ends as UCX ends it; a later
      // close (the last handle after close()) must not abandon it.
      if (e && e->phase() != endpoint_phase::closed) {
        force_close(*e, make_error_code(errc::endpoint_closed));
      }
      return s.finish_all(r, {});
    }
    if (e->phase() == endpoint_phase::closing) {
      // Already flushing for an earlier close: this one ends with it.
      try {
        e->close_waiters.push_back(r);
        return;
      } catch (...) {
        // No memory to wait: close now.
        force_close(*e, make_error_code(errc::endpoint_closed));
        return s.finish_all(r, {});
      }
    }
    // close_timeout 0: the user asked for force-closes. Without peer error handling UCX cannot
    // force-close an endpoint, so no deadline here could bound its flush: UCX closes it after
    // flushing it, and what is out ends when UCX ends it.
    if (s.close_timeout_.count() <= 0 || !s.peer_errors_ || e->phase() != endpoint_phase::open) {
      if (!s.peer_errors_ && e->move_to(endpoint_phase::closing) &&
          e->move_to(endpoint_phase::closed)) {
        hand_to_ucx(*e);
      } else {
        force_close(*e, make_error_code(errc::endpoint_closed));
      }
      return s.finish_all(r, {});
    }
    e->move_to(endpoint_phase::closing, make_error_code(errc::endpoint_closed));
    s.closing_.fetch_add(1, std::memory_order_relaxed);
    r->has_deadline = true;
    r->deadline = ferry::detail::clock::now() + s.close_timeout_;
    s.arm_deadline(r);  // past it, the endpoint is force-closed, which ends the flush
    r->sends_at_flush = e->sends;
    s.start_flush(r);
  }

  // Closed without force (no peer error handling): UCX flushes and closes it; requests out end as
  // UCX ends them (their UCS_OK is trusted: the endpoint is closed, not broken).
  void hand_to_ucx(endpoint_state& e) noexcept {
    E& s = self();
    const std::shared_ptr<endpoint_state> keep = s.find_endpoint(e);
    if (ucp_ep_h ep = std::exchange(e.ep, nullptr); ep != nullptr) {
      ucp_request_param_t p{};
      const ucs_status_ptr_t sp = ::ucp_ep_close_nbx(ep, &p);
      if (sp != nullptr && !UCS_PTR_IS_ERR(sp)) ::ucp_request_free(sp);
    }
    s.fail_acks_due(e);
    while (!e.notification_waiters.empty()) {
      request* r = e.notification_waiters.front();
      e.notification_waiters.pop_front();
      s.finish_all(r, e.failure());
    }
    release_keys_when_idle(e);
    s.forget_endpoint(e);
  }

  // The flush of a close ended (done, failed, or cancelled by a force close), often inside a UCX
  // callback, where UCX must not be asked to close the endpoint: run_deferred() goes on with it.
  void close_flushed(request* r) noexcept {
    E& s = self();
    ++r->pins;  // not freed while listed (a close from a last handle has no member)
    r->next = s.closes_flushed_;
    s.closes_flushed_ = r;
  }

  // A close's flush ended. Requests made before the close may still be out: a notification's
  // active message goes out only after its own flush, so the close's flush may end first. While
  // any is out, and the close's deadline has not passed, it flushes again; then it force-closes
  // what is left (nothing, unless the deadline passed) and ends.
  void close_go_on(request* r) noexcept {
    E& s = self();
    --r->pins;  // off the list
    endpoint_state& e = *r->endpoint;
    // A send made since the flush was posted (a notification's message, sent once its own flush
    // ended, done locally at once) may still be in UCX's buffers: it needs a flush of its own.
    // So may a notification still waiting for its acknowledgement.
    if (e.ep != nullptr && (e.in_flight != 0 || e.sends != r->sends_at_flush || s.acks_due_on(e)) &&
        !r->deadline_passed && r->value < 64) {
      ++r->value;  // flushes so far: a bound, should UCX end a flush with requests still out
      r->sends_at_flush = e.sends;
      return s.start_flush(r);
    }
    force_close(e, make_error_code(errc::endpoint_closed));
    close_done(r);
  }

  void close_done(request* r) noexcept {
    E& s = self();
    s.closing_.fetch_sub(1, std::memory_order_relaxed);
    s.finish_all(r, {});
  }

  // ---- deadlines of requests out in UCX
  static void on_deadline(ferry::detail::timer_node* t) noexcept {
    request* r = static_cast<request_timer*>(t)->owner;
    E& s = *static_cast<E*>(r->eng);
    r->deadline_passed = true;
    s.disarmed(r);  // the timer has left the heap
    switch (r->kind) {
      case request_kind::wait_notification:
        // Nothing of UCX's is out for a wait: take it off the endpoint's list.
        if (r->endpoint) {
          auto& w = r->endpoint->notification_waiters;
          w.erase(std::remove(w.begin(), w.end(), r), w.end());
        }
        return s.finish_all(r, make_error_code(errc::deadline_exceeded));
      case request_kind::accept:
        if (r->listener) {
          auto& w = r->listener->accept_waiters;
          w.erase(std::remove(w.begin(), w.end(), r), w.end());
        }
        return s.finish_all(r, make_error_code(errc::deadline_exceeded));
      default:
        break;
    }
    // Listed for the next poll(): `r` is not freed while it is listed (maybe_destroy).
    if (!r->deadline_listed) {
      r->deadline_listed = true;
      r->due_next = s.deadlines_due_;
      s.deadlines_due_ = r;
    }
  }

  // Work put off to the top or the end of poll(), outside UCX's callbacks and timer rounds:
  // requests whose deadlines passed end (their endpoints force-closed), and closes whose flushes
  // ended go on. Returns how much it did.
  std::size_t run_deferred() noexcept {
    E& s = self();
    std::size_t n = 0;
    while (s.deadlines_due_ != nullptr || s.closes_flushed_ != nullptr || !s.closes_due_.empty()) {
      for (auto& [e, why] : std::exchange(s.closes_due_, {})) {
        force_close(*e, why);
        ++n;
      }
      while (request* r = s.deadlines_due_) {
        s.deadlines_due_ = r->due_next;
        r->due_next = nullptr;
        r->deadline_listed = false;
        ++n;
        expire(r);
      }
      while (request* r = s.closes_flushed_) {
        s.closes_flushed_ = r->next;
        r->next = nullptr;
        close_go_on(r);
        ++n;
      }
    }
    return n;
  }

  // `r`'s deadline passed. Still pending: its endpoint is force-closed (which ends it with every
  // other request on it), or, closed already, `r` is abandoned or ended.
  void expire(request* r) noexcept {
    E& s = self();
    if (r->members_left == 0 && r->ucx_out == 0) return s.maybe_destroy(r);
    ++r->pins;  // not freed until this returns, whichever way it ends
    const std::shared_ptr<endpoint_state> e = r->endpoint;
    if (e && e->ep != nullptr) force_close(*e, make_error_code(errc::endpoint_closed));
    if (r->held) {
      s.abandon(r, make_error_code(errc::deadline_exceeded));
    } else if (r->kind != request_kind::close) {
      s.finish_all(r, make_error_code(errc::deadline_exceeded));
    }
    // A close UCX no longer holds has had its flush end: close_go_on (closes_flushed_) ends it.
    --r->pins;
    s.maybe_destroy(r);
  }
};

}  // namespace ferry::ucx::detail

#pragma once
// Whether a peer is still there. A part of engine (engine.hpp). Executor thread only.
//
// Same-host peers. Shared memory reports success into the segment of a peer that has died, so a
// peer in this process's PID namespace on this host is watched through a pidfd, opened when its
// endpoint is made and kept until the endpoint's state goes (the error path does not close it, so
// a request ending after its endpoint broke still sees the death). A peer in another PID namespace
// (another pod on the node: same boot id, other pids) is not watched by pid: its pid would name
// another process here.
//
// Stopped peers. A notification wait with nothing else out on its endpoint has no UCX request that
// a dead or hung peer could fail, and UCX's keepalive never notices a peer that is stopped rather
// than gone. While such a wait is pending the executor pings the peer (an active message its
// executor answers), and closes the endpoint when no answer comes within the liveness timeout or
// a watched peer has exited: the wait then fails at once instead of at its deadline.

#include <ucp/api/ucp.h>

#include <poll.h>

#include <array>
#include <chrono>
#include <memory>
#include <system_error>
#include <vector>

#include "ferry/detail/timer_service.hpp"
#include "ferry/ucx/detail/endpoint_state.hpp"
#include "ferry/ucx/detail/request.hpp"
#include "ferry/ucx/detail/wire.hpp"
#include "ferry/ucx/errors.hpp"

namespace ferry::ucx::detail {

// How long an endpoint failure that looks like a lost peer waits to see its watched process exit.
inline constexpr std::chrono::milliseconds exit_grace{20};

template <class E>
struct liveness {
  [[nodiscard]] E& self() noexcept { return static_cast<E&>(*this); }

  // A watched peer that has exited, looked at once per request (one poll of its pidfd).
  static bool peer_exited(request& r) noexcept {
    if (!r.endpoint || r.endpoint->peer_pidfd < 0) return false;
    if (!r.peer_checked) {
      r.peer_checked = true;
      r.peer_exited = process_exited(r.endpoint->peer_pidfd);
    }
    return r.peer_exited;
  }

  // What an endpoint that failed with `why` tells its users: peer_gone when its watched peer has
  // exited (UCX says "Endpoint timeout" or "Connection reset" for a peer that simply exited). A
  // process that exits closes its sockets before its pidfd turns readable, so UCX can report the
  // loss first: for a loss UCX reports, the exit is waited for up to exit_grace.
  [[nodiscard]] static std::error_code reason(const endpoint_state& e, std::error_code why) noexcept {
    if (e.peer_pidfd < 0) return why;
    const bool loss = why.category() == ucs_category() &&
                      (why.value() == UCS_ERR_ENDPOINT_TIMEOUT ||
                       why.value() == UCS_ERR_CONNECTION_RESET || why.value() == UCS_ERR_UNREACHABLE ||
                       why.value() == UCS_ERR_IO_ERROR || why.value() == UCS_ERR_NOT_CONNECTED);
    pollfd p{e.peer_pidfd, POLLIN, 0};
    const int waited = ::poll(&p, 1, loss ? static_cast<int>(exit_grace.count()) : 0);
    if (waited == 1 && (p.revents & POLLIN) != 0) return make_error_code(errc::peer_gone);
    return why;
  }

  // On the executor thread, before the engine goes: the timer may then neither fire nor be armed.
  void stop_liveness() noexcept {
    E& s = self();
    s.liveness_interval_ = std::chrono::milliseconds(0);
    if (s.liveness_armed_) (void)s.exec_.timers().cancel(s.liveness_timer_);
    s.liveness_armed_ = false;
    s.liveness_timer_.fired = false;
  }

  void arm_liveness() noexcept {
    E& s = self();
    if (s.liveness_armed_ || s.liveness_interval_.count() <= 0) return;
    s.liveness_timer_.deadline = ferry::detail::clock::now() + s.liveness_interval_;
    // Fired on the executor's thread, which then polls: poll() does the check.
    s.liveness_timer_.fire = [](ferry::detail::timer_node* t) noexcept {
      static_cast<typename E::flag_timer*>(t)->fired = true;
    };
    try {
      s.exec_.timers().arm(s.liveness_timer_);
      s.liveness_armed_ = true;
    } catch (...) {
      // No memory for the timer heap: the waits end by their deadlines, as without the check.
    }
  }

  // After progress (poll()), so that an answer that has arrived is counted.
  std::size_t liveness_round() noexcept {
    E& s = self();
    if (!s.liveness_timer_.fired) return 0;
    s.liveness_timer_.fired = false;
    s.liveness_armed_ = false;
    check_liveness();
    return 1;
  }

  // Every endpoint a notification wait is pending on with nothing else out: a watched peer that
  // has exited, or a peer that left a ping unanswered for the liveness timeout, has its endpoint
  // closed (which fails the waits); otherwise it is pinged.
  void check_liveness() noexcept {
    E& s = self();
    const auto now = ferry::detail::clock::now();
    bool waiting = false;
    std::vector<std::shared_ptr<endpoint_state>> endpoints;
    try {
      endpoints = s.endpoints_;
    } catch (...) {
      return arm_liveness();
    }
    for (const auto& e : endpoints) {
      if (e->ep == nullptr) continue;
      if (e->notification_waiters.empty()) {
        e->ping_out = false;  // the next wait starts the count afresh
        continue;
      }
      if (e->in_flight != 0) {
        // Its own requests carry the endpoint's fate (and their deadlines); start over after.
        e->ping_out = false;
        waiting = true;
        continue;
      }
      if (e->peer_pidfd >= 0 && process_exited(e->peer_pidfd)) {
        s.force_close(*e, make_error_code(errc::peer_gone));
        continue;
      }
      if (e->ping_out && now - e->ping_sent >= s.liveness_timeout_) {
        s.force_close(*e, make_error_code(errc::peer_unresponsive));
        continue;
      }
      if (!e->ping_out) {
        e->ping_out = true;
        e->ping_sent = now;  // the first ping not yet answered
      }
      // Again every interval until answered: a peer drops a ping from a worker it has no endpoint
      // to yet (it answers once it has connected back).
      send_control(*e, s.ping_header_);
      waiting = true;
    }
    if (waiting) arm_liveness();
  }

  // A ping (answered) or a pong: the peer is there, for every endpoint to it.
  void liveness_message(const am_header& h) noexcept {
    E& s = self();
    auto it = s.by_worker_.find(h.sender.worker_id);
    if (it == s.by_worker_.end()) return;
    if (h.kind == am_kind::ping) return send_control(*it->second, s.pong_header_);
    for (const auto& e : s.endpoints_) {
      if (e->peer.worker_id == h.sender.worker_id) e->ping_out = false;
    }
  }

  // A ping or pong: nothing waits for it to end, and its header is the engine's own.
  static void send_control(endpoint_state& e,
                           const std::array<unsigned char, sizeof(am_header)>& header) noexcept {
    if (e.ep == nullptr) return;
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK;
    p.cb.send = [](void* ucx_request, ucs_status_t, void*) noexcept {
      ::ucp_request_free(ucx_request);
    };
    // Failed at once: the endpoint's error handler reports it, or the unanswered ping does.
    (void)::ucp_am_send_nbx(e.ep, am_id, header.data(), header.size(), nullptr, 0, &p);
  }
};

}  // namespace ferry::ucx::detail

#pragma once
// The executor's side of a UCX worker. The worker runs in UCX's single-thread mode and only the
// progress executor's thread calls into it: submitters publish requests onto a lock-free stack and
// notify the executor, whose poll() takes them, hands them to UCX and progresses the worker; every
// UCX callback (a put, get, flush or active message ending, an endpoint failing) runs inside that
// progress, on that thread. Connections by host and port are ferry's own sockets, in the same epoll
// set the executor parks on.
//
// This class is the facade: making the worker, routing what submitters publish, and the
// executor's poll and arm. What it does is in parts, one header each, which it derives from:
//   configuration.hpp  the UCX context and worker from worker_options
//   submission.hpp     handing gets and puts to UCX, ranges checked against the peer's regions
//   completion.hpp     the flush that makes a put land; when a member ends success; abandoning
//                      what UCX keeps after a force-close; freeing a request
//   closing.hpp        graceful and forced closes, and request deadlines
//   notifications.hpp  notifications with acknowledgements; every active message received
//   liveness.hpp       watched same-host peers (pidfd) and pings of stopped peers
//   connection.hpp     endpoints from addresses, or by host and port through ferry's own
//                      handshake; imported regions
// An endpoint's lifecycle is one phase with its legal transitions (endpoint_state.hpp).

#include <ucp/api/ucp.h>

#include <sys/epoll.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <system_error>
#include <unordered_map>
#include <vector>

#include "ferry/detail/submission_stack.hpp"
#include "ferry/errors.hpp"
#include "ferry/metrics.hpp"
#include "ferry/progress_executor.hpp"
#include "ferry/transfer.hpp"
#include "ferry/ucx/detail/closing.hpp"
#include "ferry/ucx/detail/completion.hpp"
#include "ferry/ucx/detail/configuration.hpp"
#include "ferry/ucx/detail/connection.hpp"
#include "ferry/ucx/detail/endpoint_state.hpp"
#include "ferry/ucx/detail/liveness.hpp"
#include "ferry/ucx/detail/notifications.hpp"
#include "ferry/ucx/detail/request.hpp"
#include "ferry/ucx/detail/submission.hpp"
#include "ferry/ucx/detail/wire.hpp"
#include "ferry/ucx/errors.hpp"
#include "ferry/ucx/memory_region.hpp"
#include "ferry/ucx/options.hpp"
#include "ferry/ucx/remote.hpp"

namespace ferry::ucx::detail {

// Notifications that arrived from a peer before an endpoint to it was made.
struct early_queue {
  std::deque<std::uint64_t> values;
  std::uint64_t refused = 0;
};

class engine : public submission<engine>,
               public completion<engine>,
               public closing<engine>,
               public notifications<engine>,
               public liveness<engine>,
               public connection<engine> {
 public:
  // At most this many peers may have notifications kept before an endpoint to them is made.
  static constexpr std::size_t max_early_peers = 1024;

  engine(progress_executor& exec, const worker_options& options) : exec_(exec) {
    check_options(options);
    context_ = make_context(options);
    worker_ = make_worker(context_->context);
    try {
      check_status(::ucp_worker_get_efd(worker_, &efd_), "ucp_worker_get_efd");
      // The executor parks on one descriptor: UCX's, and the sockets of connections by host and
      // port (connection.hpp), in one epoll set. UCX's is tagged null.
      epfd_ = ::epoll_create1(EPOLL_CLOEXEC);
      epoll_event ev{};
      ev.events = EPOLLIN;
      ev.data.ptr = nullptr;
      if (epfd_ < 0 || ::epoll_ctl(epfd_, EPOLL_CTL_ADD, efd_, &ev) != 0) {
        throw std::system_error(errno, std::system_category(),
                                "ferry::ucx: the executor's epoll set (epoll_create1, epoll_ctl)");
      }
      ucp_am_handler_param_t hp{};
      hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                      UCP_AM_HANDLER_PARAM_FIELD_ARG;
      hp.id = am_id;
      hp.cb = &engine::on_active_message;
      hp.arg = this;
      check_status(::ucp_worker_set_am_recv_handler(worker_, &hp), "ucp_worker_set_am_recv_handler");
      ucp_address_t* address = nullptr;
      std::size_t address_bytes = 0;
      check_status(::ucp_worker_get_address(worker_, &address, &address_bytes),
                   "ucp_worker_get_address");
      ucx_address_.assign(reinterpret_cast<const std::byte*>(address),
                          reinterpret_cast<const std::byte*>(address) + address_bytes);
      ::ucp_worker_release_address(worker_, address);
      self_.worker_id = std::random_device{}() | (std::uint64_t{std::random_device{}()} << 32);
      self_.host_id = host_id();
      self_.pid_ns = pid_namespace();
      self_.pid = static_cast<std::uint32_t>(::getpid());
      peer_errors_ = options.peer_error_handling;
      meter_.attach(options.metrics, {"put", "get"});  // request_kind's order
      liveness_interval_ = options.liveness_interval;
      liveness_timeout_ = options.liveness_timeout;
      close_timeout_ = options.close_timeout;
      handshake_timeout_ = options.handshake_timeout;
      max_unclaimed_ = options.max_unclaimed_notifications;
      for (auto [header, kind] : {std::pair{&ping_header_, am_kind::ping},
                                  std::pair{&pong_header_, am_kind::pong}}) {
        am_header h;
        h.kind = kind;
        h.sender = self_;
        std::memcpy(header->data(), &h, sizeof h);
      }
    } catch (...) {
      if (epfd_ >= 0) ::close(epfd_);
      ::ucp_worker_destroy(worker_);
      throw;
    }
  }

  engine(const engine&) = delete;
  engine& operator=(const engine&) = delete;

  // After the executor has let go of the worker (remove_source): nothing else runs on it. Every
  // request ends: queued ones fail with worker_closed, those out are ended by force-closing their
  // endpoints, and what UCX still holds then is freed once the worker has gone.
  ~engine() {
    (void)run_deferred();
    incoming_.take([this](request* r) { finish_all(r, make_error_code(errc::worker_closed)); });
    for (const auto& e : std::vector<std::shared_ptr<endpoint_state>>(endpoints_)) {
      force_close(*e, make_error_code(errc::worker_closed));
    }
    // close_listener takes each off listeners_; end_handshake each off handshakes_.
    for (const auto& l : std::vector<std::shared_ptr<listener_state>>(listeners_)) {
      close_listener(*l);
    }
    while (!handshakes_.empty()) end_handshake(0, make_error_code(errc::worker_closed));
    (void)run_deferred();  // closes whose flushes the force-closes above cancelled
    if (liveness_armed_) (void)exec_.timers().cancel(liveness_timer_);
    // Requests UCX still holds (kept after a force-close, or on endpoints closed without force)
    // end now; what UCX calls back while the worker goes changes nothing of them.
    for (request* r = held_; r != nullptr; r = r->held_next) {
      abandon(r, make_error_code(errc::worker_closed));
    }
    ::ucp_worker_destroy(worker_);
    while (request* r = held_) {
      held_ = r->held_next;
      r->held = false;
      r->ucx_out = 0;
      r->members_left = 0;  // ~request fails any member still pending (worker_closed)
      if (r->has_deadline) {
        (void)exec_.timers().cancel(r->timer);
        disarmed(r);
      }
      delete r;
    }
    ::close(epfd_);
  }

  [[nodiscard]] const std::shared_ptr<context_holder>& context() const noexcept { return context_; }
  [[nodiscard]] progress_executor& executor() noexcept { return exec_; }
  [[nodiscard]] const peer_identity& self_identity() const noexcept { return self_; }
  [[nodiscard]] const std::vector<std::byte>& ucx_address() const noexcept { return ucx_address_; }
  // Notifications this worker refused, past worker_options::max_unclaimed_notifications (any
  // thread).
  [[nodiscard]] std::uint64_t notifications_refused() const noexcept {
    return notifications_refused_.load(std::memory_order_relaxed);
  }
  // Requests whose transfers ferry ended while UCX still held them (any thread).
  [[nodiscard]] std::size_t abandoned() const noexcept {
    return abandoned_count_.load(std::memory_order_relaxed);
  }

  void publish(request* r) noexcept {
    if (r->kind == request_kind::put || r->kind == request_kind::get) r->published_ns = meter_.stamp();
    incoming_.push(r);
    exec_.notify();
  }

  // The executor's calls (completion_source.hpp).
  std::size_t poll(std::size_t budget) noexcept {
    std::size_t n = run_deferred();
    n += incoming_.take([this](request* r) { arrive(r); });
    while (n < budget) {
      const unsigned events = ::ucp_worker_progress(worker_);
      if (events == 0) break;
      n += events;
    }
    n += liveness_round();
    // One epoll_wait a round, only while a listener or a handshake exists.
    if (sockets_watched()) n += poll_sockets();
    return n + run_deferred();
  }
  [[nodiscard]] int park_fd() const noexcept { return epfd_; }
  // UCS_ERR_BUSY: events are waiting, progress instead of sleeping.
  bool arm() noexcept {
    return incoming_.empty() && deadlines_due_ == nullptr && closes_flushed_ == nullptr &&
           closes_due_.empty() &&
           ::ucp_worker_arm(worker_) == UCS_OK;
  }
  [[nodiscard]] bool in_flight() const noexcept { return in_flight_ != 0; }

  static ferry::detail::status_block* attach(member& m) {
    m.status = ferry::detail::status_block::make();
    return m.status;
  }

  // Endpoints whose close is still flushing (any thread), and how long a close may flush.
  [[nodiscard]] std::size_t closing_endpoints() const noexcept {
    return closing_.load(std::memory_order_relaxed);
  }
  [[nodiscard]] std::chrono::milliseconds close_timeout() const noexcept { return close_timeout_; }

  void arm_deadline(request* r) noexcept {
    if (!r->has_deadline) return;
    r->timer.owner = r;
    r->timer.deadline = r->deadline;
    r->timer.fire = &engine::on_deadline;
    try {
      exec_.timers().arm(r->timer);
    } catch (...) {
      // No memory for the timer heap: the request runs without its deadline rather than failing.
      r->has_deadline = false;
      return;
    }
    r->armed_prev = nullptr;
    r->armed_next = armed_;
    if (armed_ != nullptr) armed_->armed_prev = r;
    armed_ = r;
  }

  // `r`'s timer has fired or is cancelled: off the armed list.
  void disarmed(request* r) noexcept {
    if (r->armed_prev != nullptr) r->armed_prev->armed_next = r->armed_next;
    if (r->armed_next != nullptr) r->armed_next->armed_prev = r->armed_prev;
    if (armed_ == r) armed_ = r->armed_next;
    r->armed_prev = r->armed_next = nullptr;
    r->has_deadline = false;
  }

  // On the executor thread, before the worker lets go of it: every timer of this engine is
  // cancelled, so that none fires on the executor while ~engine runs on another thread.
  void stop_timers() noexcept {
    stop_liveness();
    while (request* r = armed_) {
      (void)exec_.timers().cancel(r->timer);
      disarmed(r);
    }
    for (const auto& h : handshakes_) {
      if (h->armed) (void)exec_.timers().cancel(h->deadline);
      h->armed = false;
    }
  }

  // ---- the state the parts share (executor thread, unless said otherwise)
  struct flag_timer : ferry::detail::timer_node {
    bool fired = false;
  };

  progress_executor& exec_;
  std::shared_ptr<context_holder> context_;
  ucp_worker_h worker_ = nullptr;
  int efd_ = -1;   // UCX's
  int epfd_ = -1;  // what the executor parks on: efd_ and the handshakes' sockets
  bool peer_errors_ = true;
  ferry::metrics::backend_meter meter_;
  peer_identity self_;
  std::vector<std::byte> ucx_address_;
  ferry::detail::submission_stack<request> incoming_;  // any thread pushes
  std::size_t in_flight_ = 0;  // UCX requests out, not abandoned
  request* held_ = nullptr;    // requests with UCX requests out (completion.hpp)
  std::size_t abandoned_ = 0;  // of them, abandoned
  std::atomic<std::size_t> abandoned_count_{0};  // abandoned_, for any thread
  std::vector<std::shared_ptr<endpoint_state>> endpoints_;
  std::vector<std::shared_ptr<listener_state>> listeners_;
  std::vector<std::unique_ptr<handshake>> handshakes_;  // connections by host and port under way
  std::chrono::milliseconds handshake_timeout_{};
  std::unordered_map<std::uint64_t, endpoint_state*> by_worker_;
  std::unordered_map<std::uint64_t, early_queue> early_notifications_;
  std::unordered_map<std::uint64_t, request*> acks_due_;  // notifications by sequence
  std::uint64_t next_sequence_ = 1;
  std::size_t max_unclaimed_ = 0;
  std::atomic<std::uint64_t> notifications_refused_{0};  // any thread reads
  std::chrono::milliseconds liveness_interval_{};
  std::chrono::milliseconds liveness_timeout_{};
  std::chrono::milliseconds close_timeout_{};
  // Close requests flushing their endpoints: written on the executor, read by ~worker.
  std::atomic<std::size_t> closing_{0};
  request* deadlines_due_ = nullptr;   // requests whose deadlines passed, linked through due_next
  request* closes_flushed_ = nullptr;  // closes whose flush ended, linked through next
  request* armed_ = nullptr;           // requests whose deadline timers are armed
  // Endpoints to force-close at the next poll, and why (a watched peer seen exited in a callback).
  std::vector<std::pair<std::shared_ptr<endpoint_state>, std::error_code>> closes_due_;
  flag_timer liveness_timer_;
  bool liveness_armed_ = false;
  std::array<unsigned char, sizeof(am_header)> ping_header_{};
  std::array<unsigned char, sizeof(am_header)> pong_header_{};

 private:
  // Written before the call's transfer completes, whose release publishes it to the waiter.
  static void note_call_error(request* r, const char* what) noexcept {
    if (r->call_error_out == nullptr) return;
    try {
      *r->call_error_out = what;
    } catch (...) {
      // No memory for the text: the error code alone says what failed.
    }
  }

  // ---- requests arriving on the executor
  void arrive(request* r) noexcept {
    switch (r->kind) {
      case request_kind::put:
      case request_kind::get: return start_rma(r);
      case request_kind::notify: return start_notify(r);
      case request_kind::wait_notification: return start_wait(r);
      case request_kind::connect: return start_connect(r);
      case request_kind::accept: return start_accept(r);
      case request_kind::close: return start_close(r);
      case request_kind::call: {
        std::error_code ec;
        try {
          ec = r->call();
        } catch (const std::system_error& e) {
          ec = e.code();
          note_call_error(r, e.what());
        } catch (const std::exception& e) {
          ec = make_error_code(ferry::errc::unspecified_failure);
          note_call_error(r, e.what());
        } catch (...) {
          ec = make_error_code(ferry::errc::unspecified_failure);
        }
        return finish_all(r, ec);
      }
    }
  }
};

}  // namespace ferry::ucx::detail

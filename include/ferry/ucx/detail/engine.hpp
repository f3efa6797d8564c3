#pragma once
// The executor's side of a UCX worker. The worker runs in UCX's single-thread mode and only the
// progress executor's thread calls into it: submitters publish requests onto a lock-free stack and
// notify the executor, whose poll() takes them, hands them to UCX and progresses the worker; every
// UCX callback (a put, get, flush or active message ending, an endpoint failing, a peer connecting)
// runs inside that progress, on that thread. The context is made thread-safe (mt_workers_shared) so
// that memory is mapped and keys are packed on the caller's thread.
//
// A put's transfer ends when the data has landed at the peer: UCX's put callback only means the
// source may be reused, so a landed put is followed by a flush of its endpoint (one per batch), and
// its transfer ends with the flush. A notification is a flush followed by an active message, so
// the peer that receives it finds every put sent before it in its memory.
//
// Failure. An endpoint that fails (UCX's error handler: a peer that died, a link that went) fails
// every request it strands, through UCX's own callbacks, and every notification wait on it. A
// request whose deadline passes force-closes its endpoint: UCX then calls back every request out
// on it at once, so the request ends only once UCX has let go of its buffers, and drain() of a
// batch means its memory is quiescent. A same-host peer is checked by pid before a success is
// reported, since shared memory reports success into the segment of a peer that has died.
//
// Liveness. A notification wait with nothing else out on its endpoint has no UCX request that a
// dead or hung peer could fail, and UCX's keepalive never notices a peer that is stopped rather
// than gone. While such a wait is pending the executor pings the peer (an active message its
// executor answers), and closes the endpoint when no answer comes within the liveness timeout or
// a same-host peer's pid has exited: the wait then fails at once instead of at its deadline.

#include <ucp/api/ucp.h>

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <fstream>
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
#include "ferry/ucx/detail/endpoint_state.hpp"
#include "ferry/ucx/detail/request.hpp"
#include "ferry/ucx/errors.hpp"
#include "ferry/ucx/memory_region.hpp"
#include "ferry/ucx/options.hpp"
#include "ferry/ucx/remote.hpp"

namespace ferry::ucx::detail {

inline constexpr unsigned am_id = 0x6665;  // ferry's active messages on a worker
inline constexpr std::uint32_t am_magic = 0x4d415846;  // "FXAM"
enum class am_kind : std::uint32_t { notification = 1, hello = 2, ping = 3, pong = 4 };

struct am_header {
  std::uint32_t magic = am_magic;
  am_kind kind = am_kind::notification;
  peer_identity sender;
  std::uint64_t value = 0;
};

// This boot of this machine: peers with the same id share it (and its pids).
inline std::uint64_t host_id() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(in, id);
  std::uint64_t h = 1469598103934665603ull;
  for (char c : id) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  return h;
}

inline int open_pidfd(std::uint32_t pid) noexcept {
#ifdef SYS_pidfd_open
  return static_cast<int>(::syscall(SYS_pidfd_open, static_cast<pid_t>(pid), 0));
#else
  (void)pid;
  return -1;
#endif
}

// A pidfd turns readable once its process has exited.
inline bool process_exited(int pidfd) noexcept {
  if (pidfd < 0) return false;
  pollfd p{pidfd, POLLIN, 0};
  return ::poll(&p, 1, 0) == 1 && (p.revents & POLLIN) != 0;
}

// The hello a side sends when connecting by host and port: who it is and the regions it exposes.
inline std::vector<std::byte> encode_regions(const std::vector<remote_region>& regions) {
  record_writer w;
  w.put(region_magic);
  w.put(descriptor_version);
  w.put(static_cast<std::uint32_t>(regions.size()));
  for (const remote_region& r : regions) {
    const std::vector<std::byte> b = r.to_bytes();
    w.put(static_cast<std::uint32_t>(b.size()));
    w.put_bytes(b);
  }
  return w.finish();
}

inline std::vector<remote_region> decode_regions(std::span<const std::byte> bytes) {
  record_reader r(bytes, region_magic, "region list in a hello");
  const auto n = r.get<std::uint32_t>();
  std::vector<remote_region> out;
  for (std::uint32_t i = 0; i < n; ++i) {
    const auto len = r.get<std::uint32_t>();
    const std::vector<std::byte> b = r.get_bytes(len);
    out.push_back(remote_region::from_bytes(b));
  }
  r.done();
  return out;
}

class engine {
 public:
  engine(progress_executor& exec, const worker_options& options) : exec_(exec) {
    ucp_config_t* config = nullptr;
    check(::ucp_config_read(nullptr, nullptr, &config), "reading UCX's configuration");
    try {
      modify(config, "TLS", options.transports);
      if (!options.devices.empty()) modify(config, "NET_DEVICES", options.devices);
      bool mm_set = false;
      for (const auto& [k, v] : options.settings) mm_set = mm_set || k == "MM_ERROR_HANDLING";
      // Only where a shared-memory transport may load: elsewhere UCX warns of an unused setting.
      const bool shm = options.transports.find("shm") != std::string::npos ||
                       options.transports.find("posix") != std::string::npos ||
                       options.transports.find("sysv") != std::string::npos ||
                       options.transports == "all";
      if (options.peer_error_handling && shm && !mm_set) modify(config, "MM_ERROR_HANDLING", "y");
      if (options.keepalive.count() > 0) {
        modify(config, "KEEPALIVE_INTERVAL", std::to_string(options.keepalive.count()) + "ms");
      }
      for (const auto& [k, v] : options.settings) modify(config, k, v);
      ucp_params_t p{};
      p.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
      p.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
      p.mt_workers_shared = 1;
      context_ = std::make_shared<context_holder>();
      check(::ucp_init(&p, config, &context_->context), "ucp_init");
    } catch (...) {
      ::ucp_config_release(config);
      throw;
    }
    ::ucp_config_release(config);
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;
    check(::ucp_worker_create(context_->context, &wp, &worker_), "ucp_worker_create");
    try {
      check(::ucp_worker_get_efd(worker_, &efd_), "ucp_worker_get_efd");
      ucp_am_handler_param_t hp{};
      hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                      UCP_AM_HANDLER_PARAM_FIELD_ARG;
      hp.id = am_id;
      hp.cb = &on_active_message;
      hp.arg = this;
      check(::ucp_worker_set_am_recv_handler(worker_, &hp), "ucp_worker_set_am_recv_handler");
      ucp_address_t* address = nullptr;
      std::size_t address_bytes = 0;
      check(::ucp_worker_get_address(worker_, &address, &address_bytes), "ucp_worker_get_address");
      ucx_address_.assign(reinterpret_cast<const std::byte*>(address),
                          reinterpret_cast<const std::byte*>(address) + address_bytes);
      ::ucp_worker_release_address(worker_, address);
      self_.worker_id = std::random_device{}() | (std::uint64_t{std::random_device{}()} << 32);
      self_.host_id = host_id();
      self_.pid = static_cast<std::uint32_t>(::getpid());
      peer_errors_ = options.peer_error_handling;
      meter_.attach(options.metrics, {"put", "get"});  // request_kind's order
      liveness_interval_ = options.liveness_interval;
      liveness_timeout_ = options.liveness_timeout;
      if (options.close_timeout.count() < 0 || options.close_timeout > std::chrono::hours(1)) {
        throw std::invalid_argument(
            "ferry::ucx::worker_options::close_timeout must be between 0 and 1 h");
      }
      close_timeout_ = options.close_timeout;
      for (auto [header, kind] : {std::pair{&ping_header_, am_kind::ping},
                                  std::pair{&pong_header_, am_kind::pong}}) {
        am_header h;
        h.kind = kind;
        h.sender = self_;
        std::memcpy(header->data(), &h, sizeof h);
      }
    } catch (...) {
      ::ucp_worker_destroy(worker_);
      throw;
    }
  }

  engine(const engine&) = delete;
  engine& operator=(const engine&) = delete;

  // After the executor has let go of the worker (remove_source): nothing else runs on it.
  ~engine() {
    (void)run_deferred();
    incoming_.take([this](request* r) { refuse(r, make_error_code(errc::worker_closed)); });
    for (const auto& e : std::vector<std::shared_ptr<endpoint_state>>(endpoints_)) {
      close_endpoint(*e, make_error_code(errc::worker_closed));
    }
    // close_listener takes each off listeners_.
    for (const auto& l : std::vector<std::shared_ptr<listener_state>>(listeners_)) {
      close_listener(*l);
    }
    (void)run_deferred();  // closes whose flushes the force-closes above cancelled
    if (liveness_armed_) (void)exec_.timers().cancel(liveness_timer_);
    ::ucp_worker_destroy(worker_);
  }

  [[nodiscard]] const std::shared_ptr<context_holder>& context() const noexcept { return context_; }
  [[nodiscard]] progress_executor& executor() noexcept { return exec_; }
  [[nodiscard]] const peer_identity& self() const noexcept { return self_; }
  [[nodiscard]] const std::vector<std::byte>& ucx_address() const noexcept { return ucx_address_; }

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
    // After progress, so that an answer that has arrived is counted.
    if (liveness_timer_.fired) {
      liveness_timer_.fired = false;
      liveness_armed_ = false;
      check_liveness();
      ++n;
    }
    return n + run_deferred();
  }
  [[nodiscard]] int park_fd() const noexcept { return efd_; }
  // UCS_ERR_BUSY: events are waiting, progress instead of sleeping.
  bool arm() noexcept {
    return incoming_.empty() && closes_due_ == 0 && closes_flushed_ == nullptr &&
           ::ucp_worker_arm(worker_) == UCS_OK;
  }
  [[nodiscard]] bool in_flight() const noexcept { return in_flight_ != 0; }

  static ferry::detail::status_block* attach(member& m) {
    m.status = ferry::detail::status_block::make();
    return m.status;
  }

 private:
  friend struct engine_access;

  static void check(ucs_status_t s, const char* what) {
    if (s != UCS_OK) throw_status(s, std::string("ferry::ucx: ") + what);
  }
  static void modify(ucp_config_t* c, const std::string& key, const std::string& value) {
    check(::ucp_config_modify(c, key.c_str(), value.c_str()),
          ("setting UCX's " + key + "=" + value).c_str());
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
        } catch (...) {
          ec = make_error_code(ferry::errc::unspecified_failure);
        }
        return finish_all(r, ec);
      }
    }
  }

  // Fails every member of a request that never reached UCX.
  void refuse(request* r, std::error_code ec) noexcept { finish_all(r, ec); }

  void arm_deadline(request* r) noexcept {
    if (!r->has_deadline) return;
    r->timer.owner = r;
    r->timer.deadline = r->deadline;
    r->timer.fire = &on_deadline;
    try {
      exec_.timers().arm(r->timer);
    } catch (...) {
      // No memory for the timer heap: the request runs without its deadline rather than failing.
      r->has_deadline = false;
    }
  }

  std::error_code check_endpoint(const request* r) const {
    if (!r->endpoint || r->endpoint->ep == nullptr) {
      const std::error_code f = r->endpoint ? r->endpoint->failure() : std::error_code{};
      return f ? f : make_error_code(errc::endpoint_closed);
    }
    return r->endpoint->failure();
  }

  ucp_rkey_h rkey_for(endpoint_state& e, std::uint32_t index, std::error_code& ec) {
    if (index >= e.regions.size()) {
      ec = make_error_code(errc::outside_region);
      return nullptr;
    }
    imported_region& ir = e.regions[index];
    if (ir.rkey == nullptr) {
      if (const ucs_status_t s = ::ucp_ep_rkey_unpack(e.ep, ir.packed_key.data(), &ir.rkey);
          s != UCS_OK) {
        ec = status_error(s);
        return nullptr;
      }
    }
    return ir.rkey;
  }

  void start_rma(request* r) noexcept {
    if (const std::error_code ec = check_endpoint(r)) return refuse(r, ec);
    endpoint_state& e = *r->endpoint;
    arm_deadline(r);
    const bool put = r->kind == request_kind::put;
    const bool flush = put && r->completion == put_completion::landed;
    const std::size_t total = r->members.size();
    std::size_t refused = 0;
    bool refused_all = false;
    for (std::size_t i = 0; i < total && !refused_all; ++i) {
      member& m = r->members[i];
      std::error_code ec;
      // UCX may fail the endpoint inside an earlier member's call (its error handler, which
      // closes it): the rest are not handed to a closed endpoint.
      if (e.ep == nullptr) {
        ec = e.failure();
        if (!ec) ec = make_error_code(errc::endpoint_closed);
      }
      ucp_rkey_h rkey = ec ? nullptr : rkey_for(e, m.remote_index, ec);
      if (!ec) {
        const imported_region& ir = e.regions[m.remote_index];
        if (m.remote_address < ir.address || m.length > ir.length ||
            m.remote_address - ir.address > ir.length - m.length) {
          ec = make_error_code(errc::outside_region);
        }
      }
      m.outstanding = 1 + (flush ? 1 : 0);
      if (ec) {
        m.failure = ec;
        m.outstanding = 1;  // the flush does not wait for a member that never went
        refused_all = ++refused == total;  // then ending this one frees the request
        member_step(m, UCS_OK);
        continue;
      }
      ucp_request_param_t p{};
      p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
      if (m.memh != nullptr) {
        p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
        p.memh = m.memh;
      }
      p.cb.send = &on_member_done;
      p.user_data = &m;
      const ucs_status_ptr_t sp =
          put ? ::ucp_put_nbx(e.ep, m.local, m.length, m.remote_address, rkey, &p)
              : ::ucp_get_nbx(e.ep, m.local, m.length, m.remote_address, rkey, &p);
      track(e, sp, m);
    }
    // Refused members ended above; if all did, the request is gone.
    if (flush && !refused_all) start_flush(r);
  }

  // The outcome of an nbx call: done now (null), failed now, or a request whose callback follows.
  void track(endpoint_state& e, ucs_status_ptr_t sp, member& m) noexcept {
    ++e.sends;  // done locally or not: a close's flush must come after it (close_go_on)
    if (sp == nullptr) return member_step(m, UCS_OK);
    if (UCS_PTR_IS_ERR(sp)) return member_step(m, UCS_PTR_STATUS(sp));
    ++e.in_flight;
    ++in_flight_;
  }

  void start_flush(request* r) noexcept {
    endpoint_state& e = *r->endpoint;
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.send = &on_flush_done;
    p.user_data = r;
    r->flushes = 1;
    if (e.ep == nullptr) return flush_ended(r, UCS_ERR_CANCELED);
    const ucs_status_ptr_t sp = ::ucp_ep_flush_nbx(e.ep, &p);
    if (sp == nullptr) return flush_ended(r, UCS_OK);
    if (UCS_PTR_IS_ERR(sp)) return flush_ended(r, UCS_PTR_STATUS(sp));
    ++e.in_flight;
    ++in_flight_;
  }

  static void on_member_done(void* ucx_request, ucs_status_t s, void* user) noexcept {
    auto& m = *static_cast<member*>(user);
    engine& self = *m.owner->eng;
    endpoint_state& e = *m.owner->endpoint;
    --e.in_flight;
    --self.in_flight_;
    ::ucp_request_free(ucx_request);
    self.member_step(m, s);
  }

  static void on_flush_done(void* ucx_request, ucs_status_t s, void* user) noexcept {
    auto* r = static_cast<request*>(user);
    engine& self = *r->eng;
    --r->endpoint->in_flight;
    --self.in_flight_;
    ::ucp_request_free(ucx_request);
    self.flush_ended(r, s);
  }

  void flush_ended(request* r, ucs_status_t s) noexcept {
    r->flushes = 0;
    if (r->kind == request_kind::notify) return notify_flushed(r, s);
    if (r->kind == request_kind::close) return close_flushed(r);
    // Each member the flush ends gets one step; only the step of the last one can free the
    // request, and nothing touches it after that one.
    std::size_t to_step = 0;
    for (const member& m : r->members) to_step += m.status != nullptr && m.outstanding > 0 ? 1 : 0;
    for (std::size_t i = 0; to_step > 0; ++i) {
      member& m = r->members[i];
      if (m.status == nullptr || m.outstanding == 0) continue;
      --to_step;
      member_step(m, s);
    }
  }

  // One of a member's UCX parts ended with `s`.
  void member_step(member& m, ucs_status_t s) noexcept {
    if (s != UCS_OK && !m.failure) m.failure = failure_for(*m.owner, s);
    if (--m.outstanding > 0) return;
    end_member(m);
  }

  // What a request ended by UCX with `s` failed of: its own deadline, a close, or UCX's status.
  std::error_code failure_for(const request& r, ucs_status_t s) const {
    if (r.deadline_passed) return make_error_code(errc::deadline_exceeded);
    if (s == UCS_ERR_CANCELED && r.endpoint) {
      const std::error_code f = r.endpoint->failure();
      if (f) return f;
      return make_error_code(errc::endpoint_closed);
    }
    return status_error(s);
  }

  // A put or get member ended: in the kind's figures, and in its peer's, which its endpoint keeps
  // (so that a server whose peers come and go keeps no figures of endpoints it has closed).
  void record(request& r, std::uint64_t bytes, bool succeeded) noexcept {
    const auto kind = static_cast<std::size_t>(r.kind);  // put 0, get 1: meter_'s order
    static_assert(static_cast<std::size_t>(request_kind::put) == 0 &&
                  static_cast<std::size_t>(request_kind::get) == 1);
    ferry::metrics::op_metrics* no_peer = nullptr;
    endpoint_state* e = r.endpoint.get();
    if (e == nullptr || e->peer.worker_id == 0 || kind >= e->peer_metrics.size()) {
      return meter_.record_cached(kind, r.published_ns, bytes, succeeded, no_peer, {});
    }
    if (e->metrics_peer.empty()) {
      try {
        e->metrics_peer = "worker-" + std::to_string(e->peer.worker_id);
      } catch (...) {
        // Out of memory: this operation counts only in the kind's figures.
      }
    }
    meter_.record_cached(kind, r.published_ns, bytes, succeeded, e->peer_metrics[kind],
                         e->metrics_peer);
  }

  void end_member(member& m) noexcept {
    request* r = m.owner;
    std::error_code ec = m.failure;
    if (!ec && peer_gone(*r)) ec = make_error_code(errc::peer_gone);
    ferry::detail::status_block* s = std::exchange(m.status, nullptr);
    if (s != nullptr && r->published_ns != 0) record(*r, m.length, !ec);
    if (s != nullptr) {
      s->complete(ec ? transfer_state::failed : transfer_state::success, ec);
      s->release_completer_ref();
    }
    if (--r->members_left == 0) destroy(r);
  }

  // A same-host peer that has exited, looked at once per request (one poll of its pidfd).
  static bool peer_gone(request& r) noexcept {
    if (!r.endpoint || r.endpoint->peer_pidfd < 0) return false;
    if (!r.peer_checked) {
      r.peer_checked = true;
      r.peer_exited = process_exited(r.endpoint->peer_pidfd);
      if (r.peer_exited) r.endpoint->fail(make_error_code(errc::peer_gone));
    }
    return r.peer_exited;
  }

  void finish_all(request* r, std::error_code ec) noexcept {
    if (r->members.empty()) return destroy(r);  // a close from an endpoint's last handle
    for (member& m : r->members) {
      if (m.status == nullptr) continue;
      m.failure = ec;
      m.outstanding = 1;
      end_member(m);
    }
  }

  void destroy(request* r) noexcept {
    if (r->has_deadline) (void)exec_.timers().cancel(r->timer);
    delete r;
  }

  static void on_deadline(ferry::detail::timer_node* t) noexcept {
    request* r = static_cast<request_timer*>(t)->owner;
    engine& self = *r->eng;
    r->deadline_passed = true;
    r->has_deadline = false;  // the timer has left the heap
    switch (r->kind) {
      case request_kind::wait_notification:
        // Nothing of UCX's is out for a wait: take it off the endpoint's list.
        if (r->endpoint) {
          auto& w = r->endpoint->notification_waiters;
          w.erase(std::remove(w.begin(), w.end(), r), w.end());
        }
        return self.finish_all(r, make_error_code(errc::deadline_exceeded));
      case request_kind::accept:
        if (r->listener) {
          auto& w = r->listener->accept_waiters;
          w.erase(std::remove(w.begin(), w.end(), r), w.end());
        }
        return self.finish_all(r, make_error_code(errc::deadline_exceeded));
      default:
        break;
    }
    // The request is out in UCX: force-closing its endpoint makes UCX call back every request on
    // it, this one included. Not here: that would free requests whose timers fired in the same
    // round and are still to be called (timer_service::fire_expired), and a close is not made
    // from inside a callback. The executor's next poll() closes it, before it progresses UCX, so
    // nothing ends `r` before then.
    if (r->endpoint && !r->endpoint->close_due) {
      r->endpoint->close_due = true;
      ++self.closes_due_;
    }
  }

  // Work put off to the top or the end of poll(), outside UCX's callbacks and timer rounds:
  // endpoints whose requests' deadlines passed are force-closed, and closes whose flushes ended
  // go on. Returns how much it did.
  std::size_t run_deferred() noexcept {
    std::size_t n = 0;
    while (closes_due_ != 0 || closes_flushed_ != nullptr) {
      if (closes_due_ != 0) {
        closes_due_ = 0;
        // close_endpoint takes each off endpoints_.
        for (std::size_t i = 0; i < endpoints_.size();) {
          if (!endpoints_[i]->close_due) {
            ++i;
            continue;
          }
          const std::shared_ptr<endpoint_state> e = endpoints_[i];
          close_endpoint(*e, make_error_code(errc::endpoint_closed));
          ++n;
        }
      }
      while (request* r = closes_flushed_) {
        closes_flushed_ = r->next;
        r->next = nullptr;
        close_go_on(r);
        ++n;
      }
    }
    return n;
  }

  // ---- closing an endpoint
  // A close (endpoint::close(), or its last handle going) refuses new requests at once, then
  // flushes the endpoint: the requests already out end as they would have, and the peer has read
  // everything sent on it before the connection goes. Over tcp UCX emulates a put: the peer copies
  // it and sends an acknowledgement back, and UCX 1.13 aborts the peer's process when that
  // acknowledgement finds the connection gone (puts that ended source_reusable may not even have
  // been read yet). The flush is bounded by close_timeout; then, or once the flush has ended, the
  // endpoint is force-closed.
  void start_close(request* r) noexcept {
    const std::shared_ptr<endpoint_state>& e = r->endpoint;
    if (!e || e->ep == nullptr) {
      if (e) close_endpoint(*e, make_error_code(errc::endpoint_closed));
      return finish_all(r, {});
    }
    if (e->closing) {
      // Already flushing for an earlier close: this one ends with it.
      try {
        e->close_waiters.push_back(r);
        return;
      } catch (...) {
        // No memory to wait: close now.
        close_endpoint(*e, make_error_code(errc::endpoint_closed));
        return finish_all(r, {});
      }
    }
    // close_timeout 0: the user asked for force-closes. Without peer error handling UCX refuses
    // to force-close an endpoint and close_endpoint has UCX flush and close it on its own, which
    // no deadline here could bound: hand it over at once.
    if (close_timeout_.count() <= 0 || !peer_errors_) {
      close_endpoint(*e, make_error_code(errc::endpoint_closed));
      return finish_all(r, {});
    }
    e->fail(make_error_code(errc::endpoint_closed));
    e->closing = true;
    closing_.fetch_add(1, std::memory_order_relaxed);
    r->has_deadline = true;
    r->deadline = ferry::detail::clock::now() + close_timeout_;
    arm_deadline(r);  // past it, on_deadline force-closes the endpoint, which ends the flush
    r->sends_at_flush = e->sends;
    start_flush(r);
  }

  // The flush of a close ended (done, failed, or cancelled by a force close), often inside a UCX
  // callback, where UCX must not be asked to close the endpoint: run_deferred() goes on with it.
  void close_flushed(request* r) noexcept {
    r->next = closes_flushed_;
    closes_flushed_ = r;
  }

  // A close's flush ended. Requests made before the close may still be out: a notification's
  // active message goes out only after its own flush, so the close's flush may end first. While
  // any is out, and the close's deadline has not passed, it flushes again; then it force-closes
  // what is left (nothing, unless the deadline passed) and ends.
  void close_go_on(request* r) noexcept {
    endpoint_state& e = *r->endpoint;
    // A send made since the flush was posted (a notification's message, sent once its own flush
    // ended, done locally at once) may still be in UCX's buffers: it needs a flush of its own.
    if (e.ep != nullptr && (e.in_flight != 0 || e.sends != r->sends_at_flush) &&
        !r->deadline_passed && r->value < 64) {
      ++r->value;  // flushes so far: a bound, should UCX end a flush with requests still out
      r->sends_at_flush = e.sends;
      return start_flush(r);
    }
    close_endpoint(e, make_error_code(errc::endpoint_closed));
    closing_.fetch_sub(1, std::memory_order_relaxed);
    finish_all(r, {});
  }

  // ---- notifications
  void start_notify(request* r) noexcept {
    if (const std::error_code ec = check_endpoint(r)) return refuse(r, ec);
    arm_deadline(r);
    r->members[0].outstanding = 1;
    start_flush(r);
  }

  void notify_flushed(request* r, ucs_status_t s) noexcept {
    member& m = r->members[0];
    endpoint_state& e = *r->endpoint;
    if (s != UCS_OK || e.ep == nullptr) {
      return member_step(m, s != UCS_OK ? s : UCS_ERR_CANCELED);
    }
    // UCX may read the header after the call returns: it lives in the request.
    am_header h;
    h.kind = am_kind::notification;
    h.sender = self_;
    h.value = r->value;
    static_assert(sizeof(am_header) <= sizeof(r->header));
    std::memcpy(r->header, &h, sizeof h);
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.send = &on_member_done;
    p.user_data = &m;
    const ucs_status_ptr_t sp =
        ::ucp_am_send_nbx(e.ep, am_id, r->header, sizeof(am_header), nullptr, 0, &p);
    track(e, sp, m);
  }

  void start_wait(request* r) noexcept {
    endpoint_state* e = r->endpoint.get();
    if (e == nullptr) return refuse(r, make_error_code(errc::endpoint_closed));
    if (!e->notifications.empty()) {
      *r->value_out = e->notifications.front();
      e->notifications.pop_front();
      return finish_all(r, {});
    }
    if (const std::error_code ec = check_endpoint(r)) return refuse(r, ec);
    try {
      e->notification_waiters.push_back(r);
    } catch (...) {
      return refuse(r, make_error_code(std::errc::not_enough_memory));
    }
    arm_deadline(r);
    arm_liveness();
  }

  // ---- liveness of peers that notification waits wait on
 public:
  // Endpoints whose close is still flushing (any thread), and how long a close may flush.
  [[nodiscard]] std::size_t closing() const noexcept {
    return closing_.load(std::memory_order_relaxed);
  }
  [[nodiscard]] std::chrono::milliseconds close_timeout() const noexcept { return close_timeout_; }

  // On the executor thread, before the engine goes: the timer may then neither fire nor be armed.
  void stop_liveness() noexcept {
    liveness_interval_ = std::chrono::milliseconds(0);
    if (liveness_armed_) (void)exec_.timers().cancel(liveness_timer_);
    liveness_armed_ = false;
    liveness_timer_.fired = false;
  }

 private:
  void arm_liveness() noexcept {
    if (liveness_armed_ || liveness_interval_.count() <= 0) return;
    liveness_timer_.deadline = ferry::detail::clock::now() + liveness_interval_;
    // Fired on the executor's thread, which then polls: poll() does the check.
    liveness_timer_.fire = [](ferry::detail::timer_node* t) noexcept {
      static_cast<flag_timer*>(t)->fired = true;
    };
    try {
      exec_.timers().arm(liveness_timer_);
      liveness_armed_ = true;
    } catch (...) {
      // No memory for the timer heap: the waits end by their deadlines, as without the check.
    }
  }

  // Every endpoint a notification wait is pending on with nothing else out: a same-host peer whose
  // pid has exited, or a peer that left a ping unanswered for the liveness timeout, has its
  // endpoint closed (which fails the waits); otherwise it is pinged.
  void check_liveness() noexcept {
    const auto now = ferry::detail::clock::now();
    bool waiting = false;
    std::vector<std::shared_ptr<endpoint_state>> endpoints;
    try {
      endpoints = endpoints_;
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
        close_endpoint(*e, make_error_code(errc::peer_gone));
        continue;
      }
      if (e->ping_out && now - e->ping_sent >= liveness_timeout_) {
        close_endpoint(*e, make_error_code(errc::peer_unresponsive));
        continue;
      }
      if (!e->ping_out) {
        e->ping_out = true;
        e->ping_sent = now;  // the first ping not yet answered
      }
      // Again every interval until answered: a peer drops a ping from a worker it has no endpoint
      // to yet (it answers once it has connected back).
      send_control(*e, ping_header_);
      waiting = true;
    }
    if (waiting) arm_liveness();
  }

  // A ping or pong: nothing waits for it to end, and its header is the engine's own.
  void send_control(endpoint_state& e, const std::array<unsigned char, sizeof(am_header)>& header) {
    if (e.ep == nullptr) return;
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK;
    p.cb.send = [](void* ucx_request, ucs_status_t, void*) noexcept {
      ::ucp_request_free(ucx_request);
    };
    const ucs_status_ptr_t sp =
        ::ucp_am_send_nbx(e.ep, am_id, header.data(), header.size(), nullptr, 0, &p);
    // Failed at once: the endpoint's error handler reports it, or the unanswered ping does.
    (void)sp;
  }

  void deliver_notification(endpoint_state& e, std::uint64_t value) noexcept {
    if (e.notification_waiters.empty()) {
      try {
        e.notifications.push_back(value);
      } catch (...) {
        // Out of memory for the queue: the notification is lost, and says so on the endpoint.
        e.fail(make_error_code(std::errc::not_enough_memory));
      }
      return;
    }
    request* r = e.notification_waiters.front();
    e.notification_waiters.pop_front();
    *r->value_out = value;
    finish_all(r, {});
  }

  static ucs_status_t on_active_message(void* arg, const void* header, std::size_t header_bytes,
                                        void* data, std::size_t data_bytes,
                                        const ucp_am_recv_param_t* param) noexcept {
    auto& self = *static_cast<engine*>(arg);
    if (header_bytes != sizeof(am_header)) return UCS_OK;  // not ours: dropped
    am_header h;
    std::memcpy(&h, header, sizeof h);
    if (h.magic != am_magic) return UCS_OK;
    if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0) return UCS_OK;  // never sent so
    const std::span<const std::byte> payload(static_cast<const std::byte*>(data), data_bytes);
    if (h.kind == am_kind::notification) {
      auto it = self.by_worker_.find(h.sender.worker_id);
      if (it != self.by_worker_.end()) {
        self.deliver_notification(*it->second, h.value);
      } else {
        // The peer reached us before we made an endpoint to it: kept until we do.
        try {
          self.early_notifications_[h.sender.worker_id].push_back(h.value);
        } catch (...) {
        }
      }
      return UCS_OK;
    }
    if (h.kind == am_kind::ping || h.kind == am_kind::pong) {
      auto it = self.by_worker_.find(h.sender.worker_id);
      if (it == self.by_worker_.end()) return UCS_OK;
      if (h.kind == am_kind::ping) {
        self.send_control(*it->second, self.pong_header_);
      } else {
        it->second->ping_out = false;
      }
      return UCS_OK;
    }
    if (h.kind == am_kind::hello) {
      ucp_ep_h from = (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) != 0 ? param->reply_ep
                                                                                : nullptr;
      self.hello_arrived(from, h.sender, payload);
    }
    return UCS_OK;
  }

  // ---- endpoints
  ucp_ep_params_t endpoint_params(endpoint_state& e) const noexcept {
    ucp_ep_params_t p{};
    p.field_mask = UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    p.err_mode = peer_errors_ ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
    if (peer_errors_) {
      p.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
      p.err_handler.cb = &on_endpoint_error;
      p.err_handler.arg = &e;
    }
    return p;
  }

  static void on_endpoint_error(void* arg, ucp_ep_h, ucs_status_t s) noexcept {
    auto& e = *static_cast<endpoint_state*>(arg);
    e.eng->endpoint_failed(e, status_error(s));
  }

  // UCX has failed the endpoint; the requests out on it are called back with errors as UCX gets to
  // them. Close it (force: there is no peer to flush to), which calls back the rest now.
  void endpoint_failed(endpoint_state& e, std::error_code ec) noexcept {
    close_endpoint(e, ec);
  }

  void register_endpoint(const std::shared_ptr<endpoint_state>& e) {
    endpoints_.push_back(e);
    if (e->peer.worker_id != 0) by_worker_[e->peer.worker_id] = e.get();
    auto early = early_notifications_.find(e->peer.worker_id);
    if (early != early_notifications_.end()) {
      for (std::uint64_t v : early->second) e->notifications.push_back(v);
      early_notifications_.erase(early);
    }
    if (e->peer.host_id == self_.host_id && e->peer.pid != 0 && e->peer_pidfd < 0) {
      e->peer_pidfd = open_pidfd(e->peer.pid);
    }
  }

 public:
  // Creates an endpoint to a peer whose worker address (our descriptor) the user carried over.
  // On the executor thread (a call request).
  std::error_code make_endpoint(const std::shared_ptr<endpoint_state>& e,
                                std::span<const std::byte> ucx_address) {
    e->eng = this;
    ucp_ep_params_t p = endpoint_params(*e);
    p.field_mask |= UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
    p.address = reinterpret_cast<const ucp_address_t*>(ucx_address.data());
    if (const ucs_status_t s = ::ucp_ep_create(worker_, &p, &e->ep); s != UCS_OK) {
      return status_error(s);
    }
    e->handshaken = true;
    register_endpoint(e);
    return {};
  }

  // Imports a peer's region on an endpoint; its key is unpacked at first use. Executor thread.
  std::error_code import_region(endpoint_state& e, const remote_region& r, std::uint32_t& index) {
    index = static_cast<std::uint32_t>(e.regions.size());
    e.regions.push_back({r.address, r.length, r.packed_key, nullptr});
    return {};
  }

  std::error_code make_listener(const std::shared_ptr<listener_state>& l, const std::string& host,
                                std::uint16_t port) {
    l->eng = this;
    sockaddr_storage addr{};
    socklen_t len = 0;
    if (!resolve(host, port, addr, len)) return make_error_code(std::errc::invalid_argument);
    ucp_listener_params_t p{};
    p.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
    p.sockaddr.addr = reinterpret_cast<const sockaddr*>(&addr);
    p.sockaddr.addrlen = len;
    p.conn_handler.cb = &on_connection_request;
    p.conn_handler.arg = l.get();
    if (const ucs_status_t s = ::ucp_listener_create(worker_, &p, &l->listener); s != UCS_OK) {
      return status_error(s);
    }
    ucp_listener_attr_t attr{};
    attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
    if (const ucs_status_t s = ::ucp_listener_query(l->listener, &attr); s != UCS_OK) {
      ::ucp_listener_destroy(l->listener);
      l->listener = nullptr;
      return status_error(s);
    }
    const auto* sa = reinterpret_cast<const sockaddr*>(&attr.sockaddr);
    l->port = sa->sa_family == AF_INET6
                  ? ntohs(reinterpret_cast<const sockaddr_in6*>(sa)->sin6_port)
                  : ntohs(reinterpret_cast<const sockaddr_in*>(sa)->sin_port);
    listeners_.push_back(l);
    return {};
  }

  void close_listener(listener_state& l) noexcept {
    if (l.listener != nullptr) {
      ::ucp_listener_destroy(l.listener);
      l.listener = nullptr;
    }
    while (!l.accept_waiters.empty()) {
      request* r = l.accept_waiters.front();
      l.accept_waiters.pop_front();
      finish_all(r, make_error_code(errc::endpoint_closed));
    }
    for (const auto& e : std::vector<std::shared_ptr<endpoint_state>>(l.handshaking)) {
      close_endpoint(*e, make_error_code(errc::endpoint_closed));
    }
    l.handshaking.clear();
    l.ready.clear();
    listeners_.erase(std::remove_if(listeners_.begin(), listeners_.end(),
                                    [&](const auto& p) { return p.get() == &l; }),
                     listeners_.end());
  }

  // Force-closes `e`: every request UCX holds on it is called back now (cancelled), every wait
  // fails. Idempotent.
  void close_endpoint(endpoint_state& e, std::error_code why) noexcept {
    e.fail(why);
    e.closing = false;  // closing_ counts the close request until it ends (close_go_on)
    if (e.ep != nullptr) {
      // Without peer error handling UCX refuses a force-close: the endpoint is closed after a
      // flush instead, and its requests end when UCX ends them (a deadline cannot cut them short).
      // Their keys stay until then: kept (a small leak) while any is out.
      if (peer_errors_ || e.in_flight == 0) {
        for (imported_region& ir : e.regions) {
          if (ir.rkey != nullptr) ::ucp_rkey_destroy(ir.rkey);
          ir.rkey = nullptr;
        }
      }
      ucp_ep_h ep = std::exchange(e.ep, nullptr);
      ucp_request_param_t p{};
      p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      p.flags = peer_errors_ ? UCP_EP_CLOSE_FLAG_FORCE : 0;
      const ucs_status_ptr_t sp = ::ucp_ep_close_nbx(ep, &p);
      if (sp != nullptr && !UCS_PTR_IS_ERR(sp)) {
        if (peer_errors_) {
          // Not seen with FORCE in UCX 1.13; progress until it ends rather than leak it.
          while (::ucp_request_check_status(sp) == UCS_INPROGRESS) ::ucp_worker_progress(worker_);
        }
        ::ucp_request_free(sp);  // a flushing close: UCX releases it when it ends
      }
    }
    while (!e.notification_waiters.empty()) {
      request* r = e.notification_waiters.front();
      e.notification_waiters.pop_front();
      finish_all(r, why);
    }
    for (request* r : std::exchange(e.close_waiters, {})) finish_all(r, {});
    if (request* r = std::exchange(e.connect_waiter, nullptr)) {
      finish_all(r, r->deadline_passed ? make_error_code(errc::deadline_exceeded) : why);
    }
    if (e.peer_pidfd >= 0) {
      ::close(e.peer_pidfd);
      e.peer_pidfd = -1;
    }
    if (e.peer.worker_id != 0) {
      auto it = by_worker_.find(e.peer.worker_id);
      if (it != by_worker_.end() && it->second == &e) by_worker_.erase(it);
    }
    if (e.accepted_by) {
      auto& h = e.accepted_by->handshaking;
      h.erase(std::remove_if(h.begin(), h.end(), [&](const auto& p) { return p.get() == &e; }),
              h.end());
    }
    endpoints_.erase(std::remove_if(endpoints_.begin(), endpoints_.end(),
                                    [&](const auto& p) { return p.get() == &e; }),
                     endpoints_.end());
  }

 private:
  static bool resolve(const std::string& host, std::uint16_t port, sockaddr_storage& out,
                      socklen_t& len) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV | (host.empty() ? AI_PASSIVE : 0);
    addrinfo* res = nullptr;
    const std::string service = std::to_string(port);
    if (::getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &res) != 0 ||
        res == nullptr) {
      return false;
    }
    std::memcpy(&out, res->ai_addr, res->ai_addrlen);
    len = static_cast<socklen_t>(res->ai_addrlen);
    ::freeaddrinfo(res);
    return true;
  }

  // ---- connecting by host and port
  void start_connect(request* r) noexcept {
    auto e = r->endpoint;
    e->eng = this;
    sockaddr_storage addr{};
    socklen_t len = 0;
    if (!resolve(r->host, r->port, addr, len)) {
      return refuse(r, make_error_code(std::errc::invalid_argument));
    }
    ucp_ep_params_t p = endpoint_params(*e);
    p.field_mask |= UCP_EP_PARAM_FIELD_SOCK_ADDR | UCP_EP_PARAM_FIELD_FLAGS;
    p.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    p.sockaddr.addr = reinterpret_cast<const sockaddr*>(&addr);
    p.sockaddr.addrlen = len;
    if (const ucs_status_t s = ::ucp_ep_create(worker_, &p, &e->ep); s != UCS_OK) {
      return refuse(r, status_error(s));
    }
    try {
      endpoints_.push_back(e);
    } catch (...) {
      close_endpoint(*e, make_error_code(std::errc::not_enough_memory));
      return refuse(r, make_error_code(std::errc::not_enough_memory));
    }
    e->connect_waiter = r;
    arm_deadline(r);
    send_hello(*e, r->hello);
  }

  void send_hello(endpoint_state& e, const std::vector<std::byte>& regions) noexcept {
    auto* h = new (std::nothrow) hello_message;
    if (h == nullptr) return close_endpoint(e, make_error_code(std::errc::not_enough_memory));
    h->header.kind = am_kind::hello;
    h->header.sender = self_;
    h->payload = regions;
    h->eng = this;
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                     UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_AM_SEND_FLAG_REPLY;
    p.cb.send = &on_hello_sent;
    p.user_data = h;
    const ucs_status_ptr_t sp = ::ucp_am_send_nbx(e.ep, am_id, &h->header, sizeof h->header,
                                                  h->payload.data(), h->payload.size(), &p);
    if (sp == nullptr) {
      delete h;
    } else if (UCS_PTR_IS_ERR(sp)) {
      delete h;
      close_endpoint(e, status_error(UCS_PTR_STATUS(sp)));
    }
  }

  struct hello_message {
    am_header header;
    std::vector<std::byte> payload;
    engine* eng = nullptr;
  };

  static void on_hello_sent(void* ucx_request, ucs_status_t, void* user) noexcept {
    // A failed hello shows as the endpoint's error, or as the connect's deadline.
    ::ucp_request_free(ucx_request);
    delete static_cast<hello_message*>(user);
  }

  void hello_arrived(ucp_ep_h from, const peer_identity& peer,
                     std::span<const std::byte> payload) noexcept {
    std::shared_ptr<endpoint_state> e;
    for (const auto& c : endpoints_) {
      if (c->ep == from && from != nullptr) e = c;
    }
    if (!e || e->handshaken) return;
    e->peer = peer;
    try {
      e->peer_regions = decode_regions(payload);
      for (const remote_region& r : e->peer_regions) {
        e->regions.push_back({r.address, r.length, r.packed_key, nullptr});
      }
      register_endpoint(e);
    } catch (...) {
      return close_endpoint(*e, make_error_code(errc::handshake_failed));
    }
    e->handshaken = true;
    if (e->connect_waiter != nullptr) {
      request* r = std::exchange(e->connect_waiter, nullptr);
      if (r->endpoint_out != nullptr) *r->endpoint_out = e;
      return finish_all(r, {});
    }
    if (std::shared_ptr<listener_state> l = e->accepted_by) {
      auto& h = l->handshaking;
      h.erase(std::remove(h.begin(), h.end(), e), h.end());
      send_hello(*e, l->hello);
      if (e->ep == nullptr) return;
      if (!l->accept_waiters.empty()) {
        request* r = l->accept_waiters.front();
        l->accept_waiters.pop_front();
        *r->endpoint_out = e;
        return finish_all(r, {});
      }
      try {
        l->ready.push_back(e);
      } catch (...) {
        close_endpoint(*e, make_error_code(std::errc::not_enough_memory));
      }
    }
  }

  static void on_connection_request(ucp_conn_request_h cr, void* arg) noexcept {
    auto* l = static_cast<listener_state*>(arg);
    l->eng->accept_connection(*l, cr);
  }

  void accept_connection(listener_state& l, ucp_conn_request_h cr) noexcept {
    std::shared_ptr<listener_state> owner;
    for (const auto& p : listeners_) {
      if (p.get() == &l) owner = p;
    }
    if (!owner) {
      (void)::ucp_listener_reject(l.listener, cr);
      return;
    }
    std::shared_ptr<endpoint_state> e;
    try {
      e = std::make_shared<endpoint_state>();
      e->eng = this;
      e->accepted_by = owner;
      ucp_ep_params_t p = endpoint_params(*e);
      p.field_mask |= UCP_EP_PARAM_FIELD_CONN_REQUEST;
      p.conn_request = cr;
      if (::ucp_ep_create(worker_, &p, &e->ep) != UCS_OK) return;
      endpoints_.push_back(e);
      owner->handshaking.push_back(e);
    } catch (...) {
      if (e && e->ep != nullptr) close_endpoint(*e, make_error_code(std::errc::not_enough_memory));
    }
  }

  void start_accept(request* r) noexcept {
    listener_state& l = *r->listener;
    if (!l.ready.empty()) {
      *r->endpoint_out = l.ready.front();
      l.ready.pop_front();
      return finish_all(r, {});
    }
    if (l.listener == nullptr) return refuse(r, make_error_code(errc::endpoint_closed));
    arm_deadline(r);
    try {
      l.accept_waiters.push_back(r);
    } catch (...) {
      refuse(r, make_error_code(std::errc::not_enough_memory));
    }
  }

  progress_executor& exec_;
  std::shared_ptr<context_holder> context_;
  ucp_worker_h worker_ = nullptr;
  int efd_ = -1;
  bool peer_errors_ = true;
  ferry::metrics::backend_meter meter_;  // executor only, once constructed
  peer_identity self_;
  std::vector<std::byte> ucx_address_;
  ferry::detail::submission_stack<request> incoming_;
  std::size_t in_flight_ = 0;
  std::vector<std::shared_ptr<endpoint_state>> endpoints_;
  std::vector<std::shared_ptr<listener_state>> listeners_;
  std::unordered_map<std::uint64_t, endpoint_state*> by_worker_;
  std::unordered_map<std::uint64_t, std::vector<std::uint64_t>> early_notifications_;
  std::chrono::milliseconds liveness_interval_{};
  std::chrono::milliseconds liveness_timeout_{};
  std::chrono::milliseconds close_timeout_{};
  // Close requests flushing their endpoints: written on the executor, read by ~worker.
  std::atomic<std::size_t> closing_{0};
  std::size_t closes_due_ = 0;         // endpoints marked close_due by a request's deadline
  request* closes_flushed_ = nullptr;  // closes whose flush ended, linked through next
  struct flag_timer : ferry::detail::timer_node {
    bool fired = false;  // executor thread only
  };
  flag_timer liveness_timer_;
  bool liveness_armed_ = false;
  std::array<unsigned char, sizeof(am_header)> ping_header_{};
  std::array<unsigned char, sizeof(am_header)> pong_header_{};
};

}  // namespace ferry::ucx::detail

#pragma once
// Making endpoints: from a peer's worker address, or by host and port through a listener, with
// hellos that tell each side the regions the other exposes; and importing a peer's regions. A part
// of engine (engine.hpp). Executor thread only.
//
// Everything a peer sent is checked before UCX sees it: a worker address against this UCX's
// address format (wire.hpp), a region's packed key for UCX's key structure, and a same-host peer's
// pid before its key is unpacked (UCX 1.13 crashes unpacking a dead shared-memory peer's key).
// Keys are unpacked when a region is imported, while the peer is known to be there, not at first
// use.

#include <ucp/api/ucp.h>

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <span>
#include <string>
#include <system_error>
#include <vector>

#include "ferry/ucx/detail/endpoint_state.hpp"
#include "ferry/ucx/detail/request.hpp"
#include "ferry/ucx/detail/wire.hpp"
#include "ferry/ucx/errors.hpp"
#include "ferry/ucx/remote.hpp"

namespace ferry::ucx::detail {

// The hello a side sends when connecting by host and port: the regions it exposes.
inline std::vector<std::byte> encode_regions(const std::vector<remote_region>& regions) {
  record_writer w(region_magic);
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
  if (n > 4096) {
    throw std::system_error(make_error_code(errc::bad_descriptor),
                            "ferry::ucx: a hello lists " + std::to_string(n) +
                                " regions (at most 4096)");
  }
  std::vector<remote_region> out;
  for (std::uint32_t i = 0; i < n; ++i) {
    const auto len = r.get<std::uint32_t>();
    const std::vector<std::byte> b = r.get_bytes(len);
    out.push_back(remote_region::from_bytes(b));
  }
  r.done();
  return out;
}

template <class E>
struct connection {
  [[nodiscard]] E& self() noexcept { return static_cast<E&>(*this); }

  ucp_ep_params_t endpoint_params(endpoint_state& e) noexcept {
    ucp_ep_params_t p{};
    p.field_mask = UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    p.err_mode = self().peer_errors_ ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
    if (self().peer_errors_) {
      p.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
      p.err_handler.cb = &E::on_endpoint_error;
      p.err_handler.arg = &e;
    }
    return p;
  }

  // `e` now knows its peer: routed by its worker id, and watched by pid where that is possible.
  void register_endpoint(const std::shared_ptr<endpoint_state>& e) {
    E& s = self();
    if (e->peer.worker_id != 0) s.by_worker_[e->peer.worker_id] = e.get();
    auto early = s.early_notifications_.find(e->peer.worker_id);
    if (early != s.early_notifications_.end()) {
      for (std::uint64_t v : early->second.values) e->notifications.push_back(v);
      e->notifications_refused += early->second.refused;
      s.early_notifications_.erase(early);
    }
    if (same_pid_space(s.self_, e->peer) && e->peer_pidfd < 0) {
      e->peer_pidfd = open_pidfd(e->peer.pid);
    }
  }

  [[nodiscard]] std::shared_ptr<endpoint_state> find_endpoint(const endpoint_state& e) const {
    for (const auto& p : static_cast<const E&>(*this).endpoints_) {
      if (p.get() == &e) return p;
    }
    return {};
  }

  // `e` is closed: nothing routes to it any more.
  void forget_endpoint(endpoint_state& e) noexcept {
    E& s = self();
    if (e.peer.worker_id != 0) {
      auto it = s.by_worker_.find(e.peer.worker_id);
      if (it != s.by_worker_.end() && it->second == &e) s.by_worker_.erase(it);
    }
    if (e.accepted_by) {
      auto& h = e.accepted_by->handshaking;
      h.erase(std::remove_if(h.begin(), h.end(), [&](const auto& p) { return p.get() == &e; }),
              h.end());
    }
    auto& all = s.endpoints_;
    all.erase(std::remove_if(all.begin(), all.end(), [&](const auto& p) { return p.get() == &e; }),
              all.end());
  }

  // Creates an endpoint to a peer whose worker address (from our descriptor) the user carried over.
  // On the executor thread (a call request).
  std::error_code make_endpoint(const std::shared_ptr<endpoint_state>& e,
                                std::span<const std::byte> ucx_address) {
    E& s = self();
    e->eng = &s;
    if (const std::string why = worker_address_problem(ucx_address, s.ucx_address_); !why.empty()) {
      throw std::system_error(make_error_code(errc::bad_descriptor),
                              "ferry::ucx: the peer's UCX worker address " + why);
    }
    ucp_ep_params_t p = endpoint_params(*e);
    p.field_mask |= UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
    p.address = reinterpret_cast<const ucp_address_t*>(ucx_address.data());
    if (const ucs_status_t st = ::ucp_ep_create(s.worker_, &p, &e->ep); st != UCS_OK) {
      return status_error(st);
    }
    s.endpoints_.push_back(e);
    e->move_to(endpoint_phase::open);
    register_endpoint(e);
    return {};
  }

  // Imports a peer's region on an endpoint: checked, and its key unpacked now, while the peer is
  // known to be there. Executor thread.
  std::error_code import_region(endpoint_state& e, const remote_region& r, std::uint32_t& index) {
    if (!e.carries_requests() || e.ep == nullptr) {
      const std::error_code f = e.failure();
      return f ? f : make_error_code(errc::endpoint_closed);
    }
    r.check();
    if (process_exited(e.peer_pidfd)) {
      self().force_close(e, make_error_code(errc::peer_gone));
      return make_error_code(errc::peer_gone);
    }
    imported_region ir{r.address, r.length, nullptr};
    if (const ucs_status_t st = ::ucp_ep_rkey_unpack(e.ep, r.packed_key.data(), &ir.rkey);
        st != UCS_OK) {
      return status_error(st);
    }
    try {
      e.regions.push_back(ir);
    } catch (...) {
      ::ucp_rkey_destroy(ir.rkey);
      throw;
    }
    index = static_cast<std::uint32_t>(e.regions.size() - 1);
    return {};
  }

  // ---- listeners
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

  std::error_code make_listener(const std::shared_ptr<listener_state>& l, const std::string& host,
                                std::uint16_t port) {
    E& s = self();
    l->eng = &s;
    sockaddr_storage addr{};
    socklen_t len = 0;
    if (!resolve(host, port, addr, len)) return make_error_code(std::errc::invalid_argument);
    ucp_listener_params_t p{};
    p.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
    p.sockaddr.addr = reinterpret_cast<const sockaddr*>(&addr);
    p.sockaddr.addrlen = len;
    p.conn_handler.cb = &on_connection_request;
    p.conn_handler.arg = l.get();
    if (const ucs_status_t st = ::ucp_listener_create(s.worker_, &p, &l->listener); st != UCS_OK) {
      return status_error(st);
    }
    ucp_listener_attr_t attr{};
    attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
    if (const ucs_status_t st = ::ucp_listener_query(l->listener, &attr); st != UCS_OK) {
      ::ucp_listener_destroy(l->listener);
      l->listener = nullptr;
      return status_error(st);
    }
    const auto* sa = reinterpret_cast<const sockaddr*>(&attr.sockaddr);
    l->port = sa->sa_family == AF_INET6
                  ? ntohs(reinterpret_cast<const sockaddr_in6*>(sa)->sin6_port)
                  : ntohs(reinterpret_cast<const sockaddr_in*>(sa)->sin_port);
    s.listeners_.push_back(l);
    return {};
  }

  void close_listener(listener_state& l) noexcept {
    E& s = self();
    if (l.listener != nullptr) {
      ::ucp_listener_destroy(l.listener);
      l.listener = nullptr;
    }
    while (!l.accept_waiters.empty()) {
      request* r = l.accept_waiters.front();
      l.accept_waiters.pop_front();
      s.finish_all(r, make_error_code(errc::endpoint_closed));
    }
    for (const auto& e : std::vector<std::shared_ptr<endpoint_state>>(l.handshaking)) {
      s.force_close(*e, make_error_code(errc::endpoint_closed));
    }
    l.handshaking.clear();
    l.ready.clear();
    auto& all = s.listeners_;
    all.erase(std::remove_if(all.begin(), all.end(), [&](const auto& p) { return p.get() == &l; }),
              all.end());
  }

  // ---- connecting by host and port
  void start_connect(request* r) noexcept {
    E& s = self();
    auto e = r->endpoint;
    e->eng = &s;
    sockaddr_storage addr{};
    socklen_t len = 0;
    if (!resolve(r->host, r->port, addr, len)) {
      return s.finish_all(r, make_error_code(std::errc::invalid_argument));
    }
    ucp_ep_params_t p = endpoint_params(*e);
    p.field_mask |= UCP_EP_PARAM_FIELD_SOCK_ADDR | UCP_EP_PARAM_FIELD_FLAGS;
    p.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    p.sockaddr.addr = reinterpret_cast<const sockaddr*>(&addr);
    p.sockaddr.addrlen = len;
    if (const ucs_status_t st = ::ucp_ep_create(s.worker_, &p, &e->ep); st != UCS_OK) {
      return s.finish_all(r, status_error(st));
    }
    try {
      s.endpoints_.push_back(e);
    } catch (...) {
      s.force_close(*e, make_error_code(std::errc::not_enough_memory));
      return s.finish_all(r, make_error_code(std::errc::not_enough_memory));
    }
    e->connect_waiter = r;
    s.arm_deadline(r);
    send_hello(*e, r->hello);
  }

  struct hello_message {
    am_header header;
    std::vector<std::byte> payload;
  };

  void send_hello(endpoint_state& e, const std::vector<std::byte>& regions) noexcept {
    E& s = self();
    auto* h = new (std::nothrow) hello_message;
    if (h == nullptr) return s.force_close(e, make_error_code(std::errc::not_enough_memory));
    h->header.kind = am_kind::hello;
    h->header.sender = s.self_;
    try {
      h->payload = regions;
    } catch (...) {
      delete h;
      return s.force_close(e, make_error_code(std::errc::not_enough_memory));
    }
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                     UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_AM_SEND_FLAG_REPLY;
    p.cb.send = [](void* ucx_request, ucs_status_t, void* user) noexcept {
      // A failed hello shows as the endpoint's error, or as the connect's deadline.
      ::ucp_request_free(ucx_request);
      delete static_cast<hello_message*>(user);
    };
    p.user_data = h;
    const ucs_status_ptr_t sp = ::ucp_am_send_nbx(e.ep, am_id, &h->header, sizeof h->header,
                                                  h->payload.data(), h->payload.size(), &p);
    if (sp == nullptr) {
      delete h;
    } else if (UCS_PTR_IS_ERR(sp)) {
      delete h;
      s.force_close(e, status_error(UCS_PTR_STATUS(sp)));
    }
  }

  void hello_arrived(ucp_ep_h from, const peer_identity& peer,
                     std::span<const std::byte> payload) noexcept {
    E& s = self();
    std::shared_ptr<endpoint_state> e;
    for (const auto& c : s.endpoints_) {
      if (c->ep == from && from != nullptr) e = c;
    }
    if (!e || e->phase() != endpoint_phase::connecting) return;
    e->peer = peer;
    try {
      e->peer_regions = decode_regions(payload);
      register_endpoint(e);
      for (const remote_region& r : e->peer_regions) {
        imported_region ir{r.address, r.length, nullptr};
        if (::ucp_ep_rkey_unpack(e->ep, r.packed_key.data(), &ir.rkey) != UCS_OK) {
          return s.force_close(*e, make_error_code(errc::handshake_failed));
        }
        e->regions.push_back(ir);
      }
    } catch (...) {
      return s.force_close(*e, make_error_code(errc::handshake_failed));
    }
    e->move_to(endpoint_phase::open);
    if (e->connect_waiter != nullptr) {
      request* r = std::exchange(e->connect_waiter, nullptr);
      if (r->endpoint_out != nullptr) *r->endpoint_out = e;
      return s.finish_all(r, {});
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
        return s.finish_all(r, {});
      }
      try {
        l->ready.push_back(e);
      } catch (...) {
        s.force_close(*e, make_error_code(std::errc::not_enough_memory));
      }
    }
  }

  static void on_connection_request(ucp_conn_request_h cr, void* arg) noexcept {
    auto* l = static_cast<listener_state*>(arg);
    static_cast<E*>(l->eng)->accept_connection(*l, cr);
  }

  void accept_connection(listener_state& l, ucp_conn_request_h cr) noexcept {
    E& s = self();
    std::shared_ptr<listener_state> owner;
    for (const auto& p : s.listeners_) {
      if (p.get() == &l) owner = p;
    }
    if (!owner) {
      (void)::ucp_listener_reject(l.listener, cr);
      return;
    }
    std::shared_ptr<endpoint_state> e;
    try {
      e = std::make_shared<endpoint_state>();
      e->eng = &s;
      e->accepted_by = owner;
      ucp_ep_params_t p = endpoint_params(*e);
      p.field_mask |= UCP_EP_PARAM_FIELD_CONN_REQUEST;
      p.conn_request = cr;
      if (::ucp_ep_create(s.worker_, &p, &e->ep) != UCS_OK) return;
      s.endpoints_.push_back(e);
      owner->handshaking.push_back(e);
    } catch (...) {
      if (e && e->ep != nullptr) s.force_close(*e, make_error_code(std::errc::not_enough_memory));
    }
  }

  void start_accept(request* r) noexcept {
    E& s = self();
    listener_state& l = *r->listener;
    if (!l.ready.empty()) {
      *r->endpoint_out = l.ready.front();
      l.ready.pop_front();
      return s.finish_all(r, {});
    }
    if (l.listener == nullptr) return s.finish_all(r, make_error_code(errc::endpoint_closed));
    s.arm_deadline(r);
    try {
      l.accept_waiters.push_back(r);
    } catch (...) {
      s.finish_all(r, make_error_code(std::errc::not_enough_memory));
    }
  }
};

}  // namespace ferry::ucx::detail

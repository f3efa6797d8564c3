#pragma once
// Making endpoints: from a peer's worker address, or by host and port through ferry's own small
// handshake; and importing a peer's regions. A part of engine (engine.hpp). Executor thread only.
//
// By host and port. UCX's sockaddr connection manager aborts its process when a stranger sends its
// port a few wrong bytes (a UCX 1.13 assertion), so ferry does not use it. A listener is ferry's
// own TCP socket; each side of a new connection sends one hello (its identity, its UCX worker
// address and the regions it exposes), reads the other's, checks every byte of it, and creates its
// UCX endpoint from the peer's address; then the socket is closed. A hello is bounded (1 MiB, 4096
// regions), has a deadline (the connect's timeout; handshake_timeout on the listening side), and a
// listener handles at most max_pending_handshakes at once (more are closed at once). Sockets are
// non-blocking and the executor parks on them beside UCX's own descriptor (engine::park_fd).
//
// Everything a peer sent is checked before UCX sees it: a worker address against this UCX's
// address format (wire.hpp), a region's packed key for UCX's key structure, and a same-host peer's
// pid before its key is unpacked (UCX 1.13 crashes unpacking a dead shared-memory peer's key).
// Keys are unpacked when a region is imported, while the peer is known to be there, not at first
// use.

#include <ucp/api/ucp.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <span>
#include <string>
#include <system_error>
#include <vector>

#include "ferry/detail/socket.hpp"
#include "ferry/detail/timer_service.hpp"
#include "ferry/ucx/detail/endpoint_state.hpp"
#include "ferry/ucx/detail/request.hpp"
#include "ferry/ucx/detail/wire.hpp"
#include "ferry/ucx/errors.hpp"
#include "ferry/ucx/remote.hpp"

namespace ferry::ucx::detail {

inline constexpr std::uint32_t hello_magic = 0x4c485846;  // "FXHL"
inline constexpr std::size_t max_hello_bytes = std::size_t{1} << 20;
inline constexpr std::uint32_t max_hello_regions = 4096;
inline constexpr std::size_t max_pending_handshakes = 64;  // per listener

// What one side of a connection by host and port tells the other.
struct hello {
  peer_identity who;
  std::vector<std::byte> ucx_address;
  std::vector<remote_region> regions;
};

// A hello as it goes on the wire: its length (host order, 4 bytes), then the framed record.
inline std::vector<std::byte> encode_hello(const peer_identity& who,
                                           std::span<const std::byte> ucx_address,
                                           std::span<const remote_region> regions) {
  record_writer w(hello_magic);
  w.put(who);
  w.put(static_cast<std::uint32_t>(ucx_address.size()));
  w.put_bytes(ucx_address);
  w.put(static_cast<std::uint32_t>(regions.size()));
  for (const remote_region& r : regions) {
    const std::vector<std::byte> b = r.to_bytes();
    w.put(static_cast<std::uint32_t>(b.size()));
    w.put_bytes(b);
  }
  const std::vector<std::byte> body = w.finish();
  const auto n = static_cast<std::uint32_t>(body.size());
  std::vector<std::byte> out(sizeof n + body.size());
  std::memcpy(out.data(), &n, sizeof n);
  std::memcpy(out.data() + sizeof n, body.data(), body.size());
  return out;
}

// Throws std::system_error (errc::bad_descriptor) naming what is wrong with a peer's hello.
inline hello decode_hello(std::span<const std::byte> bytes, std::span<const std::byte> own_address) {
  record_reader r(bytes, hello_magic, "hello from a peer connecting by host and port");
  const auto refuse = [](const std::string& why) {
    throw std::system_error(make_error_code(errc::bad_descriptor),
                            "ferry::ucx: a peer's hello " + why);
  };
  hello h;
  h.who = r.get<peer_identity>();
  if (h.who.worker_id == 0) refuse("names no worker");
  const auto address_bytes = r.get<std::uint32_t>();
  h.ucx_address = r.get_bytes(address_bytes);
  if (const std::string why = worker_address_problem(h.ucx_address, own_address); !why.empty()) {
    refuse("has a UCX worker address that " + why);
  }
  const auto n = r.get<std::uint32_t>();
  if (n > max_hello_regions) {
    refuse("lists " + std::to_string(n) + " regions (at most " +
           std::to_string(max_hello_regions) + ")");
  }
  for (std::uint32_t i = 0; i < n; ++i) {
    const auto len = r.get<std::uint32_t>();
    h.regions.push_back(remote_region::from_bytes(r.get_bytes(len)));
  }
  r.done();
  return h;
}

// A connection by host and port whose hellos are being exchanged.
struct handshake {
  int fd = -1;
  request* connect = nullptr;                // this side connected: its request
  std::shared_ptr<listener_state> listener;  // the peer connected to this listener
  std::vector<std::byte> out;                // our hello
  std::size_t sent = 0;
  std::vector<std::byte> in;  // the peer's hello: its length, then the record
  std::size_t got = 0;
  bool connected = false;  // the TCP connect has completed (a listener's side: at once)
  struct timer : ferry::detail::timer_node {
    handshake* owner = nullptr;
  } deadline;
  bool armed = false;
  bool expired = false;
};

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

  // `e` now knows its peer: routed by its worker id (the first open endpoint to a peer receives its
  // notifications; a later one, or a hello claiming a known worker's id, takes nothing over), and
  // watched by pid where that is possible.
  void register_endpoint(const std::shared_ptr<endpoint_state>& e) {
    E& s = self();
    if (e->peer.worker_id != 0) s.by_worker_.try_emplace(e->peer.worker_id, e.get());
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

  // `e` is closed: nothing routes to it any more; its peer's messages go to another open endpoint
  // to the same worker, if there is one.
  void forget_endpoint(endpoint_state& e) noexcept {
    E& s = self();
    auto& all = s.endpoints_;
    all.erase(std::remove_if(all.begin(), all.end(), [&](const auto& p) { return p.get() == &e; }),
              all.end());
    if (e.peer.worker_id == 0) return;
    auto it = s.by_worker_.find(e.peer.worker_id);
    if (it == s.by_worker_.end() || it->second != &e) return;
    for (const auto& other : all) {
      if (other->peer.worker_id == e.peer.worker_id && other->carries_requests()) {
        it->second = other.get();
        return;
      }
    }
    s.by_worker_.erase(it);
  }

  // Creates an endpoint to a peer whose worker address (from our descriptor, or its hello) is
  // `ucx_address`. Throws std::system_error (errc::bad_descriptor) for an address UCX could not
  // take safely.
  std::error_code make_endpoint(const std::shared_ptr<endpoint_state>& e,
                                std::span<const std::byte> ucx_address) {
    E& s = self();
    e->eng = &s;
    if (const std::string why = worker_address_problem(ucx_address, s.ucx_address_); !why.empty()) {
      throw std::system_error(make_error_code(errc::bad_descriptor),
                              "ferry::ucx: the peer's UCX worker address " + why);
    }
    s.endpoints_.reserve(s.endpoints_.size() + 1);  // so that the push below cannot throw
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
    e.regions.reserve(e.regions.size() + 1);
    if (const ucs_status_t st = ::ucp_ep_rkey_unpack(e.ep, r.packed_key.data(), &ir.rkey);
        st != UCS_OK) {
      return status_error(st);
    }
    e.regions.push_back(ir);
    index = static_cast<std::uint32_t>(e.regions.size() - 1);
    return {};
  }

  // ---- listeners: ferry's own TCP sockets
  std::error_code make_listener(const std::shared_ptr<listener_state>& l, const std::string& host,
                                std::uint16_t port) {
    E& s = self();
    l->eng = &s;
    const int fd = ferry::detail::for_each_address(
        host, port, AI_PASSIVE, make_error_code(std::errc::invalid_argument),
        "ferry::ucx::worker::listen", [](int candidate, const ferry::detail::resolved_address& a) {
          const int one = 1;
          (void)::setsockopt(candidate, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
          return ::bind(candidate, a.raw(), a.length) == 0 && ::listen(candidate, 128) == 0 &&
                 ferry::detail::set_nonblocking(candidate);
        });
    if (fd < 0) return {errno, std::system_category()};
    sockaddr_storage sa{};
    socklen_t len = sizeof sa;
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len) != 0) {
      const std::error_code ec(errno, std::system_category());
      ::close(fd);
      return ec;
    }
    l->port = sa.ss_family == AF_INET6 ? ntohs(reinterpret_cast<const sockaddr_in6*>(&sa)->sin6_port)
                                       : ntohs(reinterpret_cast<const sockaddr_in*>(&sa)->sin_port);
    l->fd = fd;
    try {
      s.listeners_.push_back(l);
    } catch (...) {
      ::close(fd);
      l->fd = -1;
      throw;
    }
    if (!watch(fd, l.get(), EPOLLIN)) {
      const std::error_code ec(errno, std::system_category());
      close_listener(*l);
      return ec;
    }
    return {};
  }

  void close_listener(listener_state& l) noexcept {
    E& s = self();
    if (l.fd >= 0) {
      (void)::epoll_ctl(s.epfd_, EPOLL_CTL_DEL, l.fd, nullptr);
      ::close(l.fd);
      l.fd = -1;
    }
    while (!l.accept_waiters.empty()) {
      request* r = l.accept_waiters.front();
      l.accept_waiters.pop_front();
      s.finish_all(r, make_error_code(errc::endpoint_closed));
    }
    // Endpoints made for peers nobody accepted, and handshakes under way, end with it.
    for (const auto& e : std::exchange(l.ready, {})) {
      s.force_close(*e, make_error_code(errc::endpoint_closed));
    }
    for (std::size_t i = 0; i < s.handshakes_.size();) {
      if (s.handshakes_[i]->listener.get() == &l) {
        end_handshake(i, make_error_code(errc::endpoint_closed));
      } else {
        ++i;
      }
    }
    auto& all = s.listeners_;
    all.erase(std::remove_if(all.begin(), all.end(), [&](const auto& p) { return p.get() == &l; }),
              all.end());
  }

  void start_accept(request* r) noexcept {
    E& s = self();
    listener_state& l = *r->listener;
    if (!l.ready.empty()) {
      std::shared_ptr<endpoint_state> e = std::move(l.ready.front());
      l.ready.pop_front();
      return hand_over(r, std::move(e));
    }
    if (l.fd < 0) return s.finish_all(r, make_error_code(errc::endpoint_closed));
    try {
      l.accept_waiters.push_back(r);
    } catch (...) {
      return s.finish_all(r, make_error_code(std::errc::not_enough_memory));
    }
    s.arm_deadline(r);
  }

  // The oldest accept still wanted: one whose caller dropped its pending endpoint ends now
  // (endpoint_closed) rather than take a peer nobody would use.
  request* next_accept_waiter(listener_state& l) noexcept {
    while (!l.accept_waiters.empty()) {
      request* r = l.accept_waiters.front();
      l.accept_waiters.pop_front();
      if (!r->result || !r->result->dropped.load(std::memory_order_seq_cst)) return r;
      self().finish_all(r, make_error_code(errc::endpoint_closed));
    }
    return nullptr;
  }

  // Ends a connect or accept with `e`. A caller that dropped its pending endpoint without taking
  // it will never take `e`: the flag says so (set before the caller looks at the transfer a last
  // time; seq_cst on both sides, so at least one of the two sees the other and closes `e`).
  void hand_over(request* r, std::shared_ptr<endpoint_state> e) noexcept {
    E& s = self();
    *r->endpoint_out = e;
    const std::shared_ptr<connect_result> result = r->result;
    s.finish_all(r, {});
    if (result && result->dropped.load(std::memory_order_seq_cst)) {
      s.force_close(*e, make_error_code(errc::endpoint_closed));
    }
  }

  // ---- connecting by host and port
  void start_connect(request* r) noexcept {
    E& s = self();
    int fd = -1;
    try {
      fd = ferry::detail::for_each_address(
          r->host, r->port, 0, make_error_code(std::errc::invalid_argument),
          "resolving the host", [](int candidate, const ferry::detail::resolved_address& a) {
            return ferry::detail::set_nonblocking(candidate) &&
                   (::connect(candidate, a.raw(), a.length) == 0 || errno == EINPROGRESS);
          });
    } catch (const std::system_error& e) {
      note(r, e.what());
      return s.finish_all(r, e.code());
    } catch (...) {
      return s.finish_all(r, make_error_code(std::errc::not_enough_memory));
    }
    if (fd < 0) return s.finish_all(r, {errno, std::system_category()});
    // The request's deadline is its handshake's (the request itself arms no timer).
    handshake* h = add_handshake(fd, r->expose, r->deadline, r->has_deadline);
    if (h == nullptr) {
      ::close(fd);
      return s.finish_all(r, make_error_code(std::errc::not_enough_memory));
    }
    h->connect = r;
  }

  // ---- handshakes
  // Whether the executor must look at the sockets (a listener or a handshake exists).
  [[nodiscard]] bool sockets_watched() const noexcept {
    const E& s = static_cast<const E&>(*this);
    return !s.listeners_.empty() || !s.handshakes_.empty();
  }

  // Handles what the sockets have for us; returns how much it did.
  std::size_t poll_sockets() noexcept {
    E& s = self();
    std::size_t n = 0;
    epoll_event ev[32];
    const int k = ::epoll_wait(s.epfd_, ev, 32, 0);
    for (int i = 0; i < k; ++i) {
      void* p = ev[i].data.ptr;
      if (p == nullptr) continue;  // UCX's own descriptor: progress handles it
      ++n;
      bool is_listener = false;
      for (const auto& l : s.listeners_) is_listener = is_listener || l.get() == p;
      if (is_listener) {
        accept_connections(*static_cast<listener_state*>(p));
        continue;
      }
      for (std::size_t j = 0; j < s.handshakes_.size(); ++j) {
        if (s.handshakes_[j].get() == p) {
          step_handshake(j);
          break;
        }
      }
    }
    for (std::size_t j = 0; j < s.handshakes_.size();) {
      if (!s.handshakes_[j]->expired) {
        ++j;
        continue;
      }
      ++n;
      end_handshake(j, make_error_code(errc::deadline_exceeded));
    }
    return n;
  }

  void accept_connections(listener_state& l) noexcept {
    E& s = self();
    std::shared_ptr<listener_state> owner;
    for (const auto& p : s.listeners_) {
      if (p.get() == &l) owner = p;
    }
    for (int i = 0; i < 64 && owner && l.fd >= 0; ++i) {
      const int fd = ::accept4(l.fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) return;  // EAGAIN: none left; anything else: the next round tries again
      std::size_t pending = 0;
      for (const auto& h : s.handshakes_) pending += h->listener.get() == &l ? 1u : 0u;
      if (pending >= max_pending_handshakes) {
        ::close(fd);  // a flood of strangers does not grow this side's memory
        continue;
      }
      handshake* h = add_handshake(fd, l.expose, ferry::detail::clock::now() + s.handshake_timeout_,
                                   true);
      if (h == nullptr) {
        ::close(fd);
        continue;
      }
      h->listener = owner;
      h->connected = true;
    }
  }

  handshake* add_handshake(int fd, const std::vector<remote_region>& expose,
                           ferry::detail::clock::time_point deadline, bool has_deadline) noexcept {
    E& s = self();
    try {
      auto h = std::make_unique<handshake>();
      h->fd = fd;
      h->out = encode_hello(s.self_, s.ucx_address_, expose);
      s.handshakes_.reserve(s.handshakes_.size() + 1);
      if (!watch(fd, h.get(), EPOLLIN | EPOLLOUT)) return nullptr;
      if (has_deadline) {
        h->deadline.owner = h.get();
        h->deadline.deadline = deadline;
        h->deadline.fire = [](ferry::detail::timer_node* t) noexcept {
          static_cast<handshake::timer*>(t)->owner->expired = true;
        };
        s.exec_.timers().arm(h->deadline);
        h->armed = true;
      }
      s.handshakes_.push_back(std::move(h));
      return s.handshakes_.back().get();
    } catch (...) {
      (void)::epoll_ctl(s.epfd_, EPOLL_CTL_DEL, fd, nullptr);
      return nullptr;
    }
  }

  // Sends and reads what the socket of handshakes_[i] allows; ends it when both hellos have
  // crossed, or when it failed.
  void step_handshake(std::size_t i) noexcept {
    E& s = self();
    handshake& h = *s.handshakes_[i];
    if (!h.connected) {
      int err = 0;
      socklen_t len = sizeof err;
      if (::getsockopt(h.fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
      if (err == EINPROGRESS) return;
      if (err != 0) {
        note(h.connect, std::string("connecting: ") + std::strerror(err));
        return end_handshake(i, {err, std::system_category()});
      }
      h.connected = true;
    }
    while (h.sent < h.out.size()) {
      const ssize_t w = ::send(h.fd, h.out.data() + h.sent, h.out.size() - h.sent, MSG_NOSIGNAL);
      if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      if (w <= 0) return end_handshake(i, {errno, std::system_category()});
      h.sent += static_cast<std::size_t>(w);
      if (h.sent == h.out.size()) {
        // Ours is out: from now on only the peer's bytes matter. A socket left watched for
        // writability stays ready, and the executor would never park.
        epoll_event ev{};
        ev.events = EPOLLIN;
        ev.data.ptr = &h;
        (void)::epoll_ctl(s.epfd_, EPOLL_CTL_MOD, h.fd, &ev);
      }
    }
    for (;;) {
      // First the length (4 bytes), then that many; never more than max_hello_bytes.
      std::size_t want = sizeof(std::uint32_t);
      if (h.got >= want) {
        std::uint32_t n = 0;
        std::memcpy(&n, h.in.data(), sizeof n);
        if (n == 0 || n > max_hello_bytes) {
          note(h.connect, "the peer sent a hello of " + std::to_string(n) + " bytes");
          return end_handshake(i, make_error_code(errc::handshake_failed));
        }
        want += n;
      }
      if (h.got == want) break;
      try {
        h.in.resize(want);
      } catch (...) {
        return end_handshake(i, make_error_code(std::errc::not_enough_memory));
      }
      const ssize_t r = ::recv(h.fd, h.in.data() + h.got, want - h.got, 0);
      if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      if (r == 0) {
        note(h.connect, "the peer closed the connection before its hello was complete");
        return end_handshake(i, make_error_code(errc::handshake_failed));
      }
      if (r < 0) return end_handshake(i, {errno, std::system_category()});
      h.got += static_cast<std::size_t>(r);
    }
    if (h.sent < h.out.size()) return;  // ours still going out
    complete_handshake(i);
  }

  // Both hellos have crossed: the peer's is checked, and its endpoint made.
  void complete_handshake(std::size_t i) noexcept {
    E& s = self();
    handshake& h = *s.handshakes_[i];
    std::shared_ptr<endpoint_state> e;
    try {
      hello peer = decode_hello(std::span(h.in).subspan(sizeof(std::uint32_t)), s.ucx_address_);
      e = std::make_shared<endpoint_state>();
      e->peer = peer.who;
      if (const std::error_code ec = make_endpoint(e, peer.ucx_address)) {
        note(h.connect, "creating the UCX endpoint from the peer's address");
        return end_handshake(i, ec);
      }
      for (const remote_region& r : peer.regions) {
        std::uint32_t index = 0;
        if (const std::error_code ec = import_region(*e, r, index)) {
          s.force_close(*e, ec);
          note(h.connect, "importing the peer's regions");
          return end_handshake(i, ec);
        }
      }
      e->peer_regions = std::move(peer.regions);
    } catch (const std::system_error& x) {
      note(h.connect, x.what());
      if (e) s.force_close(*e, x.code());
      return end_handshake(i, x.code());
    } catch (...) {
      if (e) s.force_close(*e, make_error_code(std::errc::not_enough_memory));
      return end_handshake(i, make_error_code(std::errc::not_enough_memory));
    }
    if (request* connect = h.connect) {
      h.connect = nullptr;
      hand_over(connect, e);
    } else if (request* accept = next_accept_waiter(*h.listener)) {
      hand_over(accept, e);
    } else {
      listener_state& l = *h.listener;
      try {
        l.ready.push_back(e);
      } catch (...) {
        s.force_close(*e, make_error_code(std::errc::not_enough_memory));
      }
    }
    end_handshake(i, {});
  }

  // Ends handshakes_[i]: its socket closed, its connect (if any) failed with `ec`.
  void end_handshake(std::size_t i, std::error_code ec) noexcept {
    E& s = self();
    std::unique_ptr<handshake> h = std::move(s.handshakes_[i]);
    s.handshakes_.erase(s.handshakes_.begin() + static_cast<std::ptrdiff_t>(i));
    if (h->armed) (void)s.exec_.timers().cancel(h->deadline);
    (void)::epoll_ctl(s.epfd_, EPOLL_CTL_DEL, h->fd, nullptr);
    ::close(h->fd);
    if (request* r = h->connect) {
      s.finish_all(r, ec == errc::deadline_exceeded || r->deadline_passed
                          ? make_error_code(errc::deadline_exceeded)
                          : (ec ? ec : make_error_code(errc::handshake_failed)));
    }
  }

  bool watch(int fd, void* tag, std::uint32_t events) noexcept {
    epoll_event ev{};
    ev.events = events;
    ev.data.ptr = tag;
    return ::epoll_ctl(self().epfd_, EPOLL_CTL_ADD, fd, &ev) == 0;
  }

  // Why a connect failed, in words, for the caller's exception.
  static void note(request* r, const std::string& what) noexcept {
    if (r == nullptr || r->call_error_out == nullptr) return;
    try {
      *r->call_error_out = what;
    } catch (...) {
      // No memory for the text: the error code alone says what failed.
    }
  }
};

}  // namespace ferry::ucx::detail

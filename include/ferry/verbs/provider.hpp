#pragma once
// The verbs calls the backend makes, gathered in one place. The backend is a template over a
// provider: `real_provider` below forwards every call to libibverbs (the data-path ones are inline
// functions of <infiniband/verbs.h> that jump straight into the adapter's driver), and
// `fake::provider` (ferry/testing/verbs/provider.hpp) implements the same calls in process for
// tests. The choice is made at compile time, so the real build pays nothing for the fake.
//
// Every call returns 0 or an errno value (creation calls return a null handle and set errno), as
// libibverbs does; the structures are libibverbs' own (ibv_wc, ibv_send_wr, ibv_qp_attr, ...), so the
// backend reads the same fields whichever provider it runs on.

#include <infiniband/verbs.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <string>
#include <system_error>
#include <vector>

#include "ferry/detail/socket.hpp"


namespace ferry::verbs {

/// What the backend learns from one asynchronous event. Providers acknowledge the event before
/// returning it, so the backend may destroy the objects it names at any time.
template <class QpHandle, class CqHandle>
struct basic_async_event {
  ibv_event_type type{};  ///< which event (IBV_EVENT_QP_FATAL, IBV_EVENT_PORT_ERR, ...)
  QpHandle qp{};  ///< for queue pair events
  CqHandle cq{};  ///< for IBV_EVENT_CQ_ERR
  int port = 0;   ///< for port events
  /// The queue pair's number, read before the event was acknowledged: with the handle it names the
  /// queue pair even if a new one has since been created at the same address.
  std::uint32_t qp_num = 0;
};

/// The verbs provider on real adapters: every call forwards to libibverbs (0 or an errno value).
struct real_provider {
  using context_handle = ibv_context*;      ///< an opened device
  using pd_handle = ibv_pd*;                ///< a protection domain
  using mr_handle = ibv_mr*;                ///< a registered memory region
  using channel_handle = ibv_comp_channel*; ///< a completion channel
  using cq_handle = ibv_cq*;                ///< a completion queue
  using qp_handle = ibv_qp*;                ///< a queue pair
  using async_event = basic_async_event<qp_handle, cq_handle>;  ///< what get_async_event returns

  /// What basic_device says when device_names() is empty: how to get a device.
  static constexpr const char* no_device_help =
      "ibv_get_device_list returned none; is an adapter present and its driver loaded?";

  /// The names of the RDMA devices present (empty when there are none).
  [[nodiscard]] static std::vector<std::string> device_names() {
    int n = 0;
    ibv_device** list = ::ibv_get_device_list(&n);
    if (list == nullptr) {
      // ENOSYS: no kernel RDMA support at all; that is "no devices", not an error.
      if (errno == ENOSYS) return {};
      throw std::system_error(errno, std::system_category(), "ferry::verbs: ibv_get_device_list");
    }
    std::vector<std::string> names;
    for (int i = 0; i < n; ++i) names.emplace_back(::ibv_get_device_name(list[i]));
    ::ibv_free_device_list(list);
    return names;
  }

  /// Opens the device called `name`. Null with errno ENODEV when there is no such device.
  [[nodiscard]] static context_handle open_device(const std::string& name) noexcept {
    int n = 0;
    ibv_device** list = ::ibv_get_device_list(&n);
    if (list == nullptr) return nullptr;
    ibv_context* ctx = nullptr;
    int err = ENODEV;
    for (int i = 0; i < n; ++i) {
      if (name == ::ibv_get_device_name(list[i])) {
        ctx = ::ibv_open_device(list[i]);
        err = ctx == nullptr ? errno : 0;
        break;
      }
    }
    ::ibv_free_device_list(list);
    if (ctx == nullptr) errno = err;
    return ctx;
  }

  /// Closes a device opened by open_device (ibv_close_device).
  static void close_device(context_handle c) noexcept { ::ibv_close_device(c); }

  /// Reads port `port`'s attributes into `out` (ibv_query_port); 0 or an errno value.
  static int query_port(context_handle c, std::uint8_t port, ibv_port_attr& out) noexcept {
    return ::ibv_query_port(c, port, &out);
  }

  /// Reads GID `index` of port `port` into `out` (ibv_query_gid); 0 or an errno value.
  static int query_gid(context_handle c, std::uint8_t port, int index, ibv_gid& out) noexcept {
    return ::ibv_query_gid(c, port, index, &out);
  }

  /// A new protection domain (ibv_alloc_pd); null with errno set on failure.
  [[nodiscard]] static pd_handle alloc_pd(context_handle c) noexcept { return ::ibv_alloc_pd(c); }
  /// Frees a protection domain (ibv_dealloc_pd).
  static void dealloc_pd(pd_handle pd) noexcept { ::ibv_dealloc_pd(pd); }

  /// Registers `length` bytes at `addr` with access flags `access` (ibv_reg_mr); null with errno
  /// set on failure.
  [[nodiscard]] static mr_handle reg_mr(pd_handle pd, void* addr, std::size_t length,
                                        int access) noexcept {
    // ibv_reg_mr is a macro that passes the flags on as unsigned int.
    return ::ibv_reg_mr(pd, addr, length, static_cast<unsigned>(access));
  }
  /// Registers `length` bytes of the dma-buf `fd` from `offset` on (ibv_reg_dmabuf_mr, rdma-core
  /// 34 and later), addressed by work requests from `iova` on; null with errno set on failure. The
  /// region holds its own reference to the dma-buf: the caller may close `fd` once it returns.
  [[nodiscard]] static mr_handle reg_dmabuf_mr(pd_handle pd, std::uint64_t offset,
                                               std::size_t length, std::uint64_t iova, int fd,
                                               int access) noexcept {
    return ::ibv_reg_dmabuf_mr(pd, offset, length, iova, fd, access);
  }
  /// Deregisters a region (ibv_dereg_mr); 0 or an errno value.
  static int dereg_mr(mr_handle mr) noexcept { return ::ibv_dereg_mr(mr); }
  /// The region's local key, for scatter/gather entries.
  [[nodiscard]] static std::uint32_t lkey(mr_handle mr) noexcept { return mr->lkey; }
  /// The region's remote key, for peers' one-sided operations.
  [[nodiscard]] static std::uint32_t rkey(mr_handle mr) noexcept { return mr->rkey; }

  /// A new completion channel (ibv_create_comp_channel); null with errno set on failure.
  /// The channel's descriptor is made non-blocking, so get_cq_event returns EAGAIN when nothing is
  /// pending.
  [[nodiscard]] static channel_handle create_comp_channel(context_handle c) noexcept {
    ibv_comp_channel* ch = ::ibv_create_comp_channel(c);
    if (ch != nullptr && !ferry::detail::set_nonblocking(ch->fd)) {
      const int err = errno;
      ::ibv_destroy_comp_channel(ch);
      errno = err;
      return nullptr;
    }
    return ch;
  }
  /// Destroys a completion channel (ibv_destroy_comp_channel); 0 or an errno value.
  static int destroy_comp_channel(channel_handle ch) noexcept {
    return ::ibv_destroy_comp_channel(ch);
  }
  /// The channel's descriptor, readable when a completion event is pending.
  [[nodiscard]] static int channel_fd(channel_handle ch) noexcept { return ch->fd; }

  /// A completion queue of at least `entries` entries, signalling on `ch` (which may be null)
  /// through ibv_create_cq; null with errno set on failure.
  [[nodiscard]] static cq_handle create_cq(context_handle c, int entries,
                                           channel_handle ch) noexcept {
    return ::ibv_create_cq(c, entries, nullptr, ch, 0);
  }
  /// Destroys a completion queue (ibv_destroy_cq); 0 or an errno value.
  static int destroy_cq(cq_handle cq) noexcept { return ::ibv_destroy_cq(cq); }

  /// Arms the queue to signal its channel at the next completion (or the next solicited one);
  /// 0 or an errno value.
  static int req_notify_cq(cq_handle cq, bool solicited_only) noexcept {
    return ::ibv_req_notify_cq(cq, solicited_only ? 1 : 0);
  }
  /// Takes one completion event from the channel into `out`: 0, EAGAIN when none is pending, or
  /// another errno value.
  static int get_cq_event(channel_handle ch, cq_handle& out) noexcept {
    void* context = nullptr;
    if (::ibv_get_cq_event(ch, &out, &context) != 0) return errno == 0 ? EIO : errno;
    return 0;
  }
  /// Acknowledges `n` completion events taken for `cq` (needed before destroy_cq).
  static void ack_cq_events(cq_handle cq, unsigned n) noexcept { ::ibv_ack_cq_events(cq, n); }
  /// Takes up to `n` completions into `wc` (ibv_poll_cq).
  /// The number of completions written to `wc`, or a negative value on failure.
  static int poll_cq(cq_handle cq, int n, ibv_wc* wc) noexcept { return ::ibv_poll_cq(cq, n, wc); }

  /// An RC queue pair in the RESET state; `cap` is updated with what the device granted.
  [[nodiscard]] static qp_handle create_qp(pd_handle pd, cq_handle send_cq, cq_handle recv_cq,
                                           ibv_qp_cap& cap) noexcept {
    ibv_qp_init_attr attr{};
    attr.send_cq = send_cq;
    attr.recv_cq = recv_cq;
    attr.cap = cap;
    attr.qp_type = IBV_QPT_RC;
    attr.sq_sig_all = 0;
    ibv_qp* qp = ::ibv_create_qp(pd, &attr);
    if (qp != nullptr) cap = attr.cap;
    return qp;
  }
  /// Destroys a queue pair (ibv_destroy_qp); 0 or an errno value.
  static int destroy_qp(qp_handle qp) noexcept { return ::ibv_destroy_qp(qp); }
  /// The queue pair's number, which the peer connects to.
  [[nodiscard]] static std::uint32_t qp_num(qp_handle qp) noexcept { return qp->qp_num; }
  /// Moves the queue pair with the attributes `mask` selects (ibv_modify_qp); 0 or an errno value.
  static int modify_qp(qp_handle qp, ibv_qp_attr& attr, int mask) noexcept {
    return ::ibv_modify_qp(qp, &attr, mask);
  }

  /// Posts a chain of send work requests (ibv_post_send); 0, or an errno value with `*bad` the
  /// first request not posted.
  static int post_send(qp_handle qp, ibv_send_wr* wr, ibv_send_wr** bad) noexcept {
    return ::ibv_post_send(qp, wr, bad);
  }
  /// Posts a chain of receive work requests (ibv_post_recv); 0, or an errno value with `*bad` the
  /// first request not posted.
  static int post_recv(qp_handle qp, ibv_recv_wr* wr, ibv_recv_wr** bad) noexcept {
    return ::ibv_post_recv(qp, wr, bad);
  }

  /// The context's asynchronous event descriptor, made non-blocking by prepare_async_fd.
  [[nodiscard]] static int async_fd(context_handle c) noexcept { return c->async_fd; }
  /// Makes the context's asynchronous event descriptor non-blocking; false (errno set) on failure.
  [[nodiscard]] static bool prepare_async_fd(context_handle c) noexcept {
    return ferry::detail::set_nonblocking(c->async_fd);
  }

  /// Takes one asynchronous event into `out` (ibv_get_async_event).
  /// 0 and one event (already acknowledged), or EAGAIN when none is pending.
  static int get_async_event(context_handle c, async_event& out) noexcept {
    ibv_async_event ev{};
    if (::ibv_get_async_event(c, &ev) != 0) return errno == 0 ? EIO : errno;
    out = async_event{};
    out.type = ev.event_type;
    switch (ev.event_type) {
      case IBV_EVENT_CQ_ERR:
        out.cq = ev.element.cq;
        break;
      case IBV_EVENT_PORT_ACTIVE:
      case IBV_EVENT_PORT_ERR:
      case IBV_EVENT_LID_CHANGE:
      case IBV_EVENT_PKEY_CHANGE:
      case IBV_EVENT_SM_CHANGE:
      case IBV_EVENT_CLIENT_REREGISTER:
      case IBV_EVENT_GID_CHANGE:
        out.port = ev.element.port_num;
        break;
      case IBV_EVENT_DEVICE_FATAL:
        break;
      case IBV_EVENT_SRQ_ERR:
      case IBV_EVENT_SRQ_LIMIT_REACHED:
      case IBV_EVENT_WQ_FATAL:
        break;
      default:
        out.qp = ev.element.qp;
        out.qp_num = ev.element.qp->qp_num;
        break;
    }
    ::ibv_ack_async_event(&ev);
    return 0;
  }
};

}  // namespace ferry::verbs

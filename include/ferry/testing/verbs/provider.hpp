#pragma once
// The fake provider: the verbs calls with real_provider's signatures and errno conventions, on the
// in-process fabric (testing/verbs/fabric.hpp). basic_device<fake::provider> runs the verbs backend
// without an adapter.

#include <infiniband/verbs.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "ferry/testing/verbs/fabric.hpp"
#include "ferry/testing/verbs/objects.hpp"
#include "ferry/verbs/provider.hpp"

namespace ferry::verbs::fake {

/// The verbs calls, with real_provider's signatures and errno conventions, on fabric::instance().
struct provider {
  /// An opened fake device.
  using context_handle = context*;
  /// A protection domain.
  using pd_handle = pd*;
  /// A registered memory region.
  using mr_handle = mr*;
  /// A completion channel.
  using channel_handle = channel*;
  /// A completion queue.
  using cq_handle = cq*;
  /// A queue pair.
  using qp_handle = qp*;
  /// What get_async_event returns.
  using async_event = basic_async_event<qp_handle, cq_handle>;

  /// What basic_device says when no device was added: how to add one.
  static constexpr const char* no_device_help =
      "no fake device was added; call ferry::verbs::fake::fabric::instance().add_device(name) "
      "before opening a basic_device<fake::provider>";

  /// The names of the devices added to the fabric (fabric::add_device).
  [[nodiscard]] static std::vector<std::string> device_names() {
    return fabric::instance().device_names();
  }

  /// Opens the fake device called `name`; null with errno ENODEV when there is none.
  [[nodiscard]] static context_handle open_device(const std::string& name) noexcept {
    return fabric::instance().open_device(name);
  }

  /// Closes a device opened by open_device (errno EBUSY, and it stays open, while objects use it).
  static void close_device(context_handle c) noexcept { fabric::instance().close_device(c); }

  /// Reads port `port`'s attributes into `out`; 0 or an errno value.
  static int query_port(context_handle c, std::uint8_t port, ibv_port_attr& out) noexcept {
    return fabric::instance().query_port(c, port, out);
  }

  /// Reads GID `index` of port `port` into `out`; 0 or an errno value.
  static int query_gid(context_handle c, std::uint8_t port, int index, ibv_gid& out) noexcept {
    return fabric::instance().query_gid(c, port, index, out);
  }

  /// A new protection domain; null with errno set on failure.
  [[nodiscard]] static pd_handle alloc_pd(context_handle c) noexcept {
    return fabric::instance().alloc_pd(c);
  }
  /// Frees a protection domain (errno EBUSY, and it stays, while regions or queue pairs use it).
  static void dealloc_pd(pd_handle pd) noexcept { fabric::instance().dealloc_pd(pd); }

  /// Registers `length` bytes at `addr` with access flags `access`; null with errno set on failure.
  [[nodiscard]] static mr_handle reg_mr(pd_handle pd, void* addr, std::size_t length,
                                        int access) noexcept {
    return fabric::instance().reg_mr(pd, addr, length, access);
  }
  /// Registers `length` bytes of the fake dma-buf `fd` (ferry::testing::fake_dmabuf) from `offset`
  /// on, addressed by work requests from `iova` on; null with errno set on failure: EBADF when `fd`
  /// is no live fake dma-buf, EINVAL for zero bytes or a range past the dma-buf's size.
  [[nodiscard]] static mr_handle reg_dmabuf_mr(pd_handle pd, std::uint64_t offset,
                                               std::size_t length, std::uint64_t iova, int fd,
                                               int access) noexcept {
    return fabric::instance().reg_dmabuf_mr(pd, offset, length, iova, fd, access);
  }
  /// Deregisters a region; 0 or an errno value.
  static int dereg_mr(mr_handle mr) noexcept { return fabric::instance().dereg_mr(mr); }
  /// The region's local key.
  [[nodiscard]] static std::uint32_t lkey(mr_handle mr) noexcept { return mr->lkey_; }
  /// The region's remote key.
  [[nodiscard]] static std::uint32_t rkey(mr_handle mr) noexcept { return mr->rkey_; }

  /// A new completion channel with a non-blocking descriptor; null with errno set on failure.
  [[nodiscard]] static channel_handle create_comp_channel(context_handle c) noexcept {
    return fabric::instance().create_comp_channel(c);
  }
  /// Destroys a completion channel; 0 or an errno value.
  static int destroy_comp_channel(channel_handle ch) noexcept {
    return fabric::instance().destroy_comp_channel(ch);
  }
  /// The channel's descriptor, readable when a completion event is pending.
  [[nodiscard]] static int channel_fd(channel_handle ch) noexcept { return ch->fd_; }

  /// A completion queue of `entries` entries, signalling on `ch` (which may be null); null with errno set on failure.
  [[nodiscard]] static cq_handle create_cq(context_handle c, int entries,
                                           channel_handle ch) noexcept {
    return fabric::instance().create_cq(c, entries, ch);
  }
  /// Destroys a completion queue; 0, or EBUSY while events on it are unacknowledged or it is in use.
  static int destroy_cq(cq_handle cq) noexcept { return fabric::instance().destroy_cq(cq); }

  /// Arms the queue to signal its channel at the next completion (or the next solicited one).
  static int req_notify_cq(cq_handle cq, bool solicited_only) noexcept {
    return fabric::instance().req_notify_cq(cq, solicited_only);
  }
  /// Takes one completion event from the channel into `out`: 0, or EAGAIN when none is pending.
  static int get_cq_event(channel_handle ch, cq_handle& out) noexcept {
    return fabric::instance().get_cq_event(ch, out);
  }
  /// Acknowledges `n` completion events taken for `cq`.
  static void ack_cq_events(cq_handle cq, unsigned n) noexcept {
    fabric::instance().ack_cq_events(cq, n);
  }
  /// Takes up to `n` completions into `wc`; returns how many, or a negative value on failure.
  static int poll_cq(cq_handle cq, int n, ibv_wc* wc) noexcept {
    return fabric::instance().poll_cq(cq, n, wc);
  }

  /// An RC queue pair in the RESET state; `cap` is updated with what the fabric granted.
  [[nodiscard]] static qp_handle create_qp(pd_handle pd, cq_handle send_cq, cq_handle recv_cq,
                                           ibv_qp_cap& cap) noexcept {
    return fabric::instance().create_qp(pd, send_cq, recv_cq, cap);
  }
  /// Destroys a queue pair; 0 or an errno value.
  static int destroy_qp(qp_handle qp) noexcept { return fabric::instance().destroy_qp(qp); }
  /// The queue pair's number.
  [[nodiscard]] static std::uint32_t qp_num(qp_handle qp) noexcept { return qp->num_; }
  /// Moves the queue pair with the attributes `mask` selects, checked as the kernel checks them.
  static int modify_qp(qp_handle qp, ibv_qp_attr& attr, int mask) noexcept {
    return fabric::instance().modify_qp(qp, attr, mask);
  }

  /// Posts a chain of send work requests; 0, or an errno value with `*bad` the first not posted.
  static int post_send(qp_handle qp, ibv_send_wr* wr, ibv_send_wr** bad) noexcept {
    return fabric::instance().post_send(qp, wr, bad);
  }
  /// Posts a chain of receive work requests; 0, or an errno value with `*bad` the first not posted.
  static int post_recv(qp_handle qp, ibv_recv_wr* wr, ibv_recv_wr** bad) noexcept {
    return fabric::instance().post_recv(qp, wr, bad);
  }

  /// The context's asynchronous event descriptor.
  [[nodiscard]] static int async_fd(context_handle c) noexcept { return c->async_fd_; }
  /// Returns true: the descriptor is non-blocking from the start.
  [[nodiscard]] static bool prepare_async_fd(context_handle) noexcept { return true; }

  /// Takes one asynchronous event into `out`: 0 and one event (already acknowledged), or EAGAIN
  /// when none is pending.
  static int get_async_event(context_handle c, async_event& out) noexcept {
    return fabric::instance().get_async_event(c, out);
  }
};

}  // namespace ferry::verbs::fake


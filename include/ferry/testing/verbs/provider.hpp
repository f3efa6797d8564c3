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

// The verbs calls, with real_provider's signatures and errno conventions, on fabric::instance().
struct provider {
  using context_handle = context*;
  using pd_handle = pd*;
  using mr_handle = mr*;
  using channel_handle = channel*;
  using cq_handle = cq*;
  using qp_handle = qp*;
  using async_event = basic_async_event<qp_handle, cq_handle>;

  // What basic_device says when no device was added: how to add one.
  static constexpr const char* no_device_help =
      "no fake device was added; call ferry::verbs::fake::fabric::instance().add_device(name) "
      "before opening a basic_device<fake::provider>";

  [[nodiscard]] static std::vector<std::string> device_names() {
    return fabric::instance().device_names();
  }

  [[nodiscard]] static context_handle open_device(const std::string& name) noexcept {
    return fabric::instance().open_device(name);
  }

  static void close_device(context_handle c) noexcept { fabric::instance().close_device(c); }

  static int query_port(context_handle c, std::uint8_t port, ibv_port_attr& out) noexcept {
    return fabric::instance().query_port(c, port, out);
  }

  static int query_gid(context_handle c, std::uint8_t port, int index, ibv_gid& out) noexcept {
    return fabric::instance().query_gid(c, port, index, out);
  }

  [[nodiscard]] static pd_handle alloc_pd(context_handle c) noexcept {
    return fabric::instance().alloc_pd(c);
  }
  static void dealloc_pd(pd_handle pd) noexcept { fabric::instance().dealloc_pd(pd); }

  [[nodiscard]] static mr_handle reg_mr(pd_handle pd, void* addr, std::size_t length,
                                        int access) noexcept {
    return fabric::instance().reg_mr(pd, addr, length, access);
  }
  static int dereg_mr(mr_handle mr) noexcept { return fabric::instance().dereg_mr(mr); }
  [[nodiscard]] static std::uint32_t lkey(mr_handle mr) noexcept { return mr->lkey_; }
  [[nodiscard]] static std::uint32_t rkey(mr_handle mr) noexcept { return mr->rkey_; }

  [[nodiscard]] static channel_handle create_comp_channel(context_handle c) noexcept {
    return fabric::instance().create_comp_channel(c);
  }
  static int destroy_comp_channel(channel_handle ch) noexcept {
    return fabric::instance().destroy_comp_channel(ch);
  }
  [[nodiscard]] static int channel_fd(channel_handle ch) noexcept { return ch->fd_; }

  [[nodiscard]] static cq_handle create_cq(context_handle c, int entries,
                                           channel_handle ch) noexcept {
    return fabric::instance().create_cq(c, entries, ch);
  }
  static int destroy_cq(cq_handle cq) noexcept { return fabric::instance().destroy_cq(cq); }

  static int req_notify_cq(cq_handle cq, bool solicited_only) noexcept {
    return fabric::instance().req_notify_cq(cq, solicited_only);
  }
  static int get_cq_event(channel_handle ch, cq_handle& out) noexcept {
    return fabric::instance().get_cq_event(ch, out);
  }
  static void ack_cq_events(cq_handle cq, unsigned n) noexcept {
    fabric::instance().ack_cq_events(cq, n);
  }
  static int poll_cq(cq_handle cq, int n, ibv_wc* wc) noexcept {
    return fabric::instance().poll_cq(cq, n, wc);
  }

  [[nodiscard]] static qp_handle create_qp(pd_handle pd, cq_handle send_cq, cq_handle recv_cq,
                                           ibv_qp_cap& cap) noexcept {
    return fabric::instance().create_qp(pd, send_cq, recv_cq, cap);
  }
  static int destroy_qp(qp_handle qp) noexcept { return fabric::instance().destroy_qp(qp); }
  [[nodiscard]] static std::uint32_t qp_num(qp_handle qp) noexcept { return qp->num_; }
  static int modify_qp(qp_handle qp, ibv_qp_attr& attr, int mask) noexcept {
    return fabric::instance().modify_qp(qp, attr, mask);
  }

  static int post_send(qp_handle qp, ibv_send_wr* wr, ibv_send_wr** bad) noexcept {
    return fabric::instance().post_send(qp, wr, bad);
  }
  static int post_recv(qp_handle qp, ibv_recv_wr* wr, ibv_recv_wr** bad) noexcept {
    return fabric::instance().post_recv(qp, wr, bad);
  }

  [[nodiscard]] static int async_fd(context_handle c) noexcept { return c->async_fd_; }
  // The descriptor is non-blocking from the start.
  [[nodiscard]] static bool prepare_async_fd(context_handle) noexcept { return true; }

  static int get_async_event(context_handle c, async_event& out) noexcept {
    return fabric::instance().get_async_event(c, out);
  }
};

}  // namespace ferry::verbs::fake


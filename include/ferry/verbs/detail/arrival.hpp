#pragma once
// What the executor does with what submitters publish: it takes the submission stack and routes
// each op by its kind (a table, one handler per kind): a queue pair's opening and closing, a
// notification wait (delivered at once if a notification has arrived), or a unit of requests,
// queued for posting (posting.hpp) unless its queue pair or the device refuses it. The executor
// thread only (or the destructor, once the source is removed).

#include <cstddef>
#include <iterator>
#include <system_error>

#include "ferry/errors.hpp"
#include "ferry/transfer.hpp"
#include "ferry/verbs/detail/op.hpp"
#include "ferry/verbs/detail/queue_pair_state.hpp"
#include "ferry/verbs/errors.hpp"

namespace ferry::verbs::detail {

// Routing of published ops: a part of basic_device<P> (device.hpp), which derives from it privately;
// it reaches the device and the other parts through self().
template <class P>
struct arrival {
  using op_body = verbs::detail::op_body<P>;
  using op = verbs::detail::op<P>;
  using qp_state = verbs::detail::qp_state<P>;

  [[nodiscard]] basic_device<P>& self() noexcept { return static_cast<basic_device<P>&>(*this); }
  [[nodiscard]] const basic_device<P>& self() const noexcept {
    return static_cast<const basic_device<P>&>(*this);
  }

  std::size_t take_incoming() noexcept {
    return self().incoming_.take([this](op_body* o) { route(o); });
  }

  // Each kind does its own on arrival: a table indexed by op_kind, in the enum's order (op.hpp), so
  // nothing here switches over kinds.
  void route(op_body* o) noexcept {
    using arrive = void (arrival::*)(op_body*) noexcept;
    static constexpr arrive by_kind[] = {
        &arrival::route_unit,   // write
        &arrival::route_unit,   // read
        &arrival::route_unit,   // notify
        &arrival::route_wait,   // wait_notification
        &arrival::route_open,   // open
        &arrival::route_close,  // close
        &arrival::route_unit,   // peer_check
        &arrival::route_sever,  // sever
    };
    static_assert(std::size(by_kind) == static_cast<std::size_t>(op_kind::sever) + 1);
    (this->*by_kind[static_cast<std::size_t>(o->kind)])(o);
  }

  void route_open(op_body* lead) noexcept {
    qp_state* q = lead->qp;
    op::free(lead);
    q->all_next = self().qps_;
    if (self().qps_ != nullptr) self().qps_->all_prev = q;
    self().qps_ = q;
    // Created after the CQ or the device failed: nothing on it could ever complete.
    if (const int f = self().failure_.load(std::memory_order_relaxed); f != 0) {
      self().break_queue_pair(q, static_cast<errc>(f));
    }
  }

  // queue_pair::sever: broken with the caller's reason (the first reason stays).
  void route_sever(op_body* lead) noexcept {
    qp_state* q = lead->qp;
    const std::error_code why = lead->reason;
    op::free(lead);
    if (q->broken.load(std::memory_order_relaxed) != 0) return;
    q->sever_reason = why;
    self().break_queue_pair(q, errc::severed);
  }

  void route_close(op_body* lead) noexcept {
    qp_state* q = lead->qp;
    op::free(lead);
    q->close_op = nullptr;
    self().close_now(q);
  }

  // A READ, WRITE, notification or peer check: queued for the next chain unless refused.
  void route_unit(op_body* lead) noexcept {
    qp_state* q = lead->qp;
    if (const std::error_code ec = refusal(q); ec) {
      return self().end_unit(lead, transfer_state::failed, ec);
    }
    if (!self().arm_deadline(lead)) {
      return self().end_unit(lead, transfer_state::failed,
                             std::make_error_code(std::errc::not_enough_memory));
    }
    self().queue_unit(q, lead);
  }

  [[nodiscard]] std::error_code refusal(const qp_state* q) const noexcept {
    if (self().shutting_down_) return make_error_code(ferry::errc::backend_shut_down);
    if (const int b = q->broken.load(std::memory_order_relaxed); b != 0) return q->broken_error(b);
    return {};
  }

  void route_wait(op_body* w) noexcept {
    qp_state* q = w->qp;
    if (q->arrived_at != 0) return self().deliver(q, w, self().take_arrived(q));
    if (const std::error_code ec = refusal(q); ec) {
      return self().end_wait(w, transfer_state::failed, ec);
    }
    if (!self().arm_deadline(w)) {
      return self().end_wait(w, transfer_state::failed,
                             std::make_error_code(std::errc::not_enough_memory));
    }
    q->waiters.push(w);
    self().arm_peer_check(q);
  }
};

}  // namespace ferry::verbs::detail

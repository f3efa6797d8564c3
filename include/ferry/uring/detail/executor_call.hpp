#pragma once
// Work that must run on the executor thread: with deferred task work that thread is the ring's one
// issuer, so registrations and enabling the ring go there as calls, and the calling thread waits.

#include <cstddef>
#include <system_error>

#include "ferry/errors.hpp"
#include "ferry/transfer.hpp"
#include "ferry/uring/detail/engine.hpp"
#include "ferry/uring/detail/op.hpp"

namespace ferry::uring::detail {

// Run by the ring's poll() once this round's completions are handled, never from inside reap().
inline void queue_call(engine& e, op* o) noexcept { e.calls_.push(o); }

inline constexpr op_handlers call_handlers{op_kind::call, queue_call, nullptr, nullptr, nullptr};

// Runs f() on the executor thread and returns what it returned (0 or -errno); the calling thread
// waits. On the executor thread itself it runs at once.
template <class F>
int on_executor(engine& e, F f) {
  if (e.exec_.on_executor_thread()) return f();
  op* o = op::make(call_handlers);
  o->call = [](void* fn) noexcept { return (*static_cast<F*>(fn))(); };
  o->call_argument = &f;
  transfer t = engine::attach(o);
  e.publish(o, o);
  (void)t.wait();
  return t.state() == transfer_state::success ? 0 : -t.error().value();
}

// `refuse`: the ring is gone from the executor, and the kernel would refuse the call here.
inline std::size_t run_calls(engine& e, bool refuse = false) noexcept {
  std::size_t n = 0;
  while (op* o = e.calls_.pop()) {
    if (refuse) {
      e.finish(o, transfer_state::failed, make_error_code(ferry::errc::backend_shut_down));
      ++n;
      continue;
    }
    const int r = o->call(o->call_argument);
    e.finish(o, r < 0 ? transfer_state::failed : transfer_state::success,
             r < 0 ? system_error_code(-r) : std::error_code{});
    ++n;
  }
  return n;
}

}  // namespace ferry::uring::detail

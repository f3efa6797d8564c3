#pragma once
// The awaiter of something being made by the executor (a UCX endpoint, a TCP connection): it waits
// on the `made()` transfer of `Pending` like any transfer (resuming on the awaiting coroutine's
// scheduler), then returns `Pending::get()`, which by then does not block and throws
// std::system_error naming what failed.

#include <coroutine>
#include <utility>

#include "ferry/scheduler.hpp"
#include "ferry/transfer.hpp"

namespace ferry::detail {

template <class Pending>
class made_awaiter {
 public:
  explicit made_awaiter(Pending& p) : inner_(p.made().status()), owner_(&p) {}
  bool await_ready() noexcept { return inner_.await_ready(); }
  template <class Promise>
  bool await_suspend(std::coroutine_handle<Promise> h) {
    return inner_.await_suspend(h);
  }
  bool await_suspend_on(std::coroutine_handle<> h, any_scheduler s) noexcept {
    return inner_.await_suspend_on(h, std::move(s));
  }
  auto await_resume() {
    (void)inner_.await_resume();
    return owner_->get();  // terminal by now: does not block
  }

 private:
  transfer_awaiter inner_;
  Pending* owner_;
};

}  // namespace ferry::detail

// Must NOT compile: a coroutine whose promise names a scheduler with a post() that is not noexcept
// awaits a transfer. tests/meson.build checks that the compiler's message says post() must be
// noexcept.
#include <coroutine>
#include <exception>

#include <ferry/transfer.hpp>

struct throwing_scheduler {
  void post(std::coroutine_handle<> h) { h.resume(); }  // may throw, as far as the type says
};

struct with_scheduler {
  struct promise_type {
    throwing_scheduler scheduler;
    throwing_scheduler& get_scheduler() noexcept { return scheduler; }
    with_scheduler get_return_object() noexcept { return {}; }
    std::suspend_never initial_suspend() noexcept { return {}; }
    std::suspend_never final_suspend() noexcept { return {}; }
    void return_void() noexcept {}
    void unhandled_exception() noexcept { std::terminate(); }
  };
};

with_scheduler await_on_throwing_scheduler(ferry::transfer t) { (void)co_await t; }

int main() {}

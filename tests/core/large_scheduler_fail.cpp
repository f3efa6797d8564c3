// Must NOT compile: a promise returns by value a scheduler larger than four pointers (the size of
// an Asio any_io_executor). tests/meson.build checks that the message says to return a reference.
#include <coroutine>
#include <exception>
#include <ferry/transfer.hpp>

struct large_scheduler {
  void* state[7] = {};
  void post(std::coroutine_handle<> h) const noexcept { h.resume(); }
};

struct with_scheduler {
  struct promise_type {
    large_scheduler scheduler;
    large_scheduler get_scheduler() const noexcept { return scheduler; }
    with_scheduler get_return_object() noexcept { return {}; }
    std::suspend_never initial_suspend() noexcept { return {}; }
    std::suspend_never final_suspend() noexcept { return {}; }
    void return_void() noexcept {}
    void unhandled_exception() noexcept { std::terminate(); }
  };
};

with_scheduler await_on_large_scheduler(ferry::transfer t) { (void)co_await t; }

int main() {}

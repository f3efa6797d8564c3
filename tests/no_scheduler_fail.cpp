// Must NOT compile: a coroutine whose promise has no get_scheduler() awaits a transfer without
// resume_on. tests/meson.build checks that the compiler's message says what to do.
#include <coroutine>
#include <exception>

#include <ferry/transfer.hpp>

struct bare {
  struct promise_type {
    bare get_return_object() noexcept { return {}; }
    std::suspend_never initial_suspend() noexcept { return {}; }
    std::suspend_never final_suspend() noexcept { return {}; }
    void return_void() noexcept {}
    void unhandled_exception() noexcept { std::terminate(); }
  };
};

bare await_without_scheduler(ferry::transfer t) { co_await t; }

int main() {}

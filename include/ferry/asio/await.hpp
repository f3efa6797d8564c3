#pragma once
// async_await(awaitable, token): any ferry awaitable (a ferry::task, when_all(...), resume_on(...),
// a transfer) as an Asio asynchronous operation, so that an asio::awaitable coroutine, a callback
// or a future can await it. The completion signature is void(std::exception_ptr, R), where R is
// what co_await on the awaitable yields, or void(std::exception_ptr) when it yields nothing: an
// exception from the awaitable goes to the handler (asio::use_awaitable rethrows it).
//
// The awaitable runs inside a small coroutine whose scheduler is the handler's associated executor
// (asio_scheduler), so a ferry::task started this way runs its awaits there, and the handler runs
// there too, always through a post. The awaitable starts inside the initiating call, as a co_await
// would start it.
//
// It passes on no stop request: a task or when_all has nothing to stop it with, so a cancellation
// signal is ignored and `async_await(...) || timer` waits for the awaitable to end. For a wait that
// Asio can cancel, use async_wait_all, async_drain or async_wait (ferry/asio/wait.hpp).

#include <asio/associated_executor.hpp>
#include <asio/async_result.hpp>
#include <asio/executor_work_guard.hpp>
#include <asio/post.hpp>
#include <coroutine>
#include <exception>
#include <optional>
#include <type_traits>
#include <utility>

#include "ferry/asio/scheduler.hpp"
#include "ferry/scheduler.hpp"

namespace ferry {

namespace detail::asio_await {

template <class Awaitable>
using await_result_t =
    decltype(std::declval<std::remove_cvref_t<decltype(get_awaiter(std::declval<Awaitable>()))>&>()
                 .await_resume());

template <class R>
struct signature {
  using type = void(std::exception_ptr, R);
};
template <>
struct signature<void> {
  using type = void(std::exception_ptr);
};

// A fire-and-forget coroutine that resumes on an Asio executor. The scheduler lives in the promise
// and get_scheduler() returns a reference to it: an asio_scheduler over an any_io_executor is too
// large for ferry to copy into every await (the pattern docs/asio.md describes).
template <class Executor>
struct driver {
  struct promise_type {
    asio_scheduler<Executor> scheduler;

    template <class... Args>
    explicit promise_type(const ::asio::executor_work_guard<Executor>& work, Args&...)
        : scheduler(work.get_executor()) {}

    asio_scheduler<Executor>& get_scheduler() noexcept { return scheduler; }
    driver get_return_object() noexcept { return {}; }
    std::suspend_never initial_suspend() noexcept { return {}; }
    std::suspend_never final_suspend() noexcept { return {}; }
    void return_void() noexcept {}
    // Exceptions from the awaitable are caught in run(); asio::post failing to allocate is all
    // that is left, and with the handler unposted there is nobody to tell.
    void unhandled_exception() noexcept { std::terminate(); }
  };
};

// The awaitable (a task's frame, which holds a reference to its exception) is destroyed, and the
// exception moved into the handler, before the post: the handler may run at once on another thread
// and must be the last to touch them.
template <class Executor, class Awaitable, class Handler>
driver<Executor> run(::asio::executor_work_guard<Executor> work, Awaitable awaitable,
                     Handler handler) {
  using result = await_result_t<Awaitable>;
  std::exception_ptr error;
  const Executor ex = work.get_executor();
  if constexpr (std::is_void_v<result>) {
    {
      Awaitable awaited = std::move(awaitable);
      try {
        co_await std::move(awaited);
      } catch (...) {
        error = std::current_exception();
      }
    }
    ::asio::post(ex, [h = std::move(handler), e = std::move(error), w = std::move(work)]() mutable {
      std::move(h)(std::move(e));
    });
  } else {
    std::optional<result> value;
    {
      Awaitable awaited = std::move(awaitable);
      try {
        value.emplace(co_await std::move(awaited));
      } catch (...) {
        error = std::current_exception();
      }
    }
    // The handler takes a value even with an exception; the type's default stands in for it.
    ::asio::post(ex, [h = std::move(handler), e = std::move(error), v = std::move(value),
                      w = std::move(work)]() mutable {
      std::move(h)(std::move(e), v ? std::move(*v) : result{});
    });
  }
}

struct initiate {
  template <class Handler, class Awaitable>
  void operator()(Handler&& handler, Awaitable&& awaitable) const {
    using executor = ::asio::associated_executor_t<std::decay_t<Handler>, ::asio::system_executor>;
    ::asio::executor_work_guard<executor> work(
        ::asio::get_associated_executor(handler, ::asio::system_executor()));
    run(std::move(work), std::forward<Awaitable>(awaitable), std::forward<Handler>(handler));
  }
};

}  // namespace detail::asio_await

/// Any ferry awaitable as an Asio operation: the handler gets void(std::exception_ptr, R), R being
/// what `co_await` on it yields, on its associated executor.
/// The awaitable is moved into the operation (a task, a when_all) or, for an lvalue, copied (a
/// transfer). A when_all's members must stay valid until the handler runs.
template <class Awaitable, class CompletionToken>
auto async_await(Awaitable&& awaitable, CompletionToken&& token) {
  using value = std::remove_cvref_t<Awaitable>;
  using result = detail::asio_await::await_result_t<value>;
  static_assert(!std::is_reference_v<result>,
                "ferry::async_await: the awaitable must yield a value, not a reference");
  static_assert(std::is_void_v<result> || std::is_default_constructible_v<result>,
                "ferry::async_await: the handler's value must be default-constructible, since the "
                "signature void(std::exception_ptr, R) passes one beside an exception");
  return ::asio::async_initiate<CompletionToken,
                                typename detail::asio_await::signature<result>::type>(
      detail::asio_await::initiate{}, token, value(std::forward<Awaitable>(awaitable)));
}

}  // namespace ferry

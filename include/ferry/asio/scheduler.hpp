#pragma once
// asio_scheduler<Executor>: a ferry scheduler over an Asio executor. A coroutine resumed through it
// goes on inside a handler run by that executor (an io_context's threads, a strand), never on the
// thread that completed the transfer.
//
// It holds the executor by value, so how it is passed depends on the executor's size: an
// io_context::executor_type (one pointer) or a strand of it fits in any_scheduler and may be
// returned by value from a promise's get_scheduler(); an any_io_executor (56 bytes with libstdc++)
// does not, and ferry refuses it at compile time. Keep that scheduler where it outlives the
// coroutine (the promise, an engine object) and return a reference to it (docs/asio.md).
//
// post() is noexcept, as ferry requires, while Asio's post allocates (from the handler's recycling
// allocator, usually without a call to operator new): if that allocation fails the process ends on
// the completing thread. Should the executor's context be destroyed with the handle still queued,
// the coroutine is never resumed, as with any handler Asio drops at shutdown.

#include <asio/any_io_executor.hpp>
#include <asio/post.hpp>
#include <coroutine>
#include <type_traits>
#include <utility>

namespace ferry {

/// A ferry scheduler over an Asio executor: coroutines resume inside handlers that `Executor` runs.
///
/// Holds the executor by value: an io_context's executor or a strand of it fits in any_scheduler;
/// an any_io_executor does not, so keep such a scheduler somewhere and return a reference to it.
template <class Executor = ::asio::any_io_executor>
class asio_scheduler {
 public:
  using executor_type = Executor;  ///< the Asio executor it posts to

  /// A scheduler posting to `ex`.
  explicit asio_scheduler(Executor ex) noexcept(std::is_nothrow_move_constructible_v<Executor>)
      : executor_(std::move(ex)) {}

  /// Posts `h`'s resumption to the executor (asio::post). The process ends if Asio cannot
  /// allocate the handler.
  void post(std::coroutine_handle<> h) const noexcept {
    ::asio::post(executor_, [h] { h.resume(); });
  }

  /// The executor it posts to.
  [[nodiscard]] const executor_type& get_executor() const noexcept { return executor_; }

 private:
  Executor executor_;
};

}  // namespace ferry

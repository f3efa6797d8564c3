#pragma once
// A value the directory's executor is making (a publication, a record, a lookup of many names, a
// watch event): co_await it in a coroutine, get() it (blocks), or wait on made() beside transfers.

#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <system_error>
#include <utility>

#include "ferry/detail/made_awaiter.hpp"
#include "ferry/transfer.hpp"

namespace ferry {

template <class T>
class pending_result;

namespace detail {

template <class T>
struct result_state {
  std::optional<T> value;  // written before the transfer succeeds
  std::string what;        // written before the transfer fails: the error in words
  bool taken = false;      // the caller's side only
};

// The producer's end of a pending_result: completes it once; later calls do nothing and return
// false. Not thread-safe on its own: the directory completes a sink from one thread, or under the
// lock of what owns it.
template <class T>
class result_sink {
 public:
  result_sink() = default;
  result_sink(std::shared_ptr<result_state<T>> s, completer c) : s_(std::move(s)), c_(std::move(c)) {}

  bool succeed(T v) {
    if (!c_.valid()) return false;
    s_->value.emplace(std::move(v));
    return std::exchange(c_, completer{}).succeed();
  }
  bool fail(std::error_code ec, std::string what) {
    if (!c_.valid()) return false;
    s_->what = std::move(what);
    return std::exchange(c_, completer{}).fail(ec);
  }
  [[nodiscard]] bool open() const noexcept { return c_.valid(); }

 private:
  std::shared_ptr<result_state<T>> s_;
  completer c_;
};

template <class T>
[[nodiscard]] std::pair<pending_result<T>, result_sink<T>> make_result();

}  // namespace detail

/// A value the directory is making: co_await it in a coroutine (it resumes on the coroutine's
/// scheduler with the value, or throws std::system_error saying what failed), get() it (blocks),
/// or wait on made() in a batch beside other transfers, then get() it without blocking.
/// Dropping it unawaited is safe.
template <class T>
class pending_result {
 public:
  /// An empty handle: made() is an empty transfer and get() throws std::logic_error.
  pending_result() = default;

  /// Ends when the value is made or could not be: for batch waits beside other transfers.
  [[nodiscard]] const transfer& made() const noexcept { return made_; }

  /// True once get() will not block.
  [[nodiscard]] bool ready() const noexcept { return made_.done(); }

  /// Waits for the value and takes it. Throws std::system_error (its code a directory_errc, its
  /// message naming what was wrong) when it could not be made, std::logic_error when it was taken.
  T get() {
    if (!s_) throw std::logic_error("ferry::pending_result: empty handle");
    (void)made_.wait();
    if (made_.state() != transfer_state::success) {
      throw std::system_error(made_.error(), s_->what.empty() ? "ferry directory" : s_->what);
    }
    if (s_->taken) throw std::logic_error("ferry::pending_result: the value was already taken");
    s_->taken = true;
    return std::move(*s_->value);
  }

  /// `co_await` yields the value, or throws as get() does.
  [[nodiscard]] auto operator co_await() { return detail::made_awaiter<pending_result>(*this); }

 private:
  friend std::pair<pending_result<T>, detail::result_sink<T>> detail::make_result<T>();
  pending_result(std::shared_ptr<detail::result_state<T>> s, transfer t)
      : s_(std::move(s)), made_(std::move(t)) {}

  std::shared_ptr<detail::result_state<T>> s_;
  transfer made_;
};

namespace detail {

template <class T>
std::pair<pending_result<T>, result_sink<T>> make_result() {
  auto s = std::make_shared<result_state<T>>();
  auto [t, c] = make_manual_transfer();
  return {pending_result<T>(s, std::move(t)), result_sink<T>(s, std::move(c))};
}

}  // namespace detail

}  // namespace ferry

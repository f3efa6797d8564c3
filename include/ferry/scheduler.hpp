#pragma once
// Where a coroutine resumes. A scheduler is anything with a noexcept post(std::coroutine_handle<>): a
// user's own event loop qualifies as it is. A coroutine that awaits a ferry awaitable resumes on the
// scheduler its promise names through get_scheduler(), or on the one given with
// resume_on(scheduler, awaitable).
//
// post() must not throw. ferry calls it on whichever thread completes the transfer (the progress
// executor's, a timer's, the user's own), after the verdict is decided: there is nobody to hand an
// exception to, and a continuation that was not posted would never resume. So a scheduler whose
// post() is not noexcept is refused at compile time, with a message that says so. A post that may
// fail to allocate must deal with that itself (ferry::run_loop reserves its queue and never throws
// once constructed); declaring it noexcept where it may still throw ends the process on that
// thread, as noexcept does anywhere.

#include <concepts>
#include <coroutine>
#include <cstddef>
#include <new>
#include <type_traits>
#include <utility>

namespace ferry {

/// A type whose noexcept post(std::coroutine_handle<>) resumes the handle on its own thread(s).
template <class S>
concept scheduler = requires(S& s, std::coroutine_handle<> h) {
  { s.post(h) } noexcept;
};

namespace detail {

// Has a post(), noexcept or not: to tell "not a scheduler" from "post() may throw" in messages.
template <class S>
concept has_post = requires(S& s, std::coroutine_handle<> h) { s.post(h); };

template <class S>
consteval bool check_scheduler() {
  static_assert(has_post<S>,
                "ferry: a scheduler needs a member post(std::coroutine_handle<>) that resumes the "
                "handle on the scheduler's own thread");
  static_assert(!has_post<S> || scheduler<S>,
                "ferry: the scheduler's post(std::coroutine_handle<>) must be noexcept. ferry posts "
                "continuations from the thread that completed a transfer, where an exception has "
                "nowhere to go and a continuation not posted would never resume: make post() "
                "noexcept and handle a failure to queue inside it");
  return true;
}

}  // namespace detail

/// Resumes on the completing thread, which may be the progress executor's. Explicit opt-in only:
/// the continuation then runs inside the executor's loop and delays every other completion. Like any
/// post, it must not throw: a coroutine resumed here whose promise lets an exception leave resume()
/// (an unhandled_exception() that rethrows) ends the process, on the completing thread.
struct inline_scheduler {
  /// Resumes `h` at once, on the calling thread.
  void post(std::coroutine_handle<> h) const noexcept { h.resume(); }
};

/// A copyable, type-erased scheduler: either a small scheduler value held inline, or a reference to a
/// scheduler that outlives every coroutine using it.
class any_scheduler {
  struct ops {
    void (*post)(const void* storage, std::coroutine_handle<> h) noexcept;
    void (*copy)(void* to, const void* from) noexcept;
    void (*destroy)(void* storage) noexcept;
  };

  template <class S>
  static constexpr ops value_ops{
      [](const void* storage, std::coroutine_handle<> h) noexcept {
        // Copy first: posting may resume the coroutine that owns `storage`, which may then free it.
        S local(*static_cast<const S*>(storage));
        local.post(h);
      },
      [](void* to, const void* from) noexcept { ::new (to) S(*static_cast<const S*>(from)); },
      [](void* storage) noexcept { static_cast<S*>(storage)->~S(); },
  };

  template <class S>
  static constexpr ops reference_ops{
      [](const void* storage, std::coroutine_handle<> h) noexcept {
        S* target = *static_cast<S* const*>(storage);
        target->post(h);
      },
      [](void* to, const void* from) noexcept { ::new (to) S*(*static_cast<S* const*>(from)); },
      [](void*) noexcept {},
  };

 public:
  /// The largest scheduler held by value (four pointers); a larger one is held by reference.
  static constexpr std::size_t inline_capacity = 4 * sizeof(void*);

  /// No scheduler: converts to false, and post() must not be called.
  any_scheduler() noexcept = default;

  /// Holds a copy of `s`, like the standard's scheduler handles.
  template <detail::has_post S>
    requires(!std::same_as<std::remove_cvref_t<S>, any_scheduler>)
  explicit any_scheduler(S s) noexcept {
    static_assert(detail::check_scheduler<S>());
    static_assert(sizeof(S) <= inline_capacity && alignof(S) <= alignof(std::max_align_t),
                  "ferry: this scheduler is too large to copy: a scheduler returned by value "
                  "from get_scheduler() (or given to any_scheduler) must fit in four pointers, "
                  "because ferry copies it into every suspended await without allocating (a "
                  "continuation posted from a completing thread must not fail to allocate). Keep "
                  "the scheduler somewhere that outlives the coroutine (a member of the promise, "
                  "an engine object) and return a reference from get_scheduler(): "
                  "`my_scheduler& get_scheduler() noexcept { return sched_; }`; ferry then holds "
                  "one pointer to it (an Asio any_io_executor is 56 bytes: see docs/asio.md)");
    static_assert(std::is_nothrow_copy_constructible_v<S>,
                  "ferry: a scheduler returned by value must be nothrow copy-constructible");
    ::new (static_cast<void*>(storage_)) S(std::move(s));
    ops_ = &value_ops<S>;
  }

  /// Refers to `s`, which must outlive every coroutine that resumes through it.
  template <detail::has_post S>
  [[nodiscard]] static any_scheduler reference(S& s) noexcept {
    static_assert(detail::check_scheduler<S>());
    any_scheduler a;
    S* p = &s;
    ::new (static_cast<void*>(a.storage_)) S*(p);
    a.ops_ = &reference_ops<S>;
    return a;
  }

  /// A copy of the value `other` holds, or the same reference.
  any_scheduler(const any_scheduler& other) noexcept : ops_(other.ops_) {
    if (ops_ != nullptr) ops_->copy(storage_, other.storage_);
  }

  /// Drops what this holds and copies what `other` holds.
  any_scheduler& operator=(const any_scheduler& other) noexcept {
    if (this != &other) {
      reset();
      ops_ = other.ops_;
      if (ops_ != nullptr) ops_->copy(storage_, other.storage_);
    }
    return *this;
  }

  /// Destroys the scheduler held by value (a referenced one is left alone).
  ~any_scheduler() { reset(); }

  /// Posts `h` to the scheduler held; undefined on an empty any_scheduler.
  void post(std::coroutine_handle<> h) const noexcept { ops_->post(storage_, h); }

  /// True when it holds a scheduler.
  [[nodiscard]] explicit operator bool() const noexcept { return ops_ != nullptr; }

 private:
  void reset() noexcept {
    if (ops_ != nullptr) ops_->destroy(storage_);
    ops_ = nullptr;
  }

  const ops* ops_ = nullptr;
  alignas(std::max_align_t) unsigned char storage_[inline_capacity]{};
};

namespace detail {

// A promise that names a scheduler; whether its post() is noexcept is checked where it is used, so
// that a throwing post() gets its own message rather than "the promise has no get_scheduler()".
template <class P>
concept promise_with_scheduler = requires(P& p) {
  { p.get_scheduler() };
  requires has_post<std::remove_cvref_t<decltype(p.get_scheduler())>>;
};

// The scheduler a promise names: a value is copied, an lvalue reference is referred to.
template <promise_with_scheduler P>
[[nodiscard]] any_scheduler scheduler_of(P& promise) noexcept {
  using result = decltype(promise.get_scheduler());
  using plain = std::remove_cvref_t<result>;
  if constexpr (std::same_as<plain, any_scheduler>) {
    return promise.get_scheduler();
  } else if constexpr (std::is_lvalue_reference_v<result>) {
    return any_scheduler::reference(const_cast<plain&>(promise.get_scheduler()));
  } else {
    return any_scheduler(promise.get_scheduler());
  }
}

template <class>
inline constexpr bool always_false = false;

// Shared by every ferry awaiter: find the scheduler in the awaiting coroutine's promise, or fail to
// compile with a message that says what to do.
template <class Awaiter, class Promise>
decltype(auto) suspend_on_promise_scheduler(Awaiter& awaiter, std::coroutine_handle<Promise> h) {
  if constexpr (promise_with_scheduler<Promise>) {
    return awaiter.await_suspend_on(h, scheduler_of(h.promise()));
  } else {
    static_assert(always_false<Promise>,
                  "ferry: the awaiting coroutine's promise has no get_scheduler(), so ferry does not "
                  "know where to resume it. Await inside ferry::task, give your promise a "
                  "get_scheduler(), or write co_await ferry::resume_on(scheduler, awaitable).");
    return false;
  }
}

template <class A>
concept has_member_co_await = requires(A&& a) { std::forward<A>(a).operator co_await(); };

template <class A>
decltype(auto) get_awaiter(A&& a) {
  if constexpr (has_member_co_await<A>) {
    return std::forward<A>(a).operator co_await();
  } else {
    return std::forward<A>(a);
  }
}

// ferry's awaiters resume through a given scheduler when asked with await_suspend_on.
template <class A>
concept scheduled_awaiter = requires(A& a, std::coroutine_handle<> h, any_scheduler s) {
  a.await_ready();
  a.await_suspend_on(h, s);
  a.await_resume();
};

}  // namespace detail

/// What resume_on(s, awaitable) returns: awaited once, as an rvalue.
/// co_await resume_on(s, awaitable): awaits a ferry awaitable (a transfer, a when_all, a task) and
/// resumes on `s`, whatever the awaiting coroutine's promise says.
template <detail::has_post S, class Awaitable>
class resume_on_awaitable {
  static_assert(detail::check_scheduler<S>());
  using stored = std::conditional_t<std::is_lvalue_reference_v<Awaitable>, Awaitable,
                                    std::remove_cvref_t<Awaitable>>;
  using inner_awaiter = std::remove_cvref_t<decltype(detail::get_awaiter(std::declval<stored>()))>;
  static_assert(detail::scheduled_awaiter<inner_awaiter>,
                "ferry::resume_on takes ferry awaitables: a transfer, when_all(...) or a task");

 public:
  /// Keeps a reference to `s` and the awaitable (moved in, or referred to if an lvalue).
  resume_on_awaitable(S& s, Awaitable&& a)
      : scheduler_(s), awaitable_(std::forward<Awaitable>(a)) {}

  /// The awaiter of resume_on: the inner awaitable's, resuming through the given scheduler.
  class awaiter {
   public:
    /// Wraps the awaiter of `a`, to resume on `s`.
    awaiter(S& s, stored& a)
        : scheduler_(any_scheduler::reference(s)),
          inner_(detail::get_awaiter(static_cast<stored&&>(a))) {}

    /// The inner awaiter's await_ready.
    bool await_ready() { return inner_.await_ready(); }
    /// A ferry::task told first that it is leaving its own scheduler hands its result back through
    /// that scheduler when it ends, so that whoever awaits it goes on where it belongs.
    template <class Promise>
    decltype(auto) await_suspend(std::coroutine_handle<Promise> h) {
      if constexpr (requires(Promise& p) { p.note_resumed_elsewhere(); }) {
        h.promise().note_resumed_elsewhere();
      }
      return inner_.await_suspend_on(h, scheduler_);
    }
    /// The inner awaiter's result.
    decltype(auto) await_resume() { return inner_.await_resume(); }

   private:
    any_scheduler scheduler_;
    inner_awaiter inner_;
  };

  /// The awaiter; a resume_on is awaited once, as an rvalue.
  awaiter operator co_await() && { return awaiter(scheduler_, awaitable_); }

 private:
  S& scheduler_;
  stored awaitable_;
};

/// Awaits `awaitable` (a transfer, when_all(...), a task) and resumes on `s`, which must outlive
/// the await; any coroutine can await it, whatever its promise. Use: `co_await resume_on(s, t)`.
template <detail::has_post S, class Awaitable>
[[nodiscard]] resume_on_awaitable<S, Awaitable> resume_on(S& s, Awaitable&& awaitable) {
  return resume_on_awaitable<S, Awaitable>(s, std::forward<Awaitable>(awaitable));
}

}  // namespace ferry

#pragma once
// spawn(scheduler, task): starts a task on any scheduler and lets it run detached. The task starts
// on the scheduler's thread (it is posted there, so spawn itself runs none of it) and every await
// inside resumes there, as if a coroutine on that scheduler had awaited it.
//
// A detached task has nobody to rethrow to, so its outcome goes to a completion function:
// on_done(std::exception_ptr), called on the scheduler's thread when the task ends, with null when
// it returned normally (a task<T>'s value is dropped: await it inside a task<void> to keep it).
// on_done must not throw (the process ends if it does). Spawned without one, a task whose
// exception escapes ends the process through std::terminate, as one escaping a std::thread does.
//
// The scheduler is held by reference (an any_scheduler is copied) and must outlive the task; it
// must also run what is posted to it, or the task never starts and its frame is never freed.

#include <exception>
#include <type_traits>
#include <utility>

#include "ferry/detail/detached_task.hpp"
#include "ferry/scheduler.hpp"
#include "ferry/task.hpp"

namespace ferry {

/// Starts `t` detached on `scheduler` and calls `on_done(exception_ptr)` there when it ends (null
/// when it returned normally; a task<T>'s value is dropped). on_done must not throw.
/// Throws std::bad_alloc, before anything runs, when the frame that drives the task cannot be made.
template <detail::has_post S, class T, class OnDone>
requires std::is_invocable_v<OnDone&, std::exception_ptr>
void spawn(S& scheduler, task<T> t, OnDone on_done) {
  static_assert(detail::check_scheduler<std::remove_cv_t<S>>());
  auto done = [on_done = std::move(on_done)](std::exception_ptr error, auto&&...) mutable {
    on_done(std::move(error));
  };
  detail::run_detached(std::move(t), std::move(done)).start_on(detail::hold_scheduler(scheduler));
}

/// Starts `t` detached on `scheduler`; an exception escaping it ends the process (std::terminate).
template <detail::has_post S, class T>
void spawn(S& scheduler, task<T> t) {
  // Rethrown inside a noexcept function: std::terminate, whose default handler names the exception.
  spawn(scheduler, std::move(t), [](std::exception_ptr error) noexcept {
    if (error) std::rethrow_exception(error);
  });
}

}  // namespace ferry

// Schedulers: resume_on, inline_scheduler, any_scheduler, a user's own promise and scheduler.

#include <catch2/catch.hpp>

#include <atomic>
#include <thread>
#include <vector>

#include <ferry/ferry.hpp>

#include "helpers.hpp"

using namespace ferry_test;
using ferry::transfer_state;

namespace {

// A user's own scheduler handle, returned by value from get_scheduler(): one pointer, copied into
// each awaiter like the standard's scheduler handles.
struct loop_handle {
  ferry::run_loop* loop;
  void post(std::coroutine_handle<> h) const noexcept { loop->post(h); }
};

// A user's own task type whose promise names its scheduler by value.
struct user_task {
  struct promise_type {
    loop_handle sched;
    std::atomic<bool>* finished;
    promise_type(ferry::run_loop& l, ferry::transfer, std::atomic<bool>& f)
        : sched{&l}, finished(&f) {}
    loop_handle get_scheduler() const noexcept { return sched; }
    user_task get_return_object() noexcept { return {}; }
    std::suspend_never initial_suspend() noexcept { return {}; }
    std::suspend_never final_suspend() noexcept { return {}; }
    void return_void() noexcept { finished->store(true); }
    void unhandled_exception() noexcept { std::terminate(); }
  };
};

std::atomic<std::thread::id> user_task_thread{};

user_task user_coroutine(ferry::run_loop& loop, ferry::transfer t, std::atomic<bool>&) {
  co_await hop{loop};
  // Not `if (co_await t == ...)`: g++ 12 miscompiles a co_await inside an if/while/switch condition
  // after an earlier suspension (README, "Compilers").
  const transfer_state s = co_await t;
  if (s == transfer_state::success) user_task_thread.store(std::this_thread::get_id());
}

// A coroutine with no scheduler at all: it may await ferry awaitables only through resume_on.
struct bare_task {
  struct promise_type {
    bare_task get_return_object() noexcept { return {}; }
    std::suspend_never initial_suspend() noexcept { return {}; }
    std::suspend_never final_suspend() noexcept { return {}; }
    void return_void() noexcept {}
    void unhandled_exception() noexcept { std::terminate(); }
  };
};

bare_task bare_coroutine(ferry::run_loop& loop, ferry::transfer t, std::atomic<int>& state,
                         std::atomic<std::thread::id>& where) {
  const transfer_state s = co_await ferry::resume_on(loop, t);
  where.store(std::this_thread::get_id());
  state.store(static_cast<int>(s));
}

ferry::task<int> add_one(int x) { co_return x + 1; }

}  // namespace

TEST_CASE("a user's promise naming its scheduler by value resumes on that scheduler",
          "[scheduler][concurrency]") {
  engine_thread engine;
  auto [t, c] = ferry::make_manual_transfer();
  std::atomic<bool> finished{false};
  user_coroutine(engine.loop(), t, finished);
  std::this_thread::sleep_for(5ms);
  std::thread completer([c = c]() mutable { c.succeed(); });
  completer.join();
  while (!finished.load()) std::this_thread::yield();
  CHECK(user_task_thread.load() == engine.id());
}

TEST_CASE("resume_on gives a scheduler to a coroutine that has none", "[scheduler][concurrency]") {
  engine_thread engine;
  auto [t, c] = ferry::make_manual_transfer();
  std::atomic<int> state{-1};
  std::atomic<std::thread::id> where{};
  bare_coroutine(engine.loop(), t, state, where);  // suspends on this thread
  std::thread completer([c = c]() mutable { c.succeed(); });
  completer.join();
  while (state.load() < 0) std::this_thread::yield();
  CHECK(state.load() == static_cast<int>(transfer_state::success));
  CHECK(where.load() == engine.id());
}

TEST_CASE("resume_on overrides the promise's scheduler for one await", "[scheduler][concurrency]") {
  engine_thread a;
  engine_thread b;
  auto [t, c] = ferry::make_manual_transfer();
  std::vector<ferry::transfer> ts{t};
  std::atomic<bool> done{false};
  std::atomic<std::thread::id> after_batch{};
  [](ferry::run_loop& la, ferry::run_loop& lb, std::vector<ferry::transfer>& v,
     std::atomic<std::thread::id>& where, std::atomic<bool>& fin) -> detached {
    // Suspends here, on this thread, with the batch certainly pending: its one member completes
    // only below. Without the override it would resume on la, the promise's scheduler.
    (void)la;
    const auto r = co_await ferry::resume_on(lb, ferry::when_all(v, std::chrono::seconds(10)));
    if (r.ok()) where.store(std::this_thread::get_id());
    fin.store(true);
  }(a.loop(), b.loop(), ts, after_batch, done);
  c.succeed();
  while (!done.load()) std::this_thread::yield();
  CHECK(after_batch.load() == b.id());
}

TEST_CASE("resume_on a task runs it and resumes the caller through the given scheduler",
          "[scheduler][concurrency]") {
  engine_thread engine;
  std::atomic<int> value{0};
  std::atomic<std::thread::id> where{};
  [](ferry::run_loop& l, std::atomic<int>& out, std::atomic<std::thread::id>& w) -> bare_task {
    out.store(co_await ferry::resume_on(l, add_one(6)));
    w.store(std::this_thread::get_id());
  }(engine.loop(), value, where);
  while (value.load() == 0) std::this_thread::yield();
  while (where.load() == std::thread::id{}) std::this_thread::yield();
  CHECK(value.load() == 7);
  CHECK(where.load() == engine.id());
}

TEST_CASE("inline_scheduler resumes on the completing thread, by explicit choice",
          "[scheduler][concurrency]") {
  ferry::inline_scheduler inline_sched;
  auto made = ferry::make_manual_transfer();
  std::atomic<std::thread::id> where{};
  std::atomic<bool> refused{false};
  [](ferry::inline_scheduler& s, ferry::transfer tt, ferry::completer again,
     std::atomic<std::thread::id>& w, std::atomic<bool>& r) -> bare_task {
    (void)co_await ferry::resume_on(s, tt);
    w.store(std::this_thread::get_id());
    // Still inside the completer's call: completing the same transfer again must not deadlock.
    r.store(!again.fail(std::make_error_code(std::errc::io_error)));
  }(inline_sched, made.first, made.second, where, refused);
  std::thread completer([c = made.second]() mutable { c.succeed(); });
  const auto completer_id = completer.get_id();
  completer.join();
  CHECK(refused.load());
  CHECK(where.load() == completer_id);
  CHECK(made.first.state() == transfer_state::success);
}

TEST_CASE("any_scheduler copies value schedulers and refers to lvalue ones", "[scheduler]") {
  ferry::run_loop loop;
  const loop_handle h{&loop};
  ferry::any_scheduler by_value(h);
  ferry::any_scheduler by_reference = ferry::any_scheduler::reference(loop);
  ferry::any_scheduler copy = by_value;
  CHECK(static_cast<bool>(copy));
  CHECK_FALSE(static_cast<bool>(ferry::any_scheduler{}));
  copy.post(std::noop_coroutine());
  by_reference.post(std::noop_coroutine());
  CHECK(loop.size() == 2);
  CHECK(loop.poll() == 2);
}

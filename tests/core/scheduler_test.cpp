// Schedulers: run_loop, task and sync_wait, resume_on, a user's own promise and scheduler.

#include <catch2/catch.hpp>

#include <atomic>
#include <memory>
#include <random>
#include <stdexcept>
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
  void post(std::coroutine_handle<> h) const { loop->post(h); }
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

ferry::task<int> nested(int depth) {
  if (depth == 0) co_return 0;
  const int below = co_await nested(depth - 1);
  co_return below + co_await add_one(0);
}

ferry::task<void> throws_after_await(ferry::transfer t) {
  (void)co_await t;
  throw std::runtime_error("boom after the transfer");
}

}  // namespace

TEST_CASE("run_loop: post, run_one, poll and stop", "[scheduler]") {
  ferry::run_loop loop;
  CHECK(loop.poll() == 0);
  loop.post(std::noop_coroutine());
  loop.post(std::noop_coroutine());
  CHECK(loop.size() == 2);
  CHECK(loop.run_one());
  CHECK(loop.poll() == 1);
  loop.stop();
  CHECK_FALSE(loop.run_one());  // the stop is consumed...
  const auto start = clock_type::now();  // before the stopper's sleep can begin
  std::thread stopper([&] {
    std::this_thread::sleep_for(20ms);
    loop.stop();
  });
  loop.run();  // ...so this run sleeps until the next stop
  stopper.join();
  CHECK(ms_since(start) >= 15);
}

namespace {

// Posts `rounds` hops to `engine` from this thread, pausing `gap` before each; every hop must run on
// the engine thread.
void hop_rounds(engine_thread& engine, int rounds, std::chrono::microseconds gap) {
  for (int i = 0; i < rounds; ++i) {
    if (gap.count() != 0) std::this_thread::sleep_for(gap);
    std::atomic<bool> ran{false};
    std::atomic<std::thread::id> where{};
    [](ferry::run_loop& l, std::atomic<bool>& r, std::atomic<std::thread::id>& w) -> detached {
      co_await hop{l};
      w.store(std::this_thread::get_id());
      r.store(true);
    }(engine.loop(), ran, where);
    while (!ran.load()) std::this_thread::yield();
    REQUIRE(where.load() == engine.id());
  }
}

}  // namespace

TEST_CASE("run_loop wakes a sleeping run() for work posted from another thread",
          "[scheduler][concurrency]") {
  SECTION("a loop that sleeps at once") {
    engine_thread engine(0ns);
    hop_rounds(engine, 1000, 0us);
  }
  SECTION("a spinning loop, posted to while it spins and after it has gone to sleep") {
    engine_thread engine(200us);
    hop_rounds(engine, 1000, 0us);
    hop_rounds(engine, 50, 1000us);
  }
}

TEST_CASE("run_loop: posts from several threads to a loop that keeps falling asleep all run",
          "[scheduler][concurrency]") {
  // A loop that sleeps at once, posted to from four threads at irregular moments: each post may
  // land just before the loop registers as a sleeper, just after, or while an earlier post's wake
  // is still on its way. A wake that is claimed but never delivered leaves the loop asleep with
  // work queued, and the count below stops short.
  constexpr int posters = 4;
  constexpr int per_poster = 5000;
  std::atomic<int> ran{0};  // before the engine, which may still run a late hop as it stops
  engine_thread engine(0ns);
  std::vector<std::thread> threads;
  for (int p = 0; p < posters; ++p) {
    threads.emplace_back([&, p] {
      std::minstd_rand pause(static_cast<unsigned>(p + 1));
      for (int i = 0; i < per_poster; ++i) {
        [](ferry::run_loop& l, std::atomic<int>& count) -> detached {
          co_await hop{l};
          count.fetch_add(1, std::memory_order_relaxed);
        }(engine.loop(), ran);
        // Mostly back to back, now and then long enough for the loop to go to sleep.
        if (pause() % 8 == 0) std::this_thread::sleep_for(std::chrono::microseconds(pause() % 50));
      }
    });
  }
  for (auto& t : threads) t.join();
  const auto deadline = clock_type::now() + 60s;
  while (ran.load() != posters * per_poster && clock_type::now() < deadline) {
    std::this_thread::sleep_for(1ms);
  }
  REQUIRE(ran.load() == posters * per_poster);
}

TEST_CASE("run_loop: a stop racing with the loop going to sleep always ends run()",
          "[scheduler][concurrency]") {
  // Each stop lands at a different point of a loop that sleeps at once: before it looks at the
  // queue, while it registers as a sleeper, or once it sleeps. A stop lost there leaves run() asleep.
  constexpr int rounds = 20000;
  ferry::run_loop loop(0ns);
  std::atomic<int> runs_ended{0};
  std::atomic<bool> give_up{false};
  std::atomic<bool> finished{false};
  std::thread runner([&] {
    for (int i = 0; i < rounds && !give_up.load(); ++i) {
      loop.run();
      runs_ended.fetch_add(1);
    }
    finished.store(true);
  });
  std::minstd_rand pause(7);
  int ended = 0;
  for (int i = 0; i < rounds; ++i) {
    // A busy look (yielding if the runner is off its CPU), so that the pause below starts as the
    // runner heads back into run(); the pause then spreads the stops over the few hundred
    // nanoseconds it takes to reach the futex.
    for (int look = 0; runs_ended.load() != i; ++look) {
      if (look < 1000) {
        ferry::detail::cpu_relax();
      } else {
        std::this_thread::yield();
      }
    }
    for (unsigned spin = pause() % 64; spin != 0; --spin) ferry::detail::cpu_relax();
    loop.stop();
    const auto deadline = clock_type::now() + 60s;
    while (runs_ended.load() == i && clock_type::now() < deadline) std::this_thread::yield();
    ended = runs_ended.load();
    if (ended != i + 1) break;
  }
  give_up.store(true);
  while (!finished.load()) {  // lets a failed round's runner finish, so that it can be joined
    loop.stop();
    std::this_thread::sleep_for(1ms);
  }
  runner.join();
  CHECK(ended == rounds);
}

TEST_CASE("run_loop: an idle loop's spin ends early for work and for stop", "[scheduler]") {
  // A spin far longer than the test: waiting it out would show as a hang.
  ferry::run_loop loop(std::chrono::seconds(30));
  const auto start = clock_type::now();  // before the poster's first sleep can begin
  std::thread poster([&] {
    std::this_thread::sleep_for(20ms);
    loop.post(std::noop_coroutine());
    std::this_thread::sleep_for(20ms);
    loop.stop();
  });
  CHECK(loop.run_one());
  CHECK_FALSE(loop.run_one());
  poster.join();
  CHECK(ms_since(start) >= 35);
  CHECK(ms_since(start) < 10'000);
}

TEST_CASE("run_loop: the spins it takes, and the ones it refuses", "[scheduler]") {
  const ferry::run_loop adaptive;
  CHECK(adaptive.spin() == ferry::run_loop::default_spin);
  CHECK(adaptive.max_spin() == ferry::run_loop::default_max_spin);
  CHECK(adaptive.current_spin() == ferry::run_loop::default_spin);
  const ferry::run_loop fixed(3us);
  CHECK(fixed.spin() == 3us);
  CHECK(fixed.max_spin() == 3us);
  const ferry::run_loop given(10us, 2ms);
  CHECK(given.spin() == 10us);
  CHECK(given.max_spin() == 2ms);
  CHECK(given.current_spin() == 10us);
  CHECK_THROWS_WITH(ferry::run_loop(100us, 50us),
                    Catch::Contains("max_spin must not be less than spin"));
  CHECK_THROWS_WITH(ferry::run_loop(-1us, 50us), Catch::Contains("spin must not be negative"));

  // A fixed negative spin means none.
  ferry::run_loop loop(-5ms);
  CHECK(loop.spin() == 0ns);
  CHECK(loop.max_spin() == 0ns);
  std::thread stopper([&] {
    std::this_thread::sleep_for(20ms);
    loop.stop();
  });
  loop.run();
  stopper.join();
  loop.post(std::noop_coroutine());
  CHECK(loop.poll() == 1);
}

namespace {

struct idle_record {
  std::uint64_t late_sleeps = 0;  // over the last half of the posts
  std::chrono::nanoseconds spin_before_last{};  // as the last gap began (the stop after it may
                                                // end one more sleep, and move the spin again)
};

// Runs `loop` on this thread while another posts `count` items to it, `gap` apart (at least).
idle_record run_posted_every(ferry::run_loop& loop, int count, std::chrono::microseconds gap) {
  std::uint64_t halfway = 0;
  std::chrono::nanoseconds spin_before_last{};
  std::thread poster([&] {
    for (int i = 0; i < count; ++i) {
      if (i == count / 2) halfway = loop.sleeps();
      if (i == count - 1) spin_before_last = loop.current_spin();
      std::this_thread::sleep_for(gap);
      loop.post(std::noop_coroutine());
    }
    loop.stop();
  });
  loop.run();
  poster.join();
  return {loop.sleeps() - halfway, spin_before_last};
}

}  // namespace

TEST_CASE("run_loop: an adaptive spin grows to meet work that keeps coming, and shrinks after",
          "[scheduler][concurrency]") {
  // Posts 200 us apart or more: longer than the least spin, so a fixed one sleeps before nearly
  // every post; far shorter than the most (5 ms, which a busy machine's hiccups rarely reach), so
  // an adaptive one soon stops sleeping at all.
  constexpr int posts = 400;
  constexpr auto gap = 200us;
  const auto least = GENERATE(0us, 20us);
  CAPTURE(least.count());

  ferry::run_loop fixed(least);
  CHECK(run_posted_every(fixed, posts, gap).late_sleeps >= posts / 4);

  ferry::run_loop adaptive(least, 5ms);
  const idle_record busy = run_posted_every(adaptive, posts, gap);
  CHECK(busy.late_sleeps <= posts / 16);
  CHECK(busy.spin_before_last >= gap);
  CHECK(busy.spin_before_last <= 5ms);

  // Posts 20 ms apart, longer than the most: each sleep halves the spin, back to the least (from
  // 5 ms, eight halvings reach 20 us, and with a least of 0 twelve bring it under 2 us).
  const idle_record quiet = run_posted_every(adaptive, 24, 20ms);
  if (least == 0us) {
    CHECK(quiet.spin_before_last < 2us);
  } else {
    CHECK(quiet.spin_before_last == least);
  }
}

TEST_CASE("task: values, nesting, exceptions and sync_wait", "[scheduler]") {
  CHECK(ferry::sync_wait(add_one(41)) == 42);
  CHECK(ferry::sync_wait(nested(50)) == 50);

  auto [t, c] = ferry::make_manual_transfer();
  c.succeed();
  CHECK_THROWS_WITH(ferry::sync_wait(throws_after_await(t)),
                    Catch::Contains("boom after the transfer"));
}

TEST_CASE("sync_wait drives a user's run_loop, running other work posted to it",
          "[scheduler][concurrency]") {
  ferry::progress_executor exec;
  ferry::loopback_backend lb{exec};
  ferry::run_loop loop;
  std::vector<std::byte> src(256, std::byte{3}), dst(256);
  const auto state = ferry::sync_wait(loop, [&]() -> ferry::task<transfer_state> {
    co_return co_await lb.copy(dst, src);
  }());
  CHECK(state == transfer_state::success);
  CHECK(dst == src);
}

TEST_CASE("run_loop: the loop may be destroyed as soon as run() returns to a stop from another "
          "thread",
          "[scheduler][concurrency]") {
  // sync_wait's loop lives just that long: it is freed the moment run() returns. A stop() that
  // still wrote to the loop after making the stop visible is a use after free, which TSan names
  // (it did for the stop that set a flag and then moved the futex word, in most runs of this test).
  std::minstd_rand pause(11);
  constexpr int rounds = 2000;
  for (int i = 0; i < rounds; ++i) {
    auto loop = std::make_unique<ferry::run_loop>(i % 2 == 0 ? 0ns : 20us);
    std::atomic<bool> running{false};
    std::thread stopper([&running, raw = loop.get(), spin = pause() % 2000] {
      while (!running.load()) std::this_thread::yield();
      for (unsigned k = 0; k < spin; ++k) ferry::detail::cpu_relax();
      raw->stop();
    });
    running.store(true);
    loop->run();
    loop.reset();
    stopper.join();
  }
}

TEST_CASE("task: a caller resumes on its own scheduler even when the task it awaited ended on "
          "another thread",
          "[scheduler][concurrency]") {
  // The child goes on, through resume_on, on the thread that completes its transfer, and ends
  // there. Transferring straight back would run the caller on that thread too, off its run_loop.
  // A round where the transfer completed before the child suspended shows nothing (the child never
  // moved), so rounds repeat until enough of them did move.
  ferry::inline_scheduler on_completer;
  const auto child = [](ferry::transfer t, ferry::inline_scheduler& s,
                        std::atomic<bool>& awaiting) -> ferry::task<std::thread::id> {
    awaiting.store(true);
    (void)co_await ferry::resume_on(s, t);
    co_return std::this_thread::get_id();
  };
  int moved = 0;
  for (int round = 0; round < 1000 && moved < 20; ++round) {
    std::atomic<bool> awaiting{false};
    auto [t, c] = ferry::make_manual_transfer();
    std::thread completer([&awaiting, c = std::move(c)]() mutable {
      while (!awaiting.load()) std::this_thread::yield();
      std::this_thread::sleep_for(1ms);
      (void)c.succeed();
    });
    using ids_t = std::pair<std::thread::id, std::thread::id>;  // where the child ended, the caller
    const ids_t ids = ferry::sync_wait([](auto child, ferry::transfer t, ferry::inline_scheduler& s,
                                          std::atomic<bool>& awaiting) -> ferry::task<ids_t> {
      const std::thread::id child_ended_on = co_await child(t, s, awaiting);
      co_return ids_t{child_ended_on, std::this_thread::get_id()};
    }(child, t, on_completer, awaiting));
    completer.join();
    if (ids.first == std::this_thread::get_id()) continue;  // the child never left
    ++moved;
    REQUIRE(ids.second == std::this_thread::get_id());  // the caller went on on sync_wait's loop
  }
  CHECK(moved == 20);
}

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

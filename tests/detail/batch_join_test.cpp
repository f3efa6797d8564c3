// detail::batch_join: the one-word join behind wait_all, when_all and drain, driven directly.

#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <coroutine>
#include <cstddef>
#include <random>
#include <span>
#include <thread>
#include <vector>

#include <ferry/detail/batch_join.hpp>

#include "helpers.hpp"

using namespace ferry_test;
using ferry::transfer_state;
using ferry::verdict;
using ferry::detail::batch_join;
using ferry::detail::batch_mode;

namespace {

// A scheduler that counts the verdicts delivered to it and resumes nothing.
struct counting_scheduler {
  std::atomic<int>* posts;
  void post(std::coroutine_handle<>) const noexcept { posts->fetch_add(1); }
};

// A join on `members` that delivers to a blocked thread, started; finished when it goes.
class blocking_join {
 public:
  blocking_join(std::span<const ferry::transfer> members, batch_mode mode,
                ferry::detail::timer_service* timers = nullptr,
                ferry::detail::clock::time_point deadline = {})
      : members_(members), join_(batch_join::create(members.size(), mode)) {
    join_->deliver_to_sleeper();
    decided_at_start_ = join_->start(members, timers, deadline);
  }
  blocking_join(const blocking_join&) = delete;
  blocking_join& operator=(const blocking_join&) = delete;
  ~blocking_join() { join_->finish(); }

  [[nodiscard]] bool decided_at_start() const { return decided_at_start_; }
  ferry::batch_result wait(const ferry::detail::clock::time_point* deadline) {
    if (!decided_at_start_) join_->wait_blocking(deadline);
    return join_->result(members_);
  }

 private:
  std::span<const ferry::transfer> members_;
  batch_join* join_;
  bool decided_at_start_ = false;
};

}  // namespace

TEST_CASE("batch_join: members already ended decide during start, pending ones later", "[detail]") {
  SECTION("every member already succeeded") {
    batch b(3);
    for (auto& c : b.completers) c.succeed();
    blocking_join j(b.transfers, batch_mode::short_circuit);
    CHECK(j.decided_at_start());
    CHECK(j.wait(nullptr).verdict == verdict::success);
  }
  SECTION("an empty handle fails the batch at once") {
    std::vector<ferry::transfer> v(2);
    blocking_join j(v, batch_mode::short_circuit);
    CHECK(j.decided_at_start());
    const auto r = j.wait(nullptr);
    CHECK(r.verdict == verdict::failed);
    CHECK(r.error == ferry::errc::empty_transfer);
  }
  SECTION("pending members: the last completion decides") {
    batch b(4);
    blocking_join j(b.transfers, batch_mode::short_circuit);
    CHECK_FALSE(j.decided_at_start());
    std::thread t([&] {
      for (auto& c : b.completers) c.succeed();
    });
    const auto r = j.wait(nullptr);
    t.join();
    CHECK(r.verdict == verdict::success);
    CHECK(r.pending == 0);
  }
}

TEST_CASE("batch_join: a failure decides a short-circuit join at once, but a drain only once all "
          "have ended",
          "[detail]") {
  batch b(4);
  SECTION("short circuit") {
    blocking_join j(b.transfers, batch_mode::short_circuit);
    b.completers[2].fail(io_error);
    const auto r = j.wait(nullptr);
    CHECK(r.verdict == verdict::failed);
    CHECK(r.first_failed == 2u);
    CHECK(r.error == std::errc::io_error);
    CHECK(r.pending == 3);
  }
  SECTION("drain") {
    blocking_join j(b.transfers, batch_mode::drain);
    b.completers[2].fail(io_error);
    const auto soon = ferry::detail::clock::now() + 20ms;
    auto r = j.wait(&soon);
    CHECK(r.verdict == verdict::timed_out);  // a failure alone decides nothing in a drain
    CHECK(r.pending == 3);
  }
  SECTION("drain, every member ended") {
    blocking_join j(b.transfers, batch_mode::drain);
    b.completers[2].fail(io_error);
    for (std::size_t i : {0u, 1u, 3u}) b.completers[i].succeed();
    const auto r = j.wait(nullptr);
    CHECK(r.verdict == verdict::failed);
    CHECK(r.first_failed == 2u);
    CHECK(r.pending == 0);
  }
}

TEST_CASE("batch_join: the armed timer decides a join whose members stay pending", "[detail]") {
  std::atomic<int> kicks{0};
  ferry::detail::timer_service timers(
      [](void* k) noexcept { static_cast<std::atomic<int>*>(k)->fetch_add(1); }, &kicks);
  batch b(2);
  const auto deadline = ferry::detail::clock::now() + 1h;
  blocking_join j(b.transfers, batch_mode::short_circuit, &timers, deadline);
  CHECK(kicks.load() == 1);  // the join's deadline became the earliest
  CHECK(timers.next_deadline() == deadline);
  b.completers[0].succeed();
  CHECK(timers.fire_expired(deadline) == 1);
  const auto r = j.wait(nullptr);
  CHECK(r.verdict == verdict::timed_out);
  CHECK(r.pending == 1);
}

TEST_CASE("batch_join: a join that finished before its members ended is not touched by them",
          "[detail]") {
  // Under AddressSanitizer a member's late notification into a freed join is reported.
  batch b(8);
  {
    blocking_join j(b.transfers, batch_mode::short_circuit);
    b.completers[0].fail(io_error);
    CHECK(j.wait(nullptr).verdict == verdict::failed);
  }
  for (std::size_t i = 1; i < b.completers.size(); ++i) b.completers[i].succeed();
}

TEST_CASE("batch_join: exactly one of racing completions, a failure and the deadline delivers the "
          "verdict",
          "[detail][concurrency]") {
  // Two completers, a failing member and the timer firing on a third thread all race with
  // registration: each of those events may be the one that makes the verdict decidable, and the
  // CLAIMED flag lets exactly one of them deliver it. Two deliveries would resume a coroutine twice.
  constexpr int rounds = 2000;
  constexpr std::size_t members = 8;
  std::minstd_rand pick(5);
  for (int round = 0; round < rounds; ++round) {
    std::atomic<int> posts{0};
    ferry::detail::timer_service timers([](void*) noexcept {}, nullptr);
    batch b(members);
    const std::size_t failing = pick() % (members + 1);  // == members: none fails
    std::atomic<int> started{0};
    const auto complete_range = [&](std::size_t from, std::size_t to) {
      started.fetch_add(1);
      while (started.load() < 3) std::this_thread::yield();
      for (std::size_t i = from; i < to; ++i) {
        if (i == failing) {
          b.completers[i].fail(io_error);
        } else {
          b.completers[i].succeed();
        }
      }
    };
    std::thread first(complete_range, 0, members / 2);
    std::thread second(complete_range, members / 2, members);
    std::thread timer([&] {
      started.fetch_add(1);
      while (started.load() < 3) std::this_thread::yield();
      (void)timers.fire_expired(ferry::detail::clock::now());
    });
    batch_join* join = batch_join::create(members, batch_mode::short_circuit);
    join->deliver_to(std::noop_coroutine(), ferry::any_scheduler(counting_scheduler{&posts}));
    const bool decided = join->start(b.transfers, &timers, ferry::detail::clock::now());
    first.join();
    second.join();
    timer.join();
    (void)timers.fire_expired(ferry::detail::clock::now());  // in case registration armed late
    const ferry::batch_result r = join->result(b.transfers);
    join->finish();
    REQUIRE(posts.load() + (decided ? 1 : 0) == 1);
    if (r.verdict == verdict::failed) REQUIRE(r.first_failed == failing);
    if (r.verdict == verdict::success) REQUIRE(failing == members);
  }
}

// What a member that never ends keeps once its wait is over: its own status, and no node of the
// join (a join sized for N members would otherwise stay allocated until that member ends).
namespace {

// Linked waiters, and references held, on a member's status.
std::size_t linked(const ferry::transfer& t) { return t.status()->linked_waiters(); }
std::uint32_t references(const ferry::transfer& t) { return t.status()->references(); }

}  // namespace

TEST_CASE("batch_join: a wait past its deadline leaves nothing on a member that never ends",
          "[detail][regression]") {
  // The blocking form: the deadline is a futex timeout, and finish() sweeps at once.
  batch b(64);
  {
    const auto deadline = ferry::detail::clock::now() + 1ms;
    blocking_join j(b.transfers, batch_mode::short_circuit, nullptr, deadline);
    for (std::size_t i = 1; i < b.completers.size(); ++i) b.completers[i].succeed();
    CHECK(j.wait(&deadline).verdict == verdict::timed_out);
    CHECK(linked(b.transfers[0]) == 1);  // until the waiting side is done with the join
  }
  CHECK(linked(b.transfers[0]) == 0);
  CHECK(references(b.transfers[0]) == 2);  // its transfer and its completer, nothing of the join
  b.completers[0].succeed();
}

TEST_CASE("batch_join: a short-circuit verdict leaves its pending members to the deadline's timer",
          "[detail][regression]") {
  ferry::detail::timer_service timers([](void*) noexcept {}, nullptr);
  batch b(3);
  const auto deadline = ferry::detail::clock::now() + 1h;
  {
    blocking_join j(b.transfers, batch_mode::short_circuit, &timers, deadline);
    b.completers[2].fail(io_error);
    CHECK(j.wait(nullptr).verdict == verdict::failed);
  }
  // Members 0 and 1 are still pending: their nodes stay until they end or the deadline passes.
  CHECK(linked(b.transfers[0]) == 1);
  CHECK(linked(b.transfers[1]) == 1);
  CHECK_FALSE(timers.empty());

  SECTION("both end before the deadline: the last one disarms the timer and frees the join") {
    b.completers[0].succeed();
    CHECK_FALSE(timers.empty());
    b.completers[1].succeed();
    CHECK(timers.empty());
  }
  SECTION("one never ends: the deadline sweeps it") {
    b.completers[0].succeed();
    CHECK(timers.fire_expired(deadline) == 1);
    CHECK(linked(b.transfers[1]) == 0);
    CHECK(references(b.transfers[1]) == 2);
    b.completers[1].succeed();
  }
}

TEST_CASE("batch_join: a blocking wait decided early hands its pending members to the timer thread",
          "[detail][regression]") {
  batch b(2);
  SECTION("with a deadline: swept once it passes") {
    {
      const auto deadline = ferry::detail::clock::now() + 1s;
      blocking_join j(b.transfers, batch_mode::short_circuit, nullptr, deadline);
      b.completers[1].fail(io_error);
      CHECK(j.wait(&deadline).verdict == verdict::failed);
    }
    CHECK(linked(b.transfers[0]) == 1);  // the deadline has not passed yet (1 s)
    CHECK(wait_until([&] { return linked(b.transfers[0]) == 0; }));
  }
  SECTION("without one: swept at once, off the waiting thread") {
    {
      blocking_join j(b.transfers, batch_mode::short_circuit);
      b.completers[1].fail(io_error);
      CHECK(j.wait(nullptr).verdict == verdict::failed);
    }
    CHECK(wait_until([&] { return linked(b.transfers[0]) == 0; }));
  }
  CHECK(wait_until([&] { return references(b.transfers[0]) == 2; }));
  b.completers[0].succeed();
}

TEST_CASE("batch_join: the deadline's sweep and members ending at that moment each give back their "
          "status once",
          "[detail][concurrency]") {
  // The sweep runs on the timer's thread while members end on two others and the waiting side lets
  // go of the transfers: a member's status reference given back twice frees a status its completer
  // still completes (AddressSanitizer reports it; the plain build sees a reference count off by
  // one), and one given back never pins it. Each round ends with every status held by its transfer
  // and completer only.
  constexpr int rounds = 1500;
  constexpr std::size_t members = 16;
  std::minstd_rand pick(11);
  for (int round = 0; round < rounds; ++round) {
    ferry::detail::timer_service timers([](void*) noexcept {}, nullptr);
    batch b(members);
    const std::size_t failing = pick() % members;
    std::vector<ferry::transfer> kept(b.transfers.begin(), b.transfers.end());  // our own handles
    const auto deadline = ferry::detail::clock::now();
    {
      blocking_join j(b.transfers, batch_mode::short_circuit, &timers, deadline + 1h);
      b.completers[failing].fail(io_error);
      CHECK(j.wait(nullptr).verdict == verdict::failed);
    }
    b.transfers.clear();  // the waiting side lets go; `kept` watches the statuses
    std::atomic<int> started{0};
    const auto go = [&] {
      started.fetch_add(1);
      while (started.load() < 3) std::this_thread::yield();
    };
    const auto complete_every = [&](std::size_t from) {
      go();
      for (std::size_t i = from; i < members; i += 2) {
        if (i != failing) b.completers[i].succeed();
      }
    };
    std::thread even(complete_every, 0);
    std::thread odd(complete_every, 1);
    std::thread timer([&] {
      go();
      (void)timers.fire_expired(deadline + 1h);
    });
    even.join();
    odd.join();
    timer.join();
    REQUIRE(timers.empty());
    for (const auto& t : kept) {
      REQUIRE(t.status()->linked_waiters() == 0);
      REQUIRE(t.status()->references() == 2);  // `kept` and the completer group
    }
  }
}

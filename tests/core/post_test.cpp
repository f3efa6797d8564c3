// post_with_backoff: retries a full submission queue with growing pauses until one deadline, then
// hands back an ordinary failed transfer.

#include <catch2/catch.hpp>

#include <chrono>
#include <functional>
#include <optional>
#include <vector>

#include <ferry/post.hpp>
#include <ferry/run_loop.hpp>
#include <ferry/task.hpp>

#include "helpers.hpp"

using namespace ferry_test;
using ferry::transfer_state;

TEST_CASE("post_with_backoff hands back the transfer the backend takes, pausing longer after each "
          "refusal",
          "[post]") {
  std::vector<clock_type::time_point> tries;
  const ferry::transfer t = ferry::post_with_backoff(
      [&]() -> std::optional<ferry::transfer> {
        tries.push_back(clock_type::now());
        if (tries.size() < 4) return std::nullopt;
        return ferry::make_completed_transfer(transfer_state::success);
      },
      clock_type::now() + hang_bound, ferry::backoff_options{1ms, 4ms});
  REQUIRE(tries.size() == 4);
  CHECK(t.state() == transfer_state::success);
  // Pauses of 1, 2 and 4 ms (at least: sleeping may take longer, never shorter).
  CHECK(tries[1] - tries[0] >= 1ms);
  CHECK(tries[2] - tries[1] >= 2ms);
  CHECK(tries[3] - tries[2] >= 4ms);
}

TEST_CASE("post_with_backoff tries once more at the deadline, and then fails with "
          "submission_queue_full",
          "[post]") {
  int tries = 0;
  const auto deadline = clock_type::now() + 20ms;
  const ferry::transfer t = ferry::post_with_backoff(
      [&]() -> std::optional<ferry::transfer> {
        ++tries;
        return std::nullopt;
      },
      deadline, ferry::backoff_options{1ms, 1s});
  CHECK(clock_type::now() >= deadline);
  CHECK(tries >= 2);
  CHECK(t.state() == transfer_state::failed);
  CHECK(t.error() == ferry::errc::submission_queue_full);

  // A deadline already past still gets one try.
  tries = 0;
  const ferry::transfer taken = ferry::post_with_backoff(
      [&]() -> std::optional<ferry::transfer> {
        ++tries;
        return ferry::make_completed_transfer(transfer_state::success);
      },
      clock_type::now() - 1s);
  CHECK(tries == 1);
  CHECK(taken.state() == transfer_state::success);
}

TEST_CASE("post_with_backoff: zero or negative pauses neither overflow nor spin without sleeping",
          "[post]") {
  int tries = 0;
  const auto start = clock_type::now();
  const ferry::transfer t = ferry::post_with_backoff(
      [&]() -> std::optional<ferry::transfer> {
        ++tries;
        return std::nullopt;
      },
      std::chrono::steady_clock::now() + 20ms, ferry::backoff_options{-5ms, -1ms});
  CHECK(t.error() == ferry::errc::submission_queue_full);
  CHECK(ms_since(start) < 10'000);
  CHECK(tries < 100'000);  // it paused between tries, not spun
}

namespace {

using submit_fn = std::function<std::optional<ferry::transfer>()>;

// A free function: g++ 12 rejects some coroutine lambdas.
ferry::task<void> post_into(ferry::transfer& out, submit_fn submit,
                            std::chrono::milliseconds budget) {
  out = co_await ferry::post_with_backoff_async(std::move(submit), clock_type::now() + budget,
                                                ferry::backoff_options{1ms, 4ms});
}

detached count_when_run(ferry::run_loop& loop, int& ran) {
  co_await hop{loop};
  ++ran;
}

}  // namespace

TEST_CASE("post_with_backoff_async pauses on a timer: the awaiting thread runs other work meanwhile",
          "[post][concurrency]") {
  ferry::run_loop engine;  // driven by this thread through sync_wait
  int other_work_ran = 0;
  int ran_when_taken = -1;
  int tries = 0;
  ferry::transfer t;
  const submit_fn submit = [&]() -> std::optional<ferry::transfer> {
    if (++tries == 1) count_when_run(engine, other_work_ran);
    if (tries < 3) return std::nullopt;
    ran_when_taken = other_work_ran;
    return ferry::make_completed_transfer(transfer_state::success);
  };
  ferry::sync_wait(engine, post_into(t, submit, hang_bound));
  CHECK(tries == 3);
  CHECK(ran_when_taken == 1);  // the thread was not asleep in a pause
  CHECK(t.state() == transfer_state::success);
}

TEST_CASE("post_with_backoff_async fails with submission_queue_full at its deadline", "[post]") {
  ferry::run_loop engine;
  ferry::transfer t;
  const auto start = clock_type::now();
  ferry::sync_wait(engine, post_into(t, [] { return std::optional<ferry::transfer>{}; }, 20ms));
  CHECK(ms_since(start) < 5000);
  CHECK(t.error() == ferry::errc::submission_queue_full);
}

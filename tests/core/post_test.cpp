// post_with_backoff: retries a full submission queue with growing pauses until one deadline, then
// hands back an ordinary failed transfer.

#include <catch2/catch.hpp>

#include <chrono>
#include <optional>
#include <vector>

#include <ferry/post.hpp>

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

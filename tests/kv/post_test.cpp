// kv/post.hpp: the kv layer posts through ferry's post_with_backoff, under ferry::kv's names.

#include <catch2/catch.hpp>

#include <chrono>
#include <optional>
#include <type_traits>

#include <ferry/kv/post.hpp>

#include "helpers.hpp"

using namespace ferry_test;

static_assert(std::is_same_v<ferry::kv::backoff_options, ferry::backoff_options>);

TEST_CASE("kv::post_with_backoff retries a full queue and fails it at the deadline", "[kv]") {
  int tries = 0;
  const ferry::transfer taken = ferry::kv::post_with_backoff(
      [&]() -> std::optional<ferry::transfer> {
        if (++tries < 3) return std::nullopt;
        return ferry::make_completed_transfer(ferry::transfer_state::success);
      },
      clock_type::now() + hang_bound, ferry::kv::backoff_options{});
  CHECK(tries == 3);
  CHECK(taken.state() == ferry::transfer_state::success);

  const ferry::transfer refused = ferry::kv::post_with_backoff(
      [] { return std::optional<ferry::transfer>{}; }, clock_type::now() + 5ms);
  CHECK(refused.error() == ferry::errc::submission_queue_full);
}

#pragma once
// Posting into a backend whose submission queue may be full: retry with exponential backoff until one
// deadline, then hand back an ordinary failed transfer, so a full queue is never a silent drop and
// never a hang.

#include <algorithm>
#include <chrono>
#include <optional>
#include <thread>
#include <type_traits>
#include <utility>

#include "ferry/errors.hpp"
#include "ferry/transfer.hpp"

namespace ferry {

struct backoff_options {
  std::chrono::nanoseconds initial = std::chrono::microseconds(2);
  std::chrono::nanoseconds limit = std::chrono::milliseconds(1);  // the longest single pause
};

// `submit()` returns std::optional<transfer>: a transfer when the backend took the request, nullopt
// when its submission queue is full. Retried, with pauses doubling from `initial` up to `limit`, until
// `deadline`; after that the result is a transfer already failed with errc::submission_queue_full.
template <class Submit>
  requires std::is_same_v<std::remove_cvref_t<std::invoke_result_t<Submit&>>, std::optional<transfer>>
[[nodiscard]] transfer post_with_backoff(Submit&& submit, std::chrono::steady_clock::time_point deadline,
                                         backoff_options options = {}) {
  auto pause = std::max(options.initial, std::chrono::nanoseconds(1));
  for (;;) {
    if (std::optional<transfer> t = submit()) return std::move(*t);
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) {
      return make_completed_transfer(transfer_state::failed, errc::submission_queue_full);
    }
    std::this_thread::sleep_for(std::min<std::chrono::nanoseconds>(
        pause, std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - now)));
    // Doubled up to the limit (at least the first pause), without overflowing for a limit near
    // the largest duration.
    const auto limit = std::max({options.limit, options.initial, pause});
    pause = pause > limit / 2 ? limit : pause * 2;
  }
}

}  // namespace ferry

#pragma once
// Verdicts over a batch of transfers: poll_all looks, wait_all blocks with one shared deadline and
// returns the moment any member fails, drain waits until every member is terminal.

#include <chrono>
#include <cstddef>
#include <span>

#include "ferry/batch_result.hpp"
#include "ferry/poll_all.hpp"
#include "ferry/detail/batch_join.hpp"
#include "ferry/detail/timeout.hpp"
#include "ferry/transfer.hpp"

namespace ferry {

namespace detail {

[[nodiscard]] inline batch_result wait_batch(std::span<const transfer> members, timeout t,
                                             batch_mode mode) {
  batch_result r = poll_all(members);
  const bool decided =
      mode == batch_mode::short_circuit ? r.verdict != verdict::pending : r.pending == 0;
  if (decided || t.is_look()) {
    if (r.verdict == verdict::failed) name_first_failure(r, members);
    return r;
  }
  if (members.size() > max_batch_members) {
    return {verdict::failed, std::nullopt, make_error_code(errc::batch_too_large),
            members.size()};
  }
  const clock::time_point deadline = t.is_bounded() ? t.deadline() : clock::time_point{};
  batch_join* join = batch_join::create(members.size(), mode);
  join->deliver_to_sleeper();
  if (!join->start(members, nullptr, deadline)) {
    join->wait_blocking(t.is_bounded() ? &deadline : nullptr);
  }
  r = join->result(members);
  join->finish();
  return r;
}

}  // namespace detail

/// Blocks until the verdict: failed the moment any member fails (whatever its index), success when the
/// last member succeeds, timed_out when the one shared deadline passes with members pending and none
/// failed. timeout < 0: no deadline; == 0: exactly poll_all; > 0: up to that long.
template <class Rep, class Period>
[[nodiscard]] batch_result wait_all(std::span<const transfer> members,
                                    std::chrono::duration<Rep, Period> timeout) {
  return detail::wait_batch(members, detail::make_timeout(timeout),
                            detail::batch_mode::short_circuit);
}

/// Blocks until every member is terminal, failures included, so that every destination buffer is
/// quiescent; timed_out if the deadline passes first. The verdict is failed if any member failed.
template <class Rep, class Period>
[[nodiscard]] batch_result drain(std::span<const transfer> members,
                                 std::chrono::duration<Rep, Period> timeout) {
  return detail::wait_batch(members, detail::make_timeout(timeout), detail::batch_mode::drain);
}

}  // namespace ferry

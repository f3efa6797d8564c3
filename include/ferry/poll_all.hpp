#pragma once
// poll_all: the verdict over a batch right now, without waiting.

#include <cstddef>
#include <cstdint>
#include <span>

#include "ferry/batch_result.hpp"
#include "ferry/detail/status_block.hpp"
#include "ferry/errors.hpp"
#include "ferry/transfer.hpp"

namespace ferry {

namespace detail {

// One look at every member, in index order: the verdict, with `first_sequence` the number of the
// earliest failure seen. `settled`: before looking at a member, wait for any completion of it under
// way (see name_first_failure).
[[nodiscard]] inline batch_result look_at(std::span<const transfer> members,
                                          std::uint64_t& first_sequence,
                                          bool settled = false) noexcept {
  batch_result r;
  for (std::size_t i = 0; i < members.size(); ++i) {
    const transfer& t = members[i];
    if (settled && t.status() != nullptr) t.status()->wait_for_completion_under_way();
    const transfer_state s = t.state();
    if (s == transfer_state::success) continue;
    if (s == transfer_state::pending) {
      ++r.pending;
      continue;
    }
    const status_block* block = t.status();
    const completion_event ev =
        block == nullptr ? completion_event{s, make_error_code(errc::empty_transfer), 0}
                         : block->event();
    if (!r.first_failed || ev.sequence < first_sequence) {
      r.first_failed = i;
      r.error = ev.error;
      first_sequence = ev.sequence;
    }
  }
  r.verdict = r.first_failed ? verdict::failed
              : r.pending != 0 ? verdict::pending
                               : verdict::success;
  return r;
}

// What a batch wait (wait_all, when_all, drain, the Asio waits) does before it reports `failed`,
// whichever way it decided, so that it names the failure first in time without exception; poll_all
// does not, since it never waits. A failing completer takes its number while it holds its status's
// lock and publishes before it lets go (status_block::complete): every failure numbered before one
// the caller has seen either shows in its member's state or still holds that member's lock, even
// if its completer was preempted in between. So each member's completion under way is waited for
// (for moments, or for as long as such a completer is kept off its CPU), then the member is read.
// One pass over the members, on the failure path only.
inline void name_first_failure(batch_result& r, std::span<const transfer> members) noexcept {
  std::uint64_t first_sequence = 0;
  const batch_result look = look_at(members, first_sequence, true);
  if (look.first_failed) {
    r.first_failed = look.first_failed;
    r.error = look.error;
  }
}

}  // namespace detail

/// The verdict over `members` right now, from a look at each: never waits.
/// success iff every member succeeded; failed if any member failed or was cancelled, even with others
/// pending; otherwise pending. Empty: success. Never blocks, never drives progress.
///
/// first_failed is the failure first in time (lowest sequence number), not the lowest index: if
/// member i's failure was published before member j's failure took its number, j is never named. A
/// look in index order can pass i while it is still pending and then find j further on; it can do
/// so only if j took its number while the look ran (above `before`), so only then is a second look
/// made. Having seen j's state (acquire, pairing with its release publish), the second look sees
/// everything published before j's number was taken, i included. When the earliest failure the
/// first look saw is numbered at or below `before`, the load of `before` already ordered every
/// failure published before that number ahead of the look, so one look is enough. The common paths
/// (no failure, or failures older than the look) cost one load more than a single look.
[[nodiscard]] inline batch_result poll_all(std::span<const transfer> members) noexcept {
  // Acquire pairs with the acq_rel number-taking in status_block::complete() (see above).
  const std::uint64_t before = detail::failures.sequence.load(std::memory_order_acquire);
  std::uint64_t first_sequence = 0;
  const batch_result r = detail::look_at(members, first_sequence);
  if (!r.first_failed || first_sequence <= before) return r;
  return detail::look_at(members, first_sequence);
}

}  // namespace ferry

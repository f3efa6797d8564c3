#pragma once
// poll_all: the verdict over a batch right now, without waiting.

#include <cstddef>
#include <cstdint>
#include <span>

#include "ferry/batch_result.hpp"
#include "ferry/errors.hpp"
#include "ferry/transfer.hpp"

namespace ferry {

// success iff every member succeeded; failed if any member failed or was cancelled, even with others
// pending; otherwise pending. Empty: success. Never blocks, never drives progress.
[[nodiscard]] inline batch_result poll_all(std::span<const transfer> members) noexcept {
  batch_result r;
  std::uint64_t first_sequence = 0;
  for (std::size_t i = 0; i < members.size(); ++i) {
    const transfer& t = members[i];
    const transfer_state s = t.state();
    if (s == transfer_state::success) continue;
    if (s == transfer_state::pending) {
      ++r.pending;
      continue;
    }
    const detail::status_block* block = t.status();
    const detail::completion_event ev =
        block == nullptr
            ? detail::completion_event{s, make_error_code(errc::empty_transfer), 0}
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

}  // namespace ferry

#pragma once

#include <cstddef>
#include <optional>
#include <system_error>

namespace ferry {

/// A batch's verdict (poll_all, wait_all, when_all, drain): `success` when every member succeeded
/// (an empty batch too), `failed` when any member failed or was cancelled (a failure wins over
/// pending), `pending` when members are still running (a look, or drain's deadline), `timed_out`
/// when the deadline passed with members still pending and none failed.
enum class verdict { success, failed, pending, timed_out };

/// The verdict's name ("success", "failed", "pending", "timed_out"); "invalid" otherwise.
[[nodiscard]] constexpr const char* to_string(verdict v) noexcept {
  switch (v) {
    case verdict::success: return "success";
    case verdict::failed: return "failed";
    case verdict::pending: return "pending";
    case verdict::timed_out: return "timed_out";
  }
  return "invalid";
}

/// What a batch wait returns: the verdict, the member that failed first and its error.
/// After a verdict the remaining transfers keep running.
struct batch_result {
  /// The batch's verdict.
  ferry::verdict verdict = ferry::verdict::success;
  std::optional<std::size_t> first_failed;  ///< index of the member whose failure came first in time
  std::error_code error;                    ///< that member's error
  std::size_t pending = 0;                  ///< members still pending when the verdict was reached

  /// True when the verdict is success (every member succeeded).
  [[nodiscard]] bool ok() const noexcept { return verdict == ferry::verdict::success; }
};

}  // namespace ferry

#pragma once

#include "ferry/detail/config.hpp"

#include <cstdint>

namespace ferry {

/// The state of a transfer: `pending`, then exactly one of `success`, `failed`, `cancelled`.
/// pending -> exactly one of success, failed, cancelled. Terminal states absorb: the first completion
/// wins and every later attempt changes nothing.
enum class transfer_state : std::uint32_t { pending = 0, success = 1, failed = 2, cancelled = 3 };

/// The state's name ("pending", "success", "failed", "cancelled"); "invalid" otherwise.
[[nodiscard]] constexpr const char* to_string(transfer_state s) noexcept {
  switch (s) {
    case transfer_state::pending: return "pending";
    case transfer_state::success: return "success";
    case transfer_state::failed: return "failed";
    case transfer_state::cancelled: return "cancelled";
  }
  return "invalid";
}

}  // namespace ferry

#pragma once

#include <cstddef>
#include <optional>
#include <system_error>

namespace ferry {

enum class verdict { success, failed, pending, timed_out };

[[nodiscard]] constexpr const char* to_string(verdict v) noexcept {
  switch (v) {
    case verdict::success: return "success";
    case verdict::failed: return "failed";
    case verdict::pending: return "pending";
    case verdict::timed_out: return "timed_out";
  }
  return "invalid";
}

struct batch_result {
  ferry::verdict verdict = ferry::verdict::success;
  std::optional<std::size_t> first_failed;  // index of the member whose failure came first in time
  std::error_code error;                    // that member's error
  std::size_t pending = 0;                  // members still pending when the verdict was reached

  [[nodiscard]] bool ok() const noexcept { return verdict == ferry::verdict::success; }
};

}  // namespace ferry

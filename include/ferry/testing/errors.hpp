#pragma once
// The test doubles' own error codes.

#include <system_error>

#include "ferry/detail/error_category.hpp"

namespace ferry::testing {

enum class errc : int {
  injected_fault = 1,
};

[[nodiscard]] constexpr const char* describe(errc e) noexcept {
  switch (e) {
    case errc::injected_fault: return "failure injected by ferry::fault_injector";
  }
  return nullptr;
}

[[nodiscard]] inline const std::error_category& error_category() noexcept {
  return ferry::detail::error_category_of<errc, describe>("ferry.testing");
}

[[nodiscard]] inline std::error_code make_error_code(errc e) noexcept {
  return {static_cast<int>(e), error_category()};
}

}  // namespace ferry::testing

template <>
struct std::is_error_code_enum<ferry::testing::errc> : std::true_type {};

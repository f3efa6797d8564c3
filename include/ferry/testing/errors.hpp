#pragma once
// The test doubles' own error codes.

#include <system_error>

#include "ferry/detail/error_category.hpp"

namespace ferry::testing {

/// The test doubles' own error codes (category "ferry.testing").
enum class errc : int {
  injected_fault = 1,  ///< a failure ferry::fault_injector injected
};

/// The message for `e` (what error_code::message() says); nullptr for a value that is no errc.
[[nodiscard]] constexpr const char* describe(errc e) noexcept {
  switch (e) {
    case errc::injected_fault: return "failure injected by ferry::fault_injector";
  }
  return nullptr;
}

/// The category of ferry::testing::errc, named "ferry.testing".
[[nodiscard]] inline const std::error_category& error_category() noexcept {
  return ferry::detail::error_category_of<errc, describe>("ferry.testing");
}

/// `e` as a std::error_code in error_category().
[[nodiscard]] inline std::error_code make_error_code(errc e) noexcept {
  return {static_cast<int>(e), error_category()};
}

}  // namespace ferry::testing

/// Makes ferry::testing::errc an error-code enum: it converts to std::error_code and compares with one.
template <>
struct std::is_error_code_enum<ferry::testing::errc> : std::true_type {};

#pragma once
// The inference-server layer's own error codes.

#include <system_error>

#include "ferry/detail/error_category.hpp"

namespace ferry::kv {

/// The inference-server layer's own error codes (category "ferry.kv").
enum class errc : int {
  empty_request = 1,  ///< a request was sealed with no transfers: it cannot be a completed load
};

/// The message for `e` (what error_code::message() says); nullptr for a value that is no errc.
[[nodiscard]] constexpr const char* describe(errc e) noexcept {
  switch (e) {
    case errc::empty_request:
      return "request was sealed with no transfers, so it cannot be a completed load";
  }
  return nullptr;
}

/// The category of ferry::kv::errc, named "ferry.kv".
[[nodiscard]] inline const std::error_category& error_category() noexcept {
  return ferry::detail::error_category_of<errc, describe>("ferry.kv");
}

/// `e` as a std::error_code in error_category().
[[nodiscard]] inline std::error_code make_error_code(errc e) noexcept {
  return {static_cast<int>(e), error_category()};
}

}  // namespace ferry::kv

/// Makes ferry::kv::errc an error-code enum: it converts to std::error_code and compares with one.
template <>
struct std::is_error_code_enum<ferry::kv::errc> : std::true_type {};

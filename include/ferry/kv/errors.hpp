#pragma once
// The inference-server layer's own error codes.

#include <system_error>

#include "ferry/detail/error_category.hpp"

namespace ferry::kv {

enum class errc : int {
  empty_request = 1,
};

[[nodiscard]] constexpr const char* describe(errc e) noexcept {
  switch (e) {
    case errc::empty_request:
      return "request was sealed with no transfers, so it cannot be a completed load";
  }
  return nullptr;
}

[[nodiscard]] inline const std::error_category& error_category() noexcept {
  return ferry::detail::error_category_of<errc, describe>("ferry.kv");
}

[[nodiscard]] inline std::error_code make_error_code(errc e) noexcept {
  return {static_cast<int>(e), error_category()};
}

}  // namespace ferry::kv

template <>
struct std::is_error_code_enum<ferry::kv::errc> : std::true_type {};

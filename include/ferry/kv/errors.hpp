#pragma once
// The inference-server layer's own error codes.

#include <system_error>

#include "ferry/detail/error_category.hpp"

namespace ferry::kv {

/// The inference-server layer's own error codes (category "ferry.kv").
enum class errc : int {
  empty_request = 1,  ///< a request was sealed with no transfers: it cannot be a completed load
  bad_layout = 2,              ///< a cache layout fails its check (kv/layout.hpp)
  bad_parallelism = 3,         ///< a tensor-parallel rank and size cannot split a layer's heads
  incompatible_layouts = 4,    ///< two cache layouts cannot exchange blocks (kv/plan.hpp)
  bad_block_table = 5,         ///< a block table names a block outside its layout, or is malformed
  region_out_of_range = 6,     ///< a plan's byte range falls outside the memory given for a region
  bad_engine_description = 7,  ///< bytes or fields that are no valid engine description
  push_failed = 8,             ///< the producer says a write of a pushed request failed
};

/// The message for `e` (what error_code::message() says); nullptr for a value that is no errc.
[[nodiscard]] constexpr const char* describe(errc e) noexcept {
  switch (e) {
    case errc::empty_request:
      return "request was sealed with no transfers, so it cannot be a completed load";
    case errc::bad_layout:
      return "cache layout is not valid";
    case errc::bad_parallelism:
      return "tensor-parallel rank and size cannot split the layer's heads";
    case errc::incompatible_layouts:
      return "cache layouts cannot exchange blocks";
    case errc::bad_block_table:
      return "block table names a block outside its layout, or is malformed";
    case errc::region_out_of_range:
      return "byte range falls outside the memory given for its region";
    case errc::push_failed:
      return "the producer reported that a write of the pushed request failed, so its layers did "
             "not all land";
    case errc::bad_engine_description:
      return "not a valid engine description";
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

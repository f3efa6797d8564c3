#pragma once
// One std::error_category per layer (the core, each backend, kv/, the test doubles), each naming its
// own enum's values. A layer writes `describe(errc)` and gets the category from here.

#include <string>
#include <system_error>

namespace ferry::detail {

// Describe returns the text of a known value, nullptr for any other.
template <class Enum, const char* (*Describe)(Enum) noexcept>
class enum_error_category final : public std::error_category {
 public:
  explicit constexpr enum_error_category(const char* name) noexcept : name_(name) {}

  [[nodiscard]] const char* name() const noexcept override { return name_; }

  [[nodiscard]] std::string message(int value) const override {
    const char* text = Describe(static_cast<Enum>(value));
    if (text != nullptr) return text;
    return std::string("unknown ") + name_ + " error " + std::to_string(value);
  }

 private:
  const char* name_;
};

// The one instance of a layer's category.
template <class Enum, const char* (*Describe)(Enum) noexcept>
[[nodiscard]] const std::error_category& error_category_of(const char* name) noexcept {
  static const enum_error_category<Enum, Describe> category{name};
  return category;
}

}  // namespace ferry::detail

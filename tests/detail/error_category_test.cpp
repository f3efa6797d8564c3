// detail/error_category.hpp: one category per layer, naming its own enum's values.

#include <catch2/catch.hpp>

#include <string>
#include <system_error>

#include <ferry/detail/error_category.hpp>

namespace {

enum class sample_errc : int { first = 1, second };

constexpr const char* describe_sample(sample_errc e) noexcept {
  switch (e) {
    case sample_errc::first: return "the first thing went wrong";
    case sample_errc::second: return "the second thing went wrong";
  }
  return nullptr;
}

enum class other_errc : int { first = 1 };

constexpr const char* describe_other(other_errc) noexcept { return "another layer's failure"; }

const std::error_category& sample_category() {
  return ferry::detail::error_category_of<sample_errc, describe_sample>("sample");
}

}  // namespace

TEST_CASE("error_category_of: one instance per enum, its name, its texts, and unknown values named",
          "[detail]") {
  const std::error_category& c = sample_category();
  CHECK(&c == &sample_category());
  CHECK(std::string(c.name()) == "sample");
  CHECK(c.message(1) == "the first thing went wrong");
  CHECK(c.message(2) == "the second thing went wrong");
  CHECK(c.message(7) == "unknown sample error 7");
  const std::error_category& other =
      ferry::detail::error_category_of<other_errc, describe_other>("other");
  CHECK(&other != &c);
  // The same value in two categories is two errors.
  CHECK(std::error_code(1, c) != std::error_code(1, other));
  CHECK(std::error_code(1, c) == std::error_code(1, sample_category()));
}

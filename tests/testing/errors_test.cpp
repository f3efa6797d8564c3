// The test doubles' own error codes, in their own category.

#include <catch2/catch.hpp>

#include <string>
#include <system_error>

#include <ferry/errors.hpp>
#include <ferry/testing/errors.hpp>

TEST_CASE("an injected fault is a ferry.testing code, apart from the core's", "[testing]") {
  const std::error_code ec = ferry::testing::errc::injected_fault;
  CHECK(std::string(ec.category().name()) == "ferry.testing");
  CHECK(&ec.category() == &ferry::testing::error_category());
  CHECK(ec.message() == "failure injected by ferry::fault_injector");
  CHECK(ec == ferry::testing::errc::injected_fault);
  CHECK(ec != ferry::errc::empty_transfer);  // the same value in the core's category
}

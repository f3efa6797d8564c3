// kv's own error codes, in their own category.

#include <catch2/catch.hpp>

#include <string>
#include <system_error>

#include <ferry/errors.hpp>
#include <ferry/kv/errors.hpp>

TEST_CASE("kv's codes live in the ferry.kv category, apart from the core's", "[kv]") {
  const std::error_code ec = ferry::kv::errc::empty_request;
  CHECK(std::string(ec.category().name()) == "ferry.kv");
  CHECK(&ec.category() == &ferry::kv::error_category());
  CHECK(ec.message() == "request was sealed with no transfers, so it cannot be a completed load");
  CHECK(ec == ferry::kv::errc::empty_request);
  CHECK(ec != ferry::errc::empty_transfer);  // the same value in the core's category
  CHECK(ferry::kv::error_category().message(99) == "unknown ferry.kv error 99");
}

// The core's error codes: every condition has its own text in the "ferry" category, and none equals
// another layer's code of the same value.

#include <catch2/catch.hpp>

#include <set>
#include <string>
#include <system_error>

#include <ferry/errors.hpp>
#include <ferry/kv/errors.hpp>
#include <ferry/testing/errors.hpp>

TEST_CASE("every core error code has its own message in the ferry category", "[errors]") {
  std::set<std::string> messages;
  for (int v = static_cast<int>(ferry::errc::empty_transfer);
       v <= static_cast<int>(ferry::errc::submission_queue_full); ++v) {
    const std::error_code ec = static_cast<ferry::errc>(v);
    CAPTURE(v);
    CHECK(std::string(ec.category().name()) == "ferry");
    CHECK(ec.message().find("unknown") == std::string::npos);
    messages.insert(ec.message());
  }
  CHECK(messages.size() == static_cast<std::size_t>(ferry::errc::submission_queue_full));
  CHECK(std::error_code(ferry::errc::cancelled).message() ==
        "transfer was cancelled before it completed");
  CHECK(ferry::error_category().message(0) == "unknown ferry error 0");
}

TEST_CASE("core codes compare by category: a kv or testing code of the same value is another error",
          "[errors]") {
  const std::error_code core = ferry::errc::empty_transfer;
  CHECK(core == ferry::errc::empty_transfer);
  CHECK(core != ferry::kv::errc::empty_request);
  CHECK(core != ferry::testing::errc::injected_fault);
  CHECK(core.value() == std::error_code(ferry::kv::errc::empty_request).value());
  CHECK(core != std::error_code(1, std::system_category()));
  CHECK(&ferry::error_category() == &core.category());
}

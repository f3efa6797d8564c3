// poll_all: the verdict over a batch right now, without waiting or changing any status.

#include <catch2/catch.hpp>

#include <span>
#include <vector>

#include <ferry/poll_all.hpp>

#include "helpers.hpp"

using namespace ferry_test;
using ferry::transfer_state;
using ferry::verdict;

TEST_CASE("poll_all: empty, mixed and failed spans", "[poll_all]") {
  SECTION("empty is success") {
    const auto r = ferry::poll_all({});
    CHECK(r.verdict == verdict::success);
    CHECK(r.pending == 0);
    CHECK_FALSE(r.first_failed);
  }
  SECTION("all succeeded") {
    batch b(3);
    for (auto& c : b.completers) c.succeed();
    CHECK(ferry::poll_all(b.transfers).verdict == verdict::success);
  }
  SECTION("some pending, none failed") {
    batch b(3);
    b.completers[1].succeed();
    const auto r = ferry::poll_all(b.transfers);
    CHECK(r.verdict == verdict::pending);
    CHECK(r.pending == 2);
  }
  SECTION("failure wins over pending, whatever the order") {
    batch failed_first(2);
    failed_first.completers[0].fail(io_error);
    const auto a = ferry::poll_all(failed_first.transfers);
    CHECK(a.verdict == verdict::failed);
    CHECK(a.first_failed == 0u);
    CHECK(a.error == std::errc::io_error);
    CHECK(a.pending == 1);

    batch failed_last(2);
    failed_last.completers[1].fail(io_error);
    const auto b = ferry::poll_all(failed_last.transfers);
    CHECK(b.verdict == verdict::failed);
    CHECK(b.first_failed == 1u);
  }
  SECTION("a cancelled member fails the batch") {
    batch b(2);
    b.completers[0].succeed();
    b.completers[1].cancel();
    const auto r = ferry::poll_all(b.transfers);
    CHECK(r.verdict == verdict::failed);
    CHECK(r.first_failed == 1u);
    CHECK(r.error == ferry::errc::cancelled);
  }
  SECTION("an empty handle in the batch fails it with a clear error") {
    std::vector<ferry::transfer> v(2);
    const auto r = ferry::poll_all(v);
    CHECK(r.verdict == verdict::failed);
    CHECK(r.error == ferry::errc::empty_transfer);
  }
  SECTION("poll_all changes no status") {
    batch b(2);
    (void)ferry::poll_all(b.transfers);
    CHECK(b.transfers[0].state() == transfer_state::pending);
    CHECK(b.completers[0].succeed());
  }
}

// The failure first in time, when its member was passed pending by the look (issue 23, item 1).
TEST_CASE("poll_all names a failure that came first even if its member was passed pending",
          "[poll_all][concurrency][regression]") {
  // Looks repeatedly while the two failures land: any failed look must name member 0.
  for (const std::size_t n : {std::size_t{2}, std::size_t{4096}}) {
    const int wrong = later_failure_named(n, 300, [](std::span<const ferry::transfer> ts) {
      ferry::batch_result last;
      for (int i = 0; i < 64; ++i) {
        last = ferry::poll_all(ts);
        if (last.verdict == verdict::failed && last.first_failed != 0u) return last;
      }
      return last;
    });
    CAPTURE(n);
    CHECK(wrong == 0);
  }
}

// Wake-ups of GPU copies on the fake runtime: the copy engine is polled while copies are out and
// lets the executor park once none is; a submission must wake it (see check_round_trips_wake in
// helpers.hpp).

#include <catch2/catch.hpp>

#include <vector>

#include "gpu_helpers.hpp"

using namespace ferry_test::hip;
using ferry_test::check_round_trips_wake;
using ferry_test::executor_in;
using ferry_test::mode_name;
using ferry_test::wakeup_modes;

TEST_CASE("gpu: a parked executor is woken by each copy's submission and sees it end",
          "[wakeup]") {
  for (const ferry::progress_mode mode : wakeup_modes) {
    CAPTURE(mode_name(mode));
    ferry::progress_executor exec(executor_in(mode));
    engine e(exec);
    const std::vector<std::byte> src = ferry_test::pattern(4096, 2);
    std::vector<std::byte> dst(4096);
    check_round_trips_wake(
        "4 KiB device copy", mode, [&] { return exec.counters().parks; },
        [&] {
          transfer t = e.copy(dst.data(), src.data(), src.size(), fh::copy_kind::device_to_device);
          REQUIRE(t.wait_for(hang_bound) == transfer_state::success);
        });
    CHECK(dst == src);
  }
}

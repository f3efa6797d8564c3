// The faulty loopback under a soak of random faults: every transfer ends or is accounted hung.

#include <catch2/catch.hpp>

#include <cstddef>
#include <vector>

#include <ferry/testing.hpp>

#include "helpers.hpp"

using namespace ferry_test;
using ferry::transfer_state;
using ferry::verdict;

TEST_CASE("a soak: random faults, every transfer ends or is accounted hung",
          "[testing][faults][concurrency]") {
  ferry::progress_executor exec;
  ferry::fault_profile p;
  p.failure_rate = 0.05;
  p.hang_rate = 0.01;
  p.delay_rate = 0.2;
  p.max_delay = std::chrono::milliseconds(2);
  p.reorder_window = 8;
  p.seed = 2026;
  ferry::faulty_loopback lb{exec, p};
  const auto src = pattern(128, 11);
  std::vector<std::byte> dst(128);
  constexpr std::size_t batches = 200, per_batch = 32;
  std::vector<std::vector<ferry::transfer>> all;
  std::vector<verdict> verdicts;
  for (std::size_t batch = 0; batch < batches; ++batch) {
    std::vector<ferry::transfer> ts;
    for (std::size_t i = 0; i < per_batch; ++i) ts.push_back(lb.copy(dst, src));
    verdicts.push_back(ferry::wait_all(ts, 20ms).verdict);
    (void)ferry::drain(ts, 20ms);
    all.push_back(std::move(ts));
  }
  // Under load a drain may give up before a delayed transfer ends: wait until every transfer the
  // injector did not hang has ended (then none is pending but the hung ones).
  const auto pending = [&] {
    std::size_t n = 0;
    for (const auto& ts : all) {
      for (const auto& t : ts) n += t.state() == transfer_state::pending ? 1 : 0;
    }
    return n;
  };
  REQUIRE(wait_until([&] {
    const auto c = lb.faults().counters();
    return c.failed + c.forwarded + c.hung == batches * per_batch && pending() == c.hung;
  }));
  const auto c = lb.faults().counters();
  std::size_t failed = 0, succeeded = 0;
  for (std::size_t batch = 0; batch < batches; ++batch) {
    bool hung_member = false;
    for (const auto& t : all[batch]) {
      if (t.state() == transfer_state::success) ++succeeded;
      if (t.state() == transfer_state::failed) ++failed;
      if (t.state() == transfer_state::pending) hung_member = true;
    }
    // A batch with a member that never ends cannot have succeeded.
    if (hung_member) CHECK(verdicts[batch] != verdict::success);
  }
  CHECK(succeeded + failed + c.hung == batches * per_batch);
  CHECK(failed == c.failed);
  CHECK(c.hung > 0);
}

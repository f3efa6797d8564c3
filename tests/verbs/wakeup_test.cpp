// Wake-ups of RDMA completions: one-sided writes and reads on the fake adapter, whose completion
// channel is the descriptor the executor parks on, as a real adapter's is (see
// check_round_trips_wake in helpers.hpp).

#include <catch2/catch.hpp>

#include "verbs_helpers.hpp"

using namespace ferry_test::verbs;
using ferry_test::check_round_trips_wake;
using ferry_test::executor_in;
using ferry_test::mode_name;
using ferry_test::wakeup_modes;

TEST_CASE("verbs: a parked executor is woken by each work completion", "[wakeup]") {
  for (const ferry::progress_mode mode : wakeup_modes) {
    CAPTURE(mode_name(mode));
    rig_options o;
    o.exec = executor_in(mode);
    rig r(o);
    check_round_trips_wake(
        "4 KiB RDMA write", mode, [&] { return r.exec_a->counters().parks; },
        [&] {
          transfer t = r.a_qp->write(r.a_mem->slice(0, 4096), r.b_mem->remote().slice(0, 4096));
          REQUIRE(t.wait_for(hang_bound) == transfer_state::success);
        });
    check_round_trips_wake(
        "4 KiB RDMA read", mode, [&] { return r.exec_a->counters().parks; },
        [&] {
          transfer t = r.a_qp->read(r.a_mem->slice(0, 4096), r.b_mem->remote().slice(0, 4096));
          REQUIRE(t.wait_for(hang_bound) == transfer_state::success);
        });
  }
}

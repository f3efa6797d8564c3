// Wake-ups of UCX's completions, over tcp and shm: gets and notification ping-pongs between two
// workers, each on its own executor, with the executors parking (see check_round_trips_wake in
// helpers.hpp).

#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include <ferry/ucx/worker.hpp>

#include "helpers.hpp"

using namespace ferry_test;
namespace ucx = ferry::ucx;

namespace {

struct parked_side {
  parked_side(ferry::progress_mode mode, const std::string& transports)
      : exec(executor_in(mode)), worker(exec, options(transports)) {}
  static ucx::worker_options options(const std::string& transports) {
    ucx::worker_options o;
    o.transports = transports;
    return o;
  }
  ferry::progress_executor exec;
  ucx::worker worker;
};

}  // namespace

TEST_CASE("ucx: parked executors are woken by gets and notifications, over tcp and shm",
          "[wakeup]") {
  for (const char* transports : {"tcp", "shm"}) {
    for (const ferry::progress_mode mode : wakeup_modes) {
      CAPTURE(transports, mode_name(mode));
      parked_side a(mode, transports), b(mode, transports);
      ucx::endpoint ab = a.worker.connect(b.worker.address());
      ucx::endpoint ba = b.worker.connect(a.worker.address());
      const ucx::memory_region target = b.worker.allocate(4096);
      std::vector<std::byte> local_bytes(4096);
      const ucx::memory_region local = a.worker.register_memory(local_bytes);
      const ucx::remote_memory remote =
          ab.import(ucx::remote_region::from_bytes(target.describe().to_bytes()));
      const auto parks = [&] { return a.exec.counters().parks + b.exec.counters().parks; };
      check_round_trips_wake((std::string(transports) + " 4 KiB get").c_str(), mode, parks, [&] {
        ferry::transfer t = ab.get(local.slice(0, 4096), remote.slice(0, 4096), hang_bound);
        REQUIRE(t.wait_for(hang_bound) == ferry::transfer_state::success);
      });
      std::uint64_t sent = 0;
      check_round_trips_wake(
          (std::string(transports) + " notification ping-pong").c_str(), mode, parks, [&] {
            std::uint64_t at_b = 0, at_a = 0;
            ferry::transfer in_b = ba.receive_notification(at_b, hang_bound);
            ferry::transfer in_a = ab.receive_notification(at_a, hang_bound);
            ferry::transfer ping = ab.send_notification(++sent, hang_bound);
            REQUIRE(in_b.wait_for(hang_bound) == ferry::transfer_state::success);
            ferry::transfer pong = ba.send_notification(at_b, hang_bound);
            REQUIRE(in_a.wait_for(hang_bound) == ferry::transfer_state::success);
            REQUIRE(ping.wait_for(hang_bound) == ferry::transfer_state::success);
            REQUIRE(pong.wait_for(hang_bound) == ferry::transfer_state::success);
            REQUIRE(at_a == sent);
          });
    }
  }
}

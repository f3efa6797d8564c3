// basic_memory_region (memory_region.hpp) over the in-process fake adapter: allocation, slices
// inside the region only, and registration held while a request uses it.

#include <catch2/catch.hpp>

#include <cstddef>
#include <stdexcept>
#include <vector>

#include <ferry/ferry.hpp>
#include <ferry/testing/verbs.hpp>
#include <ferry/verbs/device.hpp>
#include <ferry/verbs/memory_region.hpp>

#include "helpers.hpp"
#include "verbs/verbs_helpers.hpp"

namespace {

using namespace ferry_test::verbs;

}  // namespace

TEST_CASE("verbs: an allocated region is zeroed, page-aligned and as long as asked", "[verbs]") {
  ferry::progress_executor exec;
  fv::device_options o;
  o.name = fresh_device("region_alloc");
  device dev(exec, o);
  const region r = region::allocate(dev, 5000);
  CHECK(r.size() == 5000);
  CHECK(reinterpret_cast<std::uintptr_t>(r.data()) % 4096 == 0);
  bool zero = true;
  for (const std::byte b : r.bytes()) zero = zero && b == std::byte{0};
  CHECK(zero);
  CHECK(r.remote().length == 5000);
  CHECK(r.remote().rkey == r.rkey());
  CHECK_FALSE(r.in_use());
  CHECK_THROWS_AS(region::allocate(dev, 0), std::invalid_argument);
}

TEST_CASE("verbs: a slice lies inside its region, or is refused", "[verbs]") {
  ferry::progress_executor exec;
  fv::device_options o;
  o.name = fresh_device("region_slice");
  device dev(exec, o);
  std::vector<std::byte> mine(256);
  const region r = region::register_memory(dev, mine);
  CHECK(r.data() == mine.data());
  CHECK(r.slice(0, 256).size() == 256);
  CHECK(r.slice(255, 1).data() == mine.data() + 255);
  CHECK_THROWS_AS(r.slice(200, 57), std::out_of_range);
  CHECK_THROWS_AS(r.slice(257, 0), std::out_of_range);
  CHECK(r.slice(std::span(mine).subspan(16, 32)).data() == mine.data() + 16);
  std::vector<std::byte> other(16);
  CHECK_THROWS_AS(r.slice(std::span(other)), std::out_of_range);
  CHECK_THROWS_AS(r.remote().slice(250, 7), std::out_of_range);
  CHECK_THROWS_AS(region::register_memory(dev, std::span<std::byte>{}), std::invalid_argument);
}

TEST_CASE("verbs: a region stays registered while a request holds it", "[verbs]") {
  rig r;
  transfer t;
  {
    paused_fabric paused;
    t = r.a_qp->write(r.a_mem->slice(0, 64), r.b_mem->remote().slice(0, 64));
    CHECK(r.a_mem->in_use());
  }
  REQUIRE(t.wait_for(hang_bound) == transfer_state::success);
  CHECK(ferry_test::wait_until([&] { return !r.a_mem->in_use(); }));
}

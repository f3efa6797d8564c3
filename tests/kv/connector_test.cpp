// The push receiver's bookkeeping with a load_tracker, without a backend (kv/connector.hpp); its
// transfers over real links are in tests/ucx/kv_link_test.cpp and tests/verbs/kv_link_test.cpp.

#include <catch2/catch.hpp>

#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <thread>
#include <vector>

#include <ferry/kv.hpp>

namespace kv = ferry::kv;
using namespace std::chrono_literals;

namespace {

kv::cache_layout two_layers() {
  kv::paged_shape s;
  s.layers = 2;
  s.blocks = 8;
  s.block_size = 4;
  s.head_size = 8;
  return kv::cache_layout::kv_split(s);
}

}  // namespace

TEST_CASE("kv push receiver: an expect() the tracker refuses leaves nothing behind, and a later "
          "request that times out drains instead of being handed back",
          "[kv]") {
  const kv::cache_layout layout = two_layers();
  const std::vector<std::uint32_t> src{0, 1}, dst{2, 3};
  const kv::block_pairs g{src, dst};
  kv::push_receiver receiver;
  kv::load_tracker tracker({}, [&](const ferry::transfer& t) { receiver.cancel(t); });
  tracker.begin_step();
  // Sealed already: the tracker refuses the first layer's transfer, and expect() throws. Over and
  // over, so that a status freed here is made again for the next request.
  for (kv::request_id id = 1; id <= 20; ++id) {
    const auto sealed = tracker.add_request(id);
    tracker.seal(sealed);
    CHECK_THROWS_AS(receiver.expect(tracker, sealed, id, layout, std::span(&g, 1)),
                    std::logic_error);
    CHECK(receiver.expected() == 0);
    tracker.abort_request(id);
  }
  (void)tracker.take_finished();
  kv::request_options o;
  o.abort_timeout = 50ms;
  const auto h = tracker.add_request(100, o);
  receiver.expect(tracker, h, 100, layout, std::span(&g, 1));
  tracker.seal(h);
  CHECK(receiver.expected() == 1);
  std::this_thread::sleep_for(60ms);
  CHECK(tracker.verdict(100) == kv::request_verdict::timed_out);
  // The tracker's cancel reaches request 100 (not a request whose status was freed before): it
  // drains, and is not handed back while its producer could still write into its blocks.
  for (int round = 0; round < 3; ++round) CHECK(tracker.take_finished().empty());
  CHECK(receiver.draining() == 1);
  CHECK(receiver.expected() == 1);
}

TEST_CASE("kv push receiver: a block table missing a layer's group is refused before anything is "
          "added",
          "[kv]") {
  kv::paged_shape s;
  s.layers = 1;
  s.blocks = 8;
  s.head_size = 8;
  kv::cache_layout layout = kv::cache_layout::kv_split(s);
  s.group = 1;
  s.first_region = 1;
  layout.append(kv::cache_layout::kv_split(s));  // layer 1 is in group 1
  const std::vector<std::uint32_t> src{0}, dst{1};
  const kv::block_pairs only_group_0{src, dst};
  kv::push_receiver receiver;
  kv::load_tracker tracker;
  const auto h = tracker.add_request(1);
  try {
    receiver.expect(tracker, h, 1, layout, std::span(&only_group_0, 1));
    FAIL("expect() took a request with no block table for group 1");
  } catch (const std::system_error& e) {
    CHECK(e.code() == kv::errc::bad_block_table);
    CHECK(std::string(e.what()).find("group 1") != std::string::npos);
  }
  CHECK(receiver.expected() == 0);
  CHECK(tracker.layer_transfers(0).empty());
}

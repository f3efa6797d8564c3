// The release ledger: the producer frees a transfer's blocks after the expected acknowledgements,
// once; early, duplicate and late acknowledgements, in bounded memory.

#include <catch2/catch.hpp>

#include <vector>

#include <ferry/kv/release_ledger.hpp>

namespace kv = ferry::kv;

// 8.
TEST_CASE("kv property 8: the producer frees after the expected acknowledgements, and never twice",
          "[kv]") {
  std::vector<kv::transfer_id> freed;
  kv::release_ledger ledger([&](kv::transfer_id id) { freed.push_back(id); });
  CHECK_FALSE(ledger.expect(1, 3));
  CHECK(ledger.acknowledge(1, 0) == kv::ack_result::counted);
  CHECK(ledger.acknowledge(1, 0) == kv::ack_result::duplicate);
  CHECK(ledger.acknowledge(1, 1) == kv::ack_result::counted);
  CHECK(freed.empty());
  CHECK(ledger.acknowledge(1, 2) == kv::ack_result::freed);
  CHECK(freed == std::vector<kv::transfer_id>{1});
  // Late and repeated acknowledgements never free again.
  CHECK(ledger.acknowledge(1, 2) == kv::ack_result::stale);
  CHECK(ledger.acknowledge(1, 3) == kv::ack_result::stale);
  CHECK(freed.size() == 1);
  CHECK_THROWS_WITH(ledger.expect(1, 1), Catch::Contains("already expected"));
}

TEST_CASE("kv: duplicate, early and late acknowledgements, bounded", "[kv]") {
  std::vector<kv::transfer_id> freed;
  kv::release_ledger ledger([&](kv::transfer_id id) { freed.push_back(id); },
                            kv::ledger_options{.early_capacity = 2, .finished_capacity = 2});
  SECTION("early acknowledgements count once when the transfer becomes known") {
    CHECK(ledger.acknowledge(9, 0) == kv::ack_result::early);
    CHECK(ledger.acknowledge(9, 0) == kv::ack_result::duplicate);
    CHECK(ledger.acknowledge(9, 1) == kv::ack_result::early);
    CHECK(ledger.early() == 1);
    CHECK_FALSE(ledger.expect(9, 3));
    CHECK(freed.empty());
    CHECK(ledger.acknowledge(9, 1) == kv::ack_result::duplicate);
    CHECK(ledger.acknowledge(9, 2) == kv::ack_result::freed);
    CHECK(freed == std::vector<kv::transfer_id>{9});
  }
  SECTION("every acknowledgement early: expect frees at once") {
    CHECK(ledger.acknowledge(4, 0) == kv::ack_result::early);
    CHECK(ledger.expect(4, 1));
    CHECK(freed == std::vector<kv::transfer_id>{4});
    CHECK(ledger.acknowledge(4, 0) == kv::ack_result::stale);
  }
  SECTION("the early buffer is bounded: the oldest is dropped and said so") {
    CHECK(ledger.acknowledge(1, 0) == kv::ack_result::early);
    CHECK(ledger.acknowledge(2, 0) == kv::ack_result::early);
    CHECK(ledger.acknowledge(3, 0) == kv::ack_result::early_dropped);
    CHECK(ledger.early() == 2);
    CHECK_FALSE(ledger.expect(1, 1));  // its early acknowledgement was dropped
    CHECK(ledger.expect(2, 1));
  }
  SECTION("finished ids are remembered, boundedly") {
    for (kv::transfer_id id = 1; id <= 3; ++id) {
      CHECK_FALSE(ledger.expect(id, 1));
      CHECK(ledger.acknowledge(id, 0) == kv::ack_result::freed);
    }
    CHECK(ledger.acknowledge(3, 0) == kv::ack_result::stale);
    CHECK(ledger.acknowledge(2, 0) == kv::ack_result::stale);
    CHECK(ledger.acknowledge(1, 0) == kv::ack_result::early);  // forgotten: looks early now
    CHECK(freed.size() == 3);
  }
  SECTION("bad input") {
    CHECK_THROWS_WITH(ledger.expect(1, 0), Catch::Contains("at least one consumer"));
    CHECK_THROWS_WITH(kv::release_ledger({}), Catch::Contains("free callback is empty"));
  }
}

// The KV connector core over the RDMA verbs backend (kv/verbs_link.hpp), on the in-process fake
// adapter: pull and push of a request's layers with transfer plans between engines, tracked by
// load_tracker, released through release_ledger, with failures injected. Mirrors
// tests/ucx/kv_link_test.cpp.

#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <ferry/kv.hpp>
#include <ferry/kv/connector.hpp>
#include <ferry/kv/verbs_link.hpp>
#include <ferry/spawn.hpp>
#include <ferry/sync_wait.hpp>
#include <ferry/testing/verbs.hpp>
#include <ferry/verbs/device.hpp>
#include <ferry/verbs/handshake.hpp>

#include "helpers.hpp"
#include "kv/push_consumer.hpp"
#include "verbs/verbs_helpers.hpp"

using namespace ferry_test;
using ferry::transfer_state;
namespace kv = ferry::kv;
namespace fv = ferry::verbs;
using ferry_test::verbs::fabric;
using ferry_test::verbs::fresh_device;
using link_type = kv::basic_verbs_link<fv::fake::provider>;

namespace {

constexpr std::uint32_t layers = 4;
constexpr std::uint32_t blocks = 32;
constexpr std::uint32_t total_heads = 4;

kv::cache_layout layout_for(std::uint32_t tp_size) {
  kv::paged_shape s;
  s.layers = layers;
  s.blocks = blocks;
  s.block_size = 4;
  s.total_heads = total_heads;
  s.tp_size = tp_size;
  s.head_size = 8;
  s.element_size = 2;
  s.region_per_layer = false;  // every layer in region 0
  return kv::cache_layout::kv_split(s);
}

// Queue pairs whose notification waits check their peer often: a producer that goes is noticed
// within milliseconds.
fv::queue_pair_options qp_options() {
  fv::queue_pair_options o;
  o.peer_check = std::chrono::milliseconds(5);
  return o;
}

// One engine: an executor, a fake adapter of its own, its cache in one registered region, and an
// engine thread.
struct engine {
  engine(std::uint32_t tp_rank, std::uint32_t tp_size)
      : dev(exec, fv::device_options{fresh_device("kv"), 1, 0, 4096}),
        layout(layout_for(tp_size)),
        tp{tp_rank, tp_size},
        region(ferry_test::verbs::region::allocate(dev, layout.bytes_needed(0))) {}
  [[nodiscard]] kv::engine_description describe(const std::string& id) const {
    kv::engine_description d;
    d.engine_id = id;
    d.incarnation = 1;
    d.tp = tp;
    d.layout = layout;
    d.regions.push_back(kv::verbs_region_bytes(region.remote()));
    return d;
  }
  void fill(unsigned seed) {
    std::mt19937 rng(seed);
    for (std::byte& b : region.bytes()) b = static_cast<std::byte>(rng());
  }

  ferry::progress_executor exec;
  ferry_test::verbs::device dev;
  kv::cache_layout layout;
  kv::tp_shard tp;
  ferry_test::verbs::region region;
  engine_thread thread;
};

// Both sides' links between a producer and a consumer over the verbs handshake's TCP side channel:
// the consumer's link made from the producer's kv handshake bytes (encoded, decoded, regions read
// from its descriptors), the producer's from the regions the consumer exposed in the verbs
// handshake.
struct joined {
  joined(engine& producer, engine& consumer) {
    fv::side_channel_listener listener(0);
    std::optional<fv::basic_connection<fv::fake::provider>> accepted;
    std::thread server([&] {
      accepted.emplace(listener.accept(producer.dev, std::span<const fv::remote_region>(),
                                       qp_options(), hang_bound));
    });
    const fv::remote_region exposed[] = {consumer.region.remote()};
    fv::basic_connection<fv::fake::provider> to_producer =
        fv::connect(consumer.dev, "127.0.0.1", listener.port(),
                    std::span<const fv::remote_region>(exposed), qp_options(), hang_bound);
    server.join();
    const std::vector<std::byte> handshake = kv::encode(producer.describe("prefill"));
    const kv::engine_description peer = kv::decode(handshake);
    kv::check_compatible(peer, consumer.describe("decode"));
    at_consumer.emplace(link_type::to_peer(std::move(to_producer.qp), {&consumer.region}, peer));
    at_producer.emplace(std::move(accepted->qp), std::vector{&std::as_const(producer.region)},
                        std::move(accepted->peer_regions));
  }
  std::optional<link_type> at_consumer;
  std::optional<link_type> at_producer;
};

using kv_links::run_on;

// Closes `l` on `e`'s engine thread, the thread that calls it.
void close_on(engine& e, link_type& l) {
  (void)run_on(e, [](link_type& l) -> ferry::task<int> {
    l.close();
    co_return 0;
  }(l));
}

// The plan from `src` (rank src_tp) into `dst` for a request whose block i at the source is
// src_ids[i] and at the destination dst_ids[i].
kv::transfer_plan plan_for(const engine& src, const engine& dst,
                           const std::vector<std::uint32_t>& src_ids,
                           const std::vector<std::uint32_t>& dst_ids) {
  const kv::block_pairs g{src_ids, dst_ids};
  return kv::plan_transfer(src.layout, src.tp, dst.layout, dst.tp, std::span(&g, 1));
}

// What the consumer's region must hold after the plans: the same plans applied with memcpy.
std::vector<std::byte> expected_after(const std::vector<const engine*>& producers,
                                      const std::vector<kv::transfer_plan>& plans,
                                      const engine& consumer) {
  std::vector<std::byte> out(consumer.region.bytes().begin(), consumer.region.bytes().end());
  for (std::size_t p = 0; p < producers.size(); ++p) {
    const std::span<const std::byte> src[] = {producers[p]->region.bytes()};
    const std::span<std::byte> dst[] = {out};
    kv::apply_plan(plans[p], src, dst);
  }
  return out;
}

// A request's block tables: source ids shuffled in runs, destination ids another way.
struct tables {
  std::vector<std::uint32_t> src, dst;
  explicit tables(std::uint32_t n, unsigned seed) {
    std::mt19937 rng(seed);
    std::vector<std::uint32_t> ids(blocks);
    for (std::uint32_t i = 0; i < blocks; ++i) ids[i] = i;
    std::shuffle(ids.begin(), ids.end(), rng);
    src.assign(ids.begin(), ids.begin() + n);
    std::sort(src.begin(), src.begin() + n / 2);  // half of it in runs
    std::shuffle(ids.begin(), ids.end(), rng);
    dst.assign(ids.begin(), ids.begin() + n);
  }
};

}  // namespace

TEST_CASE("kv over verbs: region descriptors round-trip, and bytes that are none are refused",
          "[kv-connector-verbs][concurrency]") {
  const fv::remote_region r{0x7f0012345000, 1 << 20, 0xabcd1234};
  const std::vector<std::byte> bytes = kv::verbs_region_bytes(r);
  CHECK(bytes.size() == 24);
  const fv::remote_region back = kv::verbs_region_from_bytes(bytes);
  CHECK(back.address == r.address);
  CHECK(back.length == r.length);
  CHECK(back.rkey == r.rkey);
  CHECK_THROWS_WITH(kv::verbs_region_from_bytes(std::span(bytes).first(23)),
                    Catch::Contains("has 23 bytes, not 24"));
  std::vector<std::byte> reserved = bytes;
  reserved[23] = std::byte{1};
  CHECK_THROWS_WITH(kv::verbs_region_from_bytes(reserved), Catch::Contains("reserved"));
  CHECK_THROWS_WITH(kv::verbs_region_from_bytes(kv::verbs_region_bytes({1, 0, 1})),
                    Catch::Contains("no bytes"));
  CHECK_THROWS_WITH(kv::verbs_region_from_bytes(kv::verbs_region_bytes({~std::uint64_t{0}, 2, 1})),
                    Catch::Contains("wraps"));
  try {
    (void)kv::verbs_region_from_bytes({});
    FAIL("no throw");
  } catch (const std::system_error& e) {
    CHECK(e.code() == kv::errc::bad_engine_description);
  }
}

TEST_CASE("kv over verbs: pull, TP 1->1 and 2->1: every layer lands byte-exact, the tracker says "
          "success, and the release frees the producers' blocks through their ledgers",
          "[kv-connector-verbs][concurrency]") {
  const std::uint32_t sources = GENERATE(1u, 2u);
  CAPTURE(sources);
  engine consumer(0, 1);
  std::vector<std::unique_ptr<engine>> producers;
  std::vector<std::unique_ptr<joined>> links;
  for (std::uint32_t p = 0; p < sources; ++p) {
    producers.push_back(std::make_unique<engine>(p, sources));
    producers.back()->fill(100 + p);
    links.push_back(std::make_unique<joined>(*producers.back(), consumer));
  }
  const tables t(20, 7);
  std::vector<kv::transfer_plan> plans;
  std::vector<const engine*> from;
  for (auto& p : producers) {
    plans.push_back(plan_for(*p, consumer, t.src, t.dst));
    from.push_back(p.get());
  }
  const std::vector<std::byte> want = expected_after(from, plans, consumer);
  // The plans move something, and not already there: byte-exact means the reads did it.
  REQUIRE_FALSE(std::equal(want.begin(), want.end(), consumer.region.bytes().begin()));

  // Each producer serves releases into its ledger on its own engine thread.
  std::vector<std::unique_ptr<kv::release_ledger>> ledgers;
  std::vector<std::atomic<int>> freed(sources);
  std::vector<std::atomic<bool>> served(sources);
  constexpr kv::request_id request = 77;
  for (std::uint32_t p = 0; p < sources; ++p) {
    ledgers.push_back(std::make_unique<kv::release_ledger>(
        [&freed, p](kv::transfer_id id) { freed[p].fetch_add(id == request ? 1 : 100); }));
    CHECK_FALSE(ledgers[p]->expect(request, 1));  // not freed until the release comes
    ferry::spawn(producers[p]->thread.loop(),
                 kv::serve_releases(*links[p]->at_producer, *ledgers[p], 0),
                 [&served, p](std::exception_ptr) noexcept { served[p].store(true); });
  }

  // The consumer: pull from every source, wait for each layer, release.
  const kv::block_pairs g{t.src, t.dst};
  const auto consume = [&]() -> ferry::task<kv::request_verdict> {
    kv::load_tracker tracker([&](kv::request_id id, kv::request_verdict v) {
      for (auto& l : links) kv::release_to(*l->at_consumer, hang_bound)(id, v);
    });
    tracker.begin_step();
    const auto h = tracker.add_request(request);
    for (std::uint32_t p = 0; p < sources; ++p) {
      kv::pull(*links[p]->at_consumer, plans[p], consumer.layout, std::span(&g, 1), tracker, h,
               hang_bound);
    }
    tracker.seal(h);
    for (std::size_t layer = 0; layer < layers; ++layer) {
      const ferry::batch_result r = co_await tracker.when_layer(layer, hang_bound);
      CHECK(r.ok());
    }
    const kv::request_verdict v = tracker.verdict(request);
    const auto finished = tracker.take_finished();
    CHECK(finished.size() == 1);
    co_return v;
  };
  CHECK(run_on(consumer, consume()) == kv::request_verdict::success);
  CHECK(std::equal(want.begin(), want.end(), consumer.region.bytes().begin()));
  for (std::uint32_t p = 0; p < sources; ++p) {
    CHECK(wait_until([&] { return freed[p].load() == 1; }));
  }
  // Closing the producers' links ends their release loops.
  for (std::uint32_t p = 0; p < sources; ++p) close_on(*producers[p], *links[p]->at_producer);
  for (std::uint32_t p = 0; p < sources; ++p) CHECK(wait_until([&] { return served[p].load(); }));
}

TEST_CASE("kv over verbs: a range outside its region fails its own transfer, and the rest land",
          "[kv-connector-verbs][concurrency]") {
  engine producer(0, 1), consumer(0, 1);
  producer.fill(3);
  joined j(producer, consumer);
  const std::uint64_t size = consumer.region.size();
  const kv::byte_range ranges[] = {
      // {src_region, dst_region, src_offset, dst_offset, length}; the source is the producer.
      {0, 0, 64, 0, 128},               // fine: producer bytes [64, 192) -> consumer [0, 128)
      {0, 0, 0, size - 8, 16},          // past the end of this side's region
      {1, 0, 0, 0, 16},                 // no such peer region
      {0, 3, 0, 0, 16},                 // no such local region
      {0, 0, ~std::uint64_t{0}, 0, 2},  // a peer offset whose end wraps
  };
  std::vector<ferry::transfer> out(std::size(ranges));
  const auto pull_some = [&]() -> ferry::task<int> {
    j.at_consumer->read(ranges, out, hang_bound);
    co_return 0;
  };
  (void)run_on(consumer, pull_some());
  REQUIRE(out[0].wait_for(hang_bound) == transfer_state::success);
  CHECK(std::equal(consumer.region.bytes().begin(), consumer.region.bytes().begin() + 128,
                   producer.region.bytes().begin() + 64));
  for (std::size_t i = 1; i < out.size(); ++i) {
    CAPTURE(i);
    CHECK(out[i].state() == transfer_state::failed);
    CHECK(out[i].error() == kv::errc::region_out_of_range);
  }
  CHECK(j.at_consumer->queue_pair().error() == std::error_code{});  // nothing reached the adapter
}

TEST_CASE("kv over verbs: a plan larger than the send queue goes in parts that fit",
          "[kv-connector-verbs][concurrency]") {
  engine producer(0, 1), consumer(0, 1);
  producer.fill(21);
  joined j(producer, consumer);
  const std::uint32_t depth = j.at_producer->queue_pair().send_depth();
  std::vector<kv::byte_range> ranges;
  for (std::uint64_t i = 0; i < depth * 2 + 3; ++i) ranges.push_back({0, 0, i * 8, i * 8, 8});
  REQUIRE(ranges.back().dst_offset + 8 <= consumer.region.size());
  std::vector<ferry::transfer> out(ranges.size());
  const auto push_all = [&]() -> ferry::task<ferry::batch_result> {
    j.at_producer->write(ranges, out, hang_bound);
    co_return co_await ferry::when_all(out, hang_bound);
  };
  CHECK(run_on(producer, push_all()).ok());
  const std::size_t n = ranges.size() * 8;
  CHECK(std::equal(consumer.region.bytes().begin(), consumer.region.bytes().begin() + n,
                   producer.region.bytes().begin()));
}

namespace {

// A consumer's side of push (tests/kv/push_consumer.hpp) on this file's engine and link.
struct push_consumer : kv_links::push_consumer<engine, link_type> {
  explicit push_consumer(engine& e)
      : kv_links::push_consumer<engine, link_type>(e, &close_on) {}
};

}  // namespace

TEST_CASE("kv over verbs: push, layer by layer: the consumer's request succeeds once the "
          "producer's notice comes, with every layer byte-exact",
          "[kv-connector-verbs][concurrency]") {
  engine producer(0, 1), consumer(0, 1);
  producer.fill(5);
  joined j(producer, consumer);
  const tables t(24, 9);
  const kv::transfer_plan plan = plan_for(producer, consumer, t.src, t.dst);
  const std::vector<std::byte> want = expected_after({&producer}, {plan}, consumer);
  REQUIRE_FALSE(std::equal(want.begin(), want.end(), consumer.region.bytes().begin()));
  push_consumer c(consumer);
  const kv::block_pairs g{t.src, t.dst};
  constexpr kv::request_id id = 5;
  c.expect(*j.at_consumer, id, g, std::chrono::seconds(30));
  CHECK(c.tracker.verdict(id) == kv::request_verdict::pending);  // nothing pushed yet

  const auto push = [&]() -> ferry::task<ferry::batch_result> {
    kv::pushed_request<link_type> p(*j.at_producer, id, plan, hang_bound);
    for (std::size_t layer = 0; layer < layers; ++layer) p.layer_computed(layer);
    const ferry::batch_result r = co_await p.finish();
    const transfer_state noticed = co_await p.notice();
    CHECK(noticed == transfer_state::success);
    co_return r;
  };
  CHECK(run_on(producer, push()).ok());
  CHECK(c.verdict(id) == kv::request_verdict::success);
  CHECK(std::equal(want.begin(), want.end(), consumer.region.bytes().begin()));
  CHECK(c.finished == std::vector<kv::request_id>{id});
  CHECK(c.receiver.stale() == 0);
}

TEST_CASE("kv over verbs: push whose notice is late times out by the request's abort_timeout, and is "
          "let go only when the late notice comes",
          "[kv-connector-verbs][concurrency]") {
  engine producer(0, 1), consumer(0, 1);
  joined j(producer, consumer);
  const tables t(8, 3);
  const kv::transfer_plan plan = plan_for(producer, consumer, t.src, t.dst);
  push_consumer c(consumer);
  const kv::block_pairs g{t.src, t.dst};
  const auto start = clock_type::now();
  c.expect(*j.at_consumer, 9, g, std::chrono::milliseconds(300));
  // Every layer written, the notice dropped: the consumer cannot know the layers landed.
  const auto write_only = [&]() -> ferry::task<int> {
    kv::pushed_request<link_type> p(*j.at_producer, 9, plan, hang_bound);
    for (std::size_t layer = 0; layer < layers; ++layer) p.layer_computed(layer);
    const ferry::batch_result r = co_await ferry::when_all(p.writes(), hang_bound);
    CHECK(r.ok());
    co_return 0;
  };
  (void)run_on(producer, write_only());
  CHECK(c.verdict(9) == kv::request_verdict::timed_out);
  CHECK(ms_since(start) >= 300);
  CHECK(ms_since(start) < 5000);
  // Timed out, but not let go: the producer could still be writing into its blocks.
  CHECK(c.finished.empty());
  CHECK(c.receiver.draining() == 1);
  // The notice that comes after ends it (counted as stale): now it is handed back.
  const auto late = [&]() -> ferry::task<transfer_state> {
    co_return co_await j.at_producer->notify(kv::push_notice{9, false}.encode(), hang_bound);
  };
  CHECK(run_on(producer, late()) == transfer_state::success);
  CHECK(c.released(9));
  CHECK(c.finished == std::vector<kv::request_id>{9});
  CHECK(c.receiver.stale() == 1);
  CHECK(c.receiver.expected() == 0);
  CHECK(c.receiver.draining() == 0);
}

TEST_CASE("kv over verbs: a failed write is pushed as a failure, and a producer gone mid-push "
          "fails every request it owed at once",
          "[kv-connector-verbs][concurrency]") {
  // Gone: its queue pair destroyed (its process died), or moved to the error state by a fatal
  // event.
  const bool destroyed = GENERATE(true, false);
  CAPTURE(destroyed);
  engine producer(0, 1), consumer(0, 1);
  joined j(producer, consumer);
  const tables t(8, 4);
  kv::transfer_plan plan = plan_for(producer, consumer, t.src, t.dst);
  push_consumer c(consumer);
  const kv::block_pairs g{t.src, t.dst};
  c.expect(*j.at_consumer, 1, g, std::chrono::seconds(30));
  c.expect(*j.at_consumer, 2, g, std::chrono::seconds(30));

  // Request 1: layer 2's first range points past the consumer's region.
  kv::transfer_plan broken = plan;
  broken.layers[2][0].dst_offset = consumer.region.size();
  const auto push_broken = [&]() -> ferry::task<ferry::batch_result> {
    kv::pushed_request<link_type> p(*j.at_producer, 1, broken, hang_bound);
    for (std::size_t layer = 0; layer < layers; ++layer) p.layer_computed(layer);
    co_return co_await p.finish();
  };
  const ferry::batch_result r = run_on(producer, push_broken());
  CHECK(r.verdict == ferry::verdict::failed);
  CHECK(r.error == kv::errc::region_out_of_range);
  CHECK(c.verdict(1) == kv::request_verdict::failed);
  CHECK(c.receiver.expected() == 1);  // request 2 still waits

  // Request 2: the producer's queue pair goes mid-push (layers written, no notice): the consumer's
  // receive fails, and request 2 with it, long before its 30 s abort_timeout.
  const auto start = clock_type::now();
  const auto half = [&]() -> ferry::task<int> {
    kv::pushed_request<link_type> p(*j.at_producer, 2, plan, hang_bound);
    p.layer_computed(0);
    p.layer_computed(1);
    const ferry::batch_result written = co_await ferry::when_all(p.writes(), hang_bound);
    CHECK(written.ok());
    if (destroyed) {
      j.at_producer->close();
    } else {
      fabric::instance().inject_qp_fatal(j.at_producer->queue_pair().native_handle());
    }
    co_return 0;
  };
  (void)run_on(producer, half());
  CHECK(c.verdict(2) == kv::request_verdict::failed);
  CHECK(ms_since(start) < 5000);
  CHECK(wait_until([&] { return c.receive_ended.load(); }));
  CHECK(c.receiver.expected() == 0);
  CHECK(j.at_consumer->queue_pair().error() == fv::errc::peer_unreachable);
}

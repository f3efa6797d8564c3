// The KV connector core over real UCX (tcp and shared memory): pull and push of a request's layers
// with transfer plans between engines, tracked by load_tracker, released through release_ledger,
// with failures injected.

#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <ferry/kv.hpp>
#include <ferry/kv/connector.hpp>
#include <ferry/kv/ucx_link.hpp>
#include <ferry/spawn.hpp>
#include <ferry/sync_wait.hpp>
#include <ferry/ucx.hpp>

#include "helpers.hpp"
#include "kv/push_consumer.hpp"
#include "ucx/peer_process.hpp"

using namespace ferry_test;
using ferry::transfer_state;
namespace kv = ferry::kv;
namespace ucx = ferry::ucx;
namespace peer = ferry_test::ucx_peer;

namespace {

constexpr std::uint32_t layers = 4;
constexpr std::uint32_t blocks = 32;
constexpr std::uint32_t total_heads = 4;

ucx::worker_options over(const std::string& transports) {
  ucx::worker_options o;
  o.transports = transports;
  o.close_timeout = std::chrono::milliseconds(300);
  return o;
}

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

// One engine: an executor, a UCX worker, an engine thread and its cache in one allocated region.
struct engine {
  engine(const std::string& transports, std::uint32_t tp_rank, std::uint32_t tp_size)
      : worker(exec, over(transports)), layout(layout_for(tp_size)), tp{tp_rank, tp_size} {
    region = worker.allocate(layout.bytes_needed(0));
  }
  [[nodiscard]] kv::engine_description describe(const std::string& id) const {
    kv::engine_description d;
    d.engine_id = id;
    d.incarnation = 1;
    d.tp = tp;
    d.layout = layout;
    d.regions.push_back(region.describe().to_bytes());
    return d;
  }
  void fill(unsigned seed) {
    std::mt19937 rng(seed);
    for (std::byte& b : region.bytes()) b = static_cast<std::byte>(rng());
  }

  ferry::progress_executor exec;
  ucx::worker worker;
  kv::cache_layout layout;
  kv::tp_shard tp;
  ucx::memory_region region;
  engine_thread thread;
};

// Both sides' links between a producer and a consumer, the consumer's made from the producer's
// handshake bytes (encoded, decoded, regions imported from its descriptors).
struct joined {
  joined(engine& producer, engine& consumer) {
    ucx::memory_region exposed = producer.region;
    auto l = producer.worker.listen("127.0.0.1", 0, std::span(&exposed, 1));
    ucx::pending_endpoint accepting = l.accept_async(hang_bound);
    ucx::endpoint to_producer =
        consumer.worker.connect("127.0.0.1", l.port(), std::span(&consumer.region, 1), hang_bound);
    ucx::endpoint to_consumer = accepting.get();
    const std::vector<std::byte> handshake = kv::encode(producer.describe("prefill"));
    const kv::engine_description peer = kv::decode(handshake);
    kv::check_compatible(peer, consumer.describe("decode"));
    at_consumer.emplace(kv::ucx_link::to_peer(std::move(to_producer), {consumer.region}, peer));
    std::vector<ucx::remote_memory> consumer_regions = to_consumer.peer_regions();
    at_producer.emplace(std::move(to_consumer), std::vector{producer.region},
                        std::move(consumer_regions));
  }
  std::optional<kv::ucx_link> at_consumer;
  std::optional<kv::ucx_link> at_producer;
};


using kv_links::run_on;

// The plan from `src` (rank src_tp) into `dst` for a request whose block i at the source is
// src_ids[i] and at the destination dst_ids[i].
kv::transfer_plan plan_for(const engine& src, const engine& dst, const std::vector<std::uint32_t>& src_ids,
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

TEST_CASE("kv over ucx: pull, TP 1->1 and 2->1: every layer lands byte-exact, the tracker says "
          "success, and the release frees the producers' blocks through their ledgers",
          "[kv-connector][concurrency]") {
  const std::string transports = GENERATE(as<std::string>{}, "tcp", "shm");
  const std::uint32_t sources = GENERATE(1u, 2u);
  CAPTURE(transports, sources);
  engine consumer(transports, 0, 1);
  std::vector<std::unique_ptr<engine>> producers;
  std::vector<std::unique_ptr<joined>> links;
  for (std::uint32_t p = 0; p < sources; ++p) {
    producers.push_back(std::make_unique<engine>(transports, p, sources));
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
  // Closing the producers' endpoints ends their release loops.
  for (auto& l : links) l->at_producer->endpoint().close();
  for (std::uint32_t p = 0; p < sources; ++p) CHECK(wait_until([&] { return served[p].load(); }));
}

namespace {

// A consumer's side of push (tests/kv/push_consumer.hpp) on this file's engine and link.
struct push_consumer : kv_links::push_consumer<engine, kv::ucx_link> {
  explicit push_consumer(engine& e)
      : kv_links::push_consumer<engine, kv::ucx_link>(
            e, [](engine&, kv::ucx_link& l) { l.endpoint().close(); }) {}
};

}  // namespace

TEST_CASE("kv over ucx: push, layer by layer: the consumer's request succeeds once the producer's "
          "notice comes, with every layer byte-exact",
          "[kv-connector][concurrency]") {
  const std::string transports = GENERATE(as<std::string>{}, "tcp", "shm");
  CAPTURE(transports);
  engine producer(transports, 0, 1), consumer(transports, 0, 1);
  producer.fill(5);
  joined j(producer, consumer);
  const tables t(24, 9);
  const kv::transfer_plan plan = plan_for(producer, consumer, t.src, t.dst);
  const std::vector<std::byte> want = expected_after({&producer}, {plan}, consumer);
  push_consumer c(consumer);
  const kv::block_pairs g{t.src, t.dst};
  constexpr kv::request_id id = 5;
  c.expect(*j.at_consumer, id, g, std::chrono::seconds(30));
  CHECK(c.tracker.verdict(id) == kv::request_verdict::pending);  // nothing pushed yet

  const auto push = [&]() -> ferry::task<ferry::batch_result> {
    kv::pushed_request<kv::ucx_link> p(*j.at_producer, id, plan, hang_bound);
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
  j.at_consumer->endpoint().close();
  CHECK(wait_until([&] { return c.receive_ended.load(); }));
}

TEST_CASE("kv over ucx: push whose notice is late times out by the request's abort_timeout, and is "
          "let go only when the late notice comes",
          "[kv-connector][concurrency]") {
  const std::string transports = GENERATE(as<std::string>{}, "tcp", "shm");
  CAPTURE(transports);
  engine producer(transports, 0, 1), consumer(transports, 0, 1);
  joined j(producer, consumer);
  const tables t(8, 3);
  const kv::transfer_plan plan = plan_for(producer, consumer, t.src, t.dst);
  push_consumer c(consumer);
  const kv::block_pairs g{t.src, t.dst};
  const auto start = clock_type::now();
  c.expect(*j.at_consumer, 9, g, std::chrono::milliseconds(300));
  // Every layer written, the notice dropped: the consumer cannot know the layers landed.
  const auto write_only = [&]() -> ferry::task<int> {
    kv::pushed_request<kv::ucx_link> p(*j.at_producer, 9, plan, hang_bound);
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

TEST_CASE("kv over ucx: a failed write is pushed as a failure, and a producer gone mid-push fails "
          "every request it owed at once",
          "[kv-connector][concurrency]") {
  const std::string transports = GENERATE(as<std::string>{}, "tcp", "shm");
  CAPTURE(transports);
  engine producer(transports, 0, 1), consumer(transports, 0, 1);
  joined j(producer, consumer);
  const tables t(8, 4);
  kv::transfer_plan plan = plan_for(producer, consumer, t.src, t.dst);
  push_consumer c(consumer);
  const kv::block_pairs g{t.src, t.dst};
  c.expect(*j.at_consumer, 1, g, std::chrono::seconds(30));
  c.expect(*j.at_consumer, 2, g, std::chrono::seconds(30));

  // Request 1: layer 2's first range points past the consumer's region.
  kv::transfer_plan broken = plan;
  broken.layers[2][0].dst_offset = consumer.region.bytes().size();
  const auto push_broken = [&]() -> ferry::task<ferry::batch_result> {
    kv::pushed_request<kv::ucx_link> p(*j.at_producer, 1, broken, hang_bound);
    for (std::size_t layer = 0; layer < layers; ++layer) p.layer_computed(layer);
    co_return co_await p.finish();
  };
  const ferry::batch_result r = run_on(producer, push_broken());
  CHECK(r.verdict == ferry::verdict::failed);
  CHECK(r.error == kv::errc::region_out_of_range);
  CHECK(c.verdict(1) == kv::request_verdict::failed);

  // Request 2: the producer's endpoint goes mid-push (layers written, no notice): the consumer's
  // receive fails, and request 2 with it, long before its 30 s abort_timeout.
  const auto start = clock_type::now();
  const auto half = [&]() -> ferry::task<int> {
    kv::pushed_request<kv::ucx_link> p(*j.at_producer, 2, plan, hang_bound);
    p.layer_computed(0);
    p.layer_computed(1);
    (void)co_await ferry::when_all(p.writes(), hang_bound);
    co_return 0;
  };
  (void)run_on(producer, half());
  j.at_producer->endpoint().close();
  CHECK(c.verdict(2) == kv::request_verdict::failed);
  CHECK(ms_since(start) < 10000);
  CHECK(wait_until([&] { return c.receive_ended.load(); }));
}

// ---- producers in processes of their own

namespace {

// A producer process: "TRANSPORTS". Listens, tells its port and its handshake, accepts the consumer,
// then takes commands: "push ID SEED" (every layer, then the notice; answers "pushed"), "stall ID
// SEED" (two layers written, then it answers "stalled" and waits for ever: the parent kills it).
int run_kv_producer(int in, int out, const std::string& transports) {
  engine producer(transports, 0, 1);
  producer.fill(11);
  ucx::memory_region exposed = producer.region;
  auto l = producer.worker.listen("127.0.0.1", 0, std::span(&exposed, 1));
  peer::send(out, std::to_string(l.port()));
  peer::send(out, kv::encode(producer.describe("prefill")));
  ucx::endpoint ep = l.accept(hang_bound);
  std::vector<ucx::remote_memory> consumer_regions = ep.peer_regions();
  kv::ucx_link link(std::move(ep), {producer.region}, std::move(consumer_regions));
  const kv::cache_layout consumer_layout = layout_for(1);
  for (;;) {
    const std::string command = peer::text(peer::receive(in, std::chrono::hours(1)));
    if (command.empty()) return 0;
    char verb[16] = {};
    unsigned long long id = 0;
    unsigned seed = 0;
    if (std::sscanf(command.c_str(), "%15s %llu %u", verb, &id, &seed) != 3) return 2;
    const tables t(12, seed);
    const kv::block_pairs g{t.src, t.dst};
    const kv::transfer_plan plan =
        kv::plan_transfer(producer.layout, producer.tp, consumer_layout, {0, 1}, std::span(&g, 1));
    const bool stall = std::string(verb) == "stall";
    const auto push = [&]() -> ferry::task<bool> {
      kv::pushed_request<kv::ucx_link> p(link, id, plan, hang_bound);
      for (std::size_t layer = 0; layer < (stall ? 2u : layers); ++layer) p.layer_computed(layer);
      if (stall) {
        (void)co_await ferry::when_all(p.writes(), hang_bound);
        co_return true;
      }
      const ferry::batch_result r = co_await p.finish();
      const transfer_state noticed = co_await p.notice();
      co_return r.ok() && noticed == transfer_state::success;
    };
    const bool ok = run_on(producer, push());
    if (stall) {
      peer::send(out, std::string("stalled"));
      ::pause();
    }
    peer::send(out, std::string(ok ? "pushed" : "push failed"));
  }
}

[[maybe_unused]] const bool kv_roles_registered = peer::role("kv-producer", &run_kv_producer);

// The consumer's side of a producer process: connected, its link made from the handshake.
struct producer_process {
  producer_process(const std::string& transports, engine& consumer)
      : child("kv-producer", transports) {
    const std::string port = peer::text(child.receive());
    const auto handshake = child.receive();
    REQUIRE(!port.empty());
    REQUIRE(handshake);
    const kv::engine_description d = kv::decode(*handshake);
    ucx::endpoint ep = consumer.worker.connect("127.0.0.1", static_cast<std::uint16_t>(std::stoi(port)),
                                               std::span(&consumer.region, 1), hang_bound);
    link.emplace(kv::ucx_link::to_peer(std::move(ep), {consumer.region}, d));
  }
  peer::process child;
  std::optional<kv::ucx_link> link;
};

}  // namespace

TEST_CASE("kv over ucx, producer in another process: push lands byte-exact, and a producer killed "
          "mid-push fails the request it owed well before its abort_timeout",
          "[kv-connector][concurrency]") {
  const std::string transports = GENERATE(as<std::string>{}, "tcp", "shm");
  CAPTURE(transports);
  engine consumer(transports, 0, 1);
  producer_process p(transports, consumer);
  push_consumer c(consumer);
  SECTION("pushed whole") {
    const tables t(12, 21);
    const kv::block_pairs g{t.src, t.dst};
    c.expect(*p.link, 1, g, std::chrono::seconds(30));
    REQUIRE(p.child.send(std::string("push 1 21")));
    CHECK(peer::text(p.child.receive()) == "pushed");
    CHECK(c.verdict(1) == kv::request_verdict::success);
    // What landed: the producer's bytes (seed 11) through the plan. Read once nothing more is
    // written here (the writes of another process are ordered by the notice, not by anything a
    // race detector sees).
    engine reference(transports, 0, 1);
    reference.fill(11);
    const kv::transfer_plan plan = plan_for(reference, consumer, t.src, t.dst);
    std::vector<std::byte> want(consumer.region.bytes().size());
    std::vector<std::byte> got(consumer.region.bytes().begin(), consumer.region.bytes().end());
    const std::span<const std::byte> src[] = {reference.region.bytes()};
    const std::span<std::byte> dst[] = {want};
    kv::apply_plan(plan, src, dst);
    std::size_t wrong = 0;
    for (const auto& layer : plan.layers) {
      for (const kv::byte_range& r : layer) {
        wrong += std::memcmp(got.data() + r.dst_offset, want.data() + r.dst_offset, r.length) != 0;
      }
    }
    CHECK(wrong == 0);
  }
  SECTION("killed mid-push") {
    const tables t(12, 22);
    const kv::block_pairs g{t.src, t.dst};
    c.expect(*p.link, 2, g, std::chrono::seconds(30));
    REQUIRE(p.child.send(std::string("stall 2 22")));
    REQUIRE(peer::text(p.child.receive()) == "stalled");
    const auto start = clock_type::now();
    p.child.kill(SIGKILL);
    CHECK(c.verdict(2) == kv::request_verdict::failed);  // not timed_out: the death is noticed
    CHECK(ms_since(start) < 10000);
    CHECK(wait_until([&] { return c.receive_ended.load(); }));
  }
}

TEST_CASE("kv over ucx, producer in another process: a pull from a killed producer fails, reports "
          "its blocks once and is released once",
          "[kv-connector][concurrency]") {
  const std::string transports = GENERATE(as<std::string>{}, "tcp", "shm");
  CAPTURE(transports);
  engine consumer(transports, 0, 1);
  producer_process p(transports, consumer);
  engine reference(transports, 0, 1);
  const tables t(12, 31);
  const kv::block_pairs g{t.src, t.dst};
  const kv::transfer_plan plan = plan_for(reference, consumer, t.src, t.dst);
  p.child.kill(SIGKILL);
  const auto consume = [&]() -> ferry::task<int> {
    int released = 0;
    kv::load_tracker tracker([&](kv::request_id, kv::request_verdict v) {
      CHECK(v == kv::request_verdict::failed);
      ++released;
    });
    tracker.begin_step();
    const auto h = tracker.add_request(3);
    kv::pull(*p.link, plan, consumer.layout, std::span(&g, 1), tracker, h, std::chrono::seconds(5));
    tracker.seal(h);
    (void)co_await tracker.when_layer(0, hang_bound);
    const auto drained = tracker.drain_step(hang_bound);
    CHECK(drained.pending == 0);
    CHECK(tracker.verdict(3) == kv::request_verdict::failed);
    const auto finished = tracker.take_finished();
    CHECK(finished.size() == 1);
    std::vector<kv::block_id> failed = tracker.drain_failed_blocks();
    std::sort(failed.begin(), failed.end());
    std::vector<kv::block_id> want(t.dst.begin(), t.dst.end());
    std::sort(want.begin(), want.end());
    CHECK(failed == want);
    CHECK(tracker.drain_failed_blocks().empty());  // once
    co_return released;
  };
  CHECK(run_on(consumer, consume()) == 1);
}

#include <ferry/metrics.hpp>

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdint>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

using namespace ferry::metrics;

// The value of one series line, "name{labels} value", found by its full name-and-labels prefix.
std::string series_value(const std::string& text, const std::string& prefix) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(prefix + " ", 0) == 0) return line.substr(prefix.size() + 1);
  }
  return {};
}

}  // namespace

TEST_CASE("every latency lands in a bucket whose bounds hold it", "[metrics]") {
  for (std::uint64_t v : {0ull, 1ull, 7ull, 8ull, 9ull, 255ull, 256ull, 257ull, 1000ull, 65536ull,
                          123456789ull, (1ull << 40) - 1}) {
    const std::size_t b = detail::bucket_of(v);
    INFO("value " << v << " bucket " << b);
    REQUIRE(b < detail::latency_buckets);
    CHECK(v <= detail::bucket_upper_ns(b));
    if (b > 0 && v > 0) CHECK(v > detail::bucket_upper_ns(b - 1));
  }
  // Within an eighth of the value above the first few buckets.
  for (std::uint64_t v = 16; v < (1ull << 39); v = v * 3 + 1) {
    CHECK(static_cast<double>(detail::bucket_upper_ns(detail::bucket_of(v))) <= v * 1.125 + 1);
  }
  CHECK(detail::bucket_of(~0ull) == detail::latency_buckets - 1);
}

TEST_CASE("per-peer series stop at max_peers peers; later peers count under \"other\"",
          "[metrics]") {
  registry r("uring", {}, 2);
  op_metrics& a = r.operation("read", "10.0.0.1");
  op_metrics& b = r.operation("read", "10.0.0.2");
  op_metrics& c = r.operation("read", "10.0.0.3");
  CHECK(&a != &b);
  CHECK(c.peer() == "other");
  CHECK(&r.operation("read", "10.0.0.4") == &c);
  // A peer already kept keeps its own series for every kind; a new one does not.
  CHECK(r.operation("write", "10.0.0.2").peer() == "10.0.0.2");
  CHECK(r.operation("write", "10.0.0.9").peer() == "other");
  // The totals are their own series whatever the peers.
  CHECK(r.operation("read").peer().empty());
  c.record(100, 1, true);
  std::ostringstream text;
  write_prometheus(text, r);
  CHECK(text.str().find("peer=\"other\"") != std::string::npos);
  CHECK(text.str().find("10.0.0.3") == std::string::npos);
  CHECK(r.snapshot().operations.size() == 6);  // read: a, b, other, total; write: 10.0.0.2, other
}

TEST_CASE("a snapshot adds up what was recorded, by outcome, with bytes of successes only",
          "[metrics]") {
  registry r("uring");
  op_metrics& reads = r.operation("read");
  CHECK(&r.operation("read") == &reads);
  CHECK(&r.operation("read", "peer-a") != &reads);
  for (int i = 0; i < 100; ++i) reads.record(1000 + static_cast<std::uint64_t>(i), 4096, true);
  reads.record(5'000'000, 4096, false);
  const snapshot s = r.snapshot();
  REQUIRE(s.operations.size() == 2);
  const operation_snapshot& o = s.operations[0];
  CHECK(o.kind == "read");
  CHECK(o.succeeded == 100);
  CHECK(o.failed == 1);
  CHECK(o.bytes == 100 * 4096);
  CHECK(o.latency_sum_ns == 100 * 1000 + 4950 + 5'000'000);
  CHECK(o.quantile(0.5).count() >= 1000);
  CHECK(o.quantile(0.5).count() <= 1200);
  CHECK(o.quantile(1.0).count() >= 5'000'000);
  CHECK(s.operations[1].count() == 0);
  CHECK(s.operations[1].quantile(0.5).count() == 0);
}

TEST_CASE("the Prometheus text has a family per metric, cumulative buckets ending in +Inf = _count",
          "[metrics]") {
  registry r("ucx", "worker \"a\"\n");
  r.operation("put", "peer\\1").record(300, 1 << 20, true);
  r.operation("put", "peer\\1").record(2'000'000'000, 1 << 20, true);
  r.operation("get").record(100, 8, false);
  const std::string text = to_prometheus(r);
  CHECK(text.find("# TYPE ferry_operations_total counter\n") != std::string::npos);
  CHECK(text.find("# TYPE ferry_bytes_total counter\n") != std::string::npos);
  CHECK(text.find("# TYPE ferry_operation_duration_seconds histogram\n") != std::string::npos);
  const std::string labels =
      R"({backend="ucx",instance_name="worker \"a\"\n",op="put",peer="peer\\1"})";
  CHECK(series_value(text, "ferry_bytes_total" + labels) == std::to_string(2 << 20));
  CHECK(series_value(text, "ferry_operation_duration_seconds_count" + labels) == "2");
  const std::string bucket = "ferry_operation_duration_seconds_bucket" + labels.substr(0, labels.size() - 1);
  CHECK(series_value(text, bucket + R"(,le="2.56e-07"})") == "0");
  CHECK(series_value(text, bucket + R"(,le="5.12e-07"})") == "1");
  CHECK(series_value(text, bucket + R"(,le="+Inf"})") == "2");
  CHECK(std::stod(series_value(text, "ferry_operation_duration_seconds_sum" + labels)) ==
        Approx(2.0000003));
  const std::string get_labels = R"({backend="ucx",instance_name="worker \"a\"\n",op="get"})";
  CHECK(series_value(text, "ferry_operations_total" + get_labels.substr(0, get_labels.size() - 1) +
                               R"(,outcome="failure"})") == "1");
}

TEST_CASE("recording from many threads while a reader takes snapshots loses nothing",
          "[metrics][concurrency]") {
  registry r("uring");
  op_metrics& m = r.operation("write");
  constexpr int threads = 4;
  constexpr int per_thread = 20000;
  std::atomic<bool> done{false};
  std::uint64_t last = 0;
  bool monotonic = true;
  std::thread reader([&] {
    for (int i = 0; i < 100000 && !done.load(std::memory_order_acquire); ++i) {
      const operation_snapshot s = r.snapshot().operations.at(0);
      if (s.succeeded < last) monotonic = false;
      last = s.succeeded;
    }
  });
  std::vector<std::thread> writers;
  for (int t = 0; t < threads; ++t) {
    writers.emplace_back([&m, t] {
      for (int i = 0; i < per_thread; ++i) {
        m.record(static_cast<std::uint64_t>(100 + t * 1000 + i % 50), 10, true);
      }
    });
  }
  for (auto& w : writers) w.join();
  done.store(true, std::memory_order_release);
  reader.join();
  const operation_snapshot s = m.snapshot();
  CHECK(monotonic);
  CHECK(s.succeeded == threads * per_thread);
  CHECK(s.bytes == 10ull * threads * per_thread);
  std::uint64_t in_buckets = 0;
  for (std::uint64_t c : s.latency) in_buckets += c;
  CHECK(in_buckets == threads * per_thread);
}

TEST_CASE("operations looked up from many threads at once are made once each",
          "[metrics][concurrency]") {
  registry r("verbs");
  std::vector<std::thread> ts;
  std::vector<op_metrics*> seen(8);
  for (int t = 0; t < 8; ++t) {
    ts.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) {
        op_metrics& m = r.operation("read", "peer" + std::to_string(i % 4));
        m.record(1, 1, true);
        if (i == 0) seen[static_cast<std::size_t>(t)] = &m;
      }
    });
  }
  for (auto& t : ts) t.join();
  const snapshot s = r.snapshot();
  CHECK(s.operations.size() == 4);
  std::uint64_t total = 0;
  for (const auto& o : s.operations) total += o.succeeded;
  CHECK(total == 8 * 200);
  for (op_metrics* p : seen) CHECK(p == seen[0]);
}

TEST_CASE("series made from many threads while a reader takes snapshots: each seen whole, none lost",
          "[metrics][concurrency]") {
  registry r("uring", {}, 1000);
  constexpr int threads = 4;
  constexpr int peers_each = 150;
  std::atomic<bool> done{false};
  bool well_formed = true;
  std::size_t most_seen = 0;
  std::thread reader([&] {
    for (int i = 0; i < 100000 && !done.load(std::memory_order_acquire); ++i) {
      const snapshot s = r.snapshot();
      for (const auto& o : s.operations) {
        if (o.kind != "send" || o.peer.rfind("10.", 0) != 0 || o.succeeded > 1) well_formed = false;
      }
      most_seen = std::max(most_seen, s.operations.size());
    }
  });
  std::vector<std::thread> makers;
  for (int t = 0; t < threads; ++t) {
    makers.emplace_back([&r, t] {
      for (int i = 0; i < peers_each; ++i) {
        r.operation("send", "10." + std::to_string(t) + ".0." + std::to_string(i)).record(5, 1, true);
      }
    });
  }
  for (auto& m : makers) m.join();
  done.store(true, std::memory_order_release);
  reader.join();
  const snapshot s = r.snapshot();
  CHECK(well_formed);
  CHECK(most_seen <= s.operations.size());
  REQUIRE(s.operations.size() == threads * peers_each);
  for (const auto& o : s.operations) CHECK(o.succeeded == 1);
}

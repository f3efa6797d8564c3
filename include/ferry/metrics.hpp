#pragma once
// Metrics a server can export: per operation kind (and per peer, where a backend has peers) the
// operations that ended, how they ended, the bytes they moved and a latency histogram, readable as a
// snapshot at any moment and written in the Prometheus text exposition format for a server's own
// HTTP endpoint.
//
// A backend records into a registry only when it was given one (ring_options::metrics,
// worker_options::metrics, device_options::metrics); without one it costs a null-pointer test per
// operation. Recording is a handful of relaxed atomic additions on a shard picked by the recording
// thread (detail/metric_shards.hpp), so completions on different threads do not share a cache line;
// a snapshot adds the shards up. A snapshot taken while operations complete is not one instant: each
// figure is exact for some moment during the read, and the histogram's count and sum may disagree by
// the few operations that completed while it was read.
//
// Latencies are kept in log-linear buckets (eight per power of two: within 12.5 %), from 1 ns to
// about 18 minutes; longer ones land in the last bucket. The Prometheus export folds them into
// buckets bounded by powers of two from 256 ns to about 69 s, the same bounds for every series, so that
// series aggregate.

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <ostream>
#include <set>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ferry/detail/metric_shards.hpp"

namespace ferry::metrics {

/// What one op_metrics holds, added up over its shards.
struct operation_snapshot {
  std::string kind;  ///< "read", "write", "send", "receive", "get", "put", ...
  std::string peer;  ///< empty: every peer (or a backend without peers)
  std::uint64_t succeeded = 0;  ///< operations that succeeded
  std::uint64_t failed = 0;     ///< failed or cancelled
  std::uint64_t bytes = 0;      ///< moved by operations that succeeded
  std::uint64_t latency_sum_ns = 0;  ///< the latencies of all of them added up, in nanoseconds
  std::array<std::uint64_t, detail::latency_buckets> latency{};  ///< counts per bucket

  /// Operations that ended, whichever way.
  [[nodiscard]] std::uint64_t count() const noexcept { return succeeded + failed; }

  /// The latency at quantile q (0..1) as the upper bound of the bucket it falls in; 0 when empty.
  [[nodiscard]] std::chrono::nanoseconds quantile(double q) const noexcept {
    std::uint64_t total = 0;
    for (std::uint64_t c : latency) total += c;
    if (total == 0) return std::chrono::nanoseconds(0);
    q = std::clamp(q, 0.0, 1.0);
    const auto rank = static_cast<std::uint64_t>(q * static_cast<double>(total - 1)) + 1;
    std::uint64_t seen = 0;
    for (std::size_t i = 0; i < latency.size(); ++i) {
      seen += latency[i];
      if (seen >= rank) {
        return std::chrono::nanoseconds(static_cast<std::int64_t>(detail::bucket_upper_ns(i)));
      }
    }
    return std::chrono::nanoseconds(
        static_cast<std::int64_t>(detail::bucket_upper_ns(latency.size() - 1)));
  }
};

/// One operation kind's figures (for one peer, or all). Addresses are stable for the registry's life:
/// a backend looks one up once and records into it without further lookups.
class op_metrics {
 public:
  /// Empty figures for `kind` and `peer` (a registry makes them: registry::operation).
  op_metrics(std::string kind, std::string peer) : kind_(std::move(kind)), peer_(std::move(peer)) {}
  op_metrics(const op_metrics&) = delete;
  op_metrics& operator=(const op_metrics&) = delete;

  /// One operation that ended after `latency_ns`; `bytes` counts only when it succeeded.
  void record(std::uint64_t latency_ns, std::uint64_t bytes, bool succeeded) noexcept {
    detail::metric_shard& s = shards_[detail::this_thread_shard()];
    // Relaxed throughout: each figure is a sum read on its own; nothing is published through them.
    (succeeded ? s.succeeded : s.failed).fetch_add(1, std::memory_order_relaxed);
    if (succeeded) s.bytes.fetch_add(bytes, std::memory_order_relaxed);
    s.latency_sum_ns.fetch_add(latency_ns, std::memory_order_relaxed);
    s.latency[detail::bucket_of(latency_ns)].fetch_add(1, std::memory_order_relaxed);
  }

  /// The figures so far, added up over the shards; any thread.
  [[nodiscard]] operation_snapshot snapshot() const {
    operation_snapshot out;
    out.kind = kind_;
    out.peer = peer_;
    for (const detail::metric_shard& s : shards_) {
      out.succeeded += s.succeeded.load(std::memory_order_relaxed);
      out.failed += s.failed.load(std::memory_order_relaxed);
      out.bytes += s.bytes.load(std::memory_order_relaxed);
      out.latency_sum_ns += s.latency_sum_ns.load(std::memory_order_relaxed);
      for (std::size_t i = 0; i < out.latency.size(); ++i) {
        out.latency[i] += s.latency[i].load(std::memory_order_relaxed);
      }
    }
    return out;
  }

  /// The operation kind these figures count ("read", "put", ...).
  [[nodiscard]] const std::string& kind() const noexcept { return kind_; }
  /// The peer they count (empty: every peer).
  [[nodiscard]] const std::string& peer() const noexcept { return peer_; }

 private:
  std::string kind_;
  std::string peer_;
  std::array<detail::metric_shard, detail::metric_shard_count> shards_{};
};

/// Every series of one registry at one moment (registry::snapshot()).
struct snapshot {
  std::string backend;  ///< the registry's backend label ("uring", "ucx", "verbs")
  std::vector<operation_snapshot> operations;  ///< in the order they were first looked up
};

/// The figures of one backend instance (a ring, a worker, a device). It must outlive the backend it
/// is given to. Lookups take a lock and may allocate; recording takes neither.
///
/// Per-peer series are kept for at most `max_peers` distinct peers (default 256): a server that sees
/// many short-lived peers (clients that come and go, each with a new address) would otherwise grow
/// its registry, and its exposition, without bound. Operations of peers beyond that are counted
/// under the peer `other_peer` ("other"), as are those of a peer whose own label is "other"; the
/// kinds' totals count every operation either way.
class registry {
 public:
  /// How many distinct peers get series of their own unless the constructor says otherwise.
  static constexpr std::size_t default_max_peers = 256;
  /// The peer label that operations of peers beyond max_peers are counted under.
  static constexpr std::string_view other_peer = "other";

  /// `backend` labels every series ("uring", "ucx", "verbs"); `instance` (optional) tells two
  /// backends of one kind apart in one export.
  explicit registry(std::string backend, std::string instance = {},
                    std::size_t max_peers = default_max_peers)
      : backend_(std::move(backend)), instance_(std::move(instance)), max_peers_(max_peers) {}
  registry(const registry&) = delete;
  registry& operator=(const registry&) = delete;

  /// The figures of `kind` for `peer` (empty: not per peer), made on first use; for a peer beyond
  /// max_peers, the figures of `kind` for other_peer.
  [[nodiscard]] op_metrics& operation(std::string_view kind, std::string_view peer = {}) {
    std::lock_guard lock(mutex_);
    if (!peer.empty() && peer != other_peer && !peers_.contains(peer)) {
      if (peers_.size() >= max_peers_) {
        peer = other_peer;
      } else {
        peers_.emplace(peer);
      }
    }
    const auto key = std::make_pair(std::string(kind), std::string(peer));
    if (const auto it = index_.find(key); it != index_.end()) return *it->second;
    ops_.push_back(std::make_unique<op_metrics>(key.first, key.second));
    op_metrics& m = *ops_.back();
    try {
      index_.emplace(key, &m);
    } catch (...) {
      ops_.pop_back();  // unindexed, a later lookup would make the same series twice
      throw;
    }
    return m;
  }

  /// Every series, added up over its shards. The lock is held only to copy the list of series, not
  /// while they are read, so that a backend looking up a new series does not wait for a snapshot.
  [[nodiscard]] metrics::snapshot snapshot() const {
    metrics::snapshot out;
    out.backend = backend_;
    std::vector<const op_metrics*> all;
    {
      std::lock_guard lock(mutex_);
      all.reserve(ops_.size());
      for (const auto& m : ops_) all.push_back(m.get());
    }
    out.operations.reserve(all.size());
    for (const op_metrics* m : all) out.operations.push_back(m->snapshot());
    return out;
  }

  /// The backend label of every series ("uring", "ucx", "verbs").
  [[nodiscard]] const std::string& backend() const noexcept { return backend_; }
  /// The instance label (empty: none), exported as instance_name.
  [[nodiscard]] const std::string& instance() const noexcept { return instance_; }
  /// How many distinct peers get series of their own.
  [[nodiscard]] std::size_t max_peers() const noexcept { return max_peers_; }

 private:
  std::string backend_;
  std::string instance_;
  std::size_t max_peers_;
  mutable std::mutex mutex_;
  // In the order they were first looked up; never shrinks, and the series' addresses are stable.
  std::vector<std::unique_ptr<op_metrics>> ops_;
  std::map<std::pair<std::string, std::string>, op_metrics*> index_;
  std::set<std::string, std::less<>> peers_;
};

/// The clock backends stamp operations with: steady, in nanoseconds.
[[nodiscard]] inline std::uint64_t now_ns() noexcept {
  return static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                        std::chrono::steady_clock::now().time_since_epoch())
                                        .count());
}

/// A backend's hook, for a backend whose completions all end on one thread (its executor): the
/// figures per operation kind, looked up once, and per peer through a slot the peer's own state
/// keeps. Detached (no registry), stamp() returns 0 and record_cached() does nothing after one test.
class backend_meter {
 public:
  /// The most operation kinds one meter records.
  static constexpr std::size_t max_kinds = 8;

  /// Records into registry `r` from now on (null: detached), looking each kind's figures up once.
  /// `kinds` name the operation kinds by index (at most max_kinds); `r` may be null.
  void attach(registry* r, std::initializer_list<const char*> kinds) {
    registry_ = r;
    if (r == nullptr) return;
    std::size_t i = 0;
    for (const char* k : kinds) {
      if (i == max_kinds) break;
      names_[i] = k;
      kinds_[i++] = &r->operation(k);
    }
  }

  /// True when attached to a registry (figures are recorded).
  [[nodiscard]] bool attached() const noexcept { return registry_ != nullptr; }

  /// When an operation was submitted; 0 when detached, which record() then ignores.
  [[nodiscard]] std::uint64_t stamp() const noexcept { return registry_ != nullptr ? now_ns() : 0; }

  /// An operation of kind `kind` stamped at `started_ns` ended. Each peer's figures are kept with
  /// the peer itself (a queue pair, a connection, an endpoint), so that they go with it: `cache` is
  /// that peer's slot for `kind`, null until its first operation, and `peer` its label (empty: the
  /// operation counts only in the kind's figures). `ended_ns` is when
  /// it ended (0: now), for a backend that reads the clock once for many; an end before the start
  /// (stamped before an operation published after it) counts as no time.
  void record_cached(std::size_t kind, std::uint64_t started_ns, std::uint64_t bytes,
                     bool succeeded, op_metrics*& cache, std::string_view peer,
                     std::uint64_t ended_ns = 0) noexcept {
    if (started_ns == 0 || kind >= max_kinds || kinds_[kind] == nullptr) return;
    const std::uint64_t ended = ended_ns != 0 ? ended_ns : now_ns();
    const std::uint64_t latency = ended > started_ns ? ended - started_ns : 0;
    kinds_[kind]->record(latency, bytes, succeeded);
    if (peer.empty()) return;
    if (cache == nullptr) {
      try {
        cache = &registry_->operation(names_[kind], peer);
      } catch (...) {
        return;  // out of memory: the peer's figures miss this operation; the kind's have it
      }
    }
    cache->record(latency, bytes, succeeded);
  }

 private:
  registry* registry_ = nullptr;
  std::array<const char*, max_kinds> names_{};
  std::array<op_metrics*, max_kinds> kinds_{};
};

namespace detail {

// A label value as the exposition format wants it: backslash, double quote and newline escaped.
inline void write_label_value(std::ostream& out, std::string_view v) {
  out << '"';
  for (char c : v) {
    switch (c) {
      case '\\': out << "\\\\"; break;
      case '"': out << "\\\""; break;
      case '\n': out << "\\n"; break;
      default: out << c;
    }
  }
  out << '"';
}

inline void write_labels(std::ostream& out, const registry& r, const operation_snapshot& op,
                         const char* extra_name = nullptr, std::string_view extra_value = {}) {
  out << "{backend=";
  write_label_value(out, r.backend());
  if (!r.instance().empty()) {
    out << ",instance_name=";
    write_label_value(out, r.instance());
  }
  out << ",op=";
  write_label_value(out, op.kind);
  if (!op.peer.empty()) {
    out << ",peer=";
    write_label_value(out, op.peer);
  }
  if (extra_name != nullptr) {
    out << ',' << extra_name << '=';
    write_label_value(out, extra_value);
  }
  out << '}';
}

// Seconds in the shortest form that reads back exactly enough ("2.56e-07").
inline std::string seconds_text(std::uint64_t ns) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.9g", static_cast<double>(ns) * 1e-9);
  return buf;
}

}  // namespace detail

/// Writes every registry's figures in the Prometheus text exposition format (version 0.0.4): each
/// metric family once, with its HELP and TYPE lines, then one series per registry and operation.
///
///     ferry_operations_total{backend,op,peer,outcome}   counter
///     ferry_bytes_total{backend,op,peer}                counter
///     ferry_operation_duration_seconds{backend,op,peer} histogram (_bucket with le, _sum, _count)
inline void write_prometheus(std::ostream& out, std::span<const registry* const> registries) {
  std::vector<std::pair<const registry*, metrics::snapshot>> all;
  all.reserve(registries.size());
  for (const registry* r : registries) all.emplace_back(r, r->snapshot());

  out << "# HELP ferry_operations_total Transfers that ended, by backend, operation kind, peer "
         "and outcome.\n# TYPE ferry_operations_total counter\n";
  for (const auto& [r, s] : all) {
    for (const operation_snapshot& op : s.operations) {
      out << "ferry_operations_total";
      detail::write_labels(out, *r, op, "outcome", "success");
      out << ' ' << op.succeeded << '\n';
      out << "ferry_operations_total";
      detail::write_labels(out, *r, op, "outcome", "failure");
      out << ' ' << op.failed << '\n';
    }
  }
  out << "# HELP ferry_bytes_total Bytes moved by transfers that succeeded.\n"
         "# TYPE ferry_bytes_total counter\n";
  for (const auto& [r, s] : all) {
    for (const operation_snapshot& op : s.operations) {
      out << "ferry_bytes_total";
      detail::write_labels(out, *r, op);
      out << ' ' << op.bytes << '\n';
    }
  }
  out << "# HELP ferry_operation_duration_seconds Time from submission to completion.\n"
         "# TYPE ferry_operation_duration_seconds histogram\n";
  for (const auto& [r, s] : all) {
    for (const operation_snapshot& op : s.operations) {
      // The fine buckets' bounds fall on the powers of two, so each exported bucket is an exact
      // sum of fine ones; the count comes from the same buckets so that +Inf equals it.
      std::uint64_t cumulative = 0;
      std::size_t fine = 0;
      for (unsigned p = detail::export_first_power; p <= detail::export_last_power; ++p) {
        const std::uint64_t bound = std::uint64_t{1} << p;
        while (fine < op.latency.size() && detail::bucket_upper_ns(fine) <= bound) {
          cumulative += op.latency[fine++];
        }
        out << "ferry_operation_duration_seconds_bucket";
        detail::write_labels(out, *r, op, "le", detail::seconds_text(bound));
        out << ' ' << cumulative << '\n';
      }
      while (fine < op.latency.size()) cumulative += op.latency[fine++];
      out << "ferry_operation_duration_seconds_bucket";
      detail::write_labels(out, *r, op, "le", "+Inf");
      out << ' ' << cumulative << '\n';
      out << "ferry_operation_duration_seconds_sum";
      detail::write_labels(out, *r, op);
      out << ' ' << detail::seconds_text(op.latency_sum_ns) << '\n';
      out << "ferry_operation_duration_seconds_count";
      detail::write_labels(out, *r, op);
      out << ' ' << cumulative << '\n';
    }
  }
}

/// Writes one registry's figures in the Prometheus text exposition format.
inline void write_prometheus(std::ostream& out, const registry& r) {
  const registry* one[] = {&r};
  write_prometheus(out, std::span<const registry* const>(one));
}

/// The Prometheus text exposition of every registry's figures, as a string.
[[nodiscard]] inline std::string to_prometheus(std::span<const registry* const> registries) {
  std::ostringstream out;
  write_prometheus(out, registries);
  return std::move(out).str();
}

/// The Prometheus text exposition of one registry's figures, as a string.
[[nodiscard]] inline std::string to_prometheus(const registry& r) {
  std::ostringstream out;
  write_prometheus(out, r);
  return std::move(out).str();
}

}  // namespace ferry::metrics

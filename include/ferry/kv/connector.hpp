#pragma once
// Moving a request's KV cache between engines with a transfer plan, over any backend that reads and
// writes a peer's registered regions one-sidedly and carries ordered notifications (a
// `one_sided_link`: kv/ucx_link.hpp over UCX, kv/verbs_link.hpp over RDMA verbs).
//
// Pull: the consumer (decode) reads every layer's ranges with pull() and tracks them in its
// load_tracker; when the tracker releases the request, release_to() tells the producer, whose
// serve_releases() acknowledges it in the producer's release_ledger, which frees the source blocks.
//
// Push: the producer (prefill) writes each layer as soon as the engine says it is computed
// (pushed_request::layer_computed), then finish() waits for every write to land and tells the
// consumer, with one notification, that every layer of the request landed (or that a write
// failed). The consumer's push_receiver has one transfer per layer in the load_tracker, ended by
// that notification; a notification that never comes fails the request by the tracker's
// abort_timeout (push_receiver::cancel is the tracker's cancel function), and a producer that dies
// fails every request it owed at once (the receive fails with the backend's error).
//
// A notification carries the request id and one bit, set when a write failed: request ids must be
// below 2^63. Everything here runs on the engine's thread, as the load_tracker does; the
// transfers' completions arrive from the progress executor.

#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <system_error>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ferry/batch_result.hpp"
#include "ferry/kv/errors.hpp"
#include "ferry/kv/layout.hpp"
#include "ferry/kv/load_tracker.hpp"
#include "ferry/kv/plan.hpp"
#include "ferry/kv/release_ledger.hpp"
#include "ferry/task.hpp"
#include "ferry/transfer.hpp"
#include "ferry/when_all.hpp"

namespace ferry::kv {

/// A peer this engine reads from and writes to one-sidedly, by the region numbers of the two
/// sides' cache layouts, with an ordered channel of 64-bit notifications.
///
/// - `read(ranges, out, timeout)`: each range from the peer's `src_region` into this side's
///   `dst_region`; out[i] ends once range i is in local memory.
/// - `write(ranges, out, timeout)`: each range from this side's `src_region` into the peer's
///   `dst_region`; out[i] ends once range i has landed in the peer's memory.
/// - `notify(value, timeout)`: sent once every write before it has landed.
/// - `next_notification(value&, timeout)`: the peer's next notification, in order.
///
/// A range outside a region fails its own transfer; nothing throws for a bad range.
template <class L>
concept one_sided_link = requires(L& l, std::span<const byte_range> ranges, std::span<transfer> out,
                                  std::chrono::nanoseconds timeout, std::uint64_t value,
                                  std::uint64_t& into) {
  l.read(ranges, out, timeout);
  l.write(ranges, out, timeout);
  { l.notify(value, timeout) } -> std::same_as<transfer>;
  { l.next_notification(into, timeout) } -> std::same_as<transfer>;
};

/// What a push notification says: every write of `request` landed, or one failed.
struct push_notice {
  request_id request = 0;  ///< the request the producer pushed
  bool failed = false;     ///< a write of it failed: its layers did not all land

  /// The notification's 64 bits: the request id, and the top bit when a write failed.
  [[nodiscard]] std::uint64_t encode() const {
    if (request >= failed_bit) {
      throw std::invalid_argument("ferry::kv::push_notice: request id " + std::to_string(request) +
                                  " is not below 2^63, which a push notification can carry");
    }
    return request | (failed ? failed_bit : 0);
  }
  /// The notice a notification's bits carry.
  [[nodiscard]] static push_notice decode(std::uint64_t value) noexcept {
    return {value & ~failed_bit, (value & failed_bit) != 0};
  }

  /// The bit that says a write failed.
  static constexpr std::uint64_t failed_bit = std::uint64_t{1} << 63;
};

}  // namespace ferry::kv

// In ferry::detail, not ferry::kv::detail, which would hide ferry::detail from the kv headers'
// unqualified detail:: names.
namespace ferry::detail::kv_connector {

using ferry::kv::block_id;
using ferry::kv::block_pairs;
using ferry::kv::cache_layout;
using ferry::kv::errc;
using ferry::kv::transfer_plan;

// The destination block ids of each group's table, in the tracker's numbering.
[[nodiscard]] inline std::vector<std::vector<block_id>> destination_ids(
    std::span<const block_pairs> groups) {
  std::vector<std::vector<block_id>> ids(groups.size());
  for (std::size_t g = 0; g < groups.size(); ++g) ids[g].assign(groups[g].dst.begin(), groups[g].dst.end());
  return ids;
}

// The destination block ids layer `layer` of a request writes: the table of the layer's group.
[[nodiscard]] inline std::span<const block_id> layer_blocks(
    const cache_layout& dst, const std::vector<std::vector<block_id>>& ids, std::size_t layer) {
  const std::uint32_t group = dst.layers[layer].group;
  if (group >= ids.size()) {
    throw std::system_error(make_error_code(errc::bad_block_table),
                            "ferry::kv: layer " + std::to_string(layer) + " is in group " +
                                std::to_string(group) + ", but the request has block tables for " +
                                std::to_string(ids.size()) + " group(s)");
  }
  return ids[group];
}

inline void check_plan(const transfer_plan& plan, const cache_layout& dst, const char* who) {
  if (plan.layers.size() != dst.layers.size()) {
    throw std::invalid_argument(std::string(who) + ": the plan has " +
                                std::to_string(plan.layers.size()) + " layers, the layout " +
                                std::to_string(dst.layers.size()));
  }
}

}  // namespace ferry::detail::kv_connector

namespace ferry::kv {

/// Pull: reads every layer of a request with `plan` from `from` and adds each layer's transfers to
/// `tracker` under `request` (the layer's destination blocks: the request's block table for the
/// layer's group in `dst`). The caller seals the request. `timeout` bounds each read. The request
/// must be open (not sealed): each layer's reads are posted before the tracker takes them, so if
/// it refuses them (it throws), reads already posted still land; abort the request then and keep
/// its blocks out of use until they have ended.
template <one_sided_link Link, class Rep, class Period>
void pull(Link& from, const transfer_plan& plan, const cache_layout& dst,
          std::span<const block_pairs> groups, load_tracker& tracker,
          load_tracker::request_handle request, std::chrono::duration<Rep, Period> timeout) {
  detail::kv_connector::check_plan(plan, dst, "ferry::kv::pull");
  const auto ids = detail::kv_connector::destination_ids(groups);
  std::vector<transfer> out;
  for (std::size_t layer = 0; layer < plan.layers.size(); ++layer) {
    const std::vector<byte_range>& ranges = plan.layers[layer];
    if (ranges.empty()) continue;
    const std::span<const block_id> blocks = detail::kv_connector::layer_blocks(dst, ids, layer);
    out.assign(ranges.size(), transfer());
    from.read(ranges, out, std::chrono::duration_cast<std::chrono::nanoseconds>(timeout));
    for (transfer& t : out) tracker.add(request, layer, std::move(t), blocks);
  }
}

/// Pull: the consumer's release function for its load_tracker: tells the producer behind `to`
/// that the request is done with (a notification carrying its id), so that the producer's
/// serve_releases() acknowledges it. The link must outlive the tracker.
template <one_sided_link Link, class Rep, class Period>
[[nodiscard]] load_tracker::release_fn release_to(Link& to, std::chrono::duration<Rep, Period> timeout) {
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(timeout);
  return [&to, ns](request_id id, request_verdict) { (void)to.notify(id, ns); };
}

/// Pull, on the producer: acknowledges in `ledger`, as consumer `rank`, every release the consumer
/// behind `from` sends, until the link fails or is closed; returns that error.
template <one_sided_link Link>
[[nodiscard]] task<std::error_code> serve_releases(Link& from, release_ledger& ledger, rank_id rank) {
  for (;;) {
    std::uint64_t value = 0;
    transfer next = from.next_notification(value, std::chrono::nanoseconds(-1));
    // Awaited into a variable: g++ 12 miscompiles a co_await inside a condition.
    const transfer_state st = co_await next;
    if (st != transfer_state::success) co_return next.error();
    (void)ledger.acknowledge(value, rank);
  }
}

/// Push, on the producer: one request written to one consumer, layer by layer as the engine
/// computes them, then confirmed with one notification. One per request and consumer; the plan
/// and the link must outlive it.
template <one_sided_link Link>
class pushed_request {
 public:
  /// `timeout` bounds each write and the notification.
  template <class Rep, class Period>
  pushed_request(Link& to, request_id id, const transfer_plan& plan,
                 std::chrono::duration<Rep, Period> timeout)
      : to_(&to), id_(id), plan_(&plan),
        timeout_(std::chrono::duration_cast<std::chrono::nanoseconds>(timeout)),
        written_(plan.layers.size(), false) {
    (void)push_notice{id, false}.encode();  // refuses an id a notification cannot carry
  }

  /// Writes layer `layer`'s ranges now. Each layer once; a layer out of range or written twice is
  /// a std::logic_error.
  void layer_computed(std::size_t layer) {
    if (layer >= written_.size()) {
      throw std::logic_error("ferry::kv::pushed_request: layer " + std::to_string(layer) +
                             " of a plan with " + std::to_string(written_.size()) + " layers");
    }
    if (written_[layer]) {
      throw std::logic_error("ferry::kv::pushed_request: layer " + std::to_string(layer) +
                             " of request " + std::to_string(id_) + " was written already");
    }
    const std::vector<byte_range>& ranges = plan_->layers[layer];
    const std::size_t first = writes_.size();
    writes_.resize(first + ranges.size());
    to_->write(ranges, std::span(writes_).subspan(first), timeout_);
    written_[layer] = true;  // only once its writes were posted
  }

  /// Once every layer was written: waits for the writes to end, then tells the consumer whether
  /// they all landed (one notification). Returns the writes' verdict; the notification's transfer
  /// is notice(). A layer never written is a std::logic_error.
  [[nodiscard]] task<batch_result> finish() {
    if (finished_) {
      throw std::logic_error("ferry::kv::pushed_request::finish: request " + std::to_string(id_) +
                             " was finished already (a second notice would end a later request "
                             "with the same id)");
    }
    finished_ = true;
    for (std::size_t layer = 0; layer < written_.size(); ++layer) {
      if (!written_[layer]) {
        throw std::logic_error("ferry::kv::pushed_request::finish: layer " + std::to_string(layer) +
                               " of request " + std::to_string(id_) + " was never written");
      }
    }
    const batch_result r = co_await when_all(writes_, timeout_);
    notice_ = to_->notify(push_notice{id_, !r.ok()}.encode(), timeout_);
    co_return r;
  }

  /// Every write so far: the source blocks are in use until each is terminal.
  [[nodiscard]] std::span<const transfer> writes() const noexcept { return writes_; }
  /// The notification finish() sent (empty before): success once the consumer holds it.
  [[nodiscard]] const transfer& notice() const noexcept { return notice_; }
  /// The request this pushes.
  [[nodiscard]] request_id id() const noexcept { return id_; }

 private:
  Link* to_;
  request_id id_;
  const transfer_plan* plan_;
  std::chrono::nanoseconds timeout_;
  std::vector<bool> written_;
  bool finished_ = false;
  std::vector<transfer> writes_;
  transfer notice_;
};

/// Push, on the consumer: tracks pushed requests in a load_tracker (one transfer per layer), ended
/// by the producer's notifications, which receive() takes. Give the tracker cancel() as its cancel
/// function, so that a request whose notification never comes fails by its abort_timeout. One
/// engine thread calls it, as it calls the tracker. A request that times out is let go only once
/// nothing can write into its blocks any more: its late notification or the link's failure (a
/// producer must therefore send every notice, "failed" included, or close the link).
///
/// What the consumer cannot see, and the engine must arrange:
/// - expect() a request before its producer can push it: a notice that comes first is counted in
///   stale() and lost, and the request then fails by its abort_timeout although its data landed;
/// - do not expect an id again on a link while an earlier attempt's notice may still come: that
///   notice would end the new attempt.
class push_receiver {
 public:
  push_receiver() = default;
  push_receiver(const push_receiver&) = delete;
  push_receiver& operator=(const push_receiver&) = delete;

  /// Fails what is still expected (ferry::errc::abandoned), so that nothing waits on it.
  ~push_receiver() {
    for (auto& [id, p] : expected_) {
      for (completer& c : p.layers) c.fail(make_error_code(ferry::errc::abandoned));
    }
  }

  /// Expects request `id` (added to `tracker` as `request`): one transfer per layer of `dst`,
  /// writing that layer's destination blocks, ended by the producer's notification. The caller
  /// seals the request. An id already expected is a std::logic_error.
  void expect(load_tracker& tracker, load_tracker::request_handle request, request_id id,
              const cache_layout& dst, std::span<const block_pairs> groups) {
    (void)push_notice{id, false}.encode();
    if (expected_.contains(id)) {
      throw std::logic_error("ferry::kv::push_receiver: request " + std::to_string(id) +
                             " is expected already");
    }
    // Every layer's block table first: a bad one throws before anything is made.
    const auto ids = detail::kv_connector::destination_ids(groups);
    std::vector<std::span<const block_id>> blocks(dst.layers.size());
    for (std::size_t layer = 0; layer < blocks.size(); ++layer) {
      blocks[layer] = detail::kv_connector::layer_blocks(dst, ids, layer);
    }
    pending p;
    p.layers.reserve(blocks.size());
    p.statuses.reserve(blocks.size());
    for (std::size_t layer = 0; layer < blocks.size(); ++layer) {
      auto [t, c] = make_manual_transfer();
      p.statuses.push_back(t.status());
      p.layers.push_back(std::move(c));
      // Throws for a handle the tracker refuses: the completers go with `p`, so the layers added
      // so far end abandoned, and nothing here names their statuses.
      tracker.add(request, layer, std::move(t), blocks[layer]);
    }
    for (const void* s : p.statuses) by_status_.insert_or_assign(s, id);
    expected_.emplace(id, std::move(p));
  }

  /// The tracker's cancel function, for a request whose notification did not come in time (its
  /// verdict is timed_out): the request drains. Its producer may still be writing into its blocks,
  /// so its transfers stay pending (the tracker keeps the request and its blocks) until the late
  /// notification comes or the link fails; then they end cancelled, and take_finished hands the
  /// request back (as failed, ferry::errc::cancelled).
  void cancel(const transfer& t) {
    const auto found = by_status_.find(t.status());
    if (found == by_status_.end()) return;
    pending& p = expected_.at(found->second);
    if (!p.draining) ++draining_;
    p.draining = true;
  }

  /// Takes the producer's notifications from `from` and ends the requests they name, until the
  /// link fails or is closed: then every request still expected fails with that error, which is
  /// returned. A notification for a request not expected (late, or never asked for) is counted in
  /// stale().
  template <one_sided_link Link>
  [[nodiscard]] task<std::error_code> receive(Link& from) {
    for (;;) {
      std::uint64_t value = 0;
      transfer next = from.next_notification(value, std::chrono::nanoseconds(-1));
      const transfer_state st = co_await next;  // not in the condition: g++ 12
      if (st != transfer_state::success) {
        const std::error_code why = next.error();
        while (!expected_.empty()) end(expected_.begin()->first, transfer_state::failed, why);
        co_return why;
      }
      const push_notice n = push_notice::decode(value);
      const auto found = expected_.find(n.request);
      if (found == expected_.end()) {
        ++stale_;
      } else if (found->second.draining) {
        ++stale_;  // late: the request timed out, and now nothing more will write into it
        end(n.request, transfer_state::cancelled, {});
      } else if (n.failed) {
        end(n.request, transfer_state::failed, make_error_code(errc::push_failed));
      } else {
        end(n.request, transfer_state::success, {});
      }
    }
  }

  /// Requests that timed out and wait for their late notification (or the link's failure) before
  /// the tracker may let go of their blocks.
  [[nodiscard]] std::size_t draining() const noexcept { return draining_; }
  /// Requests expected whose notification has not come (draining ones included).
  [[nodiscard]] std::size_t expected() const noexcept { return expected_.size(); }
  /// Notifications for requests that were not expected, or that came after their request timed
  /// out (those end the draining request).
  [[nodiscard]] std::uint64_t stale() const noexcept { return stale_; }

 private:
  void end(request_id id, transfer_state to, std::error_code ec) {
    const auto found = expected_.find(id);
    if (found == expected_.end()) return;
    pending p = std::move(found->second);
    expected_.erase(found);
    if (p.draining) --draining_;
    for (const void* s : p.statuses) by_status_.erase(s);
    for (completer& c : p.layers) c.complete(to, ec);
  }

  // A request expected: its layers' completers, and their statuses (the keys of by_status_).
  struct pending {
    std::vector<completer> layers;
    std::vector<const void*> statuses;
    bool draining = false;  // timed out: ends with its late notification or the link's failure
  };

  std::unordered_map<request_id, pending> expected_;
  std::unordered_map<const void*, request_id> by_status_;
  std::uint64_t stale_ = 0;
  std::size_t draining_ = 0;
};

}  // namespace ferry::kv

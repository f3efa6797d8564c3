#pragma once
// The producer side: a prefill machine may free the source blocks of a transfer only once every
// consumer that reads them has acknowledged (fan-in from several decode ranks). Acknowledgements come
// over the network, so they may be duplicated, arrive late (after the blocks were freed), or arrive
// early (before the producer has recorded the transfer). The ledger frees each transfer exactly once:
//
//   - a duplicate acknowledgement from the same rank counts once;
//   - an acknowledgement for a transfer already freed (late or stale) is ignored: finished ids are
//     remembered in a bounded set, oldest forgotten first;
//   - an acknowledgement for a transfer not yet expected is kept in a bounded buffer and counted once
//     when expect() arrives; when the buffer is full the oldest early transfer is dropped (and
//     reported by the return value).
//
// Thread-safe: acknowledgements may arrive on any thread. The free callback runs outside the lock,
// on the thread whose call completed the fan-in.

#include <cstddef>
#include <cstdint>
#include <algorithm>
#include <deque>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace ferry::kv {

/// The producer's number for one posted transfer (whose source blocks the ledger frees).
using transfer_id = std::uint64_t;
/// A consumer (decode rank) that acknowledges transfers.
using rank_id = std::uint32_t;

/// What release_ledger::acknowledge made of one acknowledgement.
enum class ack_result {
  counted,      ///< recorded; more acknowledgements are expected
  freed,        ///< this acknowledgement completed the fan-in: the blocks were freed
  duplicate,    ///< this rank had already acknowledged this transfer
  stale,        ///< the transfer was already freed (a late or repeated acknowledgement)
  early,        ///< the transfer is not known yet: kept until expect()
  early_dropped ///< as `early`, but the early buffer was full and its oldest entry was dropped
};

/// The result's name ("counted", "freed", ...); "invalid" otherwise.
[[nodiscard]] constexpr const char* to_string(ack_result r) noexcept {
  switch (r) {
    case ack_result::counted: return "counted";
    case ack_result::freed: return "freed";
    case ack_result::duplicate: return "duplicate";
    case ack_result::stale: return "stale";
    case ack_result::early: return "early";
    case ack_result::early_dropped: return "early_dropped";
  }
  return "invalid";
}

/// How much a release_ledger remembers; both at least 1.
struct ledger_options {
  std::size_t early_capacity = 4096;      ///< transfers with acknowledgements held before expect()
  std::size_t finished_capacity = 65536;  ///< freed transfer ids remembered to recognise late acks
};

/// The prefill side: frees each transfer's source blocks exactly once, when every consumer that
/// reads them has acknowledged.
///
/// Duplicate, late and early acknowledgements are handled (see ack_result). Thread-safe; the free
/// callback runs outside the lock, on the thread whose call completed the fan-in.
class release_ledger {
 public:
  /// free(id) releases transfer `id`'s source blocks; called exactly once per transfer.
  using free_fn = std::function<void(transfer_id)>;

  /// A ledger that frees through `free_blocks`. Throws std::invalid_argument for an empty callback
  /// or a zero capacity.
  explicit release_ledger(free_fn free_blocks, ledger_options options = {})
      : free_(std::move(free_blocks)), options_(options) {
    if (!free_) throw std::invalid_argument("ferry::kv::release_ledger: free callback is empty");
    if (options_.early_capacity == 0 || options_.finished_capacity == 0) {
      throw std::invalid_argument(
          "ferry::kv::release_ledger: early_capacity and finished_capacity must be at least 1");
    }
  }

  release_ledger(const release_ledger&) = delete;
  release_ledger& operator=(const release_ledger&) = delete;

  /// The producer posted transfer `id`, read by `consumers` ranks. Acknowledgements that arrived
  /// early count now (and may free it at once: the return value says whether it did).
  /// Throws std::invalid_argument for zero consumers, std::logic_error for an id already expected.
  bool expect(transfer_id id, std::uint32_t consumers) {
    if (consumers == 0) {
      throw std::invalid_argument("ferry::kv::release_ledger::expect: transfer " +
                                  std::to_string(id) + " needs at least one consumer");
    }
    std::unique_lock lock(mutex_);
    if (open_.contains(id) || finished_.contains(id)) {
      throw std::logic_error("ferry::kv::release_ledger::expect: transfer " + std::to_string(id) +
                             " was already expected");
    }
    entry e;
    e.expected = consumers;
    if (auto early = early_.find(id); early != early_.end()) {
      e.acked = std::move(early->second);
      early_.erase(early);
      std::erase(early_order_, id);
    }
    if (e.acked.size() >= e.expected) {
      remember_finished(id);
      lock.unlock();
      free_(id);
      return true;
    }
    open_.emplace(id, std::move(e));
    return false;
  }

  /// Rank `rank` has finished reading transfer `id`.
  ack_result acknowledge(transfer_id id, rank_id rank) {
    std::unique_lock lock(mutex_);
    if (finished_.contains(id)) return ack_result::stale;
    if (auto it = open_.find(id); it != open_.end()) {
      entry& e = it->second;
      if (!insert_rank(e.acked, rank)) return ack_result::duplicate;
      if (e.acked.size() < e.expected) return ack_result::counted;
      open_.erase(it);
      remember_finished(id);
      lock.unlock();
      free_(id);
      return ack_result::freed;
    }
    auto [it, inserted] = early_.try_emplace(id);
    if (!insert_rank(it->second, rank)) return ack_result::duplicate;
    if (!inserted) return ack_result::early;
    early_order_.push_back(id);
    if (early_.size() <= options_.early_capacity) return ack_result::early;
    early_.erase(early_order_.front());
    early_order_.pop_front();
    return ack_result::early_dropped;
  }

  /// Transfers expected and not yet freed.
  [[nodiscard]] std::size_t open() const {
    std::lock_guard lock(mutex_);
    return open_.size();
  }
  /// Transfers with acknowledgements held before their expect().
  [[nodiscard]] std::size_t early() const {
    std::lock_guard lock(mutex_);
    return early_.size();
  }

 private:
  struct entry {
    std::uint32_t expected = 0;
    std::vector<rank_id> acked;  // distinct ranks; fan-in is small
  };

  static bool insert_rank(std::vector<rank_id>& ranks, rank_id rank) {
    for (rank_id r : ranks) {
      if (r == rank) return false;
    }
    ranks.push_back(rank);
    return true;
  }

  void remember_finished(transfer_id id) {
    finished_.insert(id);
    finished_order_.push_back(id);
    if (finished_order_.size() > options_.finished_capacity) {
      finished_.erase(finished_order_.front());
      finished_order_.pop_front();
    }
  }

  free_fn free_;
  ledger_options options_;
  mutable std::mutex mutex_;
  std::unordered_map<transfer_id, entry> open_;
  std::unordered_map<transfer_id, std::vector<rank_id>> early_;
  std::deque<transfer_id> early_order_;
  std::unordered_set<transfer_id> finished_;
  std::deque<transfer_id> finished_order_;
};

}  // namespace ferry::kv

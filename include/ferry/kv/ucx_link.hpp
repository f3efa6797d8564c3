#pragma once
// A one_sided_link (kv/connector.hpp) over a UCX endpoint: transfer plans' byte ranges become
// get_batch and put_batch blocks between this side's registered regions and the peer's imported
// ones, numbered as the two sides' cache layouts number them, and the notifications are the
// endpoint's. The peer's regions come from its engine_description (kv/handshake.hpp), whose region
// descriptors are ucx::memory_region::describe().to_bytes().

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "ferry/kv/errors.hpp"
#include "ferry/kv/handshake.hpp"
#include "ferry/kv/plan.hpp"
#include "ferry/transfer.hpp"
#include "ferry/ucx.hpp"

namespace ferry::kv {

/// A peer engine over UCX, by region number: this side's registered regions and the peer's
/// imported ones. Moves the endpoint's handle; the regions' handles must outlive the transfers.
class ucx_link {
 public:
  /// `local[r]` is this side's region r, `peer[r]` the peer's region r (imported on `ep`).
  ucx_link(ucx::endpoint ep, std::vector<ucx::memory_region> local,
           std::vector<ucx::remote_memory> peer)
      : ep_(std::move(ep)), local_(std::move(local)), peer_(std::move(peer)) {}

  /// Imports every region the peer's description names (its descriptors, checked by
  /// ucx::remote_region::from_bytes) on `ep`.
  [[nodiscard]] static ucx_link to_peer(ucx::endpoint ep, std::vector<ucx::memory_region> local,
                                        const engine_description& peer) {
    std::vector<ucx::remote_memory> imported;
    imported.reserve(peer.regions.size());
    for (const std::vector<std::byte>& bytes : peer.regions) {
      imported.push_back(ep.import(ucx::remote_region::from_bytes(bytes)));
    }
    return ucx_link(std::move(ep), std::move(local), std::move(imported));
  }

  /// Each range from the peer's src_region into this side's dst_region (one get_batch).
  void read(std::span<const byte_range> ranges, std::span<transfer> out,
            std::chrono::nanoseconds timeout) {
    submit(ranges, out, timeout, false);
  }

  /// Each range from this side's src_region into the peer's dst_region (one put_batch; each ends
  /// once landed).
  void write(std::span<const byte_range> ranges, std::span<transfer> out,
             std::chrono::nanoseconds timeout) {
    submit(ranges, out, timeout, true);
  }

  /// The endpoint's notification, sent once every put before it has landed.
  [[nodiscard]] transfer notify(std::uint64_t value, std::chrono::nanoseconds timeout) {
    return ep_.send_notification(value, timeout);
  }

  /// The peer's next notification.
  [[nodiscard]] transfer next_notification(std::uint64_t& value, std::chrono::nanoseconds timeout) {
    return ep_.receive_notification(value, timeout);
  }

  /// The endpoint (to close it: a receive loop on this link then ends).
  [[nodiscard]] ucx::endpoint& endpoint() noexcept { return ep_; }

 private:
  // A range outside its regions fails alone, naming nothing UCX would have to check.
  void submit(std::span<const byte_range> ranges, std::span<transfer> out,
              std::chrono::nanoseconds timeout, bool put) {
    if (out.size() != ranges.size()) {
      throw std::invalid_argument("ferry::kv::ucx_link: " + std::to_string(ranges.size()) +
                                  " ranges but " + std::to_string(out.size()) + " transfers");
    }
    blocks_.clear();
    at_.clear();
    for (std::size_t i = 0; i < ranges.size(); ++i) {
      const byte_range& r = ranges[i];
      const std::uint32_t mine = put ? r.src_region : r.dst_region;
      const std::uint32_t theirs = put ? r.dst_region : r.src_region;
      const std::uint64_t my_offset = put ? r.src_offset : r.dst_offset;
      const std::uint64_t their_offset = put ? r.dst_offset : r.src_offset;
      if (!inside(mine, my_offset, r.length) || !reaches(theirs, their_offset, r.length)) {
        out[i] = make_completed_transfer(transfer_state::failed, errc::region_out_of_range);
        continue;
      }
      blocks_.push_back({local_[mine].slice(my_offset, r.length),
                         peer_[theirs].slice(their_offset, r.length)});
      at_.push_back(i);
    }
    if (blocks_.empty()) return;
    made_.assign(blocks_.size(), transfer());
    if (put) {
      ep_.put_batch(blocks_, made_, timeout);
    } else {
      ep_.get_batch(blocks_, made_, timeout);
    }
    for (std::size_t k = 0; k < at_.size(); ++k) out[at_[k]] = std::move(made_[k]);
  }

  [[nodiscard]] bool inside(std::uint32_t region, std::uint64_t offset,
                            std::uint64_t n) const noexcept {
    if (region >= local_.size()) return false;
    const std::size_t size = local_[region].bytes().size();
    return offset <= size && n <= size - offset;
  }
  [[nodiscard]] bool reaches(std::uint32_t region, std::uint64_t offset,
                             std::uint64_t n) const noexcept {
    if (region >= peer_.size()) return false;
    return offset <= peer_[region].length && n <= peer_[region].length - offset;
  }

  ucx::endpoint ep_;
  std::vector<ucx::memory_region> local_;
  std::vector<ucx::remote_memory> peer_;
  // Reused between calls: one engine thread calls a link.
  std::vector<ucx::rma_block> blocks_;
  std::vector<std::size_t> at_;
  std::vector<transfer> made_;
};

}  // namespace ferry::kv

#pragma once
// A one_sided_link (kv/connector.hpp) over an RC queue pair of the RDMA verbs backend: transfer
// plans' byte ranges become read_batch and write_batch blocks between this side's registered
// regions and the peer's remote ones, numbered as the two sides' cache layouts number them, and the
// notifications are the queue pair's own (send_notification: a small inline SEND, taken by the
// peer's receive_notification). The peer's regions come from its engine_description
// (kv/handshake.hpp), whose region descriptors are verbs_region_bytes(region.remote()).
//
// What "landed" means here. RC completes a queue pair's requests in order, and a WRITE succeeds at
// its initiator only once the responder's adapter acknowledged it: its bytes are placed in the
// responder's memory. The responder's own software, though, is only told so by something that
// follows the WRITEs: a SEND posted after them on the same queue pair is delivered after every one
// of them has been placed. So write()'s transfers end when the WRITEs landed as the producer sees
// them, and notify() is what tells the consumer: push ends the consumer's layers by that
// notification, never by the producer's completions.
//
// A template over the verbs provider, as the backend is: verbs_link runs on real adapters,
// basic_verbs_link<verbs::fake::provider> on the in-process fake (<ferry/testing/verbs.hpp>).

#include <algorithm>
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
#include "ferry/verbs.hpp"

// In ferry::detail, not ferry::kv::detail, which would hide ferry::detail from the kv headers'
// unqualified detail:: names.
namespace ferry::detail::kv_verbs {

// A region descriptor is the verbs handshake's own record of one exposed region (handshake.hpp):
// u64 address, u64 length, u32 rkey, u32 reserved (0), little-endian.
inline constexpr std::size_t descriptor_bytes = ferry::verbs::detail::handshake_region_bytes;

[[noreturn]] inline void bad_descriptor(const std::string& why) {
  throw std::system_error(make_error_code(ferry::kv::errc::bad_engine_description),
                          "ferry::kv: verbs region descriptor " + why);
}

// [offset, offset + n) inside `size` bytes, without overflow.
[[nodiscard]] constexpr bool inside(std::uint64_t size, std::uint64_t offset,
                                    std::uint64_t n) noexcept {
  return offset <= size && n <= size - offset;
}

}  // namespace ferry::detail::kv_verbs

namespace ferry::kv {

/// A verbs region as the descriptor an engine_description carries for it: the verbs handshake's
/// record of an exposed region (address, length, rkey: 24 bytes, little-endian).
[[nodiscard]] inline std::vector<std::byte> verbs_region_bytes(const verbs::remote_region& region) {
  verbs::detail::wire_writer w;
  w.u64(region.address);
  w.u64(region.length);
  w.u32(region.rkey);
  w.u32(0);
  const std::span<const std::byte> b = w.bytes();
  return {b.begin(), b.end()};
}

/// The region a peer's verbs_region_bytes() described. Throws std::system_error
/// (errc::bad_engine_description) for bytes that are not one: the wrong length, a reserved field
/// that is not zero, an empty region or one that wraps the address space.
[[nodiscard]] inline verbs::remote_region verbs_region_from_bytes(std::span<const std::byte> bytes) {
  namespace d = ferry::detail::kv_verbs;
  if (bytes.size() != d::descriptor_bytes) {
    d::bad_descriptor("has " + std::to_string(bytes.size()) + " bytes, not " +
                      std::to_string(d::descriptor_bytes));
  }
  verbs::detail::wire_reader r(bytes);
  verbs::remote_region out;
  out.address = r.u64();
  out.length = r.u64();
  out.rkey = r.u32();
  if (r.u32() != 0) d::bad_descriptor("has a reserved field that is not zero");
  if (out.length == 0) d::bad_descriptor("describes a region of no bytes");
  if (out.length > UINT64_MAX - out.address) {
    d::bad_descriptor("describes a region that wraps the address space");
  }
  return out;
}

/// A peer engine over an RC queue pair, by region number: this side's registered regions and the
/// peer's remote ones. Moves the queue pair's handle; the local regions' handles must outlive the
/// link (requests in flight hold their regions themselves). One engine thread calls it.
///
/// Each read() and write() posts its ranges as batches of at most the queue pair's send_depth()
/// work requests, each bounded by `timeout`; a full send queue backs off up to the queue pair's
/// admission_timeout, as the backend's batches do. As everywhere in the verbs backend, a deadline
/// that passes while the adapter holds a request takes the queue pair to the error state: the
/// link then fails everything, and a new link (a new queue pair) is needed.
template <class P>
class basic_verbs_link {
 public:
  using queue_pair_type = verbs::basic_queue_pair<P>;      ///< the queue pair the link moves
  using memory_region_type = verbs::basic_memory_region<P>;  ///< a local registered region

  /// `local[r]` is this side's region r (not null), `peer[r]` the peer's region r; `qp` is connected
  /// to the peer.
  basic_verbs_link(queue_pair_type qp, std::vector<const memory_region_type*> local,
                   std::vector<verbs::remote_region> peer)
      : qp_(std::move(qp)), local_(std::move(local)), peer_(std::move(peer)) {
    for (std::size_t r = 0; r < local_.size(); ++r) {
      if (local_[r] == nullptr) {
        throw std::invalid_argument("ferry::kv::verbs_link: local region " + std::to_string(r) +
                                    " is null");
      }
    }
  }

  /// Reads every region the peer's description names from its descriptors
  /// (verbs_region_from_bytes, which throws for bytes that are no verbs region descriptor).
  [[nodiscard]] static basic_verbs_link to_peer(queue_pair_type qp,
                                                std::vector<const memory_region_type*> local,
                                                const engine_description& peer) {
    std::vector<verbs::remote_region> regions;
    regions.reserve(peer.regions.size());
    for (const std::vector<std::byte>& bytes : peer.regions) {
      regions.push_back(verbs_region_from_bytes(bytes));
    }
    return basic_verbs_link(std::move(qp), std::move(local), std::move(regions));
  }

  /// Takes `other`'s queue pair and regions; `other` is then closed.
  basic_verbs_link(basic_verbs_link&& other) noexcept
      : qp_(std::move(other.qp_)), local_(std::move(other.local_)), peer_(std::move(other.peer_)),
        open_(std::exchange(other.open_, false)) {}
  /// Closes its own queue pair (as close() does) and takes `other`'s.
  basic_verbs_link& operator=(basic_verbs_link&& other) noexcept {
    qp_ = std::move(other.qp_);
    local_ = std::move(other.local_);
    peer_ = std::move(other.peer_);
    open_ = std::exchange(other.open_, false);
    return *this;
  }
  basic_verbs_link(const basic_verbs_link&) = delete;
  basic_verbs_link& operator=(const basic_verbs_link&) = delete;
  /// Closes the queue pair, as close() does.
  ~basic_verbs_link() = default;

  /// Each range from the peer's src_region into this side's dst_region (RDMA READs); out[i] ends
  /// once range i is in local memory.
  void read(std::span<const byte_range> ranges, std::span<transfer> out,
            std::chrono::nanoseconds timeout) {
    submit(ranges, out, timeout, false);
  }

  /// Each range from this side's src_region into the peer's dst_region (RDMA WRITEs); out[i] ends
  /// once the peer's adapter acknowledged range i: on RC, its bytes are placed in the peer's memory.
  void write(std::span<const byte_range> ranges, std::span<transfer> out,
             std::chrono::nanoseconds timeout) {
    submit(ranges, out, timeout, true);
  }

  /// The queue pair's notification (a small inline SEND), which RC delivers to the peer only after
  /// every WRITE posted before it on the queue pair. It covers the WRITEs the queue pair took: one
  /// whose transfer came back failed at once (a range outside its region) never went.
  [[nodiscard]] transfer notify(std::uint64_t value, std::chrono::nanoseconds timeout) {
    if (!open_) return closed();
    return qp_.send_notification(value, timeout);
  }

  /// The peer's next notification, in order; `value` must stay valid until the transfer is
  /// terminal. With no deadline, the queue pair's peer checks (queue_pair_options::peer_check) fail
  /// the wait with verbs::errc::peer_unreachable once the peer has gone.
  [[nodiscard]] transfer next_notification(std::uint64_t& value, std::chrono::nanoseconds timeout) {
    if (!open_) return closed();
    return qp_.receive_notification(value, timeout);
  }

  /// Closes the queue pair: what it holds fails (verbs::errc::queue_pair_closed) once the adapter
  /// has flushed it, a receive loop on this link ends, and every later call fails the same way. On
  /// the thread that calls the link.
  void close() noexcept {
    if (!open_) return;
    open_ = false;
    qp_ = queue_pair_type();
  }

  /// The queue pair (its error(), its counters' device); valid until close().
  [[nodiscard]] queue_pair_type& queue_pair() noexcept { return qp_; }

 private:
  [[nodiscard]] static transfer closed() {
    return make_completed_transfer(transfer_state::failed,
                                   make_error_code(verbs::errc::queue_pair_closed));
  }

  // A range outside its regions fails alone, before anything is posted.
  void submit(std::span<const byte_range> ranges, std::span<transfer> out,
              std::chrono::nanoseconds timeout, bool write) {
    if (out.size() != ranges.size()) {
      throw std::invalid_argument("ferry::kv::verbs_link: " + std::to_string(ranges.size()) +
                                  " ranges but " + std::to_string(out.size()) + " transfers");
    }
    if (!open_) {
      for (transfer& t : out) t = closed();
      return;
    }
    blocks_.clear();
    at_.clear();
    for (std::size_t i = 0; i < ranges.size(); ++i) {
      const byte_range& r = ranges[i];
      const std::uint32_t mine = write ? r.src_region : r.dst_region;
      const std::uint32_t theirs = write ? r.dst_region : r.src_region;
      const std::uint64_t my_offset = write ? r.src_offset : r.dst_offset;
      const std::uint64_t their_offset = write ? r.dst_offset : r.src_offset;
      if (mine >= local_.size() || theirs >= peer_.size() ||
          !ferry::detail::kv_verbs::inside(local_[mine]->size(), my_offset, r.length) ||
          !ferry::detail::kv_verbs::inside(peer_[theirs].length, their_offset, r.length)) {
        out[i] = make_completed_transfer(transfer_state::failed, errc::region_out_of_range);
        continue;
      }
      blocks_.push_back({local_[mine]->slice(static_cast<std::size_t>(my_offset),
                                             static_cast<std::size_t>(r.length)),
                         peer_[theirs].slice(their_offset, r.length)});
      at_.push_back(i);
    }
    // A batch larger than the send queue would be refused whole: post it in parts that fit.
    const std::size_t part = std::max<std::size_t>(1, qp_.send_depth());
    for (std::size_t first = 0; first < blocks_.size(); first += part) {
      const std::size_t n = std::min(part, blocks_.size() - first);
      made_.assign(n, transfer());
      const std::span<const rdma_block> blocks = std::span<const rdma_block>(blocks_).subspan(first, n);
      if (write) {
        qp_.write_batch(blocks, made_, timeout);
      } else {
        qp_.read_batch(blocks, made_, timeout);
      }
      for (std::size_t k = 0; k < n; ++k) out[at_[first + k]] = std::move(made_[k]);
    }
  }

  using rdma_block = verbs::basic_rdma_block<P>;

  queue_pair_type qp_;
  std::vector<const memory_region_type*> local_;
  std::vector<verbs::remote_region> peer_;
  bool open_ = true;
  // Reused between calls: one engine thread calls a link.
  std::vector<rdma_block> blocks_;
  std::vector<std::size_t> at_;
  std::vector<transfer> made_;
};

/// A peer engine over an RC queue pair on a real adapter (basic_verbs_link on real_provider).
using verbs_link = basic_verbs_link<verbs::real_provider>;

}  // namespace ferry::kv

#pragma once
// What a peer hands over: its registered memory, and how to connect to its queue pair.

#include <infiniband/verbs.h>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace ferry::verbs {

/// The largest message one work request moves (the RC limit of every current adapter).
inline constexpr std::size_t max_message_bytes = std::size_t{1} << 31;

/// A range of a peer's registered memory.
struct remote_slice {
  std::uint64_t address = 0;  ///< the first byte, in the peer's address space
  std::uint64_t length = 0;   ///< bytes
  std::uint32_t rkey = 0;     ///< the remote key of the region it lies in
};

/// A peer's registered region, as the handshake hands it over.
struct remote_region {
  std::uint64_t address = 0;  ///< the region's first byte, in the peer's address space
  std::uint64_t length = 0;   ///< bytes
  std::uint32_t rkey = 0;     ///< the region's remote key

  /// The `n` bytes at `offset` into the region.
  /// Throws std::out_of_range when [offset, offset + n) is not inside the region.
  [[nodiscard]] remote_slice slice(std::uint64_t offset, std::uint64_t n) const {
    if (offset > length || n > length - offset) {
      throw std::out_of_range("ferry::verbs::remote_region::slice: bytes [" +
                              std::to_string(offset) + ", " + std::to_string(offset) + " + " +
                              std::to_string(n) + ") are outside the peer's region of " +
                              std::to_string(length) + " bytes");
    }
    return {address + offset, n, rkey};
  }
};

/// What one side tells the other to connect an RC queue pair.
struct endpoint_info {
  std::uint32_t qp_num = 0;         ///< the queue pair's number
  std::uint32_t psn = 0;            ///< the first packet sequence number it sends with
  std::uint16_t lid = 0;            ///< the port's LID (InfiniBand)
  std::uint8_t mtu = IBV_MTU_1024;  ///< an ibv_mtu
  bool has_gid = false;             ///< RoCE: routed by GID
  ibv_gid gid{};                    ///< the port's GID, when has_gid
  /// The RDMA READs this side accepts in flight as a responder: the peer never has more out at once.
  std::uint8_t max_rd_atomic = 16;
};

}  // namespace ferry::verbs

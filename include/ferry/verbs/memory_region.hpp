#pragma once
// Registered memory, and the ranges of it that requests read into or write from. Every request
// using a region holds a reference to it, so it is deregistered (and, when it owns its memory,
// freed) only once the adapter can no longer touch it. Regions are made by a basic_device
// (device.hpp), which registers them.

#include <infiniband/verbs.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <new>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>

#include "ferry/verbs/remote.hpp"

namespace ferry::verbs {

template <class P>
class basic_device;
template <class P>
class basic_memory_region;
template <class P>
class basic_queue_pair;

/// The default access of a registered region: the peer may read and write it.
inline constexpr int default_region_access =
    IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;

namespace detail {

template <class P>
struct region_state {
  std::atomic<int> refs{1};
  typename P::mr_handle mr{};
  std::byte* data = nullptr;
  std::size_t size = 0;
  std::uint32_t lkey = 0;
  std::uint32_t rkey = 0;
  bool owned = false;
  bool dmabuf = false;  // registered through a dma-buf: `data` is a device address
  basic_device<P>* device = nullptr;

  void add_ref() noexcept { refs.fetch_add(1, std::memory_order_relaxed); }
  void release() noexcept;
};

template <class P>
void region_state<P>::release() noexcept {
  if (refs.fetch_sub(1, std::memory_order_acq_rel) == 1) device->unregister(this);
}

}  // namespace detail

/// A range of a registered region, to read into or write from.
template <class P>
class basic_local_slice {
 public:
  /// An empty slice, in no region.
  basic_local_slice() noexcept = default;

  /// The slice's first byte.
  [[nodiscard]] std::byte* data() const noexcept { return data_; }
  /// Its length in bytes.
  [[nodiscard]] std::size_t size() const noexcept { return length_; }
  /// The slice as a span.
  [[nodiscard]] std::span<std::byte> bytes() const noexcept { return {data_, length_}; }

 private:
  friend class basic_memory_region<P>;
  friend class basic_queue_pair<P>;
  basic_local_slice(detail::region_state<P>* r, std::byte* d, std::size_t n) noexcept
      : region_(r), data_(d), length_(n) {}

  detail::region_state<P>* region_ = nullptr;
  std::byte* data_ = nullptr;
  std::size_t length_ = 0;
};

/// One member of a batched READ or WRITE.
template <class P>
struct basic_rdma_block {
  basic_local_slice<P> local;  ///< this side's memory: written by a READ, read by a WRITE
  remote_slice remote;         ///< the peer's memory, of the same length
};

/// Registered memory. Requests hold references to it: it is deregistered, and memory it owns freed,
/// only when the handle and every request that used it are gone.
template <class P>
class basic_memory_region {
 public:
  /// An empty handle, registering nothing; only assignment and destruction are valid on it.
  basic_memory_region() noexcept = default;

  /// `bytes` of page-aligned, zeroed memory owned by the region.
  [[nodiscard]] static basic_memory_region allocate(basic_device<P>& device, std::size_t bytes,
                                                    int access = default_region_access) {
    if (bytes == 0) {
      throw std::invalid_argument("ferry::verbs::memory_region::allocate: zero bytes requested");
    }
    constexpr std::size_t page = 4096;
    if (bytes > SIZE_MAX - (page - 1)) {
      throw std::length_error("ferry::verbs::memory_region::allocate: " + std::to_string(bytes) +
                              " bytes cannot be rounded up to whole pages");
    }
    const std::size_t rounded = (bytes + page - 1) / page * page;
    auto* data = static_cast<std::byte*>(::operator new(rounded, std::align_val_t{page}));
    std::memset(data, 0, rounded);
    try {
      return basic_memory_region(device.register_state(data, bytes, access, true));
    } catch (...) {
      ::operator delete(data, std::align_val_t{page});
      throw;
    }
  }

  /// Registers memory the caller owns; it must outlive the region and every request using it
  /// (in_use() tells when none does).
  [[nodiscard]] static basic_memory_region register_memory(basic_device<P>& device,
                                                           std::span<std::byte> memory,
                                                           int access = default_region_access) {
    if (memory.empty()) {
      throw std::invalid_argument("ferry::verbs::memory_region::register_memory: empty span");
    }
    return basic_memory_region(device.register_state(memory.data(), memory.size(), access, false));
  }

  /// Registers `length` bytes of device memory (a GPU's) through the dma-buf `fd`, from `offset`
  /// into the dma-buf on, with ibv_reg_dmabuf_mr. `device_address` is the address the region is
  /// known by: data(), slices and remote() start there, so peers address the memory by it and local
  /// slices post it. Usually the device pointer the dma-buf was exported for (ferry/gpu/dmabuf.hpp's
  /// export_cuda_dmabuf and export_hip_dmabuf give the fd, offset and length;
  /// ferry::testing::fake_dmabuf stands in for them in tests).
  ///
  /// The region does not own `fd`: the caller keeps it open while this call runs and may close it
  /// once it has returned, since the registration holds its own reference to the dma-buf in the
  /// kernel. The device memory must stay allocated while the region and any request using it live.
  /// data() is a device address, not host memory: do not read it on the CPU.
  /// Throws std::system_error naming ibv_reg_dmabuf_mr with the errno: EBADF for a descriptor that
  /// is no dma-buf, EINVAL for zero bytes or a range past the dma-buf's size (and whatever else the
  /// adapter's driver refuses; EOPNOTSUPP where it cannot register dma-bufs).
  [[nodiscard]] static basic_memory_region register_dmabuf(basic_device<P>& device, int fd,
                                                           std::uint64_t offset,
                                                           std::size_t length,
                                                           std::uint64_t device_address,
                                                           int access = default_region_access) {
    return basic_memory_region(
        device.register_dmabuf_state(fd, offset, length, device_address, access));
  }

  /// Takes `other`'s region, leaving `other` empty.
  basic_memory_region(basic_memory_region&& other) noexcept
      : state_(std::exchange(other.state_, nullptr)) {}
  /// Lets go of its own region and takes `other`'s.
  basic_memory_region& operator=(basic_memory_region&& other) noexcept {
    basic_memory_region(std::move(other)).swap(*this);
    return *this;
  }
  /// Lets go of the handle: deregistered (and freed, if owned) once no request holds it either.
  ~basic_memory_region() {
    if (state_ != nullptr) state_->release();
  }
  /// Exchanges the regions the two handles refer to.
  void swap(basic_memory_region& other) noexcept { std::swap(state_, other.state_); }

  /// The region's first byte.
  [[nodiscard]] std::byte* data() const noexcept { return state_->data; }
  /// Its length in bytes (as asked; an allocated region's memory is rounded up to whole pages).
  [[nodiscard]] std::size_t size() const noexcept { return state_->size; }
  /// The region as a span.
  [[nodiscard]] std::span<std::byte> bytes() const noexcept { return {state_->data, state_->size}; }
  /// True for a region registered through a dma-buf (register_dmabuf): data() is then a device
  /// address, which the adapter reaches and the CPU may not.
  [[nodiscard]] bool is_dmabuf() const noexcept { return state_->dmabuf; }
  /// The region's local key.
  [[nodiscard]] std::uint32_t lkey() const noexcept { return state_->lkey; }
  /// The region's remote key, which a peer needs to read or write it (see remote()).
  [[nodiscard]] std::uint32_t rkey() const noexcept { return state_->rkey; }

  /// What a peer needs to read or write this region.
  [[nodiscard]] remote_region remote() const noexcept {
    return {reinterpret_cast<std::uintptr_t>(state_->data), state_->size, state_->rkey};
  }

  /// True while some request still holds the region.
  [[nodiscard]] bool in_use() const noexcept {
    return state_->refs.load(std::memory_order_acquire) > 1;
  }

  /// The `n` bytes at `offset` into the region.
  /// Throws std::out_of_range when [offset, offset + n) is not inside the region.
  [[nodiscard]] basic_local_slice<P> slice(std::size_t offset, std::size_t n) const {
    if (offset > state_->size || n > state_->size - offset) {
      throw std::out_of_range("ferry::verbs::memory_region::slice: bytes [" +
                              std::to_string(offset) + ", " + std::to_string(offset) + " + " +
                              std::to_string(n) + ") are outside the region of " +
                              std::to_string(state_->size) + " bytes");
    }
    return {state_, state_->data + offset, n};
  }

  /// The same, for a span that must lie inside the region.
  [[nodiscard]] basic_local_slice<P> slice(std::span<std::byte> part) const {
    const auto begin = reinterpret_cast<std::uintptr_t>(state_->data);
    const auto at = reinterpret_cast<std::uintptr_t>(part.data());
    if (at < begin || at - begin > state_->size || part.size() > state_->size - (at - begin)) {
      throw std::out_of_range("ferry::verbs::memory_region::slice: the span of " +
                              std::to_string(part.size()) +
                              " bytes does not lie inside the registered region");
    }
    return {state_, part.data(), part.size()};
  }

 private:
  explicit basic_memory_region(detail::region_state<P>* s) noexcept : state_(s) {}
  detail::region_state<P>* state_ = nullptr;
};

}  // namespace ferry::verbs

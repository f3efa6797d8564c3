#pragma once
// Heap memory aligned for O_DIRECT (and for registering as a fixed buffer): the kernel rejects a
// direct read or write whose address, length or offset is not a multiple of the device's logical
// block size, with EINVAL.

#include <cstddef>
#include <cstdlib>
#include <new>
#include <span>
#include <stdexcept>
#include <utility>

namespace ferry::uring {

/// Heap memory aligned for O_DIRECT and for registering as a fixed buffer; move-only, owning.
class aligned_buffer {
 public:
  /// An empty buffer (no memory).
  aligned_buffer() noexcept = default;

  /// `bytes` of memory aligned to `alignment` (4096 by default), zero-filled.
  /// Zero-filled. `alignment` must be a power of two and a multiple of sizeof(void*).
  /// Throws std::invalid_argument for a bad alignment, std::bad_alloc when out of memory.
  explicit aligned_buffer(std::size_t bytes, std::size_t alignment = 4096) : size_(bytes) {
    if (alignment < sizeof(void*) || (alignment & (alignment - 1)) != 0) {
      throw std::invalid_argument(
          "ferry::uring::aligned_buffer: alignment must be a power of two of at least "
          "sizeof(void*)");
    }
    void* p = nullptr;
    if (::posix_memalign(&p, alignment, bytes == 0 ? alignment : bytes) != 0) throw std::bad_alloc();
    data_ = static_cast<std::byte*>(p);
    for (std::size_t i = 0; i < bytes; ++i) data_[i] = std::byte{0};
  }

  /// Takes `other`'s memory, leaving it empty.
  aligned_buffer(aligned_buffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}
  /// Frees its own memory and takes `other`'s.
  aligned_buffer& operator=(aligned_buffer&& other) noexcept {
    aligned_buffer(std::move(other)).swap(*this);
    return *this;
  }
  aligned_buffer(const aligned_buffer&) = delete;
  aligned_buffer& operator=(const aligned_buffer&) = delete;
  /// Frees the memory.
  ~aligned_buffer() { std::free(data_); }

  /// Exchanges the two buffers' memory.
  void swap(aligned_buffer& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(size_, other.size_);
  }

  /// The first byte (null when empty).
  [[nodiscard]] std::byte* data() const noexcept { return data_; }
  /// Its length in bytes.
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  /// The whole buffer as a span.
  [[nodiscard]] std::span<std::byte> span() const noexcept { return {data_, size_}; }
  /// `count` bytes from `offset` (std::span::subspan: the range must lie inside).
  [[nodiscard]] std::span<std::byte> subspan(std::size_t offset, std::size_t count) const {
    return span().subspan(offset, count);
  }

 private:
  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace ferry::uring

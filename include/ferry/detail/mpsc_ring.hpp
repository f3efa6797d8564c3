#pragma once
// A bounded multi-producer, single-consumer ring (Dmitry Vyukov's bounded queue with per-cell
// sequence numbers). Producers claim a cell with one CAS on the tail and publish it with a release
// store of the cell's sequence; the single consumer needs no RMW at all.

#include <atomic>
#include <bit>
#include <cstddef>
#include <memory>
#include <new>
#include <stdexcept>

#include "ferry/detail/futex.hpp"

namespace ferry::detail {

template <class T>
class mpsc_ring {
  struct cell {
    std::atomic<std::size_t> sequence;
    T value;
  };

 public:
  explicit mpsc_ring(std::size_t capacity)
      : mask_(std::bit_ceil(capacity < 2 ? std::size_t{2} : capacity) - 1),
        cells_(std::make_unique<cell[]>(mask_ + 1)) {
    for (std::size_t i = 0; i <= mask_; ++i) cells_[i].sequence.store(i, std::memory_order_relaxed);
  }

  [[nodiscard]] std::size_t capacity() const noexcept { return mask_ + 1; }

  // Any thread. False when the ring is full.
  [[nodiscard]] bool try_push(const T& v) noexcept {
    std::size_t pos = tail_.load(std::memory_order_relaxed);
    for (;;) {
      cell& c = cells_[pos & mask_];
      // Acquire pairs with the consumer's release that freed this cell.
      const std::size_t seq = c.sequence.load(std::memory_order_acquire);
      const auto diff = static_cast<std::ptrdiff_t>(seq) - static_cast<std::ptrdiff_t>(pos);
      if (diff == 0) {
        if (tail_.compare_exchange_weak(pos, pos + 1, std::memory_order_relaxed)) {
          c.value = v;
          c.sequence.store(pos + 1, std::memory_order_release);
          return true;
        }
      } else if (diff < 0) {
        return false;
      } else {
        pos = tail_.load(std::memory_order_relaxed);
      }
    }
  }

  // The consumer thread only.
  [[nodiscard]] bool try_pop(T& out) noexcept {
    cell& c = cells_[head_ & mask_];
    // Acquire pairs with the producer's release that published the cell.
    const std::size_t seq = c.sequence.load(std::memory_order_acquire);
    if (static_cast<std::ptrdiff_t>(seq) - static_cast<std::ptrdiff_t>(head_ + 1) < 0) return false;
    out = c.value;
    c.sequence.store(head_ + mask_ + 1, std::memory_order_release);
    ++head_;
    return true;
  }

 private:
  std::size_t mask_;
  std::unique_ptr<cell[]> cells_;
  alignas(64) std::atomic<std::size_t> tail_{0};
  alignas(64) std::size_t head_ = 0;
};

}  // namespace ferry::detail

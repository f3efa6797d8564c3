#pragma once
// The in-memory backend: copies between buffers of this process, performed and completed on the
// progress executor's thread. It is the reference backend for tests, examples and benchmarks, and
// behind a fault injector (ferry/testing/faulty_loopback.hpp) the source of failures, delays,
// reordering and lost completions for soak runs.

#include <cstddef>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <span>
#include <stdexcept>

#include "ferry/detail/mpsc_ring.hpp"
#include "ferry/detail/status_block.hpp"
#include "ferry/errors.hpp"
#include "ferry/progress_executor.hpp"
#include "ferry/transfer.hpp"

namespace ferry {

/// How a loopback_backend queues its requests.
struct loopback_options {
  std::size_t queue_depth = 16384;  ///< requests queued without taking a lock; more spill to a list
};

/// The in-memory backend: copies between buffers of this process, done on the executor's thread.
///
/// The reference backend for tests, examples and benchmarks. Submitting never blocks on the
/// executor; requests still queued when it is destroyed fail with errc::backend_shut_down.
class loopback_backend {
 public:
  /// Registers with `exec`, which must outlive it. Throws std::invalid_argument for a zero
  /// queue_depth.
  explicit loopback_backend(progress_executor& exec, loopback_options options = {})
      : exec_(exec), ring_(options.queue_depth) {
    if (options.queue_depth == 0) {
      throw std::invalid_argument("ferry::loopback_options::queue_depth must be at least 1");
    }
    exec_.add_source(*this);
  }

  loopback_backend(const loopback_backend&) = delete;
  loopback_backend& operator=(const loopback_backend&) = delete;

  /// Requests still queued never touch their buffers: they fail with errc::backend_shut_down.
  ~loopback_backend() {
    exec_.remove_source(*this);
    request r;
    while (ring_.try_pop(r)) fail_unstarted(r);
    std::lock_guard lock(overflow_mutex_);
    for (request& o : overflow_) fail_unstarted(o);
    overflow_.clear();
  }

  /// Copies all of `src` into the front of `dst`.
  [[nodiscard]] transfer copy(std::span<std::byte> dst, std::span<const std::byte> src) {
    return copy(dst, src, src.size());
  }

  /// Copies the first `bytes` of `src` into the front of `dst`. Bad arguments give a transfer that has
  /// already failed with an error naming what was wrong; nothing is copied.
  [[nodiscard]] transfer copy(std::span<std::byte> dst, std::span<const std::byte> src,
                              std::size_t bytes) {
    if (bytes > dst.size()) return make_completed_transfer(transfer_state::failed, errc::destination_too_small);
    if (bytes > src.size()) return make_completed_transfer(transfer_state::failed, errc::source_too_small);
    if (overlap(dst.data(), src.data(), bytes)) {
      return make_completed_transfer(transfer_state::failed, errc::overlapping_buffers);
    }
    detail::status_block* s = detail::status_block::make();
    const request r{dst.data(), src.data(), bytes, s};
    // Once requests spill, later ones queue behind them: the executor takes them in order, and none
    // waits for ever behind a ring that keeps refilling.
    if (overflow_size_.load(std::memory_order_acquire) != 0 || !ring_.try_push(r)) {
      std::lock_guard lock(overflow_mutex_);
      try {
        overflow_.push_back(r);
      } catch (...) {
        s->release_completer_ref();  // fails it as abandoned; we return no handle either
        s->release_transfer_ref();
        throw;
      }
      overflow_size_.store(overflow_.size(), std::memory_order_release);
    }
    exec_.notify();
    return transfer(detail::adopt, s);
  }

  /// Performs and completes up to `budget` queued copies; returns how many (completion_source).
  /// Called by the executor only.
  std::size_t poll(std::size_t budget) noexcept {
    std::size_t done = 0;
    request r;
    while (done < budget && ring_.try_pop(r)) {
      perform(r);
      ++done;
    }
    if (done < budget && overflow_size_.load(std::memory_order_acquire) != 0) {
      std::lock_guard lock(overflow_mutex_);
      while (done < budget && !overflow_.empty()) {
        perform(overflow_.front());
        overflow_.pop_front();
        ++done;
      }
      overflow_size_.store(overflow_.size(), std::memory_order_release);
    }
    return done;
  }

 private:
  struct request {
    std::byte* dst = nullptr;
    const std::byte* src = nullptr;
    std::size_t bytes = 0;
    detail::status_block* status = nullptr;
  };

  static bool overlap(const std::byte* a, const std::byte* b, std::size_t n) noexcept {
    if (n == 0) return false;
    const std::less<const std::byte*> before;
    return before(a, b + n) && before(b, a + n);
  }

  static void perform(const request& r) noexcept {
    if (r.bytes != 0) std::memcpy(r.dst, r.src, r.bytes);
    r.status->complete(transfer_state::success, {});
    r.status->release_completer_ref();
  }

  static void fail_unstarted(const request& r) noexcept {
    r.status->complete(transfer_state::failed, make_error_code(errc::backend_shut_down));
    r.status->release_completer_ref();
  }

  progress_executor& exec_;
  detail::mpsc_ring<request> ring_;
  std::mutex overflow_mutex_;
  std::deque<request> overflow_;
  std::atomic<std::size_t> overflow_size_{0};
};

}  // namespace ferry

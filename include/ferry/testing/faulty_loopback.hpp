#pragma once
// The loopback backend behind a fault injector, for soak runs and tests of code that must survive
// failures, delays, reordering and lost completions.

#include <cstddef>
#include <span>
#include <utility>

#include "ferry/loopback.hpp"
#include "ferry/progress_executor.hpp"
#include "ferry/testing/fault_injector.hpp"
#include "ferry/transfer.hpp"

namespace ferry {

/// A loopback backend behind a fault_injector: copies really happen, then the injector decides what
/// the caller sees (failure, delay, reordering, a completion that never comes).
class faulty_loopback {
 public:
  /// A loopback backend and an injector, both on `exec` (which must outlive them). Throws as
  /// loopback_backend's and fault_injector's constructors do.
  faulty_loopback(progress_executor& exec, fault_profile profile, loopback_options options = {})
      : backend_(exec, options), faults_(exec, std::move(profile)) {}

  /// Copies all of `src` into the front of `dst`, wrapped by the injector.
  [[nodiscard]] transfer copy(std::span<std::byte> dst, std::span<const std::byte> src) {
    return faults_.wrap(backend_.copy(dst, src));
  }

  /// Copies the first `bytes` of `src` into the front of `dst`, wrapped by the injector.
  [[nodiscard]] transfer copy(std::span<std::byte> dst, std::span<const std::byte> src,
                              std::size_t bytes) {
    return faults_.wrap(backend_.copy(dst, src, bytes));
  }

  /// The injector (its counters, release_hung).
  [[nodiscard]] fault_injector& faults() noexcept { return faults_; }
  /// The loopback backend underneath.
  [[nodiscard]] loopback_backend& backend() noexcept { return backend_; }

 private:
  loopback_backend backend_;  // declared first: destroyed after the injector that wraps it
  fault_injector faults_;
};

}  // namespace ferry

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

// A loopback backend behind a fault_injector: copies really happen, then the injector decides what
// the caller sees (failure, delay, reordering, a completion that never comes).
class faulty_loopback {
 public:
  faulty_loopback(progress_executor& exec, fault_profile profile, loopback_options options = {})
      : backend_(exec, options), faults_(exec, std::move(profile)) {}

  [[nodiscard]] transfer copy(std::span<std::byte> dst, std::span<const std::byte> src) {
    return faults_.wrap(backend_.copy(dst, src));
  }

  [[nodiscard]] transfer copy(std::span<std::byte> dst, std::span<const std::byte> src,
                              std::size_t bytes) {
    return faults_.wrap(backend_.copy(dst, src, bytes));
  }

  [[nodiscard]] fault_injector& faults() noexcept { return faults_; }
  [[nodiscard]] loopback_backend& backend() noexcept { return backend_; }

 private:
  loopback_backend backend_;  // declared first: destroyed after the injector that wraps it
  fault_injector faults_;
};

}  // namespace ferry

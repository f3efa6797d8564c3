#pragma once
// The one full two-way fence ferry's Dekker handshakes need, in a form ThreadSanitizer understands.

#include <atomic>
#include <cstdint>

#if defined(__SANITIZE_THREAD__)
#define FERRY_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define FERRY_TSAN 1
#endif
#endif

namespace ferry::detail {

// A full two-way barrier for the Dekker handshakes (a submitter's "queue, then look at the sleeper
// flag" against a sleeper's "set the flag, then look at the queue"). ThreadSanitizer rejects
// atomic_thread_fence, so its builds use a locked RMW on a private atomic, which orders the same way
// on every architecture ferry runs on.
inline void full_barrier() noexcept {
#if defined(FERRY_TSAN)
  static std::atomic<std::uint32_t> barrier_word{0};
  barrier_word.fetch_add(0, std::memory_order_seq_cst);
#else
  std::atomic_thread_fence(std::memory_order_seq_cst);
#endif
}

}  // namespace ferry::detail

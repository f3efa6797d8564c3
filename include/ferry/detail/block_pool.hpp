#pragma once
// A pool of fixed-size blocks shared by every thread, so that steady-state traffic allocates nothing.
//
// Blocks are handed out from a thread-local chain; freed blocks go onto the freeing thread's chain.
// Whole chains of `chain_length` blocks move between threads through one mutex-protected list, so a
// producer thread that allocates and an executor thread that frees pay for the lock once every
// `chain_length` transfers. Blocks are constructed once when their slab is carved and never destroyed;
// the owner type resets them on acquire. Under AddressSanitizer a free block is poisoned except for its
// `pool_next_` link, so a use after release is reported even though the memory is recycled.

#include <cstddef>
#include <mutex>
#include <new>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#define FERRY_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define FERRY_ASAN 1
#endif
#endif

#if defined(FERRY_ASAN)
#include <sanitizer/asan_interface.h>
#endif

namespace ferry::detail {

template <class Block, std::size_t ChainLength = 64, std::size_t SlabBlocks = 256>
class block_pool {
  struct chain {
    Block* head = nullptr;
    std::size_t size = 0;
  };

  struct shared_state {
    std::mutex mutex;
    std::vector<chain> full;
    std::vector<void*> slabs;  // kept so that every slab stays reachable for leak checkers
  };

  // Trivially destructible, so a block released by a thread_local object destroyed late in thread
  // exit still finds valid storage; `flusher` hands the chains back when the thread ends.
  struct local_cache {
    chain partial;
    chain spare;
    bool flushed;
  };

  struct flusher {
    ~flusher() {
      local_cache& c = local();
      give_back(c.partial);
      give_back(c.spare);
      c.flushed = true;
    }
  };

 public:
  [[nodiscard]] static Block* acquire() {
    local_cache& c = local();
    if (c.partial.size == 0) refill(c);
    Block* b = c.partial.head;
    c.partial.head = b->pool_next_;
    --c.partial.size;
    unpoison(b);
    return b;
  }

  static void release(Block* b) noexcept {
    poison(b);
    local_cache& c = local();
    if (c.flushed) {
      chain one{b, 1};
      b->pool_next_ = nullptr;
      give_back(one);
      return;
    }
    b->pool_next_ = c.partial.head;
    c.partial.head = b;
    if (++c.partial.size < ChainLength) return;
    if (c.spare.size != 0) give_back(c.spare);
    c.spare = c.partial;
    c.partial = {};
  }

 private:
  static shared_state& shared() {
    // Never destroyed: blocks may be released during static destruction.
    static shared_state* s = new shared_state;
    return *s;
  }

  static local_cache& local() noexcept {
    thread_local local_cache cache{};
    thread_local flusher flush_at_exit;
    (void)&flush_at_exit;
    return cache;
  }

  static void give_back(chain& c) noexcept {
    if (c.size == 0) return;
    shared_state& s = shared();
    std::lock_guard lock(s.mutex);
    try {
      s.full.push_back(c);
    } catch (...) {
      // Out of memory while growing the chain list: the blocks stay allocated but unused. Losing a
      // few recyclable blocks is better than failing a release, which must not throw.
    }
    c = {};
  }

  static void refill(local_cache& c) {
    if (c.spare.size != 0) {
      c.partial = c.spare;
      c.spare = {};
      return;
    }
    shared_state& s = shared();
    {
      std::lock_guard lock(s.mutex);
      if (!s.full.empty()) {
        c.partial = s.full.back();
        s.full.pop_back();
        return;
      }
    }
    void* slab = ::operator new(SlabBlocks * sizeof(Block), std::align_val_t{alignof(Block)});
    {
      std::lock_guard lock(s.mutex);
      try {
        s.slabs.push_back(slab);
      } catch (...) {
        ::operator delete(slab, std::align_val_t{alignof(Block)});
        throw;
      }
    }
    auto* blocks = static_cast<Block*>(slab);
    for (std::size_t i = 0; i < SlabBlocks; ++i) {
      Block* b = ::new (static_cast<void*>(blocks + i)) Block;
      b->pool_next_ = c.partial.head;
      c.partial.head = b;
      poison(b);
    }
    c.partial.size = SlabBlocks;
  }

  static void poison([[maybe_unused]] Block* b) noexcept {
#if defined(FERRY_ASAN)
    ASAN_POISON_MEMORY_REGION(b, Block::poisonable_bytes);
#endif
  }

  static void unpoison([[maybe_unused]] Block* b) noexcept {
#if defined(FERRY_ASAN)
    ASAN_UNPOISON_MEMORY_REGION(b, Block::poisonable_bytes);
#endif
  }
};

}  // namespace ferry::detail

// detail::block_pool: thread-cached chains of fixed-size blocks, recycled across threads.

#include <catch2/catch.hpp>

#include <atomic>
#include <cstddef>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include <ferry/detail/block_pool.hpp>

namespace {

// A block type per test, so that each test has a pool of its own (the pool is per type).
template <int Tag>
struct tracked_block {
  std::atomic<int> in_use{0};
  unsigned char payload[56];
  tracked_block* pool_next_ = nullptr;
  static constexpr std::size_t poisonable_bytes = 64;
};

template <int Tag>
using small_pool = ferry::detail::block_pool<tracked_block<Tag>, 4, 8>;

}  // namespace

TEST_CASE("block_pool: blocks live at once are distinct, and a released block is handed out again",
          "[detail]") {
  using pool = small_pool<0>;
  std::set<tracked_block<0>*> live;
  for (int i = 0; i < 20; ++i) {  // more than a slab
    tracked_block<0>* b = pool::acquire();
    CHECK(live.insert(b).second);
  }
  tracked_block<0>* some = *live.begin();
  pool::release(some);
  CHECK(pool::acquire() == some);  // the freeing thread's own chain comes first
  for (tracked_block<0>* b : live) pool::release(b);
}

TEST_CASE("block_pool: blocks freed on another thread, and those a thread held when it ended, "
          "serve later acquisitions",
          "[detail]") {
  using pool = small_pool<1>;
  std::set<tracked_block<1>*> seen;
  for (int round = 0; round < 50; ++round) {
    std::vector<tracked_block<1>*> taken;
    std::thread producer([&] {
      for (int i = 0; i < 12; ++i) taken.push_back(pool::acquire());
    });
    producer.join();
    std::thread consumer([&] {
      for (tracked_block<1>* b : taken) pool::release(b);
    });
    consumer.join();  // ends holding part of a chain, which it hands back as it exits
    seen.insert(taken.begin(), taken.end());
  }
  // Without recycling across threads each round would carve new slabs: 50 rounds of 12 blocks.
  CHECK(seen.size() <= 4 * 8);
}

TEST_CASE("block_pool: blocks passed between threads are never handed out twice while live",
          "[detail][concurrency]") {
  // Two threads allocate and hand their blocks to the other, which frees them: chains move through
  // the shared list all the time. A block on two chains at once would be handed out twice, and
  // in_use would already be set when its second owner takes it.
  using pool = small_pool<2>;
  constexpr int per_thread = 50000;
  std::mutex m;
  std::vector<tracked_block<2>*> for_a, for_b;
  std::atomic<int> double_use{0};
  const auto run = [&](std::vector<tracked_block<2>*>& mine, std::vector<tracked_block<2>*>& theirs) {
    for (int i = 0; i < per_thread; ++i) {
      tracked_block<2>* b = pool::acquire();
      if (b->in_use.exchange(1) != 0) double_use.fetch_add(1);
      std::vector<tracked_block<2>*> to_free;
      {
        std::lock_guard lock(m);
        theirs.push_back(b);
        if (mine.size() >= 16) to_free.swap(mine);
      }
      for (tracked_block<2>* f : to_free) {
        f->in_use.store(0);
        pool::release(f);
      }
    }
  };
  std::thread a([&] { run(for_a, for_b); });
  std::thread b([&] { run(for_b, for_a); });
  a.join();
  b.join();
  for (auto* v : {&for_a, &for_b}) {
    for (tracked_block<2>* f : *v) {
      f->in_use.store(0);
      pool::release(f);
    }
  }
  CHECK(double_use.load() == 0);
}

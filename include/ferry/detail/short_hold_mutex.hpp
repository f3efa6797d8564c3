#pragma once
// A mutex for critical sections a few dozen instructions long, taken by threads on different CPUs
// at the same moments (a run_loop's queue: the executor posting a burst of completions while the
// engine thread takes them). A contended std::mutex goes straight to the kernel: the waiter makes a
// futex_wait and the holder, on unlocking, a futex_wake, two system calls for a wait of well under a
// microsecond. This one first tries again for a little while (128 pauses, a few microseconds at
// most), which is nearly always long enough for the holder to finish, and blocks only after that.
// At depth 32 in the io_uring benchmark, the engine thread's run_loop saw about 8,000 contended
// acquisitions a second; with this, no more than five a second went on to block.

#include <mutex>

#include "ferry/detail/futex.hpp"
#include "ferry/detail/spin.hpp"

namespace ferry::detail {

class short_hold_mutex {
 public:
  static constexpr int tries = 128;

  void lock() {
    for (int i = 0; i < tries; ++i) {
      if (mutex_.try_lock()) return;
      cpu_relax();
    }
    mutex_.lock();
  }

  bool try_lock() { return mutex_.try_lock(); }
  void unlock() { mutex_.unlock(); }

 private:
  std::mutex mutex_;
};

}  // namespace ferry::detail

#pragma once
// Deadline timers: one binary min-heap ordered by deadline, the earliest deadline mirrored in an
// atomic so that the owning thread checks it without the lock. The owner (the progress executor, or
// the process-wide timer thread) calls fire_expired(); any thread arms and cancels.
//
// A node being fired has already left the heap when its callback runs, outside the lock: cancel()
// then returns false, and the caller must treat the callback as running or done. Owners of nodes that
// can be cancelled therefore keep the node alive through a reference the callback drops.

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <mutex>
#include <thread>
#include <vector>

#include "ferry/detail/futex.hpp"

namespace ferry::detail {

struct timer_node {
  static constexpr std::size_t not_armed = std::numeric_limits<std::size_t>::max();

  clock::time_point deadline{};
  void (*fire)(timer_node*) noexcept = nullptr;
  std::size_t heap_index = not_armed;  // guarded by the heap lock
  timer_node* next_fired = nullptr;
};

class timer_service {
 public:
  // Called (outside the lock) when an arm made the earliest deadline earlier, so that an owner asleep
  // until the old deadline wakes up and recomputes.
  using kick_fn = void (*)(void* owner) noexcept;

  timer_service(kick_fn kick, void* owner) noexcept : kick_(kick), owner_(owner) {}
  timer_service(const timer_service&) = delete;
  timer_service& operator=(const timer_service&) = delete;

  // Throws std::bad_alloc only when the heap must grow and cannot.
  void arm(timer_node& t) {
    bool earliest = false;
    {
      std::lock_guard lock(mutex_);
      heap_.push_back(&t);
      t.heap_index = heap_.size() - 1;
      sift_up(t.heap_index);
      earliest = heap_.front() == &t;
      publish_earliest();
    }
    if (earliest) kick_(owner_);
  }

  // True when the node was still armed and now never fires.
  bool cancel(timer_node& t) noexcept {
    std::lock_guard lock(mutex_);
    if (t.heap_index == timer_node::not_armed) return false;
    remove_at(t.heap_index);
    publish_earliest();
    return true;
  }

  [[nodiscard]] clock::time_point next_deadline() const noexcept {
    return clock::time_point(clock::duration(earliest_.load(std::memory_order_acquire)));
  }

  [[nodiscard]] bool empty() const noexcept {
    return earliest_.load(std::memory_order_acquire) == none;
  }

  // Fires every timer whose deadline is at or before `now`; returns how many fired.
  std::size_t fire_expired(clock::time_point now) noexcept {
    if (earliest_.load(std::memory_order_acquire) > now.time_since_epoch().count()) return 0;
    timer_node* fired = nullptr;
    std::size_t count = 0;
    {
      std::lock_guard lock(mutex_);
      while (!heap_.empty() && heap_.front()->deadline <= now) {
        timer_node* t = heap_.front();
        remove_at(0);
        t->next_fired = fired;
        fired = t;
        ++count;
      }
      publish_earliest();
    }
    while (fired != nullptr) {
      timer_node* next = fired->next_fired;
      fired->fire(fired);
      fired = next;
    }
    return count;
  }

 private:
  static constexpr clock::rep none = std::numeric_limits<clock::rep>::max();

  void publish_earliest() noexcept {
    earliest_.store(heap_.empty() ? none : heap_.front()->deadline.time_since_epoch().count(),
                    std::memory_order_release);
  }

  void remove_at(std::size_t i) noexcept {
    timer_node* gone = heap_[i];
    gone->heap_index = timer_node::not_armed;
    timer_node* last = heap_.back();
    heap_.pop_back();
    if (last == gone) return;
    heap_[i] = last;
    last->heap_index = i;
    sift_down(i);
    sift_up(last->heap_index);
  }

  void sift_up(std::size_t i) noexcept {
    while (i > 0) {
      const std::size_t parent = (i - 1) / 2;
      if (!(heap_[i]->deadline < heap_[parent]->deadline)) break;
      swap_nodes(i, parent);
      i = parent;
    }
  }

  void sift_down(std::size_t i) noexcept {
    for (;;) {
      const std::size_t left = 2 * i + 1;
      const std::size_t right = left + 1;
      std::size_t least = i;
      if (left < heap_.size() && heap_[left]->deadline < heap_[least]->deadline) least = left;
      if (right < heap_.size() && heap_[right]->deadline < heap_[least]->deadline) least = right;
      if (least == i) return;
      swap_nodes(i, least);
      i = least;
    }
  }

  void swap_nodes(std::size_t a, std::size_t b) noexcept {
    std::swap(heap_[a], heap_[b]);
    heap_[a]->heap_index = a;
    heap_[b]->heap_index = b;
  }

  kick_fn kick_;
  void* owner_;
  std::mutex mutex_;
  std::vector<timer_node*> heap_;
  std::atomic<clock::rep> earliest_{none};
};

// The process-wide timer thread behind when_all(span, timeout) when no executor is named. Started on
// first use; stopped and joined at exit.
class timer_thread {
 public:
  timer_thread() : service_(&kick, this), thread_([this] { run(); }) {}
  timer_thread(const timer_thread&) = delete;
  timer_thread& operator=(const timer_thread&) = delete;

  ~timer_thread() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    cv_.notify_one();
    thread_.join();
  }

  [[nodiscard]] timer_service& service() noexcept { return service_; }

 private:
  static void kick(void* self) noexcept {
    auto* t = static_cast<timer_thread*>(self);
    {
      std::lock_guard lock(t->mutex_);
      ++t->kicks_;
    }
    t->cv_.notify_one();
  }

  void run() {
    std::unique_lock lock(mutex_);
    while (!stop_) {
      const std::uint64_t seen = kicks_;
      lock.unlock();
      service_.fire_expired(clock::now());
      const bool idle = service_.empty();
      const clock::time_point next = service_.next_deadline();
      lock.lock();
      // A kick after `seen` means a new, earlier deadline: go round again instead of sleeping.
      const auto woken = [&] { return stop_ || kicks_ != seen; };
      if (idle) {
        cv_.wait(lock, woken);
      } else {
        cv_.wait_until(lock, next, woken);
      }
    }
  }

  timer_service service_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::uint64_t kicks_ = 0;
  bool stop_ = false;
  std::thread thread_;
};

[[nodiscard]] inline timer_service& process_timers() {
  static timer_thread instance;
  return instance.service();
}

}  // namespace ferry::detail

#pragma once
// An in-process fake of the GPU runtime calls the copy backend makes (hip_runtime.hpp's interface), for
// testing the backend's event polling without a GPU.
//
// What it models: a current device per thread (a new thread starts on device 0), and streams and
// events that belong to the device current when they were made, an event recorded on another
// device's stream failing as CUDA's and HIP's do; streams that run their copies one after another, each taking a configurable
// time after the one before it; a copy's bytes move (memcpy) when it finishes, not when it is
// enqueued; events recorded on a stream become ready when everything enqueued before them has
// finished, and until then a query answers not_ready; an error injected on a stream makes its next
// copies fail, and the events behind each failed copy report that error, while other streams go on.
// Submission errors (a refused enqueue) can be injected too. What it does not model: real device
// memory (every pointer is host memory), sticky context-wide errors, peer access, timing events.

#include <chrono>
#include <cstddef>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "ferry/gpu/copy_kind.hpp"

namespace ferry::gpu::fake {

// Error codes, numbered as HIP numbers them.
inline constexpr int success = 0;
inline constexpr int error_invalid_value = 1;
inline constexpr int error_launch_failure = 719;
inline constexpr int error_not_ready = 600;
inline constexpr int error_invalid_resource_handle = 400;

inline thread_local int current_device = 0;

struct stream;

struct event {
  int device = 0;
  stream* on = nullptr;
  std::uint64_t after = 0;  // ready once this many of the stream's copies have finished
  bool recorded = false;
};

struct copy_op {
  void* dst = nullptr;
  const void* src = nullptr;
  std::size_t bytes = 0;
  int result = success;
  std::chrono::steady_clock::time_point done_at{};
};

struct stream {
  int device = 0;
  std::deque<copy_op> queue;     // enqueued, not finished
  std::uint64_t enqueued = 0;
  std::uint64_t finished = 0;
  std::vector<int> finished_results;  // the result of each finished copy, by number
  std::chrono::steady_clock::time_point last_done{};
  int fail_next = 0;  // this many of the next copies fail
  int fail_with = success;
};

// The process-wide script of the fake runtime. Thread-safe.
class control {
 public:
  [[nodiscard]] static control& instance() {
    static control c;
    return c;
  }

  // Each copy takes this long after the previous one on its stream finished (or was enqueued).
  void set_copy_time(std::chrono::nanoseconds t) {
    std::lock_guard lock(mutex_);
    copy_time_ = t;
  }

  // Every copy enqueued and not yet finished, on any stream, finishes at the next look: a test holds
  // a copy out with a long copy time for as long as it needs, whatever the machine's load, and then
  // lets it go. (A synchronize already asleep until such a copy's old time sleeps on.)
  void finish_queued_now() {
    std::lock_guard lock(mutex_);
    const auto now = std::chrono::steady_clock::now();
    for (const auto& s : streams_) {
      for (copy_op& op : s->queue) op.done_at = std::min(op.done_at, now);
      s->last_done = std::min(s->last_done, now);
    }
  }

  // The next `count` copies enqueued on `s` fail with `error` when they finish.
  void fail_next_copies(stream* s, int count, int error = error_launch_failure) {
    std::lock_guard lock(mutex_);
    s->fail_next = count;
    s->fail_with = error;
  }

  // The next `count` enqueues (on any stream) are refused at once with `error`.
  void refuse_next_enqueues(int count, int error = error_invalid_value) {
    std::lock_guard lock(mutex_);
    refuse_next_ = count;
    refuse_with_ = error;
  }

  // The next `count` event creations are refused with `error`.
  void refuse_next_event_creates(int count, int error = error_invalid_value) {
    std::lock_guard lock(mutex_);
    refuse_events_ = count;
    refuse_events_with_ = error;
  }

  // The next `count` event queries answer `error` whatever the event's state (a query that fails of
  // itself, not because its copy did).
  void fail_next_queries(int count, int error = error_invalid_resource_handle) {
    std::lock_guard lock(mutex_);
    fail_queries_ = count;
    fail_queries_with_ = error;
  }

  void set_devices(int n) {
    std::lock_guard lock(mutex_);
    devices_ = n;
  }

  [[nodiscard]] std::uint64_t queries() const {
    std::lock_guard lock(mutex_);
    return queries_;
  }

 private:
  friend struct runtime;

  // Finishes, in order, the copies of `s` whose time has come. Under the mutex.
  void advance(stream& s, std::chrono::steady_clock::time_point now) {
    while (!s.queue.empty() && s.queue.front().done_at <= now) {
      copy_op& op = s.queue.front();
      if (op.result == success) std::memmove(op.dst, op.src, op.bytes);
      s.finished_results.push_back(op.result);
      ++s.finished;
      s.queue.pop_front();
    }
  }

  mutable std::mutex mutex_;
  std::chrono::nanoseconds copy_time_{std::chrono::microseconds(20)};
  int refuse_next_ = 0;
  int refuse_with_ = success;
  int refuse_events_ = 0;
  int refuse_events_with_ = success;
  int fail_queries_ = 0;
  int fail_queries_with_ = success;
  int devices_ = 1;
  std::uint64_t queries_ = 0;
  std::vector<std::unique_ptr<stream>> streams_;
  std::vector<std::unique_ptr<event>> events_;
};

struct runtime {
  using stream_handle = stream*;
  using event_handle = event*;

  static constexpr int success = fake::success;
  static constexpr int not_ready = fake::error_not_ready;

  [[nodiscard]] static const char* name() noexcept { return "fake_gpu"; }
  [[nodiscard]] static const char* error_name(int e) noexcept {
    switch (e) {
      case fake::success: return "fakeSuccess";
      case error_invalid_value: return "fakeErrorInvalidValue";
      case error_launch_failure: return "fakeErrorLaunchFailure";
      case error_not_ready: return "fakeErrorNotReady";
      case error_invalid_resource_handle: return "fakeErrorInvalidResourceHandle";
      default: return nullptr;
    }
  }
  [[nodiscard]] static const char* error_string(int e) noexcept {
    switch (e) {
      case fake::success: return "no error";
      case error_invalid_value: return "invalid argument";
      case error_launch_failure: return "unspecified launch failure";
      case error_not_ready: return "device not ready";
      case error_invalid_resource_handle: return "invalid resource handle";
      default: return nullptr;
    }
  }

  static int device_count(int& n) noexcept {
    control& c = control::instance();
    std::lock_guard lock(c.mutex_);
    n = c.devices_;
    return success;
  }
  static int get_device(int& d) noexcept {
    d = current_device;
    return success;
  }
  static int set_device(int d) noexcept {
    int n = 0;
    device_count(n);
    if (d < 0 || d >= n) return error_invalid_value;
    current_device = d;
    return success;
  }
  static int enable_peer_access(int) noexcept { return success; }

  static int stream_create(stream_handle& s) noexcept {
    control& c = control::instance();
    std::lock_guard lock(c.mutex_);
    c.streams_.push_back(std::make_unique<stream>());
    s = c.streams_.back().get();
    s->device = current_device;
    return success;
  }
  static int stream_destroy(stream_handle s) noexcept {
    control& c = control::instance();
    std::lock_guard lock(c.mutex_);
    std::erase_if(c.streams_, [s](const std::unique_ptr<stream>& p) { return p.get() == s; });
    return success;
  }
  static int stream_synchronize(stream_handle s) noexcept {
    control& c = control::instance();
    std::unique_lock lock(c.mutex_);
    while (!s->queue.empty()) {
      const auto until = s->queue.back().done_at;
      lock.unlock();
      std::this_thread::sleep_until(until);
      lock.lock();
      c.advance(*s, std::chrono::steady_clock::now());
    }
    return success;
  }

  static int event_create(event_handle& e) noexcept {
    control& c = control::instance();
    std::lock_guard lock(c.mutex_);
    if (c.refuse_events_ > 0) {
      --c.refuse_events_;
      return c.refuse_events_with_;
    }
    c.events_.push_back(std::make_unique<event>());
    e = c.events_.back().get();
    e->device = current_device;
    return success;
  }
  static int event_destroy(event_handle e) noexcept {
    control& c = control::instance();
    std::lock_guard lock(c.mutex_);
    std::erase_if(c.events_, [e](const std::unique_ptr<event>& p) { return p.get() == e; });
    return success;
  }
  static int event_record(event_handle e, stream_handle s) noexcept {
    control& c = control::instance();
    std::lock_guard lock(c.mutex_);
    if (e->device != s->device) return error_invalid_resource_handle;
    e->on = s;
    e->after = s->enqueued;
    e->recorded = true;
    return success;
  }
  // not_ready until the copies before the event have finished; then the result of the last of them.
  static int event_query(event_handle e) noexcept {
    control& c = control::instance();
    std::lock_guard lock(c.mutex_);
    ++c.queries_;
    if (c.fail_queries_ > 0) {
      --c.fail_queries_;
      return c.fail_queries_with_;
    }
    if (!e->recorded || e->after == 0) return success;
    c.advance(*e->on, std::chrono::steady_clock::now());
    if (e->on->finished < e->after) return not_ready;
    return e->on->finished_results[e->after - 1];
  }
  static int event_synchronize(event_handle e) noexcept {
    if (e->recorded) stream_synchronize(e->on);
    return event_query(e);
  }

  static int memcpy_async(void* dst, const void* src, std::size_t n, copy_kind, stream_handle s) noexcept {
    control& c = control::instance();
    std::lock_guard lock(c.mutex_);
    if (c.refuse_next_ > 0) {
      --c.refuse_next_;
      return c.refuse_with_;
    }
    const auto now = std::chrono::steady_clock::now();
    copy_op op;
    op.dst = dst;
    op.src = src;
    op.bytes = n;
    if (s->fail_next > 0) {
      --s->fail_next;
      op.result = s->fail_with;
    }
    const auto start = s->queue.empty() ? now : std::max(now, s->last_done);
    op.done_at = start + c.copy_time_;
    s->last_done = op.done_at;
    s->queue.push_back(op);
    ++s->enqueued;
    return success;
  }

  static int malloc_device(void** p, std::size_t n) noexcept {
    *p = ::operator new(n, std::nothrow);
    return *p != nullptr ? success : error_invalid_value;
  }
  static int free_device(void* p) noexcept {
    ::operator delete(p);
    return success;
  }
  static int malloc_host(void** p, std::size_t n) noexcept { return malloc_device(p, n); }
  static int free_host(void* p) noexcept { return free_device(p); }
  static int memset_device(void* p, int value, std::size_t n) noexcept {
    std::memset(p, value, n);
    return success;
  }
  static int device_synchronize() noexcept {
    control& c = control::instance();
    std::vector<stream*> all;
    {
      std::lock_guard lock(c.mutex_);
      for (const auto& s : c.streams_) all.push_back(s.get());
    }
    for (stream* s : all) stream_synchronize(s);
    return success;
  }
};

}  // namespace ferry::gpu::fake

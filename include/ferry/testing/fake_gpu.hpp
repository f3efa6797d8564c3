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

///@{
/// Error codes, numbered as HIP numbers them.
inline constexpr int success = 0;
inline constexpr int error_invalid_value = 1;
inline constexpr int error_launch_failure = 719;
inline constexpr int error_not_ready = 600;
inline constexpr int error_invalid_resource_handle = 400;
///@}

/// The calling thread's current device (get_device, set_device); a new thread starts on 0.
inline thread_local int current_device = 0;

struct stream;

/// A fake event: ready once the copies enqueued on its stream before it was recorded have finished.
struct event {
  int device = 0;  ///< the device current when it was made
  stream* on = nullptr;  ///< the stream it was last recorded on
  std::uint64_t after = 0;  ///< ready once this many of the stream's copies have finished
  bool recorded = false;  ///< false until event_record
};

/// One copy enqueued on a fake stream.
struct copy_op {
  void* dst = nullptr;  ///< where the bytes go
  const void* src = nullptr;  ///< where they come from
  std::size_t bytes = 0;  ///< how many
  int result = success;  ///< what it finishes with (an injected error, or success)
  std::chrono::steady_clock::time_point done_at{};  ///< when it finishes (its bytes move then)
};

/// A fake stream: its copies finish one after another, each a copy time after the one before.
struct stream {
  int device = 0;  ///< the device current when it was made
  std::deque<copy_op> queue;     ///< enqueued, not finished
  std::uint64_t enqueued = 0;  ///< copies enqueued so far
  std::uint64_t finished = 0;  ///< copies finished so far
  std::vector<int> finished_results;  ///< the result of each finished copy, by number
  std::chrono::steady_clock::time_point last_done{};  ///< when the last copy enqueued finishes
  int fail_next = 0;  ///< this many of the next copies fail
  int fail_with = success;  ///< with this error
};

/// The process-wide script of the fake runtime. Thread-safe.
class control {
 public:
  /// The one control, made on first use.
  [[nodiscard]] static control& instance() {
    static control c;
    return c;
  }

  /// Each copy takes this long after the previous one on its stream finished (or was enqueued).
  void set_copy_time(std::chrono::nanoseconds t) {
    std::lock_guard lock(mutex_);
    copy_time_ = t;
  }

  /// Every copy enqueued and not yet finished, on any stream, finishes at the next look: a test holds
  /// a copy out with a long copy time for as long as it needs, whatever the machine's load, and then
  /// lets it go. (A synchronize already asleep until such a copy's old time sleeps on.)
  void finish_queued_now() {
    std::lock_guard lock(mutex_);
    const auto now = std::chrono::steady_clock::now();
    for (const auto& s : streams_) {
      for (copy_op& op : s->queue) op.done_at = std::min(op.done_at, now);
      s->last_done = std::min(s->last_done, now);
    }
  }

  /// The next `count` copies enqueued on `s` fail with `error` when they finish.
  void fail_next_copies(stream* s, int count, int error = error_launch_failure) {
    std::lock_guard lock(mutex_);
    s->fail_next = count;
    s->fail_with = error;
  }

  /// The next `count` enqueues (on any stream) are refused at once with `error`.
  void refuse_next_enqueues(int count, int error = error_invalid_value) {
    std::lock_guard lock(mutex_);
    refuse_next_ = count;
    refuse_with_ = error;
  }

  /// The next `count` event creations are refused with `error`.
  void refuse_next_event_creates(int count, int error = error_invalid_value) {
    std::lock_guard lock(mutex_);
    refuse_events_ = count;
    refuse_events_with_ = error;
  }

  /// The next `count` event queries answer `error` whatever the event's state (a query that fails of
  /// itself, not because its copy did).
  void fail_next_queries(int count, int error = error_invalid_resource_handle) {
    std::lock_guard lock(mutex_);
    fail_queries_ = count;
    fail_queries_with_ = error;
  }

  /// How many devices device_count reports (1 until set).
  void set_devices(int n) {
    std::lock_guard lock(mutex_);
    devices_ = n;
  }

  /// How many event queries have been made, on any event.
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

/// The fake GPU runtime: hip_runtime's calls, answered in process (basic_copy_engine<fake::runtime>).
/// Every pointer is host memory; control::instance() scripts its timing and its failures.
struct runtime {
  /// A fake stream.
  using stream_handle = stream*;
  /// A fake event.
  using event_handle = event*;

  /// The code of a call that succeeded.
  static constexpr int success = fake::success;
  /// What event_query returns while the copies before the event are unfinished.
  static constexpr int not_ready = fake::error_not_ready;

  /// The runtime's name, "fake_gpu".
  [[nodiscard]] static const char* name() noexcept { return "fake_gpu"; }
  /// The name of error code `e` ("fakeErrorLaunchFailure"); null for an unknown code.
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
  /// The description of error code `e`; null for an unknown code.
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

  /// Sets `n` to the number of fake devices (control::set_devices).
  static int device_count(int& n) noexcept {
    control& c = control::instance();
    std::lock_guard lock(c.mutex_);
    n = c.devices_;
    return success;
  }
  /// Sets `d` to the calling thread's current device.
  static int get_device(int& d) noexcept {
    d = current_device;
    return success;
  }
  /// Makes `d` the calling thread's current device; error_invalid_value if there is no such device.
  static int set_device(int d) noexcept {
    int n = 0;
    device_count(n);
    if (d < 0 || d >= n) return error_invalid_value;
    current_device = d;
    return success;
  }
  /// Succeeds: the fake models no peer access.
  static int enable_peer_access(int) noexcept { return success; }

  /// Makes a stream on the current device into `s`.
  static int stream_create(stream_handle& s) noexcept {
    control& c = control::instance();
    std::lock_guard lock(c.mutex_);
    c.streams_.push_back(std::make_unique<stream>());
    s = c.streams_.back().get();
    s->device = current_device;
    return success;
  }
  /// Destroys a stream.
  static int stream_destroy(stream_handle s) noexcept {
    control& c = control::instance();
    std::lock_guard lock(c.mutex_);
    std::erase_if(c.streams_, [s](const std::unique_ptr<stream>& p) { return p.get() == s; });
    return success;
  }
  /// Sleeps until every copy enqueued on `s` has finished.
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

  /// Makes an event on the current device into `e` (or an injected refusal).
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
  /// Destroys an event.
  static int event_destroy(event_handle e) noexcept {
    control& c = control::instance();
    std::lock_guard lock(c.mutex_);
    std::erase_if(c.events_, [e](const std::unique_ptr<event>& p) { return p.get() == e; });
    return success;
  }
  /// Records `e` on `s`; error_invalid_resource_handle when they belong to different devices.
  static int event_record(event_handle e, stream_handle s) noexcept {
    control& c = control::instance();
    std::lock_guard lock(c.mutex_);
    if (e->device != s->device) return error_invalid_resource_handle;
    e->on = s;
    e->after = s->enqueued;
    e->recorded = true;
    return success;
  }
  /// not_ready until the copies before the event have finished; then the result of the last of them.
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
  /// Waits for the event's stream, then answers as event_query.
  static int event_synchronize(event_handle e) noexcept {
    if (e->recorded) stream_synchronize(e->on);
    return event_query(e);
  }

  /// Enqueues a copy on `s` (its bytes move when it finishes), or refuses it as scripted.
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

  /// Allocates `n` bytes (host memory) into `*p`.
  static int malloc_device(void** p, std::size_t n) noexcept {
    *p = ::operator new(n, std::nothrow);
    return *p != nullptr ? success : error_invalid_value;
  }
  /// Frees memory from malloc_device.
  static int free_device(void* p) noexcept {
    ::operator delete(p);
    return success;
  }
  /// Allocates `n` bytes into `*p`, as malloc_device.
  static int malloc_host(void** p, std::size_t n) noexcept { return malloc_device(p, n); }
  /// Frees memory from malloc_host.
  static int free_host(void* p) noexcept { return free_device(p); }
  /// Sets `n` bytes at `p` to `value`, at once.
  static int memset_device(void* p, int value, std::size_t n) noexcept {
    std::memset(p, value, n);
    return success;
  }
  /// Waits until every stream's copies have finished.
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

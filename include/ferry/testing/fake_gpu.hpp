#pragma once
// An in-process fake of the GPU runtime calls ferry makes (hip_runtime.hpp's interface), for testing
// the copy backend's event polling and the layer gate without a GPU.
//
// What it models: a current device per thread (a new thread starts on device 0), and streams and
// events that belong to the device current when they were made, an event recorded on another
// device's stream failing as CUDA's and HIP's do. A stream runs its operations one after another:
// a copy takes a configurable time after the operation before it, and its bytes move (memcpy) when
// it finishes, not when it is enqueued; a wait on a 32-bit word (cuStreamWaitValue32 with GEQ, a
// cyclic comparison) holds the stream until the word reaches the value; a write of a word happens in
// its turn; the layer gate's kernel waits until a gate word reaches the epoch held by another word,
// read when the kernel starts. Events recorded on a stream become ready when everything enqueued
// before them has finished, and until then a query answers not_ready; an error injected on a stream
// makes its next copies fail, and the events behind each failed copy report that error, while other
// streams go on. Submission errors (a refused enqueue) can be injected too. Stream capture records
// operations into a graph instead of running them (a synchronize or an event record during capture
// is refused, as on CUDA); an instantiated graph launched on a stream enqueues its operations there,
// every launch reading the words afresh. Host memory allocated mapped has one address for host and
// device. The fake does its work when asked (a query, a synchronize): there is no GPU thread.
// What it does not model: real device memory (every pointer is host memory), sticky context-wide
// errors, peer access, timing events.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <new>
#include <thread>
#include <vector>

#include "ferry/gpu/copy_kind.hpp"

namespace ferry::gpu::fake {

///@{
/// Error codes, numbered as HIP and CUDA number them.
inline constexpr int success = 0;
inline constexpr int error_invalid_value = 1;
inline constexpr int error_launch_failure = 719;
inline constexpr int error_not_ready = 600;
inline constexpr int error_invalid_resource_handle = 400;
inline constexpr int error_stream_capture_unsupported = 900;
inline constexpr int error_stream_capture_invalidated = 901;
///@}

/// The calling thread's current device (get_device, set_device); a new thread starts on 0.
inline thread_local int current_device = 0;

struct stream;

/// A fake event: ready once the operations enqueued on its stream before it was recorded have
/// finished.
struct event {
  int device = 0;  ///< the device current when it was made
  stream* on = nullptr;  ///< the stream it was last recorded on
  std::uint64_t after = 0;  ///< ready once this many of the stream's operations have finished
  bool recorded = false;  ///< false until event_record
};

/// What a stream operation does.
enum class op_kind {
  copy,         ///< moves `bytes` from `src` to `dst` when it finishes
  wait_value,   ///< holds the stream until `*word` reaches `value` (cyclic, as CUDA's GEQ)
  write_value,  ///< stores `value` into `*word` in its turn
  gate_wait,    ///< the layer gate's kernel: holds the stream until `*word` reaches `*epoch`
};

/// One operation enqueued on a fake stream, or recorded in a graph.
struct stream_op {
  op_kind kind = op_kind::copy;  ///< what it does
  void* dst = nullptr;  ///< copy: where the bytes go
  const void* src = nullptr;  ///< copy: where they come from
  std::size_t bytes = 0;  ///< copy: how many
  std::uint32_t* word = nullptr;  ///< the word waited on or written
  std::uint32_t value = 0;  ///< the value waited for or written
  const std::uint32_t* epoch = nullptr;  ///< gate_wait: the word holding the epoch waited for
  int result = success;  ///< what it finishes with (an injected error, or success)
  std::chrono::nanoseconds duration{};  ///< copy: how long it takes once it starts
  std::chrono::steady_clock::time_point enqueued{};  ///< when it reached the stream
};

/// A fake graph: the operations a stream capture recorded, in order.
struct graph {
  std::vector<stream_op> ops;  ///< what a launch enqueues
};

/// An instantiated fake graph.
struct graph_exec {
  std::vector<stream_op> ops;  ///< what a launch enqueues
};

/// A fake stream: its operations finish one after another.
struct stream {
  int device = 0;  ///< the device current when it was made
  std::deque<stream_op> queue;  ///< enqueued, not finished
  std::uint64_t enqueued = 0;  ///< operations enqueued so far
  std::uint64_t finished = 0;  ///< operations finished so far
  std::vector<int> finished_results;  ///< the result of each finished operation, by number
  std::chrono::steady_clock::time_point cursor{};  ///< when the last finished operation finished
  int fail_next = 0;  ///< this many of the next copies fail
  int fail_with = success;  ///< with this error
  std::unique_ptr<graph> capturing;  ///< the graph being captured (null: not capturing)
  bool capture_broken = false;  ///< a refused call during capture invalidated it
};

/// The process-wide script of the fake runtime. Thread-safe.
class control {
 public:
  /// The one control, made on first use.
  [[nodiscard]] static control& instance() {
    static control c;
    return c;
  }

  /// Each copy takes this long after the operation before it on its stream finished (or after it
  /// was enqueued, on an idle stream).
  void set_copy_time(std::chrono::nanoseconds t) {
    std::lock_guard lock(mutex_);
    copy_time_ = t;
  }

  /// Every copy enqueued and not yet finished, on any stream, finishes at the next look: a test holds
  /// a copy out with a long copy time for as long as it needs, whatever the machine's load, and then
  /// lets it go. (Waits on words still wait for their words.)
  void finish_queued_now() {
    std::lock_guard lock(mutex_);
    const auto now = std::chrono::steady_clock::now();
    for (const auto& s : streams_) {
      for (stream_op& op : s->queue) {
        op.duration = std::chrono::nanoseconds(0);
        op.enqueued = std::min(op.enqueued, now);
      }
      s->cursor = std::min(s->cursor, now);
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

  /// Runs what can run on every stream now, as the GPU would have meanwhile (a test that watches
  /// words the fake writes calls it; queries and synchronizes do it themselves).
  void run_now() {
    std::lock_guard lock(mutex_);
    const auto now = std::chrono::steady_clock::now();
    for (const auto& s : streams_) advance(*s, now);
  }

  /// Operations enqueued on `s` and not yet finished.
  [[nodiscard]] std::size_t queued(const stream* s) const {
    std::lock_guard lock(mutex_);
    return s->queue.size();
  }

 private:
  friend struct runtime;

  // A word as the GPU reads it: the host writes it with atomics, without this mutex.
  static std::uint32_t load(const std::uint32_t* w) noexcept {
    return std::atomic_ref<std::uint32_t>(*const_cast<std::uint32_t*>(w)).load(std::memory_order_acquire);
  }
  // CUDA's GEQ: (int32_t)(*word - value) >= 0, so that epochs may wrap.
  static bool reached(std::uint32_t word, std::uint32_t value) noexcept {
    return static_cast<std::int32_t>(word - value) >= 0;
  }

  // Finishes, in order, the operations of `s` that have run by `now`. Under the mutex.
  void advance(stream& s, std::chrono::steady_clock::time_point now) {
    while (!s.queue.empty()) {
      stream_op& op = s.queue.front();
      const auto start = std::max(op.enqueued, s.cursor);
      if (start > now) return;
      auto done = start;
      switch (op.kind) {
        case op_kind::copy:
          done = start + op.duration;
          if (done > now) return;
          if (op.result == success) std::memmove(op.dst, op.src, op.bytes);
          break;
        case op_kind::wait_value:
          if (!reached(load(op.word), op.value)) return;
          done = now;  // seen now: it may have been reached earlier, which only delays what follows
          break;
        case op_kind::gate_wait:
          // The kernel reads the epoch once, when it starts: the operations before it have run.
          if (op.epoch != nullptr) {
            op.value = load(op.epoch);
            op.epoch = nullptr;
          }
          if (!reached(load(op.word), op.value)) return;
          done = now;
          break;
        case op_kind::write_value:
          std::atomic_ref<std::uint32_t>(*op.word).store(op.value, std::memory_order_release);
          break;
      }
      s.cursor = done;
      s.finished_results.push_back(op.result);
      ++s.finished;
      s.queue.pop_front();
    }
  }

  // Enqueues `op` on `s`, or records it in the graph being captured. Under the mutex.
  int submit(stream& s, stream_op op) {
    if (refuse_next_ > 0) {
      --refuse_next_;
      if (s.capturing) s.capture_broken = true;
      return refuse_with_;
    }
    if (s.capturing) {
      s.capturing->ops.push_back(op);
      return success;
    }
    enqueue(s, op);
    return success;
  }

  // Puts `op` on the stream now (a launch of a graph, or a submission). Under the mutex.
  void enqueue(stream& s, stream_op op) {
    const auto now = std::chrono::steady_clock::now();
    if (s.queue.empty()) s.cursor = std::max(s.cursor, now);
    op.enqueued = now;
    if (op.kind == op_kind::copy) {
      op.duration = copy_time_;
      if (s.fail_next > 0) {
        --s.fail_next;
        op.result = s.fail_with;
      }
    }
    s.queue.push_back(op);
    ++s.enqueued;
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

/// The fake GPU runtime: hip_runtime's calls, answered in process (basic_copy_engine<fake::runtime>,
/// basic_layer_gate<fake::runtime>). Every pointer is host memory; control::instance() scripts its
/// timing and its failures.
struct runtime {
  /// A fake stream.
  using stream_handle = stream*;
  /// A fake event.
  using event_handle = event*;
  /// A fake captured graph.
  using graph_handle = graph*;
  /// A fake instantiated graph.
  using graph_exec_handle = graph_exec*;
  /// The layer gate's kernel, loaded (the fake needs nothing: its kernel is built in).
  using kernel_handle = int;

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
      case error_stream_capture_unsupported: return "fakeErrorStreamCaptureUnsupported";
      case error_stream_capture_invalidated: return "fakeErrorStreamCaptureInvalidated";
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
      case error_stream_capture_unsupported: return "operation not permitted when stream is capturing";
      case error_stream_capture_invalidated: return "operation failed due to a previous error during capture";
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
  /// Sleeps until every operation enqueued on `s` has finished (for ever, as on a GPU, if one waits
  /// on a word nobody writes); refused while the stream is capturing.
  static int stream_synchronize(stream_handle s) noexcept {
    control& c = control::instance();
    std::unique_lock lock(c.mutex_);
    if (s->capturing) {
      s->capture_broken = true;
      return error_stream_capture_unsupported;
    }
    for (;;) {
      const auto now = std::chrono::steady_clock::now();
      c.advance(*s, now);
      if (s->queue.empty()) return success;
      // Not past the head copy's end, and never long: words and finish_queued_now change things.
      auto until = now + std::chrono::microseconds(200);
      const stream_op& head = s->queue.front();
      if (head.kind == op_kind::copy) {
        until = std::min(until, std::max(head.enqueued, s->cursor) + head.duration);
      }
      lock.unlock();
      std::this_thread::sleep_until(until);
      lock.lock();
    }
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
  /// Records `e` on `s`; error_invalid_resource_handle when they belong to different devices,
  /// error_stream_capture_unsupported while `s` is capturing (ferry records no events in graphs).
  static int event_record(event_handle e, stream_handle s) noexcept {
    control& c = control::instance();
    std::lock_guard lock(c.mutex_);
    if (e->device != s->device) return error_invalid_resource_handle;
    if (s->capturing) {
      s->capture_broken = true;
      return error_stream_capture_unsupported;
    }
    e->on = s;
    e->after = s->enqueued;
    e->recorded = true;
    return success;
  }
  /// not_ready until the operations before the event have finished; then the result of the last.
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
    stream_op op;
    op.dst = dst;
    op.src = src;
    op.bytes = n;
    return c.submit(*s, op);
  }

  /// Enqueues on `s` a wait until the word at `word` reaches `value`, cyclically (as
  /// cuStreamWaitValue32 with CU_STREAM_WAIT_VALUE_GEQ).
  static int stream_wait_value32(stream_handle s, void* word, std::uint32_t value) noexcept {
    if (word == nullptr) return error_invalid_value;
    control& c = control::instance();
    std::lock_guard lock(c.mutex_);
    stream_op op;
    op.kind = op_kind::wait_value;
    op.word = static_cast<std::uint32_t*>(word);
    op.value = value;
    return c.submit(*s, op);
  }
  /// Enqueues on `s` a write of `value` to the word at `word`, in stream order.
  static int stream_write_value32(stream_handle s, void* word, std::uint32_t value) noexcept {
    if (word == nullptr) return error_invalid_value;
    control& c = control::instance();
    std::lock_guard lock(c.mutex_);
    stream_op op;
    op.kind = op_kind::write_value;
    op.word = static_cast<std::uint32_t*>(word);
    op.value = value;
    return c.submit(*s, op);
  }

  /// Loads the layer gate's kernel on the current device (built in: nothing to load).
  static int gate_kernel_load(kernel_handle& k) noexcept {
    k = 1;
    return success;
  }
  /// Unloads the layer gate's kernel.
  static int gate_kernel_unload(kernel_handle) noexcept { return success; }
  /// Launches the layer gate's kernel on `s`: it reads the epoch at `epoch` when it starts and holds
  /// the stream until the word at `word` reaches it (cyclically). Capturable.
  static int launch_gate_wait(kernel_handle, stream_handle s, const void* word, const void* epoch) noexcept {
    if (word == nullptr || epoch == nullptr) return error_invalid_value;
    control& c = control::instance();
    std::lock_guard lock(c.mutex_);
    stream_op op;
    op.kind = op_kind::gate_wait;
    op.word = static_cast<std::uint32_t*>(const_cast<void*>(word));
    op.epoch = static_cast<const std::uint32_t*>(epoch);
    return c.submit(*s, op);
  }

  /// Starts capturing what is enqueued on `s` into a graph; error_invalid_value if it already is.
  static int stream_begin_capture(stream_handle s) noexcept {
    control& c = control::instance();
    std::lock_guard lock(c.mutex_);
    if (s->capturing) return error_invalid_value;
    s->capturing = std::make_unique<graph>();
    s->capture_broken = false;
    return success;
  }
  /// Ends the capture on `s`: `g` is the graph (error_stream_capture_invalidated, and no graph, if
  /// a refused call broke the capture).
  static int stream_end_capture(stream_handle s, graph_handle& g) noexcept {
    control& c = control::instance();
    std::lock_guard lock(c.mutex_);
    if (!s->capturing) return error_invalid_value;
    std::unique_ptr<graph> made = std::move(s->capturing);
    if (s->capture_broken) {
      g = nullptr;
      return error_stream_capture_invalidated;
    }
    g = made.release();
    return success;
  }
  /// Sets `capturing` to whether `s` is capturing.
  static int stream_is_capturing(stream_handle s, bool& capturing) noexcept {
    control& c = control::instance();
    std::lock_guard lock(c.mutex_);
    capturing = s->capturing != nullptr;
    return success;
  }
  /// Instantiates graph `g` into `x`.
  static int graph_instantiate(graph_exec_handle& x, graph_handle g) noexcept {
    if (g == nullptr) return error_invalid_value;
    x = new (std::nothrow) graph_exec{g->ops};
    return x != nullptr ? success : error_invalid_value;
  }
  /// Enqueues everything graph `x` holds on `s`, in order.
  static int graph_launch(graph_exec_handle x, stream_handle s) noexcept {
    control& c = control::instance();
    std::lock_guard lock(c.mutex_);
    if (s->capturing) {
      s->capture_broken = true;
      return error_stream_capture_unsupported;
    }
    for (const stream_op& op : x->ops) c.enqueue(*s, op);
    return success;
  }
  /// Destroys a graph.
  static int graph_destroy(graph_handle g) noexcept {
    delete g;
    return success;
  }
  /// Destroys an instantiated graph.
  static int graph_exec_destroy(graph_exec_handle x) noexcept {
    delete x;
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
  /// Allocates `n` bytes of host memory the GPU reaches too, into `*p` (free with free_host).
  static int malloc_host_mapped(void** p, std::size_t n) noexcept { return malloc_device(p, n); }
  /// Sets `*device` to the address the GPU reaches mapped host memory `host` by (the same, here).
  static int host_device_pointer(void** device, void* host) noexcept {
    *device = host;
    return success;
  }
  /// Frees memory from malloc_host or malloc_host_mapped.
  static int free_host(void* p) noexcept { return free_device(p); }
  /// Sets `n` bytes at `p` to `value`, at once.
  static int memset_device(void* p, int value, std::size_t n) noexcept {
    std::memset(p, value, n);
    return success;
  }
  /// Waits until every operation on the current device's streams has finished (streams capturing
  /// are skipped). Looks the streams up afresh each time round, so one destroyed meanwhile is never
  /// touched.
  static int device_synchronize() noexcept {
    control& c = control::instance();
    const int device = current_device;
    std::unique_lock lock(c.mutex_);
    for (;;) {
      const auto now = std::chrono::steady_clock::now();
      bool idle = true;
      for (const auto& s : c.streams_) {
        if (s->device != device || s->capturing) continue;
        c.advance(*s, now);
        idle = idle && s->queue.empty();
      }
      if (idle) return success;
      lock.unlock();
      std::this_thread::sleep_for(std::chrono::microseconds(200));
      lock.lock();
    }
  }
};

}  // namespace ferry::gpu::fake

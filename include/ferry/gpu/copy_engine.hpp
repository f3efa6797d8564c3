#pragma once
// The GPU copy backend: device-to-device, peer, host-to-device and device-to-host copies as
// transfers whose completion the progress executor detects. A template over the GPU runtime
// (hip_runtime.hpp: HIP; cuda_runtime.hpp: CUDA; ferry/testing/fake_gpu.hpp: in process).
//
// Submission. copy() runs on the caller's thread: it takes an event from a pool (timing disabled),
// enqueues the copy on one of a pool of non-blocking streams and records the event behind it, and
// appends the pair to that stream's queue, all under the stream's lock, so the queue is in the
// stream's own order. A runtime error at submission gives an already-failed transfer.
//
// Completion. Only the executor queries events: per stream, in submission order, the oldest first,
// stopping at the first that is not ready (a stream completes in order, so the later ones cannot be
// either), and starting each round at the next stream, so that a busy stream never starves the
// others. A ready event completes its transfer; an event that reports an error fails its transfer
// with a std::error_code naming the runtime error, once its stream has been waited for (the error
// may be the query's own, with the copy still running), and the engine goes on with the others. (On
// a real GPU an asynchronous fault is sticky: the whole context fails, so every later query reports
// it too.) Events have no descriptor to sleep on: while copies are outstanding the engine is busy()
// and the executor does not park, so it notices a finished copy within one round.
//
// Devices. The current device is per thread in both runtimes, and events belong to the device
// current when they are made: the engine makes its streams and events, and queries them, with its
// own device current, and gives every thread back the device it had.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "ferry/detail/block_pool.hpp"
#include "ferry/detail/status_block.hpp"
#include "ferry/errors.hpp"
#include "ferry/gpu/copy_kind.hpp"
#include "ferry/progress_executor.hpp"
#include "ferry/transfer.hpp"

namespace ferry::gpu {

namespace detail {

// The runtime's error codes, named by the runtime itself ("hipErrorInvalidValue: invalid argument").
template <class R>
class runtime_category_impl final : public std::error_category {
 public:
  [[nodiscard]] const char* name() const noexcept override { return R::name(); }
  [[nodiscard]] std::string message(int value) const override {
    const char* n = R::error_name(value);
    const char* s = R::error_string(value);
    std::string text = n != nullptr ? n : "unknown runtime error " + std::to_string(value);
    // Some runtimes' strings only repeat the name.
    if (s != nullptr && (n == nullptr || std::string_view(s) != n)) text += std::string(": ") + s;
    return text;
  }
};

}  // namespace detail

/// The category of runtime `R`'s error codes, named by the runtime ("hipErrorInvalidValue: ...").
template <class R>
[[nodiscard]] const std::error_category& runtime_category() noexcept {
  static const detail::runtime_category_impl<R> category;
  return category;
}

/// Runtime `R`'s error code `e` as a std::error_code in runtime_category<R>().
template <class R>
[[nodiscard]] std::error_code make_runtime_error(int e) noexcept {
  return {e, runtime_category<R>()};
}

/// What a copy engine is made with (basic_copy_engine's constructor).
struct copy_engine_options {
  int device = 0;          ///< the GPU whose streams carry the copies
  unsigned streams = 4;    ///< copies are spread over them round-robin, or placed with copy_on
  unsigned events = 256;   ///< events made up front; more are made when they run out
};

/// What a copy engine has done so far (basic_copy_engine::counters()).
/// submitted == completed + failed + outstanding.
struct copy_engine_counters {
  std::uint64_t submitted = 0;  ///< copies asked for
  std::uint64_t completed = 0;  ///< copies that succeeded
  std::uint64_t failed = 0;  ///< refused at submission, or failed on the GPU
  std::uint64_t event_queries = 0;  ///< event queries the executor made
};

namespace detail {

// Makes `device` current on this thread for the scope, and gives the thread its own back after.
template <class R>
class device_scope {
 public:
  explicit device_scope(int device) noexcept {
    if (R::get_device(saved_) == R::success && saved_ != device) {
      switched_ = R::set_device(device) == R::success;
    }
  }
  ~device_scope() {
    if (switched_) R::set_device(saved_);
  }
  device_scope(const device_scope&) = delete;
  device_scope& operator=(const device_scope&) = delete;

 private:
  int saved_ = 0;
  bool switched_ = false;
};

// Throws std::system_error for runtime `R`'s error `e` (not success), saying "who: what".
template <class R>
void check_runtime(int e, const char* who, const std::string& what) {
  if (e != R::success) throw std::system_error(make_runtime_error<R>(e), std::string(who) + ": " + what);
}

// A device that is not one of the GPUs fails as the runtime's set_device does, naming the call.
template <class R>
void check_device(int device, const char* who) {
  int devices = 0;
  check_runtime<R>(R::device_count(devices), who, "device_count");
  if (device < 0 || device >= devices) {
    check_runtime<R>(R::set_device(device), who, "set_device(" + std::to_string(device) + ")");
  }
}

}  // namespace detail

/// The GPU copy backend over runtime `R`: copies as transfers whose events the executor polls.
///
/// `R` is hip_runtime, cuda_runtime (ferry::gpu::copy_engine picks this build's) or
/// fake::runtime in tests. Copies on one stream complete in order; the destructor waits for every
/// copy still on the GPU.
template <class R>
class basic_copy_engine {
 public:
  using runtime = R;  ///< the GPU runtime the engine calls

  /// Makes the streams and events on `options.device` and registers with `exec`, which must
  /// outlive the engine. Throws std::invalid_argument for zero streams, std::system_error naming
  /// the runtime call that failed.
  basic_copy_engine(progress_executor& exec, copy_engine_options options = {})
      : exec_(exec), options_(options) {
    if (options_.streams == 0) {
      throw std::invalid_argument("ferry::gpu::copy_engine_options::streams must be at least 1");
    }
    detail::check_device<R>(options_.device, who);
    const detail::device_scope<R> on(options_.device);
    lanes_ = std::make_unique<lane[]>(options_.streams);
    try {
      for (unsigned i = 0; i < options_.streams; ++i) {
        check(R::stream_create(lanes_[i].stream), "stream_create");
        lanes_[i].created = true;
      }
      for (unsigned i = 0; i < options_.events; ++i) free_events_.push_back(make_event());
      exec_.add_source(*this);
    } catch (...) {
      destroy_runtime_objects();
      throw;
    }
  }

  basic_copy_engine(const basic_copy_engine&) = delete;
  basic_copy_engine& operator=(const basic_copy_engine&) = delete;

  /// Waits for every copy still on the GPU (its memory may not be freed before), completes its
  /// transfer, and releases the streams and events.
  ~basic_copy_engine() {
    // A continuation resumed below may submit again: that is refused from here on.
    shutting_down_.store(true, std::memory_order_relaxed);
    exec_.remove_source(*this);
    const detail::device_scope<R> on(options_.device);
    for (unsigned i = 0; i < options_.streams; ++i) {
      lane& l = lanes_[i];
      R::stream_synchronize(l.stream);
      take_submitted(l);
      while (record_body* r = l.head) {
        l.head = r->next;
        const int e = R::event_query(r->event);
        give_event(r->event);
        outstanding_.fetch_sub(1, std::memory_order_relaxed);
        finish(r, e);
      }
    }
    destroy_runtime_objects();
  }

  /// Copies `bytes` from `src` to `dst` on the next stream in turn.
  [[nodiscard]] transfer copy(void* dst, const void* src, std::size_t bytes, copy_kind kind) {
    const unsigned s = next_lane_.fetch_add(1, std::memory_order_relaxed) % options_.streams;
    return copy_on(s, dst, src, bytes, kind);
  }

  /// The same on stream `stream` (0 .. streams - 1): copies on one stream complete in order.
  [[nodiscard]] transfer copy_on(unsigned stream, void* dst, const void* src, std::size_t bytes,
                                 copy_kind kind) {
    if (stream >= options_.streams) {
      throw std::out_of_range("ferry::gpu::copy_engine::copy_on: stream " + std::to_string(stream) +
                              " of " + std::to_string(options_.streams));
    }
    if (shutting_down_.load(std::memory_order_relaxed)) {
      return make_completed_transfer(transfer_state::failed, errc::backend_shut_down);
    }
    if (bytes == 0) return make_completed_transfer(transfer_state::failed, errc::empty_buffer);
    if (dst == nullptr || src == nullptr) {
      return make_completed_transfer(transfer_state::failed,
                                     std::make_error_code(std::errc::bad_address));
    }
    record* r = record::pool::acquire();
    r->next = nullptr;
    try {
      r->event = take_event();
    } catch (const std::system_error& e) {
      // The runtime made no event: a runtime error at submission, like any other.
      record::pool::release(r);
      submitted_.fetch_add(1, std::memory_order_relaxed);
      failed_.fetch_add(1, std::memory_order_relaxed);
      return make_completed_transfer(transfer_state::failed, e.code());
    } catch (...) {
      record::pool::release(r);
      throw;
    }
    ferry::detail::status_block* s = nullptr;
    try {
      s = ferry::detail::status_block::make();
    } catch (...) {
      give_event(r->event);
      record::pool::release(r);
      throw;
    }
    r->status = s;
    transfer t(ferry::detail::adopt, s);
    submitted_.fetch_add(1, std::memory_order_relaxed);
    lane& l = lanes_[stream];
    {
      std::lock_guard lock(l.mutex);
      if (const int e = R::memcpy_async(dst, src, bytes, kind, l.stream); e != R::success) {
        // Refused at submission: nothing was enqueued.
        give_event(r->event);
        finish(r, e);
        return t;
      }
      if (const int e = R::event_record(r->event, l.stream); e != R::success) {
        // The copy is enqueued but cannot be watched: wait for it here, so that its memory is
        // never released while the GPU may still write it.
        R::stream_synchronize(l.stream);
        give_event(r->event);
        finish(r, e);
        return t;
      }
      // Counted before it is visible, so that the executor never takes it first.
      outstanding_.fetch_add(1, std::memory_order_relaxed);
      (l.submitted_tail == nullptr ? l.submitted_head : l.submitted_tail->next) = r;
      l.submitted_tail = r;
      // Release pairs with the acquire load in poll(): the record travels with it.
      l.has_submitted.store(true, std::memory_order_release);
    }
    exec_.notify();
    return t;
  }

  /// How many streams the copies are spread over.
  [[nodiscard]] unsigned streams() const noexcept { return options_.streams; }
  /// The runtime's handle of stream `i` (0 .. streams() - 1); the engine owns it.
  [[nodiscard]] typename R::stream_handle native_stream(unsigned i) const noexcept {
    return lanes_[i].stream;
  }
  /// Copies submitted whose transfers have not ended yet.
  [[nodiscard]] std::int64_t outstanding() const noexcept {
    return outstanding_.load(std::memory_order_acquire);
  }

  /// What the engine has done so far; any thread.
  [[nodiscard]] copy_engine_counters counters() const noexcept {
    copy_engine_counters c;
    c.submitted = submitted_.load(std::memory_order_relaxed);
    c.completed = completed_.load(std::memory_order_relaxed);
    c.failed = failed_.load(std::memory_order_relaxed);
    c.event_queries = queries_.load(std::memory_order_relaxed);
    return c;
  }

  // --- The executor's side. ---

  /// Queries the streams' oldest events and completes up to `budget` copies; returns how many
  /// (completion_source). Called by the executor only.
  std::size_t poll(std::size_t budget) noexcept {
    if (outstanding_.load(std::memory_order_acquire) == 0) return 0;
    const detail::device_scope<R> on(options_.device);
    std::size_t handled = 0;
    std::uint64_t queries = 0;
    const unsigned first = first_lane_;
    first_lane_ = (first_lane_ + 1) % options_.streams;
    for (unsigned k = 0; k < options_.streams && handled < budget; ++k) {
      lane& l = lanes_[(first + k) % options_.streams];
      if (l.has_submitted.load(std::memory_order_acquire)) take_submitted(l);
      while (l.head != nullptr && handled < budget) {
        ++queries;
        const int e = R::event_query(l.head->event);
        if (e == R::not_ready) break;  // later copies on this stream cannot be done either
        record_body* r = l.head;
        l.head = r->next;
        if (l.head == nullptr) l.tail = nullptr;
        if (e == R::success) {
          give_event(r->event);
        } else {
          // The copy failed, or the query itself did, and then the copy may still be running: wait
          // for it (for the whole stream if the event cannot tell), so that nothing writes the
          // buffer once the transfer has failed, and drop the event rather than record it again.
          if (R::event_synchronize(r->event) != R::success) R::stream_synchronize(l.stream);
          R::event_destroy(r->event);
        }
        outstanding_.fetch_sub(1, std::memory_order_relaxed);
        finish(r, e);
        ++handled;
      }
    }
    queries_.fetch_add(queries, std::memory_order_relaxed);
    return handled;
  }

  /// True while copies are outstanding, so that the executor does not park (busy_source).
  /// Events cannot wake a sleeping thread: while copies are outstanding the executor keeps looking.
  [[nodiscard]] bool busy() const noexcept {
    return outstanding_.load(std::memory_order_acquire) != 0;
  }

 private:
  struct record_body {
    typename R::event_handle event{};
    ferry::detail::status_block* status = nullptr;  // the completer reference
    record_body* next = nullptr;
  };
  struct record : record_body {
    record* pool_next_ = nullptr;
    static constexpr std::size_t poisonable_bytes = sizeof(record_body);
    using pool = ferry::detail::block_pool<record>;
  };

  struct lane {
    typename R::stream_handle stream{};
    bool created = false;
    std::mutex mutex;  // orders enqueue, record and append with the stream's own order
    record_body* submitted_head = nullptr;  // guarded by mutex
    record_body* submitted_tail = nullptr;
    std::atomic<bool> has_submitted{false};
    record_body* head = nullptr;  // the executor's, oldest first
    record_body* tail = nullptr;
  };

  static constexpr const char* who = "ferry::hip";
  static void check(int e, const std::string& what) { detail::check_runtime<R>(e, who, what); }

  typename R::event_handle make_event() {
    const detail::device_scope<R> on(options_.device);  // the event must belong to our streams' device
    typename R::event_handle e{};
    check(R::event_create(e), "event_create");
    return e;
  }

  typename R::event_handle take_event() {
    {
      std::lock_guard lock(events_mutex_);
      if (!free_events_.empty()) {
        const typename R::event_handle e = free_events_.back();
        free_events_.pop_back();
        return e;
      }
    }
    return make_event();
  }

  void give_event(typename R::event_handle e) noexcept {
    std::lock_guard lock(events_mutex_);
    try {
      free_events_.push_back(e);
    } catch (...) {
      R::event_destroy(e);  // no room to keep it: it is not needed
    }
  }

  // Moves what submitters appended onto the executor's own queue, in order.
  void take_submitted(lane& l) noexcept {
    record_body* first = nullptr;
    record_body* last = nullptr;
    {
      std::lock_guard lock(l.mutex);
      first = std::exchange(l.submitted_head, nullptr);
      last = std::exchange(l.submitted_tail, nullptr);
      l.has_submitted.store(false, std::memory_order_relaxed);
    }
    if (first == nullptr) return;
    (l.tail == nullptr ? l.head : l.tail->next) = first;
    l.tail = last;
  }

  // Ends one copy (its event already back in the pool): the transfer completes.
  void finish(record_body* r, int e) noexcept {
    ferry::detail::status_block* s = r->status;
    if (e == R::success) {
      completed_.fetch_add(1, std::memory_order_relaxed);
    } else {
      failed_.fetch_add(1, std::memory_order_relaxed);
    }
    record::pool::release(static_cast<record*>(r));
    s->complete(e == R::success ? transfer_state::success : transfer_state::failed,
                e == R::success ? std::error_code{} : make_runtime_error<R>(e));
    s->release_completer_ref();
  }

  void destroy_runtime_objects() noexcept {
    for (const typename R::event_handle e : free_events_) R::event_destroy(e);
    free_events_.clear();
    if (lanes_ == nullptr) return;
    for (unsigned i = 0; i < options_.streams; ++i) {
      if (lanes_[i].created) R::stream_destroy(lanes_[i].stream);
    }
  }

  progress_executor& exec_;
  copy_engine_options options_;
  std::unique_ptr<lane[]> lanes_;
  unsigned first_lane_ = 0;  // the executor's: where the next poll starts
  std::atomic<bool> shutting_down_{false};
  std::mutex events_mutex_;
  std::vector<typename R::event_handle> free_events_;
  alignas(64) std::atomic<unsigned> next_lane_{0};
  alignas(64) std::atomic<std::int64_t> outstanding_{0};
  std::atomic<std::uint64_t> submitted_{0};
  std::atomic<std::uint64_t> completed_{0};
  std::atomic<std::uint64_t> failed_{0};
  std::atomic<std::uint64_t> queries_{0};
};

}  // namespace ferry::gpu

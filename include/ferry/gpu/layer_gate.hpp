#pragma once
// The layer gate: layer readiness that the GPU itself waits on, so that an engine running its forward
// as one captured graph keeps layer overlap (layer L computes while layers L+1... still load).
//
// The words. The gate keeps one 32-bit word per layer in pinned host memory mapped into the GPU: the
// newest epoch (step) whose load of that layer is decided. Steps are numbered by begin_step (1, 2,
// ...). When a layer's transfers for a step are decided (all succeeded, one failed, or the step's
// deadline passed) the thread that decided it (the progress executor completing the last transfer,
// or the timer serving the deadline) writes the epoch into the layer's word, in epoch order: a word
// never passes a step whose layer is still undecided. A failed or timed-out layer is released too;
// its verdict stays readable on the host (verdict(epoch, layer)) for the last `history` steps, for
// the engine to recompute or abort after the step, as with the kv layer's verdicts.
//
// The waits, enqueued on the engine's compute stream before each layer's kernels:
//   - enqueue_wait(stream, epoch, layer): a stream memory wait, word >= epoch (cuStreamWaitValue32 /
//     hipStreamWaitValue32). The epoch is a parameter of the call, so it is for streams run eagerly,
//     not for capture (it would be frozen into the graph; the gate refuses it during capture).
//   - In a graph: enqueue_epoch(stream, epoch) before each launch, outside the graph, writes the
//     step's epoch into the gate's epoch word (mapped beside the layers' words) in stream order
//     (cuStreamWriteValue32); the graph holds enqueue_graph_wait(stream, layer), a one-thread kernel
//     that reads the epoch word when it starts and waits for the layer's word to reach it. Captured
//     once, replayed every step. One graph stream per gate: the epoch word is the gate's.
// Comparisons are cyclic ((int32_t)(word - epoch) >= 0) on CUDA and in the fake, so epochs may wrap;
// HIP's wait compares plainly, which wraps after 2^32 steps.
//
// The promise: no stream waits on the gate past its step's deadline (begin_step takes it), and
// destroying the gate releases every wait and waits for the device before its memory goes.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <span>
#include <stdexcept>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "ferry/batch_result.hpp"
#include "ferry/detail/error_category.hpp"
#include "ferry/errors.hpp"
#include "ferry/gpu/copy_engine.hpp"
#include "ferry/scheduler.hpp"
#include "ferry/spawn.hpp"
#include "ferry/task.hpp"
#include "ferry/transfer.hpp"
#include "ferry/when_all.hpp"

namespace ferry::gpu {

/// Why the layer gate released a layer that did not load (category "ferry.gpu.gate").
enum class gate_errc : int {
  deadline_passed = 1,  ///< the step's deadline passed with the layer's loads still pending
  gate_closed = 2,      ///< the gate was destroyed before the layer was decided
  no_memory = 3,        ///< the gate had no memory to watch the layer's loads
};

/// The message for `e`; nullptr for a value that is no gate_errc.
[[nodiscard]] constexpr const char* describe(gate_errc e) noexcept {
  switch (e) {
    case gate_errc::deadline_passed:
      return "the step's deadline passed before the layer's loads were decided";
    case gate_errc::gate_closed: return "the layer gate was destroyed before the layer was decided";
    case gate_errc::no_memory: return "the layer gate had no memory to watch the layer's loads";
  }
  return nullptr;
}

/// The category of gate_errc, named "ferry.gpu.gate".
[[nodiscard]] inline const std::error_category& gate_category() noexcept {
  return ferry::detail::error_category_of<gate_errc, describe>("ferry.gpu.gate");
}

/// `e` as a std::error_code in gate_category().
[[nodiscard]] inline std::error_code make_error_code(gate_errc e) noexcept {
  return {static_cast<int>(e), gate_category()};
}

}  // namespace ferry::gpu

/// Makes ferry::gpu::gate_errc an error-code enum.
template <>
struct std::is_error_code_enum<ferry::gpu::gate_errc> : std::true_type {};

namespace ferry::gpu {

/// How a layer's load for one step ended at the gate.
enum class layer_state : std::uint8_t {
  pending,    ///< not decided yet: the layer's word has not passed this step
  success,    ///< every transfer armed for the layer succeeded, or none was armed
  failed,     ///< a transfer failed (the first failure in time is in `error`)
  timed_out,  ///< the step's deadline passed with transfers still pending
  closed,     ///< the gate was destroyed before it was decided
};

/// The state's name ("pending", "success", "failed", "timed_out", "closed"); "invalid" otherwise.
[[nodiscard]] constexpr const char* to_string(layer_state s) noexcept {
  switch (s) {
    case layer_state::pending: return "pending";
    case layer_state::success: return "success";
    case layer_state::failed: return "failed";
    case layer_state::timed_out: return "timed_out";
    case layer_state::closed: return "closed";
  }
  return "invalid";
}

/// A layer's verdict for one step (basic_layer_gate::verdict).
struct layer_verdict {
  layer_state state = layer_state::pending;  ///< how it ended
  std::error_code error;  ///< failed: the first failure; timed_out: gate_errc::deadline_passed
};

/// What a layer gate is made with.
struct layer_gate_options {
  int device = 0;           ///< the GPU whose streams wait on the gate
  std::size_t layers = 0;   ///< layers 0 .. layers - 1 (at least 1, at most 65536)
  std::size_t history = 64;  ///< decided steps whose verdicts stay readable (at least 1)
  /// The first step's epoch (each next one is one more, cyclically). The words start one below it.
  /// Epochs wrap after 2^32 - 1; a test starts near there to cross the wrap.
  std::uint32_t first_epoch = 1;
};

/// What a layer gate has done so far (basic_layer_gate::counters()).
struct layer_gate_counters {
  std::uint64_t steps = 0;      ///< steps begun
  std::uint64_t decided = 0;    ///< layer verdicts reached (one per layer per step)
  std::uint64_t failed = 0;     ///< of them, failed
  std::uint64_t timed_out = 0;  ///< of them, timed out
};

namespace detail {

using gate_clock = std::chrono::steady_clock;

// True when epoch `a` comes after `b`, cyclically.
[[nodiscard]] constexpr bool epoch_after(std::uint32_t a, std::uint32_t b) noexcept {
  return static_cast<std::int32_t>(a - b) > 0;
}

struct gate_step {
  std::uint32_t epoch = 0;
  gate_clock::time_point deadline{};
  bool sealed = false;
  std::size_t undecided = 0;
  std::vector<layer_verdict> layers;
  std::vector<bool> armed;
  completer deadline_watch;  // ends the step's deadline wait once every layer is decided
};

// What the gate and its watches share: the watches (waits on a layer's transfers, on a step's
// deadline) may end after the gate is gone, and then change nothing.
struct gate_shared {
  std::mutex mutex;
  std::uint32_t* words = nullptr;  // null once the gate is closed
  std::vector<std::uint32_t> released;  // per layer: the epoch its word holds
  std::deque<gate_step> steps;  // the newest last; epochs consecutive
  std::uint32_t newest = 0;
  layer_gate_counters counts;

  gate_step* find(std::uint32_t epoch) noexcept {
    if (steps.empty()) return nullptr;
    const std::uint32_t first = steps.front().epoch;
    const std::uint32_t index = epoch - first;  // cyclic: epochs are consecutive, 0 after 2^32 - 1
    if (epoch_after(first, epoch) || index >= steps.size()) return nullptr;
    gate_step& s = steps[index];
    return s.epoch == epoch ? &s : nullptr;
  }

  // Decides layer `layer` of step `epoch`, if it is still pending; returns the completer of the
  // step's deadline wait to complete (outside the lock) when that was its last pending layer.
  completer decide(std::uint32_t epoch, std::size_t layer, layer_verdict v) noexcept {
    gate_step* s = find(epoch);
    if (s == nullptr || words == nullptr || s->layers[layer].state != layer_state::pending) return {};
    s->layers[layer] = v;
    ++counts.decided;
    if (v.state == layer_state::failed) ++counts.failed;
    if (v.state == layer_state::timed_out) ++counts.timed_out;
    advance(layer);
    if (--s->undecided == 0) return std::move(s->deadline_watch);
    return {};
  }

  // Decides every layer still pending of step `epoch` and of every step before it with `v` (a step's
  // deadline releases it even if an earlier step's deadline is later). Returns the completers of the
  // steps' deadline waits this ended, to complete outside the lock.
  std::vector<completer> decide_through(std::uint32_t epoch, layer_verdict v) noexcept {
    std::vector<completer> ended;
    if (words == nullptr) return ended;
    for (gate_step& s : steps) {
      if (epoch_after(s.epoch, epoch)) break;
      for (std::size_t l = 0; l < s.layers.size(); ++l) {
        completer c = decide(s.epoch, l, v);
        if (c.valid()) {
          try {
            ended.push_back(std::move(c));
          } catch (...) {
            // No room to hand it back: dropping it ends its wait too (abandoned).
          }
        }
      }
    }
    return ended;
  }

  // Moves the layer's word to the newest step up to which every step's layer is decided.
  void advance(std::size_t layer) noexcept {
    std::uint32_t to = released[layer];
    for (const gate_step& s : steps) {
      if (!epoch_after(s.epoch, to)) continue;
      if (s.layers[layer].state == layer_state::pending) break;
      to = s.epoch;
    }
    if (to == released[layer]) return;
    released[layer] = to;
    // Release pairs with the GPU's acquire load (and, in the fake, its atomic load).
    std::atomic_ref<std::uint32_t>(words[layer]).store(to, std::memory_order_release);
  }
};

[[nodiscard]] inline layer_verdict verdict_of(const batch_result& r) noexcept {
  switch (r.verdict) {
    case verdict::success: return {layer_state::success, {}};
    case verdict::failed: return {layer_state::failed, r.error};
    case verdict::pending:
    case verdict::timed_out: break;
  }
  return {layer_state::timed_out, make_error_code(gate_errc::deadline_passed)};
}

// Decides the layer when its transfers are decided, on the thread that decides them.
inline task<void> watch_layer(std::shared_ptr<gate_shared> g, std::uint32_t epoch, std::size_t layer,
                              std::vector<transfer> members, std::chrono::nanoseconds timeout) {
  const batch_result r = co_await when_all(std::span<const transfer>(members), timeout);
  completer last;
  {
    std::lock_guard lock(g->mutex);
    last = g->decide(epoch, layer, verdict_of(r));
  }
  last.succeed();
}

// At the step's deadline, every layer still pending is released as timed out. `until` is a transfer
// that only the gate completes (when the step is decided), ending the wait early.
inline task<void> watch_deadline(std::shared_ptr<gate_shared> g, std::uint32_t epoch, transfer until,
                                 std::chrono::nanoseconds timeout) {
  const std::span<const transfer> one(&until, 1);
  const batch_result r = co_await when_all(one, timeout);
  if (r.verdict == verdict::success) co_return;
  std::vector<completer> ended;  // let go of outside the lock
  std::lock_guard lock(g->mutex);
  ended = g->decide_through(epoch, {layer_state::timed_out, make_error_code(gate_errc::deadline_passed)});
}

// What a watch that could not run (no memory for its frames or its timer) leaves: the layer, or the
// step with every step before it, failed, so that no stream waits on it. Any thread; noexcept.
inline void watch_failed(const std::shared_ptr<gate_shared>& g, std::uint32_t epoch, std::size_t layer,
                         bool whole_step) noexcept {
  const layer_verdict v{layer_state::failed, make_error_code(gate_errc::no_memory)};
  std::vector<completer> ended;
  completer last;
  std::lock_guard lock(g->mutex);
  if (whole_step) {
    ended = g->decide_through(epoch, v);
  } else {
    last = g->decide(epoch, layer, v);
  }
}

// The scheduler the watches resume on: the thread that decides them. Static, so that a watch that
// ends after the gate never reaches into it.
inline inline_scheduler& watch_scheduler() noexcept {
  static inline_scheduler s;
  return s;
}

}  // namespace detail

/// Layer readiness the GPU waits on, over runtime `R` (gpu_runtime, or fake::runtime in tests).
///
/// The engine, each step: `e = begin_step(deadline)`; `arm(e, layer, transfers)` as each layer's
/// loads are posted (the load tracker's layer_transfers(layer)); `seal(e)` once every layer that
/// loads anything is armed. On the compute stream, before layer L's kernels: enqueue_wait(stream, e,
/// L), or in a captured graph enqueue_graph_wait(stream, L), the graph launched with
/// launch_graph(stream, graph, e) (without the epoch a launch would wait for the step before: no
/// error says so). After the step: verdict(e, L) says which layers failed or timed out. Every call
/// takes (epoch, layer) in that order. Thread-safe.
template <class R>
class basic_layer_gate {
 public:
  using runtime = R;  ///< the GPU runtime the gate calls
  using clock = std::chrono::steady_clock;  ///< the clock deadlines are on

  /// Allocates the words on `options.device`. Throws std::invalid_argument for bad options,
  /// std::system_error naming the runtime call that failed.
  explicit basic_layer_gate(layer_gate_options options) : options_(options) {
    if (options_.layers == 0 || options_.layers > 65536) {
      throw std::invalid_argument("ferry::gpu::layer_gate_options::layers must be 1 to 65536, not " +
                                  std::to_string(options_.layers));
    }
    if (options_.history == 0) {
      throw std::invalid_argument("ferry::gpu::layer_gate_options::history must be at least 1");
    }
    detail::check_device<R>(options_.device, who);
    const detail::device_scope<R> on(options_.device);
    void* host = nullptr;
    // One word per layer, then the epoch word.
    check(R::malloc_host_mapped(&host, (options_.layers + 1) * sizeof(std::uint32_t)), "malloc_host_mapped");
    words_ = static_cast<std::uint32_t*>(host);
    try {
      std::fill_n(words_, options_.layers + 1, options_.first_epoch - 1);
      void* device_words = nullptr;
      check(R::host_device_pointer(&device_words, host), "host_device_pointer");
      device_words_ = static_cast<std::uint32_t*>(device_words);
      epoch_word_ = device_words_ + options_.layers;
      shared_ = std::make_shared<detail::gate_shared>();
      shared_->words = words_;
      shared_->newest = options_.first_epoch - 1;
      shared_->released.assign(options_.layers, options_.first_epoch - 1);
    } catch (...) {
      free_memory();
      throw;
    }
  }

  basic_layer_gate(const basic_layer_gate&) = delete;
  basic_layer_gate& operator=(const basic_layer_gate&) = delete;

  /// Releases every wait (the words jump to the newest epoch; pending layers read `closed`), waits
  /// for the device to finish what it enqueued (the waits read the gate's memory), and frees it.
  /// Destroy graphs holding its waits first: a later launch would read freed memory.
  ~basic_layer_gate() {
    {
      std::lock_guard lock(shared_->mutex);
      for (detail::gate_step& s : shared_->steps) {
        for (layer_verdict& v : s.layers) {
          if (v.state == layer_state::pending) v = {layer_state::closed, make_error_code(gate_errc::gate_closed)};
        }
        s.undecided = 0;
        // Ends the step's deadline wait: it resumes here and returns at once, taking no lock.
        s.deadline_watch.succeed();
      }
      for (std::size_t l = 0; l < options_.layers; ++l) {
        std::atomic_ref<std::uint32_t>(words_[l]).store(shared_->newest, std::memory_order_release);
      }
      shared_->words = nullptr;
    }
    {
      const detail::device_scope<R> on(options_.device);
      (void)R::device_synchronize();
    }
    free_memory();
  }

  /// Begins a step: its epoch (1, 2, ..., cyclic: after 2^32 - 1 comes 0). Every layer of the step,
  /// and of every step before it, is released by `deadline` at the latest, armed or not, sealed or
  /// not. If the gate cannot watch the deadline (no memory) the step's layers are failed at once
  /// and std::bad_alloc is thrown.
  std::uint32_t begin_step(clock::time_point deadline) {
    std::uint32_t epoch = 0;
    transfer until;
    {
      std::lock_guard lock(shared_->mutex);
      epoch = shared_->newest + 1;  // wraps to 0 after 2^32 - 1: every comparison is cyclic
      while (!shared_->steps.empty() && shared_->steps.front().undecided == 0 &&
             shared_->steps.size() >= options_.history) {
        shared_->steps.pop_front();
      }
      detail::gate_step s;
      s.epoch = epoch;
      s.deadline = deadline;
      s.undecided = options_.layers;
      s.layers.assign(options_.layers, {});
      s.armed.assign(options_.layers, false);
      auto [t, c] = make_manual_transfer();
      s.deadline_watch = std::move(c);
      until = std::move(t);
      shared_->steps.push_back(std::move(s));
      shared_->newest = epoch;
      ++shared_->counts.steps;
    }
    start_watch([&] { return detail::watch_deadline(shared_, epoch, std::move(until), remaining(deadline)); },
                epoch, 0, true);
    return epoch;
  }

  /// Begins a step whose layers are all released within `timeout` from now (saturating: a timeout
  /// too long for the clock is no deadline).
  template <class Rep, class Period>
  std::uint32_t begin_step(std::chrono::duration<Rep, Period> timeout) {
    const clock::time_point now = clock::now();
    const auto left = std::chrono::duration_cast<std::chrono::duration<double>>(clock::time_point::max() - now);
    if (std::chrono::duration<double>(timeout) >= left) return begin_step(clock::time_point::max());
    if (timeout <= std::chrono::duration<Rep, Period>::zero()) return begin_step(now);
    return begin_step(now + std::chrono::duration_cast<clock::duration>(timeout));
  }

  /// Arms `layer` of step `epoch` with the transfers that load it: the layer is released once all
  /// have succeeded, at the first failure, or at the step's deadline. No transfers: released at once
  /// as success. A layer the deadline already released keeps its verdict. Throws std::logic_error
  /// for an unknown or sealed step, a layer out of range, or a layer armed twice; std::bad_alloc
  /// when it cannot watch the transfers, after failing the layer (so nothing waits on it).
  void arm(std::uint32_t epoch, std::size_t layer, std::span<const transfer> transfers) {
    std::vector<transfer> members(transfers.begin(), transfers.end());
    clock::time_point deadline{};
    completer last;
    {
      std::lock_guard lock(shared_->mutex);
      detail::gate_step& s = step(epoch, "arm");
      check_layer(layer, "arm");
      if (s.sealed) throw std::logic_error("ferry::gpu::layer_gate::arm: step " + std::to_string(epoch) + " is sealed");
      if (s.armed[layer]) {
        throw std::logic_error("ferry::gpu::layer_gate::arm: layer " + std::to_string(layer) +
                               " of step " + std::to_string(epoch) + " is armed already");
      }
      s.armed[layer] = true;
      deadline = s.deadline;
      if (members.empty()) last = shared_->decide(epoch, layer, {layer_state::success, {}});
    }
    last.succeed();
    if (!members.empty()) {
      start_watch([&] { return detail::watch_layer(shared_, epoch, layer, std::move(members), remaining(deadline)); },
                  epoch, layer, false);
    }
  }

  /// Every layer of step `epoch` not armed loads nothing this step: released at once as success.
  /// Until then an unarmed layer holds its waits until the step's deadline. Sealing again does
  /// nothing. Throws std::logic_error for an unknown step.
  void seal(std::uint32_t epoch) {
    completer last;
    {
      std::lock_guard lock(shared_->mutex);
      detail::gate_step& s = step(epoch, "seal");
      s.sealed = true;
      for (std::size_t l = 0; l < options_.layers; ++l) {
        if (s.armed[l]) continue;
        s.armed[l] = true;
        completer c = shared_->decide(epoch, l, {layer_state::success, {}});
        if (c.valid()) last = std::move(c);
      }
    }
    last.succeed();
  }

  /// Layer `layer`'s verdict for step `epoch` (pending until decided). Throws std::out_of_range for
  /// a step not begun or older than the history kept.
  [[nodiscard]] layer_verdict verdict(std::uint32_t epoch, std::size_t layer) const {
    std::lock_guard lock(shared_->mutex);
    check_layer(layer, "verdict");
    const detail::gate_step* s = shared_->find(epoch);
    if (s == nullptr) {
      throw std::out_of_range("ferry::gpu::layer_gate::verdict: step " + std::to_string(epoch) +
                              " is not begun or older than the " + std::to_string(options_.history) +
                              " steps kept");
    }
    return s->layers[layer];
  }

  /// The newest epoch layer `layer`'s word has reached (what the GPU sees).
  [[nodiscard]] std::uint32_t released(std::size_t layer) const {
    std::lock_guard lock(shared_->mutex);
    check_layer(layer, "released");
    return shared_->released[layer];
  }

  /// Enqueues on `stream` a wait until layer `layer` of step `epoch` is released (a stream memory
  /// wait). For streams run eagerly: during a capture it throws std::logic_error (the epoch would be
  /// frozen into the graph; use enqueue_graph_wait). Throws std::system_error if the runtime refuses.
  void enqueue_wait(typename R::stream_handle stream, std::uint32_t epoch, std::size_t layer) {
    check_layer(layer, "enqueue_wait");
    check_begun(epoch, "enqueue_wait");
    refuse_capture(stream, "enqueue_wait");
    const detail::device_scope<R> on(options_.device);
    check(R::stream_wait_value32(stream, device_words_ + layer, epoch), "stream_wait_value32");
  }

  /// Enqueues on `stream`, outside any capture, the write of `epoch` into the gate's epoch word, which
  /// the graph waits that follow in stream order compare against. Throws as enqueue_wait.
  void enqueue_epoch(typename R::stream_handle stream, std::uint32_t epoch) {
    check_begun(epoch, "enqueue_epoch");
    refuse_capture(stream, "enqueue_epoch");
    const detail::device_scope<R> on(options_.device);
    check(R::stream_write_value32(stream, epoch_word_, epoch), "stream_write_value32");
  }

  /// Enqueues on `stream` the epoch of step `epoch` (enqueue_epoch), then launches instantiated graph
  /// `graph`, which holds the gate's waits (enqueue_graph_wait): each launch of a forward through
  /// this call waits for its own step. Throws as enqueue_epoch, or std::system_error naming
  /// graph_launch.
  void launch_graph(typename R::stream_handle stream, typename R::graph_exec_handle graph, std::uint32_t epoch) {
    enqueue_epoch(stream, epoch);
    const detail::device_scope<R> on(options_.device);
    check(R::graph_launch(graph, stream), "graph_launch");
  }

  /// Enqueues on `stream` the gate's kernel: it waits until layer `layer` is released for the epoch
  /// the last enqueue_epoch wrote before it in stream order. Capturable: a graph holding it waits
  /// for each launch's own step. Loads the kernel on first use. Throws std::system_error if the
  /// runtime refuses (then a capture under way is invalidated).
  void enqueue_graph_wait(typename R::stream_handle stream, std::size_t layer) {
    check_layer(layer, "enqueue_graph_wait");
    const detail::device_scope<R> on(options_.device);
    {
      std::lock_guard lock(kernel_mutex_);
      if (!kernel_loaded_) {
        check(R::gate_kernel_load(kernel_), "gate_kernel_load");
        kernel_loaded_ = true;
      }
    }
    check(R::launch_gate_wait(kernel_, stream, device_words_ + layer, epoch_word_), "launch_gate_wait");
  }

  /// Layers 0 .. layers() - 1.
  [[nodiscard]] std::size_t layers() const noexcept { return options_.layers; }
  /// The device address of layer `layer`'s word, for a kernel of the engine's own that checks it.
  [[nodiscard]] const std::uint32_t* word_address(std::size_t layer) const {
    check_layer(layer, "word_address");
    return device_words_ + layer;
  }
  /// The device address of the epoch word enqueue_epoch writes.
  [[nodiscard]] const void* epoch_address() const noexcept { return epoch_word_; }

  /// What the gate has done so far; any thread.
  [[nodiscard]] layer_gate_counters counters() const {
    std::lock_guard lock(shared_->mutex);
    return shared_->counts;
  }

 private:
  static constexpr const char* who = "ferry::gpu::layer_gate";
  static void check(int e, const std::string& what) { detail::check_runtime<R>(e, who, what); }

  static clock::duration remaining(clock::time_point deadline) noexcept {
    const clock::time_point now = clock::now();
    return deadline <= now ? clock::duration::zero() : deadline - now;
  }

  // Starts a watch made by `make` on the deciding thread. A watch that cannot start, or that fails
  // inside (no memory for its wait or its timer), fails what it watched, so that no stream waits on
  // it; a failure to start is rethrown.
  template <class Make>
  void start_watch(Make&& make, std::uint32_t epoch, std::size_t layer, bool whole_step) {
    try {
      spawn(detail::watch_scheduler(), make(),
            [g = shared_, epoch, layer, whole_step](std::exception_ptr error) noexcept {
              if (error) detail::watch_failed(g, epoch, layer, whole_step);
            });
    } catch (...) {
      detail::watch_failed(shared_, epoch, layer, whole_step);
      throw;
    }
  }

  void check_layer(std::size_t layer, const char* call) const {
    if (layer >= options_.layers) {
      throw std::logic_error(std::string("ferry::gpu::layer_gate::") + call + ": layer " +
                             std::to_string(layer) + " of " + std::to_string(options_.layers));
    }
  }

  // The step `epoch`, under the mutex; std::logic_error if it is not begun or no longer kept.
  detail::gate_step& step(std::uint32_t epoch, const char* call) {
    detail::gate_step* s = shared_->find(epoch);
    if (s == nullptr) {
      throw std::logic_error(std::string("ferry::gpu::layer_gate::") + call + ": step " +
                             std::to_string(epoch) + " is not begun or no longer kept");
    }
    return *s;
  }

  void check_begun(std::uint32_t epoch, const char* call) const {
    std::lock_guard lock(shared_->mutex);
    if (shared_->find(epoch) == nullptr) {
      throw std::logic_error(std::string("ferry::gpu::layer_gate::") + call + ": step " +
                             std::to_string(epoch) +
                             " is not begun or no longer kept: a wait on it could outlive every deadline");
    }
  }

  void refuse_capture(typename R::stream_handle stream, const char* call) const {
    bool capturing = false;
    check(R::stream_is_capturing(stream, capturing), "stream_is_capturing");
    if (capturing) {
      throw std::logic_error(std::string("ferry::gpu::layer_gate::") + call +
                             ": the stream is capturing, and the epoch would be frozen into the "
                             "graph; capture enqueue_graph_wait, and enqueue_epoch before each launch");
    }
  }

  void free_memory() noexcept {
    const detail::device_scope<R> on(options_.device);
    if (kernel_loaded_) (void)R::gate_kernel_unload(kernel_);
    if (words_ != nullptr) (void)R::free_host(words_);
  }

  layer_gate_options options_;
  std::uint32_t* words_ = nullptr;         // host address of the words
  std::uint32_t* device_words_ = nullptr;  // the GPU's address of the same words
  std::uint32_t* epoch_word_ = nullptr;    // the GPU's address of the epoch graph waits compare against
  std::shared_ptr<detail::gate_shared> shared_;
  std::mutex kernel_mutex_;
  typename R::kernel_handle kernel_{};
  bool kernel_loaded_ = false;  // guarded by kernel_mutex_
};

}  // namespace ferry::gpu

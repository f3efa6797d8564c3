#pragma once
// The decode side of a disaggregated inference server: every request's KV cache arrives as transfers,
// one or more per model layer, into destination blocks. The tracker answers the engine's questions
// without ever driving progress:
//
//   - is request R done? (verdict: a few atomic loads; never blocks, changes nothing)
//   - wait for layer L across every request of this step (so layer L computes while L+1… stream in)
//   - which requests have finished (every transfer terminal), so their producer may free its blocks
//     (the release callback fires once per request, never while anything may still write)
//   - which destination blocks failed to load and must be recomputed (each reported once)
//
// A hybrid request (attention plus recurrent state, which no recomputed prefix can repair) that fails
// or times out raises transfer_error instead, before the tracker changes anything, and again each
// time it is asked, until the engine aborts it.
//
// One engine thread calls the tracker; completions arrive from the progress executor through the
// transfers themselves, so the tracker needs no lock of its own.

#include <algorithm>
#include <chrono>
#include <exception>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <system_error>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ferry/batch_result.hpp"
#include "ferry/detail/timeout.hpp"
#include "ferry/errors.hpp"
#include "ferry/kv/errors.hpp"
#include "ferry/kv/post.hpp"
#include "ferry/post.hpp"
#include "ferry/task.hpp"
#include "ferry/transfer.hpp"
#include "ferry/wait_all.hpp"
#include "ferry/when_all.hpp"

namespace ferry::kv {

/// The engine's number for a request; unique among the requests tracked at once.
using request_id = std::uint64_t;
/// A destination block of the KV cache, in the engine's numbering.
using block_id = std::uint64_t;
/// The clock requests' ages and deadlines are measured on.
using clock = std::chrono::steady_clock;

/// A request's verdict: `pending` while unsealed or while transfers are pending within its
/// abort_timeout; `success` when every transfer succeeded; `failed` when any failed (a failure
/// wins, and a request sealed with none is failed, kv::errc::empty_request); `timed_out` when it is
/// older than its abort_timeout with transfers pending and none failed.
enum class request_verdict { pending, success, failed, timed_out };

/// The verdict's name ("pending", "success", "failed", "timed_out"); "invalid" otherwise.
[[nodiscard]] constexpr const char* to_string(request_verdict v) noexcept {
  switch (v) {
    case request_verdict::pending: return "pending";
    case request_verdict::success: return "success";
    case request_verdict::failed: return "failed";
    case request_verdict::timed_out: return "timed_out";
  }
  return "invalid";
}

/// How one request is tracked (load_tracker::add_request).
struct request_options {
  /// Attention plus recurrent state (mamba, KDA, ...): a failed load cannot be repaired by
  /// recomputing a prefix, so it raises transfer_error rather than reporting blocks.
  bool hybrid = false;
  /// A request whose age is strictly greater than this, with transfers still pending and none
  /// failed, has timed out. take_finished then asks the backend to cancel its pending transfers
  /// (load_tracker's cancel function), so that they end and the request can be let go of.
  std::chrono::nanoseconds abort_timeout = std::chrono::seconds(60);
  /// How long post() and post_async() retry a backend whose submission queue is full before the
  /// transfer fails with errc::submission_queue_full (never past the request's abort_timeout). The
  /// blocking post() holds the engine thread that long at most.
  std::chrono::nanoseconds admission_timeout = std::chrono::milliseconds(10);
};

/// A hybrid request's load failed or timed out. Nothing was changed when it was raised.
class transfer_error : public std::runtime_error {
 public:
  /// The error for `request`'s transfer `member` (on `layer`), which failed with `error` or, with
  /// `timed_out`, was still pending at the request's deadline; what() says which.
  transfer_error(request_id request, std::size_t member, std::size_t layer, std::error_code error,
                 bool timed_out)
      : std::runtime_error(describe(request, member, layer, error, timed_out)),
        request_(request),
        member_(member),
        layer_(layer),
        error_(error),
        timed_out_(timed_out) {}

  /// The hybrid request whose load failed or timed out.
  [[nodiscard]] request_id request() const noexcept { return request_; }
  /// The failing transfer: its position among the request's transfers (in the order they were
  /// added) and its layer. For a timeout, the first transfer still pending.
  [[nodiscard]] std::size_t member() const noexcept { return member_; }
  /// The failing transfer's layer.
  [[nodiscard]] std::size_t layer() const noexcept { return layer_; }
  /// The failing transfer's error (empty for a timeout).
  [[nodiscard]] std::error_code error() const noexcept { return error_; }
  /// True when the request timed out rather than failed.
  [[nodiscard]] bool timed_out() const noexcept { return timed_out_; }

 private:
  static std::string describe(request_id request, std::size_t member, std::size_t layer,
                              std::error_code error, bool timed_out) {
    std::string s = "ferry::kv: hybrid request " + std::to_string(request) + ": ";
    if (timed_out) {
      s += "timed out with transfer " + std::to_string(member) + " (layer " +
           std::to_string(layer) + ") still pending";
    } else {
      s += "transfer " + std::to_string(member) + " (layer " + std::to_string(layer) +
           ") failed: " + error.message();
    }
    return s + "; recurrent state cannot be recomputed from a prefix, abort the request";
  }

  request_id request_;
  std::size_t member_;
  std::size_t layer_;
  std::error_code error_;
  bool timed_out_;
};

/// A request the tracker has let go of: every one of its transfers was terminal.
struct finished_request {
  request_id id = 0;  ///< the request
  request_verdict verdict = request_verdict::pending;  ///< success, failed or timed_out
  std::optional<std::size_t> first_failed;  ///< the member whose failure came first in time
  std::error_code error;  ///< that member's error
  bool aborted = false;  ///< true when the engine aborted it (abort_request)
};

/// The decode side of a disaggregated server: tracks every request's KV-cache transfers, per
/// layer, and answers the engine without ever driving progress.
///
/// Is a request done (verdict), wait for a layer across the step (wait_layer, when_layer), which
/// requests finished so their producer may free its blocks (take_finished, firing release once
/// each), which destination blocks failed and must be recomputed (drain_failed_blocks). One engine
/// thread calls it; it takes no lock of its own.
class load_tracker {
 public:
  /// release(id, verdict) tells the producer that request `id` no longer needs its source blocks. It is
  /// called from take_finished, exactly once per request, when every transfer of the request is
  /// terminal.
  using release_fn = std::function<void(request_id, request_verdict)>;
  /// cancel(t) asks the backend that made `t` to end it (best effort: ring::cancel, a queue pair's
  /// close, ...): called once for each transfer still pending when its request has timed out or is
  /// aborted. Without one, such transfers end only when their backend ends them.
  using cancel_fn = std::function<void(const transfer&)>;

  /// A request being registered, as returned by add_request.
  class request_handle {
   public:
    /// The request's id.
    [[nodiscard]] request_id id() const noexcept { return id_; }

   private:
    friend class load_tracker;
    request_handle(request_id id, std::uint32_t slot, std::uint64_t generation) noexcept
        : id_(id), slot_(slot), generation_(generation) {}
    request_id id_;
    std::uint32_t slot_;
    std::uint64_t generation_;  // a handle of a finished request never names a later one
  };

  /// Layers are numbered from 0 up to this (a model has tens to hundreds).
  static constexpr std::size_t max_layers = std::size_t{1} << 20;

  /// A tracker that tells the producer through `release` and ends abandoned transfers through
  /// `cancel` (either may be empty).
  explicit load_tracker(release_fn release = {}, cancel_fn cancel = {})
      : release_(std::move(release)), cancel_(std::move(cancel)) {}

  // --- Registration ---

  /// Starts a step: layer waits and drain_step cover the transfers added from here on. The previous
  /// step's layer lists stay untouched until the step after this one begins, so a wait on them that
  /// is still finishing sees what it was given; every wait must end within that.
  void begin_step() {
    not_from_submit("begin_step");
    std::swap(step_layers_, previous_layers_);
    for (auto& layer : step_layers_) layer.clear();
  }

  /// Starts tracking a request; its age counts from `created`.
  request_handle add_request(request_id id, request_options options = {},
                             clock::time_point created = clock::now()) {
    not_from_submit("add_request");
    if (options.abort_timeout < std::chrono::nanoseconds::zero()) {
      throw std::invalid_argument("ferry::kv::load_tracker: request " + std::to_string(id) +
                                  " has a negative abort_timeout");
    }
    if (options.admission_timeout < std::chrono::nanoseconds::zero()) {
      throw std::invalid_argument("ferry::kv::load_tracker: request " + std::to_string(id) +
                                  " has a negative admission_timeout");
    }
    if (index_.contains(id)) {
      throw std::invalid_argument("ferry::kv::load_tracker: request " + std::to_string(id) +
                                  " is already tracked");
    }
    std::uint32_t slot;
    if (!free_slots_.empty()) {
      slot = free_slots_.back();
      free_slots_.pop_back();
    } else {
      slot = static_cast<std::uint32_t>(requests_.size());
      requests_.emplace_back();
    }
    request_entry& r = requests_[slot];
    r.generation = ++generations_;
    r.id = id;
    r.options = options;
    r.created = created;
    r.live = true;
    r.sealed = false;
    r.aborted = false;
    r.members.clear();
    r.blocks.clear();
    r.reported_blocks.clear();
    index_.emplace(id, slot);
    return request_handle(id, slot, r.generation);
  }

  /// Registers one transfer of the request: its layer and the destination blocks it writes. If it
  /// throws (a bad layer, no memory), nothing was registered.
  void add(request_handle h, std::size_t layer, transfer t, std::span<const block_id> destination) {
    request_entry& r = make_room(h, layer, destination.size(), "add");
    commit(r, layer, std::move(t), destination);
  }

  /// Posts through `submit` and registers the result. `submit()` returns a transfer, or nullopt when
  /// the backend's submission queue is full; then it is retried with exponential backoff, the
  /// calling thread sleeping through the pauses, until the request's admission deadline (now +
  /// admission_timeout, and never past created + abort_timeout), after which an already-failed
  /// transfer (errc::submission_queue_full) is registered and takes the ordinary failure path. The
  /// room for the transfer is made before `submit` runs, so `submit` must not call back into the
  /// tracker (such a call fails with std::logic_error). An engine thread with a scheduler awaits
  /// post_async instead, which never sleeps.
  template <class Submit>
  void post(request_handle h, std::size_t layer, std::span<const block_id> destination,
            Submit&& submit) {
    // Checked, and room made, before submitting: a transfer never goes out that the tracker cannot
    // track, and registering it cannot fail.
    request_entry& r = make_room(h, layer, destination.size(), "post");
    const clock::time_point deadline = admission_deadline(r);
    transfer t = [&] {
      const submitting in_submit(submitting_);
      return post_with_backoff(std::forward<Submit>(submit), deadline);
    }();
    commit(r, layer, std::move(t), destination);
  }

  /// post() as a task, for an engine thread with a scheduler: it never sleeps the thread.
  /// co_await tracker.post_async(h, layer, destination, submit): the same, awaited. Between tries it
  /// pauses on a timer and goes on on the awaiting coroutine's scheduler, so the engine thread runs
  /// other work meanwhile. Room is made before each try, and what a try submits is registered before
  /// anything else runs; seal the request only once every post_async on it has ended. `destination`
  /// is copied: the task may outlive the caller's span.
  template <class Submit>
  [[nodiscard]] task<void> post_async(request_handle h, std::size_t layer,
                                      std::vector<block_id> destination, Submit submit) {
    const clock::time_point deadline = admission_deadline(make_room(h, layer, destination.size(),
                                                                    "post_async"));
    detail::backoff pauses(deadline, backoff_options{});
    for (bool paused = false;; paused = true) {
      // Looked up again after every pause: the engine may have added requests meanwhile, or aborted
      // this one (then the post ends here, submitting nothing; an aborted request may even have
      // been let go of already).
      if (paused && gone_or_aborted(h)) co_return;
      request_entry& r = make_room(h, layer, destination.size(), "post_async");
      std::optional<transfer> t;
      {
        const submitting in_submit(submitting_);
        t = submit();
      }
      if (!t) {
        if (const std::optional<std::chrono::nanoseconds> pause = pauses.next()) {
          co_await detail::pause_awaitable(*pause);
          continue;
        }
        t = detail::queue_stayed_full();
      }
      commit(r, layer, std::move(*t), destination);
      co_return;
    }
  }

  /// Every transfer of the request has been added: only now can it be done.
  void seal(request_handle h) {
    not_from_submit("seal");
    entry(h, "seal").sealed = true;
  }

  /// The engine gives up on the request (after a transfer_error, for one): it no longer raises, its
  /// blocks are not reported, and it is released once every transfer is terminal.
  /// Its pending transfers are cancelled through the cancel function, if the tracker has one.
  void abort_request(request_id id) {
    not_from_submit("abort_request");
    request_entry& r = requests_[lookup(id, "abort_request")];
    r.aborted = true;
    r.sealed = true;
    cancel_pending(r);
  }

  // --- Questions ---

  /// The request's verdict at `now`; throws std::out_of_range for an id not tracked.
  /// Never blocks, never drives progress, changes nothing. Unsealed: pending. Raises transfer_error for
  /// a hybrid request that failed or timed out (unless aborted).
  [[nodiscard]] request_verdict verdict(request_id id, clock::time_point now = clock::now()) const {
    const request_entry& r = requests_[lookup(id, "verdict")];
    const assessment a = assess(r, now);
    raise_if_hybrid(r, a);
    return a.verdict;
  }

  /// The step's transfers of `layer`, across every request (empty if none).
  [[nodiscard]] std::span<const transfer> layer_transfers(std::size_t layer) const noexcept {
    if (layer >= step_layers_.size()) return {};
    return step_layers_[layer];
  }

  /// Blocks until the layer's verdict (failed as soon as any member fails), or the deadline.
  template <class Rep, class Period>
  [[nodiscard]] batch_result wait_layer(std::size_t layer,
                                        std::chrono::duration<Rep, Period> timeout) const {
    return wait_all(layer_transfers(layer), timeout);
  }

  /// wait_layer, awaited: the layer's verdict without blocking the engine thread.
  /// co_await tracker.when_layer(L, deadline): the same, on the awaiting coroutine's scheduler. Add
  /// nothing to the layer while it is awaited, and let the wait end before the step after the next
  /// one begins (see begin_step).
  template <class Rep, class Period>
  [[nodiscard]] when_all_awaitable when_layer(std::size_t layer,
                                              std::chrono::duration<Rep, Period> timeout) const {
    return when_all(layer_transfers(layer), timeout);
  }

  /// The step barrier: waits until every transfer added in this step is terminal, failures
  /// included, or the one deadline passes (for engines that cannot wait inside a captured graph).
  template <class Rep, class Period>
  [[nodiscard]] batch_result drain_step(std::chrono::duration<Rep, Period> timeout) const {
    const detail::timeout t = detail::make_timeout(timeout);
    const bool forever = t.is_forever();
    const auto deadline = t.is_bounded() ? t.deadline() : clock::now();
    batch_result total;
    std::uint64_t first_sequence = 0;
    std::size_t base = 0;
    for (const auto& layer : step_layers_) {
      const auto left = forever ? std::chrono::nanoseconds(-1)
                                : std::max(std::chrono::nanoseconds::zero(),
                                           std::chrono::duration_cast<std::chrono::nanoseconds>(
                                               deadline - clock::now()));
      const batch_result r = drain(layer, left);
      total.pending += r.pending;
      if (r.first_failed) {
        const std::uint64_t seq = sequence_of(layer[*r.first_failed]);
        if (!total.first_failed || seq < first_sequence) {
          total.first_failed = base + *r.first_failed;
          total.error = r.error;
          first_sequence = seq;
        }
      }
      base += layer.size();
    }
    total.verdict = total.first_failed ? verdict::failed
                    : total.pending != 0 ? verdict::timed_out
                                         : verdict::success;
    return total;
  }

  /// Hands back every sealed request whose transfers are all terminal, firing its release exactly
  /// once, and stops tracking it. Raises transfer_error, changing nothing, if a hybrid request has
  /// failed or timed out and has not been aborted. If a release throws, the others are still sent and
  /// the exception propagates; the next call hands back the requests this one let go of.
  [[nodiscard]] std::vector<finished_request> take_finished(clock::time_point now = clock::now()) {
    not_from_submit("take_finished");
    // First look at everything, so that a raise leaves the tracker exactly as it was.
    finished_scratch_.clear();
    timed_out_scratch_.clear();
    for (std::uint32_t slot = 0; slot < requests_.size(); ++slot) {
      const request_entry& r = requests_[slot];
      if (!r.live || !r.sealed) continue;
      const assessment a = assess(r, now);
      raise_if_hybrid(r, a);
      if (a.pending == 0) finished_scratch_.push_back({slot, a});
      if (a.verdict == request_verdict::timed_out) timed_out_scratch_.push_back(slot);
    }
    // Nothing raised: timed-out requests' pending transfers are asked to end (each once), so that
    // they are let go of, and their blocks reported, once their backend has ended them (a later
    // call hands them back). A cancel that throws is rethrown after the releases below.
    std::exception_ptr cancel_error;
    for (const std::uint32_t slot : timed_out_scratch_) {
      try {
        cancel_pending(requests_[slot]);
      } catch (...) {
        if (!cancel_error) cancel_error = std::current_exception();
      }
    }
    // Requests let go of by a call whose release threw come first: that call returned nothing.
    std::vector<finished_request> out = std::move(not_handed_back_);
    not_handed_back_.clear();
    const std::size_t released_before = out.size();
    out.reserve(released_before + finished_scratch_.size());
    for (const auto& [slot, a] : finished_scratch_) {
      request_entry& r = requests_[slot];
      if (!r.options.hybrid && !r.aborted) collect_failed_blocks(r, unclaimed_blocks_);
      finished_request f{r.id, a.verdict, a.first_failed, a.error, r.aborted};
      r.live = false;
      index_.erase(r.id);
      free_slots_.push_back(slot);
      out.push_back(f);
    }
    // Every release is sent even if one of them throws; the first exception then propagates, and
    // the requests this call let go of are handed back by the next call instead.
    std::exception_ptr first_error;
    for (std::size_t i = released_before; release_ && i < out.size(); ++i) {
      try {
        release_(out[i].id, out[i].verdict);
      } catch (...) {
        if (!first_error) first_error = std::current_exception();
      }
    }
    if (!first_error) first_error = cancel_error;
    if (first_error) {
      not_handed_back_ = std::move(out);
      std::rethrow_exception(first_error);
    }
    return out;
  }

  /// Destination blocks whose load failed (or was cancelled), each reported once, and only once no
  /// transfer of the request writes them any more: the request is sealed (until then another
  /// transfer may still be added for the block) and every transfer writing the block is terminal.
  /// Hybrid and aborted requests report none.
  [[nodiscard]] std::vector<block_id> drain_failed_blocks() {
    not_from_submit("drain_failed_blocks");
    std::vector<block_id> out = std::move(unclaimed_blocks_);
    unclaimed_blocks_.clear();
    for (request_entry& r : requests_) {
      if (r.live && r.sealed && !r.options.hybrid && !r.aborted) collect_failed_blocks(r, out);
    }
    return out;
  }

  /// How many requests the tracker holds (added, not yet handed back by take_finished).
  [[nodiscard]] std::size_t tracked() const noexcept { return index_.size(); }
  /// True while request `id` is tracked.
  [[nodiscard]] bool tracks(request_id id) const noexcept { return index_.contains(id); }

 private:
  struct member {
    transfer t;
    std::uint32_t layer;
    std::uint32_t blocks_begin;
    std::uint32_t blocks_end;
    bool reported;
    bool cancel_asked;  // handed to cancel_ once
  };

  struct request_entry {
    request_id id = 0;
    request_options options;
    clock::time_point created;
    bool live = false;
    bool sealed = false;
    bool aborted = false;
    std::uint64_t generation = 0;
    std::vector<member> members;
    std::vector<block_id> blocks;
    std::vector<block_id> reported_blocks;
  };

  struct assessment {
    request_verdict verdict = request_verdict::pending;
    std::size_t pending = 0;
    std::optional<std::size_t> first_failed;
    std::error_code error;
    std::optional<std::size_t> first_pending;
  };

  [[nodiscard]] bool gone_or_aborted(request_handle h) const noexcept {
    return h.slot_ >= requests_.size() || !requests_[h.slot_].live ||
           requests_[h.slot_].generation != h.generation_ || requests_[h.slot_].aborted;
  }

  // Now + admission_timeout, never past created + abort_timeout (saturating).
  static clock::time_point admission_deadline(const request_entry& r) noexcept {
    const clock::time_point now = clock::now();
    const auto admit = std::chrono::duration_cast<clock::duration>(r.options.admission_timeout);
    const auto left = std::chrono::duration_cast<clock::duration>(r.options.abort_timeout);
    const clock::time_point admitted = now > clock::time_point::max() - admit ? clock::time_point::max()
                                                                               : now + admit;
    const clock::time_point abort =
        r.created > clock::time_point::max() - left ? clock::time_point::max() : r.created + left;
    return std::min(admitted, abort);
  }

  // Hands every pending transfer of `r` not handed over yet to cancel_, each once. The cancel
  // function must leave the tracker alone (it runs under the same guard as post()'s submit). If it
  // throws, the others are still asked and the first exception propagates.
  void cancel_pending(request_entry& r) {
    if (!cancel_) return;
    std::exception_ptr first_error;
    {
      const submitting in_cancel(submitting_);
      for (member& m : r.members) {
        if (m.cancel_asked || m.t.state() != transfer_state::pending) continue;
        m.cancel_asked = true;
        try {
          cancel_(m.t);
        } catch (...) {
          if (!first_error) first_error = std::current_exception();
        }
      }
    }
    if (first_error) std::rethrow_exception(first_error);
  }

  // The checks and allocations of registering one transfer, so that commit() cannot fail.
  request_entry& make_room(request_handle h, std::size_t layer, std::size_t blocks,
                           const char* what) {
    request_entry& r = open_entry(h, what);
    if (layer >= max_layers) {
      throw std::out_of_range(std::string("ferry::kv::load_tracker::") + what + ": layer " +
                              std::to_string(layer) +
                              " is beyond the largest supported layer index " +
                              std::to_string(max_layers - 1));
    }
    if (r.blocks.size() + blocks > UINT32_MAX) {
      throw std::length_error(std::string("ferry::kv::load_tracker::") + what + ": request " +
                              std::to_string(r.id) + " would write more than 2^32 - 1 blocks");
    }
    if (layer >= step_layers_.size()) step_layers_.resize(layer + 1);
    reserve_more(step_layers_[layer], 1);
    reserve_more(r.members, 1);
    reserve_more(r.blocks, blocks);
    return r;
  }

  void commit(request_entry& r, std::size_t layer, transfer t,
              std::span<const block_id> destination) noexcept {
    step_layers_[layer].push_back(t);
    const auto begin = static_cast<std::uint32_t>(r.blocks.size());
    r.blocks.insert(r.blocks.end(), destination.begin(), destination.end());
    r.members.push_back(member{std::move(t), static_cast<std::uint32_t>(layer), begin,
                               static_cast<std::uint32_t>(r.blocks.size()), false, false});
  }

  // Capacity for `n` more, growing geometrically.
  template <class T>
  static void reserve_more(std::vector<T>& v, std::size_t n) {
    if (v.capacity() - v.size() >= n) return;
    v.reserve(std::max(v.size() + n, 2 * v.capacity()));
  }

  static std::uint64_t sequence_of(const transfer& t) noexcept {
    return t.status() == nullptr ? 0 : t.status()->event().sequence;
  }

  // Failure wins over timeout and pending; all done is success whatever the age; a timeout needs an
  // age strictly greater than the limit.
  static assessment assess(const request_entry& r, clock::time_point now) noexcept {
    assessment a;
    if (!r.sealed) {
      a.pending = 1;  // never finished, never done
      return a;
    }
    if (r.members.empty()) {
      a.verdict = request_verdict::failed;
      a.error = make_error_code(kv::errc::empty_request);
      return a;
    }
    std::uint64_t first_sequence = 0;
    for (std::size_t i = 0; i < r.members.size(); ++i) {
      const transfer& t = r.members[i].t;
      const transfer_state s = t.state();
      if (s == transfer_state::success) continue;
      if (s == transfer_state::pending) {
        if (a.pending++ == 0) a.first_pending = i;
        continue;
      }
      const std::uint64_t seq = sequence_of(t);
      if (!a.first_failed || seq < first_sequence) {
        a.first_failed = i;
        a.error = t.error();
        first_sequence = seq;
      }
    }
    if (a.first_failed) {
      a.verdict = request_verdict::failed;
    } else if (a.pending == 0) {
      a.verdict = request_verdict::success;
    } else if (now - r.created > r.options.abort_timeout) {
      a.verdict = request_verdict::timed_out;
    }
    return a;
  }

  static void raise_if_hybrid(const request_entry& r, const assessment& a) {
    if (!r.options.hybrid || r.aborted) return;
    if (a.verdict == request_verdict::failed) {
      const std::size_t m = a.first_failed.value_or(0);
      throw transfer_error(r.id, m, r.members.empty() ? 0 : r.members[m].layer, a.error, false);
    }
    if (a.verdict == request_verdict::timed_out) {
      const std::size_t m = a.first_pending.value_or(0);
      throw transfer_error(r.id, m, r.members[m].layer, {}, true);
    }
  }

  // A block is reported once per request, and only when no transfer of the request that writes
  // it is still pending (two transfers may share a block).
  static void collect_failed_blocks(request_entry& r, std::vector<block_id>& out) {
    for (member& m : r.members) {
      if (m.reported) continue;
      const transfer_state s = m.t.state();
      if (s == transfer_state::success || s == transfer_state::pending) continue;
      bool still_written = false;
      for (std::uint32_t b = m.blocks_begin; b < m.blocks_end && !still_written; ++b) {
        still_written = written_by_pending(r, r.blocks[b]);
      }
      if (still_written) continue;  // looked at again by a later drain
      m.reported = true;
      for (std::uint32_t b = m.blocks_begin; b < m.blocks_end; ++b) {
        const block_id id = r.blocks[b];
        if (std::find(r.reported_blocks.begin(), r.reported_blocks.end(), id) !=
            r.reported_blocks.end()) {
          continue;
        }
        r.reported_blocks.push_back(id);
        out.push_back(id);
      }
    }
  }

  static bool written_by_pending(const request_entry& r, block_id id) noexcept {
    for (const member& m : r.members) {
      if (m.t.state() != transfer_state::pending) continue;
      for (std::uint32_t b = m.blocks_begin; b < m.blocks_end; ++b) {
        if (r.blocks[b] == id) return true;
      }
    }
    return false;
  }

  std::uint32_t lookup(request_id id, const char* what) const {
    const auto it = index_.find(id);
    if (it == index_.end()) {
      throw std::out_of_range(std::string("ferry::kv::load_tracker::") + what + ": request " +
                              std::to_string(id) + " is not tracked");
    }
    return it->second;
  }

  request_entry& entry(request_handle h, const char* what) {
    if (h.slot_ >= requests_.size() || !requests_[h.slot_].live ||
        requests_[h.slot_].generation != h.generation_) {
      throw std::out_of_range(std::string("ferry::kv::load_tracker::") + what + ": request " +
                              std::to_string(h.id_) + " is not tracked (finished or never added)");
    }
    return requests_[h.slot_];
  }

  // Set while post() runs the user's submit, or a cancel function runs, either of which must leave
  // the tracker alone: post() holds a reference into it, and room made for the transfer it
  // registers next; take_finished is part-way through its scratch lists.
  struct submitting {
    bool& flag;
    explicit submitting(bool& f) noexcept : flag(f) { flag = true; }
    ~submitting() { flag = false; }
    submitting(const submitting&) = delete;
    submitting& operator=(const submitting&) = delete;
  };

  void not_from_submit(const char* what) const {
    if (submitting_) {
      throw std::logic_error(std::string("ferry::kv::load_tracker::") + what +
                             ": called from inside post()'s submit function or the cancel "
                             "function, which must not change the tracker");
    }
  }

  request_entry& open_entry(request_handle h, const char* what) {
    not_from_submit(what);
    request_entry& r = entry(h, what);
    if (r.sealed) {
      throw std::logic_error(std::string("ferry::kv::load_tracker::") + what + ": request " +
                             std::to_string(h.id_) +
                             " is sealed (or aborted); every transfer must be added before seal()");
    }
    return r;
  }

  release_fn release_;
  cancel_fn cancel_;
  std::vector<request_entry> requests_;
  std::vector<std::uint32_t> free_slots_;
  std::unordered_map<request_id, std::uint32_t> index_;
  std::vector<std::vector<transfer>> step_layers_;
  std::vector<std::vector<transfer>> previous_layers_;  // kept one more step for waits finishing
  std::uint64_t generations_ = 0;
  std::vector<block_id> unclaimed_blocks_;  // from requests finished before their blocks were drained
  std::vector<std::pair<std::uint32_t, assessment>> finished_scratch_;
  std::vector<std::uint32_t> timed_out_scratch_;
  std::vector<finished_request> not_handed_back_;  // let go of by a take_finished whose release threw
  bool submitting_ = false;
};

}  // namespace ferry::kv

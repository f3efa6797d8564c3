#pragma once
// A decorator that stands between any backend's transfers and their callers, for tests and soak runs.
// wrap(inner) returns an outer transfer that ends only after `inner` has ended, so the buffer under a
// wrapped transfer is always quiescent when the caller hears about it; what the caller hears is the
// injector's choice, drawn from a seeded generator in submission order:
//   - failure: the outer transfer fails with profile.error, although the data moved;
//   - hang: the outer transfer never completes (a lost completion) until release_hung() or until the
//     injector is destroyed, when it fails as errc::abandoned;
//   - delay: the outer transfer completes up to max_delay after the inner one;
//   - otherwise it forwards the inner result. With reorder_window > 1, forwarded and failed results
//     are held and released in shuffled batches, so completions arrive out of submission order.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <system_error>
#include <utility>
#include <vector>

#include "ferry/detail/status_block.hpp"
#include "ferry/detail/timer_service.hpp"
#include "ferry/errors.hpp"
#include "ferry/testing/errors.hpp"
#include "ferry/progress_executor.hpp"
#include "ferry/transfer.hpp"

namespace ferry {

/// What a fault_injector does to the transfers it wraps, drawn per transfer from `seed`.
/// The three rates each lie in [0, 1] and sum to at most 1; the rest are forwarded.
struct fault_profile {
  double failure_rate = 0.0;  ///< share that fail with `error`, although the data moved
  double hang_rate = 0.0;  ///< share that never complete, until release_hung() (a lost completion)
  double delay_rate = 0.0;  ///< share that complete up to max_delay after their inner transfer
  std::chrono::nanoseconds max_delay{0};  ///< the longest delay
  /// With more than 1, forwarded and failed results are held and released in shuffled batches of
  /// this many, so that completions arrive out of submission order.
  std::size_t reorder_window = 0;
  /// A partial reorder window is released once it has waited this long.
  std::chrono::nanoseconds reorder_hold = std::chrono::milliseconds(1);
  std::error_code error = make_error_code(testing::errc::injected_fault);  ///< what failures say
  std::uint64_t seed = 1;  ///< the same seed gives the same choices, in submission order
};

/// What a fault_injector has done so far (fault_injector::counters()).
struct fault_counters {
  std::uint64_t wrapped = 0;  ///< transfers wrapped
  std::uint64_t failed = 0;  ///< outer transfers failed on purpose
  std::uint64_t hung = 0;  ///< outer transfers held back as lost
  std::uint64_t delayed = 0;  ///< outer transfers delayed
  std::uint64_t forwarded = 0;  ///< outer transfers given their inner result
};

/// Stands between any backend's transfers and their callers, failing, delaying, reordering or
/// losing their completions as its fault_profile says.
///
/// wrap(inner) returns an outer transfer that ends only after `inner` has ended, so the buffer under
/// it is quiescent when the caller hears about it. Polled by the executor it was given.
class fault_injector {
  enum class fate : std::uint8_t { forward, fail, hang, delay };

  struct core;

  // One wrapped transfer. Owned by the injector's lists once its inner transfer has ended; before
  // that, owned by the inner status's waiter list (it is linked there).
  struct record : detail::waiter {
    transfer inner;
    completer outer;
    fate chosen = fate::forward;
    std::chrono::nanoseconds delay{0};
    detail::clock::time_point due{};
    std::shared_ptr<core> shared;
  };

  // What an inner completion touches. Shared with the records, so that a completion that arrives
  // after the injector is gone still finds a live mutex and learns that it must finish alone.
  struct core {
    explicit core(progress_executor& e) : exec(&e) {}
    std::mutex mutex;
    bool closed = false;
    progress_executor* exec;
    std::vector<record*> arrived;
  };

 public:
  /// Registers with `exec`, which must outlive the injector. Throws std::invalid_argument for rates
  /// outside [0, 1] or summing past 1, and for a negative max_delay or reorder_hold.
  fault_injector(progress_executor& exec, fault_profile profile)
      : exec_(exec), profile_(std::move(profile)), core_(std::make_shared<core>(exec)),
        rng_(profile_.seed) {
    const auto rate_ok = [](double r) { return r >= 0.0 && r <= 1.0; };
    if (!rate_ok(profile_.failure_rate) || !rate_ok(profile_.hang_rate) ||
        !rate_ok(profile_.delay_rate) ||
        profile_.failure_rate + profile_.hang_rate + profile_.delay_rate > 1.0) {
      throw std::invalid_argument(
          "ferry::fault_profile: failure_rate, hang_rate and delay_rate must each lie in [0, 1] "
          "and sum to at most 1");
    }
    if (profile_.max_delay < std::chrono::nanoseconds::zero() ||
        profile_.reorder_hold < std::chrono::nanoseconds::zero()) {
      throw std::invalid_argument("ferry::fault_profile: max_delay and reorder_hold must not be negative");
    }
    timer_.fire = [](detail::timer_node*) noexcept {};  // firing only keeps the executor awake
    exec_.add_source(*this);
  }

  fault_injector(const fault_injector&) = delete;
  fault_injector& operator=(const fault_injector&) = delete;

  /// Results already known are delivered; hung transfers fail as errc::abandoned; transfers whose inner
  /// transfer is still running complete when it does, without the injector.
  ~fault_injector() {
    exec_.remove_source(*this);
    if (!exec_.timers().cancel(timer_)) exec_.sync();
    std::vector<record*> arrived;
    {
      std::lock_guard lock(core_->mutex);
      core_->closed = true;
      arrived.swap(core_->arrived);
    }
    for (record* r : arrived) {
      if (r->chosen == fate::hang) {
        delete r;
      } else {
        finish(r, r->chosen == fate::fail ? fate::fail : fate::forward);
      }
    }
    for (record* r : delayed_) finish(r, fate::forward);
    for (record* r : reorder_) finish(r, r->chosen);
    for (record* r : hung_) delete r;  // the outer completer goes: failed, errc::abandoned
  }

  /// The outer transfer for `inner`, whose fate is drawn now. Throws std::bad_alloc.
  [[nodiscard]] transfer wrap(transfer inner) {
    auto [outer_transfer, outer_completer] = make_manual_transfer();
    auto r = std::make_unique<record>();
    r->inner = std::move(inner);
    r->outer = std::move(outer_completer);
    r->shared = core_;
    r->notify = &on_inner_done;
    {
      std::lock_guard lock(choice_mutex_);
      const double u = uniform();
      if (u < profile_.failure_rate) {
        r->chosen = fate::fail;
      } else if (u < profile_.failure_rate + profile_.hang_rate) {
        r->chosen = fate::hang;
      } else if (u < profile_.failure_rate + profile_.hang_rate + profile_.delay_rate) {
        r->chosen = fate::delay;
        r->delay = std::chrono::nanoseconds(
            static_cast<std::int64_t>(uniform() * static_cast<double>(profile_.max_delay.count())));
      }
      ++counters_.wrapped;
    }
    record* raw = r.release();
    detail::status_block* s = raw->inner.status();
    if (s == nullptr || !s->add_waiter(raw)) arrive(raw);
    return std::move(outer_transfer);
  }

  /// Completes every hung transfer with its inner result; returns how many there were.
  std::size_t release_hung() {
    std::vector<record*> released;
    {
      std::lock_guard lock(lists_mutex_);
      released.swap(hung_);
    }
    for (record* r : released) {
      r->chosen = fate::forward;
      arrive(r);
    }
    return released.size();
  }

  /// What the injector has done so far; any thread.
  [[nodiscard]] fault_counters counters() const {
    std::lock_guard lock(choice_mutex_);
    return counters_;
  }

  /// Delivers the results that are due; returns how many outer transfers it completed
  /// (completion_source). Called by the executor only.
  std::size_t poll(std::size_t budget) noexcept {
    std::vector<record*> batch;
    {
      std::lock_guard lock(core_->mutex);
      if (core_->arrived.empty() && delayed_.empty() && reorder_.empty()) return 0;
      batch.swap(core_->arrived);
    }
    const auto now = detail::clock::now();
    std::size_t handled = 0;
    for (record* r : batch) handled += route(r, now);
    handled += release_due(now, budget);
    rearm(now);
    return handled;
  }

 private:
  static void on_inner_done(detail::waiter* w, const detail::completion_event&) noexcept {
    auto* r = static_cast<record*>(w);
    core& c = *r->shared;
    std::unique_lock lock(c.mutex);
    if (c.closed) {
      lock.unlock();
      // The injector is gone: deliver the inner result as if nothing had been injected.
      const transfer_state s = r->inner.state();
      r->outer.complete(s, r->inner.error());
      delete r;
      return;
    }
    c.arrived.push_back(r);
    // Still under the lock: a closed injector may be followed by a destroyed executor.
    c.exec->notify();
  }

  void arrive(record* r) {
    std::lock_guard lock(core_->mutex);
    core_->arrived.push_back(r);
    core_->exec->notify();
  }

  // Returns 1 when the record's outer transfer was completed now.
  std::size_t route(record* r, detail::clock::time_point now) noexcept {
    switch (r->chosen) {
      case fate::hang: {
        std::lock_guard lock(lists_mutex_);
        hung_.push_back(r);
        count(&fault_counters::hung);
        return 0;
      }
      case fate::delay:
        r->due = now + r->delay;
        delayed_.push_back(r);
        std::push_heap(delayed_.begin(), delayed_.end(), later_due);
        count(&fault_counters::delayed);
        return 0;
      case fate::forward:
      case fate::fail:
        if (profile_.reorder_window > 1) {
          if (reorder_.empty()) reorder_started_ = now;
          reorder_.push_back(r);
          return 0;
        }
        finish(r, r->chosen);
        return 1;
    }
    return 0;
  }

  std::size_t release_due(detail::clock::time_point now, std::size_t budget) noexcept {
    std::size_t released = 0;
    while (!delayed_.empty() && delayed_.front()->due <= now && released < budget) {
      std::pop_heap(delayed_.begin(), delayed_.end(), later_due);
      finish(delayed_.back(), fate::forward);
      delayed_.pop_back();
      ++released;
    }
    if (!reorder_.empty() && (reorder_.size() >= profile_.reorder_window ||
                              now - reorder_started_ >= profile_.reorder_hold)) {
      for (std::size_t i = reorder_.size(); i > 1; --i) {
        std::swap(reorder_[i - 1], reorder_[next_random(shuffle_rng_) % i]);
      }
      for (record* r : reorder_) finish(r, r->chosen);
      released += reorder_.size();
      reorder_.clear();
    }
    return released;
  }

  // Keeps one executor timer armed at the next moment a held result becomes due, so that a parked
  // executor wakes up for it.
  void rearm(detail::clock::time_point now) noexcept {
    detail::clock::time_point next = detail::clock::time_point::max();
    if (!delayed_.empty()) next = delayed_.front()->due;
    if (!reorder_.empty()) next = std::min(next, reorder_started_ + profile_.reorder_hold);
    if (next == detail::clock::time_point::max()) return;
    if (exec_.timers().cancel(timer_) && timer_.deadline <= next) {
      exec_.timers().arm(timer_);  // the earlier one still stands
      return;
    }
    timer_.deadline = std::max(next, now);
    try {
      exec_.timers().arm(timer_);
    } catch (...) {
      // No memory for the timer heap: the next poll round re-tries; while any work is in flight the
      // executor keeps polling.
    }
  }

  void finish(record* r, fate f) noexcept {
    // Counted first, so that whoever sees the outer transfer end also sees the count.
    if (f == fate::fail) {
      count(&fault_counters::failed);
      r->outer.fail(profile_.error);
    } else {
      count(&fault_counters::forwarded);
      r->outer.complete(r->inner.state(), r->inner.error());
    }
    delete r;
  }

  void count(std::uint64_t fault_counters::*field) noexcept {
    std::lock_guard lock(choice_mutex_);
    ++(counters_.*field);
  }

  static bool later_due(const record* a, const record* b) noexcept { return a->due > b->due; }

  static std::uint64_t next_random(std::uint64_t& state) noexcept {
    // splitmix64: a fixed, portable sequence for a given seed.
    std::uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }

  double uniform() noexcept { return static_cast<double>(next_random(rng_) >> 11) * 0x1.0p-53; }

  progress_executor& exec_;
  fault_profile profile_;
  std::shared_ptr<core> core_;
  mutable std::mutex choice_mutex_;  // rng_ and counters_
  std::uint64_t rng_;
  fault_counters counters_;
  std::mutex lists_mutex_;  // hung_ (release_hung runs on any thread)
  std::vector<record*> hung_;
  // The executor thread's alone:
  std::vector<record*> delayed_;
  std::vector<record*> reorder_;
  detail::clock::time_point reorder_started_{};
  std::uint64_t shuffle_rng_ = profile_.seed ^ 0x5bd1e995ULL;
  detail::timer_node timer_;
};

}  // namespace ferry

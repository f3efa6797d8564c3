#pragma once
// The progress executor: one dedicated thread that polls every completion source registered with it
// and fires deadline timers. Engine threads submit and never poll.
//
// Parking follows seastar: when idle past its spin budget the thread announces that it parks, polls
// every source once more (arming those that need it), and only then sleeps in epoll on an eventfd and
// the sources' descriptors. A submitter that queued work calls notify(), which costs one fence and one
// load unless the thread has announced sleep; only then does it write the eventfd. While a source
// has I/O in flight that will soon complete (in_flight()), adaptive mode's spin budget is the longer
// in_flight_spin: completions due within a few hundred microseconds are met awake.
//
// An idle spin (adaptive mode's spin budgets, or a source that only polling serves) offers the CPU
// once, a few microseconds in (detail::idle_spin says why once): a thread woken onto the
// executor's CPU runs then rather than after the spin. Busy mode does not: it is for a core given
// to the executor alone.

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <system_error>
#include <thread>
#include <vector>

#include <pthread.h>
#include <sched.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include "ferry/completion_source.hpp"
#include "ferry/detail/full_barrier.hpp"
#include "ferry/detail/futex.hpp"
#include "ferry/detail/spin.hpp"
#include "ferry/detail/timer_service.hpp"

namespace ferry {

/// How the progress executor's thread waits when a round finds nothing to do.
enum class progress_mode {
  busy,      ///< spins forever: lowest latency, one core
  adaptive,  ///< spins for spin_budget after the last work (in_flight_spin while I/O is out), then
             ///< parks
  park,      ///< parks as soon as a round finds nothing
};

/// How a progress_executor polls, spins and parks; checked by its constructor.
struct executor_options {
  progress_mode mode = progress_mode::adaptive;  ///< how the thread waits when idle
  /// Adaptive mode: how long the thread spins after the last completion or wake-up before it parks.
  std::chrono::nanoseconds spin_budget = std::chrono::microseconds(50);
  /// Adaptive mode, while a source says it has I/O in flight (in_flight(); for a ring, anything but
  /// socket receives): spin this long after the last completion or wake-up instead. Disk reads
  /// complete within the device's latency, often in bursts a few hundred microseconds apart, and a
  /// parked thread takes tens of microseconds to wake on a loaded or virtual machine: every burst
  /// would wait for that before its reads are replaced. Costs a CPU while such I/O flows, and up to
  /// this long after each completion while an operation that waits on a peer is out (a send to a
  /// peer that does not read, a pipe read). Set it to spin_budget (or 0) to spin no longer than that.
  std::chrono::nanoseconds in_flight_spin = std::chrono::microseconds(500);
  std::size_t poll_budget = 256;  ///< completions one source may handle per round
  int cpu = -1;                   ///< pin the thread to this CPU; -1 leaves it unpinned
};

/// What a progress_executor has done since it started (counters(); each figure read relaxed).
struct executor_counters {
  std::uint64_t completions = 0;   ///< sum of what poll() reported
  std::uint64_t rounds = 0;        ///< loop iterations
  std::uint64_t parks = 0;         ///< times the thread slept
  std::uint64_t wakeups = 0;       ///< eventfd writes by notify()
  std::uint64_t timers_fired = 0;  ///< deadline timers fired (when_all deadlines, backends' timers)
};

/// The dedicated thread that polls every registered completion source and fires deadline timers.
///
/// Engine threads submit and never poll. Backends register with add_source and must all be
/// destroyed before their executor (the process aborts otherwise). See executor_options for its
/// modes.
class progress_executor {
 public:
  /// Starts the thread with the default options (adaptive mode).
  progress_executor() : progress_executor(executor_options{}) {}

  /// Starts the thread. Throws std::invalid_argument for a zero poll_budget or a negative spin,
  /// std::system_error when the eventfd or epoll instance cannot be made.
  explicit progress_executor(executor_options options)
      : options_(options), timers_(&kick_timers, this) {
    if (options_.poll_budget == 0) {
      throw std::invalid_argument("ferry::executor_options::poll_budget must be at least 1");
    }
    if (options_.spin_budget < std::chrono::nanoseconds::zero()) {
      throw std::invalid_argument("ferry::executor_options::spin_budget must not be negative");
    }
    if (options_.in_flight_spin < std::chrono::nanoseconds::zero()) {
      throw std::invalid_argument("ferry::executor_options::in_flight_spin must not be negative");
    }
    wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (wake_fd_ < 0) throw std::system_error(errno, std::system_category(), "ferry: eventfd");
    epoll_fd_ = ::epoll_create1(EPOLL_CLOEXEC);
    if (epoll_fd_ < 0) {
      const int err = errno;
      ::close(wake_fd_);
      throw std::system_error(err, std::system_category(), "ferry: epoll_create1");
    }
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = wake_tag;
    if (::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, &ev) != 0) {
      const int err = errno;
      close_fds();
      throw std::system_error(err, std::system_category(), "ferry: epoll_ctl(eventfd)");
    }
    thread_ = std::thread([this] { run(); });
  }

  progress_executor(const progress_executor&) = delete;
  progress_executor& operator=(const progress_executor&) = delete;

  /// Every backend must be destroyed first: a source left registered, or a when_all still armed on this
  /// executor's timers, would be used after it is freed, so that is reported and the process aborts.
  ~progress_executor() {
    {
      std::lock_guard lock(sources_mutex_);
      if (!sources_.empty()) {
        std::fprintf(stderr,
                     "ferry: progress_executor destroyed with %zu completion source(s) still "
                     "registered; destroy every backend before its executor\n",
                     sources_.size());
        std::abort();
      }
    }
    stop_.store(true, std::memory_order_release);
    wake_thread();
    thread_.join();
    if (!timers_.empty()) {
      std::fprintf(stderr,
                   "ferry: progress_executor destroyed with timers still armed (a when_all on its "
                   "timers has not finished)\n");
      std::abort();
    }
    close_fds();
  }

  /// Starts polling `source` (and parking on its descriptor, if it has one). `source` must stay
  /// valid until remove_source returns.
  template <completion_source S>
  void add_source(S& source) {
    source_entry e;
    e.object = &source;
    e.poll = [](void* o, std::size_t budget) -> std::size_t {
      return static_cast<std::size_t>(static_cast<S*>(o)->poll(budget));
    };
    if constexpr (armable_source<S>) {
      e.arm = [](void* o) -> bool { return static_cast<S*>(o)->arm(); };
    }
    if constexpr (busy_source<S>) {
      e.busy = [](const void* o) -> bool { return static_cast<const S*>(o)->busy(); };
    }
    if constexpr (in_flight_source<S>) {
      e.in_flight = [](const void* o) -> bool { return static_cast<const S*>(o)->in_flight(); };
    }
    if constexpr (parkable_source<S>) e.fd = static_cast<int>(source.park_fd());
    if (e.fd >= 0) {
      epoll_event ev{};
      ev.events = EPOLLIN;
      ev.data.u64 = source_tag;
      if (::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, e.fd, &ev) != 0) {
        throw std::system_error(errno, std::system_category(),
                                "ferry: epoll_ctl(ADD) for a completion source's descriptor");
      }
    }
    {
      std::lock_guard lock(sources_mutex_);
      sources_.push_back(e);
      generation_.fetch_add(1, std::memory_order_seq_cst);
    }
    notify();
  }

  /// After this returns, the executor never calls `source` again (not even from a round that was
  /// already running when it was called). Must not be called on the executor's own thread: a
  /// continuation resumed inline there may be running inside `source`'s own poll(), which would go
  /// on using it once it is gone. That is reported and the process aborts.
  template <completion_source S>
  void remove_source(S& source) noexcept {
    if (on_executor_thread()) {
      std::fprintf(stderr,
                   "ferry: a completion source (backend) was destroyed on its progress executor's "
                   "thread, from a continuation resumed inline; destroy backends from another "
                   "thread\n");
      std::abort();
    }
    int fd = -1;
    {
      std::lock_guard lock(sources_mutex_);
      for (auto it = sources_.begin(); it != sources_.end(); ++it) {
        if (it->object == &source) {
          fd = it->fd;
          sources_.erase(it);
          break;
        }
      }
      generation_.fetch_add(1, std::memory_order_seq_cst);
    }
    if (fd >= 0) ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, fd, nullptr);
    sync();
  }

  /// Work was queued for a source without a descriptor: wake the thread if, and only if, it parks.
  void notify() noexcept {
    // Pairs with the fence in park(): either the parking thread's last poll sees the work queued
    // before this fence, or this load sees that it announced sleep.
    detail::full_barrier();
    if (parked_.load(std::memory_order_relaxed) &&
        parked_.exchange(false, std::memory_order_acq_rel)) {
      wakeups_.fetch_add(1, std::memory_order_relaxed);
      wake_thread();
    }
  }

  /// Returns once a round that started after this call has begun, so every round that could have seen
  /// an earlier state (a removed source, a cancelled timer) is over.
  void sync() noexcept {
    if (on_executor_thread()) return;
    const std::uint64_t seen = rounds_.load(std::memory_order_seq_cst);
    while (rounds_.load(std::memory_order_acquire) <= seen) {
      if (stopped_.load(std::memory_order_acquire)) return;
      wake_thread();
      std::this_thread::yield();
    }
  }

  /// True when called on the executor's own thread (from a continuation resumed inline).
  [[nodiscard]] bool on_executor_thread() const noexcept {
    return std::this_thread::get_id() == thread_id_.load(std::memory_order_acquire);
  }

  /// What the executor has done so far; any thread.
  [[nodiscard]] executor_counters counters() const noexcept {
    executor_counters c;
    c.completions = completions_.load(std::memory_order_relaxed);
    c.rounds = rounds_.load(std::memory_order_relaxed);
    c.parks = parks_.load(std::memory_order_relaxed);
    c.wakeups = wakeups_.load(std::memory_order_relaxed);
    c.timers_fired = timers_fired_.load(std::memory_order_relaxed);
    return c;
  }

  /// The options the executor was made with.
  [[nodiscard]] const executor_options& options() const noexcept { return options_; }

  /// The executor's deadline timers, fired on its thread between polls (for backends and when_all).
  [[nodiscard]] detail::timer_service& timers() noexcept { return timers_; }

 private:
  struct source_entry {
    void* object = nullptr;
    std::size_t (*poll)(void*, std::size_t) = nullptr;
    bool (*arm)(void*) = nullptr;
    bool (*busy)(const void*) = nullptr;
    bool (*in_flight)(const void*) = nullptr;
    int fd = -1;
  };

  static constexpr std::uint64_t wake_tag = 0;
  static constexpr std::uint64_t source_tag = 1;

  static void kick_timers(void* self) noexcept { static_cast<progress_executor*>(self)->notify(); }

  void wake_thread() noexcept {
    const std::uint64_t one = 1;
    [[maybe_unused]] const ssize_t n = ::write(wake_fd_, &one, sizeof one);
  }

  void close_fds() noexcept {
    if (epoll_fd_ >= 0) ::close(epoll_fd_);
    if (wake_fd_ >= 0) ::close(wake_fd_);
    epoll_fd_ = wake_fd_ = -1;
  }

  void pin() noexcept {
    if (options_.cpu < 0) return;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(static_cast<std::size_t>(options_.cpu), &set);
    ::pthread_setaffinity_np(::pthread_self(), sizeof set, &set);
  }

  void run() {
    thread_id_.store(std::this_thread::get_id(), std::memory_order_release);
    ::pthread_setname_np(::pthread_self(), "ferry-progress");
    pin();
    std::uint64_t seen_generation = ~std::uint64_t{0};
    std::uint64_t completions = 0;
    detail::clock::time_point idle_since{};
    bool idle = false;
    detail::idle_spin spin;
    std::uint64_t round = 0;
    for (;;) {
      // seq_cst store, then seq_cst load of generation_, against sync()'s seq_cst bump-then-read:
      // if sync() read an older round number, this round sees the new source list.
      rounds_.store(++round, std::memory_order_seq_cst);
      if (stop_.load(std::memory_order_acquire)) break;
      if (generation_.load(std::memory_order_seq_cst) != seen_generation) {
        std::lock_guard lock(sources_mutex_);
        round_sources_ = sources_;
        seen_generation = generation_.load(std::memory_order_relaxed);
      }
      const std::size_t handled = poll_sources();
      const std::size_t fired = fire_timers();
      if (handled != 0) {
        completions += handled;
        completions_.store(completions, std::memory_order_relaxed);
      }
      if (handled != 0 || fired != 0) {
        idle = false;
        spin.restart();
        continue;
      }
      if (options_.mode == progress_mode::busy) {
        detail::cpu_relax();
        continue;
      }
      if (any_busy()) {
        // Work is out that only polling finds: keep looking (and never announce sleep, so that
        // submitters need not wake us).
        spin.step(detail::clock::now());
        continue;
      }
      // Adaptive mode, still within in_flight_spin of the last work: while a source has I/O in
      // flight, neither stop spinning nor sleep.
      bool spin_in_flight = false;
      if (options_.mode == progress_mode::adaptive) {
        const auto now = detail::clock::now();
        if (!idle) {
          idle = true;
          idle_since = now;
        }
        const auto idle_for = now - idle_since;
        spin_in_flight = idle_for < options_.in_flight_spin;
        if (idle_for < options_.spin_budget || (spin_in_flight && any_in_flight())) {
          spin.step(now);
          continue;
        }
      }
      const std::size_t late = park(seen_generation, spin_in_flight);
      if (late != 0) {
        completions += late;
        completions_.store(completions, std::memory_order_relaxed);
      }
      idle = false;
      spin.restart();
    }
    stopped_.store(true, std::memory_order_release);
  }

  std::size_t poll_sources() {
    std::size_t handled = 0;
    for (const source_entry& e : round_sources_) handled += e.poll(e.object, options_.poll_budget);
    return handled;
  }

  // epoll_pwait2 (glibc 2.35, Linux 5.11) sleeps to the nanosecond; before it, epoll_wait's
  // milliseconds, rounded up so that a timer never fires early.
  int wait_events(epoll_event* events, const timespec* timeout) noexcept {
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 35))
    return ::epoll_pwait2(epoll_fd_, events, 8, timeout, nullptr);
#else
    int ms = -1;
    if (timeout != nullptr) {
      const std::int64_t ns = std::int64_t{timeout->tv_sec} * 1'000'000'000 + timeout->tv_nsec;
      ms = static_cast<int>(std::min<std::int64_t>((ns + 999'999) / 1'000'000, 1 << 30));
    }
    return ::epoll_wait(epoll_fd_, events, 8, ms);
#endif
  }

  [[nodiscard]] bool any_busy() const noexcept {
    for (const source_entry& e : round_sources_) {
      if (e.busy != nullptr && e.busy(e.object)) return true;
    }
    return false;
  }

  [[nodiscard]] bool any_in_flight() const noexcept {
    for (const source_entry& e : round_sources_) {
      if (e.in_flight != nullptr && e.in_flight(e.object)) return true;
    }
    return false;
  }

  std::size_t fire_timers() noexcept {
    if (timers_.empty()) return 0;
    const std::size_t fired = timers_.fire_expired(detail::clock::now());
    if (fired != 0) timers_fired_.fetch_add(fired, std::memory_order_relaxed);
    return fired;
  }

  // Gives up parking without sleeping. A submitter that found the thread announced may have claimed
  // the wake-up and written the eventfd: take that now, or the next park would end at once on it
  // (and restart the idle spin with nothing to do).
  void leave_park() noexcept {
    if (parked_.exchange(false, std::memory_order_acq_rel)) return;
    std::uint64_t drained = 0;
    [[maybe_unused]] const ssize_t r = ::read(wake_fd_, &drained, sizeof drained);
  }

  // Returns completions found by the last look before sleeping (then it does not sleep).
  // `seen_generation`: the source list round_sources_ was copied from. `spin_in_flight`: do not
  // sleep if the last look put I/O in flight (a submission taken just now); spin instead.
  std::size_t park(std::uint64_t seen_generation, bool spin_in_flight) {
    parked_.store(true, std::memory_order_relaxed);
    // Pairs with the fence in notify().
    detail::full_barrier();
    // A source added since this round began was announced by add_source's notify(), which may have
    // come before parked_ was set and so woke nobody; the last look below would miss the source's
    // work, since it polls the old list. Go round again with the new list instead of sleeping.
    if (generation_.load(std::memory_order_seq_cst) != seen_generation) {
      leave_park();
      return 0;
    }
    std::size_t late = poll_sources();
    for (const source_entry& e : round_sources_) {
      if (e.arm != nullptr && !e.arm(e.object)) ++late;
    }
    // A poll-only source handed work after this round's busy check: its notify() came before the
    // announcement and woke nobody, and the look above found the work unfinished. Nothing will
    // signal it, so keep polling. And a submission the last look took may have put I/O in flight,
    // which adaptive mode spins for.
    if (late != 0 || any_busy() || (spin_in_flight && any_in_flight()) ||
        stop_.load(std::memory_order_acquire) ||
        timers_.next_deadline() <= detail::clock::now()) {
      leave_park();
      return late;
    }
    timespec ts{};
    timespec* tsp = nullptr;
    if (!timers_.empty()) {
      const auto left = timers_.next_deadline() - detail::clock::now();
      const auto ns = std::max<std::int64_t>(
          0, std::chrono::duration_cast<std::chrono::nanoseconds>(left).count());
      ts.tv_sec = static_cast<time_t>(ns / 1'000'000'000);
      ts.tv_nsec = static_cast<long>(ns % 1'000'000'000);
      tsp = &ts;
    }
    parks_.fetch_add(1, std::memory_order_relaxed);
    epoll_event events[8];
    const int n = wait_events(events, tsp);
    parked_.store(false, std::memory_order_relaxed);
    for (int i = 0; i < n; ++i) {
      if (events[i].data.u64 == wake_tag) {
        std::uint64_t drained = 0;
        [[maybe_unused]] const ssize_t r = ::read(wake_fd_, &drained, sizeof drained);
      }
    }
    return 0;
  }

  executor_options options_;
  detail::timer_service timers_;
  int wake_fd_ = -1;
  int epoll_fd_ = -1;

  std::mutex sources_mutex_;
  std::vector<source_entry> sources_;
  std::atomic<std::uint64_t> generation_{0};
  std::vector<source_entry> round_sources_;  // the executor thread's copy

  alignas(64) std::atomic<bool> parked_{false};
  alignas(64) std::atomic<std::uint64_t> rounds_{0};
  alignas(64) std::atomic<std::uint64_t> completions_{0};
  std::atomic<std::uint64_t> parks_{0};
  std::atomic<std::uint64_t> wakeups_{0};
  std::atomic<std::uint64_t> timers_fired_{0};
  std::atomic<bool> stop_{false};
  std::atomic<bool> stopped_{false};
  std::atomic<std::thread::id> thread_id_{};
  std::thread thread_;
};

}  // namespace ferry

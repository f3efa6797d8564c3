#pragma once
// The directory interface: publish this engine's record under a name with a lease the progress
// executor keeps alive, look names up (many at once, with one deadline), watch a name or a prefix,
// withdraw. Two implementations derive from it: local_directory (directory/local.hpp, in-process,
// nothing to start) and etcd_directory (directory/etcd.hpp, etcd v3 through its JSON gateway).
//
// Threads. Every public call may be made from any thread; none blocks except get() on a pending
// result and withdraw's wait. The work runs on the executor thread: the directory is a completion
// source of its progress executor, with an inbox of calls (posted by callers) and its own timers
// (keepalives, deadlines, reconnects) behind one timer node on the executor's timer service. A
// backend's state is therefore touched by the executor thread only.
//
// Lifetimes. The directory must outlive nothing: publications and watchers hold an anchor that the
// directory clears as it goes, after which their calls fail with directory_errc::closed.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "ferry/detail/timer_service.hpp"
#include "ferry/detail/timeout.hpp"
#include "ferry/directory/errors.hpp"
#include "ferry/directory/pending.hpp"
#include "ferry/directory/record.hpp"
#include "ferry/progress_executor.hpp"
#include "ferry/transfer.hpp"

namespace ferry {

/// Limits a directory applies to what it is given and what it reads back.
struct directory_options {
  /// The largest value published or accepted from a lookup or watch (larger ones are refused with
  /// directory_errc::record_too_large).
  std::size_t max_record_bytes = default_max_record_bytes;
  /// Events a watcher buffers while nobody takes them; one more fails it with watch_overflowed.
  std::size_t max_watch_events = 4096;
};

/// How a name is published.
struct publish_options {
  /// The lease: the record goes this long after the last keepalive. The executor renews it every
  /// third of it. etcd rounds it up to whole seconds (and to its own minimum).
  std::chrono::milliseconds lease{5000};
  /// Bounds the publication itself (negative: none).
  std::chrono::nanoseconds timeout = std::chrono::seconds(10);
};

class directory;
class publication;
class watcher;

namespace detail {

// What publications and watchers reach their directory through: cleared when it goes.
struct directory_anchor {
  std::mutex mutex;
  directory* dir = nullptr;
};

// One publication's state: written on the executor, read by the handle under `mutex` or atomically.
struct publication_state {
  std::string name;
  std::uint64_t incarnation = 0;
  std::vector<std::byte> value;
  std::chrono::milliseconds lease{0};
  std::int64_t lease_id = 0;  // the backend's lease
  // Empty while the lease is held; else why not (lease_lost while it is published again,
  // unavailable while the service does not answer). Readers take the mutex.
  mutable std::mutex mutex;
  std::error_code health;
  std::uint64_t republished = 0;  // times the record was put back after its lease was lost
  bool withdrawn = false;         // executor only
  std::pair<clock::time_point, std::uint64_t> keepalive_timer{};  // executor only

  void set_health(std::error_code ec) {
    std::lock_guard lock(mutex);
    health = ec;
  }
};

// One watch: events go to a hook (internal users, called on the delivering thread, must not
// block) or to a buffer that next() takes from.
struct watch_state {
  std::string key;
  bool prefix = false;
  std::size_t max_events = 0;
  std::size_t max_record_bytes = 0;  // records larger than this are not reported
  std::function<void(const directory_event&)> hook;  // set before the watch starts, never after
  std::mutex mutex;
  std::deque<directory_event> events;
  std::error_code failure;                           // the watch ended: next() fails with it
  std::shared_ptr<result_sink<directory_event>> waiter;  // a next() waiting
  std::uint64_t waiter_id = 0;
  // The backend's (executor only): what the watch has reported, name -> incarnation.
  std::map<std::string, std::uint64_t> known;

  [[nodiscard]] bool matches(const std::string& name) const noexcept {
    return prefix ? name.compare(0, key.size(), key) == 0 : name == key;
  }

  // Any thread. Hands the event to the hook, to a waiting next(), or to the buffer. A waiting
  // next() is completed after the lock is let go: its continuation may run here (an inline
  // scheduler) and call next() again.
  void deliver(directory_event ev) {
    if (hook) return hook(ev);
    std::shared_ptr<result_sink<directory_event>> taker;
    {
      std::lock_guard lock(mutex);
      if (failure) return;
      if (waiter) {
        taker = std::exchange(waiter, nullptr);
      } else if (events.size() >= max_events) {
        events.clear();
        failure = make_error_code(directory_errc::watch_overflowed);
        return;
      } else {
        events.push_back(std::move(ev));
        return;
      }
    }
    taker->succeed(std::move(ev));
  }

  // Any thread. Ends the watch: a waiting next() and later ones fail with `ec`.
  void end(std::error_code ec, const std::string& what) {
    std::shared_ptr<result_sink<directory_event>> taker;
    std::error_code why;
    {
      std::lock_guard lock(mutex);
      if (!failure) failure = ec;
      why = failure;
      taker = std::exchange(waiter, nullptr);
    }
    if (taker) taker->fail(why, what);
  }
};

}  // namespace detail

/// A record published under a name, kept alive by the directory's executor until withdrawn.
/// Move-only; dropping it withdraws the name without waiting (withdraw() waits).
class publication {
 public:
  /// An empty handle.
  publication() = default;
  publication(const publication&) = delete;
  publication& operator=(const publication&) = delete;
  /// Takes `other`'s publication, leaving it empty.
  publication(publication&& other) noexcept = default;
  /// Withdraws its own publication (without waiting), then takes `other`'s.
  publication& operator=(publication&& other) noexcept {
    if (this != &other) {
      drop();
      state_ = std::move(other.state_);
      anchor_ = std::move(other.anchor_);
    }
    return *this;
  }
  /// Withdraws the name without waiting for the directory to confirm it.
  ~publication() { drop(); }

  /// The name it is published under.
  [[nodiscard]] const std::string& name() const { return state().name; }
  /// The incarnation the directory gave it (grows with each publication under the name).
  [[nodiscard]] std::uint64_t incarnation() const { return state().incarnation; }
  /// Empty while its lease is held; directory_errc::lease_lost while it is being published again
  /// after the lease was lost, unavailable while the directory service does not answer.
  [[nodiscard]] std::error_code health() const {
    std::lock_guard lock(state().mutex);
    return state().health;
  }
  /// How many times the record was put back after its lease was lost (etcd restarted without its
  /// data, or the lease expired while etcd was unreachable).
  [[nodiscard]] std::uint64_t republished() const {
    std::lock_guard lock(state().mutex);
    return state().republished;
  }
  /// False for an empty handle.
  explicit operator bool() const noexcept { return state_ != nullptr; }

  /// Withdraws the name: the record goes and watchers see it gone. The transfer ends once the
  /// directory has done it (or failed: unavailable, deadline_exceeded, closed).
  transfer withdraw(std::chrono::nanoseconds timeout = std::chrono::seconds(5));

 private:
  friend class directory;
  publication(std::shared_ptr<detail::publication_state> s,
              std::shared_ptr<detail::directory_anchor> a)
      : state_(std::move(s)), anchor_(std::move(a)) {}

  [[nodiscard]] const detail::publication_state& state() const {
    if (!state_) throw std::logic_error("ferry::publication: empty handle");
    return *state_;
  }
  void drop() noexcept;

  std::shared_ptr<detail::publication_state> state_;
  std::shared_ptr<detail::directory_anchor> anchor_;
};

/// A watch on a name or on every name under a prefix: next() gives each change in order.
/// Move-only; dropping it ends the watch.
class watcher {
 public:
  /// An empty handle.
  watcher() = default;
  watcher(const watcher&) = delete;
  watcher& operator=(const watcher&) = delete;
  /// Takes `other`'s watch, leaving it empty.
  watcher(watcher&&) noexcept = default;
  /// Ends its own watch and takes `other`'s.
  watcher& operator=(watcher&& other) noexcept {
    if (this != &other) {
      drop();
      state_ = std::move(other.state_);
      anchor_ = std::move(other.anchor_);
    }
    return *this;
  }
  /// Ends the watch.
  ~watcher() { drop(); }

  /// The next change, waiting up to `timeout` (negative: no deadline) for one: fails with
  /// directory_errc::deadline_exceeded when none came, watch_overflowed when more than
  /// directory_options::max_watch_events piled up untaken, closed once the directory went. One
  /// next() at a time.
  pending_result<directory_event> next(std::chrono::nanoseconds timeout);

  /// The next change if one is buffered, without waiting.
  [[nodiscard]] std::optional<directory_event> try_next() {
    if (!state_) throw std::logic_error("ferry::watcher: empty handle");
    std::lock_guard lock(state_->mutex);
    if (state_->events.empty()) return std::nullopt;
    directory_event ev = std::move(state_->events.front());
    state_->events.pop_front();
    return ev;
  }

  /// False for an empty handle.
  explicit operator bool() const noexcept { return state_ != nullptr; }

 private:
  friend class directory;
  watcher(std::shared_ptr<detail::watch_state> s, std::shared_ptr<detail::directory_anchor> a)
      : state_(std::move(s)), anchor_(std::move(a)) {}
  void drop() noexcept;

  std::shared_ptr<detail::watch_state> state_;
  std::shared_ptr<detail::directory_anchor> anchor_;
};

/// Peers by name. publish() puts this engine's record under a name with a lease the executor keeps
/// alive, each publication with an incarnation greater than any before under that name; lookup()
/// finds one name or many at once, concurrently, under one deadline; watch() reports every change
/// under a name or prefix; a publication's withdraw() (or its destructor) takes it down.
///
/// The implementations are local_directory (in-process) and etcd_directory (etcd v3). Every call
/// may be made from any thread; the work runs on the executor given at construction.
class directory {
 public:
  directory(const directory&) = delete;
  directory& operator=(const directory&) = delete;
  /// Publications and watchers left become inert (their calls fail with directory_errc::closed).
  virtual ~directory() = default;

  /// Publishes `value` under `name`. The publication's incarnation is greater than that of every
  /// earlier publication under the name. Fails with bad_name, record_too_large, unavailable,
  /// deadline_exceeded or closed, the message naming what was wrong.
  pending_result<publication> publish(std::string name, std::span<const std::byte> value,
                                      publish_options options = {}) {
    auto [pending, sink] = detail::make_result<publication>();
    auto shared = std::make_shared<detail::result_sink<publication>>(std::move(sink));
    if (std::string why = check_directory_name(name); !why.empty()) {
      shared->fail(make_error_code(directory_errc::bad_name),
                   "ferry directory: cannot publish '" + name + "': " + why);
      return std::move(pending);
    }
    if (value.size() > options_.max_record_bytes) {
      shared->fail(make_error_code(directory_errc::record_too_large),
                   "ferry directory: cannot publish '" + name + "': its value is " +
                       std::to_string(value.size()) + " bytes, over the limit of " +
                       std::to_string(options_.max_record_bytes));
      return std::move(pending);
    }
    if (options.lease <= std::chrono::milliseconds(0)) {
      shared->fail(make_error_code(directory_errc::bad_name),
                   "ferry directory: cannot publish '" + name + "': the lease must be positive");
      return std::move(pending);
    }
    auto p = std::make_shared<detail::publication_state>();
    p->name = std::move(name);
    p->value.assign(value.begin(), value.end());
    p->lease = options.lease;
    const auto deadline = deadline_after(options.timeout);
    post([this, p, shared, deadline] {
      if (abandoned_) {
        shared->fail(make_error_code(directory_errc::closed),
                     "ferry directory: cannot publish '" + p->name + "': this client was abandoned");
        return;
      }
      guard(shared, deadline, "publish '" + p->name + "'");
      start_publish(p, deadline, [this, p, shared](std::error_code ec, std::string what) {
        if (ec) {
          shared->fail(ec, std::move(what));
          return;
        }
        if (!shared->open()) {  // the caller's deadline passed first: take it down again
          p->withdrawn = true;
          start_withdraw(p, clock::now() + std::chrono::seconds(5), [](std::error_code) {});
          return;
        }
        schedule_keepalive(p);
        live_.push_back(p);
        shared->succeed(publication(p, anchor_));
      });
    });
    return std::move(pending);
  }

  /// The record under `name`. Fails with not_found, bad_record, record_too_large, unavailable,
  /// deadline_exceeded or closed, the message naming the name.
  pending_result<directory_record> lookup(std::string name, std::chrono::nanoseconds timeout) {
    auto [pending, sink] = detail::make_result<directory_record>();
    auto shared = std::make_shared<detail::result_sink<directory_record>>(std::move(sink));
    if (std::string why = check_directory_name(name); !why.empty()) {
      shared->fail(make_error_code(directory_errc::bad_name),
                   "ferry directory: cannot look up '" + name + "': " + why);
      return std::move(pending);
    }
    const auto deadline = deadline_after(timeout);
    std::vector<std::string> names{std::move(name)};
    post([this, names = std::move(names), shared, deadline]() mutable {
      guard(shared, deadline, "look up '" + names.front() + "'");
      start_lookup(std::move(names), deadline,
                   [shared](std::vector<lookup_result> r, std::error_code ec, std::string what) {
                     if (ec) {
                       shared->fail(ec, std::move(what));
                     } else if (r.size() != 1 || !r.front().record) {
                       lookup_result& one = r.front();
                       // not_found's code says it all; the others' messages say what was wrong.
                       shared->fail(one.error, one.error == directory_errc::not_found
                                                   ? "ferry directory: '" + one.name + "'"
                                                   : one.message);
                     } else {
                       shared->succeed(std::move(*r.front().record));
                     }
                   });
    });
    return std::move(pending);
  }

  /// Every name in `names` looked up at once, concurrently, under one deadline: out[i] is names[i]'s
  /// outcome (a record, or not_found / bad_record / record_too_large / bad_name). The whole lookup
  /// fails (unavailable, deadline_exceeded, closed) only when the directory could not answer.
  pending_result<std::vector<lookup_result>> lookup(std::vector<std::string> names,
                                                    std::chrono::nanoseconds timeout) {
    auto [pending, sink] = detail::make_result<std::vector<lookup_result>>();
    auto shared = std::make_shared<detail::result_sink<std::vector<lookup_result>>>(std::move(sink));
    // Bad names are answered here; the rest go to the backend, and are put back in order.
    std::vector<lookup_result> out(names.size());
    std::vector<std::string> asked;
    std::vector<std::size_t> where;
    for (std::size_t i = 0; i < names.size(); ++i) {
      out[i].name = names[i];
      if (std::string why = check_directory_name(names[i]); !why.empty()) {
        out[i].error = make_error_code(directory_errc::bad_name);
        out[i].message = "ferry directory: cannot look up '" + names[i] + "': " + why;
      } else {
        asked.push_back(std::move(names[i]));
        where.push_back(i);
      }
    }
    if (asked.empty()) {
      shared->succeed(std::move(out));
      return std::move(pending);
    }
    const auto deadline = deadline_after(timeout);
    post([this, asked = std::move(asked), where = std::move(where), out = std::move(out), shared,
          deadline]() mutable {
      guard(shared, deadline, "look up " + std::to_string(out.size()) + " names");
      start_lookup(std::move(asked), deadline,
                   [shared, where = std::move(where), out = std::move(out)](
                       std::vector<lookup_result> r, std::error_code ec, std::string what) mutable {
                     if (ec) {
                       shared->fail(ec, std::move(what));
                       return;
                     }
                     for (std::size_t j = 0; j < r.size() && j < where.size(); ++j) {
                       out[where[j]] = std::move(r[j]);
                     }
                     shared->succeed(std::move(out));
                   });
    });
    return std::move(pending);
  }

  /// Watches `key`: with `prefix` false, the name itself; with `prefix` true, every name that
  /// starts with it (the empty prefix: every name). Changes made after the watch started are
  /// reported in the order the directory made them. Throws std::system_error (bad_name) for a key
  /// that is no name or prefix.
  watcher watch(std::string key, bool prefix = false) {
    return watcher(start_watch_state(std::move(key), prefix, {}), anchor_);
  }

  /// Stops renewing this client's leases and forgets its publications without withdrawing them, as
  /// a process that died would: its records go one lease later, and watchers see them gone then.
  /// Publishing afterwards fails with directory_errc::closed. For tests of peers that die.
  void abandon() {
    auto [t, c] = make_manual_transfer();
    post([this, c = std::move(c)]() mutable {
      abandoned_ = true;
      for (auto& p : std::exchange(live_, {})) {
        p->withdrawn = true;  // a later withdraw() or drop sends nothing
        cancel(p->keepalive_timer);
      }
      c.succeed();
    });
    if (!exec_.on_executor_thread()) (void)t.wait();
  }

  /// The limits it applies.
  [[nodiscard]] const directory_options& options() const noexcept { return options_; }

  /// The executor it runs on.
  [[nodiscard]] progress_executor& executor() noexcept { return exec_; }

  /// A watch whose events go to `hook` on the thread that delivers them (the executor's, or for
  /// local_directory the publisher's), for bindings such as named_peer: `hook` must not block.
  /// The returned state ends the watch when given to end_watch().
  std::shared_ptr<detail::watch_state> watch_with(std::string key, bool prefix,
                                                  std::function<void(const directory_event&)> hook) {
    return start_watch_state(std::move(key), prefix, std::move(hook));
  }

  /// Ends a watch made by watch_with.
  void end_watch(const std::shared_ptr<detail::watch_state>& w) {
    if (!w) return;
    w->end(make_error_code(directory_errc::closed), "ferry directory: the watch was ended");
    post([this, w] {
      stop_watch(w);
      std::erase(watches_, w);
    });
  }

  /// The completion source's poll, for the executor only.
  std::size_t poll(std::size_t budget) noexcept {
    std::size_t n = 0;
    if (inbox_ready_.load(std::memory_order_acquire)) n += run_inbox();
    n += poll_io(budget);
    rearm_wake();
    return n;
  }
  /// The completion source's descriptor (the backend's sockets), for the executor only.
  [[nodiscard]] int park_fd() const noexcept { return io_fd(); }

 protected:
  /// Callbacks of the backend's operations, called once on the executor thread.
  using done_fn = std::function<void(std::error_code, std::string)>;
  /// A lookup's callback: per-name outcomes, or the whole lookup's failure.
  using lookup_fn = std::function<void(std::vector<lookup_result>, std::error_code, std::string)>;
  /// The clock of deadlines and timers.
  using clock = ferry::detail::clock;

  /// Registers nothing yet: the backend calls start() once it can be polled.
  directory(progress_executor& exec, directory_options options)
      : exec_(exec), options_(options), anchor_(std::make_shared<detail::directory_anchor>()) {
    if (options_.max_record_bytes == 0 || options_.max_watch_events == 0) {
      throw std::invalid_argument(
          "ferry::directory_options: max_record_bytes and max_watch_events must be at least 1");
    }
    anchor_->dir = this;
    wake_.node.fire = &directory::on_wake;
    wake_.self = this;
  }

  /// Adds the directory to its executor (the backend's constructor, last).
  void start() { exec_.add_source(*this); }

  /// Takes the directory off its executor (the backend's destructor, first): publications still
  /// live are withdrawn (waiting up to `farewell` for the service to confirm; their leases end them
  /// otherwise), waits and watches end with directory_errc::closed, handles go inert. Blocks.
  void stop(std::chrono::milliseconds farewell) {
    if (!exec_.on_executor_thread()) {
      std::vector<transfer> withdrawals;
      auto [t, c] = make_manual_transfer();
      post([this, &withdrawals, farewell, c = std::move(c)]() mutable {
        const auto deadline = clock::now() + farewell;
        for (auto& p : std::exchange(live_, {})) {
          if (p->withdrawn) continue;
          p->withdrawn = true;
          cancel(p->keepalive_timer);
          auto [wt, wc] = make_manual_transfer();
          withdrawals.push_back(std::move(wt));
          start_withdraw(p, deadline, [wc = std::move(wc)](std::error_code ec) mutable {
            if (ec) {
              wc.fail(ec);
            } else {
              wc.succeed();
            }
          });
        }
        // Withdrawals already on their way (a dropped publication's) get the same farewell.
        if (withdrawing_ > 0) {
          auto [wt, wc] = make_manual_transfer();
          withdrawals.push_back(std::move(wt));
          withdraw_waiters_.push_back(std::move(wc));
        }
        c.succeed();
      });
      (void)t.wait();
      const auto until = clock::now() + farewell;
      for (transfer& w : withdrawals) {
        const auto left = until - clock::now();
        if (left <= clock::duration::zero()) break;
        (void)w.wait_for(std::chrono::duration_cast<std::chrono::nanoseconds>(left));
      }
    }
    {
      std::lock_guard lock(anchor_->mutex);
      anchor_->dir = nullptr;
    }
    auto [t, c] = make_manual_transfer();
    post([this, c = std::move(c)]() mutable {
      for (auto& w : watches_) {
        w->end(make_error_code(directory_errc::closed), "ferry directory: the directory closed");
      }
      c.succeed();
    });
    if (exec_.on_executor_thread()) {
      (void)run_inbox();
    } else {
      (void)t.wait();
    }
    stopping_ = true;
    exec_.remove_source(*this);
    (void)exec_.timers().cancel(wake_.node);
    exec_.sync();
    timers_.clear();
    std::lock_guard lock(inbox_mutex_);
    inbox_.clear();
  }

  // ---- what a backend implements (executor thread only)
  /// Gives `p` an incarnation and a lease, and puts its record; calls `done` once.
  virtual void start_publish(std::shared_ptr<detail::publication_state> p,
                             clock::time_point deadline, done_fn done) = 0;
  /// Renews `p`'s lease; calls `done` with empty (renewed), lease_lost (the backend put the record
  /// back, or is doing so) or another error (the service did not answer).
  virtual void start_keepalive(std::shared_ptr<detail::publication_state> p, done_fn done) = 0;
  /// Deletes `p`'s record and ends its lease; `done(ec)` once.
  virtual void start_withdraw(std::shared_ptr<detail::publication_state> p,
                              clock::time_point deadline, std::function<void(std::error_code)> done) = 0;
  /// Looks every name up; `done` once with one outcome per name, in order.
  virtual void start_lookup(std::vector<std::string> names, clock::time_point deadline,
                            lookup_fn done) = 0;
  /// Starts delivering `w`'s events (w->deliver); calls `ready` once changes made from then on will
  /// reach it (or once it has tried, when the service does not answer).
  virtual void begin_watch(std::shared_ptr<detail::watch_state> w, std::function<void()> ready) = 0;
  /// Stops delivering `w`'s events.
  virtual void stop_watch(const std::shared_ptr<detail::watch_state>& w) = 0;
  /// The backend's I/O, polled each round (cheap when idle); returns what it handled.
  virtual std::size_t poll_io(std::size_t budget) noexcept = 0;
  /// A descriptor readable when the backend has I/O to handle, or -1.
  [[nodiscard]] virtual int io_fd() const noexcept = 0;

  // ---- what a backend uses
  /// Runs `fn` on the executor thread (in order of posting). Any thread.
  void post(std::function<void()> fn) {
    {
      std::lock_guard lock(inbox_mutex_);
      inbox_.push_back(std::move(fn));
      inbox_ready_.store(true, std::memory_order_release);
    }
    exec_.notify();
  }

  /// A timer: `fn` runs on the executor thread at `when`; the key cancels it. Executor only.
  using timer_key = std::pair<clock::time_point, std::uint64_t>;
  /// Arms a timer running `fn` at `when` on the executor thread.
  timer_key at(clock::time_point when, std::function<void()> fn) {
    const timer_key key{when, ++timer_seq_};
    timers_.emplace(key, std::move(fn));
    return key;
  }
  /// Disarms a timer (nothing if it ran or was disarmed).
  void cancel(const timer_key& key) { timers_.erase(key); }

  /// `timeout` from now as a deadline (clock::time_point::max() for a negative one).
  [[nodiscard]] static clock::time_point deadline_after(std::chrono::nanoseconds timeout) {
    if (timeout < std::chrono::nanoseconds::zero()) return clock::time_point::max();
    return clock::now() + timeout;
  }

  /// Fails `sink` with deadline_exceeded at `deadline` unless it ended before.
  template <class T>
  void guard(const std::shared_ptr<detail::result_sink<T>>& sink, clock::time_point deadline,
             std::string what) {
    if (deadline == clock::time_point::max()) return;
    (void)at(deadline, [sink, what = std::move(what)] {
      sink->fail(make_error_code(directory_errc::deadline_exceeded),
                 "ferry directory: " + what + ": the deadline passed first");
    });
  }

 private:
  friend class publication;
  friend class watcher;

  std::shared_ptr<detail::watch_state> start_watch_state(std::string key, bool prefix,
                                                         std::function<void(const directory_event&)> hook) {
    if (std::string why = check_directory_name(key, prefix); !why.empty()) {
      throw std::system_error(make_error_code(directory_errc::bad_name),
                              "ferry directory: cannot watch '" + key + "': " + why);
    }
    auto w = std::make_shared<detail::watch_state>();
    w->key = std::move(key);
    w->prefix = prefix;
    w->max_events = options_.max_watch_events;
    w->max_record_bytes = options_.max_record_bytes;
    w->hook = std::move(hook);
    // Registered before this returns (the caller's next step may be to publish under the name).
    transfer started;
    auto [t, c] = make_manual_transfer();
    started = std::move(t);
    post([this, w, c = std::move(c)]() mutable {
      watches_.push_back(w);
      auto shared = std::make_shared<completer>(std::move(c));
      begin_watch(w, [shared] { shared->succeed(); });
    });
    if (!exec_.on_executor_thread()) (void)started.wait();
    return w;
  }

  // The next renewal a third of the lease after this one was sent (at least a millisecond); after a
  // renewal that failed (the service did not answer), a tenth of the lease, so that one slow answer
  // does not cost the lease.
  void schedule_keepalive(const std::shared_ptr<detail::publication_state>& p,
                          clock::time_point from = clock::now(), bool retry = false) {
    if (p->withdrawn || stopping_ || abandoned_) return;
    const auto step = std::max<clock::duration>(std::chrono::milliseconds(1),
                                                retry ? p->lease / 10 : p->lease / 3);
    p->keepalive_timer = at(std::max(from + step, clock::now()), [this, p] {
      if (p->withdrawn) return;
      const auto sent = clock::now();
      start_keepalive(p, [this, p, sent](std::error_code ec, std::string) {
        if (!p->withdrawn) p->set_health(ec);
        const bool failed = ec && ec != directory_errc::lease_lost;
        schedule_keepalive(p, failed ? clock::now() : sent, failed);
      });
    });
  }

  std::size_t run_inbox() {
    std::vector<std::function<void()>> batch;
    {
      std::lock_guard lock(inbox_mutex_);
      batch.swap(inbox_);
      inbox_ready_.store(false, std::memory_order_relaxed);
    }
    for (auto& fn : batch) fn();
    return batch.size();
  }

  std::size_t run_due() {
    std::size_t n = 0;
    const auto now = clock::now();
    while (!timers_.empty() && timers_.begin()->first.first <= now) {
      auto fn = std::move(timers_.begin()->second);
      timers_.erase(timers_.begin());
      fn();
      ++n;
    }
    return n;
  }

  // Keeps the executor's timer node armed at the earliest of this directory's timers.
  void rearm_wake() noexcept {
    if (stopping_) return;
    const auto earliest = timers_.empty() ? clock::time_point::max() : timers_.begin()->first.first;
    if (earliest == armed_for_) return;
    if (armed_for_ != clock::time_point::max()) (void)exec_.timers().cancel(wake_.node);
    armed_for_ = earliest;
    if (earliest == clock::time_point::max()) return;
    wake_.node.deadline = earliest;
    try {
      exec_.timers().arm(wake_.node);
    } catch (...) {
      armed_for_ = clock::time_point::max();  // no memory for the heap: the next poll tries again
    }
  }

  static void on_wake(ferry::detail::timer_node* node) noexcept {
    directory* self = reinterpret_cast<wake_node*>(node)->self;
    self->armed_for_ = clock::time_point::max();
    if (self->stopping_) return;
    (void)self->run_due();
    self->rearm_wake();
  }

  progress_executor& exec_;
  directory_options options_;
  std::shared_ptr<detail::directory_anchor> anchor_;
  std::mutex inbox_mutex_;
  std::vector<std::function<void()>> inbox_;
  std::atomic<bool> inbox_ready_{false};
  std::map<timer_key, std::function<void()>> timers_;  // executor only
  std::uint64_t timer_seq_ = 0;
  // The executor's timer node, first in a standard-layout struct so that its callback finds us.
  struct wake_node {
    ferry::detail::timer_node node;
    directory* self = nullptr;
  };
  wake_node wake_;
  clock::time_point armed_for_ = clock::time_point::max();
  // Set by stop() on the caller's thread while the executor may still poll and read it.
  std::atomic<bool> stopping_{false};
  bool abandoned_ = false;  // executor only
  std::vector<std::shared_ptr<detail::publication_state>> live_;  // executor only
  // Withdrawals started by withdraw() or a dropped publication and not yet confirmed, and stop()'s
  // wait for them: the service hears of a withdrawal made just before the directory goes.
  std::size_t withdrawing_ = 0;               // executor only
  std::vector<completer> withdraw_waiters_;  // executor only
  void withdraw_ended() {
    if (--withdrawing_ > 0) return;
    for (completer& w : std::exchange(withdraw_waiters_, {})) w.succeed();
  }
  std::vector<std::shared_ptr<detail::watch_state>> watches_;     // executor only
};

inline void publication::drop() noexcept {
  if (!state_ || !anchor_) return;
  try {
    (void)withdraw(std::chrono::seconds(5));
  } catch (...) {
    // No memory to post the withdrawal: the lease ends it.
  }
  state_.reset();
  anchor_.reset();
}

inline transfer publication::withdraw(std::chrono::nanoseconds timeout) {
  if (!state_) throw std::logic_error("ferry::publication: empty handle");
  std::lock_guard lock(anchor_->mutex);
  directory* d = anchor_->dir;
  if (d == nullptr) {
    return make_completed_transfer(transfer_state::failed, make_error_code(directory_errc::closed));
  }
  auto [t, c] = make_manual_transfer();
  const auto deadline = directory::deadline_after(timeout);
  d->post([d, p = state_, c = std::move(c), deadline]() mutable {
    if (p->withdrawn) {
      c.succeed();
      return;
    }
    p->withdrawn = true;
    d->cancel(p->keepalive_timer);
    std::erase(d->live_, p);
    ++d->withdrawing_;
    d->start_withdraw(p, deadline, [d, c = std::move(c)](std::error_code ec) mutable {
      if (ec) {
        c.fail(ec);
      } else {
        c.succeed();
      }
      d->withdraw_ended();
    });
  });
  return std::move(t);
}

inline pending_result<directory_event> watcher::next(std::chrono::nanoseconds timeout) {
  if (!state_) throw std::logic_error("ferry::watcher: empty handle");
  auto [pending, sink] = detail::make_result<directory_event>();
  auto shared = std::make_shared<detail::result_sink<directory_event>>(std::move(sink));
  std::uint64_t id = 0;
  {
    std::lock_guard lock(state_->mutex);
    if (!state_->events.empty()) {
      shared->succeed(std::move(state_->events.front()));
      state_->events.pop_front();
      return std::move(pending);
    }
    if (state_->failure) {
      shared->fail(state_->failure, "ferry directory: the watch on '" + state_->key + "' ended");
      return std::move(pending);
    }
    if (state_->waiter) {
      throw std::logic_error("ferry::watcher::next: another next() is still waiting");
    }
    if (timeout == std::chrono::nanoseconds::zero()) {
      shared->fail(make_error_code(directory_errc::deadline_exceeded),
                   "ferry directory: no change under '" + state_->key + "'");
      return std::move(pending);
    }
    state_->waiter = shared;
    id = ++state_->waiter_id;
  }
  if (timeout < std::chrono::nanoseconds::zero()) return std::move(pending);
  std::lock_guard lock(anchor_->mutex);
  if (directory* d = anchor_->dir) {
    const auto deadline = directory::deadline_after(timeout);
    d->post([d, w = state_, id, deadline] {
      (void)d->at(deadline, [w, id] {
        std::shared_ptr<detail::result_sink<directory_event>> taker;
        {
          std::lock_guard held(w->mutex);
          if (w->waiter && w->waiter_id == id) taker = std::exchange(w->waiter, nullptr);
        }
        if (taker) {
          taker->fail(make_error_code(directory_errc::deadline_exceeded),
                      "ferry directory: no change under '" + w->key + "' before the deadline");
        }
      });
    });
  }
  return std::move(pending);
}

inline void watcher::drop() noexcept {
  if (!state_ || !anchor_) return;
  try {
    std::lock_guard lock(anchor_->mutex);
    if (directory* d = anchor_->dir) d->end_watch(state_);
  } catch (...) {
    // No memory to post the end: the state is freed with the last reference anyway.
  }
  state_.reset();
  anchor_.reset();
}

}  // namespace ferry

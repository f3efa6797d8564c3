#pragma once
// The in-process directory: nothing to start. A local_registry plays the part etcd plays in a
// cluster (records, incarnation counters, leases that expire, watches), and every local_directory
// made on it is one client with its own executor, as one engine process would be. Engines in one
// process (tests, one machine with several engines, the default) share the process-wide registry.
//
// Leases expire on the registry's own thread, which sleeps until the earliest expiry: a client
// whose executor stops renewing (abandon(), or an executor that went) loses its records one lease
// later, and every watcher sees them gone, as with etcd. Watch events are delivered on the thread
// that made the change (a client's executor, or the registry's expiry thread), in the order the
// registry made the changes.

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "ferry/directory/directory.hpp"

namespace ferry {

/// The in-process store behind local_directory: records, incarnation counters, leases, watches.
/// Thread-safe. Its expiry thread starts with the first lease.
class local_registry {
 public:
  /// An empty registry.
  local_registry() = default;
  local_registry(const local_registry&) = delete;
  local_registry& operator=(const local_registry&) = delete;
  /// Stops the expiry thread; directories on it must be gone.
  ~local_registry() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    if (reaper_.joinable()) reaper_.join();
  }

  /// The registry every local_directory made without one shares.
  [[nodiscard]] static std::shared_ptr<local_registry> process_wide() {
    static const std::shared_ptr<local_registry> r = std::make_shared<local_registry>();
    return r;
  }

  /// Writes `bytes` under `name` as they are, with no lease: what a foreign writer could leave
  /// under a name (garbage, a cut record, an oversized one). For tests of what readers refuse.
  void put_raw(const std::string& name, std::vector<std::byte> bytes) {
    std::unique_lock lock(mutex_);
    records_[name] = entry{std::move(bytes), 0};
    notify_put(name, lock);
  }

  /// Leases granted and not yet ended (for tests: a withdrawn or expired publication leaves none).
  [[nodiscard]] std::size_t leases() const {
    std::lock_guard lock(mutex_);
    return leases_.size();
  }

 private:
  friend class local_directory;

  struct entry {
    std::vector<std::byte> bytes;
    std::uint64_t lease = 0;  // 0: none
  };
  struct lease_entry {
    std::chrono::steady_clock::time_point expiry;
    std::chrono::milliseconds ttl;
    std::vector<std::string> names;
  };

  std::uint64_t next_incarnation(const std::string& name) {
    std::lock_guard lock(mutex_);
    return ++counters_[name];
  }

  std::uint64_t grant(std::chrono::milliseconds ttl) {
    std::lock_guard lock(mutex_);
    const std::uint64_t id = ++next_lease_;
    leases_[id] = lease_entry{std::chrono::steady_clock::now() + ttl, ttl, {}};
    if (!reaper_.joinable()) reaper_ = std::thread([this] { reap(); });
    cv_.notify_all();
    return id;
  }

  // False when the lease is gone (expired or revoked).
  bool keepalive(std::uint64_t id) {
    std::lock_guard lock(mutex_);
    auto it = leases_.find(id);
    if (it == leases_.end()) return false;
    it->second.expiry = std::chrono::steady_clock::now() + it->second.ttl;
    return true;
  }

  // False when the lease is gone.
  enum class put_result { done, lease_gone, superseded };

  // Puts the record of `incarnation` on `lease`, unless a newer incarnation of the name was issued
  // (a newer publisher holds the name: a hung one that comes back must not put its old record over
  // it).
  put_result put(const std::string& name, std::vector<std::byte> bytes, std::uint64_t lease,
                 std::uint64_t incarnation) {
    std::unique_lock lock(mutex_);
    if (counters_[name] > incarnation) return put_result::superseded;
    auto l = leases_.find(lease);
    if (l == leases_.end()) return put_result::lease_gone;
    l->second.names.push_back(name);
    records_[name] = entry{std::move(bytes), lease};
    notify_put(name, lock);
    return put_result::done;
  }

  // Deletes the name if `lease` still holds it, then ends the lease.
  void withdraw(const std::string& name, std::uint64_t lease) {
    std::unique_lock lock(mutex_);
    auto it = records_.find(name);
    if (it != records_.end() && it->second.lease == lease) erase(it, lock);
    leases_.erase(lease);
  }

  [[nodiscard]] std::optional<std::vector<std::byte>> get(const std::string& name) const {
    std::lock_guard lock(mutex_);
    auto it = records_.find(name);
    if (it == records_.end()) return std::nullopt;
    return it->second.bytes;
  }

  void add_watch(const std::shared_ptr<detail::watch_state>& w) {
    std::lock_guard lock(mutex_);
    watches_.push_back(w);
  }
  void remove_watch(const std::shared_ptr<detail::watch_state>& w) {
    std::lock_guard lock(mutex_);
    std::erase_if(watches_, [&](const std::weak_ptr<detail::watch_state>& x) {
      auto s = x.lock();
      return !s || s == w;
    });
  }

  // Under the lock: tells every matching watch. Deliveries happen under the lock so that watchers
  // see changes in the order the registry made them; a hook must not call back into the registry.
  void notify_put(const std::string& name, std::unique_lock<std::mutex>&) {
    const entry& e = records_[name];
    directory_event ev;
    ev.what = directory_event::kind::published;
    ev.record.name = name;
    // What the event carries is checked as a lookup's record would be, by the watcher's own limit.
    for (auto& weak : watches_) {
      auto w = weak.lock();
      if (!w || !w->matches(name)) continue;
      lookup_result r = decode_record(name, e.bytes, w->max_record_bytes);
      if (!r.record) continue;  // garbage is not an event; a lookup reports it
      ev.record = std::move(*r.record);
      w->deliver(ev);
    }
  }

  void erase(std::map<std::string, entry>::iterator it, std::unique_lock<std::mutex>&) {
    const std::string name = it->first;
    std::uint64_t incarnation = 0;
    lookup_result old = decode_record(name, it->second.bytes, std::size_t(-1) / 2);
    if (old.record) incarnation = old.record->incarnation;
    records_.erase(it);
    directory_event ev;
    ev.what = directory_event::kind::gone;
    ev.record.name = name;
    ev.record.incarnation = incarnation;
    for (auto& weak : watches_) {
      auto w = weak.lock();
      if (w && w->matches(name)) w->deliver(ev);
    }
  }

  void reap() {
    std::unique_lock lock(mutex_);
    while (!stop_) {
      auto next = std::chrono::steady_clock::time_point::max();
      const auto now = std::chrono::steady_clock::now();
      for (auto it = leases_.begin(); it != leases_.end();) {
        if (it->second.expiry <= now) {
          for (const std::string& name : it->second.names) {
            auto r = records_.find(name);
            if (r != records_.end() && r->second.lease == it->first) erase(r, lock);
          }
          it = leases_.erase(it);
        } else {
          next = std::min(next, it->second.expiry);
          ++it;
        }
      }
      if (next == std::chrono::steady_clock::time_point::max()) {
        cv_.wait(lock);
      } else {
        cv_.wait_until(lock, next);
      }
    }
  }

  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::map<std::string, entry> records_;
  std::map<std::string, std::uint64_t> counters_;
  std::map<std::uint64_t, lease_entry> leases_;
  std::uint64_t next_lease_ = 0;
  std::vector<std::weak_ptr<detail::watch_state>> watches_;
  std::thread reaper_;
  bool stop_ = false;
};

/// The in-process directory (the default): one client of a local_registry, run on `exec`.
/// Engines in one process find each other through the process-wide registry; a test gives each
/// simulated engine its own local_directory on a shared registry.
class local_directory final : public directory {
 public:
  /// A client of `registry` (the process-wide one by default), run on `exec`, which must outlive it.
  explicit local_directory(progress_executor& exec, directory_options options = {},
                           std::shared_ptr<local_registry> registry = local_registry::process_wide())
      : directory(exec, options), registry_(std::move(registry)) {
    if (!registry_) throw std::invalid_argument("ferry::local_directory: null registry");
    start();
  }
  /// Withdraws what it still publishes, ends its watches.
  ~local_directory() override { stop(std::chrono::milliseconds(1000)); }

  /// The registry it is a client of.
  [[nodiscard]] const std::shared_ptr<local_registry>& registry() const noexcept { return registry_; }

 private:
  void start_publish(std::shared_ptr<detail::publication_state> p, clock::time_point,
                     done_fn done) override {
    p->incarnation = registry_->next_incarnation(p->name);
    if (!put_with_new_lease(*p)) {
      return done(make_error_code(directory_errc::superseded),
                  "ferry directory: '" + p->name + "': incarnation " +
                      std::to_string(p->incarnation) + " was superseded by a newer one");
    }
    done({}, {});
  }

  void start_keepalive(std::shared_ptr<detail::publication_state> p, done_fn done) override {
    if (registry_->keepalive(static_cast<std::uint64_t>(p->lease_id))) return done({}, {});
    // The lease went (expired while this executor was stalled): put the record back, same
    // incarnation, and report it lost this once; unless a newer incarnation holds the name now.
    if (!put_with_new_lease(*p)) {
      return done(make_error_code(directory_errc::superseded),
                  "ferry directory: '" + p->name + "': incarnation " +
                      std::to_string(p->incarnation) + " was superseded while its lease was lost");
    }
    {
      std::lock_guard lock(p->mutex);
      ++p->republished;
    }
    done(make_error_code(directory_errc::lease_lost), "ferry directory: the lease was lost");
  }

  void start_withdraw(std::shared_ptr<detail::publication_state> p, clock::time_point,
                      std::function<void(std::error_code)> done) override {
    registry_->withdraw(p->name, static_cast<std::uint64_t>(p->lease_id));
    done({});
  }

  void start_lookup(std::vector<std::string> names, clock::time_point, lookup_fn done) override {
    std::vector<lookup_result> out;
    out.reserve(names.size());
    for (std::string& name : names) {
      std::optional<std::vector<std::byte>> bytes = registry_->get(name);
      if (!bytes) {
        lookup_result r;
        r.name = std::move(name);
        r.error = make_error_code(directory_errc::not_found);
        r.message = "ferry directory: nothing is published under '" + r.name + "'";
        out.push_back(std::move(r));
      } else {
        out.push_back(decode_record(std::move(name), *bytes, options().max_record_bytes));
      }
    }
    done(std::move(out), {}, {});
  }

  void begin_watch(std::shared_ptr<detail::watch_state> w, std::function<void()> ready) override {
    registry_->add_watch(w);
    ready();
  }
  void stop_watch(const std::shared_ptr<detail::watch_state>& w) override {
    registry_->remove_watch(w);
  }
  std::size_t poll_io(std::size_t) noexcept override { return 0; }
  [[nodiscard]] int io_fd() const noexcept override { return -1; }

  // False (the lease ended, the publication marked withdrawn and superseded) when a newer
  // incarnation holds the name.
  bool put_with_new_lease(detail::publication_state& p) {
    for (;;) {
      p.lease_id = static_cast<std::int64_t>(registry_->grant(p.lease));
      const auto lease = static_cast<std::uint64_t>(p.lease_id);
      switch (registry_->put(p.name, encode_record(p.incarnation, p.value), lease, p.incarnation)) {
        case local_registry::put_result::done: return true;
        case local_registry::put_result::lease_gone: continue;  // expired at once: grant again
        case local_registry::put_result::superseded:
          registry_->withdraw(p.name, lease);  // ends the lease; the newer record is not ours
          p.withdrawn = true;
          p.set_health(make_error_code(directory_errc::superseded));
          return false;
      }
    }
  }

  std::shared_ptr<local_registry> registry_;
};

}  // namespace ferry

#pragma once
// An endpoint to a peer found by name, bound to the incarnation it was made from (a fenced
// reconnect). named_peer watches the name; when the directory shows a newer incarnation it severs
// the endpoint with directory_errc::peer_restarted, when the name goes (withdrawn, or its lease
// expired because the peer died or hangs) with directory_errc::peer_gone: every transfer on it,
// out or later, fails at once with that reason. The next get() or use() looks the name up again and
// makes a fresh endpoint to the new incarnation; nothing is sent to the name over the old one after
// the fence, since a lookup that finds a newer incarnation severs the old endpoint before the new
// one is made, whether or not the watch has told yet.
//
// Endpoint is any copyable handle with `sever(std::error_code)`: ucx::endpoint, verbs::queue_pair
// through a shared_ptr, a uring::tcp_connection through std::shared_ptr (see sever_endpoint below),
// or the user's own type with a sever function given to the constructor.

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <system_error>
#include <utility>

#include "ferry/directory/directory.hpp"
#include "ferry/task.hpp"

namespace ferry {

/// A handle with a `sever(std::error_code)` member (ucx::endpoint, verbs::queue_pair).
template <class E>
concept severable = requires(E& e, std::error_code ec) { e.sever(ec); };

/// Severs `e` with `why`: `e.sever(why)`, or `e->sever(why)` for a pointer to a severable object.
template <class E>
void sever_endpoint(E& e, std::error_code why) {
  if constexpr (severable<E>) {
    e.sever(why);
  } else {
    e->sever(why);
  }
}

/// An endpoint to the peer published under a name, made from its record and bound to its
/// incarnation (see the top of this header). Thread-safe.
template <class Endpoint>
class named_peer {
 public:
  /// Makes an endpoint from the peer's record (its value: a worker address, a KV engine
  /// description). Called on the thread of get() or use(); may block while it connects.
  using connect_fn = std::function<Endpoint(const directory_record&)>;
  /// Severs an endpoint: every transfer on it, out or later, fails with the reason.
  using sever_fn = std::function<void(Endpoint&, std::error_code)>;

  /// Binds to `name` in `dir`, which must outlive it; makes nothing until the first get() or use().
  named_peer(directory& dir, std::string name, connect_fn connect,
             sever_fn sever = [](Endpoint& e, std::error_code why) { sever_endpoint(e, why); })
      : dir_(dir), state_(std::make_shared<state>()) {
    if (!connect) throw std::invalid_argument("ferry::named_peer: no connect function");
    state_->name = std::move(name);
    state_->connect = std::move(connect);
    state_->sever = std::move(sever);
    std::weak_ptr<state> weak = state_;
    watch_ = dir_.watch_with(state_->name, false, [weak](const directory_event& ev) {
      if (auto s = weak.lock()) s->on_event(ev);
    });
  }
  named_peer(const named_peer&) = delete;
  named_peer& operator=(const named_peer&) = delete;
  /// Ends the watch. The endpoint it made stays with the copies the caller holds.
  ~named_peer() { dir_.end_watch(watch_); }

  /// The endpoint to the peer's current incarnation: the one made before while the directory has
  /// shown nothing newer, else a fresh one from a lookup (blocks while it looks up and connects).
  /// Throws std::system_error: peer_gone when the name had a peer and now has none, not_found when
  /// it never had one, or what the lookup or connect failed with.
  Endpoint get(std::chrono::nanoseconds timeout) {
    if (auto e = state_->current()) return *e;
    pending_result<directory_record> found = dir_.lookup(state_->name, timeout);
    (void)found.made().wait();
    return state_->install(state_->take(found));
  }

  /// get(), to co_await: the lookup does not block the calling thread (the connect function runs on
  /// it once the record is in).
  task<Endpoint> use(std::chrono::nanoseconds timeout) {
    if (auto e = state_->current()) co_return *e;
    pending_result<directory_record> found = dir_.lookup(state_->name, timeout);
    (void)co_await found.made();
    co_return state_->install(state_->take(found));
  }

  /// The incarnation the current endpoint is bound to (0 when there is none).
  [[nodiscard]] std::uint64_t incarnation() const {
    std::lock_guard lock(state_->mutex);
    return state_->endpoint ? state_->bound : 0;
  }

  /// Why the last endpoint was severed (peer_restarted or peer_gone); empty if none was.
  [[nodiscard]] std::error_code fenced() const {
    std::lock_guard lock(state_->mutex);
    return state_->fenced;
  }

  /// Endpoints made so far (1 plus one per fenced reconnect).
  [[nodiscard]] std::uint64_t connects() const {
    std::lock_guard lock(state_->mutex);
    return state_->connects;
  }

 private:
  struct state {
    std::string name;
    connect_fn connect;
    sever_fn sever;
    mutable std::mutex mutex;
    std::optional<Endpoint> endpoint;
    std::uint64_t bound = 0;      // the endpoint's incarnation
    std::uint64_t newest = 0;     // the newest incarnation the watch or a lookup has shown
    std::uint64_t gone_at = 0;    // the newest incarnation seen gone (~0: gone, incarnation unknown)
    std::error_code fenced;
    std::uint64_t connects = 0;

    std::optional<Endpoint> current() const {
      std::lock_guard lock(mutex);
      return endpoint;
    }

    // Under the lock: ends the endpoint with `why`.
    void sever_locked(directory_errc why) {
      if (!endpoint) return;
      fenced = make_error_code(why);
      Endpoint e = std::move(*endpoint);
      endpoint.reset();
      sever(e, fenced);
    }

    // A watch event (any thread; must not block).
    void on_event(const directory_event& ev) {
      std::lock_guard lock(mutex);
      if (ev.what == directory_event::kind::published) {
        newest = std::max(newest, ev.record.incarnation);
        // The name is back (a restart, or the same incarnation put back after its lease was lost):
        // the gone seen before no longer bars a lookup that finds this incarnation.
        if (gone_at == ~std::uint64_t{0} || ev.record.incarnation >= gone_at) gone_at = 0;
        if (endpoint && ev.record.incarnation > bound) sever_locked(directory_errc::peer_restarted);
      } else {
        const std::uint64_t which = ev.record.incarnation == 0 ? ~std::uint64_t{0} : ev.record.incarnation;
        gone_at = std::max(gone_at, which);
        if (endpoint && (ev.record.incarnation == 0 || ev.record.incarnation == bound)) {
          sever_locked(directory_errc::peer_gone);
        }
      }
    }

    // The record a finished lookup found; a name that had a peer and now has none is peer_gone.
    directory_record take(pending_result<directory_record>& found) const {
      if (found.made().error() == directory_errc::not_found) {
        std::lock_guard lock(mutex);
        if (connects != 0) {
          throw std::system_error(make_error_code(directory_errc::peer_gone),
                                  "ferry::named_peer: '" + name + "' had a peer and now has none");
        }
      }
      return found.get();
    }

    Endpoint install(directory_record r) {
      {
        std::lock_guard lock(mutex);
        if (endpoint && bound >= r.incarnation) return *endpoint;  // made meanwhile
        if (r.incarnation < newest || (gone_at != 0 && gone_at >= r.incarnation)) {
          // The lookup is older than what the watch has shown: that incarnation is gone.
          throw std::system_error(make_error_code(directory_errc::peer_gone),
                                  "ferry::named_peer: incarnation " +
                                      std::to_string(r.incarnation) + " of '" + name +
                                      "' is gone; look it up again");
        }
        // The fence: the old endpoint is severed before anything goes to the new incarnation.
        if (endpoint) sever_locked(directory_errc::peer_restarted);
        newest = r.incarnation;
      }
      Endpoint made = connect(r);
      std::lock_guard lock(mutex);
      if (r.incarnation < newest || (gone_at != 0 && gone_at >= r.incarnation) ||
          (endpoint && bound > r.incarnation)) {
        // The peer restarted or went while we connected: this endpoint is already stale.
        sever(made, make_error_code(gone_at >= r.incarnation ? directory_errc::peer_gone
                                                              : directory_errc::peer_restarted));
        throw std::system_error(make_error_code(directory_errc::peer_gone),
                                "ferry::named_peer: '" + name + "' changed while connecting to " +
                                    "incarnation " + std::to_string(r.incarnation));
      }
      if (endpoint && bound == r.incarnation) {
        // Another caller won the race: this duplicate was never handed out; close it.
        sever(made, make_error_code(directory_errc::closed));
        return *endpoint;
      }
      endpoint = made;
      bound = r.incarnation;
      ++connects;
      return made;
    }
  };

  directory& dir_;
  std::shared_ptr<state> state_;
  std::shared_ptr<detail::watch_state> watch_;
};

}  // namespace ferry

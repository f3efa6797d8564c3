#pragma once
// The UCX backend's objects: a worker registered with a progress executor, the memory it maps, the
// endpoints it connects and the listener that accepts them. What runs on the executor is in
// detail/engine.hpp; everything here prepares a request on the caller's thread and publishes it.

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <coroutine>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "ferry/detail/made_awaiter.hpp"
#include "ferry/detail/timeout.hpp"
#include "ferry/errors.hpp"
#include "ferry/progress_executor.hpp"
#include "ferry/transfer.hpp"
#include "ferry/ucx/detail/endpoint_state.hpp"
#include "ferry/ucx/detail/engine.hpp"
#include "ferry/ucx/detail/request.hpp"
#include "ferry/ucx/errors.hpp"
#include "ferry/ucx/memory_region.hpp"
#include "ferry/ucx/options.hpp"
#include "ferry/ucx/remote.hpp"

namespace ferry::ucx {

class worker;

/// A peer's region imported on an endpoint: slice() gives the ranges gets and puts name.
struct remote_memory {
  std::uint64_t address = 0;  ///< the region's first byte, in the peer's address space
  std::uint64_t length = 0;   ///< bytes
  std::uint32_t index = 0;    ///< its index among the endpoint's peer regions

  /// The `n` bytes at `offset` into the region.
  /// Throws std::out_of_range when [offset, offset + n) is not inside the region.
  [[nodiscard]] remote_slice slice(std::uint64_t offset, std::uint64_t n) const {
    if (offset > length || n > length - offset) {
      throw std::out_of_range("ferry::ucx::remote_memory::slice: bytes [" + std::to_string(offset) +
                              ", " + std::to_string(offset) + " + " + std::to_string(n) +
                              ") are outside the peer's region of " + std::to_string(length) +
                              " bytes");
    }
    return {address + offset, n, index};
  }
};

/// One get or put of a batch.
struct rma_block {
  local_slice local;    ///< this side's memory: a get's destination, a put's source
  remote_slice remote;  ///< the peer's memory, of the same length
};

namespace detail {

template <class Rep, class Period>
void set_deadline(request& r, std::chrono::duration<Rep, Period> timeout) {
  const ferry::detail::timeout t = ferry::detail::make_timeout(timeout);
  if (t.is_bounded() || t.is_look()) {
    r.has_deadline = true;
    r.deadline = t.is_look() ? ferry::detail::clock::now() : t.deadline();
  }
}

// Publishes `r`, a request of one member (a call, a connect or an accept), to the executor; its
// transfer ends with it.
inline transfer start_one(engine& e, std::unique_ptr<request> r) {
  r->eng = &e;
  r->members.resize(1);
  r->members[0].owner = r.get();
  r->members_left = 1;
  transfer t(ferry::detail::adopt, engine::attach(r->members[0]));
  e.publish(r.release());
  return t;
}

// Throws std::system_error naming `what` (and what the executor said, `error`) unless `t`
// succeeded.
inline void check_one(const transfer& t, const std::string& what, const std::string& error) {
  if (t.state() != transfer_state::success) {
    throw std::system_error(t.error(), error.empty() ? what : what + ": " + error);
  }
}

// Refuses a blocking call on the executor thread itself (the executor must progress the worker for
// it to end).
inline void refuse_on_executor(engine& e, const std::string& what) {
  if (e.executor().on_executor_thread()) {
    throw std::system_error(make_error_code(errc::not_executor_safe), what);
  }
}

// start_one, then waits for it; throws std::system_error naming `what` with its error.
inline void run_one(engine& e, std::unique_ptr<request> r, const std::string& what) {
  refuse_on_executor(e, what);
  // What a call's exception said, read once the transfer has ended (the request may be gone).
  std::string error;
  r->call_error_out = &error;
  const transfer t = start_one(e, std::move(r));
  (void)t.wait();
  check_one(t, what, error);
}

// Runs f() on the executor thread and waits for it.
template <class F>
void on_executor(engine& e, const std::string& what, F f) {
  auto r = std::make_unique<request>();
  r->kind = request_kind::call;
  r->call = std::move(f);
  run_one(e, std::move(r), what);
}

}  // namespace detail

/// An endpoint to one peer. Copies share it; the last copy to go closes it.
class endpoint {
 public:
  /// An empty handle, connected to nothing; calls on it throw std::logic_error.
  endpoint() = default;

  /// The regions the peer exposed when connecting by host and port (in its order).
  [[nodiscard]] std::vector<remote_memory> peer_regions() const {
    std::vector<remote_memory> out;
    for (std::size_t i = 0; i < state()->peer_regions.size(); ++i) {
      const remote_region& r = state()->peer_regions[i];
      out.push_back({r.address, r.length, static_cast<std::uint32_t>(i)});
    }
    return out;
  }

  /// Imports a region a peer described (remote_region::from_bytes of the bytes it sent): its key is
  /// unpacked on this endpoint once, at first use. Blocks until the executor has it.
  [[nodiscard]] remote_memory import(const remote_region& region) {
    std::uint32_t index = 0;
    std::shared_ptr<detail::endpoint_state> s = state_;
    detail::engine& e = *s->eng;
    detail::on_executor(e, "ferry::ucx::endpoint::import", [&]() -> std::error_code {
      return e.import_region(*s, region, index);
    });
    return {region.address, region.length, index};
  }

  /// Why the endpoint carries nothing more; empty while it does.
  [[nodiscard]] std::error_code error() const { return state()->failure(); }

  /// One-sided put of `src` into the peer's `dst` (same length). With put_completion::landed (the
  /// default) the transfer ends once the data is in the peer's memory. `timeout` (negative: none)
  /// bounds the request: past it the endpoint is force-closed, which ends every request on it.
  template <class Rep = std::int64_t, class Period = std::nano>
  [[nodiscard]] transfer put(local_slice src, remote_slice dst,
                             std::chrono::duration<Rep, Period> timeout = std::chrono::nanoseconds(-1),
                             put_completion completion = put_completion::landed) {
    transfer out;
    const rma_block b{src, dst};
    submit(detail::request_kind::put, std::span(&b, 1), std::span(&out, 1), timeout, completion);
    return out;
  }

  /// One-sided get of the peer's `src` into `dst` (same length).
  template <class Rep = std::int64_t, class Period = std::nano>
  [[nodiscard]] transfer get(local_slice dst, remote_slice src,
                             std::chrono::duration<Rep, Period> timeout = std::chrono::nanoseconds(-1)) {
    transfer out;
    const rma_block b{dst, src};
    submit(detail::request_kind::get, std::span(&b, 1), std::span(&out, 1), timeout,
           put_completion::landed);
    return out;
  }

  /// A batch with one deadline: out[i] is blocks[i]'s transfer. A landed put batch is flushed once.
  template <class Rep = std::int64_t, class Period = std::nano>
  void put_batch(std::span<const rma_block> blocks, std::span<transfer> out,
                 std::chrono::duration<Rep, Period> timeout = std::chrono::nanoseconds(-1),
                 put_completion completion = put_completion::landed) {
    submit(detail::request_kind::put, blocks, out, timeout, completion);
  }

  /// put_batch's get counterpart: each block's remote range is read into its local one.
  template <class Rep = std::int64_t, class Period = std::nano>
  void get_batch(std::span<const rma_block> blocks, std::span<transfer> out,
                 std::chrono::duration<Rep, Period> timeout = std::chrono::nanoseconds(-1)) {
    submit(detail::request_kind::get, blocks, out, timeout, put_completion::landed);
  }

  /// Sends `value` once every put sent before it on this endpoint has landed (a flush, then an
  /// active message), so the peer's receive_notification tells it that its data is there.
  template <class Rep = std::int64_t, class Period = std::nano>
  [[nodiscard]] transfer send_notification(std::uint64_t value,
      std::chrono::duration<Rep, Period> timeout = std::chrono::nanoseconds(-1)) {
    transfer t;
    auto r = make(detail::request_kind::notify, 1, &t);
    r->value = value;
    detail::set_deadline(*r, timeout);
    publish(r.release());
    return t;
  }

  /// The next notification the peer sent, in order; `value` is written before the transfer succeeds,
  /// so it must stay valid until the transfer is terminal. A peer that dies fails the wait (UCX's
  /// keepalive notices a dead peer where nothing else is in flight; worker_options::keepalive).
  template <class Rep = std::int64_t, class Period = std::nano>
  [[nodiscard]] transfer receive_notification(std::uint64_t& value,
      std::chrono::duration<Rep, Period> timeout = std::chrono::nanoseconds(-1)) {
    transfer t;
    auto r = make(detail::request_kind::wait_notification, 1, &t);
    r->value_out = &value;
    detail::set_deadline(*r, timeout);
    publish(r.release());
    return t;
  }

  /// Closes the endpoint: requests made from now on fail with errc::endpoint_closed. Those already
  /// out get until worker_options::close_timeout to end (UCX flushes the endpoint, so the peer has
  /// read everything sent on it before the connection goes); then it is force-closed, and any still
  /// out fail with errc::endpoint_closed. Returns once it is closed (at once on the executor's
  /// thread). The last handle going closes it the same way, without waiting.
  void close() {
    if (!state_) return;
    transfer t;
    publish(make(detail::request_kind::close, 1, &t).release());
    if (!state_->eng->executor().on_executor_thread()) (void)t.wait();
  }

  /// Ends the endpoint at once for a reason the caller knows (a directory showed its peer restart
  /// or go; named_peer calls this): it is force-closed without a flush, and every request on it,
  /// out or made later, fails with `why`. Does not wait; any thread, the executor's included.
  void sever(std::error_code why) const {
    if (!state_) return;
    if (!why) why = make_error_code(errc::endpoint_closed);
    transfer t;
    auto r = make(detail::request_kind::call, 1, &t);
    r->call = [s = state_, why]() -> std::error_code {
      s->fail(why);  // the first reason stays: requests out and later ones fail with `why`
      s->eng->force_close(*s, why);
      return {};
    };
    publish(r.release());
  }

  ///@{
  /// Copies share the endpoint; the last handle to go closes it (see close()).
  endpoint(const endpoint&) = default;
  endpoint& operator=(const endpoint&) = default;
  endpoint(endpoint&&) noexcept = default;
  endpoint& operator=(endpoint&&) noexcept = default;
  ~endpoint() = default;
  ///@}

 private:
  friend class worker;
  friend class listener;

  explicit endpoint(std::shared_ptr<detail::endpoint_state> s, std::shared_ptr<void> last)
      : state_(std::move(s)), last_(std::move(last)) {}

  [[nodiscard]] const std::shared_ptr<detail::endpoint_state>& state() const {
    if (!state_) throw std::logic_error("ferry::ucx::endpoint: empty endpoint");
    return state_;
  }

  // A request of `n` members; their transfers go to out[0..n) (none made yet when out is null).
  std::unique_ptr<detail::request> make(detail::request_kind k, std::size_t n,
                                        transfer* out) const {
    auto r = std::make_unique<detail::request>();
    r->kind = k;
    r->eng = state()->eng;
    r->endpoint = state_;
    r->members.resize(n);
    r->members_left = n;
    for (std::size_t i = 0; i < n; ++i) {
      detail::member& m = r->members[i];
      m.owner = r.get();
      if (out != nullptr) out[i] = transfer(ferry::detail::adopt, detail::engine::attach(m));
    }
    return r;
  }

  void publish(detail::request* r) const noexcept { r->eng->publish(r); }

  // Why a block is refused before anything is published; empty when it is not.
  static std::error_code refusal(const rma_block& b) noexcept {
    if (b.local.region == nullptr || !*b.local.region) return make_error_code(errc::outside_region);
    if (b.local.length != b.remote.length) return make_error_code(errc::length_mismatch);
    const std::size_t size = b.local.region->bytes().size();
    if (b.local.offset > size || b.local.length > size - b.local.offset) {
      return make_error_code(errc::outside_region);
    }
    return {};
  }

  template <class Rep, class Period>
  void submit(detail::request_kind k, std::span<const rma_block> blocks, std::span<transfer> out,
              std::chrono::duration<Rep, Period> timeout, put_completion completion) {
    if (out.size() != blocks.size()) {
      throw std::invalid_argument("ferry::ucx::endpoint: " + std::to_string(blocks.size()) +
                                  " blocks but " + std::to_string(out.size()) + " transfers");
    }
    if (blocks.empty()) return;
    // Refused blocks get a failed transfer that names what was wrong; the rest make one request.
    const std::error_code broken = state()->failure();
    std::size_t accepted = 0;
    for (const rma_block& b : blocks) accepted += broken || refusal(b) ? 0u : 1u;
    std::unique_ptr<detail::request> r;
    if (accepted != 0) {
      r = make(k, accepted, nullptr);
      r->completion = completion;
      detail::set_deadline(*r, timeout);
    }
    std::size_t j = 0;
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      const rma_block& b = blocks[i];
      const std::error_code why = broken ? broken : refusal(b);
      if (why) {
        out[i] = make_completed_transfer(transfer_state::failed, why);
        continue;
      }
      detail::member& m = r->members[j];
      const auto& region = b.local.region->state();
      m.region = region;
      m.local = region->base + b.local.offset;
      m.length = b.local.length;
      m.memh = region->memh;
      m.remote_address = b.remote.address;
      m.remote_index = static_cast<std::uint32_t>(b.remote.region);
      out[i] = transfer(ferry::detail::adopt, detail::engine::attach(m));
      ++j;
    }
    if (r) publish(r.release());
  }

  std::shared_ptr<detail::endpoint_state> state_;
  std::shared_ptr<void> last_;  // the last handle's close
};

class listener;

/// An endpoint being made by host and port (worker::connect_async, listener::accept_async).
/// `co_await` it in a coroutine (it resumes on the coroutine's scheduler with the endpoint, or throws
/// std::system_error naming what failed), or get() it, which blocks. Dropping it unawaited is safe:
/// an endpoint made meanwhile is closed.
class pending_endpoint {
 public:
  /// Takes over `other`'s connection under way.
  pending_endpoint(pending_endpoint&&) noexcept = default;
  /// Lets go of its own connection under way (an endpoint made for it is closed) and takes `other`'s.
  pending_endpoint& operator=(pending_endpoint&& other) noexcept {
    if (this != &other) {
      let_go();
      owner_ = other.owner_;
      result_ = std::move(other.result_);
      made_ = std::move(other.made_);
      what_ = std::move(other.what_);
      endpoint_ = std::move(other.endpoint_);
      other.endpoint_.reset();
    }
    return *this;
  }
  pending_endpoint(const pending_endpoint&) = delete;
  pending_endpoint& operator=(const pending_endpoint&) = delete;
  /// Drops the result: an endpoint made for it, now or later, is closed.
  ~pending_endpoint() { let_go(); }

  /// Ends when the endpoint is made or could not be: for a batch wait beside other transfers.
  [[nodiscard]] const transfer& made() const noexcept { return made_; }

  /// Waits for the endpoint; throws std::system_error naming what failed (errc::not_executor_safe
  /// on the executor's own thread while it is still being made).
  [[nodiscard]] endpoint get();

  /// Resumes on the awaiting coroutine's scheduler with the endpoint, or throws as get() does.
  using awaiter = ferry::detail::made_awaiter<pending_endpoint>;
  ///@{
  /// `co_await` yields the endpoint, or throws std::system_error as get() does.
  [[nodiscard]] awaiter operator co_await() & { return awaiter(*this); }
  [[nodiscard]] awaiter operator co_await() && { return awaiter(*this); }
  ///@}

 private:
  friend class worker;
  friend class listener;
  pending_endpoint(worker& w, std::unique_ptr<detail::request> r, std::string what);

  // An endpoint made and never taken is closed: here when it was made already, else by the executor
  // when it is (connection.hpp, hand_over and next_accept_waiter).
  void let_go() noexcept {
    if (endpoint_ || !result_) return;
    result_->dropped.store(true, std::memory_order_seq_cst);
    if (made_.state() == transfer_state::success) {
      try {
        (void)get();  // a handle, dropped with this object: the endpoint closes
      } catch (...) {
        // Out of memory for the handle: the worker closes the endpoint when it goes.
      }
    }
    endpoint_.reset();
    result_.reset();
  }

  worker* owner_ = nullptr;
  std::shared_ptr<detail::connect_result> result_;
  transfer made_;
  std::string what_;
  std::optional<endpoint> endpoint_;  // once get() has made a handle of it
};

/// A UCX context and worker, progressed by `exec` alone.
class worker {
 public:
  /// Makes the UCX context and worker and registers with `exec`, which must outlive it. Throws
  /// std::system_error naming what UCX refused (a transport it has none of, say).
  explicit worker(progress_executor& exec, worker_options options = {})
      : engine_(std::make_unique<detail::engine>(exec, options)) {
    exec.add_source(*engine_);
  }
  worker(const worker&) = delete;
  worker& operator=(const worker&) = delete;

  /// Every endpoint and listener of this worker must be gone; requests still queued fail with
  /// errc::worker_closed. Endpoints whose last handle went are given until their close_timeout to
  /// flush (endpoint::close()), then force-closed. Memory regions may outlive it (they keep the
  /// context).
  ~worker() {
    // The liveness timer is the executor's: disarmed on its thread, where it fires.
    if (!engine_->executor().on_executor_thread()) {
      try {
        // Also: every close published before this call has started by the time it returns.
        detail::on_executor(*engine_, "ferry::ucx::worker: stopping the liveness check", [this] {
          engine_->stop_liveness();
          return std::error_code{};
        });
        // Each close ends by its own deadline (the executor force-closes it then); the margin is
        // for an executor held off the CPU. Whatever is left, ~engine force-closes.
        const auto until =
            std::chrono::steady_clock::now() + engine_->close_timeout() + std::chrono::seconds(1);
        while (engine_->closing_endpoints() != 0 && std::chrono::steady_clock::now() < until) {
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
        // The executor's timers keep firing after remove_source: the engine's are cancelled on
        // its thread first, so that none runs while ~engine does.
        detail::on_executor(*engine_, "ferry::ucx::worker: stopping the timers", [this] {
          engine_->stop_timers();
          return std::error_code{};
        });
      } catch (...) {
        // No memory for the request: ~engine cancels the timer, after the executor let go.
      }
    }
    engine_->executor().remove_source(*engine_);
    if (const int open = open_handles_.load(); open != 0) {
      std::fprintf(stderr,
                   "ferry: ucx::worker destroyed with %d endpoint or listener handle(s) still "
                   "open on it; destroy them before their worker\n",
                   open);
      std::abort();
    }
  }

  /// This worker's address, as bytes for the user's own channel: a peer passes them to connect().
  [[nodiscard]] std::vector<std::byte> address() const {
    detail::record_writer w(detail::address_magic);
    w.put(engine_->self_identity());
    const auto& a = engine_->ucx_address();
    w.put(static_cast<std::uint32_t>(a.size()));
    w.put_bytes(a);
    return w.finish();
  }

  /// Registers user memory (it must outlive the region).
  [[nodiscard]] memory_region register_memory(std::span<std::byte> memory) {
    return memory_region(detail::map_region(engine_->context(), memory.data(), memory.size(), false));
  }

  /// Registers `length` bytes at `address` of memory of `type`: a GPU's (cudaMalloc, hipMalloc) or
  /// the host's. The memory must outlive the region. GPU memory needs a UCX built with support for
  /// it (--with-cuda, --with-rocm); the context is asked which types it supports before anything is
  /// mapped. Throws std::system_error with errc::memory_type_unsupported, naming the type, the byte
  /// count, what this UCX supports and how to get one that does, when it cannot: ferry never stages
  /// device memory through host memory behind the caller's back. Throws std::invalid_argument for
  /// zero bytes, and std::system_error with UCX's status when ucp_mem_map refuses the memory.
  [[nodiscard]] memory_region register_memory(void* address, std::size_t length,
                                              memory_type type) {
    return memory_region(detail::map_region(engine_->context(), address, length, false, type));
  }

  /// Memory UCX allocates: over shared memory a peer reaches it directly, without emulation.
  [[nodiscard]] memory_region allocate(std::size_t bytes) {
    return memory_region(detail::map_region(engine_->context(), nullptr, bytes, true));
  }

  /// An endpoint to the peer whose address() bytes the user carried over. Both sides usually connect
  /// to each other: a side receives notifications only from peers it has an endpoint to.
  [[nodiscard]] endpoint connect(std::span<const std::byte> peer_address) {
    detail::record_reader r(peer_address, detail::address_magic, "worker address");
    const auto peer = r.get<detail::peer_identity>();
    const auto n = r.get<std::uint32_t>();
    const std::vector<std::byte> ucx = r.get_bytes(n);
    r.done();
    auto s = std::make_shared<detail::endpoint_state>();
    s->peer = peer;
    detail::engine& e = *engine_;
    detail::on_executor(e, "ferry::ucx::worker::connect", [&] { return e.make_endpoint(s, ucx); });
    return wrap(std::move(s));
  }

  /// Connects to a listener at host:port, telling the peer the regions in `expose`; returns once
  /// the hellos have crossed (endpoint::peer_regions has the peer's). Through ferry's own handshake
  /// (detail/connection.hpp), not UCX's connection manager; any transports. Blocks: in a coroutine,
  /// co_await connect_async instead.
  template <class Rep = std::int64_t, class Period = std::nano>
  [[nodiscard]] endpoint connect(const std::string& host, std::uint16_t port,
                                 std::span<const memory_region> expose,
                                 std::chrono::duration<Rep, Period> timeout = std::chrono::seconds(10)) {
    detail::refuse_on_executor(*engine_, connect_what(host, port));
    return connect_async(host, port, expose, timeout).get();
  }

  /// connect, to co_await: the calling thread never blocks (timeout bounds the whole handshake).
  template <class Rep = std::int64_t, class Period = std::nano>
  [[nodiscard]] pending_endpoint connect_async(const std::string& host, std::uint16_t port,
      std::span<const memory_region> expose,
      std::chrono::duration<Rep, Period> timeout = std::chrono::seconds(10)) {
    auto r = std::make_unique<detail::request>();
    r->kind = detail::request_kind::connect;
    r->host = host;
    r->port = port;
    r->expose = describe(expose);
    detail::set_deadline(*r, timeout);
    return pending_endpoint(*this, std::move(r), connect_what(host, port));
  }

  /// Listens on host:port (port 0: any free one; listener::port tells which), telling each peer
  /// that connects the regions in `expose`.
  [[nodiscard]] listener listen(const std::string& host, std::uint16_t port,
                                std::span<const memory_region> expose);

  /// Notifications this worker refused because their sender already had
  /// worker_options::max_unclaimed_notifications waiting here that nobody had taken (any thread).
  [[nodiscard]] std::uint64_t notifications_refused() const noexcept {
    return engine_->notifications_refused();
  }

  /// Requests whose transfers ended (failed) when their endpoint was force-closed although UCX still
  /// held them: until UCX lets go (at the latest when this worker is destroyed) it may still read a
  /// put's source or write a get's destination, and their regions stay registered (any thread).
  [[nodiscard]] std::size_t requests_held_by_ucx() const noexcept { return engine_->abandoned(); }

  /// The completion source, for the executor only.
  [[nodiscard]] detail::engine& engine() noexcept { return *engine_; }

 private:
  friend class listener;

  friend class pending_endpoint;

  static std::vector<remote_region> describe(std::span<const memory_region> expose) {
    std::vector<remote_region> regions;
    for (const memory_region& m : expose) regions.push_back(m.describe());
    return regions;
  }
  static std::string connect_what(const std::string& host, std::uint16_t port) {
    return "ferry::ucx::worker::connect to " + host + ":" + std::to_string(port);
  }

  endpoint wrap(std::shared_ptr<detail::endpoint_state> s) {
    open_handles_.fetch_add(1);
    detail::engine* e = engine_.get();
    std::atomic<int>* open = &open_handles_;
    std::shared_ptr<detail::endpoint_state> target = s;
    // Closes the endpoint on the executor when the last handle goes.
    std::shared_ptr<void> last(static_cast<void*>(s.get()), [e, open, target](void*) mutable {
      auto* r = new (std::nothrow) detail::request;
      if (r != nullptr) {
        r->kind = detail::request_kind::close;
        r->eng = e;
        r->endpoint = std::move(target);
        e->publish(r);
      }
      open->fetch_sub(1);
    });
    return endpoint(std::move(s), std::move(last));
  }

  std::unique_ptr<detail::engine> engine_;
  std::atomic<int> open_handles_{0};
};

/// Accepts peers that connect by host and port (worker::listen), handing each the regions it
/// exposes. Destroy it before its worker.
class listener {
 public:
  /// The port it listens on (the one chosen, when listen was given 0).
  [[nodiscard]] std::uint16_t port() const noexcept { return state_->port; }

  /// The next peer that connected and told its regions; waits up to `timeout`. Blocks: in a
  /// coroutine, co_await accept_async instead.
  template <class Rep = std::int64_t, class Period = std::nano>
  [[nodiscard]] endpoint accept(std::chrono::duration<Rep, Period> timeout = std::chrono::seconds(10)) {
    detail::refuse_on_executor(owner_->engine(), "ferry::ucx::listener::accept");
    return accept_async(timeout).get();
  }

  /// accept without blocking: a pending_endpoint to co_await (or get()).
  template <class Rep = std::int64_t, class Period = std::nano>
  [[nodiscard]] pending_endpoint accept_async(
      std::chrono::duration<Rep, Period> timeout = std::chrono::seconds(10)) {
    auto r = std::make_unique<detail::request>();
    r->kind = detail::request_kind::accept;
    r->listener = state_;
    detail::set_deadline(*r, timeout);
    return pending_endpoint(*owner_, std::move(r), "ferry::ucx::listener::accept");
  }

  /// Takes over `other`'s listening socket.
  listener(listener&& other) noexcept
      : owner_(other.owner_), state_(std::move(other.state_)) {}
  listener(const listener&) = delete;
  listener& operator=(const listener&) = delete;
  listener& operator=(listener&&) = delete;

  /// Stops listening (on the executor; from its own thread the worker does it when it goes).
  ~listener() {
    if (!state_) return;
    detail::engine& e = owner_->engine();
    std::shared_ptr<detail::listener_state> s = state_;
    try {
      detail::on_executor(e, "ferry::ucx::listener::~listener", [&e, s]() -> std::error_code {
        e.close_listener(*s);
        return {};
      });
    } catch (...) {
      // On the executor's own thread, or out of memory: the worker closes it when it goes.
    }
    owner_->open_handles_.fetch_sub(1);
  }

 private:
  friend class worker;
  listener(worker* owner, std::shared_ptr<detail::listener_state> s) noexcept
      : owner_(owner), state_(std::move(s)) {}

  worker* owner_;
  std::shared_ptr<detail::listener_state> state_;
};

inline listener worker::listen(const std::string& host, std::uint16_t port,
                               std::span<const memory_region> expose) {
  auto s = std::make_shared<detail::listener_state>();
  s->expose = describe(expose);
  detail::engine& e = *engine_;
  detail::on_executor(e, "ferry::ucx::worker::listen on " + host + ":" + std::to_string(port),
                      [&] { return e.make_listener(s, host, port); });
  open_handles_.fetch_add(1);
  return listener(this, std::move(s));
}

inline pending_endpoint::pending_endpoint(worker& w, std::unique_ptr<detail::request> r,
                                          std::string what)
    : owner_(&w), result_(std::make_shared<detail::connect_result>()), what_(std::move(what)) {
  r->endpoint_out = &result_->out;
  r->call_error_out = &result_->error;
  r->result = result_;
  made_ = detail::start_one(w.engine(), std::move(r));
}

inline endpoint pending_endpoint::get() {
  if (endpoint_) return *endpoint_;
  if (!made_.done()) {
    detail::refuse_on_executor(owner_->engine(), what_);
    (void)made_.wait();
  }
  detail::check_one(made_, what_, result_->error);
  endpoint_ = owner_->wrap(std::exchange(result_->out, nullptr));
  return *endpoint_;
}

}  // namespace ferry::ucx

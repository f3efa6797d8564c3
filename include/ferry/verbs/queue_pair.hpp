#pragma once
// An RC queue pair: what a user posts on. Requests are checked and admitted here, on the
// submitter's thread (the device's executor posts them; device.hpp).

#include <infiniband/verbs.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <system_error>
#include <utility>

#include "ferry/detail/status_block.hpp"
#include "ferry/detail/timeout.hpp"
#include "ferry/errors.hpp"
#include "ferry/post.hpp"
#include "ferry/transfer.hpp"
#include "ferry/verbs/detail/op.hpp"
#include "ferry/verbs/detail/queue_pair_state.hpp"
#include "ferry/verbs/errors.hpp"
#include "ferry/verbs/memory_region.hpp"
#include "ferry/verbs/options.hpp"
#include "ferry/verbs/remote.hpp"

namespace ferry::verbs {

template <class P>
class basic_device;

/// An RC queue pair. Destroying the handle moves it to the error state: requests still in flight
/// fail with errc::queue_pair_closed, and the queue pair itself is destroyed once the adapter has
/// flushed them.
template <class P>
class basic_queue_pair {
 public:
  using local_slice = basic_local_slice<P>;  ///< a range of a local registered region
  using rdma_block = basic_rdma_block<P>;    ///< one member of a batch

  /// An empty handle, with no queue pair; only assignment and destruction are valid on it.
  basic_queue_pair() noexcept = default;

  /// A new RC queue pair on `device`, to be connected (connect(), or the handshake). Throws
  /// std::invalid_argument for options out of range, std::system_error when the adapter refuses it.
  basic_queue_pair(basic_device<P>& device, queue_pair_options options = {})
      : state_(device.create_queue_pair(options)) {}

  /// Takes `other`'s queue pair, leaving `other` empty.
  basic_queue_pair(basic_queue_pair&& other) noexcept : state_(std::exchange(other.state_, nullptr)) {}
  /// Closes its own queue pair (as the destructor does) and takes `other`'s.
  basic_queue_pair& operator=(basic_queue_pair&& other) noexcept {
    basic_queue_pair(std::move(other)).swap(*this);
    return *this;
  }
  /// Closes the queue pair: requests in flight fail with errc::queue_pair_closed once flushed.
  ~basic_queue_pair() {
    if (state_ != nullptr) state_->device->close_queue_pair(state_);
  }
  /// Exchanges the queue pairs the two handles refer to.
  void swap(basic_queue_pair& other) noexcept { std::swap(state_, other.state_); }

  /// What the peer needs to connect to this queue pair.
  [[nodiscard]] endpoint_info local_info() const noexcept { return state_->device->local_info(state_); }

  /// Brings the queue pair to RTS towards `remote`. Throws std::system_error naming the failed step.
  void connect(const endpoint_info& remote) { state_->device->connect(state_, remote); }

  /// Tells the queue pair that its peer has connected too (the handshake does this itself), so that
  /// peer checks may start before anything has come back from it: a check towards a peer not yet
  /// connected would fail and take the queue pair down.
  void mark_peer_connected() noexcept { state_->peer_up.store(true, std::memory_order_relaxed); }

  /// The queue pair's number (what local_info() tells the peer).
  [[nodiscard]] std::uint32_t qp_num() const noexcept { return state_->qp_num; }
  /// The provider's handle (an ibv_qp* for real_provider); the queue pair still owns it.
  [[nodiscard]] typename P::qp_handle native_handle() const noexcept { return state_->qp; }

  /// Empty while usable; otherwise why nothing more can be posted.
  [[nodiscard]] std::error_code error() const noexcept {
    const int b = state_->broken.load(std::memory_order_acquire);
    return b == 0 ? std::error_code{} : state_->broken_error(b);
  }

  /// Ends the queue pair at once for a reason the caller knows (a directory showed its peer restart
  /// or go; named_peer calls this): it moves to the error state, and every request on it, posted or
  /// made later, fails with `why` (errc::severed when empty). Does not wait; any thread.
  void sever(std::error_code why) const {
    state_->device->sever_queue_pair(state_, why ? why : make_error_code(errc::severed));
  }

  /// Work requests the send queue holds (queue_pair_options::send_depth, or less where the adapter
  /// granted less): the largest batch a read_batch or write_batch takes.
  [[nodiscard]] std::uint32_t send_depth() const noexcept { return state_->send_depth; }

  /// Free send-queue slots right now.
  [[nodiscard]] std::int64_t send_credits() const noexcept {
    return state_->credits.load(std::memory_order_relaxed);
  }

  /// One-sided WRITE of `src` into the peer's `dst` (same length). `timeout` (negative: none) bounds
  /// the wait for the completion. When the send queue is full these back off up to the queue pair's
  /// admission timeout; the try_ forms return nullopt instead.
  template <class Rep = std::int64_t, class Period = std::nano>
  [[nodiscard]] transfer write(local_slice src, remote_slice dst,
                               std::chrono::duration<Rep, Period> timeout = std::chrono::nanoseconds(-1)) {
    return admitted([&] { return try_write(src, dst, timeout); });
  }

  /// write() without backing off: nullopt when the send queue is full.
  template <class Rep = std::int64_t, class Period = std::nano>
  [[nodiscard]] std::optional<transfer> try_write(local_slice src, remote_slice dst,
      std::chrono::duration<Rep, Period> timeout = std::chrono::nanoseconds(-1)) {
    const rdma_block b{src, dst};
    return try_single(IBV_WR_RDMA_WRITE, b, detail_timeout(timeout));
  }

  /// One-sided READ of the peer's `src` into `dst` (same length).
  template <class Rep = std::int64_t, class Period = std::nano>
  [[nodiscard]] transfer read(local_slice dst, remote_slice src,
                              std::chrono::duration<Rep, Period> timeout = std::chrono::nanoseconds(-1)) {
    return admitted([&] { return try_read(dst, src, timeout); });
  }

  /// read() without backing off: nullopt when the send queue is full.
  template <class Rep = std::int64_t, class Period = std::nano>
  [[nodiscard]] std::optional<transfer> try_read(local_slice dst, remote_slice src,
      std::chrono::duration<Rep, Period> timeout = std::chrono::nanoseconds(-1)) {
    const rdma_block b{dst, src};
    return try_single(IBV_WR_RDMA_READ, b, detail_timeout(timeout));
  }

  /// A batch posted as one linked list of work requests, only the last signalled, with one deadline:
  /// out[i] is blocks[i]'s transfer. An error completion fails every member still pending.
  template <class Rep = std::int64_t, class Period = std::nano>
  void write_batch(std::span<const rdma_block> blocks, std::span<transfer> out,
                   std::chrono::duration<Rep, Period> timeout = std::chrono::nanoseconds(-1)) {
    batch(IBV_WR_RDMA_WRITE, blocks, out, detail_timeout(timeout));
  }

  /// write_batch's READ counterpart: each block's remote slice is read into its local one.
  template <class Rep = std::int64_t, class Period = std::nano>
  void read_batch(std::span<const rdma_block> blocks, std::span<transfer> out,
                  std::chrono::duration<Rep, Period> timeout = std::chrono::nanoseconds(-1)) {
    batch(IBV_WR_RDMA_READ, blocks, out, detail_timeout(timeout));
  }

  /// A small inline SEND carrying `value`. RC delivers it after every WRITE posted before it on this
  /// queue pair has landed, so the peer's receive_notification tells it that its data is there. It
  /// covers only WRITEs the queue pair accepted: one whose transfer came back already failed (bad
  /// input, a full send queue) never went, so check those before notifying.
  template <class Rep = std::int64_t, class Period = std::nano>
  [[nodiscard]] transfer send_notification(std::uint64_t value,
      std::chrono::duration<Rep, Period> timeout = std::chrono::nanoseconds(-1)) {
    const ferry::detail::timeout t = detail_timeout(timeout);
    return admitted([&]() -> std::optional<transfer> {
      if (std::optional<transfer> refused = refuse_early()) return refused;
      if (!reserve(1)) return std::nullopt;
      op_body* o = nullptr;
      transfer tr;
      try {
        o = make_op(op_kind::notify, t);
        o->payload = value;
        o->sge.addr = reinterpret_cast<std::uintptr_t>(&o->payload);
        o->sge.length = sizeof o->payload;
        o->wr.opcode = IBV_WR_SEND;
        o->wr.send_flags = IBV_SEND_INLINE | IBV_SEND_SIGNALED;
        o->wr.sg_list = &o->sge;
        o->wr.num_sge = 1;
        o->wr.wr_id = reinterpret_cast<std::uintptr_t>(o);
        tr = attach(o);
      } catch (...) {
        state_->credits.fetch_add(1, std::memory_order_relaxed);
        throw;
      }
      state_->device->publish(o);
      return tr;
    });
  }

  /// The next notification the peer sent, in order; `value` is written before the transfer succeeds,
  /// so it must stay valid until the transfer is terminal (a deadline bounds that wait).
  template <class Rep = std::int64_t, class Period = std::nano>
  [[nodiscard]] transfer receive_notification(std::uint64_t& value,
      std::chrono::duration<Rep, Period> timeout = std::chrono::nanoseconds(-1)) {
    op_body* o = make_op(op_kind::wait_notification, detail_timeout(timeout));
    o->value_out = &value;
    transfer tr = attach(o);
    state_->device->publish(o);
    return tr;
  }

 private:
  using op_body = detail::op_body<P>;
  using op = detail::op<P>;
  using op_kind = detail::op_kind;

  template <class Rep, class Period>
  static ferry::detail::timeout detail_timeout(std::chrono::duration<Rep, Period> d) noexcept {
    return ferry::detail::make_timeout(d);
  }

  // On the executor's own thread (a continuation resumed inline) waiting would only stop the
  // completions that free room, so there the request is tried once.
  template <class Try>
  transfer admitted(Try&& attempt) {
    if (state_->device->executor().on_executor_thread()) {
      if (std::optional<transfer> t = attempt()) return std::move(*t);
      return failed(make_error_code(ferry::errc::submission_queue_full));
    }
    return post_with_backoff(std::forward<Try>(attempt),
                             ferry::detail::deadline_after(state_->admission_timeout));
  }

  // A request refused before it takes a slot: the device is dead, the queue pair broken or never
  // connected.
  [[nodiscard]] std::optional<transfer> refuse_early() const {
    if (const std::error_code f = state_->device->failure(); f) return failed(f);
    if (const std::error_code ec = error(); ec) return failed(ec);
    switch (state_->lifecycle.load()) {
      case detail::qp_state_kind::created:
        return failed(make_error_code(errc::not_connected));
      case detail::qp_state_kind::broken:
      case detail::qp_state_kind::closing:
        // Broken since error() looked: the reason was stored before the state.
        return failed(error());
      case detail::qp_state_kind::connected:
        break;
    }
    return std::nullopt;
  }

  [[nodiscard]] static transfer failed(std::error_code ec) {
    return make_completed_transfer(transfer_state::failed, ec);
  }

  [[nodiscard]] bool reserve(std::int64_t n) noexcept {
    std::int64_t have = state_->credits.load(std::memory_order_relaxed);
    do {
      if (have < n) return false;
    } while (!state_->credits.compare_exchange_weak(have, have - n, std::memory_order_acquire,
                                                    std::memory_order_relaxed));
    return true;
  }

  // Why a block cannot be posted, if it cannot.
  [[nodiscard]] std::error_code check(const rdma_block& b) const noexcept {
    if (b.local.size() == 0) return make_error_code(ferry::errc::empty_buffer);
    if (b.local.region_ == nullptr || b.local.region_->device != state_->device) {
      return make_error_code(errc::outside_local_region);
    }
    if (b.remote.length != b.local.size()) return make_error_code(errc::length_mismatch);
    if (b.local.size() > max_message_bytes) return make_error_code(errc::message_too_large);
    return {};
  }

  op_body* make_op(op_kind kind, const ferry::detail::timeout& t) {
    op_body* o = op::make(kind);
    o->qp = state_;
    if (!t.is_forever()) {
      o->has_deadline = true;
      o->timer.deadline = t.is_look() ? ferry::detail::clock::now() : t.deadline();
    }
    return o;
  }

  void fill(op_body* o, ibv_wr_opcode opcode, const rdma_block& b) noexcept {
    o->region = b.local.region_;
    o->region->add_ref();
    o->sge.addr = reinterpret_cast<std::uintptr_t>(b.local.data());
    o->sge.length = static_cast<std::uint32_t>(b.local.size());
    o->sge.lkey = b.local.region_->lkey;
    o->wr.wr_id = reinterpret_cast<std::uintptr_t>(o);
    o->wr.opcode = opcode;
    o->wr.sg_list = &o->sge;
    o->wr.num_sge = 1;
    o->wr.wr.rdma.remote_addr = b.remote.address;
    o->wr.wr.rdma.rkey = b.remote.rkey;
  }

  static transfer attach(op_body* o) {
    ferry::detail::status_block* s = nullptr;
    try {
      s = ferry::detail::status_block::make();
    } catch (...) {
      if (o->region != nullptr) o->region->release();
      op::free(o);
      throw;
    }
    o->status = s;
    return transfer(ferry::detail::adopt, s);
  }

  std::optional<transfer> try_single(ibv_wr_opcode opcode, const rdma_block& b,
                                     const ferry::detail::timeout& t) {
    if (const std::error_code ec = check(b); ec) return failed(ec);
    if (std::optional<transfer> refused = refuse_early()) return refused;
    if (!reserve(1)) return std::nullopt;
    op_body* o = nullptr;
    transfer tr;
    try {
      o = make_op(opcode == IBV_WR_RDMA_READ ? op_kind::read : op_kind::write, t);
      fill(o, opcode, b);
      o->wr.send_flags = IBV_SEND_SIGNALED;
      tr = attach(o);
    } catch (...) {
      state_->credits.fetch_add(1, std::memory_order_relaxed);  // the slot is not used after all
      throw;
    }
    state_->device->publish(o);
    return tr;
  }

  void batch(ibv_wr_opcode opcode, std::span<const rdma_block> blocks, std::span<transfer> out,
             const ferry::detail::timeout& t) {
    if (out.size() < blocks.size()) {
      throw std::invalid_argument("ferry::verbs::queue_pair: batch output span holds " +
                                  std::to_string(out.size()) + " transfers for " +
                                  std::to_string(blocks.size()) + " blocks");
    }
    // Members refused on their own merits fail alone; the rest form the unit.
    std::int64_t n = 0;
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      if (const std::error_code ec = check(blocks[i]); ec) {
        out[i] = failed(ec);
      } else {
        ++n;
      }
    }
    if (n == 0) return;
    auto refuse_all = [&](std::error_code ec) {
      for (std::size_t i = 0; i < blocks.size(); ++i) {
        if (!check(blocks[i])) out[i] = failed(ec);
      }
    };
    if (n > static_cast<std::int64_t>(state_->send_depth)) {
      return refuse_all(make_error_code(errc::batch_exceeds_send_queue));
    }
    std::optional<transfer> admitted_one = admitted_batch(n);
    if (admitted_one) return refuse_all(admitted_one->error());
    const op_kind kind = opcode == IBV_WR_RDMA_READ ? op_kind::read : op_kind::write;
    op_body* lead = nullptr;
    op_body* last = nullptr;
    std::uint32_t made = 0;
    try {
      for (std::size_t i = 0; i < blocks.size(); ++i) {
        if (check(blocks[i])) continue;
        op_body* o = make_op(kind, lead == nullptr ? t : ferry::detail::timeout{});
        fill(o, opcode, blocks[i]);
        out[i] = attach(o);
        ++made;
        if (lead == nullptr) {
          lead = o;
        } else {
          last->unit_next = o;
          o->lead = lead;
        }
        last = o;
      }
    } catch (...) {
      // Out of memory part-way: what was prepared still goes, so every handed-out transfer ends.
      state_->credits.fetch_add(n - made, std::memory_order_relaxed);
      if (lead != nullptr) post_unit(lead, last, made);
      throw;
    }
    post_unit(lead, last, made);
  }

  void post_unit(op_body* lead, op_body* last, std::uint32_t size) noexcept {
    lead->last = last;
    lead->unit_size = size;
    last->wr.send_flags = IBV_SEND_SIGNALED;
    state_->device->publish(lead);
  }

  // Reserves `n` slots, backing off up to the admission timeout. nullopt once they are reserved;
  // otherwise a failed transfer saying why.
  std::optional<transfer> admitted_batch(std::int64_t n) {
    bool got = false;
    transfer verdict = admitted([&]() -> std::optional<transfer> {
      if (std::optional<transfer> refused = refuse_early()) return refused;
      if (!reserve(n)) return std::nullopt;
      got = true;
      return transfer{};
    });
    if (got) return std::nullopt;
    return verdict;
  }

  detail::qp_state<P>* state_ = nullptr;
};

}  // namespace ferry::verbs


#pragma once
// The join behind wait_all, when_all and drain: one allocation per batch wait, holding one waiter node
// per member inline.
//
// Everything the verdict depends on lives in one 64-bit word: the number of members not yet terminal
// (plus one for the registering thread, cppcoro's N+1 trick), and flags REGISTERED, FAILED, TIMED_OUT
// and CLAIMED. Every event (a member ends, registration finishes, the deadline passes) is one CAS on
// that word, and the CAS that first makes the verdict decidable also sets CLAIMED: exactly one actor
// decides the verdict and delivers it, whichever thread it runs on.
//
// Lifetime: the join is reference counted (the waiting side, each member still linked into a status,
// the armed timer), so a completion that arrives after the verdict touches only the join, never the
// waiting coroutine's frame or the waiting thread's stack, and the verdict path never has to unlink N
// nodes before it returns: the short-circuit costs the same for 1 member and for 65536.
//
// What a member that never ends keeps: once the waiting side has finished, nodes still linked are
// swept off their statuses at the wait's deadline (by the timer that serves it, or at once by
// finish() when the deadline has already passed; a wait without a deadline is swept at once on the
// process-wide timer thread). So a lost completion pins its own status block past the deadline, not
// the join and its N nodes. Each linked node holds a reference on its status for that sweep, since
// the waiting side may have let go of the transfers by then.

#include <algorithm>
#include <atomic>
#include <cassert>
#include <coroutine>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <new>
#include <optional>
#include <span>

#include "ferry/batch_result.hpp"
#include "ferry/detail/block_pool.hpp"
#include "ferry/detail/futex.hpp"
#include "ferry/detail/spin.hpp"
#include "ferry/detail/status_block.hpp"
#include "ferry/detail/timer_service.hpp"
#include "ferry/poll_all.hpp"
#include "ferry/transfer.hpp"

namespace ferry::detail {

enum class batch_mode : std::uint8_t {
  short_circuit,  // wait_all / when_all: the first failure decides
  drain,          // drain: only "every member terminal" or the deadline decides
};

inline constexpr std::size_t max_batch_members = std::numeric_limits<std::uint32_t>::max() - 1;

class batch_join;

// The join's deadline: a timer node that knows its join.
struct join_deadline : timer_node {
  batch_join* owner = nullptr;
};

// One member's node. While linked it holds a transfer reference on `status`; the notification (a
// completion, or another waiter's sweep of expired nodes) and the join's own sweep agree through
// `handoff` on which of them gives that reference back.
struct member_node : waiter {
  status_block* status = nullptr;  // null: never linked
  std::atomic<std::uint8_t> handoff{0};
};

class batch_join {
 public:
  // Delivers a verdict decided by another thread: posts the coroutine, or wakes the blocked thread.
  using deliver_fn = void (*)(batch_join*) noexcept;

  // Throws std::bad_alloc. Joins of up to 2048 members come from pools, so a steady stream of batch
  // waits allocates nothing.
  [[nodiscard]] static batch_join* create(std::size_t members, batch_mode mode);

  batch_join(const batch_join&) = delete;
  batch_join& operator=(const batch_join&) = delete;

  // For a coroutine: the verdict is delivered by posting `h` through `s`. The join keeps its own
  // copy, so delivering touches nothing in the awaiting coroutine's frame.
  void deliver_to(std::coroutine_handle<> h, any_scheduler s) noexcept {
    continuation_ = h;
    scheduler_ = std::move(s);
    deliver_ = &post_continuation;
  }

  // For a blocked thread: the verdict is delivered through done_ (see wait_blocking).
  void deliver_to_sleeper() noexcept { deliver_ = &wake_sleeper; }

  // Arms the deadline (when `timers` is given), links every member and finishes registration.
  // Returns true when the verdict was decided during the call: the caller then must neither suspend
  // nor sleep. When it returns false, another thread may deliver the verdict at any moment.
  // Throws std::bad_alloc (only from arming the timer, before anything is linked).
  bool start(std::span<const transfer> members, timer_service* timers,
             clock::time_point deadline) {
    if (timers != nullptr) {
      timer_.deadline = deadline;
      timer_.fire = &on_deadline;
      timer_.owner = this;
      refs_.fetch_add(1, std::memory_order_relaxed);  // the armed timer's reference
      try {
        timers->arm(timer_);
      } catch (...) {
        refs_.fetch_sub(1, std::memory_order_relaxed);
        throw;
      }
      timers_ = timers;
    }
    deadline_ = deadline;
    // Pre-count one reference per member, and give back those that were never linked in one step.
    refs_.fetch_add(members.size(), std::memory_order_relaxed);
    std::size_t unlinked = 0;
    for (std::size_t i = 0; i < members.size(); ++i) {
      member_node& node = *::new (static_cast<void*>(nodes() + i)) member_node;
      node.index = static_cast<std::uint32_t>(i);
      node.notify = &on_member;
      node.expired = &is_expired;
      status_block* s = members[i].status();
      // Set before linking: a notification may read it as soon as the node is linked.
      node.status = s;
      if (s != nullptr && s->add_holding_waiter(&node)) continue;
      node.status = nullptr;
      ++unlinked;
      if (s == nullptr) {
        member_ended(i, {transfer_state::failed, make_error_code(errc::empty_transfer), 0});
      } else {
        member_ended(i, s->event());
      }
    }
    if (unlinked != 0) refs_.fetch_sub(unlinked, std::memory_order_relaxed);
    return advance(event::registered);
  }

  // Blocks until the verdict is delivered or `deadline` passes (null: none). Returns once the result
  // is readable.
  void wait_blocking(const clock::time_point* deadline) noexcept {
    if (look_before_sleep([this] { return done_.load(std::memory_order_acquire) != 0; })) return;
    while (done_.load(std::memory_order_acquire) == 0) {
      if (futex_wait(done_, 0, deadline)) continue;
      // The deadline passed. If the timeout decides, the result is ours to read now; otherwise the
      // actor that decided is about to publish done_.
      if (advance(event::timeout)) return;
      deadline = nullptr;
    }
  }

  // The verdict, worked out on the waiting side from the word as it was decided and the failure
  // record (see settle()).
  [[nodiscard]] batch_result result(std::span<const transfer> members) noexcept {
    const std::uint64_t word = decided_;
    batch_result r;
    r.pending = static_cast<std::size_t>(word & count_mask);
    const bool failure_known = read_first_failure(r);
    // In short-circuit mode a recorded failure wins even if its own CAS came after the decision:
    // a verdict never says timed_out next to a known failure.
    if ((word & failed) != 0 || (mode_ == batch_mode::short_circuit && failure_known)) {
      r.verdict = verdict::failed;
    } else if (r.pending == 0) {
      r.verdict = failure_known ? verdict::failed : verdict::success;
    } else {
      r.verdict = verdict::timed_out;
    }
    settle(r, members);
    return r;
  }

  // The deadline, brought forward: a stop request on the waiting side (an Asio cancellation). It
  // decides timed_out unless something decided first, and delivers as the deadline does; true when
  // this call decided. Only between a start() that returned false and finish(), by the waiting
  // side. A timer still armed is taken off and counted as fired, so that finish() sweeps the nodes
  // at once, as after a deadline that passed; a timer already firing decides or loses through the
  // same CAS on its own thread.
  bool expire_now() noexcept {
    const bool disarmed = timers_ != nullptr && timers_->cancel(timer_);
    const bool decides = advance(event::timeout);
    if (decides) deliver_(this);
    if (disarmed) {
      // As on_deadline does; finish() has not run, so the sweep is left to it.
      sweep_.fetch_or(fired, std::memory_order_acq_rel);
      release();  // the timer's; the waiting side's is still held
    }
    return decides;
  }

  // The waiting side is finished with the join: disarm the timer and drop the waiter's reference.
  // If no verdict was delivered (a coroutine destroyed while suspended), claim it first so that no
  // completion tries to resume what is gone. Members still linked are left to be swept at the
  // deadline (see the top of this file), so that those which end meanwhile are simply notified and
  // only the ones that do not end cost a sweep.
  void finish() noexcept {
    word_.fetch_or(claimed, std::memory_order_acq_rel);
    if (timers_ != nullptr) {
      if ((sweep_.fetch_or(finished, std::memory_order_acq_rel) & fired) != 0) {
        sweep();  // the timer ran before this: the sweep is ours
      }
    } else if (refs_.load(std::memory_order_acquire) > 1) {
      hand_over_linked_members();
    }
    release_disarming();
  }

 private:
  enum class event : std::uint8_t { success, failure, registered, timeout };

  static constexpr std::uint64_t count_mask = (std::uint64_t{1} << 40) - 1;
  static constexpr std::uint64_t registered = std::uint64_t{1} << 60;
  static constexpr std::uint64_t failed = std::uint64_t{1} << 61;
  static constexpr std::uint64_t timed_out = std::uint64_t{1} << 62;
  static constexpr std::uint64_t claimed = std::uint64_t{1} << 63;

  // sweep_ flags.
  static constexpr std::uint8_t finished = 1;  // the waiting side is done
  static constexpr std::uint8_t fired = 2;     // the deadline timer ran
  // member_node::handoff values.
  static constexpr std::uint8_t notified = 1;
  static constexpr std::uint8_t sweeping = 2;

  batch_join(std::size_t members, batch_mode mode, std::uint8_t size_class) noexcept
      : word_(members + 1),
        mode_(mode),
        size_class_(size_class),
        members_(static_cast<std::uint32_t>(members)) {}

  ~batch_join() = default;

  member_node* nodes() noexcept {
    return std::launder(reinterpret_cast<member_node*>(reinterpret_cast<unsigned char*>(this) +
                                                       sizeof(batch_join)));
  }

  static batch_join* owner_of(const waiter* w) noexcept {
    const member_node* first = static_cast<const member_node*>(w) - w->index;
    return reinterpret_cast<batch_join*>(
        const_cast<unsigned char*>(reinterpret_cast<const unsigned char*>(first)) -
        sizeof(batch_join));
  }

  void member_ended(std::size_t index, const completion_event& ev) noexcept {
    bool decided = false;
    if (ev.state == transfer_state::success) {
      decided = advance(event::success);
    } else {
      record_failure(index, ev);
      decided = advance(event::failure);
    }
    if (decided) deliver_(this);
  }

  // During start() the REGISTERED flag is still clear, so no member event can claim: deliver_ is
  // never called from inside start().
  void record_failure(std::size_t index, const completion_event& ev) noexcept {
    while (failure_lock_.exchange(true, std::memory_order_acquire)) cpu_relax();
    if (first_failed_ == no_failure || ev.sequence < first_sequence_) {
      first_failed_ = index;
      first_sequence_ = ev.sequence;
      first_error_ = ev.error;
    }
    failure_lock_.store(false, std::memory_order_release);
  }

  // Copies the failure record into `r`; false when there is none.
  bool read_first_failure(batch_result& r) noexcept {
    while (failure_lock_.exchange(true, std::memory_order_acquire)) cpu_relax();
    const bool known = first_failed_ != no_failure;
    if (known) {
      r.first_failed = first_failed_;
      r.error = first_error_;
    }
    failure_lock_.store(false, std::memory_order_release);
    return known;
  }

  // One CAS per event. Returns true when this event decided the verdict (and recorded the word).
  bool advance(event e) noexcept {
    std::uint64_t old = word_.load(std::memory_order_relaxed);
    std::uint64_t next = 0;
    bool decides = false;
    do {
      next = old;
      if (e != event::timeout) --next;
      if (e == event::failure && mode_ == batch_mode::short_circuit) next |= failed;
      if (e == event::registered) next |= registered;
      if (e == event::timeout) next |= timed_out;
      decides = (old & claimed) == 0 && (next & registered) != 0 &&
                ((next & (failed | timed_out)) != 0 || (next & count_mask) == 0);
      if (decides) next |= claimed;
      // acq_rel: a decider must see every failure recorded before an earlier event's CAS.
    } while (!word_.compare_exchange_weak(old, next, std::memory_order_acq_rel,
                                          std::memory_order_relaxed));
    // Read by the waiting side once the verdict has reached it (through the post or done_).
    if (decides) decided_ = next;
    return decides;
  }

  // Two corrections made by the waiting side, which still holds the members, so that neither costs
  // the verdict path anything:
  //  - a failure is reported as the earliest in time, even one whose completer was preempted
  //    between taking its number and publishing (name_first_failure in poll_all.hpp; rare:
  //    concurrent failures; one pass over the members);
  //  - a timeout is confirmed by a look at the members: a completion published before the deadline
  //    whose notification was still on its way decides instead (rare: the timeout path), and a
  //    failure found so is named as any other.
  void settle(batch_result& r, std::span<const transfer> members) noexcept {
    if (r.verdict == verdict::timed_out) {
      const batch_result look = poll_all(members);
      const bool decided = mode_ == batch_mode::short_circuit ? look.verdict != verdict::pending
                                                              : look.pending == 0;
      if (!decided) return;
      r = look;
    }
    if (r.verdict == verdict::failed) name_first_failure(r, members);
  }

  static void on_member(waiter* w, const completion_event& ev) noexcept {
    batch_join* self = owner_of(w);
    auto* node = static_cast<member_node*>(w);
    // A swept node (state pending) belongs to a wait that already has its verdict.
    if (ev.state != transfer_state::pending) self->member_ended(w->index, ev);
    // The status is alive here (its completer, or the waiter whose registration swept us, holds
    // it). A join sweep that already looked at this node gives the reference back itself.
    status_block* s = node->status;
    if (node->handoff.exchange(notified, std::memory_order_acq_rel) != sweeping) {
      s->release_transfer_ref();
    }
    self->release_disarming();
  }

  static bool is_expired(const waiter* w) noexcept {
    return (owner_of(w)->word_.load(std::memory_order_acquire) & claimed) != 0;
  }

  static void on_deadline(timer_node* t) noexcept {
    batch_join* self = static_cast<join_deadline*>(t)->owner;
    if (self->advance(event::timeout)) self->deliver_(self);
    // Whichever of this and finish() comes second sweeps.
    if ((self->sweep_.fetch_or(fired, std::memory_order_acq_rel) & finished) != 0) self->sweep();
    self->release();
  }

  // finish() found members still linked on a wait without a timer: sweep them now if the deadline
  // has passed, or arm the process-wide timer to do it at the deadline (a blocking wait's deadline
  // is a futex timeout), or at once, off this thread, for a wait without a deadline.
  void hand_over_linked_members() noexcept {
    const clock::time_point now = clock::now();
    const bool bounded = deadline_ != clock::time_point{};
    if (bounded && deadline_ <= now) {
      sweep();
      return;
    }
    try {
      timer_service& timers = process_timers();
      timer_.deadline = bounded ? deadline_ : now;
      timer_.fire = &on_deadline;
      timer_.owner = this;
      refs_.fetch_add(1, std::memory_order_relaxed);  // the armed timer's reference
      try {
        timers.arm(timer_);
      } catch (...) {
        refs_.fetch_sub(1, std::memory_order_relaxed);
        throw;
      }
      // Read only by a notification that saw `finished`, published below.
      timers_ = &timers;
    } catch (...) {
      sweep();  // no timer thread, or no memory for its heap: sweep here instead
      return;
    }
    if ((sweep_.fetch_or(finished, std::memory_order_acq_rel) & fired) != 0) sweep();
  }

  // Takes every node still linked off its status. The caller holds a reference to the join. A node
  // whose notification has started is left to it; its status reference is given back by whichever
  // of the two looks at `handoff` second, since the notification may end, and its completer let go
  // of the status, while this thread is still at remove_waiter.
  void sweep() noexcept {
    member_node* n = nodes();
    std::size_t removed = 0;
    for (std::uint32_t i = 0; i < members_; ++i) {
      status_block* s = n[i].status;
      if (s == nullptr) continue;
      if (n[i].handoff.exchange(sweeping, std::memory_order_acq_rel) == notified) continue;
      if (s->remove_waiter(&n[i])) ++removed;
      s->release_transfer_ref();
    }
    // The removed nodes' references; never the last, since the caller holds one, so this is a
    // plain decrement rather than release().
    if (removed != 0) {
      [[maybe_unused]] const std::size_t before =
          refs_.fetch_sub(removed, std::memory_order_acq_rel);
      assert(before > removed);
    }
  }

  // The waiting side's reference (in finish()) or a notified node's. When the one other reference
  // left is a timer armed to sweep, nothing is linked any more and the waiting side is done: the
  // timer is cancelled and the join freed now, not at the deadline, so that the executor owning the
  // timer may go as soon as the wait has returned and its completions have been delivered.
  //  - Decided on the count as this thread's own CAS sees it, so that of the waiting side and the
  //    last node, the second always sees the first gone (a load followed by a separate decrement
  //    let each see the other still holding, and neither cancelled).
  //  - Decided while still holding this reference: after giving it back, the timer's firing or
  //    another holder may free the join at once.
  //  - A cancel that succeeds proves the timer held a reference, so with a count of 2 the other is
  //    the timer's and no node is left for it to sweep. A blocking wait's hand-over may add the
  //    timer's reference between our load and our cancel, with the waiting side still holding:
  //    then the fetch_sub leaves the waiting side's reference, and its release frees the join.
  void release_disarming() noexcept {
    std::size_t count = refs_.load(std::memory_order_acquire);
    for (;;) {
      if (count == 2 && (sweep_.load(std::memory_order_acquire) & (finished | fired)) == finished &&
          timers_ != nullptr) {
        if (timers_->cancel(timer_)) {
          if (refs_.fetch_sub(2, std::memory_order_acq_rel) == 2) destroy();  // ours, the timer's
          return;
        }
        return release();  // the timer is firing: on_deadline gives back its reference
      }
      if (refs_.compare_exchange_weak(count, count - 1, std::memory_order_acq_rel,
                                      std::memory_order_acquire)) {
        if (count == 1) destroy();
        return;
      }
    }
  }

  static void post_continuation(batch_join* self) noexcept {
    // The deliverer still holds a reference to the join; post() copies the scheduler before the
    // coroutine can run.
    self->scheduler_.post(self->continuation_);
  }

  static void wake_sleeper(batch_join* self) noexcept {
    self->done_.store(1, std::memory_order_release);
    futex_wake_all(self->done_);
  }

  void release() noexcept;
  void destroy() noexcept;

  static constexpr std::size_t no_failure = std::numeric_limits<std::size_t>::max();

  // What deciding and delivering touch sits in the first two cache lines: every line the completing
  // thread must fetch adds to the verdict's latency, and more so when N is large and nothing is in
  // cache.
  std::atomic<std::uint64_t> word_;
  std::atomic<std::size_t> refs_{1};  // the waiting side, linked members, the armed timer
  std::uint64_t decided_ = 0;         // word_ as the deciding CAS left it
  deliver_fn deliver_ = nullptr;
  std::coroutine_handle<> continuation_;
  std::atomic<std::uint32_t> done_{0};  // futex word for a blocked waiter
  std::atomic<bool> failure_lock_{false};
  std::atomic<std::uint8_t> sweep_{0};  // finished, fired: see on_deadline and finish
  batch_mode mode_;
  std::uint8_t size_class_;
  std::size_t first_failed_ = no_failure;
  std::uint64_t first_sequence_ = 0;
  std::error_code first_error_;
  any_scheduler scheduler_;
  // Cold: only the timeout path and finish().
  std::uint32_t members_;
  clock::time_point deadline_{};
  timer_service* timers_ = nullptr;
  join_deadline timer_;
};

static_assert(alignof(batch_join) >= alignof(member_node));
static_assert(sizeof(batch_join) % alignof(member_node) == 0);

// Pooled storage for joins, in size classes by member count.
template <std::size_t Members>
struct join_storage {
  static constexpr std::size_t members = Members;
  static constexpr std::size_t poisonable_bytes = sizeof(batch_join) + Members * sizeof(member_node);
  alignas(batch_join) unsigned char bytes[poisonable_bytes];
  join_storage* pool_next_ = nullptr;
};

// A class's thread caches hold at most two chains of about 64 KiB; slabs are about 256 KiB.
template <std::size_t Members>
using join_pool = block_pool<
    join_storage<Members>,
    std::clamp<std::size_t>(65536 / sizeof(join_storage<Members>), 1, 64),
    std::clamp<std::size_t>(262144 / sizeof(join_storage<Members>), 2, 256)>;

// Size classes by member count; larger joins come from operator new.
struct join_memory {
  static constexpr std::uint8_t unpooled = 0xff;

  [[nodiscard]] static std::uint8_t size_class(std::size_t members) noexcept {
    if (members <= 8) return 0;
    if (members <= 32) return 1;
    if (members <= 128) return 2;
    if (members <= 512) return 3;
    if (members <= 2048) return 4;
    return unpooled;
  }

  [[nodiscard]] static void* allocate(std::size_t members, std::uint8_t size_class) {
    switch (size_class) {
      case 0: return join_pool<8>::acquire()->bytes;
      case 1: return join_pool<32>::acquire()->bytes;
      case 2: return join_pool<128>::acquire()->bytes;
      case 3: return join_pool<512>::acquire()->bytes;
      case 4: return join_pool<2048>::acquire()->bytes;
      default:
        return ::operator new(sizeof(batch_join) + members * sizeof(member_node),
                              std::align_val_t{alignof(batch_join)});
    }
  }

  static void deallocate(void* p, std::uint8_t size_class) noexcept {
    switch (size_class) {
      case 0: return give_back<8>(p);
      case 1: return give_back<32>(p);
      case 2: return give_back<128>(p);
      case 3: return give_back<512>(p);
      case 4: return give_back<2048>(p);
      default: ::operator delete(p, std::align_val_t{alignof(batch_join)});
    }
  }

 private:
  template <std::size_t Members>
  static void give_back(void* p) noexcept {
    // `bytes` is the storage's first member, so the storage starts where the join does.
    join_pool<Members>::release(static_cast<join_storage<Members>*>(p));
  }
};

inline batch_join* batch_join::create(std::size_t members, batch_mode mode) {
  const std::uint8_t size_class = join_memory::size_class(members);
  void* raw = join_memory::allocate(members, size_class);
  return ::new (raw) batch_join(members, mode, size_class);
}

inline void batch_join::release() noexcept {
  if (refs_.fetch_sub(1, std::memory_order_acq_rel) == 1) destroy();
}

inline void batch_join::destroy() noexcept {
  const std::uint8_t size_class = size_class_;
  this->~batch_join();
  join_memory::deallocate(static_cast<void*>(this), size_class);
}

}  // namespace ferry::detail

#pragma once
// A queue pair's lifecycle as one state, with every transition made here.
//
//   state      the adapter's queue pair          what can be posted
//   ---------  --------------------------------  ---------------------------------------------------
//   created    INIT, its receives posted          notification waits only (they queue); a READ, WRITE
//                                                 or notification is refused with errc::not_connected
//   connected  RTS towards its peer               everything; peer checks may go out
//   broken     ERR (ferry moved it there, or      nothing: submitters fail fast with the reason in
//              saw it go: an error completion)    qp_state::broken, the executor fails what still
//                                                 arrives; what the adapter holds comes back flushed
//   closing    ERR, its handle gone               nothing; the executor destroys it once the adapter
//                                                 has handed everything back (or its flush guard fires)
//
//   transition             made by (thread)                  who can race it
//   ---------------------  --------------------------------  ------------------------------------------
//   created -> connected   connect(): the user's thread,     the executor breaking it (a device that
//                          once the queue pair is in RTS     failed before it was routed, a fatal or
//                                                            port event): one CAS each, the first wins;
//                                                            a connect that loses leaves it broken
//   created -> broken      break_queue_pair: the executor    connect(), as above
//   connected -> broken    break_queue_pair: the executor    nothing (only the executor moves it on)
//   broken -> closing      close_now: the executor, after    nothing: the handle is gone, so no connect
//                          it broke the queue pair with
//                          errc::queue_pair_closed
//   closing -> (deleted)   destroy_qp: the executor or the   nothing
//                          device's destructor
//
// Breaking a broken or closing queue pair again changes nothing (its first reason stays); no state
// goes back. Only connect() runs off the executor thread; submitters only read the state (acquire,
// pairing with the release of the transition). It replaces three flags: connected, in_error and
// closing. Not in error, they were created (none) or connected; in error, broken (whether or not it
// had connected: nothing read `connected` once in error) or closing. Closing without in_error never
// held: closing the queue pair broke it at once.
//
// Not states, and kept apart: why it broke (qp_state::broken, data the submitters report), whether
// the peer is known to be up (qp_state::peer_up, knowledge about the other side, in any state), and
// list memberships (listed_pending, expiry_listed, doomed: which executor lists hold it this round).

#include <atomic>
#include <cstdint>

namespace ferry::verbs::detail {

enum class qp_state_kind : std::uint8_t { created, connected, broken, closing };

// The table above, as the one test every transition passes.
[[nodiscard]] constexpr bool legal_transition(qp_state_kind from, qp_state_kind to) noexcept {
  using enum qp_state_kind;
  switch (to) {
    case connected:
      return from == created;
    case broken:
      return from == created || from == connected;
    case closing:
      return from == broken;
    case created:
      return false;
  }
  return false;
}

class qp_lifecycle {
 public:
  [[nodiscard]] qp_state_kind load() const noexcept {
    // Acquire pairs with the release of the transition that stored it.
    return state_.load(std::memory_order_acquire);
  }

  // True while it can carry requests.
  [[nodiscard]] bool connected() const noexcept { return load() == qp_state_kind::connected; }
  // Broken or closing: in the error state, where the adapter flushes what it holds.
  [[nodiscard]] bool in_error() const noexcept {
    const qp_state_kind s = load();
    return s == qp_state_kind::broken || s == qp_state_kind::closing;
  }
  [[nodiscard]] bool closing() const noexcept { return load() == qp_state_kind::closing; }

  // The one place the state changes: `from` -> `to` when it is `from` now and the table allows it;
  // false (and no change) otherwise.
  bool transition(qp_state_kind from, qp_state_kind to) noexcept {
    if (!legal_transition(from, to)) return false;
    // Release pairs with load()'s acquire: what was done before the transition (the queue pair
    // brought to RTS, the reason it broke) is seen with the new state.
    return state_.compare_exchange_strong(from, to, std::memory_order_acq_rel,
                                          std::memory_order_acquire);
  }

  // created -> connected (the user's thread). False when the executor broke it first: it stays
  // broken, and requests report why.
  [[nodiscard]] bool connect() noexcept { return transition(qp_state_kind::created, qp_state_kind::connected); }

  // created or connected -> broken (the executor). True when it moved now; false when it was broken
  // or closing already. The first CAS fails only if the state is no longer created (connect() won, or
  // it is broken or closing); the second then takes connected on, and fails for the rest.
  [[nodiscard]] bool break_off() noexcept {
    return transition(qp_state_kind::created, qp_state_kind::broken) ||
           transition(qp_state_kind::connected, qp_state_kind::broken);
  }

  // broken -> closing (the executor, once its handle is gone and it is broken).
  [[nodiscard]] bool close() noexcept { return transition(qp_state_kind::broken, qp_state_kind::closing); }

 private:
  std::atomic<qp_state_kind> state_{qp_state_kind::created};
};

}  // namespace ferry::verbs::detail

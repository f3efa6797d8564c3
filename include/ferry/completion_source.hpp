#pragma once
// The contract between a backend and the progress executor: everything the executor calls on a
// backend, and when. Someone writing a backend reads this header and one backend (loopback.hpp is
// the smallest), nothing else.
//
// Registration. A backend calls exec.add_source(*this) once it can be polled and
// exec.remove_source(*this) before it goes away, never from the executor's own thread (a
// continuation resumed inline may be running inside the backend's poll()). After remove_source
// returns the executor never calls the backend again.
//
// Every call below is made on the executor thread only, so a backend's completion-side state needs
// no lock. Work reaches that thread from submitters on any thread through the backend's own queue
// (ferry uses detail::submission_stack: prepare, then publish last with one CAS); a submitter then
// calls exec.notify(), which costs one fence and one load unless the executor has parked.
//
// One round of the executor, for each source:
//   poll(budget)  required. Handles at most `budget` completions (executor_options::poll_budget)
//                 and returns how many it handled; 0 means nothing was ready. It completes
//                 transfers through their completers, which resume continuations on their own
//                 schedulers (inline only for inline_scheduler). Must not block.
// When a round finds nothing, adaptive mode spins for a while; what each source reports sets how
// long:
//   in_flight()   optional. True while the source has I/O out that completes within a device's
//                 latency (file reads and writes; not a socket receive that waits on a peer): the
//                 spin lasts executor_options::in_flight_spin rather than spin_budget.
//   busy()        optional. True while the source has work out that only polling finds (a GPU event
//                 nothing signals): the executor does not park at all.
// Then it parks, seastar's way: it announces that it parks, arms every source and polls them once
// more, and only then sleeps in epoll on its eventfd and the sources' descriptors:
//   park_fd()     optional. A descriptor that turns readable when the source has completions (an
//                 io_uring ring or its eventfd, a verbs completion channel). Read once, at
//                 add_source. A source without one has its submitters call exec.notify().
//   arm()         optional. Asks the source to signal its descriptor (ibv_req_notify_cq). Returns
//                 false when completions arrived meanwhile: the executor polls instead of sleeping.
// Deadline timers are the executor's own (progress_executor::timers()); a backend's deadlines are
// timer_nodes on that service, fired on the executor thread between polls.

#include <concepts>
#include <cstddef>

namespace ferry {

/// A backend the progress executor can poll: `poll(budget)` handles at most `budget` completions
/// and returns how many (never blocks). See the top of completion_source.hpp for the contract.
template <class S>
concept completion_source = requires(S& s, std::size_t budget) {
  { s.poll(budget) } -> std::convertible_to<std::size_t>;
};

/// A source with `park_fd()`: a descriptor that turns readable when it has completions.
template <class S>
concept parkable_source = completion_source<S> && requires(S& s) {
  { s.park_fd() } -> std::convertible_to<int>;
};

/// A source with `arm()`: asks it to signal its descriptor; false when completions came meanwhile.
template <class S>
concept armable_source = requires(S& s) {
  { s.arm() } -> std::convertible_to<bool>;
};

/// A source with `in_flight()`: true while it has device I/O out, so the executor spins longer.
template <class S>
concept in_flight_source = requires(const S& s) {
  { s.in_flight() } -> std::convertible_to<bool>;
};

/// A source with `busy()`: true while it has work out that only polling finds (no parking then).
template <class S>
concept busy_source = requires(const S& s) {
  { s.busy() } -> std::convertible_to<bool>;
};

}  // namespace ferry

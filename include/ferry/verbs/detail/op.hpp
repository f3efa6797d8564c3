#pragma once
// The op: one pooled work request, from its submitter to the executor to the adapter and back.
// A READ, WRITE or notification is a unit of one or more ops (a batch): its lead carries the
// unit's deadline and what happens to the unit; members hang off unit_next in order, only the
// last signalled. The other kinds carry a notification wait, a queue pair's opening and closing,
// and a peer check to the executor.
//
// The lead's flags are the unit's own progress, not its queue pair's state (qp_lifecycle.hpp):
// `posted` and `listed` say where the unit is (the adapter, the queue pair's list of posted units),
// `failed` that its members have been completed, `expired` and `orphaned` why it waits for its
// queue pair rather than for a completion; `timer_armed` and `has_deadline` are its deadline's.
// Several hold at once (a unit posted, listed, expired and failed), so they are not one state.

#include <infiniband/verbs.h>

#include <cstddef>
#include <cstdint>
#include <system_error>
#include <type_traits>

#include "ferry/detail/block_pool.hpp"
#include "ferry/detail/status_block.hpp"
#include "ferry/detail/timer_service.hpp"

namespace ferry::verbs::detail {

using ferry::detail::status_block;

template <class P>
struct region_state;

enum class op_kind : std::uint8_t {
  write, read, notify, wait_notification, open, close, peer_check, sever
};

template <class P>
struct qp_state;

template <class P>
struct op_body {
  ferry::detail::timer_node timer;  // first: a fired timer finds its op (see op_of)
  op_kind kind = op_kind::write;
  bool has_deadline = false;
  bool timer_armed = false;
  bool posted = false;
  bool listed = false;       // a lead in its queue pair's list of posted units
  bool orphaned = false;     // a lead cut part-way whose tail cannot be posted: ends with its QP
  bool failed = false;       // a lead whose members have all been failed
  bool expired = false;      // a lead whose deadline passed while the adapter held it
  std::uint32_t unit_size = 1;
  qp_state<P>* qp = nullptr;
  region_state<P>* region = nullptr;
  status_block* status = nullptr;  // the completer reference
  op_body* lead = nullptr;         // the first member of the unit (itself for a single request)
  op_body* last = nullptr;         // on the lead: the signalled member
  op_body* unit_next = nullptr;    // the unit's members, in order
  op_body* next = nullptr;         // submission stack, pending queue, waiter queue
  op_body* list_prev = nullptr;
  op_body* list_next = nullptr;
  op_body* expired_next = nullptr;
  std::uint64_t payload = 0;         // a notification's value, sent inline
  std::uint64_t published_ns = 0;    // a lead's, on a device that records metrics
  std::uint64_t* value_out = nullptr;  // where a received notification's value goes
  std::error_code reason{};            // a sever's: what the queue pair's transfers fail with
  ibv_sge sge{};
  ibv_send_wr wr{};
};

template <class P>
struct op : op_body<P> {
  op* pool_next_ = nullptr;  // the pool's free-list link, never poisoned
  static constexpr std::size_t poisonable_bytes = sizeof(op_body<P>);
  using pool = ferry::detail::block_pool<op>;

  [[nodiscard]] static op_body<P>* make(op_kind kind) {
    op* o = pool::acquire();
    static_cast<op_body<P>&>(*o) = op_body<P>{};
    o->kind = kind;
    o->lead = o;
    o->last = o;
    return o;
  }

  static void free(op_body<P>* o) noexcept { pool::release(static_cast<op*>(o)); }
};

template <class P>
[[nodiscard]] op_body<P>* op_of(ferry::detail::timer_node* t) noexcept {
  static_assert(std::is_standard_layout_v<op_body<P>>);
  return reinterpret_cast<op_body<P>*>(t);
}

}  // namespace ferry::verbs::detail

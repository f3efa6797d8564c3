#pragma once
// The io_uring ring's pooled operation: one per read, write, send, receive, cancel and the ring's
// own calls, prepared by the submitter and owned by the executor thread once published. Each kind
// brings its own handlers (what it does on arrival, how it fills an SQE, what its completion does,
// how it is refused), so the engine that admits, issues and reaps them never switches over kinds.

#include <liburing.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <system_error>

#include <sys/uio.h>

#include "ferry/detail/block_pool.hpp"
#include "ferry/detail/op_queue.hpp"
#include "ferry/detail/status_block.hpp"
#include "ferry/uring/frame.hpp"

namespace ferry::uring::detail {

using ferry::detail::op_queue;
using ferry::detail::status_block;

// The kinds the engine tells apart for room in the ring (admission.hpp); everything else a kind
// does is in its handlers.
enum class op_kind : std::uint8_t {
  read, write, readv, writev, send, receive, cancel, detach, call, shutdown, connect, accept, sever
};

// A connect or an accept waits on a peer, as a receive does: it takes its room from the receives'
// share (admission.hpp).
[[nodiscard]] constexpr bool waits_on_peer(op_kind k) noexcept {
  return k == op_kind::receive || k == op_kind::connect || k == op_kind::accept;
}

// The user data of a deadline linked to a connect or an accept (IORING_OP_LINK_TIMEOUT): no op of
// its own (ops are aligned, so never at address 1), and 0 is cancel_everything()'s.
inline constexpr std::uint64_t linked_deadline_data = 1;

class engine;
struct connection_state;
struct socket_setup;
struct op;

// One kind's part in each step, on the executor thread. `prepare`, `complete` and `refuse` (for an
// operation still waiting for room when the ring shuts down) are null for the kinds that are done
// with on arrival and never reach the kernel (detach, call, shutdown).
struct op_handlers {
  op_kind kind;
  void (*arrive)(engine&, op*) noexcept;  // taken off the submission stack
  void (*prepare)(io_uring_sqe*, op*) noexcept;
  void (*complete)(engine&, op*, int res) noexcept;  // its CQE, already retired from the bound
  void (*refuse)(engine&, op*) noexcept;
};

struct op_body {
  op_kind kind = op_kind::read;
  const op_handlers* handlers = nullptr;
  bool fixed_file = false;
  bool cancel_requested = false;
  bool cancelled_at_shutdown = false;
  bool receiving_payload = false;  // a receive has its header and is filling the payload
  bool frame_cancel = false;       // a send frame cancel() named (cancel_requested: its group's SQE)
  bool linked_deadline = false;    // a connect or accept: `deadline` goes with it, linked
  int fd = -1;
  int buffer_index = -1;
  std::uint32_t iov_count = 0;
  std::uint32_t iov_at = 0;        // first iovec not yet fully transferred
  std::size_t iov_skip = 0;        // bytes of iov[iov_at] already transferred
  std::size_t slot = 0;            // position in admission::in_flight_
  std::uint64_t ticket = 0;        // arrival in a backlog (0: going on from where it stopped)
  std::uint64_t published_ns = 0;  // when it was published, on a ring that records metrics
  status_block* status = nullptr;  // the completer reference (for a cancel: a transfer reference)
  std::byte* buffer = nullptr;
  std::size_t length = 0;  // bytes wanted (for a receive: of the current phase)
  std::size_t done = 0;    // bytes transferred so far (of the current phase)
  std::uint64_t offset = 0;
  const iovec* iov = nullptr;
  connection_state* connection = nullptr;
  received_block* received = nullptr;
  socket_setup* setup = nullptr;  // a connect or an accept: what it is making (socket_setup.hpp)
  std::size_t* transferred = nullptr;  // a read or write's caller learns `done` here, when it ends
  op* target = nullptr;  // for a cancel: the operation it asks the kernel to cancel
  int (*call)(void*) noexcept = nullptr;  // a call: run on the executor thread, returns -errno or 0
  void* call_argument = nullptr;
  op* next = nullptr;    // submission stack, backlog and connection queues
  frame_header header;
  iovec parts[2]{};  // a send: header and payload; a receive: parts[1] is the destination
  __kernel_timespec deadline{};  // with linked_deadline: CLOCK_MONOTONIC, absolute
};

struct op : op_body {
  op* pool_next_ = nullptr;  // the pool's free-list link, never poisoned
  static constexpr std::size_t poisonable_bytes = sizeof(op_body);
  using pool = ferry::detail::block_pool<op>;

  [[nodiscard]] static op* make(const op_handlers& handlers) {
    op* o = pool::acquire();
    static_cast<op_body&>(*o) = op_body{};
    o->kind = handlers.kind;
    o->handlers = &handlers;
    return o;
  }
};

// Matches the operation completing `s`, for op_queue::remove_first.
[[nodiscard]] inline auto completing(const status_block* s) noexcept {
  return [s](const op* o) { return o->status == s; };
}

inline constexpr std::size_t max_chunk = std::size_t{1} << 30;  // an SQE's length is 32 bits

// -ECANCELED, or -EINTR after a cancel request (the kernel interrupted a running request).
[[nodiscard]] inline bool was_cancelled(const op* o, int res) noexcept {
  return res == -ECANCELED || (res == -EINTR && o->cancel_requested);
}

[[nodiscard]] inline std::error_code system_error_code(int err) noexcept {
  return {err, std::system_category()};
}

}  // namespace ferry::uring::detail

#pragma once
// A TCP connection as the io_uring ring sees it, and the ring's list of connections that have had
// work (for cancel() and for closing a connection).

#include <atomic>
#include <cstddef>
#include <string>
#include <system_error>

#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "ferry/uring/detail/op.hpp"

namespace ferry::metrics {
class op_metrics;
}  // namespace ferry::metrics

namespace ferry::uring::detail {

// The handle (tcp_connection), every operation naming it and the ring's list of connections with
// queued work each hold a reference; the last one closes the socket. Everything but `fd` and
// `refs` belongs to the executor thread.
struct connection_state {
  int fd = -1;
  std::atomic<int> refs{1};
  std::atomic<bool> closing{false};  // set by close(): nothing queued starts any more
  connection_state* list_prev = nullptr;
  connection_state* list_next = nullptr;
  bool listed = false;
  op_queue<op> sends;
  op_queue<op> receives;
  bool sending = false;
  bool receiving = false;
  // The sends in flight: queued frames coalesced into one sendmsg, the first of them (the lead)
  // owning the SQE. Frames complete when the whole group has gone out, or it is cut short.
  static constexpr unsigned max_send_group = 16;
  op* send_group[max_send_group] = {};
  unsigned send_group_size = 0;
  std::size_t group_length = 0;
  std::size_t group_done = 0;
  iovec send_live[2 * max_send_group] = {};
  msghdr send_message{};
  std::error_code send_error;     // once set, every later send fails with it
  std::error_code receive_error;  // likewise for receives
  // tcp_connection::sever: the reason every operation on it ends with from then on (any thread:
  // sever_state 2 is stored with release once the reason is written; 1 while it is written).
  std::atomic<int> sever_state{0};
  std::error_code sever_reason;

  [[nodiscard]] std::error_code severed() const noexcept {
    return sever_state.load(std::memory_order_acquire) == 2 ? sever_reason : std::error_code{};
  }
  // On a ring that records metrics: the peer's address (its IP, without the port, so that every
  // connection from one host adds up), set when the handle is made; and its figures for sends and
  // receives, looked up by the executor at the first of each that ends.
  std::string peer;
  ferry::metrics::op_metrics* peer_metrics[2] = {};

  void release(int n = 1) noexcept {
    if (refs.fetch_sub(n, std::memory_order_acq_rel) == n) {
      ::close(fd);
      delete this;
    }
  }
};

// The connections that have had work, linked through their own list_prev/list_next. The list holds
// a reference to each.
class connection_list {
 public:
  [[nodiscard]] connection_state* front() const noexcept { return head_; }

  void add(connection_state* c) noexcept {
    if (c->listed) return;
    c->listed = true;
    c->refs.fetch_add(1, std::memory_order_relaxed);
    c->list_prev = nullptr;
    c->list_next = head_;
    if (head_ != nullptr) head_->list_prev = c;
    head_ = c;
  }

  // Takes a listed `c` off; the caller then owns the list's reference.
  void remove(connection_state* c) noexcept {
    (c->list_prev == nullptr ? head_ : c->list_prev->list_next) = c->list_next;
    if (c->list_next != nullptr) c->list_next->list_prev = c->list_prev;
    c->listed = false;
  }

 private:
  connection_state* head_ = nullptr;
};

}  // namespace ferry::uring::detail

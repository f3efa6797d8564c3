#pragma once
// The intrusive FIFO every backend keeps its operations in on the executor thread: backlogs waiting
// for room, a connection's queued sends, a queue pair's unposted requests, waiters for a
// notification. A node is linked through its own `next` member (of a type convertible to Node*),
// so queueing allocates nothing and a node sits in at most one queue at a time. Not thread-safe:
// work from other threads arrives through a submission_stack.

#include <cstddef>

namespace ferry::detail {

template <class Node>
class op_queue {
 public:
  [[nodiscard]] bool empty() const noexcept { return head_ == nullptr; }
  [[nodiscard]] Node* front() const noexcept { return head_; }

  void push(Node* n) noexcept {
    n->next = nullptr;
    if (tail_ == nullptr) {
      head_ = tail_ = n;
    } else {
      tail_->next = n;
      tail_ = n;
    }
  }

  // First in line: an operation that goes on from where it stopped keeps its place.
  void push_front(Node* n) noexcept {
    n->next = head_;
    head_ = n;
    if (tail_ == nullptr) tail_ = n;
  }

  // The oldest node, unlinked (next null), or nullptr.
  Node* pop() noexcept {
    Node* n = head_;
    if (n != nullptr) {
      head_ = n->next;
      if (head_ == nullptr) tail_ = nullptr;
      n->next = nullptr;
    }
    return n;
  }

  // Unlinks the first node `match` accepts, if any; the others keep their order.
  template <class Match>
  Node* remove_first(Match match) noexcept {
    Node* prev = nullptr;
    for (Node* n = head_; n != nullptr; prev = n, n = n->next) {
      if (!match(n)) continue;
      (prev == nullptr ? head_ : prev->next) = n->next;
      if (tail_ == n) tail_ = prev;
      n->next = nullptr;
      return n;
    }
    return nullptr;
  }

  // Unlinks every node `take` accepts (take(n) is called once per node, in order, and may keep the
  // node it accepts); the others keep their order. Returns how many were taken.
  template <class Take>
  std::size_t remove_all(Take take) noexcept {
    Node* keep_head = nullptr;
    Node* keep_tail = nullptr;
    std::size_t taken = 0;
    for (Node* n = head_; n != nullptr;) {
      Node* next = n->next;
      n->next = nullptr;
      if (take(n)) {
        ++taken;
      } else {
        (keep_tail == nullptr ? keep_head : keep_tail->next) = n;
        keep_tail = n;
      }
      n = next;
    }
    head_ = keep_head;
    tail_ = keep_tail;
    return taken;
  }

 private:
  Node* head_ = nullptr;
  Node* tail_ = nullptr;
};

}  // namespace ferry::detail

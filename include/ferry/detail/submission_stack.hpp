#pragma once
// How backends take work from any thread without a lock: a submitter prepares its nodes, then
// publishes them last with one CAS onto a stack; the one consuming thread (the executor) takes the
// whole stack with one exchange and handles it oldest first. Nodes are linked through a `next`
// member of type Node*.

#include <atomic>
#include <cstddef>

namespace ferry::detail {

template <class Node>
class submission_stack {
 public:
  // Publishes a chain already linked newest → oldest through next. After the CAS the consumer owns
  // the nodes: nothing may touch them here any more.
  void push(Node* newest, Node* oldest) noexcept {
    Node* head = head_.load(std::memory_order_relaxed);
    do {
      oldest->next = head;
      // Release pairs with the acquire exchange in take(): the nodes' fields travel with it.
    } while (!head_.compare_exchange_weak(head, newest, std::memory_order_release,
                                          std::memory_order_relaxed));
  }

  void push(Node* one) noexcept { push(one, one); }

  // A hint for the consumer's fast path; acquire, so that a consumer finding it empty after a
  // push was seen (a destructor's last look) also sees the nodes.
  [[nodiscard]] bool empty() const noexcept {
    return head_.load(std::memory_order_acquire) == nullptr;
  }

  // The consumer: takes everything published so far and calls handle(node), oldest first, each
  // node unlinked (next null). Returns how many it handled. `handle` may push more; those wait for
  // the next take().
  template <class Handle>
  std::size_t take(Handle handle) noexcept {
    Node* list = head_.exchange(nullptr, std::memory_order_acquire);
    Node* fifo = nullptr;
    while (list != nullptr) {
      Node* next = list->next;
      list->next = fifo;
      fifo = list;
      list = next;
    }
    std::size_t n = 0;
    while (fifo != nullptr) {
      Node* node = fifo;
      fifo = fifo->next;
      node->next = nullptr;
      handle(node);
      ++n;
    }
    return n;
  }

 private:
  alignas(64) std::atomic<Node*> head_{nullptr};
};

}  // namespace ferry::detail

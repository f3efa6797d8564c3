// detail::submission_stack: lock-free publication from any thread, taken oldest first by one consumer.

#include <catch2/catch.hpp>

#include <atomic>
#include <cstddef>
#include <thread>
#include <vector>

#include <ferry/detail/submission_stack.hpp>

namespace {

struct node {
  int producer = 0;
  int seq = 0;
  node* next = nullptr;
};

}  // namespace

TEST_CASE("submission_stack: take hands out everything oldest first, each node unlinked",
          "[detail]") {
  ferry::detail::submission_stack<node> stack;
  CHECK(stack.empty());
  CHECK(stack.take([](node*) {}) == 0);
  node a{0, 1}, b{0, 2}, c{0, 3}, d{0, 4};
  stack.push(&a);
  // A chain published at once, linked newest to oldest.
  c.next = &b;
  stack.push(&c, &b);
  stack.push(&d);
  CHECK_FALSE(stack.empty());
  std::vector<int> order;
  CHECK(stack.take([&](node* n) {
    CHECK(n->next == nullptr);
    order.push_back(n->seq);
  }) == 4);
  CHECK(order == std::vector<int>{1, 2, 3, 4});
  CHECK(stack.empty());
}

TEST_CASE("submission_stack: a node pushed while handling waits for the next take", "[detail]") {
  ferry::detail::submission_stack<node> stack;
  node a{0, 1}, b{0, 2};
  stack.push(&a);
  std::vector<int> order;
  CHECK(stack.take([&](node* n) {
    order.push_back(n->seq);
    if (n == &a) stack.push(&b);
  }) == 1);
  CHECK(order == std::vector<int>{1});
  CHECK(stack.take([&](node* n) { order.push_back(n->seq); }) == 1);
  CHECK(order == std::vector<int>{1, 2});
}

TEST_CASE("submission_stack: racing publishers lose nothing and each one's nodes come oldest first",
          "[detail][concurrency]") {
  constexpr int producers = 4;
  constexpr int per_producer = 50000;
  ferry::detail::submission_stack<node> stack;
  std::vector<std::vector<node>> nodes(producers, std::vector<node>(per_producer));
  std::atomic<int> finished{0};
  std::vector<std::thread> threads;
  for (int p = 0; p < producers; ++p) {
    threads.emplace_back([&, p] {
      for (int i = 0; i < per_producer; ++i) {
        node& n = nodes[static_cast<std::size_t>(p)][static_cast<std::size_t>(i)];
        n.producer = p;
        n.seq = i;
        if (i % 3 == 2) {
          // Every third push publishes the last two as one chain.
          node& prev = nodes[static_cast<std::size_t>(p)][static_cast<std::size_t>(i - 1)];
          n.next = &prev;
          stack.push(&n, &prev);
        } else if (i % 3 == 0) {
          stack.push(&n);
        }
      }
      if (per_producer % 3 == 2) stack.push(&nodes[static_cast<std::size_t>(p)].back());
      finished.fetch_add(1);
    });
  }
  std::vector<int> next(producers, 0);
  int received = 0, out_of_order = 0;
  const auto handle = [&](node* n) {
    if (n->seq != next[static_cast<std::size_t>(n->producer)]) ++out_of_order;
    next[static_cast<std::size_t>(n->producer)] = n->seq + 1;
    ++received;
  };
  for (;;) {
    const bool last = finished.load() == producers;
    (void)stack.take(handle);
    if (last) break;
  }
  for (auto& t : threads) t.join();
  CHECK(out_of_order == 0);
  CHECK(received == producers * per_producer);
}

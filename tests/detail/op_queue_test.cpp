// detail::op_queue: the intrusive FIFO both backends keep their operations in.

#include <catch2/catch.hpp>

#include <vector>

#include <ferry/detail/op_queue.hpp>

namespace {

struct node {
  int id = 0;
  node* next = nullptr;
};

std::vector<int> drain(ferry::detail::op_queue<node>& q) {
  std::vector<int> ids;
  while (node* n = q.pop()) {
    CHECK(n->next == nullptr);
    ids.push_back(n->id);
  }
  return ids;
}

}  // namespace

TEST_CASE("op_queue pops in the order pushed, push_front going first", "[detail]") {
  node a{1}, b{2}, c{3}, d{4};
  ferry::detail::op_queue<node> q;
  CHECK(q.empty());
  CHECK(q.pop() == nullptr);
  q.push(&a);
  q.push(&b);
  q.push_front(&c);
  CHECK(q.front() == &c);
  q.push(&d);
  CHECK(drain(q) == std::vector<int>{3, 1, 2, 4});
  CHECK(q.empty());
  // Empty again, the queue takes new nodes at both ends.
  q.push_front(&a);
  q.push(&b);
  CHECK(drain(q) == std::vector<int>{1, 2});
}

TEST_CASE("op_queue::remove_first unlinks one match and keeps the rest in order", "[detail]") {
  node n[5] = {{0}, {1}, {2}, {3}, {4}};
  ferry::detail::op_queue<node> q;
  for (node& x : n) q.push(&x);
  CHECK(q.remove_first([](const node* x) { return x->id == 9; }) == nullptr);
  CHECK(q.remove_first([](const node* x) { return x->id % 2 == 1; }) == &n[1]);
  CHECK(q.remove_first([](const node* x) { return x->id == 4; }) == &n[4]);  // the tail
  q.push(&n[4]);  // the tail was fixed up: a push lands after 3
  CHECK(q.remove_first([](const node* x) { return x->id == 0; }) == &n[0]);  // the head
  CHECK(drain(q) == std::vector<int>{2, 3, 4});
}

TEST_CASE("op_queue::remove_all takes every match once, in order", "[detail]") {
  node n[6] = {{0}, {1}, {2}, {3}, {4}, {5}};
  ferry::detail::op_queue<node> q;
  for (node& x : n) q.push(&x);
  std::vector<int> taken;
  const std::size_t count = q.remove_all([&](node* x) {
    if (x->id % 2 == 0) return false;
    taken.push_back(x->id);
    return true;
  });
  CHECK(count == 3);
  CHECK(taken == std::vector<int>{1, 3, 5});
  q.push(&n[1]);  // the tail is the last kept node
  CHECK(drain(q) == std::vector<int>{0, 2, 4, 1});
  CHECK(q.remove_all([](node*) { return true; }) == 0);
  CHECK(q.empty());
}

// detail::status_block: the one-word state behind every transfer, its waiter list and its sleepers.

#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include <ferry/detail/status_block.hpp>

using ferry::transfer_state;
using ferry::detail::completion_event;
using ferry::detail::status_block;
using ferry::detail::waiter;

namespace {

using namespace std::chrono_literals;
using clock_type = ferry::detail::clock;

// A block made by status_block::make(), given back (completer group and transfer reference) when the
// test is done with it.
struct owned_block {
  status_block* block = status_block::make();
  owned_block() = default;
  owned_block(const owned_block&) = delete;
  owned_block& operator=(const owned_block&) = delete;
  ~owned_block() {
    block->release_completer_ref();
    block->release_transfer_ref();
  }
  status_block* operator->() const noexcept { return block; }
};

// A waiter that counts its notifications and keeps the last event.
struct counting_waiter : waiter {
  std::atomic<int> notified{0};
  completion_event last;
  void (*then)(counting_waiter*) noexcept = nullptr;  // run inside the notification

  counting_waiter() {
    notify = [](waiter* w, const completion_event& ev) noexcept {
      auto* self = static_cast<counting_waiter*>(w);
      self->last = ev;
      if (self->then != nullptr) self->then(self);
      self->notified.fetch_add(1, std::memory_order_release);
    };
  }
};

}  // namespace

TEST_CASE("status_block: the first terminal call wins and carries its error and a failure's "
          "sequence",
          "[detail]") {
  owned_block ok;
  CHECK(ok->state() == transfer_state::pending);
  CHECK_FALSE(ok->error());
  CHECK(ok->complete(transfer_state::success, std::make_error_code(std::errc::io_error)));
  CHECK_FALSE(ok->complete(transfer_state::failed, std::make_error_code(std::errc::io_error)));
  CHECK(ok->state() == transfer_state::success);
  CHECK_FALSE(ok->error());  // a success carries no error, whatever it was given
  CHECK(ok->event().sequence == 0);

  owned_block first, second;
  CHECK(first->complete(transfer_state::failed, {}));
  CHECK(second->complete(transfer_state::cancelled, {}));
  CHECK(first->error() == ferry::errc::unspecified_failure);
  CHECK(second->error() == ferry::errc::cancelled);
  // Failures are numbered in the order they happened.
  CHECK(first->event().sequence != 0);
  CHECK(second->event().sequence > first->event().sequence);
}

TEST_CASE("status_block: waiters are notified once each, in the order linked, unless taken off "
          "first",
          "[detail]") {
  owned_block s;
  counting_waiter a, b, c;
  std::vector<counting_waiter*> order;
  static thread_local std::vector<counting_waiter*>* seen = nullptr;
  seen = &order;
  for (counting_waiter* w : {&a, &b, &c}) {
    w->then = [](counting_waiter* self) noexcept { seen->push_back(self); };
    REQUIRE(s->add_waiter(w));
  }
  CHECK(s->remove_waiter(&b));        // still linked: never notified
  CHECK_FALSE(s->remove_waiter(&b));  // and not linked twice
  CHECK(s->complete(transfer_state::failed, std::make_error_code(std::errc::io_error)));
  CHECK(order == std::vector<counting_waiter*>{&a, &c});
  CHECK(a.notified.load() == 1);
  CHECK(b.notified.load() == 0);
  CHECK(c.last.state == transfer_state::failed);
  CHECK(c.last.error == std::errc::io_error);
  // Once notified, a waiter cannot be taken off; once terminal, nothing links.
  CHECK_FALSE(s->remove_waiter(&a));
  counting_waiter late;
  CHECK_FALSE(s->add_waiter(&late));
  CHECK(late.notified.load() == 0);
}

TEST_CASE("status_block: a notification may touch its own status without deadlocking", "[detail]") {
  // The waiter is notified outside the lock: inside, it takes another waiter off, links a new one
  // (refused, the status being terminal) and reads the state.
  owned_block s;
  static status_block* block = nullptr;
  static counting_waiter* other = nullptr;
  static std::atomic<int> inside_result{0};
  block = s.block;
  counting_waiter first, second;
  other = &second;
  first.then = [](counting_waiter*) noexcept {
    counting_waiter late;
    int r = 0;
    if (block->remove_waiter(other)) r |= 1;
    if (!block->add_waiter(&late)) r |= 2;
    if (block->state() == transfer_state::success) r |= 4;
    inside_result.store(r);
  };
  SECTION("one waiter and another behind it") {
    REQUIRE(s->add_waiter(&first));
    REQUIRE(s->add_waiter(&second));
    CHECK(s->complete(transfer_state::success, {}));
    CHECK(inside_result.load() == 7);
    CHECK(second.notified.load() == 0);
  }
  SECTION("one waiter alone") {
    REQUIRE(s->add_waiter(&first));
    CHECK(s->complete(transfer_state::success, {}));
    CHECK(inside_result.load() == 6);  // nothing to take off
  }
}

TEST_CASE("status_block: registering sweeps waiters whose wait has ended, so the list stays bounded",
          "[detail]") {
  owned_block s;
  static std::atomic<bool> expired{false};
  constexpr int rounds = 1000;
  std::vector<std::unique_ptr<counting_waiter>> nodes;
  for (int i = 0; i < rounds; ++i) {
    auto w = std::make_unique<counting_waiter>();
    w->expired = [](const waiter*) noexcept { return expired.load(); };
    REQUIRE(s->add_waiter(w.get()));
    nodes.push_back(std::move(w));
  }
  expired.store(true);
  // Each registration looks at up to three nodes from the head: more than one dead node goes.
  counting_waiter probe;
  for (int i = 0; i < rounds; ++i) {
    REQUIRE(s->add_waiter(&probe));
    REQUIRE(s->remove_waiter(&probe));
  }
  int swept = 0;
  for (const auto& w : nodes) {
    if (w->notified.load() == 1) {
      ++swept;
      CHECK(w->last.state == transfer_state::pending);  // swept, not completed
    }
  }
  CHECK(swept == rounds);
  CHECK(s->complete(transfer_state::success, {}));
  for (const auto& w : nodes) CHECK(w->notified.load() == 1);
}

TEST_CASE("status_block: the last completer to go fails a pending status as abandoned", "[detail]") {
  status_block* s = status_block::make();
  s->add_completer_ref();
  s->release_completer_ref();
  CHECK(s->state() == transfer_state::pending);
  s->release_completer_ref();
  CHECK(s->state() == transfer_state::failed);
  CHECK(s->error() == ferry::errc::abandoned);
  s->release_transfer_ref();
}

TEST_CASE("status_block: a timed wait on a pending status ends at its deadline", "[detail]") {
  owned_block s;
  const auto deadline = clock_type::now() + 20ms;
  CHECK(s->wait(&deadline) == transfer_state::pending);
  CHECK(clock_type::now() >= deadline);
}

TEST_CASE("status_block: a completion racing a thread going to sleep on it always wakes it",
          "[detail][concurrency]") {
  // The completer may land before the sleeper looks, while it sets the sleepers bit, or once it
  // sleeps on the futex. A wake lost there leaves the sleeper until its deadline, and the round
  // reports pending.
  constexpr int rounds = 2000;
  int woken = 0;
  for (int i = 0; i < rounds; ++i) {
    owned_block s;
    std::atomic<bool> go{false};
    std::thread completer([&] {
      while (!go.load()) {
      }
      for (int k = 0; k < i % 512; ++k) ferry::detail::cpu_relax();
      (void)s->complete(transfer_state::success, {});
    });
    go.store(true);
    const auto deadline = clock_type::now() + 10s;
    if (s->wait(&deadline) == transfer_state::success) ++woken;
    completer.join();
  }
  CHECK(woken == rounds);
}

TEST_CASE("status_block: a waiter taken off while the status completes is notified or removed, "
          "never both",
          "[detail][concurrency]") {
  constexpr int rounds = 5000;
  constexpr int per_round = 4;
  int removed = 0, notified = 0;
  for (int i = 0; i < rounds; ++i) {
    owned_block s;
    std::vector<counting_waiter> ws(per_round);
    for (auto& w : ws) REQUIRE(s->add_waiter(&w));
    std::atomic<bool> go{false};
    std::thread completer([&] {
      while (!go.load()) {
      }
      (void)s->complete(transfer_state::success, {});
    });
    go.store(true);
    for (int k = 0; k < i % 64; ++k) ferry::detail::cpu_relax();
    bool taken[per_round];
    for (int k = 0; k < per_round; ++k) taken[k] = s->remove_waiter(&ws[k]);
    completer.join();
    for (int k = 0; k < per_round; ++k) {
      const int n = ws[k].notified.load(std::memory_order_acquire);
      REQUIRE(n + (taken[k] ? 1 : 0) == 1);
      removed += taken[k] ? 1 : 0;
      notified += n;
    }
  }
  CHECK(removed + notified == rounds * per_round);
}

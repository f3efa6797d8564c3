#pragma once
// The consumer's side of push in the link tests (tests/ucx/kv_link_test.cpp over UCX,
// tests/verbs/kv_link_test.cpp on the fake adapter): its tracker, receiver and receive loop, on its
// engine's own thread, written once for any link. An Engine has `layout` and `thread`
// (helpers.hpp's engine_thread); a Link is what kv::push_receiver receives on.

#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <exception>
#include <span>
#include <vector>

#include <ferry/kv.hpp>
#include <ferry/kv/connector.hpp>
#include <ferry/spawn.hpp>
#include <ferry/sync_wait.hpp>

#include "helpers.hpp"

namespace ferry_test::kv_links {

namespace kv = ferry::kv;

// Runs `t` on the engine's own thread, blocking this one until it ends.
template <class Engine, class T>
T run_on(Engine& e, ferry::task<T> t) {
  ferry::any_scheduler s = ferry::any_scheduler::reference(e.thread.loop());
  return ferry::sync_wait(s, std::move(t));
}

template <class Engine, class Link>
struct push_consumer {
  /// Closes the link the receive loop runs on (the loop then ends).
  using close_fn = void (*)(Engine&, Link&);
  /// The consumer of `e`; `close` ends its link when it goes.
  push_consumer(Engine& e, close_fn close) : e(e), close_(close) {}
  push_consumer(const push_consumer&) = delete;
  push_consumer& operator=(const push_consumer&) = delete;
  // The receive loop ends before the engine thread goes: closing the link fails its wait.
  ~push_consumer() {
    if (from_ == nullptr) return;
    close_(e, *from_);
    CHECK(wait_until([&] { return receive_ended.load(); }));
  }

  // Expects `id` and starts the receive loop (once) on the engine thread.
  void expect(Link& from, kv::request_id id, const kv::block_pairs& g,
              std::chrono::milliseconds abort_timeout) {
    run_on(e, [](push_consumer& self, Link& from, kv::request_id id, kv::block_pairs g,
                 std::chrono::milliseconds abort_timeout) -> ferry::task<int> {
      if (self.from_ == nullptr) {
        self.from_ = &from;
        ferry::spawn(self.e.thread.loop(), self.receiver.receive(from),
                     [&self](std::exception_ptr) noexcept { self.receive_ended.store(true); });
      }
      kv::request_options o;
      o.abort_timeout = abort_timeout;
      const auto h = self.tracker.add_request(id, o);
      self.receiver.expect(self.tracker, h, id, self.e.layout, std::span(&g, 1));
      self.tracker.seal(h);
      co_return 0;
    }(*this, from, id, g, abort_timeout));
  }

  // Waits on the engine thread until `id`'s verdict is terminal (bounded), taking finished
  // requests; returns the verdict.
  kv::request_verdict verdict(kv::request_id id) {
    return run_on(e, [](push_consumer& self, kv::request_id id) -> ferry::task<kv::request_verdict> {
      const auto until = clock_type::now() + hang_bound;
      kv::request_verdict v = kv::request_verdict::pending;
      while (clock_type::now() < until) {
        v = self.tracker.verdict(id);
        if (v != kv::request_verdict::pending) break;
        co_await hop{self.e.thread.loop()};  // let the receive loop run
      }
      // A timed-out request drains (cancelled by take_finished, kept until its late notice or the
      // link's failure); any other is handed back by the next take_finished.
      for (const auto& f : self.tracker.take_finished()) self.finished.push_back(f.id);
      co_return v;
    }(*this, id));
  }

  // Waits on the engine thread (bounded) until the tracker has handed `id` back.
  bool released(kv::request_id id) {
    return run_on(e, [](push_consumer& self, kv::request_id id) -> ferry::task<bool> {
      const auto until = clock_type::now() + hang_bound;
      while (self.tracker.tracks(id) && clock_type::now() < until) {
        for (const auto& f : self.tracker.take_finished()) self.finished.push_back(f.id);
        co_await hop{self.e.thread.loop()};
      }
      co_return !self.tracker.tracks(id);
    }(*this, id));
  }

  Engine& e;
  kv::push_receiver receiver;
  kv::load_tracker tracker{{}, [this](const ferry::transfer& t) { receiver.cancel(t); }};
  Link* from_ = nullptr;  // the link the receive loop runs on, once started
  std::atomic<bool> receive_ended{false};
  std::vector<kv::request_id> finished;

 private:
  close_fn close_;
};

}  // namespace ferry_test::kv_links

#pragma once
// The device's asynchronous events (QP fatal, CQ error, device fatal, port down, ...), read by a
// thread of its own and queued for the executor, which handles them (teardown.hpp's
// handle_async_events) since it owns all the state they change.

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "ferry/progress_executor.hpp"

namespace ferry::verbs::detail {

template <class P>
class async_event_watcher {
 public:
  using async_event = typename P::async_event;

  async_event_watcher() noexcept = default;
  async_event_watcher(const async_event_watcher&) = delete;
  async_event_watcher& operator=(const async_event_watcher&) = delete;
  ~async_event_watcher() {
    stop();
    if (stop_fd_ >= 0) ::close(stop_fd_);
  }

  // Starts the thread reading `context`'s events; it wakes `exec` when it has queued some.
  void start(typename P::context_handle context, progress_executor& exec) {
    context_ = context;
    exec_ = &exec;
    stop_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (stop_fd_ < 0) throw std::system_error(errno, std::system_category(), "ferry::verbs: eventfd");
    thread_ = std::thread([this] { run(); });
  }

  // Stops and joins the thread, if it runs; before the context it reads is closed.
  void stop() noexcept {
    if (!thread_.joinable()) return;
    const std::uint64_t one = 1;
    [[maybe_unused]] const ssize_t n = ::write(stop_fd_, &one, sizeof one);
    thread_.join();
  }

  // True when events are queued (the executor's cheap test each round).
  [[nodiscard]] bool pending() const noexcept { return pending_.load(std::memory_order_acquire); }

  // The queued events, in order, taken off the queue (the executor's).
  [[nodiscard]] std::vector<async_event> take() noexcept {
    std::vector<async_event> events;
    std::lock_guard lock(mutex_);
    events.swap(events_);
    pending_.store(false, std::memory_order_relaxed);
    return events;
  }

 private:
  // The watcher thread: asynchronous events are rare, so they get a thread of their own instead of
  // a system call in every executor round. It hands them to the executor, which owns all state.
  void run() noexcept {
    pollfd fds[2]{};
    fds[0].fd = P::async_fd(context_);
    fds[0].events = POLLIN;
    fds[1].fd = stop_fd_;
    fds[1].events = POLLIN;
    for (;;) {
      const int n = ::poll(fds, 2, -1);
      if (n < 0) {
        if (errno == EINTR) continue;
        return;
      }
      if (fds[1].revents != 0) return;
      if ((fds[0].revents & POLLIN) != 0) {
        async_event ev{};
        bool any = false;
        while (P::get_async_event(context_, ev) == 0) {
          std::lock_guard lock(mutex_);
          try {
            events_.push_back(ev);
          } catch (...) {
            // Out of memory: a fatal event still ends everything it names through its flushes
            // and deadlines; nothing else can be done here.
          }
          any = true;
        }
        if (any) {
          // Release pairs with the acquire load in pending(): the queued events travel with it.
          pending_.store(true, std::memory_order_release);
          exec_->notify();
        }
      } else if ((fds[0].revents & (POLLERR | POLLHUP | POLLNVAL)) != 0) {
        return;
      }
    }
  }

  typename P::context_handle context_{};
  progress_executor* exec_ = nullptr;
  int stop_fd_ = -1;
  std::mutex mutex_;
  std::vector<async_event> events_;
  std::atomic<bool> pending_{false};
  std::thread thread_;  // last: started once everything it reads is set
};

}  // namespace ferry::verbs::detail

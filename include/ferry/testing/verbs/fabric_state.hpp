#pragma once
// The fake fabric's bookkeeping (fabric.hpp): every object it has made, owned here and found by
// key and queue pair number, and how completions and asynchronous events reach their queues and
// descriptors. One mutex guards all of it; the NIC thread (nic.hpp), the verbs calls
// (object_calls.hpp, data_calls.hpp) and fault injection (fabric.hpp) hold it while they work on it.

#include <infiniband/verbs.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include <sys/eventfd.h>
#include <unistd.h>

#include "ferry/testing/verbs/objects.hpp"

namespace ferry::verbs::fake {

class fabric_state {
 protected:
  // The limits create_qp and create_cq grant at most.
  static constexpr std::uint32_t max_wr = 32768;
  static constexpr std::uint32_t max_sge = 16;
  static constexpr std::uint32_t max_inline = 256;
  static constexpr int max_cqe = (1 << 22) - 1;

  // Called with the mutex held after every change that may give the NIC something to do.
  void wake() {
    ++generation_;
    nic_wake_.notify_one();
  }

  void push(cq& c, const completion& e, bool solicited) {
    if (e.owner->drop_completions_ || c.error_) return;
    if (c.entries_.size() == c.capacity_) {
      fail(c);
      return;
    }
    last_push_.store(std::chrono::steady_clock::now().time_since_epoch().count(),
                     std::memory_order_release);
    c.entries_.push_back(e);
    c.ready_.store(c.entries_.size(), std::memory_order_release);
    completions_pushed_.fetch_add(1, std::memory_order_relaxed);
    const bool fires = !c.solicited_only_ || solicited || e.wc.status != IBV_WC_SUCCESS;
    if (!c.armed_ || !fires) return;
    c.armed_ = false;
    if (c.channel_ == nullptr) return;
    c.channel_->events_.push_back(&c);
    ::eventfd_write(c.channel_->fd_, 1);
  }

  void fail(cq& c) {
    if (c.error_) return;
    c.error_ = true;
    post_event(*c.context_, event{IBV_EVENT_CQ_ERR, nullptr, &c, 0});
  }

  static void post_event(context& c, const event& e) {
    c.events_.push_back(e);
    ::eventfd_write(c.async_fd_, 1);
  }

  void post_device_event(const device& d, ibv_event_type type) {
    const int port = type == IBV_EVENT_DEVICE_FATAL ? 0 : 1;
    for (const auto& c : contexts_) {
      if (c->device_ == &d) post_event(*c, event{type, nullptr, nullptr, port});
    }
  }

  // Takes `n` events off a semaphore eventfd.
  static void unsignal(int fd, std::size_t n) {
    eventfd_t value = 0;
    for (std::size_t i = 0; i < n; ++i) ::eventfd_read(fd, &value);
  }

  qp* peer(std::uint16_t lid, std::uint32_t qpn) const {
    const auto it = by_qpn_.find(qpn);
    if (it == by_qpn_.end() || it->second->pd_->context_->device_->lid_ != lid) return nullptr;
    return it->second;
  }

  device* find_device(const std::string& name) const {
    for (const auto& d : devices_) {
      if (d->name_ == name) return d.get();
    }
    return nullptr;
  }

  // A new key: an odd multiplier makes them distinct over 2^32 and far from each other, so a key
  // off by a constant is not another live one.
  std::uint32_t next_key() { return ++keys_issued_ * 0x9E3779B1u; }

  template <class T>
  static T* keep(std::vector<std::unique_ptr<T>>& owned, std::unique_ptr<T> object) {
    owned.push_back(std::move(object));
    return owned.back().get();
  }

  template <class T>
  static void discard(std::vector<std::unique_ptr<T>>& owned, const T* object) {
    std::erase_if(owned, [object](const std::unique_ptr<T>& o) { return o.get() == object; });
  }

  static void forget_events(context& c, auto&& names) {
    unsignal(c.async_fd_, std::erase_if(c.events_, names));
  }

  // As the adapter's driver does when a queue pair is reset or destroyed: its completions still in
  // the completion queues are discarded.
  static void forget_completions(const qp& q) {
    const auto owned = [&q](const completion& e) { return e.owner == &q; };
    std::erase_if(q.send_cq_->entries_, owned);
    std::erase_if(q.recv_cq_->entries_, owned);
    q.send_cq_->ready_.store(q.send_cq_->entries_.size(), std::memory_order_release);
    q.recv_cq_->ready_.store(q.recv_cq_->entries_.size(), std::memory_order_release);
  }

  static bool dead(const context& c) { return c.device_->fatal_; }

  mutable std::mutex mutex_;
  std::condition_variable nic_wake_;
  bool stop_ = false;
  bool paused_ = false;
  std::uint64_t generation_ = 0;  // bumped by wake(); the NIC sleeps while it is unchanged
  std::vector<std::unique_ptr<device>> devices_;
  std::vector<std::unique_ptr<context>> contexts_;
  std::vector<std::unique_ptr<pd>> pds_;
  std::vector<std::unique_ptr<mr>> mrs_;
  std::vector<std::unique_ptr<channel>> channels_;
  std::vector<std::unique_ptr<cq>> cqs_;
  std::vector<std::unique_ptr<qp>> qps_;
  std::unordered_map<std::uint32_t, mr*> by_lkey_;
  std::unordered_map<std::uint32_t, mr*> by_rkey_;
  std::unordered_map<std::uint32_t, qp*> by_qpn_;
  std::uint32_t keys_issued_ = 0;
  std::uint32_t next_qpn_ = 0x100;
  std::atomic<std::uint64_t> posted_send_wrs_{0};
  std::atomic<std::uint64_t> completions_pushed_{0};
  std::atomic<std::chrono::steady_clock::rep> last_push_{0};
};

}  // namespace ferry::verbs::fake

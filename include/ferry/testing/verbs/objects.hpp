#pragma once
// The objects behind the fake provider's handles (testing/verbs/provider.hpp): devices, contexts,
// protection domains, regions, channels, completion queues and queue pairs of the in-process fabric
// (testing/verbs/fabric.hpp).

#include <infiniband/verbs.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "ferry/verbs/provider.hpp"

namespace ferry::verbs::fake {

class fabric;
class fabric_state;
class nic;
class object_calls;
class data_calls;
class qp;
class cq;

using event = basic_async_event<qp*, cq*>;

// The objects the provider's handles point to. Only the fabric looks inside, under its mutex, except
// for the fields that never change after creation (keys, numbers, descriptors).

class device {
  friend class fabric;
  friend class fabric_state;
  friend class nic;
  friend class object_calls;
  friend class data_calls;
  std::string name_;
  std::uint16_t lid_ = 0;
  std::size_t open_contexts_ = 0;
  bool port_up_ = true;
  bool fatal_ = false;
};

class context {
  friend class fabric;
  friend class fabric_state;
  friend class nic;
  friend class object_calls;
  friend class data_calls;
  friend struct provider;
  device* device_ = nullptr;
  int async_fd_ = -1;
  std::deque<event> events_;
  std::size_t users_ = 0;  // protection domains, channels and completion queues
};

class pd {
  friend class fabric;
  friend class fabric_state;
  friend class nic;
  friend class object_calls;
  friend class data_calls;
  context* context_ = nullptr;
  std::size_t users_ = 0;  // memory regions and queue pairs
};

class mr {
  friend class fabric;
  friend class fabric_state;
  friend class nic;
  friend class object_calls;
  friend class data_calls;
  friend struct provider;
  pd* pd_ = nullptr;
  std::uintptr_t base_ = 0;
  std::size_t length_ = 0;
  int access_ = 0;
  std::uint32_t lkey_ = 0;
  std::uint32_t rkey_ = 0;
};

class channel {
  friend class fabric;
  friend class fabric_state;
  friend class nic;
  friend class object_calls;
  friend class data_calls;
  friend struct provider;
  context* context_ = nullptr;
  int fd_ = -1;  // an EFD_SEMAPHORE eventfd counting events_, so it is readable while one is pending
  std::deque<cq*> events_;
  std::size_t users_ = 0;  // completion queues
};

struct completion {
  ibv_wc wc{};
  qp* owner = nullptr;
  std::uint64_t seq = 0;  // the send request's sequence number; polling it releases it and older ones
  bool send = false;
};

class cq {
  friend class fabric;
  friend class fabric_state;
  friend class nic;
  friend class object_calls;
  friend class data_calls;
  context* context_ = nullptr;
  channel* channel_ = nullptr;
  std::size_t capacity_ = 0;
  std::deque<completion> entries_;
  // entries_.size(), stored under the fabric mutex after every change: an empty poll (the common
  // case for a busy poller) reads it without taking the mutex, as a real CQ poll reads the ring.
  std::atomic<std::size_t> ready_{0};
  bool armed_ = false;
  bool solicited_only_ = false;
  bool error_ = false;
  std::uint64_t events_taken_ = 0;
  std::uint64_t events_acked_ = 0;
  std::size_t users_ = 0;  // queue pairs
};

struct send_request {
  std::uint64_t seq = 0;
  std::uint64_t wr_id = 0;
  ibv_wr_opcode opcode = IBV_WR_SEND;
  unsigned flags = 0;
  std::vector<ibv_sge> sges;         // not used when inline
  std::vector<std::byte> inline_data;
  std::size_t length = 0;
  std::uint64_t remote_addr = 0;
  std::uint32_t rkey = 0;
  std::uint32_t imm = 0;  // network byte order, as posted
};

struct receive_request {
  std::uint64_t wr_id = 0;
  std::vector<ibv_sge> sges;
};

class qp {
  friend class fabric;
  friend class fabric_state;
  friend class nic;
  friend class object_calls;
  friend class data_calls;
  friend struct provider;
  pd* pd_ = nullptr;
  cq* send_cq_ = nullptr;
  cq* recv_cq_ = nullptr;
  std::uint32_t num_ = 0;
  ibv_qp_cap cap_{};
  ibv_qp_state state_ = IBV_QPS_RESET;
  unsigned access_ = 0;
  std::uint16_t dest_lid_ = 0;
  std::uint32_t dest_qpn_ = 0;
  std::uint8_t max_rd_atomic_ = 0;       // READs it has in flight at once as a requester (RTS)
  std::uint8_t max_dest_rd_atomic_ = 0;  // READs it accepts in flight as a responder (RTR)
  // Every outstanding send request, oldest first: those executed but not yet released by a poll,
  // then those still to execute, from sequence number next_exec_ on.
  std::deque<send_request> sq_;
  std::uint64_t next_seq_ = 0;
  std::uint64_t next_exec_ = 0;
  std::deque<receive_request> rq_;  // posted and not yet consumed
  std::size_t receives_outstanding_ = 0;  // posted and whose completion has not been polled
  bool drop_completions_ = false;
};


}  // namespace ferry::verbs::fake

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

/// An asynchronous event of the fake fabric, as the provider's get_async_event returns it.
using event = basic_async_event<qp*, cq*>;

// The objects the provider's handles point to. Only the fabric looks inside, under its mutex, except
// for the fields that never change after creation (keys, numbers, descriptors).

/// A fake adapter (fabric::add_device): one InfiniBand port, which fault injection can take down.
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

/// An opened device (provider::open_device): its asynchronous events and the objects made on it.
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

/// A protection domain of the fake fabric.
class pd {
  friend class fabric;
  friend class fabric_state;
  friend class nic;
  friend class object_calls;
  friend class data_calls;
  context* context_ = nullptr;
  std::size_t users_ = 0;  // memory regions and queue pairs
};

/// A registered memory region of the fake fabric: its range, access and keys.
///
/// Work requests address it from `iova_` on; its bytes are at `base_` in this process. The two are
/// the same for reg_mr, and may differ for reg_dmabuf_mr, whose caller picks the address.
class mr {
  friend class fabric;
  friend class fabric_state;
  friend class nic;
  friend class object_calls;
  friend class data_calls;
  friend struct provider;
  pd* pd_ = nullptr;
  std::uintptr_t base_ = 0;
  std::uint64_t iova_ = 0;
  std::size_t length_ = 0;
  int access_ = 0;
  std::uint32_t lkey_ = 0;
  std::uint32_t rkey_ = 0;
};

/// A completion channel of the fake fabric, with a real descriptor to sleep on.
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

/// A work completion waiting in a fake completion queue.
struct completion {
  ibv_wc wc{};  ///< what poll_cq hands back
  qp* owner = nullptr;  ///< the queue pair it belongs to
  std::uint64_t seq = 0;  ///< the send request's sequence number; polling it releases it and older ones
  bool send = false;  ///< a send request's completion (false: a receive's)
};

/// A completion queue of the fake fabric: its capacity is real, and it fails when it would overrun.
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

/// A send work request as the fake fabric keeps it, copied from the posted ibv_send_wr.
struct send_request {
  std::uint64_t seq = 0;  ///< its sequence number on the queue pair
  std::uint64_t wr_id = 0;  ///< the caller's wr_id
  ibv_wr_opcode opcode = IBV_WR_SEND;  ///< RDMA WRITE, READ, SEND, ...
  unsigned flags = 0;  ///< the ibv_send_flags posted
  std::vector<ibv_sge> sges;         ///< not used when inline
  std::vector<std::byte> inline_data;  ///< the bytes of an inline send, copied at post time
  std::size_t length = 0;  ///< total bytes
  std::uint64_t remote_addr = 0;  ///< the peer's address, for RDMA operations
  std::uint32_t rkey = 0;  ///< the peer's remote key, for RDMA operations
  std::uint32_t imm = 0;  ///< network byte order, as posted
};

/// A receive work request as the fake fabric keeps it.
struct receive_request {
  std::uint64_t wr_id = 0;  ///< the caller's wr_id
  std::vector<ibv_sge> sges;  ///< where a received message goes
};

/// A reliable-connected queue pair of the fake fabric, with its send and receive queues.
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

#pragma once
// One call a submitter makes (a get, a put, a batch of either, a notification, a wait for one, a
// connect, an accept, a close), as the executor carries it out. Every field is written by the
// submitter before the request is published and touched only by the executor after.
//
// Two counts end a request. Its members' transfers end when their parts have (members_left), or
// earlier, when ferry abandons them: a force-closed endpoint whose requests UCX does not call back.
// The request itself is freed only once UCX has called back every request it was handed
// (ucx_out), so a late callback finds it, and the regions it holds stay registered while UCX may
// still touch them. Requests with UCX requests out are on the engine's held list.

#include <ucp/api/ucp.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <system_error>
#include <vector>

#include "ferry/detail/status_block.hpp"
#include "ferry/detail/timer_service.hpp"
#include "ferry/errors.hpp"
#include "ferry/transfer_state.hpp"
#include "ferry/ucx/memory_region.hpp"
#include "ferry/ucx/options.hpp"
#include "ferry/ucx/remote.hpp"

namespace ferry::ucx::detail {

struct endpoint_state;
struct listener_state;
class engine;

enum class request_kind : std::uint8_t {
  put,
  get,
  notify,             // flush the endpoint, then send the notification
  wait_notification,  // the next notification the peer sends
  connect,            // by host and port: exchange hellos, then create the endpoint
  accept,             // the next endpoint a listener has finished the exchange with
  close,              // flush, then close an endpoint (from its last handle, or close())
  call,               // run a function on the executor thread (creating objects)
};

struct request;

// What a connect or accept by host and port ends with, shared by its request and the caller's
// pending_endpoint (worker.hpp).
struct connect_result {
  std::shared_ptr<endpoint_state> out;  // written before the request's transfer ends
  std::string error;                    // likewise: why it failed, in words
  // The caller let go of its pending_endpoint without taking the endpoint: whoever sees the
  // success and this both (the executor, or the caller's destructor) closes it; twice is harmless.
  std::atomic<bool> dropped{false};
};

// One transfer of a request: a batch has several, everything else one.
struct member {
  ferry::detail::status_block* status = nullptr;  // holds the completer reference
  request* owner = nullptr;
  std::shared_ptr<region_state> region;  // held until the request ends
  std::byte* local = nullptr;
  std::size_t length = 0;
  ucp_mem_h memh = nullptr;
  std::uint64_t remote_address = 0;
  std::uint32_t remote_index = 0;
  int outstanding = 0;  // parts of this member not yet ended (its UCX request, the flush, an ack)
  std::error_code failure;
};

struct request_timer : ferry::detail::timer_node {
  request* owner = nullptr;
};

struct request {
  request* next = nullptr;  // the submission stack's link
  request_kind kind = request_kind::call;
  engine* eng = nullptr;
  std::shared_ptr<endpoint_state> endpoint;
  std::shared_ptr<listener_state> listener;
  std::vector<member> members;
  std::size_t members_left = 0;  // members whose transfers have not ended
  std::size_t ucx_out = 0;       // UCX requests not yet called back
  std::size_t counted = 0;       // of them, counted in flight (none once abandoned)
  request* held_prev = nullptr;  // the engine's held list, while ucx_out != 0
  request* held_next = nullptr;
  bool held = false;
  bool abandoned = false;        // its members ended while UCX still held some of its requests
  unsigned pins = 0;  // callers up the stack using it, and lists holding it: not freed while any
  bool deadline_listed = false;  // on the engine's list of deadlines to act on
  request* armed_prev = nullptr;  // the engine's list of requests whose timers are armed
  request* armed_next = nullptr;
  request* due_next = nullptr;   // that list's link
  put_completion completion = put_completion::landed;
  bool has_deadline = false;
  bool deadline_passed = false;
  bool peer_checked = false;  // a same-host peer's pid, looked at when the first member ends
  bool peer_exited = false;
  ferry::detail::clock::time_point deadline{};
  std::uint64_t published_ns = 0;  // a get or put, on a worker that records metrics
  request_timer timer;
  int flushes = 0;  // the flush that ends a landed put batch or comes before a notification
  std::uint64_t value = 0;  // notify: the value; close: flushes so far
  std::uint64_t sequence = 0;  // notify: what the receiver's acknowledgement names
  std::uint64_t sends_at_flush = 0;  // close: the endpoint's sends when its last flush was posted
  std::uint64_t* value_out = nullptr;
  std::function<std::error_code()> call;
  std::string* call_error_out = nullptr;  // where a call's exception message goes
  std::shared_ptr<connect_result> result;  // connect, accept: what endpoint_out and call_error_out
                                          // point into
  std::shared_ptr<endpoint_state>* endpoint_out = nullptr;  // accept, connect
  // connect
  std::string host;
  std::uint16_t port = 0;
  std::vector<remote_region> expose;  // what this side tells the peer
  alignas(8) unsigned char header[64];  // an active message's header, which UCX may read later

  request() = default;
  request(const request&) = delete;
  request& operator=(const request&) = delete;
  // The executor frees a request once every member has ended. One freed before (making it threw
  // part-way, on the submitter's thread) fails the members it had made transfers for, so that no
  // transfer stays pending for ever.
  ~request() {
    for (member& m : members) {
      if (m.status == nullptr) continue;
      m.status->complete(transfer_state::failed, make_error_code(ferry::errc::backend_shut_down));
      m.status->release_completer_ref();
    }
  }
};

}  // namespace ferry::ucx::detail

#pragma once
// Handing a get or put request to UCX: each member's range is checked against the region the peer
// described, then given to ucp_get_nbx or ucp_put_nbx; a landed put batch is followed by one flush
// of its endpoint (completion.hpp). A GPU region's memory type goes with each of its members. A part
// of engine (engine.hpp). Executor thread only.

#include <ucp/api/ucp.h>

#include <cstddef>
#include <system_error>

#include "ferry/ucx/detail/endpoint_state.hpp"
#include "ferry/ucx/detail/request.hpp"
#include "ferry/ucx/errors.hpp"
#include "ferry/ucx/options.hpp"

namespace ferry::ucx::detail {

template <class E>
struct submission {
  [[nodiscard]] E& self() noexcept { return static_cast<E&>(*this); }

  // Why `r`'s endpoint cannot take it; empty when it can.
  [[nodiscard]] static std::error_code refusal(const request* r) {
    if (!r->endpoint) return make_error_code(errc::endpoint_closed);
    if (r->endpoint->carries_requests()) return {};
    const std::error_code f = r->endpoint->failure();
    return f ? f : make_error_code(errc::endpoint_closed);
  }

  // Why member `m` cannot go out on `e`; empty when it can. `rkey` is set when it can.
  [[nodiscard]] static std::error_code check_member(endpoint_state& e, const member& m,
                                                    ucp_rkey_h& rkey) {
    if (e.ep == nullptr) {
      const std::error_code f = e.failure();
      return f ? f : make_error_code(errc::endpoint_closed);
    }
    if (m.remote_index >= e.regions.size()) return make_error_code(errc::outside_region);
    const imported_region& ir = e.regions[m.remote_index];
    if (m.remote_address < ir.address || m.length > ir.length ||
        m.remote_address - ir.address > ir.length - m.length) {
      return make_error_code(errc::outside_region);
    }
    rkey = ir.rkey;
    return {};
  }

  void start_rma(request* r) noexcept {
    E& s = self();
    if (const std::error_code ec = refusal(r)) return s.finish_all(r, ec);
    endpoint_state& e = *r->endpoint;
    s.arm_deadline(r);
    const bool put = r->kind == request_kind::put;
    const bool flush = put && r->completion == put_completion::landed;
    // Not freed while its members are handed over, whatever ends them meanwhile.
    ++r->pins;
    for (member& m : r->members) {
      ucp_rkey_h rkey = nullptr;
      // UCX may fail the endpoint inside an earlier member's call (its error handler, which
      // force-closes it): the rest are not handed to a closed endpoint.
      const std::error_code ec = r->abandoned ? e.failure() : check_member(e, m, rkey);
      if (ec) {
        m.failure = ec;
        m.outstanding = 1;  // the flush does not wait for a member that never went
        s.member_step(m, UCS_OK);
        continue;
      }
      m.outstanding = 1 + (flush ? 1 : 0);
      ucp_request_param_t p{};
      p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
      if (m.memh != nullptr) {
        p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
        p.memh = m.memh;
      }
      // A GPU region's type is known: UCX need not look the buffer up to find it.
      if (m.region && m.region->type != memory_type::host) {
        p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMORY_TYPE;
        p.memory_type = to_ucs(m.region->type);
      }
      p.cb.send = &E::on_member_done;
      p.user_data = &m;
      const ucs_status_ptr_t sp =
          put ? ::ucp_put_nbx(e.ep, m.local, m.length, m.remote_address, rkey, &p)
              : ::ucp_get_nbx(e.ep, m.local, m.length, m.remote_address, rkey, &p);
      s.track(e, sp, m);
    }
    if (flush && r->members_left != 0 && !r->abandoned) s.start_flush(r);
    --r->pins;
    s.maybe_destroy(r);
  }
};

}  // namespace ferry::ucx::detail

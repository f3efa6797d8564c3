#pragma once
// Memory registered with a UCX context: user memory, or memory UCX allocates itself (which over
// shared memory a peer reaches directly; registered user memory goes through UCX's emulation there).
// A region is reference counted: every request that uses it holds it, so it is unmapped only once
// UCX can no longer touch it, whatever the user has let go of.

#include <ucp/api/ucp.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

#include "ferry/ucx/errors.hpp"
#include "ferry/ucx/remote.hpp"

namespace ferry::ucx {

namespace detail {

// Keeps the UCX context until the last region mapped in it is unmapped.
struct context_holder {
  ucp_context_h context = nullptr;
  context_holder() = default;
  context_holder(const context_holder&) = delete;
  context_holder& operator=(const context_holder&) = delete;
  ~context_holder() {
    if (context != nullptr) ::ucp_cleanup(context);
  }
};

struct region_state {
  std::shared_ptr<context_holder> context;
  ucp_mem_h memh = nullptr;
  std::byte* base = nullptr;
  std::size_t length = 0;
  bool allocated = false;  // UCX allocated it (UCP_MEM_MAP_ALLOCATE)
  std::vector<std::byte> packed_key;

  region_state() = default;
  region_state(const region_state&) = delete;
  region_state& operator=(const region_state&) = delete;
  // The context was made with mt_workers_shared, so mapping and unmapping are safe on any thread.
  ~region_state() {
    if (memh != nullptr) (void)::ucp_mem_unmap(context->context, memh);
  }
};

[[noreturn]] inline void throw_status(ucs_status_t s, const std::string& what) {
  throw std::system_error(status_error(s), what);
}

// Maps [address, address + length) (address null with `allocate`: UCX allocates) and packs its key.
inline std::shared_ptr<region_state> map_region(const std::shared_ptr<context_holder>& ctx,
                                                void* address, std::size_t length, bool allocate) {
  if (length == 0) {
    throw std::invalid_argument("ferry::ucx: a memory region must have at least one byte");
  }
  auto r = std::make_shared<region_state>();
  r->context = ctx;
  ucp_mem_map_params_t p{};
  p.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                 UCP_MEM_MAP_PARAM_FIELD_FLAGS;
  p.address = address;
  p.length = length;
  p.flags = allocate ? UCP_MEM_MAP_ALLOCATE : 0;
  if (const ucs_status_t s = ::ucp_mem_map(ctx->context, &p, &r->memh); s != UCS_OK) {
    throw_status(s, "ferry::ucx: registering " + std::to_string(length) + " bytes (ucp_mem_map)");
  }
  ucp_mem_attr_t attr{};
  attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
  if (const ucs_status_t s = ::ucp_mem_query(r->memh, &attr); s != UCS_OK) {
    throw_status(s, "ferry::ucx: ucp_mem_query");
  }
  r->base = static_cast<std::byte*>(attr.address);
  r->length = length;
  r->allocated = allocate;
  void* key = nullptr;
  std::size_t key_bytes = 0;
  if (const ucs_status_t s = ::ucp_rkey_pack(ctx->context, r->memh, &key, &key_bytes);
      s != UCS_OK) {
    throw_status(s, "ferry::ucx: packing the remote key (ucp_rkey_pack)");
  }
  const auto* k = static_cast<const std::byte*>(key);
  r->packed_key.assign(k, k + key_bytes);
  ::ucp_rkey_buffer_release(key);
  return r;
}

}  // namespace detail

class memory_region;

/// A range of a local region, for a get's destination or a put's source.
struct local_slice {
  const memory_region* region = nullptr;  ///< the region, whose handle must outlive the call
  std::size_t offset = 0;  ///< where the range starts in the region
  std::size_t length = 0;  ///< bytes
};

/// Memory registered with a worker's UCX context (worker::register_memory or worker::allocate).
///
/// A shared handle: every request using the region holds it, so it is unmapped only once UCX can no
/// longer touch it. describe() gives what a peer needs to reach it.
class memory_region {
 public:
  /// An empty handle (false), registering nothing.
  memory_region() = default;
  /// Takes a mapped region's state (the worker's register_memory and allocate make them).
  explicit memory_region(std::shared_ptr<detail::region_state> s) noexcept : state_(std::move(s)) {}

  /// The region's memory (empty for an empty handle).
  [[nodiscard]] std::span<std::byte> bytes() const noexcept {
    return state_ ? std::span<std::byte>(state_->base, state_->length) : std::span<std::byte>();
  }
  /// True when UCX allocated the memory (worker::allocate) rather than registering the user's.
  [[nodiscard]] bool allocated_by_ucx() const noexcept { return state_ && state_->allocated; }
  /// True unless the handle is empty.
  [[nodiscard]] explicit operator bool() const noexcept { return state_ != nullptr; }

  /// What a peer needs to reach this region, as bytes for the user's own channel
  /// (remote_region::from_bytes on the other side).
  [[nodiscard]] remote_region describe() const {
    if (!state_) throw std::logic_error("ferry::ucx::memory_region::describe on an empty region");
    return {reinterpret_cast<std::uintptr_t>(state_->base), state_->length, state_->packed_key};
  }

  /// The `n` bytes at `offset` into the region.
  /// Throws std::out_of_range when [offset, offset + n) is not inside the region.
  [[nodiscard]] local_slice slice(std::size_t offset, std::size_t n) const {
    if (!state_ || offset > state_->length || n > state_->length - offset) {
      throw std::out_of_range("ferry::ucx::memory_region::slice: bytes [" + std::to_string(offset) +
                              ", " + std::to_string(offset) + " + " + std::to_string(n) +
                              ") are outside the region of " +
                              std::to_string(state_ ? state_->length : 0) + " bytes");
    }
    return {this, offset, n};
  }
  /// The whole region as one slice.
  [[nodiscard]] local_slice whole() const { return slice(0, state_ ? state_->length : 0); }

  /// The shared state that requests hold (for the worker).
  [[nodiscard]] const std::shared_ptr<detail::region_state>& state() const noexcept {
    return state_;
  }

 private:
  std::shared_ptr<detail::region_state> state_;
};

}  // namespace ferry::ucx

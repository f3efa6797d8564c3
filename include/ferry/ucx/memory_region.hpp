#pragma once
// Memory registered with a UCX context: user memory, or memory UCX allocates itself (which over
// shared memory a peer reaches directly; registered user memory goes through UCX's emulation there).
// A region is reference counted: every request that uses it holds it, so it is unmapped only once
// UCX can no longer touch it, whatever the user has let go of. GPU memory is registered only where
// the UCX in use was built with support for it (asked of the context once); elsewhere registering it
// fails with errc::memory_type_unsupported, never staging it through host memory.

#include <ucp/api/ucp.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

#include "ferry/ucx/errors.hpp"
#include "ferry/ucx/remote.hpp"

namespace ferry::ucx {

/// Where registered memory lives: host memory, or a GPU's (worker::register_memory with a type).
/// The values are UCX's ucs_memory_type_t ones.
enum class memory_type : int {
  host = UCS_MEMORY_TYPE_HOST,                  ///< ordinary host memory
  cuda = UCS_MEMORY_TYPE_CUDA,                  ///< NVIDIA GPU memory (cudaMalloc)
  cuda_managed = UCS_MEMORY_TYPE_CUDA_MANAGED,  ///< NVIDIA managed memory (cudaMallocManaged)
  rocm = UCS_MEMORY_TYPE_ROCM,                  ///< AMD GPU memory (hipMalloc)
  rocm_managed = UCS_MEMORY_TYPE_ROCM_MANAGED,  ///< AMD managed memory (hipMallocManaged)
};

/// The name of `t`: "host", "cuda", "cuda_managed", "rocm" or "rocm_managed" ("unknown" for a value
/// that is none of them).
[[nodiscard]] constexpr const char* memory_type_name(memory_type t) noexcept {
  switch (t) {
    case memory_type::host: return "host";
    case memory_type::cuda: return "cuda";
    case memory_type::cuda_managed: return "cuda_managed";
    case memory_type::rocm: return "rocm";
    case memory_type::rocm_managed: return "rocm_managed";
  }
  return "unknown";
}

/// `t` as UCX's ucs_memory_type_t.
[[nodiscard]] constexpr ucs_memory_type_t to_ucs(memory_type t) noexcept {
  return static_cast<ucs_memory_type_t>(t);
}

namespace detail {

[[noreturn]] inline void throw_status(ucs_status_t s, const std::string& what) {
  throw std::system_error(status_error(s), what);
}

// Keeps the UCX context until the last region mapped in it is unmapped, and what it supports.
struct context_holder {
  ucp_context_h context = nullptr;
  context_holder() = default;
  context_holder(const context_holder&) = delete;
  context_holder& operator=(const context_holder&) = delete;
  ~context_holder() {
    if (context != nullptr) ::ucp_cleanup(context);
  }

  // The memory types the context can register, a bit per ucs_memory_type_t (ucp_context_query,
  // asked once; any thread).
  [[nodiscard]] std::uint64_t memory_types() {
    std::call_once(memory_types_queried_, [this] {
      ucp_context_attr_t attr{};
      attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
      if (const ucs_status_t s = ::ucp_context_query(context, &attr); s != UCS_OK) {
        throw_status(s, "ferry::ucx: asking UCX which memory types it supports (ucp_context_query)");
      }
      memory_types_ = attr.memory_types;
    });
    return memory_types_;
  }

 private:
  std::once_flag memory_types_queried_;
  std::uint64_t memory_types_ = 0;  // written once, inside call_once, which publishes it
};

struct region_state {
  std::shared_ptr<context_holder> context;
  ucp_mem_h memh = nullptr;
  std::byte* base = nullptr;
  std::size_t length = 0;
  bool allocated = false;  // UCX allocated it (UCP_MEM_MAP_ALLOCATE)
  memory_type type = memory_type::host;
  std::vector<std::byte> packed_key;

  region_state() = default;
  region_state(const region_state&) = delete;
  region_state& operator=(const region_state&) = delete;
  // The context was made with mt_workers_shared, so mapping and unmapping are safe on any thread.
  ~region_state() {
    if (memh != nullptr) (void)::ucp_mem_unmap(context->context, memh);
  }
};

// The memory types in `bits` (a bit per ucs_memory_type_t), by name: "host, cuda".
inline std::string memory_type_names(std::uint64_t bits) {
  std::string out;
  for (const memory_type t : {memory_type::host, memory_type::cuda, memory_type::cuda_managed,
                              memory_type::rocm, memory_type::rocm_managed}) {
    if ((bits & (std::uint64_t{1} << static_cast<unsigned>(to_ucs(t)))) == 0) continue;
    if (!out.empty()) out += ", ";
    out += memory_type_name(t);
  }
  return out.empty() ? "none" : out;
}

// Throws errc::memory_type_unsupported, saying what this UCX supports and what would, unless the
// context can register `type`. Nothing is ever staged through host memory instead.
inline void check_memory_type(context_holder& ctx, memory_type type, std::size_t length) {
  const auto bit = static_cast<unsigned>(to_ucs(type));
  if (bit >= static_cast<unsigned>(UCS_MEMORY_TYPE_LAST)) {
    throw std::invalid_argument("ferry::ucx: memory type " +
                                std::to_string(static_cast<int>(type)) +
                                " is none of ferry::ucx::memory_type's values");
  }
  const std::uint64_t supported = ctx.memory_types();
  if ((supported & (std::uint64_t{1} << bit)) != 0) return;
  const bool nvidia = type == memory_type::cuda || type == memory_type::cuda_managed;
  const bool amd = type == memory_type::rocm || type == memory_type::rocm_managed;
  throw std::system_error(
      make_error_code(errc::memory_type_unsupported),
      std::string("ferry::ucx: registering ") + std::to_string(length) + " bytes of " +
          memory_type_name(type) + " memory: this UCX (" + ::ucp_get_version_string() +
          ") supports " + memory_type_names(supported) + " memory only. Use a UCX built with " +
          (nvidia ? "CUDA support (configure --with-cuda, so that its cuda_copy and cuda_ipc "
                    "transports load)"
           : amd  ? "ROCm support (configure --with-rocm, so that its rocm_copy and rocm_ipc "
                    "transports load)"
                  : "support for it") +
          ", found first by the loader (LD_LIBRARY_PATH; `ucx_info -d` lists its transports)");
}

// Maps [address, address + length) of `type` memory (address null with `allocate`: UCX allocates
// host memory) and packs its key. A type the context cannot register is refused before mapping.
inline std::shared_ptr<region_state> map_region(const std::shared_ptr<context_holder>& ctx,
                                                void* address, std::size_t length, bool allocate,
                                                memory_type type = memory_type::host) {
  if (length == 0) {
    throw std::invalid_argument("ferry::ucx: a memory region must have at least one byte");
  }
  check_memory_type(*ctx, type, length);
  auto r = std::make_shared<region_state>();
  r->context = ctx;
  ucp_mem_map_params_t p{};
  p.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                 UCP_MEM_MAP_PARAM_FIELD_FLAGS | UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
  p.address = address;
  p.length = length;
  p.flags = allocate ? UCP_MEM_MAP_ALLOCATE : 0;
  p.memory_type = to_ucs(type);
  if (const ucs_status_t s = ::ucp_mem_map(ctx->context, &p, &r->memh); s != UCS_OK) {
    throw_status(s, "ferry::ucx: registering " + std::to_string(length) + " bytes of " +
                        memory_type_name(type) + " memory (ucp_mem_map)");
  }
  ucp_mem_attr_t attr{};
  attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
  if (const ucs_status_t s = ::ucp_mem_query(r->memh, &attr); s != UCS_OK) {
    throw_status(s, "ferry::ucx: ucp_mem_query");
  }
  r->base = static_cast<std::byte*>(attr.address);
  r->length = length;
  r->allocated = allocate;
  r->type = type;
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
/// Host memory, or GPU memory where this UCX was built to register it (memory_type()). A shared
/// handle: every request using the region holds it, so it is unmapped only once UCX can no
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
  /// Where the memory lives (host for an empty handle); gets and puts on a slice of a GPU region
  /// tell UCX so, rather than have it detect the type.
  [[nodiscard]] ferry::ucx::memory_type memory_type() const noexcept {
    return state_ ? state_->type : ferry::ucx::memory_type::host;
  }
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

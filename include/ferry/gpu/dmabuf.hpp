#pragma once
// GPU memory exported as a dma-buf, which an RDMA adapter registers (ferry::verbs'
// basic_memory_region::register_dmabuf) to read and write the GPU's memory directly. The export
// itself is the GPU runtime's: CUDA's cuMemGetHandleForAddressRange (driver 11.7 and later), reached
// through the runtime's driver entry points so that nothing links libcuda; HSA's
// hsa_amd_portable_export_dmabuf on ROCm (HSA AMD extension interface 1.1 and later; which ROCm
// release first ships it was not checked here).
// The CUDA export is compiled where FERRY_GPU_CUDA is defined (link -lcudart), the ROCm one where
// __HIP_PLATFORM_AMD__ is (link -lhsa-runtime64 where the export exists); without either this header
// holds only the descriptor's owner. Tests without a GPU use ferry::testing::fake_dmabuf instead.

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <system_error>
#include <utility>

#if defined(FERRY_GPU_CUDA)
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>
#endif

#if defined(__HIP_PLATFORM_AMD__) && __has_include(<hsa/hsa_ext_amd.h>)
#include <hsa/hsa.h>
#include <hsa/hsa_ext_amd.h>
#endif

namespace ferry::gpu {

/// A dma-buf exported from GPU memory: owns its descriptor, closed on destruction.
///
/// The descriptor covers a page-aligned range around the memory asked for; the memory starts
/// offset() bytes into it and is length() bytes long. Register it with
/// `basic_memory_region::register_dmabuf(device, d.fd(), d.offset(), d.length(), device_pointer)`;
/// the registration holds its own reference, so the dmabuf may be destroyed once that has returned.
/// Move-only.
class dmabuf {
 public:
  /// An empty handle, owning no descriptor.
  dmabuf() noexcept = default;
  /// Takes ownership of `fd`, a dma-buf in which the memory starts `offset` bytes in and is
  /// `length` bytes long.
  dmabuf(int fd, std::uint64_t offset, std::size_t length) noexcept
      : fd_(fd), offset_(offset), length_(length) {}

  /// Takes `other`'s descriptor, leaving it empty.
  dmabuf(dmabuf&& other) noexcept
      : fd_(std::exchange(other.fd_, -1)),
        offset_(std::exchange(other.offset_, 0)),
        length_(std::exchange(other.length_, 0)) {}
  /// Closes its own descriptor and takes `other`'s.
  dmabuf& operator=(dmabuf&& other) noexcept {
    if (this != &other) {
      reset();
      fd_ = std::exchange(other.fd_, -1);
      offset_ = std::exchange(other.offset_, 0);
      length_ = std::exchange(other.length_, 0);
    }
    return *this;
  }
  dmabuf(const dmabuf&) = delete;
  dmabuf& operator=(const dmabuf&) = delete;
  /// Closes the descriptor (reset()).
  ~dmabuf() { reset(); }

  /// The descriptor (-1 when empty).
  [[nodiscard]] int fd() const noexcept { return fd_; }
  /// Where the memory asked for starts inside the dma-buf, in bytes.
  [[nodiscard]] std::uint64_t offset() const noexcept { return offset_; }
  /// The memory's length in bytes (the dma-buf may be longer, up to whole pages).
  [[nodiscard]] std::size_t length() const noexcept { return length_; }
  /// True unless the handle is empty.
  [[nodiscard]] explicit operator bool() const noexcept { return fd_ >= 0; }

  /// Closes the descriptor, leaving the handle empty; regions registered through it stay.
  void reset() noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
    offset_ = 0;
    length_ = 0;
  }
  /// Gives up the descriptor without closing it: the caller owns it from now on.
  [[nodiscard]] int release() noexcept {
    offset_ = 0;
    length_ = 0;
    return std::exchange(fd_, -1);
  }

 private:
  int fd_ = -1;
  std::uint64_t offset_ = 0;
  std::size_t length_ = 0;
};

namespace detail {

// The page range around [address, address + length): its start and its length.
struct page_range {
  std::uintptr_t begin = 0;
  std::size_t length = 0;
};

// Throws std::system_error (invalid_argument) naming `what` for a null address, zero bytes, or a
// range that wraps around the address space when rounded out to `page`.
inline page_range pages_around(const void* address, std::size_t length, std::size_t page,
                               const char* what) {
  const auto at = reinterpret_cast<std::uintptr_t>(address);
  const char* wrong = address == nullptr ? "a null device pointer"
                      : length == 0         ? "zero bytes (a dma-buf needs at least one)"
                      : at > UINTPTR_MAX - length || at + length > UINTPTR_MAX - (page - 1)
                          ? "a range that runs past the end of the address space"
                          : nullptr;
  if (wrong != nullptr) {
    throw std::system_error(std::make_error_code(std::errc::invalid_argument),
                            std::string(what) + ": exporting " + std::to_string(length) +
                                " bytes: " + wrong);
  }
  const std::uintptr_t begin = at / page * page;
  const std::uintptr_t end = (at + length + page - 1) / page * page;
  return {begin, static_cast<std::size_t>(end - begin)};
}

[[nodiscard]] inline std::size_t host_page_size() noexcept {
  const long page = ::sysconf(_SC_PAGESIZE);
  return page > 0 ? static_cast<std::size_t>(page) : 4096;
}

}  // namespace detail

#if defined(FERRY_GPU_CUDA) || defined(FERRY_DOXYGEN)

namespace detail {

#if CUDART_VERSION >= 12050
inline constexpr const char* cuda_entry_point_call = "cudaGetDriverEntryPointByVersion";
#else
inline constexpr const char* cuda_entry_point_call = "cudaGetDriverEntryPoint";
#endif

// A driver function by name, through the runtime (so nothing links libcuda): null when the driver
// lacks it, or when `abi` (the CUDA version whose signature the caller uses) is newer than it.
inline void* cuda_driver_function(const char* name, unsigned abi, cudaError_t& error,
                                  cudaDriverEntryPointQueryResult& found) noexcept {
  void* fn = nullptr;
  found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
  error = ::cudaGetDriverEntryPointByVersion(name, &fn, abi, cudaEnableDefault, &found);
#else
  (void)abi;
  error = ::cudaGetDriverEntryPoint(name, &fn, cudaEnableDefault, &found);
#endif
  return error == cudaSuccess && found == cudaDriverEntryPointSuccess ? fn : nullptr;
}

// "CUDA_ERROR_NOT_SUPPORTED (801)", named by the driver where it can.
inline std::string cuda_result_name(CUresult r) {
  cudaError_t error = cudaSuccess;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  const char* name = nullptr;
  if (void* fn = cuda_driver_function("cuGetErrorName", 6000, error, found)) {
    if (reinterpret_cast<PFN_cuGetErrorName_v6000>(fn)(r, &name) != CUDA_SUCCESS) name = nullptr;
  }
  return std::string(name != nullptr ? name : "CUresult") + " (" +
         std::to_string(static_cast<int>(r)) + ")";
}

}  // namespace detail

/// Exports [device_pointer, device_pointer + length) of CUDA device memory (cudaMalloc, or
/// cuMemCreate mapped memory) as a dma-buf, with the driver's cuMemGetHandleForAddressRange
/// (CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD), reached through cudaGetDriverEntryPointByVersion (runtime
/// 12.5 and later; cudaGetDriverEntryPoint before). The range is widened to whole host pages, as
/// the call demands; the result's offset() says where `device_pointer` lies in it. `flags` is
/// passed on (CU_MEM_RANGE_FLAG_DMA_BUF_MAPPING_TYPE_PCIE, or 0). Throws std::system_error naming
/// the call: invalid_argument for a null pointer or zero bytes; operation_not_supported where
/// there is no CUDA driver or GPU, the driver predates 11.7, or the GPU or its memory cannot be
/// exported (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED); invalid_argument for memory the driver does
/// not know; io_error for anything else. Its text names the CUresult or cudaError_t.
[[nodiscard]] inline dmabuf export_cuda_dmabuf(const void* device_pointer, std::size_t length,
                                               unsigned long long flags = 0) {
  constexpr const char* what = "ferry::gpu::export_cuda_dmabuf: cuMemGetHandleForAddressRange";
  const detail::page_range range =
      detail::pages_around(device_pointer, length, detail::host_page_size(), what);
  cudaError_t error = cudaSuccess;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  void* fn = detail::cuda_driver_function("cuMemGetHandleForAddressRange", 11070, error, found);
  if (fn == nullptr) {
    if (error != cudaSuccess) {
      // No driver, or one older than the runtime: nothing can be exported here.
      const bool unsupported = error == cudaErrorInsufficientDriver || error == cudaErrorNoDevice;
      throw std::system_error(std::make_error_code(unsupported ? std::errc::operation_not_supported
                                                               : std::errc::io_error),
                              std::string(what) + ": looking it up in the driver (" +
                                  detail::cuda_entry_point_call + ") failed with " +
                                  ::cudaGetErrorName(error) + ": " + ::cudaGetErrorString(error));
    }
    throw std::system_error(std::make_error_code(std::errc::operation_not_supported),
                            std::string(what) + ": the CUDA driver " +
                                (found == cudaDriverEntryPointVersionNotSufficent
                                     ? "is older than 11.7, which added it"
                                     : "does not have it (it needs driver 11.7 or later)"));
  }
  int fd = -1;
  const CUresult r = reinterpret_cast<PFN_cuMemGetHandleForAddressRange_v11070>(fn)(
      &fd, static_cast<CUdeviceptr>(range.begin), range.length, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
      flags);
  if (r != CUDA_SUCCESS || fd < 0) {
    const std::errc e = r == CUDA_ERROR_NOT_SUPPORTED ? std::errc::operation_not_supported
                        : r == CUDA_ERROR_INVALID_VALUE ? std::errc::invalid_argument
                                                        : std::errc::io_error;
    throw std::system_error(std::make_error_code(e),
                            std::string(what) + "(" + std::to_string(range.length) +
                                " bytes around " + std::to_string(length) + " bytes of device " +
                                "memory) failed with " + detail::cuda_result_name(r));
  }
  return dmabuf(fd, reinterpret_cast<std::uintptr_t>(device_pointer) - range.begin, length);
}

#endif  // FERRY_GPU_CUDA || FERRY_DOXYGEN

#if defined(__HIP_PLATFORM_AMD__)

/// Exports [device_pointer, device_pointer + length) of ROCm device memory (hipMalloc) as a
/// dma-buf with HSA's hsa_amd_portable_export_dmabuf, which needs the HSA AMD extension interface
/// 1.1 and later (link -lhsa-runtime64). The result's offset() says where
/// `device_pointer` lies in the dma-buf. Throws std::system_error naming the call:
/// invalid_argument for a null pointer or zero bytes; operation_not_supported where this ROCm's
/// headers have no dma-buf export (ROCm 5.2, Debian's, has none: its interface is 1.0), or where
/// the runtime refuses the memory; io_error for another HSA status, named in the text.
[[nodiscard]] inline dmabuf export_hip_dmabuf(const void* device_pointer, std::size_t length) {
  constexpr const char* what = "ferry::gpu::export_hip_dmabuf: hsa_amd_portable_export_dmabuf";
  (void)detail::pages_around(device_pointer, length, detail::host_page_size(), what);
#if defined(HSA_AMD_INTERFACE_VERSION_MAJOR) &&                                          \
    (HSA_AMD_INTERFACE_VERSION_MAJOR > 1 ||                                              \
     (HSA_AMD_INTERFACE_VERSION_MAJOR == 1 && HSA_AMD_INTERFACE_VERSION_MINOR >= 1))
  int fd = -1;
  std::uint64_t offset = 0;
  const hsa_status_t s = ::hsa_amd_portable_export_dmabuf(device_pointer, length, &fd, &offset);
  if (s != HSA_STATUS_SUCCESS || fd < 0) {
    const char* text = nullptr;
    if (::hsa_status_string(s, &text) != HSA_STATUS_SUCCESS) text = nullptr;
    const std::errc e = s == HSA_STATUS_ERROR_INVALID_ARGUMENT ? std::errc::invalid_argument
                        : s == HSA_STATUS_ERROR_INVALID_AGENT  ? std::errc::operation_not_supported
                                                               : std::errc::io_error;
    throw std::system_error(std::make_error_code(e),
                            std::string(what) + "(" + std::to_string(length) +
                                " bytes) failed with HSA status " +
                                std::to_string(static_cast<int>(s)) +
                                (text != nullptr ? std::string(": ") + text : std::string()));
  }
  return dmabuf(fd, offset, length);
#else
  throw std::system_error(
      std::make_error_code(std::errc::operation_not_supported),
      std::string(what) + ": this ROCm has no dma-buf export (its hsa/hsa_ext_amd.h " +
#if defined(HSA_AMD_INTERFACE_VERSION_MAJOR)
          "declares the HSA AMD extension interface " +
          std::to_string(HSA_AMD_INTERFACE_VERSION_MAJOR) + "." +
          std::to_string(HSA_AMD_INTERFACE_VERSION_MINOR) +
#else
          "was not found" +
#endif
          "); HSA AMD extension interface 1.1 adds hsa_amd_portable_export_dmabuf");
#endif
}

#endif  // __HIP_PLATFORM_AMD__

}  // namespace ferry::gpu

#pragma once
// A stand-in for a GPU runtime's dma-buf export, for tests without a GPU: host memory takes the place
// of device memory, and a real descriptor (a memfd of the exported length, never mapped or written)
// takes the place of the dma-buf. A process-wide registry maps each live descriptor to the memory it
// exports, so that a fake adapter given the descriptor (ferry::verbs::fake::provider's
// reg_dmabuf_mr) reaches the memory behind it, as an RDMA adapter reaches GPU memory through the
// dma-buf the kernel hands it. Closing the descriptor takes it out of the registry; a region already
// registered through it keeps the memory, as the kernel's region keeps its own reference.

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <system_error>
#include <unordered_map>
#include <utility>

namespace ferry::testing {

namespace detail {

// Descriptor -> exported memory. The inode is kept so that a descriptor number closed behind the
// registry's back and reused for another file is not taken for the export it used to be.
class dmabuf_registry {
 public:
  struct entry {
    std::byte* base = nullptr;
    std::size_t length = 0;
    dev_t device = 0;
    ino_t inode = 0;
  };

  // Never destroyed: lookups from other static destructors stay valid.
  static dmabuf_registry& instance() {
    static dmabuf_registry* const registry = new dmabuf_registry;
    return *registry;
  }

  void add(int fd, const entry& e) {
    std::lock_guard lock(mutex_);
    exports_[fd] = e;
  }

  // Before the descriptor is closed, so that its number, free again, never names a stale entry.
  void remove(int fd) noexcept {
    std::lock_guard lock(mutex_);
    exports_.erase(fd);
  }

  [[nodiscard]] std::optional<entry> find(int fd) const {
    std::lock_guard lock(mutex_);
    const auto it = exports_.find(fd);
    if (it == exports_.end()) return std::nullopt;
    struct stat st {};
    if (::fstat(fd, &st) != 0 || st.st_dev != it->second.device || st.st_ino != it->second.inode) {
      return std::nullopt;
    }
    return it->second;
  }

 private:
  dmabuf_registry() = default;
  mutable std::mutex mutex_;
  std::unordered_map<int, entry> exports_;
};

}  // namespace detail

/// A fake dma-buf: exports [data, data + length) of host memory, standing in for device memory, as
/// a real descriptor that ferry's fake adapters look up (lookup()).
///
/// The descriptor is a memfd of `length` bytes, used only as a token: nothing is mapped or written
/// through it. The memory itself stays the caller's and must outlive every region registered through
/// the descriptor. Move-only; destroying it (or close()) closes the descriptor and ends the export.
/// Thread-safe: any thread may make, close and look up fake dma-bufs at once.
class fake_dmabuf {
 public:
  /// What a descriptor exports (lookup()).
  struct exported {
    std::byte* base = nullptr;  ///< the first byte exported
    std::size_t length = 0;     ///< the dma-buf's size in bytes
  };

  /// Exports [memory, memory + length). Throws std::invalid_argument for null memory or zero bytes,
  /// and std::system_error naming memfd_create or ftruncate when the descriptor cannot be made.
  fake_dmabuf(void* memory, std::size_t length)
      : base_(static_cast<std::byte*>(memory)), length_(length) {
    if (memory == nullptr || length == 0) {
      throw std::invalid_argument("ferry::testing::fake_dmabuf: exporting " +
                                  std::to_string(length) + " bytes at " +
                                  (memory == nullptr ? "a null address" : "an address") +
                                  ": a dma-buf needs memory of at least one byte");
    }
    fd_ = ::memfd_create("ferry-fake-dmabuf", MFD_CLOEXEC);
    if (fd_ < 0) {
      throw std::system_error(errno, std::system_category(),
                              "ferry::testing::fake_dmabuf: memfd_create");
    }
    struct stat st {};
    if (::ftruncate(fd_, static_cast<off_t>(length)) != 0 || ::fstat(fd_, &st) != 0) {
      const int err = errno;
      ::close(fd_);
      throw std::system_error(err, std::system_category(),
                              "ferry::testing::fake_dmabuf: sizing the descriptor to " +
                                  std::to_string(length) + " bytes (ftruncate)");
    }
    try {
      detail::dmabuf_registry::instance().add(fd_, {base_, length_, st.st_dev, st.st_ino});
    } catch (...) {
      ::close(fd_);
      throw;
    }
  }

  /// Takes `other`'s export, leaving it closed.
  fake_dmabuf(fake_dmabuf&& other) noexcept
      : fd_(std::exchange(other.fd_, -1)),
        base_(std::exchange(other.base_, nullptr)),
        length_(std::exchange(other.length_, 0)) {}
  /// Closes its own export and takes `other`'s.
  fake_dmabuf& operator=(fake_dmabuf&& other) noexcept {
    if (this != &other) {
      close();
      fd_ = std::exchange(other.fd_, -1);
      base_ = std::exchange(other.base_, nullptr);
      length_ = std::exchange(other.length_, 0);
    }
    return *this;
  }
  fake_dmabuf(const fake_dmabuf&) = delete;
  fake_dmabuf& operator=(const fake_dmabuf&) = delete;
  /// Closes the descriptor (close()).
  ~fake_dmabuf() { close(); }

  /// Ends the export and closes the descriptor; regions registered through it keep the memory.
  void close() noexcept {
    if (fd_ < 0) return;
    detail::dmabuf_registry::instance().remove(fd_);
    ::close(fd_);
    fd_ = -1;
  }

  /// The descriptor, as a GPU runtime's export would give it (-1 once closed).
  [[nodiscard]] int fd() const noexcept { return fd_; }
  /// Where the descriptor starts in the exported memory: always 0 (the export is not page-aligned
  /// outward as a real one may be).
  [[nodiscard]] std::uint64_t offset() const noexcept { return 0; }
  /// The dma-buf's size in bytes.
  [[nodiscard]] std::size_t length() const noexcept { return length_; }
  /// The exported memory's first byte (the "device pointer").
  [[nodiscard]] std::byte* data() const noexcept { return base_; }
  /// The exported memory's address as an integer, the usual iova of a region registered through it.
  [[nodiscard]] std::uint64_t device_address() const noexcept {
    return reinterpret_cast<std::uintptr_t>(base_);
  }

  /// What the open descriptor `fd` exports; empty when it is no fake dma-buf's (never exported,
  /// closed, or its number reused for another file).
  [[nodiscard]] static std::optional<exported> lookup(int fd) {
    const auto e = detail::dmabuf_registry::instance().find(fd);
    if (!e) return std::nullopt;
    return exported{e->base, e->length};
  }

 private:
  int fd_ = -1;
  std::byte* base_ = nullptr;
  std::size_t length_ = 0;
};

}  // namespace ferry::testing

#pragma once
// What crosses between two ferry UCX workers, and the checks made on it before UCX sees it: who a
// peer is (its worker, host, PID namespace and pid), the UCX version it runs, ferry's active
// message header, and the structure of UCX's packed remote keys and worker addresses. UCX 1.13
// unpacks keys and addresses without checking them (an empty key segfaults, a truncated one is
// over-read, a random one crashes inside ucp_ep_rkey_unpack), so every byte a peer sent is checked
// here first.

#include <ucp/api/ucp.h>
#include <ucs/memory/memory_type.h>

#include <sys/stat.h>
#include <sys/syscall.h>
#include <poll.h>
#include <unistd.h>

#include <bit>
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <span>
#include <string>

namespace ferry::ucx::detail {

// The UCX a side runs, as ucp_get_version() reports it. A packed key or worker address is UCX's own
// format, which changes between minor versions: peers must agree on major and minor.
struct ucx_version {
  std::uint32_t major = 0;
  std::uint32_t minor = 0;
  std::uint32_t release = 0;
  [[nodiscard]] static ucx_version here() noexcept {
    ucx_version v;
    unsigned a = 0, b = 0, c = 0;
    ::ucp_get_version(&a, &b, &c);
    v.major = a;
    v.minor = b;
    v.release = c;
    return v;
  }
  [[nodiscard]] bool compatible(const ucx_version& o) const noexcept {
    return major == o.major && minor == o.minor;
  }
  [[nodiscard]] std::string text() const {
    return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(release);
  }
};

// Who a peer is: its worker, and where it runs. Pids are comparable only between processes that
// share a boot (host_id) and a PID namespace (pid_ns): pods on one node share the boot id but each
// has its own namespace, where the same pid is another process.
struct peer_identity {
  std::uint64_t worker_id = 0;
  std::uint64_t host_id = 0;
  std::uint64_t pid_ns = 0;
  std::uint32_t pid = 0;
  std::uint32_t reserved = 0;
};

// This boot of this machine.
inline std::uint64_t host_id() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(in, id);
  std::uint64_t h = 1469598103934665603ull;
  for (char c : id) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  return h;
}

// This process's PID namespace (the inode of /proc/self/ns/pid); 0 where it cannot be read.
inline std::uint64_t pid_namespace() noexcept {
  struct stat st {};
  if (::stat("/proc/self/ns/pid", &st) != 0) return 0;
  return (static_cast<std::uint64_t>(st.st_dev) << 32) ^ static_cast<std::uint64_t>(st.st_ino);
}

// Whether `peer`'s pid names a process this one can watch: same boot, same PID namespace.
[[nodiscard]] inline bool same_pid_space(const peer_identity& self, const peer_identity& peer) noexcept {
  return peer.pid != 0 && peer.host_id == self.host_id && peer.pid_ns != 0 &&
         peer.pid_ns == self.pid_ns;
}

inline int open_pidfd(std::uint32_t pid) noexcept {
#ifdef SYS_pidfd_open
  return static_cast<int>(::syscall(SYS_pidfd_open, static_cast<pid_t>(pid), 0));
#else
  (void)pid;
  return -1;
#endif
}

// A pidfd turns readable once its process has exited.
inline bool process_exited(int pidfd) noexcept {
  if (pidfd < 0) return false;
  pollfd p{pidfd, POLLIN, 0};
  return ::poll(&p, 1, 0) == 1 && (p.revents & POLLIN) != 0;
}

// ---- ferry's active messages
inline constexpr unsigned am_id = 0x6665;
inline constexpr std::uint32_t am_magic = 0x4d415846;  // "FXAM"
enum class am_kind : std::uint32_t {
  notification = 1,  // value: the user's; sequence: what the ack names
  // 2 was the hello of UCX's connection manager, which ferry no longer uses (connection.hpp)
  ping = 3,
  pong = 4,
  ack = 5,  // a notification was taken (flags: ack_refused when the receiver's queue was full)
};
inline constexpr std::uint32_t ack_refused = 1;

struct am_header {
  std::uint32_t magic = am_magic;
  am_kind kind = am_kind::notification;
  peer_identity sender;
  std::uint64_t value = 0;
  std::uint64_t sequence = 0;
  std::uint32_t flags = 0;
  std::uint32_t reserved = 0;
};

// ---- UCX's packed remote key (UCX 1.13, ucp_rkey.c): a 64-bit map of the memory domains it
// covers, a memory type byte, then per domain in the map a size byte and that many bytes, then
// optionally a system device byte and 3-byte distances. Returns why `key` is not one; empty when
// its structure holds. A key that passes still names segments only UCX can judge.
[[nodiscard]] inline std::string packed_key_problem(std::span<const std::byte> key) {
  constexpr std::size_t head = sizeof(std::uint64_t) + 1;
  if (key.empty()) return "is empty";
  if (key.size() < head) {
    return "has " + std::to_string(key.size()) + " bytes, less than UCX's " +
           std::to_string(head) + "-byte header";
  }
  if (key.size() > 4096) return "has " + std::to_string(key.size()) + " bytes (at most 4096)";
  std::uint64_t md_map = 0;
  for (std::size_t i = 0; i < sizeof md_map; ++i) {
    md_map |= std::uint64_t{static_cast<unsigned char>(key[i])} << (8 * i);
  }
  if (md_map == 0) return "covers no memory domain";
  const auto mem_type = static_cast<unsigned char>(key[sizeof md_map]);
  if (mem_type >= UCS_MEMORY_TYPE_LAST) {
    return "names memory type " + std::to_string(mem_type) + ", which UCX does not have";
  }
  std::size_t at = head;
  for (int d = std::popcount(md_map); d > 0; --d) {
    if (at >= key.size()) return "is truncated inside its memory domains";
    const auto n = static_cast<unsigned char>(key[at]);
    at += 1 + n;
    if (at > key.size()) return "is truncated inside its memory domains";
  }
  const std::size_t rest = key.size() - at;
  if (rest != 0 && (rest - 1) % 3 != 0) {
    return "has " + std::to_string(rest) + " trailing bytes that are not UCX's device distances";
  }
  return {};
}

// ---- UCX's packed worker address: its first byte holds the address format's version in its low
// four bits (ucp_address.c). Compared with this worker's own; the rest is UCX's to read.
[[nodiscard]] inline std::string worker_address_problem(std::span<const std::byte> address,
                                                        std::span<const std::byte> own) {
  if (address.empty()) return "is empty";
  if (address.size() > 65536) {
    return "has " + std::to_string(address.size()) + " bytes (at most 65536)";
  }
  if (own.empty()) return {};
  const auto version = [](std::byte b) { return static_cast<unsigned>(b) & 0xfu; };
  if (version(address[0]) != version(own[0])) {
    return "is in UCX address format " + std::to_string(version(address[0])) + ", this UCX's is " +
           std::to_string(version(own[0]));
  }
  return {};
}

}  // namespace ferry::ucx::detail

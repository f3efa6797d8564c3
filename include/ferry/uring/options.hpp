#pragma once
// What a user hands the io_uring ring and gets back from it: the ring's set-up, the file a read or
// write names (plain or registered), registered memory, the blocks of a batch, and the ring's
// counters.

#include <cstddef>
#include <cstdint>
#include <span>

namespace ferry::metrics {
class registry;
}  // namespace ferry::metrics

namespace ferry::uring {

/// As the offset of a read or write: use and advance the descriptor's own position (pipes, sockets,
/// character devices).
inline constexpr std::uint64_t current_position = ~std::uint64_t{0};

/// How an io_uring ring is set up (ring's constructor).
struct ring_options {
  /// Submission queue entries (at most 32768). The completion queue gets twice as many and bounds
  /// what is in flight at once: with the default, 448 operations besides cancels, of which at most
  /// 224 socket receives, 224 sends and 336 of both together (a connection has one of each in
  /// flight at a time). A receive waiting on a silent peer, or a send on one that does not read,
  /// holds its place until the peer acts; beyond the bound, receives (or sends) on every other
  /// connection wait for one of those to complete. A server with more connections than that raises
  /// `entries`.
  unsigned entries = 256;
  /// The most SQEs one io_uring_enter carries; 0 for no limit (one call per executor round). Up to
  /// two, the kernel does not plug the block layer, so each request reaches the device at once.
  unsigned submit_batch = 2;
  /// SINGLE_ISSUER | DEFER_TASKRUN with the executor as the issuer, where the kernel has them (6.1
  /// on) and the executor is progress_mode::busy: completions are finished in the executor's own
  /// system calls rather than by interrupting it. An executor that parks always gets the plain
  /// set-up (a parked issuer hears of deferred completions a scheduler tick late). false: the plain
  /// set-up, which costs more per operation when the CPU is the limit.
  bool defer_task_work = true;
  /// Where the ring records each read, write, send and receive that ends (metrics.hpp), sends and
  /// receives also per peer (its IP address: every connection from one host adds up); it must
  /// outlive the ring. Null: nothing is recorded, at the cost of one test per operation.
  ferry::metrics::registry* metrics = nullptr;
};

/// A descriptor registered with ring::register_files.
struct fixed_file {
  unsigned index = 0;  ///< its index in the ring's registered file table
};

/// Memory registered with ring::register_buffers. Reads and writes naming it must stay inside it.
struct fixed_buffer {
  unsigned index = 0;  ///< its index in the ring's registered buffer table
  std::span<std::byte> memory;  ///< the registered memory
};

/// The file argument of a read or write: a plain descriptor or a registered one.
class file_ref {
 public:
  /// A plain descriptor (converts implicitly).
  file_ref(int fd) noexcept : fd_(fd) {}  // NOLINT: implicit by design
  /// A registered descriptor (converts implicitly).
  file_ref(fixed_file f) noexcept : fd_(static_cast<int>(f.index)), fixed_(true) {}  // NOLINT

  /// The descriptor, or the registered file's index when fixed().
  [[nodiscard]] int descriptor() const noexcept { return fd_; }
  /// True for a registered file (fixed_file).
  [[nodiscard]] bool fixed() const noexcept { return fixed_; }

 private:
  int fd_;
  bool fixed_ = false;
};

/// One block of a batched read.
struct read_block {
  std::span<std::byte> dst;  ///< where the bytes go; its size is how many are read
  std::uint64_t offset = 0;  ///< the file offset (or current_position)
  /// If given, set to the bytes that landed before the block's transfer ended (read() has the same).
  std::size_t* transferred = nullptr;
};
/// One block of a batched write.
struct write_block {
  std::span<const std::byte> src;  ///< the bytes to write
  std::uint64_t offset = 0;  ///< the file offset (or current_position)
  /// If given, set to the bytes written before the block's transfer ended (write() has the same).
  std::size_t* transferred = nullptr;
};

/// What a ring has done so far (ring::counters()).
struct ring_counters {
  std::uint64_t submitted = 0;    ///< SQEs handed to the kernel, resubmissions and cancels included
  std::uint64_t submit_calls = 0;  ///< io_uring_enter calls that handed over SQEs
  std::uint64_t completed = 0;    ///< CQEs reaped (counted before their transfers end)
  std::uint64_t resubmitted = 0;  ///< short reads and writes continued
  std::uint64_t backlogged = 0;   ///< operations that waited because the ring was full
};

}  // namespace ferry::uring

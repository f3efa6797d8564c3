#pragma once
// File reads and writes on the io_uring ring: plain, through registered buffers and descriptors,
// vectored, and in batches. A short read or write is resubmitted for the remainder; a read that hits
// the end of the file fails with errc::end_of_file, so partial data is never a success.

#include <liburing.h>

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>

#include <sys/uio.h>

#include "ferry/errors.hpp"
#include "ferry/transfer.hpp"
#include "ferry/uring/detail/engine.hpp"
#include "ferry/uring/detail/op.hpp"
#include "ferry/uring/errors.hpp"
#include "ferry/uring/options.hpp"

namespace ferry::uring::detail {

// An SQE names a registered buffer in 16 bits (the kernel registers at most 16384).
inline constexpr unsigned max_buffer_index = 0xffff;

[[nodiscard]] inline errc check_registered(const std::byte* p, std::size_t n,
                                           const fixed_buffer& registered) noexcept {
  if (registered.index > max_buffer_index) return errc::bad_registered_index;
  const auto begin = reinterpret_cast<std::uintptr_t>(registered.memory.data());
  const auto end = begin + registered.memory.size();
  const auto at = reinterpret_cast<std::uintptr_t>(p);
  const bool inside = at >= begin && at <= end && n <= end - at;
  return inside ? errc{} : errc::outside_registered_buffer;
}

[[nodiscard]] inline std::uint64_t file_offset(const op* o, std::size_t advanced) noexcept {
  return o->offset == current_position ? current_position : o->offset + advanced;
}

inline void prepare_read_write(io_uring_sqe* sqe, op* o) noexcept {
  const auto n = static_cast<unsigned>(std::min(o->length - o->done, max_chunk));
  std::byte* at = o->buffer + o->done;
  const std::uint64_t offset = file_offset(o, o->done);
  if (o->kind == op_kind::read) {
    if (o->buffer_index >= 0) {
      ::io_uring_prep_read_fixed(sqe, o->fd, at, n, offset, o->buffer_index);
    } else {
      ::io_uring_prep_read(sqe, o->fd, at, n, offset);
    }
  } else if (o->buffer_index >= 0) {
    ::io_uring_prep_write_fixed(sqe, o->fd, at, n, offset, o->buffer_index);
  } else {
    ::io_uring_prep_write(sqe, o->fd, at, n, offset);
  }
  if (o->fixed_file) sqe->flags |= IOSQE_FIXED_FILE;
}

inline void prepare_vectored(io_uring_sqe* sqe, op* o) noexcept {
  const bool reading = o->kind == op_kind::readv;
  const std::uint64_t at = file_offset(o, o->done);
  if (o->iov_skip != 0) {
    // Part of one iovec is done: finish that one alone, then go on with the array.
    const iovec& v = o->iov[o->iov_at];
    auto* p = static_cast<std::byte*>(v.iov_base) + o->iov_skip;
    const auto n = static_cast<unsigned>(std::min(v.iov_len - o->iov_skip, max_chunk));
    if (reading) {
      ::io_uring_prep_read(sqe, o->fd, p, n, at);
    } else {
      ::io_uring_prep_write(sqe, o->fd, p, n, at);
    }
  } else {
    const unsigned count = std::min<unsigned>(o->iov_count - o->iov_at, IOV_MAX);
    if (reading) {
      ::io_uring_prep_readv(sqe, o->fd, o->iov + o->iov_at, count, at);
    } else {
      ::io_uring_prep_writev(sqe, o->fd, o->iov + o->iov_at, count, at);
    }
  }
  if (o->fixed_file) sqe->flags |= IOSQE_FIXED_FILE;
}

inline void advance(op* o, std::size_t n) noexcept {
  o->done += n;
  if (o->kind != op_kind::readv && o->kind != op_kind::writev) return;
  n += o->iov_skip;
  while (o->iov_at < o->iov_count && n >= o->iov[o->iov_at].iov_len) {
    n -= o->iov[o->iov_at].iov_len;
    ++o->iov_at;
  }
  o->iov_skip = n;
}

inline void continue_partial(engine& e, op* o) noexcept {
  if (o->cancel_requested) return e.finish_cancelled(o);
  if (e.shutting_down_) {
    return e.finish(o, transfer_state::failed, make_error_code(ferry::errc::backend_shut_down));
  }
  e.resubmitted_.fetch_add(1, std::memory_order_relaxed);
  e.resume(o);
}

inline void on_file_io(engine& e, op* o, int res) noexcept {
  if (res < 0) {
    if (was_cancelled(o, res)) return e.finish_cancelled(o);
    if (res == -EINTR && !e.shutting_down_) return e.resume(o);
    return e.finish(o, transfer_state::failed, system_error_code(-res));
  }
  if (res == 0) {
    const bool reading = o->kind == op_kind::read || o->kind == op_kind::readv;
    return e.finish(o, transfer_state::failed,
                    reading ? make_error_code(errc::end_of_file) : system_error_code(EIO));
  }
  advance(o, static_cast<std::size_t>(res));
  if (o->done == o->length) return e.finish(o, transfer_state::success, {});
  continue_partial(e, o);
}

inline constexpr op_handlers read_handlers{op_kind::read, start_on_arrival, prepare_read_write,
                                           on_file_io, fail_shut_down};
inline constexpr op_handlers write_handlers{op_kind::write, start_on_arrival, prepare_read_write,
                                            on_file_io, fail_shut_down};
inline constexpr op_handlers readv_handlers{op_kind::readv, start_on_arrival, prepare_vectored,
                                            on_file_io, fail_shut_down};
inline constexpr op_handlers writev_handlers{op_kind::writev, start_on_arrival, prepare_vectored,
                                             on_file_io, fail_shut_down};

[[nodiscard]] inline transfer submit_io(engine& e, const op_handlers& kind, file_ref file,
                                        std::byte* buffer, std::size_t length,
                                        std::uint64_t offset, int buffer_index,
                                        std::size_t* transferred) {
  if (length == 0) {
    return make_completed_transfer(transfer_state::failed, ferry::errc::empty_buffer);
  }
  op* o = op::make(kind);
  o->fd = file.descriptor();
  o->fixed_file = file.fixed();
  o->buffer = buffer;
  o->length = length;
  o->offset = offset;
  o->buffer_index = buffer_index;
  o->transferred = transferred;
  transfer t = engine::attach(o);
  e.publish(o, o);
  return t;
}

[[nodiscard]] inline transfer submit_vectored(engine& e, const op_handlers& kind, file_ref file,
                                              std::span<const iovec> iov, std::uint64_t offset,
                                              std::size_t* transferred) {
  if (iov.size() > UINT32_MAX) {
    return make_completed_transfer(transfer_state::failed, errc::vector_too_large);
  }
  std::size_t total = 0;
  for (const iovec& v : iov) {
    if (v.iov_len > SIZE_MAX - total) {
      return make_completed_transfer(transfer_state::failed, errc::vector_too_large);
    }
    total += v.iov_len;
  }
  if (total == 0) return make_completed_transfer(transfer_state::failed, ferry::errc::empty_buffer);
  op* o = op::make(kind);
  o->fd = file.descriptor();
  o->fixed_file = file.fixed();
  o->iov = iov.data();
  o->iov_count = static_cast<std::uint32_t>(iov.size());
  o->length = total;
  o->offset = offset;
  o->transferred = transferred;
  transfer t = engine::attach(o);
  e.publish(o, o);
  return t;
}

template <class Blocks>
void submit_batch(engine& e, const op_handlers& kind, file_ref file, Blocks blocks,
                  std::span<transfer> out, const fixed_buffer* registered) {
  const std::size_t n = blocks.size();
  if (out.size() < n) {
    throw std::invalid_argument("ferry::uring::ring: batch output span holds " +
                                std::to_string(out.size()) + " transfers for " +
                                std::to_string(n) + " blocks");
  }
  // Linked newest first, so that the executor, which reverses the stack, sees them in order.
  op* newest = nullptr;
  op* oldest = nullptr;
  try {
    for (std::size_t i = 0; i < n; ++i) {
      const auto& block = blocks[i];
      std::byte* data = nullptr;
      std::size_t length = 0;
      if constexpr (requires { block.dst; }) {
        data = block.dst.data();
        length = block.dst.size();
      } else {
        data = const_cast<std::byte*>(block.src.data());
        length = block.src.size();
      }
      if (block.transferred != nullptr) *block.transferred = 0;
      if (length == 0) {
        out[i] = make_completed_transfer(transfer_state::failed, ferry::errc::empty_buffer);
        continue;
      }
      if (registered != nullptr) {
        if (const errc err = check_registered(data, length, *registered); err != errc{}) {
          out[i] = make_completed_transfer(transfer_state::failed, err);
          continue;
        }
      }
      op* o = op::make(kind);
      o->fd = file.descriptor();
      o->fixed_file = file.fixed();
      o->buffer_index = registered == nullptr ? -1 : static_cast<int>(registered->index);
      o->buffer = data;
      o->length = length;
      o->offset = block.offset;
      o->transferred = block.transferred;
      out[i] = engine::attach(o);
      o->next = newest;
      newest = o;
      if (oldest == nullptr) oldest = o;
    }
  } catch (...) {
    // Out of memory part-way: what was prepared still goes, so every handed-out transfer ends.
    if (newest != nullptr) e.publish(newest, oldest);
    throw;
  }
  if (newest != nullptr) e.publish(newest, oldest);
}

inline void batch_reads(engine& e, file_ref file, std::span<const read_block> blocks,
                        std::span<transfer> out, const fixed_buffer* registered) {
  submit_batch(e, read_handlers, file, blocks, out, registered);
}

inline void batch_writes(engine& e, file_ref file, std::span<const write_block> blocks,
                         std::span<transfer> out, const fixed_buffer* registered) {
  submit_batch(e, write_handlers, file, blocks, out, registered);
}

}  // namespace ferry::uring::detail

#pragma once
// The io_uring backend (link with liburing; Meson's ferry build does this where it is found): file
// reads and writes at offsets, and framed TCP blocks between two peers.

#include "ferry/detail/config.hpp"
#include "ferry/uring/aligned_buffer.hpp"
#include "ferry/uring/errors.hpp"
#include "ferry/uring/frame.hpp"
#include "ferry/uring/options.hpp"
#include "ferry/uring/ring.hpp"
#include "ferry/uring/tcp.hpp"

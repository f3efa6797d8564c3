#pragma once
// The RDMA verbs backend on real adapters, through libibverbs (link with -libverbs; Meson's ferry
// build does this where libibverbs is found). The same classes run on the in-process fake of
// <ferry/testing/verbs.hpp> for tests: basic_device<fake::provider> and so on.

#include "ferry/detail/config.hpp"
#include "ferry/verbs/device.hpp"
#include "ferry/verbs/errors.hpp"
#include "ferry/verbs/handshake.hpp"
#include "ferry/verbs/memory_region.hpp"
#include "ferry/verbs/options.hpp"
#include "ferry/verbs/provider.hpp"
#include "ferry/verbs/queue_pair.hpp"
#include "ferry/verbs/remote.hpp"

namespace ferry::verbs {

/// An RDMA device opened through libibverbs (basic_device on real_provider).
using device = basic_device<real_provider>;
/// A registered memory region on a real adapter (basic_memory_region on real_provider).
using memory_region = basic_memory_region<real_provider>;
/// A reliable-connected queue pair on a real adapter (basic_queue_pair on real_provider).
using queue_pair = basic_queue_pair<real_provider>;
/// A range of a local registered region (basic_local_slice on real_provider).
using local_slice = basic_local_slice<real_provider>;
/// One block of a one-sided transfer (basic_rdma_block on real_provider).
using rdma_block = basic_rdma_block<real_provider>;
/// A connected queue pair with its peer's details (basic_connection on real_provider).
using connection = basic_connection<real_provider>;

}  // namespace ferry::verbs

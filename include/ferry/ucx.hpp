#pragma once
// The UCX backend: one-sided get and put between processes over whatever UCX finds (TCP, shared
// memory, RDMA verbs, ...), progressed by the progress executor. Link with -lucp -lucs (Meson's
// ferry build does this where UCX is found).

#include "ferry/detail/config.hpp"
#include "ferry/ucx/errors.hpp"
#include "ferry/ucx/memory_region.hpp"
#include "ferry/ucx/options.hpp"
#include "ferry/ucx/remote.hpp"
#include "ferry/ucx/worker.hpp"

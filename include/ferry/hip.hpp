#pragma once
// The GPU copy backend's earlier header: it covers HIP (AMD) and CUDA (NVIDIA) alike, so it is
// <ferry/gpu.hpp> now, and ferry::hip is an alias of ferry::gpu.

#include "ferry/detail/config.hpp"
#include "ferry/gpu.hpp"

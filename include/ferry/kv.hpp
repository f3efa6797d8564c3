#pragma once
// The inference-server layer: per-request, per-layer KV load tracking (decode side), the release
// ledger (prefill side), what connectors exchange (cache layouts, transfer plans and the handshake
// that describes an engine), and pull and push between engines over any one-sided link
// (kv/ucx_link.hpp: over UCX, included on its own since it needs UCX).

#include "ferry/detail/config.hpp"
#include "ferry/kv/connector.hpp"
#include "ferry/kv/errors.hpp"
#include "ferry/kv/handshake.hpp"
#include "ferry/kv/layout.hpp"
#include "ferry/kv/load_tracker.hpp"
#include "ferry/kv/plan.hpp"
#include "ferry/kv/post.hpp"
#include "ferry/kv/release_ledger.hpp"

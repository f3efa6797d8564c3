#pragma once
// The inference-server layer: per-request, per-layer KV load tracking (decode side) and the release
// ledger (prefill side).

#include "ferry/detail/config.hpp"
#include "ferry/kv/errors.hpp"
#include "ferry/kv/load_tracker.hpp"
#include "ferry/kv/post.hpp"
#include "ferry/kv/release_ledger.hpp"

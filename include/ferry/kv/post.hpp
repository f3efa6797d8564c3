#pragma once
// The kv layer posts through ferry::post_with_backoff; these names keep it reachable from ferry::kv.

#include "ferry/post.hpp"

namespace ferry::kv {

using ferry::backoff_options;
using ferry::post_with_backoff;
using ferry::post_with_backoff_async;

}  // namespace ferry::kv

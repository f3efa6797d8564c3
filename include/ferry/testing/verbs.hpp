#pragma once
// The fake RDMA verbs fabric: an in-process fabric (testing/verbs/fabric.hpp) behind the same calls
// as the real provider (testing/verbs/provider.hpp), so that basic_device<fake::provider> runs the
// verbs backend, and the code above it, without an adapter. Needs the libibverbs headers (only their
// structures; nothing links against libibverbs).

#include "ferry/testing/verbs/fabric.hpp"
#include "ferry/testing/verbs/objects.hpp"
#include "ferry/testing/verbs/provider.hpp"

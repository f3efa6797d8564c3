#pragma once
// Test doubles, for ferry's own tests and for users testing their code against failures no real
// backend produces on demand: the fault injector (any backend's transfers failed, delayed, reordered
// or lost), the loopback backend behind one, and the fake GPU runtime. The fake verbs fabric needs
// the libibverbs headers and is included on its own (<ferry/testing/verbs.hpp>).

#include "ferry/detail/config.hpp"
#include "ferry/testing/errors.hpp"
#include "ferry/testing/fake_dmabuf.hpp"
#include "ferry/testing/fake_gpu.hpp"
#include "ferry/testing/fault_injector.hpp"
#include "ferry/testing/faulty_loopback.hpp"

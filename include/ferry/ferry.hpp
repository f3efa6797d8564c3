#pragma once
// The core of ferry: transfers and completers, batch verdicts (poll_all, wait_all, when_all, drain),
// posting with backoff, schedulers, tasks (spawn, sync_wait), the progress executor, the
// completion-source contract and the in-memory loopback backend. Each backend has its own header
// (<ferry/uring.hpp>, <ferry/verbs.hpp>, <ferry/gpu.hpp>), as do the inference-server layer
// (<ferry/kv.hpp>) and the test doubles (<ferry/testing.hpp>).

#include "ferry/version.hpp"
#include "ferry/batch_result.hpp"
#include "ferry/completion_source.hpp"
#include "ferry/errors.hpp"
#include "ferry/loopback.hpp"
#include "ferry/poll_all.hpp"
#include "ferry/post.hpp"
#include "ferry/progress_executor.hpp"
#include "ferry/run_loop.hpp"
#include "ferry/scheduler.hpp"
#include "ferry/spawn.hpp"
#include "ferry/sync_wait.hpp"
#include "ferry/task.hpp"
#include "ferry/transfer.hpp"
#include "ferry/transfer_state.hpp"
#include "ferry/wait_all.hpp"
#include "ferry/when_all.hpp"

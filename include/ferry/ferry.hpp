#pragma once
// The core of ferry: transfers and completers, batch verdicts (poll_all, wait_all, when_all, drain),
// posting with backoff, schedulers, tasks, the progress executor and the in-memory loopback backend.
// The io_uring, verbs and HIP backends are included explicitly from their own directories.

#include "ferry/batch_result.hpp"
#include "ferry/errors.hpp"
#include "ferry/fault_injector.hpp"
#include "ferry/loopback.hpp"
#include "ferry/poll_all.hpp"
#include "ferry/post.hpp"
#include "ferry/progress_executor.hpp"
#include "ferry/run_loop.hpp"
#include "ferry/scheduler.hpp"
#include "ferry/task.hpp"
#include "ferry/transfer.hpp"
#include "ferry/transfer_state.hpp"
#include "ferry/wait_all.hpp"
#include "ferry/when_all.hpp"

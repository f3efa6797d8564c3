#pragma once
// ferry inside Asio (standalone Asio, <asio.hpp>: Debian's libasio-dev; Boost.Asio is not
// supported): a scheduler over an Asio executor, transfers and batch waits as cancellable Asio
// operations, and any ferry awaitable (a task, when_all, resume_on) as an Asio operation. Built
// only where Asio is found (Meson option `asio`). docs/asio.md is the guide.

#include "ferry/asio/await.hpp"
#include "ferry/asio/scheduler.hpp"
#include "ferry/asio/wait.hpp"

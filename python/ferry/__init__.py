"""ferry for Python: awaitable bulk transfers for the KV connectors of inference servers.

Transfers are posted to a backend (ferry.Loopback, ferry.uring.Ring, ferry.ucx.Endpoint) whose
progress the executor's own thread drives. A transfer's state is one atomic load; poll_all,
wait_all and drain give a batch's verdict (the waits release the GIL); ``await transfer`` and
``await ferry.when_all(transfers, timeout)`` resume on the awaiting event loop's thread. No Python
code ever runs on the executor's thread.
"""

import sys as _sys

from . import _ferry
from ._ferry import (  # noqa: F401
    Batch,
    BatchResult,
    Completer,
    Errc,
    Error,
    Executor,
    FerryError,
    Loopback,
    State,
    Transfer,
    TransferError,
    TransferFailed,
    Verdict,
    collect,
    drain,
    make_completed_transfer,
    make_manual_transfer,
    poll_all,
    wait_all,
)
from ._aio import when_all  # noqa: F401

kv = _ferry.kv
directory = _ferry.directory
testing = _ferry.testing
HAS_URING = _ferry.HAS_URING
HAS_UCX = _ferry.HAS_UCX
_submodules = ["kv", "directory", "testing"]
if HAS_URING:
    uring = _ferry.uring
    _submodules.append("uring")
if HAS_UCX:
    ucx = _ferry.ucx
    _submodules.append("ucx")
# `import ferry.kv` and friends find the compiled submodules.
for _name in _submodules:
    _sys.modules[__name__ + "." + _name] = getattr(_ferry, _name)

from . import _kv  # noqa: E402,F401  (adds LoadTracker.when_layer)
from . import _directory  # noqa: E402,F401  (makes the directory's pending values awaitable)

__all__ = [
    "Batch", "BatchResult", "Completer", "Errc", "Error", "Executor", "FerryError", "Loopback",
    "State", "Transfer", "TransferError", "TransferFailed", "Verdict", "collect", "drain",
    "make_completed_transfer", "make_manual_transfer", "poll_all", "wait_all", "when_all",
    "kv", "directory", "testing",
] + (["uring"] if HAS_URING else []) + (["ucx"] if HAS_UCX else [])

"""asyncio glue: one notifier per event loop, its eventfd read by the loop itself.

The completing thread (the executor's, the timer thread, whoever called Completer.succeed) only
links the finished await onto the notifier's list and writes its eventfd; the loop's reader
callback (dispatch) runs on the loop's thread, with the GIL, and sets each future's result. Nothing
polls: an idle loop sleeps in its selector until the eventfd is written.
"""

import asyncio
import weakref

from . import _ferry

_notifiers = weakref.WeakKeyDictionary()


def _notifier(loop):
    n = _notifiers.get(loop)
    if n is None:
        n = _ferry._Notifier()
        loop.add_reader(n.fd, n.dispatch)
        _notifiers[loop] = n
    return n


def _await_transfer(self):
    loop = asyncio.get_running_loop()
    result, future = _notifier(loop).await_transfer(self, loop)
    if future is not None:
        result = yield from future
    return result


_ferry.Transfer.__await__ = _await_transfer


def _await_task(self):
    # A C++ task (ferry.kv.serve_releases, PushReceiver.receive, PushedRequest.finish): started on
    # this loop's thread when awaited, its result (or exception) taken once the loop saw it end.
    loop = asyncio.get_running_loop()
    future = _notifier(loop).start_task(self, loop)
    yield from future
    return self._result()


_ferry._Task.__await__ = _await_task


class _WhenAll:
    """The awaitable ferry.when_all returns; awaited once."""

    __slots__ = ("_transfers", "_timeout", "_who")

    def __init__(self, transfers, timeout, who):
        self._transfers = transfers
        self._timeout = timeout
        self._who = who

    def __await__(self):
        loop = asyncio.get_running_loop()
        result, future = _notifier(loop).await_batch(self._transfers, self._timeout, loop,
                                                     self._who)
        if future is not None:
            result = yield from future
        return result


def when_all(transfers, timeout=None):
    """``await ferry.when_all(transfers, timeout)``: the wait_all verdict, awaited.

    Resumes on the awaiting loop's thread the moment any member fails, when the last member
    succeeds, or at the one shared deadline (timed_out). timeout: None or negative waits forever,
    0 looks once (exactly poll_all), positive waits up to that many seconds. transfers: a
    ferry.Batch or any iterable of Transfers (copied when awaited). Cancelling the awaiting task
    cancels only the await; the transfers keep running. Bad arguments raise TypeError or
    ValueError here, not when awaited.
    """
    return _when_all(transfers, timeout, "ferry.when_all")


def _when_all(transfers, timeout, who):
    _ferry._check_wait(transfers, timeout, who)
    return _WhenAll(transfers, timeout, who)

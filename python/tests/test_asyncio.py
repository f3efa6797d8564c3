"""await transfer and await ferry.when_all: resumed on the awaiting loop's thread, woken by the
loop's own selector (an eventfd), never by polling."""

import asyncio
import selectors
import threading

import pytest

import ferry
from conftest import HANG, later

State, Verdict, Errc = ferry.State, ferry.Verdict, ferry.Errc


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, HANG))


def test_await_resumes_on_the_loops_thread_whoever_completes(executor, loopback):
    injector = ferry.testing.FaultInjector(executor, delay_rate=1.0, max_delay=0.02)

    async def main():
        here = threading.get_ident()
        seen = []
        # Completed on the executor's thread.
        t = loopback.copy(bytearray(1 << 20), bytes(1 << 20))
        seen.append((await t, threading.get_ident()))
        # Completed on another Python thread.
        t, c = ferry.make_manual_transfer()
        later(0.02, c.succeed)
        seen.append((await t, threading.get_ident()))
        # Completed by the executor's timers (a delayed result).
        t = injector.wrap(loopback.copy(bytearray(64), bytes(64)))
        seen.append((await t, threading.get_ident()))
        # when_all, decided by a failure on another thread, and by the process timer thread.
        ts = [ferry.make_manual_transfer() for _ in range(3)]
        later(0.02, ts[2][1].fail, Errc.abandoned)
        r = await ferry.when_all([t for t, _ in ts], HANG)
        seen.append((r.verdict, threading.get_ident()))
        pending, _keep = ferry.make_manual_transfer()
        r = await ferry.when_all([pending], 0.02)
        seen.append((r.verdict, threading.get_ident()))
        return here, seen

    here, seen = run(main())
    assert [s for s, _ in seen] == [State.success, State.success, State.success, Verdict.failed,
                                    Verdict.timed_out]
    assert all(ident == here for _, ident in seen)


def test_await_resumes_on_a_loop_running_in_another_thread():
    out = {}

    def thread_main():
        async def main():
            t, c = ferry.make_manual_transfer()
            later(0.02, c.succeed)
            out["state"] = await t
            out["resumed_on"] = threading.get_ident()

        out["loop_thread"] = threading.get_ident()
        asyncio.run(main())

    th = threading.Thread(target=thread_main)
    th.start()
    th.join(HANG)
    assert out["state"] == State.success
    assert out["resumed_on"] == out["loop_thread"] != threading.get_ident()


def test_awaiting_a_finished_transfer_does_not_suspend():
    async def main():
        t = ferry.make_completed_transfer(State.failed, Errc.backend_shut_down)
        return await t, await ferry.when_all([t], HANG), await ferry.when_all([], HANG)

    s, r, empty = run(main())
    assert s == State.failed
    assert r.verdict == Verdict.failed and r.error == Errc.backend_shut_down
    assert empty.verdict == Verdict.success


def test_when_all_keeps_the_verdict_rules():
    async def main():
        ts, cs = zip(*[ferry.make_manual_transfer() for _ in range(4)])
        zero = await ferry.when_all(ts, 0)  # a look: pending, not timed_out
        later(0.02, cs[3].fail, Errc.abandoned)
        failed = await ferry.when_all(ts, HANG)  # members 0..2 still pending
        ok_ts, ok_cs = zip(*[ferry.make_manual_transfer() for _ in range(3)])
        for i, c in enumerate(ok_cs):
            later(0.01 * (i + 1), c.succeed)
        success = await ferry.when_all(ok_ts, None)
        pending, _keep = ferry.make_manual_transfer()
        tiny = await ferry.when_all([pending], 1e-12)
        return zero, failed, success, tiny

    zero, failed, success, tiny = run(main())
    assert zero.verdict == Verdict.pending
    assert failed.verdict == Verdict.failed and failed.first_failed == 3 and failed.pending == 3
    assert success.verdict == Verdict.success
    assert tiny.verdict == Verdict.timed_out


def test_when_all_over_a_batch_of_256_copies(loopback):
    async def main():
        ts = [loopback.copy(bytearray(4096), bytes(4096)) for _ in range(256)]
        return await ferry.when_all(ferry.Batch(ts), HANG)

    assert run(main()).ok


def test_a_cancelled_await_leaves_the_transfer_and_the_loop_working():
    async def main():
        t, c = ferry.make_manual_transfer()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(_await(t), 0.02)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(_await(ferry.when_all([t])), 0.02)
        c.succeed()
        await asyncio.sleep(0.01)  # the cancelled awaits' wake-ups arrive and are dropped
        return await t

    async def _await(a):
        return await a

    assert run(main()) == State.success


def test_many_awaits_at_once_and_loop_after_loop(loopback):
    async def main():
        async def one():
            return await loopback.copy(bytearray(512), bytes(512))

        return await asyncio.gather(*[one() for _ in range(500)])

    for _ in range(3):
        assert run(main()) == [State.success] * 500


class CountingSelector(selectors.DefaultSelector):
    def __init__(self):
        super().__init__()
        self.selects = 0

    def select(self, timeout=None):
        self.selects += 1
        return super().select(timeout)


def test_an_await_sleeps_in_the_loops_selector_instead_of_polling():
    # A loop that polled would go round its selector every millisecond or so; woken by the
    # eventfd, it goes round a handful of times for the whole 0.3 s wait.
    selector = CountingSelector()
    loop = asyncio.SelectorEventLoop(selector)
    try:
        async def main():
            t, c = ferry.make_manual_transfer()
            later(0.3, c.succeed)
            before = selector.selects
            s = await t
            return s, selector.selects - before

        state, selects = loop.run_until_complete(asyncio.wait_for(main(), HANG))
    finally:
        loop.close()
    assert state == State.success
    assert selects < 20


def test_awaiting_outside_a_running_loop_is_refused():
    t, _c = ferry.make_manual_transfer()
    with pytest.raises(RuntimeError, match="running event loop"):
        next(iter(t.__await__()))


def test_no_wake_up_is_lost_under_completions_racing_the_loop(executor, loopback):
    # Thousands of awaits ended from the executor's thread (copies, some reordered and delayed by
    # the injector) and from two Python threads at once, while the loop keeps taking what is
    # ready: every await must resume. A lost eventfd write would leave one pending until the
    # bound.
    mixed = ferry.testing.FaultInjector(executor, delay_rate=0.3, max_delay=0.002,
                                        reorder_window=16, seed=5)

    async def main():
        manual = [ferry.make_manual_transfer() for _ in range(1000)]

        def complete(part):
            for _, c in manual[part::2]:
                c.succeed()

        copies = [mixed.wrap(loopback.copy(bytearray(64), bytes(64))) for _ in range(2000)]
        threads = [threading.Thread(target=complete, args=(p,)) for p in (0, 1)]

        async def one(t):
            return await t

        awaits = [asyncio.ensure_future(one(t)) for t in copies + [t for t, _ in manual]]
        for th in threads:
            th.start()
        states = await asyncio.gather(*awaits)
        for th in threads:
            th.join(HANG)
        return states

    for _ in range(3):
        assert run(main()) == [State.success] * 3000

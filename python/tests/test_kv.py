"""The kv layer's properties (docs/design.md, "The inference-server layer"), seen from Python."""

import asyncio
import threading
import time

import pytest

import ferry
from conftest import HANG, later

kv = ferry.kv
RV = kv.RequestVerdict
State, Verdict, Errc = ferry.State, ferry.Verdict, ferry.Errc


class Recorder:
    def __init__(self):
        self.released = []
        self.cancelled = []

    def release(self, request, verdict):
        self.released.append((request, verdict))

    def cancel(self, transfer):
        self.cancelled.append(transfer)


def tracker_with(rec=None):
    rec = rec or Recorder()
    return kv.LoadTracker(rec.release, rec.cancel), rec


def add_manual(tracker, handle, layer, blocks):
    t, c = ferry.make_manual_transfer()
    tracker.add(handle, layer, t, blocks)
    return c


def test_done_only_when_every_transfer_succeeded_in_any_order():
    tr, rec = tracker_with()
    tr.begin_step()
    h = tr.add_request(1)
    cs = [add_manual(tr, h, layer, [layer]) for layer in range(3)]
    tr.seal(h)
    cs[2].succeed()
    cs[0].succeed()
    assert tr.verdict(1) == RV.pending
    cs[1].succeed()
    assert tr.verdict(1) == RV.success


def test_unsealed_is_pending_and_sealed_empty_is_failed():
    tr, rec = tracker_with()
    h = tr.add_request(1)
    assert tr.verdict(1) == RV.pending
    assert tr.take_finished() == []
    tr.seal(h)
    assert tr.verdict(1) == RV.failed
    (f,) = tr.take_finished()
    assert f.verdict == RV.failed and f.error == kv.Errc.empty_request


def test_a_verdict_changes_nothing_and_failure_wins_over_timeout_and_pending():
    tr, rec = tracker_with()
    h = tr.add_request(1, abort_timeout=1.0, created_ns=0)
    c0 = add_manual(tr, h, 0, [10])
    _c1 = add_manual(tr, h, 1, [11])
    tr.seal(h)
    c0.fail(Errc.abandoned)
    for _ in range(3):
        assert tr.verdict(1, now_ns=10**12) == RV.failed
    assert rec.released == [] and tr.tracks(1)


def test_a_timeout_needs_an_age_strictly_greater_than_the_limit():
    tr, rec = tracker_with()
    h = tr.add_request(1, abort_timeout=1.0, created_ns=5_000_000_000)
    c = add_manual(tr, h, 0, [1])
    tr.seal(h)
    assert tr.verdict(1, now_ns=6_000_000_000) == RV.pending  # exactly the limit
    assert tr.verdict(1, now_ns=6_000_000_001) == RV.timed_out  # past it
    c.succeed()
    assert tr.verdict(1, now_ns=10**15) == RV.success  # all done: success whatever the age


def test_a_hybrid_failure_raises_before_anything_changes_and_again_until_aborted():
    tr, rec = tracker_with()
    tr.begin_step()
    h = tr.add_request(7, hybrid=True)
    c_attn = add_manual(tr, h, 0, [1, 2])
    c_state = add_manual(tr, h, 1, [3])
    tr.seal(h)
    c_state.fail(Errc.backend_shut_down)
    for ask in (lambda: tr.verdict(7), tr.take_finished, tr.take_finished):
        with pytest.raises(kv.TransferError) as info:
            ask()
        e = info.value
        assert (e.request, e.member, e.layer, e.timed_out) == (7, 1, 1, False)
        assert e.error == Errc.backend_shut_down
        assert isinstance(e, ferry.FerryError) and "hybrid request 7" in str(e)
    assert tr.tracks(7) and rec.released == [] and tr.drain_failed_blocks() == []
    tr.abort_request(7)
    assert rec.cancelled == [c_attn.transfer()]  # its pending transfer is asked to end, once
    assert tr.take_finished() == []  # still in flight: no release
    c_attn.succeed()
    (f,) = tr.take_finished()
    assert f.aborted and rec.released == [(7, RV.failed)]
    assert tr.drain_failed_blocks() == []


def test_a_hybrid_timeout_raises_naming_the_first_pending_transfer():
    tr, rec = tracker_with()
    h = tr.add_request(3, hybrid=True, abort_timeout=0.5, created_ns=0)
    add_manual(tr, h, 0, [1]).succeed()
    _c = add_manual(tr, h, 4, [2])
    tr.seal(h)
    assert tr.verdict(3, now_ns=500_000_000) == RV.pending
    with pytest.raises(kv.TransferError) as info:
        tr.take_finished(now_ns=500_000_001)
    assert info.value.timed_out and info.value.member == 1 and info.value.layer == 4
    assert info.value.error is None
    assert rec.cancelled == []  # a hybrid timeout cancels nothing until aborted


def test_failed_blocks_are_reported_once_and_only_when_nothing_writes_them():
    tr, rec = tracker_with()
    h = tr.add_request(1)
    c0 = add_manual(tr, h, 0, [100, 101])
    c1 = add_manual(tr, h, 1, [101, 102])  # shares block 101
    tr.seal(h)
    c0.fail(Errc.abandoned)
    assert tr.drain_failed_blocks() == []  # 101 is still being written by c1
    assert tr.take_finished() == [] and rec.released == []  # no release while in flight
    c1.succeed()
    assert sorted(tr.drain_failed_blocks()) == [100, 101]
    assert tr.drain_failed_blocks() == []
    (f,) = tr.take_finished()
    assert f.verdict == RV.failed and f.first_failed == 0
    assert rec.released == [(1, RV.failed)]
    assert tr.take_finished() == [] and rec.released == [(1, RV.failed)]  # exactly once


def test_a_timed_out_request_has_its_pending_transfers_cancelled_once():
    tr, rec = tracker_with()
    h = tr.add_request(1, abort_timeout=0.0, created_ns=0)
    c = add_manual(tr, h, 0, [5])
    tr.seal(h)
    assert tr.take_finished(now_ns=1) == []
    assert tr.take_finished(now_ns=2) == []
    assert len(rec.cancelled) == 1
    c.cancel()
    (f,) = tr.take_finished(now_ns=3)
    assert f.verdict == RV.failed
    assert tr.drain_failed_blocks() == [5]


def test_wait_layer_covers_exactly_that_layer_across_requests():
    tr, rec = tracker_with()
    tr.begin_step()
    layer1 = []
    for rid in (1, 2):
        h = tr.add_request(rid)
        add_manual(tr, h, 0, [rid]).succeed()
        layer1.append(add_manual(tr, h, 1, [10 + rid]))
        tr.seal(h)
    assert len(tr.layer_transfers(0)) == 2 and len(tr.layer_transfers(5)) == 0
    assert tr.wait_layer(0, HANG).ok
    assert tr.wait_layer(1, 0.02).verdict == Verdict.timed_out
    later(0.02, layer1[1].fail, Errc.abandoned)
    r = tr.wait_layer(1, HANG)  # returns at the failure, layer1[0] still pending
    assert r.verdict == Verdict.failed and r.first_failed == 1 and r.pending == 1

    async def main():
        layer1[0].succeed()
        return await tr.when_layer(0, HANG), await tr.when_layer(1, HANG)

    zero, one = asyncio.run(main())
    assert zero.ok and one.verdict == Verdict.failed


def test_drain_step_waits_for_everything_and_the_tracker_refuses_other_threads_meanwhile():
    tr, rec = tracker_with()
    tr.begin_step()
    h = tr.add_request(1)
    c = add_manual(tr, h, 0, [1])
    tr.seal(h)
    seen = []

    def other_thread():
        # Tries until drain_step is running (only then is it refused; before, the call is just
        # serialized by the GIL), however late the main thread gets there; bounded.
        try:
            for _ in range(int(HANG / 0.001)):
                try:
                    tr.verdict(1)
                except RuntimeError as e:
                    seen.append(str(e))
                    return
                time.sleep(0.001)
        finally:
            c.succeed()  # drain_step cannot return before this

    later(0.05, other_thread)
    assert tr.drain_step(HANG).ok
    assert seen and "another thread" in seen[0]


def test_post_retries_a_full_queue_then_registers_an_ordinary_failure(loopback):
    tr, rec = tracker_with()
    tr.begin_step()
    # Taken on the third try. Its admission deadline is only a "did not hang" bound: a short one
    # could pass while a loaded machine keeps this thread off the CPU between tries.
    h = tr.add_request(1, admission_timeout=HANG)
    tries = []

    def full_then_taken():
        tries.append(1)
        return None if len(tries) < 3 else loopback.copy(bytearray(16), bytes(16))

    tr.post(h, 0, [1], full_then_taken)
    assert len(tries) == 3
    tr.seal(h)
    full = tr.add_request(3, admission_timeout=0.02)
    tr.post(full, 1, [2], lambda: None)  # never taken: fails at the admission deadline
    tr.seal(full)
    r = tr.wait_layer(1, HANG)
    assert r.verdict == Verdict.failed and r.error == Errc.submission_queue_full
    assert tr.drain_step(HANG).pending == 0
    assert tr.drain_failed_blocks() == [2]

    def calls_back():
        tr.begin_step()

    h2 = tr.add_request(2)
    with pytest.raises(RuntimeError, match="submit"):
        tr.post(h2, 0, [1], calls_back)
    with pytest.raises(IndexError, match="layer"):
        tr.post(h2, 1 << 21, [1], lambda: None)


def test_bad_registrations_say_what_was_wrong():
    tr, rec = tracker_with()
    h = tr.add_request(1)
    with pytest.raises(ValueError, match="already tracked"):
        tr.add_request(1)
    with pytest.raises(ValueError, match="negative abort_timeout"):
        tr.add_request(2, abort_timeout=-1.0)
    tr.seal(h)
    with pytest.raises(RuntimeError, match="sealed"):
        tr.add(h, 0, ferry.make_manual_transfer()[0], [1])
    with pytest.raises(IndexError, match="not tracked"):
        tr.verdict(99)


def test_an_exception_in_release_still_sends_every_release():
    released = []

    def release(rid, verdict):
        released.append(rid)
        if rid == 1:
            raise KeyError("producer unreachable")

    tr = kv.LoadTracker(release)
    for rid in (1, 2):
        h = tr.add_request(rid)
        add_manual(tr, h, 0, [rid]).succeed()
        tr.seal(h)
    with pytest.raises(KeyError):
        tr.take_finished()
    assert sorted(released) == [1, 2]
    assert sorted(f.id for f in tr.take_finished()) == [1, 2]  # handed back, not released again
    assert sorted(released) == [1, 2]


def test_the_release_ledger_frees_once_after_the_fan_in():
    freed = []
    ledger = kv.ReleaseLedger(freed.append, early_capacity=2)
    A = kv.AckResult
    assert not ledger.expect(1, 2)
    assert ledger.acknowledge(1, 0) == A.counted
    assert ledger.acknowledge(1, 0) == A.duplicate
    assert ledger.acknowledge(1, 1) == A.freed
    assert ledger.acknowledge(1, 1) == A.stale
    assert freed == [1]
    assert ledger.acknowledge(2, 0) == A.early
    assert ledger.acknowledge(3, 0) == A.early
    assert ledger.acknowledge(4, 0) == A.early_dropped  # oldest early (2) dropped
    assert ledger.expect(3, 1)  # its early acknowledgement counts now
    assert freed == [1, 3] and ledger.open == 0 and ledger.early == 1
    with pytest.raises(ValueError, match="at least one consumer"):
        ledger.expect(9, 0)


def test_the_ledger_is_safe_from_many_python_threads():
    freed = []
    ledger = kv.ReleaseLedger(freed.append)
    for i in range(200):
        ledger.expect(i, 4)

    def rank(r):
        for i in range(200):
            ledger.acknowledge(i, r)
            ledger.acknowledge(i, r)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(HANG)
    assert sorted(freed) == list(range(200))


def test_layers_compute_while_later_layers_stream_in(loopback):
    # A decode step: every layer's wait covers that layer only, so layer 0 is ready while the
    # last layer's copies are held back by a delay.
    executor = ferry.Executor()
    lb = ferry.Loopback(executor)
    slow = ferry.testing.FaultInjector(executor, delay_rate=1.0, max_delay=0.2, seed=3)
    tr, rec = tracker_with()
    tr.begin_step()
    h = tr.add_request(1)
    tr.add(h, 0, lb.copy(bytearray(64), bytes(64)), [0])
    tr.add(h, 1, slow.wrap(lb.copy(bytearray(64), bytes(64))), [1])
    tr.seal(h)
    assert tr.wait_layer(0, HANG).ok
    assert tr.wait_layer(1, HANG).ok
    assert tr.verdict(1) == RV.success
    time.sleep(0)

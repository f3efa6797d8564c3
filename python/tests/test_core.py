"""The core's verdict rules, timeouts, errors and buffer lifetimes, seen from Python."""

import gc
import signal
import threading
import time
import weakref

import pytest

import ferry
from conftest import HANG, later, release_hung

State, Verdict, Errc = ferry.State, ferry.Verdict, ferry.Errc


def manual(n):
    pairs = [ferry.make_manual_transfer() for _ in range(n)]
    return [t for t, _ in pairs], [c for _, c in pairs]


def test_an_empty_batch_is_a_success_for_every_verdict():
    assert ferry.poll_all([]).verdict == Verdict.success
    assert ferry.wait_all([], HANG).verdict == Verdict.success
    assert ferry.drain([], HANG).verdict == Verdict.success


def test_the_first_completion_wins_and_later_ones_change_nothing():
    t, c = ferry.make_manual_transfer()
    assert c.succeed()
    assert not c.fail(Errc.abandoned)
    assert not c.cancel()
    assert t.state == State.success
    assert t.error is None


def test_success_only_when_every_member_succeeded():
    ts, cs = manual(3)
    cs[0].succeed()
    cs[2].succeed()
    assert ferry.poll_all(ts).verdict == Verdict.pending
    cs[1].succeed()
    r = ferry.poll_all(ts)
    assert r.verdict == Verdict.success and r.ok and r.pending == 0


def test_failure_wins_over_pending_and_cancelled_counts_as_failed():
    ts, cs = manual(3)
    cs[1].cancel()
    r = ferry.poll_all(ts)
    assert r.verdict == Verdict.failed
    assert r.first_failed == 1
    assert r.error == Errc.cancelled
    assert r.pending == 2


def test_first_failed_is_first_in_time_not_lowest_index():
    ts, cs = manual(4)
    cs[3].fail(Errc.backend_shut_down)
    cs[0].fail(Errc.abandoned)
    for r in (ferry.poll_all(ts), ferry.wait_all(ts, HANG), ferry.drain(ts, 0)):
        assert r.first_failed == 3
        assert r.error == Errc.backend_shut_down


def test_wait_all_returns_at_a_failure_whatever_its_index_while_others_pend():
    ts, cs = manual(64)
    later(0.05, cs[40].fail, 5)  # EIO
    r = ferry.wait_all(ts, HANG)
    assert r.verdict == Verdict.failed
    assert r.first_failed == 40
    assert r.error.errno == 5 and r.error.category == "system"
    assert r.pending == 63


def test_a_zero_timeout_is_exactly_poll_all():
    ts, _cs = manual(2)
    assert ferry.wait_all(ts, 0).verdict == Verdict.pending
    assert ferry.drain(ts, 0).verdict == Verdict.pending
    assert ts[0].wait(0) == State.pending


def test_a_positive_timeout_is_never_rounded_down_to_a_look():
    ts, _cs = manual(1)
    assert ferry.wait_all(ts, 1e-12).verdict == Verdict.timed_out
    assert ferry.drain(ts, 1e-12).verdict == Verdict.timed_out


def test_timed_out_at_the_shared_deadline_with_members_pending():
    ts, cs = manual(3)
    cs[0].succeed()
    r = ferry.wait_all(ts, 0.05)
    assert r.verdict == Verdict.timed_out and r.pending == 2
    assert ferry.wait_all(ts, 0.25).verdict == Verdict.timed_out  # longer than one signal slice


def test_none_and_negative_timeouts_wait_until_decided():
    for timeout in (None, -1):
        ts, cs = manual(2)
        later(0.02, cs[0].succeed)
        later(0.15, cs[1].succeed)
        assert ferry.wait_all(ts, timeout).verdict == Verdict.success
    t, c = ferry.make_manual_transfer()
    later(0.02, c.succeed)
    assert t.wait() == State.success


def test_timeouts_take_timedelta_and_refuse_nan_and_non_numbers():
    import datetime

    ts, _ = manual(1)
    assert ferry.wait_all(ts, datetime.timedelta(milliseconds=10)).verdict == Verdict.timed_out
    with pytest.raises(ValueError, match="NaN"):
        ferry.wait_all(ts, float("nan"))
    with pytest.raises(TypeError, match="timeout"):
        ferry.wait_all(ts, "1s")


def test_drain_waits_for_every_member_even_after_a_failure():
    ts, cs = manual(2)
    cs[0].fail(Errc.abandoned)
    later(0.05, cs[1].succeed)
    r = ferry.drain(ts, HANG)
    assert r.verdict == Verdict.failed and r.first_failed == 0
    assert r.pending == 0
    assert ts[1].state == State.success


def test_a_transfer_whose_last_completer_goes_fails_as_abandoned():
    t, c = ferry.make_manual_transfer()
    del c
    gc.collect()
    assert t.state == State.failed
    assert t.error == Errc.abandoned
    assert "destroyed" in t.error.message


def test_an_empty_handle_is_failed_with_empty_transfer():
    t = ferry.Transfer()
    assert not t.valid
    assert t.state == State.failed
    assert t.error == Errc.empty_transfer
    assert ferry.poll_all([t]).error == Errc.empty_transfer


def test_errors_name_what_went_wrong():
    t, c = ferry.make_manual_transfer()
    c.fail()
    assert t.error == Errc.unspecified_failure
    with pytest.raises(ferry.TransferFailed) as info:
        t.check()
    assert info.value.error == Errc.unspecified_failure
    assert isinstance(info.value, ferry.FerryError)
    r = ferry.poll_all([ferry.make_completed_transfer(State.success), t])
    with pytest.raises(ferry.TransferFailed) as info:
        r.check()
    assert info.value.first_failed == 1
    pending, _keep = ferry.make_manual_transfer()
    with pytest.raises(TimeoutError):
        ferry.wait_all([pending], 0.01).check()
    assert ferry.Error(Errc.abandoned) == Errc.abandoned
    assert ferry.Error(Errc.abandoned) != ferry.testing.Errc.injected_fault
    assert ferry.Error(2).errno == 2
    with pytest.raises(TypeError):
        c.fail("bad")
    with pytest.raises(ValueError):
        ferry.make_completed_transfer(State.pending)


def failed_with(code):
    return ferry.make_completed_transfer(State.failed, code).error


def errc_layers():
    layers = [Errc, ferry.kv.Errc, ferry.testing.Errc]
    layers += [ferry.uring.Errc] if ferry.HAS_URING else []
    layers += [ferry.ucx.Errc] if ferry.HAS_UCX else []
    return layers


def test_an_error_and_its_errc_value_compare_equal_both_ways():
    e = failed_with(Errc.abandoned)
    assert e == Errc.abandoned and Errc.abandoned == e
    assert not (e != Errc.abandoned) and not (Errc.abandoned != e)
    assert e != Errc.cancelled and Errc.cancelled != e
    assert not (e == Errc.cancelled) and not (Errc.cancelled == e)
    assert e in (Errc.cancelled, Errc.abandoned) and e not in (Errc.cancelled, Errc.empty_transfer)
    assert Errc.abandoned in [e] and Errc.abandoned in {e} and e in {Errc.abandoned}
    assert hash(e) == hash(Errc.abandoned)
    assert {e: "x"}[Errc.abandoned] == "x" and {Errc.abandoned: "y"}[e] == "y"
    # The enums among themselves are as before: equal to their own value only, not to ints.
    assert Errc.abandoned == Errc.abandoned and Errc.abandoned != Errc.cancelled
    assert Errc.abandoned != int(Errc.abandoned)
    for layer in errc_layers():
        for value in layer.__members__.values():
            err = failed_with(value)
            assert value == err and err == value and not (value != err), (layer, value)
            assert value in (err,) and err in (value,) and value in {err} and err in {value}


def test_an_error_never_equals_another_categorys_errc_with_the_same_number():
    pairs = 0
    for mine in errc_layers():
        for theirs in errc_layers():
            if theirs is mine:
                continue
            for v in mine.__members__.values():
                for w in theirs.__members__.values():
                    if int(v) != int(w):
                        continue
                    pairs += 1
                    e = failed_with(v)
                    assert e != w and w != e and not (e == w) and not (w == e), (v, w)
                    assert e not in (w,) and w not in (e,) and w not in {e} and e not in {w}
                    assert v != w and w != v
    assert pairs > 0
    # An errno error is of the system category: no Errc value equals it either.
    assert ferry.Error(int(Errc.abandoned)) != Errc.abandoned
    assert Errc.abandoned != ferry.Error(int(Errc.abandoned))


def test_a_batch_is_held_in_cxx_and_every_wait_takes_it():
    ts, cs = manual(3)
    b = ferry.Batch(ts)
    assert len(b) == 3 and b[-1] == ts[2]
    for c in cs:
        c.succeed()
    assert ferry.poll_all(b).ok and ferry.wait_all(b, HANG).ok and ferry.drain(b, HANG).ok
    with pytest.raises(TypeError, match="ferry.Transfer"):
        ferry.Batch([1, 2])


def _counting_thread(stop):
    counts = [0]

    def run():
        while not stop.is_set():
            counts[0] += 1

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, counts


@pytest.mark.parametrize("how", ["wait_all", "drain", "wait", "wait_for_timeout"])
def test_a_wait_does_not_hold_the_gil(how):
    # The transfer is completed by a Python thread, which needs the GIL to run at all: a wait that
    # held it would reach its deadline instead. Meanwhile another Python thread keeps counting.
    t, c = ferry.make_manual_transfer()
    stop = threading.Event()
    counter, counts = _counting_thread(stop)
    before = counts[0]

    def complete():
        time.sleep(0.1)
        c.succeed()

    th = threading.Thread(target=complete, daemon=True)
    th.start()
    if how == "wait_all":
        ok = ferry.wait_all([t], HANG).ok
    elif how == "drain":
        ok = ferry.drain([t], HANG).ok
    elif how == "wait":
        ok = t.wait() == State.success
    else:
        ok = t.wait(HANG) == State.success
    ran = counts[0] - before
    stop.set()
    th.join(HANG)
    counter.join(HANG)
    assert ok
    assert ran > 0


def test_a_long_wait_lets_signal_handlers_run():
    class Interrupted(Exception):
        pass

    def handler(signum, frame):
        raise Interrupted()

    old = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        t, _c = ferry.make_manual_transfer()
        with pytest.raises(Interrupted):
            ferry.wait_all([t])
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_loopback_copies_through_the_buffer_protocol(loopback):
    src = bytearray(b"abcdefgh" * 512)
    dst = bytearray(len(src))
    t = loopback.copy(dst, src)
    assert t.wait(HANG) == State.success
    assert dst == src
    part = bytearray(8)
    assert loopback.copy(part, memoryview(src)[8:], 4).wait(HANG) == State.success
    assert part[:4] == b"abcd"
    small = loopback.copy(bytearray(2), src)
    assert small.wait(HANG) == State.failed and small.error == Errc.destination_too_small


def test_numpy_arrays_are_buffers(loopback):
    np = pytest.importorskip("numpy")
    src = np.arange(1024, dtype=np.uint32)
    dst = np.zeros(1024, dtype=np.uint32)
    assert loopback.copy(dst, src).wait(HANG) == State.success
    assert (dst == src).all()
    with pytest.raises(TypeError, match="contiguous"):
        loopback.copy(np.zeros((4, 4))[:, 1], src)


def test_a_read_only_destination_is_refused_naming_it(loopback):
    with pytest.raises(TypeError, match="destination.*bytes"):
        loopback.copy(b"readonly", bytearray(8))
    with pytest.raises(TypeError, match="source.*buffer protocol"):
        loopback.copy(bytearray(8), 12)


def test_buffers_outlive_their_transfers(executor, loopback):
    np = pytest.importorskip("numpy")
    hang = ferry.testing.FaultInjector(executor, hang_rate=1.0)
    dst = np.zeros(4096, dtype=np.uint8)
    src = np.full(4096, 7, dtype=np.uint8)
    alive_dst, alive_src = weakref.ref(dst), weakref.ref(src)
    t = hang.wrap(loopback.copy(dst, src))
    del dst, src
    gc.collect()
    assert alive_dst() is not None and alive_src() is not None  # held by the pending transfer
    del t
    gc.collect()
    ferry.collect()
    assert alive_dst() is not None  # the dropped transfer is still pending: still held
    release_hung(hang, 1)
    for _ in range(3000):
        if ferry.collect() == 0:
            break
        time.sleep(0.01)
    gc.collect()
    assert alive_dst() is None and alive_src() is None
    assert ferry.collect() == 0


def test_a_held_bytearray_cannot_be_resized_under_a_transfer(executor, loopback):
    hang = ferry.testing.FaultInjector(executor, hang_rate=1.0)
    dst = bytearray(64)
    t = hang.wrap(loopback.copy(dst, bytearray(b"x" * 64)))
    with pytest.raises(BufferError):
        dst.extend(b"more")
    release_hung(hang, 1)
    assert t.wait(HANG) == State.success
    del t
    ferry.collect()  # the inner copy's handle was dropped while pending: swept now
    dst.extend(b"more")
    assert len(dst) == 68


def test_many_concurrent_waiters_from_python_threads(loopback):
    # Threads waiting on their own batches at once, with the GIL released by each wait.
    results = []

    def worker():
        for _ in range(20):
            ts = [loopback.copy(bytearray(256), bytes(256)) for _ in range(32)]
            results.append(ferry.wait_all(ts, HANG).ok)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(HANG)
    assert results == [True] * 80


def test_the_executor_reports_counters(executor, loopback):
    loopback.copy(bytearray(8), bytes(8)).wait(HANG)
    # The executor adds a round's completions to its counters when that round's poll returns: the
    # waiter, woken by the completion itself, can read them first. Wait for the count (bounded).
    for _ in range(3000):
        c = executor.counters
        if c["completions"] >= 1:
            break
        time.sleep(0.01)
    assert c["completions"] >= 1 and c["rounds"] >= 1
    with pytest.raises(ValueError, match="mode"):
        ferry.Executor(mode="fast")

"""ferry.testing.FaultInjector from Python: failures, hangs, delays and reordering over real
copies, the buffer always quiescent when the caller hears of the transfer."""

import pytest

import ferry
from conftest import HANG, release_hung

State, Verdict = ferry.State, ferry.Verdict
Injected = ferry.testing.Errc.injected_fault


def test_an_injected_failure_comes_after_the_data_moved(executor, loopback):
    inj = ferry.testing.FaultInjector(executor, failure_rate=1.0)
    dst = bytearray(128)
    t = inj.wrap(loopback.copy(dst, b"z" * 128))
    assert t.wait(HANG) == State.failed
    assert t.error == Injected and t.error.category == "ferry.testing"
    assert dst == b"z" * 128
    assert inj.counters["failed"] == 1


def test_a_hang_lasts_until_released_or_the_injector_goes(executor, loopback):
    inj = ferry.testing.FaultInjector(executor, hang_rate=1.0)
    a = inj.wrap(loopback.copy(bytearray(8), bytes(8)))
    b = inj.wrap(loopback.copy(bytearray(8), bytes(8)))
    assert ferry.wait_all([a, b], 0.05).verdict == Verdict.timed_out
    release_hung(inj, 2)
    assert ferry.wait_all([a, b], HANG).ok
    c = inj.wrap(loopback.copy(bytearray(8), bytes(8)))
    assert c.wait(0.05) == State.pending
    del inj  # a hung transfer fails as abandoned when its injector goes
    assert c.wait(HANG) == State.failed and c.error == ferry.Errc.abandoned


def test_delays_and_reordering_deliver_every_result(executor, loopback):
    inj = ferry.testing.FaultInjector(executor, delay_rate=0.5, max_delay=0.01, reorder_window=8,
                                      failure_rate=0.2, seed=11)
    ts = [inj.wrap(loopback.copy(bytearray(32), bytes(32))) for _ in range(200)]
    r = ferry.drain(ts, HANG)
    assert r.pending == 0
    counts = inj.counters
    assert counts["wrapped"] == 200
    assert counts["failed"] + counts["forwarded"] == 200
    assert sum(t.state == State.failed for t in ts) == counts["failed"]


def test_bad_profiles_are_refused(executor):
    with pytest.raises(ValueError, match="sum to at most 1"):
        ferry.testing.FaultInjector(executor, failure_rate=0.7, hang_rate=0.7)
    with pytest.raises(ValueError, match="max_delay"):
        ferry.testing.FaultInjector(executor, max_delay=-1.0)

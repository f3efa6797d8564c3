"""The connector example's cases (python/examples/kv_connector.py), with transfers completed by
hand: hybrid [failed, pending] and [pending, failed], a timeout at exactly the limit and past it,
an attention-only failure, a KDA layer with two statuses."""

import os
import sys

import pytest

import ferry
from conftest import HANG, later

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from kv_connector import FerryKVConnector, LoadSpec, LoopbackTransport, main  # noqa: E402

Errc, Verdict = ferry.Errc, ferry.Verdict


class ManualTransport:
    """Every read is a manual transfer; completers[(request, layer)] lists its completers (two
    for a KDA layer)."""

    def __init__(self, kda_layers=()):
        self.kda_layers = set(kda_layers)
        self.completers = {}
        self.cancelled = []
        self.released = []

    def read(self, request_id, layer, blocks):
        out = []
        for _ in range(2 if layer in self.kda_layers else 1):
            t, c = ferry.make_manual_transfer()
            self.completers.setdefault((request_id, layer), []).append(c)
            out.append(t)
        return out

    def cancel(self, transfer):
        # Asks only, like a backend whose cancel takes effect later: the test ends it.
        self.cancelled.append(transfer)

    def release(self, request_id):
        self.released.append(request_id)

    def c(self, request_id, layer, i=0):
        return self.completers[(request_id, layer)][i]


def two_layer_request(rid, hybrid, **kw):
    return LoadSpec(rid, {0: [rid * 10], 1: [rid * 10 + 1]}, hybrid=hybrid, **kw)


@pytest.mark.parametrize("order", ["failed_pending", "pending_failed"])
def test_a_hybrid_request_raises_whichever_member_failed(order):
    tp = ManualTransport()
    conn = FerryKVConnector(tp, num_layers=2, layer_timeout=HANG)
    conn.start_load_kv([two_layer_request(1, hybrid=True)])
    failing = 0 if order == "failed_pending" else 1
    tp.c(1, failing).fail(Errc.abandoned)
    assert conn.wait_for_layer_load(failing).verdict == Verdict.failed
    for _ in range(2):  # raised again each time, nothing changed
        with pytest.raises(ferry.TransferError) as info:
            conn.get_finished()
        assert info.value.request == 1 and info.value.layer == failing
        assert info.value.error == Errc.abandoned and not info.value.timed_out
        assert tp.released == [] and conn.get_block_ids_with_load_errors() == set()
    conn.abort_request(1)
    assert tp.cancelled == [tp.c(1, 1 - failing).transfer()]  # the read in flight is asked to end
    assert conn.get_finished() == set()  # and until it has, nothing is released
    tp.c(1, 1 - failing).cancel()
    assert conn.get_finished() == {1}
    assert tp.released == [1] and conn.get_block_ids_with_load_errors() == set()


def test_a_timeout_at_exactly_the_limit_is_not_one_and_past_it_is():
    tp = ManualTransport()
    conn = FerryKVConnector(tp, num_layers=2, load_timeout=2.0)
    start = 1_000_000_000
    conn.start_load_kv([two_layer_request(1, hybrid=False)], now_ns=start)
    tp.c(1, 0).succeed()
    limit = start + 2_000_000_000
    assert conn.get_finished(now_ns=limit) == set()  # age == limit: still loading
    assert tp.cancelled == [] and conn.get_block_ids_with_load_errors() == set()
    # Past it: the pending read is asked to end (once); once it has, the request is released and
    # its blocks reported.
    assert conn.get_finished(now_ns=limit + 1) == set()
    assert conn.get_finished(now_ns=limit + 2) == set()
    assert tp.cancelled == [tp.c(1, 1).transfer()]
    tp.c(1, 1).cancel()
    assert conn.get_finished(now_ns=limit + 3) == {1}
    assert conn.get_block_ids_with_load_errors() == {11}
    assert conn.get_block_ids_with_load_errors() == set()
    assert tp.released == [1]


def test_a_hybrid_timeout_raises_past_the_limit_only():
    tp = ManualTransport()
    conn = FerryKVConnector(tp, num_layers=2, load_timeout=2.0)
    conn.start_load_kv([two_layer_request(1, hybrid=True)], now_ns=0)
    assert conn.get_finished(now_ns=2_000_000_000) == set()
    with pytest.raises(ferry.TransferError) as info:
        conn.get_finished(now_ns=2_000_000_001)
    assert info.value.timed_out and info.value.member == 0
    assert tp.cancelled == [] and tp.released == []


def test_an_attention_only_failure_reports_its_blocks_once_and_spares_other_requests():
    tp = ManualTransport()
    conn = FerryKVConnector(tp, num_layers=2, layer_timeout=HANG)
    conn.start_load_kv([two_layer_request(1, hybrid=False), two_layer_request(2, hybrid=False)])
    tp.c(1, 0).succeed()
    tp.c(2, 0).succeed()
    tp.c(2, 1).succeed()
    assert conn.wait_for_layer_load(0).ok
    later(0.02, tp.c(1, 1).fail, Errc.backend_shut_down)
    r = conn.wait_for_layer_load(1)
    assert r.verdict == Verdict.failed and r.error == Errc.backend_shut_down
    assert conn.get_finished() == {1, 2}
    assert conn.get_block_ids_with_load_errors() == {11}
    assert conn.get_block_ids_with_load_errors() == set()
    assert sorted(tp.released) == [1, 2]
    assert conn.get_finished() == set()


def test_a_kda_layer_with_two_statuses_is_done_only_when_both_are():
    tp = ManualTransport(kda_layers={1})
    conn = FerryKVConnector(tp, num_layers=2, layer_timeout=0.05)
    conn.start_load_kv([two_layer_request(1, hybrid=True)])
    tp.c(1, 0).succeed()
    tp.c(1, 1, 0).succeed()  # the attention half of the KDA layer
    assert conn.wait_for_layer_load(1).verdict == Verdict.timed_out
    assert conn.tracker.verdict(1) == ferry.kv.RequestVerdict.pending
    assert conn.get_finished() == set()
    tp.c(1, 1, 1).fail(Errc.abandoned)  # the recurrent-state half, last in the list, fails
    with pytest.raises(ferry.TransferError) as info:
        conn.get_finished()
    assert info.value.layer == 1 and info.value.member == 2


def test_a_kda_layer_succeeds_with_both_statuses():
    tp = ManualTransport(kda_layers={0})
    conn = FerryKVConnector(tp, num_layers=2, layer_timeout=HANG)
    conn.start_load_kv([two_layer_request(1, hybrid=True)])
    for c in tp.completers[(1, 0)] + tp.completers[(1, 1)]:
        c.succeed()
    assert conn.wait_for_layer_load(0).ok and conn.get_finished() == {1}


def test_the_loopback_transport_moves_the_bytes():
    tp = LoopbackTransport(num_layers=2, num_blocks=4, block_bytes=512, kda_layers={1})
    conn = FerryKVConnector(tp, num_layers=2, layer_timeout=HANG)
    conn.start_load_kv([LoadSpec(1, {0: [0, 1], 1: [2]})])
    assert conn.wait_for_layer_load(0).ok and conn.wait_for_layer_load(1).ok
    assert conn.get_finished() == {1}
    assert tp.landed(0, 0) and tp.landed(0, 1) and tp.landed(1, 2) and not tp.landed(1, 3)


def test_the_example_runs():
    assert main() == 0

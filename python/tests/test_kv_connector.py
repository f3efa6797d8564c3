"""The KV connector core from Python (ferry.kv): layouts, plans, the handshake, and pull and push
between two processes over UCX (the producer is python/examples/kv_connector.py's producer role,
in a process of its own), byte-exact; a producer killed mid-push fails the request it owed at once,
not by its timeout; bad input names the function and the argument, each case in its own process."""

import asyncio
import os
import sys
import time

import numpy as np
import pytest

import ferry
import ferry.kv as kv
from bad_input_cases import CaseRunner, check_raised

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import kv_connector as example  # noqa: E402

needs_ucx = pytest.mark.skipif(not ferry.HAS_UCX, reason="ferry was built without ferry.ucx")


# --- Layouts, plans, the handshake (no transport) ---

def small_layout(**kw):
    args = dict(layers=2, blocks=8, block_size=4, total_heads=2, head_size=8,
                region_per_layer=False)
    args.update(kw)
    return kv.CacheLayout.kv_split(**args)


def test_from_array_and_from_strides_match_the_named_constructor():
    cache = np.zeros((2, 8, 4, 2, 8), dtype=np.float16)  # [K/V, blocks, block_size, heads, dim]
    k = kv.TensorLayout.from_array(cache[0], "token_major", base=cache)
    v = kv.TensorLayout.from_array(cache[1], "token_major", base=cache)
    layer = small_layout(layers=1, region_per_layer=True).layers[0]
    assert [k, v] == layer.tensors
    # A framework tensor: element strides (torch's .stride()) times the element size.
    elem_strides = [s // cache.itemsize for s in cache[1].strides]
    assert kv.TensorLayout.from_strides("token_major", cache[1].shape, elem_strides, 2,
                                        cache[1].ctypes.data - cache.ctypes.data) == v
    hm = np.zeros((8, 2, 4, 8), dtype=np.float16)  # [blocks, heads, block_size, dim]
    t = kv.TensorLayout.from_array(hm, "head_major")
    assert (t.heads, t.block_size, t.head_stride, t.token_stride) == (2, 4, 64, 16)


def test_named_constructors_check_and_bytes_needed():
    for make in (kv.CacheLayout.kv_split, kv.CacheLayout.kv_interleaved,
                 kv.CacheLayout.head_major, kv.CacheLayout.cross_layer):
        layout = make(layers=2, blocks=8, block_size=4, total_heads=4, tp_size=2, head_size=8)
        layout.check(kv.TpShard(1, 2))
        assert layout.bytes_needed(0) > 0
    mla = kv.CacheLayout.mla(layers=2, blocks=8, block_size=4, head_size=16)
    assert not mla.layers[0].heads_sharded
    hybrid = small_layout().append(kv.CacheLayout.recurrent_state(
        layers=1, blocks=4, total_heads=2, head_sizes=[3, 5], first_region=2))
    assert hybrid.group_count == 2 and hybrid.region_count == 3
    hybrid.check()


def test_plans_apply_byte_exact_and_expose_ranges():
    src, dst = small_layout(), small_layout(blocks=12)
    planner = kv.TransferPlanner(src, kv.TpShard(0, 1), dst, (0, 1))
    plan = planner.plan([(np.array([3, 4, 5, 1], dtype=np.uint32), [0, 1, 2, 9])])
    assert plan.layer_count == 2 and plan.ranges == sum(len(layer) for layer in plan.layers)
    arr = plan.layer_array(0)
    assert arr.shape == (len(plan.layers[0]), 5) and int(arr[:, 4].sum()) > 0
    assert plan.bytes == 2 * 2 * 4 * (4 * 2 * 8 * 2)  # layers, K/V, blocks, one block's bytes
    a = np.random.default_rng(1).integers(0, 255, src.bytes_needed(0), dtype=np.uint8)
    b = np.zeros(dst.bytes_needed(0), dtype=np.uint8)
    kv.apply_plan(plan, [a], [b])
    blk = 4 * 2 * 8 * 2
    assert bytes(b[9 * blk:10 * blk]) == bytes(a[1 * blk:2 * blk])  # layer 0 K, block 1 -> 9


def test_heterogeneous_tp_sources():
    assert kv.tp_sources(8, True, 2, kv.TpShard(0, 4)) == [(0, 0, 2)]
    assert kv.heads_held(8, kv.TpShard(3, 4)) == (6, 2)
    assert kv.tp_source_ranks(small_layout(total_heads=4, tp_size=1), 2, kv.TpShard(0, 1)) == [0, 1]


def test_errors_compare_with_kv_errc():
    def code(fn):
        with pytest.raises(ferry.FerryError) as e:
            fn()
        return e.value.error

    bad = small_layout()
    layers = bad.layers
    layers[0].tensors = [layers[0].tensors[0], layers[0].tensors[0]]  # K and V overlap
    bad.layers = layers
    assert code(bad.check) == kv.Errc.bad_layout
    assert code(lambda: small_layout().check(kv.TpShard(0, 3))) == kv.Errc.bad_parallelism
    assert code(lambda: kv.TransferPlanner(small_layout(), (0, 1), small_layout(head_size=16),
                                           (0, 1))) == kv.Errc.incompatible_layouts
    planner = kv.TransferPlanner(small_layout(), (0, 1), small_layout(), (0, 1))
    assert code(lambda: planner.plan([([8], [0])])) == kv.Errc.bad_block_table
    plan = planner.plan([([1], [2])])
    assert code(lambda: kv.apply_plan(plan, [bytearray(10)], [bytearray(10)])) == \
        kv.Errc.region_out_of_range
    assert code(lambda: kv.EngineDescription.decode(b"not a description at all")) == \
        kv.Errc.bad_engine_description
    assert kv.Errc.push_failed != kv.Errc.bad_layout


def test_engine_description_round_trips():
    d = kv.EngineDescription("prefill-0", 3, kv.TpShard(0, 1), small_layout(), [b"\x01\x02"])
    back = kv.EngineDescription.decode(d.encode())
    assert back == d and back.regions == [b"\x01\x02"] and back.tp == kv.TpShard(0, 1)
    d.check_compatible(back)
    kv.check_compatible(d.layout, d.tp, back.layout, back.tp)
    with pytest.raises(ferry.FerryError) as e:
        kv.EngineDescription("x", 1, (0, 1), small_layout(), []).encode()  # no region descriptor
    assert e.value.error == kv.Errc.bad_engine_description


# --- Two processes over UCX ---

@needs_ucx
@pytest.mark.parametrize("transports", ["tcp", "shm"])
def test_pull_and_push_between_two_processes_byte_exact(transports):
    assert asyncio.run(example.ucx_session(transports)) == 0


@needs_ucx
@pytest.mark.parametrize("transports", ["tcp", "shm"])
def test_a_producer_killed_mid_push_fails_the_request_not_by_timeout(transports):
    async def run():
        c = example.UcxConnector(transports)
        receiving = asyncio.ensure_future(c.receiver.receive(c.link))
        abort_timeout = 60.0
        await c.push(7, [0, 1, 2], [5, 6, 7], verb="stall", abort_timeout=abort_timeout)
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(None, c.producer.line) == "stalled"
        start = time.monotonic()
        c.producer.proc.kill()
        c.producer.proc.wait(example.HANG)
        finished = await asyncio.wait_for(c.wait_request(7), example.HANG)
        took = time.monotonic() - start
        assert finished.verdict == kv.RequestVerdict.failed, finished
        assert took < abort_timeout / 3, f"failed only after {took:.1f} s"
        assert finished.error is not None
        err = await asyncio.wait_for(receiving, example.HANG)
        assert err is not None and c.receiver.expected == 0
        assert sorted(c.tracker.drain_failed_blocks()) == [5, 6, 7]  # to recompute, once

    asyncio.run(run())


@needs_ucx
def test_an_awaited_task_is_awaited_once():
    async def run():
        ex = ferry.Executor()
        w = ferry.ucx.Worker(ex, transports="tcp")
        peer = ferry.ucx.Worker(ex, transports="tcp")
        region = w.register_memory(bytearray(64))
        link = kv.UcxLink.from_peer_regions(w.connect(peer.address()), [region])
        receiver = kv.PushReceiver()
        task = receiver.receive(link)
        receiving = asyncio.ensure_future(task)
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="awaited already"):
            await task
        link.endpoint.close()
        err = await asyncio.wait_for(receiving, example.HANG)
        assert err is not None  # the closed endpoint's error ends the loop

    asyncio.run(run())


# --- Bad input, each case in its own process ---

PRELUDE = """\
import numpy as np
import ferry, ferry.kv as kv
layout = kv.CacheLayout.kv_split(layers=2, blocks=4, block_size=2, total_heads=2, head_size=8)
planner = kv.TransferPlanner(layout, (0, 1), layout, (0, 1))
plan = planner.plan([([0], [1])])
tr = kv.LoadTracker()
h = tr.add_request(1)
desc = kv.EngineDescription("e", 1, kv.TpShard(0, 1), layout, [b"x"])
"""
UCX = PRELUDE + """\
import ferry.ucx
ex = ferry.Executor()
w = ferry.ucx.Worker(ex, transports="tcp")
peer = ferry.ucx.Worker(ex, transports="tcp")
region = w.register_memory(bytearray(4096))
ep = w.connect(peer.address())
link = kv.UcxLink.from_peer_regions(ep, [region])
pushed = kv.PushedRequest(link, 1, plan, 5)
receiver = kv.PushReceiver()
ledger = kv.ReleaseLedger(lambda i: None)
"""
TE, VE = "TypeError", "ValueError"
CASES = [
    ("kv", "kv.TensorLayout(blocks=-1)", VE, "ferry.kv.TensorLayout: blocks"),
    ("kv", "kv.TensorLayout(region='0')", TE, "ferry.kv.TensorLayout: region"),
    ("kv", "kv.TensorLayout.from_array('x', 'token_major')", TE,
     "ferry.kv.TensorLayout.from_array: array"),
    ("kv", "kv.TensorLayout.from_array(np.zeros((2,2,2,2)), 'bogus')", VE,
     "ferry.kv.TensorLayout.from_array: kind"),
    ("kv", "kv.TensorLayout.from_array(np.zeros((2,2,2,4))[..., ::2], 'token_major')", VE,
     "ferry.kv.TensorLayout.from_array: array"),
    ("kv", "kv.TensorLayout.from_strides('latent', [1, 2], [2, 1], 2, 0)", VE,
     "ferry.kv.TensorLayout.from_strides: shape"),
    ("kv", "kv.TensorLayout.from_strides('latent', [1, 2, 2], None, 2, 0)", TE,
     "ferry.kv.TensorLayout.from_strides: strides"),
    ("kv", "kv.LayerLayout(tensors=[None])", TE, "ferry.kv.LayerLayout: tensors[0]"),
    ("kv", "kv.CacheLayout.kv_split(layers='2', blocks=4)", TE,
     "ferry.kv.CacheLayout.kv_split: layers"),
    ("kv", "kv.CacheLayout.mla(layers=2, blocks=4, region_per_layer=1)", TE,
     "ferry.kv.CacheLayout.mla: region_per_layer"),
    ("kv", "kv.CacheLayout.recurrent_state(layers=1, blocks=1, head_sizes=[-1])", VE,
     "ferry.kv.CacheLayout.recurrent_state: head_sizes[0]"),
    ("kv", "layout.check(tp='x')", TE, "ferry.kv.CacheLayout.check: tp"),
    ("kv", "layout.append(None)", TE, "ferry.kv.CacheLayout.append: more"),
    ("kv", "kv.TransferPlanner(None, (0, 1), layout, (0, 1))", TE, "ferry.kv.TransferPlanner: src"),
    ("kv", "kv.TransferPlanner(layout, 5, layout, (0, 1))", TE,
     "ferry.kv.TransferPlanner: src_tp"),
    ("kv", "planner.plan(None)", TE, "ferry.kv.TransferPlanner.plan: groups"),
    ("kv", "planner.plan([([0], [None])])", TE, "ferry.kv.TransferPlanner.plan: groups[0][1][0]"),
    ("kv", "planner.plan([([-1], [0])])", VE, "ferry.kv.TransferPlanner.plan: groups[0][0][0]"),
    ("kv", "plan.layer_array(2)", VE, "ferry.kv.TransferPlan.layer_array"),
    ("kv", "kv.apply_plan(plan, [bytes(9000)], [bytes(9000)])", TE, "ferry.kv.apply_plan: dst[0]"),
    ("kv", "kv.apply_plan(None, [], [])", TE, "ferry.kv.apply_plan: plan"),
    ("kv", "kv.EngineDescription.decode(42)", TE, "ferry.kv.EngineDescription.decode: data"),
    ("kv", "kv.EngineDescription('e', -1, (0, 1), layout, [])", VE,
     "ferry.kv.EngineDescription: incarnation"),
    ("kv", "kv.EngineDescription('e', 1, (0, 1), None, [])", TE,
     "ferry.kv.EngineDescription: layout"),
    ("kv", "desc.check_compatible(None)", TE, "ferry.kv.EngineDescription.check_compatible: dst"),
    ("kv", "kv.heads_held(4, 'x')", TE, "ferry.kv.heads_held: tp"),
    ("kv", "kv.tp_sources(4, 1, 2, (0, 1))", TE, "ferry.kv.tp_sources: heads_sharded"),
    ("kv", "kv.TpShard(rank=-1)", VE, "ferry.kv.TpShard: rank"),
    ("ucx", "kv.UcxLink(None, [region], desc)", TE, "ferry.kv.UcxLink: endpoint"),
    ("ucx", "kv.UcxLink(ep, [None], desc)", TE, "ferry.kv.UcxLink: local_regions[0]"),
    ("ucx", "kv.UcxLink(ep, [region], None)", TE, "ferry.kv.UcxLink: peer_description"),
    ("ucx", "kv.UcxLink.from_peer_regions(ep, None)", TE,
     "ferry.kv.UcxLink.from_peer_regions: local_regions"),
    ("ucx", "kv.pull(None, plan, layout, [([0], [1])], tr, h)", TE, "ferry.kv.pull: link"),
    ("ucx", "kv.pull(link, plan, layout, [([0], [1])], None, h)", TE, "ferry.kv.pull: tracker"),
    ("ucx", "kv.pull(link, plan, layout, [([0], [1])], tr, 1)", TE, "ferry.kv.pull: request"),
    ("ucx", "kv.pull(link, plan, layout, [([0], [1])], tr, h, 'x')", TE, "ferry.kv.pull: timeout"),
    ("ucx", "kv.release_to(link, 'x')", TE, "ferry.kv.release_to: timeout"),
    ("ucx", "kv.serve_releases(link, None, 0)", TE, "ferry.kv.serve_releases: ledger"),
    ("ucx", "kv.serve_releases(link, ledger, -1)", VE, "ferry.kv.serve_releases: rank"),
    ("ucx", "kv.PushedRequest(link, -1, plan)", VE, "ferry.kv.PushedRequest: request_id"),
    ("ucx", "kv.PushedRequest(link, 2**63, plan)", VE, "ferry.kv.PushedRequest: request_id"),
    ("ucx", "kv.PushedRequest(link, 1, None)", TE, "ferry.kv.PushedRequest: plan"),
    ("ucx", "pushed.layer_computed(2)", VE, "ferry.kv.PushedRequest.layer_computed: layer"),
    ("ucx", "pushed.layer_computed(None)", TE, "ferry.kv.PushedRequest.layer_computed: layer"),
    ("ucx", "receiver.expect(None, h, 1, layout, [([0], [1])])", TE,
     "ferry.kv.PushReceiver.expect: tracker"),
    ("ucx", "receiver.expect(tr, h, 2**63, layout, [([0], [1])])", VE,
     "ferry.kv.PushReceiver.expect: id"),
    ("ucx", "receiver.expect(tr, h, 1, layout, [(0, 1)])", TE,
     "ferry.kv.PushReceiver.expect: groups[0][0]"),
    ("ucx", "receiver.cancel(None)", TE, "ferry.kv.PushReceiver.cancel: transfer"),
    ("ucx", "receiver.receive(None)", TE, "ferry.kv.PushReceiver.receive: link"),
]

RUNNER = CaseRunner(lambda part: UCX if part == "ucx" else PRELUDE,
                    lambda: [(p, e) for p, e, _, _ in CASES if p != "ucx" or ferry.HAS_UCX])


@pytest.mark.parametrize("part,expression,exception,names", CASES, ids=[c[1] for c in CASES])
def test_bad_input_names_the_function_and_the_argument(part, expression, exception, names):
    if part == "ucx" and not ferry.HAS_UCX:
        pytest.skip("ferry was built without ferry.ucx")
    check_raised(RUNNER.result(part, expression), expression, exception, names)

#!/usr/bin/env python3
"""A KV connector's decode side, shaped like vLLM's (KVConnectorBase_V1, worker role), on ferry.

The connector loads each scheduled request's KV cache from the prefill side, layer by layer:

- start_load_kv(requests) posts every layer's reads at the start of a step (one transfer per
  status: a KDA layer posts two, attention and recurrent state);
- wait_for_layer_load(layer) blocks (with the GIL released) on exactly that layer's reads across
  every request of the step, so layer L computes while L+1 ... stream in; ``await
  async_wait_for_layer_load(layer)`` is the same on an asyncio loop;
- get_finished() hands back the requests whose reads are all terminal and tells the producer it
  may free their blocks, once per request and never while a read may still write;
- get_block_ids_with_load_errors() reports the destination blocks whose load failed, each once,
  for the engine to recompute;
- a hybrid request (attention plus recurrent state: no recomputed prefix can repair it) that
  failed or timed out raises ferry.TransferError from get_finished, before anything changed; the
  engine aborts it (abort_request) and it is released once its reads have ended.

The transport is anything with read(request_id, layer, blocks) -> [Transfer, ...],
cancel(transfer) and release(request_id). Run as a script, it uses LoopbackTransport below (copies
in this process, one failure injected with ferry's fault injector); python/tests/test_connector.py
drives it with transfers it completes by hand.

Then, with UCX, the same connector between two processes (ucx_main): a prefill process
(``kv_connector.py producer TRANSPORTS``) and this one (decode), each with a paged cache in a numpy
array registered with its worker and described by a ferry.kv.CacheLayout. They trade
EngineDescriptions (the handshake, as hex lines on the producer's stdin/stdout: the connector's
own side channel), plan with a TransferPlanner and move the blocks both ways:

- pull: the decode side reads with ferry.kv.pull into its LoadTracker; the tracker's release
  (ferry.kv.release_to) tells the producer, whose ``await ferry.kv.serve_releases(...)`` loop
  acknowledges it in its ReleaseLedger, which frees the source blocks;
- push: the producer writes each layer as it is "computed" (PushedRequest.layer_computed), then
  ``await finish()`` notifies; the decode side's PushReceiver (``await receive(link)``) ends the
  request in the tracker.

Both end byte-exact: the decode side checks its cache against the plan applied with memcpy
(ferry.kv.apply_plan) to the producer's (deterministic) contents.
"""

import asyncio
import dataclasses
import sys

import ferry


@dataclasses.dataclass
class LoadSpec:
    """One request to load: its destination blocks per layer, and whether it is hybrid."""

    request_id: int
    blocks: dict  # layer -> [block ids]
    hybrid: bool = False


class FerryKVConnector:
    def __init__(self, transport, num_layers, load_timeout=60.0, layer_timeout=10.0):
        self.transport = transport
        self.num_layers = num_layers
        self.load_timeout = load_timeout
        self.layer_timeout = layer_timeout
        self.released = []  # request ids whose producer was told to free their blocks
        self.tracker = ferry.kv.LoadTracker(self._release, transport.cancel)

    def _release(self, request_id, verdict):
        self.released.append(request_id)
        self.transport.release(request_id)

    # --- Worker-side hooks ---

    def start_load_kv(self, requests, now_ns=None):
        """Posts the reads of every layer of every request in this step."""
        self.tracker.begin_step()
        for spec in requests:
            h = self.tracker.add_request(spec.request_id, hybrid=spec.hybrid,
                                         abort_timeout=self.load_timeout, created_ns=now_ns)
            for layer in range(self.num_layers):
                blocks = spec.blocks.get(layer, [])
                for t in self.transport.read(spec.request_id, layer, blocks):
                    self.tracker.add(h, layer, t, blocks)
            self.tracker.seal(h)

    def wait_for_layer_load(self, layer):
        """Blocks until this layer's reads, across the step's requests, are decided: the moment
        one fails, when the last succeeds, or at layer_timeout. Returns the BatchResult."""
        return self.tracker.wait_layer(layer, self.layer_timeout)

    async def async_wait_for_layer_load(self, layer):
        return await self.tracker.when_layer(layer, self.layer_timeout)

    def get_finished(self, now_ns=None):
        """Requests whose reads are all terminal, released once each. Raises
        ferry.TransferError for a failed or timed-out hybrid request (nothing changed)."""
        return {f.id for f in self.tracker.take_finished(now_ns=now_ns)}

    def get_block_ids_with_load_errors(self):
        """Destination blocks whose load failed, each reported once."""
        return set(self.tracker.drain_failed_blocks())

    def abort_request(self, request_id):
        self.tracker.abort_request(request_id)


class LoopbackTransport:
    """Reads from a 'prefill' arena into a 'decode' arena in this process. Reads named in
    `fail` are wrapped by a fault injector that fails them (after the copy: the destination is
    quiescent when the failure is heard); a KDA layer (in `kda_layers`) posts two reads."""

    def __init__(self, num_layers, num_blocks, block_bytes, fail=(), kda_layers=()):
        self.executor = ferry.Executor()
        self.copies = ferry.Loopback(self.executor)
        self.faults = ferry.testing.FaultInjector(self.executor, failure_rate=1.0)
        self.block_bytes = block_bytes
        self.fail = set(fail)
        self.kda_layers = set(kda_layers)
        size = num_layers * num_blocks * block_bytes
        self.prefill = bytearray((i * 7 + 3) % 251 for i in range(size))
        self.decode = bytearray(size)
        self.num_blocks = num_blocks
        self.released = []

    def _slice(self, arena, layer, block):
        start = (layer * self.num_blocks + block) * self.block_bytes
        return memoryview(arena)[start:start + self.block_bytes]

    def read(self, request_id, layer, blocks):
        parts = 2 if layer in self.kda_layers else 1
        reads = []
        for part in range(parts):
            for block in blocks:
                half = self.block_bytes // parts
                dst = self._slice(self.decode, layer, block)[part * half:(part + 1) * half]
                src = self._slice(self.prefill, layer, block)[part * half:(part + 1) * half]
                t = self.copies.copy(dst, src)
                if (request_id, layer) in self.fail:
                    t = self.faults.wrap(t)
                reads.append(t)
        return reads

    def cancel(self, transfer):
        pass  # loopback copies always end by themselves

    def release(self, request_id):
        self.released.append(request_id)

    def landed(self, layer, block):
        return self._slice(self.decode, layer, block) == self._slice(self.prefill, layer, block)


def main():
    num_layers, num_blocks = 8, 64
    transport = LoopbackTransport(num_layers, num_blocks, block_bytes=4096,
                                  fail={(2, 3), (4, 5)}, kda_layers={6})
    connector = FerryKVConnector(transport, num_layers)
    requests = [
        LoadSpec(1, {layer: [0, 1] for layer in range(num_layers)}),
        LoadSpec(2, {layer: [2, 3] for layer in range(num_layers)}),  # layer 3 fails
        LoadSpec(3, {layer: [4, 5] for layer in range(num_layers)}),
        LoadSpec(4, {layer: [6] for layer in range(num_layers)}, hybrid=True),  # layer 5 fails
    ]
    connector.start_load_kv(requests)
    for layer in range(num_layers):
        r = connector.wait_for_layer_load(layer)
        print(f"layer {layer}: {r.verdict.name}" +
              (f" (member {r.first_failed}: {r.error})" if r.first_failed is not None else ""))
    try:
        connector.get_finished()
        raise AssertionError("the failed hybrid request did not raise")
    except ferry.TransferError as e:
        print(f"hybrid request {e.request} raised: layer {e.layer}: {e.error}")
        assert e.request == 4 and e.layer == 5
        assert connector.released == []  # raised before anything changed
        connector.abort_request(e.request)
    finished = connector.get_finished()
    errors = connector.get_block_ids_with_load_errors()
    print(f"finished: {sorted(finished)}; blocks to recompute: {sorted(errors)}")
    assert finished == {1, 2, 3, 4}
    assert errors == {2, 3}  # request 2's layer-3 blocks; the aborted hybrid request reports none
    assert connector.get_block_ids_with_load_errors() == set()  # reported once
    assert sorted(transport.released) == [1, 2, 3, 4]
    assert all(transport.landed(layer, b) for layer in range(num_layers) for b in (0, 1, 4, 5))

    async def async_step():
        connector.start_load_kv([LoadSpec(5, {layer: [7] for layer in range(num_layers)})])
        for layer in range(num_layers):
            assert (await connector.async_wait_for_layer_load(layer)).ok
        return connector.get_finished()

    assert asyncio.run(async_step()) == {5}
    print("kv connector example: ok")
    return 0


# --- Two processes over UCX ---

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE = 4, 32, 16, 4, 64
HANG = 30.0


def paged_cache(seed=None):
    """A vLLM-style paged cache, [layers, 2 (K, V), blocks, block_size, heads, head_size] fp16, and
    its CacheLayout read from the array itself (TensorLayout.from_array, offsets from the base)."""
    import numpy as np

    shape = (LAYERS, 2, BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE)
    if seed is None:
        cache = np.zeros(shape, dtype=np.float16)
    else:
        raw = np.random.default_rng(seed).integers(0, 1 << 16, size=shape, dtype=np.uint16)
        cache = raw.view(np.float16)
    layers = [ferry.kv.LayerLayout(group=0, total_heads=HEADS, tensors=[
        ferry.kv.TensorLayout.from_array(cache[layer, kv], "token_major", region=0, base=cache)
        for kv in (0, 1)]) for layer in range(LAYERS)]
    layout = ferry.kv.CacheLayout(layers)
    layout.check(ferry.kv.TpShard(0, 1))
    # The same as the named constructor for this layout (one region, layers one after another).
    assert layout == ferry.kv.CacheLayout.kv_split(
        layers=LAYERS, blocks=BLOCKS, block_size=BLOCK_SIZE, total_heads=HEADS,
        head_size=HEAD_SIZE, element_size=2, region_per_layer=False)
    assert layout.bytes_needed(0) == cache.nbytes
    return cache, layout


def describe(engine_id, layout, region):
    return ferry.kv.EngineDescription(engine_id, 1, ferry.kv.TpShard(0, 1), layout,
                                      [region.describe()])


PRODUCER_SEED = 7


def producer(transports):
    """The prefill process. Prints its port and its EngineDescription (hex), reads the consumer's,
    then serves releases while it takes commands on stdin: ``expect ID`` (pull: the ledger waits
    for the consumer's release, printing ``freed ID``), ``push ID SRC DST`` (every layer, then the
    notice; prints ``pushed ok``), ``stall ID SRC DST`` (two layers written, prints ``stalled``,
    then hangs: the parent kills it), ``quit``. SRC and DST: comma-separated block ids."""
    ex = ferry.Executor()
    worker = ferry.ucx.Worker(ex, transports=transports)
    cache, layout = paged_cache(PRODUCER_SEED)
    region = worker.register_memory(cache)
    listener = worker.listen("127.0.0.1", 0, [region])
    print(listener.port, flush=True)
    print(describe("prefill", layout, region).encode().hex(), flush=True)
    consumer = ferry.kv.EngineDescription.decode(bytes.fromhex(sys.stdin.readline()))
    describe("prefill", layout, region).check_compatible(consumer)
    ep = listener.accept(HANG)
    link = ferry.kv.UcxLink.from_peer_regions(ep, [region])
    planner = ferry.kv.TransferPlanner(layout, ferry.kv.TpShard(0, 1), consumer.layout,
                                       consumer.tp)
    ledger = ferry.kv.ReleaseLedger(lambda tid: print(f"freed {tid}", flush=True))

    async def run():
        loop = asyncio.get_running_loop()
        releases = asyncio.ensure_future(ferry.kv.serve_releases(link, ledger, 0))
        while True:
            line = (await loop.run_in_executor(None, sys.stdin.readline)).split()
            if not line or line[0] == "quit":
                break
            verb, rid = line[0], int(line[1])
            if verb == "expect":
                ledger.expect(rid, 1)
                print("expecting", flush=True)
                continue
            src, dst = ([int(b) for b in x.split(",")] for x in line[2:4])
            plan = planner.plan([(src, dst)])
            pushed = ferry.kv.PushedRequest(link, rid, plan, HANG)
            if verb == "stall":
                pushed.layer_computed(0)
                pushed.layer_computed(1)
                await ferry.when_all(pushed.writes, HANG)
                print("stalled", flush=True)
                await asyncio.sleep(3600)
            for layer in range(plan.layer_count):
                pushed.layer_computed(layer)  # as the engine computes each layer
            r = await pushed.finish()
            noticed = await pushed.notice
            print("pushed " + ("ok" if r.ok and noticed == ferry.State.success else "failed"),
                  flush=True)
        ep.close()
        await releases  # ends with the closed endpoint's error
        return 0

    return asyncio.run(run())


class ProducerProcess:
    """The decode side's view of a producer process: its handshake, and its command lines."""

    def __init__(self, transports, layout, region, worker):
        import subprocess

        self.proc = subprocess.Popen([sys.executable, __file__, "producer", transports],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        port = int(self.line())
        self.description = ferry.kv.EngineDescription.decode(bytes.fromhex(self.line()))
        self.send(describe("decode", layout, region).encode().hex())
        ep = worker.connect_to("127.0.0.1", port, [region], HANG)
        self.link = ferry.kv.UcxLink(ep, [region], self.description)

    def send(self, line):
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def line(self):
        out = self.proc.stdout.readline()
        if not out:
            raise RuntimeError("the producer process ended")
        return out.strip()

    def close(self):
        if self.proc.poll() is None:
            self.send("quit")
            self.proc.wait(HANG)
        return self.proc.returncode


def expected_after(plan, cache):
    """What the decode cache must hold after `plan`: the plan applied with memcpy to the
    producer's contents (which are deterministic)."""
    src, _ = paged_cache(PRODUCER_SEED)
    out = cache.copy()
    ferry.kv.apply_plan(plan, [src], [out])
    return out


class UcxConnector:
    """The decode side over UCX: pull and push into one LoadTracker."""

    def __init__(self, transports):
        self.ex = ferry.Executor()
        self.worker = ferry.ucx.Worker(self.ex, transports=transports)
        self.cache, self.layout = paged_cache()
        self.region = self.worker.register_memory(self.cache)
        self.producer = ProducerProcess(transports, self.layout, self.region, self.worker)
        self.link = self.producer.link
        self.planner = ferry.kv.TransferPlanner(
            self.producer.description.layout, self.producer.description.tp, self.layout,
            ferry.kv.TpShard(0, 1))
        self.receiver = ferry.kv.PushReceiver()
        release = ferry.kv.release_to(self.link, HANG)
        self.pulled = set()

        def release_pulled(request_id, verdict):
            if request_id in self.pulled:  # pushed requests need no release
                release(request_id, verdict)

        self.tracker = ferry.kv.LoadTracker(release=release_pulled, cancel=self.receiver.cancel)

    async def wait_request(self, request_id):
        for layer in range(LAYERS):
            await self.tracker.when_layer(layer, HANG)
        (finished,) = self.tracker.take_finished()
        assert finished.id == request_id, finished
        return finished

    async def pull(self, request_id, src, dst):
        plan = self.planner.plan([(src, dst)])
        want = expected_after(plan, self.cache)
        self.producer.send(f"expect {request_id}")
        assert self.producer.line() == "expecting"
        self.pulled.add(request_id)
        self.tracker.begin_step()
        h = self.tracker.add_request(request_id)
        ferry.kv.pull(self.link, plan, self.layout, [(src, dst)], self.tracker, h, HANG)
        self.tracker.seal(h)
        finished = await self.wait_request(request_id)
        assert finished.verdict == ferry.kv.RequestVerdict.success, finished
        assert self.producer.line() == f"freed {request_id}"  # the release reached the ledger
        return plan, want

    async def push(self, request_id, src, dst, verb="push", abort_timeout=60.0):
        import numpy as np

        plan = self.planner.plan([(np.array(src, dtype=np.uint32),
                                   np.array(dst, dtype=np.uint32))])
        want = expected_after(plan, self.cache)
        self.tracker.begin_step()
        h = self.tracker.add_request(request_id, abort_timeout=abort_timeout)
        self.receiver.expect(self.tracker, h, request_id, self.layout, [(src, dst)])
        self.tracker.seal(h)
        self.producer.send(f"{verb} {request_id} {','.join(map(str, src))} "
                           f"{','.join(map(str, dst))}")
        return plan, want

    def close(self):
        return self.producer.close()


async def ucx_session(transports):
    import numpy as np

    c = UcxConnector(transports)
    receiving = asyncio.ensure_future(c.receiver.receive(c.link))
    rng = np.random.default_rng(3)
    # Pull: request 1's 6 blocks, shuffled on both sides.
    src = [int(b) for b in rng.permutation(BLOCKS)[:6]]
    dst = [int(b) for b in rng.permutation(BLOCKS)[:6]]
    _, want = await c.pull(1, src, dst)
    assert np.array_equal(c.cache.view(np.uint16), want.view(np.uint16)), "pull not byte-exact"
    print(f"pull over {transports}: {len(src)} blocks byte-exact, released and freed")
    # Push: request 2's blocks into others.
    src = [int(b) for b in rng.permutation(BLOCKS)[:5]]
    dst = [b for b in range(BLOCKS) if b not in c.tracker.drain_failed_blocks()][10:15]
    _, want = await c.push(2, src, dst)
    finished = await c.wait_request(2)
    assert finished.verdict == ferry.kv.RequestVerdict.success, finished
    assert c.producer.line() == "pushed ok"
    assert np.array_equal(c.cache.view(np.uint16), want.view(np.uint16)), "push not byte-exact"
    print(f"push over {transports}: {len(src)} blocks byte-exact")
    assert c.close() == 0
    err = await receiving  # the producer closed its endpoint: the receive loop ends
    print(f"receive loop ended: {err}")
    assert c.receiver.expected == 0
    return 0


def ucx_main(transports="tcp"):
    if not ferry.HAS_UCX:
        print("kv connector over UCX: skipped (ferry built without UCX)")
        return 0
    return asyncio.run(ucx_session(transports))


if __name__ == "__main__":
    if sys.argv[1:2] == ["producer"]:
        sys.exit(producer(sys.argv[2]))
    rc = main()
    if rc == 0:
        rc = ucx_main()
        if ferry.HAS_UCX:
            print("kv connector over UCX: ok")
    sys.exit(rc)

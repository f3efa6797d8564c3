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


if __name__ == "__main__":
    sys.exit(main())

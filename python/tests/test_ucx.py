"""ferry.ucx from Python, against real UCX over TCP (127.0.0.1): descriptors as bytes, get and put
between two workers, and between two processes."""

import os
import subprocess
import sys

import pytest

import ferry
from conftest import HANG
from peers import BLOCK_BYTES, pattern

State, Verdict = ferry.State, ferry.Verdict
ucx = ferry.ucx
PEERS = os.path.join(os.path.dirname(__file__), "peers.py")


def worker():
    return ucx.Worker(ferry.Executor(), transports="tcp")


def test_get_and_put_between_two_workers_by_address_and_descriptor_bytes():
    a, b = worker(), worker()
    ab = a.connect(b.address())
    target_memory = bytearray(pattern(3))
    target = b.register_memory(target_memory)
    remote = ab.import_region(target.describe())  # bytes, as a connector's side channel carries
    local_memory = bytearray(BLOCK_BYTES)
    local = a.register_memory(local_memory)
    get = ab.get(local.whole(), remote.slice(0, BLOCK_BYTES), HANG)
    assert get.wait(HANG) == State.success and local_memory == pattern(3)
    local_memory[:] = pattern(4)
    puts = ab.put_batch([(local.slice(0, 4096), remote.slice(0, 4096)),
                         (local.slice(4096, 4096), remote.slice(4096, 4096))], HANG)
    assert ferry.wait_all(puts, HANG).ok
    assert target_memory[:8192] == pattern(4)[:8192]
    with pytest.raises(IndexError, match="outside"):
        remote.slice(0, BLOCK_BYTES + 1)
    with pytest.raises(ferry.FerryError) as info:
        ab.import_region(b"not a descriptor at all")
    assert info.value.error == ucx.Errc.bad_descriptor
    mismatch = ab.get(local.slice(0, 8), remote.slice(0, 16))
    assert mismatch.wait(HANG) == State.failed and mismatch.error == ucx.Errc.length_mismatch
    del ab


def test_close_lets_puts_out_end_and_refuses_later_ones_and_close_timeout_is_checked():
    a, b = ucx.Worker(ferry.Executor(), transports="tcp", close_timeout=2.0), worker()
    ab = a.connect(b.address())
    target_memory = bytearray(BLOCK_BYTES)
    remote = ab.import_region(b.register_memory(target_memory).describe())
    local = a.register_memory(bytearray(pattern(5)))
    put = ab.put(local.whole(), remote.slice(0, BLOCK_BYTES), HANG)
    ab.close()
    assert put.wait(HANG) == State.success and target_memory == pattern(5)
    after = ab.put(local.whole(), remote.slice(0, BLOCK_BYTES), HANG)
    assert after.wait(HANG) == State.failed and after.error == ucx.Errc.endpoint_closed
    with pytest.raises(ValueError, match="close_timeout"):
        ucx.Worker(ferry.Executor(), transports="tcp", close_timeout=-1.0)


def test_a_transfer_keeps_its_region_and_buffer_alive():
    a, b = worker(), worker()
    ab = a.connect(b.address())
    target = b.allocate(BLOCK_BYTES)
    memoryview(target)[:] = pattern(9)
    remote = ab.import_region(target.describe())
    t = ab.get(a.register_memory(bytearray(BLOCK_BYTES)).whole(), remote.slice(0, BLOCK_BYTES))
    assert t.wait(HANG) == State.success  # the region (and its bytearray) lived on in t


def test_put_and_notification_between_two_processes_by_host_and_port():
    peer = subprocess.Popen([sys.executable, PEERS, "ucx_target"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        port = int(peer.stdout.readline())
        w = worker()
        mine = bytearray(BLOCK_BYTES)
        region = w.register_memory(mine)
        ep = w.connect_to("127.0.0.1", port, [region], HANG)
        (theirs,) = ep.peer_regions()
        assert theirs.length == BLOCK_BYTES
        got = ep.get(region.whole(), theirs.slice(0, BLOCK_BYTES), HANG)
        assert got.wait(HANG) == State.success and mine == pattern(0)
        mine[:] = pattern(1)
        put = ep.put(region.whole(), theirs.slice(0, BLOCK_BYTES), HANG)
        note = ep.send_notification(42, HANG)
        assert ferry.wait_all([put, note], HANG).ok
        assert peer.stdout.readline().strip() == "landed"
        peer.stdin.write("done\n")
        peer.stdin.flush()
        assert peer.wait(HANG) == 0
        del ep
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait(HANG)


def test_get_between_two_processes_by_address_bytes():
    peer = subprocess.Popen([sys.executable, PEERS, "ucx_by_address"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        address = bytes.fromhex(peer.stdout.readline().strip())
        descriptor = bytes.fromhex(peer.stdout.readline().strip())
        w = worker()
        ep = w.connect(address)
        remote = ep.import_region(descriptor)
        dst = bytearray(BLOCK_BYTES)
        t = ep.get(w.register_memory(dst).whole(), remote.slice(0, BLOCK_BYTES), HANG)
        assert t.wait(HANG) == State.success and dst == pattern(5)
        del ep
        peer.stdin.write("done\n")
        peer.stdin.flush()
        assert peer.wait(HANG) == 0
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait(HANG)

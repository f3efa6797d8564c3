"""ferry.uring from Python: file reads and writes at offsets, and framed blocks over TCP
(127.0.0.1), in one process and between two."""

import asyncio
import os
import subprocess
import sys
import tempfile

import pytest

import ferry
from conftest import HANG
from peers import BLOCK_BYTES, BLOCKS, pattern

State, Verdict = ferry.State, ferry.Verdict
uring = ferry.uring


@pytest.fixture
def ring(executor):
    return uring.Ring(executor)


def test_file_writes_and_reads_at_offsets(ring):
    with tempfile.TemporaryFile() as f:
        data = bytearray(os.urandom(1 << 16))
        w = ring.write(f.fileno(), data, 4096)
        assert w.wait(HANG) == State.success and w.transferred == len(data)
        back = bytearray(len(data))
        r = ring.read(f.fileno(), back, 4096)
        assert r.wait(HANG) == State.success and r.transferred == len(data)
        assert back == data
        reads = ring.read_batch(f.fileno(), [(bytearray(4096), 4096 * (i + 1)) for i in range(8)])
        assert ferry.wait_all(reads, HANG).ok


def test_a_read_past_the_end_fails_naming_end_of_file(ring):
    with tempfile.TemporaryFile() as f:
        os.write(f.fileno(), b"short")
        dst = bytearray(64)
        t = ring.read(f.fileno(), dst, 0)
        assert t.wait(HANG) == State.failed
        assert t.error == uring.Errc.end_of_file and t.transferred == 5
        assert dst[:5] == b"short"


def test_batched_reads_report_transferred_as_single_reads_do(ring):
    with tempfile.TemporaryFile() as f:
        os.write(f.fileno(), b"0123456789")
        dsts = [bytearray(4), bytearray(4), bytearray(8), bytearray(0)]
        reads = ring.read_batch(f.fileno(), list(zip(dsts, [0, 4, 6, 0])))
        assert ferry.drain(reads, HANG).pending == 0
        assert [t.state for t in reads] == [State.success, State.success, State.failed,
                                            State.failed]
        assert [t.transferred for t in reads] == [4, 4, 4, 0]
        assert reads[2].error == uring.Errc.end_of_file
        assert reads[3].error == ferry.Errc.empty_buffer
        assert dsts[0] == b"0123" and dsts[1] == b"4567" and dsts[2][:4] == b"6789"
        single = ring.read(f.fileno(), bytearray(8), 6)
        assert single.wait(HANG) == State.failed and single.transferred == reads[2].transferred


def test_a_cancelled_pipe_read_ends_cancelled_and_its_buffer_is_released(ring):
    rfd, wfd = os.pipe()
    try:
        t = ring.read(rfd, bytearray(16), uring.CURRENT_POSITION)
        assert t.wait(0.05) == State.pending
        ring.cancel(t)
        assert t.wait(HANG) == State.cancelled and t.error == ferry.Errc.cancelled
    finally:
        os.close(rfd)
        os.close(wfd)


def test_tcp_blocks_in_one_process_awaited_on_asyncio(ring):
    listener = uring.TcpListener("127.0.0.1", 0)
    import threading

    accepted = {}
    th = threading.Thread(target=lambda: accepted.setdefault("c", listener.accept(ring)))
    th.start()
    client = uring.TcpConnection.connect(ring, "127.0.0.1", listener.port)
    th.join(HANG)
    server = accepted["c"]

    async def main():
        dsts = [bytearray(BLOCK_BYTES) for _ in range(4)]
        recvs = [server.receive(d) for d in dsts]
        sends = [client.send(i, pattern(i)) for i in range(4)]
        r = await ferry.when_all(recvs + sends, HANG)
        return r, recvs, dsts

    r, recvs, dsts = asyncio.run(main())
    assert r.ok
    assert [t.received for t in recvs] == [(i, BLOCK_BYTES) for i in range(4)]
    assert all(dsts[i] == pattern(i) for i in range(4))
    small = server.receive(bytearray(8))
    client.send(9, b"x" * 64)
    assert small.wait(HANG) == State.failed and small.error == uring.Errc.block_too_large
    client.close()
    server.close()


def test_tcp_between_two_processes():
    executor = ferry.Executor()
    ring = uring.Ring(executor)
    listener = uring.TcpListener("127.0.0.1", 0)
    peer = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "peers.py"),
                             "tcp_sender", str(listener.port)])
    try:
        conn = listener.accept(ring)
        dsts = [bytearray(BLOCK_BYTES) for _ in range(BLOCKS)]
        recvs = [conn.receive(d) for d in dsts]
        r = ferry.wait_all(recvs, HANG)
        assert r.ok, r
        assert [t.received[0] for t in recvs] == list(range(BLOCKS))
        assert all(dsts[b] == pattern(b) for b in range(BLOCKS))
        assert conn.send(999, b"ack").wait(HANG) == State.success
        assert peer.wait(HANG) == 0
        # The peer closed: a receive now fails instead of waiting.
        t = conn.receive(bytearray(16))
        assert t.wait(HANG) == State.failed
        conn.close()
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait(HANG)

"""The other process of the two-process tests (test_uring.py, test_ucx.py): run as
``python peers.py ROLE ARGS...``. Each role prints what the parent needs on stdout, one line at a
time, and exits 0 only if everything it checked held."""

import sys

import ferry

BLOCKS, BLOCK_BYTES = 32, 64 * 1024
HANG = 30.0


def pattern(block, n=BLOCK_BYTES):
    return bytes((block * 31 + i) % 256 for i in range(n))


def tcp_sender(port):
    # Connects, sends BLOCKS framed blocks, then waits for the parent's one-block acknowledgement.
    ex = ferry.Executor()
    ring = ferry.uring.Ring(ex)
    conn = ferry.uring.TcpConnection.connect(ring, "127.0.0.1", int(port))
    sends = [conn.send(b, pattern(b)) for b in range(BLOCKS)]
    assert ferry.wait_all(sends, HANG).ok, ferry.poll_all(sends)
    ack = bytearray(16)
    t = conn.receive(ack)
    assert t.wait(HANG) == ferry.State.success, t
    assert t.received == (999, 3) and ack[:3] == b"ack"
    conn.close()
    return 0


def ucx_target():
    # Listens exposing a region holding pattern(0); the parent gets it, puts pattern(1) over it
    # and notifies; the region must then hold pattern(1).
    ex = ferry.Executor()
    w = ferry.ucx.Worker(ex, transports="tcp")
    memory = bytearray(pattern(0))
    region = w.register_memory(memory)
    listener = w.listen("127.0.0.1", 0, [region])
    print(listener.port, flush=True)
    ep = listener.accept(HANG)
    note = ep.receive_notification(HANG)
    assert note.wait(HANG) == ferry.State.success, note
    assert note.value == 42
    assert bytes(memory) == pattern(1), "the parent's put had not landed when notified"
    print("landed", flush=True)
    sys.stdin.readline()
    return 0


def ucx_by_address():
    # Prints its worker address and a region's descriptor as hex (the connector's own side
    # channel), then waits for the parent to say it is done.
    ex = ferry.Executor()
    w = ferry.ucx.Worker(ex, transports="tcp")
    region = w.allocate(BLOCK_BYTES)
    memoryview(region)[:] = pattern(5)
    print(w.address().hex(), flush=True)
    print(region.describe().hex(), flush=True)
    sys.stdin.readline()
    return 0


if __name__ == "__main__":
    role, *args = sys.argv[1:]
    sys.exit({"tcp_sender": tcp_sender, "ucx_target": ucx_target,
              "ucx_by_address": ucx_by_address}[role](*args))

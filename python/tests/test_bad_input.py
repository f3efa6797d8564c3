# Bad input to every public function and constructor: a TypeError (wrong type, None where an object
# is needed) or a ValueError (out of range) whose message names the function and the argument,
# never a crash and never pybind11's "Unable to cast Python instance of type ...".
#
# Each case runs in a process of its own, so that a crash fails its test instead of ending the whole
# run. The processes are started together, a few at a time, the first time a test asks for its
# result; each test then checks its own case's.
import pytest

import ferry
from bad_input_cases import CaseRunner, check_raised, said_by

CORE = """\
import ferry, ferry.kv, ferry.testing
ex = ferry.Executor()
lb = ferry.Loopback(ex)
t, c = ferry.make_manual_transfer()
buf = bytearray(16)
"""

PRELUDES = {
    "core": CORE,
    "kv": CORE + """\
tr = ferry.kv.LoadTracker()
h = tr.add_request(1)
ledger = ferry.kv.ReleaseLedger(lambda i: None)
layout = ferry.kv.CacheLayout.kv_split(layers=2, blocks=4, block_size=2, total_heads=2, head_size=8)
planner = ferry.kv.TransferPlanner(layout, (0, 1), layout, (0, 1))
plan = planner.plan([([0], [1])])
desc = ferry.kv.EngineDescription("e", 1, (0, 1), layout, [b"x"])
""",
    "uring": CORE + """\
import tempfile, ferry.uring
ring = ferry.uring.Ring(ex)
f = tempfile.TemporaryFile()
fd = f.fileno()
listener = ferry.uring.TcpListener()
conn = ferry.uring.TcpConnection.connect(ring, "127.0.0.1", listener.port)
""",
    # One get first: the endpoint's wire-up is over before the case runs and the process exits
    # (UCX once aborted in ucp_worker_destroy on a wire-up message still pending at exit).
    "ucx": CORE + """\
import ferry.ucx
w = ferry.ucx.Worker(ex, transports="tcp")
peer = ferry.ucx.Worker(ex, transports="tcp")
ep = w.connect(peer.address())
region = w.register_memory(bytearray(64))
ls = region.slice(0, 8)
peer_region = peer.register_memory(bytearray(64))
remote = ep.import_region(peer_region.describe())
rs = remote.slice(0, 8)
assert ep.get(ls, rs, 60).wait(60) == ferry.State.success
layout = ferry.kv.CacheLayout.kv_split(layers=2, blocks=4, block_size=2, total_heads=2, head_size=8)
plan = ferry.kv.TransferPlanner(layout, (0, 1), layout, (0, 1)).plan([([0], [1])])
link = ferry.kv.UcxLink.from_peer_regions(ep, [region])
pushed = ferry.kv.PushedRequest(link, 1, plan, 5)
receiver = ferry.kv.PushReceiver()
import ferry.directory
named_dir = ferry.directory.LocalDirectory(ex, registry=ferry.directory.LocalRegistry())
named_pub = named_dir.publish("x", b"v").get(5)
named = ferry.ucx.NamedPeer(named_dir, "x", lambda record: ep)
""",
    # A watch with an event waiting, so that its next() ends at once.
    "directory": CORE + """\
import ferry.directory as fd
reg = fd.LocalRegistry()
d = fd.LocalDirectory(ex, registry=reg)
w = d.watch("x")
pub = d.publish("x", b"v").get(5)
""",
}

TE, VE = "TypeError", "ValueError"

# (part, expression, exception, what its message names besides the function)
CASES = [
    # ferry.Error, Transfer, Completer, make_completed_transfer
    ("core", "ferry.Error('x')", TE, "ferry.Error: code"),
    ("core", "ferry.Error(-1)", VE, "ferry.Error: code"),
    ("core", "ferry.Error(2**40)", VE, "ferry.Error: code"),
    ("core", "t.wait('1')", TE, "ferry.Transfer.wait: timeout"),
    ("core", "t.wait(float('nan'))", VE, "ferry.Transfer.wait: timeout"),
    ("core", "c.fail('bad')", TE, "ferry.Completer.fail: error"),
    ("core", "c.fail(-1)", VE, "ferry.Completer.fail: error"),
    ("core", "ferry.make_completed_transfer(None)", TE, "ferry.make_completed_transfer: state"),
    ("core", "ferry.make_completed_transfer(2)", TE, "ferry.make_completed_transfer: state"),
    ("core", "ferry.make_completed_transfer(ferry.State.failed, 'x')", TE,
     "ferry.make_completed_transfer: error"),
    # Batches and their waits
    ("core", "ferry.Batch(None)", TE, "ferry.Batch: transfers"),
    ("core", "ferry.Batch([t, None])", TE, "ferry.Batch: transfers[1]"),
    ("core", "ferry.Batch([t])['0']", TE, "ferry.Batch.__getitem__: index"),
    ("core", "ferry.Batch([t])[2**70]", VE, "ferry.Batch.__getitem__: index"),
    ("core", "ferry.poll_all(None)", TE, "ferry.poll_all: transfers"),
    ("core", "ferry.poll_all(5)", TE, "ferry.poll_all: transfers"),
    ("core", "ferry.wait_all(None)", TE, "ferry.wait_all: transfers"),
    ("core", "ferry.wait_all([t], '1s')", TE, "ferry.wait_all: timeout"),
    ("core", "ferry.drain([1])", TE, "ferry.drain: transfers[0]"),
    ("core", "ferry.drain([t], float('nan'))", VE, "ferry.drain: timeout"),
    ("core", "ferry.when_all(None)", TE, "ferry.when_all: transfers"),
    ("core", "ferry.when_all([None])", TE, "ferry.when_all: transfers[0]"),
    ("core", "ferry.when_all([t], '1s')", TE, "ferry.when_all: timeout"),
    # Executor
    ("core", "ferry.Executor(mode=None)", TE, "ferry.Executor: mode"),
    ("core", "ferry.Executor(mode='fast')", VE, "ferry.Executor: mode"),
    ("core", "ferry.Executor(spin_budget='1')", TE, "ferry.Executor: spin_budget"),
    ("core", "ferry.Executor(in_flight_spin=-1.0)", VE, "ferry.Executor: negative in_flight_spin"),
    ("core", "ferry.Executor(poll_budget=-1)", VE, "ferry.Executor: poll_budget"),
    ("core", "ferry.Executor(poll_budget=0)", VE, "ferry.Executor: poll_budget"),
    ("core", "ferry.Executor(poll_budget=2.5)", TE, "ferry.Executor: poll_budget"),
    ("core", "ferry.Executor(poll_budget=None)", TE, "ferry.Executor: poll_budget"),
    ("core", "ferry.Executor(cpu=-2)", VE, "ferry.Executor: cpu"),
    ("core", "ferry.Executor(cpu='0')", TE, "ferry.Executor: cpu"),
    # Loopback
    ("core", "ferry.Loopback(None)", TE, "ferry.Loopback: executor"),
    ("core", "ferry.Loopback(42)", TE, "ferry.Loopback: executor"),
    ("core", "ferry.Loopback(ex, queue_depth=-1)", VE, "ferry.Loopback: queue_depth"),
    ("core", "ferry.Loopback(ex, queue_depth=None)", TE, "ferry.Loopback: queue_depth"),
    ("core", "lb.copy(None, buf)", TE, "ferry.Loopback.copy: dst"),
    ("core", "lb.copy(buf, None)", TE, "ferry.Loopback.copy: src"),
    ("core", "lb.copy(b'read-only', buf)", TE, "ferry.Loopback.copy: dst"),
    ("core", "lb.copy(memoryview(bytearray(16))[::2], buf)", TE, "ferry.Loopback.copy: dst"),
    ("core", "lb.copy(buf, bytearray(16), -1)", VE, "ferry.Loopback.copy: nbytes"),
    ("core", "lb.copy(buf, bytearray(16), '8')", TE, "ferry.Loopback.copy: nbytes"),
    ("core", "lb.copy(buf, bytearray(16), 8.0)", TE, "ferry.Loopback.copy: nbytes"),
    ("core", "lb.copy(buf, bytearray(16), 2**64)", VE, "ferry.Loopback.copy: nbytes"),
    ("core", "ferry._ferry._bench_cpp(None, 'wait_all', 1, 1, 1)", TE,
     "ferry._bench_cpp: executor"),
    ("core", "ferry._ferry._bench_cpp(ex, 'wait_all', -1, 1, 1)", VE, "ferry._bench_cpp: rounds"),
    # ferry.testing
    ("core", "ferry.testing.FaultInjector(None)", TE, "ferry.testing.FaultInjector: executor"),
    ("core", "ferry.testing.FaultInjector(ex, failure_rate=None)", TE,
     "ferry.testing.FaultInjector: failure_rate"),
    ("core", "ferry.testing.FaultInjector(ex, hang_rate=-0.1)", VE,
     "ferry.testing.FaultInjector: hang_rate"),
    ("core", "ferry.testing.FaultInjector(ex, delay_rate='0.5')", TE,
     "ferry.testing.FaultInjector: delay_rate"),
    ("core", "ferry.testing.FaultInjector(ex, max_delay=None)", TE,
     "ferry.testing.FaultInjector: max_delay"),
    ("core", "ferry.testing.FaultInjector(ex, reorder_window=-1)", VE,
     "ferry.testing.FaultInjector: reorder_window"),
    ("core", "ferry.testing.FaultInjector(ex, reorder_hold='1')", TE,
     "ferry.testing.FaultInjector: reorder_hold"),
    ("core", "ferry.testing.FaultInjector(ex, error='x')", TE,
     "ferry.testing.FaultInjector: error"),
    ("core", "ferry.testing.FaultInjector(ex, seed=-1)", VE, "ferry.testing.FaultInjector: seed"),
    ("core", "ferry.testing.FaultInjector(ex, seed=None)", TE, "ferry.testing.FaultInjector: seed"),
    ("core", "ferry.testing.FaultInjector(ex).wrap(None)", TE,
     "ferry.testing.FaultInjector.wrap: transfer"),
    # ferry.kv.LoadTracker
    ("kv", "ferry.kv.LoadTracker(release=42)", TE, "ferry.kv.LoadTracker: release"),
    ("kv", "ferry.kv.LoadTracker(cancel='no')", TE, "ferry.kv.LoadTracker: cancel"),
    ("kv", "tr.add_request(None)", TE, "ferry.kv.LoadTracker.add_request: id"),
    ("kv", "tr.add_request(-2)", VE, "ferry.kv.LoadTracker.add_request: id"),
    ("kv", "tr.add_request('2')", TE, "ferry.kv.LoadTracker.add_request: id"),
    ("kv", "tr.add_request(2, hybrid=None)", TE, "ferry.kv.LoadTracker.add_request: hybrid"),
    ("kv", "tr.add_request(2, abort_timeout='1')", TE,
     "ferry.kv.LoadTracker.add_request: abort_timeout"),
    ("kv", "tr.add_request(2, admission_timeout=float('nan'))", VE,
     "ferry.kv.LoadTracker.add_request: admission_timeout"),
    ("kv", "tr.add_request(2, created_ns=1.5)", TE, "ferry.kv.LoadTracker.add_request: created_ns"),
    ("kv", "tr.add_request(2, created_ns=-1)", VE, "ferry.kv.LoadTracker.add_request: created_ns"),
    ("kv", "tr.add(None, 0, t, [1])", TE, "ferry.kv.LoadTracker.add: handle"),
    ("kv", "tr.add(h, -1, t, [1])", VE, "ferry.kv.LoadTracker.add: layer"),
    ("kv", "tr.add(h, None, t, [1])", TE, "ferry.kv.LoadTracker.add: layer"),
    ("kv", "tr.add(h, 0, None, [1])", TE, "ferry.kv.LoadTracker.add: transfer"),
    ("kv", "tr.add(h, 0, t, None)", TE, "ferry.kv.LoadTracker.add: blocks"),
    ("kv", "tr.add(h, 0, t, [1, 'x'])", TE, "ferry.kv.LoadTracker.add: blocks[1]"),
    ("kv", "tr.add(h, 0, t, [1.5])", TE, "ferry.kv.LoadTracker.add: blocks[0]"),
    ("kv", "tr.add(h, 0, t, [-1])", VE, "ferry.kv.LoadTracker.add: blocks[0]"),
    ("kv", "tr.post(None, 0, [1], lambda: t)", TE, "ferry.kv.LoadTracker.post: handle"),
    ("kv", "tr.post(h, '0', [1], lambda: t)", TE, "ferry.kv.LoadTracker.post: layer"),
    ("kv", "tr.post(h, 0, None, lambda: t)", TE, "ferry.kv.LoadTracker.post: blocks"),
    ("kv", "tr.post(h, 0, [1], None)", TE, "ferry.kv.LoadTracker.post: submit"),
    ("kv", "tr.post(h, 0, [1], lambda: 5)", TE, "ferry.kv.LoadTracker.post: what submit() returns"),
    ("kv", "tr.seal(None)", TE, "ferry.kv.LoadTracker.seal: handle"),
    ("kv", "tr.abort_request(None)", TE, "ferry.kv.LoadTracker.abort_request: id"),
    ("kv", "tr.abort_request(-1)", VE, "ferry.kv.LoadTracker.abort_request: id"),
    ("kv", "tr.verdict(None)", TE, "ferry.kv.LoadTracker.verdict: id"),
    ("kv", "tr.verdict(1, now_ns='now')", TE, "ferry.kv.LoadTracker.verdict: now_ns"),
    ("kv", "tr.layer_transfers(None)", TE, "ferry.kv.LoadTracker.layer_transfers: layer"),
    ("kv", "tr.layer_transfers(-1)", VE, "ferry.kv.LoadTracker.layer_transfers: layer"),
    ("kv", "tr.wait_layer(-1)", VE, "ferry.kv.LoadTracker.wait_layer: layer"),
    ("kv", "tr.wait_layer(0, '1s')", TE, "ferry.kv.LoadTracker.wait_layer: timeout"),
    ("kv", "tr.when_layer(None)", TE, "ferry.kv.LoadTracker.when_layer: layer"),
    ("kv", "tr.when_layer(0, '1s')", TE, "ferry.kv.LoadTracker.when_layer: timeout"),
    ("kv", "tr.drain_step('1s')", TE, "ferry.kv.LoadTracker.drain_step: timeout"),
    ("kv", "tr.take_finished('now')", TE, "ferry.kv.LoadTracker.take_finished: now_ns"),
    ("kv", "tr.take_finished(-5)", VE, "ferry.kv.LoadTracker.take_finished: now_ns"),
    ("kv", "tr.tracks(None)", TE, "ferry.kv.LoadTracker.tracks: id"),
    # ferry.kv.ReleaseLedger
    ("kv", "ferry.kv.ReleaseLedger(None)", TE, "ferry.kv.ReleaseLedger: free"),
    ("kv", "ferry.kv.ReleaseLedger(print, early_capacity=-1)", VE,
     "ferry.kv.ReleaseLedger: early_capacity"),
    ("kv", "ferry.kv.ReleaseLedger(print, finished_capacity=None)", TE,
     "ferry.kv.ReleaseLedger: finished_capacity"),
    ("kv", "ledger.expect(None, 1)", TE, "ferry.kv.ReleaseLedger.expect: id"),
    ("kv", "ledger.expect(1, -1)", VE, "ferry.kv.ReleaseLedger.expect: consumers"),
    ("kv", "ledger.expect(1, 2**32)", VE, "ferry.kv.ReleaseLedger.expect: consumers"),
    ("kv", "ledger.acknowledge(-1, 0)", VE, "ferry.kv.ReleaseLedger.acknowledge: id"),
    ("kv", "ledger.acknowledge(1, None)", TE, "ferry.kv.ReleaseLedger.acknowledge: rank"),
    # ferry.uring
    ("uring", "ferry.uring.Ring(None)", TE, "ferry.uring.Ring: executor"),
    ("uring", "ferry.uring.Ring(ex, entries=0)", VE, "ferry.uring.Ring: entries"),
    ("uring", "ferry.uring.Ring(ex, entries=-1)", VE, "ferry.uring.Ring: entries"),
    ("uring", "ferry.uring.Ring(ex, entries='8')", TE, "ferry.uring.Ring: entries"),
    ("uring", "ferry.uring.Ring(ex, submit_batch=None)", TE, "ferry.uring.Ring: submit_batch"),
    ("uring", "ferry.uring.Ring(ex, defer_task_work=None)", TE,
     "ferry.uring.Ring: defer_task_work"),
    ("uring", "ring.read(None, buf, 0)", TE, "ferry.uring.Ring.read: fd"),
    ("uring", "ring.read(-1, buf, 0)", VE, "ferry.uring.Ring.read: fd"),
    ("uring", "ring.read(fd, None, 0)", TE, "ferry.uring.Ring.read: dst"),
    ("uring", "ring.read(fd, b'read-only', 0)", TE, "ferry.uring.Ring.read: dst"),
    ("uring", "ring.read(fd, buf, -1)", VE, "ferry.uring.Ring.read: offset"),
    ("uring", "ring.read(fd, buf, None)", TE, "ferry.uring.Ring.read: offset"),
    ("uring", "ring.read(fd, buf, 2**64)", VE, "ferry.uring.Ring.read: offset"),
    ("uring", "ring.write(fd, None, 0)", TE, "ferry.uring.Ring.write: src"),
    ("uring", "ring.write(fd, buf, '0')", TE, "ferry.uring.Ring.write: offset"),
    ("uring", "ring.read_batch(None, [])", TE, "ferry.uring.Ring.read_batch: fd"),
    ("uring", "ring.read_batch(fd, None)", TE, "ferry.uring.Ring.read_batch: blocks"),
    ("uring", "ring.read_batch(fd, [None])", TE, "ferry.uring.Ring.read_batch: blocks[0]"),
    ("uring", "ring.read_batch(fd, [(buf, 0), (buf,)])", TE,
     "ferry.uring.Ring.read_batch: blocks[1]"),
    ("uring", "ring.read_batch(fd, [(buf, -1)])", VE,
     "ferry.uring.Ring.read_batch: blocks[0] offset"),
    ("uring", "ring.read_batch(fd, [(b'read-only', 0)])", TE,
     "ferry.uring.Ring.read_batch: blocks[0] dst"),
    ("uring", "ring.cancel(None)", TE, "ferry.uring.Ring.cancel: transfer"),
    ("uring", "ferry.uring.TcpConnection.connect(None, '127.0.0.1', listener.port)", TE,
     "ferry.uring.TcpConnection.connect: ring"),
    ("uring", "ferry.uring.TcpConnection.connect(ring, None, listener.port)", TE,
     "ferry.uring.TcpConnection.connect: host"),
    ("uring", "ferry.uring.TcpConnection.connect(ring, '127.0.0.1', -1)", VE,
     "ferry.uring.TcpConnection.connect: port"),
    ("uring", "ferry.uring.TcpConnection.connect(ring, '127.0.0.1', 70000)", VE,
     "ferry.uring.TcpConnection.connect: port"),
    ("uring", "ferry.uring.TcpConnection.connect(ring, '127.0.0.1', listener.port, send_buffer=-1)",
     VE, "ferry.uring.TcpConnection.connect: send_buffer"),
    ("uring", "conn.send(-1, b'x')", VE, "ferry.uring.TcpConnection.send: block_id"),
    ("uring", "conn.send(1, None)", TE, "ferry.uring.TcpConnection.send: payload"),
    ("uring", "conn.receive(None)", TE, "ferry.uring.TcpConnection.receive: dst"),
    ("uring", "conn.receive(b'read-only')", TE, "ferry.uring.TcpConnection.receive: dst"),
    ("uring", "ferry.uring.TcpListener(address=None)", TE, "ferry.uring.TcpListener: address"),
    ("uring", "ferry.uring.TcpListener(port=-1)", VE, "ferry.uring.TcpListener: port"),
    ("uring", "ferry.uring.TcpListener(backlog=-1)", VE, "ferry.uring.TcpListener: backlog"),
    ("uring", "ferry.uring.TcpListener(receive_buffer='big')", TE,
     "ferry.uring.TcpListener: receive_buffer"),
    ("uring", "listener.accept(None)", TE, "ferry.uring.TcpListener.accept: ring"),
    # ferry.ucx
    ("ucx", "ferry.ucx.Worker(None)", TE, "ferry.ucx.Worker: executor"),
    ("ucx", "ferry.ucx.Worker(ex, transports=None)", TE, "ferry.ucx.Worker: transports"),
    ("ucx", "ferry.ucx.Worker(ex, devices=None)", TE, "ferry.ucx.Worker: devices"),
    ("ucx", "ferry.ucx.Worker(ex, peer_error_handling=None)", TE,
     "ferry.ucx.Worker: peer_error_handling"),
    ("ucx", "ferry.ucx.Worker(ex, keepalive='1s')", TE, "ferry.ucx.Worker: keepalive"),
    ("ucx", "ferry.ucx.Worker(ex, settings=[('UCX_TLS', 'tcp')])", TE,
     "ferry.ucx.Worker: settings"),
    ("ucx", "ferry.ucx.Worker(ex, settings={'UCX_TLS': None})", TE,
     "ferry.ucx.Worker: settings['UCX_TLS']"),
    ("ucx", "ferry.ucx.Worker(ex, close_timeout=-1.0)", VE,
     "ferry.ucx.Worker: negative close_timeout"),
    ("ucx", "w.register_memory(None)", TE, "ferry.ucx.Worker.register_memory: buffer"),
    ("ucx", "w.register_memory(b'read-only')", TE, "ferry.ucx.Worker.register_memory: buffer"),
    ("ucx", "w.allocate(-1)", VE, "ferry.ucx.Worker.allocate: nbytes"),
    ("ucx", "w.allocate(0)", VE, "ferry.ucx.Worker.allocate: nbytes"),
    ("ucx", "w.allocate(None)", TE, "ferry.ucx.Worker.allocate: nbytes"),
    ("ucx", "w.connect(None)", TE, "ferry.ucx.Worker.connect: address"),
    ("ucx", "w.connect_to(None, 1)", TE, "ferry.ucx.Worker.connect_to: host"),
    ("ucx", "w.connect_to('127.0.0.1', -1)", VE, "ferry.ucx.Worker.connect_to: port"),
    ("ucx", "w.connect_to('127.0.0.1', 1, expose=5)", TE, "ferry.ucx.Worker.connect_to: expose"),
    ("ucx", "w.connect_to('127.0.0.1', 1, expose=[None])", TE,
     "ferry.ucx.Worker.connect_to: expose[0]"),
    ("ucx", "w.connect_to('127.0.0.1', 1, timeout='1s')", TE,
     "ferry.ucx.Worker.connect_to: timeout"),
    ("ucx", "w.listen(None)", TE, "ferry.ucx.Worker.listen: host"),
    ("ucx", "w.listen('127.0.0.1', 70000)", VE, "ferry.ucx.Worker.listen: port"),
    ("ucx", "w.listen('127.0.0.1', 0, [1])", TE, "ferry.ucx.Worker.listen: expose[0]"),
    ("ucx", "w.listen('127.0.0.1').accept('1s')", TE, "ferry.ucx.Listener.accept: timeout"),
    ("ucx", "region.slice(-1, 1)", VE, "ferry.ucx.MemoryRegion.slice: offset"),
    ("ucx", "region.slice(0, None)", TE, "ferry.ucx.MemoryRegion.slice: length"),
    ("ucx", "remote.slice(None, 1)", TE, "ferry.ucx.RemoteMemory.slice: offset"),
    ("ucx", "remote.slice(0, -1)", VE, "ferry.ucx.RemoteMemory.slice: length"),
    ("ucx", "ep.import_region(None)", TE, "ferry.ucx.Endpoint.import_region: descriptor"),
    ("ucx", "ep.put(None, rs)", TE, "ferry.ucx.Endpoint.put: src"),
    ("ucx", "ep.put(ls, None)", TE, "ferry.ucx.Endpoint.put: dst"),
    ("ucx", "ep.put(ls, rs, '1s')", TE, "ferry.ucx.Endpoint.put: timeout"),
    ("ucx", "ep.put(ls, rs, None, None)", TE, "ferry.ucx.Endpoint.put: completion"),
    ("ucx", "ep.put(ls, rs, None, 'soon')", VE, "ferry.ucx.Endpoint.put: completion"),
    ("ucx", "ep.get(None, rs)", TE, "ferry.ucx.Endpoint.get: dst"),
    ("ucx", "ep.get(rs, ls)", TE, "ferry.ucx.Endpoint.get: dst"),
    ("ucx", "ep.get(ls, None)", TE, "ferry.ucx.Endpoint.get: src"),
    ("ucx", "ep.put_batch(None)", TE, "ferry.ucx.Endpoint.put_batch: blocks"),
    ("ucx", "ep.put_batch([None])", TE, "ferry.ucx.Endpoint.put_batch: blocks[0]"),
    ("ucx", "ep.put_batch([(ls, None)])", TE, "ferry.ucx.Endpoint.put_batch: blocks[0][1]"),
    ("ucx", "ep.put_batch([], completion=None)", TE, "ferry.ucx.Endpoint.put_batch: completion"),
    ("ucx", "ep.get_batch([(None, rs)])", TE, "ferry.ucx.Endpoint.get_batch: blocks[0][0]"),
    ("ucx", "ep.get_batch([], '1s')", TE, "ferry.ucx.Endpoint.get_batch: timeout"),
    ("ucx", "ep.send_notification(-1)", VE, "ferry.ucx.Endpoint.send_notification: value"),
    ("ucx", "ep.send_notification(None)", TE, "ferry.ucx.Endpoint.send_notification: value"),
    ("ucx", "ep.receive_notification('1s')", TE,
     "ferry.ucx.Endpoint.receive_notification: timeout"),
]

# The sweep: every public function, constructor and method that takes arguments, called with None
# for each of them, each call in its own process. None is refused by name where an object or a
# number is needed, and taken where it is documented (a timeout, an error, now), never a crash.
# Instances to call methods on, by class name (a failed empty Transfer: its wait returns at once).
INSTANCES = {
    "Transfer": ("core", "ferry.Transfer()"),
    "Completer": ("core", "c"),
    "Batch": ("core", "ferry.Batch([t])"),
    "BatchResult": ("core", "ferry.poll_all([t])"),
    "Error": ("core", "ferry.Error(1)"),
    "Executor": ("core", "ex"),
    "Loopback": ("core", "lb"),
    "FaultInjector": ("core", "ferry.testing.FaultInjector(ex)"),
    "LoadTracker": ("kv", "tr"),
    "ReleaseLedger": ("kv", "ledger"),
    "Ring": ("uring", "ring"),
    "TcpConnection": ("uring", "conn"),
    "TcpListener": ("uring", "listener"),
    "Worker": ("ucx", "w"),
    "Endpoint": ("ucx", "ep"),
    "MemoryRegion": ("ucx", "region"),
    "RemoteMemory": ("ucx", "remote"),
    "Listener": ("ucx", "w.listen('127.0.0.1')"),
    "TpShard": ("kv", "ferry.kv.TpShard()"),
    "TensorLayout": ("kv", "layout.layers[0].tensors[0]"),
    "LayerLayout": ("kv", "layout.layers[0]"),
    "CacheLayout": ("kv", "layout"),
    "ByteRange": ("kv", "plan.layers[0][0]"),
    "TransferPlan": ("kv", "plan"),
    "TransferPlanner": ("kv", "planner"),
    "EngineDescription": ("kv", "desc"),
    "UcxLink": ("ucx", "link"),
    "PushedRequest": ("ucx", "pushed"),
    "PushReceiver": ("ucx", "receiver"),
    "NamedPeer": ("ucx", "named"),
    "LocalRegistry": ("directory", "reg"),
    "Directory": ("directory", "d"),
    "LocalDirectory": ("directory", "d"),
    "Publication": ("directory", "pub"),
    "Watcher": ("directory", "w"),
    "PendingPublication": ("directory", "d.publish('y', b'v')"),
    "PendingRecord": ("directory", "d.lookup('x')"),
    "PendingLookups": ("directory", "d.lookup_many(['x'])"),
    "PendingEvent": ("directory", "w.next(None)"),
}
# Calls that take None for every argument and then wait: Listener.accept's default timeout is 10 s.
SWEEP_SKIPS = {"Listener.accept"}
# The Python-level functions (not in the compiled module's namespaces).
PYTHON_FUNCTIONS = [("core", "ferry.when_all", "when_all", 2),
                    ("kv", "tr.when_layer", "LoadTracker.when_layer", 2)]


def parameters_of(function, name):
    """How many arguments (self aside) a pybind11 function called `name` takes, from its signature
    line; None when it has none (a class without a constructor, a Python function)."""
    line = (function.__doc__ or "").lstrip().split("\n")[0]
    if not line.startswith(name + "("):
        return None
    start = len(name)
    names, depth, quote, current = [], 0, None, ""
    for ch in line[start + 1:]:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                break
            depth -= 1
        elif ch == "," and depth == 0:
            names.append(current.strip())
            current = ""
            continue
        current += ch
    if current.strip():
        names.append(current.strip())
    return sum(1 for n in names if not n.startswith("self"))


def sweep_cases():
    modules = [("core", "ferry", ferry._ferry), ("kv", "ferry.kv", ferry.kv),
               ("core", "ferry.testing", ferry.testing),
               ("directory", "ferry.directory", ferry.directory)]
    modules += [("uring", "ferry.uring", ferry.uring)] if ferry.HAS_URING else []
    modules += [("ucx", "ferry.ucx", ferry.ucx)] if ferry.HAS_UCX else []
    cases = []
    for part, prefix, module in modules:
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_"):
                continue
            if not isinstance(obj, type):
                n = parameters_of(obj, name) if callable(obj) else None
                if n:
                    cases.append((part, f"{prefix}.{name}({', '.join(['None'] * n)})", name))
                continue
            if issubclass(obj, BaseException) or hasattr(obj, "__members__"):
                continue  # exceptions, and enums (pybind11's own)
            n = parameters_of(obj.__init__, "__init__")
            if n:
                cases.append((part, f"{prefix}.{name}({', '.join(['None'] * n)})", name))
            for attr in sorted(vars(obj)):
                method = getattr(obj, attr)
                if (attr.startswith("_") and attr not in ("__getitem__", "__eq__", "__ne__")) \
                        or not callable(method) or isinstance(vars(obj)[attr], property):
                    continue
                n = parameters_of(method, attr)
                if not n or f"{name}.{attr}" in SWEEP_SKIPS:
                    continue
                if isinstance(vars(obj)[attr], staticmethod):
                    where, target = part, f"{prefix}.{name}"
                else:
                    if name not in INSTANCES:
                        raise AssertionError(f"the sweep has no instance of {prefix}.{name}")
                    where, target = INSTANCES[name]
                cases.append((where, f"{target}.{attr}({', '.join(['None'] * n)})",
                              f"{name}.{attr}"))
    for part, target, who, n in PYTHON_FUNCTIONS:
        cases.append((part, f"{target}({', '.join(['None'] * n)})", who))
    return cases


SWEEP = sweep_cases()

def available(part):
    return part not in ("uring", "ucx") or hasattr(ferry, part)


def every_case():
    todo = [(p, e) for p, e, _, _ in CASES if available(p)]
    return todo + [(p, e) for p, e, _ in SWEEP if (p, e) not in set(todo)]


RUNNER = CaseRunner(PRELUDES.__getitem__, every_case)
result_of = RUNNER.result


@pytest.mark.parametrize("part,expression,exception,names", CASES,
                         ids=[c[1] for c in CASES])
def test_bad_input_raises_naming_the_function_and_the_argument(part, expression, exception, names):
    if not available(part):
        pytest.skip(f"ferry was built without ferry.{part}")
    check_raised(result_of(part, expression), expression, exception, names)


@pytest.mark.parametrize("part,expression,who", SWEEP, ids=[c[1] for c in SWEEP])
def test_none_for_every_argument_is_refused_by_name_or_taken_never_a_crash(part, expression, who):
    r = result_of(part, expression)
    assert r.returncode == 0, f"{expression} ended the interpreter ({r.returncode}): {r.stderr}"
    said = said_by(r)
    assert said, f"{expression}: {r.stderr}"
    if said != "RAISED nothing":
        assert said.startswith(("RAISED TypeError ", "RAISED ValueError ")), f"{expression}: {said}"
        assert f"{who}" in said, f"{expression}: {said!r} does not name {who!r}"
        assert "Unable to cast" not in said and "incompatible" not in said, said


def test_the_sweep_covers_every_part():
    whos = {who for _, _, who in SWEEP}
    assert {"Loopback", "Loopback.copy", "Batch.__getitem__", "LoadTracker.add", "ReleaseLedger",
            "FaultInjector.wrap", "when_all"} <= whos, sorted(whos)
    if ferry.HAS_URING:
        assert {"Ring", "Ring.read_batch", "TcpConnection.connect", "TcpListener.accept"} <= whos
    assert {"Directory.publish", "Directory.lookup_many", "LocalDirectory", "Watcher.next",
            "PendingRecord.get"} <= whos
    if ferry.HAS_UCX:
        assert {"Worker", "Worker.connect_to", "Endpoint.put_batch", "RemoteMemory.slice",
                "NamedPeer", "NamedPeer.get", "Endpoint.sever"} <= whos


def test_a_transfer_compares_unequal_to_anything_else_instead_of_raising():
    t = ferry.Transfer()
    assert (t == None) is False and (t != None) is True  # noqa: E711
    assert t in [None, t] and t not in [None, 3, "t"]


def test_none_where_none_is_documented_is_still_taken():
    assert not ferry.Error(None)
    t, c = ferry.make_manual_transfer()
    assert c.fail(None) and t.error == ferry.Errc.unspecified_failure
    assert ferry.Executor(spin_budget=None, in_flight_spin=None) is not None
    assert ferry.wait_all([], None).ok
    tr = ferry.kv.LoadTracker(None, None)
    assert tr.add_request(1, abort_timeout=None, admission_timeout=None, created_ns=None).id == 1

"""ferry.directory from Python: publish, look up (one name and a thousand at once) and watch,
awaited on asyncio and waited on; a peer that dies loses its name; bad names and values are
refused; an endpoint found by name (ferry.ucx.NamedPeer) is fenced when the peer restarts. The
in-process LocalDirectory always, EtcdDirectory against a real etcd started here on 127.0.0.1 ports
picked free (skipped where etcd is not installed)."""

import asyncio
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request

import pytest

import ferry
from conftest import HANG

d = ferry.directory
Errc = d.Errc


@pytest.fixture(scope="module")
def etcd_url():
    if not os.access("/usr/bin/etcd", os.X_OK) or not d.HAS_ETCD:
        pytest.skip("etcd not installed (Debian: etcd-server) or ferry built without libcurl")
    ports = []
    socks = [socket.socket() for _ in range(2)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    work = tempfile.mkdtemp(prefix="ferry-py-etcd-")
    url = "http://127.0.0.1:%d" % ports[0]
    peer = "http://127.0.0.1:%d" % ports[1]
    log = open(os.path.join(work, "etcd.log"), "w")
    proc = subprocess.Popen(
        ["/usr/bin/setpriv", "--pdeathsig", "KILL", "/usr/bin/etcd", "--name", "py",
         "--data-dir", os.path.join(work, "data"), "--listen-client-urls", url,
         "--advertise-client-urls", url, "--listen-peer-urls", peer,
         "--initial-advertise-peer-urls", peer, "--initial-cluster", "py=" + peer,
         "--logger", "zap"], stdout=log, stderr=log)
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("etcd did not start; see " + work)
            time.sleep(0.1)
    yield url
    proc.kill()
    proc.wait()
    log.close()
    shutil.rmtree(work, ignore_errors=True)


_roots = iter(range(1_000_000))


def make(kind, etcd_url_or_none, registry=None, **kw):
    ex = ferry.Executor()
    if kind == "local":
        return d.LocalDirectory(ex, registry=registry, **kw)
    return d.EtcdDirectory(ex, endpoints=etcd_url_or_none, root="py%d-%d/" % (os.getpid(), next(_roots)), **kw)


@pytest.fixture(params=["local", "etcd"])
def pair(request):
    """Two clients of one directory: (publisher, reader)."""
    if request.param == "local":
        reg = d.LocalRegistry()
        return make("local", None, reg), make("local", None, reg)
    url = request.getfixturevalue("etcd_url")
    ex = ferry.Executor()
    root = "py%d-%d/" % (os.getpid(), next(_roots))
    return (d.EtcdDirectory(ex, endpoints=url, root=root),
            d.EtcdDirectory(ferry.Executor(), endpoints=url, root=root))


def test_publish_lookup_and_watch_awaited_on_asyncio(pair):
    pub_dir, reader = pair

    async def main():
        w = reader.watch("decode/", prefix=True)
        pub = await pub_dir.publish("decode/0", b"engine description", lease=2.0)
        assert pub.incarnation >= 1 and pub.health is None
        r = await reader.lookup("decode/0", HANG)
        assert (r.name, r.incarnation, r.value) == ("decode/0", pub.incarnation, b"engine description")
        ev = await w.next(HANG)
        assert ev.kind == "published" and ev.record.incarnation == pub.incarnation
        with pytest.raises(ferry.FerryError) as info:
            await reader.lookup("decode/none", HANG)
        assert info.value.error == Errc.not_found
        assert await pub.withdraw() == ferry.State.success
        ev = await w.next(HANG)
        assert ev.kind == "gone" and ev.record.name == "decode/0"
        again = await pub_dir.publish("decode/0", b"restarted")
        assert again.incarnation > pub.incarnation
        again.close()

    asyncio.run(main())


def test_a_thousand_names_at_once(pair):
    pub_dir, reader = pair
    pubs = [p.get(HANG) for p in [pub_dir.publish("n/%d" % i, b"%d" % i, lease=5.0) for i in range(0, 1000, 10)]]
    names = ["n/%d" % i for i in range(1000)]
    results = reader.lookup_many(names, HANG).get(HANG)
    assert [r.name for r in results] == names
    for i, r in enumerate(results):
        if i % 10 == 0:
            assert r.error is None and r.record.value == b"%d" % i
        else:
            assert r.record is None and r.error == Errc.not_found
    del pubs


def test_a_client_that_dies_loses_its_names_with_its_lease():
    reg = d.LocalRegistry()
    a, b = make("local", None, reg), make("local", None, reg)
    w = b.watch("svc")
    pub = a.publish("svc", b"x", lease=0.3).get(HANG)
    assert w.next(HANG).get(HANG).kind == "published"
    a.abandon()
    start = time.monotonic()
    ev = w.next(HANG).get(HANG)
    assert ev.kind == "gone" and ev.record.incarnation == pub.incarnation
    assert time.monotonic() - start < 5  # the lease, not a deadline
    with pytest.raises(ferry.FerryError) as info:
        b.lookup("svc", HANG).get(HANG)
    assert info.value.error == Errc.not_found


def test_garbage_under_a_name_is_refused_with_a_message():
    reg = d.LocalRegistry()
    a = make("local", None, reg)
    reg.put_raw("junk", b"\x00" * 40)
    with pytest.raises(ferry.FerryError) as info:
        a.lookup("junk", HANG).get(HANG)
    assert info.value.error == Errc.bad_record and "junk" in str(info.value)
    small = make("local", None, reg, max_record_bytes=8)
    big = a.publish("big", b"y" * 100).get(HANG)  # held: a dropped publication withdraws
    [r] = small.lookup_many(["big"], HANG).get(HANG)
    assert r.error == Errc.record_too_large and "big" in r.message


def test_bad_arguments_are_refused_naming_them():
    a = make("local", None, d.LocalRegistry())
    with pytest.raises(ferry.FerryError) as info:
        a.publish("has space", b"x").get(HANG)
    assert info.value.error == Errc.bad_name
    with pytest.raises(TypeError, match="publish"):
        a.publish("x", None)
    with pytest.raises(TypeError, match="name"):
        a.lookup(None)
    with pytest.raises(ValueError, match="lease"):
        a.publish("x", b"v", lease=-1.0)
    with pytest.raises(ferry.FerryError) as info:
        a.watch("bad name")
    assert info.value.error == Errc.bad_name
    with pytest.raises(TypeError, match="names"):
        a.lookup_many(None)
    a.close()
    with pytest.raises(ferry.FerryError) as info:
        a.lookup("x")
    assert info.value.error == Errc.closed


@pytest.mark.skipif(not ferry.HAS_UCX, reason="ferry was built without ferry.ucx")
def test_named_peer_is_fenced_when_the_peer_restarts():
    ucx = ferry.ucx
    reg = d.LocalRegistry()
    n = 16384

    def engine():
        w = ucx.Worker(ferry.Executor(), transports="tcp")
        mem = bytearray(n)
        region = w.register_memory(mem)
        record = len(w.address()).to_bytes(4, "little") + w.address() + region.describe()
        return w, mem, region, record

    wa, ma, ra, rec_a = engine()
    wb, mb, rb, rec_b = engine()
    wc = ucx.Worker(ferry.Executor(), transports="tcp")
    src = wc.register_memory(bytearray(b"\x07" * n))
    da, db, dc = (make("local", None, reg) for _ in range(3))
    pa = da.publish("engine", rec_a).get(HANG)
    remotes = {}

    def connect(record):
        k = int.from_bytes(record.value[:4], "little")
        ep = wc.connect(record.value[4:4 + k])
        remotes[record.incarnation] = ep.import_region(record.value[4 + k:])
        return ep

    peer = ucx.NamedPeer(dc, "engine", connect)
    ep = peer.get(HANG)
    first = peer.incarnation
    assert ep.put(src.whole(), remotes[first].slice(0, n), HANG).wait(HANG) == ferry.State.success
    assert ma == b"\x07" * n
    pb = db.publish("engine", rec_b).get(HANG)  # the engine restarted under its name
    assert peer.fenced == Errc.peer_restarted
    late = ep.put(src.whole(), remotes[first].slice(0, n), HANG)
    assert late.wait(HANG) == ferry.State.failed and late.error == Errc.peer_restarted
    ep2 = peer.get(HANG)
    assert peer.incarnation == pb.incarnation and peer.connects == 2
    assert ep2.put(src.whole(), remotes[pb.incarnation].slice(0, n), HANG).wait(HANG) == ferry.State.success
    assert mb == b"\x07" * n
    del pa

import threading
import time

import pytest

import ferry

# Every wait in these tests is bounded; this is the "did not hang" bound, far above what any of
# them needs.
HANG = 30.0


@pytest.fixture
def executor():
    return ferry.Executor()


@pytest.fixture
def loopback(executor):
    return ferry.Loopback(executor)


def later(delay, fn, *args):
    """Runs fn(*args) on a Python thread after `delay` seconds; returns the started thread."""
    t = threading.Timer(delay, fn, args)
    t.daemon = True
    t.start()
    return t


def release_hung(injector, n):
    """Releases n hung transfers of `injector`, once the executor has routed them (bounded)."""
    released = 0
    for _ in range(3000):
        released += injector.release_hung()
        if released >= n:
            return released
        time.sleep(0.01)
    raise AssertionError(f"only {released} of {n} hung transfers were released")

# Bad input to constructors: a TypeError naming what was wrong, never a crash. Each case runs in a
# process of its own, so that a crash fails its test instead of ending the whole run.
import os
import subprocess
import sys

import pytest

import ferry

CASES = [
    ("ferry.Loopback(None)", "ferry.Loopback", None),
    ("ferry.testing.FaultInjector(None)", "ferry.testing.FaultInjector", None),
    ("ferry.uring.Ring(None)", "ferry.uring.Ring", "uring"),
    ("ferry.ucx.Worker(None)", "ferry.ucx.Worker", "ucx"),
]


@pytest.mark.parametrize("expression,who,part", CASES)
def test_an_executor_given_as_none_is_a_type_error_naming_it(expression, who, part):
    if part is not None and not hasattr(ferry, part):
        pytest.skip(f"ferry was built without ferry.{part}")
    code = (
        "import ferry, ferry.testing\n"
        + (f"import ferry.{part}\n" if part else "")
        + "try:\n"
        + f"    {expression}\n"
        + "except TypeError as e:\n"
        + "    print('TypeError:', e)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env=os.environ)
    assert r.returncode == 0, f"{expression} ended the interpreter ({r.returncode}): {r.stderr}"
    assert "TypeError:" in r.stdout, r.stdout + r.stderr
    assert who in r.stdout and "None" in r.stdout, r.stdout


@pytest.mark.parametrize("arguments,name", [("release=42", "release"), ("cancel='no'", "cancel")])
def test_a_load_tracker_callback_that_cannot_be_called_is_refused_when_given(arguments, name):
    code = (
        "import ferry, ferry.kv\n"
        + "try:\n"
        + f"    ferry.kv.LoadTracker({arguments})\n"
        + "except TypeError as e:\n"
        + "    print('TypeError:', e)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env=os.environ)
    assert r.returncode == 0, r.stderr
    assert "TypeError:" in r.stdout and f"{name} must be callable" in r.stdout, r.stdout + r.stderr

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


def type_error_in_own_process(imports, expression):
    """Runs `expression` in a new interpreter; returns its TypeError's text, failing the test if
    the interpreter died or nothing was raised."""
    code = f"{imports}\ntry:\n    {expression}\nexcept TypeError as e:\n    print('TypeError:', e)\n"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env=os.environ)
    assert r.returncode == 0, f"{expression} ended the interpreter ({r.returncode}): {r.stderr}"
    assert "TypeError:" in r.stdout, r.stdout + r.stderr
    return r.stdout


@pytest.mark.parametrize("expression,who,part", CASES)
def test_an_executor_given_as_none_is_a_type_error_naming_it(expression, who, part):
    if part is not None and not hasattr(ferry, part):
        pytest.skip(f"ferry was built without ferry.{part}")
    imports = "import ferry, ferry.testing" + (f", ferry.{part}" if part else "")
    said = type_error_in_own_process(imports, expression)
    assert who in said and "None" in said, said


@pytest.mark.parametrize("arguments,name", [("release=42", "release"), ("cancel='no'", "cancel")])
def test_a_load_tracker_callback_that_cannot_be_called_is_refused_when_given(arguments, name):
    said = type_error_in_own_process("import ferry, ferry.kv", f"ferry.kv.LoadTracker({arguments})")
    assert f"{name} must be callable" in said, said

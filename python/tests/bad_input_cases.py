"""Bad-input cases run each in a new interpreter, so that a crash fails its case instead of ending
the run: shared by test_bad_input.py and test_kv_connector.py."""

import concurrent.futures
import os
import subprocess
import sys
import threading

CHILD = """\
{prelude}
try:
    {expression}
except Exception as e:
    print("RAISED", type(e).__name__, str(e).replace("\\n", " "))
else:
    print("RAISED nothing")
"""


class CaseRunner:
    """Runs every case's process on the first result asked for, a few at a time; each still runs
    alone in its own interpreter. `prelude_of(part)` is the code a case of `part` runs after;
    `todo()` lists the (part, expression) pairs to run."""

    def __init__(self, prelude_of, todo):
        self._prelude_of = prelude_of
        self._todo = todo
        self._results = {}
        self._lock = threading.Lock()

    def run(self, part, expression):
        """Runs `expression` after the part's prelude in a new interpreter; returns the process."""
        code = CHILD.format(prelude=self._prelude_of(part), expression=expression)
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=120, env=os.environ)

    def result(self, part, expression):
        """The finished process of one case."""
        with self._lock:
            if not self._results:
                with concurrent.futures.ThreadPoolExecutor(max(2, os.cpu_count() or 2)) as pool:
                    for key in self._todo():
                        self._results[key] = pool.submit(self.run, *key)
        return self._results[(part, expression)].result()


def said_by(r):
    """The one line the case printed (UCX may log to stdout too)."""
    return next((line for line in r.stdout.splitlines() if line.startswith("RAISED ")), "")


def check_raised(r, expression, exception, names):
    """The case's process survived and raised `exception` with a message naming `names`."""
    assert r.returncode == 0, f"{expression} ended the interpreter ({r.returncode}): {r.stderr}"
    said = said_by(r)
    assert said.startswith(f"RAISED {exception} "), f"{expression}: {said or r.stderr}"
    assert names in said, f"{expression}: {said!r} does not name {names!r}"
    assert "Unable to cast" not in said and "incompatible function arguments" not in said, said

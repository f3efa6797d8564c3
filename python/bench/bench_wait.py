#!/usr/bin/env python3
"""Waiting for a batch from Python, against the same wait in C++ and against a 1 ms polling loop.

One batch: `n` loopback copies of `bytes` each (completed by the executor's thread), posted, then
waited for. Per batch, each way:

  cpp wait_all     the batch posted and waited for in C++ (ferry._ferry._bench_cpp, GIL released)
  cpp when_all     the same, a coroutine awaiting when_all on a run_loop that sleeps at once
  py wait_all      ferry.wait_all(transfers, 10) from Python
  py when_all      await ferry.when_all(transfers, 10) on an asyncio loop
  py poll 1 ms     what connectors do today: look at every status, sleep 1 ms, look again

Figures: medians over `runs` runs of each run's median per batch: wall time (and, for the Python
ways, the part after the 256 copies were posted: posting from Python costs a few microseconds a
copy), CPU of the waiting thread, and CPU of the whole process (the executor's copies included). 'Python overhead' is the
Python way's wall time minus the C++ way's. All ways run in one process, one after the other,
round-robin across runs.
"""

import argparse
import asyncio
import statistics
import subprocess
import time

import ferry


def median(xs):
    return statistics.median(xs)


def post(lb, dst, src, n, size):
    return [lb.copy(dst[i * size:(i + 1) * size], src[i * size:(i + 1) * size]) for i in range(n)]


def measure(batch_fn, batches):
    """Runs batch_fn() `batches` times; per-batch (wall, thread CPU, process CPU, wait part) in
    ns, the wait part being from when batch_fn's posting ended (it returns that perf_counter_ns)
    to its end."""
    out = []
    for _ in range(batches):
        w0, c0, p0 = time.perf_counter_ns(), time.thread_time_ns(), time.process_time_ns()
        posted = batch_fn()
        end = time.perf_counter_ns()
        out.append((end - w0, time.thread_time_ns() - c0, time.process_time_ns() - p0,
                    end - posted))
    return out


def run_once(ex, lb, n, size, batches):
    src = memoryview(bytearray(b"\x01" * (n * size)))
    dst = memoryview(bytearray(n * size))
    results = {}

    for mode in ("wait_all", "when_all"):
        r = ferry._ferry._bench_cpp(ex, mode, batches, n, size)
        results["cpp " + mode] = list(zip(r["wall_ns"], r["thread_cpu_ns"], r["process_cpu_ns"],
                                          [0] * batches))

    def py_wait_all():
        ts = post(lb, dst, src, n, size)
        posted = time.perf_counter_ns()
        assert ferry.wait_all(ts, 10).ok
        return posted

    results["py wait_all"] = measure(py_wait_all, batches)

    async def when_all_batches():
        out = []
        for _ in range(batches):
            w0, c0, p0 = time.perf_counter_ns(), time.thread_time_ns(), time.process_time_ns()
            ts = post(lb, dst, src, n, size)
            posted = time.perf_counter_ns()
            assert (await ferry.when_all(ts, 10)).ok
            end = time.perf_counter_ns()
            out.append((end - w0, time.thread_time_ns() - c0, time.process_time_ns() - p0,
                        end - posted))
        return out

    results["py when_all"] = asyncio.run(when_all_batches())

    def py_poll():
        ts = post(lb, dst, src, n, size)
        posted = time.perf_counter_ns()
        while not all(t.done for t in ts):
            time.sleep(0.001)
        assert all(t.state == ferry.State.success for t in ts)
        return posted

    results["py poll 1 ms"] = measure(py_poll, batches)
    return {k: tuple(median([b[i] for b in v]) for i in range(4)) for k, v in results.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=256, help="transfers per batch")
    ap.add_argument("--bytes", type=int, default=4096, help="bytes per transfer")
    ap.add_argument("--batches", type=int, default=200, help="batches per way per run")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="2 runs of 20 batches")
    a = ap.parse_args()
    if a.quick:
        a.runs, a.batches = 2, 20
    ex = ferry.Executor()
    lb = ferry.Loopback(ex)
    runs = [run_once(ex, lb, a.n, a.bytes, a.batches) for _ in range(a.runs)]
    ways = list(runs[0])
    fig = {w: tuple(median([r[w][i] for r in runs]) for i in range(4)) for w in ways}
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=False).stdout.strip()
    except OSError:
        commit = "?"
    print(f"batch of {a.n} x {a.bytes} B loopback copies; medians of {a.runs} runs x "
          f"{a.batches} batches; commit {commit}")
    print()
    print("| way | wall per batch (us) | of which waiting, after posting (us) | waiting thread CPU "
          "per batch (us) | process CPU per batch (us) | Python overhead vs the C++ way (us) |")
    print("|---|---|---|---|---|---|")
    base = {"py wait_all": "cpp wait_all", "py when_all": "cpp when_all",
            "py poll 1 ms": "cpp wait_all"}
    for w in ways:
        wall, cpu, proc, waiting = (x / 1000 for x in fig[w])
        over = ""
        if w in base:
            over = f"{wall - fig[base[w]][0] / 1000:+.0f} (vs {base[w]})"
        part = "-" if w.startswith("cpp") else f"{waiting:.0f}"
        print(f"| {w} | {wall:.0f} | {part} | {cpu:.0f} | {proc:.0f} | {over} |")
    for w in ways:
        print(f"# per-run wall (us) {w}: " +
              ", ".join(f"{r[w][0] / 1000:.0f}" for r in runs))


if __name__ == "__main__":
    main()

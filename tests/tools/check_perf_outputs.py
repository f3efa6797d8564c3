"""Checks what a ferry-perf run wrote: the JSON (parses, holds the run's configuration, one result per
block size with figures, the metrics), the SVG (well-formed XML, an <svg> root with drawing in it) and
the Prometheus text (the exposition format: every sample under a declared family, counters, histograms
with cumulative buckets ending in +Inf equal to _count, and _sum).

  check_perf_outputs.py json FILE BACKEND OP WORKLOAD SIZES METRIC_OP [PEER]
  check_perf_outputs.py svg FILE
  check_perf_outputs.py prometheus FILE
"""
import json
import math
import re
import sys
import xml.etree.ElementTree as ET


def fail(msg):
    print("check_perf_outputs: " + msg, file=sys.stderr)
    sys.exit(1)


def check_json(path, backend, op, workload, sizes, metric_op, peer=None):
    with open(path) as f:
        doc = json.load(f)
    cfg = doc["config"]
    if cfg["backend"] != backend or cfg["op"] != op or cfg["workload"] != workload:
        fail("config says %s/%s/%s" % (cfg["backend"], cfg["op"], cfg["workload"]))
    want = [int(s) for s in sizes.split(",")]
    if cfg["block_sizes"] != want:
        fail("config block_sizes %s, expected %s" % (cfg["block_sizes"], want))
    for key in ("ferry_version", "kernel", "compiler"):
        if not doc["environment"].get(key):
            fail("environment lacks " + key)
    if not doc["command"] or doc["command"][1] not in ("initiator", "file"):
        fail("command is not the ferry-perf command line")
    results = doc["results"]
    if [r["block_size"] for r in results] != want:
        fail("results for %s" % [r["block_size"] for r in results])
    for r in results:
        if "error" in r:
            fail("result has an error: " + r["error"])
        if r["ops"] <= 0 or r["bytes"] != r["ops"] * r["block_size"] or not r["mb_per_s"] > 0:
            fail("result without figures: %s" % r)
        cpu = r["cpu"]
        if cpu["initiator_us_per_op"] is None or "target_us_per_op" not in cpu:
            fail("CPU per operation missing on one side: %s" % cpu)
        if workload == "latency":
            lat = r["latency_us"]
            if not (0 < lat["min"] <= lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["p999"] <= lat["max"]):
                fail("latency percentiles out of order: %s" % lat)
        if workload == "kv":
            kv = r["kv"]
            ready = kv["layer_ready_us_median"]
            if kv["steps"] <= 0 or len(ready) != cfg["layers"] or ready != sorted(ready):
                fail("kv figures: %s" % kv)
            if not kv["step_us_p50"] >= ready[-1] * 0.5:
                fail("kv step time below its layers' ready times: %s" % kv)
    ops = [o for o in doc["metrics"]["operations"] if o["op"] == metric_op]
    if not ops:
        fail("metrics hold no %s operations: %s" % (metric_op, doc["metrics"]))
    total = sum(o["succeeded"] for o in ops if o["peer"] == "")
    if total < sum(r["ops"] for r in results):
        fail("metrics count %d %s, fewer than the run's %d" % (total, metric_op, sum(r["ops"] for r in results)))
    if peer == "peer" and not any(o["peer"] for o in ops):
        fail("metrics have no per-peer series")


def check_svg(path):
    root = ET.parse(path).getroot()
    if root.tag != "{http://www.w3.org/2000/svg}svg":
        fail("root element is %s" % root.tag)
    drawn = [e for e in root.iter() if e.tag.split("}")[1] in ("polyline", "circle")]
    if not drawn:
        fail("the SVG draws no data")


SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$')
LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"\s*(,|$)')


def parse_labels(text):
    out = {}
    pos = 0
    while pos < len(text):
        m = LABEL.match(text, pos)
        if not m:
            fail("bad label set {%s}" % text)
        out[m.group(1)] = re.sub(r'\\(.)', lambda x: {"n": "\n"}.get(x.group(1), x.group(1)), m.group(2))
        pos = m.end()
    return out


def check_prometheus(path):
    types = {}
    samples = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line:
                continue
            if line.startswith("# TYPE "):
                parts = line.split()
                if len(parts) != 4 or parts[3] not in ("counter", "gauge", "histogram", "summary", "untyped"):
                    fail("line %d: bad TYPE line" % n)
                if parts[2] in types:
                    fail("line %d: family %s declared twice" % (n, parts[2]))
                types[parts[2]] = parts[3]
                continue
            if line.startswith("#"):
                continue
            m = SAMPLE.match(line)
            if not m:
                fail("line %d is not a sample: %r" % (n, line))
            value = float(m.group(4))
            samples.append((m.group(1), parse_labels(m.group(3) or ""), value))
    if not samples:
        fail("no samples")
    hist = {}
    for name, labels, value in samples:
        family = name
        for suffix in ("_bucket", "_sum", "_count"):
            if name.endswith(suffix) and types.get(name[: -len(suffix)]) == "histogram":
                family = name[: -len(suffix)]
        if family not in types:
            fail("sample %s has no TYPE" % name)
        kind = types[family]
        if kind == "counter":
            if not name.endswith("_total") or value < 0:
                fail("counter %s: %s" % (name, value))
        if kind == "histogram":
            key = tuple(sorted((k, v) for k, v in labels.items() if k != "le"))
            h = hist.setdefault((family, key), {"buckets": [], "sum": None, "count": None})
            if name.endswith("_bucket"):
                if "le" not in labels:
                    fail("bucket without le")
                h["buckets"].append((float(labels["le"]) if labels["le"] != "+Inf" else math.inf, value))
            elif name.endswith("_sum"):
                h["sum"] = value
            elif name.endswith("_count"):
                h["count"] = value
    if not hist:
        fail("no histogram")
    for (family, key), h in hist.items():
        b = h["buckets"]
        if not b or b[-1][0] != math.inf:
            fail("%s %s: buckets do not end with +Inf" % (family, key))
        if [x for x, _ in b] != sorted(x for x, _ in b):
            fail("%s %s: le bounds not increasing" % (family, key))
        if any(b[i][1] > b[i + 1][1] for i in range(len(b) - 1)):
            fail("%s %s: buckets not cumulative" % (family, key))
        if h["count"] is None or h["sum"] is None:
            fail("%s %s: _sum or _count missing" % (family, key))
        if h["count"] != b[-1][1]:
            fail("%s %s: _count %s is not the +Inf bucket %s" % (family, key, h["count"], b[-1][1]))


def main():
    what = sys.argv[1]
    if what == "json":
        check_json(*sys.argv[2:])
    elif what == "svg":
        check_svg(sys.argv[2])
    elif what == "prometheus":
        check_prometheus(sys.argv[2])
    else:
        fail("unknown check " + what)
    print("check_perf_outputs: %s %s ok" % (what, sys.argv[2]))


if __name__ == "__main__":
    main()

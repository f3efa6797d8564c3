"""Checks what a ferry-perf run wrote: the JSON (parses, holds the run's configuration, one result per
block size with figures, the metrics), the SVG (well-formed XML with an <svg> root; every panel draws
data, no line of a single point, tick labels distinct, increasing and with their unit, no text
outside the picture or a rotated label longer than its plot; a latency run has its distribution, a
kv run its step times and a point per layer) and the Prometheus text (the exposition format: every
sample under a declared family, counters, histograms with cumulative buckets ending in +Inf equal to
_count, and _sum).

  check_perf_outputs.py json FILE BACKEND OP WORKLOAD SIZES METRIC_OP [PEER] [checked]
  check_perf_outputs.py svg FILE [stream|latency|kv [LAYERS]]
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


def check_json(path, backend, op, workload, sizes, metric_op, peer=None, checked=None):
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
    if checked == "checked" and cfg.get("check") is not True:
        fail("config does not say --check")
    for r in results:
        if "error" in r:
            fail("result has an error: " + r["error"])
        if checked == "checked" and r.get("checked") is not True:
            fail("result not checked: %s" % r)
        if r["ops"] <= 0 or r["bytes"] != r["ops"] * r["block_size"] or not r["mb_per_s"] > 0:
            fail("result without figures: %s" % r)
        cpu = r["cpu"]
        if cpu["initiator_us_per_op"] is None or (backend != "file" and "target_us_per_op" not in cpu):
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


SVG = "{http://www.w3.org/2000/svg}"
UNITS = {"time": {"ns": 1e-3, "\u00b5s": 1.0, "ms": 1e3, "s": 1e6}, "rate": {"MB/s": 1.0, "GB/s": 1e3}}


def tag(e):
    return e.tag[len(SVG):] if e.tag.startswith(SVG) else e.tag


def text_of(e):
    return "".join(e.itertext())


def font_size(e, inherited):
    return float(e.get("font-size", inherited))


def text_box(e, size):
    """The box a text takes, estimated: 0.6 em a character, anchored as it says."""
    x, y = float(e.get("x", 0)), float(e.get("y", 0))
    w = len(text_of(e)) * size * 0.6
    anchor = e.get("text-anchor", "start")
    x0 = x - w / 2 if anchor == "middle" else x - w if anchor == "end" else x
    return x0, y - size, x0 + w, y + size * 0.3


def tick_value(label, kind):
    """A tick label's value in the axis's base unit (µs, MB/s); None when it is not number and unit."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(?: (\S+))?", label)
    if not m:
        return None
    if kind in UNITS:
        if m.group(2) not in UNITS[kind]:
            return None
        return float(m.group(1)) * UNITS[kind][m.group(2)]
    return float(m.group(1)) if m.group(2) is None else None


def polyline_points(e):
    pts = []
    for pair in e.get("points", "").split():
        x, y = pair.split(",")
        pts.append((float(x), float(y)))
    return pts


def check_svg(path, workload=None, layers=None):
    root = ET.parse(path).getroot()
    if root.tag != SVG + "svg":
        fail("root element is %s" % root.tag)
    view = [float(v) for v in root.get("viewBox").split()]
    base_size = float(root.get("font-size", 12))
    drawn = [e for e in root.iter() if tag(e) in ("polyline", "circle")]
    if not drawn:
        fail("the SVG draws no data")
    for e in root.iter():
        if tag(e) != "text" or not text_of(e):
            continue
        size = font_size(e, base_size)
        x0, y0, x1, y1 = text_box(e, size)
        if e.get("transform", "").startswith("rotate"):
            continue  # checked against its panel below
        if x0 < view[0] - 1 or x1 > view[0] + view[2] + 1 or y0 < view[1] - 1 or y1 > view[1] + view[3] + 1:
            fail("text %r (about %.0f,%.0f to %.0f,%.0f) is cut by the picture's edge" % (text_of(e), x0, y0, x1, y1))
    # A panel is a group with a plot frame (a rect). Its ticks are found by where they stand (y ticks
    # right-aligned left of the frame, x ticks centred just below it), so that the checks hold for
    # any layout; what an axis measures comes from data-axis where given, else from its label.
    panels = [g for g in root.iter() if tag(g) == "g" and any(tag(e) == "rect" for e in g)]
    if not panels:
        fail("no panel")
    titles = []
    for g in panels:
        title = "".join(text_of(t) for t in g if tag(t) == "text" and t.get("class") == "panel-title")
        titles.append(title)
        rect = next(e for e in g if tag(e) == "rect")
        left, top = float(rect.get("x")), float(rect.get("y"))
        height = float(rect.get("height"))
        bottom = top + height
        lines = [e for e in g if tag(e) == "polyline"]
        circles = [e for e in g if tag(e) == "circle"]
        if not lines and not circles:
            fail("panel %r draws nothing" % title)
        for line in lines:
            pts = polyline_points(line)
            if len(set(pts)) < 2:
                fail("panel %r draws a line of a single point: %s" % (title, line.get("points")))
        texts = [e for e in g if tag(e) == "text" and text_of(e)]
        rotated = [e for e in texts if e.get("transform", "").startswith("rotate")]
        for e in rotated:
            length = len(text_of(e)) * font_size(e, base_size) * 0.6
            mid = float(e.get("y"))
            if mid - length / 2 < top - 2 or mid + length / 2 > bottom + 2:
                fail("panel %r: its axis label %r is longer than the plot" % (title, text_of(e)))
        flat = [e for e in texts if e not in rotated]
        y_ticks = [e for e in flat if e.get("text-anchor") == "end" and float(e.get("x")) <= left]
        x_ticks = [e for e in flat if e.get("text-anchor") == "middle" and bottom < float(e.get("y")) <= bottom + 25]
        x_label = " ".join(text_of(e) for e in flat if e.get("text-anchor") == "middle" and
                           bottom + 25 < float(e.get("y")) <= bottom + 50)
        y_label = " ".join(text_of(e) for e in rotated)
        if not y_ticks or not x_ticks:
            fail("panel %r: %d y ticks and %d x ticks" % (title, len(y_ticks), len(x_ticks)))
        # Tick labels: each axis's distinct, with their unit where the axis has one, and increasing
        # along the axis (up the y axis, rightwards on the x axis).
        for vertical, ticks, label in ((True, y_ticks, y_label), (False, x_ticks, x_label)):
            kind = ticks[0].get("data-axis")
            if kind is None:
                kind = ("percent" if label == "percentile" else "size" if "block size" in label
                        else "index" if label == "layer" else "time or rate")
            labels = [text_of(t) for t in ticks]
            if len(set(labels)) != len(labels):
                fail("panel %r: %s ticks repeat: %s" % (title, kind, labels))
            if kind == "size":
                continue
            if kind == "time or rate":
                values = [tick_value(l, "time") if tick_value(l, "time") is not None else tick_value(l, "rate")
                          for l in labels]
            else:
                values = [tick_value(l, kind) for l in labels]
            if None in values:
                fail("panel %r: %s ticks without their unit: %s" % (title, kind, labels))
            pos = [-float(t.get("y")) if vertical else float(t.get("x")) for t in ticks]
            order = [v for _, v in sorted(zip(pos, values))]
            if any(a >= b for a, b in zip(order, order[1:])):
                fail("panel %r: %s ticks do not increase along the axis: %s" % (title, kind, labels))
    if workload == "latency" and not any(t.startswith("Latency distribution") for t in titles):
        fail("a latency run's SVG has no latency distribution: panels %s" % titles)
    if workload == "kv":
        if not any(t.startswith("kv step time") for t in titles):
            fail("a kv run's SVG has no step time panel: panels %s" % titles)
        layer_panels = [g for g, t in zip(panels, titles) if t.startswith("kv layers")]
        if not layer_panels:
            fail("a kv run's SVG has no layer panel: panels %s" % titles)
        g = layer_panels[0]
        ticks = [text_of(e) for e in g if tag(e) == "text" and e.get("data-axis") == "index"]
        if layers is not None and ticks != [str(i) for i in range(int(layers))]:
            fail("the kv layer panel's layers are %s, expected 0 to %d" % (ticks, int(layers) - 1))
        for line in (e for e in g if tag(e) == "polyline"):
            if layers is not None and len(polyline_points(line)) != int(layers):
                fail("a kv layer line has %d points, expected %s" % (len(polyline_points(line)), layers))


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
        check_svg(*sys.argv[2:])
    elif what == "prometheus":
        check_prometheus(sys.argv[2])
    else:
        fail("unknown check " + what)
    print("check_perf_outputs: %s %s ok" % (what, sys.argv[2]))


if __name__ == "__main__":
    main()

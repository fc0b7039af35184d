"""The trace summariser's reference: section statistics and device time from a whole trace loaded with
``json.load`` and computed plainly (small traces only), and the comparisons of a summary with a record of the same
trace. Used by the summariser's tests and by ``python -m benchmarks.bench_trace``'s checks."""

from __future__ import annotations

import gzip
import json
import statistics
from pathlib import Path
from typing import Any

STAT_KEYS = ("min_s", "mean_s", "median_s", "max_s")
TOLERANCE_S = 1e-6


def reference_summary(path: Path) -> dict[str, dict[str, float]]:
    """Section statistics from the whole trace loaded with ``json.load``, computed plainly (small traces only).

    A section instance's duration is its CPU ``dur``, except forward/backward: first start to last end of the
    ``kernel`` events whose correlation id belongs to a launch (a name with ``Launch`` in it) made inside the range,
    on the range's thread (any thread of its process for backward).
    """
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        events = json.load(f)["traceEvents"]
    complete = [e for e in events if e.get("ph") == "X"]
    ranges = [e for e in complete if e["name"].startswith("__sec:") and not e.get("cat", "").startswith("gpu_")]
    launches = [e for e in complete if "Launch" in e["name"] and e["name"].startswith(("cu", "hip"))]
    kernels: dict[int, list[tuple[float, float]]] = {}
    for e in complete:
        if e.get("cat") == "kernel":
            kernels.setdefault(e["args"]["correlation"], []).append((e["ts"], e["ts"] + e["dur"]))
    durations: dict[str, list[float]] = {}
    for r in ranges:
        name = r["name"][len("__sec:") :]
        value = r["dur"]
        if name in ("forward", "backward"):
            spans = [
                span
                for e in launches
                if e["pid"] == r["pid"]
                and (name == "backward" or e["tid"] == r["tid"])
                and r["ts"] <= e["ts"] <= r["ts"] + r["dur"]
                for span in kernels.get(e["args"]["correlation"], [])
            ]
            if spans:
                value = max(end for _, end in spans) - min(start for start, _ in spans)
        durations.setdefault(name, []).append(value)
    return {name: stats(values) for name, values in durations.items()}


def reference_device(path: Path) -> dict[str, float]:
    """The device's kernels, copies and memsets of the whole trace loaded with ``json.load``, computed plainly: their
    number and time, and the busy and wall time of the ``ProfilerStep#`` ranges (ms; small traces only)."""
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    device = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    steps = sorted(
        (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e["name"].startswith("ProfilerStep#") and not e.get("cat", "").startswith("gpu_")
    )
    busy = sum(max(0.0, min(end, hi) - max(start, lo)) for start, end in _union(device) for lo, hi in _union(steps))
    return {"events": len(device), "ms": sum(end - start for start, end in device) / 1e3,
            "wall_ms": sum(hi - lo for lo, hi in _union(steps)) / 1e3, "busy_ms": busy / 1e3}  # fmt: skip


def as_summary(record: dict[str, float]) -> dict[str, Any]:
    """A device record (the generator's) in the summary's shape, for :func:`compare_device`."""
    return {"device": {"events": record["events"], "classes": {"all": {"ms": record["ms"]}}},
            "idle": {"wall_ms": record["wall_ms"], "busy_ms": record["busy_ms"]}}  # fmt: skip


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Intervals merged where they overlap, sorted."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def compare_device(summary: dict[str, Any], want: dict[str, float] | None) -> list[str]:
    """Differences between a summary's device table and idle share and a record of the same trace (``want``: the
    generator's or :func:`reference_device`'s; None: nothing to compare): the number of device events exactly, the
    classes' total and the busy and wall time to 1 ns per event (each duration is written to the nanosecond)."""
    if want is None:
        return []
    device, idle = summary.get("device") or {}, summary.get("idle") or {}
    classes = device.get("classes", {}).values()
    got = {"events": device.get("events"), "ms": sum(c["ms"] for c in classes), "wall_ms": idle.get("wall_ms"),
           "busy_ms": idle.get("busy_ms")}  # fmt: skip
    problems = [] if got["events"] == want["events"] else [f"device events {got['events']} != {want['events']}"]
    slack = 1e-6 * (want["events"] + len(classes))  # ms: 1 ns per event, and per class for rounding each to 1 ns
    for key in ("ms", "wall_ms", "busy_ms"):
        if got[key] is None or abs(got[key] - want[key]) > slack:
            problems.append(f"device {key} {got[key]} != {want[key]}")
    return problems


def compare(got: dict[str, dict[str, Any]], want: dict[str, dict[str, Any]]) -> list[str]:
    """Differences between two section-statistics tables: counts exactly, seconds to :data:`TOLERANCE_S`."""
    problems = [f"{name} missing" for name in want if name not in got]
    problems += [f"{name} unexpected" for name in got if name not in want]
    for name in want.keys() & got.keys():
        if got[name]["count"] != want[name]["count"]:
            problems.append(f"{name} count {got[name]['count']} != {want[name]['count']}")
        for key in STAT_KEYS:
            if abs(got[name][key] - want[name][key]) > TOLERANCE_S:
                problems.append(f"{name} {key} {got[name][key]} != {want[name][key]}")
    return problems


def stats(values_us: list[float]) -> dict[str, Any]:
    """count, min, mean, median, max (s) of durations in µs, unrounded."""
    return {
        "count": len(values_us),
        "min_s": min(values_us) / 1e6,
        "mean_s": statistics.fmean(values_us) / 1e6,
        "median_s": statistics.median(values_us) / 1e6,
        "max_s": max(values_us) / 1e6,
    }

"""summarize_trace: per-section statistics from hand-made chrome traces whose answers are computed by hand here."""

from __future__ import annotations

import gzip
import itertools
import json
import os
import random
import re
import statistics
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest
from scripts.profiling import summarize_trace as st

ROOT = Path(__file__).resolve().parents[1]
MODULE = ROOT / "scripts" / "profiling" / "summarize_trace.py"
PID, TID, OTHER_TID, GPU_PID, STREAM = 4242, 4242, 4300, 0, 7

# Per step k (4 steps, starting at k * 10_000 µs): the durations the trace is built from, in µs.
STEP_US = [5000, 4000, 4500, 6000]  # sorted 4000 4500 5000 6000: median 4750, mean 4875
LOADER_FIRST_US = [800]
LOADER_NEXT_US = [100, 400, 250]  # median 250, mean 250
FWD_KERNEL_SPAN_US = [100, 300, 200, 1000]  # sorted 100 200 300 1000: median 250, mean 400
BWD_KERNEL_SPAN_US = [500, 900, 400, 600]  # sorted 400 500 600 900: median 550, mean 600
FWD_CPU_US = [1000, 1200, 900, 1100]  # sorted 900 1000 1100 1200: median 1050, mean 1050
BWD_CPU_US = [1500, 1300, 1400, 1800]  # sorted 1300 1400 1500 1800: median 1450, mean 1500
OPT_CPU_US = [50, 80, 60, 90]  # sorted 50 60 80 90: median 70, mean 70

CUDA_LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel")
HIP_LAUNCHES = ("hipLaunchKernel", "hipExtModuleLaunchKernel", "hipModuleLaunchKernel")

EXPECTED_CPU = {
    "step": (4, 4000e-6, 4875e-6, 4750e-6, 6000e-6),
    "loader_first": (1, 800e-6, 800e-6, 800e-6, 800e-6),
    "loader_next": (3, 100e-6, 250e-6, 250e-6, 400e-6),
    "optimizer": (4, 50e-6, 70e-6, 70e-6, 90e-6),
}
EXPECTED_KERNELS = {"forward": (4, 100e-6, 400e-6, 250e-6, 1000e-6), "backward": (4, 400e-6, 600e-6, 550e-6, 900e-6)}
EXPECTED_CPU_FALLBACK = {
    "forward": (4, 900e-6, 1050e-6, 1050e-6, 1200e-6),
    "backward": (4, 1300e-6, 1500e-6, 1450e-6, 1800e-6),
}


def section(name, ts, dur, *, tid=TID, pid=PID, cat="user_annotation"):
    return {"ph": "X", "cat": cat, "name": f"__sec:{name}", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "args": {}}


def cpu_op(name, ts, dur):
    return {"ph": "X", "cat": "cpu_op", "name": name, "pid": PID, "tid": TID, "ts": ts, "dur": dur, "args": {}}


def launch(name, ts, corr, *, tid=TID, cat="cuda_runtime"):
    args = {"cbid": 211, "correlation": corr}
    return {"ph": "X", "cat": cat, "name": name, "pid": PID, "tid": tid, "ts": ts, "dur": 4, "args": args}


def kernel(ts, dur, corr, *, cat="kernel", name="void k<float>()"):
    args = {"device": 0, "stream": STREAM, "correlation": corr}
    return {"ph": "X", "cat": cat, "name": name, "pid": GPU_PID, "tid": STREAM, "ts": ts, "dur": dur, "args": args}


# Real kernel names (tests/data/h200/4-chrome_trace.json.gz): a convolution, a matrix product, an element-wise op
CONV = "sm90_xmma_fprop_implicit_gemm_f16f16_f16f32_f32_nhwckrsc_nhwc_tilesize256x64x32_warpgroupsize1x1x1_g1_execute"
GEMM = "void cutlass::Kernel2<cutlass_75_wmma_tensorop_f16_s161616gemm_f16_32x32_64x2_nt_align1>(...::Params)"
ADD = (
    "void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::Half>, std::array<char*, 3ul> >"
)
ADAM = "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<...FusedAdamMathFunctor<float, 4>...>"
# Per step of make_trace(): device time per class (µs), the profiled step's wall time and the device's busy time in it
STEP_DEVICE_US = {"convolution": 20, "matrix product / attention": 40, "element-wise": 80 + 500, "memcpy/memset": 250}
STEP_DEVICE_COUNT = {"convolution": 2, "matrix product / attention": 2, "element-wise": 3, "memcpy/memset": 2}
PROFILER_STEP_US = 7400  # ProfilerStep#k: t .. t + 7400, which cuts the optimizer's kernel (t + 7000 .. 7500) at 400
STEP_BUSY_US = 200 + 70 + 70 + 400  # the copy (the memset runs inside it), forward's and backward's kernels, 400


def kernel_section(events, name, ts, cpu_dur, span, gpu_at, launches, corr):
    """A range with three launches inside; their kernels (a convolution, a matrix product, an element-wise add) run
    from gpu_at to gpu_at + span (listed last first), 70 µs of kernels without overlap."""
    events.append(section(name, ts, cpu_dur))
    c1, c2, c3 = corr(), corr(), corr()
    for i, c in enumerate((c1, c2, c3)):
        events.append(cpu_op("aten::mm", ts + 10 + 100 * i, 50))
        events.append(launch(launches[i % len(launches)], ts + 20 + 100 * i, c, cat=_runtime_cat(launches[0])))
    events.append(kernel(gpu_at + span - 40, 40, c3, name=ADD))
    events.append(kernel(gpu_at, 10, c1, name=CONV))
    events.append(kernel(gpu_at + 20, 20, c2, name=GEMM))


def _runtime_cat(name):
    return "hip_runtime" if name.startswith("hip") else "cuda_runtime"


def make_trace(launches=CUDA_LAUNCHES, *, gpu=True):
    """Four training steps, each in a ProfilerStep range; with gpu=False the same ranges and CPU ops without any
    launch, kernel, copy or memset."""
    events = [{"ph": "M", "name": "process_name", "pid": PID, "tid": 0, "args": {"name": "python"}}]
    corr = itertools.count(1).__next__  # correlation ids, as CUPTI hands them out
    for k in range(4):
        t = 10_000 * k
        events.append({**cpu_op(f"ProfilerStep#{k + 2}", t, PROFILER_STEP_US), "cat": "user_annotation"})
        loader = ("loader_first", LOADER_FIRST_US[0]) if k == 0 else ("loader_next", LOADER_NEXT_US[k - 1])
        events.append(section(loader[0], t, loader[1]))
        events.append(section("step", t + 1000, STEP_US[k]))
        gpu_events = []
        kernel_section(gpu_events, "forward", t + 1100, FWD_CPU_US[k], FWD_KERNEL_SPAN_US[k], t + 2500, launches, corr)
        kernel_section(gpu_events, "backward", t + 2400, BWD_CPU_US[k], BWD_KERNEL_SPAN_US[k], t + 5000, launches, corr)
        events.append(section("optimizer", t + 4300, OPT_CPU_US[k]))
        if gpu:
            events.extend(gpu_events)
            c = corr()  # the optimizer's launch: outside forward/backward, its kernel is not theirs
            events += [launch(launches[0], t + 4310, c, cat=_runtime_cat(launches[0])), kernel(t + 7000, 500, c)]
            events[-1]["name"] = ADAM
            c = corr()  # the batch's copy in the loader, and a memset inside it (device time, never a section's)
            events += [launch("cudaMemcpyAsync", t + 100, c), kernel(t + 500, 200, c, cat="gpu_memcpy")]
            events[-1]["name"] = "Memcpy HtoD (Pinned -> Device)"
            c = corr()
            events += [launch("cudaMemsetAsync", t + 110, c), kernel(t + 600, 50, c, cat="gpu_memset")]
            events[-1]["name"] = "Memset (Device)"
            # GPU-timeline copies of the ranges must not count as instances
            events.append(section("forward", t + 2500, 5, pid=GPU_PID, tid=STREAM, cat="gpu_user_annotation"))
        else:
            events.extend(e for e in gpu_events if e["cat"] in ("user_annotation", "cpu_op"))
    return {"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "Test GPU"}], "traceEvents": events}


def kineto_text(trace):
    """The trace in torch/kineto's layout: every event opens with a line holding only two spaces and '{'."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    body = ",\n".join(
        "  {\n" + ",\n".join(f"    {json.dumps(k)}: {json.dumps(v)}" for k, v in ev.items()) + "\n  }" for ev in events
    )
    if isinstance(trace, list):
        return "[\n" + body + "\n]\n"
    head = "".join(f"  {json.dumps(k)}: {json.dumps(v)},\n" for k, v in trace.items() if k != "traceEvents")
    tail = '  "displayTimeUnit": "ms",\n  "traceName": "/runs/__sec:kernel\\"cudaLaunch.json"\n'  # markers, not events
    return "{\n" + head + '  "traceEvents": [\n' + body + "\n  ],\n" + tail + "}\n"


LAYOUTS = ["kineto", "compact", "indented", "lines", "sorted"]


def lines_text(trace):
    """One event per line, as many tools re-save traces."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    body = "[\n" + ",\n".join(json.dumps(ev) for ev in events) + "\n]"
    if isinstance(trace, list):
        return body + "\n"
    rest = {k: v for k, v in trace.items() if k != "traceEvents"}
    return '{"traceEvents": ' + body + "".join(f", {json.dumps(k)}: {json.dumps(v)}" for k, v in rest.items()) + "}\n"


def write(path, trace, layout="kineto"):
    """The trace as torch writes it (kineto), on one line (compact), indented, one event a line, or sorted keys."""
    if layout == "kineto":
        text = kineto_text(trace)
    elif layout == "lines":
        text = lines_text(trace)
    else:
        text = json.dumps(
            trace, indent={"compact": None, "indented": 2, "sorted": 1}[layout], sort_keys=layout == "sorted"
        )
    path.write_text(text)
    return path


def has(module):
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def needs(parser):
    """Skip where the parser's optional package is not installed."""
    if parser == "orjson" and not has(parser):
        pytest.skip(f"the optional {parser} package is not installed")


def check(sections, expected):
    for name, (count, lo, mean, median, hi) in expected.items():
        got = sections[name]
        assert got["count"] == count, name
        assert got["min_s"] == pytest.approx(lo, abs=1e-9), name
        assert got["mean_s"] == pytest.approx(mean, abs=1e-9), name
        assert got["median_s"] == pytest.approx(median, abs=1e-9), name
        assert got["max_s"] == pytest.approx(hi, abs=1e-9), name


def run_cli(*args, cwd=ROOT):
    return subprocess.run(
        [sys.executable, "-m", "scripts.summarize_trace", *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("launches", [CUDA_LAUNCHES, HIP_LAUNCHES], ids=["cuda", "hip"])
def test_forward_and_backward_are_first_kernel_start_to_last_kernel_end(tmp_path, launches):
    summary = st.summarize(write(tmp_path / "trace.json", make_trace(launches)))
    check(summary["sections"], EXPECTED_KERNELS)
    check(summary["sections"], EXPECTED_CPU)
    assert summary["sources"]["forward"] == summary["sources"]["backward"] == "kernels"
    assert summary["sources"]["step"] == "cpu"
    assert summary["devices"] == ["Test GPU"]


@pytest.mark.parametrize(
    "name",
    [
        "cudaLaunchKernel",
        "cudaLaunchKernelExC",
        "cuLaunchKernel",
        "cuLaunchKernelEx",
        "cudaLaunchCooperativeKernel",
        "cudaGraphLaunch",
        "hipLaunchKernel",
        "hipExtLaunchKernel",
        "hipExtModuleLaunchKernel",
        "hipModuleLaunchKernel",
        "hipLaunchCooperativeKernel",
        "hipGraphLaunch",
    ],
)
def test_each_launch_name_ties_kernels_to_their_section(tmp_path, name):
    summary = st.summarize(write(tmp_path / "trace.json", make_trace((name,))))
    check(summary["sections"], EXPECTED_KERNELS)


def test_a_launch_inside_nested_sections_counts_for_both(tmp_path):
    events = [
        section("backward", 0, 1000),
        section("forward", 100, 100),  # recomputation inside backward (activation checkpointing)
        launch("cudaLaunchKernel", 150, 1),
        launch("cudaLaunchKernel", 500, 2),  # after the nested forward ended: backward's only
        kernel(1000, 10, 1),
        kernel(2000, 100, 2),
    ]
    summary = st.summarize(write(tmp_path / "trace.json", {"traceEvents": events}))
    check(summary["sections"], {"forward": (1, 10e-6, 10e-6, 10e-6, 10e-6)})
    check(summary["sections"], {"backward": (1, 1100e-6, 1100e-6, 1100e-6, 1100e-6)})


def test_kernels_launched_outside_sections_or_on_other_threads_are_ignored(tmp_path):
    trace = make_trace()
    events = trace["traceEvents"]
    # each would stretch the first forward instance (kernels 2500..2600) if it were counted
    events += [launch("cudaLaunchKernel", 1050, 9001), kernel(2000, 10, 9001)]  # before forward, inside step
    events += [launch("cudaLaunchKernel", 1150, 9002, tid=OTHER_TID), kernel(2100, 10, 9002)]  # other thread
    events += [launch("cudaMemcpyAsync", 1160, 9003), kernel(2200, 10, 9003, cat="gpu_memcpy")]  # a copy
    events += [launch("cudaLaunchKernel", 1170, 9004), kernel(2400, 10, 9004, cat="gpu_memset")]  # not a kernel
    summary = st.summarize(write(tmp_path / "trace.json", trace))
    check(summary["sections"], EXPECTED_KERNELS)


def test_backward_counts_kernels_launched_by_the_autograd_thread(tmp_path):
    events = [
        section("backward", 0, 1000),
        launch("cudaLaunchKernel", 200, 1, tid=OTHER_TID),  # autograd's device thread runs the backward ops
        launch("cudaLaunchKernel", 900, 2, tid=OTHER_TID),
        launch("cudaLaunchKernel", 1500, 3, tid=OTHER_TID),  # after the range: not backward's
        kernel(1000, 10, 1),
        kernel(1400, 100, 2),
        kernel(3000, 100, 3),
        section("forward", 2000, 100),
        launch("cudaLaunchKernel", 2050, 4, tid=OTHER_TID),  # forward still needs its own thread
        kernel(3500, 10, 4),
    ]
    summary = st.summarize(write(tmp_path / "trace.json", {"traceEvents": events}))
    check(summary["sections"], {"backward": (1, 500e-6, 500e-6, 500e-6, 500e-6)})
    assert summary["sources"]["forward"] == "cpu"


def test_graph_launch_counts_every_kernel_of_its_correlation_and_suffixed_names_match(tmp_path):
    events = [
        section("forward", 0, 500),
        launch("cudaGraphLaunch", 10, 1),
        launch("cudaLaunchKernel_ptsz", 20, 2),
        kernel(1000, 10, 1),
        kernel(1100, 10, 1),
        kernel(1200, 50, 2),
        kernel(1300, 10, 1),  # graph kernels share the launch's correlation id
    ]
    summary = st.summarize(write(tmp_path / "trace.json", {"traceEvents": events}))
    check(summary["sections"], {"forward": (1, 310e-6, 310e-6, 310e-6, 310e-6)})


def test_cpu_only_trace_falls_back_to_range_durations(tmp_path):
    summary = st.summarize(write(tmp_path / "trace.json", make_trace(gpu=False)))
    check(summary["sections"], EXPECTED_CPU_FALLBACK)
    check(summary["sections"], EXPECTED_CPU)
    assert summary["sources"]["forward"] == "cpu"
    assert summary["launches"] == summary["kernels"] == 0


# ------------------------------------------------------------------------- where the device's time goes
KERNEL_NAMES = json.loads((ROOT / "tests" / "data" / "kernel_names.json").read_text())
H200 = ROOT / "tests" / "data" / "h200"


def recorded_collections(monkeypatch):
    """A list that receives every _Collected the summariser makes (what it kept, to be counted)."""
    made = []

    class Recorded(st._Collected):
        def __init__(self):
            super().__init__()
            made.append(self)

    monkeypatch.setattr(st, "_Collected", Recorded)
    return made


def check_device(summary, steps=4):
    """The device table and idle share of make_trace()'s first ``steps`` steps, computed by hand above."""
    device = summary["device"]
    assert list(device["classes"]) == list(st.CLASS_ORDER)
    total_us = steps * sum(STEP_DEVICE_US.values())
    assert device["events"] == steps * sum(STEP_DEVICE_COUNT.values())
    assert device["ms"] == pytest.approx(total_us / 1e3, abs=1e-9)
    for name, row in device["classes"].items():
        assert row["count"] == steps * STEP_DEVICE_COUNT.get(name, 0), name
        assert row["ms"] == pytest.approx(steps * STEP_DEVICE_US.get(name, 0) / 1e3, abs=1e-9), name
        assert row["share"] == pytest.approx(STEP_DEVICE_US.get(name, 0) / sum(STEP_DEVICE_US.values()), abs=1e-6)
    idle = summary["idle"]
    assert (idle["window"], idle["ranges"]) == ("profiler steps", steps)
    assert idle["wall_ms"] == pytest.approx(steps * PROFILER_STEP_US / 1e3, abs=1e-9)
    assert idle["busy_ms"] == pytest.approx(steps * STEP_BUSY_US / 1e3, abs=1e-9)
    assert idle["idle_ms"] == pytest.approx(steps * (PROFILER_STEP_US - STEP_BUSY_US) / 1e3, abs=1e-9)
    assert idle["share"] == pytest.approx(0.9, abs=1e-6)  # 6660 of 7400 µs a step


@pytest.mark.parametrize("launches", [CUDA_LAUNCHES, HIP_LAUNCHES], ids=["cuda", "hip"])
def test_device_time_per_class_and_idle_share_of_the_profiled_steps(tmp_path, launches):
    """Per class the count, ms and share of the kernels, copies and memsets; idle: the ProfilerStep ranges less the
    union of device activity in them (a memset inside a copy counts once, the kernel past a step's end only up to
    it), whatever the order of the events in the file."""
    trace = make_trace(launches)
    check_device(st.summarize(write(tmp_path / "trace.json", trace)))
    trace["traceEvents"].reverse()
    check_device(st.summarize(write(tmp_path / "reversed.json", trace, "compact")))


def test_a_cpu_trace_says_it_has_no_device_time_and_no_idle_share(tmp_path):
    path = write(tmp_path / "trace.json", make_trace(gpu=False))
    summary = st.summarize(path)
    assert summary["device"]["events"] == 0 and summary["device"]["ms"] == 0 and summary["idle"] is None
    assert all(row == {"count": 0, "ms": 0.0, "share": 0.0} for row in summary["device"]["classes"].values())
    result = run_cli(path)
    assert result.returncode == 0, result.stderr
    assert (
        "device time by kernel class: none: no kernel, copy or memset in this trace (a CPU-only run)" in result.stdout
    )
    assert "device idle" not in result.stdout


def test_a_device_only_trace_is_summarised_over_its_device_span(tmp_path):
    """A profile of device activity only (torch.profiler with the CUDA activity alone, started and stopped by hand,
    as the benchmark's busy steps): no sections, no ProfilerStep ranges; the idle share is measured from the first
    device start to the last device end, and says so."""
    events = [e for e in make_trace()["traceEvents"] if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    summary = st.summarize(write(tmp_path / "trace.json", {"traceEvents": events}))
    assert summary["sections"] == {} and summary["device"]["events"] == 4 * sum(STEP_DEVICE_COUNT.values())
    idle = summary["idle"]
    span = 30_000 + 7_500 - 500  # the first copy starts at 500, the last optimizer kernel ends at 37,500
    busy = 4 * (200 + 70 + 70 + 500)
    assert (idle["window"], idle["ranges"]) == ("device span", 1)
    assert (idle["wall_ms"], idle["busy_ms"]) == (pytest.approx(span / 1e3), pytest.approx(busy / 1e3))
    text = st.format_table(summary)
    assert (
        "from the first device start to the last device end (37.000 ms; the trace has no ProfilerStep ranges)" in text
    )


@pytest.mark.parametrize("seed", range(6))
def test_busy_time_is_the_union_of_overlapping_intervals_inside_the_steps(tmp_path, seed):
    """Kernels on several streams overlap, touch, nest and cross the steps' edges: the busy time equals a count of
    the microseconds covered by any of them inside any ProfilerStep range (integer endpoints: exact)."""
    rng = random.Random(seed)
    intervals = [(a, a + rng.randrange(0, 40)) for a in (rng.randrange(0, 400) for _ in range(60))]
    steps = [(10, 90), (90, 150), (200, 330), (350, 351)]  # two steps touching, one of a microsecond
    events = [kernel(a, b - a, i + 1, name=rng.choice((CONV, GEMM, ADD))) for i, (a, b) in enumerate(intervals)]
    events += [{**cpu_op(f"ProfilerStep#{i}", a, b - a), "cat": "user_annotation"} for i, (a, b) in enumerate(steps)]
    rng.shuffle(events)
    summary = st.summarize(write(tmp_path / "trace.json", {"traceEvents": events}))
    covered = {t for a, b in intervals for t in range(a, b)}
    inside = {t for a, b in steps for t in range(a, b)}
    idle = summary["idle"]
    assert idle["ranges"] == 3  # the touching ranges join
    assert idle["busy_ms"] * 1e3 == pytest.approx(len(covered & inside), abs=1e-6)
    assert idle["wall_ms"] * 1e3 == pytest.approx(len(inside), abs=1e-6)


def test_what_is_kept_is_a_fixed_few_numbers_per_event_and_one_row_per_class(tmp_path, monkeypatch):
    """Memory, counted: every kept event costs its kind's fixed number of doubles (kernels 5, launches 3, sections 4,
    copies and memsets 2, ProfilerStep ranges 2); per kernel name only the bounded cache of their classes and the
    numbers of the first NAMES_KEPT names (the kernels of later names count together, in their class's list of the
    longest kernels); the device table has one row per class however many distinct names the kernels have."""
    trace = make_trace()
    corr = itertools.count(10_000).__next__
    trace["traceEvents"] += [kernel(50_000 + i, 1, corr(), name=f"void my_kernel_{i}<float>()") for i in range(5000)]
    made = recorded_collections(monkeypatch)
    st._class_index.cache_clear()
    summary = st.summarize(write(tmp_path / "trace.json", trace, "compact"))
    kept = made[-1]
    widths = {"kernel": 5, "launch": 3, "section": 4, "transfer": 2, "step": 2}
    assert {name: len(kind.fields) for name, kind in st.KINDS.items()} == widths
    counts = {"kernel": 4 * 7 + 5000, "launch": 4 * 7, "section": 4 * 5, "transfer": 4 * 2, "step": 4}
    assert {name: kept.count(name) for name in widths} == counts
    assert {name: len(rows) for name, rows in kept.rows.items()} == {k: widths[k] * counts[k] for k in widths}
    assert st._class_index.cache_info().currsize <= st._CLASS_CACHE < 5000
    assert list(summary["device"]["classes"]) == list(st.CLASS_ORDER)
    assert summary["device"]["classes"]["other"]["count"] == 5000
    assert len(kept.numbers.kernels) == st.NAMES_KEPT < 5000
    beyond = 5000 - (st.NAMES_KEPT - len({e["name"] for e in make_trace()["traceEvents"] if e.get("cat") == "kernel"}))
    longest = summary["device"]["top"]["other"]
    assert longest[0] == {"name": st.OTHER_NAMES, "count": beyond, "ms": beyond / 1e3, "share": pytest.approx(
        beyond / 1e3 / summary["device"]["ms"], abs=1e-6)}  # fmt: skip
    assert [k["count"] for k in longest[1:]] == [1, 1]


@pytest.mark.parametrize("index", range(len(KERNEL_NAMES["names"])))
def test_real_kernel_names_of_cuda_and_rocm_fall_in_their_class(index):
    """Kernel names taken from real traces (tests/data/kernel_names.json says which), each in the class a reader of
    its library would give it."""
    entry = KERNEL_NAMES["names"][index]
    assert st.kernel_class(entry["name"]) == entry["class"], entry["name"]
    assert entry["source"] in KERNEL_NAMES["sources"]


def _alternatives(pattern):
    """The top-level alternatives of a regular expression (``a|b(?:c|d)`` -> ``a``, ``b(?:c|d)``)."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(pattern):
        if char == "(" and pattern[i - 1 : i] != "\\":
            depth += 1
        elif char == ")" and pattern[i - 1 : i] != "\\":
            depth -= 1
        elif char == "|" and depth == 0:
            parts.append(pattern[start:i])
            start = i + 1
    return [*parts, pattern[start:]]


def test_every_class_and_every_pattern_is_proven_on_real_names_of_both_vendors():
    """Each class holds real CUDA and ROCm names, and each alternative of each rule is what classifies at least one
    real name of its class (no pattern in the table that no real name needs)."""
    names = KERNEL_NAMES["names"]
    for name in st.CLASS_ORDER:
        assert {e["vendor"] for e in names if e["class"] == name} == {"CUDA", "ROCm"}, name
    for name, pattern in st.KERNEL_CLASSES:
        for alternative in _alternatives(pattern):
            assert any(e["class"] == name and re.search(alternative, e["name"]) for e in names), (name, alternative)


def test_the_busy_steps_trace_of_a_benchmark_row_is_summarised_over_its_device_span():
    """The kit's tiny run on an H200 (tests/data/h200/busy_steps_trace.json.gz): StepTimer profiles only the device's
    activity in its busy steps, with no sections and no ProfilerStep ranges; every kernel, copy and memset in it is in
    one class, and the idle share is taken over the span of device activity."""
    path = H200 / "busy_steps_trace.json.gz"
    with gzip.open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    summary = st.summarize(path)
    device, idle = summary["device"], summary["idle"]
    assert summary["sections"] == {} and device["events"] == len(events) == 2823
    assert device["ms"] == pytest.approx(sum(e["dur"] for e in events) / 1e3, abs=len(events) * 1e-6)
    assert sum(row["count"] for row in device["classes"].values()) == device["events"]
    span = max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)
    assert (idle["window"], idle["wall_ms"]) == ("device span", pytest.approx(span / 1e3, abs=1e-6))
    assert device["classes"]["convolution"]["count"] > 0 and device["classes"]["layout conversion and copies"]["ms"] > 0


def test_device_classes_add_up_to_key_averages_device_total_on_the_h200_profile():
    """The H200 profile of tests/data/h200/: the classes' counts and milliseconds add up to what torch's
    key_averages() of the same run holds for the device: its device rows less the record_function ranges mirrored on
    the GPU timeline (``__sec:*``, ``Optimizer.step#AdamW.step``: a name that is also a CPU row), the "Self CUDA time
    total" of its table (306.952 ms). Per class too, classifying key_averages' rows by the same rules. Counts are
    exact; times agree to 1 ns per event: the trace writes each duration to the nanosecond, and its timestamps (about
    4.9e12 µs) are doubles exact to about 1 ns, so a sum of N durations may differ by up to N ns."""
    summary = st.summarize(H200 / "4-chrome_trace.json.gz")
    rows = json.loads((H200 / "4-key_averages.json").read_text())
    ranges = {r["name"] for r in rows if r["device_type"] == "CPU"}
    device = [r for r in rows if r["device_type"] != "CPU" and r["name"] not in ranges]
    events = sum(r["count"] for r in device)
    assert summary["device"]["events"] == events == 5132
    total_ms = sum(r["device_time_total_us"] for r in device) / 1e3
    assert summary["device"]["ms"] == pytest.approx(total_ms, abs=events * 1e-6)
    assert total_ms == pytest.approx(306.952, abs=5e-4)
    for name, row in summary["device"]["classes"].items():
        mine = [r for r in device if st.kernel_class(r["name"]) == name]
        assert row["count"] == sum(r["count"] for r in mine), name
        ms = sum(r["device_time_total_us"] for r in mine) / 1e3
        assert row["ms"] == pytest.approx(ms, abs=row["count"] * 1e-6 + 1e-6), name
    assert summary["device"]["classes"]["other"]["share"] < 0.01  # the rules cover the bundle's own kernels
    idle = summary["idle"]
    profiler_steps = next(r for r in rows if r["name"] == "ProfilerStep*" and r["device_type"] == "CPU")
    assert idle["wall_ms"] == pytest.approx(profiler_steps["cpu_time_total_us"] / 1e3, abs=1e-3)
    assert idle["busy_ms"] <= summary["device"]["ms"] and idle["ranges"] == 2


def test_the_longest_kernels_of_each_class_are_key_averages_longest_rows_of_that_class():
    """Per class, the kernels of one name together, longest first: the same names, counts and milliseconds as the
    longest rows of key_averages() (one row a name) of the same run classified by the same rules, on the H200 profile
    of tests/data/h200/ (to 1 ns an event, as the classes); copies and memsets are not kernels and are named in no
    list. The table prints them, names cut."""
    summary = st.summarize(H200 / "4-chrome_trace.json.gz")
    rows = json.loads((H200 / "4-key_averages.json").read_text())
    ranges = {r["name"] for r in rows if r["device_type"] == "CPU"}
    kernels = [r for r in rows if r["device_type"] != "CPU" and r["name"] not in ranges]
    kernels = [r for r in kernels if st.kernel_class(r["name"]) != "memcpy/memset"]
    top = summary["device"]["top"]
    assert list(top) == [c for c in st.CLASS_ORDER if c != "memcpy/memset"]  # every class with kernels, in order
    for name, listed in top.items():
        mine = sorted(
            (r for r in kernels if st.kernel_class(r["name"]) == name), key=lambda r: -r["device_time_total_us"]
        )
        assert [k["name"] for k in listed] == [r["name"] for r in mine[: st.TOP_KERNELS]], name
        for k, r in zip(listed, mine):
            assert k["count"] == r["count"] and k["ms"] == pytest.approx(
                r["device_time_total_us"] / 1e3, abs=k["count"] * 1e-6 + 1e-6
            )
            assert k["share"] == pytest.approx(k["ms"] / summary["device"]["ms"], abs=1e-6)
    assert top["softmax"][0]["name"].startswith("void (anonymous namespace)::softmax_warp_backward<float")
    text = st.format_table(summary)
    assert "the longest kernels of each class, by name" in text
    assert (
        "      12 x      7.810 ms   2.5 %  void (anonymous namespace)::softmax_warp_backward<float, float, float"
        in text
    )
    assert max(len(line) for line in text.splitlines()) < 160  # C++ names of thousands of characters, cut


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("parser", ["auto", "json", "orjson"])
def test_every_layout_and_parser_gives_the_same_answer(tmp_path, layout, parser):
    needs(parser)
    trace = make_trace(HIP_LAUNCHES)
    summary = st.summarize(write(tmp_path / "trace.json", trace, layout), parser=parser)
    check(summary["sections"], EXPECTED_KERNELS)
    check(summary["sections"], EXPECTED_CPU)
    assert summary["events"] == len(trace["traceEvents"])
    if parser in ("auto", "orjson"):  # skimming works whatever the layout
        assert summary["parser"] == ("json" if parser == "auto" else "orjson") + "-skim"


def test_bare_event_list_is_accepted(tmp_path):
    events = make_trace()["traceEvents"]
    for layout in ("kineto", "compact"):
        summary = st.summarize(write(tmp_path / f"{layout}.json", events, layout))
        check(summary["sections"], EXPECTED_KERNELS)


def test_events_in_any_file_order_give_the_same_answer(tmp_path):
    trace = make_trace()
    trace["traceEvents"].reverse()  # kernels before their launches, launches before their ranges
    summary = st.summarize(write(tmp_path / "trace.json", trace))
    check(summary["sections"], EXPECTED_KERNELS)
    check(summary["sections"], EXPECTED_CPU)


@pytest.mark.parametrize("chunk", [1, 7, 64, 4096])
def test_reading_in_small_chunks_gives_the_same_answer(tmp_path, monkeypatch, chunk):
    path = write(tmp_path / "trace.json", make_trace())
    monkeypatch.setattr(st, "_CHUNK_CHARS", chunk)
    for parser in ("auto", "json"):
        summary = st.summarize(path, parser=parser)
        check(summary["sections"], EXPECTED_KERNELS)
        check(summary["sections"], EXPECTED_CPU)
        assert summary["events"] == len(make_trace()["traceEvents"])


# Text that skimming must not miscount or misread: each is put among the events of make_trace()
ODDITIES = {
    # objects in a list inside an event, the second written exactly like an event (on one line: the head itself)
    "nested-like-events": {
        "ph": "X",
        "cat": "cpu_op",
        "name": "aten::mm",
        "pid": PID,
        "tid": TID,
        "ts": 1,
        "dur": 1,
        "args": {"inputs": [{"x": 1}, {"ph": "X", "cat": "kernel", "ts": 0, "dur": 9e9, "args": {"correlation": 1}}]},
    },
    "nested-after-a-number": {"ph": "i", "name": "x", "ts": 1, "args": {"l": [1, {"x": 1}, {"ph": "X", "k": 2}]}},
    "no-ph": {"name": "__sec:forward", "cat": "kernel", "ts": 0, "dur": 1, "args": {"correlation": 2}},  # not an event
    "no-ph-no-marker": {"name": "aten::mm", "ts": 0, "dur": 1},
    "ph-not-first": {"name": "__sec:forward", "ph": "X", "pid": PID, "tid": TID, "ts": 40000, "dur": 7},
    "ph-not-first-no-marker": {"name": "aten::mm", "ph": "X", "pid": PID, "tid": TID, "ts": 40000, "dur": 7},
    "nested-ph": {"ph": "i", "name": "marker", "pid": PID, "tid": TID, "ts": 1, "args": {"ph": "X", "k": "kernel"}},
    "strings": {"ph": "i", "name": '}, {"ph": "X", "cat": "kernel"} __sec:step cudaLaunchKernel \u00e9', "ts": 1},
}


@pytest.mark.parametrize("layout", ["kineto", "compact", "lines"])
@pytest.mark.parametrize("oddity", list(ODDITIES))
@pytest.mark.parametrize("chunk", [97, 1 << 20])
def test_skimming_agrees_with_decoding_every_event_around_odd_text(tmp_path, monkeypatch, layout, oddity, chunk):
    trace = make_trace()
    events = trace["traceEvents"]
    for at in (len(events) - 1, len(events) // 2, 1):  # near the end, in the middle, near the start
        events.insert(at, ODDITIES[oddity])
    path = write(tmp_path / "trace.json", trace, layout)
    monkeypatch.setattr(st, "_CHUNK_CHARS", chunk)
    full = st.summarize(path, parser="json")
    assert full["events"] == len(events)
    for parser in ("auto", "orjson"):
        if parser == "orjson" and not has("orjson"):
            continue
        got = st.summarize(path, parser=parser)
        assert got["parser"] == parser.replace("auto", "json") + "-skim"
        assert {**got, "parser": ""} == {**full, "parser": ""}, parser


@pytest.mark.parametrize("layout", ["compact", "indented"])
def test_events_after_the_list_are_not_counted(tmp_path, layout):
    # another list of event-like objects after traceEvents, markers and all: top-level data, not events
    trace = make_trace()
    trace["otherEvents"] = [kernel(0, 9e9, 1), launch("cudaLaunchKernel", 1, 1), kernel(0, 9e9, 2)]
    trace["traceName"] = "__sec:forward"
    path = write(tmp_path / "trace.json", trace, layout)
    for parser in ("auto", "json"):
        summary = st.summarize(path, parser=parser)
        assert summary["events"] == len(trace["traceEvents"]), parser
        check(summary["sections"], EXPECTED_KERNELS)


@pytest.mark.parametrize("chunk", [1, 5, 4096])
def test_raw_utf8_text_and_a_bom_split_across_chunks(tmp_path, monkeypatch, chunk):
    # chunks of 1 and 5 split multi-byte characters between reads; the buffer grows to hold an event, so
    # skimming works whatever the chunk
    trace = make_trace()
    events = trace["traceEvents"]
    for i, ev in enumerate(events):
        if ev.get("cat") == "cpu_op" and i % 3 == 0:
            ev["name"] = "aten::mm_ünïcødé_操作"  # multi-byte characters in skipped and decoded text alike
        if ev.get("cat") == "kernel":
            ev["name"] = "void k<ε>()"
    events.append(section("validación_検証", 0, 2500))  # a section named in UTF-8: reported as named
    trace["deviceProperties"] = [{"id": 0, "name": "Tésla Ü 80GB"}]
    body = ",\n".join(json.dumps(ev, ensure_ascii=False) for ev in events)
    text = "\ufeff" + '{"deviceProperties": ' + json.dumps(trace["deviceProperties"], ensure_ascii=False)
    text += ', "traceEvents": [\n' + body + "\n]}\n"
    plain, packed = tmp_path / "trace.json", tmp_path / "trace.json.gz"
    plain.write_bytes(text.encode("utf-8"))
    packed.write_bytes(gzip.compress(text.encode("utf-8")))
    monkeypatch.setattr(st, "_CHUNK_CHARS", chunk)
    full = st.summarize(plain, parser="json")
    for path in (plain, packed):
        for parser in ("auto", "orjson") if has("orjson") else ("auto",):
            skim = st.summarize(path, parser=parser)
            assert skim["parser"] == parser.replace("auto", "json") + "-skim"
            assert {**skim, "parser": "", "trace": ""} == {**full, "parser": "", "trace": ""}
            check(skim["sections"], EXPECTED_KERNELS)
            check(skim["sections"], {"validación_検証": (1, 2500e-6, 2500e-6, 2500e-6, 2500e-6)})
            assert skim["devices"] == ["Tésla Ü 80GB"]


def test_bytes_that_are_not_utf8_are_replaced_as_a_text_reader_would(tmp_path):
    text = kineto_text(make_trace()).replace('"__sec:step"', '"__sec:st\xffep"').encode("latin-1")
    (tmp_path / "trace.json").write_bytes(text)
    for parser in ("auto", "json", "orjson") if has("orjson") else ("auto", "json"):
        summary = st.summarize(tmp_path / "trace.json", parser=parser)
        assert summary["sections"]["st\ufffdep"]["count"] == 4, parser


# ------------------------------------------------------------------------- traces built to defeat skimming
# Names with C++ punctuation, separator-like text, quotes, escapes and non-ASCII characters inside strings
LONG_KERNEL = (
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
    "TensorListMetadata<4>, at::native::FusedAdamMathFunctor<float, 4>::{lambda()#1}, float*, float, bool>("
    "at::native::(anonymous namespace)::TensorListMetadata<4>, {lambda(float, float)#2}, float*, float, bool)"
)
ODD_NAMES = ('}, {"ph": "X", "cat": "kernel", "ts": 0}', "[{x}, {y}] ,{ ,[{ }]", 'say "hi" \\ é \u2028 操作', "{")
NESTED_LIKE_A_KERNEL = {
    "inputs": [{"x": 1}, {"ph": "X", "cat": "kernel", "ts": 0, "dur": 9e9, "args": {"correlation": 1}}]
}


def _render(ev, rng):
    """One event in a layout drawn at random: kineto's current template (a key a line, ``"dur": ...\\n    ,\\n
    "args": {``), the one before it (keys sharing lines), one line, minified, name first, args first and indented,
    CRLF and tabs."""
    ascii_only = rng.random() < 0.5
    dump = lambda v: json.dumps(v, ensure_ascii=ascii_only)  # noqa: E731
    keys = [k for k in ev if k != "args"]
    args = "" if "args" not in ev else dump(ev["args"])[1:-1]
    kind = rng.randrange(7)
    if kind == 0:
        body = ",\n".join(f"    {dump(k)}: {dump(ev[k])}" for k in keys)
        return "  {\n" + body + ("" if "args" not in ev else f'\n    ,\n    "args": {{\n      {args}\n    }}') + "\n  }"
    if kind == 1:
        first = ", ".join(f"{dump(k)}: {dump(ev[k])}" for k in keys[:5])
        rest = ", ".join(f"{dump(k)}: {dump(ev[k])}" for k in keys[5:])
        tail = "" if "args" not in ev else f',\n    "args": {{\n      {args}\n    }}'
        return f"  {{\n    {first}{',' if rest else ''}\n    {rest}{tail}\n  }}"
    if kind == 2:
        return json.dumps(ev, ensure_ascii=ascii_only)
    if kind == 3:
        return json.dumps(ev, ensure_ascii=ascii_only, separators=(",", ":"))
    if kind == 4:
        return json.dumps({"name": ev.get("name", ""), **ev}, ensure_ascii=ascii_only)
    if kind == 5:
        return json.dumps({"args": ev.get("args", {}), **ev}, ensure_ascii=ascii_only, indent=1)
    return json.dumps(ev, ensure_ascii=ascii_only, indent="\t").replace("\n", "\r\n")


def adversarial_trace(blocks, seed=0):
    """A trace of ``blocks`` training steps written to defeat skimming, and the section durations (µs) it holds.

    Per step: sections with launches and kernels (long C++ names), events in seven layouts mixed at random with
    random separators, names holding braces, brackets, quotes, escapes and event-like text, a list of objects
    written like a kernel inside an operator's args, empty and oddly keyed list elements, markers written with
    ``\\u`` escapes, and every fifth step a stretch of 300 operators without any marker."""
    rng = random.Random(seed)
    texts, expected = [], {"step": [], "forward": [], "backward": []}
    corr = itertools.count(1).__next__
    for b in range(blocks):
        t = 100_000 * b
        events = [{"name": "thread_name", "ph": "M", "pid": PID, "tid": TID, "args": {"name": f"thread {b}"}}]
        events.append(section("step", t, 9000 + b))
        expected["step"].append(9000 + b)
        for name, start, tid in (("forward", t + 100, TID), ("backward", t + 3000, OTHER_TID)):
            events.append(section(name, start, 2000))
            cs = [corr() for _ in range(3)]
            for i, c in enumerate(cs):
                events.append(cpu_op(ODD_NAMES[(b + i) % len(ODD_NAMES)], start + 10 + i, 5))
                events.append(launch(CUDA_LAUNCHES[i], start + 20 + 100 * i, c, tid=TID if name == "forward" else tid))
                events.append(
                    {"ph": "s", "id": c, "pid": PID, "tid": tid, "ts": start + 20, "cat": "ac2g", "name": "ac2g"}
                )
            span = 100 + b + (7 if name == "backward" else 0)
            for i, c in enumerate(cs):
                ev = kernel(t + 50_000 + (span - 40 if i == 2 else 10 * i), 40 if i == 2 else 10, c)
                ev["name"] = LONG_KERNEL
                events.append(ev)
            expected[name].append(span)
        events.append(
            {
                "ph": "X",
                "cat": "cpu_op",
                "name": "aten::cat",
                "pid": PID,
                "tid": TID,
                "ts": t,
                "dur": 1,
                "args": NESTED_LIKE_A_KERNEL,
            }
            if b % 3 == 0
            else {}
        )
        events.append({"1st key": "not a letter", "ph": "i", "ts": t})
        if b % 5 == 2:
            events += [cpu_op(f"aten::stack_{i}", t + 9000, 1) for i in range(300)]
        for ev in events:
            text = _render(ev, rng)
            if ev.get("cat") in ("kernel", "cuda_runtime") and rng.random() < 0.2:  # decoded, not matched byte by byte
                text = text.replace('"kernel"', '"\\u006bernel"').replace("Launch", "L\\u0061unch")
            texts.append(text.replace('"__sec:', '"\\u005f_sec:') if rng.random() < 0.1 else text)
    seps = (",\n", ", ", ",", "\n,\n", " ,\r\n\t")
    body = texts[0] + "".join(rng.choice(seps) + text for text in texts[1:])
    return '{"traceEvents": [\n' + body + '\n],\n"traceName": "__sec:kernel cudaLaunchKernel"}\n', expected


def check_durations(summary, expected_us):
    """Every section's statistics equal those of the durations the trace was built with."""
    for name, values in expected_us.items():
        values = sorted(values)
        want = (len(values), values[0] / 1e6, statistics.fmean(values) / 1e6, statistics.median(values) / 1e6)
        got = summary["sections"][name]
        assert (got["count"], got["min_s"], got["mean_s"], got["median_s"]) == pytest.approx(want, abs=1e-9), name
        assert got["max_s"] == pytest.approx(values[-1] / 1e6, abs=1e-9), name


@pytest.mark.parametrize("parser", ["auto", "orjson"])
def test_work_is_linear_in_the_trace_on_layouts_built_to_defeat_skimming(tmp_path, monkeypatch, parser):
    """Characters searched and decoded (counted, not timed) for 2N steps are at most ~2x those for N steps, and a
    bounded multiple of the characters read whatever the chunk size: no text is re-scanned per event or per
    fallback (a reader that searched the rest of its buffer again at each fallback does chunk/event work per
    character)."""
    needs(parser)
    full = {}
    for chunk in (1 << 12, 1 << 16):
        monkeypatch.setattr(st, "_CHUNK_CHARS", chunk)
        for blocks in (30, 60):
            text, expected = adversarial_trace(blocks)
            path = tmp_path / f"{blocks}.json"
            path.write_text(text, encoding="utf-8")
            work = {}
            summary = st.summarize(path, parser=parser, work=work)
            check_durations(summary, expected)
            if blocks not in full:
                full[blocks] = st.summarize(path, parser="json")
            assert {**summary, "parser": ""} == {**full[blocks], "parser": ""}
            assert work["read"] == len(text.encode("utf-8"))
            full[blocks, chunk] = work["indexed"] + work["decoded"]
            assert full[blocks, chunk] < 3 * work["read"], (chunk, blocks, work)
        assert full[60, chunk] < 2.2 * full[30, chunk], (chunk, full)


def test_an_event_larger_than_many_chunks_costs_linear_work(tmp_path, monkeypatch):
    """The buffer doubles to hold an event (or a top-level value) longer than a chunk, instead of growing a chunk at
    a time and scanning the event again after each (quadratic in its length)."""
    monkeypatch.setattr(st, "_CHUNK_CHARS", 1 << 10)
    trace = make_trace()
    huge = cpu_op("aten::mm", 1, 1)
    huge["args"] = {"Concrete Inputs": ["{[x]} " * 200_000]}
    trace["traceEvents"].insert(len(trace["traceEvents"]) // 2, huge)
    trace["distributedInfo"] = {"pg_config": [{"ranks": list(range(100_000))}]}
    path = write(tmp_path / "trace.json", trace)
    for parser in ("auto", "json"):
        work = {}
        summary = st.summarize(path, parser=parser, work=work)
        check(summary["sections"], EXPECTED_KERNELS)
        assert summary["events"] == len(trace["traceEvents"])
        assert work["indexed"] + work["decoded"] < 6 * work["read"], work
        assert work["fills"] < work["read"] / (1 << 10) / 2, work  # fewer refills than chunks: the buffer grew


def test_markers_written_with_unicode_escapes_are_found(tmp_path):
    text = kineto_text(make_trace())
    text = text.replace('"cudaLaunchKernel"', '"cudaLaunch\\u004bernel"').replace('"kernel"', '"\\u006bernel"')
    text = text.replace('"__sec:forward"', '"\\u005f_sec:forward"')
    (tmp_path / "trace.json").write_text(text)
    summary = st.summarize(tmp_path / "trace.json")
    assert summary["parser"] == "json-skim"
    check(summary["sections"], EXPECTED_KERNELS)
    check(summary["sections"], EXPECTED_CPU)


# ------------------------------------------------------------------------- every decoding path against the full decode
def odd_trace():
    """make_trace() with every oddity three times, raw UTF-8 and an escaped marker: text for every decoder path."""
    trace = make_trace()
    events = trace["traceEvents"]
    for oddity in ODDITIES.values():
        for at in (len(events) - 1, len(events) // 2, 1):
            events.insert(at, oddity)
    events.insert(5, section("validación_検証", 10, 2500))
    return trace


@pytest.mark.parametrize("parser", ["auto", "orjson"])
def test_skimming_gives_the_full_decodes_summary_on_every_decoding_path(tmp_path, monkeypatch, parser):
    """Every layout mix, taint, escape, non-ASCII and non-UTF-8 byte, buffer edge and event larger than a chunk
    gives the same summary (events counted, values, order) when picked events are decoded from their exact text
    as when every event is decoded (``parser="json"``); gzipped too."""
    needs(parser)
    adversarial, _ = adversarial_trace(12, seed=5)
    odd = kineto_text(odd_trace()).replace('"__sec:step"', '"__sec:st\xffep"')
    huge = make_trace()
    huge["traceEvents"].insert(9, {**cpu_op("aten::mm", 1, 1), "args": {"Concrete Inputs": ["{[x]} " * 4000]}})
    paths = {
        "adversarial": tmp_path / "adversarial.json",
        "odd": tmp_path / "odd.json.gz",
        "huge": write(tmp_path / "huge.json", huge, "lines"),
    }
    paths["adversarial"].write_text(adversarial, encoding="utf-8")
    paths["odd"].write_bytes(gzip.compress(odd.encode("latin-1")))
    for chunk in (1 << 12, 1 << 20):
        monkeypatch.setattr(st, "_CHUNK_CHARS", chunk)
        for name, path in paths.items():
            full = st.summarize(path, parser="json")
            skim = st.summarize(path, parser=parser)
            assert skim["parser"].endswith("-skim") and full["parser"] == "json", (name, chunk)
            assert {**skim, "parser": ""} == {**full, "parser": ""}, (name, chunk)
            if name == "odd":  # the non-UTF-8 byte replaced, the raw UTF-8 name read, the oddities counted
                assert skim["sections"]["st\ufffdep"]["count"] == 4
                assert skim["sections"]["validación_検証"]["count"] == 1
                assert skim["events"] == len(odd_trace()["traceEvents"])


def test_every_event_a_kind_takes_holds_its_marker_and_the_skimmer_searches_every_kinds_marker():
    """The skimmer decodes only events whose text holds a marker, so every event a kind of KINDS takes must hold its
    kind's marker as written (escaped text is decoded anyway: a backslash is a marker too)."""
    events = odd_trace()["traceEvents"] + json.loads(adversarial_trace(10)[0])["traceEvents"]
    taken = dict.fromkeys(st.KINDS, 0)
    for ev in events:
        for name, kind in st.KINDS.items():
            try:
                row = kind.row(ev, st._Numbers()) if isinstance(ev, dict) and ev.get("ph") == "X" else None
            except (AttributeError, KeyError, TypeError, ValueError):
                break
            if row is not None:
                assert len(row) == len(kind.fields), name
                assert kind.marker in json.dumps(ev, ensure_ascii=False), (name, ev)
                taken[name] += 1
                break
    assert all(taken.values()), taken
    assert set(st._markers()) == {kind.marker for kind in st.KINDS.values()} | {"\\"}


def test_a_new_kind_is_one_entry_in_the_table_and_the_skimmer_finds_its_events(tmp_path, monkeypatch):
    """A kind added to KINDS alone (here: CUPTI's stream syncs, whose GPU events hold no other marker once their
    correlation id is gone) is kept by every parser, the skimmer included: its marker is searched without any other
    edit."""
    trace = make_trace()
    sync = {"ph": "X", "cat": "cuda_sync", "name": "Stream Sync", "pid": GPU_PID, "tid": 9, "dur": 5}
    copies = [{**sync, "ts": t} for t in range(0, 50_000, 5000)]
    trace["traceEvents"][3:3] = copies
    path = write(tmp_path / "trace.json", trace)

    def copy_row(ev, numbers):
        return (float(ev["ts"]), float(ev["dur"])) if ev.get("cat") == "cuda_sync" else None

    kinds = {**st.KINDS, "copy": st.Kind("syncs timed", '"cuda_sync"', ("ts", "dur"), copy_row)}
    monkeypatch.setattr(st, "KINDS", kinds)
    made = recorded_collections(monkeypatch)
    for parser in ("auto", "orjson", "json") if has("orjson") else ("auto", "json"):
        summary = st.summarize(path, parser=parser)
        check(summary["sections"], EXPECTED_KERNELS)
        assert made[-1].count("copy") == len(copies), parser
        assert list(made[-1].columns("copy")[0]) == [float(c["ts"]) for c in copies], parser


@pytest.mark.parametrize("parser", ["auto", "orjson", "json"])
def test_a_malformed_event_is_named_by_its_byte(tmp_path, parser):
    needs(parser)
    text = kineto_text(make_trace())
    text, n = re.subn(r'"correlation": 2\b', '"correlation": 02', text, count=1)  # a leading zero: not JSON
    assert n == 1
    path = tmp_path / "trace.json"
    path.write_text(text)
    with pytest.raises(st.TraceError) as error:
        st.summarize(path, parser=parser)
    byte = text.index('"correlation": 02') + len('"correlation": 0')  # where the scanner finds the '2'
    assert f"trace.json: malformed JSON (Expecting ',' delimiter at byte {byte})" in str(error.value)


@pytest.mark.parametrize("fraction", [0.01, 0.37, 0.5, 0.81, 0.9999])
def test_a_cut_trace_of_mixed_layouts_is_reported_as_truncated(tmp_path, fraction):
    text, _ = adversarial_trace(8, seed=3)
    path = tmp_path / "cut.json"
    path.write_text(text[: int(len(text) * fraction)], encoding="utf-8")
    for parser in ("auto", "json"):
        with pytest.raises(st.TraceError, match=r"cut\.json: truncated JSON") as error:
            st.summarize(path, parser=parser)
        message = str(error.value)
        assert " at at " not in message and "inside in" not in message and "ends inside" not in message, message


def test_a_failure_early_in_a_compressed_trace_stops_reading_at_once(tmp_path, monkeypatch):
    path = tmp_path / "trace.json.gz"
    body = kineto_text(make_trace())
    path.write_bytes(gzip.compress(('{"traceEvents": [{"ph": "X"} {' + body * 200).encode()))  # malformed at once
    monkeypatch.setattr(st, "_CHUNK_CHARS", 1 << 12)
    before, work = threading.active_count(), {}
    with pytest.raises(st.TraceError, match="malformed"):
        st.summarize(path, work=work)
    assert threading.active_count() == before and work["read"] <= 1 << 13  # not inflated on behind the error


@pytest.mark.parametrize("suffix", [".json", ".json.gz"])
@pytest.mark.parametrize("good", [True, False], ids=["read", "malformed"])
def test_reading_leaves_no_thread_and_never_touches_the_interpreters_switch_interval(
    tmp_path, monkeypatch, suffix, good
):
    """The summariser is also called inside a training process (and may be called from two threads at once), so it
    must not start threads it leaves behind nor change interpreter-wide settings such as the GIL's switch interval,
    even for a while: whether the trace was read or refused, no thread is left and nothing was set."""
    text = kineto_text(make_trace()) if good else '{"traceEvents": [{"ph": "X"} {'
    path = tmp_path / f"trace{suffix}"
    path.write_bytes(gzip.compress(text.encode()) if suffix.endswith(".gz") else text.encode())
    calls = []
    monkeypatch.setattr(sys, "setswitchinterval", lambda value: calls.append(value))
    before = threading.active_count()
    if good:
        check(st.summarize(path)["sections"], EXPECTED_KERNELS)
    else:
        with pytest.raises(st.TraceError, match="malformed"):
            st.summarize(path)
    assert threading.active_count() == before and calls == []


def test_json_gz_and_zip_inputs_give_identical_results(tmp_path):
    text = kineto_text(make_trace())
    plain = tmp_path / "trace.json"
    plain.write_text(text)
    with gzip.open(tmp_path / "trace.json.gz", "wt") as f:
        f.write(text)
    with zipfile.ZipFile(tmp_path / "trace.json.zip", "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("rank0.pt.trace.json", text)
    results = [st.summarize(tmp_path / name) for name in ("trace.json", "trace.json.gz", "trace.json.zip")]
    assert results[0]["sections"] == results[1]["sections"] == results[2]["sections"]
    check(results[2]["sections"], EXPECTED_KERNELS)


def test_zip_without_exactly_one_json_member_names_its_members(tmp_path):
    path = tmp_path / "traces.json.zip"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("rank0.json", "[]")
        z.writestr("rank1.json", "[]")
        z.writestr("notes.txt", "")
    with pytest.raises(st.TraceError, match=r"exactly one \.json.*rank0\.json.*rank1\.json.*notes\.txt"):
        st.summarize(path)


@pytest.mark.parametrize("suffix", [".json", ".json.gz"])
def test_cli_leaves_the_input_file_unchanged(tmp_path, suffix):
    text = kineto_text(make_trace()).encode()
    path = tmp_path / f"trace{suffix}"
    path.write_bytes(gzip.compress(text) if suffix.endswith(".gz") else text)
    before = path.read_bytes()
    past = time.time() - 3600
    os.utime(path, (past, past))
    mtime = path.stat().st_mtime_ns
    result = run_cli(path)
    assert result.returncode == 0, result.stderr
    assert path.read_bytes() == before
    assert path.stat().st_mtime_ns == mtime


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "empty file"),
        ("   \n", "empty file"),
        (None, "truncated"),  # a kineto trace cut in the middle of an event
        ('{"traceEvents": [{"ph": "X", "name": "__sec:step", "ts": 1, "dur": 2}', "truncated"),
        ('{"schemaVersion": 1}', "not a chrome trace"),
        ('"just a string"', "not a chrome trace"),
        ('{"traceEvents": [{"ph": "X", "name": "aten::mm", "ts": 1, "dur": 2}]}', "no '__sec:' ranges"),
        ('{"traceEvents": []}', "no trace events"),
        ('{"traceEvents": [{"ph": "X"} {"ph": "X"}]}', "malformed"),
    ],
    ids=[
        "empty",
        "blank",
        "truncated-kineto",
        "truncated",
        "no-events-key",
        "string",
        "no-sections",
        "no-events",
        "malformed",
    ],
)
def test_bad_input_exits_non_zero_with_a_message_naming_the_file(tmp_path, content, message):
    if content is None:
        full = kineto_text(make_trace())
        content = full[: len(full) // 2]
    path = tmp_path / "bad trace.json"
    path.write_text(content)
    result = run_cli(path)
    assert result.returncode != 0
    assert str(path) in result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def test_missing_file_and_gzip_garbage_are_clear_errors(tmp_path):
    result = run_cli(tmp_path / "nowhere.json")
    assert result.returncode != 0 and "nowhere.json" in result.stderr and "Traceback" not in result.stderr
    garbage = tmp_path / "trace.json.gz"
    garbage.write_bytes(gzip.compress(b'{"traceEvents": [')[:-8] + b"\x00" * 8)
    with pytest.raises(st.TraceError, match=r"trace\.json\.gz"):
        st.summarize(garbage)


@pytest.mark.parametrize("chunk", [5, 4096, 1 << 22])
def test_gzip_members_and_padding_inflate_whole_at_any_chunk_boundary(tmp_path, monkeypatch, chunk):
    """Every member of a gzip file is read (zero padding between them skipped, as gzip does) and a cut stream is
    reported; the summary equals the plain file's."""
    monkeypatch.setattr(st, "_CHUNK_CHARS", chunk)
    text = kineto_text(make_trace()).encode()
    half = len(text) // 2
    packed = gzip.compress(text[:half]) + b"\0" * 5 + gzip.compress(text[half:]) + b"\0" * 3
    (tmp_path / "trace.json.gz").write_bytes(packed)
    (tmp_path / "trace.json").write_bytes(text)
    (tmp_path / "cut.json.gz").write_bytes(packed[: len(packed) - 40])
    plain = st.summarize(tmp_path / "trace.json")
    assert {**st.summarize(tmp_path / "trace.json.gz"), "trace": ""} == {**plain, "trace": ""}
    with pytest.raises(st.TraceError, match=r"cut\.json\.gz: cannot read.*end-of-stream marker.*still being written"):
        st.summarize(tmp_path / "cut.json.gz")


def test_cli_refuses_an_unknown_parser_naming_the_choices(tmp_path):
    result = run_cli(write(tmp_path / "trace.json", make_trace()), "--parser", "ijson")  # a parser it does not have
    assert result.returncode == 2 and "unknown parser 'ijson'; use one of auto, orjson, json" in result.stderr
    assert "Traceback" not in result.stderr


def test_json_format_has_the_documented_shape(tmp_path):
    result = run_cli(write(tmp_path / "trace.json", make_trace()), "--format", "json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert list(out["sections"]) == ["step", "loader_first", "loader_next", "forward", "backward", "optimizer"]
    for stats in out["sections"].values():
        assert set(stats) == {"count", "min_s", "mean_s", "median_s", "max_s"}
        assert isinstance(stats["count"], int)
    check(out["sections"], EXPECTED_KERNELS)
    check_device(out)


def test_text_table_lists_sections_in_pipeline_order_then_others(tmp_path):
    trace = make_trace()
    trace["traceEvents"] += [section("aaa_custom", 0, 1), section("validation", 0, 2_000_000)]
    result = run_cli(write(tmp_path / "trace.json", trace))
    assert result.returncode == 0, result.stderr
    rows = [line.split()[0] for line in result.stdout.splitlines()[3:11]]
    assert rows == [
        "step",
        "loader_first",
        "loader_next",
        "forward",
        "backward",
        "optimizer",
        "aaa_custom",
        "validation",
    ]
    assert "2.000000" in result.stdout  # the 2 s validation range, in seconds
    lines = result.stdout.splitlines()
    table = lines[lines.index("") + 1 :]  # after the sections and a blank line: the device table, then idle
    assert table[0] == "device time by kernel class (36 kernels, copies and memsets, 3.560 ms):"
    assert [line[:30].strip() for line in table[3:12]] == list(st.CLASS_ORDER)
    assert table[3].split()[-3:] == ["8", "0.080", "2.2"]  # convolution: 8 kernels, 80 µs of 3,560
    assert table[12] == (
        "device idle 90.0 % of the profiled steps (4 ProfilerStep ranges, 29.600 ms): 26.640 ms without a kernel, "
        "copy or memset running"
    )


def test_module_is_standalone_no_torch_no_bundle_imports(tmp_path):
    # load the file on its own in a fresh interpreter and look at what it pulled in
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('summarize_trace', {str(MODULE)!r})\n"
        "mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'monai', 'scripts'))\n"
        "print(bad)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
    # every import statement names a standard-library module (fire and orjson are imported only where optional)
    import ast

    allowed_optional = {"fire", "orjson", "argparse"}
    for node in ast.walk(ast.parse(MODULE.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "relative import"
            names = [node.module]
        for name in names:
            top = name.split(".")[0]
            assert top in sys.stdlib_module_names or top in allowed_optional or top == "__future__", name


def test_copied_file_runs_alone_without_fire_or_orjson(tmp_path):
    """The copy runs alone on a laptop with neither installed: argparse reads its options."""
    copy = tmp_path / "summarize_trace.py"
    copy.write_bytes(MODULE.read_bytes())
    trace = write(tmp_path / "trace.json", make_trace())
    code = (
        "import runpy, sys\n"
        "sys.modules['fire'] = None; sys.modules['orjson'] = None\n"  # as if neither were installed
        f"sys.argv = ['summarize_trace.py', {str(trace)!r}, '--format', 'json']\n"
        f"runpy.run_path({str(copy)!r}, run_name='__main__')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=60
    )
    assert result.returncode == 0, result.stderr
    check(json.loads(result.stdout)["sections"], EXPECTED_KERNELS)

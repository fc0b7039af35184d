"""Benchmark of ``scripts.summarize_trace`` on large synthetic torch.profiler chrome traces of several shapes.

Each shape is a CUDA/HIP training run as torch.profiler records it, written independently of the summariser (plain
string templates, no code from it): ``__sec:`` ranges (loader, step, forward, backward, optimizer), ``cpu_op`` events
with recorded shapes, runtime launch events whose names are CUDA-only, HIP-only or mixed (``cudaLaunchKernel``,
``cuLaunchKernel``, ``hipExtModuleLaunchKernel``, ...), ``kernel`` events on two streams tied to their launches by
``args.correlation``, ``ac2g`` flows, ``gpu_user_annotation`` copies of the section names, memcpys inside the loader
ranges (and one inside every forward), backward launches on autograd's own thread, and a step's GPU events written
after (``after``) or before (``before``) its CPU events. The text is in the layout torch writes (``kineto``: every
event opens with a line holding only ``  {``, one key per line) or one event per line (``compact``, as a trace
re-saved by another tool).

For every shape the benchmark

1. writes a small trace (a few MB), loads it whole with ``json.load`` and computes the statistics with an independent
   reference (:func:`reference_summary`), and checks both the generator's own record and the summariser's output
   against it (1e-6 s);
2. writes a large trace (``--size_gb``, 10^9 bytes uncompressed) as ``.json`` and ``.json.gz`` at once, streamed to
   disk step by step so the benchmark itself stays small;
3. runs ``python -m scripts.summarize_trace TRACE --format json --parser P`` in a child process for each file and
   parser, checks its statistics against the generator's record (1e-6 s), and measures the child's wall time,
   throughput (MB/s of uncompressed trace, 10^6 bytes; also per CPU second of the child, steadier on a shared
   machine, where it counts the read-ahead thread too), peak resident memory (the child's own ``VmHWM``; where
   ``/proc`` is missing, ``ru_maxrss`` from ``os.wait4``, which also counts this process's memory), the load
   average and the CPU time the hypervisor gave other machines meanwhile (``steal %``, from ``/proc/stat``: on a
   VM, a row measured while neighbours were busy is slow for reasons that are not the summariser's).

It prints a markdown table, one row per shape, file and parser, and the slowest row::

    python -m benchmarks.bench_trace [--size_gb 1.0] [--shapes all|cuda-after,mixed-before,...]
                                     [--parsers auto[,orjson,json,ijson]] [--output_dir DIR] [--keep false]
                                     [--json_out FILE]

``--parsers auto,orjson`` compares the standard library with the optional accelerator (``pip install orjson``).

Without ``--output_dir`` the traces go to a temporary folder that is removed afterwards (unless ``--keep true``).
"""

from __future__ import annotations

import gzip
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any, TextIO

ROOT = Path(__file__).resolve().parents[1]
PID, MAIN_TID, AUTOGRAD_TID, GPU_PID = 31337, 31337, 31402, 0
COMPUTE_STREAM, SIDE_STREAM, COPY_STREAM = 7, 20, 13
LAUNCHES = {  # (name, category) of the runtime/driver calls that launch kernels
    "cuda": (
        ("cudaLaunchKernel", "cuda_runtime"),
        ("cudaLaunchKernelExC", "cuda_runtime"),
        ("cuLaunchKernel", "cuda_driver"),
    ),
    "hip": (
        ("hipLaunchKernel", "cuda_runtime"),
        ("hipExtModuleLaunchKernel", "cuda_runtime"),
        ("hipModuleLaunchKernel", "cuda_runtime"),
    ),
}
LAUNCHES["mixed"] = tuple(x for pair in zip(LAUNCHES["cuda"], LAUNCHES["hip"], strict=True) for x in pair)
COPIES = {"cuda": ("cudaMemcpyAsync", "cudaStreamSynchronize"), "hip": ("hipMemcpyAsync", "hipStreamSynchronize")}
COPIES["mixed"] = COPIES["cuda"]
KERNEL_NAMES = (
    "void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl(at::TensorIteratorBase&, "
    "at::native::GeluType)::{lambda()#2}::operator()() const::{lambda()#2}::operator()() const::{lambda(float)#1}, "
    "at::detail::Array<char*, 2> >(int, at::native::GeluCUDAKernelImpl(at::TensorIteratorBase&, "
    "at::native::GeluType)::{lambda()#2}::operator()() const::{lambda()#2}::operator()() const::{lambda(float)#1}, "
    "at::detail::Array<char*, 2>)",
    "sm90_xmma_fprop_implicit_gemm_indexed_f16f16_f16f32_f32_ndhwc_kt3x3x3_nhwc_tilesize128x128x64_warpgroupsize1x1x1",
    "void cudnn::ops::nchwToNhwcKernel<__half, __half, float, false, true, (cudnnKernelDataType_t)0>"
    "(cudnn::ops::nchw2nhwc_params_t<float>, __half const*, __half*)",
    "Cijk_Ailk_Bljk_HHS_BH_MT128x128x32_MI32x32x8x1_SN_1LDSB0_APM1_ABV0_ACED0_AF0EM1_AF1EM1_AMAS3_ASE_ASGT_ASAE01_ASCE01",
    "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::Half, float>(int, float, "
    "c10::Half const*, c10::Half const*, c10::Half const*, float*, float*, c10::Half*)",
)
FORWARD_OPS = (("aten::conv3d", "aten::convolution"), ("aten::layer_norm", "aten::native_layer_norm"))
FORWARD_OPS += (("aten::gelu", "aten::gelu"), ("aten::linear", "aten::addmm"))
BACKWARD_OPS = ("ConvolutionBackward0", "NativeLayerNormBackward0", "GeluBackward0", "AddmmBackward0")
OPS_PER_SECTION = {"forward": 160, "backward": 320, "optimizer": 24}
SECTIONS = ("step", "loader_first", "loader_next", "forward", "backward", "optimizer")
STAT_KEYS = ("min_s", "mean_s", "median_s", "max_s")
TOLERANCE_S = 1e-6
SHAPES = tuple(f"{names}-{order}" for names in ("cuda", "hip", "mixed") for order in ("after", "before"))
SHAPES += ("mixed-after-compact", "mixed-before-compact")
SMALL_TRACE_BYTES = 3_000_000


def main(
    size_gb: float = 1.0,
    shapes: str = "all",
    parsers: str = "auto",
    output_dir: str | None = None,
    keep: bool | str = False,
    json_out: str | None = None,
) -> None:
    """Check every shape against the full-load reference, then time the summariser on large traces; print a table."""
    chosen = _split(shapes, SHAPES)
    parser_list = _split(parsers, ("auto", "orjson", "json", "ijson"))
    from scripts.config import as_bool

    keep = as_bool(keep, "keep")
    folder = Path(output_dir) if output_dir else Path(tempfile.mkdtemp(prefix="bench_trace_"))
    folder.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    problems: list[str] = []
    try:
        for shape in chosen:
            problems += [f"{shape} (small trace): {p}" for p in check_small(shape, folder, parser_list)]
            rows += _bench_shape(shape, folder, int(size_gb * 1e9), parser_list, keep or bool(output_dir))
    finally:
        if not keep and not output_dir:
            shutil.rmtree(folder, ignore_errors=True)
    problems += [f"{r['shape']} {r['file']} {r['parser']}: {r['check']}" for r in rows if r["check"] != "ok"]
    print(markdown_table(rows))
    if rows:
        slowest = min(rows, key=lambda r: r["mb_per_s"])
        print(
            f"\nslowest: {slowest['shape']} {slowest['file']} parser={slowest['parser']}: {slowest['mb_per_s']} MB/s; "
            f"largest peak RSS {max(r['peak_rss_mb'] for r in rows)} MB; load average {_load()}"
        )
    if json_out:
        Path(json_out).write_text(json.dumps({"rows": rows, "problems": problems}, indent=2) + "\n")
    if problems:
        print("\n".join(["problems:", *problems]), file=sys.stderr)
        raise SystemExit(1)


def check_small(shape: str, folder: Path, parsers: list[str]) -> list[str]:
    """Write a small trace of ``shape``; compare the generator's record and the summariser with a full load."""
    path = folder / f"small-{shape}.json"
    expected = write_trace(path, SMALL_TRACE_BYTES, shape)
    reference = reference_summary(path)
    problems = [f"generator: {p}" for p in compare(expected["sections"], reference)]
    for parser in parsers:
        run = run_summarizer(path, parser)
        if run["summary"] is None:
            problems.append(f"parser={parser}: {run['stderr'].strip() or 'no output'}")
        else:
            problems += [f"parser={parser}: {p}" for p in compare(run["summary"]["sections"], reference)]
    path.unlink()
    return problems


def _bench_shape(shape: str, folder: Path, size: int, parsers: list[str], keep: bool) -> list[dict[str, Any]]:
    """Write the large trace of ``shape`` (.json and .json.gz) and time every parser on both files."""
    plain, packed = folder / f"{shape}.json", folder / f"{shape}.json.gz"
    t0 = time.perf_counter()
    expected = write_trace(plain, size, shape, gz_path=packed)
    gen_s = time.perf_counter() - t0
    rows = []
    try:
        for path in (plain, packed):
            for parser in parsers:
                run = run_summarizer(path, parser)
                got = run["summary"]
                problems = compare(got["sections"], expected["sections"]) if got else [run["stderr"].strip()[-300:]]
                rows.append(_row(shape, path, plain.stat().st_size, expected, run, problems, gen_s))
                print(_row_line(rows[-1]), flush=True)
    finally:
        if not keep:
            plain.unlink(missing_ok=True)
            packed.unlink(missing_ok=True)
    return rows


def _row(
    shape: str, path: Path, size: int, expected: dict, run: dict, problems: list[str], gen_s: float
) -> dict[str, Any]:
    """One result row: shape, file kind, parser used, sizes, time, MB/s of uncompressed trace, peak RSS, check."""
    summary = run["summary"] or {}
    return {
        "shape": shape,
        "file": ".json.gz" if path.name.endswith(".gz") else ".json",
        "parser": summary.get("parser", run["parser"]),
        "trace_bytes": size,
        "file_bytes": path.stat().st_size,
        "events": expected["events"],
        "kernels": expected["kernels"],
        "wall_s": round(run["wall_s"], 2),
        "mb_per_s": round(size / 1e6 / run["wall_s"], 1),
        "cpu_s": round(run["cpu_s"], 2),
        "mb_per_cpu_s": round(size / 1e6 / max(run["cpu_s"], 1e-9), 1),
        "peak_rss_mb": round(run["maxrss_kb"] / 1024, 1),
        "load": _load(),
        "steal_pct": run.get("steal_pct"),
        "generate_s": round(gen_s, 1),
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "check": "ok" if not problems else "; ".join(problems),
    }


def _row_line(row: dict[str, Any]) -> str:
    """One progress line for a result row."""
    return (
        f"bench_trace: {row['shape']} {row['file']} ({row['trace_bytes'] / 1e9:.2f} GB, {row['events']} events, "
        f"{row['kernels']} kernels) parser={row['parser']}: {row['wall_s']} s, {row['mb_per_s']} MB/s, "
        f"{row['mb_per_cpu_s']} MB per CPU s, peak RSS {row['peak_rss_mb']} MB, load {row['load']}, "
        f"steal {row['steal_pct']} %, check {row['check']}"
    )


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table (shape, file, parser, GB, s, MB/s, MB per CPU second, peak RSS MB, load, steal %,
    check)."""
    lines = [
        "| shape | file | parser | trace GB | s | MB/s | MB per CPU s | peak RSS MB | load | steal % | check |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['file']} | {r['parser']} | {r['trace_bytes'] / 1e9:.2f} | {r['wall_s']} | "
            f"{r['mb_per_s']} | {r['mb_per_cpu_s']} | {r['peak_rss_mb']} | {r['load']} | {r.get('steal_pct')} | "
            f"{r['check']} |"
        )
    return "\n".join(lines)


# -------------------------------------------------------------------------------------------------------- generator
def write_trace(
    path: Path, min_bytes: int, shape: str = "mixed-after", gz_path: Path | None = None, ops_scale: float = 1.0
) -> dict[str, Any]:
    """Stream a synthetic trace of ``shape`` of at least ``min_bytes`` to ``path`` (and gzipped to ``gz_path``).

    ``ops_scale`` scales the operators per section (small steps for quick tests).

    Returns the statistics the trace was built with (:meth:`_TraceWriter.expected`).
    """
    gen = _TraceWriter(shape, ops_scale)
    with ExitStack() as stack:
        outs: list[TextIO] = [stack.enter_context(open(path, "w", encoding="utf-8"))]
        if gz_path is not None:
            outs.append(stack.enter_context(gzip.open(gz_path, "wt", encoding="utf-8", compresslevel=6)))
        written = 0
        for chunk in gen.chunks():
            for out in outs:
                out.write(chunk)
            written += len(chunk)
            if written >= min_bytes:
                break
        for out in outs:
            out.write(gen.footer())
    return gen.expected()


class _TraceWriter:
    """Writes one training step at a time and records the durations a correct summariser must report (µs)."""

    def __init__(self, shape: str, ops_scale: float = 1.0) -> None:
        parts = shape.split("-")
        if len(parts) not in (2, 3) or parts[0] not in LAUNCHES or parts[1] not in ("after", "before"):
            raise ValueError(f"unknown shape {shape!r}; use one of {', '.join(SHAPES)}")
        self.launches, self.copies = LAUNCHES[parts[0]], COPIES[parts[0]]
        self.kernels_first = parts[1] == "before"
        self.compact = parts[2:] == ["compact"]
        if parts[2:] not in ([], ["compact"]):
            raise ValueError(f"unknown layout in shape {shape!r}")
        self.t = 4_499_287_129_934.027  # µs, as kineto's absolute timestamps
        self.gpu_free = {COMPUTE_STREAM: self.t, SIDE_STREAM: self.t, COPY_STREAM: self.t}
        self.corr, self.ext, self.events, self.kernels, self.launch_index = 1, 1, 0, 0, 0
        self.durations: dict[str, list[float]] = {}
        self.ops = {name: max(1, round(n * ops_scale)) for name, n in OPS_PER_SECTION.items()}

    def chunks(self) -> Iterator[str]:
        """The header, then one step after another (without end: the caller stops and writes the footer)."""
        yield self.header()
        step = 0
        while True:
            yield self.step(step)
            step += 1

    def header(self) -> str:
        """The top-level keys before the events, as torch writes them."""
        return (
            '{\n  "schemaVersion": 1,\n  "deviceProperties": [\n    {\n      "id": 0, "name": "NVIDIA H100 80GB HBM3", '
            '"totalGlobalMem": 85045559296,\n      "computeMajor": 9, "computeMinor": 0\n    }\n  ],\n'
            '  "cupti_version": 24,\n  "cuda_runtime_version": 12080,\n  "cuda_driver_version": 12080,\n'
            '  "trace_id": "D14660C0FEE8493FB51EFB2C3B281A75",\n  "record_shapes": 1,\n'
            '  "displayTimeUnit": "ms",\n  "baseTimeNanoseconds": 1700000000000000000,\n  "traceEvents": [\n'
        )

    def footer(self) -> str:
        """The end of the event list and a trailing top-level key that holds marker texts (not an event)."""
        return '\n  ],\n  "traceName": "/runs/profiler/__sec:kernel-cudaLaunchKernel.json"\n}\n'

    def _emit(self, out: list[str], fields: list[tuple[str, str]], args: str | None) -> None:
        """Append one event; ``fields`` are (key, JSON text) pairs, ``args`` the JSON text inside ``args: {}``."""
        if self.compact:
            body = ", ".join(f'"{k}": {v}' for k, v in fields)
            text = "{" + body + (f', "args": {{{args}}}' if args is not None else "") + "}"
        else:
            body = ",\n".join(f'    "{k}": {v}' for k, v in fields)
            tail = f'\n    ,\n    "args": {{\n      {args}\n    }}' if args is not None else "\n    "
            text = "  {\n" + body + tail + "\n  }"
        out.append(text)
        self.events += 1

    def _x(
        self, out: list[str], cat: str, name: str, tid: int, ts: float, dur: float, args: str, pid: int = PID
    ) -> None:
        """A complete (``ph: X``) event with its fields in kineto's order."""
        fields = [("ph", '"X"'), ("cat", f'"{cat}"'), ("name", json.dumps(name)), ("pid", str(pid)), ("tid", str(tid))]
        self._emit(out, [*fields, ("ts", f"{ts:.3f}"), ("dur", f"{dur:.3f}")], args)

    def _flow(self, out: list[str], ph: str, pid: int, tid: int, ts: float, corr: int) -> None:
        """An ``ac2g`` flow start (``s``, at the launch) or end (``f``, at the kernel)."""
        fields = [("ph", f'"{ph}"'), ("id", str(corr)), ("pid", str(pid)), ("tid", str(tid)), ("ts", f"{ts:.3f}")]
        fields += [("cat", '"ac2g"'), ("name", '"ac2g"')] + ([("bp", '"e"')] if ph == "f" else [])
        self._emit(out, fields, None)

    def _range(self, out: list[str], gpu: list[str], name: str, ts: float, dur: float, span: tuple | None) -> None:
        """A ``__sec:`` range on the main thread (and its GPU-timeline copy over ``span`` when given)."""
        args = f'"External id": {self.ext},"Record function id": 0, "Ev Idx": {self.ext}'
        self._x(out, "user_annotation", f"__sec:{name}", MAIN_TID, ts, dur, args)
        if span is not None:
            args = f'"External id": {self.ext}'
            self._x(gpu, "gpu_user_annotation", f"__sec:{name}", COMPUTE_STREAM, span[0], span[1] - span[0], args, 0)
        self.ext += 1

    def _cpu_op(self, out: list[str], name: str, tid: int, ts: float, dur: float) -> None:
        """An operator with recorded shapes (sizes vary from op to op, as in a real network)."""
        c, d = 24 * (1 + self.ext % 5), 96 >> (self.ext % 4)
        args = (
            f'"External id": {self.ext},"Sequence number": {self.ext % 977}, "Fwd thread id": 0, '
            f'"Record function id": 0, "Concrete Inputs": ["", "", "", "[{d % 3}, 1, 1]", "[1, 1, 1]"], '
            '"Input type": ["c10::Half", "c10::Half", "c10::Half", "ScalarList", "ScalarList"], '
            f'"Input Strides": [[{c * d**3}, 1, {c * d * d}, {c * d}, 1], [{c * 27}, 1, {c * 9}, {c * 3}, {c}], '
            f'[1], [], []], "Input Dims": [[1, {c}, {d}, {d}, {d}], [{c}, {c}, 3, 3, 3], [{c}], [], []], '
            f'"Ev Idx": {self.ext}'
        )
        self._x(out, "cpu_op", name, tid, ts + (self.ext % 7) * 0.001, dur + (self.ext % 13) * 0.37, args)
        self.ext += 1

    def _launch(self, out: list[str], gpu: list[str], tid: int, stream: int, copy: bool = False) -> tuple[float, float]:
        """A runtime call on ``tid`` and its kernel (or memcpy) on ``stream``; returns the kernel's (start, end)."""
        ts, corr = self.t + 1.5, self.corr
        if copy:
            name, cat = self.copies[0], "cuda_runtime"
        else:
            name, cat = self.launches[self.launch_index % len(self.launches)]
            self.launch_index += 1
        args = f'"External id": {self.ext}, "cbid": {211 if not copy else 41}, "correlation": {corr}'
        self._x(out, cat, name, tid, ts, 6.125, args)
        self._flow(out, "s", PID, tid, ts, corr)
        start = round(max(ts + 9.0, self.gpu_free[stream] + 1.0), 3)
        dur = round(180.0 if copy else 3.0 + (corr * 7919 % 200) / 8.0, 3)
        if copy:
            args = (
                f'"External id": {self.ext}, "device": 0, "context": 1, "stream": {stream}, "correlation": {corr}, '
                '"bytes": 16777216, "memory bandwidth (GB/s)": 93.2'
            )
            self._x(gpu, "gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", stream, start, dur, args, GPU_PID)
        else:
            args = (
                f'"External id": {self.ext}, "queued": 0, "device": 0, "context": 1, "stream": {stream}, '
                f'"correlation": {corr}, "registers per thread": {32 + corr % 7 * 8}, "shared memory": '
                f'{corr % 5 * 4096}, "blocks per SM": {corr % 23 / 10}, "warps per SM": {corr % 67 / 10}, "grid": '
                f'[{corr % 997}, {1 + corr % 3}, 1], "block": [{128 << corr % 3}, 1, 1], "est. achieved occupancy %": '
                f"{corr % 100}"
            )
            self._x(gpu, "kernel", KERNEL_NAMES[corr % len(KERNEL_NAMES)], stream, start, dur, args, GPU_PID)
            self.kernels += 1
        self._flow(gpu, "f", GPU_PID, stream, start, corr)
        self.gpu_free[stream] = start + dur
        self.corr += 1
        self.ext += 1
        self.t += 10.0
        return start, round(start + dur, 3)

    def _section(self, out: list[str], gpu: list[str], name: str, ops: int) -> None:
        """A kernel-timed section; records first kernel start to last kernel end (copies do not count)."""
        ts = self.t
        self.t += 2.0
        if name == "forward":  # an input copy first: a copy is not a kernel, so it must not stretch the span
            self._cpu_op(out, "aten::to", MAIN_TID, self.t, 200.0)
            self._launch(out, gpu, MAIN_TID, COMPUTE_STREAM, copy=True)
        spans = []
        for i in range(ops):
            if name == "forward":
                outer, inner = FORWARD_OPS[i % len(FORWARD_OPS)]
                tid = MAIN_TID
            else:  # autograd's device thread runs the backward ops and launches their kernels
                inner = BACKWARD_OPS[i % len(BACKWARD_OPS)]
                outer, tid = f"autograd::engine::evaluate_function: {inner}", AUTOGRAD_TID
            self._cpu_op(out, outer, tid, self.t, 24.0)
            self._cpu_op(out, inner, tid, self.t + 1.0, 20.0)
            spans.append(self._launch(out, gpu, tid, SIDE_STREAM if i % 7 == 3 else COMPUTE_STREAM))
        self.t += 2.0
        span = (min(s for s, _ in spans), max(e for _, e in spans))
        self._range(out, gpu, name, ts, self.t - ts, span)
        self.durations.setdefault(name, []).append(span[1] - span[0])

    def step(self, index: int) -> str:
        """One training step's events: CPU events and GPU events in the shape's order."""
        out: list[str] = []
        gpu: list[str] = []
        loader = "loader_first" if index == 0 else "loader_next"
        loader_ts = self.t
        self.t += 5.0
        for _ in range(2):  # the batch's copies to the device, inside the loader range
            self._cpu_op(out, "aten::copy_", MAIN_TID, self.t, 20.0)
            self._launch(out, gpu, MAIN_TID, COPY_STREAM, copy=True)
        self.t += 1000.0 + (index * 37 % 1000)
        self._cpu_record(out, loader, loader_ts, self.t - loader_ts)
        self.t += 10.0
        step_ts = self.t
        self.t += 5.0
        self._section(out, gpu, "forward", self.ops["forward"] + index % 3)
        self._section(out, gpu, "backward", self.ops["backward"] + index % 5)
        opt_ts = self.t
        for _ in range(self.ops["optimizer"]):  # launched outside forward/backward: not theirs
            self._cpu_op(out, "aten::_foreach_add_", MAIN_TID, self.t, 8.0)
            self._launch(out, gpu, MAIN_TID, COMPUTE_STREAM)
        self._cpu_record(out, "optimizer", opt_ts, self.t - opt_ts)
        self.t += 5.0
        self._cpu_record(out, "step", step_ts, self.t - step_ts)
        self.t = max(self.t, *self.gpu_free.values()) + 20.0
        events = gpu + out if self.kernels_first else out + gpu
        return ("" if index == 0 else ",\n") + ",\n".join(events)

    def _cpu_record(self, out: list[str], name: str, ts: float, dur: float) -> None:
        """A CPU-timed range: its duration as the summariser must read it back (3 decimals)."""
        self._range(out, [], name, ts, dur, None)
        self.durations.setdefault(name, []).append(round(dur, 3))

    def expected(self) -> dict[str, Any]:
        """Events and kernels written, and count/min/mean/median/max (s) of every section."""
        return {
            "events": self.events,
            "kernels": self.kernels,
            "sections": {name: _stats(values) for name, values in self.durations.items()},
        }


# -------------------------------------------------------------------------------------------------------- reference
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
    return {name: _stats(values) for name, values in durations.items()}


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


def _stats(values_us: list[float]) -> dict[str, Any]:
    """count, min, mean, median, max (s) of durations in µs, unrounded."""
    return {
        "count": len(values_us),
        "min_s": min(values_us) / 1e6,
        "mean_s": statistics.fmean(values_us) / 1e6,
        "median_s": statistics.median(values_us) / 1e6,
        "max_s": max(values_us) / 1e6,
    }


# ------------------------------------------------------------------------------------------------------------ runner
# The child reports its own peak RSS (VmHWM, of the process image after exec): ru_maxrss from wait4 would include
# the memory of this (larger) benchmark process, which the child borrows between fork and exec.
_CHILD = """
import runpy, sys
sys.argv = sys.argv[1:]
try:
    runpy.run_module("scripts.summarize_trace", run_name="__main__", alter_sys=True)
finally:
    try:
        with open("/proc/self/status") as status:
            hwm = [line.split()[1] for line in status if line.startswith("VmHWM:")]
        sys.stderr.write(f"\\nVmHWM {hwm[0]}\\n")
    except (OSError, IndexError):
        pass
"""


def run_summarizer(trace: Path, parser: str) -> dict[str, Any]:
    """Run the CLI in a child process; its wall time, peak RSS (KiB) and parsed JSON output."""
    cmd = [sys.executable, "-c", _CHILD, "summarize_trace", str(trace), "--format", "json", "--parser", parser]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        steal0 = _cpu_jiffies()
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=err)
        if hasattr(os, "wait4"):
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
            maxrss, cpu = usage.ru_maxrss, usage.ru_utime + usage.ru_stime
        else:  # pragma: no cover - non-Unix
            proc.wait()
            usage = resource.getrusage(resource.RUSAGE_CHILDREN)
            maxrss, cpu = usage.ru_maxrss, usage.ru_utime + usage.ru_stime
        wall = time.perf_counter() - t0
        steal1 = _cpu_jiffies()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(), err.read().decode()
    hwm = [line.split()[1] for line in stderr.splitlines() if line.startswith("VmHWM ")]
    summary = json.loads(stdout) if proc.returncode == 0 else None
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "maxrss_kb": int(hwm[-1]) if hwm else maxrss,
        "summary": summary,
        "stderr": "\n".join(line for line in stderr.splitlines() if not line.startswith("VmHWM ")),
        "parser": parser,
        "steal_pct": _steal_pct(steal0, steal1),
    }


def _cpu_jiffies() -> tuple[int, int] | None:
    """(steal, total) CPU time of the machine in jiffies from /proc/stat; None where there is none."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (fields[7] if len(fields) > 7 else 0), sum(fields[:8])


def _steal_pct(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The share of CPU time the hypervisor gave other machines while a row ran (a VM's noisy neighbours: the
    row's MB/s is then low for reasons not the summariser's)."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return round(100 * (after[0] - before[0]) / (after[1] - before[1]), 1)


def _split(value: str | tuple | list, allowed: tuple[str, ...]) -> list[str]:
    """A comma-separated choice (or ``all``) checked against ``allowed``."""
    items = list(value) if isinstance(value, (tuple, list)) else [v.strip() for v in str(value).split(",") if v.strip()]
    if items == ["all"]:
        return list(allowed)
    unknown = [v for v in items if v not in allowed]
    if unknown or not items:
        raise SystemExit(f"bench_trace: unknown {unknown or 'empty choice'}; choose from {', '.join(allowed)}")
    return items


def _load() -> float:
    """The 1-minute load average now (benchmarks on a shared machine are noisy)."""
    return round(os.getloadavg()[0], 2)


if __name__ == "__main__":
    import fire

    fire.Fire(main)

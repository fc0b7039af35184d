"""Benchmark of ``scripts.profiling.summarize_trace`` on large synthetic torch.profiler chrome traces of several shapes.

Each shape is a CUDA/HIP training run as torch.profiler records it, written independently of the summariser (plain
string templates, no code from it): ``__sec:`` ranges (loader, step, forward, backward, optimizer), ``cpu_op`` events
with recorded shapes, runtime launch events whose names are CUDA-only, HIP-only or mixed (``cudaLaunchKernel``,
``cuLaunchKernel``, ``hipExtModuleLaunchKernel``, ...), ``kernel`` events on two streams tied to their launches by
``args.correlation``, ``ac2g`` flows, ``gpu_user_annotation`` copies of the section names, memcpys inside the loader
ranges (and one inside every forward), backward launches on autograd's own thread. A shape is named
``NAMES-ORDER[-LAYOUT]``:

* order: a step's GPU events written after (``after``) or before (``before``) its CPU events, or kineto's own order
  (``window``): every CPU event of the profiling window, the CPU trace's span, then the GPU activities (runtime
  calls with them, each followed by its flow start, kernels by their flow end), then thread and process names, the
  GPU span, the ``gpu_user_annotation`` copies and ``Record Window End`` (GPU events held in a spool file meanwhile);
* layout: one key a line (no suffix: ``"dur": ...\\n    ,\\n    "args": {``), one event a line (``compact``, as
  another tool re-saves a trace), or libkineto's ``output_json.cpp`` templates verbatim: ``kineto`` (since April
  2026: one key a line; metadata with ``ph`` first; the stream-sync row's name in the older template; instants with
  an empty line where ``cat`` would be; flow ends with ``\\n    , "bp": "e"``), ``kineto22`` (April 2022 - April
  2026, as the torch releases of those years write it: keys sharing lines, ``"ts"``/``"dur"`` on the next; metadata
  and global instants with ``name`` before ``ph``; CUPTI/roctracer metadata whose line breaks were removed;
  ``distributedInfo`` with a list of objects after the events), or ``jumble`` (adversarial: each event in one of
  eight layouts drawn at random with odd whitespace around separators; names holding ``}, {"ph": ...``, ``[{``,
  escaped quotes, backslashes, raw and ``\\u``-escaped non-ASCII characters, and sometimes markers written with
  ``\\u`` escapes; lists of objects, one written like a kernel, inside operators' args; empty objects in the event
  list; one-line metadata events first).

The ``kineto``, ``kineto22`` and ``jumble`` shapes also hold what real CUDA/HIP traces hold beyond that: kernel
names that are C++ signatures of 50 to 760 characters (``{lambda()#1}``, ``(anonymous namespace)``, ``<...>``), CUPTI
occupancy objects in kernel args, HIP launch args naming their kernel, ``[memory]`` instants, ``python_function``
frames, ``fwdbwd`` flows, ``Stream Sync`` events, trace spans with string pids, and every 8th step a loader stretch of
13,000 to 27,000 events without any kernel, launch or section.

For every shape the benchmark

1. writes a small trace (a few MB), loads it whole with ``json.load`` and computes the statistics with an independent
   reference (:func:`reference_summary`), and checks both the generator's own record and the summariser's output
   against it (1e-6 s);
2. writes a large trace (``--size_gb``, 10^9 bytes uncompressed) as ``.json``, streamed to disk step by step so the
   benchmark itself stays small, then gzips it (``.json.gz``, level 6);
3. runs ``scripts/profiling/summarize_trace.py TRACE --format json --parser P`` (the file, run as ``__main__``) in a
child
   process for each file and parser, checks its statistics against the generator's record (1e-6 s), and measures
   the child's wall time, throughput (MB/s of uncompressed trace, 10^6 bytes; also per CPU second of the child and
   any process it starts, steadier on a shared machine), peak resident memory (the child's own
   ``VmHWM``, plus the peak of any process it starts, as 0.5.1 did to decode; where ``/proc`` is missing,
   ``ru_maxrss`` from ``os.wait4``, which also counts this process's memory), the load average and the CPU time the
   hypervisor gave other machines meanwhile (``steal %``, from ``/proc/stat``: on a VM, a row measured while
   neighbours were busy is slow for reasons that are not the summariser's).

It prints a markdown table, one row per shape, file and parser, and the slowest row::

    python -m benchmarks.bench_trace [--size_gb 1.0] [--shapes all|cuda-after,cuda-window-kineto,...]
                                     [--parsers auto[,orjson,json]] [--output_dir DIR] [--keep false]
                                     [--json_out FILE] [--repeat N] [--baseline FILE [--baseline_label NAME]]

``--parsers auto,orjson`` compares the standard library with the optional accelerator (``pip install orjson``).
``--baseline /tmp/st_051/summarize_trace.py`` also times another copy of the summariser (e.g. ``git show
v0.5.1:scripts/profiling/summarize_trace.py``), run in its child exactly as this one, on the same files, interleaved run
by run (a ``version`` column labels the rows: ``new`` and ``--baseline_label``), so one table compares two versions
measured in the same minutes.

Without ``--output_dir`` the traces go to a temporary folder that is removed afterwards (unless ``--keep true``); with
it, they are kept with the generator's record (``SHAPE.expected.json``) and a later run of the same size reuses them.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
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
# Long C++ signatures (200-700 characters) as CUPTI and rocprofiler demangle them, for the kineto-layout shapes
_ADD = (
    "at::native::gpu_kernel_impl_nocast<at::native::CUDAFunctor_add<c10::Half> >(at::TensorIteratorBase&, "
    "at::native::CUDAFunctor_add<c10::Half> const&)::{lambda(int)#1}"
)
_SUM = (
    "at::native::ReduceOp<float, at::native::func_wrapper_t<float, at::native::sum_functor<float, float, float>::"
    "operator()(at::TensorIterator&)::{lambda(float, float)#1}>, unsigned int, float, 4, 4>"
)
_ADAM = "at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, (at::native::ADAM_MODE)1, false>"
_CAST = (
    "at::detail::Array<char*, 3>, TrivialOffsetCalculator<2, unsigned int>, TrivialOffsetCalculator<1, "
    "unsigned int>, at::native::memory::LoadWithCast<2>, at::native::memory::StoreWithCast<1>"
)
_UNROLLED = f"void at::native::unrolled_elementwise_kernel<{_ADD}, {_CAST} >(int, {_ADD}, {_CAST})"
CUDA_KERNEL_NAMES = (
    _UNROLLED,
    f"void at::native::elementwise_kernel<128, 2, {_ADD}>(int, {_ADD})",
    f"void at::native::reduce_kernel<512, 1, {_SUM} >({_SUM})",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
    f"TensorListMetadata<4>, {_ADAM}, float*, float, float, float, float, float, float, bool, float*, float*>("
    f"at::native::(anonymous namespace)::TensorListMetadata<4>, {_ADAM}, float*, float, float, float, float, float, "
    "float, bool, float*, float*)",
    "sm90_xmma_fprop_implicit_gemm_indexed_f16f16_f16f32_f32_ndhwc_kt3x3x3_nhwc_tilesize128x128x64_warpgroupsize1x1x1",
    *KERNEL_NAMES[::2],
    "void cutlass::Kernel2<cutlass_80_wmma_tensorop_f16_s161616gemm_f16_32x32_128x2_tn_align8>("
    "cutlass_80_wmma_tensorop_f16_s161616gemm_f16_32x32_128x2_tn_align8::Params)",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::(anonymous "
    "namespace)::SoftMaxForwardEpilogue>(float*, float const*, int)",
)
HIP_KERNEL_NAMES = (
    f"void at::native::elementwise_kernel<128, 2, {_ADD}>(int, {_ADD})",
    "Cijk_Ailk_Bljk_HHS_BH_MT128x128x32_MI32x32x8x1_SN_1LDSB0_APM1_ABV0_ACED0_AF0EM1_AF1EM1_AMAS3_ASE_ASGT_ASAE01_ASCE01"
    "_ASEM1_AAC0_BL1_BS1_DTL0_DTVA0_DVO0_ETSP_EPS1_FL0_GRPM1_GRVW8_GSU1_GSUASB_GLS0_ISA942_IU1_K1_KLA_LBSPPA128",
    "naive_conv_ab_nonpacked_fwd_ndhwc_half_double_half",
    f"void at::native::reduce_kernel<512, 1, {_SUM} >({_SUM})",
    "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::Half, float>(int, float, "
    "c10::Half const*, c10::Half const*, c10::Half const*, float*, float*, c10::Half*)",
    "igemm_fwd_gtcx35_nhwc_fp16_bx0_ex1_bt256x128x32_wt32x32x8_ws2x1_wr2x2_ta1x8x2x1_1x4x1x64_tb1x8x1x1_1x4x1x64_pta",
    _UNROLLED,
)
PYTHON_FRAMES = (
    "torch/nn/modules/module.py(1784): _call_impl",
    "monai/networks/nets/swin_unetr.py(1027): forward",
    "torch/nn/modules/conv.py(717): forward",
    "torch/utils/data/_utils/collate.py(171): collate",
    "monai/data/utils.py(488): list_data_collate",
)
CPU_STRETCH_EVENTS = 20_000  # a marker-free loader stretch every 8th step of the kineto-layout shapes (x 2/3 to 4/3)
SYNC_ROW_OFFSET = 1_000_000  # kineto's kSyncStreamTidOffset: the Stream Sync row of a stream
ORDERS = ("after", "before", "window")
LAYOUTS = ("keys", "compact", "kineto", "kineto22", "jumble")
SHAPES = tuple(f"{names}-{order}" for names in ("cuda", "hip", "mixed") for order in ("after", "before"))
SHAPES += ("mixed-after-compact", "mixed-before-compact")
SHAPES += ("cuda-window-kineto", "hip-window-kineto", "cuda-window-kineto22", "hip-window-kineto22")
SHAPES += ("mixed-window-jumble", "mixed-after-jumble")
SMALL_TRACE_BYTES = 3_000_000
SUMMARIZER = ROOT / "scripts" / "summarize_trace.py"
PARSERS = ("auto", "orjson", "json")


def main(
    size_gb: float = 1.0,
    shapes: str = "all",
    parsers: str = "auto",
    output_dir: str | None = None,
    keep: bool | str = False,
    json_out: str | None = None,
    repeat: int = 1,
    baseline: str | None = None,
    baseline_label: str = "baseline",
) -> None:
    """Check every shape against the full-load reference, then time the summariser on large traces; print a table.

    ``repeat`` runs each file and parser that many times, in rounds (every file and parser once, then again), and
    reports the fastest run with every run's MB/s beside it: on a shared VM whose speed changes from minute to minute
    the fastest of a few runs measures the code, and the spread shows the machine. ``baseline``: another copy of
    ``summarize_trace.py``, timed too (after each run of this one, on the same file and parser), its rows labelled
    ``baseline_label``."""
    chosen = _split(shapes, SHAPES)
    parser_list = _split(parsers, PARSERS)
    versions = {"new": SUMMARIZER}
    if baseline:
        if not Path(baseline).is_file() or str(baseline_label) == "new":
            raise SystemExit(f"bench_trace: --baseline {baseline} is not a file, or is labelled 'new'")
        versions[str(baseline_label)] = Path(baseline).resolve()
    from scripts.common.config import as_bool

    keep = as_bool(keep, "keep")
    folder = Path(output_dir) if output_dir else Path(tempfile.mkdtemp(prefix="bench_trace_"))
    folder.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    problems: list[str] = []
    try:
        for shape in chosen:
            problems += [f"{shape} (small trace): {p}" for p in check_small(shape, folder, parser_list, versions)]
            kept = keep or bool(output_dir)
            rows += _bench_shape(shape, folder, int(size_gb * 1e9), parser_list, kept, int(repeat), versions)
    finally:
        if not keep and not output_dir:
            shutil.rmtree(folder, ignore_errors=True)
    problems += [
        f"{r['shape']} {r['file']} {r['parser']} {r['version']}: {r['check']}" for r in rows if r["check"] != "ok"
    ]
    print(markdown_table(rows))
    if rows:
        slowest = min(rows, key=lambda r: r["mb_per_s"])
        for version in versions:
            mine = [r for r in rows if r["version"] == version]
            slowest = min(mine, key=lambda r: r["mb_per_s"])
            print(
                f"\nslowest{'' if len(versions) == 1 else ' of ' + version}: {slowest['shape']} {slowest['file']} "
                f"parser={slowest['parser']}: {slowest['mb_per_s']} MB/s; largest peak RSS "
                f"{max(r['peak_rss_mb'] for r in mine)} MB; load average {_load()}"
            )
    if json_out:
        Path(json_out).write_text(json.dumps({"rows": rows, "problems": problems}, indent=2) + "\n")
    if problems:
        print("\n".join(["problems:", *problems]), file=sys.stderr)
        raise SystemExit(1)


def check_small(shape: str, folder: Path, parsers: list[str], versions: dict[str, Path] | None = None) -> list[str]:
    """Write a small trace of ``shape``; compare the generator's record and the summariser (each version of it)
    with a full load."""
    path = folder / f"small-{shape}.json"
    expected = write_trace(path, SMALL_TRACE_BYTES, shape)
    reference, device = reference_summary(path), reference_device(path)
    problems = [f"generator: {p}" for p in compare(expected["sections"], reference)]
    problems += [f"generator: {p}" for p in compare_device(_as_summary(expected["device"]), device)]
    for parser in parsers:
        for version, script in (versions or {"new": SUMMARIZER}).items():
            run = run_summarizer(path, parser, script)
            if run["summary"] is None:
                problems.append(f"{version} parser={parser}: {run['stderr'].strip() or 'no output'}")
            else:
                found = compare(run["summary"]["sections"], reference)
                found += compare_device(run["summary"], device if version == "new" else None)
                problems += [f"{version} parser={parser}: {p}" for p in found]
    path.unlink()
    return problems


def _bench_shape(
    shape: str,
    folder: Path,
    size: int,
    parsers: list[str],
    keep: bool,
    repeat: int = 1,
    versions: dict[str, Path] | None = None,
) -> list[dict[str, Any]]:
    """Write the large trace of ``shape`` (.json and .json.gz; kept ones reused) and time every parser of every
    version on both files ``repeat`` times (in rounds, the versions one after the other on each file and parser); a
    row per file, parser and version: its fastest run, every run's MB/s, and every run's check."""
    plain, packed = folder / f"{shape}.json", folder / f"{shape}.json.gz"
    expected, gen_s = _large_trace(shape, plain, packed, size, keep)
    runs: dict[tuple[Path, str, str], list[dict[str, Any]]] = {}
    try:
        for _ in range(max(1, repeat)):
            for path in (plain, packed):
                for parser in parsers:
                    for version, script in (versions or {"new": SUMMARIZER}).items():
                        run = run_summarizer(path, parser, script)
                        got = run["summary"]
                        device = expected.get("device") if version == "new" else None  # a baseline may predate it
                        problems = (
                            compare(got["sections"], expected["sections"]) + compare_device(got, device)
                            if got
                            else [run["stderr"].strip()[-300:]]
                        )
                        row = _row(shape, path, plain.stat().st_size, expected, run, problems, gen_s)
                        row["version"] = version
                        runs.setdefault((path, parser, version), []).append(row)
                        print(_row_line(row), flush=True)
    finally:
        if not keep:
            plain.unlink(missing_ok=True)
            packed.unlink(missing_ok=True)
    rows = []
    for tried in runs.values():
        best = dict(min(tried, key=lambda r: r["wall_s"]))
        best["runs_mb_per_s"] = [r["mb_per_s"] for r in tried]
        failed = [r["check"] for r in tried if r["check"] != "ok"]
        best["check"] = failed[0] if failed else "ok"
        rows.append(best)
    return rows


def _large_trace(shape: str, plain: Path, packed: Path, size: int, keep: bool) -> tuple[dict[str, Any], float]:
    """Write the large trace of ``shape`` (and its gzip), or reuse the kept ones of the same size; the generator's
    record and the seconds it took to write them."""
    record = plain.with_name(f"{shape}.expected.json")
    if keep and record.is_file() and plain.is_file() and packed.is_file():
        saved = json.loads(record.read_text())
        if saved["size"] == size and saved["files"] == [plain.stat().st_size, packed.stat().st_size]:
            print(f"bench_trace: reusing {plain} and {packed.name}", flush=True)
            return saved["expected"], saved["generate_s"]
    record.unlink(missing_ok=True)
    t0 = time.perf_counter()
    expected = write_trace(plain, size, shape, gz_path=packed)
    gen_s = time.perf_counter() - t0
    if keep:  # written last: its presence says both files are whole
        files = [plain.stat().st_size, packed.stat().st_size]
        record.write_text(json.dumps({"size": size, "files": files, "expected": expected, "generate_s": gen_s}))
    return expected, gen_s


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
        f"{row['kernels']} kernels) {row.get('version', 'new')} parser={row['parser']}: {row['wall_s']} s, "
        f"{row['mb_per_s']} MB/s, "
        f"{row['mb_per_cpu_s']} MB per CPU s, peak RSS {row['peak_rss_mb']} MB, load {row['load']}, "
        f"steal {row['steal_pct']} %, check {row['check']}"
    )


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table (shape, file, parser, version where there are several, GB, s, MB/s, MB per CPU
    second, peak RSS MB, load, steal %, check, and every run's MB/s where there are several)."""
    several = any(len(r.get("runs_mb_per_s", [])) > 1 for r in rows)
    versions = len({r.get("version", "new") for r in rows}) > 1
    lines = [
        "| shape | file | parser |"
        + (" version |" if versions else "")
        + " trace GB | s | MB/s | MB per CPU s | peak RSS MB | load | steal % | check |"
        + (" MB/s of each run |" if several else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if versions else "") + ("---|" if several else ""),
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['file']} | {r['parser']} |"
            + (f" {r.get('version', 'new')} |" if versions else "")
            + f" {r['trace_bytes'] / 1e9:.2f} | {r['wall_s']} | "
            f"{r['mb_per_s']} | {r['mb_per_cpu_s']} | {r['peak_rss_mb']} | {r['load']} | {r.get('steal_pct')} | "
            f"{r['check']} |" + (f" {', '.join(map(str, r.get('runs_mb_per_s', [])))} |" if several else "")
        )
    return "\n".join(lines)


# -------------------------------------------------------------------------------------------------------- generator
def write_trace(
    path: Path, min_bytes: int, shape: str = "mixed-after", gz_path: Path | None = None, ops_scale: float = 1.0
) -> dict[str, Any]:
    """Stream a synthetic trace of ``shape`` of at least ``min_bytes`` to ``path`` (and gzipped to ``gz_path``).

    ``ops_scale`` scales the operators per section and the long CPU-only stretches (small steps for quick tests).
    ``window`` shapes hold a step's GPU activities in a spool file until every CPU event is written, as kineto
    writes a profiling window.

    Returns the statistics the trace was built with (:meth:`_TraceWriter.expected`).
    """
    gen = _TraceWriter(shape, ops_scale)
    with ExitStack() as stack:
        out = stack.enter_context(open(path, "w", encoding="utf-8", newline=""))
        out.write(gen.header())
        events = _EventList(out)
        spool = None
        if gen.window:
            spool = _EventList(stack.enter_context(tempfile.TemporaryFile("w+", encoding="utf-8", newline="")))
        events.add(gen.opening())
        step = 0
        while events.written + (spool.written if spool else 0) < min_bytes:
            cpu, gpu = gen.step(step)
            if spool is not None:
                events.add(cpu)
                spool.add(gpu)
            else:
                events.add(gpu + cpu if gen.kernels_first else cpu + gpu)
            step += 1
        events.add(gen.cpu_closing())
        if spool is not None and spool.written:
            spool.out.seek(0)
            out.write(",\n" if events.written else "")
            shutil.copyfileobj(spool.out, out, 1 << 22)
            events.written += spool.written
            events.first = False
        events.add(gen.closing())
        out.write(gen.footer())
    if gz_path is not None:
        with open(path, "rb") as plain, gzip.open(gz_path, "wb", compresslevel=6) as packed:
            shutil.copyfileobj(plain, packed, 1 << 22)
    return gen.expected()


class _EventList:
    """Events written to a text stream, separated as kineto separates them (``},\\n  {``)."""

    def __init__(self, out: TextIO) -> None:
        self.out, self.first, self.written = out, True, 0

    def add(self, events: list[str]) -> None:
        """Append the events' texts (each an object, without the separator)."""
        if not events:
            return
        text = ("" if self.first else ",\n") + ",\n".join(events)
        self.first = False
        self.out.write(text)
        self.written += len(text)


# kineto's templates (libkineto/src/output_json.cpp). An event is (kind, fields, args): fields maps keys to JSON
# texts in the writer's key order, args is the text inside ``"args": {...}`` (None: no args).
_PH = {"X": '"X"', "M": '"M"', "M-inline": '"M"', "i": '"i"'}


def _k26(kind: str, f: dict[str, str], args: str | None) -> str:
    """Kineto since April 2026 (``refactor JSON chrome trace writing``): one key a line, ``"dur": ...\\n    ,\\n
    "args": {``; metadata with ``ph`` first; instants keep an empty line where their ``cat`` would be."""
    field = "" if args is None else f',\n    "args": {{\n      {args}\n    }}'
    if kind == "X":
        return (
            f'  {{\n    "ph": "X",\n    "cat": {f["cat"]},\n    "name": {f["name"]},\n    "pid": {f["pid"]},\n'
            f'    "tid": {f["tid"]},\n    "ts": {f["ts"]},\n    "dur": {f["dur"]}\n    {field}\n  }}'
        )
    if kind == "flow":
        bp = ', "bp": "e"' if "bp" in f else ""
        return (
            f'  {{\n    "ph": {f["ph"]},\n    "id": {f["id"]},\n    "pid": {f["pid"]},\n    "tid": {f["tid"]},\n'
            f'    "ts": {f["ts"]},\n    "cat": {f["cat"]},\n    "name": {f["name"]}\n    {bp}\n  }}'
        )
    if kind == "M":
        return (
            f'  {{\n    "ph": "M",\n    "name": {f["name"]},\n    "ts": {f["ts"]},\n    "pid": {f["pid"]},\n'
            f'    "tid": {f["tid"]},\n    "args": {{\n      {args}\n    }}\n  }}'
        )
    if kind == "M-inline":  # the stream-sync row's thread name: the older template, kept inline in 2026
        return (
            f'  {{\n    "name": {f["name"]}, "ph": "M", "ts": {f["ts"]}, "pid": {f["pid"]}, "tid": {f["tid"]},\n'
            f'    "args": {{\n      {args}\n    }}\n  }}'
        )
    cat = f'\n    "cat": {f["cat"]},' if "cat" in f else ""  # kind "i"
    return (
        f'  {{\n    "ph": "i",\n    {cat}\n    "s": {f["s"]},\n    "name": {f["name"]},\n    "pid": {f["pid"]},\n'
        f'    "tid": {f["tid"]},\n    "ts": {f["ts"]}\n    {field}\n  }}'
    )


def _k22(kind: str, f: dict[str, str], args: str | None) -> str:
    """Kineto April 2022 - April 2026 (commits 1679e50e to c51fcfea): keys share lines (``"ph": "X", "cat": ...,
    "name": ..., "pid": ..., "tid": ...,`` then ``"ts": ..., "dur": ...,``); metadata and global instants with
    ``name`` first."""
    field = "" if args is None else f',\n    "args": {{\n      {args}\n    }}'
    if kind == "X" and f["cat"] == '"Trace"':
        return (
            f'  {{\n    "ph": "X", "cat": "Trace", "ts": {f["ts"]}, "dur": {f["dur"]},\n    "pid": {f["pid"]}, '
            f'"tid": {f["tid"]},\n    "name": {f["name"]}{field}\n  }}'
        )
    if kind == "X":
        return (
            f'  {{\n    "ph": "X", "cat": {f["cat"]}, "name": {f["name"]}, "pid": {f["pid"]}, "tid": {f["tid"]},\n'
            f'    "ts": {f["ts"]}, "dur": {f["dur"]}{field}\n  }}'
        )
    if kind == "flow":
        bp = ', "bp": "e"' if "bp" in f else ""
        return (
            f'  {{\n    "ph": {f["ph"]}, "id": {f["id"]}, "pid": {f["pid"]}, "tid": {f["tid"]}, "ts": {f["ts"]},\n'
            f'    "cat": {f["cat"]}, "name": {f["name"]}{bp}\n  }}'
        )
    if kind in ("M", "M-inline"):
        return (
            f'  {{\n    "name": {f["name"]}, "ph": "M", "ts": {f["ts"]}, "pid": {f["pid"]}, "tid": {f["tid"]},\n'
            f'    "args": {{\n      {args}\n    }}\n  }}'
        )
    if "cat" in f:  # an instant of the CPU trace ([memory])
        return (
            f'  {{\n    "ph": "i", "cat": {f["cat"]}, "s": {f["s"]}, "name": {f["name"]},\n    "pid": {f["pid"]}, '
            f'"tid": {f["tid"]},\n    "ts": {f["ts"]}{field}\n  }}'
        )
    return (  # global instants: iteration start, record window end
        f'  {{\n    "name": {f["name"]}, "ph": "i", "s": {f["s"]},\n    "pid": {f["pid"]}, "tid": {f["tid"]}, '
        f'"ts": {f["ts"]}\n  }}'
    )


def _one_line(kind: str, f: dict[str, str], args: str | None, sep: str = ", ", colon: str = ": ") -> str:
    """The event on one line (as tools re-save traces), keys in the writer's order."""
    items = [f'"{k}"{colon}{v}' for k, v in f.items()]
    if args is not None:
        items.append(f'"args"{colon}{{{args}}}')
    return "{" + sep.join(items) + "}"


class _Jumble:
    """Each event in a layout drawn at random: both kineto templates, one line, minified, name first, args first,
    one key a line with CRLF and tabs, spaces around colons; separators with odd whitespace around them."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def __call__(self, kind: str, f: dict[str, str], args: str | None) -> str:
        """One event's text."""
        r = self.rng.random()
        if r < 0.25:
            text = _k26(kind, f, args)
        elif r < 0.45:
            text = _k22(kind, f, args)
        elif r < 0.6:
            text = _one_line(kind, f, args)
        elif r < 0.7:
            text = _one_line(kind, f, args, ",", ":")
        elif r < 0.78:
            text = _one_line(kind, {"name": f.get("name", '""'), **f}, args)
        elif r < 0.84 and args is not None:
            text = "{" + f'"args": {{\n  {args}\n}},\n' + ", ".join(f'"{k}": {v}' for k, v in f.items()) + "}"
        elif r < 0.92:
            items = [f'\t"{k}" : {v}' for k, v in f.items()] + ([] if args is None else [f'\t"args" : {{ {args} }}'])
            text = "{\r\n" + " ,\r\n".join(items) + "\r\n}"
        else:
            text = _one_line(kind, f, args, " ,  ", " :\n ")
        pad = self.rng.random()
        if pad < 0.1:
            return "\n\n   " + text + " "
        if pad < 0.15:
            return "\t" + text + "\r\n"
        return text


# Adversarial texts for the jumble shape: braces, brackets, quotes, escapes and separator-like text inside strings
ODD_NAMES = (
    "aten::_foreach_add_ (lambda [{x}, {y}])",
    'torch/_dynamo/eval_frame.py(632): _fn {"device": "cuda:0"}',
    'void k<"a", \'b\'>() }, {"ph": "X", "cat": "kernel"} ]',
    "µs-timer ünïcødé 操作 \u2028 {[(",
    'back\\slash \\u0041 and \\"quoted\\"',
    '}},{{ [[ ]] ,{ ,[{ "x": 1}]',
)
NESTED_ARGS = (
    '"Concrete Inputs": [{"dtype": "c10::Half", "shape": [1, {"n": 2}]}, {"ph": "X", "cat": "kernel", "ts": 0, '
    '"dur": 9e9, "args": {"correlation": 1}}], "Input type": ["", "ScalarList"]'
)


class _TraceWriter:
    """Writes one training step at a time and records the durations a correct summariser must report (µs)."""

    def __init__(self, shape: str, ops_scale: float = 1.0) -> None:
        parts = shape.split("-")
        if len(parts) not in (2, 3) or parts[0] not in LAUNCHES or parts[1] not in ORDERS:
            raise ValueError(f"unknown shape {shape!r}; use one of {', '.join(SHAPES)}")
        self.layout = parts[2] if len(parts) == 3 else "keys"
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown layout in shape {shape!r}; use one of {', '.join(LAYOUTS)}")
        self.launches, self.copies = LAUNCHES[parts[0]], COPIES[parts[0]]
        self.hip = parts[0] == "hip"
        self.kernels_first, self.window = parts[1] == "before", parts[1] == "window"
        self.compact = self.layout == "compact"
        self.rich = self.layout in ("kineto", "kineto22", "jumble")  # kineto's other events, long kernel names
        self.rng = random.Random(sum(map(ord, shape)))
        self.render = {"kineto": _k26, "kineto22": _k22, "jumble": _Jumble(self.rng)}.get(self.layout)
        self.legacy_args = self.layout == "kineto22"
        self.kernel_names = (HIP_KERNEL_NAMES if self.hip else CUDA_KERNEL_NAMES) if self.rich else KERNEL_NAMES
        self.t = 4_499_287_129_934.027  # µs, as kineto's absolute timestamps
        self.t0 = self.t
        self.gpu_free = {COMPUTE_STREAM: self.t, SIDE_STREAM: self.t, COPY_STREAM: self.t}
        self.corr, self.ext, self.events, self.kernels, self.launch_index = 1, 1, 0, 0, 0
        self.durations: dict[str, list[float]] = {}
        self.on_device: list[tuple[float, float]] = []  # this step's kernels and copies (start, end), µs
        self.device = {"events": 0, "us": 0.0, "wall_us": 0.0, "busy_us": 0.0}  # every step's, for expected()
        self.ops = {name: max(1, round(n * ops_scale)) for name, n in OPS_PER_SECTION.items()}
        self.stretch = max(2, round(CPU_STRETCH_EVENTS * ops_scale))
        self.annotations: list[str] = []  # window shapes: the GPU copies of the ranges, written at the end
        self.synced: set[int] = set()

    # ----------------------------------------------------------------------------------------- header and footer
    def header(self) -> str:
        """The top-level keys before the events, as torch writes them."""
        if self.layout == "kineto":
            meta = "".join(f'\n      "{k}": {v},' for k, v in self._metadata())
            return (
                ' {\n    "schemaVersion": 1,\n    "deviceProperties": ['
                + self._device_json(False)
                + "],\n    "
                + meta
                + '\n    "displayTimeUnit": "ms",\n    "baseTimeNanoseconds": 1700000000000000000,\n'
                '    "traceEvents": [\n    \n'
            )
        if self.layout in ("kineto22", "jumble"):
            meta = "".join(f'\n      "{k}": {v},' for k, v in self._metadata())
            return (
                '\n  {\n    "schemaVersion": 1,\n    "deviceProperties": ['
                + self._device_json(True)
                + "\n    ],"
                + meta
                + '\n  "displayTimeUnit": "ms",\n  "baseTimeNanoseconds": 1700000000000000000,\n  "traceEvents": [\n'
            )
        return (
            '{\n  "schemaVersion": 1,\n  "deviceProperties": [\n    {\n      "id": 0, "name": "NVIDIA H100 80GB HBM3", '
            '"totalGlobalMem": 85045559296,\n      "computeMajor": 9, "computeMinor": 0\n    }\n  ],\n'
            '  "cupti_version": 24,\n  "cuda_runtime_version": 12080,\n  "cuda_driver_version": 12080,\n'
            '  "trace_id": "D14660C0FEE8493FB51EFB2C3B281A75",\n  "record_shapes": 1,\n'
            '  "displayTimeUnit": "ms",\n  "baseTimeNanoseconds": 1700000000000000000,\n  "traceEvents": [\n'
        )

    def _metadata(self) -> list[tuple[str, str]]:
        """Trace-level metadata torch and kineto add (``metadataToJSON``), a path holding marker texts included."""
        if self.hip:
            version = [("roctracer_version", "4"), ("hip_runtime_version", "60342134")]
        else:
            version = [("cupti_version", "26"), ("cuda_runtime_version", "12090"), ("cuda_driver_version", "13000")]
        return [
            ("trace_id", '"D14660C0FEE8493FB51EFB2C3B281A75"'),
            ("with_stack", "1"),
            ("record_shapes", "1"),
            ("profile_memory", "1"),
            ("PT_PROFILER_DIR", '"/runs/train/profiler/__sec:kernel cudaLaunchKernel"'),
            *version,
        ]

    def _device_json(self, legacy: bool) -> str:
        """``deviceProperties``: kineto's template per version (2022-2026 spread over lines, 2026 on one)."""
        name, mem, sms = (
            ("AMD Instinct MI300X", 205822885888, 304) if self.hip else ("NVIDIA H100 80GB HBM3", 85045559296, 132)
        )
        extra = (
            [("maxSharedMemoryPerMultiProcessor", "65536")]
            if self.hip
            else [
                ("regsPerMultiprocessor", "65536"),
                ("sharedMemPerBlockOptin", "232448"),
                ("sharedMemPerMultiprocessor", "233472"),
            ]
        )
        if not legacy:
            fields = [("id", "0"), ("name", f'"{name}"'), ("totalGlobalMem", str(mem)), ("computeMajor", "9")]
            fields += [("computeMinor", "0"), ("maxThreadsPerBlock", "1024"), ("maxThreadsPerMultiprocessor", "2048")]
            fields += [("regsPerBlock", "65536"), ("warpSize", "64" if self.hip else "32")]
            fields += [("sharedMemPerBlock", "49152"), ("numSms", str(sms)), *extra]
            return "{" + ", ".join(f'"{k}": {v}' for k, v in fields) + "}"
        tail = ", ".join(f'"{k}": {v}' for k, v in extra)
        return (
            f'\n    {{\n      "id": 0, "name": "{name}", "totalGlobalMem": {mem},\n      "computeMajor": 9, '
            '"computeMinor": 0,\n      "maxThreadsPerBlock": 1024, "maxThreadsPerMultiprocessor": 2048,\n'
            f'      "regsPerBlock": 65536, "warpSize": {64 if self.hip else 32},\n      "sharedMemPerBlock": 49152, '
            f'"numSms": {sms}\n    , {tail}\n    }}'
        )

    def footer(self) -> str:
        """The end of the event list and the top-level keys after it (marker texts and a list of objects among
        them: not events)."""
        name = '"/runs/profiler/__sec:kernel-cudaLaunchKernel.pt.trace.json"'
        if self.layout == "kineto":
            return f'\n  ],"traceName": {name} }}'
        if self.layout in ("kineto22", "jumble"):
            dist = (
                '\n  "distributedInfo": {"backend": "nccl", "rank": 0, "world_size": 2, "pg_count": 2, "pg_config": '
                '[{"pg_name": "0", "pg_desc": "default_pg", "backend_config": "cuda:nccl", "pg_size": 2, "ranks": '
                '[0, 1]},{"pg_name": "1", "pg_desc": "undefined", "backend_config": "cuda:nccl", "pg_size": 2, '
                '"ranks": [0, 1]}], "nccl_version": "2.21.5"},'
            )
            warn = '\n      "WARNING": ["cudaLaunchKernel on __sec:forward: \\"kernel\\" {x}, {y}"],'
            return f'\n  ],{dist}{warn}\n  "traceName": {name}\n}}'
        return '\n  ],\n  "traceName": "/runs/profiler/__sec:kernel-cudaLaunchKernel.json"\n}\n'

    def opening(self) -> list[str]:
        """Events before the first step: none from kineto; the jumble shape starts with metadata events, one a
        line, some with ``name`` before ``ph``."""
        if self.layout != "jumble":
            return []
        out: list[str] = []
        for pid, label in ((PID, "CPU"), (GPU_PID, "GPU 0")):
            fields = {"name": '"process_name"', "ph": '"M"', "ts": self._ts(self.t0), "pid": str(pid), "tid": "0"}
            self._put(out, "M", fields, f'"name": "{label}"', _one_line)
            fields = {"ph": '"M"', "name": '"process_labels"', "pid": str(pid), "tid": "0", "ts": self._ts(self.t0)}
            self._put(out, "M", fields, f'"labels": "{label}"', _one_line)
        return out

    def cpu_closing(self) -> list[str]:
        """After the CPU events of the window: kineto's span of the CPU trace, its sort index, the iteration
        marker."""
        if not self.rich:
            return []
        out: list[str] = []
        start, dur = self._ts(self.t0), self._ts(self.t - self.t0)
        span = {"cat": '"Trace"', "name": '"PyTorch Profiler (0)"', "pid": '"Spans"', "tid": '"PyTorch Profiler"'}
        self._put(out, "X", {**span, "ts": start, "dur": dur}, '"Op count": 0')
        meta = {"name": '"process_sort_index"', "ts": start, "pid": '"Spans"', "tid": "0"}
        self._put(out, "M", meta, '"sort_index": 536870912')
        marker = {"s": '"g"', "name": '"Iteration Start: PyTorch Profiler"', "pid": '"Traces"'}
        self._put(out, "i", {**marker, "tid": '"Trace PyTorch Profiler"', "ts": start}, None)
        return out

    def closing(self) -> list[str]:
        """After the GPU activities: thread and process names, the GPU copies of the ranges (window shapes) and
        the record window's end, as kineto's ``finalizeTrace`` writes them."""
        if not self.rich:
            return []
        out: list[str] = []
        start = self._ts(self.t0)
        for pid, tid, name in (
            (PID, MAIN_TID, "thread 31337 (python3)"),
            (PID, AUTOGRAD_TID, "thread 31402 (pt_autograd_0)"),
        ):
            self._put(
                out, "M", {"name": '"thread_name"', "ts": start, "pid": str(pid), "tid": str(tid)}, f'"name": "{name}"'
            )
            self._put(
                out,
                "M",
                {"name": '"thread_sort_index"', "ts": start, "pid": str(pid), "tid": str(tid)},
                f'"sort_index": {tid}',
            )
        for stream in (COMPUTE_STREAM, SIDE_STREAM, COPY_STREAM):
            fields = {"name": '"thread_name"', "ts": start, "pid": str(GPU_PID), "tid": str(stream)}
            self._put(out, "M", fields, f'"name": "stream {stream}"')
        for pid in (PID, *range(16)):
            label = "CPU" if pid == PID else f"GPU {pid}"
            for key, arg in (("process_name", '"name": "python3"'), ("process_labels", f'"labels": "{label}"')):
                self._put(out, "M", {"name": f'"{key}"', "ts": start, "pid": str(pid), "tid": "0"}, arg)
            self._put(
                out,
                "M",
                {"name": '"process_sort_index"', "ts": start, "pid": str(pid), "tid": "0"},
                f'"sort_index": {pid}',
            )
        span = {"cat": '"Trace"', "name": '"GPU: PyTorch Profiler (0)"', "pid": '"Spans"', "tid": '"PyTorch Profiler"'}
        self._put(out, "X", {**span, "ts": start, "dur": self._ts(self.t - self.t0)}, f'"Op count": {self.kernels}')
        out += self.annotations
        self.annotations = []
        end = {"s": '"g"', "name": '"Record Window End"', "pid": '""', "tid": '""', "ts": self._ts(self.t + 50.0)}
        self._put(out, "i", end, None)
        return out

    # ------------------------------------------------------------------------------------------------ one event
    @staticmethod
    def _ts(value: float) -> str:
        return f"{value:.3f}"

    def _put(self, out: list[str], kind: str, fields: dict[str, str], args: str | None, render: Any = None) -> None:
        """Append one event of a rich layout, rendered by that layout's template (or ``render``)."""
        if "ph" not in fields:
            fields = {"ph": _PH[kind], **fields}
        out.append((render or self.render)(kind, fields, args))
        self.events += 1

    def _emit(self, out: list[str], fields: list[tuple[str, str]], args: str | None) -> None:
        """Append one event; ``fields`` are (key, JSON text) pairs, ``args`` the JSON text inside ``args: {}``."""
        if self.render is not None:
            kind = "flow" if fields[0][1] in ('"s"', '"f"') else "X"
            self._put(out, kind, dict(fields), args)
            return
        if self.compact:
            body = ", ".join(f'"{k}": {v}' for k, v in fields)
            text = "{" + body + (f', "args": {{{args}}}' if args is not None else "") + "}"
        else:
            body = ",\n".join(f'    "{k}": {v}' for k, v in fields)
            tail = f'\n    ,\n    "args": {{\n      {args}\n    }}' if args is not None else "\n    "
            text = "  {\n" + body + tail + "\n  }"
        out.append(text)
        self.events += 1

    def _name(self, name: str) -> str:
        """A name as JSON text; the jumble shape sometimes escapes characters that need no escape (a reader must
        decode, not match bytes)."""
        if self.layout == "jumble" and self.rng.random() < 0.004:
            return '"' + "".join(f"\\u{ord(c):04x}" if c in "Lkeo_" else json.dumps(c)[1:-1] for c in name) + '"'
        return json.dumps(name, ensure_ascii=self.layout != "jumble" or self.rng.random() < 0.5)

    def _x(
        self, out: list[str], cat: str, name: str, tid: int, ts: float, dur: float, args: str, pid: int = PID
    ) -> None:
        """A complete (``ph: X``) event with its fields in kineto's order."""
        cat_text = (
            '"\\u006bernel"'
            if cat == "kernel" and self.layout == "jumble" and self.rng.random() < 0.003
            else f'"{cat}"'
        )
        fields = [("ph", '"X"'), ("cat", cat_text), ("name", self._name(name) if self.rich else json.dumps(name))]
        fields += [("pid", str(pid)), ("tid", str(tid))]
        self._emit(out, [*fields, ("ts", f"{ts:.3f}"), ("dur", f"{dur:.3f}")], args)

    def _flow(self, out: list[str], ph: str, pid: int, tid: int, ts: float, corr: int, cat: str = "ac2g") -> None:
        """An ``ac2g`` flow start (``s``, at the launch) or end (``f``, at the kernel); ``fwdbwd`` between ops."""
        fields = [("ph", f'"{ph}"'), ("id", str(corr)), ("pid", str(pid)), ("tid", str(tid)), ("ts", f"{ts:.3f}")]
        fields += [("cat", f'"{cat}"'), ("name", f'"{cat}"')] + ([("bp", '"e"')] if ph == "f" else [])
        self._emit(out, fields, None)

    def _args(self, pairs: list[tuple[str, Any]], legacy_breaks: tuple[int, ...] = ()) -> str:
        """``External id`` and an activity's metadata as kineto joins them: ``,`` after the external id, ``, ``
        between the rest. The 2022-2026 templates start the metadata on a new line and break lines before the
        fields at ``legacy_breaks`` (indices into ``pairs``); ``sanitizeStrForJSON`` removed the breaks and left
        their indentation."""
        head = f'"External id": {pairs[0][1]},'
        if not self.legacy_args:
            return head + ", ".join(f'"{k}": {v}' for k, v in pairs[1:])
        text = ""
        for i, (k, v) in enumerate(pairs[1:], 1):
            text += ("      " if i == 1 else ",      " if i in legacy_breaks else ", ") + f'"{k}": {v}'
        return head + text

    # ----------------------------------------------------------------------------------------- events of a step
    def _range(self, out: list[str], gpu: list[str], name: str, ts: float, dur: float, span: tuple | None) -> None:
        """A ``__sec:`` range on the main thread (and its GPU-timeline copy over ``span`` when given)."""
        args = f'"External id": {self.ext},"Record function id": 0, "Ev Idx": {self.ext}'
        self._x(out, "user_annotation", f"__sec:{name}", MAIN_TID, ts, dur, args)
        if span is not None:
            args = f'"External id": {self.ext}'
            copy: list[str] = self.annotations if self.window and self.rich else gpu
            self._x(copy, "gpu_user_annotation", f"__sec:{name}", COMPUTE_STREAM, span[0], span[1] - span[0], args, 0)
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
        if self.layout == "jumble":
            r = self.rng.random()
            if r < 0.01:
                args = f'"External id": {self.ext},' + NESTED_ARGS
            if 0.01 <= r < 0.04:
                name = self.rng.choice(ODD_NAMES)
        self._x(out, "cpu_op", name, tid, ts + (self.ext % 7) * 0.001, dur + (self.ext % 13) * 0.37, args)
        if self.rich and self.ext % 4 == 0:  # profile_memory: the allocator's instant events
            fields = {"cat": '"cpu_instant_event"', "s": '"t"', "name": '"[memory]"', "pid": str(PID), "tid": str(tid)}
            mem = (
                f'"Total Reserved": {2097152 * (1 + self.ext % 97)}, "Total Allocated": '
                f'{1048576 * (1 + self.ext % 89)}, "Bytes": {512 * (1 + self.ext % 31)}, "Addr": '
                f'{139872512 + self.ext * 512}, "Device Id": 0, "Device Type": 1'
            )
            self._put(out, "i", {**fields, "ts": self._ts(ts + 0.5)}, mem)
        self.ext += 1

    def _python(self, out: list[str], name: str, tid: int, ts: float, dur: float) -> None:
        """A Python frame (``with_stack``): no marker in it."""
        args = f'"Python parent id": {self.ext - 1}, "Python id": {self.ext}, "Python thread": 0'
        self._x(out, "python_function", name, tid, ts, dur, args)
        self.ext += 1

    def _launch_args(self, name: str, corr: int, copy: bool, stream: int) -> str:
        """The runtime call's args: CUDA's cbid, or HIP's cid with the kernel's name, grid and block."""
        if not self.rich:
            return f'"External id": {self.ext}, "cbid": {211 if not copy else 41}, "correlation": {corr}'
        if not self.hip:
            return self._args([("External id", self.ext), ("cbid", 211 if not copy else 41), ("correlation", corr)])
        if copy:
            pairs = [("External id", self.ext), ("cid", 52), ("correlation", corr), ("src", '"0x7f3a2c000000"')]
            return self._args([*pairs, ("dst", '"0x7f3a10000000"'), ("bytes", '"16777216"'), ("kind", '"1"')])
        kernel = json.dumps(self.kernel_names[corr % len(self.kernel_names)])
        grid, block = f"[{corr % 997}, {1 + corr % 3}, 1]", f"[{128 << corr % 3}, 1, 1]"
        pairs = [("External id", self.ext), ("kernel", kernel), ("cid", 3), ("correlation", corr)]
        return self._args([*pairs, ("grid", grid), ("block", block), ("shared memory", corr % 5 * 4096)], (1, 4, 5, 6))

    def _kernel_args(self, corr: int, stream: int) -> str:
        """A kernel's args as the tracer writes them (CUPTI's occupancy fields; HIP's queue and kind)."""
        if not self.rich:
            return (
                f'"External id": {self.ext}, "queued": 0, "device": 0, "context": 1, "stream": {stream}, '
                f'"correlation": {corr}, "registers per thread": {32 + corr % 7 * 8}, "shared memory": '
                f'{corr % 5 * 4096}, "blocks per SM": {corr % 23 / 10}, "warps per SM": {corr % 67 / 10}, "grid": '
                f'[{corr % 997}, {1 + corr % 3}, 1], "block": [{128 << corr % 3}, 1, 1], "est. achieved occupancy %": '
                f"{corr % 100}"
            )
        grid, block = f"[{corr % 997}, {1 + corr % 3}, 1]", f"[{128 << corr % 3}, 1, 1]"
        if self.hip:
            pairs = [("External id", self.ext), ("device", 0), ("stream", stream), ("hsa_queue", 94021 + stream)]
            pairs += [("correlation", corr), ("kind", '"KERNEL_DISPATCH"'), ("grid", grid), ("block", block)]
            return self._args(pairs, (1, 4, 6))
        sep = ",        " if self.legacy_args else ", "
        occupancy = sep.join(
            f'"{k}": {v}'
            for k, v in (
                ("activeBlocksPerMultiprocessor", 8 + corr % 8),
                ("limitingFactors", '"WARPS|REGS"' if corr % 3 else '"SMEM"'),
                ("blockLimitRegs", 8),
                ("blockLimitSharedMem", 32),
                ("blockLimitWarps", 16),
                ("blockLimitBlocks", 32),
                ("blockLimitBarriers", 32),
                ("allocatedRegistersPerBlock", 8192),
                ("allocatedSharedMemPerBlock", corr % 5 * 4096),
            )
        )
        occupancy = "{        " + occupancy + "      }" if self.legacy_args else "{" + occupancy + "}"
        pairs = [("External id", self.ext), ("queued", 0), ("device", 0), ("context", 1), ("stream", stream)]
        pairs += [
            ("correlation", corr),
            ("registers per thread", 32 + corr % 7 * 8),
            ("shared memory", corr % 5 * 4096),
        ]
        pairs += [("blocks per SM", f"{corr % 23 / 10:.6f}"), ("warps per SM", f"{corr % 67 / 10:.6f}")]
        pairs += [("grid", grid), ("block", block), ("est. achieved occupancy %", corr % 100), ("occupancy", occupancy)]
        return self._args(pairs, (1, 4, 6, 7, 8, 9, 10, 11, 12, 13))

    def _launch(self, out: list[str], gpu: list[str], tid: int, stream: int, copy: bool = False) -> tuple[float, float]:
        """A runtime call on ``tid`` and its kernel (or memcpy) on ``stream``; returns the kernel's (start, end)."""
        ts, corr = self.t + 1.5, self.corr
        if copy:
            name, cat = self.copies[0], "cuda_runtime"
        else:
            name, cat = self.launches[self.launch_index % len(self.launches)]
            self.launch_index += 1
        runtime = gpu if self.window else out  # kineto writes runtime calls with the GPU activities
        self._x(runtime, cat, name, tid, ts, 6.125, self._launch_args(name, corr, copy, stream))
        self._flow(runtime, "s", PID, tid, ts, corr)
        start = round(max(ts + 9.0, self.gpu_free[stream] + 1.0), 3)
        dur = round(180.0 if copy else 3.0 + (corr * 7919 % 200) / 8.0, 3)
        if copy:
            args = (
                f'"External id": {self.ext}, "device": 0, "context": 1, "stream": {stream}, "correlation": {corr}, '
                '"bytes": 16777216, "memory bandwidth (GB/s)": 93.2'
            )
            name = "Memcpy HtoD (Pinned -> Device)" if not self.hip else "Memcpy CopyHostToDevice (Host -> Device)"
            self._x(gpu, "gpu_memcpy", name, stream, start, dur, args, GPU_PID)
        else:
            name = self.kernel_names[corr % len(self.kernel_names)]
            self._x(gpu, "kernel", name, stream, start, dur, self._kernel_args(corr, stream), GPU_PID)
            self.kernels += 1
        self._flow(gpu, "f", GPU_PID, stream, start, corr)
        self.gpu_free[stream] = start + dur
        self.corr += 1
        self.ext += 1
        self.t += 10.0
        self.on_device.append((start, round(start + dur, 3)))
        return start, round(start + dur, 3)

    def _sync(self, out: list[str], gpu: list[str]) -> None:
        """``cudaStreamSynchronize`` and CUPTI's ``Stream Sync`` (kineto 2026 moves it to its own row and writes
        that row's name, in the older template, before the first one)."""
        corr, stream = self.corr, COMPUTE_STREAM
        args = self._args([("External id", self.ext), ("cbid", 131), ("correlation", corr)])
        self._x(gpu if self.window else out, "cuda_runtime", self.copies[1], MAIN_TID, self.t, 40.0, args)
        if not self.hip:
            row = stream + (SYNC_ROW_OFFSET if self.layout == "kineto" else 0)
            if self.layout == "kineto" and row not in self.synced:
                self.synced.add(row)
                fields = {"name": '"thread_name"', "ts": self._ts(self.t), "pid": str(GPU_PID), "tid": str(row)}
                self._put(gpu, "M-inline", fields, f'"name": "stream {stream} (sync)"')
            pairs = [("External id", self.ext), ("cuda_sync_kind", '"stream_synchronize"'), ("stream", stream)]
            args = self._args([*pairs, ("correlation", corr), ("device", 0), ("context", 1)], (2, 4))
            self._x(gpu, "cuda_sync", "Stream Sync", row, self.t + 2.0, 36.0, args, GPU_PID)
        self.corr += 1
        self.ext += 1

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
            if self.rich and name == "forward" and i % 4 == 0:
                self._python(out, PYTHON_FRAMES[i % len(PYTHON_FRAMES)], tid, self.t, 30.0)
            self._cpu_op(out, outer, tid, self.t, 24.0)
            self._cpu_op(out, inner, tid, self.t + 1.0, 20.0)
            if self.rich and i % 16 == 0:  # torch links a forward op to its backward op
                self._flow(out, "s" if name == "forward" else "f", PID, tid, self.t + 1.0, 9000 + i, "fwdbwd")
            spans.append(self._launch(out, gpu, tid, SIDE_STREAM if i % 7 == 3 else COMPUTE_STREAM))
        self.t += 2.0
        span = (min(s for s, _ in spans), max(e for _, e in spans))
        self._range(out, gpu, name, ts, self.t - ts, span)
        self.durations.setdefault(name, []).append(span[1] - span[0])

    def _stretch(self, out: list[str], index: int) -> None:
        """Every 8th step of a rich shape (the second first), the loader collates on the main thread: tens of
        thousands of Python frames, operators and allocator events without any marker (section, launch, kernel)."""
        for i in range(self.stretch * (2 + index % 3) // 3):
            if i % 3 == 0:
                self._python(out, PYTHON_FRAMES[-1 - i % 2], MAIN_TID, self.t, 3.0)
            else:
                self._cpu_op(out, ("aten::stack", "aten::cat")[i % 2], MAIN_TID, self.t, 2.0)
            self.t += 0.25

    def step(self, index: int) -> tuple[list[str], list[str]]:
        """One training step's CPU events and GPU events."""
        out: list[str] = []
        gpu: list[str] = []
        loader = "loader_first" if index == 0 else "loader_next"
        loader_ts = self.t
        self.t += 5.0
        if self.rich and index % 8 == 1:
            self._stretch(out, index)
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
        if self.rich:
            self._sync(out, gpu)
        self._cpu_record(out, "optimizer", opt_ts, self.t - opt_ts)
        self.t += 5.0
        self._cpu_record(out, "step", step_ts, self.t - step_ts)
        self.t = max(self.t, *self.gpu_free.values()) + 20.0
        self._profiler_step(out, index, loader_ts)
        if self.layout == "jumble" and index % 5 == 0:
            out.append("{}")  # an empty object is a list element too: counted, not an event of interest
            self.events += 1
        return out, gpu

    def _profiler_step(self, out: list[str], index: int, ts: float) -> None:
        """torch.profiler's ``ProfilerStep#<n>`` range around the step, from its loader's start to past its last device
        activity; records the step's device time, and its busy time: the union of its kernels and copies (they
        overlap on the three streams), all inside the range."""
        args = f'"External id": {self.ext},"Record function id": 0, "Ev Idx": {self.ext}'
        self._x(out, "user_annotation", f"ProfilerStep#{index}", MAIN_TID, ts, self.t - ts, args)
        self.ext += 1
        reach = busy = 0.0
        for start, end in sorted(self.on_device):
            busy += max(0.0, end - max(start, reach))
            reach = max(reach, end)
        self.device["events"] += len(self.on_device)
        self.device["us"] += sum(end - start for start, end in self.on_device)
        self.device["wall_us"] += round(self.t - ts, 3)
        self.device["busy_us"] += busy
        self.on_device = []

    def _cpu_record(self, out: list[str], name: str, ts: float, dur: float) -> None:
        """A CPU-timed range: its duration as the summariser must read it back (3 decimals)."""
        self._range(out, [], name, ts, dur, None)
        self.durations.setdefault(name, []).append(round(dur, 3))

    def expected(self) -> dict[str, Any]:
        """Events and kernels written, count/min/mean/median/max (s) of every section, and the device's kernels and
        copies: their number, their time and the busy and wall time of the profiled steps (ms)."""
        device = self.device
        return {
            "events": self.events,
            "kernels": self.kernels,
            "device": {
                "events": device["events"],
                "ms": device["us"] / 1e3,
                "wall_ms": device["wall_us"] / 1e3,
                "busy_ms": device["busy_us"] / 1e3,
            },
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


def _as_summary(record: dict[str, float]) -> dict[str, Any]:
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
# The child runs a summariser file as __main__ (this bundle's, or a baseline copy, the same way) and reports its own
# peak RSS (VmHWM, of the process image after exec): ru_maxrss from wait4 would include the memory of this (larger)
# benchmark process, which the child borrows between fork and exec. It adds the peak of any process it started
# (ru_maxrss of its children; 0.5.1 decoded events in a second one): the sum bounds what both held at once.
_CHILD = """
import resource, runpy, sys
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    try:
        with open("/proc/self/status") as status:
            hwm = [line.split()[1] for line in status if line.startswith("VmHWM:")]
        decoder = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        sys.stderr.write(f"\\nVmHWM {int(hwm[0]) + decoder}\\n")
    except (OSError, IndexError):
        pass
"""


def run_summarizer(trace: Path, parser: str, script: Path | None = None) -> dict[str, Any]:
    """Run the CLI of ``script`` (this bundle's summariser by default) in a child process; its wall time, peak RSS
    (KiB) and parsed JSON output."""
    script = str(script or SUMMARIZER)
    cmd = [sys.executable, "-c", _CHILD, script, str(trace), "--format", "json", "--parser", parser]
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

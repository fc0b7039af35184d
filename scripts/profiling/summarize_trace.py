"""Per-section timing statistics from a torch.profiler chrome trace, streamed (the file is never loaded whole).

Input: a chrome trace of ``torch.profiler`` (``{"traceEvents": [...], ...}`` or a bare list of events), ``.json``,
``.json.gz`` or a ``.zip`` holding one ``.json`` (told apart by their first bytes), opened read-only.

Output: per ``record_function`` range named ``__sec:<name>`` (``step``, ``loader_first``, ``loader_next``, ``forward``,
``backward``, ``optimizer`` or any other), the count, min, mean, median and max duration in seconds. ``forward`` and
``backward`` are timed on the accelerator: the first start to the last end of the kernels (``cat == "kernel"``, tied
by ``args.correlation``) whose launch (a call of :data:`LAUNCH_NAMES`, CUDA or HIP, whatever its ``cat``) lies in the
range instance on its thread (any thread of the process for ``backward``: autograd launches from its own threads).
Copies and memsets are not kernels (the sections time compute); a graph launch counts all its kernels; correlation
ids are taken as unique in a trace (one process per trace, as torch writes them). An instance without a matched
kernel (a CPU-only trace) falls back to its CPU duration (``dur``), which times every other section; ``sources`` says
which was used. GPU-timeline copies of the ranges (``gpu_user_annotation``) are ignored.

Where the device's time goes: every kernel, copy and memset of the device's timeline in a class of
:data:`KERNEL_CLASSES` (CUDA's and ROCm's names alike), per class the count, the time, its share of all device time
(``key_averages()``'s self device time) and its :data:`TOP_KERNELS` longest kernels by name; and the device's idle
share of the profiled steps: the union of the ``ProfilerStep#N`` ranges less the union of the device intervals in them
(without such ranges, from the first device start to the last device end, and the summary says so).

One pass, events in any order, a few doubles kept an event (:data:`KINDS`). ``parser``: ``"auto"`` (default) skims
the text whatever its layout and decodes, by the C scanner of :mod:`json`, only the events that hold a kind's marker
(:class:`_ArrayReader`), in work linear in the file's size; ``"orjson"`` (optional) decodes those with orjson, faster,
to the same values; ``"json"`` decodes and so checks every event. Truncation is always detected.

Standalone: standard library only (``fire`` and ``orjson`` where installed), nothing from the bundle, no torch, so it
runs on a laptop next to a trace copied from a cluster::

    python -m scripts.summarize_trace runs/profile/trace.json.gz [--format json]
    python summarize_trace.py trace.json            # the file copied anywhere
"""

from __future__ import annotations

import bisect
import functools
import gzip
import json
import operator
import re
import statistics
import sys
import zipfile
import zlib
from array import array
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple, NoReturn

SECTION_PREFIX = "__sec:"
#: Row order of the table; other sections follow alphabetically.
SECTION_ORDER = ("step", "loader_first", "loader_next", "forward", "backward", "optimizer")
#: Sections timed on the accelerator (from their kernels) rather than by their CPU range.
KERNEL_TIMED = frozenset({"forward", "backward"})
#: Sections whose kernels may be launched from other threads of the process (autograd's device threads).
PROCESS_WIDE = frozenset({"backward"})
#: The runtime and driver calls that launch kernels, CUDA's and HIP's.
LAUNCH_NAMES = frozenset({
    "cudaLaunchKernel", "cudaLaunchKernelExC", "cudaLaunchCooperativeKernel", "cudaLaunchCooperativeKernelMultiDevice",
    "cudaGraphLaunch", "cuLaunchKernel", "cuLaunchKernelEx", "cuLaunchCooperativeKernel", "cuGraphLaunch",
    "hipLaunchKernel", "hipExtLaunchKernel", "hipModuleLaunchKernel", "hipExtModuleLaunchKernel",
    "hipHccModuleLaunchKernel", "hipLaunchCooperativeKernel", "hipLaunchCooperativeKernelMultiDevice",
    "hipExtLaunchMultiKernelMultiDevice", "hipModuleLaunchCooperativeKernel", "hipGraphLaunch",
})  # fmt: skip
PARSERS = ("auto", "orjson", "json")
#: What ``summarize(..., work=dict)`` counts, in bytes of (uncompressed) trace: ``read`` from the file, ``indexed``
#: (searched for boundaries, taints and markers), ``decoded`` (handed to a decoder); and ``fills`` (buffer refills).
WORK_KEYS = ("read", "indexed", "decoded", "fills")

#: The classes of device time, in the tables' order; ``other`` holds what no pattern of :data:`KERNEL_CLASSES` finds.
CLASS_ORDER = ("convolution", "matrix product / attention", "normalisation", "layout conversion and copies",
               "element-wise", "reductions", "softmax", "memcpy/memset", "other")  # fmt: skip
#: The rules: (class, pattern), tried in this order on a kernel's name; the first pattern ``re.search`` finds decides
#: (the copies and memsets of the device's timeline are memcpy/memset whatever their name). The order settles names
#: that two patterns find: the runtime's blit kernels first; norms, softmax and layout conversions before element-wise
#: (``batch_norm_calc_invstd`` and ``direct_copy_kernel_cuda`` run inside ``vectorized_elementwise_kernel``);
#: element-wise before convolution and matrix products (torch.compile names a pointwise kernel after the ops it fuses:
#: ``triton_poi_fused_convolution_0`` is a bias add); convolution before matrix products (cuDNN's
#: ``sm90_xmma_fprop_implicit_gemm``, MIOpen's ``igemm_fwd_gtcx``). AMP's casts are element-wise. Every pattern is
#: tested on the real CUDA and ROCm names of tests/data/kernel_names.json.
KERNEL_CLASSES: tuple[tuple[str, str], ...] = (
    ("memcpy/memset", r"^Mem(?:cpy|set)\b|__amd_rocclr_(?:copy|fill)Buffer"),  # ROCm's hipMemcpy/hipMemset kernels
    ("normalisation", r"batch_norm|BatchNorm|layer_norm|group_?norm|GroupNorm|rms_norm|RowwiseMoments|GammaBeta"
                      r"|ComputeInternalGradients|Compute(?:Backward)?FusedParams"),  # LayerNorm's, GroupNorm's others
    ("softmax", r"[Ss]oft[Mm]ax"),
    ("layout conversion and copies",  # cuDNN's and MIOpen's layout transforms, torch's copies, roll
     r"nchwToNhwc|nhwcToNchw|batched_transpose_|transpose_(?:NCHW2CNHW|CNHW2NCHW)|direct_copy_kernel"
     r"|CatArrayBatchedCopy|SubTensorOpWithCastTensor|roll_cuda_kernel|tensorTransform"),
    ("element-wise", r"elementwise|multi_tensor_apply|triton_poi_|SubTensorOpWithScalar"),
    ("convolution",  # cuDNN (fprop/dgrad/wgrad, implicit_convolveNd_sgemm), MIOpen (igemm, naive, asm, im2col), CK
     r"fprop|dgrad|wgrad|[Cc]onv(?:_|Nd_|2d_)|convolve|igemm_(?:fwd|bwd|wrw)_|Im[23]d2Col|bwd_weight"),
    ("matrix product / attention",  # cuBLAS(Lt), CUTLASS, hipBLASLt/rocBLAS (Tensile's Cijk_), flash attention
     r"gemm|nvjet_|cutlass|cublas|Cijk_|attn|fmha|flash_(?:fwd|bwd)"),
    ("reductions", r"[Rr]educe|triton_(?:red|per)_"),
)  # fmt: skip
TRANSFER_CATEGORIES = frozenset({"gpu_memcpy", "gpu_memset"})  # ``cat`` of the device's copies and memsets
PROFILER_STEP = "ProfilerStep#"  # torch.profiler's range around each profiled step: the idle share's wall time
_CLASS_CACHE = 4096  # kernel names whose class is remembered (a network has hundreds; the cache bounds a strange one)
#: Distinct kernel names numbered for the longest-kernel lists (a compiled network has a few thousand at most); the
#: kernels of any later name count together, as :data:`OTHER_NAMES`.
NAMES_KEPT = 4096
OTHER_NAMES = f"(kernels of names beyond the first {NAMES_KEPT})"
TOP_KERNELS = 3  # the longest kernels by name listed per class

# API-version and per-thread-stream suffixes some tracers keep: cudaLaunchKernel_v7000, cudaLaunchKernel_ptsz.
_NAME_SUFFIX = re.compile(r"(?:_v\d+|_ptsz|_ptds|_spt)+$")
_NON_WS = re.compile(r"[^ \t\n\r]")
_SEPARATOR = re.compile(r"[ \t\n\r]*,[ \t\n\r]*")
# Two consecutive objects of one list: '}', a comma, '{' (group 1) and a key starting with a letter (see _ArrayReader).
_BOUNDARY = re.compile(r'\}[ \t\n\r]*+,[ \t\n\r]*+(\{)[ \t\n\r]*+"[A-Za-z_]')
# An object opened as a list element: a '{' after a comma or a '[' (whitespace between), or after 9 or more whitespace
# characters (over-matching only sends an event to the scanner); the first two lookbehinds make ': {' fail fast.
_OBJECT_IN_LIST = re.compile(
    r"\{(?<!:\{)(?<!: \{)(?:(?<=[,\[]\{)"
    + "".join(rf"|(?<=[,\[][ \t\n\r]{{{n}}}\{{)" for n in range(1, 9))
    + r"|(?<=[ \t\n\r]{9}\{))"
)
_CHUNK_CHARS = 1 << 20  # characters (bytes) read per refill of the event scanner
_BOM = "\xef\xbb\xbf"  # UTF-8's byte order mark, read as Latin-1
_MAX_PENDING_CHARS = 1 << 26  # one event larger than this is treated as malformed JSON


class TraceError(ValueError):
    """The trace cannot be summarised; the message names the file and says why."""


# ------------------------------------------------------------------------------------------------- kinds of event
class _Numbers(dict):
    """The numbers that stand for threads (``(pid, tid)``) and section names in the kept rows, a key numbered when
    first seen; kernel names apart (:meth:`kernel`)."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels: dict[str, int] = {}

    def kernel(self, name: str) -> int:
        """The number of a kernel name: the first :data:`NAMES_KEPT` distinct names are numbered from 0, any later
        one is -1 (:data:`OTHER_NAMES`), so memory stays bounded whatever the trace holds."""
        number = self.kernels.get(name)
        if number is None:
            if len(self.kernels) >= NAMES_KEPT:
                return -1
            number = self.kernels[name] = len(self.kernels)
        return number


class Kind(NamedTuple):
    """One kind of event the summary is made of: a row of :data:`KINDS`."""

    kept_for: str  # what the summary uses it for
    marker: str  # a literal the text of every such event holds: the skimmer decodes only events holding a marker
    fields: tuple[str, ...]  # the numbers kept of each event, in this order, as doubles
    row: Callable[[dict, _Numbers], tuple[float, ...] | None]  # them (None: not this kind), from a decoded "X" event


_MAX_CORRELATION = 1 << 53  # correlation ids are kept as doubles: exact below 2**53 (CUDA's and HIP's are 32-bit)


def _correlation(ev: dict) -> int:
    """The event's ``args.correlation``; ValueError (the event is dropped) unless positive and below 2**53."""
    corr = int(ev["args"]["correlation"])
    if not 0 < corr < _MAX_CORRELATION:
        raise ValueError(corr)
    return corr


def _span(ev: dict) -> tuple[float, float]:
    """(start, end) of a complete event."""
    ts = float(ev["ts"])
    return ts, ts + float(ev["dur"])


def _on_cpu(ev: dict, name: str, prefix: str) -> bool:
    """Whether a range named ``name`` starts with ``prefix`` and lies on the CPU timeline (not a ``gpu_`` copy)."""
    return name.startswith(prefix) and not str(ev.get("cat", "")).startswith("gpu_")


def _kernel_row(ev: dict, numbers: _Numbers) -> tuple[float, ...] | None:
    """(correlation, start, end, class index, name number) of a kernel (``cat == "kernel"``)."""
    if ev.get("cat") != "kernel":
        return None
    corr, (start, end), name = _correlation(ev), _span(ev), str(ev.get("name", ""))
    return corr, start, end, _class_index(name), numbers.kernel(name)


def _transfer_row(ev: dict, numbers: _Numbers) -> tuple[float, ...] | None:
    """(start, end) of a copy or memset on the device's timeline (:data:`TRANSFER_CATEGORIES`)."""
    return _span(ev) if ev.get("cat") in TRANSFER_CATEGORIES else None


def _step_row(ev: dict, numbers: _Numbers) -> tuple[float, ...] | None:
    """(start, end) of a ``ProfilerStep#<n>`` range on the CPU timeline."""
    return _span(ev) if _on_cpu(ev, ev.get("name"), PROFILER_STEP) else None


def kernel_class(name: str) -> str:
    """The class a kernel named ``name`` counts in: the first of :data:`KERNEL_CLASSES` that finds it, else other."""
    return CLASS_ORDER[_class_index(name)]


@functools.lru_cache(maxsize=_CLASS_CACHE)
def _class_index(name: str) -> int:
    """:func:`kernel_class` as an index into :data:`CLASS_ORDER`, remembered for the last names seen."""
    for index, pattern in _RULES:
        if pattern.search(name):
            return index
    return len(CLASS_ORDER) - 1


_RULES = tuple((CLASS_ORDER.index(name), re.compile(pattern)) for name, pattern in KERNEL_CLASSES)
_TRANSFER_CLASS = CLASS_ORDER.index("memcpy/memset")


@functools.lru_cache(maxsize=1024)
def _is_suffixed_launch(name: str) -> bool:
    """Whether ``name`` is a launch once API-version and stream suffixes are dropped."""
    return "_" in name and _NAME_SUFFIX.sub("", name) in LAUNCH_NAMES


def _launch_row(ev: dict, numbers: _Numbers) -> tuple[float, ...] | None:
    """(thread number, ts, correlation) of a launch: a runtime call named in :data:`LAUNCH_NAMES` (or with a suffix)."""
    name = ev.get("name")
    if name not in LAUNCH_NAMES and not (name.startswith(("cu", "hip")) and _is_suffixed_launch(name)):
        return None
    corr, ts = _correlation(ev), float(ev["ts"])
    return numbers.setdefault((ev.get("pid"), ev.get("tid")), len(numbers)), ts, corr


def _section_row(ev: dict, numbers: _Numbers) -> tuple[float, ...] | None:
    """(section-name number, thread number, ts, dur) of a ``__sec:`` range on the CPU timeline."""
    name = ev.get("name")
    if not _on_cpu(ev, name, SECTION_PREFIX):
        return None
    ts, dur, thread = float(ev["ts"]), float(ev["dur"]), (ev.get("pid"), ev.get("tid"))
    section = numbers.setdefault(name[len(SECTION_PREFIX) :], len(numbers))
    return section, numbers.setdefault(thread, len(numbers)), ts, dur


#: Every kind of event the summary is made of: what it is kept for, a literal the text of every such event holds (its
#: marker), the numbers kept of each (doubles, one flat array a kind) and the function that makes them from a decoded
#: ``"ph": "X"`` event (None: not this kind; an event without a field its kind needs is dropped). An event goes to the
#: first kind that takes it. The skimmer decodes only the events whose text holds a marker (:func:`_markers`), so a
#: new kind is one entry here, and its use in :func:`_resolve`.
KINDS = {
    "kernel": Kind("forward/backward's accelerator time (the span of the kernels their launches started); the device "
                   "time per class and the idle share",
                   '"correlation"',  # a kernel is kept only with its args' correlation id
                   ("correlation", "start", "end", "class", "name"), _kernel_row),
    "transfer": Kind("the device time of copies and memsets (memcpy/memset) and the idle share; never a section's",
                     '"gpu_mem',  # the start of their cat, gpu_memcpy or gpu_memset
                     ("start", "end"), _transfer_row),
    "launch": Kind("ties each kernel (by correlation id) to the range instance whose thread launched it in its time",
                   '"correlation"',  # one search finds kernels and launches (copies too: decoded, then dropped)
                   ("thread", "ts", "correlation"), _launch_row),
    "section": Kind("the ranges timed: every instance's CPU duration, or the span of its kernels", '"__sec:',
                    ("section", "thread", "ts", "dur"), _section_row),
    "step": Kind("the wall time of the idle share: the profiled steps", '"' + PROFILER_STEP, ("start", "end"),
                 _step_row),
}  # fmt: skip


def _markers() -> tuple[str, ...]:
    """The literals the skimmer searches for: each kind's marker, and a backslash, so that an event whose strings
    hold escapes (a key or a name could be written with \\u escapes) is decoded too. Over-matching is harmless."""
    return (*dict.fromkeys(kind.marker for kind in KINDS.values()), "\\")


class _Collected:
    """What one pass keeps: per kind of :data:`KINDS`, the rows of its events in one flat array; the numbers that
    stand for threads and section names in them; the top-level keys other than ``traceEvents``; events counted."""

    def __init__(self) -> None:
        self.rows = {name: array("d") for name in KINDS}
        self.numbers = _Numbers()  # a thread's (pid, tid) or a section's name -> its number; kernel names apart
        self.meta: dict[str, Any] = {}
        self.decoded = self.skipped = 0
        self.skimmed = False  # some events were counted without being decoded
        kinds, numbers = [(kind.row, self.rows[name].extend) for name, kind in KINDS.items()], self.numbers

        def add(ev: Any) -> None:
            """Keep the row of a decoded event from the first kind that takes it (none for events of no kind, or
            without the fields their kind needs)."""
            try:
                if ev.get("ph") != "X":
                    return
                for row_of, keep in kinds:
                    row = row_of(ev, numbers)
                    if row is not None:
                        keep(row)
                        return
            except (AttributeError, KeyError, TypeError, ValueError, OverflowError):
                return

        self.add = add

    def columns(self, kind: str) -> list[array]:
        """The kept numbers of every event of ``kind``, one array per field."""
        width = len(KINDS[kind].fields)
        return [self.rows[kind][i::width] for i in range(width)]

    def column(self, kind: str, field: str) -> array:
        """The kept values of one field of every event of ``kind``."""
        fields = KINDS[kind].fields
        return self.rows[kind][fields.index(field) :: len(fields)]

    def count(self, kind: str) -> int:
        """How many events of ``kind`` were kept."""
        return len(self.rows[kind]) // len(KINDS[kind].fields)


# ------------------------------------------------------------------------------------------------------ interface
def summarize(path: str | Path, parser: str = "auto", work: dict[str, int] | None = None) -> dict[str, Any]:
    """Statistics per ``__sec:`` section of the trace at ``path``.

    Returns ``{"sections": {name: {"count", "min_s", "mean_s", "median_s", "max_s"}}, "sources": {name:
    "kernels" | "cpu" | "mixed"}, "trace": str, "events": int, "launches": int, "kernels": int, "parser": str,
    "device": {"events", "ms", "classes": {class: {"count", "ms", "share"}}, "top": {class: [{"name", "count", "ms",
    "share"}]}}, "idle": {"window", "ranges", "wall_ms", "busy_ms", "idle_ms", "share"} | None}`` plus ``"devices"``
    (GPU names) when the trace records them. ``sections`` is ordered as :data:`SECTION_ORDER`, ``classes`` as
    :data:`CLASS_ORDER` (shares of ``device.ms``, 0 to 1); ``idle`` is None without device activity. ``work``, a
    dict, receives what reading cost (:data:`WORK_KEYS`). Raises :class:`TraceError` for a missing, empty, truncated
    or non-trace file, or one with neither sections nor device activity.
    """
    path = Path(path)
    if parser not in PARSERS:
        raise TraceError(f"{path}: unknown parser {parser!r}; use one of {', '.join(PARSERS)}")
    fast = _accelerator(path) if parser == "orjson" else None
    collected = _Collected()
    work = work if work is not None else {}
    work.update(dict.fromkeys(WORK_KEYS, 0))
    try:
        with _open_binary(path) as stream:
            _read_events_json(_Scanner(stream, path, work), collected, fast, skim=parser != "json")
    except (EOFError, zlib.error) as exc:  # a compressed trace cut short, as the profiler leaves one it was writing
        raise TraceError(f"{path}: cannot read: {exc}; was the trace still being written?") from exc
    except (OSError, zipfile.BadZipFile) as exc:
        raise TraceError(f"{path}: cannot read: {exc}") from exc
    events = collected.decoded + collected.skipped
    if events == 0:
        raise TraceError(f"{path}: no trace events (an empty traceEvents list)")
    if not collected.count("section") and not collected.count("kernel") + collected.count("transfer"):
        raise TraceError(
            f"{path}: no '{SECTION_PREFIX}' ranges and no device activity among {events} events; was it profiled "
            f"with the bundle's record_function sections ({', '.join(SECTION_PREFIX + s for s in SECTION_ORDER)})?"
        )
    durations, sources = _resolve(collected)
    summary: dict[str, Any] = {
        "sections": {name: _stats(durations[name]) for name in _ordered(durations)},
        "sources": {name: sources[name] for name in _ordered(durations)},
        "trace": str(path),
        "events": events,
        "launches": collected.count("launch"),
        "kernels": collected.count("kernel"),
        "parser": ("orjson" if fast else "json") + ("-skim" if collected.skimmed else ""),
        "device": device_time(collected),
        "idle": idle_share(collected),
    }
    devices = _device_names(collected.meta.get("deviceProperties"))
    if devices:
        summary["devices"] = devices
    return summary


def format_table(summary: dict[str, Any]) -> str:
    """The summary as a fixed-width table, one row per section, durations in seconds."""
    header = f"{'section':<14}{'count':>7}{'min_s':>12}{'mean_s':>12}{'median_s':>12}{'max_s':>12}  source"
    lines = [f"{summary.get('trace', '')}: {summary.get('events', 0)} events", header, "-" * len(header)]
    sources = summary.get("sources", {})
    for name, st in summary["sections"].items():
        cells = "".join(f"{st[k]:>12.6f}" for k in ("min_s", "mean_s", "median_s", "max_s"))
        lines.append(f"{name:<14}{st['count']:>7}{cells}  {sources.get(name, 'cpu')}")
    if summary.get("devices"):
        lines.append("devices: " + ", ".join(summary["devices"]))
    lines.append("forward/backward from 'kernels': first kernel start to last kernel end; 'cpu': range duration.")
    if "device" in summary:
        lines += ["", *format_device_table(summary["device"], summary.get("idle"))]
    return "\n".join(lines)


def format_device_table(device: dict[str, Any], idle: dict[str, Any] | None) -> list[str]:
    """The lines of the device-time table (one row per class of :data:`CLASS_ORDER`: count, ms, share) and the idle
    line; on a trace without device activity one line that says so."""
    if not device["events"]:
        return ["device time by kernel class: none: no kernel, copy or memset in this trace (a CPU-only run)"]
    header = f"{'class':<30}{'count':>8}{'device ms':>12}{'share %':>9}"
    lines = [f"device time by kernel class ({device['events']} kernels, copies and memsets, {device['ms']:.3f} ms):",
             header, "-" * len(header)]  # fmt: skip
    for name, row in device["classes"].items():
        lines.append(f"{name:<30}{row['count']:>8}{row['ms']:>12.3f}{100 * row['share']:>9.1f}")
    if idle:
        wall = f"{idle['wall_ms']:.3f} ms"
        where = f"of the profiled steps ({idle['ranges']} ProfilerStep range{'s' * (idle['ranges'] != 1)}, {wall})"
        if idle["window"] != "profiler steps":
            where = f"from the first device start to the last device end ({wall}; the trace has no ProfilerStep ranges)"
        lines.append(f"device idle {100 * idle['share']:.1f} % {where}: {idle['idle_ms']:.3f} ms without a kernel, "
                     "copy or memset running")  # fmt: skip
    if device.get("top"):
        lines += [
            "",
            f"the longest kernels of each class, by name (at most {TOP_KERNELS}; names cut at {_NAME_WIDTH}):",
        ]
        for name, kernels in device["top"].items():
            lines.append(name)
            for k in kernels:
                cut = k["name"] if len(k["name"]) <= _NAME_WIDTH else k["name"][: _NAME_WIDTH - 3] + "..."
                lines.append(f"  {k['count']:>6} x {k['ms']:>10.3f} ms {100 * k['share']:>5.1f} %  {cut}")
    return lines


_NAME_WIDTH = 110  # characters of a kernel's name the text table shows (C++ template names run to thousands)


def main(trace: str, format: str = "text", parser: str = "auto") -> None:
    """Print the per-section statistics of TRACE (.json, .json.gz or .zip) as a table (``text``) or ``json``.

    ``--parser``: ``auto`` (standard library, the default), ``orjson`` (the same skim, events decoded by the optional
    orjson package: faster) or ``json`` (every event decoded and checked: slower)."""
    if format not in ("text", "json"):
        _fail(f"--format must be 'text' or 'json', not {format!r}")
    try:
        summary = summarize(str(trace), parser=parser)
    except TraceError as exc:
        _fail(str(exc))
    print(json.dumps(summary, indent=2) if format == "json" else format_table(summary))


def _fail(message: str) -> NoReturn:
    """Print the message as the CLI's error and exit with status 2 (no traceback)."""
    print(f"summarize_trace: error: {message}", file=sys.stderr)
    raise SystemExit(2)


# -------------------------------------------------------------------------------------------------------- reading
@contextmanager
def _open_binary(path: Path) -> Iterator[BinaryIO]:
    """The decompressed JSON bytes of ``path``; plain, gzip or a zip with one ``.json`` member (read-only)."""
    with open(path, "rb") as raw:
        magic = raw.read(4)
        raw.seek(0)
        if magic[:2] == b"\x1f\x8b":
            with gzip.GzipFile(fileobj=raw, mode="rb") as stream:
                yield stream
        elif magic in (b"PK\x03\x04", b"PK\x05\x06"):
            with zipfile.ZipFile(raw, "r") as archive:
                names = [n for n in archive.namelist() if not n.endswith("/")]
                members = [n for n in names if n.lower().endswith(".json")]
                if len(members) != 1:
                    holds = names or "nothing"
                    raise TraceError(f"{path}: a zip trace must hold exactly one .json member; it holds {holds}")
                with archive.open(members[0], "r") as stream:
                    yield stream
        else:
            yield raw


class _Scanner:
    """Walks a JSON text one value at a time with the C scanner of :mod:`json`, refilling a bounded buffer.

    The text is the file's bytes read as Latin-1 (one character a byte, so string operations stay on one-byte
    characters whatever the trace holds; :func:`_utf8` decodes what is kept), read and inflated in the caller's thread
    (a read-ahead thread would only contend for the GIL)."""

    def __init__(self, stream: BinaryIO, path: Path, work: dict[str, int]) -> None:
        self.stream, self.path, self.work = stream, path, work
        self.buf, self.pos, self.base, self.eof = "", 0, 0, False
        self.generation = 0  # counts refills: an index of ``buf`` is valid while this is unchanged
        self.scan = json.JSONDecoder().scan_once

    def fill(self) -> bool:
        """Append the next chunk to the buffer (dropping the text before ``pos``); False at the end of the file. A
        chunk is at least as long as the text kept, so the work on a value of many chunks stays linear in it."""
        if self.eof:
            return False
        data = self.stream.read(max(_CHUNK_CHARS, len(self.buf) - self.pos)).decode("latin-1")
        if not data:
            self.eof = True
            return False
        self.base += self.pos
        self.buf = self.buf[self.pos :] + data
        self.pos = 0
        self.generation += 1
        self.work["read"] += len(data)
        self.work["fills"] += 1
        return True

    def peek(self) -> str:
        """The next non-whitespace character ('' at the end of the file), without consuming it."""
        while True:
            match = _NON_WS.search(self.buf, self.pos)
            if match:
                self.pos = match.start()
                return self.buf[self.pos]
            self.pos = len(self.buf)
            if not self.fill():
                return ""

    def expect(self, chars: str, where: str) -> str:
        """Consume the next non-whitespace character, one of ``chars``; else a truncated/malformed error."""
        char = self.peek()
        if char == "":
            raise self.error("truncated", f"the file ends {where}")
        if char not in chars:
            raise self.error("malformed", f"expected {' or '.join(repr(c) for c in chars)} {where}, found {char!r}")
        self.pos += 1
        return char

    def value(self) -> Any:
        """Decode the next complete JSON value (refilling the buffer when it ends inside it)."""
        if self.peek() == "":
            raise self.error("truncated", "the file ends where a value should start")
        work = self.work
        while True:
            buf, pos = self.buf, self.pos
            try:
                obj, end = self.scan(buf, pos)
            except StopIteration as exc:  # "Expecting value" at exc.value
                err_pos, msg = exc.value, "Expecting value"
            except json.JSONDecodeError as exc:
                err_pos, msg = exc.pos, exc.msg
            else:
                work["decoded"] += end - pos
                if end < len(buf) or self.eof or not self.fill():  # a number could go on in the next chunk
                    self.pos = end
                    return obj if buf.isascii() else self.scan(_utf8(buf[pos:end]), 0)[0]
                continue
            work["decoded"] += len(buf) - pos  # at most: how far the scanner got is not known
            at_end = err_pos >= len(buf) - 64 or msg.startswith("Unterminated string")
            where = f"{msg.removesuffix(' at')} at byte {self.base + err_pos}"  # "Unterminated string starting at"
            if not at_end or len(buf) - pos > _MAX_PENDING_CHARS:
                raise self.error("malformed", where)
            if not self.fill():
                raise self.error("truncated", f"{where}, the end of the file")

    def error(self, kind: str, detail: str) -> TraceError:
        """A :class:`TraceError` naming the file: ``truncated`` (asks whether it was still written) or malformed."""
        if kind == "truncated":
            return TraceError(f"{self.path}: truncated JSON ({detail}); was the trace still being written?")
        return TraceError(f"{self.path}: malformed JSON ({detail})")


def _read_events_json(sc: _Scanner, out: _Collected, fast: Any, skim: bool) -> None:
    """Hand the trace events to ``out.add``; top-level keys other than ``traceEvents`` go to ``out.meta``."""
    path = sc.path
    while len(sc.buf) < len(_BOM) and sc.fill():
        pass
    if sc.buf.startswith(_BOM):
        sc.pos = len(_BOM)
    first = sc.peek()
    if first == "":
        raise TraceError(f"{path}: empty file (no JSON in it)")
    if first == "[":
        _ArrayReader(sc, out, fast, skim).read()
    elif first == "{":
        sc.pos += 1
        found, more = False, sc.peek() != "}"
        if not more:
            sc.pos += 1
        while more:
            key = sc.value()
            if not isinstance(key, str):
                raise sc.error("malformed", f"an object key must be a string, found {key!r}")
            sc.expect(":", f"after the key {key!r}")
            if key == "traceEvents":
                if sc.peek() != "[":
                    raise TraceError(f"{path}: not a chrome trace: 'traceEvents' is not a list")
                found = True
                _ArrayReader(sc, out, fast, skim).read()
            else:
                out.meta[key] = sc.value()
            more = sc.expect(",}", "in the top-level object") == ","
        if not found:
            raise TraceError(f"{path}: not a chrome trace: the top-level object has no 'traceEvents' list")
    else:
        raise TraceError(f"{path}: not a chrome trace: it does not start with '{{' or '[' (found {first!r})")
    if sc.peek() != "":
        raise sc.error("malformed", f"unexpected data after the JSON document at byte {sc.base + sc.pos}")


class _ArrayReader:
    """Reads the event list: every element decoded (``skim`` off), or only the events that can matter.

    Skimming rests on :data:`_BOUNDARY`: ``}``, a comma, ``{`` and a key starting with a letter, whitespace anywhere
    between. A raw ``"`` never occurs inside a JSON string and a closing one cannot be followed by a letter, so that
    quote opens a key: no part of a match lies inside a string, and the two objects are consecutive elements of one
    list, whatever their layout. That list could be nested in an event (objects in its args) or follow the event
    list, but its first object opens right after a ``[``, or after a comma that follows no object, and
    :data:`_OBJECT_IN_LIST` finds every such ``{``. So from a known element start, the text up to the next boundary
    is exactly one event when it holds no such ``{`` but the boundaries' own (a *taint*; one in a string costs only
    a decode).

    Each buffer is indexed once, in C (:meth:`_index`): boundaries, taints, and the events holding a marker. Clean
    events are counted without being decoded, events with a marker are decoded from their exact text, and an element
    with a taint, or with no boundary after it in the buffer, is decoded alone by the json scanner before counting
    resumes. Only the event carried into the next buffer is indexed again, and a buffer grows by at least what it
    carries, so the work is linear in the text whatever the layouts (``work`` counts it). The last events and the
    closing bracket always go through the scanner: truncation and bad endings are reported as without skimming.
    """

    def __init__(self, sc: _Scanner, out: _Collected, fast: Any, skim: bool) -> None:
        self.sc, self.out, self.fast, self.skim = sc, out, fast, skim
        self.indexed = -1  # the scanner's generation the index below describes
        self.opens: list[int] = []  # the '{' of every boundary after the indexed position: where an event starts
        self.taints: list[int] = []  # where a list element opens other than at a boundary
        self.marked: list[int] = []  # the events (indices into opens: the boundary each ends at) holding a marker
        self.k = self.t = self.m = 0  # next boundary, taint, marked event
        self.tainted = False  # the last buffer indexed had taints
        self.markers = _markers()

    def read(self) -> None:
        """Read the event list at the scanner's position, counting clean events and decoding the others."""
        sc = self.sc
        sc.expect("[", "at the start of the event list")
        if sc.peek() == "]":
            sc.pos += 1
            return
        if not self.skim:
            self._decode_elements(-1)
            return
        while True:
            if self._skim():
                continue
            if self.k == len(self.opens) and len(sc.buf) - sc.pos < _CHUNK_CHARS and sc.fill():
                continue  # the event goes on in the next chunk: read on (once) rather than fail to decode it
            if self._decode_elements(1):
                return

    def _decode_elements(self, count: int) -> bool:
        """Decode ``count`` elements (all when negative) from ``sc.pos``, the start of one; True when the list
        ends."""
        sc, scan, separator, out, work = self.sc, self.sc.scan, _SEPARATOR.match, self.out, self.sc.work
        while count:
            count -= 1
            buf, pos = sc.buf, sc.pos
            try:  # the common case first: the element and its comma inside the buffer
                obj, end = scan(buf, pos)
                comma = separator(buf, end)
            except (StopIteration, json.JSONDecodeError):
                comma, end = None, len(buf)  # how far the scanner got is not known: at most to the end
            work["decoded"] += end - pos
            if comma is not None and comma.end() < len(buf):
                out.add(obj if buf.isascii() else scan(_utf8(buf[pos:end]), 0)[0])
                out.decoded += 1
                sc.pos = comma.end()
                continue
            out.add(sc.value())  # at the end of the buffer, the last element, or an error: refills and reports
            out.decoded += 1
            if sc.expect(",]", "in the traceEvents list") == "]":
                return True
            sc.peek()  # at the next element
        return False

    def _skim(self) -> bool:
        """From ``sc.pos`` (an element's start), count the clean events up to the next taint and decode those with
        a marker; False when the element there needs the scanner (a taint in it, or no boundary after it)."""
        sc, out = self.sc, self.out
        buf, pos = sc.buf, sc.pos
        if self.indexed != sc.generation:
            self._index(buf, pos)
        opens, taints, marked = self.opens, self.taints, self.marked
        k = self.k = bisect.bisect_right(opens, pos, self.k)
        t = self.t = bisect.bisect_right(taints, pos, self.t)
        stop = bisect.bisect_left(opens, taints[t], k) if t < len(taints) else len(opens)
        if stop == k:
            return False
        m = bisect.bisect_left(marked, k, self.m)
        m_stop = self.m = bisect.bisect_left(marked, stop, m)
        picked = marked[m:m_stop]
        starts, ends = [opens[s - 1] for s in picked], [opens[s] for s in picked]
        if picked and picked[0] == k:
            starts[0] = pos
        if picked:
            self._decode_picked(buf, starts, ends)
        sc.work["decoded"] += sum(map(operator.sub, ends, starts))
        out.decoded += m_stop - m
        out.skipped += stop - k - (m_stop - m)
        out.skimmed = True
        sc.pos = opens[stop - 1]
        self.k = stop
        return True

    def _index(self, buf: str, pos: int) -> None:
        """Find the boundaries after ``pos``, and the taints and the marked events before the last boundary (a few
        passes of C code over the text, once per refill)."""
        self.indexed = self.sc.generation
        self.k = self.t = self.m = 0
        self.taints, self.marked = [], []
        opens = self.opens = [match.start(1) for match in _BOUNDARY.finditer(buf, pos)]
        self.sc.work["indexed"] += len(buf) - pos
        if not opens:
            return
        last = opens[-1]
        # counted first (cheap); located where they differ, at once after a buffer that had taints
        if self.tainted or len(_OBJECT_IN_LIST.findall(buf, pos + 1, last)) != len(opens) - 1:
            found = {match.start() for match in _OBJECT_IN_LIST.finditer(buf, pos + 1, last)}
            self.taints = sorted(found.difference(opens))
            self.tainted = bool(self.taints)
        marked: set[int] = set()
        find, bisect_right = buf.find, bisect.bisect_right
        for literal in self.markers:
            at = find(literal, pos, last)
            while at >= 0:
                s = bisect_right(opens, at)
                marked.add(s)
                at = find(literal, opens[s], last)  # the rest of that event needs no search
        self.marked = sorted(marked)

    def _decode_picked(self, buf: str, starts: list[int], ends: list[int]) -> None:
        """Decode and keep the one event from each ``start`` to the last ``}`` before its ``end`` (the next boundary):
        orjson when given, else the json scanner in place; a text either refuses goes to :func:`_decode_exact`."""
        fast, sc, add, rfind = self.fast, self.sc, self.out.add, buf.rfind
        scan, ascii_text = sc.scan, buf.isascii()  # O(1): a str knows
        for start, end in zip(starts, ends):
            stop = rfind("}", start, end) + 1
            if fast is not None:
                text = buf[start:stop]
                try:  # orjson reads UTF-8 bytes itself
                    add(fast(text if text.isascii() else text.encode("latin-1")))
                    continue
                except ValueError:  # refused (an integer beyond 64 bits, invalid UTF-8): the scanner decides
                    pass
            elif ascii_text:  # the json scanner, in place
                try:
                    event, at = scan(buf, start)
                except (StopIteration, json.JSONDecodeError):
                    at = -1
                if at == stop:
                    add(event)
                    continue
            add(_decode_exact(_utf8(buf[start:stop]), scan, sc.path, sc.base + start))


def _decode_exact(text: str, scan: Any, path: Path, at: int) -> Any:
    """The one event ``text`` holds (found at byte ``at`` of the trace), decoded by the json scanner; a
    :class:`TraceError` naming the file and the byte when it is not exactly one JSON value."""
    try:
        event, end = scan(text, 0)
    except StopIteration as exc:
        raise TraceError(f"{path}: malformed JSON (Expecting value at byte {at + exc.value})") from exc
    except json.JSONDecodeError as exc:
        raise TraceError(f"{path}: malformed JSON ({exc.msg} at byte {at + exc.pos})") from exc
    if end != len(text):
        raise TraceError(f"{path}: malformed JSON (an event ends at byte {at + end}, before its boundary)")
    return event


def _utf8(text: str) -> str:
    """The text as UTF-8 (bad bytes replaced), from the one-character-a-byte text :class:`_Scanner` reads."""
    return text if text.isascii() else text.encode("latin-1").decode("utf-8", "replace")


def _accelerator(path: Path) -> Any:
    """``orjson.loads``, the optional decoder of the events skimming picks (a text it refuses, e.g. an integer beyond
    64 bits or ``NaN``, goes to the :mod:`json` scanner)."""
    try:
        import orjson
    except ImportError as exc:
        raise TraceError(f"{path}: parser='orjson' needs the orjson package (pip install orjson)") from exc
    return orjson.loads


# ------------------------------------------------------------------------------------------------------- analysis
def _resolve(c: _Collected) -> tuple[dict[str, list[float]], dict[str, str]]:
    """Duration (µs) of every range instance, and per section whether kernels or CPU ranges gave them."""
    names = list(c.numbers)  # the key of each number
    # Backward kernels are launched by autograd's device threads, not the thread that opened the range, so backward
    # ranges match launches from any thread of their process (a per-process pseudo-thread, numbered too).
    process_of = {
        i: c.numbers.setdefault((key[0], "*"), len(c.numbers)) for i, key in enumerate(names) if isinstance(key, tuple)
    }
    ranges = [(names[int(s)], int(t), ts, dur) for s, t, ts, dur in zip(*c.columns("section"))]
    owners_of = _launch_owners(ranges, process_of, *c.columns("launch"))
    first: dict[int, float] = {}  # per range id: its kernels' first start and last end
    last: dict[int, float] = {}
    corrs, starts, ends, _, _ = c.columns("kernel")
    for corr, start, end in zip(corrs, starts, ends):
        for rid in owners_of(int(corr)):
            if start < first.get(rid, start + 1.0):
                first[rid] = start
            if end > last.get(rid, end - 1.0):
                last[rid] = end
    durations: dict[str, list[float]] = {}
    from_kernels: dict[str, int] = {}
    for rid, (section, _, _, dur) in enumerate(ranges):
        if rid in first:
            durations.setdefault(section, []).append(last[rid] - first[rid])
            from_kernels[section] = from_kernels.get(section, 0) + 1
        else:
            durations.setdefault(section, []).append(dur)
    sources = {}
    for section, values in durations.items():
        n = from_kernels.get(section, 0)
        sources[section] = "cpu" if n == 0 else "kernels" if n == len(values) else "mixed"
    return durations, sources


def device_time(c: _Collected) -> dict[str, Any]:
    """Device time per class of :data:`CLASS_ORDER` (copies and memsets in memcpy/memset): the count, the ms and the
    share of all device time (0 when there is none); ``top``: per class that has kernels, its :data:`TOP_KERNELS`
    longest kernels by name (name, count, ms, share), longest first (copies and memsets are not kernels: not there)."""
    counts, us = [0] * len(CLASS_ORDER), [0.0] * len(CLASS_ORDER)
    # (name number, class index) -> [count, µs]: one entry a name (the kernels of OTHER_NAMES: one entry a class)
    by_name: dict[tuple[int, int], list[float]] = {}
    _, starts, ends, classes_of, names_of = c.columns("kernel")
    for start, end, index, name in zip(starts, ends, classes_of, names_of):
        counts[int(index)] += 1
        us[int(index)] += end - start
        entry = by_name.setdefault((int(name), int(index)), [0, 0.0])
        entry[0] += 1
        entry[1] += end - start
    counts[_TRANSFER_CLASS] += c.count("transfer")
    us[_TRANSFER_CLASS] += sum(map(operator.sub, c.column("transfer", "end"), c.column("transfer", "start")))
    total = sum(us)
    classes = {
        name: {"count": counts[i], "ms": round(us[i] / 1e3, 6), "share": round(us[i] / total, 6) if total else 0.0}
        for i, name in enumerate(CLASS_ORDER)
    }
    names = [*c.numbers.kernels, OTHER_NAMES]  # number -1: the last
    top: dict[str, list[dict[str, Any]]] = {}
    # longest first; a tie in the order of the names, so that the events' order in the file never matters
    for (number, index), (count, time) in sorted(by_name.items(), key=lambda kv: (-kv[1][1], names[kv[0][0]])):
        listed = top.setdefault(CLASS_ORDER[index], [])
        if len(listed) < TOP_KERNELS:
            listed.append({"name": names[number], "count": int(count), "ms": round(time / 1e3, 6),
                           "share": round(time / total, 6) if total else 0.0})  # fmt: skip
    top = {name: top[name] for name in CLASS_ORDER if name in top}
    return {"events": sum(counts), "ms": round(total / 1e3, 6), "classes": classes, "top": top}


def idle_share(c: _Collected) -> dict[str, Any] | None:
    """The device's idle time: the union of the ``ProfilerStep#`` ranges (``window`` "profiler steps", ``ranges`` of
    them; without any, "device span": the first device start to the last device end) less the union of the device
    intervals inside it, in ms and as a share of the window; None without device activity."""
    starts, ends = c.column("transfer", "start"), c.column("transfer", "end")
    starts.extend(c.column("kernel", "start"))
    ends.extend(c.column("kernel", "end"))
    if not starts:
        return None
    windows = _merged(zip(c.column("step", "start"), c.column("step", "end")))
    window = "profiler steps"
    if not windows:
        windows, window = [(min(starts), max(ends))], "device span"
    starts = array("d", sorted(starts))  # one list of floats at a time: O(1) per interval, sorted once
    ends = array("d", sorted(ends))
    wall = sum(hi - lo for lo, hi in windows)
    busy = _covered(starts, ends, windows)
    return {"window": window, "ranges": len(windows), "wall_ms": round(wall / 1e3, 6),
            "busy_ms": round(busy / 1e3, 6), "idle_ms": round((wall - busy) / 1e3, 6),
            "share": round((wall - busy) / wall, 6) if wall > 0 else 0.0}  # fmt: skip


def _merged(ranges: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """``ranges`` as sorted, disjoint ranges (overlapping or touching ones joined)."""
    out: list[tuple[float, float]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _covered(starts: array, ends: array, windows: list[tuple[float, float]]) -> float:
    """The length of the union of intervals inside ``windows`` (sorted, disjoint), from their sorted starts and ends."""
    covered, w = 0.0, 0
    for lo, hi in _pieces(starts, ends):
        while w < len(windows) and windows[w][1] <= lo:
            w += 1
        k = w
        while k < len(windows) and windows[k][0] < hi:
            covered += min(hi, windows[k][1]) - max(lo, windows[k][0])
            k += 1
    return covered


def _pieces(starts: array, ends: array) -> Iterator[tuple[float, float]]:
    """The union of intervals as disjoint pieces in time order, from their sorted starts and sorted ends: at any time
    (starts <= t) - (ends < t) intervals are open whichever start belongs to whichever end, so one merge of the two
    finds where the count leaves and returns to zero (an end before the next start closes one)."""
    open_, j, begin = 0, 0, 0.0
    for start in starts:
        while ends[j] < start:
            open_ -= 1
            if not open_:
                yield begin, ends[j]
            j += 1
        if not open_:
            begin = start
        open_ += 1
    if open_:
        yield begin, ends[-1]


def _launch_owners(
    ranges: list[tuple[str, int, float, float]], process_of: dict[int, int], threads: array, ts: array, corrs: array
) -> Callable[[int], tuple[int, ...]]:
    """A function correlation -> ids (indices into ``ranges``) of the kernel-timed ranges whose launches carry it: a
    launch on the range's thread (its process's, for :data:`PROCESS_WIDE`) in its time, once per nesting range."""
    # per thread, sorted by start, with the running maximum of their ends: a scan back from a launch stops early
    per_thread: dict[int, tuple[list[float], list[float], list[float], list[int]]] = {}
    for rid in sorted((i for i, r in enumerate(ranges) if r[0] in KERNEL_TIMED), key=lambda i: ranges[i][1:3]):
        section, thread, start, dur = ranges[rid]
        if section in PROCESS_WIDE:
            thread = process_of[thread]
        starts, ends, reach, rids = per_thread.setdefault(thread, ([], [], [], []))
        starts.append(start)
        ends.append(start + dur)
        reach.append(max(start + dur, reach[-1]) if reach else start + dur)
        rids.append(rid)
    launched, owner = array("q"), array("i")
    candidates: dict[float, list[tuple[list[float], list[float], list[float], list[int]]]] = {}
    for thread, at, corr in zip(threads, ts, corrs):  # numbers kept as doubles hash and compare as the ints they hold
        lists = candidates.get(thread)
        if lists is None:  # the ranges a launch of this thread may fall in: its own, its process's
            lists = candidates[thread] = [per_thread[k] for k in (thread, process_of.get(thread)) if k in per_thread]
        for starts, ends, reach, rids in lists:
            j = bisect.bisect_right(starts, at) - 1
            while j >= 0 and reach[j] >= at:
                if ends[j] >= at:
                    launched.append(int(corr))
                    owner.append(rids[j])
                j -= 1
    return _owner_lookup(launched, owner)


def _owner_lookup(launched: array, owner: array) -> Callable[[int], tuple[int, ...]]:
    """A function correlation -> range ids, for the kernels' side of the join. CUDA/HIP correlation ids count up from
    1 per process, so where they are dense the first range of each id goes in a table indexed by ``id - min`` (4 bytes
    an entry), else in a dict (about 100 bytes an entry); the other ranges of launches in nested ranges in ``extra``."""
    low = min(launched, default=0)
    span = max(launched, default=-1) - low + 1
    dense = span < 4 * len(launched) + 1024
    first: Any = array("i", [-1]) * span if dense else {}
    extra: dict[int, list[int]] = {}
    for corr, rid in zip(launched, owner):
        key = corr - low if dense else corr
        if (first[key] if dense else first.get(key, -1)) < 0:
            first[key] = rid
        else:
            extra.setdefault(corr, []).append(rid)

    def lookup(corr: int) -> tuple[int, ...]:
        """Range ids whose launches carry ``corr``."""
        rid = (first[corr - low] if 0 <= corr - low < span else -1) if dense else first.get(corr, -1)
        if rid < 0:
            return ()
        return (rid, *extra[corr]) if extra and corr in extra else (rid,)

    return lookup


def _stats(values_us: list[float]) -> dict[str, Any]:
    """count, min, mean, median, max of durations in µs, as seconds rounded to the trace's resolution (1 ns)."""
    return {
        "count": len(values_us),
        "min_s": round(min(values_us) / 1e6, 9),
        "mean_s": round(statistics.fmean(values_us) / 1e6, 9),
        "median_s": round(statistics.median(values_us) / 1e6, 9),
        "max_s": round(max(values_us) / 1e6, 9),
    }


def _ordered(names: Iterable[str]) -> list[str]:
    """Section names in :data:`SECTION_ORDER`, the others after them alphabetically."""
    rank = {name: i for i, name in enumerate(SECTION_ORDER)}
    return sorted(names, key=lambda name: (rank.get(name, len(rank)), name))


def _device_names(properties: Any) -> list[str]:
    """The GPU names in the trace's ``deviceProperties`` (none when absent or malformed)."""
    if not isinstance(properties, list):
        return []
    return [str(p["name"]) for p in properties if isinstance(p, dict) and "name" in p]


def cli() -> None:
    """``python -m scripts.summarize_trace``, or this file run alone: fire where installed, else argparse."""
    try:
        import fire
    except ImportError:  # a laptop without fire: the same interface through argparse
        import argparse

        cli = argparse.ArgumentParser(prog="summarize_trace", description=main.__doc__)
        cli.add_argument("trace")
        cli.add_argument("--format", default="text", choices=("text", "json"))
        cli.add_argument("--parser", default="auto", choices=PARSERS)
        main(**vars(cli.parse_args()))
    else:
        fire.Fire(main)


if __name__ == "__main__":
    cli()

"""Per-section timing statistics from a torch.profiler chrome trace, streamed (the file is never loaded whole).

Input: a chrome trace written by ``torch.profiler`` (``{"traceEvents": [...], ...}`` or a bare list of events) as
``.json``, ``.json.gz`` or a ``.zip`` holding one ``.json``; the format is told from the file's first bytes. The file
is only ever opened for reading.
Output: for every ``record_function`` range named ``__sec:<name>`` (``step``, ``loader_first``, ``loader_next``,
``forward``, ``backward``, ``optimizer``, or any other), the count, min, mean, median and max duration in seconds.

* ``step``, ``loader_*``, ``optimizer`` and any other section: the CPU duration (``dur``) of each range instance.
* ``forward`` and ``backward``: accelerator time, from the first kernel start to the last kernel end among the kernels
  launched inside the range instance: a launch (a runtime call named in :data:`LAUNCH_NAMES`, CUDA or HIP, matched by
  name whatever its ``cat``) on the range's pid/tid (any thread of the pid for ``backward``, whose kernels
  autograd launches from its own device threads) with ``range.ts <= launch.ts <= range.ts + range.dur``, tied to its
  kernel (``cat == "kernel"``) by ``args.correlation``. Copies and memsets (``cudaMemcpyAsync``, ``cudaMemsetAsync``
  and their GPU ``gpu_memcpy`` / ``gpu_memset`` events) are not kernels and are not counted: the sections time
  compute, and a copy the training loop makes is the loader's business. A graph launch counts all its kernels (they
  share its correlation id). An instance with no matched kernel (a CPU-only trace) falls back to its CPU duration;
  ``sources`` in the summary says which was used. GPU-timeline copies of the ranges (``gpu_user_annotation``) are
  ignored. Correlation ids are assumed unique within the trace (one process per trace, as torch writes them).

Memory: one pass keeps the section ranges (few) and, per launch and per kernel, only a few numbers in typed arrays
(20 and 24 bytes); ranges and kernels may come in any order in the file. The launch-to-kernel join uses a table
indexed by correlation id (4 bytes an id), not a dict.

Parsing (``parser``): ``"auto"`` (default) reads text in 1 MiB chunks and, when the events are laid out as
torch/kineto write them (each opens with a line holding only ``  {``), decodes only the events whose text holds a
kernel, section or launch marker, with the C scanner of :mod:`json`, and counts the others without decoding them;
any other layout, or text that stops fitting it, is read with ``"json"``: every event decoded by that scanner.
``"ijson"`` uses ``ijson.items`` (its C backend when built) where that package is installed. On a 1 GB synthetic
kineto trace on 2 cores (``python -m benchmarks.bench_trace --parser ...``): auto 70-111 MB/s (two sessions of this
shared machine), ijson 81 MB/s, json 70 MB/s, each about 65 MB peak RSS. Skipped events are not validated;
truncation is always detected, since the last events and the closing bracket go through the checked parser.

Standalone: standard library only (``fire`` and ``ijson`` are used when installed), nothing from the bundle, no
torch, so it runs on a laptop next to a trace copied from a cluster::

    python -m scripts.summarize_trace runs/profile/trace.json.gz [--format json]
    python summarize_trace.py trace.json            # the file copied anywhere
"""

from __future__ import annotations

import bisect
import gzip
import io
import json
import logging
import re
import statistics
import sys
import zipfile
import zlib
from array import array
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, NoReturn, TextIO

logger = logging.getLogger(__name__)

SECTION_PREFIX = "__sec:"
#: Row order of the table; other sections follow alphabetically.
SECTION_ORDER = ("step", "loader_first", "loader_next", "forward", "backward", "optimizer")
#: Sections timed on the accelerator (from their kernels) rather than by their CPU range.
KERNEL_TIMED = frozenset({"forward", "backward"})
#: sections whose kernels may be launched from other threads of the process (autograd's device threads)
PROCESS_WIDE = frozenset({"backward"})
CUDA_LAUNCH_NAMES = frozenset(
    {
        "cudaLaunchKernel",
        "cudaLaunchKernelExC",
        "cudaLaunchCooperativeKernel",
        "cudaLaunchCooperativeKernelMultiDevice",
        "cudaGraphLaunch",
        "cuLaunchKernel",
        "cuLaunchKernelEx",
        "cuLaunchCooperativeKernel",
        "cuGraphLaunch",
    }
)
HIP_LAUNCH_NAMES = frozenset(
    {
        "hipLaunchKernel",
        "hipExtLaunchKernel",
        "hipModuleLaunchKernel",
        "hipExtModuleLaunchKernel",
        "hipHccModuleLaunchKernel",
        "hipLaunchCooperativeKernel",
        "hipLaunchCooperativeKernelMultiDevice",
        "hipExtLaunchMultiKernelMultiDevice",
        "hipModuleLaunchCooperativeKernel",
        "hipGraphLaunch",
    }
)
LAUNCH_NAMES = CUDA_LAUNCH_NAMES | HIP_LAUNCH_NAMES
PARSERS = ("auto", "json", "ijson")

# API-version and per-thread-stream suffixes some tracers keep: cudaLaunchKernel_v7000, cudaLaunchKernel_ptsz.
_NAME_SUFFIX = re.compile(r"(?:_v\d+|_ptsz|_ptds|_spt)+$")
_NON_WS = re.compile(r"[^ \t\n\r]")
_SEPARATOR = re.compile(r"[ \t\n\r]*,[ \t\n\r]*")
_COMMA_NEXT = re.compile(r"[ \t\n\r]*,")
# kineto's layout: each top-level event opens with a line of two spaces and '{'. _MARKER finds the events that can
# matter: kernels, sections, launches (over-matching is harmless: every decoded event is filtered as usual).
_EVENT_START = "\n  {\n"
_MARKER = re.compile(r'"(?:kernel"|__sec:|(?:cu|hip)[A-Za-z]*Launch)')
_CHUNK_CHARS = 1 << 20  # characters read per refill of the event scanner
_MAX_PENDING_CHARS = 1 << 26  # one event larger than this is treated as malformed JSON


class TraceError(ValueError):
    """The trace cannot be summarised; the message names the file and says why."""


def summarize(path: str | Path, parser: str = "auto") -> dict[str, Any]:
    """Statistics per ``__sec:`` section of the trace at ``path``.

    Returns ``{"sections": {name: {"count", "min_s", "mean_s", "median_s", "max_s"}}, "sources": {name:
    "kernels" | "cpu" | "mixed"}, "trace": str, "events": int, "launches": int, "kernels": int, "parser": str}``
    plus ``"devices"`` (GPU names) when the trace records them. ``sections`` is ordered as :data:`SECTION_ORDER`.
    Raises :class:`TraceError` for a missing, empty, truncated or non-trace file, or one without sections.
    """
    path = Path(path)
    if parser not in PARSERS:
        raise TraceError(f"{path}: unknown parser {parser!r}; use one of {', '.join(PARSERS)}")
    state = _ReadState(skim=parser == "auto")
    try:
        if parser == "ijson":
            collected = _collect(_iter_events_ijson(path))
        else:
            try:
                with _open_text(path) as stream:
                    collected = _collect(_iter_events_json(stream, path, state))
            except (_LayoutMismatch, TraceError):
                if not state.skimmed:  # _LayoutMismatch comes only from skimming
                    raise
                logger.info("%s: not in kineto's layout after all; reading every event", path)
                state = _ReadState(skim=False)
                with _open_text(path) as stream:
                    collected = _collect(_iter_events_json(stream, path, state))
            collected.events += state.skipped
            parser = "json-skim" if state.skimmed else "json"
    except (OSError, EOFError, zlib.error, zipfile.BadZipFile) as exc:
        raise TraceError(f"{path}: cannot read: {exc}") from exc
    if collected.events == 0:
        raise TraceError(f"{path}: no trace events (an empty traceEvents list)")
    if not collected.ranges:
        raise TraceError(
            f"{path}: no '{SECTION_PREFIX}' ranges among {collected.events} events; was it profiled with the "
            f"bundle's record_function sections ({', '.join(SECTION_PREFIX + s for s in SECTION_ORDER)})?"
        )
    durations, sources = _resolve(collected)
    summary: dict[str, Any] = {
        "sections": {name: _stats(durations[name]) for name in _ordered(durations)},
        "sources": {name: sources[name] for name in _ordered(durations)},
        "trace": str(path),
        "events": collected.events,
        "launches": len(collected.launch_ts),
        "kernels": len(collected.kernel_corr),
        "parser": parser,
    }
    devices = _device_names(state.meta.get("deviceProperties"))
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
    return "\n".join(lines)


def main(trace: str, format: str = "text", parser: str = "auto") -> None:
    """Print the per-section statistics of TRACE (.json, .json.gz or .zip) as a table (``text``) or ``json``."""
    trace = str(trace)
    if format not in ("text", "json"):
        _fail(f"--format must be 'text' or 'json', not {format!r}")
    try:
        summary = summarize(trace, parser=parser)
    except TraceError as exc:
        _fail(str(exc))
    print(json.dumps(summary, indent=2) if format == "json" else format_table(summary))


def _fail(message: str) -> NoReturn:
    print(f"summarize_trace: error: {message}", file=sys.stderr)
    raise SystemExit(2)


# ----------------------------------------------------------------------------------------------------------- reading
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
                    raise TraceError(
                        f"{path}: a zip trace must hold exactly one .json member; it holds {names or 'nothing'}"
                    )
                with archive.open(members[0], "r") as stream:
                    yield stream
        else:
            yield raw


@contextmanager
def _open_text(path: Path) -> Iterator[TextIO]:
    with _open_binary(path) as stream:
        text = io.TextIOWrapper(stream, encoding="utf-8-sig", errors="replace", newline="")
        try:
            yield text
        finally:
            text.detach()


class _Scanner:
    """Walks a JSON text one value at a time with the C scanner of :mod:`json`, refilling a bounded buffer."""

    def __init__(self, stream: TextIO, path: Path) -> None:
        self.stream, self.path = stream, path
        self.buf, self.pos, self.base, self.eof = "", 0, 0, False
        self.scan = json.JSONDecoder().scan_once

    def fill(self) -> bool:
        if self.eof:
            return False
        data = self.stream.read(_CHUNK_CHARS)
        if not data:
            self.eof = True
            return False
        self.base += self.pos
        self.buf = self.buf[self.pos :] + data
        self.pos = 0
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
        char = self.peek()
        if char == "":
            raise self.error("truncated", f"the file ends inside {where}")
        if char not in chars:
            raise self.error("malformed", f"expected {' or '.join(repr(c) for c in chars)} {where}, found {char!r}")
        self.pos += 1
        return char

    def value(self) -> Any:
        """Decode the next complete JSON value (refilling the buffer when it ends inside it)."""
        if self.peek() == "":
            raise self.error("truncated", "the file ends where a value should start")
        while True:
            buf, pos = self.buf, self.pos
            try:
                obj, end = self.scan(buf, pos)
            except StopIteration as exc:  # "Expecting value" at exc.value
                err_pos, msg = exc.value, "Expecting value"
            except json.JSONDecodeError as exc:
                err_pos, msg = exc.pos, exc.msg
            else:
                if end < len(buf) or self.eof or not self.fill():  # a number could go on in the next chunk
                    self.pos = end
                    return obj
                continue
            at_end = err_pos >= len(buf) - 64 or msg.startswith("Unterminated string")
            if not at_end or len(buf) - pos > _MAX_PENDING_CHARS:
                raise self.error("malformed", f"{msg} at character {self.base + err_pos}")
            if not self.fill():
                raise self.error("truncated", f"{msg} at character {self.base + err_pos}, the end of the file")

    def error(self, kind: str, detail: str) -> TraceError:
        if kind == "truncated":
            return TraceError(f"{self.path}: truncated JSON ({detail}); was the trace still being written?")
        return TraceError(f"{self.path}: malformed JSON ({detail})")


class _ReadState:
    """What the event reader tells the caller besides the events: top-level keys, skipped events, mode used."""

    def __init__(self, skim: bool) -> None:
        self.skim = skim  # allowed to skip events that cannot matter (kineto layout only)
        self.skimmed = False  # it did
        self.skipped = 0
        self.meta: dict[str, Any] = {}


class _LayoutMismatch(Exception):
    """The text looked like kineto's layout but is not; the caller starts again with the full parser."""


def _iter_events_json(stream: TextIO, path: Path, state: _ReadState) -> Iterator[Any]:
    """Yield the trace events one by one; top-level keys other than ``traceEvents`` go to ``state.meta``."""
    sc = _Scanner(stream, path)
    first = sc.peek()
    if first == "":
        raise TraceError(f"{path}: empty file (no JSON in it)")
    if first == "[":
        yield from _iter_array(sc, state)
    elif first == "{":
        sc.pos += 1
        found = False
        if sc.peek() == "}":
            sc.pos += 1
        else:
            while True:
                key = sc.value()
                if not isinstance(key, str):
                    raise sc.error("malformed", f"an object key must be a string, found {key!r}")
                sc.expect(":", f"after the key {key!r}")
                if key == "traceEvents":
                    if sc.peek() != "[":
                        raise TraceError(f"{path}: not a chrome trace: 'traceEvents' is not a list")
                    found = True
                    yield from _iter_array(sc, state)
                else:
                    state.meta[key] = sc.value()
                if sc.expect(",}", "in the top-level object") == "}":
                    break
        if not found:
            raise TraceError(f"{path}: not a chrome trace: the top-level object has no 'traceEvents' list")
    else:
        raise TraceError(f"{path}: not a chrome trace: it does not start with '{{' or '[' (found {first!r})")
    if sc.peek() != "":
        raise sc.error("malformed", f"unexpected data after the JSON document at character {sc.base + sc.pos}")


def _iter_array(sc: _Scanner, state: _ReadState) -> Iterator[Any]:
    """Yield the values of the JSON array at the scanner's position.

    In kineto's layout the events are first skimmed (:func:`_skim_kineto`). The checked loop decodes value after
    value straight from the buffer while each is followed by a comma inside it; anything else (the end of the
    buffer, the closing bracket, an error) goes through :meth:`_Scanner.value` and :meth:`_Scanner.expect`.
    """
    sc.expect("[", "at the start of the event list")
    if sc.peek() == "]":
        sc.pos += 1
        return
    if state.skim and _kineto_layout(sc):
        state.skimmed = True
        after_value = yield from _skim_kineto(sc, state)
        if after_value is None:  # the skim reached the closing bracket
            return
        if after_value and sc.expect(",]", "in the traceEvents list") == "]":
            return
    scan, separator = sc.scan, _SEPARATOR.match
    while True:
        buf, pos = sc.buf, sc.pos
        while True:
            try:
                obj, end = scan(buf, pos)
            except (StopIteration, json.JSONDecodeError):
                break
            comma = separator(buf, end)
            if comma is None:
                break
            yield obj
            pos = comma.end()
        sc.pos = pos
        yield sc.value()
        if sc.expect(",]", "in the traceEvents list") == "]":
            return


def _kineto_layout(sc: _Scanner) -> bool:
    """Whether the first event opens with a line holding only two spaces and '{', as torch/kineto write it."""
    pos = sc.pos
    return sc.buf[pos] == "{" and sc.buf[pos - 3 : pos] == _EVENT_START[:3] and sc.buf[pos + 1 : pos + 2] == "\n"


def _skim_kineto(sc: _Scanner, state: _ReadState) -> Iterator[Any]:
    """Yield only the events that can matter, in kineto's layout; return where the checked parser goes on.

    JSON strings hold no raw newline, so in kineto's layout a line holding only ``  {`` opens a top-level event.
    The text is searched for :data:`_MARKER` (``"kernel"``, ``"__sec:``, a ``cu``/``hip`` launch name); only the
    event around a marker is decoded, and it must be followed by ``,`` or ``]``, else :class:`_LayoutMismatch`.
    Events without a marker are counted, not decoded. Returns ``None`` when the array is finished, otherwise
    whether ``sc.pos`` is just after an event (``True``) or at the start of one (``False``); the last events and
    the closing bracket always go through the checked parser, so truncation is reported as without skimming.
    """
    find, opener, scan, comma = _MARKER.search, _EVENT_START, sc.scan, _COMMA_NEXT.match
    pos = sc.pos - 3
    after_value = False
    while True:
        buf = sc.buf
        marker = find(buf, pos)
        if marker is None:
            keep = buf.rfind(opener, pos)  # that event may go on in the next chunk
            if keep >= 0:
                state.skipped += buf.count(opener, pos, keep)
                pos, after_value = keep, False
            sc.pos = pos
            if len(buf) - pos > _MAX_PENDING_CHARS or not sc.fill():
                return after_value
            pos = sc.pos
            continue
        start = buf.rfind(opener, pos, marker.start())
        if start < 0:  # after an event comes ',' and another event (or ']', handled below): not kineto's layout
            raise _LayoutMismatch
        state.skipped += buf.count(opener, pos, start)
        try:  # the common case: the event and the comma after it are in the buffer
            event, end = scan(buf, start + 3)
        except (StopIteration, json.JSONDecodeError):
            end = -1
        if end >= 0 and comma(buf, end) is not None:
            if not isinstance(event, dict) or "ph" not in event:
                raise _LayoutMismatch
            yield event
            pos, after_value = end, True
            continue
        sc.pos = start + 3  # at the end of the buffer, the last event, or an error: the checked path
        event = sc.value()
        char = sc.peek()
        if char not in (",", "]") or not isinstance(event, dict) or "ph" not in event:
            raise _LayoutMismatch
        yield event
        if char == "]":
            sc.pos += 1
            return None
        pos, after_value = sc.pos, True


def _iter_events_ijson(path: Path) -> Iterator[Any]:
    """Yield the trace events with ijson (its C backend when built), for comparison with the default parser."""
    try:
        import ijson
    except ImportError as exc:
        raise TraceError(f"{path}: parser='ijson' needs the ijson package (pip install ijson)") from exc
    with _open_binary(path) as stream:
        head = stream.read(1 << 16).lstrip()
    if not head:
        raise TraceError(f"{path}: empty file (no JSON in it)")
    if head[:1] not in (b"{", b"["):
        raise TraceError(f"{path}: not a chrome trace: it does not start with '{{' or '['")
    prefix = "item" if head[:1] == b"[" else "traceEvents.item"
    logger.debug("ijson backend %s", ijson.backend)
    with _open_binary(path) as stream:
        try:
            yield from ijson.items(stream, prefix, use_float=True)
        except ijson.IncompleteJSONError as exc:
            detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise TraceError(f"{path}: truncated or malformed JSON ({detail})") from exc
        except ijson.JSONError as exc:
            detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise TraceError(f"{path}: malformed JSON ({detail})") from exc


# ---------------------------------------------------------------------------------------------------------- analysis
class _Collected:
    """What one pass keeps: section ranges, and compact arrays for launches and kernels."""

    def __init__(self) -> None:
        self.events = 0
        self.ranges: list[tuple[str, int, float, float]] = []  # (section, thread index, ts, dur)
        self.threads: dict[tuple[Any, Any], int] = {}
        self.launch_thread, self.launch_ts, self.launch_corr = array("i"), array("d"), array("q")
        self.kernel_corr, self.kernel_start, self.kernel_end = array("q"), array("d"), array("d")


def _is_launch_name(name: str, cache: dict[str, bool]) -> bool:
    known = cache.get(name)
    if known is None:
        known = cache[name] = _NAME_SUFFIX.sub("", name) in LAUNCH_NAMES
    return known


def _collect(events: Iterable[Any]) -> _Collected:
    """One pass over the events, keeping only what :func:`_resolve` needs."""
    out = _Collected()
    ranges, threads = out.ranges, out.threads
    l_thread, l_ts, l_corr = out.launch_thread.append, out.launch_ts.append, out.launch_corr.append
    k_corr, k_start, k_end = out.kernel_corr.append, out.kernel_start.append, out.kernel_end.append
    launch_names, name_cache, prefix, n_prefix = LAUNCH_NAMES, {}, SECTION_PREFIX, len(SECTION_PREFIX)
    count = 0
    for ev in events:
        count += 1
        try:
            if ev.get("ph") != "X":
                continue
            name = ev.get("name")
            if ev.get("cat") == "kernel":
                corr = int(ev["args"]["correlation"])
                if corr > 0:
                    ts = float(ev["ts"])
                    k_corr(corr)
                    k_start(ts)
                    k_end(ts + float(ev["dur"]))
            elif name in launch_names or (
                name.startswith(("cu", "hip")) and "_" in name and _is_launch_name(name, name_cache)
            ):
                corr = int(ev["args"]["correlation"])
                if corr > 0:
                    key = (ev.get("pid"), ev.get("tid"))
                    index = threads.get(key)
                    if index is None:
                        index = threads[key] = len(threads)
                    l_ts(float(ev["ts"]))
                    l_thread(index)
                    l_corr(corr)
            elif name.startswith(prefix) and not str(ev.get("cat", "")).startswith("gpu_"):
                key = (ev.get("pid"), ev.get("tid"))
                index = threads.get(key)
                if index is None:
                    index = threads[key] = len(threads)
                ranges.append((name[n_prefix:], index, float(ev["ts"]), float(ev["dur"])))
        except (AttributeError, KeyError, TypeError, ValueError, OverflowError):
            continue  # not an event of interest, or one without the fields it needs
    out.events = count
    return out


def _resolve(c: _Collected) -> tuple[dict[str, list[float]], dict[str, str]]:
    """Duration (µs) of every range instance, and per section whether kernels or CPU ranges gave them."""
    # Kernel-timed ranges per thread, sorted by start, with the running maximum of their ends so that the
    # backward scan from a launch stops as soon as no earlier range can still contain it.
    # Backward kernels are launched by autograd's device threads, not the thread that opened the range, so backward
    # ranges match launches from any thread of their process (keyed by a per-process pseudo-thread).
    process_of = {index: c.threads.setdefault((key[0], "*"), len(c.threads)) for key, index in list(c.threads.items())}
    per_thread: dict[int, tuple[list[float], list[float], list[float], list[int]]] = {}
    for rid in sorted(
        (i for i, r in enumerate(c.ranges) if r[0] in KERNEL_TIMED), key=lambda i: (c.ranges[i][1], c.ranges[i][2])
    ):
        section, thread, ts, dur = c.ranges[rid]
        if section in PROCESS_WIDE:
            thread = process_of[thread]
        starts, ends, reach, rids = per_thread.setdefault(thread, ([], [], [], []))
        starts.append(ts)
        ends.append(ts + dur)
        reach.append(max(ts + dur, reach[-1]) if reach else ts + dur)
        rids.append(rid)
    # Launches inside a kernel-timed range: (correlation, range id) pairs, a launch in nested ranges once per range.
    launched, owner = array("q"), array("i")
    for thread, ts, corr in zip(c.launch_thread, c.launch_ts, c.launch_corr, strict=True):
        for key in (thread, process_of.get(thread)):
            lists = per_thread.get(key)
            if lists is None:
                continue
            starts, ends, reach, rids = lists
            j = bisect.bisect_right(starts, ts) - 1
            while j >= 0 and reach[j] >= ts:
                if ends[j] >= ts:
                    launched.append(corr)
                    owner.append(rids[j])
                j -= 1
    owners_of = _owner_lookup(launched, owner)
    del launched, owner
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    for corr, start, end in zip(c.kernel_corr, c.kernel_start, c.kernel_end, strict=True):
        for rid in owners_of(corr):
            if start < first.get(rid, start + 1.0):
                first[rid] = start
            if end > last.get(rid, end - 1.0):
                last[rid] = end
    durations: dict[str, list[float]] = {}
    from_kernels: dict[str, int] = {}
    for rid, (section, _, _, dur) in enumerate(c.ranges):
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


def _owner_lookup(launched: array, owner: array) -> Any:
    """A function correlation -> range ids, for the kernels' side of the join.

    CUDA/HIP correlation ids count up from 1 per process, so a table indexed by ``id - min`` (4 bytes an entry) is
    far smaller than a dict (about 100 bytes an entry) whenever the ids are dense; sparse ids get the dict.
    """
    none: tuple[int, ...] = ()
    if not launched:
        return lambda corr: none
    low, high = min(launched), max(launched)
    extra: dict[int, list[int]] = {}  # ids launched from nested ranges: all but the first range
    if high - low < 4 * len(launched) + 1024:
        table = array("i", [-1]) * (high - low + 1)
        for corr, rid in zip(launched, owner, strict=True):
            if table[corr - low] < 0:
                table[corr - low] = rid
            else:
                extra.setdefault(corr, []).append(rid)

        def lookup(corr: int) -> Any:
            index = corr - low
            if index < 0 or index > high - low or table[index] < 0:
                return none
            return (table[index], *extra[corr]) if extra and corr in extra else (table[index],)

        return lookup
    first: dict[int, int] = {}
    for corr, rid in zip(launched, owner, strict=True):
        if corr in first:
            extra.setdefault(corr, []).append(rid)
        else:
            first[corr] = rid

    def lookup_sparse(corr: int) -> Any:
        rid = first.get(corr)
        if rid is None:
            return none
        return (rid, *extra[corr]) if corr in extra else (rid,)

    return lookup_sparse


def _stats(values_us: list[float]) -> dict[str, Any]:
    """count, min, mean, median, max of durations in µs, as seconds rounded to the nanosecond (the trace's
    resolution)."""
    return {
        "count": len(values_us),
        "min_s": round(min(values_us) / 1e6, 9),
        "mean_s": round(statistics.fmean(values_us) / 1e6, 9),
        "median_s": round(statistics.median(values_us) / 1e6, 9),
        "max_s": round(max(values_us) / 1e6, 9),
    }


def _ordered(names: Iterable[str]) -> list[str]:
    rank = {name: i for i, name in enumerate(SECTION_ORDER)}
    return sorted(names, key=lambda name: (rank.get(name, len(rank)), name))


def _device_names(properties: Any) -> list[str]:
    if not isinstance(properties, list):
        return []
    return [str(p["name"]) for p in properties if isinstance(p, dict) and "name" in p]


def _cli() -> None:
    try:
        import fire
    except ImportError:  # a laptop without fire: the same interface through argparse
        import argparse

        cli = argparse.ArgumentParser(prog="summarize_trace", description=main.__doc__)
        cli.add_argument("trace")
        cli.add_argument("--format", default="text", choices=("text", "json"))
        cli.add_argument("--parser", default="auto", choices=PARSERS)
        args = cli.parse_args()
        main(args.trace, format=args.format, parser=args.parser)
    else:
        fire.Fire(main)


if __name__ == "__main__":
    _cli()

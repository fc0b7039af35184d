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

Parsing (``parser``): ``"auto"`` (default, standard library) reads text in 1 MiB chunks and skims it, whatever the
layout and however layouts are mixed in one file (kineto's templates of any year, one event a line, keys sharing
lines, indented): each chunk is searched once, in C, for the text between two events (``}``, comma, ``{`` and a key),
for objects opened inside lists (which could be events' args rather than events), and for the literals that an event
that can matter must hold (``"correlation"``, ``"__sec:``, or any backslash escape). Events between two such
boundaries are counted without being decoded; those holding a literal are decoded from their exact text by the C
scanner of :mod:`json`; an event whose text is ambiguous (a list of objects inside it, or such text in its strings) is
decoded by that scanner on its own, and counting goes on after it. No text is searched or decoded more than a
constant number of times (:class:`_ArrayReader`; ``work`` counts it). ``"json"`` decodes every event. ``"orjson"``
(optional: ``pip install orjson``) skims the same way but decodes the picked events with orjson, about 3x faster than
the json scanner, to the same values. ``"ijson"`` uses ``ijson.items`` where that package is installed. The file is
read (and inflated) by a read-ahead thread. On a trace of 8 MiB or more with two CPUs free, the picked events are
decoded by a second process (this file run again, fed through a pipe) while this one reads and skims: the two halves
of the work overlap, and the summary is the same (``decode_process``). Two CPUs free: :func:`usable_cpus`, the
affinity mask and any cgroup CPU quota (a container limited to one CPU keeps one process).
``python -m benchmarks.bench_trace`` measures every shape. Skipped events are not validated; truncation is always
detected, since the last events and the closing bracket go through the checked parser.

Standalone: standard library only (``fire`` is used when installed; ``orjson`` and ``ijson`` when installed and asked
for), nothing from the bundle, no torch, so it runs on a laptop next to a trace copied from a cluster::

    python -m scripts.summarize_trace runs/profile/trace.json.gz [--format json]
    python summarize_trace.py trace.json            # the file copied anywhere
"""

from __future__ import annotations

import bisect
import contextlib
import gzip
import io
import json
import logging
import math
import operator
import os
import pickle
import queue
import re
import statistics
import struct
import subprocess
import sys
import threading
import zipfile
import zlib
from array import array
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, NoReturn

try:
    import fcntl
except ImportError:  # pragma: no cover - not Unix
    fcntl = None  # type: ignore[assignment]

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
PARSERS = ("auto", "json", "orjson", "ijson")

# API-version and per-thread-stream suffixes some tracers keep: cudaLaunchKernel_v7000, cudaLaunchKernel_ptsz.
_NAME_SUFFIX = re.compile(r"(?:_v\d+|_ptsz|_ptds|_spt)+$")
_NON_WS = re.compile(r"[^ \t\n\r]")
_SEPARATOR = re.compile(r"[ \t\n\r]*,[ \t\n\r]*")
# Literals in the text of every event that can matter: a kernel or a launch is kept only with its args' correlation id,
# a section by its name; and a backslash, so that an event whose strings hold escapes (a key or a name could be written
# with \u escapes) is decoded too. Over-matching is harmless (copies and other runtime calls carry a correlation id
# too): every decoded event is filtered as usual. One literal for kernels and launches, rather than "kernel" and
# "Launch", is one search of the text less.
_MARKERS = ('"correlation"', '"__sec:', "\\")
# Two consecutive objects of one list: '}', a comma, '{' (group 1) and a key starting with a letter (see _ArrayReader).
_BOUNDARY = re.compile(r'\}[ \t\n\r]*+,[ \t\n\r]*+(\{)[ \t\n\r]*+"[A-Za-z_]')
# An object opened as a list element: a '{' after a comma or a '[' (whitespace between); after 9 or more whitespace
# characters whatever precedes them (over-matching only sends an event to the scanner). The first two lookbehinds
# only make the common '{' of an object value (': {') fail fast.
_OBJECT_IN_LIST = re.compile(
    r"\{(?<!:\{)(?<!: \{)(?:(?<=[,\[]\{)"
    + "".join(rf"|(?<=[,\[][ \t\n\r]{{{n}}}\{{)" for n in range(1, 9))
    + r"|(?<=[ \t\n\r]{9}\{))"
)
_CHUNK_CHARS = 1 << 20  # characters (bytes) read per refill of the event scanner
_BOM = "\xef\xbb\xbf"  # UTF-8's byte order mark, read as Latin-1
_READ_AHEAD = 4  # chunks read (and inflated) ahead of the parser
_SWITCH_INTERVAL_S = 0.0001  # while reading: how soon the read-ahead thread gets the GIL back from the parser
_GZIP_READ = 1 << 18  # compressed bytes read at a time
_INFLATE_CHUNK = 1 << 22  # inflated bytes per zlib call: the thread takes the GIL once per chunk
_MAX_PENDING_CHARS = 1 << 26  # one event larger than this is treated as malformed JSON
_BATCH_CHARS = 1 << 20  # event text sent to the decoding process at a time
_BATCHES_AHEAD = 8  # batches waiting for the decoding process (bounded memory)
#: Traces of at least this many bytes of JSON (uncompressed) are decoded in a second process when two CPUs are free:
#: below it, starting the process (~0.1 s) costs more than it saves.
DECODE_PROCESS_MIN_BYTES = 8 << 20
#: What ``summarize(..., work=dict)`` counts, in bytes of (uncompressed) trace: ``read`` from the file, ``indexed``
#: (searched for boundaries, taints and markers), ``decoded`` (handed to a decoder); and ``fills``
#: (buffer refills).
WORK_KEYS = ("read", "indexed", "decoded", "fills")


class TraceError(ValueError):
    """The trace cannot be summarised; the message names the file and says why."""


def summarize(
    path: str | Path, parser: str = "auto", work: dict[str, int] | None = None, decode_process: bool | None = None
) -> dict[str, Any]:
    """Statistics per ``__sec:`` section of the trace at ``path``.

    Returns ``{"sections": {name: {"count", "min_s", "mean_s", "median_s", "max_s"}}, "sources": {name:
    "kernels" | "cpu" | "mixed"}, "trace": str, "events": int, "launches": int, "kernels": int, "parser": str}``
    plus ``"devices"`` (GPU names) when the trace records them. ``sections`` is ordered as :data:`SECTION_ORDER`.
    ``work``, a dict, receives what reading cost (:data:`WORK_KEYS`; the json parsers): linear in the file's size
    whatever its layout. ``decode_process``: decode the picked events in a second process while this one reads and
    skims (``None``: for traces of :data:`DECODE_PROCESS_MIN_BYTES` or more, uncompressed, when two CPUs are free;
    the summary is the same either way). Raises :class:`TraceError` for a missing, empty, truncated or non-trace
    file, or one without sections.
    """
    path = Path(path)
    if parser not in PARSERS:
        raise TraceError(f"{path}: unknown parser {parser!r}; use one of {', '.join(PARSERS)}")
    skim = parser in ("auto", "orjson")
    fast = _accelerator(path) if parser == "orjson" else None
    if decode_process is None:
        decode_process = skim and usable_cpus() >= 2 and _text_size(path) >= DECODE_PROCESS_MIN_BYTES
    if decode_process and skim:
        try:
            return _summarize(path, parser, work, fast, _DecodeProcess.start(path, fast is not None))
        except _DecodeProcessFailed as exc:
            logger.warning("%s; decoding in this process instead", exc)
    return _summarize(path, parser, work, fast, None)


def _summarize(
    path: Path, parser: str, work: dict[str, int] | None, fast: Any, process: _DecodeProcess | None
) -> dict[str, Any]:
    """:func:`summarize` with the events decoded here (``process`` None) or by ``process``."""
    collected = _Collected()
    state = _ReadState(collected, skim=parser in ("auto", "orjson"), work=work)
    state.fast = fast
    try:
        if parser == "ijson":
            for event in _iter_events_ijson(path):
                state.add(event)
                state.decoded += 1
        else:
            with contextlib.ExitStack() as stack:
                if process is not None:
                    stack.enter_context(process)
                    state.decoder = process
                    state.add = process.add
                with _open_text(path) as stream:
                    _read_events_json(stream, path, state)
                if process is not None:
                    collected = process.finish()
            parser = ("orjson" if state.fast else "json") + ("-skim" if state.skimmed else "")
        collected.events = state.decoded + state.skipped
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


def main(trace: str, format: str = "text", parser: str = "auto", decode_process: bool | None = None) -> None:
    """Print the per-section statistics of TRACE (.json, .json.gz or .zip) as a table (``text``) or ``json``.

    ``--parser``: ``auto`` (standard library, the default), ``orjson`` (the same skim, events decoded by the optional
    orjson package: faster), ``json`` (every event decoded) or ``ijson``. ``--decode_process``: decode the picked
    events in a second process (default: for traces of 8 MiB or more, uncompressed, when two CPUs are free;
    ``false`` keeps it to one process)."""
    trace = str(trace)
    if format not in ("text", "json"):
        _fail(f"--format must be 'text' or 'json', not {format!r}")
    if isinstance(decode_process, str) and decode_process.lower() in ("true", "false"):
        decode_process = decode_process.lower() == "true"  # fire reads True/False as bools, true/false as strings
    if decode_process is not None and not isinstance(decode_process, bool):
        _fail(f"--decode_process must be true or false, not {decode_process!r}")
    try:
        summary = summarize(trace, parser=parser, decode_process=decode_process)
    except TraceError as exc:
        _fail(str(exc))
    print(json.dumps(summary, indent=2) if format == "json" else format_table(summary))


def _fail(message: str) -> NoReturn:
    """Print the message as the CLI's error and exit with status 2 (no traceback)."""
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
def _open_text(path: Path) -> Iterator[io.TextIOWrapper]:
    """The text of ``path`` byte for byte (as Latin-1: one character a byte, so every string operation runs on
    one-byte characters however much non-ASCII text the trace holds; :func:`_utf8` decodes what is kept);
    read ahead by a thread (and inflated there when compressed).

    While the file is read, the interpreter's switch interval is :data:`_SWITCH_INTERVAL_S` (restored after): at
    the default 5 ms the reading thread waited that long for the GIL each time it came back from zlib or the disk,
    and the parser then waited for text (1 GB gzipped, mixed-after: 87.0 -> 104.9 MB/s with orjson)."""
    with _open_binary(path) as stream:
        if isinstance(stream, gzip.GzipFile):  # its file (not read yet), inflated in long zlib calls: _inflate
            ahead = _ReadAhead(_inflate(stream.fileobj, _INFLATE_CHUNK))
        else:
            ahead = _ReadAhead(iter(lambda: stream.read(_INFLATE_CHUNK), b""))
        text = io.TextIOWrapper(io.BufferedReader(ahead, _CHUNK_CHARS), encoding="latin-1", newline="")
        switch = sys.getswitchinterval()
        sys.setswitchinterval(_SWITCH_INTERVAL_S)
        try:
            yield text
        finally:
            sys.setswitchinterval(switch)
            text.detach()
            ahead.stop()


def _inflate(raw: BinaryIO, size: int) -> Iterator[bytes]:
    """The inflated bytes of a gzip file (every member; zero padding between members skipped, as :mod:`gzip`
    does), at most ``size`` bytes a chunk.

    Each zlib call turns up to :data:`_GZIP_READ` compressed bytes into up to ``size`` bytes, taking the GIL back
    only a few times per call (zlib releases it while it inflates). ``GzipFile`` feeds zlib 8 KiB at a time, so its
    thread had to win the GIL back from the parser every ~150 KB of output, up to a 5 ms switch interval each time,
    and the parser waited for text: on 1 GB gzipped traces this reader is 7-12 % faster (docs/performance.md)."""
    inflater, started, data, full = zlib.decompressobj(31), False, b"", False
    while True:
        if not started:
            data = data.lstrip(b"\0")
        if not data and not full:
            data = raw.read(_GZIP_READ)
            if not data:
                if started and not inflater.eof:
                    raise EOFError("the gzip stream ends before its end-of-stream marker")
                return
            continue
        out = inflater.decompress(data, size)
        started, full, data = True, len(out) == size, inflater.unconsumed_tail
        if out:
            yield out
        if inflater.eof:  # the next member, if any, starts in the bytes after this one
            data, full = inflater.unused_data + data, False
            inflater, started = zlib.decompressobj(31), False


class _ReadAhead(io.RawIOBase):
    """Bytes made by a thread (a file inflated) while the caller parses.

    zlib releases the GIL, so on two cores decompression costs the parser little. At most :data:`_READ_AHEAD`
    chunks wait; an error in the thread is raised in the reader's.
    """

    def __init__(self, chunks: Iterator[bytes]) -> None:
        super().__init__()
        self.chunks: queue.Queue[bytes | BaseException] = queue.Queue(_READ_AHEAD)
        self.rest, self.done, self.halt = memoryview(b""), False, threading.Event()
        self.thread = threading.Thread(target=self._run, args=(chunks,), daemon=True)
        self.thread.start()

    def _run(self, chunks: Iterator[bytes]) -> None:
        """Thread body: put chunks into the queue until the end (an empty chunk), an error (queued too) or
        :meth:`stop`."""
        try:
            for data in chunks:
                if self.halt.is_set():
                    return
                self.chunks.put(data)
            self.chunks.put(b"")
        except Exception as exc:  # handed to the reading thread, which raises it
            self.chunks.put(exc)

    def readable(self) -> bool:
        """Always: this stream is for reading."""
        return True

    def readinto(self, buffer: Any) -> int:
        """Copy the next bytes into ``buffer``; 0 at the end of the stream."""
        while not self.rest and not self.done:
            item = self.chunks.get()
            if isinstance(item, BaseException):
                self.done = True
                raise item
            self.rest, self.done = memoryview(item), not item
        n = min(len(buffer), len(self.rest))
        buffer[:n] = self.rest[:n]
        self.rest = self.rest[n:]
        return n

    def stop(self) -> None:
        """End the thread (before the stream under it is closed)."""
        self.halt.set()
        while self.thread.is_alive():
            with contextlib.suppress(queue.Empty):
                self.chunks.get(timeout=0.05)  # unblocks a thread waiting to put
        self.thread.join()


class _Scanner:
    """Walks a JSON text one value at a time with the C scanner of :mod:`json`, refilling a bounded buffer."""

    def __init__(self, stream: io.TextIOWrapper, path: Path, work: dict[str, int]) -> None:
        self.stream, self.path, self.work = stream, path, work
        self.buf, self.pos, self.base, self.eof = "", 0, 0, False
        self.generation = 0  # counts refills: an index of ``buf`` is valid while this is unchanged
        self.scan = json.JSONDecoder().scan_once

    def fill(self) -> bool:
        """Append the next chunk to the buffer (dropping the text before ``pos``); False at the end of the file.

        A chunk is at least as long as the text kept, so a value that spans many chunks is scanned again only
        as often as the buffer doubles: its cost stays linear in its length."""
        if self.eof:
            return False
        data = self.stream.read(max(_CHUNK_CHARS, len(self.buf) - self.pos))
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
            raise self.error("truncated", f"the file ends inside {where}")
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
            if not at_end or len(buf) - pos > _MAX_PENDING_CHARS:
                raise self.error("malformed", f"{msg} at byte {self.base + err_pos}")
            if not self.fill():
                raise self.error("truncated", f"{msg} at byte {self.base + err_pos}, the end of the file")

    def error(self, kind: str, detail: str) -> TraceError:
        """A :class:`TraceError` naming the file: ``truncated`` (asks whether it was still written) or malformed."""
        if kind == "truncated":
            return TraceError(f"{self.path}: truncated JSON ({detail}); was the trace still being written?")
        return TraceError(f"{self.path}: malformed JSON ({detail})")


class _ReadState:
    """The event reader's settings and tallies: where events go, top-level keys, events decoded and skipped, and
    the work done (bytes read, indexed and handed to a decoder; refills)."""

    def __init__(self, collected: _Collected, skim: bool, work: dict[str, int] | None = None) -> None:
        self.collected = collected
        self.add = _adder(collected)  # takes one decoded event
        self.skim = skim  # allowed to skip events that cannot matter
        self.fast: Any = None  # the accelerator's decoder of one event's text, if any
        self.decoder: Any = _LocalDecoder(self)  # decodes the texts of the picked events (or a _DecodeProcess)
        self.skimmed = False  # it did
        self.decoded = self.skipped = 0
        self.meta: dict[str, Any] = {}
        self.work = work if work is not None else {}
        for key in WORK_KEYS:
            self.work[key] = 0


def _read_events_json(stream: io.TextIOWrapper, path: Path, state: _ReadState) -> None:
    """Hand the trace events to ``state.add`` one by one; top-level keys other than ``traceEvents`` go to
    ``state.meta``."""
    sc = _Scanner(stream, path, state.work)
    while len(sc.buf) < len(_BOM) and sc.fill():
        pass
    if sc.buf.startswith(_BOM):
        sc.pos = len(_BOM)
    first = sc.peek()
    if first == "":
        raise TraceError(f"{path}: empty file (no JSON in it)")
    if first == "[":
        _ArrayReader(sc, state).read()
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
                    _ArrayReader(sc, state).read()
                else:
                    state.meta[key] = sc.value()
                if sc.expect(",}", "in the top-level object") == "}":
                    break
        if not found:
            raise TraceError(f"{path}: not a chrome trace: the top-level object has no 'traceEvents' list")
    else:
        raise TraceError(f"{path}: not a chrome trace: it does not start with '{{' or '[' (found {first!r})")
    if sc.peek() != "":
        raise sc.error("malformed", f"unexpected data after the JSON document at byte {sc.base + sc.pos}")


class _ArrayReader:
    """Reads the event list: every element decoded (``skim`` off), or only the events that can matter.

    Skimming rests on one pattern, :data:`_BOUNDARY`: ``}``, a comma, ``{`` and a key that starts with a letter,
    whitespace anywhere between. A raw ``"`` never occurs inside a JSON string and a string that closes cannot be
    followed by a letter, so that quote opens a key: no part of a match lies inside a string, and the two objects are
    consecutive elements of one list, whatever the layout of either (kineto's templates of any year, one line, keys
    sharing lines, indented, CRLF). That list may still be nested in an event (a list of objects in its args), or
    follow the event list; but the first object of any such list is opened right after a ``[``, or after a comma that
    follows no object, and :data:`_OBJECT_IN_LIST` finds every ``{`` opened after a ``[`` or a comma. So from a known
    element start, the text up to the next boundary is exactly one event when it holds no ``{`` of that kind other
    than the boundaries' own (a *taint*; one inside a string only costs a decode).

    Each buffer is indexed once, in C (:meth:`_index`): boundaries, taints, and the events holding a marker
    (:data:`_MARKERS`). Clean events are counted without being decoded; events with a marker are decoded from their
    exact text (orjson, or the json scanner, which must end exactly at the boundary); an element with a taint, or
    without a boundary after it in the buffer, is decoded by the json scanner on its own, and counting resumes at the
    next element. Only the unfinished event carried into the next buffer is indexed again, and a buffer grows by at
    least what it carries, so the work is linear in the text whatever the mix of layouts (``work`` counts it); the
    degraded path costs one decode per element it takes. The last events and the closing bracket always go through
    the scanner, so truncation and malformed endings are reported as without skimming.
    """

    def __init__(self, sc: _Scanner, state: _ReadState) -> None:
        self.sc, self.state = sc, state
        self.indexed = -1  # the scanner's generation the index below describes
        self.opens: list[int] = []  # the '{' of every boundary after the indexed position: where an event starts
        self.taints: list[int] = []  # where a list element opens other than at a boundary
        self.marked: list[int] = []  # the events (indices into opens: the boundary each ends at) holding a marker
        self.k = self.t = self.m = 0  # next boundary, taint, marked event
        self.tainted = False  # the last buffer indexed had taints

    def read(self) -> None:
        """Read the event list at the scanner's position, counting clean events and decoding the others."""
        sc = self.sc
        sc.expect("[", "at the start of the event list")
        if sc.peek() == "]":
            sc.pos += 1
            return
        if not self.state.skim:
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
        sc, scan, separator, state = self.sc, self.sc.scan, _SEPARATOR.match, self.state
        element, work = state.decoder.element, state.work
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
                element(sc, buf, pos, end, obj)
                state.decoded += 1
                sc.pos = comma.end()
                continue
            state.add(sc.value())  # at the end of the buffer, the last element, or an error: refills and reports
            state.decoded += 1
            if sc.expect(",]", "in the traceEvents list") == "]":
                return True
            sc.peek()  # at the next element
        return False

    def _skim(self) -> bool:
        """From ``sc.pos`` (an element's start), count the clean events up to the next taint and decode those with
        a marker; False when the element there needs the scanner (a taint in it, or no boundary after it)."""
        sc = self.sc
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
        size = sum(map(operator.sub, ends, starts))
        if picked:
            self.state.decoder.spans(sc, buf, starts, ends)
        self.state.work["decoded"] += size
        n = m_stop - m
        self.state.decoded += n
        self.state.skipped += stop - k - n
        self.state.skimmed = True
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
        self.state.work["indexed"] += len(buf) - pos
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
        for literal in _MARKERS:
            at = find(literal, pos, last)
            while at >= 0:
                s = bisect_right(opens, at)
                marked.add(s)
                at = find(literal, opens[s], last)  # the rest of that event needs no search
        self.marked = sorted(marked)


class _LocalDecoder:
    """Decodes the picked events in this process, in place where it can."""

    def __init__(self, state: _ReadState) -> None:
        self.state = state

    def spans(self, sc: _Scanner, buf: str, starts: list[int], ends: list[int]) -> None:
        """Decode the event at each ``start`` of ``buf``, which ends at the last ``}`` before its ``end`` (the next
        boundary), exactly one event each, and hand the events to the collector (orjson when given, else the json
        scanner in place; a text either refuses goes to :func:`_decode_exact`, which decodes it as UTF-8 or names
        the error)."""
        fast, scan, add, rfind = self.state.fast, sc.scan, self.state.add, buf.rfind
        ascii_text = buf.isascii()  # O(1): a str knows
        for start, end in zip(starts, ends, strict=True):
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

    def element(self, sc: _Scanner, buf: str, start: int, end: int, event: Any) -> None:
        """Hand over ``event``, which the scanner decoded from ``buf[start:end]`` (again as UTF-8 where the text is
        not ASCII)."""
        self.state.add(event if buf.isascii() else sc.scan(_utf8(buf[start:end]), 0)[0])


class _DecodeProcessFailed(RuntimeError):
    """The decoding process could not start, or died: the trace is read again without it."""


# Messages to the decoding process: a header (kind, n, size) and ``size`` bytes.
_HEADER = struct.Struct("<qqq")
_TEXT, _SPANS, _JSON = 0, 1, 2  # the reader's buffer (n: its offset in the trace); n (start, end) pairs; one event


class _DecodeProcess:
    """Decodes the picked events in a second process while this one reads, searches and picks.

    On two cores, reading and searching the text (C) and picking events is about half the work and decoding the
    picked events (building their dicts, keeping what matters) the other half; in one process they add up. This
    process sends each buffer it reads once (Latin-1 bytes: the file's bytes) and then the (start, next boundary)
    offsets of the events it picks in it, through the child's stdin, written by a thread (at most
    :data:`_BATCHES_AHEAD` messages wait); an event decoded here without its text (the last of a buffer) is sent as
    JSON. The child runs this same file (:func:`_decode_worker`) and decodes exactly as :class:`_LocalDecoder` does,
    in the order sent, so the summary is the in-process one; it sends back the collected arrays, or the first
    malformed event's error (with its byte), at which it stops at once.
    """

    def __init__(self, path: Path, proc: subprocess.Popen) -> None:
        self.path, self.proc = path, proc
        self.generation = -1  # the reader's buffer the child holds
        self.starts: list[int] = []  # offsets in that buffer of the events picked since it was sent
        self.ends: list[int] = []
        self.batches: queue.Queue[tuple[bytes, ...] | None] = queue.Queue(_BATCHES_AHEAD)
        self.broken: BaseException | None = None  # the writer's error: the child ended early
        self.result: dict[str, Any] | None = None
        self.probe = _Collected()  # scratch: what the collector would keep of an event decoded here
        self.probe_add = _adder(self.probe)
        self.writer = threading.Thread(target=self._write, daemon=True)
        self.writer.start()

    @classmethod
    def start(cls, path: Path, fast: bool) -> _DecodeProcess:
        """Start the child (this file, run by this interpreter); :class:`_DecodeProcessFailed` if it cannot."""
        code = (
            "import importlib.util, sys; "
            "spec = importlib.util.spec_from_file_location('_summarize_trace_worker', sys.argv[1]); "
            "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); "
            "module._decode_worker(sys.argv[2], sys.argv[3] == 'orjson')"
        )
        args = [sys.executable, "-c", code, str(Path(__file__).resolve()), str(path), "orjson" if fast else "json"]
        try:
            proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        except OSError as exc:
            raise _DecodeProcessFailed(f"{path}: cannot start the decoding process ({exc})") from exc
        with contextlib.suppress(AttributeError, OSError):  # Linux: a 1 MiB pipe, 16x fewer switches to the child
            fcntl.fcntl(proc.stdin.fileno(), fcntl.F_SETPIPE_SZ, _BATCH_CHARS)
        return cls(path, proc)

    def _matters(self, event: Any) -> bool:
        """Whether the collector keeps anything of ``event`` (tried on a scratch collector, emptied again)."""
        self.probe_add(event)
        probe = self.probe
        if not (probe.ranges or probe.launch_ts or probe.kernel_corr):
            return False
        self.probe = _Collected()
        self.probe_add = _adder(self.probe)
        return True

    def add(self, event: Any) -> None:
        """An event decoded here without its text (the last events of a buffer): sent as JSON if it matters."""
        if self._matters(event):
            self._flush()
            self._send(_JSON, 0, json.dumps(event).encode("ascii"))

    def element(self, sc: _Scanner, buf: str, start: int, end: int, event: Any) -> None:
        """An event the scanner decoded here from ``buf[start:end]`` (one with a list of objects inside, or the
        last of a buffer): its span is sent, to be decoded there again, only if it matters (most do not)."""
        if self._matters(event):
            self.spans(sc, buf, [start], [end])

    def spans(self, sc: _Scanner, buf: str, starts: list[int], ends: list[int]) -> None:
        """Queue the picked events' offsets; they are sent once per buffer, after the buffer itself."""
        if sc.generation != self.generation:
            self._flush()
            self.generation = sc.generation
            self._send(_TEXT, sc.base, buf.encode("latin-1"))
        self.starts += starts
        self.ends += ends

    def _flush(self) -> None:
        """Send the offsets queued for the buffer the child holds."""
        if self.starts:
            self._send(_SPANS, len(self.starts), array("q", self.starts).tobytes(), array("q", self.ends).tobytes())
            self.starts, self.ends = [], []

    def _send(self, kind: int, n: int, *parts: bytes) -> None:
        """Queue one message for the writer thread."""
        batch = (_HEADER.pack(kind, n, sum(map(len, parts))), *parts)
        while self.writer.is_alive():
            try:
                self.batches.put(batch, timeout=0.05)
                return
            except queue.Full:
                continue
        self._collect()  # the child stopped reading: raise its error, or say it died
        raise _DecodeProcessFailed(f"{self.path}: the decoding process stopped reading ({self.broken})")

    def _write(self) -> None:
        """Writer thread: send the messages to the child's stdin, then close it (the end of the input)."""
        stdin = self.proc.stdin
        try:
            for batch in iter(self.batches.get, None):
                for part in batch:
                    stdin.write(part)
        except OSError as exc:  # the child ended early (an error it reports) or died
            self.broken = exc
        finally:
            with contextlib.suppress(OSError):
                stdin.close()

    def _end_input(self) -> None:
        """Let the writer finish (it closes the child's input) and wait for it."""
        while self.writer.is_alive():
            try:
                self.batches.put(None, timeout=0.05)
                break
            except queue.Full:
                continue
        self.writer.join()

    def finish(self) -> _Collected:
        """Send what is queued, wait for the child and return what it collected (raises its error)."""
        self._flush()
        return self._collect()

    def _collect(self) -> _Collected:
        """End the input, read the child's result and return its collected events; raise its TraceError, or
        :class:`_DecodeProcessFailed` if it died."""
        if self.result is None:
            self._end_input()
            data = self.proc.stdout.read()
            code = self.proc.wait()
            try:
                self.result = pickle.loads(data)
            except Exception as exc:
                raise _DecodeProcessFailed(
                    f"{self.path}: the decoding process ended without a result (exit status {code})"
                ) from exc
        result = self.result
        if result["error"]:
            raise TraceError(result["error"])
        return _collected_from(result)

    def __enter__(self) -> _DecodeProcess:
        return self

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        """On an error here, the child's own error comes first (it is earlier in the file); always end the child."""
        try:
            if isinstance(exc, TraceError):
                self._flush()
                self._collect()  # raises the child's error when it had one
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self._end_input()
            self.proc.stdout.close()


def _decode_worker(path: str, fast: bool) -> None:
    """The decoding process (:class:`_DecodeProcess`): read the messages from stdin, decode every picked event in
    order, write the collected arrays (pickled) to stdout at the end, or the first malformed event's error."""
    collected = _Collected()
    add, scan, error = _adder(collected), json.JSONDecoder().scan_once, None
    loads = _accelerator(Path(path)) if fast else None
    stdin, size_of = sys.stdin.buffer, _HEADER.size
    data, view, text, base, ascii_text = b"", memoryview(b""), "", 0, True
    while error is None:
        head = stdin.read(size_of)
        if len(head) < size_of:
            break
        kind, n, size = _HEADER.unpack(head)
        message = stdin.read(size)
        if kind == _TEXT:  # orjson reads the bytes; the json scanner and error messages need the text
            data, view, base = message, memoryview(message), n
            text = "" if loads is not None else data.decode("latin-1")
            ascii_text = text.isascii()
            continue
        if kind == _JSON:
            add(json.loads(message))
            continue
        starts, ends = array("q"), array("q")
        starts.frombytes(message[: 8 * n])
        ends.frombytes(message[8 * n :])
        rfind = data.rfind
        try:
            for start, end in zip(starts, ends, strict=True):
                stop = rfind(b"}", start, end) + 1
                if loads is not None:
                    try:
                        add(loads(view[start:stop]))
                        continue
                    except ValueError:
                        pass
                elif ascii_text:
                    try:
                        event, at = scan(text, start)
                    except (StopIteration, json.JSONDecodeError):
                        at = -1
                    if at == stop:
                        add(event)
                        continue
                add(_decode_exact(data[start:stop].decode("utf-8", "replace"), scan, path, base + start))
        except TraceError as exc:
            error = str(exc)
    result = {
        "error": error,
        "ranges": collected.ranges,
        "threads": list(collected.threads.items()),
        **{name: getattr(collected, name).tobytes() for name in _Collected.ARRAYS},
    }
    sys.stdout.buffer.write(pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))
    sys.stdout.buffer.flush()


def _collected_from(result: dict[str, Any]) -> _Collected:
    """The :class:`_Collected` a decoding process sent back."""
    collected = _Collected()
    collected.ranges = result["ranges"]
    collected.threads = dict(result["threads"])
    for name in _Collected.ARRAYS:
        getattr(collected, name).frombytes(result[name])
    return collected


CGROUP_ROOT = Path("/sys/fs/cgroup")


def usable_cpus(root: Path = CGROUP_ROOT) -> int:
    """The CPUs this process may use: its affinity mask (taskset, SLURM's binding), reduced to a cgroup CPU quota
    where one is set (Docker's --cpus, Kubernetes limits), rounded up; at least 1.

    The bundle's one count of CPUs (ONNX Runtime's threads, prepare's workers, this file's second process): it lives
    here because this file must run on its own, with the standard library only; the others import it."""
    try:
        count = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        count = os.cpu_count() or 1
    quota = cgroup_cpu_quota(root)
    return max(1, min(count, math.ceil(quota)) if quota else count)


def cgroup_cpu_quota(root: Path = CGROUP_ROOT) -> float | None:
    """CPUs allowed by the cgroup's quota (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``)."""
    try:
        text = (root / "cpu.max").read_text().split()
        if text and text[0] != "max":
            return int(text[0]) / int(text[1])
        return None
    except (OSError, ValueError, IndexError, ZeroDivisionError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def _text_size(path: Path) -> int:
    """About how many bytes of JSON ``path`` holds: its size, or for gzip the size its trailer records (modulo 4 GiB,
    hence at least the compressed size), for a zip its member's; 0 when it cannot be read (the reader then says
    why)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as raw:
            magic = raw.read(4)
            if magic[:2] == b"\x1f\x8b" and size >= 18:
                raw.seek(-4, io.SEEK_END)
                return max(size, struct.unpack("<I", raw.read(4))[0])
        if magic in (b"PK\x03\x04", b"PK\x05\x06"):
            with zipfile.ZipFile(path) as archive:
                return max([size] + [info.file_size for info in archive.infolist()])
        return size
    except (OSError, zipfile.BadZipFile, struct.error):
        return 0


def _decode_exact(text: str, scan: Any, path: Path | str, at: int) -> Any:
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
    """The text as UTF-8 (bad bytes replaced), from the one-character-a-byte text :func:`_open_text` reads."""
    return text if text.isascii() else text.encode("latin-1").decode("utf-8", "replace")


def _accelerator(path: Path) -> Any:
    """``orjson.loads``, the optional accelerator: it decodes the events that skimming picks about 3x faster than
    the :mod:`json` scanner, to the same values (a text it refuses, e.g. an integer beyond 64 bits or ``NaN``, goes
    to the :mod:`json` scanner instead)."""
    try:
        import orjson
    except ImportError as exc:
        raise TraceError(f"{path}: parser='orjson' needs the orjson package (pip install orjson)") from exc
    return orjson.loads


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

    ARRAYS = ("launch_thread", "launch_ts", "launch_corr", "kernel_corr", "kernel_start", "kernel_end")


def _is_launch_name(name: str, cache: dict[str, bool]) -> bool:
    """Whether ``name`` is a launch once API-version and stream suffixes are dropped (cached per name)."""
    known = cache.get(name)
    if known is None:
        known = cache[name] = _NAME_SUFFIX.sub("", name) in LAUNCH_NAMES
    return known


def _adder(out: _Collected) -> Callable[[Any], None]:
    """A function that keeps what :func:`_resolve` needs from one decoded event (ignoring any other event)."""
    ranges, threads = out.ranges, out.threads
    l_thread, l_ts, l_corr = out.launch_thread.append, out.launch_ts.append, out.launch_corr.append
    k_corr, k_start, k_end = out.kernel_corr.append, out.kernel_start.append, out.kernel_end.append
    launch_names, name_cache, prefix, n_prefix = LAUNCH_NAMES, {}, SECTION_PREFIX, len(SECTION_PREFIX)

    def add(ev: Any) -> None:
        """Keep a kernel's (correlation, start, end), a launch's (thread, ts, correlation) or a section range."""
        try:
            if ev.get("ph") != "X":
                return
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
            return  # not an event of interest, or one without the fields it needs

    return add


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
            """Range ids whose launches carry ``corr`` (table-indexed)."""
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
        """Range ids whose launches carry ``corr`` (dict-indexed)."""
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
    """Section names in :data:`SECTION_ORDER`, the others after them alphabetically."""
    rank = {name: i for i, name in enumerate(SECTION_ORDER)}
    return sorted(names, key=lambda name: (rank.get(name, len(rank)), name))


def _device_names(properties: Any) -> list[str]:
    """The GPU names in the trace's ``deviceProperties`` (none when absent or malformed)."""
    if not isinstance(properties, list):
        return []
    return [str(p["name"]) for p in properties if isinstance(p, dict) and "name" in p]


def _cli() -> None:
    """The command line: fire where installed, else the same options through argparse."""
    try:
        import fire
    except ImportError:  # a laptop without fire: the same interface through argparse
        import argparse

        cli = argparse.ArgumentParser(prog="summarize_trace", description=main.__doc__)
        cli.add_argument("trace")
        cli.add_argument("--format", default="text", choices=("text", "json"))
        cli.add_argument("--parser", default="auto", choices=PARSERS)
        cli.add_argument("--decode_process", default=None, choices=("true", "false"))
        args = cli.parse_args()
        main(args.trace, format=args.format, parser=args.parser, decode_process=args.decode_process)
    else:
        fire.Fire(main)


if __name__ == "__main__":
    _cli()

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

Parsing (``parser``): ``"auto"`` (default, standard library) reads text in 1 MiB chunks and skims it whatever the
layout (kineto's, one event a line, indented, one line): the first events, decoded in full, give the exact text
between two events (:class:`_ArrayReader`); after that only the events whose text holds a kernel, section or launch
marker are decoded (by the C scanner of :mod:`json`) and the others are counted by that text, which is trusted only
where cheap counts show that it separates events of the list; any other text is read event by event. ``"json"``
decodes every event. ``"orjson"`` (optional: ``pip install orjson``) skims the same way but decodes the picked events
with orjson, about 3x faster than the json scanner, to the same values. ``"ijson"`` uses ``ijson.items`` where that
package is installed. Compressed input is inflated by a read-ahead thread. ``python -m benchmarks.bench_trace``
measures every realistic shape. Skipped events are not validated; truncation is always detected, since the last
events and the closing bracket go through the checked parser.

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
import queue
import re
import statistics
import sys
import threading
import zipfile
import zlib
from array import array
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, NoReturn

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
# Literals found in every event that can matter: kernels, sections, launches (over-matching is harmless: every
# decoded event is filtered as usual). Names written with \u escapes would be missed; no trace writer does that.
_MARKERS = ('"kernel"', '"__sec:', "Launch")
# the text between two events: '}', the separator, '{' and the next event's first key and colon
_HEAD = re.compile(r'\}[ \t\n\r]*,[ \t\n\r]*\{[ \t\n\r]*(?P<key>"[^"\\]*"[ \t\n\r]*:)')
_LEARN_EVENTS = 4  # identical heads in a row before skimming
_CHUNK_CHARS = 1 << 20  # characters read per refill of the event scanner
_READ_AHEAD = 4  # chunks inflated ahead of the parser
_GZIP_READ = 1 << 18  # compressed bytes read at a time
_INFLATE_CHUNK = 1 << 22  # inflated bytes per zlib call: the thread takes the GIL once per chunk
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
    collected = _Collected()
    state = _ReadState(collected, skim=parser in ("auto", "orjson"))
    if parser == "orjson":
        state.fast = _accelerator(path)
    try:
        if parser == "ijson":
            for event in _iter_events_ijson(path):
                state.add(event)
                state.decoded += 1
        else:
            with _open_text(path) as stream:
                _read_events_json(stream, path, state)
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


def main(trace: str, format: str = "text", parser: str = "auto") -> None:
    """Print the per-section statistics of TRACE (.json, .json.gz or .zip) as a table (``text``) or ``json``.

    ``--parser``: ``auto`` (standard library, the default), ``orjson`` (the same skim, events decoded by the optional
    orjson package: faster), ``json`` (every event decoded) or ``ijson``."""
    trace = str(trace)
    if format not in ("text", "json"):
        _fail(f"--format must be 'text' or 'json', not {format!r}")
    try:
        summary = summarize(trace, parser=parser)
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
    """The decoded text of ``path`` (a BOM dropped, bad bytes replaced); compressed input is inflated ahead in a
    thread."""
    with _open_binary(path) as stream:
        if isinstance(stream, io.BufferedReader):
            ahead = None
        elif isinstance(stream, gzip.GzipFile):  # its file (not read yet), inflated in long zlib calls: _inflate
            ahead = _ReadAhead(_inflate(stream.fileobj, _INFLATE_CHUNK))
        else:
            ahead = _ReadAhead(iter(lambda: stream.read(_CHUNK_CHARS), b""))
        text = io.TextIOWrapper(
            stream if ahead is None else io.BufferedReader(ahead, _CHUNK_CHARS),
            encoding="utf-8-sig",
            errors="replace",
            newline="",
        )
        try:
            yield text
        finally:
            text.detach()
            if ahead is not None:
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

    def __init__(self, stream: io.TextIOWrapper, path: Path) -> None:
        self.stream, self.path = stream, path
        self.buf, self.pos, self.base, self.eof = "", 0, 0, False
        self.scan = json.JSONDecoder().scan_once

    def fill(self) -> bool:
        """Append the next chunk to the buffer (dropping the text before ``pos``); False at the end of the file."""
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
        """A :class:`TraceError` naming the file: ``truncated`` (asks whether it was still written) or malformed."""
        if kind == "truncated":
            return TraceError(f"{self.path}: truncated JSON ({detail}); was the trace still being written?")
        return TraceError(f"{self.path}: malformed JSON ({detail})")


class _ReadState:
    """The event reader's settings and tallies: where events go, top-level keys, events decoded and skipped."""

    def __init__(self, collected: _Collected, skim: bool) -> None:
        self.collected = collected
        self.add = _adder(collected)  # takes one decoded event
        self.skim = skim  # allowed to skip events that cannot matter
        self.fast: Any = None  # the accelerator's decoder of one event's text, if any
        self.skimmed = False  # it did
        self.decoded = self.skipped = 0
        self.meta: dict[str, Any] = {}


def _read_events_json(stream: io.TextIOWrapper, path: Path, state: _ReadState) -> None:
    """Hand the trace events to ``state.add`` one by one; top-level keys other than ``traceEvents`` go to
    ``state.meta``."""
    sc = _Scanner(stream, path)
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
        raise sc.error("malformed", f"unexpected data after the JSON document at character {sc.base + sc.pos}")


class _ArrayReader:
    """Reads the event list: every event decoded (checked mode), or, once the text between events is known, only the
    events that can matter (skim mode).

    Checked mode decodes value after value with the C scanner of :mod:`json` and checks the separators. From the
    first events it learns the *head*: the exact text from one event's closing ``}`` through the next event's first
    key and colon, e.g. ``},\\n  {\\n    "ph":`` in torch/kineto's layout or ``}, {"ph":`` on one line. A raw ``"``
    never occurs inside a JSON string, so in valid JSON every occurrence of the head is structural: an object closed,
    a comma, an object opened with that first key. Skim mode then searches the text for the literals of
    :data:`_MARKERS` and decodes only the event around each (the one opened by the last head before the marker).
    The events in between are counted, not decoded: a window between two heads holds as many events as heads, and
    that is trusted only when the window also holds exactly as many of the first key (``"ph":``) and of the gap (the
    head without its key): an event without that first key, a nested list of objects written with the same
    separator, or the end of the list shows as a difference, and the window is then read in checked mode. A decoded
    event must be a dict with ``ph`` that spans its marker. The last events and the closing bracket always go through
    checked mode, so truncation and malformed endings are reported as without skimming.
    """

    def __init__(self, sc: _Scanner, state: _ReadState) -> None:
        self.sc, self.state = sc, state
        self.head = ""
        self.same: tuple[str, ...] = ()  # texts that occur exactly once per head in a span (see _events_in)
        self.never: tuple[str, ...] = ()  # texts that do not occur in a span
        self.brace = 0  # index of the '{' in the head
        self.candidate, self.agreed = "", 0
        self.fast = state.fast  # optional accelerator: the text of one event -> the event (ValueError if not one)

    def read(self) -> None:
        """Read the event list at the scanner's position, switching between checked and skim mode."""
        sc = self.sc
        sc.expect("[", "at the start of the event list")
        if sc.peek() == "]":
            sc.pos += 1
            return
        target = 0
        while True:
            q = self._checked(target)
            if q is None:
                return
            self.state.skimmed = True
            target = self._skim(q)
            if target is None:
                return

    def _checked(self, target: int) -> int | None:
        """Decode events (``sc.pos`` at the next one) until the list ends (returns None) or, past the absolute
        offset ``target``, an event is followed by the learned head (returns the head's index in ``sc.buf``)."""
        sc, scan, separator, state = self.sc, self.sc.scan, _SEPARATOR.match, self.state
        skim, add = state.skim, state.add
        while True:
            sc.peek()  # the fast loop starts at a value, not at the whitespace before it
            buf, pos = sc.buf, sc.pos
            while True:  # events followed by a comma inside the buffer
                try:
                    obj, end = scan(buf, pos)
                except (StopIteration, json.JSONDecodeError):
                    break
                comma = separator(buf, end)
                if comma is None:
                    break
                add(obj)
                state.decoded += 1
                if skim and sc.base + end > target and self._at_head(buf, end - 1):
                    sc.pos = end - 1
                    return end - 1
                pos = comma.end()
            sc.pos = pos
            add(sc.value())  # at the end of the buffer, the last event, or an error: refills and reports
            state.decoded += 1
            end = sc.base + sc.pos
            if sc.expect(",]", "in the traceEvents list") == "]":
                return None
            at = end - 1 - sc.base
            if skim and end > target and at >= 0 and self._at_head(sc.buf, at):
                sc.pos = at
                return at

    def _at_head(self, buf: str, at: int) -> bool:
        """Whether the learned head starts at ``buf[at]`` (the '}' closing an event); learns it from the first
        events: :data:`_LEARN_EVENTS` consecutive identical heads."""
        if self.head:
            return buf.startswith(self.head, at)
        match = _HEAD.match(buf, at)
        if match is None:
            self.candidate, self.agreed = "", 0
            return False
        text = match.group()
        if text != self.candidate:
            self.candidate, self.agreed = text, 0
        self.agreed += 1
        if self.agreed < _LEARN_EVENTS:
            return False
        self.head, self.brace = text, text.index("{")
        space = text[2 : self.brace]  # between the comma and the '{'
        if "\n" in space:
            self.same, self.never = (space + "{",), ()
        else:
            self.same, self.never = ("," + space + "{",), tuple(dict.fromkeys(("[" + space + "{", "[{")))
        return True

    def _events_in(self, buf: str, start: int, stop: int) -> int:
        """The events in ``buf[start:stop]`` (``start`` at a head, ``stop`` at a head or an event's end): one per
        head, once every head there is known to sit between two events of the list; else -1.

        A head is an object closed, a comma, an object opened: two elements of *some* list. A nested list would
        show where its first object is opened: after ``[`` or after a comma that follows no object; so would an
        event that does not open with the key. Where the separator holds a line break (pretty-printed: kineto, one
        event a line, indented) every line-break-and-indent-then-``{`` must belong to a head; on one line, every
        ``,{`` (with the separator's spaces) must, and no ``[{`` may occur. (A writer is assumed to separate list
        items the same way everywhere; the event list's own opening lies before any span.)"""
        n = buf.count(self.head, start, stop)
        for needle in self.same:
            if buf.count(needle, start, stop) != n:
                return -1
        for needle in self.never:
            if buf.find(needle, start, stop) >= 0:
                return -1
        return n

    def _skim(self, q: int) -> int | None:
        """Skim from the head at ``sc.buf[q]``: decode the events around markers, count the others.

        Work is settled per span (a buffer's worth, see :meth:`_read_span`): its decoded events go to the
        collector at once (while in the cache) and are taken back unless :meth:`_events_in` vouches for the span,
        which checked mode then reads again. Returns None at the end of the list, else the absolute offset up to
        which checked mode must read, with ``sc.pos`` at the start of the event it goes on from."""
        sc, brace, state = self.sc, self.brace, self.state
        start = q
        while True:
            buf, mark = sc.buf, state.collected.mark()
            q, end, m, decoded = self._read_span(buf, q)
            n = self._events_in(buf, start, end if end > 0 else q)
            if n < 0:  # checked mode reads the span again
                state.collected.rollback(mark)
                sc.pos = start + brace
                return sc.base + max(end, q, m)
            state.decoded += decoded
            state.skipped += n - decoded
            if end == -2:  # no marker left, or its event goes on in the next chunk
                if not self._refill(q):
                    return sc.base + len(sc.buf)  # the tail of the list, or an oversized event: checked mode
                q = start = sc.pos
            elif end == -1:  # not an event around the marker after all: checked mode decodes it (or reports)
                sc.pos = q + brace
                return sc.base + m
            else:  # the list ends here, or the next event opens differently
                sc.pos = end
                if sc.expect(",]", "in the traceEvents list") == "]":
                    return None
                return sc.base + sc.pos

    def _read_span(self, buf: str, q: int) -> tuple[int, int, int, int]:
        """From the head at ``buf[q]``, hand the event around each marker to the collector while each is followed
        by a head; return ``(q, end, marker, decoded)``: the head reached, how it stopped (``end > 0``: an event
        that ends there without a head after it; -2: no marker left in ``buf``, ``q`` is then its last head, or
        the event at ``q`` goes on in the next chunk; -1: the event at ``q`` is not a trace event around
        ``marker``), and the number of events decoded."""
        head, brace, scan, fast, add = self.head, self.brace, self.sc.scan, self.fast, self.state.add
        find, rfind, startswith = buf.find, buf.rfind, buf.startswith
        m, decoded = q, 0
        for m in _marker_positions(buf, q):
            if m < q:  # inside an event already decoded
                continue
            h = rfind(head, q, m)
            if h < 0:
                return q, -1, m, decoded
            end = 0
            if fast is not None and (stop := find(head, m)) >= 0:
                try:  # the accelerator takes the text up to the next head, which must be exactly one value
                    event, end = fast(buf[h + brace : stop + 1]), stop + 1
                except ValueError:  # not one value, or one it refuses: the json scanner decides
                    end = 0
            if not end:
                try:
                    event, end = scan(buf, h + brace)
                except (StopIteration, json.JSONDecodeError):
                    return h, -2 if find(head, m) < 0 and not self.sc.eof else -1, m, decoded
            if end <= m or not isinstance(event, dict) or "ph" not in event:
                return h, -1, m, decoded
            add(event)
            decoded += 1
            if not startswith(head, end - 1):
                return h, end, m, decoded
            q = end - 1
        last = rfind(head, q + 1)
        return max(last, q), -2, m, decoded

    def _refill(self, q: int) -> bool:
        """Read on, keeping the text from ``q``; False (``sc.pos`` at the event after ``q``) at the end of the file
        or when one event would outgrow :data:`_MAX_PENDING_CHARS`: checked mode takes over there."""
        sc = self.sc
        sc.pos = q
        if len(sc.buf) - q > _MAX_PENDING_CHARS or not sc.fill():
            sc.pos = q + self.brace
            return False
        return True


def _marker_positions(buf: str, start: int) -> list[int]:
    """Where the literals of :data:`_MARKERS` occur in ``buf`` from ``start`` on, in order."""
    hits: list[int] = []
    find, append = buf.find, hits.append
    for literal in _MARKERS:
        at = find(literal, start)
        while at >= 0:
            append(at)
            at = find(literal, at + 1)
    hits.sort()
    return hits


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
    """What one pass keeps: section ranges, and compact arrays for launches and kernels. What was added after a
    :meth:`mark` can be taken back (:meth:`rollback`)."""

    def __init__(self) -> None:
        self.events = 0
        self.ranges: list[tuple[str, int, float, float]] = []  # (section, thread index, ts, dur)
        self.threads: dict[tuple[Any, Any], int] = {}
        self.launch_thread, self.launch_ts, self.launch_corr = array("i"), array("d"), array("q")
        self.kernel_corr, self.kernel_start, self.kernel_end = array("q"), array("d"), array("d")

    def mark(self) -> tuple[int, int, int]:
        """Where the ranges, launches and kernels end now."""
        return len(self.ranges), len(self.launch_ts), len(self.kernel_corr)

    def rollback(self, mark: tuple[int, int, int]) -> None:
        """Drop what was added after ``mark`` (thread indices stay: unused ones are harmless)."""
        ranges, launches, kernels = mark
        del self.ranges[ranges:]
        for column in (self.launch_thread, self.launch_ts, self.launch_corr):
            del column[launches:]
        for column in (self.kernel_corr, self.kernel_start, self.kernel_end):
            del column[kernels:]


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
        args = cli.parse_args()
        main(args.trace, format=args.format, parser=args.parser)
    else:
        fire.Fire(main)


if __name__ == "__main__":
    _cli()

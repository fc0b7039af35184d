"""Benchmark of ``scripts/profiling/summarize_trace.py`` on large synthetic torch.profiler chrome traces.

The traces are written by ``tests/trace_factory.py`` (the summariser's test fixture; its docstring explains each
shape: CUDA, HIP and mixed launch names, kineto's orders and layouts, and ``jumble``, built to defeat skimming). For
every shape the benchmark

1. writes a small trace (a few MB), loads it whole with ``json.load`` and computes the statistics with the
   independent reference of ``tests/trace_reference.py``, and checks both the generator's own record and the
   summariser's output against it (1e-6 s);
2. writes a large trace (``--size_gb``, 10^9 bytes uncompressed) as ``.json``, streamed to disk step by step so the
   benchmark itself stays small, then gzips it (``.json.gz``, level 6);
3. runs ``scripts/profiling/summarize_trace.py TRACE --format json --parser P`` (the file, run as ``__main__``) in a
   child process for each file and parser, checks its statistics against the generator's record (1e-6 s), and
   measures the child's wall time, throughput (MB/s of uncompressed trace, 10^6 bytes; also per CPU second of the
   child and any process it starts, steadier on a shared machine), peak resident memory (the child's own ``VmHWM``,
   plus the peak of any process it starts, for a summariser that decodes in another process; where ``/proc`` is
   missing, ``ru_maxrss`` from ``os.wait4``, which also counts this process's memory), the load average and the CPU
   time the hypervisor gave other machines meanwhile (``steal %``, from ``/proc/stat``: on a VM, a row measured while
   neighbours were busy is slow for reasons that are not the summariser's).

It prints a markdown table, one row per shape, file and parser, and the slowest row::

    python -m benchmarks.bench_trace [--size_gb 1.0] [--shapes all|cuda-after,cuda-window-kineto,...]
                                     [--parsers auto[,orjson,json]] [--output_dir DIR] [--keep false]
                                     [--json_out FILE] [--repeat N] [--baseline FILE [--baseline_label NAME]]

``--parsers auto,orjson`` compares the standard library with the optional accelerator (``pip install orjson``).
``--baseline OLD/summarize_trace.py`` also times another copy of the summariser (e.g. ``git show
REV:scripts/profiling/summarize_trace.py``), run in its child exactly as this one, on the same files, interleaved run
by run (a ``version`` column labels the rows: ``new`` and ``--baseline_label``), so one table compares two versions
measured in the same minutes.

Without ``--output_dir`` the traces go to a temporary folder that is removed afterwards (unless ``--keep true``); with
it, they are kept with the generator's record (``SHAPE.expected.json``) and a later run of the same size reuses them.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# The traces and the reference are the summariser's test fixtures. tests/ is a folder on the path, as pytest has it,
# not a package: an installed distribution may own the name ``tests`` (rt_utils does).
if str(ROOT / "tests") not in sys.path:
    sys.path.append(str(ROOT / "tests"))
from trace_factory import SHAPES, write_trace  # noqa: E402
from trace_reference import as_summary, compare, compare_device, reference_device, reference_summary  # noqa: E402

SMALL_TRACE_BYTES = 3_000_000
SUMMARIZER = ROOT / "scripts" / "profiling" / "summarize_trace.py"
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
    problems += [f"generator: {p}" for p in compare_device(as_summary(expected["device"]), device)]
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


# ------------------------------------------------------------------------------------------------------------ runner
# The child runs a summariser file as __main__ (this bundle's, or a baseline copy, the same way) and reports its own
# peak RSS (VmHWM, of the process image after exec): ru_maxrss from wait4 would include the memory of this (larger)
# benchmark process, which the child borrows between fork and exec. It adds the peak of any process it started
# (ru_maxrss of its children, for a summariser that decodes in another process): the sum bounds what both held.
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

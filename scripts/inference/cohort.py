"""A cohort inferred in parts that resume: each part takes its share of the cases, skips those done earlier with the
same weights and settings, and merges every part's report into the cohort's.

* **Parts.** ``--num_parts N --part_id K`` (nnU-Net's names; under torchrun the ranks, under a SLURM array the tasks)
  give part K the cases :func:`split` assigns it: every case found, in one part exactly, the parts balanced by the
  cases' sizes (slices), not their count. Every part finds the cases itself, from a folder or a PACS query alike, and
  computes the same split.
* **Resume.** A case is done when its folder holds ``<case>_run.json`` (written last into the folder that is then
  moved into place whole) whose key equals this run's: the SHA-256 of every weights file, the bundle's version and
  every setting its outputs depend on (:func:`outputs_key`). Such a case is listed as done earlier with its outputs
  and not inferred again; one interrupted, failed or made with other weights or settings is inferred again, and
  ``--redo true`` infers every case again.
* **Reports.** A part writes its own report in ``<output_dir>/.parts/<K>-of-<N>/``; :func:`merge` (each part at its
  end, or ``monai.bundle run merge`` by hand) combines the reports of the parts present into
  ``<output_dir>/inference_report.json`` and ``report.csv`` under a lock, each case once with the part and host that
  ran it, whatever order the parts end in.
* **One run per part.** A part holds a lock on its folder while it runs; a second run of the same part and output
  folder stops at once, naming the process and host that hold it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import socket
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ignite.engine import Engine, Events
from scripts.common.config import ConfigError
from scripts.common.files import file_sha256, hold_lock, write_json
from scripts.data.dicom.identity import bundle_version
from scripts.inference.records import REPORT, Case, read_run_report, report_path, write_run_report
from scripts.inference.report import report_rows, write_report_csv

logger = logging.getLogger(__name__)

PARTS = ".parts"  # under the output folder: a folder per part (its report, its lock) and the merge's lock
RUN_RECORD = "_run.json"  # <case><RUN_RECORD>: what made the case's outputs, the last file written into its folder
#: what a part's report holds of its own; the rest (the input, the series rules, the models, the outputs key, the
#: files skipped) is the same in every part and goes into the cohort's report as it is
PER_PART = ("part", "host", "started", "ended", "cases", "skipped", "num_done", "num_failed", "num_skipped",
            "num_flagged", "split")  # fmt: skip


@dataclass(frozen=True)
class Part:
    """Part ``index`` (0-based) of ``count``."""

    index: int = 0
    count: int = 1

    @classmethod
    def of(cls, num_parts: int | str = 1, part_id: int | str = 0) -> Part:
        """The part this process runs: ``num_parts``/``part_id`` as given, or under torchrun (``WORLD_SIZE`` > 1 and
        the defaults given) its rank of the world."""
        count, index = int(num_parts), int(part_id)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1 and (count, index) == (1, 0):
            count, index = world, int(os.environ.get("RANK", "0"))
        if count < 1 or not 0 <= index < count:
            raise ConfigError(f"part_id={index}, num_parts={count}: --part_id must be 0 to num_parts - 1 "
                              "(--num_parts 4 --part_id 0 ... 3)")  # fmt: skip
        return cls(index, count)

    @property
    def name(self) -> str:
        return f"{self.index}-of-{self.count}"

    def folder(self, output_dir: str | Path) -> Path:
        """Where this part's report and lock live."""
        return Path(output_dir) / PARTS / self.name

    def __str__(self) -> str:
        return f"part {self.index} of {self.count}"


def case_size(case: Mapping) -> float:
    """A case's work, in slices: a DICOM series' files (a PACS series' instances), a NIfTI's voxels / 512^2."""
    if case.get("slice_paths"):
        return float(len(case["slice_paths"]))
    if case.get("instances"):
        return float(case["instances"])
    if case.get("source") == "nifti":
        try:
            import nibabel as nib

            shape = nib.load(str(case["image"])).header.get_data_shape()
            return max(1.0, float(shape[0] * shape[1] * (shape[2] if len(shape) > 2 else 1)) / 512**2)
        except Exception:  # an unreadable file fails when it is read; here it only weighs one slice
            return 1.0
    return 1.0


def split(sizes: Mapping[str, float], count: int) -> dict[str, int]:
    """Each case id's part: the largest case first, each to the part with the least work so far (ties: the lower
    part); the same for every part that is given the same cases, whatever their order."""
    load = [0.0] * count
    parts = {}
    for case_id in sorted(sizes, key=lambda c: (-sizes[c], c)):
        part = min(range(count), key=lambda p: (load[p], p))
        parts[case_id] = part
        load[part] += sizes[case_id]
    return parts


def outputs_key(model_paths: Sequence[str | Path], record: Mapping[str, str], settings: Mapping[str, Any]) -> dict:
    """What a case's outputs depend on, and its key: the SHA-256 of every weights file (not its path), the TTA,
    post-processing, backend and precision that ran them (``record_models`` less the paths), the bundle's version,
    and ``settings`` (geometry, intensities, windows, region, which outputs, the plausibility limits)."""
    depends = {
        "weights_sha256": [file_sha256(p) for p in model_paths],
        **{k: v for k, v in record.items() if k != "models"},
        "version": bundle_version(),
        "settings": json.loads(json.dumps(settings, sort_keys=True, default=str)),
    }
    key = hashlib.sha256(json.dumps(depends, sort_keys=True).encode()).hexdigest()
    return {"key": key, "depends_on": depends}


def run_record_path(output_dir: str | Path, case_id: str) -> Path:
    return Path(output_dir) / case_id / f"{case_id}{RUN_RECORD}"


def done_earlier(output_dir: str | Path, case_id: str, key: str) -> dict | None:
    """The run record of ``case_id`` when its outputs are complete and were made with ``key``; else None."""
    try:
        record = json.loads(run_record_path(output_dir, case_id).read_text())
    except (OSError, ValueError):
        return None
    folder = Path(output_dir) / case_id
    outputs = {kind: folder / name for kind, name in record.get("outputs", {}).items()}
    if record.get("key") != key or not outputs or not all(path.is_file() for path in outputs.values()):
        return None
    return {**record, "outputs": {kind: str(path) for kind, path in outputs.items()}}


class PartLockedError(RuntimeError):
    """Another process runs the same part into the same output folder."""


def lock_part(folder: Path) -> None:
    """Hold ``folder``'s lock for this process's life; raise :class:`PartLockedError` naming the holder if held."""
    path = folder / "lock"
    holder = hold_lock(path)
    if holder:
        raise PartLockedError(
            f"part {folder.name}: already running into {folder.parents[1]} ({holder}; lock {path}). Wait for it to "
            "end, or stop it: two runs of one part would write the same cases"
        )


def take_part(
    cases: Sequence[Case], num_parts: int | str, part_id: int | str, output_dir: str | Path, key: Mapping,
    redo: bool = False,
) -> list[Case]:  # fmt: skip
    """This part's cases still to infer, from ``cases`` (every case found: the report the finder wrote in this part's
    folder lists them, and the cases that failed their check); the part's report keeps only its own cases, those done
    earlier marked so with their outputs. ``redo``: the switch as read once (``inference_flag#redo``), a bool."""
    part = Part.of(num_parts, part_id)
    folder = part.folder(output_dir)
    if not cases and not report_path(folder).is_file():  # nothing found (MONAI's tools building the config): no trace
        return []
    lock_part(folder)
    found = read_run_report(folder)
    runnable = {c["case_id"]: c for c in cases}
    records = {r["case_id"]: r for r in found.get("cases", [])}
    if found.get("split") == part.name:  # the finder split the cases already, and reported this part's alone
        assigned = dict.fromkeys(records, part.index)
    else:
        assigned = split({case_id: case_size(runnable.get(case_id, {})) for case_id in records}, part.count)
    mine, todo, earlier = [], [], 0
    for case_id in records:  # in the order found
        if assigned[case_id] != part.index:
            continue
        record = {**records[case_id], "part": part.name, "host": socket.gethostname()}
        redone = redo or case_id not in runnable
        done = None if redone else done_earlier(output_dir, case_id, key["key"])
        if done is not None:
            record.update(status="done", earlier=True, outputs=done["outputs"], finished=done.get("finished"))
            earlier += 1
        elif case_id in runnable:
            _remove_partial(Path(output_dir), case_id)
            todo.append(runnable[case_id])
        mine.append(record)
    found.update(cases=mine, part=part.name, host=socket.gethostname(), started=time.time(), outputs_key=key)
    found["skipped"] = found.get("skipped", []) if part.index == 0 else []
    found.pop("ended", None)
    write_run_report(folder, found)
    logger.info("%s: %d case(s) of %d; %d done earlier with the same weights and settings, %d to infer", part,
                len(mine), found.get("cases_found", len(records)), earlier, len(todo))  # fmt: skip
    return todo


def _remove_partial(output_dir: Path, case_id: str) -> None:
    """What a killed run left of ``case_id``: its staging folder, or its outputs moved aside while being replaced."""
    for left in (*output_dir.glob(f".partial-*-{case_id[:100]}"), *output_dir.glob(f".old-*-{case_id[:100]}")):
        if left.name.split("-", 2)[-1] == case_id[:100]:
            shutil.rmtree(left, ignore_errors=True)


@contextmanager
def _merge_lock(output_dir: Path) -> Iterator[None]:
    path = output_dir / PARTS / "merge.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def end_part(num_parts: int | str, part_id: int | str, output_dir: str | Path) -> dict:
    """Mark this part's report ended, then merge the cohort's (see :func:`merge`)."""
    folder = Part.of(num_parts, part_id).folder(output_dir)
    report = read_run_report(folder)
    report["ended"] = time.time()
    write_run_report(folder, report)
    return merge(output_dir)


def merge(output_dir: str | Path, num_parts: int | str | None = None) -> dict:
    """``<output_dir>/inference_report.json`` and ``report.csv`` from the reports of the parts present (of
    ``num_parts``; None: those of the part written last), under a lock: each case once, with its part and host; the
    rows of ``report.csv`` from each done case's own report. Returns the merged report."""
    output_dir = Path(output_dir)
    with _merge_lock(output_dir):
        folders = sorted((output_dir / PARTS).glob("*-of-*/" + REPORT))
        if num_parts is None and folders:
            num_parts = max(folders, key=lambda p: p.stat().st_mtime).parent.name.split("-of-")[1]
        folders = [f.parent for f in folders if f.parent.name.endswith(f"-of-{num_parts}")]
        parts = {f.name: read_run_report(f) for f in sorted(folders, key=lambda f: int(f.name.split("-")[0]))}
        cases: dict[str, dict] = {}
        for report in parts.values():
            cases.update({c["case_id"]: c for c in report.get("cases", [])})
        _mark_stale(parts, cases)
        merged = _summary(parts, cases, num_parts)
        write_run_report(output_dir, merged)
        rows = [row for case in merged["cases"] if case.get("status") == "done" for row in _rows(output_dir, case)]
        write_report_csv(output_dir / "report.csv", rows, replace=True)
    return merged


def _mark_stale(parts: Mapping[str, dict], cases: dict[str, dict]) -> None:
    """The cases of parts whose outputs were made with other weights or settings than the part started last: listed
    as ``stale`` (no row in report.csv), with what to do, never mixed silently into the cohort's results."""
    key = lambda report: (report.get("outputs_key") or {}).get("key")  # noqa: E731
    newest = max(parts.items(), key=lambda item: item[1].get("started", 0), default=(None, {}))
    stale = [name for name, report in parts.items() if key(report) not in (None, key(newest[1]))]
    if not stale:
        return
    why = (f"made with other weights or settings (outputs_key) than part {newest[0]}, the part run last: run part(s) "
           f"{', '.join(stale)} again with its weights and settings")  # fmt: skip
    logger.warning("%s", why)
    for name in stale:
        for case in parts[name].get("cases", []):
            cases[case["case_id"]] = {**case, "status": "stale", "reason": why}


def _rows(output_dir: Path, case: Mapping) -> list[dict]:
    path = output_dir / case["case_id"] / f"{case['case_id']}_report.json"
    try:
        return report_rows(case["case_id"], json.loads(path.read_text())["structures"])
    except (OSError, ValueError, KeyError):
        return []


def _summary(parts: Mapping[str, dict], cases: Mapping[str, dict], num_parts: Any) -> dict:
    first = next(iter(parts.values()), {})
    listed = sorted(cases.values(), key=lambda c: c["case_id"])
    counts = {s: sum(c.get("status") == s for c in listed) for s in ("done", "failed", "pending", "stale")}
    ran = [c for c in listed if c.get("status") == "done" and not c.get("earlier")]
    about = {}
    for name, report in parts.items():
        done = [c for c in report.get("cases", []) if c.get("status") == "done" and not c.get("earlier")]
        hours = ((report.get("ended") or time.time()) - report.get("started", time.time())) / 3600
        rate = round(len(done) / hours, 1) if hours > 0 else None
        about[name] = {"host": report.get("host"), "ended": bool(report.get("ended")), "cases": len(report["cases"]),
                       "inferred": len(done), "cases_per_hour": rate}  # fmt: skip
    starts = [r["started"] for r in parts.values() if "started" in r]
    ends = [r.get("ended") or time.time() for r in parts.values()]
    hours = (max(ends) - min(starts)) / 3600 if starts else 0
    return {
        **{k: v for k, v in first.items() if k not in PER_PART},
        "num_parts": int(num_parts or 1), "parts": about, "cases": listed,
        "skipped": [s for report in parts.values() for s in report.get("skipped", [])],
        "num_done": counts["done"], "num_failed": counts["failed"], "num_pending": counts["pending"],
        "num_stale": counts["stale"],
        "num_done_earlier": sum(bool(c.get("earlier")) for c in listed),
        "cases_per_hour": round(len(ran) / hours, 1) if hours > 0 else None,
    }  # fmt: skip


def part_report_path(num_parts: int | str, part_id: int | str, output_dir: str | Path) -> Path:
    """This part's own report (its failures end the command with status 1)."""
    return report_path(Part.of(num_parts, part_id).folder(output_dir))


def claim_device(device: Any) -> None:
    """Under torchrun (``LOCAL_WORLD_SIZE`` > 1), this rank's share of the machine: on a GPU the card ``LOCAL_RANK``
    (``cuda`` then means it), on a CPU its share of the cores this process may use (its affinity: torch, OpenVINO,
    ONNX Runtime and the loader's workers all size themselves by it)."""
    import torch

    rank, ranks = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if ranks <= 1:
        return
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        return
    cores = sorted(os.sched_getaffinity(0))
    share = cores[rank * len(cores) // ranks : (rank + 1) * len(cores) // ranks] or [cores[rank % len(cores)]]
    os.sched_setaffinity(0, share)
    torch.set_num_threads(len(share))
    logger.info("rank %d of %d on this node: CPU cores %s", rank, ranks, ",".join(map(str, share)))


class Progress:
    """Evaluator handler: on a terminal a bar of this part's cases with the time left; in a log (a SLURM output file)
    one line per case, done/total and the time left; at the end the part's cases per hour."""

    def __init__(self, num_parts: int | str = 1, part_id: int | str = 0) -> None:
        self.part = Part.of(num_parts, part_id)
        self.bar: Any = None
        self.start, self.done = 0.0, 0

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.STARTED, self._started)
        engine.add_event_handler(Events.ITERATION_COMPLETED, self._case_done)
        engine.add_event_handler(Events.COMPLETED, self._completed)

    def _total(self, engine: Engine) -> int:
        return len(engine.data_loader) if engine.data_loader is not None else 0

    def _started(self, engine: Engine) -> None:
        self.start, self.done = time.perf_counter(), 0
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=self._total(engine), desc=str(self.part), unit="case")

    def _case_done(self, engine: Engine) -> None:
        self.done += 1
        total, elapsed = self._total(engine), time.perf_counter() - self.start
        if self.bar is not None:
            self.bar.update(1)
            return
        left = elapsed / self.done * (total - self.done)
        failed = len(getattr(engine, "failures", []))
        logger.info("%s: %d/%d cases (%d failed), %.1f s per case, about %s left", self.part, self.done, total,
                    failed, elapsed / self.done, _duration(left))  # fmt: skip

    def _completed(self, engine: Engine) -> None:
        if self.bar is not None:
            self.bar.close()
        hours = (time.perf_counter() - self.start) / 3600
        rate = f"{self.done / hours:.1f} cases per hour" if hours > 0 and self.done else "no case"
        logger.info("%s: %d case(s) in %s, %s", self.part, self.done, _duration(hours * 3600), rate)


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    hours, rest = divmod(seconds, 3600)
    return (f"{hours} h " if hours else "") + f"{rest // 60} min {rest % 60} s"


def write_run_record(folder: Path, case_id: str, key: Mapping, outputs: Mapping[str, str]) -> None:
    """``<case>_run.json`` in the case's staging ``folder``: the key of what made its outputs, and which they are."""
    named = {kind: Path(path).name for kind, path in outputs.items()}
    finished = time.strftime("%Y-%m-%d %H:%M:%S")
    record = {"key": key["key"], "depends_on": key["depends_on"], "outputs": named, "finished": finished}
    write_json(folder / f"{case_id}{RUN_RECORD}", {**record, "host": socket.gethostname()})

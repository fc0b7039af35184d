"""What inference writes per case, each case's outcome in the run's report, and the command's exit status.

* :class:`SaveCased` writes, per case, into ``<output_dir>/<case>/``: ``<case>_seg.nii.gz`` on the input's own grid
  (for a DICOM series acquired at uneven spacing or with a gantry tilt: the equal-step orthogonal grid
  :class:`scripts.inference.inputs.LoadCased` resampled it to -- a true Cartesian grid, which the slices as acquired are
  not); the tumour report (:mod:`scripts.inference.report`: volume, components, RECIST axes, 3D diameter, centroid,
  side, slices, HU) as ``<case>_report.json`` and a picture of the axial, coronal and sagittal planes through the
  tumour, ``<case>_report.png``; and, for DICOM input, the DICOM objects of :mod:`scripts.inference.writers` that
  reference the CT series: ``<case>_seg.dcm`` (DICOM SEG), ``<case>_rtstruct.dcm`` (RTSTRUCT, for treatment-planning
  systems) and ``<case>_sr.dcm`` (a TID 1500 measurement report referencing the SEG). The SEG and the RTSTRUCT always
  hold the labels on the series' own slices, every instance referenced: a resampled series' label map is mapped back
  onto them (:meth:`scripts.data.dicom.ct.SliceMap.to_slices`, from the case's metadata), while the NIfTI, the report
  and the SR's measurements stay on the Cartesian grid, and the report's ``notes`` say what was done.
  ``<output_dir>/report.csv`` gets one row per case and structure. A case's files are written into a hidden folder and
  moved into place together: a case that fails while writing leaves nothing half-written, and its outputs from an
  earlier run stay as they were. The writers that wait on nothing else run side by side in a pool of ``workers`` threads
  (default: up to :data:`WRITE_WORKERS`, no more than the CPUs; zlib, numpy and file writes release Python's lock),
  which ends with the call; the label map is converted once, in NIfTI's voxel order, and the CT's headers read once;
  the SR waits for the report and the SEG. What they write is what they write one after the other (``workers=1``).
  Given ``models`` (:meth:`scripts.inference.ensemble.Models.record`: the weight files with their SHA-256, TTA,
  post-processing), the DICOM SEG carries them as its algorithm's parameters and the tumour report as ``models``.
  Given ``plausible`` (limits of :func:`scripts.inference.report.implausible`), a tumour unlikely to be a lung GTV --
  bigger than one is likely to be, in more pieces, filling most of the border of the region the network ran on
  (``inferer``'s last region) -- is flagged, with what to check (:data:`scripts.inference.report.WHAT_TO_CHECK`), in the
  report's ``implausible``, a warning in the log and the SR's findings; the case is written all the same.
* :class:`InferenceSummary` completes the run's report, ``inference_report.json`` (:mod:`scripts.inference.records`),
  case by case -- ``done`` with its files, seconds and any ``flags``, or ``failed`` with the stage and the reason --
  records the ``models`` used, and prints one line at the end (naming the flagged cases, if any).
* :func:`exit_on_failures` ends the command with status 1 when any case failed (the others are written), the
  convention of ``scripts.data.tcia``'s downloader.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np
from ignite.engine import Engine, Events
from monai.transforms import MapTransform
from scripts.common.cpus import usable_cpus
from scripts.common.files import display_name, save_nifti
from scripts.common.geometry import bounding_box, voxel_volume_ml
from scripts.data.dicom import CtSeries, SeriesSource, SliceMap, read_ct_series, scan_ct_series
from scripts.data.dicom.identity import algorithm_identification, bundle_version
from scripts.inference.cohort import write_run_record
from scripts.inference.figures import png_bytes, render_planes
from scripts.inference.inputs import slice_map_of
from scripts.inference.records import REPORT, merged_items, read_run_report, write_run_report
from scripts.inference.report import (
    WHAT_TO_CHECK,
    implausible,
    report_rows,
    tumour_report,
    write_report_csv,
    write_tumour_report,
)
from scripts.inference.writers.rtstruct import write_rtstruct
from scripts.inference.writers.seg import source_images, with_type_2, write_dicom_seg
from scripts.inference.writers.sr import write_sr

logger = logging.getLogger(__name__)

#: the most writers :class:`SaveCased` runs side by side by default (NIfTI, report, picture, SEG, RTSTRUCT: at most four
#: at once wait on nothing else)
WRITE_WORKERS = 4


class CaseOutputError(RuntimeError):
    """Writing a case's outputs failed; nothing of it was left behind (the message says what and why)."""


class SaveCased(MapTransform):
    """Write the label map under ``keys`` as NIfTI and, for DICOM input, as a DICOM SEG referencing the CT."""

    stage = "write"  # what CaseByCaseEvaluator times it as, and the stage a failure here is recorded at

    def __init__(
        self,
        keys,
        output_dir: str | Path,
        labels: Sequence[str],
        write_seg: bool = True,
        algorithm_version: str | None = None,
        enabled: bool = True,
        allow_missing_keys: bool = False,
        write_rtstruct: bool = False,
        write_sr: bool = False,
        write_report: bool = False,
        models: Mapping[str, str] | None = None,
        plausible: Mapping[str, float] | None = None,
        inferer: Any = None,
        workers: int | None = None,
        outputs_key: Mapping | None = None,
    ) -> None:
        super().__init__(keys, allow_missing_keys)
        # a cohort's (scripts.inference.cohort.outputs_key): each case's folder gets its run record, the key by which
        # a later run knows it done, and report.csv is the cohort's merge's to write
        self.outputs_key = outputs_key
        self.enabled = enabled
        self.output_dir = Path(output_dir)
        self.labels = list(labels)
        self.write_seg, self.write_rtstruct, self.write_sr = write_seg, write_rtstruct, write_sr
        self.write_report = write_report
        self.version = str(algorithm_version or bundle_version())  # the bundle's (configs/metadata.json) unless given
        self.models = dict(models) if models else None
        self.plausible = dict(plausible) if plausible else None
        self.inferer = inferer  # its ``last["box_lps_mm"]``: where the network ran on the case just predicted
        # how many writers run side by side (1: one after the other in the calling thread, the serial code)
        self.workers = max(1, int(workers)) if workers is not None else min(WRITE_WORKERS, usable_cpus())
        self.algorithm = algorithm_identification(self.version)
        #: the last case's seconds per output (``labels``, ``nifti``, ``ct``, ``report``, ``picture``, ``dicom_seg``,
        #: ``rtstruct``, ``sr``, ``move``), for python -m benchmarks.bench_outputs
        self.last_seconds: dict[str, float] = {}
        if self.models:  # which weights (and TTA, post-processing) made the segmentation, as DICOM records it
            self.algorithm[0].AlgorithmParameters = ",".join(f"{k}={v}" for k, v in self.models.items())
        if enabled and write_sr and not write_report:  # the SR carries the report's numbers: say so once
            logger.warning(
                "write_report is off: no DICOM SR (it carries the report's measurements), no report.csv and no "
                "plausibility check either, though write_sr is on"
            )

    def __call__(self, data: Mapping[Hashable, Any]) -> dict:
        d = dict(data)
        if not self.enabled:
            return d
        case_id = str(d["case_id"])
        self.last_seconds = {}
        staging = self.output_dir / f".partial-{os.getpid()}-{case_id[:100]}"
        shutil.rmtree(staging, ignore_errors=True)
        try:
            outputs = {}
            for key in self.key_iterator(d):
                outputs[key] = self._write(d, d[key], case_id, staging)
            if self.outputs_key is not None:  # last into the folder: present only with every output beside it
                written = {kind: path for files, _, _ in outputs.values() for kind, path in files.items()}
                write_run_record(staging, case_id, self.outputs_key, written)
            with _timed(self.last_seconds, "move"):
                _move_into_place(staging, self.output_dir / case_id)
        except Exception as err:
            raise CaseOutputError(f"{case_id}: writing its outputs to {self.output_dir} failed ({err})") from err
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        final = self.output_dir / case_id
        for key, (files, report, flags) in outputs.items():
            d[f"{key}_files"] = {kind: str(final / Path(path).name) for kind, path in files.items()}
            d[f"{key}_flags"] = [flag["finding"] for flag in flags]
            if report is not None and self.outputs_key is None:
                write_report_csv(self.output_dir / "report.csv", report_rows(case_id, report))
        return d

    def _write(self, d: dict, tensor, case_id: str, folder: Path) -> tuple[dict[str, str], dict | None, list[dict]]:
        seconds = self.last_seconds
        with _timed(seconds, "labels"):
            labels, box = label_volume(tensor)
        labels.flags.writeable = False  # read by writers side by side: none may change it
        affine = np.asarray(tensor.meta.get("original_affine", tensor.affine), dtype=float)
        dicom = d.get("source") == "dicom"
        series = d.get("slice_paths") or d.get("source_path")  # the CT series' files (discovery), or its folder
        slices = slice_map_of(tensor.meta) if dicom and hasattr(tensor, "meta") else None
        files = {"nifti": str(folder / f"{case_id}_seg.nii.gz")}
        report, flags = None, []
        with _Jobs(self.workers, seconds) as jobs:
            jobs.submit("nifti", save_nifti, files["nifti"], labels, affine)
            with _timed(seconds, "labels"):
                on_slices = labels if slices is None else slices.to_slices(labels)  # the series' own, for SEG/RTSTRUCT
            if slices is not None:
                logger.info("%s: labels mapped from the resampled %s grid back onto the %d original slices", case_id,
                            "x".join(map(str, labels.shape)), on_slices.shape[2])  # fmt: skip
            ct = None
            if self.write_report:  # the CT read again for HU; its headers serve the DICOM writers
                source = d.get("slice_paths") or d["source_path"]
                hu, notes, ct = jobs.run("ct", original_ct, source, d.get("source", "dicom"), labels.shape)
                files["report"] = str(folder / f"{case_id}_report.json")
                reported = jobs.submit("report", self._report, d, labels, hu, notes, affine, case_id, folder, slices)
                files["picture"] = str(folder / f"{case_id}_report.png")
                title = f"{case_id}: {', '.join(self.labels)}"
                jobs.submit("picture", _write_picture, files["picture"], hu, labels, affine, title)
            sr = dicom and self.write_sr and self.write_report
            if dicom and (self.write_seg or self.write_rtstruct or sr):
                series = ct.scanned if ct is not None else jobs.run("ct", scan_ct_series, series, resample=True)
                # what the DICOM writers add to the headers, added before they read them side by side
                if self.write_seg:
                    source_images(series)
                else:
                    with_type_2([ds for _, ds in series.headers])
            if dicom and self.write_seg:
                files["dicom_seg"] = str(folder / f"{case_id}_seg.dcm")
                seg = jobs.submit("dicom_seg", write_dicom_seg, on_slices, series, self.labels, files["dicom_seg"],
                                  self.algorithm)  # fmt: skip
            if dicom and self.write_rtstruct:
                files["rtstruct"] = str(folder / f"{case_id}_rtstruct.dcm")
                jobs.submit("rtstruct", write_rtstruct, on_slices, series, self.labels, files["rtstruct"], self.version)
            if self.write_report:
                report, flags = jobs.wait(reported)
            if sr:  # the report's measurements and flags, and the SEG's UIDs
                files["sr"] = str(folder / f"{case_id}_sr.dcm")
                if self.write_seg:
                    jobs.wait(seg)
                jobs.submit("sr", write_sr, report, series, files.get("dicom_seg"), files["sr"], self.version, flags)
        voxel_ml = voxel_volume_ml(affine)
        with _timed(seconds, "labels"):
            inside = labels[box]  # every labelled voxel
            counts = [float(np.count_nonzero(inside == i)) for i in range(1, len(self.labels) + 1)]
        volumes = {n: round(count * voxel_ml, 3) for n, count in zip(self.labels, counts, strict=True)}
        logger.info("%s: %s, volumes (ml) %s", case_id, ", ".join(Path(f).name for f in files.values()), volumes)
        return files, report, flags

    def _report(
        self,
        d: dict,
        labels: np.ndarray,
        hu: np.ndarray | None,
        notes: list[str],
        affine: np.ndarray,
        case_id: str,
        folder: Path,
        slices: SliceMap | None,
    ) -> tuple[dict, list[dict]]:
        """The tumour report of the prediction, with HU from the case's CT read again (on the grid the prediction is
        on), as JSON; a resampled series' notes say how, and where the DICOM labels are. Also what makes the tumour
        implausible (logged as a warning, in the report with what to check)."""
        report = tumour_report(labels, hu, affine, self.labels, region_on(self.inferer, affine, labels.shape))
        flags = implausible(report, self.plausible) if self.plausible else []
        context = {"input": display_name(str(d["source_path"])), "model_version": self.version}
        if flags:
            context["implausible"] = {"findings": flags, "what_to_check": WHAT_TO_CHECK}
            logger.warning("%s: implausible prediction: %s; %s", case_id, "; ".join(f["finding"] for f in flags),
                           WHAT_TO_CHECK)  # fmt: skip
        if slices is not None:
            grid = "x".join(map(str, labels.shape))
            notes.append(f"this report and the NIfTI are on the resampled {grid} grid; the DICOM SEG and RTSTRUCT "
                         f"hold the labels on the {len(slices.origins)} original slices")  # fmt: skip
        if notes:
            context["notes"] = notes
        if self.models:
            context["models"] = self.models
        write_tumour_report(report, case_id, folder, **context)
        return report, flags


def _write_picture(path: str, hu: np.ndarray | None, labels: np.ndarray, affine: np.ndarray, title: str) -> None:
    """The tumour report's picture: the axial, coronal and sagittal planes through the tumour, as PNG."""
    Path(path).write_bytes(png_bytes(render_planes(hu, labels, affine, title=title)))


class _Jobs:
    """A case's writers as jobs: with ``workers`` 1, each runs in this thread when it is submitted (in order, the
    first failure ending the case: the serial code's behaviour); with more, in a pool of that many threads, which
    lives as long as the ``with`` block. Leaving the block waits for every job, and on a failure cancels those not
    started and raises the error of the first job, in submission order, that failed, so no writer is still writing
    into the staging folder when it is removed. Each job's seconds are added to ``seconds`` under its name."""

    def __init__(self, workers: int, seconds: dict[str, float]) -> None:
        self.seconds = seconds
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="save_case") if workers > 1 else None
        self.jobs: list[Future] = []

    def __enter__(self) -> _Jobs:
        return self

    def submit(self, name: str, work: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        """Start ``work(*args, **kwargs)`` in the pool, or without one run it now; raise a failure already seen."""
        self._raise_first_failure()
        if self.pool is None:
            return self._here(name, work, *args, **kwargs)
        job = self.pool.submit(self._timed, name, work, *args, **kwargs)
        self.jobs.append(job)
        return job

    def run(self, name: str, work: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``work``'s result, computed in this thread as a job of its own (what the next jobs need)."""
        self._raise_first_failure()
        return self._here(name, work, *args, **kwargs).result()

    def wait(self, job: Future) -> Any:
        """The job's result, once it is done (its error, or an earlier job's, raised)."""
        concurrent.futures.wait([job])
        self._raise_first_failure()
        return job.result()

    def _here(self, name: str, work: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        """``work`` run in this thread, as a finished job; its failure (or an earlier job's) raised."""
        job: Future = Future()
        try:
            job.set_result(self._timed(name, work, *args, **kwargs))
        except Exception as err:
            job.set_exception(err)
        self.jobs.append(job)
        self._raise_first_failure()
        return job

    def _timed(self, name: str, work: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        with _timed(self.seconds, name):
            return work(*args, **kwargs)

    def _raise_first_failure(self) -> None:
        for job in self.jobs:
            if job.done() and not job.cancelled() and job.exception() is not None:
                raise job.exception()

    def __exit__(self, kind: type | None, error: BaseException | None, traceback: Any) -> None:
        if self.pool is None:
            return
        self.pool.shutdown(wait=True, cancel_futures=kind is not None)
        self._raise_first_failure()


def label_volume(tensor: Any) -> tuple[np.ndarray, tuple[slice, ...]]:
    """The label map ``tensor`` ([..., X, Y, Z], any number type, on any device) as uint8 [X, Y, Z] in Fortran order
    -- NIfTI's voxel order and the DICOM SEG's frames, so neither copies it again
    (:func:`scripts.common.files.save_nifti` writes it in one piece) -- and the box that holds its labelled voxels. Only
    the box is converted and copied: the rest of a CT is zeros. The values are ``astype(np.uint8)``'s."""
    values = np.asarray(tensor.detach().cpu() if hasattr(tensor, "detach") else tensor).reshape(tensor.shape[-3:])
    labels = np.zeros(values.shape, np.uint8, order="F")
    found = bounding_box(values)
    box = tuple(slice(int(a), int(b)) for a, b in zip(*found, strict=True)) if found else (slice(0, 0),) * 3
    labels[box] = values[box]
    return labels, box


@contextlib.contextmanager
def _timed(seconds: dict[str, float], name: str) -> Iterator[None]:
    """Add the seconds the block takes to ``seconds[name]``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start


def region_on(inferer: Any, affine: np.ndarray, shape: Sequence[int]) -> tuple[np.ndarray, np.ndarray] | None:
    """The box the network last ran on (``inferer.last["box_lps_mm"]``, :class:`scripts.inference.inferers.
    FallbackSlidingWindowInferer`'s record, in world mm) as (start, stop) voxel indices of the grid ``affine`` (RAS)
    and ``shape`` places: the voxels whose centres lie in it. None when the inferer does not say."""
    corners = (getattr(inferer, "last", None) or {}).get("box_lps_mm")
    if corners is None:
        return None
    low, high = (np.asarray(c, float) * [-1.0, -1.0, 1.0] for c in corners)  # LPS -> RAS
    grid = np.array(np.meshgrid(*np.stack([low, high], axis=1), indexing="ij")).reshape(3, -1).T
    ijk = (grid - affine[:3, 3]) @ np.linalg.inv(affine[:3, :3]).T
    start = np.clip(np.ceil(ijk.min(0) - 1e-6), 0, shape).astype(int)
    stop = np.clip(np.floor(ijk.max(0) + 1e-6) + 1, 0, shape).astype(int)
    return start, stop


def original_ct(
    path: SeriesSource, source: str, shape: tuple[int, ...]
) -> tuple[np.ndarray | None, list[str], CtSeries | None]:
    """The case's CT in HU on the grid inference read it on (a DICOM series' own, or its equal-step grid when it was
    resampled; a NIfTI's), for the report and the pictures, the reader's notes and the DICOM series read (None for
    NIfTI); HU None if it cannot be read again or does not match the prediction's grid (the report then has no HU
    statistics, the picture no CT)."""
    ct = None
    try:
        if source == "dicom":
            ct = read_ct_series(path, resample=True)
            hu, notes = ct.hu, ct.notes
        else:
            hu, notes = np.asarray(nib.load(str(path)).dataobj), []
    except Exception as err:  # the prediction is written (a picture drawn) without the CT rather than not at all
        logger.warning("%s: CT not read again for the report or picture (%s)", path, err)
        return None, [], None
    hu = hu.reshape(hu.shape[:3]) if hu.ndim == 4 and hu.shape[3] == 1 else hu
    return (hu if hu.shape == tuple(shape) else None), notes, ct


def _move_into_place(staging: Path, final: Path) -> None:
    """The staged case folder replaces ``final`` (an earlier run's outputs are removed only once the new ones are
    complete)."""
    backup = final.with_name(f".old-{os.getpid()}-{final.name[:100]}")
    if final.exists():
        os.replace(final, backup)
    os.replace(staging, final)
    shutil.rmtree(backup, ignore_errors=True)


class InferenceSummary:
    """Evaluator handler: each case's outcome into ``inference_report.json``, and one line at the end (cases done
    and failed, seconds per case, output folder)."""

    def __init__(
        self, output_dir: str | Path, models: Mapping[str, str] | None = None, report_dir: str | Path | None = None
    ) -> None:
        self.output_dir = Path(output_dir)
        self.report_dir = Path(report_dir) if report_dir is not None else self.output_dir  # a cohort's part's own
        self.models = dict(models) if models else None
        self.report: dict = {}
        self._start = self._case_start = 0.0

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.STARTED, self._started)
        engine.add_event_handler(Events.ITERATION_STARTED, self._case_started)
        engine.add_event_handler(Events.ITERATION_COMPLETED, self._case_done)
        engine.add_event_handler(Events.COMPLETED, self._completed)

    def _started(self, engine: Engine) -> None:
        self.report = read_run_report(self.report_dir)
        if self.models:
            self.report["models"] = self.models
        self._start = time.perf_counter()

    def _case_started(self, engine: Engine) -> None:
        self._case_start = time.perf_counter()

    def _case_done(self, engine: Engine) -> None:
        seconds = round(time.perf_counter() - self._case_start, 2)
        timing = {"stage_seconds": dict(getattr(engine, "stage_seconds", {}))}
        last = getattr(getattr(engine, "inferer", None), "last", None)
        if last:
            timing["region"] = {k: v for k, v in last.items() if k != "seconds"}
        for item in merged_items(engine):
            files = {k: v for key, value in item.items() if key.endswith("_files") for k, v in value.items()}
            flags = [flag for key, value in item.items() if key.endswith("_flags") for flag in value]
            judged = {"flags": flags, "what_to_check": WHAT_TO_CHECK} if flags else {}
            self._update(str(item.get("case_id")), status="done", outputs=files, seconds=seconds, **timing, **judged)
            if flags:
                logger.warning("%s: %.1f s (%s); FLAGGED: %s; %s", item.get("case_id"), seconds, _stages(timing),
                               "; ".join(flags), WHAT_TO_CHECK)  # fmt: skip
            else:
                logger.info("%s: %.1f s (%s)", item.get("case_id"), seconds, _stages(timing))
        for failure in getattr(engine, "failures", [])[len(self._failed()) :]:
            self._update(failure.get("case_id", "?"), status="failed", stage=failure["stage"],
                         reason=failure["reason"], seconds=seconds)  # fmt: skip
        write_run_report(self.report_dir, self.report)

    def _failed(self) -> list[dict]:
        return [c for c in self.report["cases"] if c.get("status") == "failed" and c.get("stage") != "check"]

    def _update(self, case_id: str, **fields: Any) -> None:
        for case in self.report["cases"]:
            if case.get("case_id") == case_id:
                for stale in ("flags", "what_to_check"):  # from an earlier run of the case
                    case.pop(stale, None)
                case.update(fields)
                return
        self.report["cases"].append({"case_id": case_id, **fields})

    def _completed(self, engine: Engine) -> None:
        total = time.perf_counter() - self._start
        cases = self.report["cases"]
        done = [c for c in cases if c.get("status") == "done"]
        failed = [c for c in cases if c.get("status") == "failed"]
        flagged = [str(c.get("case_id")) for c in done if c.get("flags")]
        self.report.update(num_done=len(done), num_failed=len(failed), num_skipped=len(self.report["skipped"]),
                           num_flagged=len(flagged))  # fmt: skip
        write_run_report(self.report_dir, self.report)
        ran = [c for c in done if not c.get("earlier")]  # a cohort's cases done by an earlier run are not this one's
        per_case = total / max(len(ran) + len(failed), 1)
        names = ", ".join(flagged[:10]) + (", ..." if len(flagged) > 10 else "")
        earlier = f", {len(done) - len(ran)} done earlier" if len(done) > len(ran) else ""
        print(
            f"inferred {len(ran)} case(s) in {total:.1f} s ({per_case:.1f} s per case, loading included) "
            f"-> {self.output_dir}{earlier}; failed {len(failed)}, skipped {len(self.report['skipped'])} (see {REPORT})"
            + (f"; {len(flagged)} flagged as implausible, written all the same: {names}" if flagged else "")
        )


def _stages(timing: dict) -> str:
    """``read 1.2, preprocess 0.8, region 0.2 (thorax), predict 9.0 (30 of 56 windows), ...`` for the log."""
    region = timing.get("region", {})
    parts = []
    for stage, value in timing["stage_seconds"].items():
        if stage == "region" and region:
            parts.append(f"region {value:.1f} ({region['method']})")
        elif stage == "predict" and region:
            parts.append(f"predict {value:.1f} ({region['windows']} of {region['windows_whole_input']} windows)")
        else:
            parts.append(f"{stage} {value:.1f}")
    return ", ".join(parts)


def exit_on_failures(report_file: str | Path) -> None:
    """End the command with status 1, naming the failed cases, when the report (``inference_report.json``'s cases,
    ``metrics_summary.json``'s ``failed``) lists any; otherwise do nothing."""
    path = Path(report_file)
    report = json.loads(path.read_text()) if path.is_file() else {}
    failed = report.get("failed", []) + [c for c in report.get("cases", []) if c.get("status") == "failed"]
    if failed:
        names = ", ".join(f"{c.get('case_id')} ({c.get('stage')})" for c in failed[:10])
        raise SystemExit(f"{len(failed)} case(s) failed: {names}; the reasons are in {report_file}")

"""Inference inputs: which cases an ``--input_dir`` holds, and each case loaded as the CT training saw.

* :func:`find_inputs` turns ``--input_dir`` into cases: every NIfTI file, and one case per DICOM study, found by
  :mod:`scripts.data.dicom.discovery` from the files' headers in any folder layout, its CT series chosen by
  ``series_rules`` -- the rule a study from a PACS gets (:mod:`scripts.data.dicom.series_rules`). A DICOM case is named
  by its PatientID (``_<StudyDate>`` when the patient has several studies). Each series is checked from its headers
  before any pixel is read (at least two slices on a straight line and no missing file, the tags that place a slice
  in space); a bad input is skipped with a message naming the file, listed in ``inference_report.json``, and the
  rest still run.
* :class:`LoadCased` reads a case into a ``[1, X, Y, Z]`` MetaTensor in HU with its RAS affine -- the grid and
  orientation ``scripts.data.prepare`` writes for training, so inference sees what training saw. A series acquired at
  uneven spacing or with a gantry tilt is read onto an equal-step orthogonal grid (``read_ct_series(resample=True)``,
  as dcm2niix does); the metadata then carries under :data:`SLICE_MAP` where the original slices lie in that grid,
  which :class:`scripts.inference.outputs.SaveCased` uses (:func:`slice_map_of`) to write the labels back onto them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np
import torch
from monai.data import Dataset, MetaTensor, list_data_collate
from monai.transforms import MapTransform, apply_transform
from monai.utils import MetaKeys
from scripts.common.cpus import usable_cpus
from scripts.common.files import check_case_name, display_name, unique_name
from scripts.data.dicom import DicomCaseError, read_ct_series, scan_ct_series
from scripts.data.dicom.ct import SeriesSource, SliceMap
from scripts.data.dicom.discovery import INDEX, DicomIndex, damaged_slice, scan
from scripts.data.dicom.series_rules import PREFERENCE, SeriesRules
from scripts.inference.cohort import Part, case_size, split
from scripts.inference.records import REPORT, Case, Skipped, as_failed, write_run_report

logger = logging.getLogger(__name__)

NIFTI_SUFFIXES = (".nii", ".nii.gz")
#: metadata key of a resampled series: its :class:`~scripts.data.dicom.ct.SliceMap` as tensors (they survive collation,
#: the preprocessing and its inversion as ``original_affine`` does): ``origins`` (slices, 3), ``shape`` (2,),
#: ``grid_shape`` (3,)
SLICE_MAP = "slice_map"


#: :func:`as_float32`: at most this many threads copy a volume, this many planes of its middle axis at a time
CONVERT_THREADS = 8
PLANES_PER_CHUNK = 16

#: what of a case's record travels with its loaded data through the DataLoader (strings, which collate)
IDENTITY = ("case_id", "source", "source_path")
#: the key under which a :class:`CaseDataset` item carries its index in the dataset (its record's place)
CASE_INDEX = "case_index"
#: a NIfTI whose values span less than this is not a CT in Hounsfield units (a label map, a mask, a normalised
#: image): any CT holds air (about -1000 HU) and soft tissue (0 to 100 HU), so its values span 900 or more
MIN_HU_SPAN = 200.0


class InferenceInputError(ValueError):
    """No usable input at all; the message names the folder and what it should hold."""


def find_inputs(
    input_dir: str | Path,
    report_dir: str | Path | None = None,
    series_rules: SeriesRules | Mapping | None = None,
    output_dir: str | Path | None = None,
    part: Part | None = None,
) -> list[Case]:
    """Cases under ``input_dir``, each with its ``image``, ``case_id`` and ``source`` (``dicom`` or ``nifti``); a DICOM
    case also carries its ``series_uid`` and ``slice_paths`` (``image`` is the series' folder).

    Every NIfTI file and every DICOM study is a case; each is checked from its headers first, and one that cannot
    work is recorded as failed at the ``check`` stage (with the reason naming the file) and not returned. Top-level
    folders holding neither are listed as skipped. With ``report_dir`` all of it goes to
    ``<report_dir>/inference_report.json``, which the run completes case by case. The run's ``output_dir`` (None:
    ``report_dir``) is never searched, and keeps the headers read in ``dicom_index.json`` for the next run. With a
    cohort's ``part``, only its share of the cases (:func:`scripts.inference.cohort.split`) is checked, reported and
    returned. Raises
    :class:`InferenceInputError` when no case can be run at all.
    """
    root = Path(input_dir)
    if not root.exists():
        raise InferenceInputError(f"--input_dir {root}: no such file or folder.")
    outputs = report_dir if output_dir is None else output_dir
    # what the scan read, kept in the output folder: the next run, and every part of a cohort, reads only new files
    cache = None if outputs is None else Path(outputs) / INDEX
    index = scan(root, cache, progress=False, skip_folder=_not_inputs(outputs))
    dicom, failed = index.inference_cases(series_rules)
    cases = [{**c, "source": "dicom", "source_path": c["image"]} for c in dicom]
    taken = {c["case_id"] for c in cases + failed}
    for rel in (r for r in index.headers if _is_nifti(Path(r))):
        path = root / rel if root.is_dir() else root
        name = unique_name(path.name.removesuffix(".gz").removesuffix(".nii").removesuffix(".NII"), taken)
        cases.append(Case(image=str(path), source="nifti", source_path=str(path), case_id=name))
    if root.is_file() and not _is_nifti(root) and not cases:
        cases.append(Case(image=str(root), source="unknown", source_path=str(root), case_id=root.name))
    found = len(cases) + len(failed)
    if part is not None and part.count > 1:  # a cohort's part checks and reports its own cases only
        assigned = split({c["case_id"]: case_size(c) for c in cases + failed}, part.count)
        cases, failed = ([c for c in group if assigned[c["case_id"]] == part.index] for group in (cases, failed))
    failures = [as_failed({**f, "source": "dicom"}, "check") for f in failed]
    runnable = []
    for case in cases:
        try:
            check_case_name(case["case_id"])
            runnable.append(_checked(case, index))
        except Exception as err:  # one input that cannot work never stops the others
            reason = str(err) if isinstance(err, (DicomCaseError, InferenceInputError)) else root_message(err)
            reason = reason if case["image"] in reason else f"{display_name(case['image'])}: {reason}"
            failures.append(as_failed(case, "check", reason))
    skipped = _skipped_folders(root, index, outputs)
    for entry in failures:
        logger.error("failed: %s", entry["reason"])
    for entry in skipped:
        logger.warning("skipped: %s", entry["reason"])
    if report_dir is not None:
        records = [{**c, "status": "pending"} for c in runnable] + failures
        records = [{k: v for k, v in r.items() if k != "slice_paths"} for r in records]
        listed = {"cases": records, "skipped": skipped, "skipped_files": index.skipped(), "cases_found": found}
        if part is not None:
            listed["split"] = part.name
        rules = asdict(SeriesRules.of(series_rules))
        write_run_report(report_dir, {"input_dir": str(root), "series_rules": rules, **listed})
    if not runnable and not (part is not None and part.count > 1 and found):  # a part may hold no case
        detail = "; ".join(e["reason"] for e in failures + skipped) or "it is empty"
        advice = (
            "Each case found failed for the reason given: repair or replace those files, or change the series_rules "
            "that refused them."
            if failures
            else "Give a folder holding DICOM CT series (any layout: a TCIA download, a PACS export) or NIfTI files "
            "(.nii.gz)."
        )
        raise InferenceInputError(f"--input_dir {root}: no usable input ({detail}). {advice}")
    counts = (len(runnable), root, len(failures), len(skipped))
    logger.info("%d case(s) to infer under %s; %d failed their check, %d skipped", *counts)
    return runnable


def _skipped_folders(root: Path, index: DicomIndex, outputs: str | Path | None = None) -> list[Skipped]:
    """The folders not read (an earlier run's outputs, this run's, a top-level link to a folder read already), with
    why, and the other top-level folders of ``root`` that hold no CT image and no NIfTI file (not ``outputs``, made
    by the scan's own index when it lies inside ``root``)."""
    if not root.is_dir():
        return []
    ours = None if outputs is None else Path(outputs).resolve()
    found = {Path(rel).parts[0] for rel, h in index.headers.items() if h["kind"] == "ct" or _is_nifti(Path(rel))}
    why = {rel: f"{why}." for rel, why in index.folders_skipped.items()}
    for rel, first in index.links_again.items():  # a link at the top, where a user looks; deeper ones are clutter
        if len(Path(rel).parts) == 1:
            why[rel] = f"the same folder as {display_name(str(root / first))}, reached again through a link: read once."
    for child in (p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".") and p.resolve() != ours):
        if child.name not in found and not any(Path(rel).parts[:1] == (child.name,) for rel in why):
            why[child.name] = "no CT series (DICOM) or NIfTI."
    named = {rel: display_name(str(root / rel)) for rel in why}
    return [Skipped(input=named[rel], reason=f"{named[rel]}: {why[rel]}") for rel in sorted(why)]


def _not_inputs(output_dir: str | Path | None) -> Callable[[Path, Sequence[str]], str | None]:
    """For :func:`scripts.data.dicom.discovery.scan`: why a folder under ``--input_dir`` holds no input -- it is this
    run's output folder, or an earlier run's (it holds :data:`REPORT`), whose label maps would be read as CTs."""
    ours = None if output_dir is None else Path(output_dir).resolve()

    def why(folder: Path, files: Sequence[str]) -> str | None:
        if ours is not None and folder.resolve() == ours:
            return "this run's output folder: not read"
        if REPORT in files:
            return f"an earlier inference run's output folder (it holds {REPORT}): not read"
        return None

    return why


class CaseDataset(Dataset):
    """A MONAI ``Dataset`` in which a case that fails never stops the run: ``load`` then ``transform`` are applied
    per case (each timed: ``seconds_read``, ``seconds_preprocess``), and an exception in either becomes the case's
    failure record (``failure_stage`` = ``read`` or ``preprocess``, ``failure_reason`` = the error's own message,
    which names the file) that :class:`scripts.inference.engine.CaseByCaseEvaluator` records and skips. Works in
    DataLoader worker processes.

    Only what loading made travels through the DataLoader and its collation: the keys ``load`` and ``transform``
    added or changed (the image), the case's identity (:data:`IDENTITY`) and its index (:data:`CASE_INDEX`). The
    rest of the case's record -- discovery's ``series``, ``alternatives`` and ``notes`` (where a scout's spacing is
    None), ``slice_paths``, a label's path -- stays here: the evaluator joins it to the case again after collation
    (:meth:`record`), so no value of a record can end a run in ``default_collate``. Give the DataLoader
    :func:`collate_cases` as its ``collate_fn``: a case whose loaded data still cannot be batched then fails alone,
    at stage ``collate``."""

    def __init__(self, data: Sequence[dict], transform: Callable | None = None, load: Callable | None = None) -> None:
        super().__init__(data=data, transform=transform)
        self.load = load

    def record(self, index: int) -> Case:
        """The case's record as it was given (discovery's, a datalist's entry)."""
        return dict(self.data[int(index)])

    def _transform(self, index: int) -> dict:
        record = self.data[index]
        item = dict(record)
        seconds = {}
        for stage, step in (("read", self.load), ("preprocess", self.transform)):
            if step is None:
                continue
            clock = time.perf_counter()
            try:
                item = apply_transform(step, item)
            except Exception as err:  # one case's data must not end the run
                return {**failure_record(item, stage, err), CASE_INDEX: index}
            seconds[f"seconds_{stage}"] = time.perf_counter() - clock
        made = {
            k: v
            for k, v in item.items()
            if (k in IDENTITY and isinstance(v, str)) or k not in record or not _same(v, record[k])
        }
        return {**made, **seconds, CASE_INDEX: index}


def collate_cases(batch: Sequence[dict]) -> Any:
    """MONAI's ``list_data_collate`` of a batch of :class:`CaseDataset` items; a batch that cannot be collated becomes
    the failure records of its cases (stage ``collate``, the reason naming the error), so the DataLoader's worker
    lives on and the next case runs."""
    try:
        return list_data_collate(batch)
    except Exception as err:  # a value collation cannot batch: the case fails, not the run
        reason = f"its loaded data cannot be batched ({root_message(err)})"
        return list_data_collate(
            [{**failure_record(item, "collate", reason), CASE_INDEX: item.get(CASE_INDEX, -1)} for item in batch]
        )


def _same(value: Any, given: Any) -> bool:
    """Whether a record's value came through loading unchanged (the same object, or an equal plain value)."""
    if value is given:
        return True
    if type(value) is not type(given) or isinstance(value, (torch.Tensor, np.ndarray)):
        return False
    try:
        return bool(value == given)
    except Exception:  # values that do not compare as one bool
        return False


def failure_record(item: Mapping, stage: str, error: BaseException | str) -> dict:
    """What is kept of a failed case: its identity, the stage and the innermost error's message (or ``error``, a
    reason already written)."""
    keep = {k: item[k] for k in (*IDENTITY, "image") if isinstance(item.get(k), str)}
    reason = error if isinstance(error, str) else root_message(error)
    return {**keep, "failure_stage": stage, "failure_reason": reason}


def root_message(error: BaseException) -> str:
    """The message that explains the failure: our own (which names the file and what to do) where the chain holds one,
    else the innermost error's (MONAI wraps a transform's error in RuntimeErrors; ours wrap the library's)."""
    while not isinstance(error, (DicomCaseError, InferenceInputError)) and error.__cause__ is not None:
        error = error.__cause__
    if isinstance(error, (DicomCaseError, InferenceInputError)):
        return str(error)
    return f"{type(error).__name__}: {error}"


def load_case(path: str | Path, source: str, files: SeriesSource | None = None) -> MetaTensor:
    """A ``[1, X, Y, Z]`` float32 MetaTensor (HU) with its RAS affine, from a CT series folder or a NIfTI file. Its
    metadata says the channel is first (``original_channel_dim`` 0, MONAI's key), so ``EnsureChannelFirstd`` in the
    inference preprocessing leaves it as it is (and adds the channel to MONAI Deploy's channel-less volumes). A series
    at uneven spacing or with a gantry tilt comes on its equal-step grid, with :data:`SLICE_MAP` in the metadata.
    ``files``: the series' files, as discovery found them (else every CT slice in the folder ``path``)."""
    path = Path(path)
    slices = None
    if source == "dicom":
        ct = read_ct_series(files or path, resample=True)
        array, affine, slices = ct.hu, ct.affine_ras, ct.slices
        for note in ct.notes:
            logger.info("%s: %s", display_name(str(path)), note)
    else:
        array, affine = _read_nifti(path)
    meta = {"filename_or_obj": str(path), "source": source, "original_affine": torch.as_tensor(affine)}
    meta[MetaKeys.ORIGINAL_CHANNEL_DIM] = 0  # the channel is first
    if slices is not None:
        meta[SLICE_MAP] = {"origins": torch.as_tensor(slices.origins), "shape": torch.as_tensor(slices.shape),
                           "grid_shape": torch.as_tensor(slices.grid_shape)}  # fmt: skip
    return MetaTensor(torch.from_numpy(as_float32(array))[None], affine=affine, meta=meta)


def as_float32(array: np.ndarray, threads: int | None = None) -> np.ndarray:
    """``array`` as a C-ordered float32 copy, the values of ``np.ascontiguousarray(array, dtype=np.float32)``.

    A CT comes Fortran-ordered (the DICOM reader's slices, a NIfTI's data), so the copy transposes it; done in one
    call, its reads are strided. Copied a plane of the middle axis at a time (a 512 x 120 plane fits in cache), in
    chunks shared by ``threads`` (None: the CPUs this process may use, at most :data:`CONVERT_THREADS`; numpy's copy
    runs outside Python's lock), it takes a third of the time (docs/performance.md, "The seconds around the
    network")."""
    if array.ndim != 3 or not array.flags.f_contiguous or array.flags.c_contiguous:
        return np.ascontiguousarray(array, dtype=np.float32)
    out = np.empty(array.shape, dtype=np.float32)

    def copy(start: int) -> None:
        for j in range(start, min(start + PLANES_PER_CHUNK, array.shape[1])):
            out[:, j, :] = array[:, j, :]

    chunks = range(0, array.shape[1], PLANES_PER_CHUNK)
    workers = min(int(threads or min(CONVERT_THREADS, usable_cpus())), len(chunks))
    if workers <= 1:
        for start in chunks:
            copy(start)
    else:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="as-float32") as pool:
            list(pool.map(copy, chunks))
    return out


def slice_map_of(meta: Mapping) -> SliceMap | None:
    """The :class:`~scripts.data.dicom.ct.SliceMap` that :func:`load_case` put in a case's metadata (it comes through
    collation, preprocessing and its inversion with the prediction's), or None for a case read on its own slices."""
    found = meta.get(SLICE_MAP) if meta else None
    if not found:
        return None
    shape = tuple(int(v) for v in np.asarray(found["shape"]).reshape(-1))
    grid = tuple(int(v) for v in np.asarray(found["grid_shape"]).reshape(-1))
    return SliceMap(np.asarray(found["origins"], dtype=float).reshape(-1, 3), shape, grid)


class LoadCased(MapTransform):
    """Replace the path under ``keys`` by the case's CT (see :func:`load_case`); ``source`` says DICOM or NIfTI. A
    NIfTI file that holds no CT in Hounsfield units is refused (:func:`check_hounsfield`)."""

    def __call__(self, data: Mapping[Hashable, Any]) -> dict:
        d = dict(data)
        for key in self.key_iterator(d):
            path = d[key]
            source = d.get("source", "dicom" if Path(path).is_dir() else "nifti")
            d[key] = load_case(path, source, d.get("slice_paths"))
            if source == "nifti":
                check_hounsfield(d[key], path)
        return d


def _read_nifti(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """A NIfTI CT's 3D voxels and affine; :class:`InferenceInputError` naming the file for one that cannot be read or
    is not 3D (whether it holds Hounsfield units is :func:`check_hounsfield`'s)."""
    try:
        image = nib.load(str(path))
        array, affine = np.asarray(image.dataobj), image.affine
    except Exception as err:  # a cut or damaged file: nibabel's, gzip's and zlib's errors
        raise InferenceInputError(
            f"{path}: its voxels cannot be read ({type(err).__name__}: {err}): the file is cut short or damaged; "
            "copy or write it again."
        ) from err
    if array.ndim == 4 and array.shape[-1] == 1:
        array = array[..., 0]
    if array.ndim != 3:
        raise InferenceInputError(f"{path}: image of shape {array.shape}; a 3D CT volume is needed.")
    return array, affine


def check_hounsfield(image: torch.Tensor, path: str | Path) -> None:
    """:class:`InferenceInputError` naming ``path`` when ``image`` cannot be a CT in Hounsfield units: its values span
    less than :data:`MIN_HU_SPAN` (a label map, a mask, a normalised image -- an earlier run's ``_seg.nii.gz`` among
    the inputs), or are not numbers. A DICOM CT is in HU by its rescale; a NIfTI file says nothing of its unit."""
    low, high = (float(v) for v in torch.aminmax(image.as_tensor() if isinstance(image, MetaTensor) else image))
    if not high - low >= MIN_HU_SPAN:  # NaN fails too
        raise InferenceInputError(
            f"{path}: its values span {low:g} to {high:g}, not a CT in Hounsfield units (air is about -1000 HU, soft "
            "tissue 0 to 100): a label map, a mask or a normalised image? Give the CT itself, in HU."
        )


def _is_nifti(path: Path) -> bool:
    return path.name.lower().endswith(NIFTI_SUFFIXES)


def _checked(case: dict, index: DicomIndex) -> dict:
    """``case`` as it can run, checked from its headers (:func:`_check_input`). A DICOM study whose chosen series
    fails its check (a missing slice, a damaged file among its slices) runs on its next usable series in the rules'
    order (:meth:`~scripts.data.dicom.discovery.DicomIndex.fallbacks`), which says so in its notes and ``series``; when
    every usable series fails, the error gives each one's reason."""
    if case["source"] != "dicom":
        _check_input(case)
        return case
    failures: list[tuple[dict, str]] = []
    for candidate in [case, *index.fallbacks(case)]:
        try:
            _check_input(candidate)
        except (DicomCaseError, InferenceInputError) as err:
            failures.append((candidate, str(err)))
            continue
        return _noted(candidate, failures)
    if len(failures) == 1:
        raise DicomCaseError(failures[0][1])
    raise DicomCaseError(
        f"none of the study's {len(failures)} usable CT series passes its check: "
        + "; ".join(f"{_series_name(c['series'])}: {why}" for c, why in failures)
    )


def _noted(case: dict, failures: Sequence[tuple[dict, str]]) -> dict:
    """``case`` on the series that passed its check after the ``failures`` (the series tried before, and why they
    failed): the notes, ``series["why"]`` and ``alternatives`` say what happened."""
    if not failures:
        return case
    used = _series_name(case["series"])
    tried, notes, failed = set(), [], []
    for candidate, why in failures:
        info = candidate["series"]
        tried.add(info["series_uid"])
        notes.append(f"{_series_name(info)} failed its check, so {used} is used: {why}")
        kept = {k: v for k, v in info.items() if k not in ("why", "note")}
        failed.append({**kept, "reason": f"failed its check: {why}"})
    others = [a for a in case["alternatives"] if a["series_uid"] not in tried | {case["series_uid"]}]
    why = f"the series before it failed the check from the headers; the next usable series by {PREFERENCE}"
    return {
        **case,
        "series": {**case["series"], "why": why},
        "alternatives": failed + others,
        "notes": notes + case["notes"],
    }


def _series_name(info: Mapping) -> str:
    """A series as a report names it: by its SeriesNumber, or its UID where it has none."""
    return f"series {info.get('number') or info['series_uid']}"


def _check_input(case: dict) -> None:
    path, source = Path(case["image"]), case["source"]
    if source == "dicom":  # uneven spacing and gantry tilt are resampled when the case is read
        if case.get("damaged"):
            raise DicomCaseError(damaged_slice(case["damaged"][0], case["series_uid"]))
        try:
            scan_ct_series(case.get("slice_paths") or path, resample=True)
        except DicomCaseError as err:
            if not case.get("damaged_nearby"):
                raise
            nearby = ", ".join(display_name(f) for f in case["damaged_nearby"][:3])
            raise DicomCaseError(f"{err}; the folder also holds damaged DICOM files, one of which may be the slice "
                                 f"missing: {nearby}") from err  # fmt: skip
    elif source == "nifti":
        try:
            shape = nib.load(str(path)).shape
        except Exception as err:  # not NIfTI at all, or a header cut short
            raise InferenceInputError(
                f"{path}: not a NIfTI file nibabel can read ({type(err).__name__}: {err}); write it again, or move it "
                "out of the input folder."
            ) from err
        if not (len(shape) == 3 or (len(shape) == 4 and shape[-1] == 1)):
            raise InferenceInputError(f"{path}: image of shape {tuple(shape)}; a 3D CT volume is needed.")
        if min(shape[:3]) < 2:
            raise InferenceInputError(f"{path}: image of shape {tuple(shape)} has a single slice; a 3D CT is needed.")
    else:
        raise InferenceInputError(f"{path}: not a NIfTI file (.nii, .nii.gz) or a folder of DICOM CT slices.")

"""Inference inputs: which cases an ``--input_dir`` holds, and each case loaded as the CT training saw.

* :func:`find_inputs` turns ``--input_dir`` into cases: every CT series folder (one per case, or a TCIA-layout tree
  ``<PatientID>/<SeriesNumber>/image/``) and every NIfTI file. Each series is checked from its headers before any
  pixel is read (one series per folder, at least two slices on a straight line and no missing file, the tags that
  place a slice in space); a bad input is skipped with a message naming the file, listed in
  ``inference_report.json``, and the rest still run.
* :class:`LoadCased` reads a case into a ``[1, X, Y, Z]`` MetaTensor in HU with its RAS affine -- the grid and
  orientation ``scripts.prepare`` writes for training, so inference sees what training saw. A series acquired at
  uneven spacing or with a gantry tilt is read onto an equal-step orthogonal grid (``read_ct_series(resample=True)``,
  as dcm2niix does); the metadata then carries under :data:`SLICE_MAP` where the original slices lie in that grid,
  which :class:`scripts.outputs.SaveCased` uses (:func:`slice_map_of`) to write the labels back onto them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np
import pydicom
import torch
from monai.data import Dataset, MetaTensor
from monai.transforms import MapTransform, apply_transform
from monai.utils import MetaKeys
from pydicom.errors import InvalidDicomError
from scripts.dicom import DicomCaseError, read_ct_series, scan_ct_series
from scripts.dicom.ct import CT_IMAGE_STORAGE, ENHANCED_CT_STORAGE, SliceMap
from scripts.files import check_case_name, display_name, write_json

logger = logging.getLogger(__name__)

NIFTI_SUFFIXES = (".nii", ".nii.gz")
REPORT = "inference_report.json"
#: metadata key of a resampled series: its :class:`~scripts.dicom.ct.SliceMap` as tensors (they survive collation,
#: the preprocessing and its inversion as ``original_affine`` does): ``origins`` (slices, 3), ``shape`` (2,),
#: ``grid_shape`` (3,)
SLICE_MAP = "slice_map"


class InferenceInputError(ValueError):
    """No usable input at all; the message names the folder and what it should hold."""


def find_inputs(input_dir: str | Path, report_dir: str | Path | None = None) -> list[dict]:
    """Cases under ``input_dir`` as ``{"image": path, "case_id": ..., "source": "dicom" | "nifti"}``.

    Every CT series folder and NIfTI file is a case; each is checked from its headers first, and one that cannot
    work is recorded as failed at the ``check`` stage (with the reason naming the file) and not returned. Folders
    holding neither are listed as skipped. With ``report_dir`` all of it goes to
    ``<report_dir>/inference_report.json``, which the run completes case by case. Raises
    :class:`InferenceInputError` when no case can be run at all.
    """
    root = Path(input_dir)
    if not root.exists():
        raise InferenceInputError(f"--input_dir {root}: no such file or folder.")
    candidates, skipped = _candidates(root)
    cases = [{"image": str(path), "source": source, "case_id": ""} for path, source in candidates]
    _name_cases(cases, root)
    runnable, failed = [], []
    for case in cases:
        try:
            check_case_name(case["case_id"])
            _check_input(Path(case["image"]), case["source"])
        except (DicomCaseError, InferenceInputError, ValueError) as err:
            reason = str(err) if case["image"] in str(err) else f"{display_name(case['image'])}: {err}"
            failed.append({**case, "status": "failed", "stage": "check", "reason": reason})
            logger.error("failed: %s", reason)
            continue
        runnable.append(case)
    for entry in skipped:
        logger.warning("skipped: %s", entry["reason"])
    if report_dir is not None:
        records = [{**c, "status": "pending"} for c in runnable] + failed
        write_report(report_dir, {"input_dir": str(root), "cases": records, "skipped": skipped})
    if not runnable:
        detail = "; ".join(e["reason"] for e in failed + skipped) or "it is empty"
        raise InferenceInputError(
            f"--input_dir {root}: no usable input ({detail}). Give a folder of CT series folders (DICOM), a TCIA "
            "tree <PatientID>/<SeriesNumber>/image/, or NIfTI files (.nii.gz)."
        )
    logger.info("%d case(s) to infer under %s; %d failed their check, %d skipped", len(runnable), root, len(failed),
                len(skipped))  # fmt: skip
    return runnable


def write_report(folder: str | Path, report: dict) -> Path:
    """``<folder>/inference_report.json`` (atomically): every case with its outcome, and the skipped inputs."""
    return write_json(Path(folder) / REPORT, report)


def _candidates(root: Path) -> tuple[list[tuple[Path, str]], list[dict]]:
    """(path, source) of every NIfTI file and CT series folder under ``root`` (links followed, each real folder
    visited once, so a link loop cannot list a case twice), and the top-level folders that hold neither."""
    if root.is_file():
        return [(root, "nifti" if _is_nifti(root) else "unknown")], []
    candidates: list[tuple[Path, str]] = []
    covered: set[Path] = set()
    visited: set[str] = set()
    for folder, dirs, files in os.walk(root, followlinks=True):  # linked case folders are inputs too
        real = os.path.realpath(folder)
        if real in visited:
            dirs[:] = []
            continue
        visited.add(real)
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        folder = Path(folder)
        for name in sorted(files):
            if _is_nifti(folder / name):
                candidates.append((folder / name, "nifti"))
                covered.add(folder)
        if _is_ct_folder(folder, files):
            candidates.append((folder, "dicom"))
            covered.add(folder)
    skipped = [
        {"input": display_name(str(child)), "reason": f"{display_name(str(child))}: no CT series (DICOM) or NIfTI."}
        for child in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
        if not any(c == child or child in c.parents for c in covered)
    ]
    return candidates, skipped


class CaseDataset(Dataset):
    """A MONAI ``Dataset`` in which a case that fails never stops the run: ``load`` then ``transform`` are applied
    per case, and an exception in either becomes the case's failure record (``failure_stage`` = ``read`` or
    ``preprocess``, ``failure_reason`` = the error's own message, which names the file) that
    :class:`scripts.evaluators.CaseByCaseEvaluator` records and skips. Works in DataLoader worker processes: the
    record travels in the batch."""

    def __init__(self, data: Sequence[dict], transform: Callable | None = None, load: Callable | None = None) -> None:
        super().__init__(data=data, transform=transform)
        self.load = load

    def _transform(self, index: int) -> dict:
        item = dict(self.data[index])
        for stage, step in (("read", self.load), ("preprocess", self.transform)):
            if step is None:
                continue
            try:
                item = apply_transform(step, item)
            except Exception as err:  # one case's data must not end the run
                return failure_record(item, stage, err)
        return item


def failure_record(item: Mapping, stage: str, error: BaseException) -> dict:
    """What is kept of a failed case: its identity, the stage and the innermost error's message."""
    keep = {k: item[k] for k in ("case_id", "source", "source_path", "image") if isinstance(item.get(k), str)}
    return {**keep, "failure_stage": stage, "failure_reason": root_message(error)}


def root_message(error: BaseException) -> str:
    """The message that explains the failure: our own (which names the file and what to do) where the chain holds one,
    else the innermost error's (MONAI wraps a transform's error in RuntimeErrors; ours wrap the library's)."""
    while not isinstance(error, (DicomCaseError, InferenceInputError)) and error.__cause__ is not None:
        error = error.__cause__
    if isinstance(error, (DicomCaseError, InferenceInputError)):
        return str(error)
    return f"{type(error).__name__}: {error}"


def load_case(path: str | Path, source: str) -> MetaTensor:
    """A ``[1, X, Y, Z]`` float32 MetaTensor (HU) with its RAS affine, from a CT series folder or a NIfTI file. Its
    metadata says the channel is first (``original_channel_dim`` 0, MONAI's key), so ``EnsureChannelFirstd`` in the
    inference preprocessing leaves it as it is (and adds the channel to MONAI Deploy's channel-less volumes). A series
    at uneven spacing or with a gantry tilt comes on its equal-step grid, with :data:`SLICE_MAP` in the metadata."""
    path = Path(path)
    slices = None
    if source == "dicom":
        ct = read_ct_series(path, resample=True)
        array, affine, slices = ct.hu, ct.affine_ras, ct.slices
        for note in ct.notes:
            logger.info("%s: %s", display_name(str(path)), note)
    else:
        image = nib.load(str(path))
        array, affine = np.asarray(image.dataobj), image.affine
        if array.ndim == 4 and array.shape[-1] == 1:
            array = array[..., 0]
        if array.ndim != 3:
            raise InferenceInputError(f"{path}: image of shape {array.shape}; a 3D CT volume is needed.")
    meta = {"filename_or_obj": str(path), "source": source, "original_affine": torch.as_tensor(affine)}
    meta[MetaKeys.ORIGINAL_CHANNEL_DIM] = 0  # the channel is first
    if slices is not None:
        meta[SLICE_MAP] = {"origins": torch.as_tensor(slices.origins), "shape": torch.as_tensor(slices.shape),
                           "grid_shape": torch.as_tensor(slices.grid_shape)}  # fmt: skip
    return MetaTensor(torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))[None], affine=affine, meta=meta)


def slice_map_of(meta: Mapping) -> SliceMap | None:
    """The :class:`~scripts.dicom.ct.SliceMap` that :func:`load_case` put in a case's metadata (it comes through
    collation, preprocessing and its inversion with the prediction's), or None for a case read on its own slices."""
    found = meta.get(SLICE_MAP) if meta else None
    if not found:
        return None
    shape = tuple(int(v) for v in np.asarray(found["shape"]).reshape(-1))
    grid = tuple(int(v) for v in np.asarray(found["grid_shape"]).reshape(-1))
    return SliceMap(np.asarray(found["origins"], dtype=float).reshape(-1, 3), shape, grid)


class LoadCased(MapTransform):
    """Replace the path under ``keys`` by the case's CT (see :func:`load_case`); ``source`` says DICOM or NIfTI."""

    def __call__(self, data: Mapping[Hashable, Any]) -> dict:
        d = dict(data)
        for key in self.key_iterator(d):
            d[key] = load_case(d[key], d.get("source", "dicom" if Path(d[key]).is_dir() else "nifti"))
        return d


def _is_nifti(path: Path) -> bool:
    return path.name.lower().endswith(NIFTI_SUFFIXES)


def _is_ct_folder(folder: Path, files: Sequence[str]) -> bool:
    """True when the folder holds a CT image (found by SOP Class; other objects and files beside it do not count)."""
    for name in sorted(files):
        if name.startswith(".") or _is_nifti(folder / name) or name.lower().endswith((".json", ".csv", ".txt")):
            continue
        try:
            ds = pydicom.dcmread(folder / name, stop_before_pixels=True, specific_tags=["SOPClassUID"])
        except (InvalidDicomError, OSError, EOFError, ValueError):
            continue
        sop = str(ds.get("SOPClassUID", "") or getattr(ds.get("file_meta"), "MediaStorageSOPClassUID", ""))
        if sop == CT_IMAGE_STORAGE or sop in ENHANCED_CT_STORAGE:
            return True
    return False


def _check_input(path: Path, source: str) -> None:
    if source == "dicom":
        scan_ct_series(path, resample=True)  # uneven spacing and gantry tilt are resampled when the case is read
    elif source == "nifti":
        shape = nib.load(str(path)).shape
        if not (len(shape) == 3 or (len(shape) == 4 and shape[-1] == 1)):
            raise InferenceInputError(f"{path}: image of shape {tuple(shape)}; a 3D CT volume is needed.")
        if min(shape[:3]) < 2:
            raise InferenceInputError(f"{path}: image of shape {tuple(shape)} has a single slice; a 3D CT is needed.")
    else:
        raise InferenceInputError(f"{path}: not a NIfTI file (.nii, .nii.gz) or a folder of DICOM CT slices.")


def _name_cases(cases: list[dict], root: Path) -> None:
    """Case ids from paths: a TCIA tree's ``LUNG1-001/<SeriesNumber>/image`` is ``LUNG1-001`` (``LUNG1-001_<Series>``
    when the patient has several series), another folder its path under ``input_dir`` joined by ``_``, a NIfTI file
    its name without extension. Repeated ids get ``_2``, ``_3``, ..."""
    seen: dict[str, int] = {}
    for case in cases:
        path = Path(case["image"])
        case["source_path"] = case["image"]  # kept as a string (not "image_..."; MONAI treats those as meta dicts)
        if case["source"] == "nifti":
            name = path.name.removesuffix(".gz").removesuffix(".nii").removesuffix(".NII")
        elif path.name.lower() == "image" and path.parent != root and path.parent.parent != root.parent:
            series, patient = path.parent, path.parent.parent
            siblings = [d for d in patient.iterdir() if (d / "image").is_dir() or (d / "IMAGE").is_dir()]
            name = patient.name if len(siblings) == 1 else f"{patient.name}_{series.name}"
        else:
            name = "_".join(path.relative_to(root).parts) if path != root else root.name
        seen[name] = seen.get(name, 0) + 1
        case["case_id"] = name if seen[name] == 1 else f"{name}_{seen[name]}"

"""Inference inputs: which cases an ``--input_dir`` holds, and each case loaded as the CT training saw.

* :func:`find_inputs` turns ``--input_dir`` into cases: every CT series folder (one per case, or a TCIA-layout tree
  ``<PatientID>/<SeriesNumber>/image/``) and every NIfTI file. Each series is checked from its headers before any
  pixel is read (one series per folder, at least two evenly spaced slices, the tags that place a slice in space); a
  bad input is skipped with a message naming the file, listed in ``inference_report.json``, and the rest still run.
* :class:`LoadCased` reads a case into a ``[1, X, Y, Z]`` MetaTensor in HU with its RAS affine -- the grid and
  orientation ``scripts.prepare`` writes for training, so inference sees what training saw.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np
import pydicom
import torch
from monai.data import MetaTensor
from monai.transforms import MapTransform
from pydicom.errors import InvalidDicomError

from scripts.dicom import DicomCaseError, read_ct_series, scan_ct_series

logger = logging.getLogger(__name__)

NIFTI_SUFFIXES = (".nii", ".nii.gz")


class InferenceInputError(ValueError):
    """No usable input at all; the message names the folder and what it should hold."""


def find_inputs(input_dir: str | Path, report_dir: str | Path | None = None) -> list[dict]:
    """Cases under ``input_dir`` as ``{"image": path, "case_id": ..., "source": "dicom" | "nifti"}``.

    Bad inputs are logged and skipped; with ``report_dir`` the found and skipped inputs are written to
    ``<report_dir>/inference_report.json``. Raises :class:`InferenceInputError` when nothing usable is found.
    """
    root = Path(input_dir)
    if not root.exists():
        raise InferenceInputError(f"--input_dir {root}: no such file or folder.")
    candidates: list[tuple[Path, str]] = []
    skipped: list[dict] = []
    if root.is_file():
        candidates.append((root, "nifti" if _is_nifti(root) else "unknown"))
    else:
        covered: set[Path] = set()
        for folder, dirs, files in os.walk(root, followlinks=True):  # linked case folders are inputs too
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            folder = Path(folder)
            for name in sorted(files):
                if _is_nifti(folder / name):
                    candidates.append((folder / name, "nifti"))
                    covered.add(folder)
            if _is_ct_folder(folder, files):
                candidates.append((folder, "dicom"))
                covered.add(folder)
        for child in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
            if not any(c == child or child in c.parents for c in covered):
                skipped.append({"input": str(child), "reason": f"{child}: no CT series (DICOM, Modality CT) or NIfTI."})

    cases = []
    for path, source in candidates:
        try:
            _check_input(path, source)
        except (DicomCaseError, InferenceInputError) as err:
            skipped.append({"input": str(path), "reason": str(err)})
            continue
        cases.append({"image": str(path), "source": source, "case_id": ""})
    _name_cases(cases, root)
    for entry in skipped:
        logger.error("skipped: %s", entry["reason"])
    if report_dir is not None:
        report = Path(report_dir) / "inference_report.json"
        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_text(json.dumps({"input_dir": str(root), "cases": cases, "skipped": skipped}, indent=2))
    if not cases:
        detail = "; ".join(e["reason"] for e in skipped) or "it is empty"
        raise InferenceInputError(
            f"--input_dir {root}: no usable input ({detail}). Give a folder of CT series folders (DICOM), a TCIA "
            "tree <PatientID>/<SeriesNumber>/image/, or NIfTI files (.nii.gz)."
        )
    logger.info("%d case(s) to infer under %s, %d skipped", len(cases), root, len(skipped))
    return cases


def load_case(path: str | Path, source: str) -> MetaTensor:
    """A ``[1, X, Y, Z]`` float32 MetaTensor (HU) with its RAS affine, from a CT series folder or a NIfTI file."""
    path = Path(path)
    if source == "dicom":
        ct = read_ct_series(path)
        array, affine = ct.hu, ct.affine_ras
    else:
        image = nib.load(str(path))
        array, affine = np.asarray(image.dataobj), image.affine
        if array.ndim == 4 and array.shape[-1] == 1:
            array = array[..., 0]
        if array.ndim != 3:
            raise InferenceInputError(f"{path}: image of shape {array.shape}; a 3D CT volume is needed.")
    meta = {"filename_or_obj": str(path), "source": source, "original_affine": torch.as_tensor(affine)}
    return MetaTensor(torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))[None], affine=affine, meta=meta)


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
    """True when the folder's first DICOM file is a CT image (SEG, RTSTRUCT and other files are not inputs)."""
    for name in sorted(files):
        if name.startswith(".") or _is_nifti(folder / name) or name.lower().endswith((".json", ".csv", ".txt")):
            continue
        try:
            ds = pydicom.dcmread(folder / name, stop_before_pixels=True, specific_tags=["Modality"])
        except (InvalidDicomError, OSError, EOFError, ValueError):
            continue
        return str(ds.get("Modality", "")).upper() == "CT"
    return False


def _check_input(path: Path, source: str) -> None:
    if source == "dicom":
        scan_ct_series(path)
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

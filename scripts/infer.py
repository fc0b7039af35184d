"""Inference building blocks: find the input cases, load DICOM or NIfTI, post-process, write NIfTI and DICOM SEG.

``configs/inference.yaml`` wires these into a MONAI evaluator:

* :func:`find_inputs` turns ``--input_dir`` into cases: every CT series folder (one per case, or a TCIA-layout tree
  ``<PatientID>/<SeriesNumber>/image/``) and every NIfTI file. Each series is checked from its headers before any
  pixel is read (one series per folder, at least two evenly spaced slices, the tags that place a slice in space); a
  bad input is skipped with a message naming the file, listed in ``inference_report.json``, and the rest still run.
* :class:`LoadCased` reads a case into a ``[1, X, Y, Z]`` MetaTensor in HU with its RAS affine -- the grid and
  orientation ``scripts.prepare`` writes for training, so inference sees what training saw.
* :class:`KeepLargestComponentsd` keeps the largest connected component(s) of each structure (scipy, no
  scikit-image needed).
* :class:`SaveCased` writes ``<output_dir>/<case>/<case>_seg.nii.gz`` on the input's own grid and, for DICOM input,
  ``<case>_seg.dcm``: a DICOM SEG (highdicom) that references the source series and instances, shares their frame of
  reference and names and codes each segment, so OHIF or 3D Slicer overlays it on the CT exactly.
* :class:`FallbackSlidingWindowInferer` is MONAI's sliding-window inferer that, when the device runs out of memory,
  retries the case once with the windows on the device and the stitched output in CPU memory.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any

import highdicom as hd
import nibabel as nib
import numpy as np
import pydicom
import torch
from ignite.engine import Engine, Events
from monai.data import MetaTensor
from monai.inferers import SlidingWindowInferer
from monai.transforms import MapTransform
from pydicom.errors import InvalidDicomError
from pydicom.sr.codedict import codes
from scipy import ndimage

from scripts.dicom import DicomCaseError, read_ct_series, scan_ct_series, segment_description
from scripts.files import replace_atomically, save_nifti
from scripts.metrics import spacing_of

logger = logging.getLogger(__name__)

NIFTI_SUFFIXES = (".nii", ".nii.gz")
ALGORITHM_NAME = "SwinUNETR NSCLC-Radiomics bundle"
#: torch raises this on CUDA and ROCm alike; older torch only has the CUDA name
OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


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


def keep_largest_components(labels: np.ndarray, num_components: int = 1) -> np.ndarray:
    """Per structure (each value > 0), keep its ``num_components`` largest 26-connected components."""
    out = np.zeros_like(labels)
    structure = np.ones((3,) * labels.ndim, dtype=bool)
    for value in np.unique(labels):
        if value == 0:
            continue
        components, count = ndimage.label(labels == value, structure=structure)
        if count <= num_components:
            out[components > 0] = value
            continue
        sizes = np.bincount(components.ravel())
        sizes[0] = 0
        keep = np.argsort(sizes)[::-1][:num_components]
        out[np.isin(components, keep)] = value
    return out


class KeepLargestComponentsd(MapTransform):
    """:func:`keep_largest_components` on a label map ``[1, X, Y, Z]``; ``num_components`` 0 leaves it as is."""

    def __init__(self, keys, num_components: int = 1, allow_missing_keys: bool = False) -> None:
        super().__init__(keys, allow_missing_keys)
        self.num_components = int(num_components)

    def __call__(self, data: Mapping[Hashable, Any]) -> dict:
        d = dict(data)
        if self.num_components <= 0:
            return d
        for key in self.key_iterator(d):
            tensor = d[key]
            kept = keep_largest_components(np.asarray(tensor.detach().cpu()), self.num_components)
            d[key] = tensor.new_tensor(kept) if isinstance(tensor, torch.Tensor) else kept
        return d


class SaveCased(MapTransform):
    """Write the label map under ``keys`` as NIfTI and, for DICOM input, as a DICOM SEG referencing the CT."""

    def __init__(
        self,
        keys,
        output_dir: str | Path,
        labels: Sequence[str],
        write_seg: bool = True,
        algorithm_version: str = "0.1.0",
        enabled: bool = True,
        allow_missing_keys: bool = False,
    ) -> None:
        super().__init__(keys, allow_missing_keys)
        self.enabled = enabled
        self.output_dir = Path(output_dir)
        self.labels = list(labels)
        self.write_seg = write_seg
        self.algorithm = hd.AlgorithmIdentificationSequence(
            name=ALGORITHM_NAME, family=codes.cid7162.ArtificialIntelligence, version=str(algorithm_version)
        )

    def __call__(self, data: Mapping[Hashable, Any]) -> dict:
        d = dict(data)
        if not self.enabled:
            return d
        case_id = str(d["case_id"])
        folder = self.output_dir / case_id
        folder.mkdir(parents=True, exist_ok=True)
        for key in self.key_iterator(d):
            tensor = d[key]
            labels = np.asarray(tensor.detach().cpu()).reshape(tensor.shape[-3:]).astype(np.uint8)
            affine = np.asarray(tensor.meta.get("original_affine", tensor.affine), dtype=float)
            nifti_path = folder / f"{case_id}_seg.nii.gz"
            save_nifti(nifti_path, labels, affine)
            outputs = {"nifti": str(nifti_path)}
            if self.write_seg and d.get("source") == "dicom":
                seg_path = folder / f"{case_id}_seg.dcm"
                write_dicom_seg(labels, d["source_path"], self.labels, seg_path, self.algorithm)
                outputs["dicom_seg"] = str(seg_path)
            voxel_ml = float(np.prod(spacing_of(affine))) / 1000.0
            volumes = {n: round(float((labels == i).sum()) * voxel_ml, 3) for i, n in enumerate(self.labels, start=1)}
            logger.info("%s: %s, volumes (ml) %s", case_id, ", ".join(outputs.values()), volumes)
            d[f"{key}_files"] = outputs
        return d


def write_dicom_seg(
    labels: np.ndarray,
    image_dir: str | Path,
    names: Sequence[str],
    path: str | Path,
    algorithm: hd.AlgorithmIdentificationSequence,
) -> hd.seg.Segmentation:
    """A DICOM SEG of the label map ``labels`` [X, Y, Z] (on the grid of the series in ``image_dir``).

    Frame ``k`` annotates the ``k``-th slice along the slice normal, the order :func:`scan_ct_series` sorts by, so
    every frame references the CT instance it lies on. Segment ``i`` is ``names[i - 1]``; empty frames are omitted.
    """
    headers, _ = scan_ct_series(image_dir)
    if labels.shape != (int(headers[0][1].Columns), int(headers[0][1].Rows), len(headers)):
        raise ValueError(f"{image_dir}: prediction shape {labels.shape} does not match the series' grid.")
    source = [ds for _, ds in headers]
    frames = np.ascontiguousarray(labels.transpose(2, 1, 0))  # [slice, row, column], as the CT stores pixels
    seg = hd.seg.Segmentation(
        source_images=source,
        pixel_array=frames,
        segmentation_type=hd.seg.SegmentationTypeValues.BINARY,
        segment_descriptions=[segment_description(i, name, algorithm) for i, name in enumerate(names, start=1)],
        series_instance_uid=hd.UID(),
        series_number=int(source[0].get("SeriesNumber", 0) or 0) + 9000,
        sop_instance_uid=hd.UID(),
        instance_number=1,
        manufacturer="NSCLC SwinUNETR bundle",
        manufacturer_model_name=ALGORITHM_NAME,
        software_versions=str(algorithm[0].AlgorithmVersion),
        device_serial_number="none",
        content_label="GTV" if names and names[0].upper().startswith("GTV") else "SEGMENTATION",
        content_description="SwinUNETR segmentation",
        omit_empty_frames=True,
    )
    replace_atomically(path, seg.save_as)
    return seg


class InferenceSummary:
    """Evaluator handler: times each case and prints one line at the end (cases, seconds per case, output folder)."""

    def __init__(self, output_dir: str | Path) -> None:
        self.output_dir = Path(output_dir)
        self.times: list[float] = []
        self._start = self._case_start = 0.0

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.STARTED, self._started)
        engine.add_event_handler(Events.ITERATION_STARTED, self._case_started)
        engine.add_event_handler(Events.ITERATION_COMPLETED, self._case_done)
        engine.add_event_handler(Events.COMPLETED, self._completed)

    def _started(self, engine: Engine) -> None:
        self._start, self.times = time.perf_counter(), []

    def _case_started(self, engine: Engine) -> None:
        self._case_start = time.perf_counter()

    def _case_done(self, engine: Engine) -> None:
        self.times.append(time.perf_counter() - self._case_start)

    def _completed(self, engine: Engine) -> None:
        total = time.perf_counter() - self._start
        per_case = total / max(len(self.times), 1)
        report = self.output_dir / "inference_report.json"
        skipped = len(json.loads(report.read_text()).get("skipped", [])) if report.is_file() else 0
        print(
            f"inferred {len(self.times)} case(s) in {total:.1f} s ({per_case:.1f} s per case, loading included) "
            f"-> {self.output_dir}; skipped {skipped} (see {report.name})"
        )


class FallbackSlidingWindowInferer(SlidingWindowInferer):
    """Sliding-window inference that survives a full CT that does not fit: on an out-of-memory error the case is
    run again once with the windows on the accelerator (``sw_device``) and the output stitched in CPU memory."""

    def __call__(self, inputs: torch.Tensor, network, *args: Any, **kwargs: Any):
        try:
            return super().__call__(inputs, network, *args, **kwargs)
        except (OUT_OF_MEMORY, RuntimeError) as err:
            if not isinstance(err, OUT_OF_MEMORY) and "out of memory" not in str(err).lower():
                raise
            logger.warning(
                "out of memory in sliding-window inference of an input of shape %s on %s (%s); retrying with the "
                "windows on %s and the output stitched on the CPU",
                tuple(inputs.shape), inputs.device, str(err).splitlines()[0], inputs.device,
            )  # fmt: skip
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            saved = self.sw_device
            self.sw_device = inputs.device
            try:
                output = super().__call__(inputs, network, *args, device=torch.device("cpu"), **kwargs)
            finally:
                self.sw_device = saved
            try:
                return output.to(inputs.device)
            except (OUT_OF_MEMORY, RuntimeError):
                return output


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

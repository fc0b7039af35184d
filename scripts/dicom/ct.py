"""A CT series folder (one file per slice) -> HU volume on its own voxel grid, with the LPS affine that places it.

* :func:`scan_ct_series` reads the headers and checks, before any pixel is decoded, that the folder holds one
  series, one orientation, one in-plane geometry and evenly spaced slices (a gap means a missing slice). Slices are
  ordered by their position along the slice normal -- never by file name or InstanceNumber.
* :func:`read_ct_series` then decodes the pixels into an int16 HU volume indexed ``[column, row, slice]``.

Problems raise :class:`DicomCaseError` with a message that names the file and says what to do.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pydicom
from pydicom.errors import InvalidDicomError

from scripts.dicom.common import LPS_TO_RAS, DicomCaseError

logger = logging.getLogger(__name__)

#: positions along the slice normal must agree with a uniform grid to this fraction of the slice spacing
SLICE_TOLERANCE = 0.1
#: direction cosines of two slices count as equal below this difference
ORIENTATION_TOLERANCE = 1e-4
# what NBIA zips carry besides the slices (TciaDataset copies them into image/): skipped, not read as DICOM
NOT_DICOM_SUFFIXES = {".csv", ".json", ".txt", ".xml"}
NOT_DICOM_NAMES = {"LICENSE", "LICENSE.TXT", "README"}
#: tags without which a slice cannot be placed in its series and in space
REQUIRED_CT_TAGS = (
    "SeriesInstanceUID",
    "ImageOrientationPatient",
    "ImagePositionPatient",
    "PixelSpacing",
    "Rows",
    "Columns",
)


@dataclass
class CtSeries:
    """A CT series sorted along its slice normal; ``hu`` is indexed ``[column, row, slice]``."""

    hu: np.ndarray
    affine_lps: np.ndarray
    sop_instance_uids: list[str]
    files: list[Path]
    series_uid: str
    frame_of_reference_uid: str
    patient_id: str

    @property
    def affine_ras(self) -> np.ndarray:
        return LPS_TO_RAS @ self.affine_lps

    @property
    def spacing(self) -> tuple[float, float, float]:
        return tuple(float(s) for s in np.linalg.norm(self.affine_lps[:3, :3], axis=0))


def scan_ct_series(
    image_dir: str | Path, with_pixels: bool = False
) -> tuple[list[tuple[Path, pydicom.Dataset]], np.ndarray]:
    """The headers of a CT series folder sorted along the slice normal, and its LPS affine.

    Checks that the folder holds exactly one series, one orientation, one in-plane geometry and evenly spaced
    slices (a gap means a missing slice), so a bad series is rejected before any pixel is decoded. Pixel data is
    not read unless ``with_pixels`` (then each file is read once, its pixels still undecoded).
    """
    image_dir = Path(image_dir)
    headers = _read_headers(image_dir, with_pixels)
    _check_one_volume(headers, image_dir)
    iop = np.asarray(headers[0][1].ImageOrientationPatient, dtype=float)
    normal = np.cross(iop[:3], iop[3:])
    positions = np.array([np.dot(np.asarray(ds.ImagePositionPatient, dtype=float), normal) for _, ds in headers])
    order = np.argsort(positions, kind="stable")
    headers = [headers[i] for i in order]
    step = _check_slice_spacing(positions[order], [p for p, _ in headers], image_dir)
    return headers, _affine(headers[0][1], normal, step)


def _read_headers(image_dir: Path, with_pixels: bool) -> list[tuple[Path, pydicom.Dataset]]:
    """Every DICOM file of the folder (known non-DICOM companions skipped), with the tags that place a slice."""
    files = sorted(p for p in image_dir.iterdir() if p.is_file() and not p.name.startswith("."))
    if not files:
        raise DicomCaseError(f"{image_dir}: no files in the CT image folder; download the case again.")
    headers = []
    for path in files:
        if path.suffix.lower() in NOT_DICOM_SUFFIXES or path.name.upper() in NOT_DICOM_NAMES:
            continue
        try:
            ds = pydicom.dcmread(path, stop_before_pixels=not with_pixels)
        except (InvalidDicomError, OSError, EOFError, ValueError) as err:
            raise DicomCaseError(
                f"{path}: not a readable DICOM file ({err}); delete the case and download it again."
            ) from err
        for tag in REQUIRED_CT_TAGS:
            if tag not in ds:
                raise DicomCaseError(
                    f"{path}: has no {tag}; the file is truncated or not a CT slice. Download the case again."
                )
        headers.append((path, ds))
    return headers


def _check_one_volume(headers: list[tuple[Path, pydicom.Dataset]], image_dir: Path) -> None:
    """One series, one orientation and one in-plane geometry, or :class:`DicomCaseError` naming the odd file."""
    series = Counter(str(ds.get("SeriesInstanceUID", "")) for _, ds in headers)
    if len(series) > 1:
        detail = ", ".join(f"{uid} ({n} files)" for uid, n in series.most_common())
        raise DicomCaseError(
            f"{image_dir}: {len(series)} series are mixed in one image folder: {detail}; keep one series per folder."
        )
    path0, ds0 = headers[0]
    iop0 = np.asarray(ds0.ImageOrientationPatient, dtype=float)
    for path, ds in headers:
        iop = np.asarray(ds.ImageOrientationPatient, dtype=float)
        if np.abs(iop - iop0).max() > ORIENTATION_TOLERANCE:
            raise DicomCaseError(
                f"{path}: ImageOrientationPatient {iop.tolist()} differs from {iop0.tolist()} in {path0.name}; "
                "slices of one volume must share one orientation (is this a localizer or a reformatted series?)."
            )
        if (ds.Rows, ds.Columns) != (ds0.Rows, ds0.Columns) or not np.allclose(
            np.asarray(ds.PixelSpacing, dtype=float), np.asarray(ds0.PixelSpacing, dtype=float), rtol=1e-4
        ):
            raise DicomCaseError(f"{path}: Rows/Columns/PixelSpacing differ from {path0.name}; mixed geometry.")


def _affine(first: pydicom.Dataset, normal: np.ndarray, step: float) -> np.ndarray:
    """The LPS affine of voxel (column, row, slice) indices, from the first slice along the normal."""
    iop = np.asarray(first.ImageOrientationPatient, dtype=float)
    row_spacing, col_spacing = (float(v) for v in first.PixelSpacing)
    affine = np.eye(4)
    affine[:3, 0] = iop[:3] * col_spacing  # i = column index, moves along a row
    affine[:3, 1] = iop[3:] * row_spacing  # j = row index, moves down a column
    affine[:3, 2] = normal * step
    affine[:3, 3] = np.asarray(first.ImagePositionPatient, dtype=float)
    return affine


def read_ct_series(image_dir: str | Path) -> CtSeries:
    """Read every DICOM file in ``image_dir`` as one CT series, sorted by position along the slice normal.

    The checks of :func:`scan_ct_series`, then stored values converted to HU with each slice's rescale
    slope/intercept.
    """
    headers, affine = scan_ct_series(image_dir, with_pixels=True)  # every file read once
    ds0 = headers[0][1]
    # slices contiguous in memory: (columns, rows, slices) seen through a transpose of (slices, rows, columns), i.e.
    # Fortran order -- what NIfTI stores, so writing it is a plain copy
    by_slice = np.empty((len(headers), int(ds0.Rows), int(ds0.Columns)), dtype=np.int16)
    for k, (path, ds) in enumerate(headers):
        try:
            stored = ds.pixel_array
        except Exception as err:  # pixel decoding raises many types (truncated data, codec errors)
            raise DicomCaseError(f"{path}: pixel data cannot be decoded ({err}); download the case again.") from err
        by_slice[k] = to_hu(stored, ds)
        del ds.PixelData  # the decoded slice is kept; its bytes are not needed twice
    hu = by_slice.transpose(2, 1, 0)

    return CtSeries(
        hu=hu,
        affine_lps=affine,
        sop_instance_uids=[str(ds.SOPInstanceUID) for _, ds in headers],
        files=[p for p, _ in headers],
        series_uid=str(ds0.get("SeriesInstanceUID", "")),
        frame_of_reference_uid=str(ds0.get("FrameOfReferenceUID", "")),
        patient_id=str(ds0.get("PatientID", "")),
    )


def to_hu(stored: np.ndarray, ds: pydicom.Dataset) -> np.ndarray:
    """Stored values to HU (int16, clipped) with the slice's rescale slope and intercept; integer arithmetic for the
    usual slope 1 and whole-number intercept, float (rounded) otherwise."""
    slope = float(ds.get("RescaleSlope", 1.0) or 1.0)
    intercept = float(ds.get("RescaleIntercept", 0.0) or 0.0)
    if slope == 1.0 and intercept.is_integer() and stored.dtype.kind in "iu":
        values = stored.astype(np.int32) + int(intercept)
    else:
        values = np.rint(stored.astype(np.float32) * slope + intercept)
    return np.clip(values, -32768, 32767).astype(np.int16)


def _check_slice_spacing(positions: np.ndarray, files: list[Path], image_dir: Path) -> float:
    """Return the slice step; raise on duplicate positions and on gaps (a missing slice) in the series."""
    if len(positions) < 2:
        raise DicomCaseError(f"{image_dir}: only {len(positions)} slice; a 3D CT needs at least two.")
    diffs = np.diff(positions)
    duplicate = np.flatnonzero(diffs < 1e-3)
    if duplicate.size:
        i = duplicate[0]
        raise DicomCaseError(
            f"{files[i + 1]}: same slice position as {files[i].name} ({positions[i]:.2f} mm); duplicate slices."
        )
    step = float(np.median(diffs))
    off = np.flatnonzero(np.abs(diffs - step) > SLICE_TOLERANCE * step)
    if off.size:
        i = off[0]
        missing = round(diffs[i] / step) - 1
        what = f"{missing} missing slice(s)" if missing >= 1 else "uneven slice spacing"
        raise DicomCaseError(
            f"{image_dir}: {what} between {files[i].name} ({positions[i]:.2f} mm) and {files[i + 1].name} "
            f"({positions[i + 1]:.2f} mm), expected steps of {step:.2f} mm; download the series again."
        )
    return step

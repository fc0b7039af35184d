"""A CT series folder (one file per slice) -> HU volume on its own voxel grid, with the LPS affine that places it.

* :func:`scan_ct_series` reads the headers and checks, before any pixel is decoded, that the folder holds one
  series, one orientation, one in-plane geometry and evenly spaced slices on a straight line (a gap means a missing
  slice). Slices are ordered by their position along the slice normal -- never by file name or InstanceNumber.
* :func:`read_ct_series` then decodes the pixels into an int16 HU volume indexed ``[column, row, slice]``.

What a folder may hold besides the slices is classified by SOP Class, not by failing: a DICOMDIR, presentation
states, key objects, SRs, SEGs, RTSTRUCTs, secondary captures and files that are not DICOM at all (``Thumbs.db``,
``LICENSE``) are skipped and listed in :attr:`CtSeries.notes`. What cannot be placed or converted correctly is
refused with :class:`DicomCaseError` naming the file and the cause:

* a file that is DICOM but cut or damaged, or a slice without the tags that place it in space;
* a slice without RescaleSlope / RescaleIntercept (Type 1 in the CT Image module; HU are never guessed);
* an Enhanced (multi-frame) CT object -- one file holding the whole series -- which this reader does not convert;
* slices stepped sideways (gantry tilt) by more than half a pixel over the series: the grid is sheared, and NIfTI
  consumers that read the qform (ITK, 3D Slicer) would misplace it. A smaller drift is kept exactly in the affine;
* pixel data that cannot be decoded: the message names the transfer syntax and the package that decodes it, or says
  that the data are cut.

``PixelPaddingValue`` voxels (outside the scanner's field of view) become air, -1024 HU.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pydicom
from pydicom.errors import InvalidDicomError
from pydicom.pixels.decoders.base import get_decoder
from pydicom.uid import UID
from scripts.dicom.common import LPS_TO_RAS, DicomCaseError

logger = logging.getLogger(__name__)

CT_IMAGE_STORAGE = "1.2.840.10008.5.1.4.1.1.2"
ENHANCED_CT_STORAGE = ("1.2.840.10008.5.1.4.1.1.2.1", "1.2.840.10008.5.1.4.1.1.2.2")  # enhanced, legacy converted
DICOMDIR_STORAGE = "1.2.840.10008.1.3.10"
#: positions along the slice normal must agree with a uniform grid to this fraction of the slice spacing
SLICE_TOLERANCE = 0.1
#: direction cosines of two slices count as equal below this difference
ORIENTATION_TOLERANCE = 1e-4
#: HU written where the scanner marked a voxel as padding (outside its field of view)
PADDING_HU = -1024
#: tags without which a slice cannot be placed in its series and in space, or turned into HU
REQUIRED_CT_TAGS = (
    "SeriesInstanceUID",
    "ImageOrientationPatient",
    "ImagePositionPatient",
    "PixelSpacing",
    "Rows",
    "Columns",
)
RESCALE_TAGS = ("RescaleSlope", "RescaleIntercept")
#: transfer syntaxes whose pixel data pydicom hands over as the plain little-endian values (deflate is inflated on read)
NATIVE_LITTLE_ENDIAN = ("1.2.840.10008.1.2", "1.2.840.10008.1.2.1", "1.2.840.10008.1.2.1.99")


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
    notes: list[str] = field(default_factory=list)  # files skipped (not CT slices), geometry kept with a remark

    @property
    def affine_ras(self) -> np.ndarray:
        return LPS_TO_RAS @ self.affine_lps

    @property
    def spacing(self) -> tuple[float, float, float]:
        return tuple(float(s) for s in np.linalg.norm(self.affine_lps[:3, :3], axis=0))


def scan_ct_series(
    image_dir: str | Path, with_pixels: bool = False, notes: list[str] | None = None
) -> tuple[list[tuple[Path, pydicom.Dataset]], np.ndarray]:
    """The headers of a CT series folder sorted along the slice normal, and its LPS affine.

    Pixel data is not read unless ``with_pixels`` (then each file is read once, its pixels still undecoded). What
    was skipped or kept with a remark is appended to ``notes``.
    """
    image_dir = Path(image_dir)
    notes = [] if notes is None else notes
    headers = _read_headers(image_dir, with_pixels, notes)
    _check_one_volume(headers, image_dir)
    iop = np.asarray(headers[0][1].ImageOrientationPatient, dtype=float)
    normal = np.cross(iop[:3], iop[3:])
    xyz = np.array([np.asarray(ds.ImagePositionPatient, dtype=float) for _, ds in headers])
    order = np.argsort(xyz @ normal, kind="stable")
    headers, xyz = [headers[i] for i in order], xyz[order]
    _check_slice_spacing(xyz @ normal, [p for p, _ in headers], image_dir)
    step = _slice_step(xyz, normal, headers, image_dir, notes)
    return headers, _affine(headers[0][1], step)


def read_ct_series(image_dir: str | Path) -> CtSeries:
    """Read every CT slice in ``image_dir`` as one series, sorted by position along the slice normal.

    The checks of :func:`scan_ct_series`, then stored values converted to HU with each slice's rescale
    slope/intercept, padding set to air.
    """
    notes: list[str] = []
    headers, affine = scan_ct_series(image_dir, with_pixels=True, notes=notes)  # every file read once
    ds0 = headers[0][1]
    # slices contiguous in memory: (columns, rows, slices) seen through a transpose of (slices, rows, columns), i.e.
    # Fortran order -- what NIfTI stores, so writing it is a plain copy
    by_slice = np.empty((len(headers), int(ds0.Rows), int(ds0.Columns)), dtype=np.int16)
    for k, (path, ds) in enumerate(headers):
        read_hu(path, ds, out=by_slice[k])
        del ds.PixelData  # the decoded slice is kept; its bytes are not needed twice
    return CtSeries(
        hu=by_slice.transpose(2, 1, 0),
        affine_lps=affine,
        sop_instance_uids=[str(ds.SOPInstanceUID) for _, ds in headers],
        files=[p for p, _ in headers],
        series_uid=str(ds0.get("SeriesInstanceUID", "")),
        frame_of_reference_uid=str(ds0.get("FrameOfReferenceUID", "")),
        patient_id=str(ds0.get("PatientID", "")),
        notes=notes,
    )


def to_hu(stored: np.ndarray, ds: pydicom.Dataset) -> np.ndarray:
    """Stored values to HU (int16, clipped) with the slice's rescale slope and intercept; integer arithmetic for the
    usual slope 1 and whole-number intercept, float (rounded) otherwise. Padding values become :data:`PADDING_HU`."""
    slope, intercept = float(ds.RescaleSlope), float(ds.RescaleIntercept)
    if slope == 1.0 and intercept.is_integer() and stored.dtype.kind in "iu":
        values = stored.astype(np.int32) + int(intercept)
    else:
        values = np.rint(stored.astype(np.float32) * slope + intercept)
    hu = np.clip(values, -32768, 32767).astype(np.int16)
    padding = _padding_mask(stored, ds)
    if padding is not None:
        hu[padding] = PADDING_HU
    return hu


def read_hu(path: Path, ds: pydicom.Dataset, out: np.ndarray) -> np.ndarray:
    """The slice's HU written into ``out`` (int16, rows x columns): ``to_hu(decode(path, ds), ds)``, computed straight
    from the file's bytes in int16 for the usual CT slice -- uncompressed little-endian 16-bit values whose HU fit in
    int16 without clipping (slope 1, whole-number intercept) -- which takes a third of the time of pydicom's generic
    decoder followed by the conversion and gives the same values; any other slice goes that way."""
    stored = _native_stored_values(ds, out.shape)
    intercept = float(ds.RescaleIntercept)
    if stored is None or float(ds.RescaleSlope) != 1.0 or not intercept.is_integer():
        out[...] = to_hu(decode(path, ds), ds)
        return out
    bits = int(ds.get("BitsStored", 16))
    low, high = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if stored.dtype.kind == "i" else (0, (1 << bits) - 1)
    if high > np.iinfo(np.int16).max or low + intercept < -32768 or high + intercept > 32767:
        out[...] = to_hu(decode(path, ds), ds)  # values that do not fit int16 before or after the rescale
        return out
    np.add(stored.view("<i2"), np.int16(intercept), out=out)
    padding = _padding_mask(stored, ds)
    if padding is not None:
        out[padding] = PADDING_HU
    return out


def _native_stored_values(ds: pydicom.Dataset, shape: tuple[int, int]) -> np.ndarray | None:
    """The stored values of an uncompressed little-endian 16-bit single-frame slice as an array over its bytes (bits
    above BitsStored cleared, or sign-extended when signed, as pydicom's decoder does); None for anything else."""
    meta = getattr(ds, "file_meta", None)
    syntax = str(meta.get("TransferSyntaxUID", "")) if meta is not None else ""
    if (
        syntax not in NATIVE_LITTLE_ENDIAN
        or int(ds.get("BitsAllocated", 0)) != 16
        or int(ds.get("SamplesPerPixel", 1)) != 1
        or int(ds.get("NumberOfFrames", 1) or 1) != 1
        or "PixelData" not in ds
        or (int(ds.Rows), int(ds.Columns)) != shape
    ):
        return None
    data = ds.PixelData
    if not isinstance(data, bytes) or len(data) < 2 * shape[0] * shape[1]:
        return None  # cut pixel data: the generic decoder says so
    signed = int(ds.get("PixelRepresentation", 0)) == 1
    stored = np.frombuffer(data, "<i2" if signed else "<u2", shape[0] * shape[1]).reshape(shape)
    unused = 16 - int(ds.get("BitsStored", 16))
    if 0 < unused < 16:
        stored = np.right_shift(np.left_shift(stored, unused), unused)
    return stored


def decode(path: Path, ds: pydicom.Dataset) -> np.ndarray:
    """The slice's stored values, or :class:`DicomCaseError` saying whether the data are cut or the transfer syntax
    needs a decoder package (named) that is not installed."""
    meta = getattr(ds, "file_meta", None)
    syntax = UID(str(meta.get("TransferSyntaxUID", ""))) if meta is not None else UID("")
    try:
        return ds.pixel_array
    except Exception as err:  # pixel decoding raises many types (truncated data, codec errors)
        if syntax.is_transfer_syntax and syntax.is_compressed:
            try:
                decoder = get_decoder(syntax)
            except NotImplementedError:
                decoder = None
            if decoder is None or not decoder.is_available:
                needs = f"install one of {decoder.missing_dependencies}" if decoder else "pydicom has no decoder for it"
                raise DicomCaseError(
                    f"{path}: pixel data in {syntax.name} ({syntax}) cannot be decoded here: {needs} (requirements.txt "
                    "pins pylibjpeg-libjpeg, pylibjpeg-openjpeg and pyjpegls), or export the series uncompressed."
                ) from err
            raise DicomCaseError(
                f"{path}: pixel data in {syntax.name} ({syntax}) could not be decoded ({err}): the compressed data are "
                "damaged or cut; download the case again."
            ) from err
        raise DicomCaseError(
            f"{path}: pixel data cannot be read ({err}): the file is cut or damaged; download the case again."
        ) from err


def _read_headers(image_dir: Path, with_pixels: bool, notes: list[str]) -> list[tuple[Path, pydicom.Dataset]]:
    """The CT slices of the folder; every other file is skipped by what it is (noted), a damaged one refused."""
    files = sorted(p for p in image_dir.iterdir() if p.is_file() and not p.name.startswith("."))
    headers, skipped = [], []
    for path in files:
        ds = _read_dicom(path, with_pixels)
        if ds is None and path.suffix.lower() == ".dcm":
            raise DicomCaseError(f"{path}: named .dcm but not DICOM: the file is damaged; download the case again.")
        kind = "not DICOM" if ds is None else _not_a_ct_slice(ds)
        if kind:
            skipped.append(f"{path.name} ({kind})")
            continue
        missing = [tag for tag in REQUIRED_CT_TAGS if tag not in ds]
        if missing:
            raise DicomCaseError(
                f"{path}: a CT image without {missing}, which every CT slice carries to place it in space: the file "
                "is cut or damaged; download the case again."
            )
        if any(tag not in ds for tag in RESCALE_TAGS):
            raise DicomCaseError(
                f"{path}: no RescaleSlope/RescaleIntercept (required in every CT image): its stored values cannot be "
                "turned into Hounsfield units and are not guessed. Export the series again with its rescale tags."
            )
        headers.append((path, ds))
    if skipped:
        notes.append(f"skipped {len(skipped)} file(s) that are not CT slices: {', '.join(skipped[:10])}")
    if not headers:
        detail = f" (only {', '.join(skipped[:5])})" if skipped else ""
        raise DicomCaseError(f"{image_dir}: no CT slices in the image folder{detail}; download the case again.")
    return headers


def _read_dicom(path: Path, with_pixels: bool) -> pydicom.Dataset | None:
    """The file's dataset; None when it is not DICOM at all; :class:`DicomCaseError` when it is DICOM but damaged."""
    try:
        return pydicom.dcmread(path, stop_before_pixels=not with_pixels)
    except InvalidDicomError:
        pass  # no DICOM preamble: perhaps a raw dataset (some exports write those), perhaps not DICOM at all
    except (OSError, EOFError, ValueError, KeyError) as err:
        raise DicomCaseError(f"{path}: a DICOM file that cannot be read ({err}): it is cut or damaged.") from err
    try:
        ds = pydicom.dcmread(path, stop_before_pixels=not with_pixels, force=True)
        return ds if "SOPClassUID" in ds and "Modality" in ds else None
    except Exception:  # garbage read as DICOM: not DICOM
        return None


def _not_a_ct_slice(ds: pydicom.Dataset) -> str:
    """Empty for a CT image slice; else what the object is (to skip it), or an error for an Enhanced CT."""
    sop = str(ds.get("SOPClassUID", "") or getattr(ds.get("file_meta"), "MediaStorageSOPClassUID", ""))
    if sop == DICOMDIR_STORAGE or "DirectoryRecordSequence" in ds:
        return "DICOMDIR"
    if sop in ENHANCED_CT_STORAGE:
        raise DicomCaseError(
            f"{ds.filename}: an {UID(sop).name} (SOP class {sop}): one multi-frame file holding the whole series, "
            "which this reader does not convert. Export the series as classic CT images (CT Image Storage, one "
            "file per slice), e.g. with your PACS or `dcm2niix`, and give that folder (or the NIfTI) instead."
        )
    if sop == CT_IMAGE_STORAGE:
        return ""
    return UID(sop).name if sop else f"no SOP class, modality {ds.get('Modality', 'unknown')}"


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


def _check_slice_spacing(positions: np.ndarray, files: list[Path], image_dir: Path) -> float:
    """Return the slice step along the normal; raise on duplicate positions and on gaps (a missing slice)."""
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


def _slice_step(xyz: np.ndarray, normal: np.ndarray, headers: list, image_dir: Path, notes: list[str]) -> np.ndarray:
    """The vector from one slice position to the next (the affine's third column), exactly as the positions give it.

    Slices of a gantry-tilted series are stepped sideways as well as along the normal: that grid is sheared. A drift
    of up to half a pixel over the whole series is kept in the affine and noted; more is refused.
    """
    step = (xyz[-1] - xyz[0]) / (len(xyz) - 1)
    along = float(step @ normal)
    spread = np.abs(np.diff(xyz, axis=0) - step).max()
    if spread > SLICE_TOLERANCE * abs(along):
        raise DicomCaseError(
            f"{image_dir}: slice positions do not lie on one straight line at even steps (off by {spread:.2f} mm); "
            "the series mixes acquisitions or was reformatted. Keep one regular series per folder."
        )
    sideways = step - along * normal
    drift = float(np.linalg.norm(sideways)) * (len(xyz) - 1)
    pixel = float(min(np.asarray(headers[0][1].PixelSpacing, dtype=float)))
    tilt = float(np.degrees(np.arctan2(np.linalg.norm(sideways), abs(along))))
    if drift > 0.5 * pixel:
        raise DicomCaseError(
            f"{image_dir}: the slices step {np.linalg.norm(sideways):.3f} mm sideways per slice ({drift:.1f} mm over "
            f"the series: a gantry tilt of {tilt:.1f} deg), so the voxel grid is sheared. NIfTI readers that use the "
            "qform (ITK, 3D Slicer) would misplace it, so it is refused: resample it to an orthogonal grid first, "
            "e.g. with `dcm2niix` (which corrects gantry tilt), and give the NIfTI to inference."
        )
    if drift > 1e-3:
        notes.append(f"slices step {drift:.3f} mm sideways over the series (tilt {tilt:.3f} deg): kept in the affine")
    return step


def _affine(first: pydicom.Dataset, step: np.ndarray) -> np.ndarray:
    """The LPS affine of voxel (column, row, slice) indices, from the first slice along the normal."""
    iop = np.asarray(first.ImageOrientationPatient, dtype=float)
    row_spacing, col_spacing = (float(v) for v in first.PixelSpacing)
    affine = np.eye(4)
    affine[:3, 0] = iop[:3] * col_spacing  # i = column index, moves along a row
    affine[:3, 1] = iop[3:] * row_spacing  # j = row index, moves down a column
    affine[:3, 2] = step
    affine[:3, 3] = np.asarray(first.ImagePositionPatient, dtype=float)
    return affine


def _padding_mask(stored: np.ndarray, ds: pydicom.Dataset) -> np.ndarray | None:
    """Where the stored values are PixelPaddingValue (or within [value, PixelPaddingRangeLimit]); None if none."""
    if "PixelPaddingValue" not in ds:
        return None
    value = int(ds.PixelPaddingValue)
    limit = int(ds.get("PixelPaddingRangeLimit", value))
    low, high = min(value, limit), max(value, limit)
    mask = (stored >= low) & (stored <= high)
    return mask if mask.any() else None

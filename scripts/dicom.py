"""Read one NSCLC-Radiomics case (a CT series folder and a DICOM SEG file) into aligned volumes.

Input: a folder of CT slices (one file per slice) and a DICOM SEG that annotates them.
Output: :class:`CaseVolumes` -- the CT in Hounsfield units (int16), a label volume (uint8, 0 = background,
``i + 1`` = the i-th requested label) on the CT's own voxel grid, and the RAS affine NIfTI expects.

Why not MONAI's ``PydicomReader``: it assumes dense SEGs (one frame per CT slice and segment), while highdicom and
dcmqi omit empty frames by default, and it mutates the ``label_dict`` it is given. Here

* CT slices are ordered by their position along the slice normal -- never by file name or InstanceNumber;
* every SEG frame is placed on the CT slice it references (``SourceImageSequence``) or, when a frame carries no
  reference, on the slice at its ``ImagePositionPatient``; missing frames are empty, so sparse SEGs work;
* segments are matched by a normalised name (``"GTV-1"``, ``"GTV1"`` and ``"gtv 1"`` are the same label) and
  shell-style patterns (``"GTV*"`` merges GTV-1, GTV-2, ...); other segments are ignored.

Problems raise :class:`DicomCaseError` with a message that names the file and says what is wrong.
"""

from __future__ import annotations

import fnmatch
import logging
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import highdicom as hd
import numpy as np
import pydicom
from pydicom.errors import InvalidDicomError
from pydicom.sr.codedict import codes

logger = logging.getLogger(__name__)

#: positions along the slice normal must agree with a uniform grid to this fraction of the slice spacing
SLICE_TOLERANCE = 0.1
SEG_STORAGE = "1.2.840.10008.5.1.4.1.1.66.4"  # Segmentation Storage SOP class
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
#: LPS (DICOM patient) to RAS (NIfTI world) coordinates
LPS_TO_RAS = np.diag([-1.0, -1.0, 1.0, 1.0])


class DicomCaseError(ValueError):
    """A case that cannot be read; the message names the case, the file and what to do."""


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


@dataclass
class CaseVolumes:
    """A CT and its label volume on the same grid, ready to be written as NIfTI."""

    patient_id: str
    image: np.ndarray  # int16 HU, [x, y, z] voxel order
    label: np.ndarray  # uint8, 0 = background, i + 1 = labels[i]
    affine: np.ndarray  # RAS, as NIfTI stores it
    labels: list[str]
    segments: dict[str, list[str]] = field(default_factory=dict)  # requested label -> matched SEG segment labels
    info: dict = field(default_factory=dict)


def normalize_name(name: str) -> str:
    """``"GTV-1"``, ``"gtv 1"`` and ``"GTV_1"`` all become ``"gtv1"``: case, spaces and punctuation do not count."""
    return re.sub(r"[^0-9a-z*?]", "", name.lower())


def scan_ct_series(
    image_dir: str | Path, with_pixels: bool = False
) -> tuple[list[tuple[Path, pydicom.Dataset]], np.ndarray]:
    """The headers of a CT series folder sorted along the slice normal, and its LPS affine.

    Checks that the folder holds exactly one series, one orientation, one in-plane geometry and evenly spaced
    slices (a gap means a missing slice), so a bad series is rejected before any pixel is decoded. Pixel data is
    not read unless ``with_pixels`` (then each file is read once, its pixels still undecoded).
    """
    image_dir = Path(image_dir)
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
        headers.append((path, ds))

    for path, ds in headers:
        for tag in REQUIRED_CT_TAGS:
            if tag not in ds:
                raise DicomCaseError(
                    f"{path}: has no {tag}; the file is truncated or not a CT slice. Download the case again."
                )

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

    row_dir, col_dir = iop0[:3], iop0[3:]
    normal = np.cross(row_dir, col_dir)
    positions = np.array([np.dot(np.asarray(ds.ImagePositionPatient, dtype=float), normal) for _, ds in headers])
    order = np.argsort(positions, kind="stable")
    headers = [headers[i] for i in order]
    positions = positions[order]
    step = _check_slice_spacing(positions, [p for p, _ in headers], image_dir)

    row_spacing, col_spacing = (float(v) for v in ds0.PixelSpacing)
    affine = np.eye(4)
    affine[:3, 0] = row_dir * col_spacing  # i = column index, moves along a row
    affine[:3, 1] = col_dir * row_spacing  # j = row index, moves down a column
    affine[:3, 2] = normal * step
    affine[:3, 3] = np.asarray(headers[0][1].ImagePositionPatient, dtype=float)

    return headers, affine


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


def read_seg_labels(seg_file: str | Path, ct: CtSeries, labels: Sequence[str]) -> tuple[np.ndarray, dict]:
    """Decode the segments of ``seg_file`` that match ``labels`` onto the grid of ``ct``.

    Returns the label volume (uint8, ``i + 1`` where ``labels[i]`` is present; earlier labels win where segments
    overlap, so a tumour inside a lung stays tumour) and ``{label: [matched segment labels]}``.
    """
    seg_file = Path(seg_file)
    seg = _read_seg(seg_file)

    seg_for = str(seg.get("FrameOfReferenceUID", ""))
    if ct.frame_of_reference_uid and seg_for and seg_for != ct.frame_of_reference_uid:
        raise DicomCaseError(
            f"{seg_file}: FrameOfReferenceUID {seg_for} differs from the CT's {ct.frame_of_reference_uid}; "
            "this SEG was drawn on another scan. Check that seg/ and image/ belong to the same study."
        )
    referenced_series = {str(item.SeriesInstanceUID) for item in seg.get("ReferencedSeriesSequence", [])}
    if referenced_series and ct.series_uid not in referenced_series:
        raise DicomCaseError(
            f"{seg_file}: references series {sorted(referenced_series)}, not the CT series {ct.series_uid} in "
            f"{ct.files[0].parent}; download the CT series the SEG references."
        )
    if int(seg.Rows) != ct.hu.shape[1] or int(seg.Columns) != ct.hu.shape[0]:
        raise DicomCaseError(
            f"{seg_file}: frames are {seg.Rows}x{seg.Columns}, the CT slices {ct.hu.shape[1]}x{ct.hu.shape[0]}; "
            "SEGs on a different in-plane grid are not supported."
        )

    segments = {int(item.SegmentNumber): str(item.get("SegmentLabel", "")) for item in seg.SegmentSequence}
    by_label = _match_segments(segments, labels, seg_file)
    wanted: dict[int, int] = {}  # segment number -> label index; the first label that matches a segment keeps it
    for index, numbers in enumerate(by_label.values()):
        for number in numbers:
            wanted.setdefault(number, index)
    slice_of_frame = _frame_slices(seg, ct, seg_file)
    fractional = str(seg.SegmentationType) == "FRACTIONAL"
    max_fraction = float(seg.get("MaximumFractionalValue", 1) or 1)

    label = np.zeros(ct.hu.shape, dtype=np.uint8, order="F")  # slices contiguous, like the CT
    # paint higher label indices first so that the first requested label wins on overlap
    frames = sorted(
        (wanted[number], frame_index, k)
        for frame_index, (number, k) in enumerate(slice_of_frame)
        if number in wanted and k is not None
    )
    pixels = _seg_frames(seg, seg_file) if frames else None
    for index, frame_index, k in reversed(frames):
        stored = pixels[frame_index]
        mask = stored >= 0.5 * max_fraction if fractional else stored > 0
        label[:, :, k][mask.T] = index + 1
    names = {label_name: [segments[n] for n in nums] for label_name, nums in by_label.items()}
    return label, names


def read_case(image_dir: str | Path, seg_file: str | Path, labels: Sequence[str] = ("GTV-1",)) -> CaseVolumes:
    """Read a CT series and its SEG into aligned volumes (see the module docstring)."""
    ct = read_ct_series(image_dir)
    label, names = read_seg_labels(seg_file, ct, labels)
    return CaseVolumes(
        patient_id=ct.patient_id,
        image=ct.hu,
        label=label,
        affine=ct.affine_ras,
        labels=list(labels),
        segments=names,
        info={"spacing": ct.spacing, "shape": list(ct.hu.shape), "series_uid": ct.series_uid},
    )


def segment_description(
    number: int, label: str, algorithm: hd.AlgorithmIdentificationSequence | None = None
) -> hd.seg.SegmentDescription:
    """A SEG segment named ``label`` and coded in SNOMED CT, so viewers show what it is, not only its name.

    GTVs are "Morphologically abnormal structure / Neoplasm"; the organs of NSCLC-Radiomics get their organ codes;
    anything else is "Tissue". With ``algorithm`` the segment is marked AUTOMATIC (a model's output), else MANUAL.
    """
    key = normalize_name(label)
    organs = {"lungleft": codes.SCT.Lung, "lungright": codes.SCT.Lung, "heart": codes.SCT.Heart,
              "esophagus": codes.SCT.Esophagus, "spinalcord": codes.SCT.SpinalCord}  # fmt: skip
    if key.startswith("gtv"):
        category, kind = codes.SCT.MorphologicallyAbnormalStructure, codes.SCT.Neoplasm
    elif key in organs:
        category, kind = codes.SCT.Organ, organs[key]
    else:
        category, kind = codes.SCT.Tissue, codes.SCT.Tissue
    return hd.seg.SegmentDescription(
        segment_number=number,
        segment_label=label,
        segmented_property_category=category,
        segmented_property_type=kind,
        algorithm_type="AUTOMATIC" if algorithm else "MANUAL",
        algorithm_identification=algorithm,
    )


def find_seg_file(seg_dir: str | Path) -> Path:
    """The single SEG file in a case's ``seg`` folder (TciaDataset writes one file per SEG series)."""
    seg_dir = Path(seg_dir)
    if not seg_dir.is_dir():
        raise DicomCaseError(f"{seg_dir}: no seg folder; this case has no segmentation to train on.")
    files = sorted(p for p in seg_dir.iterdir() if p.is_file() and p.suffix.lower() == ".dcm")
    if not files:
        raise DicomCaseError(f"{seg_dir}: the seg folder holds no .dcm file; download the case again.")
    if len(files) > 1:
        raise DicomCaseError(f"{seg_dir}: {len(files)} SEG files found, expected one; keep the SEG to use.")
    return files[0]


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


def _read_seg(seg_file: Path) -> pydicom.Dataset:
    """The SEG's dataset, read with pydicom alone: highdicom's reader re-validates and copies every per-frame item,
    which took ~0.5 s of a 0.8 s case preparation, for nothing this module uses."""
    try:
        seg = pydicom.dcmread(seg_file)
    except Exception as err:  # pydicom raises InvalidDicomError/EOFError/ValueError/... for broken files
        raise DicomCaseError(f"{seg_file}: not a readable DICOM SEG ({err}); download the case again.") from err
    missing = [k for k in ("SegmentSequence", "PerFrameFunctionalGroupsSequence", "PixelData", "Rows") if k not in seg]
    if str(seg.get("SOPClassUID", "")) != SEG_STORAGE or missing:
        raise DicomCaseError(
            f"{seg_file}: not a readable DICOM SEG (SOP class {seg.get('SOPClassUID', 'none')}, missing "
            f"{missing or 'nothing'}); download the case again."
        )
    return seg


def _seg_frames(seg: pydicom.Dataset, seg_file: Path) -> np.ndarray:
    """All frames of the SEG, ``(frames, rows, columns)``: BINARY unpacked to 0/1, FRACTIONAL as stored."""
    try:
        pixels = seg.pixel_array
    except Exception as err:  # truncated pixel data, unsupported compression, ...
        raise DicomCaseError(f"{seg_file}: SEG pixel data cannot be decoded ({err}); download the case again.") from err
    return pixels.reshape(int(seg.get("NumberOfFrames", 1) or 1), int(seg.Rows), int(seg.Columns))


def _match_segments(available: dict[int, str], labels: Sequence[str], seg_file: Path) -> dict[str, list[int]]:
    """Map each requested label to the SEG's segment numbers (``available``: number -> label) that match it."""
    matched: dict[str, list[int]] = {}
    for name in labels:
        pattern = normalize_name(name)
        numbers = [n for n, label in available.items() if fnmatch.fnmatchcase(normalize_name(label), pattern)]
        if not numbers:
            raise DicomCaseError(
                f"{seg_file}: no segment matches label {name!r}; the SEG has {sorted(available.values())}. "
                "Without it the case cannot be used (set `labels` to a name listed here if it is spelt differently)."
            )
        matched[name] = numbers
    return matched


def _frame_slices(seg: pydicom.Dataset, ct: CtSeries, seg_file: Path) -> list[tuple[int, int | None]]:
    """For every SEG frame, its segment number and the CT slice index it belongs on.

    A frame's ``SourceImageSequence`` reference decides where it is; frames without one are placed by projecting
    their ``ImagePositionPatient`` onto the CT's slice normal.
    """
    slice_of_uid = {uid: k for k, uid in enumerate(ct.sop_instance_uids)}
    normal = ct.affine_lps[:3, 2] / np.linalg.norm(ct.affine_lps[:3, 2])
    origin = ct.affine_lps[:3, 3]
    step = float(np.linalg.norm(ct.affine_lps[:3, 2]))
    shared = seg.get("SharedFunctionalGroupsSequence", [None])[0]
    result = []
    for i, frame in enumerate(seg.PerFrameFunctionalGroupsSequence):
        number = _frame_attr(frame, shared, "SegmentIdentificationSequence", "ReferencedSegmentNumber")
        if number is None:
            raise DicomCaseError(f"{seg_file}: frame {i + 1} names no segment; the SEG is malformed.")
        k = None
        for derivation in frame.get("DerivationImageSequence", []):
            for source in derivation.get("SourceImageSequence", []):
                uid = str(source.get("ReferencedSOPInstanceUID", ""))
                if uid in slice_of_uid:
                    k = slice_of_uid[uid]
                elif uid:
                    raise DicomCaseError(
                        f"{seg_file}: frame {i + 1} references instance {uid}, which is not in the CT series "
                        f"{ct.series_uid}; the SEG belongs to another series."
                    )
        if k is None:
            position = _frame_attr(frame, shared, "PlanePositionSequence", "ImagePositionPatient")
            if position is None:
                raise DicomCaseError(f"{seg_file}: frame {i + 1} has neither a source image nor a position.")
            offset = np.asarray(position, dtype=float) - origin
            along = float(np.dot(offset, normal)) / step
            k = round(along)
            if abs(along - k) > SLICE_TOLERANCE or np.linalg.norm(offset - np.dot(offset, normal) * normal) > 1e-2:
                raise DicomCaseError(
                    f"{seg_file}: frame {i + 1} at {list(position)} mm does not lie on a CT slice; "
                    "the SEG and the CT do not share one grid."
                )
            if not 0 <= k < ct.hu.shape[2]:
                raise DicomCaseError(f"{seg_file}: frame {i + 1} lies outside the CT volume (slice {k}).")
        result.append((int(number), k))
    return result


def _frame_attr(frame, shared, sequence: str, attribute: str):
    """A functional-group attribute from the per-frame item, else from the shared one (DICOM allows either)."""
    for item in (frame, shared):
        if item is not None and sequence in item and len(item[sequence].value):
            value = item[sequence][0].get(attribute)
            if value is not None:
                return value
    return None

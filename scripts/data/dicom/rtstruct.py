"""An RTSTRUCT (RT Structure Set) -> label volume on the grid of the CT series its contours were drawn on.

NSCLC-Radiomics ships its GTVs and organs as RTSTRUCT contours (~55 ROI names across the collection: ``GTV-1``,
``gtv-2``, ``GTV_4R``, ``gtv-pre-op``, ...). :func:`read_rtstruct_labels` makes them a label source with the contract
of :func:`scripts.data.dicom.seg.read_seg_labels`:

* ROIs are matched to the requested labels by :func:`scripts.common.labels.matching` (``"GTV*"`` merges every GTV);
* every closed planar contour is placed on the CT slice it lies on, found in world millimetres (its points mapped
  through the CT's affine); a contour between two CT slices, across slices, on another frame of reference or
  referencing a CT instance other than the one it lies on is refused: the RTSTRUCT was drawn on another scan;
* the contours of one ROI on one slice are combined with the even-odd rule: a contour inside another is a hole;
* a voxel is inside a contour when its centre is (``skimage.draw.polygon``, edges included); a contour that covers
  no voxel centre still marks the voxels its outline passes through, so a sub-pixel GTV is not lost.

Input: the RTSTRUCT file and the :class:`~scripts.data.dicom.ct.CtSeries` it annotates. Output: a uint8 label volume
``[column, row, slice]`` (``i + 1`` where ``labels[i]`` is) and ``{label: [matched ROI names]}``. Problems raise
:class:`DicomCaseError` with a message that names the file and says what to do.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pydicom
from scripts.data.dicom.common import RTSTRUCT_STORAGE, DicomCaseError, match_numbers
from scripts.data.dicom.ct import SLICE_TOLERANCE, CtSeries
from skimage.draw import polygon
from skimage.measure import points_in_poly

logger = logging.getLogger(__name__)

#: contour types that enclose an area (CLOSED_PLANAR_XOR says the even-odd rule explicitly; we apply it to both)
CLOSED_TYPES = ("CLOSED_PLANAR", "CLOSED_PLANAR_XOR")
OUTLINE_STEP = 0.25  # voxels between the samples of a sub-pixel contour's outline


def is_rtstruct(path: str | Path) -> bool:
    """True when ``path`` is a readable DICOM file of the RT Structure Set Storage SOP class (only its header is
    read); False for anything else, unreadable files included."""
    try:
        ds = pydicom.dcmread(path, stop_before_pixels=True, specific_tags=["SOPClassUID"])
    except Exception:  # not DICOM, truncated, a folder, ...: simply not an RTSTRUCT
        return False
    return str(ds.get("SOPClassUID", "")) == RTSTRUCT_STORAGE


def read_rtstruct_labels(rtstruct_file: str | Path, ct: CtSeries, labels: Sequence[str]) -> tuple[np.ndarray, dict]:
    """Rasterise the ROIs of ``rtstruct_file`` that match ``labels`` onto the grid of ``ct``.

    Returns the label volume (uint8, ``i + 1`` where ``labels[i]`` is present; earlier labels win where ROIs overlap,
    so a tumour inside a lung stays tumour) and ``{label: [matched ROI names]}``.
    """
    rtstruct_file = Path(rtstruct_file)
    ds = _read_rtstruct(rtstruct_file)
    _check_series(ds, ct, rtstruct_file)
    rois = {int(item.ROINumber): item for item in ds.StructureSetROISequence}
    names = {number: str(item.get("ROIName", "")) for number, item in rois.items()}
    by_label = match_numbers(names, labels, rtstruct_file, "ROI", "RTSTRUCT")
    wanted: dict[int, int] = {}  # ROI number -> label index; the first label that matches an ROI keeps it
    for index, numbers in enumerate(by_label.values()):
        for number in numbers:
            wanted.setdefault(number, index)
    for number in wanted:
        _check_frame_of_reference(rois[number], ct, rtstruct_file)
    contours = {int(item.ReferencedROINumber): item.get("ContourSequence", []) for item in ds.ROIContourSequence}

    label = np.zeros(ct.hu.shape, dtype=np.uint8, order="F")  # slices contiguous, like the CT
    # paint higher label indices first so that the first requested label wins on overlap
    for number, index in sorted(wanted.items(), key=lambda item: -item[1]):
        slices = _roi_slices(contours.get(number, []), ct, rtstruct_file, names[number])
        if not slices:
            logger.warning("%s: ROI %r has no closed contour; label %r is empty there.", rtstruct_file,
                           names[number], list(by_label)[index])  # fmt: skip
        for k, mask in slices.items():
            label[:, :, k][mask] = index + 1
    return label, {name: [names[n] for n in numbers] for name, numbers in by_label.items()}


def _read_rtstruct(path: Path) -> pydicom.Dataset:
    """The RTSTRUCT's dataset, or :class:`DicomCaseError` when the file is not a readable RT Structure Set."""
    try:
        ds = pydicom.dcmread(path)
    except Exception as err:  # pydicom raises InvalidDicomError/EOFError/ValueError/... for broken files
        raise DicomCaseError(f"{path}: not a readable DICOM RTSTRUCT ({err}); download the case again.") from err
    missing = [k for k in ("StructureSetROISequence", "ROIContourSequence") if k not in ds]
    if not missing:  # a truncated file reads as far as it goes: check the items this reader relies on
        rois = enumerate(ds.StructureSetROISequence, 1)
        missing += [f"ROINumber of ROI {i}" for i, x in rois if "ROINumber" not in x]
        missing += [f"ReferencedROINumber of contour set {i}" for i, x in enumerate(ds.ROIContourSequence, 1)
                    if "ReferencedROINumber" not in x]  # fmt: skip
    if str(ds.get("SOPClassUID", "")) != RTSTRUCT_STORAGE or missing:
        raise DicomCaseError(
            f"{path}: not a readable DICOM RTSTRUCT (SOP class {ds.get('SOPClassUID', 'none')}, missing "
            f"{missing or 'nothing'}); download the case again."
        )
    return ds


def _check_series(ds: pydicom.Dataset, ct: CtSeries, path: Path) -> None:
    """The RTSTRUCT's referenced series (when it names any) must include the CT series."""
    referenced = {
        str(series.get("SeriesInstanceUID", ""))
        for frame in ds.get("ReferencedFrameOfReferenceSequence", [])
        for study in frame.get("RTReferencedStudySequence", [])
        for series in study.get("RTReferencedSeriesSequence", [])
    } - {""}
    if referenced and ct.series_uid and ct.series_uid not in referenced:
        raise DicomCaseError(
            f"{path}: references series {sorted(referenced)}, not the CT series {ct.series_uid} in "
            f"{ct.files[0].parent}; download the CT series the RTSTRUCT references."
        )


def _check_frame_of_reference(roi: pydicom.Dataset, ct: CtSeries, path: Path) -> None:
    """An ROI drawn in another frame of reference than the CT's cannot be placed on it."""
    roi_for = str(roi.get("ReferencedFrameOfReferenceUID", ""))
    if ct.frame_of_reference_uid and roi_for and roi_for != ct.frame_of_reference_uid:
        raise DicomCaseError(
            f"{path}: ROI {roi.get('ROIName', '')!r} references FrameOfReferenceUID {roi_for}, the CT's is "
            f"{ct.frame_of_reference_uid}; it was drawn on another scan. Check that rtstruct/ and image/ belong to "
            "the same study."
        )


def _roi_slices(contours: Sequence[pydicom.Dataset], ct: CtSeries, path: Path, roi: str) -> dict[int, np.ndarray]:
    """The ROI's in-plane masks ``[column, row]`` by CT slice index, from its closed contours (even-odd per slice)."""
    world_to_voxel = np.linalg.inv(ct.affine_lps)
    slice_of_uid = {uid: k for k, uid in enumerate(ct.sop_instance_uids)}
    by_slice: dict[int, list[np.ndarray]] = {}
    skipped = set()
    for n, contour in enumerate(contours, start=1):
        kind = str(contour.get("ContourGeometricType", ""))
        if kind not in CLOSED_TYPES:
            skipped.add(kind)
            continue
        data = _contour_data(contour, path, roi, n)
        if data.size == 0 or data.size % 3:
            raise DicomCaseError(
                f"{path}: ROI {roi!r} contour {n} has {data.size} coordinates, not (x, y, z) triplets; the RTSTRUCT "
                "is malformed. Export it again."
            )
        ijk = data.reshape(-1, 3) @ world_to_voxel[:3, :3].T + world_to_voxel[:3, 3]
        k = _contour_slice(ijk[:, 2], ct, path, roi, n)
        for image in contour.get("ContourImageSequence", []):
            uid = str(image.get("ReferencedSOPInstanceUID", ""))
            if uid and slice_of_uid.get(uid) != k:
                where = f"slice {slice_of_uid[uid]}" if uid in slice_of_uid else "an instance not in the CT series"
                raise DicomCaseError(
                    f"{path}: ROI {roi!r} contour {n} lies on CT slice {k} but references {where} ({uid}); the "
                    "RTSTRUCT belongs to another series. Use the RTSTRUCT drawn on this CT."
                )
        by_slice.setdefault(k, []).append(ijk[:, :2])
    if skipped:
        logger.warning("%s: ROI %r: %s contours carry no area and are ignored.", path, roi, sorted(skipped))
    return {k: _fill_slice(polygons, ct.hu.shape[:2]) for k, polygons in by_slice.items()}


def _contour_data(contour: pydicom.Dataset, path: Path, roi: str, n: int) -> np.ndarray:
    """A contour's Contour Data as numbers. Stored as UN (an Explicit VR file whose value outgrew the 65,534 bytes of a
    DS length, PS3.5 6.2.2), pydicom hands it over as bytes: they are the DS text, decoded here; anything else raises
    :class:`DicomCaseError` naming the file."""
    value = contour.get("ContourData", [])
    if not isinstance(value, bytes):
        return np.asarray(value, dtype=float)
    text = value.strip(b" \0")
    try:
        return np.array(text.decode("ascii").split("\\"), dtype=float) if text else np.zeros(0)
    except ValueError as err:  # UnicodeDecodeError is one
        raise DicomCaseError(
            f"{path}: ROI {roi!r} contour {n}: its Contour Data, stored as UN ({len(value)} bytes), is not decimal "
            f"numbers separated by backslashes ({str(err)[:80]}); the RTSTRUCT is malformed. Export it again."
        ) from err


def _contour_slice(k: np.ndarray, ct: CtSeries, path: Path, roi: str, n: int) -> int:
    """The CT slice index a contour lies on (its points' fractional slice indices ``k``), or :class:`DicomCaseError`
    for a contour between slices, across slices or outside the volume."""
    nearest = round(float(np.median(k)))
    step = float(np.linalg.norm(ct.affine_lps[:3, 2]))
    if np.abs(k - nearest).max() > SLICE_TOLERANCE:
        origin = float(np.dot(ct.affine_lps[:3, 3], ct.affine_lps[:3, 2] / step))
        where = ", ".join(f"{origin + v * step:.2f}" for v in (k.min(), k.max()))
        low = int(np.floor(k.min()))
        raise DicomCaseError(
            f"{path}: ROI {roi!r} contour {n} lies at {where} mm along the slice normal, not on a CT slice (slices "
            f"{low} and {low + 1} are at {origin + low * step:.2f} and {origin + (low + 1) * step:.2f} mm, "
            f"{step:.2f} mm apart); it was drawn on another slice spacing. Use the RTSTRUCT drawn on this CT."
        )
    if not 0 <= nearest < ct.hu.shape[2]:
        raise DicomCaseError(
            f"{path}: ROI {roi!r} contour {n} lies outside the CT volume (slice {nearest} of {ct.hu.shape[2]}); the "
            "RTSTRUCT belongs to another series."
        )
    return nearest


def _fill_slice(polygons: list[np.ndarray], shape: tuple[int, int]) -> np.ndarray:
    """The even-odd fill of one slice's contours (``(N, 2)`` column/row voxel coordinates each) as a ``shape`` mask.

    A voxel is inside a contour when its centre is (edges included). A contour that covers no voxel centre and is
    not a hole (inside an even number of the others) marks the voxels its outline passes through instead.
    """
    mask = np.zeros(shape, dtype=bool)
    tiny = []
    for index, points in enumerate(polygons):
        ii, jj = polygon(points[:, 0], points[:, 1], shape)
        if ii.size:
            mask[ii, jj] ^= True
        else:
            tiny.append(index)
    for index in tiny:
        first = polygons[index][:1]
        depth = sum(
            bool(points_in_poly(first, other)[0]) for i, other in enumerate(polygons) if i != index and len(other) > 2
        )
        if depth % 2 == 0:
            ii, jj = _outline_voxels(polygons[index], shape)
            mask[ii, jj] = True
    return mask


def _outline_voxels(points: np.ndarray, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Indices of the voxels that a closed outline (or a single point) passes through, inside ``shape``."""
    closed = np.vstack([points, points[:1]])
    samples = [points]
    for start, end in itertools.pairwise(closed):
        count = int(np.ceil(np.linalg.norm(end - start) / OUTLINE_STEP)) + 1
        samples.append(start + np.linspace(0.0, 1.0, count)[:, None] * (end - start))
    voxels = np.unique(np.rint(np.vstack(samples)).astype(int), axis=0)
    inside = (voxels >= 0).all(1) & (voxels[:, 0] < shape[0]) & (voxels[:, 1] < shape[1])
    return voxels[inside, 0], voxels[inside, 1]

"""A predicted label map as a DICOM RTSTRUCT (RT Structure Set), so a treatment planning system can load the
structures as contours on the CT they were predicted from.

Input: the label map ``[X, Y, Z]`` (uint8, ``i`` = ``names[i - 1]``) on the slices of the CT series in ``image_dir``
as acquired (``Z`` = its number of slices, also when they are unevenly spaced or tilted).
Output: one RTSTRUCT file with

* one ROI per structure (an empty structure keeps its ROI, with no contour), coloured, coded in SNOMED CT like the SEG
  segments (:func:`scripts.dicom.segment_description`), RT ROI Interpreted Type GTV / ORGAN / CONTROL, and ROI
  Generation Algorithm AUTOMATIC with this bundle's name and version;
* closed planar contours per CT slice, each referencing that slice's SOP Instance UID, in the CT's frame of
  reference, study and patient; a structure's holes are separate contours (the even-odd rule readers apply);
* contours traced at sub-voxel precision (``skimage.measure.find_contours`` at level 0.5: the outline runs halfway
  between voxel centres inside and outside, so a reader that fills voxel centres gets the mask back exactly),
  placed in world mm through each slice's own ImagePositionPatient and the series' orientation and pixel spacing.

The file is written atomically (:func:`scripts.files.replace_atomically`) and approved as nothing: ApprovalStatus
UNAPPROVED, a model's proposal for a person to review.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Sequence
from pathlib import Path

import highdicom as hd
import numpy as np
import pydicom
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.sr.codedict import codes
from pydicom.uid import ExplicitVRLittleEndian
from scripts.dicom import RTSTRUCT_STORAGE, ScannedSeries, SeriesSource, scan_ct_series, segment_description
from scripts.files import replace_atomically
from scripts.labels import normalize_name
from scripts.writers.seg import ALGORITHM_NAME, MANUFACTURER, PATIENT_STUDY_TYPE_2, algorithm_identification
from skimage.measure import find_contours

logger = logging.getLogger(__name__)

#: ROI colours (RGB) by normalised structure name; other structures take FALLBACK_COLOURS in turn
COLOURS = {"lungleft": (0, 120, 255), "lungright": (0, 200, 255), "heart": (255, 0, 255),
           "esophagus": (255, 170, 0), "spinalcord": (255, 255, 0)}  # fmt: skip
GTV_COLOUR = (255, 0, 0)
FALLBACK_COLOURS = ((0, 255, 0), (0, 255, 255), (255, 128, 128), (160, 80, 255), (255, 128, 0))
#: Detached Study Management SOP class, which RTReferencedStudySequence items name (as every RTSTRUCT writer does)
STUDY_REFERENCE_CLASS = "1.2.840.10008.3.1.2.3.1"
SERIES_NUMBER_OFFSET = 9100  # the SEG takes the CT's series number + 9000


def write_rtstruct(
    labels: np.ndarray,
    image_dir: SeriesSource | ScannedSeries,
    names: Sequence[str],
    path: str | Path,
    algorithm_version: str,
) -> pydicom.Dataset:
    """An RTSTRUCT of the label map ``labels`` [X, Y, Z] (on the slices of the series in ``image_dir``), ROI ``i`` =
    ``names[i - 1]``, written atomically to ``path`` and returned. ``image_dir``: the series' folder or files, or its
    :class:`~scripts.dicom.ScannedSeries`."""
    headers, _ = scan_ct_series(image_dir, resample=True)  # every slice as acquired, whatever its spacing
    slices = [ds for _, ds in headers]
    labels = np.asarray(labels)
    if labels.shape != (int(slices[0].Columns), int(slices[0].Rows), len(slices)):
        raise ValueError(f"{headers[0][0].parent}: prediction shape {labels.shape} does not match the series' grid.")
    if labels.size and int(labels.max()) > len(names):
        raise ValueError(f"{path}: the label map holds label {int(labels.max())} but only {len(names)} names.")
    ds = _structure_set(slices, algorithm_version)
    for number, name in enumerate(names, start=1):
        contours = [(ct, line) for k, ct in enumerate(slices) for line in _slice_contours(labels[:, :, k], number, ct)]
        if not contours:
            logger.warning("%s: structure %r is empty; its ROI is written without a contour.", path, name)
        _add_roi(ds, number, name, contours, slices[0].FrameOfReferenceUID, algorithm_version)
    replace_atomically(path, lambda tmp: ds.save_as(tmp, enforce_file_format=True))
    return ds


def _slice_contours(plane: np.ndarray, number: int, ct: Dataset) -> list[np.ndarray]:
    """The outlines (``(N, 3)`` LPS mm, not closed by a repeated point) of label ``number`` in ``plane`` [column, row],
    the CT slice ``ct``: outer boundaries and holes alike, traced halfway between inside and outside voxel centres."""
    mask = plane == number
    if not mask.any():
        return []
    columns, rows = np.nonzero(mask)
    i0, j0 = columns.min(), rows.min()
    crop = np.pad(mask[i0 : columns.max() + 1, j0 : rows.max() + 1], 1).astype(np.float32)  # padded: all closed
    iop = np.asarray(ct.ImageOrientationPatient, dtype=float)
    row_spacing, column_spacing = (float(v) for v in ct.PixelSpacing)
    origin = np.asarray(ct.ImagePositionPatient, dtype=float)
    outlines = []
    for traced in find_contours(crop, 0.5):
        ij = _corners(traced[:-1]) + np.array([i0 - 1, j0 - 1])  # traced[-1] repeats traced[0]
        world = origin + np.outer(ij[:, 0] * column_spacing, iop[:3]) + np.outer(ij[:, 1] * row_spacing, iop[3:])
        outlines.append(world)
    return outlines


def _corners(points: np.ndarray) -> np.ndarray:
    """The points of a closed outline where it turns: the traced staircase has long runs of collinear points, which
    add bytes and no shape (exactly collinear, so dropping them leaves the polygon as it was)."""
    before, after = points - np.roll(points, 1, axis=0), np.roll(points, -1, axis=0) - points
    turns = np.abs(before[:, 0] * after[:, 1] - before[:, 1] * after[:, 0]) > 1e-9
    return points[turns] if turns.sum() >= 3 else points


def _structure_set(slices: list[Dataset], algorithm_version: str) -> Dataset:
    """The RT Structure Set without ROIs: patient, study, frame of reference and the CT instances it references."""
    ct = slices[0]
    now = datetime.datetime.now()
    ds = Dataset()
    ds.file_meta = FileMetaDataset()
    ds.file_meta.MediaStorageSOPClassUID = ds.SOPClassUID = RTSTRUCT_STORAGE
    ds.file_meta.MediaStorageSOPInstanceUID = ds.SOPInstanceUID = hd.UID()
    ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds.SpecificCharacterSet = ct.get("SpecificCharacterSet", "ISO_IR 100")
    ds.InstanceCreationDate, ds.InstanceCreationTime = now.strftime("%Y%m%d"), now.strftime("%H%M%S")
    for key in ("StudyInstanceUID", *PATIENT_STUDY_TYPE_2):
        setattr(ds, key, ct.get(key, ""))
    ds.FrameOfReferenceUID = ct.FrameOfReferenceUID
    ds.Modality, ds.SeriesInstanceUID = "RTSTRUCT", hd.UID()
    ds.SeriesNumber = int(ct.get("SeriesNumber", 0) or 0) + SERIES_NUMBER_OFFSET
    ds.SeriesDescription, ds.OperatorsName = f"{ALGORITHM_NAME} structures", ""
    ds.SeriesDate, ds.SeriesTime = ds.InstanceCreationDate, ds.InstanceCreationTime
    ds.Manufacturer, ds.ManufacturerModelName = MANUFACTURER, ALGORITHM_NAME
    ds.SoftwareVersions, ds.InstanceNumber = str(algorithm_version), 1
    ds.StructureSetLabel, ds.StructureSetName = "AI contours", f"{ALGORITHM_NAME} {algorithm_version}"[:64]
    ds.StructureSetDate, ds.StructureSetTime = ds.InstanceCreationDate, ds.InstanceCreationTime
    series = Dataset()
    series.SeriesInstanceUID, series.ContourImageSequence = ct.SeriesInstanceUID, [_image(s) for s in slices]
    study = Dataset()
    study.ReferencedSOPClassUID, study.ReferencedSOPInstanceUID = STUDY_REFERENCE_CLASS, ct.StudyInstanceUID
    study.RTReferencedSeriesSequence = [series]
    frame = Dataset()
    frame.FrameOfReferenceUID, frame.RTReferencedStudySequence = ct.FrameOfReferenceUID, [study]
    ds.ReferencedFrameOfReferenceSequence = [frame]
    ds.StructureSetROISequence, ds.ROIContourSequence, ds.RTROIObservationsSequence = [], [], []
    ds.ApprovalStatus = "UNAPPROVED"
    return ds


def _add_roi(ds: Dataset, number: int, name: str, contours: list, frame_uid: str, algorithm_version: str) -> None:
    """ROI ``number`` named ``name`` with its contours ((CT slice, (N, 3) LPS points) pairs), its colour, codes and
    interpreted type, in the three sequences of the structure set."""
    description = segment_description(number, name)
    roi = Dataset()
    roi.ROINumber, roi.ReferencedFrameOfReferenceUID, roi.ROIName = number, frame_uid, name
    roi.ROIGenerationAlgorithm = "AUTOMATIC"
    roi.ROIGenerationDescription = f"{ALGORITHM_NAME} {algorithm_version}"[:64]
    roi.ROIDerivationAlgorithmIdentificationSequence = algorithm_identification(algorithm_version)
    ds.StructureSetROISequence.append(roi)
    roi_contour = Dataset()
    roi_contour.ReferencedROINumber, roi_contour.ROIDisplayColor = number, list(_colour(name, number))
    if contours:
        roi_contour.ContourSequence = [_contour(n, ct, points) for n, (ct, points) in enumerate(contours, start=1)]
    ds.ROIContourSequence.append(roi_contour)
    observation = Dataset()
    observation.ObservationNumber, observation.ReferencedROINumber = number, number
    observation.RTROIInterpretedType, observation.ROIInterpreter = _interpreted_type(description), ""
    observation.RTROIIdentificationCodeSequence = description.SegmentedPropertyTypeCodeSequence
    ds.RTROIObservationsSequence.append(observation)


def _contour(number: int, ct: Dataset, points: np.ndarray) -> Dataset:
    """One CLOSED_PLANAR contour on the CT slice ``ct``; coordinates rounded to 0.1 micrometre (short DS strings)."""
    item = Dataset()
    item.ContourNumber, item.ContourImageSequence = number, [_image(ct)]
    item.ContourGeometricType, item.NumberOfContourPoints = "CLOSED_PLANAR", len(points)
    item.ContourData = [round(float(v), 4) + 0.0 for v in points.ravel()]  # + 0.0: no "-0.0"
    return item


def _image(ct: Dataset) -> Dataset:
    item = Dataset()
    item.ReferencedSOPClassUID, item.ReferencedSOPInstanceUID = ct.SOPClassUID, ct.SOPInstanceUID
    return item


def _interpreted_type(description: hd.seg.SegmentDescription) -> str:
    """RT ROI Interpreted Type from the structure's SNOMED category: a neoplasm is a GTV, an organ an ORGAN, anything
    else a CONTROL structure."""
    category = description.SegmentedPropertyCategoryCodeSequence[0].CodeValue
    if category == codes.SCT.MorphologicallyAbnormalStructure.value:
        return "GTV"
    return "ORGAN" if category == codes.SCT.Organ.value else "CONTROL"


def _colour(name: str, number: int) -> tuple[int, int, int]:
    key = normalize_name(name)
    if key.startswith("gtv"):
        return GTV_COLOUR
    return COLOURS.get(key, FALLBACK_COLOURS[(number - 1) % len(FALLBACK_COLOURS)])

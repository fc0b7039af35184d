"""A predicted label map as a DICOM RTSTRUCT (RT Structure Set), so a treatment planning system can load the
structures as contours on the CT they were predicted from.

Input: the label map ``[X, Y, Z]`` (uint8, ``i`` = ``names[i - 1]``) on the slices of the CT series in ``image_dir``
as acquired (``Z`` = its number of slices, also when they are unevenly spaced or tilted).
Output: one RTSTRUCT file with

* one ROI per structure (an empty structure keeps its ROI, with no contour), coloured, coded in SNOMED CT like the SEG
  segments (:func:`scripts.data.dicom.segment_description`), RT ROI Interpreted Type GTV / ORGAN / CONTROL, and ROI
  Generation Algorithm AUTOMATIC with this bundle's name and version;
* closed planar contours per CT slice, each referencing that slice's SOP Instance UID, in the CT's frame of
  reference, study and patient; a structure's holes are separate contours (the even-odd rule readers apply);
* contours traced at sub-voxel precision (:func:`scripts.inference.contours.outlines`, marching squares at level 0.5 as
  ``skimage.measure.find_contours`` traces them: the outline runs halfway between voxel centres inside and outside,
  so a reader that fills voxel centres gets the mask back exactly), placed in world mm through each slice's own
  ImagePositionPatient and the series' orientation and pixel spacing.

The work is linear in the voxels and the contours' length, whatever the label map (a wrong prediction's whole thorax
with holes has hundreds of thousands of contours): the contours are traced, placed and written as text for all
slices at once, and the ROI Contour Sequence is encoded directly rather than as a pydicom dataset per contour, which
cost ~0.3 ms each. The file is written atomically (:func:`scripts.common.files.replace_atomically`) and approved as
nothing: ApprovalStatus UNAPPROVED, a model's proposal for a person to review.

The file is in Implicit VR Little Endian (1.2.840.10008.1.2), the transfer syntax every DICOM implementation shall
support (PS3.5 10.1), whose value lengths are 32-bit: a contour's Contour Data (DS) of a few thousand points (a large
tumour; a wrong prediction's thorax) outgrows the 65,534 bytes an Explicit VR DS length can say, and Explicit VR could
then only call it UN (PS3.5 6.2.2), which pydicom (``replace_un_with_known_vr`` stops at 0xFFFF bytes), DCMTK
(``--retain-un`` by default) and rt-utils hand back as bytes, not numbers. One encoding for every file: what a
planning system is tested with is what a flagged prediction brings it.
"""

from __future__ import annotations

import datetime
import logging
import struct
from collections.abc import Sequence
from pathlib import Path

import highdicom as hd
import numpy as np
import pydicom
from pydicom.charset import convert_encodings
from pydicom.dataelem import RawDataElement
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.sr.codedict import codes
from pydicom.uid import ImplicitVRLittleEndian
from scripts.common.files import replace_atomically
from scripts.common.labels import normalize_name
from scripts.data.dicom import RTSTRUCT_STORAGE, ScannedSeries, SeriesSource, scan_ct_series, segment_description
from scripts.data.dicom.identity import ALGORITHM_NAME, MANUFACTURER, algorithm_identification
from scripts.inference.contours import outlines
from scripts.inference.writers.seg import PATIENT_STUDY_TYPE_2

logger = logging.getLogger(__name__)

#: ROI colours (RGB) by normalised structure name; other structures take FALLBACK_COLOURS in turn
COLOURS = {"lungleft": (0, 120, 255), "lungright": (0, 200, 255), "heart": (255, 0, 255),
           "esophagus": (255, 170, 0), "spinalcord": (255, 255, 0)}  # fmt: skip
GTV_COLOUR = (255, 0, 0)
FALLBACK_COLOURS = ((0, 255, 0), (0, 255, 255), (255, 128, 128), (160, 80, 255), (255, 128, 0))
#: Detached Study Management SOP class, which RTReferencedStudySequence items name (as every RTSTRUCT writer does)
STUDY_REFERENCE_CLASS = "1.2.840.10008.3.1.2.3.1"
SERIES_NUMBER_OFFSET = 9100  # the SEG takes the CT's series number + 9000
ROI_CONTOUR_SEQUENCE = 0x30060039


def write_rtstruct(
    labels: np.ndarray,
    image_dir: SeriesSource | ScannedSeries,
    names: Sequence[str],
    path: str | Path,
    algorithm_version: str,
) -> pydicom.Dataset:
    """An RTSTRUCT of the label map ``labels`` [X, Y, Z] (on the slices of the series in ``image_dir``), ROI ``i`` =
    ``names[i - 1]``, written atomically to ``path`` and returned. ``image_dir``: the series' folder or files, or its
    :class:`~scripts.data.dicom.ScannedSeries`."""
    headers, _ = scan_ct_series(image_dir, resample=True)  # every slice as acquired, whatever its spacing
    slices = [ds for _, ds in headers]
    labels = np.asarray(labels)
    if labels.shape != (int(slices[0].Columns), int(slices[0].Rows), len(slices)):
        raise ValueError(f"{headers[0][0].parent}: prediction shape {labels.shape} does not match the series' grid.")
    if labels.size and int(labels.max()) > len(names):
        raise ValueError(f"{path}: the label map holds label {int(labels.max())} but only {len(names)} names.")
    ds = _structure_set(slices, algorithm_version)
    places = _slice_places(slices)
    references = [_image_sequence(ct) for ct in slices]
    roi_contours = []
    for number, name in enumerate(names, start=1):
        points, planes, starts = outlines(labels == number, axis=2)
        if len(starts) == 1:
            logger.warning("%s: structure %r is empty; its ROI is written without a contour.", path, name)
        _add_roi(ds, number, name, slices[0].FrameOfReferenceUID, algorithm_version)
        roi_contours.append(_roi_contour(number, name, *_corners(points, planes, starts), places, references))
    value = b"".join(roi_contours)
    ds[ROI_CONTOUR_SEQUENCE] = RawDataElement(ROI_CONTOUR_SEQUENCE, "SQ", len(value), value, 0, True, True, True,
                                              False)  # fmt: skip
    # the encoding the file is written in: pydicom writes the raw sequence as it is instead of parsing it to check
    ds.set_original_encoding(True, True, convert_encodings(ds.SpecificCharacterSet))
    replace_atomically(path, lambda tmp: ds.save_as(tmp, enforce_file_format=True))
    return ds


def _corners(points: np.ndarray, planes: np.ndarray, starts: np.ndarray) -> tuple:
    """The points of each closed outline where it turns (``outlines``' ``points``, ``planes``, ``starts``): the traced
    staircase has long runs of collinear points, which add bytes and no shape (exactly collinear, so dropping them
    leaves the polygon as it was); an outline with fewer than three turns keeps all."""
    lengths = np.diff(starts)
    outline = np.repeat(np.arange(len(lengths)), lengths)
    first, length, index = starts[:-1][outline], lengths[outline], np.arange(len(points))
    before = points - points[first + (index - first - 1) % length]
    after = points[first + (index - first + 1) % length] - points
    turns = np.abs(before[:, 0] * after[:, 1] - before[:, 1] * after[:, 0]) > 1e-9
    keep = turns | (np.bincount(outline, weights=turns, minlength=len(lengths)) < 3)[outline]
    kept = np.concatenate([[0], np.cumsum(np.bincount(outline[keep], minlength=len(lengths)))])
    return points[keep], planes[keep], kept


def _slice_places(slices: list[Dataset]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each slice's ImagePositionPatient and its steps in mm along a column index and a row index (LPS)."""
    origin = np.array([[float(v) for v in ct.ImagePositionPatient] for ct in slices])
    orientation = np.array([[float(v) for v in ct.ImageOrientationPatient] for ct in slices])
    spacing = np.array([[float(v) for v in ct.PixelSpacing] for ct in slices])  # row spacing, column spacing
    return origin, orientation[:, :3] * spacing[:, 1:], orientation[:, 3:] * spacing[:, :1]


def _roi_contour(number: int, name: str, points, planes, starts, places, references: list[bytes]) -> bytes:
    """One item of the ROI Contour Sequence, encoded: the ROI's colour, its CLOSED_PLANAR contours (``points`` (N, 2)
    column and row indices on slices ``planes``, outline ``j`` from ``starts[j]``) and its number."""
    colour = "\\".join(str(v) for v in _colour(name, number)).encode()
    contours = _contour_items(points, planes, starts, places, references) if len(starts) > 1 else b""
    sequence = _element(0x30060040, "SQ", contours) if contours else b""
    return _item(_element(0x3006002A, "IS", colour) + sequence + _element(0x30060084, "IS", str(number).encode()))


def _contour_items(points, planes, starts, places, references: list[bytes]) -> bytes:
    """The items of a Contour Sequence, encoded for all contours at once: each is its CT slice's Contour Image
    Sequence, CLOSED_PLANAR, its number of points, its number (1, 2, ...) and its points in world mm to 0.1
    micrometre. Each item's head is assembled as a row of a character matrix with the characters that count marked
    (blocks of (characters, which count, how many count)), the contour data as text runs (:func:`_runs`); heads and
    runs are then laid out one after the other."""
    origin, along_column, along_row = places
    world = origin[planes] + points[:, :1] * along_column[planes] + points[:, 1:] * along_row[planes]
    data, data_ends = _runs(world.ravel(), 4, 3 * starts)
    data_length = np.diff(data_ends, prepend=0)
    count, plane = len(starts) - 1, planes[starts[:-1]]
    lengths = np.array([len(r) for r in references])
    reference = np.zeros((len(references), lengths.max()), np.uint8)
    reference_keep = np.arange(lengths.max()) < lengths[:, None]
    reference[reference_keep] = np.frombuffer(b"".join(references), np.uint8)
    blocks = [(reference[plane], reference_keep[plane], lengths[plane]),
              _constant(_element(0x30060042, "CS", b"CLOSED_PLANAR"), count)]  # fmt: skip
    for tag, value in ((0x30060046, np.diff(starts)), (0x30060048, np.arange(1, count + 1))):
        text = _even(*_decimal_text(value, 0))
        blocks += [_header(tag, text[2]), text]
    blocks.append(_header(0x30060050, data_length))  # DS of any length: Implicit VR's lengths are 32-bit
    item_length = sum(block[2] for block in blocks) + data_length
    start = np.hstack([_constant(struct.pack("<HH", 0xFFFE, 0xE000), count)[0], _little(item_length, 4)])
    blocks.insert(0, (start, np.ones((count, 8), bool), np.full(count, 8)))
    chars, keep = np.hstack([b[0] for b in blocks]), np.hstack([b[1] for b in blocks])
    return _interleave(chars[keep].tobytes(), np.cumsum(sum(b[2] for b in blocks)), data, data_ends)


def _decimal_text(values: np.ndarray, places: int, spare: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``values`` as decimal text rounded to ``places`` decimals, trailing zeros dropped (``-12.5``, ``100``,
    ``0.0003``): a character matrix, one row per value, with ``spare`` empty columns at the end, which of its
    characters count, and how many. The digits come from tables of every whole part and every decimal part."""
    scaled = np.rint(np.asarray(values, float) * 10**places).astype(np.int64)
    whole, fraction = np.divmod(np.abs(scaled), 10**places)
    digits = len(str(int(whole.max()))) if whole.size else 1
    width = 1 + digits + (1 + places if places else 0)
    chars, keep = np.zeros((len(scaled), width + spare), np.uint8), np.zeros((len(scaled), width + spare), bool)
    chars[:, 0], keep[:, 0] = ord("-"), scaled < 0
    text, used = _digit_table(digits)
    used = used[whole]
    chars[:, 1 : 1 + digits], keep[:, 1 : 1 + digits] = text[whole], np.arange(digits) >= digits - used[:, None]
    length = keep[:, 0] + used
    if places:
        text, _ = _digit_table(places)
        zeros = sum((np.arange(10**places) % 10**d == 0).astype(int) for d in range(1, places + 1))
        shown = np.where(np.arange(10**places) == 0, 0, places - np.minimum(zeros, places))[fraction]  # to the last
        chars[:, digits + 1], keep[:, digits + 1] = ord("."), shown > 0  # non-zero decimal
        chars[:, digits + 2 : width] = text[fraction]
        keep[:, digits + 2 : width] = np.arange(places) < shown[:, None]
        length += np.where(shown > 0, shown + 1, 0)
    return chars, keep, length


def _digit_table(digits: int) -> tuple[np.ndarray, np.ndarray]:
    """Every number below ``10**digits`` as ``digits`` characters with leading zeros, and how many digits it uses."""
    numbers = np.arange(10**digits)
    text = np.stack([ord("0") + (numbers // 10 ** (digits - 1 - d)) % 10 for d in range(digits)], axis=1)
    used = np.ones(len(numbers), int) + sum((numbers >= 10**d).astype(int) for d in range(1, digits))
    return text.astype(np.uint8), used


def _runs(values: np.ndarray, places: int, bounds: np.ndarray) -> tuple[bytes, np.ndarray]:
    """``values`` as :func:`_decimal_text` in runs ``bounds[j]:bounds[j + 1]``, ``\\``-separated within a run and
    each run padded to an even length with a space: all runs' bytes and each run's end in them."""
    chars, keep, length = _decimal_text(values, places, spare=1)
    last = np.asarray(bounds[1:]) - 1
    chars[:, -1], keep[:, -1] = ord("\\"), True
    keep[last, -1] = False
    run = np.add.reduceat(length, np.asarray(bounds[:-1])) + np.diff(bounds) - 1  # values and separators
    chars[last, -1], keep[last, -1] = ord(" "), run % 2 == 1
    return chars[keep].tobytes(), np.cumsum(run + run % 2)


def _even(chars: np.ndarray, keep: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Text rows padded to an even length with a space."""
    pad = np.full((len(chars), 1), ord(" "), np.uint8)
    return np.hstack([chars, pad]), np.hstack([keep, (length % 2 == 1)[:, None]]), length + length % 2


def _header(tag: int, length: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Implicit VR element headers (tag, 4-byte length) for values of ``length`` bytes, one row each."""
    rows = len(length)
    chars = np.hstack([_constant(struct.pack("<HH", tag >> 16, tag & 0xFFFF), rows)[0], _little(length, 4)])
    return chars, np.ones((rows, 8), bool), np.full(rows, 8)


def _constant(value: bytes, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The same bytes on every row."""
    return (
        np.tile(np.frombuffer(value, np.uint8), (rows, 1)),
        np.ones((rows, len(value)), bool),
        np.full(rows, len(value)),
    )


def _little(values: np.ndarray, size: int) -> np.ndarray:
    """Unsigned little-endian integers, ``size`` bytes each, one row per value."""
    return np.asarray(values, f"<u{size}").view(np.uint8).reshape(-1, size)


def _interleave(heads: bytes, head_ends: np.ndarray, tails: bytes, tail_ends: np.ndarray) -> bytes:
    """Head 0, tail 0, head 1, tail 1, ...: pieces of ``heads`` and of ``tails`` (each the pieces one after the
    other, ending at the given offsets) laid out alternately."""
    pieces = [b""] * (2 * len(head_ends))
    head_starts, tail_starts = [0, *head_ends[:-1].tolist()], [0, *tail_ends[:-1].tolist()]
    pieces[0::2] = [heads[a:b] for a, b in zip(head_starts, head_ends.tolist(), strict=True)]
    pieces[1::2] = [tails[a:b] for a, b in zip(tail_starts, tail_ends.tolist(), strict=True)]
    return b"".join(pieces)


def _element(tag: int, vr: str, value: bytes) -> bytes:
    """A data element in Implicit VR Little Endian (the VR is not written; it says how the value is padded to an
    even length: UIDs with NUL, text with a space)."""
    if len(value) % 2:
        value += b"\0" if vr == "UI" else b" "
    return struct.pack("<HHI", tag >> 16, tag & 0xFFFF, len(value)) + value


def _item(content: bytes) -> bytes:
    """A sequence item of defined length."""
    return struct.pack("<HHI", 0xFFFE, 0xE000, len(content)) + content


def _image_sequence(ct: Dataset) -> bytes:
    """A contour's Contour Image Sequence, encoded: the CT slice it lies on."""
    uids = _element(0x00081150, "UI", str(ct.SOPClassUID).encode())
    uids += _element(0x00081155, "UI", str(ct.SOPInstanceUID).encode())
    return _element(0x30060016, "SQ", _item(uids))


def _structure_set(slices: list[Dataset], algorithm_version: str) -> Dataset:
    """The RT Structure Set without ROIs: patient, study, frame of reference and the CT instances it references."""
    ct = slices[0]
    now = datetime.datetime.now()
    ds = Dataset()
    ds.file_meta = FileMetaDataset()
    ds.file_meta.MediaStorageSOPClassUID = ds.SOPClassUID = RTSTRUCT_STORAGE
    ds.file_meta.MediaStorageSOPInstanceUID = ds.SOPInstanceUID = hd.UID()
    ds.file_meta.TransferSyntaxUID = ImplicitVRLittleEndian
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
    ds.StructureSetROISequence, ds.RTROIObservationsSequence = [], []  # the ROI Contour Sequence: write_rtstruct
    ds.ApprovalStatus = "UNAPPROVED"
    return ds


def _add_roi(ds: Dataset, number: int, name: str, frame_uid: str, algorithm_version: str) -> None:
    """ROI ``number`` named ``name`` with its codes and interpreted type, in the Structure Set ROI and RT ROI
    Observations sequences (its contours and colour go to the ROI Contour Sequence, :func:`_roi_contour`)."""
    description = segment_description(number, name)
    roi = Dataset()
    roi.ROINumber, roi.ReferencedFrameOfReferenceUID, roi.ROIName = number, frame_uid, name
    roi.ROIGenerationAlgorithm = "AUTOMATIC"
    roi.ROIGenerationDescription = f"{ALGORITHM_NAME} {algorithm_version}"[:64]
    roi.ROIDerivationAlgorithmIdentificationSequence = algorithm_identification(algorithm_version)
    ds.StructureSetROISequence.append(roi)
    observation = Dataset()
    observation.ObservationNumber, observation.ReferencedROINumber = number, number
    observation.RTROIInterpretedType, observation.ROIInterpreter = _interpreted_type(description), ""
    observation.RTROIIdentificationCodeSequence = description.SegmentedPropertyTypeCodeSequence
    ds.RTROIObservationsSequence.append(observation)


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

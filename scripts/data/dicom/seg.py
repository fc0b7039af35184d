"""A DICOM SEG -> label volume on the grid of the CT series it annotates.

Why not MONAI's ``PydicomReader``: it assumes dense SEGs (one frame per CT slice and segment), while highdicom and
dcmqi omit empty frames by default, and it mutates the ``label_dict`` it is given. Here

* every SEG frame is placed on the CT slice it references (``SourceImageSequence``) or, when a frame carries no
  reference, on the slice at its ``ImagePositionPatient``; missing frames are empty, so sparse SEGs work;
* segments are matched to the requested labels by :func:`scripts.common.labels.matching` (``"GTV-1"`` = ``"gtv 1"``,
  ``"GTV*"`` merges every GTV); other segments are ignored;
* the file is read with pydicom alone: highdicom's reader re-validates and copies every per-frame item (~0.5 s of a
  0.8 s case preparation) for nothing used here.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
import pydicom
from pydicom.datadict import dictionary_VR
from pydicom.dataelem import RawDataElement
from scripts.data.dicom.common import SEG_STORAGE, DicomCaseError, match_numbers
from scripts.data.dicom.ct import SLICE_TOLERANCE, CtSeries


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
    by_label = match_numbers(segments, labels, seg_file, "segment", "SEG")
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
    pixels = _seg_frames(seg, seg_file, sorted({f for _, f, _ in frames})) if frames else None
    for index, frame_index, k in reversed(frames):
        stored = pixels[frame_index]
        mask = stored >= 0.5 * max_fraction if fractional else stored > 0
        label[:, :, k][mask.T] = index + 1
    names = {label_name: [segments[n] for n in nums] for label_name, nums in by_label.items()}
    return label, names


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


def _seg_frames(seg: pydicom.Dataset, seg_file: Path, needed: Sequence[int]) -> dict[int, np.ndarray]:
    """The ``needed`` frames of the SEG by index, ``(rows, columns)`` each: BINARY unpacked to 0/1, FRACTIONAL as
    stored. Uncompressed frames that start on a byte boundary (every BINARY frame whose rows x columns is a
    multiple of 8, e.g. 512 x 512) are unpacked alone: the other structures' frames (lungs, heart, ...: most of an
    NSCLC-Radiomics SEG) are never decoded. Anything else goes through pydicom's decoder."""
    rows, columns = int(seg.Rows), int(seg.Columns)
    bits = int(seg.get("BitsAllocated", 1))
    syntax = getattr(seg.get("file_meta"), "TransferSyntaxUID", None)
    frame_bits = rows * columns * bits
    if syntax is not None and not syntax.is_compressed and bits in (1, 8) and frame_bits % 8 == 0:
        data = seg.PixelData
        size = frame_bits // 8
        if len(data) >= size * int(seg.get("NumberOfFrames", 1) or 1):
            raw = {i: np.frombuffer(data, np.uint8, size, i * size) for i in needed}
            if bits == 1:
                return {i: np.unpackbits(b, bitorder="little").reshape(rows, columns) for i, b in raw.items()}
            return {i: b.reshape(rows, columns) for i, b in raw.items()}
    try:
        pixels = seg.pixel_array
    except Exception as err:  # truncated pixel data, unsupported compression, ...
        raise DicomCaseError(f"{seg_file}: SEG pixel data cannot be decoded ({err}); download the case again.") from err
    pixels = pixels.reshape(int(seg.get("NumberOfFrames", 1) or 1), rows, columns)
    return {i: pixels[i] for i in needed}


def _frame_slices(seg: pydicom.Dataset, ct: CtSeries, seg_file: Path) -> list[tuple[int, int | None]]:
    """For every SEG frame, its segment number and the CT slice index it belongs on.

    A frame's ``SourceImageSequence`` reference decides where it is; frames without one are placed by projecting
    their ``ImagePositionPatient`` onto the CT's slice normal.
    """
    slice_of_uid = {uid: k for k, uid in enumerate(ct.sop_instance_uids)}
    origin, step = ct.affine_lps[:3, 3], ct.affine_lps[:3, 2]  # slice k lies at origin + k * step (+ in-plane)
    normal = np.cross(ct.affine_lps[:3, 0], ct.affine_lps[:3, 1])
    normal /= np.linalg.norm(normal)
    try:
        references = frame_references(seg)
    except ValueError as err:  # e.g. an ImagePositionPatient that is not numbers
        raise DicomCaseError(
            f"{seg_file}: the frames' functional groups cannot be read ({err}); the SEG is malformed."
        ) from err
    result = []
    for i, frame in enumerate(references):
        number = frame.segment
        if number is None:
            raise DicomCaseError(f"{seg_file}: frame {i + 1} names no segment; the SEG is malformed.")
        k = None
        for uid in frame.sources:
            if uid in slice_of_uid:
                k = slice_of_uid[uid]
            elif uid:
                raise DicomCaseError(
                    f"{seg_file}: frame {i + 1} references instance {uid}, which is not in the CT series "
                    f"{ct.series_uid}; the SEG belongs to another series."
                )
        if k is None:
            position = frame.position
            if position is None:
                raise DicomCaseError(f"{seg_file}: frame {i + 1} has neither a source image nor a position.")
            offset = np.asarray(position, dtype=float) - origin
            along = float(offset @ normal) / float(step @ normal)
            k = round(along)
            # the frame's first pixel must be slice k's first pixel: same plane and same in-plane grid
            if abs(along - k) > SLICE_TOLERANCE or np.linalg.norm(offset - k * step) > 1e-2:
                raise DicomCaseError(
                    f"{seg_file}: frame {i + 1} at {list(position)} mm does not lie on a CT slice; "
                    "the SEG and the CT do not share one grid."
                )
            if not 0 <= k < ct.hu.shape[2]:
                raise DicomCaseError(f"{seg_file}: frame {i + 1} lies outside the CT volume (slice {k}).")
        result.append((int(number), k))
    return result


@dataclass(frozen=True)
class FrameReference:
    """What places one SEG frame: its segment number, the CT instances it was derived from, its position (mm)."""

    segment: int | None
    sources: tuple[str, ...]
    position: tuple[float, ...] | None


def frame_references(seg: pydicom.Dataset) -> list[FrameReference]:
    """Every frame's :class:`FrameReference`, each attribute from the frame's functional groups, else from the shared
    ones (DICOM allows either).

    The per-frame sequence -- a few nested items per frame, hundreds to thousands of frames -- is walked straight
    from its bytes when pydicom left it unparsed (a defined length, little endian: what DCMTK, dcmqi, highdicom and
    pydicom write): building pydicom datasets for every item took ~0.1 s of a 0.25 s case preparation. Anything
    else is read through pydicom; both give the same references (tests/test_dicom_seg.py).
    """
    shared = seg.get("SharedFunctionalGroupsSequence", [None])[0]
    fallback = _reference_of(_as_items(shared)) if shared is not None else FrameReference(None, (), None)
    frames = _raw_frame_items(seg)
    if frames is None:
        frames = [_as_items(frame) for frame in seg.PerFrameFunctionalGroupsSequence]
    references = []
    for items in frames:
        own = _reference_of(items)
        references.append(
            FrameReference(
                own.segment if own.segment is not None else fallback.segment,
                own.sources or fallback.sources,
                own.position if own.position is not None else fallback.position,
            )
        )
    return references


# the attributes read from each frame's functional groups, as (sequence tag, nested sequence tags..., element tag)
SEGMENT_NUMBER = (0x0062000A, 0x0062000B)  # SegmentIdentificationSequence > ReferencedSegmentNumber (US)
SOURCE_UID = (0x00089124, 0x00082112, 0x00081155)  # DerivationImage > SourceImage > ReferencedSOPInstanceUID (UI)
POSITION = (0x00209113, 0x00200032)  # PlanePositionSequence > ImagePositionPatient (DS)
PER_FRAME = 0x52009230  # PerFrameFunctionalGroupsSequence
_ITEM, _ITEM_END, _SEQUENCE_END, _UNDEFINED = 0xFFFEE000, 0xFFFEE00D, 0xFFFEE0DD, 0xFFFFFFFF
_LONG_VRS = {b"OB", b"OD", b"OF", b"OL", b"OV", b"OW", b"SQ", b"SV", b"UC", b"UN", b"UR", b"UT", b"UV"}


def _reference_of(item: dict) -> FrameReference:
    """A frame's reference from its items as ``{tag: bytes | [nested items]}``."""
    number = _values(item, SEGMENT_NUMBER)
    position = _values(item, POSITION)
    return FrameReference(
        segment=struct.unpack_from("<H", number[0])[0] if number and len(number[0]) >= 2 else None,
        sources=tuple(u for u in (v.decode("ascii", "replace").strip("\0 ") for v in _values(item, SOURCE_UID)) if u),
        position=tuple(float(x) for x in position[0].decode("ascii").split("\\")) if position else None,
    )


def _values(item: dict, path: tuple[int, ...]) -> list[bytes]:
    """The raw values at ``path`` (sequence tags, then the element's tag), through every item of every sequence."""
    if len(path) == 1:
        value = item.get(path[0])
        return [value] if isinstance(value, bytes) and value else []
    return [v for nested in item.get(path[0]) or [] for v in _values(nested, path[1:])]


def _as_items(dataset: pydicom.Dataset) -> dict:
    """The attributes :func:`_reference_of` reads, from a pydicom dataset, in the raw walker's form."""
    items: dict = {}
    for path in (SEGMENT_NUMBER, SOURCE_UID, POSITION):
        _copy_path(items, dataset, path)
    return items


def _copy_path(target: dict, dataset: pydicom.Dataset, path: tuple[int, ...]) -> None:
    """``dataset``'s values at ``path`` into ``target``, nested as the walker nests them."""
    if len(path) == 1:
        element = dataset.get(path[0])
        if element is not None and element.value is not None and element.value != "":
            target[path[0]] = _raw_value(path[0], element.value)
        return
    nested = list(dataset.get(path[0], []))
    level = target.setdefault(path[0], [{} for _ in nested])
    for sub_target, item in zip(level, nested):
        _copy_path(sub_target, item, path[1:])


def _raw_value(tag: int, value) -> bytes:
    if tag == SEGMENT_NUMBER[-1]:
        return struct.pack("<H", int(value))
    if tag == POSITION[-1]:
        return "\\".join(repr(float(v)) for v in value).encode()
    return str(value).encode()


def _raw_frame_items(seg: pydicom.Dataset) -> list[dict] | None:
    """The per-frame items parsed from the element's bytes, or None when pydicom already parsed it (an undefined
    length), it is big endian, or the bytes do not walk cleanly to one item per frame."""
    element = seg.get_item(PER_FRAME)
    if not isinstance(element, RawDataElement) or not element.is_little_endian or element.value is None:
        return None
    try:
        items, _ = _read_items(element.value, 0, len(element.value), not element.is_implicit_VR)
    except (struct.error, ValueError):
        return None
    return items if len(items) == int(seg.get("NumberOfFrames", 1) or 1) else None


def _read_items(buf: bytes, pos: int, end: int, explicit: bool) -> tuple[list[dict], int]:
    """The items of a sequence whose value is ``buf[pos:end]`` (``end`` = the buffer's end for an undefined length,
    then a sequence delimiter stops it); returns them and the position after the sequence."""
    items = []
    while pos < end:
        group, number, length = struct.unpack_from("<HHI", buf, pos)
        tag, pos = (group << 16) | number, pos + 8
        if tag == _SEQUENCE_END:
            return items, pos
        if tag != _ITEM:
            raise ValueError(f"expected an item at byte {pos - 8}")
        item_end = end if length == _UNDEFINED else pos + length
        item, after = _read_elements(buf, pos, item_end, explicit)
        items.append(item)
        pos = after if length == _UNDEFINED else item_end
    return items, pos


def _read_elements(buf: bytes, pos: int, end: int, explicit: bool) -> tuple[dict, int]:
    """One item's elements as ``{tag: bytes | [items]}`` up to ``end`` or an item delimiter, and where it ended."""
    elements: dict = {}
    while pos < end:
        group, number = struct.unpack_from("<HH", buf, pos)
        tag = (group << 16) | number
        if tag == _ITEM_END:
            return elements, pos + 8
        if explicit:
            vr = buf[pos + 4 : pos + 6]
            if vr in _LONG_VRS:
                (length,), pos = struct.unpack_from("<I", buf, pos + 8), pos + 12
            else:
                (length,), pos = struct.unpack_from("<H", buf, pos + 6), pos + 8
            sequence = vr == b"SQ" or (vr == b"UN" and length == _UNDEFINED)
        else:
            (length,), pos = struct.unpack_from("<I", buf, pos + 4), pos + 8
            sequence = length == _UNDEFINED or _is_sequence(tag)
        if sequence:
            items, after = _read_items(buf, pos, len(buf) if length == _UNDEFINED else pos + length, explicit)
            elements[tag], pos = items, after
        elif length == _UNDEFINED or pos + length > len(buf):
            raise ValueError(f"element ({group:04X},{number:04X}) cannot be walked")
        else:
            elements[tag], pos = buf[pos : pos + length], pos + length
    return elements, pos


@cache
def _is_sequence(tag: int) -> bool:
    """Whether the data dictionary declares ``tag`` a sequence (implicit VR streams do not say)."""
    try:
        return dictionary_VR(tag) == "SQ"
    except KeyError:
        return False

"""A DICOM SEG -> label volume on the grid of the CT series it annotates.

Why not MONAI's ``PydicomReader``: it assumes dense SEGs (one frame per CT slice and segment), while highdicom and
dcmqi omit empty frames by default, and it mutates the ``label_dict`` it is given. Here

* every SEG frame is placed on the CT slice it references (``SourceImageSequence``) or, when a frame carries no
  reference, on the slice at its ``ImagePositionPatient``; missing frames are empty, so sparse SEGs work;
* segments are matched to the requested labels by :func:`scripts.labels.matching` (``"GTV-1"`` = ``"gtv 1"``,
  ``"GTV*"`` merges every GTV); other segments are ignored;
* the file is read with pydicom alone: highdicom's reader re-validates and copies every per-frame item (~0.5 s of a
  0.8 s case preparation) for nothing used here.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pydicom
from scripts.dicom.common import SEG_STORAGE, DicomCaseError, find_single, match_numbers
from scripts.dicom.ct import SLICE_TOLERANCE, CtSeries


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


def find_seg_file(seg_dir: str | Path) -> Path:
    """The single DICOM SEG in a case's ``seg`` folder, found by SOP Class whatever the file names."""
    return find_single(seg_dir, SEG_STORAGE, "DICOM SEG")


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


def _frame_attr(frame, shared, sequence: str, attribute: str):
    """A functional-group attribute from the per-frame item, else from the shared one (DICOM allows either)."""
    for item in (frame, shared):
        if item is not None and sequence in item and len(item[sequence].value):
            value = item[sequence][0].get(attribute)
            if value is not None:
                return value
    return None

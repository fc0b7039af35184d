"""What an annotation series (SEG or RTSTRUCT) says about its case: where it goes on disk and which CT it annotates."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pydicom
from pydicom.errors import InvalidDicomError
from scripts.data.tcia.errors import TciaError


def read_annotation(seg_dir: Path, files: list[str], modality: str, label: str) -> pydicom.Dataset:
    """Header of the first file whose Modality is ``modality``."""
    for name in files:
        try:
            ds = pydicom.dcmread(seg_dir / name, stop_before_pixels=True)
        except (InvalidDicomError, OSError, ValueError) as err:
            raise TciaError(f"{label}: {name} is not a readable DICOM file ({err})") from err
        if str(ds.get("Modality", "")).upper() == modality.upper():
            return ds
    raise TciaError(f"{label}: none of its {len(files)} file(s) has Modality {modality}")


def case_key(ds: pydicom.Dataset) -> tuple[str, str]:
    """(PatientID, SeriesNumber) folder names for a SEG dataset, with TciaDataset's fallbacks.

    Raises :class:`TciaError` when a value could not serve as a single folder name.
    """
    patient = str(ds.get("PatientID") or ds.get("PatientName") or "").strip() or "patient"
    number = ds.get("SeriesNumber") or ds.get("AcquisitionNumber")
    series_number = str(number).strip() if number else "0"
    for what, value in (("PatientID", patient), ("SeriesNumber", series_number)):
        if value in (".", "..") or any(c in value for c in "/\\\0") or value.startswith("."):
            raise TciaError(
                f"{what} {value!r} of SEG series {ds.get('SeriesInstanceUID', '?')} is not a safe "
                "folder name; refusing to write it"
            )
    return patient, series_number


def find_referenced_series_uid(ds: pydicom.Dataset) -> str | None:
    """The SeriesInstanceUID a SEG references: ReferencedSeriesSequence first, then any nested sequence
    (e.g. ReferencedFrameOfReferenceSequence); never the SEG's own UID. None when there is none."""
    own = str(ds.get("SeriesInstanceUID", ""))
    for item in ds.get("ReferencedSeriesSequence", None) or []:
        uid = str(item.get("SeriesInstanceUID", ""))
        if uid and uid != own:
            return uid
    for uid in _nested_values(ds, 0x0020000E):
        if uid != own:
            return uid
    return None


def find_referenced_sop_uids(ds: pydicom.Dataset) -> list[str]:
    """Every ReferencedSOPInstanceUID in the SEG's sequences (first occurrence order, no duplicates)."""
    return list(dict.fromkeys(_nested_values(ds, 0x00081155)))


def _nested_values(ds: pydicom.Dataset, tag: int) -> Iterable[str]:
    """Values of ``tag`` inside the sequences of ``ds`` (depth first), never at its top level."""
    for elem in ds:
        if elem.VR == "SQ":
            for item in elem.value or []:
                if tag in item and item[tag].value:
                    yield str(item[tag].value)
                yield from _nested_values(item, tag)

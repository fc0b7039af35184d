"""What every DICOM reader of the bundle shares: its error type and the constants of the standard it relies on."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pydicom
from scripts.common.labels import matching

#: LPS (DICOM patient) to RAS (NIfTI world) coordinates
LPS_TO_RAS = np.diag([-1.0, -1.0, 1.0, 1.0])
SEG_STORAGE = "1.2.840.10008.5.1.4.1.1.66.4"  # Segmentation Storage SOP class
RTSTRUCT_STORAGE = "1.2.840.10008.5.1.4.1.1.481.3"  # RT Structure Set Storage SOP class


class DicomCaseError(ValueError):
    """A case that cannot be read; the message names the case, the file and what to do."""


def sop_class_of(path: Path) -> str:
    """The file's SOP Class UID from its header ('' when it is not DICOM or has none); pixels are not read."""
    try:
        ds = pydicom.dcmread(path, stop_before_pixels=True, specific_tags=["SOPClassUID"])
    except Exception:  # anything unreadable is "not this object"; the caller says what was expected
        return ""
    return str(ds.get("SOPClassUID", "") or getattr(ds.get("file_meta"), "MediaStorageSOPClassUID", "") or "")


def match_numbers(
    available: dict[int, str], labels: Sequence[str], path: Path, item: str, holder: str
) -> dict[str, list[int]]:
    """Map each requested label to the numbers of the ``item``s (segments of a SEG, ROIs of an RTSTRUCT; ``available``:
    number -> name) that match it by the tolerant rules of :func:`scripts.common.labels.matching`;
    :class:`DicomCaseError` naming what the ``holder`` has when a label matches none."""
    matched: dict[str, list[int]] = {}
    for name in labels:
        names = set(matching(name, available.values()))
        numbers = [n for n, found in available.items() if found in names]
        if not numbers:
            raise DicomCaseError(
                f"{path}: no {item} matches label {name!r}; the {holder} has {sorted(available.values())}. "
                "Without it the case cannot be used (set `labels` to a name listed here if it is spelt differently)."
            )
        matched[name] = numbers
    return matched

"""What to segment: the collection, its structure names, and the one set of rules that turns a requested label into
the segments (SEG) or ROIs (RTSTRUCT) of a case.

* :data:`COLLECTION` -- the TCIA collection this bundle is trained on (its folder name in ``dataset_dir``);
* :data:`NSCLC_SEGMENTS` -- the structure names its annotations use (GTV-2, GTV-3, ... exist for some patients);
* :func:`normalize_name` -- ``"GTV-1"``, ``"gtv 1"`` and ``"GTV_1"`` are one name: case, spaces and punctuation do
  not count; shell patterns survive (``"GTV*"`` merges every GTV);
* :func:`matching` -- which of a case's structure names a requested label matches;
* :func:`check_labels` -- a ``labels`` setting that can work, checked before any data is touched.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Sequence

COLLECTION = "NSCLC-Radiomics"
NSCLC_SEGMENTS = ("GTV-1", "GTV-2", "GTV-3", "GTV-4", "Lung-Left", "Lung-Right", "Heart", "Esophagus", "Spinal-Cord")
#: a label map is uint8 with 0 for the background
MAX_LABELS = 254


class LabelError(ValueError):
    """A ``labels`` setting that cannot work; the message says what to set instead."""


def normalize_name(name: str) -> str:
    """``"GTV-1"``, ``"gtv 1"`` and ``"GTV_1"`` all become ``"gtv1"``: case, spaces and punctuation do not count."""
    return re.sub(r"[^0-9a-z*?]", "", str(name).lower())


def matching(label: str, names: Iterable[str]) -> list[str]:
    """The ``names`` (segment or ROI names of one case) that the requested ``label`` matches, in their order."""
    pattern = normalize_name(label)
    return [name for name in names if fnmatch.fnmatchcase(normalize_name(name), pattern)]


def check_labels(labels: Sequence[str] | str, collection: str | None = COLLECTION) -> list[str]:
    """``labels`` as a list of names, or :class:`LabelError`: at least one, none blank, none twice, at most
    :data:`MAX_LABELS`; for NSCLC-Radiomics each must match one of the collection's structures (``collection=None``:
    names are not checked against any collection)."""
    if isinstance(labels, str):
        labels = [labels]
    labels = [str(x) for x in labels or []]
    if not labels or any(not x.strip() for x in labels):
        raise LabelError(f"labels={labels!r}: give a list of structure names, e.g. \"['GTV-1']\".")
    if len(set(map(normalize_name, labels))) != len(labels):
        raise LabelError(f"labels={labels}: a structure is listed twice.")
    if len(labels) > MAX_LABELS:
        raise LabelError(f"labels: at most {MAX_LABELS} structures fit in a uint8 label map.")
    if collection == COLLECTION:
        for name in labels:
            if not matching(name, NSCLC_SEGMENTS):
                raise LabelError(
                    f"labels: {name!r} is not a segment of {COLLECTION}; use names from {list(NSCLC_SEGMENTS)} "
                    "(case, spaces and dashes are ignored; 'GTV*' merges all GTVs)."
                )
    return labels

"""One case of the collection -- a CT series and its DICOM SEG -- read into aligned volumes ready for NIfTI."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from scripts.dicom.ct import read_ct_series
from scripts.dicom.seg import read_seg_labels


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
        info={"spacing": ct.spacing, "shape": list(ct.hu.shape), "series_uid": ct.series_uid, "notes": ct.notes},
    )

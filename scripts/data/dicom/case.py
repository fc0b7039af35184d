"""One case of the collection -- a CT series and the annotation its labels come from (a DICOM SEG or an RTSTRUCT) --
read into aligned volumes ready for NIfTI. Which files make a case is :mod:`scripts.data.dicom.discovery`'s answer, from
their headers; ``label_source`` (``seg``, ``rtstruct`` or ``auto``) says which kind of annotation it may take.
NSCLC-Radiomics ships both; most other collections and every treatment-planning export have RTSTRUCT only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from scripts.data.dicom.common import RTSTRUCT_STORAGE, sop_class_of
from scripts.data.dicom.ct import SeriesSource, read_ct_series
from scripts.data.dicom.rtstruct import read_rtstruct_labels
from scripts.data.dicom.seg import read_seg_labels

LABEL_SOURCES = ("auto", "seg", "rtstruct")


@dataclass
class CaseVolumes:
    """A CT and its label volume on the same grid, ready to be written as NIfTI."""

    patient_id: str
    image: np.ndarray  # int16 HU, [x, y, z] voxel order
    label: np.ndarray  # uint8, 0 = background, i + 1 = labels[i]
    affine: np.ndarray  # RAS, as NIfTI stores it
    labels: list[str]
    segments: dict[str, list[str]] = field(default_factory=dict)  # requested label -> matched segment / ROI names
    info: dict = field(default_factory=dict)


def read_case(image_dir: SeriesSource, annotation: str | Path, labels: Sequence[str] = ("GTV-1",)) -> CaseVolumes:
    """Read a CT series (its folder, or its files) and its annotation (a SEG or an RTSTRUCT, told apart by SOP
    Class) into aligned volumes."""
    ct = read_ct_series(image_dir)
    reader = read_rtstruct_labels if sop_class_of(Path(annotation)) == RTSTRUCT_STORAGE else read_seg_labels
    label, names = reader(annotation, ct, labels)
    return CaseVolumes(
        patient_id=ct.patient_id,
        image=ct.hu,
        label=label,
        affine=ct.affine_ras,
        labels=list(labels),
        segments=names,
        info={"spacing": ct.spacing, "shape": list(ct.hu.shape), "series_uid": ct.series_uid, "notes": ct.notes},
    )

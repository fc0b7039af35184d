"""One case of the collection -- a CT series and the annotation its labels come from (a DICOM SEG or an RTSTRUCT) --
read into aligned volumes ready for NIfTI.

The annotation is found by SOP Class in the case's ``seg/`` or ``rtstruct/`` folder (the folder names of
``monai.apps.TciaDataset`` and ``scripts.tcia``), whatever the file names: ``label_source`` ``seg`` or ``rtstruct``
asks for one kind; ``auto`` takes the SEG when there is one, else the RTSTRUCT. NSCLC-Radiomics ships both; most
other collections and every treatment-planning export have RTSTRUCT only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from scripts.dicom.common import RTSTRUCT_STORAGE, SEG_STORAGE, DicomCaseError, sop_class_of
from scripts.dicom.ct import read_ct_series
from scripts.dicom.rtstruct import read_rtstruct_labels
from scripts.dicom.seg import read_seg_labels

LABEL_SOURCES = ("auto", "seg", "rtstruct")
ANNOTATION_FOLDERS = ("seg", "rtstruct")
KINDS = {SEG_STORAGE: "seg", RTSTRUCT_STORAGE: "rtstruct"}


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


def find_annotation(case_dir: str | Path, label_source: str = "auto") -> Path:
    """The file a case's labels come from (see the module docstring); :class:`DicomCaseError` saying what the case
    holds when it has none of the kind asked for, or several."""
    if label_source not in LABEL_SOURCES:
        raise ValueError(f"label_source={label_source!r}: choose one of {list(LABEL_SOURCES)}.")
    case_dir = Path(case_dir)
    found: dict[str, list[Path]] = {"seg": [], "rtstruct": []}
    for folder in (case_dir / name for name in ANNOTATION_FOLDERS):
        if folder.is_dir():
            for path in sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")):
                kind = KINDS.get(sop_class_of(path))
                if kind:
                    found[kind].append(path)
    kind = label_source if label_source != "auto" else ("seg" if found["seg"] else "rtstruct")
    if not any((case_dir / name).is_dir() for name in ANNOTATION_FOLDERS):
        raise DicomCaseError(f"{case_dir}: no seg folder (nor rtstruct folder); this case has no labels to train on.")
    if not found[kind]:
        holds = ", ".join(f"{len(v)} {k.upper()}" for k, v in found.items() if v) or "no SEG or RTSTRUCT"
        raise DicomCaseError(
            f"{case_dir}: no {'DICOM SEG or RTSTRUCT' if label_source == 'auto' else kind.upper()} in "
            f"{'/ or '.join(ANNOTATION_FOLDERS)}/ (it holds {holds}); this case has no labels to train on."
        )
    if len(found[kind]) > 1:
        names = ", ".join(str(p.relative_to(case_dir)) for p in found[kind])
        raise DicomCaseError(f"{case_dir}: {len(found[kind])} {kind.upper()} objects ({names}); keep the one to use.")
    return found[kind][0]


def read_case(image_dir: str | Path, annotation: str | Path, labels: Sequence[str] = ("GTV-1",)) -> CaseVolumes:
    """Read a CT series and its annotation (a SEG or an RTSTRUCT, told apart by SOP Class) into aligned volumes."""
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

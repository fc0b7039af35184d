"""How the bundle names and codes a structure when it writes DICOM (SEG segments; RTSTRUCT ROIs use the same codes),
so viewers and PACS show what a structure is, not only its name."""

from __future__ import annotations

import highdicom as hd
from pydicom.sr.codedict import codes
from scripts.common.labels import normalize_name


def segment_description(
    number: int, label: str, algorithm: hd.AlgorithmIdentificationSequence | None = None
) -> hd.seg.SegmentDescription:
    """A SEG segment named ``label`` and coded in SNOMED CT, so viewers show what it is, not only its name.

    GTVs are "Morphologically abnormal structure / Neoplasm"; the organs of NSCLC-Radiomics get their organ codes;
    anything else is "Tissue". With ``algorithm`` the segment is marked AUTOMATIC (a model's output), else MANUAL.
    """
    key = normalize_name(label)
    organs = {"lungleft": codes.SCT.Lung, "lungright": codes.SCT.Lung, "heart": codes.SCT.Heart,
              "esophagus": codes.SCT.Esophagus, "spinalcord": codes.SCT.SpinalCord}  # fmt: skip
    if key.startswith("gtv"):
        category, kind = codes.SCT.MorphologicallyAbnormalStructure, codes.SCT.Neoplasm
    elif key in organs:
        category, kind = codes.SCT.Organ, organs[key]
    else:
        category, kind = codes.SCT.Tissue, codes.SCT.Tissue
    return hd.seg.SegmentDescription(
        segment_number=number,
        segment_label=label,
        segmented_property_category=category,
        segmented_property_type=kind,
        algorithm_type="AUTOMATIC" if algorithm else "MANUAL",
        algorithm_identification=algorithm,
    )

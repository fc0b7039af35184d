"""Who the bundle says it is in the DICOM it writes (SEG, RTSTRUCT, SR) and looks for on a PACS: the algorithm's name,
its manufacturer and its version (the bundle's, ``configs/metadata.json``)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import highdicom as hd
from pydicom.sr.codedict import codes

ALGORITHM_NAME = "SwinUNETR NSCLC-Radiomics bundle"
MANUFACTURER = "NSCLC SwinUNETR bundle"
BUNDLE_ROOT = Path(__file__).absolute().parents[3]  # the folder of scripts/ and configs/, links not followed


@functools.cache
def bundle_version(bundle_root: str | Path = BUNDLE_ROOT) -> str:
    """The bundle's version, ``version`` of ``<bundle_root>/configs/metadata.json``: the algorithm's version that every
    DICOM object and report records."""
    return str(json.loads((Path(bundle_root) / "configs" / "metadata.json").read_text())["version"])


def algorithm_identification(version: str | None = None) -> hd.AlgorithmIdentificationSequence:
    """Who made the segmentation: this bundle, at ``version`` (None: :func:`bundle_version`)."""
    return hd.AlgorithmIdentificationSequence(
        name=ALGORITHM_NAME, family=codes.cid7162.ArtificialIntelligence, version=str(version or bundle_version())
    )

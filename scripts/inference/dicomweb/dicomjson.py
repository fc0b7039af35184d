"""DICOM JSON (the form QIDO-RS and WADO-RS metadata answer in): reading values by keyword, walking nested
sequences, and what an object says of itself (its modality and UIDs, the algorithm that made it)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pydicom
from pydicom.datadict import tag_for_keyword


def tag(keyword: str) -> str:
    return f"{tag_for_keyword(keyword):08X}"


def values(item: Mapping, keyword: str) -> list:
    return list((item.get(tag(keyword)) or {}).get("Value") or [])


def first(item: Mapping, keyword: str, default: Any = None) -> Any:
    found = values(item, keyword)
    return found[0] if found else default


def walk(item: Mapping) -> Iterator[Mapping]:
    """``item`` and every item nested in its sequences (DICOM JSON)."""
    yield item
    for element in item.values():
        if isinstance(element, Mapping) and element.get("vr") == "SQ":
            for sub in element.get("Value") or []:
                yield from walk(sub)


def referenced(instance: Mapping, keyword: str) -> set[str]:
    """Every value of ``keyword`` in the items nested in the instance's sequences (its references)."""
    return {str(v) for item in walk(instance) if item is not instance for v in values(item, keyword)}


def code(item: Mapping) -> str | None:
    return first(first(item, "ConceptNameCodeSequence", {}) or {}, "CodeValue")


def algorithms(instance: Mapping) -> set[tuple[str, str]]:
    """(name, version) of the algorithms an object says made it: ManufacturerModelName with SoftwareVersions (SEG,
    RTSTRUCT), and an SR's Algorithm Name (DCM 111001) with its Algorithm Version (111003)."""
    found = {(str(first(instance, "ManufacturerModelName")), str(first(instance, "SoftwareVersions")))}
    for item in walk(instance):
        texts = {code(c): first(c, "TextValue") for c in values(item, "ContentSequence")}
        if texts.get("111001"):
            found.add((str(texts["111001"]), str(texts.get("111003"))))
    return found


def object_of(instance: Mapping | pydicom.Dataset) -> dict:
    """Modality, series and SOP Instance UID of a DICOM JSON header or a dataset (what the report names)."""
    if isinstance(instance, pydicom.Dataset):
        keys = (instance.get("Modality"), instance.get("SeriesInstanceUID"), instance.get("SOPInstanceUID"))
    else:
        keys = (first(instance, "Modality"), first(instance, "SeriesInstanceUID"), first(instance, "SOPInstanceUID"))
    return {"modality": str(keys[0]), "series_uid": str(keys[1]), "sop_uid": str(keys[2])}

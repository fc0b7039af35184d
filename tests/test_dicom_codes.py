"""How written DICOM names and codes a structure: GTVs are "Morphologically abnormal structure / Neoplasm", the
organs of NSCLC-Radiomics get their SNOMED CT organ codes, anything else is "Tissue"; a model's segment is AUTOMATIC
with its algorithm, a segment without one is MANUAL."""

from __future__ import annotations

import highdicom as hd
import pytest
from pydicom.sr.codedict import codes
from scripts.data.dicom.codes import segment_description


def coded(description: hd.seg.SegmentDescription) -> tuple[tuple[str, str, str], tuple[str, str, str]]:
    category = description.SegmentedPropertyCategoryCodeSequence[0]
    kind = description.SegmentedPropertyTypeCodeSequence[0]
    return (
        (category.CodingSchemeDesignator, category.CodeValue, category.CodeMeaning.lower()),
        (kind.CodingSchemeDesignator, kind.CodeValue, kind.CodeMeaning.lower()),
    )


def algorithm() -> hd.AlgorithmIdentificationSequence:
    return hd.AlgorithmIdentificationSequence(name="model", family=codes.cid7162.ArtificialIntelligence, version="2")


@pytest.mark.parametrize("name", ["GTV-1", "GTV1", "gtv 2", "Gtv_primary"])
def test_gtv_names_are_neoplasm(name):
    category, kind = coded(segment_description(1, name))
    assert category == ("SCT", "49755003", "morphologically abnormal structure")
    assert kind == ("SCT", "108369006", "neoplasm")


@pytest.mark.parametrize(
    ("name", "code"),
    [
        ("Lung-Left", "39607008"),
        ("Lung-Right", "39607008"),
        ("lung left", "39607008"),
        ("Heart", "80891009"),
        ("Esophagus", "32849002"),
        ("Spinal-Cord", "2748008"),
        ("SpinalCord", "2748008"),
    ],
)
def test_organs_get_their_snomed_codes(name, code):
    category, kind = coded(segment_description(2, name))
    assert category == ("SCT", "91772007", "organ")
    assert kind[:2] == ("SCT", code)


@pytest.mark.parametrize("name", ["Body", "PTV", "Lungs", "CTV-1"])
def test_other_structures_are_tissue(name):
    category, kind = coded(segment_description(3, name))
    assert category[:2] == kind[:2] == ("SCT", "85756007")


def test_segment_keeps_its_number_and_label():
    description = segment_description(4, "Heart")
    assert description.SegmentNumber == 4 and description.SegmentLabel == "Heart"


def test_with_an_algorithm_the_segment_is_automatic_and_names_it():
    description = segment_description(1, "GTV-1", algorithm())
    assert description.SegmentAlgorithmType == "AUTOMATIC"
    assert description.SegmentAlgorithmName == "model"
    assert description.SegmentationAlgorithmIdentificationSequence[0].AlgorithmVersion == "2"


def test_without_an_algorithm_the_segment_is_manual():
    description = segment_description(1, "GTV-1")
    assert description.SegmentAlgorithmType == "MANUAL"
    assert "SegmentationAlgorithmIdentificationSequence" not in description

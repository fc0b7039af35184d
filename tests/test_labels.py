"""One set of label rules: structure names match in any spelling, patterns merge structures, bad lists are
refused before any data is touched."""

from __future__ import annotations

import pytest
from scripts.common.config import ConfigError, check_config
from scripts.common.labels import check_labels, matching, normalize_name

GOOD = {"labels": ["GTV-1"], "roi_size": [96, 96, 96], "spacing": [1.0, 1.0, 3.0], "hu_window": [-1000, 500]}


@pytest.mark.parametrize("labels", [["GTV-1", "Lung-Left"], ["gtv 1"], ["GTV*"], ["spinal cord"]])
def test_nsclc_segment_names_are_accepted_in_any_spelling(labels):
    assert check_config(**{**GOOD, "labels": labels})


@pytest.mark.parametrize("labels", [["Tumour"], ["GTV-1", "gtv1"], [], "GTV-1"])
def test_bad_labels_are_refused(labels):
    with pytest.raises(ConfigError, match="labels"):
        check_config(**{**GOOD, "labels": labels})


def test_other_collections_accept_their_own_names():
    assert check_config(**{**GOOD, "labels": ["Kidney"]}, collection="KiTS")


def test_normalize_name():
    assert normalize_name("GTV-1") == normalize_name("gtv 1") == normalize_name("GTV_1") == "gtv1"


def test_patterns_match_every_structure_they_name():
    names = ["GTV-1", "gtv 2", "Lung-Left", "GTV_4R"]
    assert matching("GTV*", names) == ["GTV-1", "gtv 2", "GTV_4R"]
    assert matching("lung left", names) == ["Lung-Left"]


def test_prepare_checks_the_list_but_not_the_collection_names():
    assert check_labels("Kidney", collection=None) == ["Kidney"]

"""Fail-fast configuration checks and command-line flags: each error names the id and a value that works."""

from __future__ import annotations

import pytest
from scripts.config import ConfigError, as_bool, check_config, check_roi_size

GOOD = {"labels": ["GTV-1"], "roi_size": [96, 96, 96], "spacing": [1.0, 1.0, 3.0], "hu_window": [-1000, 500]}


def test_good_config_passes():
    assert check_config(**GOOD)


@pytest.mark.parametrize("roi", [[48, 48, 48], [32, 32, 32], [96, 96, 80], [96, 96]])
def test_roi_size_must_be_multiple_of_32_with_more_than_one_bottleneck_voxel(roi):
    with pytest.raises(ConfigError, match=r"roi_size=.*Try --roi_size"):
        check_roi_size(roi)


@pytest.mark.parametrize("roi", [[64, 64, 32], [96, 96, 96], [128, 128, 64]])
def test_roi_sizes_swinunetr_trains_on_pass(roi):
    check_roi_size(roi)  # [64, 64, 32]: the demo's patch; instance norm sees 2x2x1 voxels at the bottleneck


@pytest.mark.parametrize(
    ("text", "expected"), [("true", True), ("False", False), ("false", False), ("1", True), (True, True)]
)
def test_command_line_flags_are_parsed_as_booleans(text, expected):
    assert as_bool(text) is expected


def test_unclear_flag_is_refused():
    with pytest.raises(ConfigError, match="expected true or false"):
        as_bool("maybe", "resume")


def test_flags_are_read_by_monais_own_rule():
    """as_bool keeps MONAI's str2bool words without importing MONAI: the same answer for every word, any case."""
    from monai.utils import str2bool
    from scripts.config import FALSE_WORDS, TRUE_WORDS

    for word in (*TRUE_WORDS, *FALSE_WORDS):
        for text in (word, word.upper(), f" {word.title()} "):
            assert as_bool(text) == str2bool(text.strip())
    for text in ("maybe", "", "2", "on"):
        with pytest.raises(ValueError):
            str2bool(text)
        with pytest.raises(ConfigError):
            as_bool(text)

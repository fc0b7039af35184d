"""Fail-fast configuration checks and command-line flags: each error names the id and a value that works."""

from __future__ import annotations

import pytest
from scripts.common.config import ConfigError, as_bool, check_config, check_roi_size, unset

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


def test_null_as_yaml_and_the_command_line_give_it_means_none_and_a_value_does_not():
    assert all(unset(value) for value in (None, "", "null", "None"))
    assert not any(unset(value) for value in ("srun python", "0", 0, "false", "none-such"))


def test_unclear_flag_is_refused():
    with pytest.raises(ConfigError, match="expected true or false"):
        as_bool("maybe", "resume")


def test_flags_are_read_by_monais_own_rule():
    """as_bool keeps MONAI's str2bool words without importing MONAI: the same answer for every word, any case."""
    from monai.utils import str2bool
    from scripts.common.config import FALSE_WORDS, TRUE_WORDS

    for word in (*TRUE_WORDS, *FALSE_WORDS):
        for text in (word, word.upper(), f" {word.title()} "):
            assert as_bool(text) == str2bool(text.strip())
    for text in ("maybe", "", "2", "on"):
        with pytest.raises(ValueError):
            str2bool(text)
        with pytest.raises(ConfigError):
            as_bool(text)


def test_an_override_no_config_defines_fails_with_the_closest_ids(root):
    """`--max_epoch 2` (a typo) was added by MONAI as a new id that nothing reads, and the run went on with
    max_epochs' default. Known ids pass, whatever lies below their first part (a component's new argument), as do
    MONAI's own options; a command line that is not monai.bundle's is not checked."""
    from scripts.common.config import check_overrides

    main = "/venv/lib/python3.11/site-packages/monai/bundle/__main__.py"
    configs = str([str(root / "configs" / "train.yaml"), str(root / "configs" / "demo.yaml")])
    with pytest.raises(ConfigError) as err:
        check_overrides([main, "run", "--config_file", configs, "--max_epoch", "2", "--output_dir", "x"])
    assert str(err.value).startswith("--max_epoch (did you mean --max_epochs")
    assert "no config of the bundle defines that id, so the setting would be ignored" in str(err.value)
    good = [main, "run", "training", "--config_file", configs, "--max_epochs", "2", "--train#trainer#max_epochs=3",
            "--sliding_window_inferer#overlap", "0.5", "--demo_cases", "4", "--meta_file", "m", "--resume"]  # fmt: skip
    assert check_overrides(good)
    inference = [main, "run", "inference", "--config_file", str(root / "configs" / "inference.yaml"),
                 "--series_rules#min_slices", "50", "--input_dirr", "x"]  # fmt: skip
    with pytest.raises(ConfigError, match=r"--input_dirr \(did you mean --input_dir"):
        check_overrides(inference)
    assert check_overrides(["pytest", "--max_epoch", "2"]), "not monai.bundle's command line: not checked"

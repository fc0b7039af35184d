"""The configs MONAI's tools read alone are generated from train.yaml and inference's own ids, and stay so: a stale
file fails here, each copied id equals train.yaml's, every id is defined once and every reference resolves, and an
edit of train.yaml reaches both generated files with its comments."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import ROOT
from scripts.build_configs import GENERATED_LINE, ConfigBuildError, main, references, stale, standalone, write

CONFIGS = ROOT / "configs"


class UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key defined twice in one mapping (PyYAML keeps the last one silently)."""

    def construct_mapping(self, node, deep=False):
        keys = [self.construct_object(k, deep=deep) for k, _ in node.value]
        twice = {k for k in keys if keys.count(k) > 1}
        assert not twice, f"defined twice: {sorted(twice)}"
        return super().construct_mapping(node, deep)


def load(path: Path) -> dict:
    return yaml.load(path.read_text(), Loader=UniqueKeyLoader)  # a SafeLoader subclass


def test_the_generated_configs_are_up_to_date():
    assert stale() == [], "run `python -m scripts.build_configs` after editing configs/train.yaml or inference's ids"


def test_train_json_is_train_yaml_with_a_note_where_to_edit():
    generated = json.loads((CONFIGS / "train.json").read_text())
    note = generated.pop("_generated_")
    assert next(iter(json.loads((CONFIGS / "train.json").read_text()))) == "_generated_", "the note comes first"
    assert "edit train.yaml" in note and "python -m scripts.build_configs" in note
    assert generated == load(CONFIGS / "train.yaml")


def test_inference_yaml_copies_train_yaml_ids_unchanged_and_defines_its_own():
    text = (CONFIGS / "inference.yaml").read_text()
    own_text, copied_text = text.split(GENERATED_LINE)
    own, copied, train = yaml.safe_load(own_text), yaml.safe_load(copied_text), load(CONFIGS / "train.yaml")
    assert not set(own) & set(copied), "an id is either inference's own or copied, never both"
    for key, value in copied.items():
        if isinstance(value, dict) and value != train[key]:  # one level into a mapping: only the keys needed
            assert all(train[key][k] == v for k, v in value.items()), key
        else:
            assert value == train[key], key
    # what inference changes or adds stays its own: the preprocessing it builds, its inferer, outputs, workflow
    assert {"preprocessing", "inferer", "postprocessing", "save_case", "initialize", "run", "output_dir"} <= set(own)
    assert set(copied["flag"]) < set(train["flag"]), "only the switches inference reads"
    assert {"network_def", "ct_transforms", "inverse_postprocessing", "roi_size", "spacing", "labels"} <= set(copied)
    assert not {"train", "validate", "optimizer", "loss", "prepare"} & set(copied), "nothing of training"


def test_in_inference_yaml_each_id_is_defined_once_and_every_reference_resolves():
    config = load(CONFIGS / "inference.yaml")  # refuses a key defined twice

    def defined(ref: str) -> bool:
        node = config
        for part in ref.split("#"):
            if isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            elif isinstance(node, dict) and part in node:
                node = node[part]
            else:
                return False
        return True

    refs = {ref for key, value in config.items() for ref in references(value, key)}
    assert "network_def" in refs or "local_network" in refs
    dangling = sorted(r for r in refs if not r.startswith("_meta_") and not defined(r))
    assert dangling == [], f"references to ids the file does not define: {dangling}"


def test_a_newcomer_sees_which_file_to_edit():
    head = (CONFIGS / "inference.yaml").read_text().splitlines()[:12]
    assert any("GENERATED line" in line for line in head) and any("edit those in train.yaml" in line for line in head)
    assert any("python -m scripts.build_configs" in line for line in head)
    assert "GENERATED below: edit configs/train.yaml" in GENERATED_LINE
    assert "configs/inference.yaml" in (CONFIGS / "train.yaml").read_text().split("imports:")[0]


def test_an_edit_of_train_yaml_reaches_both_generated_files_with_its_comment(tmp_path):
    configs = tmp_path / "configs"
    shutil.copytree(CONFIGS, configs)
    train = configs / "train.yaml"
    line = next(x for x in train.read_text().splitlines() if x.startswith("roi_size:"))
    train.write_text(train.read_text().replace(line, line.replace("[96, 96, 96]", "[128, 128, 64]")))
    assert stale(configs) == [configs / "train.json", configs / "inference.yaml"]
    with pytest.raises(SystemExit) as stopped:
        main(check=True, configs=configs)
    assert stopped.value.code == 1
    assert write(configs) == [configs / "train.json", configs / "inference.yaml"] and stale(configs) == []
    assert load(configs / "inference.yaml")["roi_size"] == [128, 128, 64]
    assert json.loads((configs / "train.json").read_text())["roi_size"] == [128, 128, 64]
    assert line.replace("[96, 96, 96]", "[128, 128, 64]") in (configs / "inference.yaml").read_text(), "its comment"
    own = (CONFIGS / "inference.yaml").read_text().split(GENERATED_LINE)[0]
    assert (configs / "inference.yaml").read_text().startswith(own), "inference's own part is kept as written"


TRAIN = """# header of the file, not copied

# ---------------------------------------------------------------- settings
size: 3                 # a comment kept with its line
unused: 1
# the comment above a key goes with it
scale: $@size * 2
# ---------------------------------------------------------------- switches
flag:
  # a comment inside a mapping goes with the key below
  a: "$bool(@size)"
  b: "$bool(@unused)"
as_list:
  - "%#0"
net:
  _target_: Foo
  width: "@scale"
  use_a: "@flag#a"
"""


def test_only_the_needed_entries_are_copied_with_their_comments_and_sections():
    own = "# own\nnetwork: '@net'\nbundle_root: .\ndevice: cpu\ndataset_dir: x\ndataset: 1\nevaluator: 1\ninferer: 1\n"
    text = standalone(TRAIN + "network_def: '@net'\n", own)
    generated = text.split(GENERATED_LINE)[1]
    assert "unused" not in generated and "  b:" not in generated and "header of the file" not in generated
    for kept in ("size: 3                 # a comment kept with its line", "# the comment above a key goes with it",
                 "  # a comment inside a mapping goes with the key below", '  a: "$bool(@size)"'):  # fmt: skip
        assert kept in generated, kept
    assert generated.count("-- settings") == 1 and generated.count("-- switches") == 1
    config = yaml.safe_load(text)
    assert config["flag"] == {"a": "$bool(@size)"} and config["net"]["width"] == "@scale"
    assert text.startswith(own), "the own part first, as written"


def test_macros_and_relative_references_are_followed():
    assert references("%#0", "as_list#1") == ["as_list#0"]
    assert references("$@##size + 1", "net#width") == ["size"]
    assert references("@net#width", "x") == ["net#width"]
    assert references("not @a reference", "x") == []


def test_an_own_part_that_changes_ids_inside_ids_or_needs_an_unknown_id_is_refused():
    with pytest.raises(ConfigBuildError, match=r"\['flag#a'\] change ids inside other ids"):
        standalone(TRAIN, "flag#a: true\n")
    own = "bundle_root: .\ndevice: cpu\ndataset_dir: x\ndataset: 1\nevaluator: 1\ninferer: 1\nnetwork_def: '@net'\n"
    with pytest.raises(ConfigBuildError, match=r"needs @nowhere, which neither it nor train\.yaml defines"):
        standalone(TRAIN, own + "network: '@nowhere'\n")
    with pytest.raises(ConfigBuildError, match=r"defines \['inferer'\]: MONAI's inference workflows require them"):
        standalone(TRAIN, own.replace("inferer: 1\n", ""))

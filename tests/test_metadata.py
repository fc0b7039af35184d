"""configs/metadata.json: valid against the model-zoo schema (built here, nothing downloaded) and truthful."""

from __future__ import annotations

import json
import re
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

TENSOR = {
    "type": "object",
    "required": ["type", "format", "num_channels", "spatial_shape", "dtype", "value_range", "is_patch_data"],
    "properties": {
        "type": {"type": "string"},
        "format": {"type": "string"},
        "modality": {"type": "string"},
        "num_channels": {"type": "integer"},
        "spatial_shape": {"type": "array"},
        "dtype": {"type": "string"},
        "value_range": {"type": "array"},
        "is_patch_data": {"type": "boolean"},
        "channel_def": {"type": "object"},
    },
}
# the required part of MONAI's meta_schema_20240725.json
SCHEMA = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "type": "object",
    "required": [
        "schema", "version", "changelog", "monai_version", "pytorch_version", "numpy_version",
        "required_packages_version", "task", "description", "authors", "copyright", "network_data_format",
    ],
    "properties": {
        "version": {"type": "string"},
        "changelog": {"type": "object"},
        "required_packages_version": {"type": "object", "additionalProperties": {"type": "string"}},
        "network_data_format": {
            "type": "object",
            "required": ["inputs", "outputs"],
            "properties": {
                "inputs": {"type": "object", "additionalProperties": TENSOR},
                "outputs": {"type": "object", "additionalProperties": TENSOR},
            },
        },
    },
}  # fmt: skip


@pytest.fixture(scope="module")
def meta(root) -> dict:
    return json.loads((root / "configs" / "metadata.json").read_text())


def test_schema_is_the_model_zoo_one_and_version_is_in_changelog(meta):
    assert meta["schema"].endswith("meta_schema_20240725.json")
    assert meta["version"] in meta["changelog"]


def test_the_changelog_says_each_version_in_one_short_line(meta, root):
    """As the model zoo's bundles write it: one line per version, newest first; the numbers measured with a version
    live in CHANGELOG.md, which names every version the metadata does."""
    versions = list(meta["changelog"])
    assert versions[0] == meta["version"]
    assert versions == sorted(versions, key=lambda v: tuple(int(n) for n in v.split(".")), reverse=True)
    for number, line in meta["changelog"].items():
        assert "\n" not in line and len(line) <= 200, f"{number}: {len(line)} characters"
    changelog = (root / "CHANGELOG.md").read_text()
    assert all(f"## [{v}]" in changelog for v in versions)


def test_network_format_matches_the_task(meta):
    image = meta["network_data_format"]["inputs"]["image"]
    pred = meta["network_data_format"]["outputs"]["pred"]
    assert (image["format"], image["num_channels"], image["spatial_shape"]) == ("hounsfield", 1, [96, 96, 96])
    assert image["value_range"] == [0, 1] and image["is_patch_data"] is True
    assert pred["num_channels"] == 2 and pred["channel_def"] == {"0": "background", "1": "GTV-1"}


def test_output_channels_are_named_as_the_configs_name_the_labels(meta, root):
    """channel_def names each structure as configs/train.yaml's ``labels`` do (MONAI Label shows these names, and
    the SEG, RTSTRUCT and reports use the labels'): channel k is labels[k - 1], channel 0 the background."""
    import yaml

    labels = yaml.safe_load((root / "configs" / "train.yaml").read_text())["labels"]
    pred = meta["network_data_format"]["outputs"]["pred"]
    assert pred["channel_def"] == {"0": "background", **{str(k): name for k, name in enumerate(labels, 1)}}
    assert pred["num_channels"] == len(labels) + 1


def test_pins_match_requirements_and_the_installed_packages(meta, root):
    lines = (root / "requirements.txt").read_text().splitlines()
    pins = dict(
        re.match(r"([A-Za-z0-9_.-]+)==(\S+)", line).groups()
        for line in lines
        if "==" in line and not line.startswith("#")
    )
    for package, pinned in meta["required_packages_version"].items():
        assert pins[package] == pinned, f"{package}: requirements.txt pins {pins[package]}, metadata says {pinned}"
        assert version(package) == pinned
    assert meta["monai_version"] == pins["monai"] == version("monai")


def test_references_cite_the_data_and_the_network(meta):
    text = " ".join(meta["references"])
    assert "10.7937/K9/TCIA.2015.PF0M9REI" in text and "2201.01266" in text and "ncomms5006" in text


def test_docs_and_license_exist(root):
    for path in ("LICENSE", "docs/README.md", "docs/data_license.txt", "large_files.yml", "Dockerfile"):
        assert Path(root / path).is_file(), path
    assert "CC BY-NC 3.0" in (root / "docs" / "data_license.txt").read_text()


def test_every_package_the_bundle_imports_is_pinned_in_metadata(meta, root):
    """What scripts/ imports beyond the standard library, torch, MONAI and numpy is in required_packages_version
    (the zoo installs a bundle's requirements from there), under its distribution's name. Imports guarded by
    ``except ImportError`` are optional accelerators and are not required."""
    import ast
    from importlib.metadata import packages_distributions

    def names(node: ast.AST) -> set[str]:
        if isinstance(node, ast.Import):
            return {a.name.split(".")[0] for a in node.names}
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            return {node.module.split(".")[0]}
        return set()

    imported, optional = set(), set()
    for path in (root / "scripts").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            imported |= names(node)
            if isinstance(node, ast.Try) and any("ImportError" in ast.unparse(h) for h in node.handlers):
                optional |= {n for inner in node.body for sub in ast.walk(inner) for n in names(sub)}
    imported -= optional
    distributions = packages_distributions()
    needed = {dist for name in imported - set(sys.stdlib_module_names) - {"scripts", "torch", "monai", "numpy"}
              for dist in distributions.get(name, [name])}  # fmt: skip
    listed = {k.lower() for k in meta["required_packages_version"]}
    assert sorted(d for d in needed if d.lower() not in listed) == []


def test_framework_versions_are_the_ones_requirements_install(meta, root):
    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", (root / "requirements.txt").read_text(), re.M))
    assert meta["numpy_version"] == pins["numpy"] == version("numpy")
    assert meta["pytorch_version"] in version("torch")

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


def pyproject(root) -> dict:
    import tomllib

    return tomllib.loads((root / "pyproject.toml").read_text())["project"]


def lowest_python(requires: str) -> tuple[int, int]:
    """The lowest Python 3 minor release a ``Requires-Python`` specifier admits (``>=3.11`` -> (3, 11))."""
    from packaging.specifiers import SpecifierSet

    spec = SpecifierSet(requires or "")
    return next((3, minor) for minor in range(0, 40) if spec.contains(f"3.{minor}.0") or spec.contains(f"3.{minor}.99"))


def test_pyproject_carries_the_bundles_version(meta, root):
    """pyproject.toml's version is metadata.json's: one version for the bundle, whichever file a tool reads."""
    assert pyproject(root)["version"] == meta["version"]


def test_requires_python_is_the_lowest_python_every_pin_supports(root):
    """requires-python's lower bound is the highest of the lowest Pythons the pinned packages of requirements.txt
    declare (their installed distributions' ``Requires-Python``): not lower, which a pin would refuse to install on,
    nor higher than the pins ask for."""
    from importlib.metadata import PackageNotFoundError, metadata

    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", (root / "requirements.txt").read_text(), re.M))
    needs = {}
    for package, pinned in pins.items():
        try:
            installed = metadata(package)
        except PackageNotFoundError:
            continue
        assert installed["Version"] == pinned, f"{package}: {installed['Version']} installed, {pinned} pinned"
        needs[package] = lowest_python(installed.get("Requires-Python") or "")
    assert {"numpy", "scipy"} <= set(needs), sorted(needs)
    bound = lowest_python(pyproject(root)["requires-python"])
    highest = max(needs.values())
    assert bound == highest, (bound, {p: v for p, v in needs.items() if v == highest})


def test_the_requirements_page_states_the_python_pyproject_requires(root):
    """docs/requirements.md gives the lowest Python as pyproject.toml's requires-python does."""
    major, minor = lowest_python(pyproject(root)["requires-python"])
    page = (root / "docs" / "requirements.md").read_text()
    assert f"Python {major}.{minor} or later" in page
    assert re.findall(r"Python (3\.\d+)\+", (root / "README.md").read_text()) == [f"{major}.{minor}"]


def test_every_torch_the_docs_and_install_files_install_is_the_one_the_bundle_is_tested_with(meta, root):
    """Each ``torch==X`` of the README, the pages, the requirements files and the Dockerfile (and its
    ``TORCH_VERSION``) is metadata.json's ``pytorch_version``, the release CI tests with."""
    files = [root / "README.md", *sorted((root / "docs").glob("*.md")), *sorted(root.glob("requirements*.txt")),
             root / "Dockerfile", root / "docker-compose.yml"]  # fmt: skip
    found = {}
    for path in files:
        text = path.read_text()
        for torch in re.findall(r"torch==([\w.+]+)", text) + re.findall(r"TORCH_VERSION=([\w.+]+)", text):
            found.setdefault(torch, []).append(path.name)
    assert found and set(found) == {meta["pytorch_version"]}, found

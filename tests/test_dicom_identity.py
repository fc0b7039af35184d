"""Who the bundle says it is in its DICOM: the version is configs/metadata.json's (or a bundle root's given), and the
algorithm identification carries the name and that version unless told another."""

from __future__ import annotations

import json
from pathlib import Path

from scripts.data.dicom.identity import ALGORITHM_NAME, BUNDLE_ROOT, algorithm_identification, bundle_version

ROOT = Path(__file__).resolve().parents[1]


def test_the_version_is_metadata_json_s(tmp_path):
    assert BUNDLE_ROOT.resolve() == ROOT
    assert bundle_version() == json.loads((ROOT / "configs" / "metadata.json").read_text())["version"]
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "metadata.json").write_text(json.dumps({"version": "9.8.7"}))
    assert bundle_version(tmp_path) == "9.8.7"


def test_the_algorithm_identification_names_the_bundle_at_its_version():
    (item,) = algorithm_identification()
    assert (item.AlgorithmName, item.AlgorithmVersion) == (ALGORITHM_NAME, bundle_version())
    assert algorithm_identification("2.0")[0].AlgorithmVersion == "2.0"

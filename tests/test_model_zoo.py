"""The MONAI model zoo's own checks, run as the zoo runs them -- from a working directory that is not the bundle, the
bundle named by ``bundle_root`` -- without a network.

The zoo's ``ci/verify_bundle.py`` checks the metadata against its schema, the version and changelog, the files a
bundle must and should hold, the network's input and output against the metadata (``verify_net_in_out``) and the
TorchScript export; its unit tests run each workflow with ``check_properties`` on (``ci/unit_tests/utils.py``
``check_workflow``: initialize, check properties, run, finalize). Exports (traced TorchScript, ONNX) are checked in
tests/test_workflow_export.py; what a zoo PR must still add is listed in docs/README.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, configs
from monai.bundle import ConfigWorkflow, verify_metadata

SCHEMA = Path(__file__).parent / "data" / "meta_schema_20240725.json"


def check_workflow(workflow: ConfigWorkflow) -> None:
    """What the zoo's unit tests do with each workflow."""
    workflow.initialize()
    assert workflow.check_properties() == [], "the bundle properties MONAI expects"
    workflow.run()
    workflow.finalize()


def test_metadata_validates_against_the_model_zoo_schema():
    meta = json.loads((ROOT / "configs" / "metadata.json").read_text())
    assert meta["schema"].endswith(SCHEMA.name), "the schema copy is the one the metadata names"
    verify_metadata(meta_file=str(ROOT / "configs" / "metadata.json"), filepath=str(SCHEMA))


def test_version_is_in_the_changelog_and_the_required_files_are_there():
    meta = json.loads((ROOT / "configs" / "metadata.json").read_text())
    assert meta["version"] in meta["changelog"]
    for necessary in ("configs/metadata.json", "LICENSE"):
        assert (ROOT / necessary).is_file(), necessary
    assert [p.name for p in (ROOT / "configs").glob("inference.*")] == ["inference.yaml"]
    assert "models/model.pt" in (ROOT / "large_files.yml").read_text() or not (ROOT / "models" / "model.pt").exists()


def test_network_in_and_out_match_the_metadata_from_another_folder(tmp_path):
    args = [sys.executable, "-m", "monai.bundle", "verify_net_in_out", "network_def", "--meta_file",
            str(ROOT / "configs" / "metadata.json"), "--config_file", configs("train.yaml", "inference.yaml"),
            "--bundle_root", str(ROOT), "--feature_size", "12"]  # fmt: skip
    result = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "verified with no error" in result.stdout + result.stderr, result.stderr[-2000:]


@pytest.fixture(scope="module")
def zoo_run(tmp_path_factory, monkeypatch_module, tiny_data) -> Path:
    """train (one tiny epoch), evaluate and infer, each as a zoo unit test runs it, from a foreign folder."""
    tmp = tmp_path_factory.mktemp("zoo")
    monkeypatch_module.chdir(tmp)
    common = {"bundle_root": str(ROOT), "dataset_dir": str(tiny_data / "data"),
              "prepared_dir": str(tiny_data / "prepared"), "output_dir": str(tmp / "run"), "demo_cases": 4,
              "num_samples": 1, "max_epochs": 1, "val_interval": 1, "num_workers": 0}  # fmt: skip
    meta = str(ROOT / "configs" / "metadata.json")
    logging = str(ROOT / "configs" / "logging.conf")
    paths = lambda *names: [str(ROOT / "configs" / n) for n in names]  # noqa: E731
    check_workflow(ConfigWorkflow(workflow_type="train", config_file=paths("train.yaml", "demo.yaml"),
                                  meta_file=meta, logging_file=logging, **common))  # fmt: skip
    evaluated = {**common, "eval_dir": str(tmp / "eval"), "eval_pictures": 0}
    # the zoo runs evaluate.json on train.json as a "train" workflow (its test_eval_config)
    check_workflow(ConfigWorkflow(workflow_type="train", config_file=paths("train.yaml", "demo.yaml", "evaluate.yaml"),
                                  meta_file=meta, logging_file=logging, **evaluated))  # fmt: skip
    inferred = {**common, "input_dir": str(tiny_data / "data"), "output_dir": str(tmp / "infer"),
                "model_path": str(tmp / "run" / "model.pt")}  # fmt: skip
    workflow = ConfigWorkflow(workflow_type="infer", config_file=paths("train.yaml", "demo.yaml", "inference.yaml"),
                              meta_file=meta, logging_file=logging, **inferred)  # fmt: skip
    check_workflow(workflow)
    return tmp


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_train_evaluate_and_infer_run_as_the_zoo_runs_them(zoo_run):
    assert (zoo_run / "run" / "model.pt").is_file() and (zoo_run / "run" / "checkpoints" / "latest.pt").is_file()
    summary = json.loads((zoo_run / "eval" / "metrics_summary.json").read_text())
    assert summary["num_cases"] >= 1 and summary["failed"] == []
    report = json.loads((zoo_run / "infer" / "inference_report.json").read_text())
    assert report["num_done"] == 4 and report["num_failed"] == 0

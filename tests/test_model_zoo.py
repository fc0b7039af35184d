"""The MONAI model zoo's own checks, run as the zoo runs them -- from a working directory that is not the bundle, the
bundle named by ``bundle_root`` -- without a network.

The zoo's ``ci/verify_bundle.py`` checks the metadata against its schema, the version and changelog, the files a
bundle must and should hold, the network's input and output against the metadata (``verify_data_shape``: MONAI's
``verify_net_in_out`` on ``configs/inference.*`` ALONE), the inference properties (``create_workflow`` on that config
alone) and the TorchScript export; its unit tests run each workflow with ``check_properties`` on
(``ci/unit_tests/utils.py`` ``check_workflow``: initialize, check properties, run, finalize), training from
``configs/train.json``. Here the bundle sits under ``models/<name>/`` of a zoo-like folder, which is the working
directory. Exports (traced TorchScript, ONNX) are checked in tests/test_workflow_export.py (SwinUNETR traces but does
not script: the zoo lists such bundles in ``exclude_verify_torchscript_list``); what a zoo PR must still add is
listed in docs/README.md.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from conftest import ROOT
from monai.bundle import ConfigWorkflow, verify_metadata

SCHEMA = Path(__file__).parent / "data" / "meta_schema_20240725.json"
NAME = "nsclc_swinunetr"


def check_workflow(workflow: ConfigWorkflow) -> None:
    """What the zoo's unit tests do with each workflow."""
    workflow.initialize()
    assert workflow.check_properties() == [], "the bundle properties MONAI expects"
    workflow.run()
    workflow.finalize()


def test_metadata_validates_against_the_model_zoo_schema(zoo, monkeypatch):
    monkeypatch.chdir(zoo)
    meta_file = f"models/{NAME}/configs/metadata.json"
    assert json.loads(Path(meta_file).read_text())["schema"].endswith(SCHEMA.name), "the copy is the one it names"
    verify_metadata(meta_file=meta_file, filepath=str(SCHEMA))


def test_version_is_in_the_changelog_and_the_required_files_are_there(zoo):
    bundle = zoo / "models" / NAME
    meta = json.loads((bundle / "configs" / "metadata.json").read_text())
    assert meta["version"] in meta["changelog"]
    for necessary in ("configs/metadata.json", "LICENSE", "configs/train.json"):  # train.json: monai.bundle.load
        assert (bundle / necessary).is_file(), necessary
    assert [p.name for p in (bundle / "configs").glob("inference.*")] == ["inference.yaml"]
    assert "models/model.pt" in (bundle / "large_files.yml").read_text()


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> Path:
    """A model-zoo checkout: the bundle under ``models/<name>/`` (its files linked, a ``models/`` folder of its own),
    the zoo's root the working directory of every check, as the zoo's CI runs them."""
    from conftest import save_weights
    from monai.networks.nets import SwinUNETR

    root = tmp_path_factory.mktemp("model-zoo")
    bundle = root / "models" / NAME
    (bundle / "models").mkdir(parents=True)
    for item in ("configs", "scripts", "docs", "LICENSE", "large_files.yml"):
        (bundle / item).symlink_to(ROOT / item)
    # what the zoo downloads through large_files.yml before its checks: weights of the default network (untrained)
    save_weights(SwinUNETR(in_channels=1, out_channels=2, feature_size=48), bundle / "models" / "model.pt")
    return root


def test_verify_data_shape_on_the_inference_config_alone(zoo, monkeypatch, caplog):
    """The zoo's verify_data_shape: MONAI's verify_net_in_out on configs/inference.yaml alone, the default network
    (SwinUNETR feature size 48) at the metadata's 96^3 input, from the zoo's root with the bundle first on sys.path."""
    from monai.bundle import verify_net_in_out

    monkeypatch.chdir(zoo)
    monkeypatch.syspath_prepend(str(zoo / "models" / NAME))
    caplog.set_level(logging.INFO)
    bundle = f"models/{NAME}"
    verify_net_in_out(net_id="network_def", meta_file=f"{bundle}/configs/metadata.json",
                      config_file=f"{bundle}/configs/inference.yaml", bundle_root=bundle)  # fmt: skip
    assert "data shape of network is verified with no error" in caplog.text


def test_the_inference_config_alone_has_monais_inference_properties(zoo, monkeypatch):
    """verify_bundle's property check: create_workflow (which runs initialize) on the inference config alone, with the
    zoo's settings only: it builds the evaluator, so the network with its weights (checked), and nothing more: the
    CPU runtime's export and compilation wait for a run (scripts.inference.backends.prepare), none is written here."""
    from monai.bundle import create_workflow

    monkeypatch.chdir(zoo)
    bundle = f"models/{NAME}"
    monkeypatch.syspath_prepend(str(zoo / bundle))  # as the zoo's tests of bundles with scripts do
    workflow = create_workflow(workflow_type="inference", bundle_root=bundle,
                               config_file=f"{bundle}/configs/inference.yaml",
                               logging_file=f"{bundle}/configs/logging.conf",
                               meta_file=f"{bundle}/configs/metadata.json")  # fmt: skip
    assert workflow.check_properties() == []
    assert not (zoo / bundle / "runs").exists(), "initialize writes nothing"
    assert not list((zoo / bundle / "models").glob("*.onnx*")), "and exports nothing"


@pytest.fixture(scope="module")
def zoo_run(zoo, tiny_data) -> Path:
    """The zoo's unit-test pattern, from the zoo's root with the bundle on sys.path: train with configs/train.json and
    its overrides (one tiny epoch of the demo-sized network), evaluate with train.json + evaluate as a "train" workflow
    (its test_eval_config), infer with configs/inference.yaml ALONE -- each on the default backend (OpenVINO on
    this CPU): no setting the zoo would not pass."""
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(zoo)
        patch.syspath_prepend(str(zoo / "models" / NAME))
        bundle = f"models/{NAME}"
        files = {"meta_file": f"{bundle}/configs/metadata.json", "logging_file": f"{bundle}/configs/logging.conf"}
        network = {"bundle_root": bundle, "feature_size": 12, "roi_size": [64, 64, 32], "spacing": [2.0, 2.0, 3.0]}
        common = {**network, "dataset_dir": str(tiny_data / "data"), "prepared_dir": str(tiny_data / "prepared"),
                  "output_dir": str(zoo / "run"), "model_path": str(zoo / "run" / "model.pt"), "num_samples": 1,
                  "max_epochs": 1, "val_interval": 1, "num_workers": 0}  # fmt: skip
        check_workflow(ConfigWorkflow(workflow_type="train", config_file=f"{bundle}/configs/train.json", **files,
                                      **common))  # fmt: skip
        # the zoo runs evaluate on train.json as a "train" workflow (its test_eval_config)
        check_workflow(ConfigWorkflow(workflow_type="train", config_file=[f"{bundle}/configs/train.json",
                                      f"{bundle}/configs/evaluate.yaml"], **files, **common,
                                      eval_dir=str(zoo / "eval"), eval_pictures=0))  # fmt: skip
        check_workflow(ConfigWorkflow(workflow_type="infer", config_file=f"{bundle}/configs/inference.yaml", **files,
                                      **network, input_dir=str(tiny_data / "data"), output_dir=str(zoo / "infer"),
                                      model_path=str(zoo / "run" / "model.pt"), num_workers=0))  # fmt: skip
    return zoo


def test_train_evaluate_and_infer_run_as_the_zoo_runs_them(zoo_run):
    assert (zoo_run / "run" / "model.pt").is_file() and (zoo_run / "run" / "checkpoints" / "latest.pt").is_file()
    summary = json.loads((zoo_run / "eval" / "metrics_summary.json").read_text())
    assert summary["num_cases"] >= 1 and summary["failed"] == []
    report = json.loads((zoo_run / "infer" / "inference_report.json").read_text())
    assert report["num_done"] == 4 and report["num_failed"] == 0
    assert not (zoo_run / "models" / NAME / "runs").exists(), "nothing written into the bundle"
    assert (zoo_run / "models" / NAME / "models" / "model.pt").stat().st_size > 2e8, "the f48 weights left alone"

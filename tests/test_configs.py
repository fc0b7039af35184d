"""Bundle-level behaviour: the configs run through MONAI's own CLI, learn, resume exactly and fail fast."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest
import torch
from conftest import bundle_run, demo_args, train_workflow


def best_dice(stdout: str) -> float:
    match = re.search(r"best validation Dice ([0-9.]+) at epoch (\d+)", stdout)
    assert match, stdout[-3000:]
    return float(match.group(1))


def trained_epochs(output: str) -> list[int]:
    """Epochs whose training loop ran, from ignite/MONAI's 'Epoch[k] Complete' log lines."""
    return sorted({int(e) for e in re.findall(r"Epoch\[(\d+)\] Complete", output)})


def test_demo_learns_the_synthetic_tumour(demo_run):
    _, result, _ = demo_run
    assert best_dice(result.stdout) > 0.7  # the demo's target; measured 0.84 here


def test_demo_writes_only_under_its_run_folder(demo_run, root):
    tmp, _, before = demo_run
    assert (tmp / "run" / "model.pt").is_file()
    assert list((tmp / "run").glob("events.out.tfevents.*")), "TensorBoard logs"
    device = json.loads((tmp / "run" / "device_report.json").read_text())
    assert device["backend"] == "cpu" and "MIOPEN_FIND_MODE" not in device["settings"]
    state = torch.load(tmp / "run" / "checkpoints" / "latest.pt", weights_only=True)
    assert state["trainer"]["epoch"] == 10
    weights = root / "models" / "model.pt"
    assert (weights.stat().st_mtime_ns if weights.exists() else None) == before, "models/model.pt was touched"
    report = json.loads((tmp / "prepared" / "prepare_report.json").read_text())
    assert report["num_rejected"] == 0 and report["num_cases"] == 10


def test_resume_continues_the_epoch_count_and_matches_an_uninterrupted_run(tmp_path, root, demo_run):
    demo_tmp, _, _ = demo_run
    shared = {"dataset_dir": demo_tmp / "data", "prepared_dir": demo_tmp / "prepared"}
    # uninterrupted: 2 epochs
    straight = bundle_run(root, *demo_args(tmp_path / "a", max_epochs=2, **shared))
    assert straight.returncode == 0, straight.stderr[-3000:]
    # the same run killed during epoch 2 (started as model-zoo READMEs spell it: `run training`), then resumed
    latest = tmp_path / "b" / "run" / "checkpoints" / "latest.pt"
    args = demo_args(tmp_path / "b", max_epochs=2, **shared)
    command = [sys.executable, "-m", "monai.bundle", "run", "training", *args]
    crashed = subprocess.Popen(command, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while not latest.exists() and crashed.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    crashed.kill()
    crashed.wait()
    assert torch.load(latest, weights_only=True)["trainer"]["epoch"] == 1, "killed after epoch 1 was saved"
    second = bundle_run(root, *demo_args(tmp_path / "b", max_epochs=2, resume="true", **shared))
    assert second.returncode == 0, second.stderr[-3000:]
    log = second.stdout + second.stderr
    assert "resumed from" in log
    assert trained_epochs(log) == [2], "the resumed run trains epoch 2 only"
    a = torch.load(tmp_path / "a" / "run" / "checkpoints" / "latest.pt", weights_only=True)
    b = torch.load(tmp_path / "b" / "run" / "checkpoints" / "latest.pt", weights_only=True)
    assert a["trainer"] == b["trainer"] and b["trainer"]["epoch"] == 2
    for name, tensor in a["network"].items():
        torch.testing.assert_close(b["network"][name], tensor, msg=f"{name} differs after resume")
    assert a["lr_scheduler"] == b["lr_scheduler"]


def test_resume_without_a_checkpoint_starts_fresh(tmp_path, root, demo_run):
    demo_tmp, _, _ = demo_run
    shared = {"dataset_dir": demo_tmp / "data", "prepared_dir": demo_tmp / "prepared"}
    result = bundle_run(root, *demo_args(tmp_path, max_epochs=1, resume="true", **shared))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "starting from epoch 1" in result.stdout + result.stderr


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (["--roi_size", "[48,48,48]"], "multiple of 32"),
        (["--labels", "['Tumour']"], "not a segment of NSCLC-Radiomics"),
        (["--hu_window", "[500,-1000]"], "lower < upper"),
    ],
)
def test_wrong_config_values_fail_fast_with_what_to_change(tmp_path, root, override, message):
    result = bundle_run(root, *demo_args(tmp_path), *override, timeout=300)
    assert result.returncode != 0
    assert message in result.stderr + result.stdout
    assert not (tmp_path / "data").exists(), "the check runs before any data is generated"


def test_check_properties_pass_for_train_and_demo(demo_run, root):
    tmp, _, _ = demo_run
    for configs in (["configs/train.yaml"], ["configs/train.yaml", "configs/demo.yaml"]):
        workflow = train_workflow(root, configs, tmp, tmp / "props")
        assert workflow.check_properties() == []

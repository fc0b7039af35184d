"""train.yaml through MONAI's own CLI: the shipped demo learns, a killed run resumes exactly, and wrong settings fail
before any data is touched -- from a working directory that is not the bundle."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
import zygote
from conftest import (
    DEMO,
    DEMO_TEST_EPOCHS,
    MECHANICS_NETWORK,
    ROOT,
    bundle_run,
    demo_args,
    train_workflow,
    workflow_run,
)
from monai.bundle import ConfigWorkflow
from scripts.common.config import ConfigError


def causes(error: BaseException) -> list[BaseException]:
    """The error and the ones it was raised from (MONAI wraps a config expression's error in a RuntimeError)."""
    chain = [error]
    while chain[-1].__cause__ is not None:
        chain.append(chain[-1].__cause__)
    return chain


def best_dice(stdout: str) -> float:
    match = re.search(r"best validation Dice ([0-9.]+) at epoch (\d+)", stdout)
    assert match, stdout[-3000:]
    return float(match.group(1))


def trained_epochs(output: str) -> list[int]:
    """Epochs whose training loop ran, from ignite/MONAI's 'Epoch[k] Complete' log lines."""
    return sorted({int(e) for e in re.findall(r"SupervisedTrainer - INFO - Epoch\[(\d+)\] Complete", output)})


def test_demo_learns_the_synthetic_tumour(demo_run):
    _, result, _ = demo_run
    assert best_dice(result.stdout) > 0.85  # the demo's target, as shipped
    assert re.search(r"training data: cache (memory|gpu) \(cache auto", result.stdout), "the cache's place is logged"


def test_demo_writes_only_under_its_run_folder(demo_run, root):
    tmp, _, before = demo_run
    assert (tmp / "run" / "model.pt").is_file()
    assert list((tmp / "run").glob("events.out.tfevents.*")), "TensorBoard logs"
    device = json.loads((tmp / "run" / "device_report.json").read_text())
    assert device["backend"] == "cpu" and "MIOPEN_FIND_MODE" not in device["settings"]
    state = torch.load(tmp / "run" / "checkpoints" / "latest.pt", weights_only=True)
    assert state["trainer"]["epoch"] == DEMO_TEST_EPOCHS
    weights = root / "models" / "model.pt"
    assert (weights.stat().st_mtime_ns if weights.exists() else None) == before, "models/model.pt was touched"
    report = json.loads((tmp / "prepared" / "prepare_report.json").read_text())
    assert report["num_rejected"] == 0 and report["num_cases"] == 10


def test_validation_picture_reaches_tensorboard(demo_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tmp, _, _ = demo_run
    tags = []
    for events in (tmp / "run").glob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(events), size_guidance={"images": 0})
        accumulator.Reload()
        tags += accumulator.Tags()["images"]
    assert any(tag.startswith("validation/") for tag in tags), tags


def test_every_training_steps_loss_reaches_the_log_and_tensorboard_once(demo_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tmp, result, _ = demo_run
    logged = re.findall(r"Epoch: (\d+)/\d+, Iter: (\d+)/(\d+) -- train_loss: ([0-9.]+)", result.stdout)
    steps = int(logged[0][2])
    assert [(int(e), int(i)) for e, i, _, _ in logged] == [
        (e, i) for e in range(1, DEMO_TEST_EPOCHS + 1) for i in range(1, steps + 1)
    ], "each step once, in order, under its own epoch and step"
    scalars = []
    for events in (tmp / "run").glob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        scalars += accumulator.Scalars("train_loss") if "train_loss" in accumulator.Tags()["scalars"] else []
    assert [s.step for s in sorted(scalars, key=lambda s: s.step)] == list(range(1, len(logged) + 1))
    assert [round(s.value, 4) for s in sorted(scalars, key=lambda s: s.step)] == [float(v) for *_, v in logged]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, tiny_data) -> dict[str, Path | str]:
    """Two epochs straight through; the same run (started with --resume true and no checkpoint yet) killed during
    epoch 2; then resumed. Mechanics only: a few small cases, one patch per step."""
    demo_tmp = tiny_data
    tmp = tmp_path_factory.mktemp("resume")
    shared = {"dataset_dir": demo_tmp / "data", "prepared_dir": demo_tmp / "prepared", "max_epochs": 2,
              "network_def": MECHANICS_NETWORK}  # fmt: skip
    workflow_run(*demo_args(tmp / "a", **shared))  # the reference: straight through, in this process
    latest = tmp / "b" / "run" / "checkpoints" / "latest.pt"
    # started as model-zoo READMEs spell it: `run training`
    argv = ["run", "training", *demo_args(tmp / "b", resume="true", **shared), "--bundle_root", str(ROOT)]
    crashed = zygote.start(argv, tmp, dict(os.environ))  # a process of its own, forked from the tests' zygote
    deadline = time.monotonic() + 600
    while not latest.exists() and crashed.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    crashed.signal(signal.SIGKILL)
    crashed.wait()
    log = tmp / "killed.log"
    log.write_text("".join(crashed.output()))
    second = bundle_run(*demo_args(tmp / "b", resume="true", **shared))
    assert second.returncode == 0, second.stderr[-3000:]
    return {"a": tmp / "a", "b": tmp / "b", "killed_log": log.read_text(), "second_log": second.stdout + second.stderr}


def test_resume_continues_the_epoch_count_and_matches_an_uninterrupted_run(resumed):
    latest = resumed["b"] / "run" / "checkpoints" / "latest.pt"
    assert latest.exists()
    log = resumed["second_log"]
    assert "resumed from" in log
    assert trained_epochs(log) == [2], "the resumed run trains epoch 2 only"
    a = torch.load(resumed["a"] / "run" / "checkpoints" / "latest.pt", weights_only=True)
    b = torch.load(latest, weights_only=True)
    assert a["trainer"] == b["trainer"] and b["trainer"]["epoch"] == 2
    for name, tensor in a["network"].items():
        torch.testing.assert_close(b["network"][name], tensor, msg=f"{name} differs after resume")
    assert a["lr_scheduler"] == b["lr_scheduler"]


def test_resume_without_a_checkpoint_starts_fresh(resumed):
    assert "starting from epoch 1" in resumed["killed_log"]
    assert trained_epochs(resumed["killed_log"])[:1] == [1]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"roi_size": [48, 48, 48]}, "multiple of 32"),
        ({"labels": ["Tumour"]}, "not a segment of NSCLC-Radiomics"),
        ({"hu_window": [500, -1000]}, "lower < upper"),
    ],
)
def test_wrong_config_values_fail_fast_with_what_to_change(tmp_path, override, message):
    workflow = ConfigWorkflow(
        config_file=[str(ROOT / "configs" / c) for c in ("train.yaml", "demo.yaml")],
        workflow_type="train",
        bundle_root=str(ROOT),
        dataset_dir=str(tmp_path / "data"),
        **override,
    )
    workflow.initialize()  # light: only the seed, as for `monai.bundle load`
    with pytest.raises(RuntimeError) as raised:
        workflow.run()  # setup: the check is the first step after the bundle's Python is imported
    assert any(isinstance(e, ConfigError) and message in str(e) for e in causes(raised.value)), raised.value
    assert not (tmp_path / "data").exists(), "the check runs before any data is generated"


def test_a_wrong_value_ends_the_command_with_an_error_status(tmp_path):
    result = bundle_run(*demo_args(tmp_path), "--roi_size", "[48,48,48]", timeout=300)
    assert result.returncode != 0
    assert "multiple of 32" in result.stderr + result.stdout
    assert not (tmp_path / "data").exists(), "the check runs before any data is generated"


def test_a_wrong_bundle_root_says_what_to_pass(tmp_path):
    result = bundle_run("--config_file", DEMO, "--bundle_root", str(tmp_path), cwd=tmp_path, timeout=300)
    assert result.returncode != 0
    assert "scripts does not exist" in result.stderr and "--bundle_root" in result.stderr


def test_check_properties_pass_for_train_and_demo(demo_run):
    tmp, _, _ = demo_run
    for configs_ in (["train.yaml"], ["train.yaml", "demo.yaml"]):
        workflow = train_workflow(configs_, tmp, tmp / "props")
        assert workflow.check_properties() == []


def test_every_switch_is_read_once_as_a_boolean():
    """Each on/off id of every config is read by ``as_bool`` exactly once (in its flag#<id> entry, or where inference
    uses its own), in that config or in train.yaml, which the overrides are layered on (inference.yaml stands
    alone): a switch that skipped it would read "false" as true."""
    import yaml

    train_text = (ROOT / "configs" / "train.yaml").read_text()
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        text = path.read_text()
        inherited = "" if path.name in ("train.yaml", "inference.yaml") else train_text
        switches = [k for k, v in yaml.safe_load(text).items() if isinstance(v, bool) and "#" not in k]
        reads = {k: (text + inherited).count(f"@as_bool(@{k})") for k in switches}
        assert all(n == 1 for n in reads.values()), f"{path.name}: as_bool reads per switch {reads}"


def test_every_workflow_step_of_every_config_is_one_expression():
    """Each step of initialize, setup, run and finalize is a string (an expression or a reference): a step whose text
    holds ": " outside quotes would be read by YAML as a one-key mapping, and silently never run."""
    import yaml

    for path in sorted((ROOT / "configs").glob("*.yaml")):
        config = yaml.safe_load(path.read_text())
        for key in ("initialize", "setup", "run", "finalize", "+initialize", "+run"):
            steps = config.get(key) or []
            assert all(isinstance(step, str) for step in steps), f"{path.name}: {key} has a step that is not a string"

"""No documented command overwrites trained weights or a training state it did not create: on a trained run's folder,
profile, benchmark, evaluate and inference -- each given that folder as its output_dir and its weights as model_path,
the worst case -- leave model.pt and checkpoints/latest.pt byte for byte as they were. A new training into a folder
that holds another run's state says so in its first lines, naming each file and what keeps it; a resumed one does
not. Mechanics only: the small network on the tiny cases, a few steps, every command in this process."""

from __future__ import annotations

import hashlib
import logging
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import MECHANICS_NETWORK, configs, demo_args, workflow_run

TRAIN = configs("train.yaml", "demo.yaml")
PROTECTED = ("model.pt", "model.json", "checkpoints/latest.pt")


def digests(run: Path) -> dict[str, tuple[str, int, int]]:
    """Each protected file's content hash and its inode and modification time: the demo's training is deterministic,
    so a command that trained the same epochs again would write the same bytes, as a new file (written aside, then
    renamed) at a new time."""
    stats = {name: (run / name).stat() for name in PROTECTED}
    return {name: (hashlib.sha256((run / name).read_bytes()).hexdigest(), s.st_ino, s.st_mtime_ns)
            for name, s in stats.items()}  # fmt: skip


@contextmanager
def bundle_records() -> Iterator[list[logging.LogRecord]]:
    """The records the bundle's Python logs (``scripts.*``, INFO and above) while the block runs."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("scripts")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def notices(records: list[logging.LogRecord]) -> list[str]:
    return [r.getMessage() for r in records if r.name == "scripts.training.checkpoint" and r.levelno == logging.WARNING]


@pytest.fixture(scope="module")
def trained(tiny_data, tmp_path_factory) -> dict:
    """One epoch trained into ``run/`` (its best weights at the demo's model_path, ``run/model.pt``), then each
    command that must not train them run on that folder, the files' digests taken before and after each."""
    tmp = tmp_path_factory.mktemp("no_overwrite")
    data = {"dataset_dir": tiny_data / "data", "prepared_dir": tiny_data / "prepared", "network_def": MECHANICS_NETWORK}
    run = tmp / "run"
    with bundle_records() as first:
        workflow_run(*demo_args(tmp, max_epochs=1, **data))
    before = digests(run)
    after: dict[str, dict[str, str]] = {}
    logged: dict[str, list[logging.LogRecord]] = {}
    on_the_run = {"output_dir": run, "model_path": run / "model.pt"}
    # as the configs' headers spell them: profile and benchmark run `run`, evaluate its own id
    commands = {
        "profile": ([], configs("train.yaml", "demo.yaml", "profile.yaml"), {"profiler_schedule": "[0,1,1,1]"}),
        "benchmark": ([], configs("train.yaml", "demo.yaml", "benchmark.yaml"),
                      {"benchmark_warmup": 1, "benchmark_steps": 1, "benchmark_busy_steps": 0}),
        "evaluate": (["evaluate"], configs("train.yaml", "demo.yaml", "evaluate.yaml"), {"eval_pictures": 0}),
    }  # fmt: skip
    for name, (run_id, config_file, settings) in commands.items():
        with bundle_records() as logged[name]:
            workflow_run(*run_id, *demo_args(tmp, config_file=config_file, **data, **on_the_run, **settings))
        after[name] = digests(run)
    case = tiny_data / "data" / "NSCLC-Radiomics" / "LUNG1-004"
    with bundle_records() as logged["inference"]:
        workflow_run("inference", "--config_file", configs("inference.yaml", "demo.yaml"), "--input_dir", str(case),
                     "--output_dir", str(tmp / "inference"), "--model_path", str(run / "model.pt"), "--network_def",
                     MECHANICS_NETWORK, "--dataset_dir", str(data["dataset_dir"]), "--prepared_dir",
                     str(data["prepared_dir"]), "--num_workers", "0")  # fmt: skip
    after["inference"] = digests(run)
    return {"tmp": tmp, "run": run, "before": before, "after": after, "logged": logged, "first": first}


def test_profile_benchmark_evaluate_and_inference_leave_the_trained_weights_and_state_byte_for_byte(trained):
    run = trained["run"]
    for name, digest in trained["after"].items():
        assert digest == trained["before"], f"{name} rewrote {[k for k in digest if digest[k] != trained['before'][k]]}"
    # each command did its work, beside the training's files
    assert (run / "profiler" / "2-chrome_trace.json.gz").is_file()
    assert (run / "benchmark.json").is_file()
    assert (run / "eval" / "metrics.csv").is_file()
    assert list((trained["tmp"] / "inference").rglob("*_seg.nii.gz"))


def test_only_a_new_training_says_it_replaces_another_runs_state(trained):
    assert notices(trained["first"]) == [], "the first training found nothing to replace"
    for name, records in trained["logged"].items():
        assert notices(records) == [], f"{name} trains no weights: it has nothing to warn about"


@pytest.fixture
def copy_of_the_run(trained, tmp_path) -> Path:
    """The trained folder copied, so that a test that trains into it leaves the module's folder as it is."""
    shutil.copytree(trained["run"], tmp_path / "run", ignore=shutil.ignore_patterns("profiler", "eval", "*.onnx*"))
    return tmp_path


def test_a_new_training_into_a_trained_folder_names_what_it_replaces_in_its_first_lines(copy_of_the_run, tiny_data):
    tmp = copy_of_the_run
    run = tmp / "run"
    data = {"dataset_dir": tiny_data / "data", "prepared_dir": tiny_data / "prepared", "network_def": MECHANICS_NETWORK}
    before = digests(run)
    with bundle_records() as records:
        workflow_run(*demo_args(tmp, max_epochs=1, **data))
    checkpoint, weights = notices(records)
    assert [r.getMessage() for r in records[:2]] == [checkpoint, weights], "said first, before the data is read"
    assert checkpoint.startswith(f"{run / 'checkpoints' / 'latest.pt'} holds the training state of epoch 1 of another")
    assert "replaces it after its first epoch" in checkpoint and "--resume true to continue" in checkpoint
    assert weights.startswith(f"{run / 'model.pt'} holds weights this run did not train")
    assert "at its first validation" in weights and "--model_path" in weights
    replaced = digests(run)
    assert all(replaced[name] != before[name] for name in PROTECTED), "and replaced as it said"


def test_a_resumed_training_says_nothing(copy_of_the_run, tiny_data):
    tmp = copy_of_the_run
    data = {"dataset_dir": tiny_data / "data", "prepared_dir": tiny_data / "prepared", "network_def": MECHANICS_NETWORK}
    with bundle_records() as records:  # epoch 1 of 1 saved: resumed, nothing left to train
        workflow_run(*demo_args(tmp, max_epochs=1, resume="true", **data))
    assert notices(records) == [] and any(r.getMessage().startswith("resumed from") for r in records)

"""The cross-validation CLI's pieces without training: the post-processing decision, which folds a process trains
(one process, torchrun ranks, SLURM array tasks), what a fold's run inherits, when a fold counts as finished, and
the settings it refuses."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest
import torch
import yaml
from conftest import ROOT, configs
from scripts.evaluation import cross_validation as cv


def rows(dice: list[float], name: str = "GTV-1") -> list[dict]:
    return [{"case_id": f"c{i}", f"{name}_dice": d} for i, d in enumerate(dice)]


def test_the_largest_component_is_kept_only_when_it_raises_the_mean_out_of_fold_dice():
    raw, largest = rows([0.5, 0.7, float("nan")]), rows([0.6, 0.7, float("nan")])
    decision = cv.choose_postprocessing(largest, raw, ["GTV-1"], keep=1)
    assert decision["keep_largest_components"] == 1 and decision["candidate"] == 1
    assert decision["mean_dice_raw"] == pytest.approx(0.6)
    assert decision["mean_dice_largest_component"] == pytest.approx(0.65)
    assert cv.choose_postprocessing(raw, largest, ["GTV-1"], keep=2)["keep_largest_components"] == 0
    assert cv.choose_postprocessing(raw, raw, ["GTV-1"], keep=1)["keep_largest_components"] == 0, "a tie keeps raw"


def test_the_decision_averages_structures_per_case_and_reports_each():
    raw = [{"case_id": "a", "GTV-1_dice": 0.4, "Heart_dice": 0.9}, {"case_id": "b", "GTV-1_dice": 0.6}]
    raw[1]["Heart_dice"] = float("nan")  # nothing to find, nothing found
    decision = cv.choose_postprocessing(raw, raw, ["GTV-1", "Heart"], keep=1)
    assert decision["mean_dice_raw"] == pytest.approx((0.65 + 0.6) / 2)
    assert decision["per_structure"]["Heart"] == {"raw": 0.9, "largest_component": 0.9}


def test_one_process_trains_every_fold_torchrun_ranks_and_array_tasks_their_share(monkeypatch):
    for name in ("LOCAL_RANK", "WORLD_SIZE", "RANK", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(name, raising=False)
    assert cv._share([0, 1, 2, 3, 4]) == [0, 1, 2, 3, 4]
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert cv._share([0, 1, 2, 3, 4]) == [1, 3]
    for name in ("LOCAL_RANK", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "4")
    assert cv._share([0, 1, 2, 3, 4]) == [4]
    with pytest.raises(ValueError, match="SLURM_ARRAY_TASK_ID=4"):
        cv._share([0, 1])


def test_a_fold_under_torchrun_is_no_ddp_rank_and_sees_only_its_gpu(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    env = cv._fold_environment()
    assert not {"LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT", "TORCHELASTIC_RUN_ID"} & set(env)
    assert env["CUDA_VISIBLE_DEVICES"] == "6"


def test_a_fold_is_trained_by_this_python_unless_a_launcher_is_given(tmp_path, monkeypatch):
    """The default, which the end-to-end tests do not take (they give the tests' zygote or torchrun as the launcher):
    ``python -m monai.bundle run`` with this interpreter; a launcher's words in its place."""
    plan = cv.make_plan(configs("train.yaml", "demo.yaml"), str(tmp_path), {"bundle_root": str(ROOT)})
    commands = []
    monkeypatch.setattr(cv.subprocess, "run", lambda command, **_: commands.append(command) or SimpleNamespace(
        returncode=1))  # fmt: skip
    for launcher in (None, "torchrun --standalone --nproc_per_node=2"):
        with pytest.raises(cv.CrossValidationError, match="fold 0: training ended with status 1"):
            cv.train_fold(plan, 0, launcher)
    assert commands[0][:5] == [sys.executable, "-m", "monai.bundle", "run", "--config_file"]
    assert commands[1][:6] == ["torchrun", "--standalone", "--nproc_per_node=2", "-m", "monai.bundle", "run"]
    assert commands[0][1:] == commands[1][3:], "the same fold's run either way"


def test_folds_come_from_the_datalist_and_must_be_two_or_more(tmp_path):
    datalist = {"training": [{"fold": 1}, {"fold": 0}, {"fold": 1}]}
    assert cv.fold_ids(datalist, None, tmp_path) == [0, 1]
    assert cv.fold_ids(datalist, "1", tmp_path) == [1]
    with pytest.raises(ValueError, match=r"fold\(s\) \[3\]"):
        cv.fold_ids(datalist, [3], tmp_path)
    with pytest.raises(cv.CrossValidationError, match="at least 2"):
        cv.fold_ids({"training": [{"fold": 0}]}, None, tmp_path)


def test_a_fold_is_finished_when_its_checkpoint_reached_max_epochs_and_its_weights_exist(tmp_path):
    plan = cv.make_plan(configs("train.yaml", "demo.yaml"), str(tmp_path), {"bundle_root": str(ROOT)})
    folder = plan.fold_dir(0)
    demo_epochs = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())["max_epochs"]
    assert plan.max_epochs == demo_epochs and plan.labels == ["GTV-1"] and plan.keep == 1
    assert cv.checkpoint_epoch(folder) == 0
    (folder / "checkpoints").mkdir(parents=True)
    torch.save({"trainer": {"epoch": demo_epochs, "iteration": 50}}, folder / "checkpoints" / "latest.pt")
    with pytest.raises(cv.CrossValidationError, match="val_interval"):
        cv._check_finished(plan, 0)
    (folder / "model.pt").write_bytes(b"")
    cv._check_finished(plan, 0)
    assert cv.train_fold(plan, 0) == "skipped"
    torch.save({"trainer": {"epoch": 4, "iteration": 20}}, folder / "checkpoints" / "latest.pt")
    with pytest.raises(cv.CrossValidationError, match=f"trained 4 of {demo_epochs} epochs"):
        cv._check_finished(plan, 0)


def test_ids_set_per_fold_are_refused_and_the_default_folder_is_beside_the_run(tmp_path):
    with pytest.raises(ValueError, match="--fold is set per fold"):
        cv.make_plan(configs("train.yaml"), None, {"fold": 1})
    plan = cv.make_plan(configs("train.yaml"), None, {"output_dir": str(tmp_path / "run")})
    assert plan.root == tmp_path / "run" / "crossval"


def test_a_missing_datalist_is_an_error_when_folds_run_in_parallel(tmp_path):
    plan = cv.make_plan(configs("train.yaml"), str(tmp_path), {"dataset_dir": str(tmp_path / "data")})
    with pytest.raises(cv.CrossValidationError, match="prepare the data once"):
        cv._ensure_datalist(plan, prepare=False)


def test_the_summary_table_shows_folds_overall_the_decision_and_the_test_rows(tmp_path):
    stats = {"GTV-1_dice": {"mean": 0.8, "median": 0.81, "std": 0.05}}
    summary = {
        "num_folds": 2, "num_cases": 4, "labels": ["GTV-1"], "metrics": stats,
        "per_fold": {"0": {"num_cases": 2, "metrics": stats}, "1": {"num_cases": 2, "metrics": stats}},
        "postprocessing": {"mean_dice_raw": 0.79, "mean_dice_largest_component": 0.8, "candidate": 1,
                           "keep_largest_components": 1},
        "test": [{"variant": "ensemble + TTA", "models": 2, "passes_per_window": 16, "cases": 1, "mean_dice": 0.9,
                  "median_dice": 0.9, "mean_hd95_mm": 2.0, "mean_surface_dice": 0.95, "seconds_per_case": 3.0}],
    }  # fmt: skip
    table = cv.format_summary(summary)
    assert "| all | 4 | 0.8000 | 0.8100 | 0.0500 |" in table
    assert "0.7900 raw, 0.8000 keeping the 1 largest" in table and "| ensemble + TTA | 2 | 16 | 1 |" in table
    json.dumps(summary)  # what summary.json holds is plain JSON


def test_evaluation_in_this_process_leaves_out_the_configs_that_join_a_torchrun_group(tmp_path, monkeypatch):
    """The folds train under the launcher with every config; the evaluation runs in this process, which no launcher
    started: a config that sets distributed_setup (in YAML or JSON) is left out of it, one that leaves it null is
    kept."""
    from pathlib import Path

    joining = sorted(p.name for p in (ROOT / "configs").glob("*.yaml") if cv.joins_process_group(p))
    assert joining == ["multi_gpu_evaluate.yaml", "multi_gpu_train.yaml"]
    own = tmp_path / "my_cluster.json"
    own.write_text(json.dumps({"distributed_setup": "$@scripts.training.distributed.setup('gloo')", "max_epochs": 3}))
    kept = tmp_path / "my_settings.yaml"
    kept.write_text("distributed_setup: null\nmax_epochs: 3\n")
    assert cv.joins_process_group(own) and not cv.joins_process_group(kept)
    files = [str(ROOT / "configs" / n) for n in ("train.yaml", "demo.yaml", "multi_gpu_train.yaml")]
    plan = cv.make_plan(str([*files, str(own), str(kept)]), str(tmp_path / "cv"), {})
    assert plan.files == [*files, str(own), str(kept)], "the folds' trainings get every file"
    assert plan.eval_files == [*files[:2], str(kept)]
    given = []

    class Workflow:  # what the evaluation hands to MONAI
        def __init__(self, config_file, **_ids):
            given.append(config_file)

        def initialize(self):
            pass

        run = finalize = initialize

    monkeypatch.setattr("monai.bundle.ConfigWorkflow", Workflow)
    cv.evaluate_in_process(plan, tmp_path / "eval")
    assert [Path(f).name for f in given[0]] == ["train.yaml", "demo.yaml", "my_settings.yaml", "evaluate.yaml"]

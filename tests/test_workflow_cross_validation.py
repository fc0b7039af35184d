"""2-fold cross-validation of the demo network on small synthetic cases, end to end through the CLI, killed in fold 1
and run again: two fold folders, fold 0 not retrained and fold 1 resumed, out-of-fold metrics covering every training
case once, a post-processing decision with both numbers, an ensemble whose probabilities are the mean of its two
models', the models named in the DICOM SEG and the report, and one table for the test split."""

from __future__ import annotations

import copy
import csv
import json
import os
import re
import shlex
import shutil
import time

import highdicom as hd
import numpy as np
import pytest
import torch
import zygote
from conftest import MECHANICS_NETWORK, ROOT, TINY_CASES, TINY_SHAPE, configs, torchrun

MAX_EPOCHS = 2
# the demo network (as the issue asks), one patch per step, validation once at the end, one mirror axis for the TTA
# comparison
# PyTorch runs the folds' networks in evaluation (ONNX Runtime, the default on a CPU, would export each fold's
# weights first: tests/test_backends.py and test_workflow_inference.py cover that backend)
SETTINGS = {"num_samples": 1, "max_epochs": MAX_EPOCHS, "val_interval": MAX_EPOCHS, "demo_cases": 4,
            "tta_axes": "[0]", "eval_pictures": 1, "inference_backend": "torch"}  # fmt: skip


INFERENCE = [str(ROOT / "configs" / name) for name in ("inference.yaml", "demo.yaml")]


def trained_epochs(output: str) -> list[int]:
    return sorted({int(e) for e in re.findall(r"SupervisedTrainer - INFO - Epoch\[(\d+)\] Complete", output)})


@pytest.fixture(scope="module")
def cross_validated(small_cases, tmp_path_factory) -> dict:
    """Four small cases (three training cases in folds 0/1, one test case); the CV command killed once fold 1 has
    saved its first epoch, then run again to the end. The command and each fold's ``python -m monai.bundle`` are
    processes of their own forked from the tests' zygote (the folds by way of ``--launcher``, tests/zygote.py), which
    has imported torch and MONAI: each would spend ~7 s on those imports, five times."""
    from scripts.data.prepare import prepare

    data, truths = small_cases
    tmp = tmp_path_factory.mktemp("cross_validation")
    prepare(data, tmp / "prepared", num_folds=2, val_fraction=0.0, test_fraction=0.25, num_workers=1, progress=False)
    command = ["-m", "scripts.cross_validation", "run", "--config_file", configs("train.yaml", "demo.yaml"),
               "--output_dir", str(tmp / "cv"), "--dataset_dir", str(data), "--prepared_dir",
               str(tmp / "prepared")]  # fmt: skip
    for key, value in SETTINGS.items():
        command += [f"--{key}", str(value)]
    env, launch = dict(os.environ), zygote.launcher()
    if launch is not None:
        command += ["--launcher", shlex.join(launch[0])]
        env.update(launch[1])
    fold_1 = tmp / "cv" / "fold_1" / "checkpoints" / "latest.pt"
    first = zygote.start_python(command, ROOT, env, new_session=True)
    deadline = time.monotonic() + 1200
    while not fold_1.exists() and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    first.kill_group()  # the CLI and the fold it runs, in fold 1's second epoch
    first.wait()
    killed = "".join(first.output())
    fold_0 = tmp / "cv" / "fold_0"
    before = {p: p.read_bytes() for p in (fold_0 / "model.pt", fold_0 / "checkpoints" / "latest.pt")}
    second = zygote.run_python(command, ROOT, env, timeout=1800)
    assert second.returncode == 0, second.stdout[-4000:] + second.stderr[-4000:]
    datalist = json.loads((tmp / "prepared" / "datalist.json").read_text())
    return {"tmp": tmp, "cv": tmp / "cv", "truths": truths, "datalist": datalist, "fold_0_before": before,
            "killed": killed, "second": second.stdout + second.stderr}  # fmt: skip


def test_each_fold_trains_into_its_own_folder_and_a_killed_run_resumes_fold_1_only(cross_validated):
    cv = cross_validated["cv"]
    for fold in (0, 1):
        folder = cv / f"fold_{fold}"
        state = torch.load(folder / "checkpoints" / "latest.pt", weights_only=True)
        assert state["trainer"]["epoch"] == MAX_EPOCHS
        assert json.loads((folder / "model.json").read_text())["labels"] == ["GTV-1"]
        assert (folder / "model.pt").is_file()
    killed, second = cross_validated["killed"], cross_validated["second"]
    assert "fold 0: training" in killed and "fold 1: training" in killed
    assert f"fold 0: finished (epoch {MAX_EPOCHS} of {MAX_EPOCHS}), skipped" in second
    assert "fold 1: resuming after epoch 1" in second and "resumed from" in second
    assert trained_epochs(second) == [2], "the second run trains fold 1's second epoch and nothing else"
    for path, content in cross_validated["fold_0_before"].items():
        assert path.read_bytes() == content, f"{path} was rewritten: fold 0 was trained again"


def read_csv(path) -> list[dict]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def test_out_of_fold_metrics_cover_every_training_case_once_by_the_fold_that_did_not_see_it(cross_validated):
    cv, datalist = cross_validated["cv"], cross_validated["datalist"]
    rows = read_csv(cv / "cv" / "metrics.csv")
    folds = {d["case_id"]: d["fold"] for d in datalist["training"]}
    assert sorted(r["case_id"] for r in rows) == sorted(folds) and len(folds) == 3
    assert all(int(r["fold"]) == folds[r["case_id"]] for r in rows), "each case predicted by its own fold's model"
    summary = json.loads((cv / "cv" / "summary.json").read_text())
    assert summary["num_cases"] == 3 and sorted(summary["per_fold"]) == ["0", "1"]
    for group in [summary["metrics"], *(f["metrics"] for f in summary["per_fold"].values())]:
        assert {"mean", "median", "std"} <= set(group["GTV-1_dice"])
    assert summary["per_fold"]["0"]["num_cases"] + summary["per_fold"]["1"]["num_cases"] == 3
    variant = "" if summary["postprocessing"]["keep_largest_components"] else "raw"
    for row in rows:  # the pooled rows are the folds' own evaluations, in each CT's own space
        fold_rows = read_csv(cv / f"fold_{row['fold']}" / "oof" / variant / "metrics.csv")
        assert row["GTV-1_dice"] == next(r["GTV-1_dice"] for r in fold_rows if r["case_id"] == row["case_id"])
    worst = min(rows, key=lambda r: float(r["GTV-1_dice"]))["case_id"]
    assert [p.name for p in (cv / "cv" / "pictures").iterdir()] == [f"{worst}.png"]


def test_the_postprocessing_decision_and_both_numbers_are_in_the_ensembles_model_json(cross_validated):
    cv = cross_validated["cv"]
    info = json.loads((cv / "model.json").read_text())
    rows = read_csv(cv / "cv" / "metrics.csv")
    raw = np.nanmean([float(r["GTV-1_dice_raw"]) for r in rows])
    largest = np.nanmean([float(r["GTV-1_dice_largest_component"]) for r in rows])
    decision = info["postprocessing"]
    assert decision["mean_dice_raw"] == pytest.approx(raw, abs=1e-5)
    assert decision["mean_dice_largest_component"] == pytest.approx(largest, abs=1e-5)
    assert info["keep_largest_components"] == (1 if decision["mean_dice_largest_component"] > raw else 0)
    assert [m["path"] for m in info["models"]] == ["fold_0/model.pt", "fold_1/model.pt"]
    assert info["labels"] == ["GTV-1"]


@pytest.fixture(scope="module")
def ensemble_inference(cross_validated, tmp_path_factory) -> dict:
    """inference.yaml with --model_paths <cv folder> on the test case's DICOM series, in this process; the
    ensemble's input and output at each window are kept."""
    from monai.bundle import ConfigWorkflow

    tmp = tmp_path_factory.mktemp("ensemble_inference")
    case = cross_validated["datalist"]["test"][0]["case_id"]
    truth = next(t for t in cross_validated["truths"] if t["patient_id"] == case)
    shutil.copytree(truth["image_dir"], tmp / "in" / case)
    workflow = ConfigWorkflow(
        config_file=INFERENCE, workflow_type="infer",
        bundle_root=str(ROOT), input_dir=str(tmp / "in"), output_dir=str(tmp / "out"),
        model_paths=str(cross_validated["cv"]), num_workers=0, write_rtstruct=False, write_sr=False,
        inference_backend="torch",
    )  # fmt: skip
    workflow.initialize()
    network = workflow.parser.get_parsed_content("network")
    windows: list = []
    network.register_forward_hook(lambda _m, args, out: windows.append((args[0].clone(), out.clone())))
    workflow.run()
    return {"workflow": workflow, "case": case, "out": tmp / "out", "windows": windows}


@torch.no_grad()
def test_ensemble_inference_equals_the_mean_of_the_single_model_probabilities(ensemble_inference, cross_validated):
    from scripts.training.weights import load_weights

    workflow, windows = ensemble_inference["workflow"], ensemble_inference["windows"]
    assert len(windows) == 1, "the small case is one sliding window: its map is the window's"
    image, output = windows[0]
    template = workflow.parser.get_parsed_content("local_network")
    singles = []
    for fold in (0, 1):
        single = load_weights(copy.deepcopy(template), cross_validated["cv"] / f"fold_{fold}" / "model.pt").eval()
        singles.append(torch.softmax(workflow.parser.get_parsed_content("inferer")(image, single), 1))
    mean = (singles[0] + singles[1]) / 2
    torch.testing.assert_close(torch.softmax(output, 1), mean, atol=1e-5, rtol=0)
    assert (singles[0] - singles[1]).abs().max() > 1e-3, "the two folds' models differ"


def test_inference_applies_the_chosen_postprocessing_unless_overridden(ensemble_inference, cross_validated):
    from monai.bundle import ConfigWorkflow

    def last_step(workflow, id_="trained_postprocessing") -> tuple[int, tuple]:
        step = workflow.parser.get_parsed_content(id_)[-1].converter
        return step.num_components, tuple(step.applied_labels)

    chosen = json.loads((cross_validated["cv"] / "model.json").read_text())["keep_largest_components"]
    assert last_step(ensemble_inference["workflow"]) == ((1, (1,)) if chosen else (1, ()))
    explicit = ConfigWorkflow(config_file=INFERENCE, workflow_type=None,
                              bundle_root=str(ROOT), model_paths=str(cross_validated["cv"]),
                              keep_largest_components=2)  # fmt: skip
    assert last_step(explicit) == (2, (1,)), "--keep_largest_components wins over the folder's choice"
    deploy = explicit.parser.get_parsed_content("postprocessing").transforms[-1].converter
    assert deploy.num_components == 2, "MONAI Deploy's postprocessing id reads the config's value, never the folder"


def test_the_dicom_seg_and_the_report_name_the_models_used(ensemble_inference, cross_validated):
    out, case = ensemble_inference["out"], ensemble_inference["case"]
    seg = hd.seg.segread(out / case / f"{case}_seg.dcm")
    algorithm = seg.SegmentSequence[0].SegmentationAlgorithmIdentificationSequence
    parameters = hd.AlgorithmIdentificationSequence.from_sequence(algorithm).parameters
    assert parameters["num_models"] == "2" and parameters["tta"] == "none"
    for fold in (0, 1):
        assert f"fold_{fold}/model.pt (sha256 " in parameters["models"]
    report = json.loads((out / case / f"{case}_report.json").read_text())
    assert report["models"] == parameters
    assert json.loads((out / "inference_report.json").read_text())["models"] == parameters


def test_the_test_split_table_compares_fold_0_the_ensemble_and_the_ensemble_with_tta(cross_validated):
    cv = cross_validated["cv"]
    rows = read_csv(cv / "cv" / "test_comparison.csv")
    assert [r["variant"] for r in rows] == ["fold 0", "ensemble", "ensemble + TTA"]
    expected = [("1", "1", "1"), ("2", "2", "1"), ("2", "4", "1")]  # models, passes per window, cases
    assert [(r["models"], r["passes_per_window"], r["cases"]) for r in rows] == expected
    assert json.loads((cv / "cv" / "summary.json").read_text())["test"][2]["variant"] == "ensemble + TTA"
    assert "| ensemble + TTA | 2 | 4 | 1 |" in cross_validated["second"]


def test_folds_trained_under_torchrun_with_multi_gpu_train_are_evaluated_in_this_process(tiny_data, tmp_path):
    """docs/evaluation.md's DDP folds: each fold's training under torchrun with multi_gpu_train.yaml (one rank of gloo
    here), then the out-of-fold evaluation in the CLI's own process, which torchrun did not start, without that file.
    Mechanics only: the small network, one fold of the tiny cases (every fold is trained and evaluated alike; each
    costs a torchrun start), one epoch."""
    # torchrun with one rank, the rank forked from the tests' zygote (its command given after zygote.py --exec)
    launch, env = torchrun(["--standalone", "--nproc_per_node=1"], [])
    launcher = shlex.join(launch)
    command = ["-m", "scripts.cross_validation", "run", "--config_file",
               configs("train.yaml", "demo.yaml", "multi_gpu_train.yaml"), "--launcher", launcher, "--folds", "1",
               "--output_dir", str(tmp_path / "cv"), "--dataset_dir", str(tiny_data / "data"), "--prepared_dir",
               str(tiny_data / "prepared"), "--demo_cases", str(TINY_CASES), "--demo_shape", str(list(TINY_SHAPE)),
               "--network_def", MECHANICS_NETWORK, "--num_samples", "1", "--max_epochs", "1", "--val_interval", "1",
               "--eval_pictures", "0", "--inference_backend", "torch", "--compare_test", "false"]  # fmt: skip
    result = zygote.run_python(command, ROOT, env, timeout=600)  # the CLI forked from the zygote too
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert output.count("process group: rank 0 of 1, backend gloo") == 1, "the fold trained as a DDP rank"
    multi_gpu = str(ROOT / "configs" / "multi_gpu_train.yaml")
    assert f"evaluating in this process without {multi_gpu}: they join a torchrun process group" in output
    summary = json.loads((tmp_path / "cv" / "cv" / "summary.json").read_text())
    assert list(summary["per_fold"]) == ["1"] and summary["num_cases"] == 1

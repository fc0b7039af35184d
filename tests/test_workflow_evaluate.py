"""evaluate.yaml on the demo-trained network, through MONAI's CLI from a foreign working directory: one row per case
in each CT's own voxel space, Dice equal to a recount from the saved predictions, pictures of the worst cases."""

from __future__ import annotations

import csv
import json

import nibabel as nib
import numpy as np
import pytest
from conftest import bundle_run, configs, demo_args
from faults import INJECTED_OOM

DEMO_EVALUATE = configs("train.yaml", "demo.yaml", "evaluate.yaml")
# inference with the demo's weights: the demo's settings come from demo.yaml, layered as in training
DEMO_INFERENCE = configs("inference.yaml", "demo.yaml")


def dice(a: np.ndarray, b: np.ndarray) -> float:
    return 2.0 * np.logical_and(a, b).sum() / (a.sum() + b.sum())


@pytest.fixture(scope="module")
def evaluated(demo_run, tmp_path_factory):
    tmp, _, _ = demo_run
    eval_dir = tmp_path_factory.mktemp("eval")
    args = demo_args(tmp, shrink=False, config_file=DEMO_EVALUATE)
    # the first case runs out of memory (tests/faults.py): its prediction is stitched on the CPU, then scored like the
    # others
    result = bundle_run("evaluate", *args, "--eval_dir", str(eval_dir), "--save_predictions", "true",
                        "--eval_pictures", "1", "--sliding_window_inferer#_target_", "faults.OutOfMemoryOnce",
                        with_faults=True)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return tmp, eval_dir, result


def test_evaluate_writes_one_row_per_case_with_dice_equal_to_a_recount(evaluated):
    tmp, eval_dir, _ = evaluated
    datalist = json.loads((tmp / "prepared" / "datalist.json").read_text())
    rows = list(csv.DictReader((eval_dir / "metrics.csv").open()))
    assert sorted(r["case_id"] for r in rows) == sorted(d["case_id"] for d in datalist["validation"])
    for row in rows:
        case = row["case_id"]
        pred_file = eval_dir / "predictions" / case / f"{case}_seg.nii.gz"
        label_file = tmp / "prepared" / "labels" / f"{case}.nii.gz"
        pred, label = nib.load(pred_file), nib.load(label_file)
        # predictions are back on the CT's own grid, not the 2 mm training grid
        assert pred.shape == label.shape and np.allclose(pred.affine, label.affine, atol=1e-4)
        recount = dice(np.asarray(pred.dataobj) == 1, np.asarray(label.dataobj) == 1)
        assert float(row["GTV-1_dice"]) == pytest.approx(recount, abs=1e-5)
        assert float(row["GTV-1_hd95_mm"]) >= 0 and 0 <= float(row["GTV-1_surface_dice"]) <= 1
    summary = json.loads((eval_dir / "metrics_summary.json").read_text())
    assert summary["num_cases"] == len(rows) and not summary.get("failed")
    output = evaluated[2].stderr + evaluated[2].stdout
    assert output.count("out of memory in sliding-window inference") == 1, "the fallback ran, for one case"
    assert INJECTED_OOM in output, "the fallback's warning quotes the injected error"
    assert summary["metrics"]["GTV-1_dice"]["mean"] > 0.7  # the demo network finds the synthetic tumour


def test_evaluate_draws_the_worst_case(evaluated):
    _, eval_dir, _ = evaluated
    rows = list(csv.DictReader((eval_dir / "metrics.csv").open()))
    worst = min(rows, key=lambda r: float(r["GTV-1_dice"]))["case_id"]
    pictures = list((eval_dir / "pictures").glob("*.png"))
    assert [p.stem for p in pictures] == [worst]
    from PIL import Image

    image = np.asarray(Image.open(pictures[0]).convert("RGB"))
    assert image.shape[0] >= 256
    green = (image[..., 1] > 200) & (image[..., 0] < 80)
    assert green.sum() > 20, "the truth contour is drawn"

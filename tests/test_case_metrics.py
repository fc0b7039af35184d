"""The evaluation handler writes one row per case and a summary that agrees with it."""

from __future__ import annotations

import csv
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from monai.data import MetaTensor
from scripts.evaluation.case_metrics import CaseMetrics

R_MM, OFFSET_MM = 15.0, 8.0


def sphere(spacing, centre_mm, radius_mm=R_MM, extent_mm=80.0) -> np.ndarray:
    axes = [np.arange(int(extent_mm / s)) * s for s in spacing]
    grid = np.meshgrid(*axes, indexing="ij")
    return sum((g - c) ** 2 for g, c in zip(grid, centre_mm, strict=True)) <= radius_mm**2


def collect(handler: CaseMetrics, case_id: str, pred: np.ndarray, truth: np.ndarray, spacing) -> None:
    """One case through the handler as the evaluator hands it over: one-hot masks on an axis-aligned grid."""
    affine = torch.diag(torch.tensor([*spacing, 1.0]))

    def onehot(mask: np.ndarray) -> MetaTensor:
        return MetaTensor(torch.from_numpy(np.stack([1 - mask, mask])), affine=affine)

    state = SimpleNamespace(batch=[{"case_id": case_id}],  # MONAI keeps the inputs' keys in the batch
                            output=[{"pred": onehot(pred), "truth": onehot(truth)}])  # fmt: skip
    handler._collect(SimpleNamespace(state=state))


def test_handler_writes_one_row_per_case_and_a_summary(tmp_path):
    spacing = (1.0, 1.0, 3.0)
    handler = CaseMetrics(tmp_path, ["GTV-1"], tolerance_mm=3.0)
    truth = sphere(spacing, (40, 40, 40)).astype(np.float32)
    for case_id, offset in (("A", 0.0), ("B", OFFSET_MM)):
        collect(handler, case_id, sphere(spacing, (40 + offset, 40, 40)).astype(np.float32), truth, spacing)
    handler.write()
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    assert [r["case_id"] for r in rows] == ["A", "B"]
    assert float(rows[0]["GTV-1_dice"]) == 1.0 and float(rows[1]["GTV-1_dice"]) < 0.7
    summary = json.loads((tmp_path / "metrics_summary.json").read_text())
    dice = summary["metrics"]["GTV-1_dice"]
    assert dice["count"] == 2 and dice["mean"] == pytest.approx((1.0 + float(rows[1]["GTV-1_dice"])) / 2, abs=1e-5)


def test_rows_carry_the_tumour_measurements_of_prediction_and_truth(tmp_path):
    spacing = (1.0, 1.0, 3.0)
    truth = sphere(spacing, (40, 40, 40)).astype(np.float32)
    pred = truth.copy()
    pred[5:8, 5:8, 5:8] = 1  # a stray second piece
    handler = CaseMetrics(tmp_path, ["GTV-1"], tolerance_mm=3.0)
    collect(handler, "A", pred, truth, spacing)
    handler.write()
    row = next(csv.DictReader((tmp_path / "metrics.csv").open()))
    assert float(row["GTV-1_pred_components"]) == 2 and float(row["GTV-1_truth_components"]) == 1
    assert float(row["GTV-1_truth_long_axis_mm"]) == pytest.approx(2 * R_MM, abs=1.0)  # the sphere's diameter
    assert float(row["GTV-1_pred_max_3d_diameter_mm"]) >= float(row["GTV-1_truth_max_3d_diameter_mm"])

"""TODO docstring."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import ndimage
from scripts.evaluation.metrics import case_metrics, structure_metrics

R_MM, OFFSET_MM = 15.0, 8.0


def sphere(spacing, centre_mm, radius_mm=R_MM, extent_mm=80.0) -> np.ndarray:
    axes = [np.arange(int(extent_mm / s)) * s for s in spacing]
    grid = np.meshgrid(*axes, indexing="ij")
    return sum((g - c) ** 2 for g, c in zip(grid, centre_mm, strict=True)) <= radius_mm**2


def reference(pred: np.ndarray, truth: np.ndarray, spacing, tolerance_mm: float) -> tuple[float, float]:
    """HD95 (max of the two directed 95th percentiles) and surface Dice, straight from scipy distance maps."""

    def surface(mask):
        return mask & ~ndimage.binary_erosion(mask)

    sp, st = surface(pred), surface(truth)
    d_pred_to_truth = ndimage.distance_transform_edt(~st, sampling=spacing)[sp]
    d_truth_to_pred = ndimage.distance_transform_edt(~sp, sampling=spacing)[st]
    hd95 = max(np.percentile(d_pred_to_truth, 95), np.percentile(d_truth_to_pred, 95))
    within = (d_pred_to_truth <= tolerance_mm).sum() + (d_truth_to_pred <= tolerance_mm).sum()
    return float(hd95), float(within / (d_pred_to_truth.size + d_truth_to_pred.size))


@pytest.mark.parametrize("spacing", [(1.0, 1.0, 1.0), (1.0, 1.0, 3.0), (0.8, 0.8, 2.5)])
def test_offset_spheres_match_scipy_and_geometry(spacing):
    truth = sphere(spacing, (40, 40, 40))
    pred = sphere(spacing, (40 + OFFSET_MM, 40, 40))
    m = structure_metrics(pred, truth, spacing, tolerance_mm=3.0)

    # Dice of two equal spheres whose centres are d apart: lens volume / sphere volume
    lens = math.pi * (4 * R_MM + OFFSET_MM) * (2 * R_MM - OFFSET_MM) ** 2 / 12
    assert m["dice"] == pytest.approx(lens / (4 / 3 * math.pi * R_MM**3), abs=0.01)
    hd95, surface_dice = reference(pred, truth, np.asarray(spacing), 3.0)
    assert m["hd95_mm"] == pytest.approx(hd95, abs=1e-4)
    assert m["surface_dice"] == pytest.approx(surface_dice, abs=1e-5)
    # in mm, not voxels: the farthest surface point is OFFSET_MM away, whatever the grid
    assert 0.75 * OFFSET_MM < m["hd95_mm"] <= OFFSET_MM + 1e-3
    assert m["truth_ml"] == pytest.approx(4 / 3 * math.pi * R_MM**3 / 1000, rel=0.03)


def test_tolerance_beyond_the_offset_gives_surface_dice_one():
    spacing = (1.0, 1.0, 3.0)
    truth, pred = sphere(spacing, (40, 40, 40)), sphere(spacing, (40 + OFFSET_MM, 40, 40))
    assert structure_metrics(pred, truth, spacing, tolerance_mm=OFFSET_MM + 0.5)["surface_dice"] == pytest.approx(1.0)
    same = structure_metrics(truth, truth, spacing, tolerance_mm=0.0)
    assert (same["dice"], same["hd95_mm"], same["surface_dice"]) == (1.0, 0.0, 1.0)


def test_empty_masks_are_explicit():
    empty = np.zeros((20, 20, 20), bool)
    blob = empty.copy()
    blob[5:10, 5:10, 5:10] = True
    missed = structure_metrics(empty, blob, (1, 1, 1), 2.0)
    assert missed["dice"] == 0.0 and missed["surface_dice"] == 0.0 and math.isnan(missed["hd95_mm"])
    nothing = structure_metrics(empty, empty, (1, 1, 1), 2.0)
    assert math.isnan(nothing["dice"]) and nothing["pred_ml"] == 0.0


def test_case_metrics_per_structure_of_a_label_map():
    truth = np.zeros((30, 30, 10), np.uint8)
    truth[2:10, 2:10, 2:5] = 1
    truth[15:25, 15:25, 5:8] = 2
    pred = truth.copy()
    pred[pred == 2] = 0  # structure 2 missed entirely
    m = case_metrics(pred, truth, (1.0, 1.0, 3.0), ["GTV-1", "Heart"])
    assert m["GTV-1_dice"] == 1.0 and m["Heart_dice"] == 0.0
    assert m["Heart_truth_ml"] == pytest.approx(10 * 10 * 3 * 3.0 / 1000)

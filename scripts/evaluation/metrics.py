"""Per-case segmentation metrics in physical units, and the evaluator handler that writes them.

:func:`case_metrics` compares a predicted and a true label map of one case on the same voxel grid, structure by
structure (label ``i + 1`` = ``labels[i]``):

* ``dice`` -- 2|P∩T| / (|P| + |T|); NaN when both are empty (nothing to find, nothing found);
* ``hd95_mm`` -- the 95th-percentile Hausdorff distance in mm: for each surface voxel of one mask the distance to the
  nearest surface voxel of the other, the 95th percentile of each direction, the larger of the two (MONAI's
  definition); NaN when either mask is empty;
* ``surface_dice`` -- the fraction of both surfaces lying within ``tolerance_mm`` of the other surface (Nikolov et
  al. 2021); NaN when both are empty, 0 when exactly one is;
* ``truth_ml`` / ``pred_ml`` -- the volumes, which show at a glance whether a low Dice is a miss or a small lesion.

Distances use the voxel spacing from the affine, so a 1 x 1 x 3 mm grid is measured in mm, not in voxels.
:func:`summarize` gives mean, median, std and count per column; :mod:`scripts.evaluation.case_metrics` writes them per
case.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import numpy as np
import torch
from monai.metrics import compute_hausdorff_distance, compute_surface_dice
from scripts.common.geometry import voxel_volume_ml

METRICS = ("dice", "hd95_mm", "surface_dice", "truth_ml", "pred_ml")


def structure_metrics(pred: np.ndarray, truth: np.ndarray, spacing: Sequence[float], tolerance_mm: float) -> dict:
    """Metrics of one structure from two boolean masks on the same grid (see the module docstring)."""
    pred, truth = np.asarray(pred, dtype=bool), np.asarray(truth, dtype=bool)
    if pred.shape != truth.shape:
        raise ValueError(f"prediction shape {pred.shape} differs from the label shape {truth.shape}.")
    voxel_ml = voxel_volume_ml(spacing)
    n_pred, n_truth = int(pred.sum()), int(truth.sum())
    result = {"truth_ml": n_truth * voxel_ml, "pred_ml": n_pred * voxel_ml}
    if n_pred == 0 and n_truth == 0:
        return {"dice": math.nan, "hd95_mm": math.nan, "surface_dice": math.nan, **result}
    result["dice"] = 2.0 * int(np.logical_and(pred, truth).sum()) / (n_pred + n_truth)
    if n_pred == 0 or n_truth == 0:
        return {"hd95_mm": math.nan, "surface_dice": 0.0, **result}
    # MONAI wants one-hot batches [B, C, ...]: background channel + this structure, background excluded below
    p = torch.from_numpy(np.stack([~pred, pred])[None])
    t = torch.from_numpy(np.stack([~truth, truth])[None])
    spacing = [float(s) for s in spacing]
    with warnings.catch_warnings():  # MONAI 1.6 warns about its own internal use of a deprecated argument
        warnings.simplefilter("ignore", FutureWarning)
        result["hd95_mm"] = float(compute_hausdorff_distance(p, t, percentile=95, spacing=spacing)[0, 0])
        result["surface_dice"] = float(compute_surface_dice(p, t, [float(tolerance_mm)], spacing=spacing)[0, 0])
    return result


def case_metrics(
    pred: np.ndarray, truth: np.ndarray, spacing: Sequence[float], labels: Sequence[str], tolerance_mm: float = 3.0
) -> dict[str, float]:
    """Metrics of every structure of one case from two label maps (0 = background, ``i + 1`` = ``labels[i]``).

    Keys are ``"<label>_<metric>"``, e.g. ``"GTV-1_dice"``.
    """
    out: dict[str, float] = {}
    for index, name in enumerate(labels, start=1):
        values = structure_metrics(pred == index, truth == index, spacing, tolerance_mm)
        out.update({f"{name}_{metric}": values[metric] for metric in METRICS})
    return out


def summarize(rows: Sequence[dict], columns: Sequence[str]) -> dict[str, dict]:
    """Mean, median, std and count of each column over the cases, NaNs left out (``count`` says how many were not)."""
    summary = {}
    for column in columns:
        values = np.array([float(r[column]) for r in rows], dtype=float)
        finite = values[np.isfinite(values)]
        stats = {"count": int(finite.size), "nan": int(values.size - finite.size)}
        if finite.size:
            stats.update(mean=float(finite.mean()), median=float(np.median(finite)), std=float(finite.std()))
        summary[column] = stats
    return summary

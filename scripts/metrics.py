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
:class:`CaseMetrics` collects these per case during an evaluation run and writes ``metrics.csv`` (one row per case)
and ``metrics_summary.json`` (mean, median, std, count per column), plus a PNG per case or for the worst N cases.
"""

from __future__ import annotations

import csv
import logging
import math
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from ignite.engine import Engine, Events
from monai.metrics import compute_hausdorff_distance, compute_surface_dice

from scripts.distributed import is_rank0, world_size
from scripts.files import write_json, write_text

logger = logging.getLogger(__name__)

METRICS = ("dice", "hd95_mm", "surface_dice", "truth_ml", "pred_ml")


def spacing_of(affine: np.ndarray | torch.Tensor) -> tuple[float, ...]:
    """Voxel size in mm along each array axis: the lengths of the affine's first three columns."""
    affine = np.asarray(affine.cpu() if isinstance(affine, torch.Tensor) else affine, dtype=float)
    return tuple(float(v) for v in np.linalg.norm(affine[:3, :3], axis=0))


def structure_metrics(pred: np.ndarray, truth: np.ndarray, spacing: Sequence[float], tolerance_mm: float) -> dict:
    """Metrics of one structure from two boolean masks on the same grid (see the module docstring)."""
    pred, truth = np.asarray(pred, dtype=bool), np.asarray(truth, dtype=bool)
    if pred.shape != truth.shape:
        raise ValueError(f"prediction shape {pred.shape} differs from the label shape {truth.shape}.")
    voxel_ml = float(np.prod(spacing)) / 1000.0
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


class CaseMetrics:
    """Evaluator handler: per-case metrics (and pictures) in each case's original voxel space.

    Expects the evaluator's post-processed batch/output to hold, per case, ``pred`` and ``truth`` as one-hot or
    label-map tensors on the original image grid (MetaTensors: the truth's affine gives the spacing) and ``case_id``.
    Writes ``<output_dir>/metrics.csv``, ``<output_dir>/metrics_summary.json`` and, with ``pictures`` > 0, a PNG of
    the ``pictures`` cases with the lowest mean Dice to ``<output_dir>/pictures/`` (``pictures=-1``: every case).
    """

    def __init__(
        self,
        output_dir: str | Path,
        labels: Sequence[str],
        tolerance_mm: float = 3.0,
        pred_key: str = "pred",
        truth_key: str = "truth",
        pictures: int = 0,
        hu_window: Sequence[float] = (-1000, 500),
        enabled: bool | None = None,
    ) -> None:
        self.output_dir = Path(output_dir)
        self.labels = list(labels)
        self.tolerance_mm = float(tolerance_mm)
        self.pred_key, self.truth_key = pred_key, truth_key
        self.pictures = int(pictures)
        self.hu_window = tuple(hu_window)
        self.enabled = is_rank0() if enabled is None else enabled  # None: rank 0 writes (after gathering all ranks)
        self.rows: list[dict] = []
        self._png: dict[str, bytes] = {}

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.EPOCH_STARTED, self._reset)
        engine.add_event_handler(Events.ITERATION_COMPLETED, self._collect)
        engine.add_event_handler(Events.EPOCH_COMPLETED, self.write)

    def _reset(self, engine: Engine) -> None:
        self.rows, self._png = [], {}

    def _collect(self, engine: Engine) -> None:
        for item in merged_items(engine):
            pred, truth = _label_map(item[self.pred_key]), _label_map(item[self.truth_key])
            spacing = spacing_of(item[self.truth_key].affine)
            case_id = _case_id(item)
            row = {"case_id": case_id, **case_metrics(pred, truth, spacing, self.labels, self.tolerance_mm)}
            self.rows.append(row)
            logger.info("%s: %s", case_id, ", ".join(f"{k} {v:.4g}" for k, v in row.items() if k.endswith("_dice")))
            if self.pictures:
                self._png[case_id] = self._render(item, pred, truth)

    def _render(self, item: dict, pred: np.ndarray, truth: np.ndarray) -> bytes:
        from scripts.figures import png_bytes, render_case

        image = item.get("image")
        source = getattr(image, "meta", {}).get("filename_or_obj") if image is not None else None
        ct = _load_volume(source, truth.shape)
        affine = np.asarray(item[self.truth_key].affine, dtype=float)
        return png_bytes(render_case(ct, truth, pred, affine, self.hu_window, title=_case_id(item)))

    def write(self, engine: Engine | None = None) -> None:
        if world_size() > 1:  # each rank evaluated its own cases: rank 0 writes them all
            gathered: list = [None] * world_size()
            torch.distributed.all_gather_object(gathered, (self.rows, self._png))
            self.rows = sorted((r for rows, _ in gathered for r in rows), key=lambda r: r["case_id"])
            self._png = {k: v for _, png in gathered for k, v in png.items()}
        if not self.enabled or not self.rows:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        columns = [c for c in self.rows[0] if c != "case_id"]
        write_text(self.output_dir / "metrics.csv", _csv_text(self.rows, ["case_id", *columns]))
        summary = {
            "num_cases": len(self.rows),
            "labels": self.labels,
            "surface_dice_tolerance_mm": self.tolerance_mm,
            "metrics": summarize(self.rows, columns),
        }
        write_json(self.output_dir / "metrics_summary.json", summary)
        dice = {r["case_id"]: np.nanmean([r[f"{n}_dice"] for n in self.labels] or [np.nan]) for r in self.rows}
        worst = sorted(self._png, key=lambda c: (np.nan_to_num(dice[c], nan=2.0), c))
        if self.pictures > 0:
            worst = worst[: self.pictures]
        for case_id in worst:
            path = self.output_dir / "pictures" / f"{case_id}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(self._png[case_id])
        means = {c: s.get("mean") for c, s in summary["metrics"].items() if c.endswith(("_dice", "_hd95_mm"))}
        logger.info("%d cases: %s -> %s", len(self.rows), means, self.output_dir / "metrics.csv")
        shown = ", ".join(f"mean {k} {v:.4f}" for k, v in means.items() if v is not None)
        print(f"evaluated {len(self.rows)} cases: {shown}; per case: {self.output_dir / 'metrics.csv'}")


def merged_items(engine: Engine) -> list[dict]:
    """Per case, the evaluator's batch and output dicts in one (MONAI keeps ``case_id`` and other inputs in the batch,
    the network's ``image``/``pred`` and keys made by post-processing in the output)."""
    batch, output = engine.state.batch, engine.state.output
    if not isinstance(output, list):
        batch, output = [batch], [output]
    if not isinstance(batch, list) or len(batch) != len(output):
        return [dict(o) for o in output]
    return [{**b, **o} for b, o in zip(batch, output, strict=True)]


def _label_map(tensor) -> np.ndarray:
    """A label map [X, Y, Z] from a one-hot [C, X, Y, Z] or a label map [1, X, Y, Z] tensor."""
    array = np.asarray(tensor.detach().cpu() if isinstance(tensor, torch.Tensor) else tensor)
    if array.ndim == 4 and array.shape[0] > 1:
        return array.argmax(0).astype(np.uint8)
    return array.reshape(array.shape[-3:]).astype(np.uint8)


def _case_id(item: dict) -> str:
    case_id = item.get("case_id")
    if case_id is None:
        meta = getattr(item.get("image"), "meta", {})
        case_id = Path(str(meta.get("filename_or_obj", "case"))).name.split(".")[0]
    return str(case_id)


def _load_volume(source, shape: tuple[int, ...]) -> np.ndarray | None:
    """The original CT (HU) for a picture, or None when it cannot be read (the picture then shows masks only)."""
    if not source:
        return None
    try:
        import nibabel as nib

        volume = np.asarray(nib.load(str(source)).dataobj)
        return volume if volume.shape == tuple(shape) else None
    except Exception as err:  # a picture must never fail an evaluation
        logger.warning("%s: cannot read the CT for a picture (%s)", source, err)
        return None


def _csv_text(rows: Sequence[dict], columns: Sequence[str]) -> str:
    import io

    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(columns), lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})
    return buffer.getvalue()

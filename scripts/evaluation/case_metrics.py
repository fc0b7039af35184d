"""The evaluator handler behind ``configs/evaluate.yaml``: per-case metrics in each case's original voxel space.

:class:`CaseMetrics` collects :func:`scripts.evaluation.metrics.case_metrics` per case during an evaluation run and
writes ``metrics.csv`` (one row per case: Dice, HD95, surface Dice, volumes, and the tumour report's RECIST axes, 3D
diameter and component count of the prediction and of the truth) and ``metrics_summary.json`` (mean, median, std,
count per column), plus a PNG per case or for the worst N cases (:mod:`scripts.inference.figures`). Under DDP each rank
evaluates its own cases and rank 0 gathers and writes them all.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from ignite.engine import Engine, Events
from scripts.common.files import csv_text, write_json, write_text
from scripts.common.geometry import spacing_of
from scripts.evaluation.metrics import case_metrics, summarize
from scripts.inference.figures import png_bytes, render_case
from scripts.inference.outputs import original_ct
from scripts.inference.records import case_id_of, label_map, merged_items
from scripts.inference.report import tumour_report
from scripts.training.distributed import is_rank0, world_size

logger = logging.getLogger(__name__)


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
        models: dict | None = None,
    ) -> None:
        self.output_dir = Path(output_dir)
        self.models = dict(models or {})  # what made the predictions (weights, backend, precision): into the summary
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
            pred, truth = label_map(item[self.pred_key]), label_map(item[self.truth_key])
            spacing = spacing_of(item[self.truth_key].affine)
            case_id = case_id_of(item)
            row = {"case_id": case_id, **case_metrics(pred, truth, spacing, self.labels, self.tolerance_mm)}
            affine = np.asarray(item[self.truth_key].affine, dtype=float)
            row.update(measurement_columns(pred, truth, affine, self.labels))
            self.rows.append(row)
            logger.info("%s: %s", case_id, ", ".join(f"{k} {v:.4g}" for k, v in row.items() if k.endswith("_dice")))
            if self.pictures:
                self._png[case_id] = self._render(item, pred, truth)

    def _render(self, item: dict, pred: np.ndarray, truth: np.ndarray) -> bytes:
        image = item.get("image")
        source = getattr(image, "meta", {}).get("filename_or_obj") if image is not None else None
        ct = original_ct(source, "nifti", truth.shape)[0] if source else None  # None: the masks on black
        affine = np.asarray(item[self.truth_key].affine, dtype=float)
        return png_bytes(render_case(ct, truth, pred, affine, self.hu_window, title=case_id_of(item)))

    def write(self, engine: Engine | None = None) -> None:
        failed = list(getattr(engine, "failures", []))  # cases the evaluator recorded and skipped (CaseByCaseEvaluator)
        if world_size() > 1:  # each rank evaluated its own cases: rank 0 writes them all
            gathered: list = [None] * world_size()
            torch.distributed.all_gather_object(gathered, (self.rows, self._png, failed))
            self.rows = sorted((r for rows, _, _ in gathered for r in rows), key=lambda r: r["case_id"])
            self._png = {k: v for _, png, _ in gathered for k, v in png.items()}
            failed = [f for _, _, fails in gathered for f in fails]
        if not self.enabled or not (self.rows or failed):
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        columns = [c for c in self.rows[0] if c != "case_id"] if self.rows else []
        write_text(self.output_dir / "metrics.csv", csv_text(self.rows, ["case_id", *columns]))
        summary = {
            "num_cases": len(self.rows),
            "labels": self.labels,
            "surface_dice_tolerance_mm": self.tolerance_mm,
            "metrics": summarize(self.rows, columns),
            "failed": failed,  # cases not evaluated: stage and reason (the command exits with status 1)
        }
        if self.models:
            summary["models"] = self.models
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
        print(f"evaluated {len(self.rows)} cases: {shown}; per case: {self.output_dir / 'metrics.csv'}"
              + (f"; {len(failed)} failed (see metrics_summary.json)" if failed else ""))  # fmt: skip


#: the tumour report's numbers that metrics.csv carries for the prediction and the truth (scripts/inference/report.py)
REPORT_COLUMNS = ("components", "long_axis_mm", "short_axis_mm", "max_3d_diameter_mm")


def measurement_columns(pred: np.ndarray, truth: np.ndarray, affine: np.ndarray, labels: list[str]) -> dict:
    """``<label>_pred_<measure>`` and ``<label>_truth_<measure>`` of :data:`REPORT_COLUMNS`: whether the predicted
    tumour has the truth's RECIST axes, 3D diameter and number of pieces, beside its Dice."""
    columns = {}
    for kind, volume in (("pred", pred), ("truth", truth)):
        for name, measured in tumour_report(volume, None, affine, labels).items():
            columns.update({f"{name}_{kind}_{m}": float(measured[m]) for m in REPORT_COLUMNS})
    return columns

"""What inference writes per case, and the line it prints at the end.

:class:`SaveCased` writes ``<output_dir>/<case>/<case>_seg.nii.gz`` on the input's own grid and, for DICOM input,
the DICOM objects of :mod:`scripts.writers` (``<case>_seg.dcm``); :class:`InferenceSummary` times the cases.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from ignite.engine import Engine, Events
from monai.transforms import MapTransform

from scripts.files import save_nifti
from scripts.geometry import voxel_volume_ml
from scripts.writers.seg import algorithm_identification, write_dicom_seg

logger = logging.getLogger(__name__)


class SaveCased(MapTransform):
    """Write the label map under ``keys`` as NIfTI and, for DICOM input, as a DICOM SEG referencing the CT."""

    def __init__(
        self,
        keys,
        output_dir: str | Path,
        labels: Sequence[str],
        write_seg: bool = True,
        algorithm_version: str = "0.1.0",
        enabled: bool = True,
        allow_missing_keys: bool = False,
    ) -> None:
        super().__init__(keys, allow_missing_keys)
        self.enabled = enabled
        self.output_dir = Path(output_dir)
        self.labels = list(labels)
        self.write_seg = write_seg
        self.algorithm = algorithm_identification(algorithm_version)

    def __call__(self, data: Mapping[Hashable, Any]) -> dict:
        d = dict(data)
        if not self.enabled:
            return d
        case_id = str(d["case_id"])
        folder = self.output_dir / case_id
        folder.mkdir(parents=True, exist_ok=True)
        for key in self.key_iterator(d):
            tensor = d[key]
            labels = np.asarray(tensor.detach().cpu()).reshape(tensor.shape[-3:]).astype(np.uint8)
            affine = np.asarray(tensor.meta.get("original_affine", tensor.affine), dtype=float)
            nifti_path = folder / f"{case_id}_seg.nii.gz"
            save_nifti(nifti_path, labels, affine)
            outputs = {"nifti": str(nifti_path)}
            if self.write_seg and d.get("source") == "dicom":
                seg_path = folder / f"{case_id}_seg.dcm"
                write_dicom_seg(labels, d["source_path"], self.labels, seg_path, self.algorithm)
                outputs["dicom_seg"] = str(seg_path)
            voxel_ml = voxel_volume_ml(affine)
            volumes = {n: round(float((labels == i).sum()) * voxel_ml, 3) for i, n in enumerate(self.labels, start=1)}
            logger.info("%s: %s, volumes (ml) %s", case_id, ", ".join(outputs.values()), volumes)
            d[f"{key}_files"] = outputs
        return d


class InferenceSummary:
    """Evaluator handler: times each case and prints one line at the end (cases, seconds per case, output folder)."""

    def __init__(self, output_dir: str | Path) -> None:
        self.output_dir = Path(output_dir)
        self.times: list[float] = []
        self._start = self._case_start = 0.0

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.STARTED, self._started)
        engine.add_event_handler(Events.ITERATION_STARTED, self._case_started)
        engine.add_event_handler(Events.ITERATION_COMPLETED, self._case_done)
        engine.add_event_handler(Events.COMPLETED, self._completed)

    def _started(self, engine: Engine) -> None:
        self._start, self.times = time.perf_counter(), []

    def _case_started(self, engine: Engine) -> None:
        self._case_start = time.perf_counter()

    def _case_done(self, engine: Engine) -> None:
        self.times.append(time.perf_counter() - self._case_start)

    def _completed(self, engine: Engine) -> None:
        total = time.perf_counter() - self._start
        per_case = total / max(len(self.times), 1)
        report = self.output_dir / "inference_report.json"
        skipped = len(json.loads(report.read_text()).get("skipped", [])) if report.is_file() else 0
        print(
            f"inferred {len(self.times)} case(s) in {total:.1f} s ({per_case:.1f} s per case, loading included) "
            f"-> {self.output_dir}; skipped {skipped} (see {report.name})"
        )

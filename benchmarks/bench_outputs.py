"""Benchmark of the seconds around the network: a chest CT through ``configs/inference.yaml`` with every output on
(NIfTI, DICOM SEG, RTSTRUCT, SR, the tumour report and its picture), the network replaced by an oracle.

The case is the chest phantom of :func:`scripts.data.synthetic.write_chest_case` (512 x 512 x 100 of 0.98 mm, 3 mm
slices, as DICOM, the tumour of ``--pathology``). The oracle gives, inside the thorax region the shipped inferer finds,
the logits a network gives on it, for each of ``--masks``:

* ``tumour``: a trained network's -- sure tumour inside the phantom's analytic tumour, falling off over a few mm at its
  surface, sure background elsewhere, and one small false-positive blob 30 mm away that the largest-component step must
  remove;
* ``thorax``: weights that do not fit the input (random ones mark the whole thorax as tumour): tumour wherever the CT is
  denser than -500 HU (body; the lungs' air holes in it), but for a vessel 2 mm across every 5 mm -- tens of thousands
  of outline points per slice, the mask the report's short axis once took 45 s on. It must be flagged as implausible.

Everything else is the shipped pipeline: the reading, the preprocessing, the region, the post-processing (softmax,
inversion onto the CT's grid, argmax, largest component) and every writer. So the table is what a case costs besides
its network, stage by stage, transform by transform and output by output (:attr:`scripts.inference.outputs.SaveCased.
last_seconds`: each output's own seconds, which overlap when the writers run side by side), a row per mask::

    python -m benchmarks.bench_outputs [--slices 100] [--pathology none] [--repeats 3] [--masks tumour,thorax]
                                       [--outputs all] [--workers N] [--output_dir DIR]

``--outputs all``: every writer ``configs/inference.yaml`` turns on by default; ``--outputs kit``: the NIfTI and the
DICOM SEG alone, what the GPU kit's full-CT inference writes (``benchmarks/gpu_proof.py``). ``--workers``: how many
writers :class:`scripts.inference.outputs.SaveCased` runs side by side (1: one after the other; default: its own).

Each repeat runs the case again in the same process (the first pays Python's and the libraries' first calls, and is
reported apart). It also checks what was written: the tumour's volume against the phantom's analytic one, and that
the thorax is flagged.
"""

from __future__ import annotations

import contextlib
import cProfile
import csv
import json
import pstats
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scripts.inference.inferers import FallbackSlidingWindowInferer

ROOT = Path(__file__).resolve().parents[1]
#: the oracle's false positive: a sphere of this radius (mm), this far (mm, LPS) from the tumour's centre
BLOB_RADIUS_MM, BLOB_OFFSET_MM = 5.0, (0.0, 0.0, 30.0)
#: the thorax mask: tumour where the CT is above this (HU), but for vessels every VESSEL_PERIOD_MM (about 2 mm across)
BODY_HU, VESSEL_PERIOD_MM = -500.0, 5.0
MASKS = ("tumour", "thorax")
#: the writers' switches of each ``--outputs`` choice (``kit``: as benchmarks.gpu_proof's full-CT runs set them)
OUTPUTS = {"all": {}, "kit": {"write_rtstruct": False, "write_sr": False, "write_report": False}}


class OracleInferer(FallbackSlidingWindowInferer):
    """The shipped inferer (its region, its placement of the region's output in the whole grid) with the windows'
    network replaced by logits computed at each voxel's centre in LPS mm: from the phantom's truth (``mask``
    "tumour") or from the CT itself ("thorax", see the module docstring)."""

    def __init__(self, truth: dict, mask: str = "tumour", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if mask not in MASKS:
            raise ValueError(f"mask={mask!r}: choose among {MASKS}.")
        self.truth, self.mask = truth, mask
        self._whole: torch.Tensor | None = None

    def __call__(self, inputs: torch.Tensor, network: Any, *args: Any, **kwargs: Any):
        self._whole = inputs
        return super().__call__(inputs, network, *args, **kwargs)

    def _run(self, inputs: torch.Tensor, network: Any, *args: Any, **kwargs: Any):
        if self._whole is not None and tuple(inputs.shape) == tuple(self._whole.shape):
            return self._logits(self._whole, tuple(slice(0, n) for n in inputs.shape[2:]))
        return torch.zeros((inputs.shape[0], 2, *inputs.shape[2:]))  # replaced by _place below

    def _place(self, output: torch.Tensor, box: Any, inputs: torch.Tensor) -> torch.Tensor:
        full = super()._place(output, box, inputs)
        full[(slice(None), slice(None), *box.slices())] = self._logits(inputs, box.slices())
        return full

    def _logits(self, inputs: torch.Tensor, box: tuple[slice, ...]) -> torch.Tensor:
        ras = np.asarray(inputs.affine, float).reshape(-1, 4, 4)[0]
        axes = [np.arange(s.start, s.stop, dtype=float) for s in box]
        grid = np.stack(np.meshgrid(*axes, indexing="ij"), axis=-1)
        lps = (grid @ ras[:3, :3].T + ras[:3, 3]) * np.array([-1.0, -1.0, 1.0])
        if self.mask == "thorax":
            hu = (
                np.asarray(inputs[0, 0][box].float().cpu()) * (self.hu_window[1] - self.hu_window[0])
                + self.hu_window[0]
            )
            waves = np.sin(2 * np.pi * lps[..., 0] / VESSEL_PERIOD_MM) * np.sin(
                2 * np.pi * lps[..., 1] / VESSEL_PERIOD_MM
            )
            tumour = np.where((hu > BODY_HU) & (waves <= 0.5), 12.0, -12.0)
            return torch.from_numpy(np.stack([np.zeros_like(tumour), tumour])[None].astype(np.float32))
        centre = np.asarray(self.truth["tumour_centre_lps"], float)
        radii = np.asarray(self.truth["tumour_radii_mm"], float)
        inside = 1.0 - np.sqrt((((lps - centre) / radii) ** 2).sum(-1))  # > 0 inside, ~ mm / radius outside
        blob = 1.0 - np.linalg.norm(lps - centre - np.asarray(BLOB_OFFSET_MM), axis=-1) / BLOB_RADIUS_MM
        tumour = np.clip(np.maximum(inside * radii.mean(), blob * BLOB_RADIUS_MM) * 2.0, -12.0, 12.0)
        logits = np.stack([np.zeros_like(tumour), tumour])[None].astype(np.float32)
        return torch.from_numpy(logits)


def main(
    slices: int = 100,
    pathology: str = "none",
    repeats: int = 3,
    output_dir: str | None = None,
    profile: bool = False,
    masks: str | tuple = MASKS,
    outputs: str = "all",
    workers: int | None = None,
) -> dict:
    """Write the case, run it ``repeats`` + 1 times for each of ``masks``, print the seconds per stage and per
    transform (``profile``: and cProfile's 40 costliest calls of each mask's last run)."""
    from scripts.data.synthetic import write_chest_case

    masks = tuple(m.strip() for m in masks.split(",")) if isinstance(masks, str) else tuple(masks)
    if outputs not in OUTPUTS:
        raise ValueError(f"outputs={outputs!r}: choose among {sorted(OUTPUTS)}.")
    folder = Path(output_dir) if output_dir else Path(tempfile.mkdtemp(prefix="bench_outputs_"))
    try:
        truth = write_chest_case(folder / "in", "P1", (512, 512, int(slices)), pathology=pathology, seed=3)
        weights = _weights(folder / "models" / "model.pt")
        results = {}
        for mask in masks:
            runs = [_run(folder, weights, truth, mask, f"{mask}-{r}", profile and r == repeats, OUTPUTS[outputs],
                         workers) for r in range(int(repeats) + 1)]  # fmt: skip
            results[mask] = _summary(runs, truth)
        result = {"slices": int(slices), "outputs": outputs, "workers": workers, "masks": results}
        print(format_result(result))
        return result
    finally:
        if not output_dir:
            shutil.rmtree(folder, ignore_errors=True)


def _run(
    folder: Path, weights: Path, truth: dict, mask: str, name: str, profile: bool, writers: dict, workers: int | None
) -> dict:
    """One run of the case through ``configs/inference.yaml`` with the oracle for ``mask``: its seconds, stages and
    transforms, the tumour it wrote and its flags."""
    from monai.bundle import ConfigWorkflow

    out = folder / "out" / name
    workflow = ConfigWorkflow(config_file=str(ROOT / "configs" / "inference.yaml"), workflow_type=None,
                              bundle_root=str(ROOT), input_dir=str(folder / "in"), output_dir=str(out),
                              model_path=str(weights), inference_backend="torch", num_workers=0,
                              feature_size=12, **writers)  # fmt: skip
    workflow.initialize()
    parser = workflow.parser
    settings = dict(parser["sliding_window_inferer"])  # the shipped inferer's settings, resolved below
    kwargs = {k: parser.get_parsed_content(f"sliding_window_inferer#{k}") for k in settings if k != "_target_"}
    parser["sliding_window_inferer"] = OracleInferer(truth, mask, **kwargs)
    if workers is not None:
        parser["save_case#workers"] = int(workers)
    transforms = _timed(parser)
    save_case = parser.get_parsed_content("save_case")  # the writer the evaluator's post-processing ends with
    profiler = cProfile.Profile() if profile else None
    start = time.perf_counter()
    with profiler or contextlib.nullcontext():
        workflow.run()
    total = time.perf_counter() - start
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("cumulative").print_stats("scripts|pydicom|highdicom|PIL|nibabel", 45)
    workflow.finalize()
    (case,) = json.loads((out / "inference_report.json").read_text())["cases"]
    if case.get("status") != "done":
        raise RuntimeError(f"the case failed: {case}")
    tumour_ml = _tumour_ml(out)
    shutil.rmtree(out / "P1", ignore_errors=True)  # a thorax's RTSTRUCT is ~100 MB: keep the disk to one run's
    return {"total_s": total, "stages": case["stage_seconds"], "transforms": dict(transforms),
            "outputs": dict(save_case.last_seconds), "tumour_ml": tumour_ml,
            "flags": case.get("flags", [])}  # fmt: skip


def _weights(path: Path) -> Path:
    """Weights for the (unused) network the bundle loads and records: SwinUNETR f12, with the labels they are for."""
    from monai.networks.nets import SwinUNETR
    from scripts.training.weights import save_weights

    return save_weights(SwinUNETR(in_channels=1, out_channels=2, feature_size=12), path, ["GTV-1"])


def _timed(parser: Any) -> dict[str, float]:
    """Wrap each post-processing transform (the list the evaluator's post-processing is built from) so its seconds add
    up under its class name; the writers' seconds are the report's ``write`` stage."""
    seconds: dict[str, float] = {}
    transforms = parser.get_parsed_content("trained_postprocessing")  # resolved once: the evaluator gets this list
    for i, transform in enumerate(transforms):
        transforms[i] = _Timed(transform, seconds)
    return seconds


class _Timed:
    """A transform whose seconds add up in ``seconds`` under its class name; the attributes the evaluator reads
    (``stage``, ``enabled``) are the transform's."""

    def __init__(self, transform: Any, seconds: dict[str, float]) -> None:
        self._transform, self._seconds = transform, seconds
        self._name = type(transform).__name__

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transform, name)

    def __call__(self, data: Any) -> Any:
        clock = time.perf_counter()
        try:
            return self._transform(data)
        finally:
            self._seconds[self._name] = self._seconds.get(self._name, 0.0) + time.perf_counter() - clock


def _tumour_ml(out: Path) -> float:
    """The tumour's volume the run wrote: its report's, or without one (``--outputs kit``) its NIfTI's."""
    if (out / "report.csv").is_file():
        (row,) = [r for r in csv.DictReader((out / "report.csv").open()) if r["structure"] == "GTV-1"]
        return round(float(row["volume_ml"]), 2)
    import nibabel as nib
    from scripts.common.geometry import voxel_volume_ml

    image = nib.load(out / "P1" / "P1_seg.nii.gz")
    return round(float(np.count_nonzero(np.asarray(image.dataobj) == 1)) * voxel_volume_ml(image.affine), 2)


def _summary(runs: list[dict], truth: dict) -> dict:
    """The median of the repeats after the first, per stage and per transform; the first run's apart."""
    warm = runs[1:] or runs
    stages = sorted({k for r in runs for k in r["stages"]})
    names = list(dict.fromkeys(k for r in runs for k in r["transforms"]))
    outputs = list(dict.fromkeys(k for r in runs for k in r.get("outputs", {})))
    radii = np.asarray(truth["tumour_radii_mm"], float)
    return {"repeats": len(warm), "first_total_s": round(runs[0]["total_s"], 2),
            "total_s": round(statistics.median(r["total_s"] for r in warm), 2),
            "stages": {k: round(statistics.median(r["stages"].get(k, 0.0) for r in warm), 2) for k in stages},
            "transforms": {k: round(statistics.median(r["transforms"].get(k, 0.0) for r in warm), 2) for k in names},
            "outputs": {k: round(statistics.median(r["outputs"].get(k, 0.0) for r in warm), 3) for k in outputs},
            "tumour_ml": warm[-1]["tumour_ml"], "analytic_tumour_ml": round(4 / 3 * np.pi * radii.prod() / 1000, 2),
            "postprocess_and_write_s": round(statistics.median(_around(r) for r in warm), 2),
            "flags": warm[-1]["flags"]}  # fmt: skip


def _around(run: dict) -> float:
    """A run's seconds after the network: post-processing and writing."""
    return run["stages"].get("postprocess", 0.0) + run["stages"].get("write", 0.0)


def format_result(result: dict) -> str:
    """A row per mask (the seconds after the network: post-processing, and writing the report and every output), then
    each mask's stages and post-processing transforms."""
    which = "every output on" if result.get("outputs", "all") == "all" else "the GPU kit's outputs (NIfTI, SEG)"
    if result.get("workers") is not None:
        which += f", {result['workers']} writer(s) side by side"
    lines = [f"seconds per case, a 512 x 512 x {result['slices']} chest CT, {which} (median of the warm runs):",
             "| mask | written | flagged | postprocess | write (report + every output) | postprocess + write | total |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for mask, r in result["masks"].items():
        flagged = f"yes ({len(r['flags'])})" if r["flags"] else "no"
        seconds = [r["stages"].get("postprocess", 0.0), r["stages"].get("write", 0.0), r["postprocess_and_write_s"]]
        cells = [mask, f"{r['tumour_ml']} ml", flagged, *(f"{v:.2f}" for v in [*seconds, r["total_s"]])]
        lines.append("| " + " | ".join(cells) + " |")
    for mask, r in result["masks"].items():
        lines += ["", f"{mask}: {r['repeats']} warm runs (the first run: {r['first_total_s']} s)", "| stage | s |",
                  "|---|---|"]  # fmt: skip
        lines += [f"| {k} | {v:.2f} |" for k, v in r["stages"].items()]
        lines += ["", "| post-processing transform | s |", "|---|---|"]
        lines += [f"| {k} | {v:.2f} |" for k, v in r["transforms"].items()]
        if r.get("outputs"):
            lines += ["", "| write stage, per output (SaveCased.last_seconds) | s |", "|---|---|"]
            lines += [f"| {k} | {v:.3f} |" for k, v in r["outputs"].items()]
        if mask == "tumour":
            lines.append(f"tumour: {r['tumour_ml']} ml written, {r['analytic_tumour_ml']} ml analytic")
        for flag in r["flags"]:
            lines.append(f"flagged: {flag}")
    return "\n".join(lines)


if __name__ == "__main__":
    import fire
    from scripts.common.cli import printed

    fire.Fire(printed(main))

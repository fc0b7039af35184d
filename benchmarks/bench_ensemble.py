"""Benchmark of inference time per case: one model, an ensemble of several, and the ensemble with mirror TTA.

Runs ``configs/inference.yaml`` on ``configs/demo.yaml``'s network (SwinUNETR f12, 64^3 sliding windows on the demo's
2 x 2 x 3 mm grid) in this process, on synthetic DICOM cases of the demo's size, for three variants: ``model_path``
alone, ``--model_paths`` of ``models`` weight files laid out as cross-validation writes them (``fold_<k>/model.pt``),
and the same with ``--tta true``. The weights are random (different per fold): time does not depend on their values.
Only the NIfTI label map is written (no DICOM SEG, RTSTRUCT, SR or report), so the numbers are the network's and the
pipeline's around it. A first untimed run warms the process up (thread pools, allocator)::

    python -m benchmarks.bench_ensemble [--cases 2] [--shape "[128,128,40]"] [--models 5] [--tta_axes "[0,1,2]"]
                                        [--inference_backend auto|torch|onnxruntime] [--output_dir DIR]
                                        [--json_out FILE]

Per variant: seconds per case for the whole case (read DICOM, preprocess, sliding window, invert, write) and for the
network alone (the sliding window's forward passes, timed by hooks), and the whole-case time relative to one model.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = [str(ROOT / "configs" / name) for name in ("inference.yaml", "demo.yaml")]


def main(
    cases: int = 2,
    shape: Sequence[int] = (128, 128, 40),
    models: int = 5,
    tta_axes: Sequence[int] = (0, 1, 2),
    inference_backend: str = "auto",
    output_dir: str | None = None,
    json_out: str | None = None,
) -> dict[str, Any]:
    """Write the cases and the weights, time the three variants, print a table (``inference_backend`` as in the
    config: auto is OpenVINO on a CPU, each weight file exported once before the timed runs)."""
    folder = Path(output_dir) if output_dir else Path(tempfile.mkdtemp(prefix="bench_ensemble_"))
    try:
        inputs = _write_cases(folder / "in", int(cases), shape)
        ensemble_dir = _write_weights(folder / "cv", int(models))
        single = {"model_path": str(ensemble_dir / "fold_0" / "model.pt"), "inference_backend": inference_backend}
        ensemble = {"model_paths": str(ensemble_dir), "inference_backend": inference_backend}
        with_tta = {**ensemble, "tta": True, "tta_axes": list(tta_axes)}
        variants = [("1 model", single), (f"{models}-model ensemble", ensemble),
                    (f"{models}-model ensemble + TTA", with_tta)]  # fmt: skip
        _infer(inputs, folder / "warm_up", single)  # untimed: the first run pays the process's one-time costs
        report: dict[str, Any] = {"cases": int(cases), "shape": list(shape), "cpus": os.cpu_count(), "rows": []}
        for name, settings in variants:
            report["rows"].append({"variant": name, **_infer(inputs, folder / name.replace(" ", "_"), settings)})
        base = report["rows"][0]["s_per_case"]
        for row in report["rows"]:
            row["vs_1_model"] = round(row["s_per_case"] / base, 2)
        print(format_report(report))
        if json_out:
            Path(json_out).write_text(json.dumps(report, indent=2) + "\n")
        return report
    finally:
        if not output_dir:
            shutil.rmtree(folder, ignore_errors=True)


def _write_cases(folder: Path, cases: int, shape: Sequence[int]) -> Path:
    """Synthetic DICOM series as the demo writes them, one folder per case."""
    from scripts.common.labels import COLLECTION
    from scripts.data.synthetic import generate

    generate(folder, num_cases=cases, shape=tuple(shape), seed=900, tumour_hu=400)  # cases already written are kept
    return folder / COLLECTION  # the series only (generate writes its truth beside them)


def _write_weights(folder: Path, models: int) -> Path:
    """``models`` random initialisations of the demo network as cross-validation folds (with their labels)."""
    import torch
    from monai.networks.nets import SwinUNETR
    from scripts.training.weights import save_weights

    for fold in range(models):
        path = folder / f"fold_{fold}" / "model.pt"
        if not path.is_file():
            torch.manual_seed(fold)
            save_weights(SwinUNETR(in_channels=1, out_channels=2, feature_size=12), path, ["GTV-1"])
    return folder


def _infer(inputs: Path, out: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """One inference run of every case; seconds per case for the whole run and for the network's forward passes."""
    from monai.bundle import ConfigWorkflow
    from scripts.inference.backends import prepare

    workflow = ConfigWorkflow(config_file=CONFIGS, workflow_type=None, bundle_root=str(ROOT), input_dir=str(inputs),
                              output_dir=str(out), num_workers=0, write_dicom_seg=False, write_rtstruct=False,
                              write_sr=False, write_report=False, **settings)  # fmt: skip
    workflow.initialize()
    network = prepare(workflow.parser.get_parsed_content("network"))  # a CPU runtime's export: before the clock
    forward: list[float] = []
    network.register_forward_pre_hook(lambda *_: forward.append(-time.perf_counter()))
    network.register_forward_hook(lambda *_: forward.append(time.perf_counter()))
    start = time.perf_counter()
    workflow.run()
    total = time.perf_counter() - start
    workflow.finalize()
    report = json.loads((out / "inference_report.json").read_text())
    done = [c for c in report["cases"] if c.get("status") == "done"]
    models = getattr(network, "models", [network])
    passes = len(models) * len(getattr(network, "flips", [()]))
    return {"models": len(models), "passes_per_window": passes, "s_per_case": round(total / len(done), 2),
            "network_s_per_case": round(sum(forward) / len(done), 2),
            "case_s_median": round(statistics.median(c["seconds"] for c in done), 2)}  # fmt: skip


def format_report(report: dict[str, Any]) -> str:
    shape = "x".join(map(str, report["shape"]))
    lines = [f"bench_ensemble: {report['cases']} synthetic case(s) of {shape} voxels, demo network, "
             f"{report['cpus']} CPUs", "| variant | models | passes/window | s/case | network s/case | vs 1 model |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for r in report["rows"]:
        lines.append(f"| {r['variant']} | {r['models']} | {r['passes_per_window']} | {r['s_per_case']:.2f} | "
                     f"{r['network_s_per_case']:.2f} | {r['vs_1_model']:.2f}x |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    import fire

    fire.Fire(main)

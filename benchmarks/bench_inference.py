"""Benchmark of CPU inference: the same case through ``configs/inference.yaml`` as shipped, run by PyTorch and by
ONNX Runtime (``inference_backend``), side by side.

The shipped network (SwinUNETR feature size 48, random weights: time does not depend on their values) and the
shipped window settings (96^3 windows, sw_batch_size 4, overlap 0.25, 1 x 1 x 3 mm) on synthetic chest CTs written as
DICOM: ``small`` (160 x 160 x 48 voxels of 1.6 mm, 3 mm slices) and ``chest`` (512 x 512 x 120 of 0.98 mm, 3 mm
slices, a realistic planning CT). Each backend and case runs in a child process of its own (so its peak RSS is its
own, and nothing one leaves warm helps the other); the ONNX export (once per weights file, cached beside them) is
made before the timed run and reported apart. Only the NIfTI label map is written::

    python -m benchmarks.bench_inference [--cases small,chest] [--backends torch,onnxruntime] [--threads N]
                                         [--output_dir DIR] [--json_out FILE]

Per case and backend: seconds for the whole case (read DICOM, preprocess, sliding window, invert, write), seconds in
the network (its forward passes, timed by hooks), the windows run, GFLOP/s (the network's floating-point work per
window counted by torch's FlopCounterMode, times the windows, over the network seconds), peak RSS, and onnxruntime's
time relative to torch's; then how many voxels of the two label maps agree.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CASES = {  # columns, rows, slices; pixel spacing (mm); 3 mm slices
    "tiny": ((64, 64, 24), 2.0),  # for the benchmark's own test, with a small network
    "small": ((160, 160, 48), 1.6),
    "chest": ((512, 512, 120), 0.9765625),
}


def main(
    cases: str | Sequence[str] = ("small", "chest"),
    backends: str | Sequence[str] = ("torch", "onnxruntime"),
    threads: int | None = None,
    feature_size: int = 48,
    roi_size: Sequence[int] = (96, 96, 96),
    output_dir: str | None = None,
    json_out: str | None = None,
) -> dict[str, Any]:
    """Write the cases and the weights, run every case with every backend in a child process, print a table.
    ``feature_size`` and ``roi_size`` other than the shipped ones are for a quick check only."""
    cases, backends = _names(cases), _names(backends)
    network = {"feature_size": int(feature_size), "roi_size": [int(r) for r in roi_size]}
    folder = Path(output_dir) if output_dir else Path(tempfile.mkdtemp(prefix="bench_inference_"))
    try:
        weights = _write_weights(folder / "models" / "model.pt", network["feature_size"])
        report: dict[str, Any] = {"cpus": len(os.sched_getaffinity(0)), "threads": threads, "rows": [], **network,
                                  "gflop_per_window": round(window_gflop(**network), 1)}  # fmt: skip
        for case in cases:
            inputs = _write_case(folder / "in" / case, case)
            for backend in backends:
                out = folder / "out" / f"{case}_{backend}"
                row = _child(inputs, out, weights, backend, threads, network)
                row.update(case=case, shape="x".join(map(str, CASES[case][0])), backend=backend)
                row["gflop_per_s"] = round(report["gflop_per_window"] * row["windows"] / row["network_s"], 1)
                report["rows"].append(row)
            report.setdefault("agreement", {})[case] = _agreement(folder / "out", case, backends)
        for row in report["rows"]:
            torch_row = next((r for r in report["rows"] if r["case"] == row["case"] and r["backend"] == "torch"), None)
            row["vs_torch"] = round(row["s_per_case"] / torch_row["s_per_case"], 2) if torch_row else None
        print(format_report(report))
        if json_out:
            Path(json_out).write_text(json.dumps(report, indent=2) + "\n")
        return report
    finally:
        if not output_dir:
            shutil.rmtree(folder, ignore_errors=True)


def window_gflop(feature_size: int = 48, roi_size: Sequence[int] = (96, 96, 96)) -> float:
    """The network's floating-point operations for one window (a multiply-add counts 2), by FlopCounterMode."""
    import torch
    from monai.networks.nets import SwinUNETR
    from torch.utils.flop_counter import FlopCounterMode

    network = SwinUNETR(in_channels=1, out_channels=2, feature_size=feature_size).eval()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        network(torch.zeros(1, 1, *roi_size))
    return counter.get_total_flops() / 1e9


def _names(value: str | Sequence[str]) -> list[str]:
    return [v.strip() for v in (value.split(",") if isinstance(value, str) else value) if v.strip()]


def _write_weights(path: Path, feature_size: int) -> Path:
    """Random weights of the network, with the labels they are for."""
    if not path.is_file():
        import torch
        from monai.networks.nets import SwinUNETR

        torch.manual_seed(0)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(SwinUNETR(in_channels=1, out_channels=2, feature_size=feature_size).state_dict(), path)
        path.with_suffix(".json").write_text(json.dumps({"labels": ["GTV-1"]}))
    return path


def _write_case(folder: Path, case: str) -> Path:
    """One synthetic chest CT as DICOM (kept when written already)."""
    from scripts.synthetic import write_case

    shape, pixel = CASES[case]
    if not folder.is_dir():
        write_case(folder, "P1", seed=7, shape=shape, pixel_spacing=(pixel, pixel), slice_spacing=3.0)
    return folder


def _child(inputs: Path, out: Path, weights: Path, backend: str, threads: int | None, network: dict) -> dict[str, Any]:
    """Run :func:`infer` in a fresh Python process; its result, with that process's peak RSS."""
    command = [sys.executable, "-m", "benchmarks.bench_inference", "infer", str(inputs), str(out), str(weights),
               backend, str(threads or ""), json.dumps(network)]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{backend} on {inputs}: exit status {done.returncode}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def infer(inputs: str, out: str, weights: str, backend: str, threads: str = "", network: str = "{}") -> None:
    """(Child process) configs/inference.yaml alone on ``inputs``; prints one JSON line with the times."""
    from monai.bundle import ConfigWorkflow

    settings = {"cpu_threads": int(threads)} if str(threads).strip() else {}
    settings.update(json.loads(network) if isinstance(network, str) else network)
    workflow = ConfigWorkflow(config_file=str(ROOT / "configs" / "inference.yaml"), workflow_type=None,
                              bundle_root=str(ROOT), input_dir=inputs, output_dir=out, model_path=weights,
                              inference_backend=backend, num_workers=0, write_dicom_seg=False, write_rtstruct=False,
                              write_sr=False, write_report=False, **settings)  # fmt: skip
    workflow.initialize()
    start = time.perf_counter()
    network = workflow.parser.get_parsed_content("network")  # onnxruntime: exported here when not cached yet
    setup = time.perf_counter() - start
    forward: list[float] = []
    windows: list[int] = []

    def before(_module, args) -> None:  # returns None: the inputs go on unchanged
        forward.append(-time.perf_counter())
        windows.append(args[0].shape[0])

    network.register_forward_pre_hook(before)
    network.register_forward_hook(lambda *_: forward.append(time.perf_counter()))
    start = time.perf_counter()
    workflow.run()
    total = time.perf_counter() - start
    workflow.finalize()
    print(json.dumps({"s_per_case": round(total, 1), "network_s": round(sum(forward), 1), "windows": sum(windows),
                      "network_setup_s": round(setup, 1),
                      "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}))  # fmt: skip


def _agreement(out: Path, case: str, backends: list[str]) -> float | None:
    """The fraction of voxels on which the backends' label maps agree (None with one backend)."""
    if len(backends) < 2:
        return None
    import nibabel as nib
    import numpy as np

    maps = [np.asarray(nib.load(out / f"{case}_{b}" / "P1" / "P1_seg.nii.gz").dataobj) for b in backends]
    return round(float(np.mean([(m == maps[0]).mean() for m in maps[1:]])), 6)


def format_report(report: dict[str, Any]) -> str:
    window = "x".join(map(str, report["roi_size"]))
    lines = [f"bench_inference: configs/inference.yaml (SwinUNETR f{report['feature_size']}, {window} windows), "
             f"{report['cpus']} CPUs, {report['gflop_per_window']} GFLOP per window",
             "| case | backend | s/case | network s/case | windows | GFLOP/s | peak RSS MB | vs torch |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in report["rows"]:
        vs = f"{r['vs_torch']:.2f}x" if r["vs_torch"] is not None else ""
        lines.append(f"| {r['case']} ({r['shape']}) | {r['backend']} | {r['s_per_case']:.1f} | {r['network_s']:.1f} | "
                     f"{r['windows']} | {r['gflop_per_s']:.0f} | {r['peak_rss_mb']} | {vs} |")  # fmt: skip
    for case, agreement in report.get("agreement", {}).items():
        if agreement is not None:
            lines.append(f"{case}: label maps agree on {100 * agreement:.3f} % of voxels")
    setup = [f"{r['backend']} {r['case']}: {r['network_setup_s']} s" for r in report["rows"]]
    lines.append("network set-up (weights loaded; onnxruntime: exported when not cached): " + ", ".join(setup))
    return "\n".join(lines)


if __name__ == "__main__":
    import fire

    fire.Fire({"main": main, "infer": infer} if len(sys.argv) > 1 and sys.argv[1] in ("main", "infer") else main)

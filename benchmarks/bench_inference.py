"""Benchmark of CPU inference: the same case through ``configs/inference.yaml`` as shipped, run by PyTorch, ONNX
Runtime and OpenVINO in f32 and bf16 (``inference_backend``, ``cpu_precision``), with the windows over the thorax only
(``roi_region: thorax``, the default) and over the whole body crop (``roi_region: body``), side by side; and the same
case asked of MONAI Label 0.8.5's ``monaibundle`` app with the bundle copied in (``--backends monailabel``: its
settings as shipped, OpenVINO in bf16 where native; ``monailabel-f32``, ``monailabel-torch``: that precision,
PyTorch), as 3D Slicer asks it, ``--requests`` times in one process.

The shipped network (SwinUNETR feature size 48, random weights: time does not depend on their values) and the
shipped window settings (96^3 windows, sw_batch_size 4, overlap 0.25, 1 x 1 x 3 mm) on synthetic CTs written as
DICOM: ``small`` (scripts.data.synthetic's demo-like chest, 160 x 160 x 48 voxels of 1.6 mm, 3 mm slices) and ``chest``
(:func:`scripts.data.synthetic.write_chest_case`: 512 x 512 x 120 of 0.98 mm, 3 mm slices -- the neck above the lungs,
shoulders and arms beside the body, the upper abdomen below, the couch under the back, as a planning CT holds them;
scripts/data/phantom.py states the proportions). Each backend, region and case runs in a child process of its own (so
its peak RSS is its own, and nothing one leaves warm helps the other); the ONNX export and OpenVINO's compilation (once
per weights file and precision, cached beside them) are made before the timed run and reported apart. Only the NIfTI
label map is written::

    python -m benchmarks.bench_inference [--cases small,chest] [--backends torch,onnxruntime,openvino-f32,openvino-bf16]
                                         [--regions body,thorax] [--threads N] [--output_dir DIR] [--json_out FILE]
                                         [--requests 3]   (MONAI Label's rows: --backends openvino-bf16,monailabel)

Per case, backend and region: seconds for the whole case and per stage (read, preprocess, region, predict,
postprocess, write: inference_report.json's), seconds in the network (its forward passes, timed by hooks), the windows
run, GFLOP/s (the network's floating-point work per window counted by torch's FlopCounterMode, times the windows, over
the network seconds), peak RSS, and the time relative to the body crop's with the same backend and to torch's; then
how many voxels of the label maps agree (every run of a case against its first, and each MONAI Label row against the
bundle's row of its runtime and precision), and whether the thorax region holds the tumour where the phantom put it.
MONAI Label's rows: the seconds of its last ``--requests - 1`` requests' median (its own latencies: reading is in
preprocess), the first request's extra seconds (the export and compilation into the copied bundle's models/, unless
cached) as the network's set-up.
"""

from __future__ import annotations

import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from scripts.common.cpus import usable_cpus

ROOT = Path(__file__).resolve().parents[1]
CASES = {  # columns, rows, slices; pixel spacing, slice spacing (mm); the chest phantom or the demo-like synthetic case
    "tiny": ((128, 128, 40), 4.0, 9.0, "chest"),  # for the benchmark's own test, with a small network and grid
    "small": ((160, 160, 48), 1.6, 3.0, "synthetic"),
    "chest": ((512, 512, 120), 0.9765625, 3.0, "chest"),
}


def main(
    cases: str | Sequence[str] = ("small", "chest"),
    backends: str | Sequence[str] = ("torch", "onnxruntime", "openvino-f32", "openvino-bf16"),
    regions: str | Sequence[str] = ("body", "thorax"),
    threads: int | None = None,
    feature_size: int = 48,
    roi_size: Sequence[int] = (96, 96, 96),
    spacing: Sequence[float] | None = None,
    output_dir: str | None = None,
    json_out: str | None = None,
    requests: int = 3,
) -> dict[str, Any]:
    """Write the cases and the weights, run every case with every backend and region in a child process, print a
    table. ``feature_size``, ``roi_size`` and ``spacing`` other than the shipped ones are for a quick check only."""
    cases, backends, regions = _names(cases), _names(backends), _names(regions)
    network = {"feature_size": int(feature_size), "roi_size": [int(r) for r in roi_size]}
    if spacing is not None:
        network["spacing"] = [float(s) for s in spacing]
    folder = Path(output_dir) if output_dir else Path(tempfile.mkdtemp(prefix="bench_inference_"))
    try:
        weights = _write_weights(folder / "models" / "model.pt", network["feature_size"])
        report: dict[str, Any] = {"cpus": usable_cpus(), "threads": threads, "rows": [], **network,
                                  "gflop_per_window": round(window_gflop(network["feature_size"], network["roi_size"]),
                                                            1)}  # fmt: skip
        for case in cases:
            inputs, truth = _write_case(folder / "in" / case, case)
            runs = []
            for backend in backends:
                for region in regions:
                    out = folder / "out" / f"{case}_{backend}_{region}"
                    settings = {**network, "roi_region": region}
                    if backend.startswith("monailabel"):
                        settings["requests"] = int(requests)
                    row = _child(inputs, out, weights, backend, threads, settings)
                    row.update(case=case, shape="x".join(map(str, CASES[case][0])), backend=backend, region=region)
                    row["gflop_per_s"] = round(report["gflop_per_window"] * row["windows"] / row["network_s"], 1)
                    row["holds_tumour"] = _holds(row.get("box_lps_mm"), truth)
                    report["rows"].append(row)
                    runs.append((out, backend, region))
            box = next((r["box_lps_mm"] for r in report["rows"] if r["case"] == case and r["region"] == "thorax"), None)
            report.setdefault("agreement", {})[case] = _agreement(runs, box)
            _monai_label_agreement([r for r in report["rows"] if r["case"] == case], folder / "out")
        _relative(report["rows"])
        print(format_report(report))
        if json_out:
            Path(json_out).write_text(json.dumps(report, indent=2) + "\n")
        return report
    finally:
        if not output_dir:
            shutil.rmtree(folder, ignore_errors=True)


def _relative(rows: list[dict]) -> None:
    """Each row's time over the body crop's with the same backend, and over torch's with the same region."""
    for row in rows:
        same = [r for r in rows if r["case"] == row["case"]]
        body = next((r for r in same if r["backend"] == row["backend"] and r["region"] == "body"), None)
        torch_row = next((r for r in same if r["region"] == row["region"] and r["backend"] == "torch"), None)
        row["vs_body"] = round(row["s_per_case"] / body["s_per_case"], 2) if body else None
        row["vs_torch"] = round(row["s_per_case"] / torch_row["s_per_case"], 2) if torch_row else None


def _holds(box: list | None, truth: dict | None) -> bool | None:
    """Whether the region's box (LPS mm) holds the phantom's tumour (its centre and semi-axes); None without both."""
    if not box or not truth or "tumour_centre_lps" not in truth:
        return None
    import numpy as np

    low, high = np.asarray(box, float)
    centre, radii = np.asarray(truth["tumour_centre_lps"]), np.asarray(truth["tumour_radii_mm"])
    return bool((low <= centre - radii).all() and (high >= centre + radii).all())


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
        from scripts.training.weights import save_weights

        torch.manual_seed(0)
        save_weights(SwinUNETR(in_channels=1, out_channels=2, feature_size=feature_size), path, ["GTV-1"])
    return path


def _write_case(folder: Path, case: str) -> tuple[Path, dict | None]:
    """One synthetic CT as DICOM (kept when written already), and the chest phantom's truth (None for the other)."""
    from scripts.data.synthetic import write_case, write_chest_case

    shape, pixel, slices, kind = CASES[case]
    truth_file = folder / "truth.json"
    if not folder.is_dir():
        if kind == "chest":
            truth = write_chest_case(folder, "P1", shape, pixel, slices, seed=7)
            truth_file.write_text(json.dumps(truth))
        else:
            write_case(folder, "P1", seed=7, shape=shape, pixel_spacing=(pixel, pixel), slice_spacing=slices)
    return folder, json.loads(truth_file.read_text()) if truth_file.is_file() else None


def _child(inputs: Path, out: Path, weights: Path, backend: str, threads: int | None, network: dict) -> dict[str, Any]:
    """Run :func:`infer` in a fresh Python process; its result, with that process's peak RSS."""
    command = [sys.executable, "-m", "benchmarks.bench_inference", "infer", str(inputs), str(out), str(weights),
               backend, str(threads or ""), json.dumps(network)]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{backend} on {inputs}: exit status {done.returncode}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def infer(inputs: str, out: str, weights: str, backend: str, threads: str = "", network: str = "{}") -> None:
    """(Child process) :func:`_infer`, with int8's check against f32 timed but deciding nothing: random weights
    predict near ties everywhere, so no such check means anything on them (with trained weights the guard holds:
    tests/test_workflow_inference.py), and what is measured here is int8's time."""
    from unittest import mock

    from scripts.inference import int8

    with mock.patch.dict(int8.GUARD, agreement=0.0, tumour_dice=0.0, volume_change=float("inf")):
        _infer(inputs, out, weights, backend, threads, network)


def _infer(inputs: str, out: str, weights: str, backend: str, threads: str = "", network: str = "{}") -> None:
    """configs/inference.yaml alone on ``inputs`` with ``backend`` (``openvino-bf16``: OpenVINO in
    that precision; ``monailabel...``: :func:`monai_label_case`, asked ``network["requests"]`` times); prints one JSON
    line with the times."""
    from monai.bundle import ConfigWorkflow
    from scripts.inference.backends import precision_in_force, prepare

    settings = {"cpu_threads": int(threads)} if str(threads).strip() else {}
    backend, _, precision = backend.partition("-")
    settings["cpu_precision"] = precision or "auto"
    settings.update(json.loads(network) if isinstance(network, str) else network)
    if backend == "monailabel":
        if precision == "torch":
            settings.update(inference_backend="torch", cpu_precision="auto")
        requests = int(settings.pop("requests", 3))
        print(json.dumps(monai_label_case(Path(inputs), Path(out), Path(weights), settings, requests)))
        return
    workflow = ConfigWorkflow(config_file=str(ROOT / "configs" / "inference.yaml"), workflow_type=None,
                              bundle_root=str(ROOT), input_dir=inputs, output_dir=out, model_path=weights,
                              inference_backend=backend, num_workers=0, write_dicom_seg=False, write_rtstruct=False,
                              write_sr=False, write_report=False, **settings)  # fmt: skip
    workflow.initialize()
    start = time.perf_counter()
    network = workflow.parser.get_parsed_content("network")
    prepare(network)  # CPU runtimes: exported and compiled here if not cached
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
    (case,) = json.loads((Path(out) / "inference_report.json").read_text())["cases"]
    region = case.get("region", {})
    print(json.dumps({"s_per_case": round(total, 1), "network_s": round(sum(forward), 1), "windows": sum(windows),
                      "windows_whole_input": region.get("windows_whole_input"), "method": region.get("method"),
                      "box_lps_mm": region.get("box_lps_mm"), "stage_seconds": case.get("stage_seconds", {}),
                      "network_setup_s": round(setup, 1),
                      "precision": precision_in_force(network, workflow.parser.get_parsed_content("precision")),
                      "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}))  # fmt: skip


def monai_label_case(inputs: Path, out: Path, weights: Path, settings: dict, requests: int = 3) -> dict[str, Any]:
    """(Child process) MONAI Label 0.8.5's app (``monailabel apps --download --name monaibundle``) with the bundle
    copied in under ``out`` (its configs with ``settings``, ``weights`` as its models/model.pt), asked ``requests``
    times for the case's series as 3D Slicer asks (model, image, device cpu), in this process: the first request
    exports and compiles into the copy's models/ (a new folder: nothing cached), the others reuse it. The label map of
    the last request goes where :func:`infer` writes it (``out/P1/P1_seg.nii.gz``)."""
    import argparse
    import statistics

    sys.path.insert(0, str(ROOT / "tests"))
    from test_monailabel import NAME, copy_bundle, monai_label_workarounds, server_app

    monai_label_workarounds()
    from monailabel.main import Main

    series = next(inputs.glob("**/image"))
    work = out / "monailabel"
    (work / "studies").mkdir(parents=True)
    Main().action_apps(argparse.Namespace(download=True, name="monaibundle", output=str(work / "apps"), prefix=None))
    copy_bundle(work / "apps" / "monaibundle" / "model" / NAME, work / "no-dicom", settings, weights)
    app = server_app(work)
    task = app._infers[NAME]
    inferer = task.bundle_config.get_parsed_content("inferer")  # the instance MONAI Label calls (parsed once)
    forward: list[float] = []
    windows: list[int] = []
    runs = inferer.network_for

    def timed(network):  # the network's forward passes, timed as infer's hooks time them
        runtime = runs(network)

        def run(x):
            start = time.perf_counter()
            logits = runtime(x)
            forward.append(time.perf_counter() - start)
            windows.append(x.shape[0])
            return logits

        return run

    inferer.network_for = timed
    answers = []
    for _ in range(requests):
        forward.clear()
        windows.clear()
        start = time.perf_counter()
        answer = app.infer({"model": NAME, "image": str(series), "device": "cpu", "result_extension": ".nii.gz"})
        answers.append({"s": time.perf_counter() - start, "network_s": sum(forward), "windows": sum(windows),
                        "latencies": answer["params"]["latencies"], "file": answer["file"]})  # fmt: skip
    (out / "P1").mkdir(parents=True, exist_ok=True)
    shutil.move(answers[-1]["file"], out / "P1" / "P1_seg.nii.gz")
    warm = answers[1:] or answers
    median = statistics.median(a["s"] for a in warm)
    latencies = min(warm, key=lambda a: abs(a["s"] - median))["latencies"]
    runtime = inferer.runtime
    return {"s_per_case": round(median, 1), "network_s": round(statistics.median(a["network_s"] for a in warm), 1),
            "windows": warm[0]["windows"], "windows_whole_input": inferer.last.get("windows_whole_input"),
            "method": inferer.last.get("method"), "box_lps_mm": inferer.last.get("box_lps_mm"),
            "network_setup_s": round(answers[0]["s"] - median, 1),
            "first_request_s": round(answers[0]["s"], 1), "requests_s": [round(a["s"], 1) for a in answers],
            "stage_seconds": {"preprocess": latencies["pre"], "predict": latencies["infer"],
                              "postprocess": latencies["invert"] + latencies["post"], "write": latencies["write"]},
            "runtime": f"{runtime.backend}-{runtime.precision}" if runtime else "torch",
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}  # fmt: skip


def _monai_label_agreement(rows: list[dict], out: Path) -> None:
    """Each MONAI Label row's share of voxels equal to the bundle's row of the same runtime and region, if run."""
    import nibabel as nib
    import numpy as np

    for row in rows:
        same = next((r for r in rows if r["backend"] == row.get("runtime") and r["region"] == row["region"]), None)
        if not row["backend"].startswith("monailabel") or same is None:
            continue
        maps = [np.asarray(nib.load(out / f"{row['case']}_{r['backend']}_{r['region']}" / "P1" / "P1_seg.nii.gz")
                           .dataobj) for r in (row, same)]  # fmt: skip
        row["same_as_bundle"] = {same["backend"]: round(float((maps[0] == maps[1]).mean()), 6)}


def _agreement(runs: list[tuple[Path, str, str]], box: list | None) -> dict[str, float | None]:
    """How many voxels agree: between the backends (each region's runs against its first, every voxel), and between
    the regions inside the thorax box (each backend's; outside it the thorax run is background by construction and a
    network with random weights is not). None where there is nothing to compare."""
    import nibabel as nib
    import numpy as np

    maps = {(backend, region): nib.load(out / "P1" / "P1_seg.nii.gz") for out, backend, region in runs}
    data = {key: np.asarray(image.dataobj) for key, image in maps.items()}
    pairs = {"backends": [], "regions_in_box": []}
    for (backend, region), labels in data.items():
        first = next(v for (b, r), v in data.items() if r == region)
        if first is not labels:
            pairs["backends"].append(float((labels == first).mean()))
        if region != "body" and (backend, "body") in data and box:
            inside = _inside(maps[(backend, region)].affine, labels.shape, box)
            pairs["regions_in_box"].append(float((labels[inside] == data[(backend, "body")][inside]).mean()))
    return {k: round(min(v), 6) if v else None for k, v in pairs.items()}


def _inside(affine: Any, shape: tuple[int, ...], box: list) -> Any:
    """The voxels (of an axis-aligned RAS grid) whose centres lie in ``box`` (LPS mm, min and max corners)."""
    import numpy as np

    lps = np.diag([-1.0, -1.0, 1.0, 1.0]) @ np.asarray(affine, float)
    low, high = np.asarray(box, float)
    masks = [(low[a] <= c) & (c <= high[a]) for a in range(3)
             for c in [lps[a, a] * np.arange(shape[a]) + lps[a, 3]]]  # fmt: skip
    return masks[0][:, None, None] & masks[1][None, :, None] & masks[2][None, None, :]


def format_report(report: dict[str, Any]) -> str:
    window = "x".join(map(str, report["roi_size"]))
    lines = [f"bench_inference: configs/inference.yaml (SwinUNETR f{report['feature_size']}, {window} windows), "
             f"{report['cpus']} CPUs, {report['gflop_per_window']} GFLOP per window",
             "| case | backend | region | s/case | read | preprocess | region s | predict | postprocess | write | "
             "network s | windows | GFLOP/s | peak RSS MB | vs body | vs torch | holds tumour |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in report["rows"]:
        stages = r.get("stage_seconds", {})
        stage_names = ("read", "preprocess", "region", "predict", "postprocess", "write")
        times = " | ".join(f"{stages.get(k, 0.0):.1f}" for k in stage_names)
        ratios = [f"{r[k]:.2f}x" if r.get(k) is not None else "" for k in ("vs_body", "vs_torch")]
        windows = f"{r['windows']} of {r['windows_whole_input']}" if r.get("windows_whole_input") else r["windows"]
        holds = {True: "yes", False: "NO", None: ""}[r.get("holds_tumour")]
        lines.append(f"| {r['case']} ({r['shape']}) | {r['backend']} | {r['region']} | {r['s_per_case']:.1f} | "
                     f"{times} | {r['network_s']:.1f} | {windows} | {r['gflop_per_s']:.0f} | {r['peak_rss_mb']} | "
                     f"{ratios[0]} | {ratios[1]} | {holds} |")  # fmt: skip
    for case, agreement in report.get("agreement", {}).items():
        if agreement.get("backends") is not None:
            lines.append(f"{case}: the backends' label maps agree on {100 * agreement['backends']:.3f} % of voxels")
        if agreement.get("regions_in_box") is not None:
            lines.append(
                f"{case}: thorax and body label maps agree on {100 * agreement['regions_in_box']:.3f} % of the "
                "voxels inside the thorax box (outside it the thorax run is background)"
            )
    for r in report["rows"]:
        if r.get("first_request_s") is not None:
            lines.append(f"{r['case']}: MONAI Label ({r['runtime']}) requests took {r['requests_s']} s (the first "
                         f"exports and compiles unless cached); label map equal to the bundle's "
                         f"{r.get('same_as_bundle', 'not run')}")  # fmt: skip
    setup = [f"{r['backend']} {r['case']} {r['region']}: {r['network_setup_s']} s" for r in report["rows"]]
    lines.append(
        "network set-up (weights loaded; CPU runtimes: exported and compiled when not cached): " + ", ".join(setup)
    )
    return "\n".join(lines)


if __name__ == "__main__":
    import fire
    from scripts.common.cli import printed

    if len(sys.argv) > 1 and sys.argv[1] == "infer":
        fire.Fire(infer, command=sys.argv[2:])
    else:
        fire.Fire(printed(main))

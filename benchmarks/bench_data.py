"""Benchmark of the training data path: MONAI ``TciaDataset`` reading DICOM every epoch vs. prepare once + cache.

On synthetic cases of realistic size (512 x 512 x 120 voxels at 0.98 x 0.98 x 3 mm, GTV and left-lung segments, in
the TCIA layout) it measures, each approach in its own child process (so peak RSS is its own):

* ``original`` -- the original scripts' way: ``monai.apps.TciaDataset(download=False)`` with
  ``LoadImaged(reader="PydicomReader")`` on the DICOM series and SEG of every item, every epoch (no cache);
* ``cache`` -- a plain ``CacheDataset`` over the prepared NIfTI with train.yaml's transforms, float32 volumes and
  ``RandCropByPosNegLabeld`` searching each volume for foreground/background voxels on every draw;
* ``ours`` -- train.yaml's dataset as shipped: the same, plus ``CompactForCropd`` (float16 image, uint8 label, cached
  crop centre candidates) and no defensive deep copy of a cached case per draw (``copy_cache: false``).

All three run the same geometry and intensity transforms (train.yaml's, read from the config) and the same random
crops (``num_samples`` patches of ``roi_size`` per case); only where the data comes from and what is cached differ.
It reports seconds of data per epoch (first epoch: reading + caching; steady state: median of the later ones),
peak RSS, bytes per cached case, and the speed-up of the steady-state epoch over ``original``. Before that it times
``scripts.data.prepare`` per case against a bare pydicom read of the same CT series (every file read and its pixels
decoded, nothing else), wall clock and CPU, each in fresh child processes (see :func:`_time_prepare`)::

    python -m benchmarks.bench_data [--cases 4] [--shape "[512,512,120]"] [--epochs 5] [--original_epochs 2]
                                 [--output_dir DIR] [--keep false] [--json_out FILE]

Data time only: no network, one process, no loader workers (each approach would scale with workers alike).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
COLLECTION = "NSCLC-Radiomics"
APPROACHES = ("original", "cache", "ours")
SEGMENTS = ("GTV-1", "Lung-Left")


def main(
    cases: int = 4,
    shape: Sequence[int] = (512, 512, 120),
    epochs: int = 5,
    original_epochs: int = 2,
    output_dir: str | None = None,
    keep: bool | str = False,
    json_out: str | None = None,
) -> dict[str, Any]:
    """Write the cases, time prepare against a bare read, run the three approaches, print a table."""
    from scripts.common.config import as_bool

    folder = Path(output_dir) if output_dir else Path(tempfile.mkdtemp(prefix="bench_data_"))
    dicom_dir, prepared_dir = folder / "dicom", folder / "prepared"
    try:
        _write_cases(dicom_dir, int(cases), shape)
        report: dict[str, Any] = {"cases": int(cases), "shape": list(shape), "cpus": os.cpu_count()}
        report["prepare"] = _time_prepare(dicom_dir, prepared_dir)
        for approach in APPROACHES:
            runs = int(original_epochs) if approach == "original" else int(epochs)
            report[approach] = _run_child(approach, dicom_dir, prepared_dir, runs)
        baseline = report["original"]["steady_epoch_s"]
        for approach in APPROACHES:
            report[approach]["speedup_vs_original"] = round(baseline / report[approach]["steady_epoch_s"], 1)
        print(format_report(report))
        if json_out:
            Path(json_out).write_text(json.dumps(report, indent=2) + "\n")
        return report
    finally:
        if not output_dir and not as_bool(keep, "keep"):
            shutil.rmtree(folder, ignore_errors=True)


def _write_cases(dicom_dir: Path, cases: int, shape: Sequence[int]) -> None:
    from scripts.data.synthetic import write_case
    from tqdm import tqdm

    for i in tqdm(range(cases), desc="synthetic cases", unit="case"):
        pid = f"LUNG1-{i + 1:03d}"
        if not (dicom_dir / "synthetic_truth" / f"{pid}.json").is_file():
            # two segments, every SEG frame stored: MONAI's PydicomReader needs per-frame segment ids and no omitted
            # frames (NSCLC-Radiomics SEGs hold several structures; train.yaml uses the GTV)
            write_case(dicom_dir, pid, seed=i, shape=shape, segments=list(SEGMENTS), sparse_seg=False)


def _time_prepare(dicom_dir: Path, prepared_dir: Path, rounds: int = 3, passes: int = 3) -> dict[str, float]:
    """Seconds per case, wall clock and CPU (every thread of the process): ``scripts.data.prepare`` (one worker process;
    it keeps two cases in flight in threads, so that one's NIfTI writes overlap the next one's reading) vs. reading
    the CT series with pydicom, on files already in the page cache.

    Each is timed in fresh child processes, as a user's run starts, alternating (bare, prepare) ``rounds`` times,
    ``passes`` passes per child; the medians over all passes are reported. Not both in one process: a bare read's
    ~0.5 MB allocations cost up to 40 % less right after prepare has freed its volumes (glibc then serves them from
    its heap), so that would time the allocator's state as much as the code."""
    runs: dict[str, list] = {"bare": [], "prepare": []}
    for _ in range(int(rounds)):
        for kind in runs:
            runs[kind] += _run_child(f"time_{kind}", dicom_dir, prepared_dir, int(passes))["passes"]
    (bare_wall, bare_cpu), (wall, cpu) = ([statistics.median(x) for x in zip(*runs[k])] for k in runs)
    return {"bare_pydicom_read_s_per_case": round(bare_wall, 3), "bare_pydicom_read_cpu_s_per_case": round(bare_cpu, 3),
            "prepare_s_per_case": round(wall, 3), "prepare_cpu_s_per_case": round(cpu, 3),
            "ratio": round(wall / bare_wall, 2), "cpu_ratio": round(cpu / bare_cpu, 2),
            "passes": {k: [[round(x, 3) for x in run] for run in v] for k, v in runs.items()}}  # fmt: skip


def _time_passes(kind: str, dicom_dir: Path, prepared_dir: Path, passes: int) -> list[tuple[float, float]]:
    """``passes`` times (wall, CPU) per case of a bare read of every series (``kind="bare"``) or of prepare."""
    from scripts.data.prepare import prepare

    series = sorted((dicom_dir / COLLECTION).glob("*/*/image"))
    times = []
    for _ in range(passes):
        if kind == "bare":
            wall, cpu = _timed(lambda: [bare_read(image_dir) for image_dir in series])
        else:
            shutil.rmtree(prepared_dir, ignore_errors=True)  # every pass converts every case
            wall, cpu = _timed(lambda: prepare(dicom_dir, prepared_dir, num_workers=1, progress=False))
        times.append((wall / len(series), cpu / len(series)))
    return times


def _timed(work) -> tuple[float, float]:
    """Wall-clock and CPU seconds of ``work()``."""
    wall, cpu = time.perf_counter(), time.process_time()
    work()
    return time.perf_counter() - wall, time.process_time() - cpu


def bare_read(image_dir: Path):
    """The least any DICOM pipeline does: read every file of the series and decode its pixels into one volume
    (sorted by z, stacked slice after slice; no checks, no HU conversion)."""
    import numpy as np
    import pydicom

    slices = [pydicom.dcmread(f) for f in sorted(image_dir.glob("*.dcm"))]
    slices.sort(key=lambda s: float(s.ImagePositionPatient[2]))
    return np.stack([s.pixel_array for s in slices])


def _run_child(approach: str, dicom_dir: Path, prepared_dir: Path, epochs: int) -> dict[str, Any]:
    command = [sys.executable, "-m", "benchmarks.bench_data", "child", approach, str(dicom_dir), str(prepared_dir),
               str(epochs)]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"bench_data: the {approach!r} run failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def child(approach: str, dicom_dir: str, prepared_dir: str, epochs: int) -> None:
    """One approach, in this process: build the dataset, draw ``epochs`` epochs of patches, print JSON (or, for
    ``time_bare`` / ``time_prepare``, time ``epochs`` passes of that)."""
    if approach in ("time_bare", "time_prepare"):
        kind = approach.removeprefix("time_")
        print(json.dumps({"passes": _time_passes(kind, Path(dicom_dir), Path(prepared_dir), int(epochs))}))
        return
    import torch

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    start = time.perf_counter()
    dataset = _dataset(approach, Path(dicom_dir), Path(prepared_dir))
    built = time.perf_counter() - start
    epoch_s, patches = [], 0
    for _ in range(int(epochs)):
        start = time.perf_counter()
        for index in range(len(dataset)):
            patches += len(dataset[index])
        epoch_s.append(time.perf_counter() - start)
    epoch_s[0] += built  # reading and caching belong to the first epoch
    cached = getattr(dataset, "_cache", None) or []
    result = {
        "approach": approach,
        "cases": len(dataset),
        "epochs": int(epochs),
        "patches": patches,
        "first_epoch_s": round(epoch_s[0], 2),
        "steady_epoch_s": round(statistics.median(epoch_s[1:]) if len(epoch_s) > 1 else epoch_s[0], 3),
        "epoch_s": [round(s, 3) for s in epoch_s],
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "cached_mb_per_case": round(sum(nbytes(c) for c in cached) / len(cached) / 2**20, 1) if cached else 0.0,
    }
    print(json.dumps(result))


def _dataset(approach: str, dicom_dir: Path, prepared_dir: Path):
    from monai.bundle import ConfigParser

    parser = ConfigParser()
    parser.read_config(str(ROOT / "configs" / "train.yaml"))
    # every case, cached by one thread (the original approach has no parallelism either)
    parser.update({"prepared_dir": str(prepared_dir), "cache": "memory", "num_workers": 1})
    parser["train#data"] = "$@train#datalist + @validate#datalist"
    if approach in ("original", "cache"):  # MONAI searching every volume on every draw, float32 cache, copied
        crop = parser["train#random_transforms#0"]
        for key in ("fg_indices_key", "bg_indices_key"):
            crop.pop(key)
        crop.update({"image_key": "image", "image_threshold": 0})
        parser["train#compact_transforms"] = []
        parser["train#dataset#copy_cache"] = True
    if approach == "original":
        return _tcia_dataset(dicom_dir, parser)
    return parser.get_parsed_content("train#dataset")  # train.yaml's own dataset: CacheDataset, cache: memory


def _tcia_dataset(dicom_dir: Path, parser):
    """MONAI's TciaDataset on the DICOM folder, loading with PydicomReader each time an item is read."""
    from monai.apps import TciaDataset
    from monai.transforms import Compose, EnsureChannelFirstd, Lambda, LoadImaged

    load = [
        LoadImaged(keys=["image", "seg"], reader="PydicomReader", label_dict={n: i for i, n in enumerate(SEGMENTS)}),
        EnsureChannelFirstd(keys="image"),
        Lambda(lambda d: {"image": d["image"], "label": d["seg"][..., 0][None]}),  # (x, y, z, segments) -> (1, x, y, z)
    ]
    deterministic = parser.get_parsed_content("train#deterministic_transforms")[1:]  # all but train.yaml's loader
    transform = Compose(load + deterministic + parser.get_parsed_content("train#random_transforms"))
    return TciaDataset(dicom_dir, COLLECTION, "training", transform=transform, download=False, val_frac=0.0,
                       cache_num=0, progress=False)  # fmt: skip


def nbytes(value: Any) -> int:
    """Bytes of the arrays and tensors in a cached item (metadata included; Python object overhead not)."""
    import numpy as np
    import torch

    if isinstance(value, torch.Tensor):
        own = value.numel() * value.element_size()
        meta = getattr(value, "meta", None)
        return own + (nbytes(dict(meta)) if meta else 0)
    if isinstance(value, np.ndarray):
        return value.nbytes
    if isinstance(value, dict):
        return sum(nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(nbytes(v) for v in value)
    return 0


def format_report(report: dict[str, Any]) -> str:
    prep = report["prepare"]
    lines = [
        f"bench_data: {report['cases']} cases of {'x'.join(map(str, report['shape']))} voxels, {report['cpus']} CPUs",
        f"prepare {prep['prepare_s_per_case']:.3f} s/case vs bare pydicom read "
        f"{prep['bare_pydicom_read_s_per_case']:.3f} s/case ({prep['ratio']:.2f}x); "
        f"CPU {prep['prepare_cpu_s_per_case']:.3f} vs {prep['bare_pydicom_read_cpu_s_per_case']:.3f} s/case "
        f"({prep['cpu_ratio']:.2f}x)",
        "| approach | first epoch s | steady epoch s | speed-up | peak RSS MB | cached MB/case |",
        "|---|---|---|---|---|---|",
    ]
    for name in APPROACHES:
        r = report[name]
        lines.append(f"| {name} | {r['first_epoch_s']:.2f} | {r['steady_epoch_s']:.3f} | {r['speedup_vs_original']}x "
                     f"| {r['peak_rss_mb']:.0f} | {r['cached_mb_per_case']:.1f} |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    import fire

    fire.Fire({"main": main, "child": child} if len(sys.argv) > 1 and sys.argv[1] in ("main", "child") else main)

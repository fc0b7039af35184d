"""Benchmark of a cohort inferred in one part and in two side by side (torchrun's ranks, each on its share of the
cores): cases per hour of the same chest CTs, as ``configs/inference.yaml`` runs them from the command line.

The cases are the synthetic chest (a planning CT of 512 x 512 pixels: neck, arms, abdomen) at realistic slice counts;
the weights are given (their network decides the time per window: name it beside the numbers)::

    python -m benchmarks.bench_cohort --weights runs/demo/model.pt [--config demo] [--cases 6] [--output_dir DIR]
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SLICES = (90, 100, 110, 120, 130, 140)  # a chest CT of 3 mm slices, neck to upper abdomen


def main(weights: str, config: str = "demo", cases: int = 6, output_dir: str | None = None) -> dict[str, Any]:
    """Write the cases, infer them in 1 part and in 2, print a row each (the outputs removed unless ``output_dir``)."""
    from scripts.data.synthetic import write_chest_case

    folder = Path(output_dir) if output_dir else Path(tempfile.mkdtemp(prefix="bench_cohort_"))
    inputs = folder / "in"
    try:
        for k in range(int(cases)):
            if not (inputs / f"CHEST-{k}").exists():
                write_chest_case(inputs / f"CHEST-{k}", f"CHEST-{k}", (512, 512, SLICES[k % len(SLICES)]))
        configs = ["configs/inference.yaml"] + ([f"configs/{config}.yaml"] if config else [])
        rows = [_run(inputs, folder / f"out_{parts}", weights, configs, parts) for parts in (1, 2)]
        print(f"{int(cases)} chest CTs of 512 x 512 x {min(SLICES)}-{max(SLICES)}, weights {weights}\n")
        print("| parts | wall s | cases | cases per hour | each part, cases per hour |\n|---|---|---|---|---|")
        for row in rows:
            each = ", ".join(f"{p['cases_per_hour']}" for p in row["parts"].values())
            print(f"| {row['num_parts']} | {row['wall_s']:.1f} | {row['num_done']} | {row['per_hour']:.0f} | {each} |")
        return {"cases": int(cases), "rows": rows}
    finally:
        if not output_dir:
            shutil.rmtree(folder, ignore_errors=True)


def _run(inputs: Path, out: Path, weights: str, configs: list[str], parts: int) -> dict[str, Any]:
    """One cohort run from a fresh output folder (the CPU runtime's export, cached beside the weights, made first)."""
    shutil.rmtree(out, ignore_errors=True)
    launcher = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={parts}"]
                                   if parts > 1 else [])  # fmt: skip
    command = [*launcher, "-m", "monai.bundle", "run", "inference", "--config_file", str(configs),
               "--input_dir", str(inputs), "--output_dir", str(out), "--model_path", weights]  # fmt: skip
    start = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if result.returncode:
        raise RuntimeError(f"{parts} part(s) failed:\n{result.stderr[-3000:]}")
    report = json.loads((out / "inference_report.json").read_text())
    return {**{k: report[k] for k in ("num_parts", "num_done", "parts")}, "wall_s": wall,
            "per_hour": report["num_done"] / wall * 3600}  # fmt: skip


if __name__ == "__main__":
    import fire
    from scripts.common.cli import printed

    fire.Fire(printed(main))

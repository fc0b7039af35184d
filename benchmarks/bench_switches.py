"""Run ``configs/benchmark.yaml`` once per set of speed switches and print a markdown table of the results.

    python -m benchmarks.bench_switches --dataset_dir /data/tcia                      # train.yaml's network and data
    python -m benchmarks.bench_switches --demo true --output_dir runs/bench_demo      # the demo's network and data

Each set is a separate ``monai.bundle run`` (a fresh process: no warm caches or compiled graphs carried over), so
rows are comparable. The first row is the loop of the original research-contributions / AMD scripts (no cache,
DataLoader workers, fp16 with GradScaler, no compile); GPU-only rows are skipped on a CPU. Rows and per-set JSON go
to ``<output_dir>/<set>/benchmark.json`` and ``<output_dir>/performance_table.md``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

#: name -> (command-line overrides, needs a GPU)
SWITCH_SETS: dict[str, tuple[dict[str, str], bool]] = {
    "original-style loop (no cache, DataLoader, fp16)": (
        {"cache": "none", "thread_loader": "false", "amp": "true", "amp_dtype": "float16", "fused_optimizer": "false"},
        False,
    ),
    "bundle defaults (cache memory)": ({}, False),
    "cache none": ({"cache": "none"}, False),
    "cache disk": ({"cache": "disk"}, False),
    "cache gpu + ThreadDataLoader": ({"cache": "gpu"}, True),
    "ThreadDataLoader": ({"thread_loader": "true"}, False),
    "num_workers 0": ({"num_workers": "0"}, False),
    "gradient checkpointing": ({"use_checkpoint": "true"}, False),
    "channels_last": ({"channels_last": "true"}, False),
    "amp bfloat16": ({"amp_dtype": "bfloat16"}, True),
    "fused window attention (bf16)": ({"amp_dtype": "bfloat16", "fused_attention": "true"}, True),
    "amp off": ({"amp": "false"}, True),
    "no fused AdamW": ({"fused_optimizer": "false"}, True),
    "torch.compile": ({"compile": "true"}, False),
    "best: cache gpu + bf16 + compile": ({"cache": "gpu", "amp_dtype": "bfloat16", "compile": "true"}, True),
}


def run(
    output_dir: str = "runs/bench_switches",
    demo: bool = False,
    warmup: int = 5,
    steps: int = 20,
    only: str | None = None,
    timeout: int = 1800,
    **overrides,
) -> None:
    """Benchmark every set (or those whose name contains ``only``); prints the markdown table and writes it."""
    configs = ["configs/train.yaml"] + (["configs/demo.yaml"] if str(demo).lower() == "true" else [])
    configs.append("configs/benchmark.yaml")
    gpu = torch.cuda.is_available()
    out = Path(output_dir)
    rows = []
    for name, (switches, needs_gpu) in SWITCH_SETS.items():
        if (needs_gpu and not gpu) or (only and only not in name):
            continue
        folder = out / _slug(name)
        settings = {"output_dir": str(folder), "benchmark_warmup": warmup, "benchmark_steps": steps}
        settings.update(overrides)
        settings.update(switches)
        args = [sys.executable, "-m", "monai.bundle", "run", "--config_file", str(configs).replace('"', "'")]
        for key, value in settings.items():
            args += [f"--{key}", str(value)]
        print(f"--- {name}", flush=True)
        result = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
        line = next((x for x in result.stdout.splitlines() if x.startswith("benchmark:")), None)
        if result.returncode != 0 or line is None:
            print(f"failed ({result.returncode}): {result.stderr.strip().splitlines()[-1:]}", flush=True)
            rows.append((name, None))
            continue
        print(line, flush=True)
        rows.append((name, json.loads((folder / "benchmark.json").read_text())))
    table = _table(rows)
    out.mkdir(parents=True, exist_ok=True)
    (out / "performance_table.md").write_text(table)
    print(table)


def _table(rows: list[tuple[str, dict | None]]) -> str:
    device = next((r["device"] for _, r in rows if r), {}) or {}
    lines = [
        f"device: {device.get('device_name')} ({device.get('backend')}), torch {device.get('torch')}, "
        f"MONAI {device.get('monai')}",
        "",
        "| switches | ms/step (median) | p90 | patches/s | data wait | peak memory GiB | vs first row |",
        "|---|---|---|---|---|---|---|",
    ]
    base = next((r["result"]["patches_per_s"] for _, r in rows if r), None)
    for name, report in rows:
        if report is None:
            lines.append(f"| {name} | failed | | | | | |")
            continue
        r = report["result"]
        speedup = f"{r['patches_per_s'] / base:.2f}x" if base else ""
        lines.append(
            f"| {name} | {r['ms_per_step_median']:.0f} | {r['ms_per_step_p90']:.0f} | {r['patches_per_s']:.3f} | "
            f"{100 * r['data_wait_fraction']:.1f}% | {r['peak_memory_gib']:.2f} | {speedup} |"
        )
    return "\n".join(lines) + "\n"


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name.lower()).strip("_")[:60]


if __name__ == "__main__":
    import fire

    fire.Fire(run)

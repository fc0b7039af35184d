"""Run ``configs/benchmark.yaml`` once per set of speed switches, in one process, and print a markdown table.

    python -m benchmarks.bench_switches --dataset_dir /data/tcia                      # train.yaml's network and data
    python -m benchmarks.bench_switches --demo true --output_dir runs/bench_demo      # the demo's network and data
    python -m benchmarks.bench_switches --only "patches" --dataset_dir /data/tcia     # the sets whose name holds it

:func:`run_rows` runs the sets one after the other in this process: torch, MONAI, the CUDA context and cuDNN's
algorithm choices are paid for once, and the training cache is built once per place (host memory, device) and handed
to the next rows that keep the same preprocessing (only their random transforms are rebuilt: ``num_samples`` may
differ). Nothing else carries over: every row builds its own network, optimiser and trainer, and compiled graphs are
dropped between rows. The first row is the loop of the original research-contributions / AMD scripts (no cache,
DataLoader workers, fp16 with GradScaler, no compile); GPU-only rows are skipped on a CPU; a row that fails (out of
memory with 16 patches on a smaller card) is recorded and the next one runs. Each row's ``benchmark.json`` goes to
``<output_dir>/<set>/`` and the table to ``<output_dir>/performance_table.md``. With ``keep_trace`` every row asks
its StepTimer for the chrome trace of its busy steps (``benchmark_trace``: :data:`BUSY_TRACE`, the device activity it
profiled on a GPU for its busy share), and a row keeps it when it is faster than every row before it, so the fastest
row has one for ``python -m scripts.summarize_trace``.

A compiled row keeps its compiled code in ``compile_cache_dir`` (train.yaml's, or the one ``settings`` give), so a
compiled row after it with the same network, shapes and precision compiles from the cache; benchmark.json says how
many graphs came from it (``compile_cache``), and for ``cuda_graphs`` which steps a CUDA graph replayed.
"""

from __future__ import annotations

import ast
import gc
import json
import logging
import math
import multiprocessing
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from scripts.common.config import check_ids

ROOT = Path(__file__).resolve().parents[1]


def learning_rate_for(patches: int, base: float = 1.0e-4, base_patches: int = 4) -> str:
    """train.yaml's learning rate scaled for ``patches`` a step by the square-root rule (docs/training.md):
    ``base * sqrt(patches / base_patches)``, as the command line would give it."""
    return f"{base * math.sqrt(patches / base_patches):.4g}"


#: name -> (command-line overrides, needs a GPU). bf16 is the base of the rows after "amp bfloat16": each changes one
#: thing against it. The defaults (fp16, compile auto: off in a benchmark; cuda_graphs on, so "CUDA graphs (fp16)" and
#: the compile rows' "+ CUDA graphs" repeat the default, beside docs/performance.md's rows that had them off) are the
#: base of the rows before it: more patches a step, with the learning rate scaled by the square-root rule; the full
#: training's defaults (compile auto on: regional, fp16), then the same again (which compiles from the first's cache);
#: compile's reduce-overhead captures each region itself, so it turns the whole step's graph off; the compiled step with
#: the window attention as one scaled_dot_product_attention (compiled, the attention's softmax is the step's largest
#: kernel class, docs/performance.md); the MetaTensor row is the defaults' step with the batch as a MetaTensor,
#: decollated after each step (which reads the loss off the GPU) and the GPU synchronised around each step
SWITCH_SETS: dict[str, tuple[dict[str, str], bool]] = {
    "original-style loop (no cache, DataLoader, fp16)": (
        {"cache": "none", "num_workers": "4", "amp": "true", "amp_dtype": "float16", "fused_optimizer": "false"},
        False,
    ),
    "cache memory, 4 workers": ({"cache": "memory", "num_workers": "4"}, False),
    "bundle defaults (cache auto)": ({}, False),
    "MetaTensor batch, decollated, synchronised steps": (
        {
            "train#trainer#prepare_batch": "$monai.engines.default_prepare_batch",
            "train#trainer#decollate": "true",
            "benchmark_sync_steps": "true",
        },
        False,
    ),
    "CUDA graphs (fp16)": ({"cuda_graphs": "true"}, True),
    "8 patches a step (fp16, lr x1.41)": ({"num_samples": "8", "learning_rate": learning_rate_for(8)}, True),
    "16 patches a step (fp16, lr x2)": ({"num_samples": "16", "learning_rate": learning_rate_for(16)}, True),
    "compile regional (fp16)": ({"compile": "true"}, True),
    "compile regional (fp16) + CUDA graphs": ({"compile": "true", "cuda_graphs": "true"}, True),
    "compile regional, reduce-overhead (fp16)": (
        {"compile": "true", "compile_mode": "reduce-overhead", "cuda_graphs": "false"},
        True,
    ),
    "compile regional (fp16) + CUDA graphs, fused attention": (
        {"compile": "true", "cuda_graphs": "true", "fused_attention": "true"},
        True,
    ),
    "cache none": ({"cache": "none"}, False),
    "cache disk": ({"cache": "disk"}, False),
    "cache gpu + ThreadDataLoader": ({"cache": "gpu"}, True),
    "ThreadDataLoader": ({"thread_loader": "true"}, False),
    "num_workers 0": ({"num_workers": "0"}, False),
    "gradient checkpointing": ({"use_checkpoint": "true"}, False),
    "channels_last": ({"channels_last": "true"}, False),
    "amp off": ({"amp": "false"}, True),
    "no fused AdamW": ({"fused_optimizer": "false"}, True),
    "torch.compile, whole network": ({"compile": "true", "compile_scope": "whole"}, False),
    "amp bfloat16": ({"amp_dtype": "bfloat16"}, True),
    "fused window attention (bf16)": ({"amp_dtype": "bfloat16", "fused_attention": "true"}, True),
    "channels_last (bf16)": ({"amp_dtype": "bfloat16", "channels_last": "true"}, True),
    "compile regional (bf16)": ({"amp_dtype": "bfloat16", "compile": "true"}, True),
    "compile regional, reduce-overhead (bf16)": (
        {"amp_dtype": "bfloat16", "compile": "true", "compile_mode": "reduce-overhead", "cuda_graphs": "false"},
        True,
    ),
}
#: the chrome trace of a row's busy steps, beside its benchmark.json (kept by a row faster than the rows before it)
BUSY_TRACE = "busy_trace.json.gz"
#: the ids whose values decide what the training cache holds: rows agreeing on them (and on the cache's place) share it
CACHE_IDS = ("dataset_dir", "prepared_dir", "spacing", "hu_window", "body_hu", "roi_size", "cache_rate", "labels")


def run_rows(
    sets: Sequence[str],
    configs: Sequence[str | Path],
    settings: dict[str, Any],
    output_dir: str | Path,
    deadline: float | None = None,
    estimate_s: dict[str, float] | None = None,
    progress: Callable[[list[dict[str, Any]]], None] | None = None,
    keep_trace: bool = False,
) -> list[dict[str, Any]]:
    """Run each named set of :data:`SWITCH_SETS` on ``configs`` (benchmark.yaml last) with ``settings`` in this
    process (see the module docstring); one record per set: ``ok`` with benchmark.json's report, ``failed`` with the
    error, or ``skipped`` (no GPU; or ``deadline``, a ``time.monotonic()`` value, would pass before its estimate).
    ``progress`` is given the records so far after each set. ``keep_trace``: a row faster than every earlier row
    keeps its busy steps' trace and its record names it (``trace``; None where none was profiled: a CPU)."""
    from monai.bundle import ConfigParser

    if not logging.getLogger().handlers:  # the bundle's log lines (the cache's place, the trainer) in this output
        logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(asctime)s - %(name)s - %(message)s")
    gpu = torch.cuda.is_available()
    shared: dict[str, Any] = {}  # cache key -> the dataset that holds it
    records = []
    for name in sets:
        switches, needs_gpu = SWITCH_SETS[name]
        record: dict[str, Any] = {"set": name, "switches": switches, "status": "ok"}
        records.append(record)
        estimate = (estimate_s or {}).get(name, 0.0)
        if needs_gpu and not gpu:
            record.update(status="skipped", reason="no GPU")
        elif deadline is not None and time.monotonic() + estimate > deadline:
            record.update(status="skipped", reason=f"budget: ~{estimate:.0f} s more would pass the deadline")
        if record["status"] == "skipped":
            if progress:
                progress(records)
            continue
        folder = Path(output_dir) / slug(name)
        start = time.monotonic()
        print(f"--- {name}", flush=True)
        parser = ConfigParser()
        parser.read_config([str(c) for c in configs])
        parser.update({**settings, "output_dir": str(folder), **overrides(name)})
        if keep_trace:
            parser["benchmark_trace"] = str(folder / BUSY_TRACE)
        try:
            parser.get_parsed_content("initialize")
            parser.get_parsed_content("scripts")
            key = _cache_key(parser)
            if key in shared:  # the same preprocessing cached in the same place by an earlier row
                parser["train#dataloader#dataset"] = shared[key]
                parser["training_cache"] = json.loads(key)[0]  # decided already: not read and logged again
                shared[key].transform = parser.get_parsed_content("train#preprocessing")  # this row's random part
            parser.get_parsed_content("run")
            if key and key not in shared:
                shared[key] = parser.get_parsed_content("train#dataloader").dataset
            if not (folder / "benchmark.json").is_file():  # the engine caught an error (a transform's) and ended
                raise RuntimeError(f"the run ended without {folder / 'benchmark.json'}: the log above says why")
            record["report"] = json.loads((folder / "benchmark.json").read_text())
            _keep_trace(records, record)
        except Exception as error:  # one row's failure (out of memory, a compiler error) must not end the others
            record.update(status="failed", error=f"{type(error).__name__}: {error}",
                          traceback=traceback.format_exc(limit=6))  # fmt: skip
            print(record["traceback"], flush=True)
        finally:
            _stop_workers()
            del parser
            _release()
        record["seconds"] = round(time.monotonic() - start, 1)
        if progress:
            progress(records)
    return records


def _keep_trace(records: list[dict[str, Any]], record: dict[str, Any]) -> None:
    """A row faster than every earlier row keeps the busy-steps trace its StepTimer wrote (``trace``); another row's
    is deleted (a few MB that no table reads)."""
    trace = record["report"]["result"].get("busy_trace")
    if not trace:
        return
    if _fastest_so_far(records, record):
        record["trace"] = trace
    else:
        Path(trace).unlink(missing_ok=True)
        record["report"]["result"]["busy_trace"] = None


def _fastest_so_far(records: list[dict[str, Any]], record: dict[str, Any]) -> bool:
    """Whether ``record``'s row made more patches a second than every earlier row that ran."""
    speed = record["report"]["result"]["patches_per_s"]
    earlier = [r["report"]["result"]["patches_per_s"] for r in records if r is not record and "report" in r]
    return all(speed > other for other in earlier)


def overrides(name: str) -> dict[str, Any]:
    """The set's overrides as ``monai.bundle run`` gets them from its command line: fire reads each value as a
    Python literal where it is one ("8" -> 8) and as a string otherwise ("true", "bfloat16"). Passed on as strings,
    a count would break the config's arithmetic (``@batch_size * @num_samples`` with "8")."""
    return {key: _as_literal(value) for key, value in SWITCH_SETS[name][0].items()}


def _as_literal(value: str) -> Any:
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return value


def _cache_key(parser) -> str | None:
    """What a cached training set of this row holds and where (None: no cache to share)."""
    place = parser.get_parsed_content("training_cache")
    if place not in ("memory", "gpu"):
        return None
    return json.dumps([place, *(str(parser[i]) for i in CACHE_IDS)])


def _stop_workers() -> None:
    """End the row's DataLoader worker processes (the only child processes a row starts) now: the trainer stopped
    mid-epoch, so each worker still holds the batches it prefetched, and torch's shutdown, when the loader is collected,
    waits 5 s for each before ending it (15 s a row, measured)."""
    for child in multiprocessing.active_children():
        child.terminate()
        child.join()


def _release() -> None:
    """Drop the last row's network, optimiser, compiled graphs and the device memory they held."""
    gc.collect()
    torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run(
    output_dir: str = "runs/bench_switches",
    demo: bool = False,
    warmup: int = 5,
    steps: int = 30,
    only: str | None = None,
    **overrides,
) -> None:
    """Benchmark every set (or those whose name contains ``only``); prints the markdown table and writes it."""
    configs = [ROOT / "configs" / "train.yaml"]
    configs += [ROOT / "configs" / "demo.yaml"] if str(demo).lower() == "true" else []
    configs.append(ROOT / "configs" / "benchmark.yaml")
    check_ids(overrides, configs)  # a misspelt option (--onlyy) would otherwise reach every row as a new config id
    settings = {"bundle_root": str(ROOT), "benchmark_warmup": warmup, "benchmark_steps": steps, **overrides}
    sets = [name for name in SWITCH_SETS if not only or only in name]
    if not sets:
        raise SystemExit(f"bench_switches: --only {only!r} is in no row's name; the rows: " + "; ".join(SWITCH_SETS))
    records = run_rows(sets, configs, settings, output_dir)
    table = table_of(records)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "performance_table.md").write_text(table)
    print(table)


def table_of(records: Sequence[dict[str, Any]]) -> str:
    """The markdown table of :func:`run_rows`' records, each row against the first that ran."""
    reports = [r["report"] for r in records if r["status"] == "ok"]
    device = (reports[0]["device"] if reports else None) or {}
    lines = [
        f"device: {device.get('device_name')} ({device.get('backend')}), torch {device.get('torch')}, "
        f"MONAI {device.get('monai')}",
        "",
        "| switches | ms/step (median) | p90 | patches/s | data wait | GPU busy | peak memory GiB | first step s | "
        "vs first row |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    base = reports[0]["result"]["patches_per_s"] if reports else None
    for record in records:
        if record["status"] != "ok":
            why = record.get("reason") or record.get("error", "")
            lines.append(f"| {record['set']} | {record['status']}: {why[:80]} | | | | | | | |")
            continue
        r = record["report"]["result"]
        busy = "n/a" if r.get("gpu_busy_fraction") is None else f"{100 * r['gpu_busy_fraction']:.1f}%"
        lines.append(
            f"| {record['set']} | {r['ms_per_step_median']:.0f} | {r['ms_per_step_p90']:.0f} | "
            f"{r['patches_per_s']:.3f} | {100 * r['data_wait_fraction']:.1f}% | {busy} | {r['peak_memory_gib']:.2f} | "
            f"{'n/a' if r['first_step_s'] is None else format(r['first_step_s'], '.1f')} | "
            f"{r['patches_per_s'] / base:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def slug(name: str) -> str:
    """A folder name for a set's name."""
    return "".join(c if c.isalnum() else "_" for c in name.lower()).strip("_")[:60]


if __name__ == "__main__":
    import fire
    from scripts.common.cli import fire_command

    fire.Fire(run, command=fire_command(sys.argv[1:]))

"""The GPU proof kit: one command that runs every GPU path of the bundle and measures it, for a GPU lent for minutes.

    python -m benchmarks.gpu_proof --output_dir DIR [--budget_s 450] [--only train,throughput] [--dry_run true]

Steps (:data:`STEPS`, in this order): the environment (device, driver, torch/CUDA/cuDNN, host CPUs); synthetic data
(512 x 512 x 120 chest CTs as DICOM, prepared); the network (FLOPs of one training step by ``FlopCounterMode``,
random weights for evaluation and inference); one short training run (AMP fp16 with GradScaler, fused AdamW, the
NVML monitor) and the checks of its checkpoint and monitor files; resume from it; ``profile.yaml`` (chrome trace
with CUDA kernels, ``memory.pickle``) and the trace summariser on that trace, checked against torch.profiler's own
``key_averages()`` of the same run; evaluate and inference with the out-of-memory fallback forced once; torchrun
with NCCL; training throughput (``benchmark.yaml``, each switch in a row of its own, >= 30 timed steps, with data
wait, GPU-busy share, MFU and the first step's seconds): today's defaults, CUDA graphs and 8 and 16 patches a step
(:data:`THROUGHPUT_SETS`, all in one child); the CUDA-graph check (the replayed training equal to the eager one); the
full training's defaults (compile auto on: regional, fp16) compiled with an empty compile cache and then, in a second
process, from that cache with CUDA graphs (:data:`COMPILE_SETS`: the first step's seconds of both, the cache's hits);
full-CT inference (DICOM in, NIfTI + SEG out), the first and a warm case; last, as far as the budget goes, compile's
fused-attention and reduce-overhead rows and the rows earlier runs measured (:data:`LAST_SETS`), so a short budget
drops those and never the new ones. Where the GPU's time goes: the summariser's device time per kernel class, its
longest kernels and the idle share, for the defaults (the profile step's trace, else the busy steps of the defaults
row) and for the fastest row (the trace of its profiled busy steps, which bench_switches keeps for a row faster than
the rows before it). The issue's targets are printed met or not met.

Every step runs in a child process with a time limit (:class:`Runner`), so a crash, a CUDA error or a hang ends that
step only: it is recorded as ``failed`` with the last lines of its log (``DIR/logs/<step>.log``) and the next step
runs. A step is ``skipped`` with its reason: ``no GPU`` (CUDA-only), ``budget`` (it would not finish within
``--budget_s``; its estimate is in :class:`Sizes`), or a step it needs that did not succeed. After every step the
command prints its running total and rewrites ``DIR/gpu_proof.json`` and ``DIR/gpu_proof.md``, so a run cut short
still leaves its results. ``--only`` runs the named steps (and the steps they need) again, e.g. after a fix. The
children are forks of this process, which imported torch and MONAI once (~15 s a child on the H200 machine) and never
initialises CUDA itself (it reads the device only through children), so forking is safe on a GPU.

``--dry_run true`` runs the same steps on the CPU with a tiny network and tiny cases (:data:`DRY`): every step that
needs no CUDA runs for real (torchrun with gloo), the CUDA-only ones are skipped ("no GPU"); tests/test_gpu_proof.py
runs it. Nothing a dry run prints is a GPU number.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import json
import logging
import os
import re
import runpy
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from benchmarks.bench_switches import run_rows
from scripts.common.config import as_bool
from scripts.common.cpus import usable_cpus
from scripts.common.files import write_json, write_text
from scripts.common.labels import COLLECTION
from scripts.profiling.summarize_trace import SECTION_PREFIX, TraceError, format_device_table, summarize

#: the device types of key_averages() rows that are the GPU's own (kernels, copies, ranges on its timeline)
DEVICE_TYPES = ("CUDA", "HIP")

ROOT = Path(__file__).resolve().parents[1]
#: dense bf16 peak (TFLOP/s, no sparsity) by the words of torch's device name; the first entry whose words all occur
#: in the name (case-insensitive) wins. A device not listed gets no MFU (it says so) rather than a guessed one.
PEAK_BF16_TFLOPS: tuple[tuple[tuple[str, ...], float], ...] = (
    (("H200",), 989.4),
    (("H100", "PCIe"), 756.0),
    (("H100", "HBM3"), 989.4),  # H100 SXM5 reports itself as "NVIDIA H100 80GB HBM3"
    (("H100", "SXM"), 989.4),
    (("A100",), 312.0),
    (("MI300X",), 1307.4),
)
#: issue 49's targets for the next GPU run (printed by the kit, met or not; no test asserts them): patches/s of the
#: fastest row and of the full training's defaults (compile auto on), MFU and GPU busy of the fastest row, the first
#: step of a compile with an empty cache and from the cache, a warm full CT end to end and its network time
TARGETS = {"patches_per_s": 45.0, "defaults_patches_per_s": 35.0, "mfu_percent": 10.0, "gpu_busy_percent": 95.0,
           "data_wait_percent": 5.0, "compile_s": 90.0, "compile_cached_s": 20.0, "fullct_s": 1.5,
           "network_s": 0.25}  # fmt: skip
#: the throughput rows (bench_switches' sets), in three steps: first today's defaults (the baseline: compile auto is
#: off in a benchmark's short run; cuda_graphs was off when the last GPU run measured them and is on since, so the
#: next run's defaults row holds the graphs and its "CUDA graphs" row repeats it), the same as 0.11.1 ran and timed it
#: (the before of 0.11.2's host-side changes, on the same GPU) and the new rows -- CUDA graphs, 8
#: and 16 patches a step with the learning-rate rule; then the compile rows, each in a process of its own sharing one
#: compile cache: the full training's defaults (compile auto on there) with the cache empty, then from it with CUDA
#: graphs; last compile's reduce-overhead and the rows earlier runs measured (bf16 and its switches, 0.7's defaults,
#: the original loop), which a short budget drops
SEED_SET, DEFAULTS_SET = "original-style loop (no cache, DataLoader, fp16)", "bundle defaults (cache auto)"
GRAPHS_SET, HOST_CACHE_SET = "CUDA graphs (fp16)", "0.7 defaults (cache memory, 4 workers)"
COMPILE_SET, COMPILE_GRAPHS_SET = "compile regional (fp16)", "compile regional (fp16) + CUDA graphs"
OLD_STEP_SET = "0.11.1's step (MetaTensor batch, decollated, synchronised steps)"
THROUGHPUT_SETS = (DEFAULTS_SET, OLD_STEP_SET, GRAPHS_SET, "8 patches a step (fp16, lr x1.41)",
                   "16 patches a step (fp16, lr x2)")  # fmt: skip
COMPILE_SETS = (COMPILE_SET, COMPILE_GRAPHS_SET)
EARLIER_SETS = ("amp bfloat16", "fused window attention (bf16)", "channels_last (bf16)", HOST_CACHE_SET, SEED_SET)
#: the rows of the last step never measured, before the earlier runs' rows, budget allowing (`--only
#: compile_cache,throughput_earlier` with a budget for them): the compiled step with the window attention as one
#: scaled_dot_product_attention (compiled, the attention's softmax was 30 % of the step's GPU time and the largest
#: class; the fused attention's graph is smaller, so its first step, a compilation of its own, also measures whether a
#: cold compile gets under the target); then compile's own CUDA graphs of each region (torch.compile's
#: reduce-overhead) against the whole step's (cuda_graphs), from the compile rows' cache
FUSED_COMPILE_SET = "compile regional (fp16) + CUDA graphs, fused attention"
REDUCE_OVERHEAD_SET = "compile regional, reduce-overhead (fp16)"
LAST_SETS = (FUSED_COMPILE_SET, REDUCE_OVERHEAD_SET, *EARLIER_SETS)
#: the steps that measure throughput rows, in the kit's order; the last stops its rows where the budget ends and
#: reserves nothing before it
ROW_STEPS, LAST_ROWS = ("throughput", "compile_cache", "throughput_earlier"), "throughput_earlier"
#: modules every child would import (~15 s each on the H200 machine, ~10 s on 2 cores): imported once, then forked
PRELOAD = ("torch", "monai.bundle", "monai.engines", "monai.handlers", "monai.networks.nets", "scripts.data.dataset",
           "scripts.training.checkpoint", "scripts.inference.inferers", "scripts.inference.engine",
           "scripts.inference.outputs", "scripts.evaluation.case_metrics", "scripts.inference.inputs",
           "scripts.profiling.profiler", "scripts.profiling.benchmark", "scripts.training.weights",
           "scripts.inference.ensemble", "scripts.inference.figures", "scripts.training.accelerator",
           "scripts.training.compilation", "scripts.training.graphs", "torch.distributed.run")  # fmt: skip
FALLBACK_LOG = "out of memory in sliding-window inference"  # scripts.inference.inferers' warning when it retries a case
LOG_TAIL_LINES = 25


# ------------------------------------------------------------------------------------------------------------ sizes
@dataclass(frozen=True)
class Sizes:
    """How large the kit's runs are: the GPU's (train.yaml's network and patch on realistic CTs) or the dry run's.

    ``settings`` go to every bundle run on top of its configs; ``case`` is the synthetic CT written for training and
    for full-CT inference: (columns, rows, slices), pixel spacing (mm), and whether it is the chest phantom
    (:func:`scripts.data.synthetic.write_chest_case`) or scripts.data.synthetic's simpler case. ``estimates_s`` are the
    expected seconds of the steps (the budget's guard; on a GPU a guess until a run has measured them)."""

    settings: dict[str, Any]
    case: tuple[tuple[int, int, int], float, bool]
    training_cases: int  # written and prepared: the split gives most to training, one to validation
    iterations: int  # training iterations of each path run (train, resume, torchrun)
    profile_schedule: tuple[int, int, int, int]
    bench: tuple[int, int]  # a throughput row's warm-up (graphs: 3 eager steps, then the capture) and timed iterations
    timeout_s: float  # one child's limit; a run that compiles gets three times this
    estimates_s: dict[str, float] = field(default_factory=dict)  # steps, and throughput rows by their set's name


GPU = Sizes(
    settings={},  # train.yaml's own: SwinUNETR f48, 96^3 patches, 1 x 1 x 3 mm, 4 patches a step, 4 workers
    case=((512, 512, 120), 0.9765625, True),
    training_cases=4,
    iterations=2,
    profile_schedule=(1, 1, 2, 1),
    bench=(5, 30),
    timeout_s=180,
    # the seconds the third H200 run measured (docs/gpu-runs/2026-11-27-h200-0.11/, rounded up) for the steps it ran,
    # else the second's (docs/gpu-runs/2026-11-27-h200/, forked children), the larger of its two calls where a step
    # ran in both; the seed-style row: the first run's 981 ms a step. ESTIMATES (marked "est."), rows whose own
    # seconds no run recorded: the 8- and 16-patch rows, 38 steps at about 2x and 4x the defaults' 160 ms plus cuDNN's
    # search for the new shapes; CUDA graphs: the defaults row without its cache build and algorithm search (shared),
    # at a faster step. The throughput steps' own figures are their first rows: they stop their rows themselves where
    # the rest of the kit would no longer fit.
    estimates_s={
        "environment": 19,
        "data": 9,
        "network": 4,
        "train": 31,
        "resume": 15,
        "profile": 25,
        "evaluate_oom": 21,
        "inference_oom": 11,
        "torchrun": 37,
        "throughput": 60,
        "cuda_graphs": 5,
        "compile_cache": 189,  # its two rows and two processes
        "throughput_earlier": 25,
        "fullct_inference": 52,  # est.: four runs of 13 s (two: 25.5 s)
        DEFAULTS_SET: 33,
        OLD_STEP_SET: 15,  # est.: as the CUDA graphs row (the defaults' cache and algorithm search shared)
        GRAPHS_SET: 15,  # est.
        "8 patches a step (fp16, lr x1.41)": 30,  # est.
        "16 patches a step (fp16, lr x2)": 45,  # est.
        COMPILE_SET: 162,
        COMPILE_GRAPHS_SET: 27,
        FUSED_COMPILE_SET: 162,  # est.: a compilation of its own (another graph), as the cold compile row
        REDUCE_OVERHEAD_SET: 120,  # est.: compiles again (another mode), part from the cache
        "amp bfloat16": 24,
        "fused window attention (bf16)": 8,
        "channels_last (bf16)": 18,
        HOST_CACHE_SET: 15,
        SEED_SET: 40,
    },
)
DRY = Sizes(
    # the tests' kind of network for mechanics: a small BasicUNet steps ~4x faster than SwinUNETR f12 on 2 cores
    # (0.5-1 s against 2-5 s for a 64 x 32 x 32 patch, forward + backward), so a dozen runs fit in a minute
    settings={
        "network_def": {
            "_target_": "BasicUNet",
            "spatial_dims": 3,
            "in_channels": 1,
            "out_channels": "@num_classes",
            "features": [4, 4, 8, 8, 16, 4],
        },
        "roi_size": [64, 32, 32],  # the smallest patch check_config allows (it is SwinUNETR's)
        "spacing": [2.0, 2.0, 3.0],
        "num_samples": 1,
        "num_workers": 0,
        "sw_batch_size": 2,
        "device": "$torch.device('cpu')",
    },
    case=((48, 48, 24), 2.0, False),
    training_cases=4,
    iterations=1,
    profile_schedule=(0, 1, 1, 1),
    bench=(0, 1),
    timeout_s=150,
)

#: the dry run's sizes on the default device: the GPU paths in seconds (tests/test_gpu_proof.py's gpu tests)
TINY = dataclasses.replace(DRY, settings={k: v for k, v in DRY.settings.items() if k != "device"})


# ----------------------------------------------------------------------------------------------------------- runner
class StepFailed(RuntimeError):
    """A step's check failed or its child ended badly; ``tail`` holds the last lines of the child's log, ``numbers``
    what the step measured all the same (kept in its record)."""

    def __init__(self, message: str, tail: str = "", numbers: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.tail, self.numbers = tail, numbers


class _Skip(Exception):
    """The step cannot run here (no GPU, no budget left, a step it needs did not succeed); the message says why."""


@dataclass
class Child:
    """How a child process ended: exit status (None: killed at its time limit), seconds, its log."""

    returncode: int | None
    seconds: float
    log: Path

    def tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last ``lines`` lines of the log (each cut to 300 characters): where a traceback ends."""
        return "\n".join(line[:300] for line in self.log_text().splitlines()[-lines:])

    def log_text(self) -> str:
        """The whole log (empty when there is none)."""
        return self.log.read_text(errors="replace") if self.log.is_file() else ""


class Runner:
    """Run ``python -m <module> <args>`` in a child process with its output in a log file and a time limit, so that a
    crash, a CUDA error or a hang ends that child only (its whole process group, DataLoader workers included).

    The child is a fork of this process, which imported torch and MONAI once (:data:`PRELOAD`): nothing a child does
    (a CUDA context, compiled graphs, warm caches) carries over to the next, and this process never initialises CUDA
    (a process that forks must not)."""

    def __init__(self) -> None:
        self.preload_s: float | None = None

    def module(self, module: str, args: Sequence[str], log: Path, timeout_s: float) -> Child:
        """``python -m module args`` in a forked child, run from the bundle's root."""
        self._preload()
        log.parent.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _run_forked(module, list(args), log)  # never returns
        return Child(_wait(pid, start + timeout_s), time.monotonic() - start, log)

    def _preload(self) -> None:
        """Import :data:`PRELOAD` once, so each forked child starts with them imported."""
        if self.preload_s is None:
            start = time.monotonic()
            for name in PRELOAD:
                with contextlib.suppress(ImportError):
                    __import__(name)
            self.preload_s = round(time.monotonic() - start, 1)


def _run_forked(module: str, args: list[str], log: Path) -> None:
    """(In the forked child) run ``module`` as ``python -m`` would, output to ``log``, then leave with its status."""
    code = 1
    try:
        os.setpgid(0, 0)
        os.chdir(ROOT)
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        for stream in (sys.stdout, sys.stderr):  # a child killed at its limit keeps what it printed
            with contextlib.suppress(AttributeError):
                stream.reconfigure(line_buffering=True)
        os.environ["PYTHONUNBUFFERED"] = "1"
        sys.argv = [module, *args]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as stop:
        if isinstance(stop.code, str):
            print(stop.code, file=sys.stderr)
        code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
    except Exception:  # reported in the log, as python -m would (anything else: the status stays 1)
        traceback.print_exc()
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _wait(pid: int, deadline: float) -> int | None:
    """The exit status of forked child ``pid``; None when it was killed at ``deadline`` (time.monotonic)."""
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            _kill_group(pid)  # what it left behind (DataLoader workers)
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            _kill_group(pid)
            os.waitpid(pid, 0)
            return None
        time.sleep(0.05)


def _kill_group(pgid: int) -> None:
    """SIGKILL the process group the kit started for one child (gone already: nothing to do)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


# -------------------------------------------------------------------------------------------------------- the kit
@dataclass(frozen=True)
class Step:
    """One named step: what it proves (``title``), its function (returns the step's numbers; raises :class:`_Skip` or
    :class:`StepFailed`), the steps whose results it needs, whether it needs CUDA, and whether it is heavy (a bundle
    run: skipped when the budget would not hold it)."""

    name: str
    title: str
    run: Callable[[Kit], dict[str, Any]]
    needs: tuple[str, ...] = ()
    gpu_only: bool = False
    heavy: bool = True


class Kit:
    """The state of one run of the kit: where it writes, its sizes, its child runner, and every step's record."""

    def __init__(self, output_dir: Path, dry_run: bool, gpu: bool, budget_s: float, tiny: bool = False) -> None:
        self.out = output_dir
        self.dry_run, self.gpu, self.budget_s = dry_run, gpu, float(budget_s)
        self.sizes = GPU if not (dry_run or tiny) else DRY if dry_run else TINY
        self.mode = "dry run" if dry_run else "tiny" if tiny else "full"
        self.runner = Runner()
        self.steps: list[Step] = []
        self.started = time.monotonic()
        self.started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
        self.records: dict[str, dict[str, Any]] = {}
        self.data = self.out / "data"
        self.prepared = self.data / "prepared"
        self.weights = self.out / "models" / "model.pt"

    # ------------------------------------------------------------------ children
    def elapsed(self) -> float:
        """Seconds since the kit started."""
        return time.monotonic() - self.started

    def time_left(self, step: str, factor: float = 1.0) -> float:
        """A child's time limit: the sizes' limit (times ``factor``), never past the budget plus a minute."""
        left = self.budget_s + 60 - self.elapsed()
        if left <= 5:
            raise _Skip(f"budget: {self.elapsed():.0f} s of {self.budget_s:.0f} s spent before {step}")
        return min(self.sizes.timeout_s * factor, left)

    def log(self, name: str) -> Path:
        """Where the child of step (or helper run) ``name`` writes its output."""
        return self.out / "logs" / f"{name}.log"

    def check(self, child: Child, what: str) -> Child:
        """``child`` if it ended with status 0; else :class:`StepFailed` naming ``what`` with its log's tail."""
        if child.returncode is None:
            raise StepFailed(f"{what}: killed after {child.seconds:.0f} s (its time limit)", child.tail())
        if child.returncode != 0:
            raise StepFailed(f"{what}: exit status {child.returncode} (log: {child.log})", child.tail())
        return child

    def helper(self, name: str, log_name: str, factor: float = 1.0, **options: Any) -> dict[str, Any]:
        """Run one of :data:`HELPERS` in a child (it may import torch and touch the device); its JSON result."""
        result = self.out / "helpers" / f"{log_name}.json"
        result.unlink(missing_ok=True)
        args = ["helper", name, "--out", str(result), *_flags(options)]
        self.check(self.runner.module("benchmarks.gpu_proof", args, self.log(log_name), self.time_left(name, factor)),
                   f"helper {name}")  # fmt: skip
        return json.loads(result.read_text())

    def bundle(self, name: str, configs: Sequence[str], factor: float = 1.0, torchrun: bool = False,
               **settings: Any) -> tuple[Path, Child]:  # fmt: skip
        """One ``monai.bundle run`` of ``configs`` (under configs/) with ``settings`` (see :meth:`training`) in a
        child, under torchrun (``--standalone --nproc_per_node=1``) when asked; its output folder and the child.
        ``factor`` scales the child's time limit (a run that compiles)."""
        run_dir = self.out / "runs" / name
        merged = {"output_dir": run_dir, **settings}
        args = ["run", "--config_file", str([str(ROOT / "configs" / c) for c in configs]), "--bundle_root", str(ROOT)]
        args += _flags(merged)
        limit = self.time_left(name, factor)
        if torchrun:  # torchrun's agent, which starts the worker as a fresh `python -m monai.bundle`
            launcher = ["--standalone", "--nproc_per_node=1", "-m", "monai.bundle"]
            child = self.runner.module("torch.distributed.run", [*launcher, *args], self.log(name), limit)
        else:
            child = self.runner.module("monai.bundle", args, self.log(name), limit)
        self.check(child, f"monai.bundle run {' + '.join(configs)}")
        return Path(merged["output_dir"]), child

    def training(self, name: str, **settings: Any) -> dict[str, Any]:
        """The settings of a run on the kit's prepared data: the sizes', its own weights file (never the bundle's
        models/model.pt), no preparation (the data step did it), then ``settings``."""
        run_dir = self.out / "runs" / name
        return {"dataset_dir": self.data / "train", "prepared_dir": self.prepared, "prepare_data": False,
                "model_path": run_dir / "model.pt", **self.sizes.settings, **settings}  # fmt: skip

    def numbers(self, step: str) -> dict[str, Any]:
        """The numbers of an earlier step that succeeded (:class:`_Skip` if it did not)."""
        record = self.records.get(step)
        if not record or record["status"] != "ok":
            raise _Skip(f"needs {step} ({record['status'] if record else 'not run'})")
        return record["numbers"]

    # ------------------------------------------------------------------ running the steps
    def run(self, steps: Sequence[Step]) -> None:
        """Run ``steps`` in order, each recorded, printed and saved as soon as it ends."""
        self.steps = list(steps)
        for index, step in enumerate(steps, 1):
            record = self._run_step(step)
            self.records[step.name] = record
            reason = f" ({record['reason']})" if record.get("reason") else ""
            print(f"gpu_proof [{index:2d}/{len(steps)}] {step.name:<26} {record['status']:<7} "
                  f"{record['seconds']:7.1f} s{reason} | total {self.elapsed():6.1f} s of {self.budget_s:.0f} s",
                  flush=True)  # fmt: skip
            if record["status"] == "failed":
                print(_indent(record["error"]), flush=True)
            self.save()

    def _run_step(self, step: Step) -> dict[str, Any]:
        """One step's record: ok with its numbers, skipped with the reason, or failed with the error's last lines."""
        start = time.monotonic()
        record: dict[str, Any] = {"name": step.name, "title": step.title, "status": "ok", "seconds": 0.0}
        try:
            for need in step.needs:
                self.numbers(need)
            if step.gpu_only and not self.gpu:
                raise _Skip("no GPU" if not self.dry_run or not _cuda_visible() else "dry run: CPU only")
            estimate = self.sizes.estimates_s.get(step.name, 0.0)
            if step.heavy and self.elapsed() + estimate > self.budget_s:
                spent = self.elapsed()
                raise _Skip(f"budget: {spent:.0f} s spent, ~{estimate:.0f} s more would pass {self.budget_s:.0f} s")
            record["numbers"] = step.run(self)
        except _Skip as skip:
            record.update(status="skipped", reason=str(skip))
        except StepFailed as failure:
            record.update(status="failed", error=f"{failure}\n{failure.tail}".strip())
            if failure.numbers:
                record["numbers"] = failure.numbers
        except Exception as error:  # the kit's own bug in one step must not end the others
            record.update(status="failed", error=f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=4)}")
        record["seconds"] = round(time.monotonic() - start, 1)
        if self.log(step.name).is_file():
            record["log"] = str(self.log(step.name))
        return record

    # ------------------------------------------------------------------ reports
    def environment(self) -> dict[str, Any]:
        """The environment step's numbers (empty until it succeeded)."""
        return self.records.get("environment", {}).get("numbers", {})

    def report(self) -> dict[str, Any]:
        """Everything the kit knows so far, as ``gpu_proof.json`` holds it."""
        statuses = [r["status"] for r in self.records.values()]
        return {
            "kit": "python -m benchmarks.gpu_proof", "mode": self.mode, "gpu": self.gpu, "started": self.started_at,
            "elapsed_s": round(self.elapsed(), 1), "budget_s": self.budget_s,
            "preload_s": self.runner.preload_s, "environment": self.environment(),
            "counts": {s: statuses.count(s) for s in ("ok", "failed", "skipped")},
            "steps": list(self.records.values()), "throughput": throughput_rows(self.records),
            "throughput_not_run": [r for r in _throughput_records(self.records) if r["status"] != "ok"],
            "fullct_inference": fullct_rows(self.records), "targets": targets(self),
            "kernel_classes": kernel_classes(self.records),
        }  # fmt: skip

    def save(self) -> None:
        """Rewrite gpu_proof.json and gpu_proof.md (atomically: a killed run leaves the last complete pair)."""
        report = self.report()
        write_json(self.out / "gpu_proof.json", report, default=str)
        write_text(self.out / "gpu_proof.md", format_markdown(report))


# ---------------------------------------------------------------------------------------------------------- steps
def step_environment(kit: Kit) -> dict[str, Any]:
    """Device name, driver, torch/CUDA/cuDNN/MONAI versions and the host's CPUs, as a child sees them."""
    info = kit.helper("environment", "environment", dry_run=kit.dry_run)
    kit.gpu = not kit.dry_run and bool(info["cuda_available"])  # torch's word, from a child: this process forks
    info["peak_bf16_tflops"], info["peak_source"] = peak_bf16_tflops(str(info.get("device_name") or ""), kit.gpu)
    return info


def step_data(kit: Kit) -> dict[str, Any]:
    """Synthetic training cases and two full-CT inference cases as DICOM (kept when written already), prepared."""
    from scripts.data.prepare import prepare

    (shape, pixel, chest), start = kit.sizes.case, time.monotonic()
    cases = [(kit.data / "train", f"LUNG1-{i + 1:03d}", i + 1) for i in range(kit.sizes.training_cases)]
    cases += [(kit.data / "fullct", f"FULLCT-{i + 1}", 7) for i in range(2)]  # one CT twice: the second is warm
    todo = [c for c in cases if not (c[0] / COLLECTION / c[1]).is_dir()]
    with ProcessPoolExecutor(max_workers=max(1, min(len(todo), usable_cpus()))) as pool:
        for done in [pool.submit(_write_case, *c, shape, pixel, chest) for c in todo]:
            done.result()
    written = time.monotonic() - start
    report = prepare(kit.data / "train", kit.prepared, num_workers=usable_cpus(), progress=False)
    datalist = json.loads((kit.prepared / "datalist.json").read_text())
    split = {k: len(datalist.get(k, [])) for k in ("training", "validation")}
    if not split["training"] or not split["validation"]:
        raise StepFailed(f"prepare gave {split} cases; see {kit.prepared / 'prepare_report.json'}")
    return {"case_shape": list(shape), "pixel_spacing_mm": pixel, "phantom": "chest" if chest else "synthetic",
            "cases_written": len(todo), "write_s": round(written, 1), "split": split,
            "prepare_s": round(time.monotonic() - start - written, 1),
            "rejected": len([c for c in report.get("cases", []) if c.get("status") == "rejected"])}  # fmt: skip


def _write_case(folder: Path, patient_id: str, seed: int, shape: tuple, pixel: float, chest: bool) -> None:
    """One synthetic CT with its SEG in the TCIA layout (a worker process of :func:`step_data`)."""
    from scripts.data.synthetic import write_case, write_chest_case

    if chest:
        write_chest_case(folder, patient_id, shape, pixel, 3.0, seed=seed)
    else:
        write_case(folder, patient_id, seed, shape, (pixel, pixel), 3.0, tumour_hu=400)


def step_network(kit: Kit) -> dict[str, Any]:
    """FLOPs of one training step (FlopCounterMode, forward + backward of the step's patches) on the device, and
    random weights for evaluation and inference (their values do not change the time)."""
    settings = {**kit.sizes.settings, "model_path": kit.weights}
    return kit.helper("network", "network", settings=json.dumps(settings, default=str))


def step_train(kit: Kit) -> dict[str, Any]:
    """One short epoch of train.yaml with validation and a checkpoint: AMP fp16 with GradScaler, fused AdamW and the
    NVML monitor on a GPU (train.yaml's defaults there); float32 on a CPU, where AMP is off."""
    epochs = {"train#trainer#epoch_length": kit.sizes.iterations}
    settings = kit.training("train", max_epochs=1, val_interval=1, **epochs)
    run_dir, child = kit.bundle("train", ["train.yaml"], **settings)
    found = re.search(r"best validation Dice ([0-9.]+) at epoch (\d+)", child.log_text())
    state = kit.helper("checkpoint", "train_checkpoint", path=str(run_dir / "checkpoints" / "latest.pt"))
    if state["epoch"] != 1:
        raise StepFailed(f"the checkpoint says epoch {state['epoch']}, not 1")
    return {"precision": "float16 AMP + GradScaler" if kit.gpu else "float32 (AMP is CUDA-only)",
            "iterations": state["iteration"], "validation_dice": float(found.group(1)) if found else None,
            "checkpoint": state, "run_dir": str(run_dir)}  # fmt: skip


def step_grad_scaler(kit: Kit) -> dict[str, Any]:
    """The fp16 run's checkpoint holds GradScaler's state: the loss was scaled."""
    state = kit.numbers("train")["checkpoint"]
    if not state["has_scaler"] or not state["scaler_scale"]:
        raise StepFailed(f"no GradScaler state in the fp16 run's checkpoint: {state}")
    return {"scale": state["scaler_scale"]}


def step_fused_adamw(kit: Kit) -> dict[str, Any]:
    """The training run's AdamW was the fused one (train.yaml's fused_optimizer on CUDA)."""
    state = kit.numbers("train")["checkpoint"]
    if state["fused"] is not True:
        raise StepFailed(f"AdamW's param group says fused={state['fused']!r}, not True")
    return {"fused": True}


def step_gpu_monitor(kit: Kit) -> dict[str, Any]:
    """The training run's GPU monitor sampled NVML into gpu_utilisation.csv and drew gpu_utilisation.png."""
    run_dir = Path(kit.numbers("train")["run_dir"])
    if "GPU utilisation (nvml)" not in kit.log("train").read_text(errors="replace"):
        raise StepFailed("the training log has no 'GPU utilisation (nvml)' line: the monitor did not use NVML")
    with open(run_dir / "gpu_utilisation.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    png = run_dir / "gpu_utilisation.png"
    if not rows or not png.is_file() or png.read_bytes()[:4] != b"\x89PNG":
        raise StepFailed(f"{len(rows)} samples in {run_dir / 'gpu_utilisation.csv'}, PNG there: {png.is_file()}")
    util = [float(r["util_percent"]) for r in rows if r["util_percent"] not in ("", "nan")]
    return {"samples": len(rows), "gpu": rows[0]["name"], "mean_util_percent": round(sum(util) / max(len(util), 1), 1),
            "peak_mem_used_mib": max(float(r["mem_used_mib"]) for r in rows)}  # fmt: skip


def step_resume(kit: Kit) -> dict[str, Any]:
    """Resume the training run from its checkpoint for a second epoch: it must start at epoch 1 and end at 2."""
    run_dir = Path(kit.numbers("train")["run_dir"])
    settings = kit.training("train", output_dir=run_dir, max_epochs=2, resume=True, val_interval=1000,
                            **{"train#trainer#epoch_length": kit.sizes.iterations})  # fmt: skip
    _, child = kit.bundle("resume", ["train.yaml"], **settings)
    found = re.search(r"resumed from .*: epoch (\d+), iteration (\d+)", child.log_text())
    state = kit.helper("checkpoint", "resume_checkpoint", path=str(run_dir / "checkpoints" / "latest.pt"))
    if not found or int(found.group(1)) != 1 or state["epoch"] != 2:
        raise StepFailed(f"resumed from epoch {found.group(1) if found else '(no resume line)'}, checkpoint at epoch "
                         f"{state['epoch']}: expected 1 and 2", child.tail())  # fmt: skip
    return {"resumed_from_epoch": 1, "epoch_after": state["epoch"], "iteration_after": state["iteration"]}


def step_profile(kit: Kit) -> dict[str, Any]:
    """profile.yaml: a chrome trace (with CUDA kernels on a GPU), its key averages and, on a GPU, memory.pickle."""
    wait, warmup, active, _ = kit.sizes.profile_schedule
    settings = kit.training(
        "profile",
        max_epochs=1,
        val_interval=1000,
        profiler_schedule=list(kit.sizes.profile_schedule),
        **{"train#trainer#epoch_length": wait + warmup + active},
    )
    run_dir, _ = kit.bundle("profile", ["train.yaml", "profile.yaml"], **settings)
    folder = run_dir / "profiler"
    traces = sorted(folder.glob("*-chrome_trace.json.gz"), key=lambda p: int(p.name.split("-")[0]))
    if not traces:
        raise StepFailed(f"no chrome trace in {folder}")
    averages = traces[0].with_name(traces[0].name.replace("chrome_trace.json.gz", "key_averages.json"))
    memory = folder / "memory.pickle"
    if kit.gpu and (not memory.is_file() or memory.stat().st_size == 0):
        raise StepFailed(f"no memory.pickle in {folder}")
    return {
        "trace": str(traces[0]),
        "trace_mb": round(traces[0].stat().st_size / 1e6, 2),
        "key_averages": str(averages),
        "memory_pickle_mb": round(memory.stat().st_size / 1e6, 2) if memory.is_file() else None,
    }


def step_summariser(kit: Kit) -> dict[str, Any]:
    """scripts.profiling.summarize_trace on the profile run's trace, checked against torch.profiler's key_averages() of
    the same run (an independent account of the same events), and its reading speed."""
    profile = kit.numbers("profile")
    trace = Path(profile["trace"])
    work: dict[str, int] = {}
    start = time.perf_counter()
    summary = summarize(trace, work=work)
    seconds = time.perf_counter() - start
    checks = compare_with_key_averages(summary, json.loads(Path(profile["key_averages"]).read_text()))
    inflated = work["read"]  # the uncompressed bytes it read: the whole trace
    numbers = {"sections": {name: {"count": s["count"], "total_s": round(s["mean_s"] * s["count"], 6),
                                   "source": summary["sources"].get(name)} for name, s in summary["sections"].items()},
               "kernels": summary["kernels"], "launches": summary["launches"], "events": summary["events"],
               "trace_mb_uncompressed": round(inflated / 1e6, 2), "seconds": round(seconds, 3),
               "mb_per_s": round(inflated / 1e6 / seconds, 1), "checks": checks, "trace": str(trace),
               "device": summary["device"], "idle": summary["idle"]}  # fmt: skip
    if kit.gpu and not summary["kernels"]:
        raise StepFailed(f"no CUDA kernel in {trace}: the profiler recorded the CPU only", numbers=numbers)
    wrong = [c for c in checks if not c["ok"]]
    if wrong:
        message = "the summariser and key_averages disagree: " + "; ".join(_check_text(c) for c in wrong)
        raise StepFailed(message, numbers=numbers)
    return numbers


def compare_with_key_averages(summary: dict[str, Any], rows: list[dict[str, Any]], rel: float = 0.01) -> list[dict]:
    """Checks of a trace summary against torch.profiler's key averages
    (:func:`scripts.profiling.profiler.key_average_rows`).

    Per section: the same number of instances; a CPU-timed section's total equal to its range's CPU total (``rel``,
    plus 5 us per instance for rounding); a kernel-timed one's total (first kernel start to last kernel end of each
    instance) at least the kernel time key_averages gives the range (the kernels its own thread launched in it: on
    one stream, kernels inside a span cannot take longer than the span). And the same number of kernels (copies and
    memsets are not kernels to either).

    On CUDA and ROCm ``key_averages()`` holds two rows per range: the CPU row (``device_type`` CPU: the range's CPU
    time, and the kernels launched in it) and the device row (the range as the GPU timeline shows it, no CPU time):
    CPU time is read from the first, a kernel-timed section from the second."""
    empty = {"count": 0, "cpu_time_total_us": 0.0, "device_time_total_us": 0.0}
    host = {r["name"]: r for r in rows if r.get("device_type", "CPU") == "CPU"}
    device: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("device_type", "CPU") in DEVICE_TYPES:
            device.setdefault(r["name"], []).append(r)
    checks: list[dict[str, Any]] = []
    for name, stats in summary["sections"].items():
        row = host.get(SECTION_PREFIX + name, empty)
        count, total = stats["count"], stats["mean_s"] * stats["count"]
        checks.append({"what": f"{name}: instances", "summariser": count, "key_averages": row["count"],
                       "ok": count == row["count"]})  # fmt: skip
        slack = rel + 5e-6 * count / max(total, 1e-9)
        if summary["sources"].get(name, "cpu") == "cpu":
            reference = row["cpu_time_total_us"] / 1e6
            ok = abs(total - reference) <= slack * max(reference, total)
            checks.append({"what": f"{name}: CPU seconds", "summariser": round(total, 6),
                           "key_averages": round(reference, 6), "ok": ok})  # fmt: skip
        else:  # the range as the device saw it (its rows on CUDA / HIP), else the kernels its CPU row launched
            on_device = device.get(SECTION_PREFIX + name)
            kernel_us = sum(r["device_time_total_us"] for r in on_device) if on_device else row["device_time_total_us"]
            reference = kernel_us / 1e6
            checks.append({"what": f"{name}: kernel span s >= kernel s in the range", "summariser": round(total, 6),
                           "key_averages": round(reference, 6), "busy_fraction": round(reference / max(total, 1e-9), 3),
                           "ok": reference <= total * (1 + slack)})  # fmt: skip
    kernels = sum(
        r["count"]
        for r in rows
        if r.get("device_type") in DEVICE_TYPES and not _is_copy(r["name"]) and not r["name"].startswith(SECTION_PREFIX)
    )
    checks.append({"what": "kernels", "summariser": summary["kernels"], "key_averages": kernels,
                   "ok": abs(summary["kernels"] - kernels) <= rel * kernels})  # fmt: skip
    return checks


def _is_copy(name: str) -> bool:
    """Whether a device row of key_averages is a copy or a memset (``Memcpy HtoD (...)``, ``Memset (Device)``)."""
    return name.startswith(("Memcpy", "Memset", "memcpy", "memset"))


def _check_text(check: dict[str, Any]) -> str:
    """One failed check in words."""
    return f"{check['what']}: summariser {check['summariser']}, key_averages {check['key_averages']}"


def step_evaluate_oom(kit: Kit) -> dict[str, Any]:
    """evaluate.yaml on the validation case with the sliding window's out-of-memory fallback forced once."""
    settings = kit.training("evaluate_oom", model_path=kit.weights, eval_split="validation", eval_pictures=0,
                            inference_backend="torch", **{"sliding_window_inferer#force_oom": 1})  # fmt: skip
    run_dir, child = kit.bundle("evaluate_oom", ["train.yaml", "evaluate.yaml"], **settings)
    retries = _fallbacks(child)
    summary = json.loads((run_dir / "eval" / "metrics_summary.json").read_text())
    return {"fallbacks": retries, "cases": summary.get("num_cases"), "failed": len(summary.get("failed", []))}


def step_inference_oom(kit: Kit) -> dict[str, Any]:
    """inference.yaml on one DICOM CT with the out-of-memory fallback forced once: NIfTI and DICOM SEG out."""
    case = sorted((kit.data / "train" / COLLECTION).iterdir())[0]
    settings = _inference(kit, case, **{"sliding_window_inferer#force_oom": 1})
    run_dir, child = kit.bundle("inference_oom", ["inference.yaml"], **settings)
    retries = _fallbacks(child)
    outputs = {kind: sorted(str(p) for p in run_dir.glob(f"*/*_{kind}")) for kind in ("seg.nii.gz", "seg.dcm")}
    if not all(outputs.values()):
        raise StepFailed(f"inference wrote {outputs} under {run_dir}", child.tail())
    return {"fallbacks": retries, "nifti": outputs["seg.nii.gz"][0], "seg": outputs["seg.dcm"][0]}


def _inference(kit: Kit, input_dir: Path, **settings: Any) -> dict[str, Any]:
    """Settings of an inference.yaml run on ``input_dir`` with the kit's random weights and the PyTorch backend,
    writing the NIfTI and the DICOM SEG (RTSTRUCT, SR and the report are CPU work, tested on the CPU)."""
    return {"input_dir": input_dir, "model_path": kit.weights, "inference_backend": "torch", "write_rtstruct": False,
            "write_sr": False, "write_report": False, **kit.sizes.settings, **settings}  # fmt: skip


def _fallbacks(child: Child) -> int:
    """How many times the run's sliding window fell back after an out-of-memory error; StepFailed if never."""
    count = child.log_text().count(FALLBACK_LOG)
    if not count:
        raise StepFailed(f"no '{FALLBACK_LOG}' warning in {child.log}: the fallback did not run", child.tail())
    return count


def step_torchrun(kit: Kit) -> dict[str, Any]:
    """multi_gpu_train.yaml under torchrun --nproc_per_node=1: NCCL on a GPU (gloo in the dry run), a short epoch
    with validation sharded over the ranks and the checkpoint written by rank 0."""
    backend = "nccl" if kit.gpu else "gloo"
    settings = kit.training("torchrun", max_epochs=1, val_interval=1, dist_backend=backend, dist_timeout_minutes=5,
                            **{"train#trainer#epoch_length": kit.sizes.iterations})  # fmt: skip
    run_dir, child = kit.bundle("torchrun", ["train.yaml", "multi_gpu_train.yaml"], torchrun=True, **settings)
    found = re.search(r"process group: rank 0 of (\d+), backend (\w+)", child.log_text())
    if not found or found.group(2) != backend or not (run_dir / "checkpoints" / "latest.pt").is_file():
        raise StepFailed(f"expected a {backend} process group and a checkpoint; found "
                         f"{found.group(0) if found else 'no process-group line'}", child.tail())  # fmt: skip
    return {"backend": found.group(2), "world_size": int(found.group(1))}


def step_throughput(kit: Kit) -> dict[str, Any]:
    """Today's defaults (the baseline) and the new rows, :data:`THROUGHPUT_SETS`, in one child (bench_switches.run_rows:
    imports, the CUDA context and the cache paid once), each over the sizes' timed steps; the child stops starting rows
    where the steps after this one would no longer fit the budget. The rows it finished count even when it was cut
    short. The defaults row's busy steps give the defaults' kernel classes where the profile step did not run."""
    rows, child = _rows_in_child(kit, "throughput", "throughput", THROUGHPUT_SETS)
    numbers = _rows_numbers(rows)
    numbers["defaults"] = next((row_classes(r) for r in rows if r["loop"] == DEFAULTS_SET and r.get("trace")), None)
    if child.returncode != 0 or not any(r["status"] == "ok" for r in rows):
        raise StepFailed(f"throughput: exit status {child.returncode}, {len(rows)} row(s) recorded", child.tail(),
                         numbers)  # fmt: skip
    return numbers


def step_compile_cache(kit: Kit) -> dict[str, Any]:
    """The full training's defaults (compile auto on: regional, fp16) compiled in a child with an empty compile cache,
    then the same network in a second child (a second run, as a resumed run or another rank is) from that cache, with
    CUDA graphs: the first step's seconds of each, and the second's hits and misses from torch's counters."""
    cache = kit.out / "compile_cache"
    shutil.rmtree(cache, ignore_errors=True)
    reserve = kit.sizes.estimates_s.get(COMPILE_GRAPHS_SET, 0.0)
    rows, first = _rows_in_child(kit, "compile_cache", "compile_cache_empty", COMPILE_SETS[:1], reserve_s=reserve,
                                 compile_cache_dir=cache)  # fmt: skip
    more, second = _rows_in_child(kit, "compile_cache", "compile_cache_reused", COMPILE_SETS[1:],
                                  compile_cache_dir=cache)  # fmt: skip
    rows += more
    numbers = {**_rows_numbers(rows), "cache_dir": str(cache), "cache_mb": round(_folder_bytes(cache) / 1e6, 1)}
    failed = [f"{r['loop']}: {r['status']} ({str(r.get('reason'))[:200]})" for r in rows if r["status"] != "ok"]
    if failed or first.returncode != 0 or second.returncode != 0:
        raise StepFailed(f"compile_cache: exit status {first.returncode} and {second.returncode}; " + "; ".join(failed),
                         second.tail(), numbers)  # fmt: skip
    hits = (rows[1].get("compile_cache") if len(rows) == 2 else None) or {}
    if not hits.get("fx_graph_hits"):
        raise StepFailed(f"the second process compiled without the cache's graphs: {hits}", second.tail(), numbers)
    return numbers


def step_throughput_earlier(kit: Kit) -> dict[str, Any]:
    """Last and only as far as the budget goes: the compiled step with fused attention, compile's reduce-overhead
    (from the compile rows' cache), then the rows earlier runs measured (:data:`LAST_SETS`)."""
    rows, child = _rows_in_child(kit, "throughput_earlier", "throughput_earlier", LAST_SETS,
                                 compile_cache_dir=kit.out / "compile_cache")  # fmt: skip
    numbers = _rows_numbers(rows)
    if child.returncode != 0:
        raise StepFailed(f"throughput_earlier: exit status {child.returncode}, {len(rows)} row(s) recorded",
                         child.tail(), numbers)  # fmt: skip
    return numbers


def _rows_in_child(kit: Kit, step: str, name: str, sets: Sequence[str], reserve_s: float = 0.0,
                   **settings: Any) -> tuple[list[dict[str, Any]], Child]:  # fmt: skip
    """``sets`` through bench_switches.run_rows in one child (log and records named ``name``), on the kit's data with
    ``settings``, starting no row past the time the steps after ``step`` (and ``reserve_s`` more) need; its rows as the
    kit reports them (:func:`_row`), and the child."""
    warmup, steps = kit.sizes.bench
    deadline_s = max(kit.budget_s - _later_s(kit, step) - reserve_s - kit.elapsed(), 0.0)
    merged = kit.training(step, benchmark_warmup=warmup, benchmark_steps=steps, benchmark_busy_steps=3,
                          bundle_root=ROOT, **settings)  # fmt: skip
    result = kit.out / "helpers" / f"{name}.json"
    result.unlink(missing_ok=True)
    args = ["helper", "throughput", "--out", str(result), "--settings", json.dumps(merged, default=str),
            "--output_dir", str(kit.out / "runs" / name), "--deadline_s", str(deadline_s),
            "--sets", json.dumps(list(sets))]  # fmt: skip
    limit = kit.time_left(name, factor=max(deadline_s / kit.sizes.timeout_s, 1.0) + 1.0)
    child = kit.runner.module("benchmarks.gpu_proof", args, kit.log(name), limit)
    rows = json.loads(result.read_text()) if result.is_file() else []
    return [_row(kit, r) for r in rows], child


def _later_s(kit: Kit, step: str) -> float:
    """The seconds the heavy steps after ``step`` are expected to take here (the last rows' step reserves none)."""
    after = kit.steps[kit.steps.index(STEP_BY_NAME[step]) + 1 :]
    return sum(kit.sizes.estimates_s.get(s.name, 0.0) for s in after
               if s.heavy and s.name != LAST_ROWS and (kit.gpu or not s.gpu_only))  # fmt: skip


def _rows_numbers(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A row step's numbers: its rows and the kernel classes of its fastest row."""
    return {"rows": rows, "fastest": fastest_row_classes(rows)}


def _folder_bytes(folder: Path) -> int:
    """The bytes of the files under ``folder`` (0 where there is none)."""
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if folder.is_dir() else 0


def _row(kit: Kit, record: dict[str, Any]) -> dict[str, Any]:
    """One throughput row as the kit reports it: the set's timings, its GPU-busy share and MFU."""
    row = {"loop": record["set"], "status": record["status"], "seconds": record.get("seconds")}
    if record["status"] != "ok":
        return {**row, "reason": record.get("reason") or record.get("error")}
    r = record["report"]["result"]
    busy = r.get("gpu_busy_fraction")
    row.update(ms_per_step=round(r["ms_per_step_median"], 1), ms_per_step_p90=round(r["ms_per_step_p90"], 1),
               patches_per_step=r["patches_per_step"], patches_per_s=round(r["patches_per_s"], 3),
               timed_steps=r["timed_steps"], data_wait_percent=round(100 * r["data_wait_fraction"], 1),
               gpu_busy_percent=None if busy is None else round(100 * busy, 1),
               first_step_s=r["first_step_s"] and round(r["first_step_s"], 1), peak_memory_gib=r["peak_memory_gib"],
               peak_reserved_gib=r.get("peak_reserved_gib"),
               cache=record["report"]["switches"].get("cache"), trace=record.get("trace"),
               compile_cache=r.get("compile_cache"), cuda_graphs=r.get("cuda_graphs"))  # fmt: skip
    return {**row, **mfu(kit, r["patches_per_s"])}


def fastest_row_classes(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Where the GPU's time goes in the fastest throughput row (most patches a second): the summariser's device time
    per kernel class and idle share of the trace of its busy steps (bench_switches keeps the fastest row's), beside
    the row's own GPU-busy share; the reason where there is no such trace."""
    ran = [r for r in rows if r["status"] == "ok"]
    if not ran:
        return {"reason": "no throughput row ran"}
    return row_classes(max(ran, key=lambda r: r["patches_per_s"]))


def row_classes(row: dict[str, Any]) -> dict[str, Any]:
    """The summariser's device time per kernel class and idle share of a row's busy-steps trace, beside the row's
    speed and GPU-busy share; the reason where it has no trace."""
    found: dict[str, Any] = {"loop": row["loop"], "patches_per_s": row["patches_per_s"],
                             "gpu_busy_percent": row.get("gpu_busy_percent")}  # fmt: skip
    if not row.get("trace"):
        why = "its busy steps were not profiled (the benchmark profiles them on a GPU only)"
        return {**found, "reason": f"no trace: {why}" if row.get("gpu_busy_percent") is None else "no trace saved"}
    try:
        summary = summarize(row["trace"])
    except TraceError as error:
        return {**found, "reason": str(error)}
    return {**found, "trace": row["trace"], "device": summary["device"], "idle": summary["idle"]}


def mfu(kit: Kit, patches_per_s: float) -> dict[str, Any]:
    """Model-FLOP utilisation at ``patches_per_s``: the network step's FLOP count per patch times the patches a second,
    over the device's dense bf16 peak; None with the reason where either is unknown."""
    network = kit.records.get("network", {})
    peak = kit.environment().get("peak_bf16_tflops")
    if network.get("status") != "ok":
        return {"mfu": None, "mfu_reason": "no FLOP count (the network step did not succeed)"}
    if not peak:
        return {"mfu": None, "mfu_reason": kit.environment().get("peak_source", "no environment")}
    numbers = network["numbers"]
    achieved = numbers["train_step_tflop"] / numbers["patches_per_step"] * patches_per_s
    return {"model_tflop_per_s": round(achieved, 1), "mfu": round(achieved / peak, 4)}


def step_cuda_graphs(kit: Kit) -> dict[str, Any]:
    """The training replayed as a CUDA graph trains as the eager one: two short trainings of train.yaml's network from
    the same weights on the same batches (fp16 with GradScaler, the fused AdamW, deterministic cuDNN), MONAI's own
    iteration and scripts.training.graphs' (warm-up, capture, replays): the losses of every step within 0.1 %, and the
    weights after them within 1 % of what training changed them by (L2 norms: a kernel's atomics may order sums
    differently, and Adam scales a gradient near zero up to the learning rate)."""
    numbers = kit.helper("cuda_graphs", "cuda_graphs", settings=json.dumps(kit.sizes.settings, default=str))
    summary = numbers["graphed"]["summary"]
    problems = []
    if summary["captures"] != 1 or summary["replayed"] < 1 or summary["eager"] or summary["disabled"]:
        problems.append(f"the graphed run did not capture once and replay: {summary}")
    if numbers["max_loss_difference"] > 1e-3 * numbers["loss_scale"]:
        problems.append(f"losses differ by up to {numbers['max_loss_difference']:.3g}")
    if numbers["weight_difference"] > 1e-2 * numbers["weight_change"]:
        problems.append(f"the weights differ by {numbers['weight_difference']:.3g} (L2) against a change of "
                        f"{numbers['weight_change']:.3g} in training")  # fmt: skip
    if problems:
        raise StepFailed("; ".join(problems), numbers=numbers)
    return numbers


#: the full-CT runs (run dir suffix, settings): inference's defaults (on a GPU the CT preprocessed on it); two
#: candidates for the network's seconds, never measured on a GPU: the window attention as one
#: scaled_dot_product_attention (memory-efficient attention with the bias as its mask, instead of four kernels over
#: a 343 x 343 matrix a head) and 8 windows a forward pass instead of 4; and 0.10's host preprocessing (DataLoader
#: workers), for the before and after on one GPU
FULLCT_RUNS = {
    "defaults": ("", {}),
    "fused attention": ("_fused", {"fused_attention": "true"}),
    "8 windows a pass": ("_sw8", {"sw_batch_size": 8}),
    "host preprocessing": ("_host", {"preprocessing_device": "cpu"}),
}


def step_fullct(kit: Kit) -> dict[str, Any]:
    """Two copies of one full CT (DICOM in, NIfTI + SEG out) with AMP per run of :data:`FULLCT_RUNS` (without a GPU
    the defaults only): the first case's and a warm case's seconds; end to end = read + preprocess + the case's seconds
    (which start once it is loaded). A run that fails is recorded with its reason and the next one runs; the step
    fails, with every run's numbers, when any did."""
    rows, failed, tails = [], {}, []
    for run, (suffix, overrides) in list(FULLCT_RUNS.items())[: None if kit.gpu else 1]:  # a CPU: the defaults only
        try:
            rows += _fullct_run(kit, run, suffix, overrides)
        except StepFailed as error:
            failed[run] = str(error)
            tails.append(f"--- {run}\n{error.tail}")
    defaults = [r for r in rows if r["run"] == "defaults" and r["warm"]]
    numbers = {"cases": rows, "warm_network_s": defaults[-1].get("predict") if defaults else None, "failed": failed}
    if failed:
        raise StepFailed("; ".join(f"{run}: {why}" for run, why in failed.items()), "\n".join(tails), numbers)
    return numbers


def _fullct_run(kit: Kit, run: str, suffix: str, overrides: dict[str, Any]) -> list[dict[str, Any]]:
    """One run of :data:`FULLCT_RUNS`: a row of stage seconds per case."""
    settings = _inference(kit, kit.data / "fullct", **overrides)
    run_dir, _ = kit.bundle(f"fullct_inference{suffix}", ["inference.yaml"], **settings)
    report = json.loads((run_dir / "inference_report.json").read_text())
    cases = [c for c in report["cases"] if c.get("status") == "done"]
    if len(cases) != 2:
        raise StepFailed(f"{len(cases)} of 2 cases done; see {run_dir / 'inference_report.json'}")
    rows = []
    for i, c in enumerate(cases):
        stages = c.get("stage_seconds", {})
        end = stages.get("read", 0.0) + stages.get("preprocess", 0.0) + (c.get("seconds") or 0.0)
        rows.append({"run": run, "case": c["case_id"], **stages, "windows": c.get("region", {}).get("windows"),
                     "seconds": c.get("seconds"), "end_to_end_s": round(end, 2), "warm": i > 0,
                     "labelled_share": _labelled_share(c.get("outputs", {}).get("nifti"))})  # fmt: skip
    return rows


def _labelled_share(nifti: str | None) -> float | None:
    """The share of the CT's voxels the label map written to ``nifti`` labels (None without one). The kit's weights
    are random: they label an arbitrary, large part of the thorax, where a tumour is a few thousandths of it, and the
    post-processing and the writers take time with the labelled voxels (a tumour's: benchmarks.bench_outputs)."""
    if not nifti or not Path(nifti).is_file():
        return None
    import nibabel
    import numpy as np

    labels = np.asarray(nibabel.load(nifti).dataobj)
    return round(float(np.count_nonzero(labels)) / labels.size, 4)


STEPS: tuple[Step, ...] = (
    Step("environment", "device, driver, torch/CUDA versions, host CPUs", step_environment, heavy=False),
    Step("data", "synthetic CTs as DICOM, prepared", step_data),
    Step("network", "FLOPs of a training step; random weights", step_network),
    Step("train", "1 epoch: AMP fp16 + GradScaler, fused AdamW, NVML monitor", step_train, needs=("data",)),
    Step("grad_scaler", "GradScaler state in the fp16 checkpoint", step_grad_scaler, ("train",), True, False),
    Step("fused_adamw", "the fused AdamW ran", step_fused_adamw, ("train",), True, False),
    Step("gpu_monitor", "NVML monitor CSV + PNG", step_gpu_monitor, ("train",), True, False),
    Step("cuda_graphs", "a CUDA-graph training equals the eager one", step_cuda_graphs, gpu_only=True),
    Step("throughput", "throughput: defaults, CUDA graphs, 8 and 16 patches", step_throughput, ("data", "network")),
    Step("compile_cache", "compile, cache empty, then from it", step_compile_cache, ("data", "network"), True),
    Step("fullct_inference", "full-CT inference, AMP: a first and a warm case", step_fullct, ("data", "network")),
    Step("resume", "resume from the checkpoint: epoch 1 -> 2", step_resume, needs=("train",)),
    Step("profile", "profile.yaml: chrome trace (CUDA kernels), memory.pickle", step_profile, needs=("data",)),
    Step("summariser", "summarize_trace vs key_averages(), MB/s", step_summariser, needs=("profile",), heavy=False),
    Step("evaluate_oom", "evaluate.yaml, OOM fallback forced once", step_evaluate_oom, needs=("data", "network")),
    Step("inference_oom", "inference.yaml, OOM fallback forced once", step_inference_oom, needs=("data", "network")),
    Step("torchrun", "torchrun --nproc_per_node=1, NCCL", step_torchrun, needs=("data",)),
    Step("throughput_earlier", "earlier runs' rows, budget allowing", step_throughput_earlier, ("data", "network")),
)
STEP_BY_NAME = {step.name: step for step in STEPS}


def select(steps: Sequence[Step], only: str | Sequence[str] | None) -> list[Step]:
    """``steps`` named in ``only`` (comma-separated) and every step they need, in the kit's order; all if None."""
    if not only:
        return list(steps)
    wanted = {n.strip() for n in (only.split(",") if isinstance(only, str) else only) if n.strip()}
    unknown = wanted - {s.name for s in steps}
    if unknown:
        raise SystemExit(f"--only: unknown step(s) {sorted(unknown)}; the steps are {[s.name for s in steps]}")
    by_name = {s.name: s for s in steps}
    pending = list(wanted)
    while pending:
        for need in by_name[pending.pop()].needs:
            if need not in wanted:
                wanted.add(need)
                pending.append(need)
    return [s for s in steps if s.name in wanted or s.name == "environment"]


# ------------------------------------------------------------------------------------------------- peaks and tables
def peak_bf16_tflops(device_name: str, gpu: bool) -> tuple[float | None, str]:
    """The device's dense bf16 peak from :data:`PEAK_BF16_TFLOPS` and where it came from; None with the reason for a
    CPU or a device not listed."""
    if not gpu:
        return None, "no GPU: MFU is a GPU measure"
    name = device_name.upper()
    for words, peak in PEAK_BF16_TFLOPS:
        if all(w.upper() in name for w in words):
            return peak, f"dense bf16 peak of {' '.join(words)}"
    return None, f"no dense bf16 peak known for {device_name!r}: add it to PEAK_BF16_TFLOPS in benchmarks/gpu_proof.py"


def throughput_rows(records: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The throughput rows that ran, each with its speed relative to today's defaults (the baseline of the same run)
    and to the seed-style loop, where each ran."""
    rows = [r for r in _throughput_records(records) if r["status"] == "ok"]
    bases = {name: next((r["patches_per_s"] for r in rows if r["loop"] == loop), None)
             for name, loop in (("vs_defaults", DEFAULTS_SET), ("vs_seed", SEED_SET))}  # fmt: skip
    return [{**r, **{k: round(r["patches_per_s"] / b, 2) if b else None for k, b in bases.items()}} for r in rows]


def _throughput_records(records: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Every row the row steps recorded (ok, failed or skipped), in the kit's order."""
    return [row for step in ROW_STEPS for row in (records.get(step, {}).get("numbers") or {}).get("rows", [])]


def kernel_classes(records: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Where the GPU's time goes: the defaults -- the profiled run (the summariser step's numbers of the profile
    step's trace), else the busy steps of the throughput step's defaults row -- and the fastest row of every row step
    (:func:`fastest_row_classes`), each with its reason where unmeasured."""
    keep = ("loop", "trace", "device", "idle", "gpu_busy_percent", "reason")
    summariser = records.get("summariser") or {}
    defaults = summariser.get("numbers") or {}
    if "device" not in defaults:
        defaults = ((records.get("throughput") or {}).get("numbers") or {}).get("defaults") or defaults
    if "device" not in defaults and "reason" not in defaults:
        defaults = {"reason": f"the summariser step {summariser.get('status', 'did not run')}"}
    found = [n["fastest"] for n in ((records.get(s) or {}).get("numbers") or {} for s in ROW_STEPS) if "fastest" in n]
    ran = [f for f in found if f.get("loop")]
    best = max(ran, key=lambda f: f.get("patches_per_s") or 0.0) if ran else found[0] if found else None
    if best is None:
        best = {"reason": f"the throughput step {(records.get('throughput') or {}).get('status', 'did not run')}"}
    return {
        name: {k: v for k, v in entry.items() if k in keep}
        for name, entry in (("defaults", defaults), ("fastest", best))
    }


def fullct_rows(records: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per case of each full-CT run that ran (those of a step that failed in another run too)."""
    numbers = (records.get("fullct_inference") or {}).get("numbers") or {}
    return [{"step": "fullct_inference", **case} for case in numbers.get("cases", [])]


def targets(kit: Kit) -> dict[str, str]:
    """The issue's targets (:data:`TARGETS`), each met / not met / unmeasured, with the row and number behind it."""
    if kit.mode != "full" or not kit.gpu:
        why = "no GPU" if kit.mode == "full" else f"{kit.mode} sizes, not the shipped ones"
        return dict.fromkeys(TARGETS, f"unmeasured: {why}")
    rows = {r["loop"]: r for r in throughput_rows(kit.records)}
    best = max(rows.values(), key=lambda r: r["patches_per_s"], default={})
    warm = [r for r in fullct_rows(kit.records) if r.get("warm") and r.get("run", "defaults") == "defaults"]
    seconds = [r["end_to_end_s"] for r in warm if r.get("end_to_end_s") is not None]
    network = [r["predict"] for r in warm if r.get("predict") is not None]
    mfu_percent = None if best.get("mfu") is None else round(100 * best["mfu"], 2)
    cached = rows.get(COMPILE_GRAPHS_SET, {})
    if not (cached.get("compile_cache") or {}).get("fx_graph_hits"):
        cached = {}  # compiled without the cache (the first compile did not run): not a cached first step
    found = {  # target -> (the row it is read from, its value, whether more is better)
        "patches_per_s": (best.get("loop"), best.get("patches_per_s"), True),
        # the defaults of a full GPU training: compile auto is on there (regional, fp16), cuda_graphs as train.yaml's
        "defaults_patches_per_s": (COMPILE_SET, rows.get(COMPILE_SET, {}).get("patches_per_s"), True),
        "mfu_percent": (best.get("loop"), mfu_percent, True),
        "gpu_busy_percent": (best.get("loop"), best.get("gpu_busy_percent"), True),
        "data_wait_percent": (DEFAULTS_SET, rows.get(DEFAULTS_SET, {}).get("data_wait_percent"), False),
        "compile_s": (COMPILE_SET, rows.get(COMPILE_SET, {}).get("first_step_s"), False),
        "compile_cached_s": (f"{COMPILE_GRAPHS_SET}, from the cache", cached.get("first_step_s"), False),
        "fullct_s": ("warm full-CT case, end to end", min(seconds, default=None), False),
        "network_s": ("warm full-CT case", min(network, default=None), False),
    }
    verdict = {}
    for name, (row, value, more) in found.items():
        if value is None:
            verdict[name] = f"unmeasured: no {row or 'throughput row'} result"
            continue
        met = value >= TARGETS[name] if more else value <= TARGETS[name]
        sense = ">=" if more else "<="
        verdict[name] = f"{'met' if met else 'not met'}: {value:g} ({row}; target {sense} {TARGETS[name]:g})"
    return verdict


def format_markdown(report: dict[str, Any]) -> str:
    """``gpu_proof.md``: the environment, every step, the throughput and inference tables and the targets."""
    env = report["environment"]
    kind = {"dry run": "DRY RUN on the CPU (tiny network and data): no number here is a GPU number",
            "tiny": "tiny network and data on the device: the paths only, no number worth reporting",
            "full": "measured on the device named below, one run"}[report["mode"]]  # fmt: skip
    if report["mode"] == "full" and not report["gpu"]:
        kind = "the shipped sizes on a machine without a GPU: no number here is a GPU number"
    lines = [f"# GPU proof kit ({kind})", "",
             f"`{report['kit']}`, started {report['started']}, {report['elapsed_s']:.0f} s of a "
             f"{report['budget_s']:.0f} s budget; steps " + ", ".join(f"{k} {v}" for k, v in report["counts"].items())
             + ".", "",
             f"Bundle {env.get('bundle_version')} ({env.get('bundle_commit') or 'no git commit'}). "
             f"Device: {env.get('device_name')} ({env.get('total_memory_gib')} GiB), driver {env.get('driver')}, "
             f"torch {env.get('torch')}, CUDA {env.get('cuda')}, cuDNN {env.get('dnn_version')}, MONAI "
             f"{env.get('monai')}, Python {env.get('python')}; host CPUs: {env.get('usable_cpus')} usable of "
             f"{env.get('cpu_count')}; dense bf16 peak: {env.get('peak_bf16_tflops')} TFLOP/s "
             f"({env.get('peak_source')}).", "",
             "| step | what it proves | status | s | numbers / reason |", "|---|---|---|---|---|"]  # fmt: skip
    for r in report["steps"]:
        detail = r.get("reason") or (r.get("error", "").splitlines() or [""])[0] or _brief(r.get("numbers", {}))
        lines.append(f"| {r['name']} | {r['title']} | {r['status']} | {r['seconds']:.1f} | {detail} |")
    if report["throughput"]:
        lines += [
            "",
            "Training throughput (benchmark.yaml; the compile rows each in a process of its own, sharing one compile "
            "cache; ms/step median over the timed steps; GPU busy = kernel time over step time; MFU over the dense "
            "bf16 peak; peak GiB = the allocator's peak over the timed steps (reserved: what it holds; a CUDA graph's "
            "pool stays reserved and its replays allocate nothing); first step = compile and algorithm search; vs "
            "defaults = against today's defaults, this run):",
            "",
            "| loop | cache | steps | ms/step | patches/s | data wait | GPU busy | MFU | peak GiB (reserved) | "
            "first step s | vs defaults | compile cache, CUDA graph |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in report["throughput"]:
            share = f"{100 * r['mfu']:.1f} %" if r.get("mfu") is not None else "n/a"
            busy = f"{r['gpu_busy_percent']:.1f} %" if r.get("gpu_busy_percent") is not None else "n/a"
            ratio = f"{r['vs_defaults']:.2f}x" if r.get("vs_defaults") else ""
            reserved = f" ({r['peak_reserved_gib']:.2f})" if r.get("peak_reserved_gib") is not None else ""
            lines.append(
                f"| {r['loop']} | {r['cache']} | {r['timed_steps']} x {r['patches_per_step']} | "
                f"{r['ms_per_step']:.0f} | {r['patches_per_s']:.2f} | {r['data_wait_percent']:.1f} % | {busy} | "
                f"{share} | {r['peak_memory_gib']:.2f}{reserved} | {r['first_step_s'] or 'n/a'} | {ratio} | "
                f"{_row_notes(r)} |"
            )
    others = report.get("throughput_not_run", [])
    if others:  # a failed or skipped row says so in the table's file too, not only in the JSON
        lines += ["", "Throughput rows that did not run:"]
        lines += [f"- {r['loop']}: {r['status']}: {str(r.get('reason') or '')[:200]}" for r in others]
    if report["fullct_inference"]:
        lines += [
            "",
            "Full-CT inference (inference_report.json's stage seconds; load = read + preprocess, network = predict; "
            "labelled: the share of the CT's voxels the random weights label, where a tumour is a few thousandths):",
            "",
            "| run | case | load s | region s | network s | postprocess s | write s | end to end s | windows "
            "| labelled |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in report["fullct_inference"]:
            load = r.get("read", 0.0) + r.get("preprocess", 0.0)
            lines.append(
                f"| {r.get('run', r['step'])} | {r['case']} | {load:.2f} | {r.get('region', 0):.2f} | "
                f"{r.get('predict', 0):.2f} | {r.get('postprocess', 0):.2f} | {r.get('write', 0):.2f} | "
                f"{r.get('end_to_end_s', 'n/a')} | {r.get('windows')} | {_percent(r.get('labelled_share'))} |"
            )
    lines += _kernel_class_lines(report.get("kernel_classes", {}))
    lines += ["", "Targets:"] + [f"- {name}: {text}" for name, text in report["targets"].items()]
    return "\n".join(lines) + "\n"  # fmt: skip


def _percent(share: float | None) -> str:
    """A share (0 to 1) as a percentage for the tables; blank when unknown."""
    return "" if share is None else f"{100 * share:.2f} %"


def _row_notes(row: dict[str, Any]) -> str:
    """A row's compile-cache counts (where it compiled) and what its CUDA graph did (where it had one)."""
    notes = []
    cache = row.get("compile_cache") or {}
    if any(cache.values()):
        notes.append(f"{cache.get('fx_graph_hits', 0)} graphs from the cache, {cache.get('fx_graph_misses', 0)} "
                     "compiled")  # fmt: skip
    graphs = row.get("cuda_graphs")
    if graphs and graphs.get("disabled"):
        notes.append(f"graph: none ({graphs['disabled'][:80]})")
    elif graphs:
        notes.append(f"graph captured at step {graphs['captured_at_iteration']}, {graphs['replayed']} replays, "
                     f"{graphs['eager']} eager")  # fmt: skip
    return "; ".join(notes)


def _kernel_class_lines(found: dict[str, dict[str, Any]]) -> list[str]:
    """The markdown of where the GPU's time goes: for the profiled defaults run and the fastest throughput row, the
    summariser's table as ``python -m scripts.summarize_trace`` prints it, or why there is none."""
    if not found:
        return []
    lines = ["", "Where the GPU's time goes (`python -m scripts.summarize_trace TRACE`: device time per kernel class, "
             "classed by kernel name; idle: wall time less the union of device activity):"]  # fmt: skip
    titles = {"defaults": "Profiled defaults run (profile step)", "fastest": "Fastest throughput row"}
    for name, title in titles.items():
        entry = found.get(name, {})
        if entry.get("loop"):
            busy = entry.get("gpu_busy_percent")
            title += f", {entry['loop']}" + ("" if busy is None else f" (the benchmark's GPU busy {busy:.1f} %)")
        if "device" not in entry:
            lines += ["", f"{title}: {entry.get('reason', 'not measured')}."]
            continue
        lines += ["", f"{title}, `{entry['trace']}`:", "", "```text", *format_device_table(entry["device"],
                  entry["idle"]), "```"]  # fmt: skip
    return lines


def _brief(numbers: dict[str, Any], width: int = 160) -> str:
    """A step's scalar numbers in one short line for the table."""
    parts = [f"{k} {v}" for k, v in numbers.items() if isinstance(v, (int, float, str)) and len(str(v)) < 40]
    text = ", ".join(parts)
    return text if len(text) <= width else text[: width - 3] + "..."


def _indent(text: str) -> str:
    """``text`` indented under the step's line of the running output."""
    return "\n".join("    " + line for line in text.splitlines())


def _flags(settings: dict[str, Any]) -> list[str]:
    """``--key value`` pairs as fire and ``monai.bundle run`` read them (lists as Python literals)."""
    return [part for key, value in settings.items() for part in (f"--{key}", str(value))]


def _cuda_visible() -> bool:
    """Whether this machine has an NVIDIA GPU, without initialising CUDA here (a dry run forks)."""
    return Path("/dev/nvidiactl").exists()


# ------------------------------------------------------------------------------------------------- the children's side
def helper_environment(out: str, dry_run: bool = False) -> None:
    """(Child) the device report of scripts.training.accelerator, the driver's version and the host's CPUs, to
    ``out``."""
    import torch
    from scripts.training.accelerator import device_report

    device = torch.device("cuda" if torch.cuda.is_available() and not as_bool(dry_run) else "cpu")
    info = device_report(device)
    info.pop("settings", None)
    info.update(driver=_driver_version(), usable_cpus=usable_cpus(), cpu_count=os.cpu_count(),
                cuda_available=torch.cuda.is_available(), **bundle_version())  # fmt: skip
    write_json(out, info, default=str)


def bundle_version() -> dict[str, str | None]:
    """The version of the bundle measured (``configs/metadata.json``) and its git commit where the tree is a clone
    (None where the tree has no git history): a run's files say which code gave their numbers."""
    version = json.loads((ROOT / "configs" / "metadata.json").read_text())["version"]
    commit = None
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10)  # fmt: skip
        if done.returncode == 0 and done.stdout.strip():
            commit = done.stdout.strip()
    return {"bundle_version": version, "bundle_commit": commit}


def _driver_version() -> str | None:
    """The NVIDIA driver's version (nvidia-smi, which ships with the driver), None without one."""
    query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
    with contextlib.suppress(OSError, subprocess.SubprocessError, IndexError):
        return subprocess.run(query, capture_output=True, text=True, timeout=10, check=True).stdout.split()[0]
    return None


def helper_network(out: str, settings: str | dict) -> None:
    """(Child) train.yaml's network with ``settings`` (JSON): its random weights to ``model_path`` (with the sidecar
    naming the labels) and the FLOPs of one training step on the device (FlopCounterMode: matmuls and convolutions of
    the forward and the backward over ``batch_size * num_samples`` patches), to ``out``."""
    import torch
    from monai.bundle import ConfigParser
    from scripts.training.weights import save_weights
    from torch.utils.flop_counter import FlopCounterMode

    parser = ConfigParser()
    parser.read_config(str(ROOT / "configs" / "train.yaml"))
    parser.update(json.loads(settings) if isinstance(settings, str) else settings)  # fire decodes JSON itself
    network = parser.get_parsed_content("network_def")
    # parsed, not read raw: train.yaml's ids may be references (num_samples is one to displayable_configs)
    weights = save_weights(network, parser.get_parsed_content("model_path"), parser.get_parsed_content("labels"))
    device = parser.get_parsed_content("device")
    roi = [int(r) for r in parser.get_parsed_content("roi_size")]
    patches = int(parser.get_parsed_content("batch_size")) * int(parser.get_parsed_content("num_samples"))
    network = network.to(device).train()
    batch = torch.rand(patches, 1, *roi, device=device)
    precision = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    with FlopCounterMode(display=False) as counter:
        with precision:
            output = network(batch)
        forward = counter.get_total_flops()
        output.float().mean().backward()
    described = {"network": type(network).__name__}
    if "feature_size" in parser["network_def"]:  # SwinUNETR's width (the dry run's BasicUNet has none)
        described["feature_size"] = int(parser.get_parsed_content("feature_size"))
    write_json(
        out,
        {
            **described,
            "roi_size": roi,
            "patches_per_step": patches,
            "parameters": sum(p.numel() for p in network.parameters()),
            "device": str(device),
            "forward_tflop": round(forward / 1e12, 4),
            "train_step_tflop": round(counter.get_total_flops() / 1e12, 4),
            "weights": str(weights),
        },
    )


def helper_checkpoint(out: str, path: str) -> None:
    """(Child) what a training checkpoint says: epoch, iteration, GradScaler's scale, whether AdamW was fused."""
    import torch

    state = torch.load(path, map_location="cpu", weights_only=True)
    groups = state.get("optimizer", {}).get("param_groups", [{}])
    scaler = state.get("scaler") or {}
    write_json(out, {"epoch": int(state["trainer"]["epoch"]), "iteration": int(state["trainer"]["iteration"]),
                     "has_scaler": "scaler" in state, "scaler_scale": scaler.get("scale"),
                     "fused": groups[0].get("fused")}, default=float)  # fmt: skip


def helper_throughput(out: str, settings: str | dict, output_dir: str, deadline_s: float,
                      sets: str | Sequence[str] = THROUGHPUT_SETS) -> None:  # fmt: skip
    """(Child) ``sets`` (a JSON list of bench_switches' set names) through bench_switches.run_rows on train.yaml +
    benchmark.yaml with ``settings`` (JSON), starting no row past ``deadline_s`` from now; the records to ``out``,
    rewritten after every row."""
    configs = [ROOT / "configs" / "train.yaml", ROOT / "configs" / "benchmark.yaml"]
    settings = json.loads(settings) if isinstance(settings, str) else settings
    sets = json.loads(sets) if isinstance(sets, str) else list(sets)  # fire decodes JSON itself
    estimates = GPU.estimates_s if settings.get("roi_size") is None else {}  # the shipped sizes, else a quick run
    run_rows(sets, configs, settings, output_dir, time.monotonic() + float(deadline_s), estimates,
             progress=lambda records: write_json(out, records, default=str), keep_trace=True)  # fmt: skip


def helper_cuda_graphs(out: str, settings: str | dict, steps: int = 8, patches: int = 2, device: str = "cuda") -> None:
    """(Child) train.yaml's network, loss and fused AdamW trained ``steps`` steps twice from the same weights on the
    same ``patches``-patch batches (fp16 AMP with GradScaler, cuDNN deterministic): with MONAI's own iteration and with
    scripts.training.graphs' (eager warm-up, capture, replays; on a CPU all eager). Each run's losses, seconds and the
    graphed run's summary, the largest loss difference, the L2 norms of the weights' difference and of the eager run's
    change in training, and whether the weights are bitwise equal, to ``out``."""
    import copy

    import torch
    from ignite.engine import Events
    from monai.bundle import ConfigParser
    from monai.engines import SupervisedTrainer
    from scripts.training.graphs import GraphedIteration

    parser = ConfigParser()
    parser.read_config(str(ROOT / "configs" / "train.yaml"))
    parser.update(json.loads(settings) if isinstance(settings, str) else settings)
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = False, True
    device = torch.device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    roi = [int(r) for r in parser.get_parsed_content("roi_size")]
    torch.manual_seed(0)
    start = parser.get_parsed_content("network_def").to(device)
    generator = torch.Generator(device).manual_seed(0)
    data = [{"image": torch.rand(patches, 1, *roi, device=device, generator=generator),
             "label": (torch.rand(patches, 1, *roi, device=device, generator=generator) > 0.9).float()}
            for _ in range(int(steps))]  # fmt: skip
    runs: dict[str, dict[str, Any]] = {}
    for name, iteration in (("eager", None), ("graphed", GraphedIteration())):
        network = copy.deepcopy(start)
        optimizer = torch.optim.AdamW(network.parameters(), lr=1e-3, weight_decay=1e-5, fused=True)
        trainer = SupervisedTrainer(device=device, max_epochs=1, train_data_loader=data, network=network,
                                    optimizer=optimizer, loss_function=parser.get_parsed_content("loss"), amp=True,
                                    amp_kwargs={"dtype": torch.float16}, iteration_update=iteration,
                                    decollate=False)  # fmt: skip
        losses: list[float] = []
        trainer.add_event_handler(
            Events.ITERATION_COMPLETED, lambda e, seen=losses: seen.append(float(e.state.output["loss"]))
        )
        sync()
        began = time.perf_counter()
        trainer.run()
        sync()
        runs[name] = {"losses": losses, "seconds": round(time.perf_counter() - began, 3), "network": network,
                      "scale": trainer.scaler.get_scale()}  # fmt: skip
        if iteration is not None:
            runs[name]["summary"] = iteration.summary()
    eager, graphed = runs["eager"].pop("network"), runs["graphed"].pop("network")
    pairs = list(zip(graphed.parameters(), eager.parameters(), start.parameters(), strict=True))

    def norm(tensors: Any) -> float:
        return float(sum(t.double().square().sum() for t in tensors) ** 0.5)

    write_json(out, {
        **runs, "steps": int(steps), "patches": patches, "roi_size": roi,
        "max_loss_difference": max(abs(a - b) for a, b in zip(runs["graphed"]["losses"], runs["eager"]["losses"])),
        "loss_scale": max(abs(x) for x in runs["eager"]["losses"]),
        "weight_difference": norm(g - e for g, e, _ in pairs),
        "weight_change": norm(e - s0 for _, e, s0 in pairs),
        "bitwise_equal": all(torch.equal(g, e) for g, e, _ in pairs),
    })  # fmt: skip


HELPERS = {"environment": helper_environment, "network": helper_network, "checkpoint": helper_checkpoint,
           "throughput": helper_throughput, "cuda_graphs": helper_cuda_graphs}  # fmt: skip


# -------------------------------------------------------------------------------------------------------------- CLI
def main(
    output_dir: str, dry_run: bool | str = False, budget_s: float = 450.0, only: str | None = None, tiny: bool = False
) -> None:
    """Run the kit (see the module docstring); ``DIR/gpu_proof.json`` and ``.md`` hold the results. ``tiny``: the dry
    run's network and data on the GPU (the GPU paths in seconds, no number worth reporting)."""
    dry = as_bool(dry_run, "dry_run")
    gpu = not dry and _cuda_visible()
    kit = Kit(Path(output_dir).resolve(), dry, gpu, budget_s, tiny=as_bool(tiny, "tiny"))
    kit.out.mkdir(parents=True, exist_ok=True)
    steps = select(STEPS, only)
    mode = "dry run on the CPU" if dry else ("GPU" if gpu else "no GPU found: the CUDA-only steps will be skipped")
    print(f"gpu_proof: {len(steps)} steps, {mode}, budget {budget_s:.0f} s -> {kit.out}", flush=True)
    kit.run(steps)
    print(format_markdown(kit.report()), flush=True)


if __name__ == "__main__":
    import fire

    if len(sys.argv) > 1 and sys.argv[1] == "helper":
        fire.Fire(HELPERS, command=sys.argv[2:])
    else:
        fire.Fire(main)

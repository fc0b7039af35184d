"""The GPU proof kit: one command that proves the bundle's GPU paths and measures them, for a GPU lent for minutes.

    python -m benchmarks.gpu_proof --output_dir DIR [--budget_s 450] [--only throughput,resume] [--dry_run true]

:data:`STEPS`, in order: the environment; synthetic chest CTs as DICOM, prepared; the network's FLOPs a training step
and random weights; the training throughput of :data:`THROUGHPUT_SETS` (``benchmark.yaml``, a row per set of
switches); compile with an empty compile cache, then from it in a second process; full-CT inference, a first and a
warm case; tests/test_gpu.py's gpu tests at the kit's sizes (``pytest -m gpu``: AMP training, resume, the profiler
against ``key_averages()``, the out-of-memory fallback, CUDA graphs against eager, torchrun with NCCL), each reported
as a step; last :data:`LAST_SETS`' rows. The tests and the last rows take what the budget leaves, never the rows
before. Then where the GPU's time goes for the defaults and the fastest row, and the targets (:data:`TARGETS`).

A step runs in a child with a time limit (:class:`Runner`): a crash or a hang ends that step only, ``failed`` with its
log's last lines (``DIR/logs/<step>.log``); ``skipped`` says why (``no GPU``; ``budget``: its estimate in
:class:`Sizes` would pass ``--budget_s``; a step it needs failed). ``DIR/gpu_proof.json`` and ``.md`` are rewritten
after every step. ``--only`` runs the named steps and the steps they need; a name that is no step picks the gpu tests
whose names hold it (``--only resume,cuda_graphs``). ``--dry_run true``: tiny sizes (:data:`DRY`) on the CPU, the
CUDA-only steps and the gpu tests skipped with the reason (tests/test_gpu_proof.py runs it); ``--tiny true``: those
sizes on the GPU (the paths in seconds). Neither prints a GPU number.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
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
from xml.etree import ElementTree

from benchmarks.bench_switches import _as_literal, run_rows
from scripts.common.config import as_bool
from scripts.common.cpus import usable_cpus
from scripts.common.files import write_json, write_text
from scripts.common.labels import COLLECTION
from scripts.profiling.summarize_trace import TraceError, format_device_table, summarize

ROOT = Path(__file__).resolve().parents[1]
GPU_TESTS = ROOT / "tests" / "test_gpu.py"
#: dense bf16 peak (TFLOP/s, no sparsity) by the words of torch's device name (H100 SXM5's: "NVIDIA H100 80GB HBM3"):
#: the first entry whose words all occur in it wins; a device not listed gets no MFU (it says so), not a guessed one
PEAK_BF16_TFLOPS: tuple[tuple[tuple[str, ...], float], ...] = (
    (("H200",), 989.4), (("H100", "PCIe"), 756.0), (("H100", "HBM3"), 989.4), (("H100", "SXM"), 989.4),
    (("A100",), 312.0), (("MI300X",), 1307.4))  # fmt: skip
#: the targets the kit prints as met or not (no test asserts them): patches/s of the fastest row and of the full
#: training's defaults, MFU and GPU busy of the fastest row, a compile's first step with an empty cache and from the
#: cache, a warm full CT end to end and its network time
TARGETS = {"patches_per_s": 45.0, "defaults_patches_per_s": 35.0, "mfu_percent": 10.0, "gpu_busy_percent": 95.0,
           "data_wait_percent": 5.0, "compile_s": 90.0, "compile_cached_s": 20.0, "fullct_s": 1.5,
           "network_s": 0.25}  # fmt: skip
#: the throughput rows (bench_switches' sets): the defaults (the baseline; compile auto off in a short run, cuda_graphs
#: on: the "CUDA graphs" row repeats them), their step with the MetaTensor batch, decollation and synchronised steps
#: (docs/performance.md, "The host's share of a training step"), 8 and 16 patches a step with the learning-rate rule;
#: the compile rows, each in a process of its own sharing one compile cache: the full training's defaults (compile auto
#: on there) with the cache empty, then from it with CUDA graphs; last the rows a short budget drops
SEED_SET, DEFAULTS_SET = "original-style loop (no cache, DataLoader, fp16)", "bundle defaults (cache auto)"
GRAPHS_SET, HOST_CACHE_SET = "CUDA graphs (fp16)", "cache memory, 4 workers"
COMPILE_SET, COMPILE_GRAPHS_SET = "compile regional (fp16)", "compile regional (fp16) + CUDA graphs"
METATENSOR_SET = "MetaTensor batch, decollated, synchronised steps"
THROUGHPUT_SETS = (DEFAULTS_SET, METATENSOR_SET, GRAPHS_SET, "8 patches a step (fp16, lr x1.41)",
                   "16 patches a step (fp16, lr x2)")  # fmt: skip
COMPILE_SETS = (COMPILE_SET, COMPILE_GRAPHS_SET)
EARLIER_SETS = ("amp bfloat16", "fused window attention (bf16)", "channels_last (bf16)", HOST_CACHE_SET, SEED_SET)
#: the last rows: the compiled step with the window attention as one scaled_dot_product_attention (compiled, the
#: softmax is the step's largest class of GPU time: docs/performance.md, "Where a training step's GPU time goes"; its
#: first step, a compilation of its own, also measures a cold compile of a smaller graph); compile's CUDA graphs of
#: each region (reduce-overhead) against the whole step's, from the compile rows' cache; then the older settings
FUSED_COMPILE_SET = "compile regional (fp16) + CUDA graphs, fused attention"
REDUCE_OVERHEAD_SET = "compile regional, reduce-overhead (fp16)"
LAST_SETS = (FUSED_COMPILE_SET, REDUCE_OVERHEAD_SET, *EARLIER_SETS)
#: the steps that measure throughput rows, in the kit's order; the steps that take what the budget leaves
ROW_STEPS, LAST_STEPS = ("throughput", "compile_cache", "throughput_earlier"), ("gpu_tests", "throughput_earlier")
#: modules every child would import (~15 s each on an H200 machine, ~10 s on 2 cores): imported once, then forked
PRELOAD = ("torch", "monai.bundle", "monai.engines", "monai.handlers", "monai.networks.nets", "scripts.data.dataset",
           "scripts.training.checkpoint", "scripts.inference.inferers", "scripts.inference.engine",
           "scripts.inference.outputs", "scripts.evaluation.case_metrics", "scripts.inference.inputs",
           "scripts.profiling.profiler", "scripts.profiling.benchmark", "scripts.training.weights",
           "scripts.inference.ensemble", "scripts.inference.figures", "scripts.training.accelerator",
           "scripts.training.compilation", "scripts.training.graphs")  # fmt: skip
NVIDIA = "/dev/nvidiactl"  # where an NVIDIA driver runs; looked for without initialising CUDA here (the kit forks)
STOP_GRACE_S = 30  # a child interrupted at its time limit (SIGINT: pytest writes its results) is killed this later


# ------------------------------------------------------------------------------------------------------------ sizes
@dataclass(frozen=True)
class Sizes:
    """How large the kit's runs (and tests/test_gpu.py's) are: ``settings`` on top of every bundle run's configs;
    ``case``, the synthetic CT: (columns, rows, slices), pixel spacing (mm), whether it is the chest phantom
    (:func:`scripts.data.synthetic.write_chest_case`); ``estimates_s``, the steps' seconds (the budget's guard)."""

    settings: dict[str, Any]
    case: tuple[tuple[int, int, int], float, bool]
    training_cases: int  # written and prepared: the split gives most to training, one to validation
    bench: tuple[int, int]  # a throughput row's warm-up (graphs: 3 eager steps, then the capture) and timed iterations
    timeout_s: float  # one child's limit; a run that compiles gets three times this
    estimates_s: dict[str, float] = field(default_factory=dict)  # steps, and throughput rows by their set's name


#: train.yaml's own settings (SwinUNETR f48, 96^3 patches, 4 a step) on chest CTs. Estimates: the kit's seconds on an
#: H200 (docs/performance.md, "One NVIDIA H200", whose files it links; rounded up; the seed-style row: its 981 ms a
#: step). Guesses where no file holds a step's seconds: 8 and 16 patches, 38 steps at 2x and 4x the defaults' 160 ms
#: plus cuDNN's search; CUDA graphs, the MetaTensor row: the defaults without the cache build; full CT: 4 runs of 13 s;
#: fused attention: a cold compile; reduce-overhead: part cached; the gpu tests: their start. A throughput step's own
#: figure is its first row (it stops its rows where the rest of the kit would no longer fit).
GPU = Sizes(settings={}, case=((512, 512, 120), 0.9765625, True), training_cases=4, bench=(5, 30), timeout_s=180,
            estimates_s={"environment": 19, "data": 9, "network": 4, "throughput": 60, "compile_cache": 189,
                         "fullct_inference": 52, "gpu_tests": 30, "throughput_earlier": 25, DEFAULTS_SET: 33,
                         METATENSOR_SET: 15, GRAPHS_SET: 15, "8 patches a step (fp16, lr x1.41)": 30,
                         "16 patches a step (fp16, lr x2)": 45, COMPILE_SET: 162, COMPILE_GRAPHS_SET: 27,
                         FUSED_COMPILE_SET: 162, REDUCE_OVERHEAD_SET: 120, "amp bfloat16": 24,
                         "fused window attention (bf16)": 8, "channels_last (bf16)": 18, HOST_CACHE_SET: 15,
                         SEED_SET: 40})  # fmt: skip
#: a small BasicUNet steps ~4x faster than SwinUNETR f12 on 2 cores (0.5-1 s against 2-5 s for a 64 x 32 x 32 patch,
#: forward + backward), so a dozen runs fit in a minute; its patch is the smallest check_config allows
DRY = Sizes(settings={"network_def": {"_target_": "BasicUNet", "spatial_dims": 3, "in_channels": 1,
                                      "out_channels": "@num_classes", "features": [4, 4, 8, 8, 16, 4]},
                      "roi_size": [64, 32, 32], "spacing": [2.0, 2.0, 3.0], "num_samples": 1, "num_workers": 0,
                      "sw_batch_size": 2, "device": "$torch.device('cpu')"},
            case=((48, 48, 24), 2.0, False), training_cases=4, bench=(0, 1), timeout_s=150)  # fmt: skip
#: the dry run's sizes on the default device: the GPU paths in seconds (``--tiny true``; tests/test_gpu.py's default)
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
    """How a child process ended: exit status (None: stopped at its time limit), seconds, its log."""

    returncode: int | None
    seconds: float
    log: Path

    def tail(self, lines: int = 25) -> str:
        """The last ``lines`` lines of the log (each cut to 300 characters): where a traceback ends."""
        text = self.log.read_text(errors="replace") if self.log.is_file() else ""
        return "\n".join(line[:300] for line in text.splitlines()[-lines:])


class Runner:
    """Run ``python -m <module> <args>``, or a function, in a child process with its output in a log file and a time
    limit: a crash, a CUDA error or a hang ends that child only (its process group, DataLoader workers included); at
    the limit the group is interrupted (SIGINT, as Ctrl-C) and killed :data:`STOP_GRACE_S` later. The child is a fork
    of this process, which imported torch and MONAI once (:data:`PRELOAD`) and never initialises CUDA (a forking
    process must not): nothing a child does (a CUDA context, compiled graphs, warm caches) carries over to the next."""

    def __init__(self) -> None:
        self.preload_s: float | None = None

    def module(self, module: str, args: Sequence[str], log: Path, timeout_s: float, env: dict | None = None) -> Child:
        """``python -m module args`` in a forked child, run from the bundle's root with ``env`` set."""

        def run() -> None:
            sys.argv = [module, *args]
            runpy.run_module(module, run_name="__main__", alter_sys=True)

        return self.call(run, log, timeout_s, env)

    def call(self, function: Callable[[], Any], log: Path, timeout_s: float, env: dict | None = None) -> Child:
        """``function()`` in a forked child, run from the bundle's root with ``env`` set."""
        self._preload()
        log.parent.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _run_forked(function, log, env or {})  # never returns
        return Child(_wait(pid, start + timeout_s), time.monotonic() - start, log)

    def _preload(self) -> None:
        """Import :data:`PRELOAD` once, so each forked child starts with them imported."""
        if self.preload_s is None:
            start = time.monotonic()
            for name in PRELOAD:
                with contextlib.suppress(ImportError):
                    __import__(name)
            self.preload_s = round(time.monotonic() - start, 1)


def _run_forked(function: Callable[[], Any], log: Path, env: dict[str, str]) -> None:
    """(In the forked child) run ``function`` as ``python -m`` runs a module, output to ``log``, then leave with its
    status."""
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
        os.environ.update(PYTHONUNBUFFERED="1", **env)
        function()
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
    """The exit status of forked child ``pid``; None when it was stopped at ``deadline`` (time.monotonic)."""
    stopped = False
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            _signal_group(pid, signal.SIGKILL)  # what it left behind (DataLoader workers)
            return None if stopped else os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:  # interrupted first, killed if still there after the grace
            _signal_group(pid, signal.SIGKILL if stopped else signal.SIGINT)
            stopped, deadline = True, deadline + STOP_GRACE_S
        time.sleep(0.05)


def _signal_group(pgid: int, signum: int) -> None:
    """Send ``signum`` to the process group the kit started for one child (gone already: nothing to do)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


# -------------------------------------------------------------------------------------------------------- the kit
@dataclass(frozen=True)
class Step:
    """A named step: what it does, its function (its numbers; raises :class:`_Skip` or :class:`StepFailed`), the steps
    it needs, whether it needs CUDA, whether it is heavy (skipped when the budget would not hold it)."""

    name: str
    title: str
    run: Callable[[Kit], dict[str, Any]]
    needs: tuple[str, ...] = ()
    gpu_only: bool = False
    heavy: bool = True


class Kit:
    """The state of one run of the kit: where it writes, its sizes, its child runner, the steps, the keywords that pick
    the gpu tests (none: all), and every step's record (the gpu tests' after their step's)."""

    def __init__(self, output_dir: Path, dry_run: bool, gpu: bool, budget_s: float, tiny: bool = False) -> None:
        self.out = output_dir
        self.dry_run, self.gpu, self.budget_s = dry_run, gpu, float(budget_s)
        self.sizes = GPU if not (dry_run or tiny) else DRY if dry_run else TINY
        self.mode = "dry run" if dry_run else "tiny" if tiny else "full"
        self.runner, self.steps, self.keywords, self.records = Runner(), [], [], {}
        self.started, self.started_at = time.monotonic(), datetime.now(timezone.utc).isoformat(timespec="seconds")
        self.data, self.weights = self.out / "data", self.out / "models" / "model.pt"
        self.prepared = self.data / "prepared"

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
        if child.returncode != 0:
            why = f"exit status {child.returncode} (log: {child.log})" if child.returncode else "stopped at its limit"
            raise StepFailed(f"{what}: {why} after {child.seconds:.0f} s", child.tail())
        return child

    def helper(self, helper: Callable[..., None], name: str, **options: Any) -> dict[str, Any]:
        """``helper(out, **options)`` (the children's side: it may touch the device) in a child; what it wrote."""
        result = self.out / "helpers" / f"{name}.json"
        result.unlink(missing_ok=True)
        run = functools.partial(helper, str(result), **options)
        self.check(self.runner.call(run, self.log(name), self.time_left(name)), f"helper {name}")
        return json.loads(result.read_text())

    def run(self, steps: Sequence[Step]) -> None:
        """Run ``steps`` in order, each recorded, printed and saved as soon as it ends (the gpu tests' records, each a
        step of the report, after theirs)."""
        self.steps = list(steps)
        for index, step in enumerate(steps, 1):
            record = self._run_step(step)
            tests = (record.get("numbers") or {}).pop("tests", [])
            self.records[step.name] = record
            self.records.update((test["name"], test) for test in tests)
            reason = f" ({record['reason']})" if record.get("reason") else ""
            print(f"gpu_proof [{index:2d}/{len(steps)}] {step.name:<26} {record['status']:<7} "
                  f"{record['seconds']:7.1f} s{reason} | total {self.elapsed():6.1f} s of {self.budget_s:.0f} s",
                  flush=True)  # fmt: skip
            if record["status"] == "failed":
                print(_indent(record["error"]), flush=True)
            for test in tests:  # one line each, and a failure's message under it
                text = test.get("reason") or (test.get("error", "").splitlines() or [""])[0]
                print(_indent(f"{test['name']:<66} {test['status']:<7} {test['seconds']:7.1f} s {text}"), flush=True)
            self.save()

    def _run_step(self, step: Step) -> dict[str, Any]:
        """One step's record: ok with its numbers, skipped with the reason, or failed with the error's last lines."""
        start = time.monotonic()
        record: dict[str, Any] = {"name": step.name, "title": step.title, "status": "ok", "seconds": 0.0}
        try:
            for need in step.needs:
                if (self.records.get(need) or {}).get("status") != "ok":
                    raise _Skip(f"needs {need} ({(self.records.get(need) or {}).get('status', 'not run')})")
            if step.gpu_only and not self.gpu:
                raise _Skip("dry run: CPU only" if self.dry_run and Path(NVIDIA).exists() else "no GPU")
            estimate, spent = self.sizes.estimates_s.get(step.name, 0.0), self.elapsed()
            if step.heavy and spent + estimate > self.budget_s:
                raise _Skip(f"budget: {spent:.0f} s spent, ~{estimate:.0f} s more would pass {self.budget_s:.0f} s")
            record["numbers"] = step.run(self)
        except _Skip as skip:
            record.update(status="skipped", reason=str(skip))
        except StepFailed as failure:
            record.update(status="failed", error=f"{failure}\n{failure.tail}".strip())
            record.update({"numbers": failure.numbers} if failure.numbers else {})
        except Exception as error:  # the kit's own bug in one step must not end the others
            record.update(status="failed", error=f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=4)}")
        record["seconds"] = round(time.monotonic() - start, 1)
        if self.log(step.name).is_file():
            record["log"] = str(self.log(step.name))
        return record

    def environment(self) -> dict[str, Any]:
        """The environment step's numbers (empty until it succeeded)."""
        return self.records.get("environment", {}).get("numbers", {})

    def report(self) -> dict[str, Any]:
        """Everything the kit knows so far, as ``gpu_proof.json`` holds it."""
        done = [r["status"] for r in self.records.values()]
        return {"kit": "python -m benchmarks.gpu_proof", "mode": self.mode, "gpu": self.gpu, "started": self.started_at,
                "elapsed_s": round(self.elapsed(), 1), "budget_s": self.budget_s, "preload_s": self.runner.preload_s,
                "environment": self.environment(), "counts": {k: done.count(k) for k in ("ok", "failed", "skipped")},
                "steps": list(self.records.values()), "throughput": throughput_rows(self.records),
                "throughput_not_run": [r for r in _throughput_records(self.records) if r["status"] != "ok"],
                "fullct_inference": fullct_rows(self.records), "targets": targets(self),
                "kernel_classes": kernel_classes(self.records)}  # fmt: skip

    def save(self) -> None:
        """Rewrite gpu_proof.json and gpu_proof.md (atomically: a killed run leaves the last complete pair)."""
        report = self.report()
        write_json(self.out / "gpu_proof.json", report, default=str)
        write_text(self.out / "gpu_proof.md", format_markdown(report))


# ---------------------------------------------------------------------------------------------------------- steps
def step_environment(kit: Kit) -> dict[str, Any]:
    """Device name, driver, versions and the host's CPUs, as a child sees them (this process forks: no CUDA here)."""
    info = kit.helper(helper_environment, "environment", dry_run=kit.dry_run)
    kit.gpu = not kit.dry_run and bool(info["cuda_available"])
    info["peak_bf16_tflops"], info["peak_source"] = peak_bf16_tflops(str(info.get("device_name") or ""), kit.gpu)
    return info


def step_data(kit: Kit) -> dict[str, Any]:
    """Synthetic training cases and two full-CT inference cases as DICOM (kept when written already), prepared."""
    from scripts.data.prepare import prepare

    (shape, pixel, chest), start = kit.sizes.case, time.monotonic()
    cases = [(kit.data / "train", f"LUNG1-{i + 1:03d}", i + 1) for i in range(kit.sizes.training_cases)]
    cases += [(kit.data / "fullct", f"FULLCT-{i + 1}", 7) for i in range(2)]  # one CT twice: the second is warm
    todo = [c for c in cases if not (c[0] / COLLECTION / c[1]).is_dir()]
    write_cases(todo, kit.sizes.case)
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


def write_cases(cases: Sequence[tuple[Path, str, int]], case: tuple[tuple[int, int, int], float, bool]) -> None:
    """Synthetic CTs with their SEGs in the TCIA layout, side by side in worker processes: ``cases`` are (folder,
    patient id, seed), ``case`` the sizes' (shape, pixel spacing, chest phantom or not: :attr:`Sizes.case`)."""
    from scripts.data.synthetic import write_case, write_chest_case

    shape, pixel, chest = case
    with ProcessPoolExecutor(max_workers=max(1, min(len(cases), usable_cpus()))) as pool:
        for done in [pool.submit(write_chest_case, folder, patient, shape, pixel, 3.0, seed=seed) if chest else
                     pool.submit(write_case, folder, patient, seed, shape, (pixel, pixel), 3.0, tumour_hu=400)
                     for folder, patient, seed in cases]:  # fmt: skip
            done.result()


def step_network(kit: Kit) -> dict[str, Any]:
    """FLOPs of one training step (FlopCounterMode, forward + backward of the step's patches) on the device, and
    random weights for full-CT inference (their values do not change the time)."""
    settings = {**kit.sizes.settings, "model_path": str(kit.weights)}
    return kit.helper(helper_network, "network", settings=settings)


def step_gpu_tests(kit: Kit) -> dict[str, Any]:
    """tests/test_gpu.py's gpu tests (``pytest -m gpu``, ``-k`` the keywords of ``--only``) at the kit's sizes, in a
    child interrupted where the budget ends: a record per test (its recorded numbers; skipped with the reason, the
    budget for a test not reached), and the profile test's trace classed by kernel. A dry run hides the GPU."""
    xml = kit.out / "gpu_tests.xml"
    xml.unlink(missing_ok=True)
    args = ["-m", "gpu", str(GPU_TESTS), "-o", "addopts=", "-o", "junit_family=xunit1", "-p", "no:cacheprovider",
            "-v", "-rA", f"--junitxml={xml}", f"--basetemp={kit.out / 'gpu_tests'}"]  # fmt: skip
    args += ["-k", " or ".join(kit.keywords)] if kit.keywords else []
    env = {"GPU_PROOF_SIZES": "full" if kit.mode == "full" else "tiny"}
    env.update({"CUDA_VISIBLE_DEVICES": ""} if kit.dry_run else {})
    limit = kit.time_left("gpu_tests", factor=float("inf"))  # the budget's, not one child's
    child = kit.runner.module("pytest", args, kit.log("gpu_tests"), limit, env)
    tests = junit_records(xml) if xml.is_file() else []
    if child.returncode is None:  # interrupted at the time limit: the tests it did not reach
        reached = {t["name"] for t in tests}
        tests += [{"name": name, "title": _words(name), "status": "skipped", "seconds": 0.0,
                   "reason": f"budget: pytest stopped after {child.seconds:.0f} s"}
                  for name in gpu_tests(kit.keywords) if name not in reached]  # fmt: skip
    statuses = [t["status"] for t in tests]
    trace = next((t["numbers"]["trace"] for t in tests if "trace" in t.get("numbers", {})), None)
    numbers = {"tests": tests, **{s: statuses.count(s) for s in ("ok", "failed", "skipped")},
               "defaults": trace_classes(trace) if trace else None}  # fmt: skip
    if numbers["failed"] or child.returncode not in (0, None):
        failed = [t["name"] for t in tests if t["status"] == "failed"]
        raise StepFailed(f"pytest: exit status {child.returncode}, failed: {failed}", child.tail(), numbers)
    return numbers


def junit_records(xml: Path) -> list[dict[str, Any]]:
    """One record per test of pytest's junit-xml file: ok, failed (with its message) or skipped (with the reason), its
    seconds, and what it recorded with ``record_property`` as its numbers."""
    records = []
    for case in ElementTree.parse(xml).iter("testcase"):
        name = case.get("name", "")
        record: dict[str, Any] = {"name": name, "title": _words(name), "status": "ok",
                                  "seconds": round(float(case.get("time") or 0), 1)}  # fmt: skip
        numbers = {p.get("name"): _as_literal(p.get("value", "")) for p in case.iter("property")}
        record.update({"numbers": numbers} if numbers else {})
        for failure in [*case.iter("failure"), *case.iter("error")]:
            record.update(status="failed", error=f"{failure.get('message', '')}\n{failure.text or ''}".strip()[-3000:])
        for skipped in case.iter("skipped"):
            record.update(status="skipped", reason=skipped.get("message", ""))
        records.append(record)
    return records


def gpu_tests(keywords: Sequence[str] = ()) -> list[str]:
    """The names of tests/test_gpu.py's gpu tests (read from its source: the kit never imports the tests) that hold
    one of ``keywords`` (all where none is given)."""
    names = re.findall(r"^@pytest\.mark\.gpu\n(?:@.*\n)*def (test_\w+)", GPU_TESTS.read_text(), flags=re.M)
    return [n for n in names if not keywords or any(k.lower() in n.lower() for k in keywords)]


def _words(test: str) -> str:
    """A test's name as words: what it proves."""
    return test.removeprefix("test_").replace("_", " ")


def step_throughput(kit: Kit) -> dict[str, Any]:
    """:data:`THROUGHPUT_SETS` in one child (bench_switches.run_rows: imports, CUDA context and cache paid once),
    starting no row where the steps after this one would no longer fit the budget (the rows it finished count). The
    defaults row's busy steps give the defaults' kernel classes where the profile test did not run."""
    rows, child = _rows_in_child(kit, "throughput", "throughput", THROUGHPUT_SETS)
    numbers = {"rows": rows, "fastest": fastest_row_classes(rows)}
    numbers["defaults"] = next((row_classes(r) for r in rows if r["loop"] == DEFAULTS_SET and r.get("trace")), None)
    if child.returncode != 0 or not any(r["status"] == "ok" for r in rows):
        raise StepFailed(f"throughput: exit status {child.returncode}, {len(rows)} row(s)", child.tail(), numbers)
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
    size = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file()) if cache.is_dir() else 0
    numbers = {"rows": rows, "fastest": fastest_row_classes(rows), "cache_dir": str(cache),
               "cache_mb": round(size / 1e6, 1)}  # fmt: skip
    failed = [f"{r['loop']}: {r['status']} ({str(r.get('reason'))[:200]})" for r in rows if r["status"] != "ok"]
    if failed or first.returncode != 0 or second.returncode != 0:
        raise StepFailed(f"compile_cache: exit status {first.returncode} and {second.returncode}; " + "; ".join(failed),
                         second.tail(), numbers)  # fmt: skip
    hits = (rows[1].get("compile_cache") if len(rows) == 2 else None) or {}
    if not hits.get("fx_graph_hits"):
        raise StepFailed(f"the second process compiled without the cache's graphs: {hits}", second.tail(), numbers)
    return numbers


def step_throughput_earlier(kit: Kit) -> dict[str, Any]:
    """:data:`LAST_SETS`, last and only as far as the budget goes (the compile rows from the compile cache)."""
    rows, child = _rows_in_child(kit, "throughput_earlier", "throughput_earlier", LAST_SETS,
                                 compile_cache_dir=kit.out / "compile_cache")  # fmt: skip
    numbers = {"rows": rows, "fastest": fastest_row_classes(rows)}
    if child.returncode != 0:
        raise StepFailed(f"throughput_earlier: exit status {child.returncode}", child.tail(), numbers)
    return numbers


def _rows_in_child(kit: Kit, step: str, name: str, sets: Sequence[str], reserve_s: float = 0.0,
                   **settings: Any) -> tuple[list[dict[str, Any]], Child]:  # fmt: skip
    """``sets`` through bench_switches.run_rows in one child (its log and records named ``name``) with ``settings``,
    starting no row past the time the steps after ``step`` (and ``reserve_s``) need; its rows (:func:`_row`), child."""
    warmup, steps = kit.sizes.bench
    deadline_s = max(kit.budget_s - _later_s(kit, step) - reserve_s - kit.elapsed(), 0.0)
    # on the kit's prepared data (no preparation), with weights of its own (never the bundle's models/model.pt)
    merged = {"dataset_dir": kit.data / "train", "prepared_dir": kit.prepared, "prepare_data": False,
              "model_path": kit.out / "runs" / step / "model.pt", **kit.sizes.settings, "benchmark_warmup": warmup,
              "benchmark_steps": steps, "benchmark_busy_steps": 3, "bundle_root": ROOT, **settings}  # fmt: skip
    result = kit.out / "helpers" / f"{name}.json"
    result.unlink(missing_ok=True)
    merged = {key: str(value) if isinstance(value, Path) else value for key, value in merged.items()}
    run = functools.partial(helper_throughput, str(result), merged, str(kit.out / "runs" / name), deadline_s, sets)
    limit = kit.time_left(name, factor=max(deadline_s / kit.sizes.timeout_s, 1.0) + 1.0)
    child = kit.runner.call(run, kit.log(name), limit)
    rows = json.loads(result.read_text()) if result.is_file() else []
    return [_row(kit, r) for r in rows], child


def _later_s(kit: Kit, step: str) -> float:
    """The seconds the heavy steps after ``step`` are expected to take here (:data:`LAST_STEPS` reserve none)."""
    after = kit.steps[[s.name for s in kit.steps].index(step) + 1 :]
    return sum(kit.sizes.estimates_s.get(s.name, 0.0) for s in after
               if s.heavy and s.name not in LAST_STEPS and (kit.gpu or not s.gpu_only))  # fmt: skip


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
    """:func:`row_classes` of the fastest throughput row (most patches a second: bench_switches keeps its busy steps'
    trace); the reason where no row ran."""
    ran = [r for r in rows if r["status"] == "ok"]
    return row_classes(max(ran, key=lambda r: r["patches_per_s"])) if ran else {"reason": "no throughput row ran"}


def row_classes(row: dict[str, Any]) -> dict[str, Any]:
    """The summariser's device time per kernel class and idle share of a row's busy-steps trace, beside the row's
    speed and GPU-busy share; the reason where it has no trace."""
    found: dict[str, Any] = {"loop": row["loop"], "patches_per_s": row["patches_per_s"],
                             "gpu_busy_percent": row.get("gpu_busy_percent")}  # fmt: skip
    if not row.get("trace"):
        why = "its busy steps were not profiled (the benchmark profiles them on a GPU only)"
        return {**found, "reason": f"no trace: {why}" if row.get("gpu_busy_percent") is None else "no trace saved"}
    return {**found, **trace_classes(row["trace"])}


def trace_classes(trace: str) -> dict[str, Any]:
    """The summariser's device time per kernel class and idle share of ``trace``; the reason where it cannot read it."""
    try:
        summary = summarize(trace)
    except TraceError as error:
        return {"reason": str(error)}
    return {"trace": trace, "device": summary["device"], "idle": summary["idle"]}


def mfu(kit: Kit, patches_per_s: float) -> dict[str, Any]:
    """Model-FLOP utilisation at ``patches_per_s``: the network step's FLOP count per patch times the patches a second,
    over the device's dense bf16 peak; None with the reason where either is unknown."""
    network, peak = kit.records.get("network", {}), kit.environment().get("peak_bf16_tflops")
    if network.get("status") != "ok" or not peak:
        why = kit.environment().get("peak_source", "no environment") if network.get("status") == "ok" else None
        return {"mfu": None, "mfu_reason": why or "no FLOP count (the network step did not succeed)"}
    achieved = network["numbers"]["train_step_tflop"] / network["numbers"]["patches_per_step"] * patches_per_s
    return {"model_tflop_per_s": round(achieved, 1), "mfu": round(achieved / peak, 4)}


#: the full-CT runs (run dir suffix, settings): inference's defaults (on a GPU the CT preprocessed on it); two
#: candidates for the network's seconds: the window attention as one scaled_dot_product_attention (memory-efficient
#: attention with the bias as its mask, instead of four kernels over a 343 x 343 matrix a head) and 8 windows a
#: forward pass instead of 4; and the preprocessing on the host (DataLoader workers), beside the GPU's
FULLCT_RUNS = {"defaults": ("", {}), "fused attention": ("_fused", {"fused_attention": "true"}),
               "8 windows a pass": ("_sw8", {"sw_batch_size": 8}),
               "host preprocessing": ("_host", {"preprocessing_device": "cpu"})}  # fmt: skip


def step_fullct(kit: Kit) -> dict[str, Any]:
    """Two copies of one full CT (DICOM in, NIfTI + SEG out) with AMP per run of :data:`FULLCT_RUNS` (a CPU: the
    defaults only): a first and a warm case's seconds; end to end = read + preprocess + the case's seconds. A run that
    fails is recorded with its reason and the next one runs; the step then fails, with every run's numbers."""
    rows, failed, tails = [], {}, []
    for run, (suffix, overrides) in list(FULLCT_RUNS.items())[: None if kit.gpu else 1]:
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
    """One run of :data:`FULLCT_RUNS` (the kit's random weights, the PyTorch backend, the NIfTI and the DICOM SEG
    written: RTSTRUCT, SR and the report are CPU work): a row of stage seconds per case."""
    name = f"fullct_inference{suffix}"
    run_dir = kit.out / "runs" / name
    settings = {"input_dir": kit.data / "fullct", "model_path": kit.weights, "inference_backend": "torch",
                "write_rtstruct": False, "write_sr": False, "write_report": False, **kit.sizes.settings,
                **overrides, "output_dir": run_dir}  # fmt: skip
    args = ["run", "--config_file", str([str(ROOT / "configs" / "inference.yaml")]), "--bundle_root", str(ROOT)]
    kit.check(kit.runner.module("monai.bundle", [*args, *_flags(settings)], kit.log(name), kit.time_left(name)),
              "monai.bundle run inference.yaml")  # fmt: skip
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
    """The share of the CT's voxels the label map written to ``nifti`` labels (None without one): the kit's random
    weights label a large part of the thorax, a tumour a few thousandths of it, and the post-processing and the
    writers take time with the labelled voxels (a tumour's: benchmarks.bench_outputs)."""
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
    Step("throughput", "throughput: defaults, CUDA graphs, 8 and 16 patches", step_throughput, ("data", "network")),
    Step("compile_cache", "compile, cache empty, then from it", step_compile_cache, ("data", "network"), True),
    Step("fullct_inference", "full-CT inference, AMP: a first and a warm case", step_fullct, ("data", "network")),
    Step("gpu_tests", "pytest -m gpu tests/test_gpu.py, budget allowing", step_gpu_tests),
    Step("throughput_earlier", "older settings' rows, budget allowing", step_throughput_earlier, ("data", "network")),
)


def select(steps: Sequence[Step], only: str | Sequence[str] | None) -> tuple[list[Step], list[str]]:
    """``steps`` named in ``only`` (comma-separated) and every step they need, in the kit's order (all if None); and
    the names in ``only`` that are no step, each a part of a gpu test's name (they add the gpu_tests step)."""
    if not only:
        return list(steps), []
    wanted = {n.strip() for n in (only.split(",") if isinstance(only, str) else only) if n.strip()}
    keywords = sorted(wanted - {s.name for s in steps})
    unknown = [k for k in keywords if not gpu_tests([k])]
    if unknown:
        raise SystemExit(f"--only: {unknown} name(s) no step and no gpu test; the steps are {[s.name for s in steps]}, "
                         f"the gpu tests (a part of a name picks them) {gpu_tests()}")  # fmt: skip
    wanted = (wanted - set(keywords)) | ({"gpu_tests"} if keywords else set())
    wanted |= {need for s in steps if s.name in wanted for need in s.needs}  # the steps needed need none
    return [s for s in steps if s.name in wanted or s.name == "environment"], keywords


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
    """The throughput rows that ran, each with its speed relative to the defaults row (the baseline of the same run)
    and to the seed-style loop, where each ran."""
    rows = [r for r in _throughput_records(records) if r["status"] == "ok"]
    bases = {name: next((r["patches_per_s"] for r in rows if r["loop"] == loop), None)
             for name, loop in (("vs_defaults", DEFAULTS_SET), ("vs_seed", SEED_SET))}  # fmt: skip
    return [{**r, **{k: round(r["patches_per_s"] / b, 2) if b else None for k, b in bases.items()}} for r in rows]


def _throughput_records(records: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Every row the row steps recorded (ok, failed or skipped), in the kit's order."""
    return [row for step in ROW_STEPS for row in (records.get(step, {}).get("numbers") or {}).get("rows", [])]


def kernel_classes(records: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Where the GPU's time goes: the defaults -- the profile test's trace (the gpu tests' numbers), else the busy
    steps of the throughput step's defaults row -- and the fastest row of every row step (:func:`fastest_row_classes`),
    each with its reason where unmeasured."""
    keep = ("loop", "trace", "device", "idle", "gpu_busy_percent", "reason")
    numbers = {step: (records.get(step) or {}).get("numbers") or {} for step in ("gpu_tests", *ROW_STEPS)}
    defaults = numbers["gpu_tests"].get("defaults") or {}
    if "device" not in defaults:
        defaults = numbers["throughput"].get("defaults") or defaults
    if "device" not in defaults and "reason" not in defaults:
        defaults = {"reason": "no profiled run: the profile test and the defaults row left no trace"}
    found = [numbers[step]["fastest"] for step in ROW_STEPS if "fastest" in numbers[step]]
    ran = [f for f in found if f.get("loop")]
    best = max(ran, key=lambda f: f.get("patches_per_s") or 0.0) if ran else found[0] if found else None
    if best is None:
        best = {"reason": f"the throughput step {(records.get('throughput') or {}).get('status', 'did not run')}"}
    return {name: {k: v for k, v in entry.items() if k in keep} for name, entry in (("defaults", defaults),
                                                                                    ("fastest", best))}  # fmt: skip


def fullct_rows(records: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per case of each full-CT run that ran (those of a step that failed in another run too)."""
    numbers = (records.get("fullct_inference") or {}).get("numbers") or {}
    return [{"step": "fullct_inference", **case} for case in numbers.get("cases", [])]


def targets(kit: Kit) -> dict[str, str]:
    """The targets (:data:`TARGETS`), each met / not met / unmeasured, with the row and number behind it."""
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
    verdict = {name: f"unmeasured: no {row or 'throughput row'} result" for name, (row, value, _) in found.items()
               if value is None}  # fmt: skip
    for name, (row, value, more) in ((k, v) for k, v in found.items() if k not in verdict):
        met, sense = (value >= TARGETS[name], ">=") if more else (value <= TARGETS[name], "<=")
        verdict[name] = f"{'met' if met else 'not met'}: {value:g} ({row}; target {sense} {TARGETS[name]:g})"
    return {name: verdict[name] for name in found}


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
        lines += ["", "Training throughput (benchmark.yaml; the compile rows each in a process of its own, sharing one "
                  "compile cache; ms/step median over the timed steps; GPU busy = kernel time over step time; MFU over "
                  "the dense bf16 peak; peak GiB = the allocator's peak over the timed steps (reserved: what it holds; "
                  "a CUDA graph's pool stays reserved and its replays allocate nothing); first step = compile and "
                  "algorithm search; vs defaults = against the defaults row of this run):", "",
                  "| loop | cache | steps | ms/step | patches/s | data wait | GPU busy | MFU | peak GiB (reserved) | "
                  "first step s | vs defaults | compile cache, CUDA graph |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in report["throughput"]:
            share = f"{100 * r['mfu']:.1f} %" if r.get("mfu") is not None else "n/a"
            busy = f"{r['gpu_busy_percent']:.1f} %" if r.get("gpu_busy_percent") is not None else "n/a"
            ratio = f"{r['vs_defaults']:.2f}x" if r.get("vs_defaults") else ""
            reserved = f" ({r['peak_reserved_gib']:.2f})" if r.get("peak_reserved_gib") is not None else ""
            lines.append(f"| {r['loop']} | {r['cache']} | {r['timed_steps']} x {r['patches_per_step']} | "
                         f"{r['ms_per_step']:.0f} | {r['patches_per_s']:.2f} | {r['data_wait_percent']:.1f} % | "
                         f"{busy} | {share} | {r['peak_memory_gib']:.2f}{reserved} | {r['first_step_s'] or 'n/a'} | "
                         f"{ratio} | {_row_notes(r)} |")  # fmt: skip
    others = report.get("throughput_not_run", [])
    if others:  # a failed or skipped row says so in the table's file too, not only in the JSON
        lines += ["", "Throughput rows that did not run:"]
        lines += [f"- {r['loop']}: {r['status']}: {str(r.get('reason') or '')[:200]}" for r in others]
    if report["fullct_inference"]:
        lines += ["", "Full-CT inference (inference_report.json's stage seconds; load = read + preprocess, network = "
                  "predict; labelled: the share of the CT's voxels the random weights label, where a tumour is a few "
                  "thousandths):", "", "| run | case | load s | region s | network s | postprocess s | write s | end "
                  "to end s | windows | labelled |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in report["fullct_inference"]:
            load, share = r.get("read", 0.0) + r.get("preprocess", 0.0), r.get("labelled_share")
            lines.append(f"| {r.get('run', r['step'])} | {r['case']} | {load:.2f} | {r.get('region', 0):.2f} | "
                         f"{r.get('predict', 0):.2f} | {r.get('postprocess', 0):.2f} | {r.get('write', 0):.2f} | "
                         f"{r.get('end_to_end_s', 'n/a')} | {r.get('windows')} | "
                         f"{'' if share is None else f'{100 * share:.2f} %'} |")  # fmt: skip
    lines += _kernel_class_lines(report.get("kernel_classes", {}))
    lines += ["", "Targets:"] + [f"- {name}: {text}" for name, text in report["targets"].items()]
    return "\n".join(lines) + "\n"  # fmt: skip


def _row_notes(row: dict[str, Any]) -> str:
    """A row's compile-cache counts (where it compiled) and what its CUDA graph did (where it had one)."""
    cache, graphs, notes = row.get("compile_cache") or {}, row.get("cuda_graphs"), []
    if any(cache.values()):
        notes.append(f"{cache.get('fx_graph_hits', 0)} graphs from the cache, {cache.get('fx_graph_misses', 0)} "
                     "compiled")  # fmt: skip
    if graphs:
        notes.append(f"graph: none ({graphs['disabled'][:80]})" if graphs.get("disabled") else
                     f"graph captured at step {graphs['captured_at_iteration']}, {graphs['replayed']} replays, "
                     f"{graphs['eager']} eager")  # fmt: skip
    return "; ".join(notes)


def _kernel_class_lines(found: dict[str, dict[str, Any]]) -> list[str]:
    """The markdown of where the GPU's time goes: for the profiled defaults run and the fastest throughput row, the
    summariser's table as ``python -m scripts.summarize_trace`` prints it, or why there is none."""
    if not found:
        return []
    lines = ["", "Where the GPU's time goes (`python -m scripts.summarize_trace TRACE`: device time per kernel class, "
             "classed by kernel name; idle: wall time less the union of device activity):"]  # fmt: skip
    for name, title in (("defaults", "Profiled defaults run"), ("fastest", "Fastest throughput row")):
        entry, busy = found.get(name, {}), found.get(name, {}).get("gpu_busy_percent")
        if entry.get("loop"):
            title += f", {entry['loop']}" + ("" if busy is None else f" (the benchmark's GPU busy {busy:.1f} %)")
        lines += (["", f"{title}: {entry.get('reason', 'not measured')}."] if "device" not in entry else
                  ["", f"{title}, `{entry['trace']}`:", "", "```text", *format_device_table(entry["device"],
                   entry["idle"]), "```"])  # fmt: skip
    return lines


def _brief(numbers: dict[str, Any], width: int = 160) -> str:
    """A step's scalar numbers in one short line for the table."""
    text = ", ".join(f"{k} {v}" for k, v in numbers.items() if isinstance(v, (int, float, str)) and len(str(v)) < 40)
    return text if len(text) <= width else text[: width - 3] + "..."


def _indent(text: str) -> str:
    """``text`` indented under its step's line of the running output."""
    return "\n".join("    " + line for line in text.splitlines())


def _flags(settings: dict[str, Any]) -> list[str]:
    """``--key value`` pairs as fire and ``monai.bundle run`` read them (lists as Python literals)."""
    return [part for key, value in settings.items() for part in (f"--{key}", str(value))]


# ------------------------------------------------------------------------------------------------- the children's side
def helper_environment(out: str, dry_run: bool = False) -> None:
    """(Child) the device report of scripts.training.accelerator, the driver's version, the host's CPUs and the
    bundle's version and git commit (a run's files say which code gave their numbers), to ``out``."""
    import torch
    from scripts.training.accelerator import device_report

    info = device_report(torch.device("cuda" if torch.cuda.is_available() and not as_bool(dry_run) else "cpu"))
    info.pop("settings", None)
    info.update(driver=_first_word(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]),
                usable_cpus=usable_cpus(), cpu_count=os.cpu_count(), cuda_available=torch.cuda.is_available(),
                bundle_version=json.loads((ROOT / "configs" / "metadata.json").read_text())["version"],
                bundle_commit=_first_word(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]))  # fmt: skip
    write_json(out, info, default=str)


def _first_word(command: list[str]) -> str | None:
    """The first word ``command`` prints; None where it fails or is missing (no NVIDIA driver, no git clone)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError, IndexError):
        return subprocess.run(command, capture_output=True, text=True, timeout=10, check=True).stdout.split()[0]
    return None


def helper_network(out: str, settings: dict[str, Any]) -> None:
    """(Child) train.yaml's network with ``settings``: its random weights to ``model_path`` (with the sidecar
    naming the labels) and the FLOPs of one training step on the device (FlopCounterMode: matmuls and convolutions of
    the forward and the backward over ``batch_size * num_samples`` patches), to ``out``."""
    import torch
    from monai.bundle import ConfigParser
    from scripts.training.weights import save_weights
    from torch.utils.flop_counter import FlopCounterMode

    parser = ConfigParser()
    parser.read_config(str(ROOT / "configs" / "train.yaml"))
    parser.update(settings)
    # parsed, not read raw: train.yaml's ids may be references (num_samples is one to displayable_configs)
    network, device, roi, batch_size, samples, path, labels = (parser.get_parsed_content(key) for key in (
        "network_def", "device", "roi_size", "batch_size", "num_samples", "model_path", "labels"))  # fmt: skip
    weights = save_weights(network, path, labels)
    roi, patches = [int(r) for r in roi], int(batch_size) * int(samples)
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
    write_json(out, {**described, "roi_size": roi, "patches_per_step": patches, "device": str(device),
                     "parameters": sum(p.numel() for p in network.parameters()), "weights": str(weights),
                     "forward_tflop": round(forward / 1e12, 4),
                     "train_step_tflop": round(counter.get_total_flops() / 1e12, 4)})  # fmt: skip


def helper_throughput(out: str, settings: dict[str, Any], output_dir: str, deadline_s: float,
                      sets: Sequence[str] = THROUGHPUT_SETS) -> None:  # fmt: skip
    """(Child) ``sets`` (a JSON list of bench_switches' set names) through bench_switches.run_rows on train.yaml +
    benchmark.yaml with ``settings`` (JSON), starting no row past ``deadline_s`` from now; the records to ``out``,
    rewritten after every row."""
    configs = [ROOT / "configs" / "train.yaml", ROOT / "configs" / "benchmark.yaml"]
    estimates = GPU.estimates_s if settings.get("roi_size") is None else {}  # the shipped sizes, else a quick run
    run_rows(sets, configs, settings, output_dir, time.monotonic() + float(deadline_s), estimates,
             progress=lambda records: write_json(out, records, default=str), keep_trace=True)  # fmt: skip


# -------------------------------------------------------------------------------------------------------------- CLI
def main(
    output_dir: str, dry_run: bool | str = False, budget_s: float = 450.0, only: str | None = None, tiny: bool = False
) -> None:
    """Run the kit (see the module docstring); ``DIR/gpu_proof.json`` and ``.md`` hold the results. ``tiny``: the dry
    run's network and data on the GPU (the GPU paths in seconds, no number worth reporting)."""
    dry = as_bool(dry_run, "dry_run")
    gpu = not dry and Path(NVIDIA).exists()
    kit = Kit(Path(output_dir).resolve(), dry, gpu, budget_s, tiny=as_bool(tiny, "tiny"))
    kit.out.mkdir(parents=True, exist_ok=True)
    steps, kit.keywords = select(STEPS, only)
    mode = "dry run on the CPU" if dry else ("GPU" if gpu else "no GPU found: the CUDA-only steps will be skipped")
    print(f"gpu_proof: {len(steps)} steps, {mode}, budget {budget_s:.0f} s -> {kit.out}", flush=True)
    kit.run(steps)
    print(format_markdown(kit.report()), flush=True)


if __name__ == "__main__":
    import fire

    fire.Fire(main)

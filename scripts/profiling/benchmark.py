"""Training throughput with the switches in force: a timer on the trainer's own events, and its JSON report.

:class:`StepTimer` lets ``warmup`` iterations pass (compilation, cache warm-up, cuDNN/MIOpen algorithm search), then
times ``steps`` iterations and stops the trainer. The timed steps run back to back, as in training: the device is
synchronised only where the timed window starts and ends, and a step's time is the interval between its end and the
previous step's end on the device's own timeline (CUDA events recorded behind each step; the host clock on a CPU). So
the host issuing the next step while the device still runs this one counts as it does in training, and a host that
cannot keep up shows as a longer step. (``sync_steps`` synchronises the device around every step instead: each step then
begins with an empty device, which counts the host's time to issue the first kernels as device idle time -- kept
for a comparison with such numbers on the same GPU.) For each
timed step it also records the host's wait for the batch (``GET_BATCH_STARTED`` -> ``GET_BATCH_COMPLETED``). It writes
``benchmark.json`` -- ms/step (median, p90), patches/s, the fraction of step time spent waiting for data, peak
device memory (peak RSS on a CPU), the device report and the switches -- and prints one summary line.

The warm-up steps are timed too and reported apart (``first_step_s``: compilation and the algorithm search happen
there; ``warmup_s``: all of them), so a compiled run shows both its compile time and its steady state. On a GPU,
``busy_steps`` more steps run under ``torch.profiler`` (device activity only) after the timed ones, back to back too:
``gpu_busy_fraction`` is the time during which at least one kernel or copy ran on the device over those steps' wall
time -- what is left is the device waiting for the host (data, Python, kernel launches). The profiled steps are not
among the timed ones; with ``trace`` their chrome trace is written there too (``python -m scripts.summarize_trace``
reads it: device time per kernel class).

The report also says what the run compiled from the compile cache (``compile_cache``: torch's hit and miss counters
over this run, :func:`scripts.training.compilation.cache_counters`) and, with ``iteration`` (a
:class:`scripts.training.graphs.GraphedIteration`), which steps a CUDA graph replayed (``cuda_graphs``).
"""

from __future__ import annotations

import logging
import resource
import time
from collections.abc import Iterable
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import torch
from ignite.engine import Engine, Events
from scripts.common.config import as_bool
from scripts.common.files import write_json
from scripts.training.compilation import cache_counters
from scripts.training.distributed import is_rank0, world_size

logger = logging.getLogger(__name__)

#: forward + backward cost of SwinUNETR feature_size 48 on one 96^3 patch (fvcore-style count, ~1.9 TFLOP)
SWINUNETR48_TFLOP_PER_96CUBE = 1.9


class StepTimer:
    """Ignite handler: warm up, time ``steps`` training iterations, write ``path`` and stop the trainer."""

    def __init__(
        self,
        path: str | Path,
        device: torch.device | str,
        warmup: int = 5,
        steps: int = 20,
        patches_per_step: int = 1,
        switches: dict | None = None,
        device_report: dict | None = None,
        tflop_per_patch: float | None = None,
        enabled: bool | None = None,
        busy_steps: int = 5,
        trace: str | Path | None = None,
        iteration: Any = None,
        sync_steps: bool = False,
    ) -> None:
        self.path = Path(path)
        self.device = torch.device(device)
        self.warmup, self.steps = int(warmup), int(steps)
        self.patches_per_step = int(patches_per_step)
        self.switches = dict(switches or {})
        self.device_report = device_report
        self.tflop_per_patch = tflop_per_patch
        self.enabled = is_rank0() if enabled is None else enabled  # None: rank 0 of a DDP run writes the report
        self.busy_steps = int(busy_steps) if self.device.type == "cuda" else 0  # kernel times need a GPU
        self.trace = Path(trace) if trace else None  # where the busy steps' chrome trace goes (None: not kept)
        self.trace_written: str | None = None
        self.iteration = iteration  # the trainer's iteration_update, when it reports what it did (summary())
        self.sync_steps = as_bool(sync_steps, "benchmark_sync_steps")  # each step timed alone, the device synchronised
        self.compile_counters = cache_counters()  # this process's counts before the run: the report gives the run's
        self.wait: list[float] = []
        self.total: list[float] = []
        self.warmup_times: list[float] = []
        self.busy: float | None = None
        self._t0 = self._t1 = 0.0
        self._count = 0
        self._profiler: torch.profiler.profile | None = None
        self._profiled = 0
        self._profile_start = 0.0
        self._marks: list[Any] = []  # the timed window's marks: its start, then each timed step's end
        self._started = False  # whether the timed window has started
        self.epochs = 0  # the trainer's epochs when it stopped: 1 where the steps ran in one epoch (benchmark.yaml)

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.GET_BATCH_STARTED, self._batch_started)
        engine.add_event_handler(Events.GET_BATCH_COMPLETED, self._batch_completed)
        engine.add_event_handler(Events.ITERATION_COMPLETED, self._iteration_completed)
        engine.add_event_handler(Events.COMPLETED, self._completed)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _mark(self) -> Any:
        """A point on the device's timeline, taken without waiting: an event behind the work issued so far (a GPU),
        or the host clock (a CPU, where the work is done when the host gets here)."""
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _seconds(self, start: Any, end: Any) -> float:
        """The device time between two marks; a GPU's events must have completed (after a synchronise)."""
        return end - start if self.device.type != "cuda" else start.elapsed_time(end) / 1000

    def _back_to_back(self) -> bool:
        """Whether this step runs in the timed window or in the profiled one: no synchronising there (unless
        ``sync_steps`` asks for it)."""
        return self._count >= self.warmup and not self.sync_steps

    def _batch_started(self, engine: Engine) -> None:
        if not self._back_to_back():  # a warm-up step is timed alone: compilation and algorithm search happen there
            self._sync()
        if self._count == self.warmup and not self._started:  # the timed window starts, the device idle
            self._started = True
            self._sync()
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
            self._marks = [] if self.sync_steps else [self._mark()]
        self._t0 = time.perf_counter()

    def _batch_completed(self, engine: Engine) -> None:
        self._t1 = time.perf_counter()

    def _iteration_completed(self, engine: Engine) -> None:
        back_to_back = self._back_to_back()
        mark = self._mark() if back_to_back and self._profiler is None else None
        if not back_to_back:
            self._sync()
        end = time.perf_counter()
        self._count += 1
        if self._profiler is not None:  # the steps after the timed ones, profiled for the device's busy time
            self._profiled += 1
            if self._profiled >= self.busy_steps:
                self._sync()
                end = time.perf_counter()
                self._profiler.stop()
                events = self._profiler.profiler.kineto_results.events()
                device = [
                    (e.start_ns(), e.start_ns() + e.duration_ns()) for e in events if e.device_type().name != "CPU"
                ]  # kernels, copies and sets on the device's timeline
                self.busy = busy_fraction(device, int(1e9 * (end - self._profile_start)))
                if self.trace is not None and self.enabled:
                    self.trace.parent.mkdir(parents=True, exist_ok=True)
                    self._profiler.export_chrome_trace(str(self.trace))
                    self.trace_written = str(self.trace)
                engine.terminate()
            return
        if self._count <= self.warmup:
            self.warmup_times.append(end - self._t0)
        if self._count > self.warmup:
            self.wait.append(self._t1 - self._t0)
            if self.sync_steps:
                self.total.append(end - self._t0)  # the step alone, from its batch's start to its end
            else:
                self._marks.append(mark)
        if self._count == self.warmup + self.steps:
            self._sync()  # every mark has been passed: the steps' times can be read
            if not self.sync_steps:
                self.total = [self._seconds(a, b) for a, b in pairwise(self._marks)]
            self._marks = []
            if not self.busy_steps:
                engine.terminate()
                return
            self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            self._profiler.start()
            self._profile_start = time.perf_counter()

    def _completed(self, engine: Engine) -> None:
        self.epochs = engine.state.epoch
        if not self.enabled or not self.total:
            return
        report = self.report()
        write_json(self.path, report, default=str)
        r = report["result"]
        print(
            f"benchmark: {r['ms_per_step_median']:.1f} ms/step (p90 {r['ms_per_step_p90']:.1f}), "
            f"{r['patches_per_s']:.2f} patches/s per rank x {r['ranks']}, "
            f"data wait {100 * r['data_wait_fraction']:.1f}% of step time, "
            f"GPU busy {_percent(r['gpu_busy_fraction'])}, "
            f"first step {'n/a' if r['first_step_s'] is None else format(r['first_step_s'], '.1f')} s, "
            f"peak memory {r['peak_memory_gib']:.2f} GiB ({r['peak_memory_kind']}); {self.path}"
        )

    def report(self) -> dict[str, Any]:
        total, wait = np.asarray(self.total), np.asarray(self.wait)
        median = float(np.median(total))
        if self.device.type == "cuda":
            peak, kind = torch.cuda.max_memory_allocated(self.device) / 2**30, "device, torch allocator"
        else:
            peak, kind = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "host RSS"
        result = {
            "warmup_steps": self.warmup,
            "timed_steps": len(total),
            "patches_per_step": self.patches_per_step,
            "ms_per_step_median": 1000 * median,
            "ms_per_step_p90": 1000 * float(np.percentile(total, 90)),
            "ms_per_step_mean": 1000 * float(total.mean()),
            "patches_per_s": self.patches_per_step * len(total) / float(total.sum()),
            "data_wait_fraction": float(wait.sum() / total.sum()),
            "data_wait_ms_median": 1000 * float(np.median(wait)),
            "gpu_busy_fraction": self.busy,  # None on a CPU, or when the busy steps did not run
            "busy_steps": self._profiled,
            "epochs": self.epochs,
            "first_step_s": self.warmup_times[0] if self.warmup_times else None,
            "warmup_s": float(sum(self.warmup_times)),
            "peak_memory_gib": round(peak, 3),
            "peak_memory_kind": kind,
            # what the allocator holds: a CUDA graph's pool stays reserved between replays, which allocate nothing,
            # so with cuda_graphs the allocated peak of the timed steps says little of the memory the step needs
            "peak_reserved_gib": (
                round(torch.cuda.max_memory_reserved(self.device) / 2**30, 3) if self.device.type == "cuda" else None
            ),
        }
        result["ranks"] = world_size()  # DDP: every rank takes the same steps, the run does N times one rank's work
        result["global_patches_per_s"] = result["patches_per_s"] * result["ranks"]
        if self.tflop_per_patch:
            result["model_tflop_per_s"] = result["patches_per_s"] * self.tflop_per_patch
        result["busy_trace"] = self.trace_written
        now = cache_counters()
        result["compile_cache"] = {key: now[key] - self.compile_counters.get(key, 0) for key in now}
        summary = getattr(self.iteration, "summary", None)
        result["cuda_graphs"] = summary() if callable(summary) else None
        return {"result": result, "switches": self.switches, "device": self.device_report}


def busy_fraction(intervals: Iterable[tuple[int, int]], wall_ns: int) -> float:
    """The share of ``wall_ns`` covered by at least one of ``intervals`` (start, end in ns): the union, so kernels that
    overlap on several streams count once. Sorted once, then one pass."""
    covered, reach = 0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            covered += end - start
            reach = end
        elif end > reach:
            covered += end - reach
            reach = end
    return min(covered / wall_ns, 1.0) if wall_ns > 0 else 0.0


def _percent(fraction: float | None) -> str:
    return "n/a" if fraction is None else f"{100 * fraction:.1f}%"


def tflop_per_patch(feature_size: int, roi_size: list[int]) -> float | None:
    """The known forward+backward cost for SwinUNETR f48 at 96^3 (scaled by voxels for other patch sizes), else None:
    model-FLOP utilisation is reported only where the count is known."""
    if int(feature_size) != 48:
        return None
    return SWINUNETR48_TFLOP_PER_96CUBE * float(np.prod(roi_size)) / 96**3

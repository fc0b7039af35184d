"""torch.profiler for the bundle's ignite trainer: chrome traces, key-average tables and a memory snapshot.

Enabled by ``configs/profile.yaml``, whose training stops once the schedule's cycles are written
(``stop_training``). The schedule ``[wait, warmup, active, repeat]`` is counted in **training iterations** (the
original AMD scripts stepped the profiler once per epoch, so "active: 3" meant three epochs). For each completed
cycle, under ``<output_dir>/profiler/``:

* ``<step>-chrome_trace.json.gz`` -- open in https://ui.perfetto.dev or chrome://tracing, or summarise it with
  ``python -m scripts.summarize_trace``;
* ``<step>-trace_summary.txt`` -- key averages sorted by device time (self CPU time on a CPU-only run);
* ``<step>-key_averages.json`` -- every row of those key averages as numbers (microseconds), torch's own accounting
  of the same events, against which a summary of the trace can be checked (``tests/test_gpu.py`` does);
* ``memory.pickle`` -- CUDA/ROCm allocator history from the start until the end of the first cycle
  (https://pytorch.org/memory_viz); skipped, with a log line, without a GPU.

:class:`SectionMarkers` wraps the trainer's phases in ``record_function`` ranges named ``__sec:loader_first``,
``__sec:loader_next``, ``__sec:step``, ``__sec:forward``, ``__sec:backward`` and ``__sec:optimizer`` (the names of
the original scripts' traces, so one summariser reads both), from ignite/MONAI events -- MONAI's trainer is used as
it is, not forked. With ``nvtx=True`` the same names also appear as NVTX ranges for Nsight Systems.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from ignite.engine import Engine, Events
from monai.engines.utils import IterationEvents
from scripts.common.events import on_exception_first
from scripts.common.files import write_json

logger = logging.getLogger(__name__)

SECTION_PREFIX = "__sec:"


class _Range:
    """One open ``record_function`` (+ optional NVTX) range."""

    def __init__(self, name: str, nvtx: bool) -> None:
        self.name = SECTION_PREFIX + name
        self.nvtx = nvtx
        self.record = torch.profiler.record_function(self.name)
        self.record.__enter__()
        if self.nvtx:
            torch.cuda.nvtx.range_push(self.name)

    def close(self) -> None:
        if self.nvtx:
            torch.cuda.nvtx.range_pop()
        self.record.__exit__(None, None, None)


class SectionMarkers:
    """Mark loader / step / forward / backward / optimizer phases of a MONAI ``SupervisedTrainer``.

    The forward range opens in a forward pre-hook on the network (after the batch reached the device) and closes at
    MONAI's ``FORWARD_COMPLETED``; backward spans ``LOSS_COMPLETED`` -> ``BACKWARD_COMPLETED``; optimizer spans
    ``BACKWARD_COMPLETED`` -> ``MODEL_COMPLETED``. Validation forwards are not marked.
    """

    def __init__(self, network: torch.nn.Module | None = None, nvtx: bool = False) -> None:
        self.network = network
        self.nvtx = nvtx and torch.cuda.is_available()
        self.open: dict[str, _Range] = {}
        self.in_iteration = False

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.GET_BATCH_STARTED, self._loader_start)
        engine.add_event_handler(Events.GET_BATCH_COMPLETED, self._end, "loader")
        engine.add_event_handler(Events.ITERATION_STARTED, self._step_start)
        engine.add_event_handler(IterationEvents.FORWARD_COMPLETED, self._end, "forward")
        engine.add_event_handler(IterationEvents.LOSS_COMPLETED, self._start, "backward")
        engine.add_event_handler(IterationEvents.BACKWARD_COMPLETED, self._switch, "backward", "optimizer")
        engine.add_event_handler(IterationEvents.MODEL_COMPLETED, self._end, "optimizer")
        engine.add_event_handler(Events.ITERATION_COMPLETED, self._step_end)
        network = self.network if self.network is not None else getattr(engine, "network", None)
        if network is not None:
            network.register_forward_pre_hook(self._forward_start)

    def _start(self, _engine: Engine | None, key: str, name: str | None = None) -> None:
        self.open[key] = _Range(name or key, self.nvtx)

    def _end(self, _engine: Engine | None, key: str) -> None:
        section = self.open.pop(key, None)
        if section is not None:
            section.close()

    def _switch(self, engine: Engine, old: str, new: str) -> None:
        self._end(engine, old)
        self._start(engine, new)

    def _loader_start(self, engine: Engine) -> None:
        first = engine.state.iteration % max(engine.state.epoch_length or 1, 1) == 0
        self._start(engine, "loader", "loader_first" if first else "loader_next")

    def _step_start(self, engine: Engine) -> None:
        self.in_iteration = True
        self._start(engine, "step")

    def _forward_start(self, _module: torch.nn.Module, _inputs) -> None:
        if self.in_iteration and "forward" not in self.open and "backward" not in self.open:
            self._start(None, "forward")

    def _step_end(self, engine: Engine) -> None:
        for key in ("forward", "backward", "optimizer"):
            self._end(engine, key)
        self._end(engine, "step")
        self.in_iteration = False


class ProfilerHandler:
    """Run ``torch.profiler`` on a schedule of training iterations and write traces, tables and a memory snapshot.

    Args:
        output_dir: the run's output folder; files go to ``<output_dir>/profiler/``.
        schedule: ``[wait, warmup, active, repeat]`` in iterations (``repeat`` 0 = until training ends).
        network: the trained network, for the forward range (defaults to ``engine.network``).
        record_shapes / with_stack / profile_memory: passed to ``torch.profiler.profile``.
        memory_snapshot: record the CUDA/ROCm allocator history until the end of the first cycle.
        rank: this process's rank; only ``profile_ranks`` profile (default: rank 0).
        nvtx: also emit NVTX ranges (CUDA only).
        row_limit: rows of the key-averages table.
        stop_training: end the training (``engine.terminate()``) once the ``repeat`` cycles are written, on every
            rank at the same iteration (the iterations after them would only train, unmeasured); ``repeat`` must
            then be at least 1.
    """

    def __init__(
        self,
        output_dir: str | Path,
        schedule: list[int] | tuple[int, int, int, int] = (2, 2, 4, 1),
        network: torch.nn.Module | None = None,
        record_shapes: bool = True,
        with_stack: bool = False,
        profile_memory: bool = False,
        memory_snapshot: bool = True,
        rank: int | None = None,
        profile_ranks: list[int] | str = (0,),
        nvtx: bool = False,
        row_limit: int = 40,
        stop_training: bool = False,
    ) -> None:
        self.steps = schedule_steps(schedule, stop_training)
        self.wait, self.warmup, self.active, self.repeat = (int(v) for v in schedule)
        self.stop_training = stop_training
        self.iterations = 0
        self.dir = Path(output_dir) / "profiler"
        self.rank = int(os.environ.get("RANK", 0)) if rank is None else int(rank)
        self.enabled = profile_ranks == "all" or self.rank in [int(r) for r in profile_ranks]
        self.markers = SectionMarkers(network, nvtx)
        self.kwargs = {"record_shapes": record_shapes, "with_stack": with_stack, "profile_memory": profile_memory}
        self.device = torch.cuda.is_available()
        self.memory_snapshot = memory_snapshot
        self.row_limit = row_limit
        self.profiler: torch.profiler.profile | None = None
        self.cycles = 0
        self.written: list[Path] = []

    def attach(self, engine: Engine) -> None:
        self.markers.attach(engine)  # ranges cost nothing when no profiler is recording
        if self.enabled:
            engine.add_event_handler(Events.STARTED, self.start)
            engine.add_event_handler(Events.ITERATION_COMPLETED, self.step)
            engine.add_event_handler(Events.COMPLETED, self.stop)
            on_exception_first(engine, self.stop)  # the steps profiled before an error are written, then it propagates
        if self.stop_training:  # on every rank: DDP ranks that stopped apart would wait for each other forever
            engine.add_event_handler(Events.ITERATION_COMPLETED, self._terminate_after_schedule)

    def start(self, _engine: Engine | None = None) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device:
            activities.append(torch.profiler.ProfilerActivity.CUDA)  # also HIP kernels on ROCm builds
            if self.memory_snapshot:
                torch.cuda.memory._record_memory_history(max_entries=200_000)
        elif self.memory_snapshot:
            logger.info("profiler: no CUDA/ROCm device, so no memory.pickle (the snapshot records the GPU allocator)")
        self.profiler = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(
                wait=self.wait, warmup=self.warmup, active=self.active, repeat=self.repeat
            ),
            on_trace_ready=self._trace_ready,
            **self.kwargs,
        )
        self.profiler.__enter__()
        logger.info(
            "profiling iterations with wait=%d warmup=%d active=%d repeat=%d -> %s",
            self.wait,
            self.warmup,
            self.active,
            self.repeat,
            self.dir,
        )

    def step(self, _engine: Engine | None = None) -> None:
        if self.profiler is not None:
            self.profiler.step()
            if self.repeat and self.cycles >= self.repeat:
                self.stop()

    def _terminate_after_schedule(self, engine: Engine) -> None:
        self.iterations += 1  # attached after step(): the last cycle's trace is written before the engine stops
        if self.iterations >= self.steps:
            logger.info("profiler: %d iterations profiled as scheduled, training stops", self.iterations)
            engine.terminate()

    def stop(self, _engine: Engine | None = None, *_args) -> None:
        if self.profiler is not None:
            profiler, self.profiler = self.profiler, None
            profiler.__exit__(None, None, None)
        self._dump_memory()

    def _trace_ready(self, profiler: torch.profiler.profile) -> None:
        step = profiler.step_num
        trace = self.dir / f"{step}-chrome_trace.json.gz"
        tmp = self.dir / f".{step}-chrome_trace.tmp{os.getpid()}.json.gz"
        profiler.export_chrome_trace(str(tmp))
        os.replace(tmp, trace)
        sort_by = "self_cuda_time_total" if self.device else "self_cpu_time_total"
        averages = profiler.key_averages()
        table = averages.table(sort_by=sort_by, row_limit=self.row_limit)
        summary = self.dir / f"{step}-trace_summary.txt"
        summary.write_text(f"key averages of iterations up to {step}, sorted by {sort_by}\n{table}\n")
        rows = write_json(self.dir / f"{step}-key_averages.json", key_average_rows(averages))
        self.written += [trace, summary, rows]
        self.cycles += 1
        logger.info("profiler cycle %d: wrote %s and %s", self.cycles, trace, summary.name)
        if self.cycles == 1:
            self._dump_memory()

    def _dump_memory(self) -> None:
        if self.device and self.memory_snapshot:
            self.memory_snapshot = False
            path = self.dir / "memory.pickle"
            torch.cuda.memory._dump_snapshot(str(path))
            torch.cuda.memory._record_memory_history(enabled=None)
            self.written.append(path)
            logger.info("profiler: wrote the allocator history to %s", path)


def schedule_steps(schedule: Sequence[int], stop_training: bool = True) -> int:
    """The training iterations that ``[wait, warmup, active, repeat]`` spans (each cycle waits, warms up and records:
    ``(wait + warmup + active) * repeat``; 0 for ``repeat`` 0, a profiler that runs until training ends, which a
    run that stops after its schedule cannot use). Raises ValueError naming ``profiler_schedule`` otherwise."""
    values = list(schedule)
    if len(values) != 4 or any(int(v) < 0 for v in values) or int(values[2]) < 1:
        raise ValueError(f"profiler_schedule={values}: give [wait, warmup, active, repeat], active >= 1.")
    wait, warmup, active, repeat = (int(v) for v in values)
    if stop_training and repeat < 1:
        raise ValueError(
            f"profiler_schedule={values}: repeat 0 profiles until training ends, but this run stops after its profiled "
            "iterations; give repeat >= 1 (e.g. --profiler_schedule [2,2,4,1])."
        )
    return (wait + warmup + active) * repeat


def key_average_rows(averages: Any) -> list[dict[str, Any]]:
    """Each row of ``profiler.key_averages()`` as plain numbers: name, count, device type and the total and self
    times in microseconds (CPU and device; ``device_*`` is CUDA/HIP kernel time, 0 on a CPU-only run)."""
    rows = []
    for row in averages:
        device = getattr(row, "device_time_total", None)  # torch < 2.4 named these cuda_*
        self_device = getattr(row, "self_device_time_total", None)
        rows.append(
            {
                "name": row.key,
                "count": int(row.count),
                "device_type": str(row.device_type).rsplit(".", 1)[-1],
                "cpu_time_total_us": float(row.cpu_time_total),
                "self_cpu_time_total_us": float(row.self_cpu_time_total),
                "device_time_total_us": float(row.cuda_time_total if device is None else device),
                "self_device_time_total_us": float(row.self_cuda_time_total if self_device is None else self_device),
            }
        )
    return rows

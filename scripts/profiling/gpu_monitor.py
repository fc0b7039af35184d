"""Optional GPU utilisation sampler for training runs: a CSV while the job runs, a plot and a summary at the end.

A low mean utilisation is the first sign that a run is input-bound (data loading, caching, CPU transforms) rather
than compute-bound, and the peak memory says how much headroom a larger ROI or batch has. :class:`GpuMonitor`
samples every GPU from a background daemon thread and appends one row per GPU to
``<output_dir>/gpu_utilisation.csv`` (flushed after every sample, so a crashed run keeps its data). On stop it draws
``gpu_utilisation.png`` and logs one line per GPU: mean / max utilisation and peak memory.

Backends, tried in this order (the first whose first sample succeeds wins; ``backend=`` forces one): ``nvml``
(the ``pynvml`` module of nvidia-ml-py), ``nvidia-smi``, ``rocm-smi``, ``amd-smi``. A missing, failing, slow or
unparsable tool means "not available" -- never an exception. Without any backend the monitor logs one INFO line and
every method is a no-op, so it can stay in a config on CPU-only machines.

Use it as a context manager, as an ignite handler (:meth:`GpuMonitor.attach`), or beside any job::

    python -m scripts.gpu_monitor watch --output_dir runs/gpu [--interval_s 1] [--duration_s 600]
"""

from __future__ import annotations

import csv
import json
import logging
import math
import re
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scripts.common.config import as_bool
from scripts.common.events import on_exception_first

logger = logging.getLogger(__name__)

CSV_HEADER = ("time_s", "gpu", "name", "util_percent", "mem_used_mib", "mem_total_mib")
TIMEOUT_S = 5.0
_MIB_PER_UNIT = {"B": 2**-20, "KB": 2**-10, "KIB": 2**-10, "MB": 1.0, "MIB": 1.0, "GB": 2**10, "GIB": 2**10}
_MISSING = {"", "n/a", "[n/a]", "[not supported]", "not supported", "none"}


@dataclass
class Sample:
    gpu: int
    name: str
    util_percent: float
    mem_used_mib: float
    mem_total_mib: float


def _num(value: Any) -> float:
    """A reading as a float; "N/A"-like values become NaN, anything else unparsable raises ValueError."""
    if isinstance(value, dict):  # amd-smi: {"value": 12, "unit": "%"}
        value = value.get("value")
    if value is None or (isinstance(value, str) and value.strip().lower() in _MISSING):
        return math.nan
    return float(str(value).strip().rstrip("%"))


def _run(cmd: list[str]) -> str:
    """stdout of ``cmd``; raises on a missing binary, non-zero exit or timeout."""
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, check=True).stdout


def _json(text: str) -> Any:
    """The first JSON document in ``text`` (the SMI tools sometimes print warnings before it)."""
    starts = [i for i in (text.find("{"), text.find("[")) if i >= 0]
    if not starts:
        raise ValueError("no JSON in output")
    return json.JSONDecoder().raw_decode(text[min(starts) :])[0]


class Backend:
    name = ""
    command: tuple[str, ...] = ()

    def available(self) -> bool:
        """Whether one sample can be taken now (never raises)."""
        try:
            return bool(self.sample())
        except Exception as err:  # a broken tool is "not available", whatever it does
            logger.debug("GPU backend %s not available: %s", self.name, err)
            return False

    def sample(self) -> list[Sample]:
        return self.parse(_run(list(self.command)))

    def parse(self, text: str) -> list[Sample]:
        raise NotImplementedError

    def close(self) -> None:
        """Release what :meth:`sample` opened (NVML's handle)."""


class NvmlBackend(Backend):
    name = "nvml"

    def __init__(self) -> None:
        self._pynvml: Any = None

    def sample(self) -> list[Sample]:
        if self._pynvml is None:
            import pynvml

            pynvml.nvmlInit()
            self._pynvml = pynvml
        pynvml = self._pynvml
        samples = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            name = pynvml.nvmlDeviceGetName(handle)
            name = name.decode() if isinstance(name, bytes) else str(name)
            util = float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            samples.append(Sample(i, name, util, mem.used / 2**20, mem.total / 2**20))
        return samples

    def close(self) -> None:
        if self._pynvml is not None:
            self._pynvml.nvmlShutdown()
            self._pynvml = None


class NvidiaSmiBackend(Backend):
    name = "nvidia-smi"
    command = (
        "nvidia-smi",
        "--query-gpu=index,name,utilization.gpu,memory.used,memory.total",
        "--format=csv,noheader,nounits",
    )

    def parse(self, text: str) -> list[Sample]:
        samples = []
        for row in csv.reader(text.strip().splitlines(), skipinitialspace=True):
            if len(row) != 5:
                raise ValueError(f"unexpected nvidia-smi row: {row}")
            samples.append(Sample(int(row[0]), row[1].strip(), _num(row[2]), _num(row[3]), _num(row[4])))
        return samples


class RocmSmiBackend(Backend):
    name = "rocm-smi"
    command = ("rocm-smi", "--showuse", "--showmeminfo", "vram", "--showproductname", "--json")
    NAME_KEYS = ("Card Series", "Card series", "Card SKU", "Card Model", "Card model", "Device Name")

    def parse(self, text: str) -> list[Sample]:
        samples = []
        for key, info in _json(text).items():
            match = re.fullmatch(r"card(\d+)", key)
            if not match or not isinstance(info, dict):
                continue  # e.g. "system"
            name = next((str(info[k]) for k in self.NAME_KEYS if info.get(k)), "AMD GPU")
            used, total = (_num(info.get(f"VRAM Total {k}Memory (B)")) / 2**20 for k in ("Used ", ""))
            samples.append(Sample(int(match.group(1)), name, _num(info.get("GPU use (%)")), used, total))
        if not samples:
            raise ValueError("no card in rocm-smi output")
        return samples


class AmdSmiBackend(Backend):
    name = "amd-smi"
    command = ("amd-smi", "metric", "--usage", "--mem-usage", "--json")

    def _mib(self, reading: Any) -> float:
        unit = str(reading.get("unit", "MB")).upper() if isinstance(reading, dict) else "MB"
        return _num(reading) * _MIB_PER_UNIT.get(unit, 1.0)  # amd-smi's "MB" is bytes / 2**20

    def parse(self, text: str) -> list[Sample]:
        data = _json(text)
        gpus = data.get("gpu_data", []) if isinstance(data, dict) else data  # newer versions wrap the list
        samples = []
        for entry in gpus:
            usage = entry.get("usage") if isinstance(entry.get("usage"), dict) else {}
            mem = entry.get("mem_usage") if isinstance(entry.get("mem_usage"), dict) else {}
            name = (entry.get("asic") or {}).get("market_name") or "AMD GPU"
            samples.append(
                Sample(
                    int(entry["gpu"]),
                    str(name),
                    _num(usage.get("gfx_activity")),
                    self._mib(mem.get("used_vram")),
                    self._mib(mem.get("total_vram")),
                )
            )
        if not samples:
            raise ValueError("no GPU in amd-smi output")
        return samples


BACKENDS: dict[str, type[Backend]] = {b.name: b for b in (NvmlBackend, NvidiaSmiBackend, RocmSmiBackend, AmdSmiBackend)}


def detect(backend: str | None = None) -> Backend | None:
    """The first backend (or the named one) whose first sample succeeds; None if there is none."""
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: expected one of {', '.join(BACKENDS)}")
    for name in [backend] if backend else BACKENDS:
        candidate = BACKENDS[name]()
        if (name == "nvml" or shutil.which(candidate.command[0])) and candidate.available():
            return candidate
    return None


class GpuMonitor:
    """Sample GPU utilisation and memory every ``interval_s`` seconds in a daemon thread (see the module docstring).

    As an ignite handler (:meth:`attach`) it stops, and draws its plot, also when training fails.
    """

    def __init__(
        self,
        output_dir: str | Path,
        interval_s: float = 1.0,
        enabled: bool | str = True,
        plot: bool | str = True,
        backend: str | None = None,
        rank0_only: bool | str = True,
        filename: str = "gpu_utilisation.csv",
    ) -> None:
        self.output_dir = Path(output_dir)
        self.interval_s = float(interval_s)
        self.enabled = as_bool(enabled, "enabled")
        self.plot = as_bool(plot, "plot")
        self.backend_name = backend
        self.rank0_only = as_bool(rank0_only, "rank0_only")
        self.csv_path = self.output_dir / filename
        self.png_path = self.csv_path.with_suffix(".png")
        self.backend: Backend | None = None
        self._detected = False
        self._thread: threading.Thread | None = None
        self._stop_event = threading.Event()
        self._lock = threading.Lock()
        self._file: Any = None
        self._stats: dict[int, dict[str, Any]] = {}
        self._t0 = 0.0
        self._warned = False

    @property
    def running(self) -> bool:
        return self._thread is not None

    def _active(self) -> bool:
        if not self.enabled:
            return False
        if self.rank0_only:
            from scripts.training.distributed import is_rank0  # imports torch: not needed by the watch CLI (all ranks)

            if not is_rank0():
                return False
        if not self._detected:
            self._detected = True
            self.backend = detect(self.backend_name)
            if self.backend is None:
                logger.info("GPU utilisation logging is off: no NVML / nvidia-smi / rocm-smi / amd-smi was found.")
        return self.backend is not None

    def start(self) -> GpuMonitor:
        """Open the CSV and start sampling; a no-op when running, disabled, not rank 0 or without a backend."""
        if self.running or not self._active():
            return self
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.csv_path, "w", newline="")  # noqa: SIM115 -- closed in stop()
        self._writer = csv.writer(self._file)
        self._writer.writerow(CSV_HEADER)
        self._file.flush()
        self._stats, self._warned = {}, False
        self._t0 = time.monotonic()
        self._stop_event.clear()
        self._thread = threading.Thread(target=self._loop, name="gpu-monitor", daemon=True)
        self._thread.start()
        logger.info("GPU utilisation (%s) every %gs -> %s", self.backend.name, self.interval_s, self.csv_path)
        return self

    def _loop(self) -> None:
        while True:  # sample first, so even a very short run has one row
            self._record()
            if self._stop_event.wait(self.interval_s):
                return

    def _record(self) -> None:
        try:
            samples = self.backend.sample()
        except Exception as err:  # a hiccup of the tool must not end the run
            if not self._warned:
                logger.warning("GPU utilisation sample failed (%s); skipping failed samples.", err)
                self._warned = True
            return
        t = round(time.monotonic() - self._t0, 3)
        with self._lock:
            if self._file is None:
                return
            for s in samples:
                row = (round(s.util_percent, 2), round(s.mem_used_mib, 2), round(s.mem_total_mib, 2))
                self._writer.writerow((t, s.gpu, s.name, *row))
                st = self._stats.setdefault(s.gpu, {"name": s.name, "util": [], "peak": math.nan, "n": 0})
                st["n"] += 1
                if not math.isnan(s.util_percent):
                    st["util"].append(s.util_percent)
                st["peak"] = max(st["peak"], s.mem_used_mib) if not math.isnan(st["peak"]) else s.mem_used_mib
            self._file.flush()

    def stop(self) -> dict[int, dict[str, Any]]:
        """Stop sampling, close the CSV, draw the PNG and log the summary; returns :meth:`summary`."""
        if self._thread is None:
            return self.summary()
        self._stop_event.set()
        self._thread.join(timeout=2 * TIMEOUT_S + self.interval_s)
        self._thread = None
        with self._lock:
            self._file.close()
            self._file = None
        self.backend.close()
        if self.plot:
            self._draw()
        parts = [
            f"GPU{i} {v['name']}: mean {v['mean_util_percent']:.0f}%, max {v['max_util_percent']:.0f}%, "
            f"peak {v['peak_mem_used_mib']:.0f} MiB"
            for i, v in self.summary().items()
        ]
        logger.info("GPU utilisation (%s): %s -- %s", self.backend.name, "; ".join(parts) or "no sample", self.csv_path)
        return self.summary()

    def summary(self) -> dict[int, dict[str, Any]]:
        """``{gpu: {"name", "mean_util_percent", "max_util_percent", "peak_mem_used_mib", "samples"}}``."""
        with self._lock:
            return {
                gpu: {
                    "name": st["name"],
                    "mean_util_percent": sum(st["util"]) / len(st["util"]) if st["util"] else math.nan,
                    "max_util_percent": max(st["util"], default=math.nan),
                    "peak_mem_used_mib": st["peak"],
                    "samples": st["n"],
                }
                for gpu, st in sorted(self._stats.items())
            }

    def _draw(self) -> None:
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
        except ImportError:
            logger.info("matplotlib is not installed: no %s", self.png_path.name)
            return
        series: dict[str, tuple[list[float], list[float], list[float]]] = {}
        with open(self.csv_path, newline="") as f:
            for row in csv.DictReader(f):
                t, u, m = series.setdefault(f"GPU{row['gpu']} {row['name']}", ([], [], []))
                t.append(float(row["time_s"]))
                u.append(float(row["util_percent"]))
                m.append(float(row["mem_used_mib"]))
        fig = Figure(figsize=(10, 6), layout="constrained")
        FigureCanvasAgg(fig)
        util_ax, mem_ax = fig.subplots(2, 1, sharex=True)
        for label, (t, u, m) in series.items():
            util_ax.plot(t, u, label=label)
            mem_ax.plot(t, m, label=label)
        util_ax.set(ylabel="utilisation (%)", ylim=(0, 105), title=f"GPU utilisation ({self.backend.name})")
        mem_ax.set(ylabel="memory used (MiB)", xlabel="time (s)")
        util_ax.legend(loc="upper right", fontsize="small")
        fig.savefig(self.png_path, dpi=100)

    def attach(self, engine: Any) -> None:
        """Start on ``STARTED``; stop on ``COMPLETED`` and, first of all, on ``EXCEPTION_RAISED``: the CSV is closed
        and the plot drawn before a handler that re-raises ends the chain
        (:func:`scripts.common.events.on_exception_first`).
        """
        from ignite.engine import Events

        if not self.enabled:
            return
        engine.add_event_handler(Events.STARTED, lambda _: self.start())
        engine.add_event_handler(Events.COMPLETED, lambda _: self.stop())
        on_exception_first(engine, self.stop)

    def __enter__(self) -> GpuMonitor:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def watch(
    output_dir: str, interval_s: float = 1.0, duration_s: float | None = None, backend: str | None = None
) -> None:
    """Sample until Ctrl-C (or ``duration_s``), then write the PNG and print the summary."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    monitor = GpuMonitor(output_dir, interval_s=interval_s, backend=backend, rank0_only=False).start()
    if not monitor.running:
        return
    deadline = math.inf if duration_s is None else time.monotonic() + float(duration_s)
    try:
        while time.monotonic() < deadline:
            time.sleep(min(0.2, max(deadline - time.monotonic(), 0.0)))
    except KeyboardInterrupt:
        pass
    finally:
        monitor.stop()

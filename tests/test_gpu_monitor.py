"""GpuMonitor against fake ``nvidia-smi`` / ``rocm-smi`` / ``amd-smi`` executables: no GPU needed.

PATH holds only the fakes (they call /bin/cat etc. by absolute path) and ``pynvml`` cannot be imported, so the real
tools of the machine running the tests never answer.
"""

from __future__ import annotations

import csv
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ignite.engine import Engine
from scripts.profiling import gpu_monitor
from scripts.profiling.gpu_monitor import GpuMonitor, detect

# two alternating nvidia-smi outputs: GPU 0 at 20 % then 60 %, GPU 1 always 90 %
NVIDIA_A = "0, NVIDIA H100 80GB HBM3, 20, 1000, 81559\n1, NVIDIA H100 80GB HBM3, 90, 30000, 81559\n"
NVIDIA_B = "0, NVIDIA H100 80GB HBM3, 60, 5000, 81559\n1, NVIDIA H100 80GB HBM3, 90, 30000, 81559\n"
GIB = 2**30
ROCM = {
    "card0": {
        "GPU use (%)": "12",
        "VRAM Total Memory (B)": str(64 * GIB),
        "VRAM Total Used Memory (B)": str(3 * GIB),
        "Card Series": "AMD Instinct MI210",
    },
    "card1": {"VRAM Total Memory (B)": str(64 * GIB), "VRAM Total Used Memory (B)": str(GIB // 2)},  # no use (%)
    "system": {"Driver version": "6.8.5"},
}
AMD_SMI = {
    "gpu_data": [
        {
            "gpu": 0,
            "usage": {"gfx_activity": {"value": 47, "unit": "%"}, "umc_activity": {"value": 3, "unit": "%"}},
            "mem_usage": {"total_vram": {"value": 196592, "unit": "MB"}, "used_vram": {"value": 4096, "unit": "MB"}},
        }
    ]
}


@pytest.fixture
def tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """``tools(name, script_body)`` writes an executable fake on a PATH that holds nothing else."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setitem(sys.modules, "pynvml", None)

    def make(name: str, body: str) -> Path:
        path = bin_dir / name
        path.write_text("#!/bin/sh\n" + body)
        path.chmod(0o755)
        return path

    return make


def cat(tools, name: str, text: str, tmp_path: Path) -> None:
    fixture = tmp_path / f"{name}.out"
    fixture.write_text(text)
    tools(name, f"/bin/cat {fixture}\n")


def alternating_nvidia_smi(tools, tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text(NVIDIA_A)
    (tmp_path / "b.txt").write_text(NVIDIA_B)
    (tmp_path / "count").write_text("0")
    tools(
        "nvidia-smi",
        f"n=$(/bin/cat {tmp_path}/count)\necho $((n + 1)) > {tmp_path}/count\n"
        f"if [ $((n % 2)) -eq 0 ]; then /bin/cat {tmp_path}/a.txt; else /bin/cat {tmp_path}/b.txt; fi\n",
    )


def rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def wait_for_rows(path: Path, n: int, timeout_s: float = 2.0) -> None:
    """Rows must reach the disk while the monitor runs (it flushes after every sample)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and len(rows(path)) >= n:
            return
        time.sleep(0.02)
    raise AssertionError(f"fewer than {n} rows in {path}")


def monitor_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "scripts.profiling.gpu_monitor" and r.levelno >= logging.INFO]


def test_nvidia_smi_two_gpus_csv_png_and_summary(tools, tmp_path: Path) -> None:
    alternating_nvidia_smi(tools, tmp_path)
    out = tmp_path / "run"
    with GpuMonitor(out, interval_s=0.05) as monitor:
        assert monitor.backend.name == "nvidia-smi"
        wait_for_rows(out / "gpu_utilisation.csv", 6)  # three samples: GPU 0 has seen 20 % and 60 %
    table = rows(out / "gpu_utilisation.csv")
    assert list(table[0]) == ["time_s", "gpu", "name", "util_percent", "mem_used_mib", "mem_total_mib"]
    gpu0 = [r for r in table if r["gpu"] == "0"]
    gpu1 = [r for r in table if r["gpu"] == "1"]
    assert len(gpu0) == len(gpu1) >= 3
    assert {float(r["util_percent"]) for r in gpu0} == {20.0, 60.0}
    assert {(float(r["util_percent"]), float(r["mem_used_mib"])) for r in gpu1} == {(90.0, 30000.0)}
    assert all(float(r["mem_total_mib"]) == 81559.0 and r["name"] == "NVIDIA H100 80GB HBM3" for r in table)
    times = [float(r["time_s"]) for r in gpu0]
    assert times == sorted(times) and times[0] < 1.0

    summary = monitor.summary()
    utils0 = [float(r["util_percent"]) for r in gpu0]
    assert summary[0]["max_util_percent"] == 60.0
    assert summary[0]["mean_util_percent"] == pytest.approx(sum(utils0) / len(utils0))
    assert summary[0]["peak_mem_used_mib"] == 5000.0
    assert summary[0]["samples"] == len(gpu0)
    assert summary[1]["mean_util_percent"] == summary[1]["max_util_percent"] == 90.0
    assert summary[1]["name"] == "NVIDIA H100 80GB HBM3"
    assert (out / "gpu_utilisation.png").read_bytes().startswith(b"\x89PNG")


def test_rocm_smi_json(tools, tmp_path: Path) -> None:
    cat(tools, "rocm-smi", "WARNING: no power cap\n" + json.dumps(ROCM), tmp_path)
    backend = detect()
    assert backend is not None and backend.name == "rocm-smi"
    card0, card1 = sorted(backend.sample(), key=lambda s: s.gpu)
    assert (card0.gpu, card0.name, card0.util_percent) == (0, "AMD Instinct MI210", 12.0)
    assert (card0.mem_used_mib, card0.mem_total_mib) == (3 * 1024.0, 64 * 1024.0)
    assert card1.gpu == 1 and card1.util_percent != card1.util_percent  # missing "GPU use (%)" -> NaN
    assert card1.mem_used_mib == 512.0


def test_amd_smi_json(tools, tmp_path: Path) -> None:
    cat(tools, "amd-smi", json.dumps(AMD_SMI), tmp_path)
    backend = detect()
    assert backend is not None and backend.name == "amd-smi"
    [gpu] = backend.sample()
    assert (gpu.gpu, gpu.util_percent, gpu.mem_used_mib, gpu.mem_total_mib) == (0, 47.0, 4096.0, 196592.0)


@pytest.mark.parametrize("broken", ["/bin/echo oops >&2\nexit 1\n", "/bin/echo 'this is not, a table'\n"])
def test_broken_nvidia_smi_falls_through_to_rocm_smi(tools, tmp_path: Path, broken: str) -> None:
    tools("nvidia-smi", broken)
    cat(tools, "rocm-smi", json.dumps(ROCM), tmp_path)
    backend = detect()
    assert backend is not None and backend.name == "rocm-smi"


@pytest.mark.parametrize(
    "nvidia",
    ["exit 1\n", "/bin/echo 'NVIDIA-SMI has failed'\n", "exec /bin/sleep 10\n"],
    ids=["exit1", "garbage", "hang"],
)
def test_no_working_backend_writes_nothing_and_logs_once(
    tools, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, nvidia: str
) -> None:
    monkeypatch.setattr(gpu_monitor, "TIMEOUT_S", 0.3)
    tools("nvidia-smi", nvidia)
    tools("rocm-smi", "/bin/echo '{not json'\n")
    tools("amd-smi", "exit 2\n")
    out = tmp_path / "run"
    caplog.set_level(logging.DEBUG, logger="scripts.profiling.gpu_monitor")
    monitor = GpuMonitor(out, interval_s=0.05)
    with monitor:
        assert not monitor.running
    monitor.start()
    assert monitor.stop() == {}
    assert not out.exists()
    [record] = monitor_records(caplog)
    assert record.levelno == logging.INFO
    assert all(tool in record.getMessage() for tool in ("NVML", "nvidia-smi", "rocm-smi", "amd-smi"))


def test_ignite_engine_completed(tools, tmp_path: Path) -> None:
    cat(tools, "nvidia-smi", NVIDIA_A, tmp_path)
    out = tmp_path / "run"
    monitor = GpuMonitor(out, interval_s=0.05)
    engine = Engine(lambda engine, batch: time.sleep(0.02))
    monitor.attach(engine)
    engine.run(range(5), max_epochs=1)
    assert not monitor.running
    table = rows(out / "gpu_utilisation.csv")
    assert len(table) >= 2 and {r["gpu"] for r in table} == {"0", "1"}
    assert (out / "gpu_utilisation.png").exists()


@pytest.mark.parametrize("stats_handler", [None, "before", "after"])
def test_ignite_engine_exception_stops_monitor_and_reaches_caller(tools, tmp_path: Path, stats_handler) -> None:
    """Alone, or beside MONAI's StatsHandler (which re-raises and ends the handler chain) attached before or after."""
    from monai.handlers import StatsHandler

    cat(tools, "nvidia-smi", NVIDIA_A, tmp_path)
    out = tmp_path / "run"
    monitor = GpuMonitor(out, interval_s=0.05)
    seen = []

    def step(engine: Engine, batch: int) -> None:
        seen.append((monitor._thread, monitor._file))
        if engine.state.iteration == 3:
            raise RuntimeError("out of memory, say")

    engine = Engine(step)
    if stats_handler == "before":
        StatsHandler(iteration_log=False, epoch_log=False).attach(engine)
    monitor.attach(engine)
    if stats_handler == "after":
        StatsHandler(iteration_log=False, epoch_log=False).attach(engine)
    with pytest.raises(RuntimeError, match="out of memory"):
        engine.run(range(10), max_epochs=1)
    thread, file = seen[-1]
    assert thread is not None and not thread.is_alive()
    assert file.closed
    assert not monitor.running
    assert len(rows(out / "gpu_utilisation.csv")) >= 2  # the data of the failed run is kept
    assert (out / "gpu_utilisation.png").exists(), "the plot is drawn for a failed run too"


@pytest.mark.parametrize("kwargs", [{"enabled": "false"}, {"enabled": False}, {"plot": "False", "enabled": "no"}])
def test_disabled_writes_nothing(tools, tmp_path: Path, kwargs: dict) -> None:
    cat(tools, "nvidia-smi", NVIDIA_A, tmp_path)
    out = tmp_path / "run"
    engine = Engine(lambda engine, batch: None)
    monitor = GpuMonitor(out, interval_s=0.05, **kwargs)
    monitor.attach(engine)
    engine.run(range(3), max_epochs=1)
    with monitor:
        assert not monitor.running
    assert not out.exists() and monitor.summary() == {}


def test_enabled_string_true_plot_false_and_idempotent_start_stop(tools, tmp_path: Path) -> None:
    cat(tools, "nvidia-smi", NVIDIA_A, tmp_path)
    out = tmp_path / "run"
    with GpuMonitor(out, interval_s=0.05, enabled="true", plot="false") as monitor:
        thread = monitor._thread
        wait_for_rows(out / "gpu_utilisation.csv", 2)
        assert monitor.start()._thread is thread  # a second start neither restarts nor truncates the CSV
        wait_for_rows(out / "gpu_utilisation.csv", 4)
    summary = monitor.summary()
    assert monitor.stop() == summary and summary[0]["samples"] == len(rows(out / "gpu_utilisation.csv")) // 2
    assert not (out / "gpu_utilisation.png").exists()


def test_only_rank0_samples(tools, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cat(tools, "nvidia-smi", NVIDIA_A, tmp_path)
    import scripts.training.distributed

    monkeypatch.setattr(scripts.training.distributed, "rank", lambda: 1)
    with GpuMonitor(tmp_path / "rank1", interval_s=0.05) as monitor:
        assert not monitor.running
    assert not (tmp_path / "rank1").exists()
    with GpuMonitor(tmp_path / "all", interval_s=0.05, rank0_only=False):
        wait_for_rows(tmp_path / "all" / "gpu_utilisation.csv", 2)


def test_unknown_backend_is_an_error() -> None:
    with pytest.raises(ValueError, match="nvidia-smi"):
        GpuMonitor("unused", backend="cuda-smi").start()


def test_cli_watch_with_duration(tools, tmp_path: Path, root: Path) -> None:
    cat(tools, "nvidia-smi", NVIDIA_A, tmp_path)
    out = tmp_path / "watch"
    args = ["watch", "--output_dir", str(out), "--interval_s", "0.05", "--duration_s", "0.5", "--backend", "nvidia-smi"]
    result = subprocess.run(
        [sys.executable, "-m", "scripts.gpu_monitor", *args], cwd=root, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    table = rows(out / "gpu_utilisation.csv")
    assert len(table) >= 4 and {float(r["util_percent"]) for r in table} == {20.0, 90.0}
    assert (out / "gpu_utilisation.png").read_bytes().startswith(b"\x89PNG")
    assert "GPU0 NVIDIA H100 80GB HBM3: mean 20%, max 20%" in result.stderr

"""Training throughput as the benchmark reports it: on a real ignite Engine whose data and steps take known times,
the warm-up steps are left out, the run stops after ``steps`` timed steps, ms/step and the data-wait fraction match the
injected times, and the JSON report carries the switches and the device report. The model-FLOP figure is given only
where the count is known (SwinUNETR feature_size 48). On a GPU the profiled busy steps give the busy share and, when
asked, their chrome trace; the report counts this run's compile-cache hits and what a CUDA graph replayed."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from ignite.engine import Engine
from scripts.profiling import benchmark
from scripts.profiling.benchmark import StepTimer, busy_fraction, tflop_per_patch

DATA_S, STEP_S, WARMUP_STEP_S = 0.020, 0.040, 0.300
WARMUP, STEPS = 2, 5


def slow_batches():
    """An endless loader that takes ``DATA_S`` per batch."""
    while True:
        time.sleep(DATA_S)
        yield "batch"


def trainer() -> Engine:
    """An engine whose first ``WARMUP`` steps are slow (as compilation is) and the others take ``STEP_S``."""

    def step(engine: Engine, batch) -> None:
        time.sleep(WARMUP_STEP_S if engine.state.iteration <= WARMUP else STEP_S)

    return Engine(step)


def timed_run(path: Path, **kwargs) -> tuple[Engine, StepTimer]:
    engine = trainer()
    timer = StepTimer(path, "cpu", warmup=WARMUP, steps=STEPS, **kwargs)
    timer.attach(engine)
    engine.run(slow_batches(), max_epochs=1, epoch_length=1000)
    return engine, timer


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "benchmark.json"
    switches = {"cache": "disk", "amp": True, "roi_size": [96, 96, 96], "dataset_dir": Path("/data")}
    engine, timer = timed_run(path, patches_per_step=2, switches=switches, device_report={"name": "test CPU"})
    return engine, timer, path


def test_run_stops_after_warmup_plus_steps(measured):
    engine, timer, _ = measured
    assert engine.state.iteration == WARMUP + STEPS
    assert len(timer.total) == len(timer.wait) == STEPS


def test_times_match_the_injected_ones_and_leave_out_the_warmup(measured):
    _, _, path = measured
    result = json.loads(path.read_text())["result"]
    step_ms = 1000 * (DATA_S + STEP_S)
    assert result["warmup_steps"] == WARMUP and result["timed_steps"] == STEPS
    assert step_ms <= result["ms_per_step_median"] < step_ms + 40
    assert result["ms_per_step_mean"] < 1000 * WARMUP_STEP_S / 2, "the slow warm-up steps are not in the mean"
    assert result["ms_per_step_p90"] >= result["ms_per_step_median"]
    assert 1000 * DATA_S <= result["data_wait_ms_median"] < 1000 * DATA_S + 25
    assert result["data_wait_fraction"] == pytest.approx(DATA_S / (DATA_S + STEP_S), abs=0.12)
    assert result["patches_per_s"] == pytest.approx(2 * 1000 / result["ms_per_step_mean"], rel=1e-9)
    assert result["ranks"] == 1 and result["global_patches_per_s"] == result["patches_per_s"]
    assert result["peak_memory_kind"] == "host RSS" and result["peak_memory_gib"] > 0
    assert "model_tflop_per_s" not in result, "no FLOP figure without a known count"
    assert result["first_step_s"] == pytest.approx(WARMUP_STEP_S + DATA_S, abs=0.04), "compile time, apart"
    assert result["warmup_s"] == pytest.approx(WARMUP * (WARMUP_STEP_S + DATA_S), abs=0.08)
    assert result["gpu_busy_fraction"] is None and result["busy_steps"] == 0, "kernel time is a GPU measure"


def test_without_warm_up_the_first_step_is_timed_too(tmp_path):
    engine = trainer()
    StepTimer(tmp_path / "b.json", "cpu", warmup=0, steps=3).attach(engine)
    engine.run(slow_batches(), max_epochs=1, epoch_length=1000)
    result = json.loads((tmp_path / "b.json").read_text())["result"]
    assert engine.state.iteration == 3 and result["timed_steps"] == 3 and result["first_step_s"] is None
    assert result["ms_per_step_p90"] >= 1000 * (WARMUP_STEP_S + DATA_S), "the slow first step is among them"


def test_report_carries_the_switches_and_the_device(measured):
    _, _, path = measured
    report = json.loads(path.read_text())
    assert report["switches"] == {"cache": "disk", "amp": True, "roi_size": [96, 96, 96], "dataset_dir": "/data"}
    assert report["device"] == {"name": "test CPU"}
    assert path.read_text().endswith("}\n")


def test_summary_line_is_printed(tmp_path, capsys):
    timed_run(tmp_path / "b.json", tflop_per_patch=1.9)
    line = capsys.readouterr().out.strip()
    assert line.startswith("benchmark: ") and "ms/step" in line and "data wait" in line
    assert line.endswith(str(tmp_path / "b.json"))
    result = json.loads((tmp_path / "b.json").read_text())["result"]
    assert result["model_tflop_per_s"] == pytest.approx(result["patches_per_s"] * 1.9)


def test_disabled_timer_stops_the_run_but_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(benchmark, "is_rank0", lambda: False)
    engine, _ = timed_run(tmp_path / "rank1.json")
    assert engine.state.iteration == WARMUP + STEPS, "every rank stops after the same steps"
    assert list(tmp_path.iterdir()) == [] and capsys.readouterr().out == ""


def test_flop_count_is_known_only_for_feature_size_48():
    assert tflop_per_patch(48, [96, 96, 96]) == pytest.approx(1.9)
    assert tflop_per_patch("48", [96, 96, 192]) == pytest.approx(3.8)
    assert tflop_per_patch(48, [64, 64, 64]) == pytest.approx(1.9 * (64 / 96) ** 3)
    assert tflop_per_patch(24, [96, 96, 96]) is None
    assert tflop_per_patch(12, [96, 96, 96]) is None


def test_busy_time_is_the_union_of_the_device_intervals():
    # two overlapping kernels on two streams (0-10, 5-15), one kernel inside another (20-30, 21-22), a gap
    assert busy_fraction([(20, 30), (0, 10), (21, 22), (5, 15)], 40) == pytest.approx(25 / 40)
    assert busy_fraction([], 40) == 0.0 and busy_fraction([(0, 50)], 40) == 1.0


class _FakeKineto:
    """torch.profiler.profile as StepTimer uses it, on a machine without a GPU: device events 2 ms in every 10 ms."""

    def __init__(self, activities):
        assert [a.name for a in activities] == ["CUDA"], "device activity only: the host's ops are not traced"
        self.started = self.stopped = 0

    def start(self):
        self.started += 1
        self.t0 = time.perf_counter_ns()

    def stop(self):
        self.stopped += 1
        wall = time.perf_counter_ns() - self.t0
        device = SimpleNamespace(name="CUDA")
        events = [SimpleNamespace(device_type=lambda: device, start_ns=lambda t=t: t, duration_ns=lambda: 2_000_000)
                  for t in range(self.t0, self.t0 + wall - 2_000_000, 10_000_000)]  # fmt: skip
        self.profiler = SimpleNamespace(kineto_results=SimpleNamespace(events=lambda: events))

    def export_chrome_trace(self, path: str) -> None:
        Path(path).write_text(json.dumps({"traceEvents": [{"name": "kernel", "ph": "X"}]}))


class _FakeEvent:
    """A CUDA event stood in for: recorded at a host time, the device being as fast as the host here."""

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing, "an event without timing cannot give elapsed times"
        self.at = None

    def record(self) -> None:
        self.at = time.perf_counter()

    def elapsed_time(self, end: _FakeEvent) -> float:
        return 1000 * (end.at - self.at)


def test_on_a_gpu_extra_profiled_steps_give_the_busy_share(tmp_path, monkeypatch):
    """The control flow a GPU takes, with CUDA's calls and the profiler stood in for: the timed steps run back to back
    (the device synchronised where the window starts and ends, not between them) and are timed by events; the busy
    steps run after them, back to back too, are not among them, and give the device's share of their wall time."""
    synced_after = []
    monkeypatch.setattr(benchmark.torch.cuda, "synchronize", lambda *a: synced_after.append(engine.state.iteration))
    monkeypatch.setattr(benchmark.torch.cuda, "reset_peak_memory_stats", lambda *a: None)
    monkeypatch.setattr(benchmark.torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(benchmark.torch.cuda, "max_memory_allocated", lambda *a: 2**30)
    made = []
    monkeypatch.setattr(benchmark.torch.profiler, "profile", lambda activities: made.append(_FakeKineto(activities))
                        or made[-1])  # fmt: skip
    engine = trainer()
    trace = tmp_path / "traces" / "busy_trace.json"
    graphs = {"captured_at_iteration": 4, "replayed": 4, "eager": 0}
    timer = StepTimer(tmp_path / "gpu.json", "cuda", warmup=WARMUP, steps=STEPS, busy_steps=3, trace=trace,
                      iteration=SimpleNamespace(summary=lambda: graphs))  # fmt: skip
    timer.attach(engine)
    engine.run(slow_batches(), max_epochs=1, epoch_length=1000)
    result = json.loads((tmp_path / "gpu.json").read_text())["result"]
    assert engine.state.iteration == WARMUP + STEPS + 3 and result["timed_steps"] == STEPS
    assert len(made) == 1 and made[0].started == made[0].stopped == 1
    assert result["busy_steps"] == 3 and result["gpu_busy_fraction"] == pytest.approx(0.2, abs=0.05)
    assert result["peak_memory_kind"] == "device, torch allocator" and result["peak_memory_gib"] == 1.0
    assert result["busy_trace"] == str(trace) and json.loads(trace.read_text())["traceEvents"][0]["name"] == "kernel"
    assert result["cuda_graphs"] == graphs, "what the iteration reports of its CUDA graph"
    step_ms = 1000 * (DATA_S + STEP_S)
    assert step_ms <= result["ms_per_step_median"] < step_ms + 40, "a step: from the previous step's end to its end"
    warm_up = [i for step in range(1, WARMUP + 1) for i in (step - 1, step)]  # before and after each warm-up step
    window = [WARMUP, WARMUP + STEPS, WARMUP + STEPS + 3]  # where the timed window starts and ends, the busy end
    assert synced_after == [*warm_up, *window], "no synchronising between timed steps"


def test_sync_steps_times_each_step_alone_as_before_0_11_2(tmp_path, monkeypatch):
    """The old method, kept for a same-GPU comparison: the device synchronised before and after every step."""
    synced_after = []
    monkeypatch.setattr(benchmark.torch.cuda, "synchronize", lambda *a: synced_after.append(engine.state.iteration))
    monkeypatch.setattr(benchmark.torch.cuda, "reset_peak_memory_stats", lambda *a: None)
    monkeypatch.setattr(benchmark.torch.cuda, "max_memory_allocated", lambda *a: 2**30)
    monkeypatch.setattr(benchmark.torch.cuda, "Event", lambda **kw: pytest.fail("no event: each step is timed alone"))
    engine = trainer()
    StepTimer(tmp_path / "gpu.json", "cuda", warmup=WARMUP, steps=STEPS, busy_steps=0, sync_steps="true").attach(engine)
    engine.run(slow_batches(), max_epochs=1, epoch_length=1000)
    result = json.loads((tmp_path / "gpu.json").read_text())["result"]
    alone = [i for step in range(1, WARMUP + STEPS + 1) for i in (step - 1, step)]  # before and after each step
    window = 2 * WARMUP  # where the timed window starts (synchronised once more) and ends (once more)
    assert synced_after == [*alone[:window], WARMUP, *alone[window:], WARMUP + STEPS]
    assert result["timed_steps"] == STEPS and result["ms_per_step_median"] >= 1000 * (DATA_S + STEP_S)


def test_the_report_counts_this_runs_compile_cache_hits_only(tmp_path, monkeypatch):
    """torch's counters count for the whole process (a bench runs many rows in one): the report gives the difference
    over this run; without a trace file or an iteration that reports, those say None."""
    counts = iter([{"fx_graph_hits": 5, "fx_graph_misses": 2}, {"fx_graph_hits": 9, "fx_graph_misses": 2}])
    monkeypatch.setattr(benchmark, "cache_counters", lambda: next(counts))
    timed_run(tmp_path / "b.json")
    result = json.loads((tmp_path / "b.json").read_text())["result"]
    assert result["compile_cache"] == {"fx_graph_hits": 4, "fx_graph_misses": 0}
    assert result["busy_trace"] is None and result["cuda_graphs"] is None

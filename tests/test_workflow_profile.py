"""profile.yaml on a real (CPU) training run: files where documented, sections the summariser agrees on, the GPU
utilisation monitor finding an SMI tool on PATH, and a run that stops after its profiled iterations having written
no weights and no training state."""

from __future__ import annotations

import ast
import csv
import gzip
import json
import os
import statistics

import pytest
from conftest import MECHANICS_NETWORK, bundle_run, configs, demo_args, workflow_run
from scripts.common.cli import bundle_error

PROFILE = configs("train.yaml", "demo.yaml", "profile.yaml")


@pytest.fixture(scope="module")
def profiled(tmp_path_factory, tiny_data):
    demo_tmp = tiny_data
    tmp = tmp_path_factory.mktemp("profiled")
    # the trainer's own count of what it ran, read when the run ends
    state = "{'iteration': @train#trainer.state.iteration, 'epoch': @train#trainer.state.epoch}"
    finalize = f"$open({str(tmp / 'trainer.txt')!r}, 'w').write(str({state}))"
    args = demo_args(tmp, config_file=PROFILE, dataset_dir=demo_tmp / "data", prepared_dir=demo_tmp / "prepared",
                     network_def=MECHANICS_NETWORK, finalize=[finalize])  # fmt: skip
    # a stand-in nvidia-smi on PATH: the run's GPU utilisation monitor (on by default) must find and log it
    tools = tmp / "tools"
    tools.mkdir()
    fake = tools / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho '0, Fake GPU, 37, 1024, 81559'\n")
    fake.chmod(0o755)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PATH", f"{tools}{os.pathsep}{os.environ['PATH']}")
        result = bundle_run(*args, "--profiler_schedule", "[0,1,2,1]")
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp / "run" / "profiler", result


def test_the_run_stops_after_its_profiled_iterations_and_writes_no_weights_nor_training_state(profiled):
    folder, result = profiled
    run = folder.parent
    # wait 0 + warmup 1 + active 2, one cycle: three iterations, all in the first epoch of max_epochs' 1000
    assert ast.literal_eval((run.parent / "trainer.txt").read_text()) == {"iteration": 3, "epoch": 1}
    assert not (run / "model.pt").exists() and not (run / "checkpoints").exists()
    assert not list(run.rglob("*.pt")), "no weights, no checkpoint"
    assert result.stdout.splitlines()[-1] == f"profiled 3 training iterations: {run}/profiler"
    assert "best validation Dice" not in result.stdout and "no validation ran" not in result.stdout


def test_a_schedule_that_never_ends_is_refused_naming_profiler_schedule_before_any_data_is_read(tmp_path):
    from scripts.profiling.profiler import ProfilerHandler, schedule_steps

    assert schedule_steps([2, 2, 4, 1]) == 8 and schedule_steps([1, 0, 2, 3]) == 9
    with pytest.raises(ValueError, match=r"profiler_schedule=\[0, 1, 2, 0\]: repeat 0 .* give repeat >= 1"):
        ProfilerHandler(tmp_path, [0, 1, 2, 0], stop_training=True)
    assert ProfilerHandler(tmp_path, [0, 1, 2, 0]).steps == 0, "without stop_training: profiled until training ends"
    with pytest.raises(ValueError, match="active >= 1"):
        schedule_steps([1, 1, 0, 1])
    # the run: refused at its start, before prepare would read (and fail on) a dataset_dir that does not exist
    args = demo_args(tmp_path, config_file=PROFILE, dataset_dir=tmp_path / "none", prepared_dir=tmp_path / "none")
    with pytest.raises(Exception) as refused:
        workflow_run(*args, "--profiler_schedule", "[0,1,2,0]")
    assert "profiler_schedule=[0, 1, 2, 0]: repeat 0" in str(bundle_error(refused.value))
    assert not (tmp_path / "none").exists() and not (tmp_path / "run").exists()


def test_gpu_utilisation_is_logged_beside_the_run(profiled):
    folder, _ = profiled
    with open(folder.parent / "gpu_utilisation.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows and {(r["gpu"], r["name"], r["util_percent"], r["mem_used_mib"]) for r in rows} == {
        ("0", "Fake GPU", "37.0", "1024.0")
    }
    assert (folder.parent / "gpu_utilisation.png").read_bytes()[:4] == b"\x89PNG"


def test_trace_and_summary_are_written_per_cycle_under_the_run_folder(profiled):
    folder, result = profiled
    # wait 0 + warmup 1 + active 2: the first cycle ends after iteration 3
    assert (folder / "3-chrome_trace.json.gz").is_file()
    summary = (folder / "3-trace_summary.txt").read_text()
    assert "self_cpu_time_total" in summary and "aten::" in summary
    assert not (folder / "memory.pickle").exists()
    assert "no memory.pickle" in result.stdout + result.stderr


def test_sections_in_the_trace_match_an_independent_count(profiled):
    from scripts.profiling.summarize_trace import summarize

    folder, _ = profiled
    trace = folder / "3-chrome_trace.json.gz"
    with gzip.open(trace) as f:
        events = json.load(f)["traceEvents"]
    durations: dict[str, list[float]] = {}
    for event in events:
        if event.get("ph") == "X" and str(event.get("name", "")).startswith("__sec:"):
            durations.setdefault(event["name"].removeprefix("__sec:"), []).append(event["dur"] / 1e6)
    # two active iterations: each has a step, a forward, a backward and an optimizer range
    for name in ("step", "forward", "backward", "optimizer"):
        assert len(durations[name]) == 2, name
    sections = summarize(trace)["sections"]
    for name, values in durations.items():
        stats = sections[name]
        assert stats["count"] == len(values)
        assert stats["min_s"] == pytest.approx(min(values), rel=1e-6)
        assert stats["max_s"] == pytest.approx(max(values), rel=1e-6)
        assert stats["mean_s"] == pytest.approx(statistics.mean(values), rel=1e-6)
        assert stats["median_s"] == pytest.approx(statistics.median(values), rel=1e-6)

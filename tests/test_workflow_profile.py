"""profile.yaml on a real (CPU) training run: files where documented, sections the summariser agrees on, and the
GPU utilisation monitor finding an SMI tool on PATH."""

from __future__ import annotations

import csv
import gzip
import json
import os
import statistics

import pytest
from conftest import MECHANICS_NETWORK, bundle_run, configs, demo_args

PROFILE = configs("train.yaml", "demo.yaml", "profile.yaml")


@pytest.fixture(scope="module")
def profiled(tmp_path_factory, tiny_data):
    demo_tmp = tiny_data
    tmp = tmp_path_factory.mktemp("profiled")
    args = demo_args(tmp, config_file=PROFILE, max_epochs=1, dataset_dir=demo_tmp / "data",
                     prepared_dir=demo_tmp / "prepared", network_def=MECHANICS_NETWORK)  # fmt: skip
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
    from scripts.summarize_trace import summarize

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

"""The GPU proof kit (benchmarks/gpu_proof.py): its dry run on the CPU runs every step that needs no CUDA and skips
the CUDA-only ones, and says so; its own reckoning (peaks, the trace check, which steps run) on its own; and where a
GPU is, the CUDA paths with the dry run's tiny network (marked gpu)."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from benchmarks.gpu_proof import (
    COMPILE_SET,
    DEFAULTS_SET,
    DRY,
    HOST_CACHE_SET,
    SEED_SET,
    STEPS,
    THROUGHPUT_SETS,
    compare_with_key_averages,
    fastest_row_classes,
    format_markdown,
    helper_network,
    peak_bf16_tflops,
    select,
    targets,
)
from conftest import ROOT

KIT = [sys.executable, "-m", "benchmarks.gpu_proof"]
CUDA_ONLY = {s.name for s in STEPS if s.gpu_only}
#: the CUDA paths the gpu tests run with the tiny network (the compiling ones take minutes: the kit itself runs them)
GPU_PATHS = ("grad_scaler", "fused_adamw", "gpu_monitor", "resume", "summariser", "evaluate_oom", "inference_oom",
             "torchrun", "throughput")  # fmt: skip


def run_kit(out: Path, *options: str) -> tuple[dict, str]:
    """The kit as a user runs it, from the bundle's root; its report and what it printed."""
    done = subprocess.run([*KIT, "--output_dir", str(out), *options], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "gpu_proof.json").read_text()), done.stdout


def by_name(report: dict) -> dict[str, dict]:
    return {step["name"]: step for step in report["steps"]}


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[dict, str, Path]:
    out = tmp_path_factory.mktemp("gpu_proof")
    report, stdout = run_kit(out, "--dry_run", "true")
    return report, stdout, out


def test_dry_run_reports_every_step_and_none_fails(dry_run):
    report, stdout, out = dry_run
    steps = by_name(report)
    assert list(steps) == [s.name for s in STEPS]
    assert not {name: s["error"] for name, s in steps.items() if s["status"] == "failed"}
    # a running total after every step, and the report's header: the machine and the versions
    assert stdout.count("| total ") == len(STEPS)
    env = report["environment"]
    assert env["torch"] and env["monai"] and env["usable_cpus"] >= 1 and env["device_name"]
    markdown = (out / "gpu_proof.md").read_text()
    assert markdown.startswith("# GPU proof kit (DRY RUN on the CPU") and "no number here is a GPU number" in markdown
    assert all(f"| {s.name} |" in markdown for s in STEPS)


def test_cuda_only_steps_say_no_gpu_and_the_others_ran(dry_run):
    steps = by_name(dry_run[0])
    assert {"grad_scaler", "fused_adamw", "gpu_monitor"} == CUDA_ONLY
    for name, step in steps.items():
        expected = ("skipped", "no GPU") if name in CUDA_ONLY else ("ok", None)
        assert (step["status"], step.get("reason")) == expected, name


def test_summariser_agrees_with_key_averages_of_the_same_run(dry_run):
    numbers = by_name(dry_run[0])["summariser"]["numbers"]
    assert {"step", "forward", "backward", "optimizer"} <= set(numbers["sections"])
    checks = {c["what"]: c for c in numbers["checks"]}
    assert all(c["ok"] for c in checks.values()), checks
    assert checks["forward: instances"]["summariser"] == checks["forward: instances"]["key_averages"] == 1
    assert checks["kernels"]["summariser"] == checks["kernels"]["key_averages"] == 0  # a CPU trace has none
    assert numbers["mb_per_s"] > 0 and numbers["trace_mb_uncompressed"] > 0


def test_the_cpu_run_says_plainly_that_its_traces_hold_no_device_time(dry_run):
    """The kernel-class tables of a dry run: the profiled defaults run's trace has no kernel (a CPU), and no
    throughput row profiled busy steps (a GPU's), so the fastest row has no trace; both say so."""
    report, stdout, out = dry_run
    numbers = by_name(report)["summariser"]["numbers"]
    assert numbers["device"]["events"] == 0 and numbers["idle"] is None
    rows = by_name(report)["throughput"]["numbers"]["rows"]
    assert all(r.get("trace") is None for r in rows if r["status"] == "ok")
    found = report["kernel_classes"]
    assert found["defaults"]["device"]["events"] == 0
    assert found["fastest"]["reason"].startswith("no trace: its busy steps were not profiled")
    markdown = (out / "gpu_proof.md").read_text()
    assert "device time by kernel class: none: no kernel, copy or memset in this trace (a CPU-only run)" in markdown
    assert f"Fastest throughput row, {found['fastest']['loop']}: no trace: its busy steps" in markdown
    assert "Where the GPU's time goes" in stdout


def test_the_kernel_class_tables_of_a_gpu_run_in_the_report(dry_run, tmp_path):
    """On a GPU both tables come from traces with kernels (here the H200 runs' in tests/data/h200/: the first run's
    profile for the defaults, the tiny kit run's busy steps for the fastest row); the fastest row is the one with the
    most patches a second, whose trace the report reads, with the row's own GPU-busy share beside the table."""
    from scripts.summarize_trace import summarize

    profile = str(ROOT / "tests" / "data" / "h200" / "4-chrome_trace.json.gz")
    trace = str(ROOT / "tests" / "data" / "h200" / "busy_steps_trace.json.gz")
    rows = [{"loop": DEFAULTS_SET, "status": "ok", "patches_per_s": 23.6, "gpu_busy_percent": 81.0, "trace": None},
            {"loop": COMPILE_SET, "status": "ok", "patches_per_s": 32.0, "gpu_busy_percent": 88.0, "trace": trace},
            {"loop": SEED_SET, "status": "failed", "reason": "out of memory"}]  # fmt: skip
    fastest = fastest_row_classes(rows)
    assert (fastest["loop"], fastest["trace"], fastest["device"]["events"]) == (COMPILE_SET, trace, 2823)
    assert fastest_row_classes(rows[:1])["reason"] == "no trace saved"  # busy steps ran, their trace was not kept
    assert fastest_row_classes(rows[2:]) == {"reason": "no throughput row ran"}
    report = json.loads(json.dumps(dry_run[0]))
    defaults = {"trace": profile, **{k: v for k, v in summarize(profile).items() if k in ("device", "idle")}}
    report["kernel_classes"] = {"defaults": defaults, "fastest": fastest}
    markdown = format_markdown(report)
    assert f"Profiled defaults run (profile step), `{profile}`:" in markdown
    assert "device time by kernel class (5132 kernels, copies and memsets, 306.952 ms):" in markdown
    assert "device idle 51.0 % of the profiled steps (2 ProfilerStep ranges, 626.015 ms)" in markdown
    assert f"Fastest throughput row, {COMPILE_SET} (the benchmark's GPU busy 88.0 %), `{trace}`:" in markdown
    assert "device time by kernel class (2823 kernels, copies and memsets, 8.002 ms):" in markdown
    assert "from the first device start to the last device end (129.199 ms; the trace has no ProfilerStep" in markdown


def test_the_bench_keeps_the_busy_steps_trace_of_a_row_faster_than_the_rows_before(tmp_path):
    """bench_switches writes the chrome trace of a row's profiled busy steps (StepTimer's profile, here a CPU one)
    when the row is faster than every earlier row, and nothing where the timer profiled none."""
    import torch
    from benchmarks.bench_switches import BUSY_TRACE, _fastest_so_far, _save_busy_trace
    from scripts.benchmark import StepTimer

    timer = StepTimer(tmp_path / "benchmark.json", "cpu")
    parser = SimpleNamespace(get_parsed_content=lambda id: [object(), timer])
    assert _save_busy_trace(parser, tmp_path / BUSY_TRACE) is None  # no busy steps were profiled
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        torch.ones(4).add_(1)
    timer._profiler, timer.busy = profiler, 0.5
    assert _save_busy_trace(parser, tmp_path / BUSY_TRACE) == str(tmp_path / BUSY_TRACE)
    with gzip.open(tmp_path / BUSY_TRACE) as f:
        assert any(e.get("name") == "aten::add_" for e in json.load(f)["traceEvents"])
    report = {"result": {"patches_per_s": 2.0}}
    records = [{"report": {"result": {"patches_per_s": 1.0}}}, {"status": "failed"}, {"report": report}]
    assert _fastest_so_far(records, records[-1])
    assert not _fastest_so_far([{"report": {"result": {"patches_per_s": 3.0}}}, records[-1]], records[-1])


def test_resume_continues_from_the_saved_epoch(dry_run):
    steps = by_name(dry_run[0])
    assert steps["train"]["numbers"]["checkpoint"]["epoch"] == 1
    assert steps["resume"]["numbers"] == {"resumed_from_epoch": 1, "epoch_after": 2, "iteration_after": 2}


def test_evaluation_and_inference_fall_back_once_and_inference_writes_nifti_and_seg(dry_run):
    import pydicom

    steps = by_name(dry_run[0])
    assert steps["evaluate_oom"]["numbers"]["fallbacks"] == 1 and steps["evaluate_oom"]["numbers"]["failed"] == 0
    inference = steps["inference_oom"]["numbers"]
    assert inference["fallbacks"] == 1
    assert inference["nifti"].endswith("_seg.nii.gz") and Path(inference["nifti"]).stat().st_size > 0
    assert pydicom.dcmread(inference["seg"], stop_before_pixels=True).Modality == "SEG"


def test_throughput_rows_run_in_one_child_and_claim_no_gpu_number(dry_run):
    report, _, out = dry_run
    rows = {r["loop"]: r for r in by_name(report)["throughput"]["numbers"]["rows"]}
    assert list(rows) == list(THROUGHPUT_SETS), "every row recorded, in order"
    ran = list(report["throughput"])
    assert [r["loop"] for r in ran] == [DEFAULTS_SET, HOST_CACHE_SET, SEED_SET], "the rows a CPU can run"
    skipped = [rows[name] for name in THROUGHPUT_SETS if name not in (DEFAULTS_SET, HOST_CACHE_SET, SEED_SET)]
    assert all(row["status"] == "skipped" and row["reason"] == "no GPU" for row in skipped)
    assert [r["cache"] for r in ran] == ["memory", "memory", "none"], "cache auto stays in host memory on a CPU"
    for row in ran:
        assert row["ms_per_step"] > 0 and row["timed_steps"] >= 1 and row["gpu_busy_percent"] is None
        assert row["mfu"] is None and "no GPU" in row["mfu_reason"]
    assert ran[2]["vs_seed"] == 1.0
    assert "- amp bfloat16: skipped: no GPU" in (out / "gpu_proof.md").read_text(), "the rows that did not run say so"
    log = (out / "logs" / "throughput.log").read_text()
    # each build starts one progress bar at 0 % (tqdm may print its end twice when a refresh meets the close)
    assert log.count("Loading dataset:   0%") == 1, "the host cache is built once and shared by the next row"
    cases = report["fullct_inference"]
    assert [c["warm"] for c in cases] == [False, True] and all(c["windows"] >= 1 and "predict" in c for c in cases)
    assert all(verdict.startswith("unmeasured") for verdict in report["targets"].values())


def test_the_network_step_reads_train_yamls_own_patch_count(tmp_path):
    """The dry run overrides num_samples; the GPU run does not, and train.yaml's is a reference
    (``@displayable_configs#num_samples``): read raw, it ended the H200 run's network step. Without the override the
    step counts train.yaml's 4 patches (here on the dry run's small network)."""
    settings = {k: v for k, v in DRY.settings.items() if k != "num_samples"} | {"model_path": str(tmp_path / "m.pt")}
    helper_network(str(tmp_path / "network.json"), settings)
    numbers = json.loads((tmp_path / "network.json").read_text())
    assert numbers["patches_per_step"] == 4 and (tmp_path / "m.pt").is_file()


def test_targets_read_the_right_rows():
    rows = [{"loop": SEED_SET, "status": "ok", "patches_per_s": 1.3, "mfu": 0.008, "gpu_busy_percent": 40.0,
             "data_wait_percent": 92.0, "first_step_s": 3.0},
            {"loop": DEFAULTS_SET, "status": "ok", "patches_per_s": 30.0, "mfu": 0.07, "gpu_busy_percent": 95.0,
             "data_wait_percent": 2.0, "first_step_s": 9.0},
            {"loop": COMPILE_SET, "status": "ok", "patches_per_s": 50.0, "mfu": 0.12, "gpu_busy_percent": 88.0,
             "data_wait_percent": 3.0, "first_step_s": 140.0}]  # fmt: skip
    cases = [{"predict": 0.4}, {"predict": 0.2, "warm": True}]
    records = {"throughput": {"status": "ok", "numbers": {"rows": rows}},
               "fullct_inference": {"status": "ok", "numbers": {"cases": cases}}}  # fmt: skip
    verdict = targets(SimpleNamespace(mode="full", gpu=True, records=records))
    assert verdict["patches_per_s"] == f"met: 50 ({COMPILE_SET}; target >= 45)"
    assert verdict["mfu_percent"].startswith("met: 12 (") and verdict["gpu_busy_percent"].startswith("not met: 88 (")
    assert verdict["data_wait_percent"] == f"met: 2 ({DEFAULTS_SET}; target <= 5)", "the defaults' row"
    assert verdict["compile_s"] == f"not met: 140 ({COMPILE_SET}; target <= 90)"
    assert verdict["network_s"] == "met: 0.2 (warm full-CT case; target <= 0.25)"
    assert targets(SimpleNamespace(mode="full", gpu=True, records={}))["compile_s"].startswith("unmeasured")


def test_peaks_come_from_the_device_name_and_an_unknown_device_gets_no_mfu():
    assert peak_bf16_tflops("NVIDIA H100 80GB HBM3", True)[0] == 989.4
    assert peak_bf16_tflops("NVIDIA H100 PCIe", True)[0] == 756.0
    assert peak_bf16_tflops("NVIDIA H200", True)[0] == 989.4
    assert peak_bf16_tflops("NVIDIA A100-SXM4-80GB", True)[0] == 312.0
    assert peak_bf16_tflops("AMD Instinct MI300X", True)[0] == 1307.4
    peak, reason = peak_bf16_tflops("NVIDIA H100 NVL", True)
    assert peak is None and "add it to PEAK_BF16_TFLOPS" in reason
    assert peak_bf16_tflops("x86_64", False)[0] is None


def test_trace_check_fails_where_the_summariser_and_key_averages_differ():
    summary = {"sections": {"step": {"count": 2, "mean_s": 0.5}, "forward": {"count": 2, "mean_s": 0.1}},
               "sources": {"step": "cpu", "forward": "kernels"}, "kernels": 10}  # fmt: skip
    rows = [{"name": "__sec:step", "count": 2, "device_type": "CPU", "cpu_time_total_us": 1.0e6,
             "device_time_total_us": 0.0},
            {"name": "__sec:forward", "count": 2, "device_type": "CPU", "cpu_time_total_us": 0.05e6,
             "device_time_total_us": 0.25e6},
            {"name": "void kernel", "count": 9, "device_type": "CUDA", "cpu_time_total_us": 0.0,
             "device_time_total_us": 0.15e6},
            {"name": "Memcpy HtoD (Pageable -> Device)", "count": 4, "device_type": "CUDA", "cpu_time_total_us": 0.0,
             "device_time_total_us": 0.01e6}]  # fmt: skip
    checks = {c["what"]: c["ok"] for c in compare_with_key_averages(summary, rows)}
    assert checks["step: instances"] and checks["step: CPU seconds"] and checks["forward: instances"]
    assert not checks["forward: kernel span s >= kernel s in the range"], "0.25 s of kernels cannot fit in 0.2 s"
    assert not checks["kernels"], "10 kernels against 9 (the copies are not kernels)"


def test_the_trace_check_passes_on_the_first_h200_profile():
    """The first GPU run's profile (tests/data/h200/: its chrome trace and key_averages(), as the kit wrote them on one
    H200): CUDA gives two rows per range, and the check reads the CPU row's CPU time (the summariser's 0.494 s for two
    steps) and the device row's kernel time, so every check holds where the kit reported a false disagreement."""
    from scripts.summarize_trace import summarize

    data = ROOT / "tests" / "data" / "h200"
    summary = summarize(data / "4-chrome_trace.json.gz")
    rows = json.loads((data / "4-key_averages.json").read_text())
    checks = compare_with_key_averages(summary, rows)
    assert [c for c in checks if not c["ok"]] == []
    by_what = {c["what"]: c for c in checks}
    assert by_what["step: CPU seconds"]["key_averages"] == pytest.approx(0.494288, abs=1e-6)
    assert by_what["forward: kernel span s >= kernel s in the range"]["key_averages"] == pytest.approx(0.2394, abs=1e-4)
    assert by_what["kernels"]["summariser"] == 4526


def test_only_runs_the_named_steps_and_the_steps_they_need():
    assert [s.name for s in select(STEPS, "resume")] == ["environment", "data", "train", "resume"]
    assert [s.name for s in select(STEPS, "summariser,torchrun")] == [
        "environment", "data", "profile", "summariser", "torchrun"]  # fmt: skip
    with pytest.raises(SystemExit, match="unknown step"):
        select(STEPS, "trian")


@pytest.fixture(scope="module")
def tiny_on_gpu(tmp_path_factory) -> dict:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA/ROCm device: the kit's GPU paths are proven where one is")
    report, _ = run_kit(tmp_path_factory.mktemp("gpu_proof_tiny"), "--tiny", "true", "--only", ",".join(GPU_PATHS))
    return by_name(report)


@pytest.mark.gpu
@pytest.mark.parametrize("step", ["train", "profile", *GPU_PATHS])
def test_gpu_path_runs_on_the_device(tiny_on_gpu, step):
    assert tiny_on_gpu[step]["status"] == "ok", tiny_on_gpu[step]


@pytest.mark.gpu
def test_gpu_trace_holds_kernels_and_the_fp16_run_scaled_its_loss(tiny_on_gpu):
    assert tiny_on_gpu["summariser"]["numbers"]["kernels"] > 0
    assert tiny_on_gpu["grad_scaler"]["numbers"]["scale"] > 0
    assert tiny_on_gpu["torchrun"]["numbers"]["backend"] == "nccl"

"""The GPU proof kit (benchmarks/gpu_proof.py): its dry run on the CPU runs every step that needs no CUDA and skips
the CUDA-only ones, and says so; its own reckoning (peaks, the trace check, which steps run) on its own; and where a
GPU is, the CUDA paths with the dry run's tiny network (marked gpu)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from benchmarks.gpu_proof import (
    COMPILE_GRAPHS_SET,
    COMPILE_SET,
    COMPILE_SETS,
    DEFAULTS_SET,
    DRY,
    EARLIER_SETS,
    FULLCT_RUNS,
    GPU,
    GRAPHS_SET,
    HOST_CACHE_SET,
    LAST_SETS,
    OLD_STEP_SET,
    SEED_SET,
    STEPS,
    THROUGHPUT_SETS,
    StepFailed,
    _flags,
    _later_s,
    compare_with_key_averages,
    fastest_row_classes,
    format_markdown,
    fullct_rows,
    helper_cuda_graphs,
    helper_network,
    kernel_classes,
    peak_bf16_tflops,
    row_classes,
    select,
    step_cuda_graphs,
    step_fullct,
    targets,
)
from conftest import ROOT

KIT = [sys.executable, "-m", "benchmarks.gpu_proof"]
CUDA_ONLY = {s.name for s in STEPS if s.gpu_only}
#: the CUDA paths the gpu tests run with the tiny network (the compiling ones take minutes: the kit itself runs them)
GPU_PATHS = ("grad_scaler", "fused_adamw", "gpu_monitor", "resume", "summariser", "evaluate_oom", "inference_oom",
             "torchrun", "throughput", "cuda_graphs")  # fmt: skip


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
    version = json.loads((ROOT / "configs" / "metadata.json").read_text())["version"]
    assert env["bundle_version"] == version, "the run's files say which version gave their numbers"
    markdown = (out / "gpu_proof.md").read_text()
    assert markdown.startswith("# GPU proof kit (DRY RUN on the CPU") and "no number here is a GPU number" in markdown
    assert all(f"| {s.name} |" in markdown for s in STEPS)


def test_cuda_only_steps_say_no_gpu_and_the_others_ran(dry_run):
    steps = by_name(dry_run[0])
    assert {"grad_scaler", "fused_adamw", "gpu_monitor", "cuda_graphs", "compile_cache"} == CUDA_ONLY
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
    from scripts.profiling.summarize_trace import summarize

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
    """Every row's StepTimer writes the trace of its busy steps where benchmark.yaml's benchmark_trace says (a GPU
    profiles them); bench_switches keeps it for a row faster than every earlier row and deletes the others'."""
    from benchmarks.bench_switches import _fastest_so_far, _keep_trace

    def row(speed: float, name: str) -> dict:
        trace = tmp_path / name
        trace.write_text("{}")
        return {"report": {"result": {"patches_per_s": speed, "busy_trace": str(trace)}}}

    records = [row(1.0, "a"), {"status": "failed"}, row(2.0, "b")]
    for record in (records[0], records[2]):
        _keep_trace(records[: records.index(record) + 1], record)
    assert [r.get("trace") for r in records] == [str(tmp_path / "a"), None, str(tmp_path / "b")]
    slower = row(1.5, "c")
    _keep_trace([*records, slower], slower)
    assert "trace" not in slower and not (tmp_path / "c").exists() and slower["report"]["result"]["busy_trace"] is None
    no_trace = {"report": {"result": {"patches_per_s": 9.0, "busy_trace": None}}}
    _keep_trace([no_trace], no_trace)
    assert "trace" not in no_trace, "a CPU profiles no busy steps"
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


def test_throughput_rows_run_in_their_steps_children_and_claim_no_gpu_number(dry_run):
    """The baseline and the new rows first (one child), the compile rows (a GPU's: skipped), the earlier runs' rows
    last (one child); on a CPU the rows a CPU can run ran, and the others say why not."""
    report, _, out = dry_run
    steps = by_name(report)
    rows = {r["loop"]: r for r in steps["throughput"]["numbers"]["rows"]}
    assert list(rows) == list(THROUGHPUT_SETS), "every row recorded, in order"
    earlier = {r["loop"]: r for r in steps["throughput_earlier"]["numbers"]["rows"]}
    assert list(earlier) == list(LAST_SETS)
    assert steps["compile_cache"]["reason"] == "no GPU"
    ran = list(report["throughput"])
    on_a_cpu = [DEFAULTS_SET, OLD_STEP_SET, HOST_CACHE_SET, SEED_SET]
    assert [r["loop"] for r in ran] == on_a_cpu, "the rows a CPU can run"
    skipped = [row for name, row in {**rows, **earlier}.items() if name not in on_a_cpu]
    assert all(row["status"] == "skipped" and row["reason"] == "no GPU" for row in skipped)
    assert [r["cache"] for r in ran] == ["memory", "memory", "memory", "none"], "cache auto stays in host memory"
    for row in ran:
        assert row["ms_per_step"] > 0 and row["timed_steps"] >= 1 and row["gpu_busy_percent"] is None
        assert row["mfu"] is None and "no GPU" in row["mfu_reason"]
    assert ran[3]["vs_seed"] == 1.0 and ran[0]["vs_defaults"] == 1.0
    markdown = (out / "gpu_proof.md").read_text()
    assert "- amp bfloat16: skipped: no GPU" in markdown and f"- {GRAPHS_SET}: skipped: no GPU" in markdown
    assert (
        ran[0]["compile_cache"]
        == dict.fromkeys(["fx_graph_hits", "fx_graph_misses", "aot_autograd_hits", "aot_autograd_misses"], 0)
        and ran[0]["cuda_graphs"] is None
    )
    # each build starts one progress bar at 0 % (tqdm may print its end twice when a refresh meets the close)
    log = (out / "logs" / "throughput_earlier.log").read_text()
    assert log.count("Loading dataset:   0%") == 1, "the host cache is built once and shared by the next row"
    cases = report["fullct_inference"]
    assert [c["warm"] for c in cases] == [False, True] and all(c["windows"] >= 1 and "predict" in c for c in cases)
    assert all(0.0 <= c["labelled_share"] <= 1.0 for c in cases), "the label map's share is read from its NIfTI"
    assert f"| {cases[1]['windows']} | {100 * cases[1]['labelled_share']:.2f} % |" in markdown
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
    """The fastest row for speed, MFU and GPU busy; the full training's defaults (compile auto on: the fp16 compile
    row) for the defaults' speed; the compile rows' first steps, the second only where it came from the cache; the
    warm full CT, end to end and its network."""
    rows = [{"loop": SEED_SET, "status": "ok", "patches_per_s": 1.3, "mfu": 0.008, "gpu_busy_percent": 40.0,
             "data_wait_percent": 92.0, "first_step_s": 3.0},
            {"loop": DEFAULTS_SET, "status": "ok", "patches_per_s": 30.0, "mfu": 0.07, "gpu_busy_percent": 95.0,
             "data_wait_percent": 2.0, "first_step_s": 9.0}]  # fmt: skip
    compiled = [{"loop": COMPILE_SET, "status": "ok", "patches_per_s": 36.0, "mfu": 0.09, "gpu_busy_percent": 85.0,
                 "data_wait_percent": 3.0, "first_step_s": 140.0, "compile_cache": {"fx_graph_hits": 0}},
                {"loop": COMPILE_GRAPHS_SET, "status": "ok", "patches_per_s": 50.0, "mfu": 0.12,
                 "gpu_busy_percent": 96.0, "data_wait_percent": 3.0, "first_step_s": 19.5,
                 "compile_cache": {"fx_graph_hits": 44}}]  # fmt: skip
    cases = [{"run": "defaults", "predict": 0.4, "seconds": 4.0, "end_to_end_s": 7.3},
             {"run": "defaults", "predict": 0.2, "seconds": 1.2, "end_to_end_s": 1.6, "warm": True}]  # fmt: skip
    records = {"throughput": {"status": "ok", "numbers": {"rows": rows}},
               "compile_cache": {"status": "ok", "numbers": {"rows": compiled}},
               "fullct_inference": {"status": "ok", "numbers": {"cases": cases}}}  # fmt: skip
    verdict = targets(SimpleNamespace(mode="full", gpu=True, records=records))
    assert verdict["patches_per_s"] == f"met: 50 ({COMPILE_GRAPHS_SET}; target >= 45)"
    assert verdict["defaults_patches_per_s"] == f"met: 36 ({COMPILE_SET}; target >= 35)"
    assert verdict["mfu_percent"].startswith("met: 12 (") and verdict["gpu_busy_percent"].startswith("met: 96 (")
    assert verdict["data_wait_percent"] == f"met: 2 ({DEFAULTS_SET}; target <= 5)", "the defaults' row"
    assert verdict["compile_s"] == f"not met: 140 ({COMPILE_SET}; target <= 90)"
    assert verdict["compile_cached_s"] == f"met: 19.5 ({COMPILE_GRAPHS_SET}, from the cache; target <= 20)"
    assert verdict["fullct_s"] == "not met: 1.6 (warm full-CT case, end to end; target <= 1.5)"
    assert verdict["network_s"] == "met: 0.2 (warm full-CT case; target <= 0.25)"
    compiled[1]["compile_cache"] = {"fx_graph_hits": 0}  # the first compile failed: the second compiled cold
    verdict = targets(SimpleNamespace(mode="full", gpu=True, records=records))
    assert verdict["compile_cached_s"].startswith("unmeasured")
    assert targets(SimpleNamespace(mode="full", gpu=True, records={}))["compile_s"].startswith("unmeasured")


def test_the_kernel_classes_read_the_defaults_row_and_the_fastest_row_of_every_step():
    """Without the profile step the defaults' classes come from the defaults row's busy steps; the fastest row is the
    fastest of every row step's (here the compile step's, from the H200's busy-steps trace)."""
    trace = str(ROOT / "tests" / "data" / "h200" / "busy_steps_trace.json.gz")
    defaults = {"loop": DEFAULTS_SET, "status": "ok", "patches_per_s": 23.6, "gpu_busy_percent": 83.0, "trace": trace}
    fast = {**defaults, "loop": COMPILE_GRAPHS_SET, "patches_per_s": 50.0}
    slow = {"rows": [defaults], "fastest": row_classes(defaults), "defaults": row_classes(defaults)}
    quick = {"rows": [fast], "fastest": row_classes(fast)}
    records = {"throughput": {"status": "ok", "numbers": slow}, "compile_cache": {"status": "ok", "numbers": quick}}
    found = kernel_classes(records)
    assert found["defaults"]["loop"] == DEFAULTS_SET and found["defaults"]["device"]["events"] == 2823
    assert found["fastest"]["loop"] == COMPILE_GRAPHS_SET and "patches_per_s" not in found["fastest"]
    assert kernel_classes({})["fastest"] == {"reason": "the throughput step did not run"}
    assert kernel_classes({})["defaults"] == {"reason": "the summariser step did not run"}


def test_every_full_ct_run_sets_inference_ids_to_values_of_their_types():
    """The full-CT runs run on a GPU only (beyond the defaults), so their overrides are checked on inference.yaml
    itself, as ``monai.bundle run`` reads them from the kit's command line: each id exists and parses to the type of
    its default (a switch: a string the bundle reads as a bool), and the runs write to folders of their own."""
    from benchmarks.bench_switches import _as_literal
    from monai.bundle import ConfigParser

    configs = [str(ROOT / "configs" / "inference.yaml")]
    defaults = ConfigParser()
    defaults.read_config(configs)
    assert len({suffix for suffix, _ in FULLCT_RUNS.values()}) == len(FULLCT_RUNS)
    for run, (_, settings) in FULLCT_RUNS.items():
        flags = _flags(settings)
        given = {key[2:]: _as_literal(value) for key, value in zip(flags[::2], flags[1::2])}
        parser = ConfigParser()
        parser.read_config(configs)
        parser.update(given)
        for key in settings:
            default, value = defaults.get_parsed_content(key), parser.get_parsed_content(key)
            if isinstance(default, bool):
                assert value in (True, False, "true", "false"), (run, key, value)
            else:
                assert type(value) is type(default), (run, key, value, default)


def test_a_full_ct_run_that_fails_keeps_the_other_runs_rows_and_says_which_failed(monkeypatch):
    """A run of FULLCT_RUNS never measured before (fused attention, 8 windows) may fail on a GPU: the runs after it
    still run, the step fails naming it with its log's tail, and the rows of the others reach the table and the
    targets."""
    import benchmarks.gpu_proof as kit_module

    def run(kit, name, suffix, overrides):
        if name == "fused attention":
            raise StepFailed("monai.bundle run inference.yaml: exit status 1", "RuntimeError: no kernel")
        return [{"run": name, "case": f"FULLCT-{i + 1}", "predict": 0.4, "end_to_end_s": 2.0, "warm": i > 0}
                for i in range(2)]  # fmt: skip

    monkeypatch.setattr(kit_module, "_fullct_run", run)
    with pytest.raises(StepFailed) as failed:
        step_fullct(SimpleNamespace(gpu=True))
    assert str(failed.value) == "fused attention: monai.bundle run inference.yaml: exit status 1"
    assert failed.value.tail == "--- fused attention\nRuntimeError: no kernel"
    numbers = failed.value.numbers
    assert [r["run"] for r in numbers["cases"][::2]] == [r for r in FULLCT_RUNS if r != "fused attention"]
    assert numbers["warm_network_s"] == 0.4 and list(numbers["failed"]) == ["fused attention"]
    rows = fullct_rows({"fullct_inference": {"status": "failed", "numbers": numbers}})
    assert len(rows) == 2 * (len(FULLCT_RUNS) - 1)


def test_a_short_budget_drops_the_earlier_rows_never_the_new_ones():
    """The rows earlier runs measured run last, in a step that reserves nothing (the budget left is theirs), while the
    new rows' steps reserve the time of the steps after them; in the GPU command's selection (the report's) the
    estimates of the new steps fit its budget of 450 s, the throughput step's new rows before its deadline."""
    assert STEPS[-1].name == "throughput_earlier" and set(EARLIER_SETS).isdisjoint({*THROUGHPUT_SETS, *COMPILE_SETS})
    assert {HOST_CACHE_SET, SEED_SET, "amp bfloat16"} <= set(EARLIER_SETS)
    steps = select(STEPS, "throughput,cuda_graphs,compile_cache,fullct_inference,throughput_earlier")
    assert [s.name for s in steps] == ["environment", "data", "network", "cuda_graphs", "throughput", "compile_cache",
                                       "fullct_inference", "throughput_earlier"]  # fmt: skip
    kit = SimpleNamespace(steps=steps, sizes=GPU, gpu=True)
    estimate = GPU.estimates_s
    later = estimate["compile_cache"] + estimate["fullct_inference"]
    assert _later_s(kit, "throughput") == later, "the earlier rows reserve nothing"
    assert _later_s(kit, "compile_cache") == estimate["fullct_inference"] and _later_s(kit, "throughput_earlier") == 0
    before = sum(estimate[name] for name in ("environment", "data", "network", "cuda_graphs"))
    new_rows = sum(estimate[name] for name in THROUGHPUT_SETS)
    assert new_rows <= 450 - later - before, "every new row starts before the throughput step's deadline"
    assert sum(estimate[name] for name in COMPILE_SETS) <= estimate["compile_cache"]
    assert before + new_rows + later <= 450 - 30, "with half a minute to spare for the earlier rows"


def test_the_cuda_graph_check_trains_monais_way_and_the_graphed_way_and_fails_without_a_capture(tmp_path):
    """The check's helper on a CPU (the dry run's network, 3 steps): MONAI's own iteration and scripts.training.graphs'
    train the same weights, bitwise (on a CPU every step is eager); the step, given those numbers, fails because nothing
    was captured, and passes a graphed run that captured and replayed with the losses and weights alike."""
    out = tmp_path / "cuda_graphs.json"
    helper_cuda_graphs(str(out), {k: v for k, v in DRY.settings.items() if k != "device"}, steps=3, device="cpu")
    numbers = json.loads(out.read_text())
    assert numbers["bitwise_equal"] and numbers["max_loss_difference"] == 0 and numbers["weight_change"] > 0
    assert numbers["graphed"]["summary"]["eager"] == 3 and len(numbers["eager"]["losses"]) == 3
    kit = SimpleNamespace(sizes=DRY, helper=lambda *a, **k: numbers)
    with pytest.raises(StepFailed, match="the graphed run did not capture once and replay"):
        step_cuda_graphs(kit)
    numbers["graphed"]["summary"] = {"captures": 1, "replayed": 4, "eager": 0, "disabled": None}
    assert step_cuda_graphs(kit) is numbers
    numbers["weight_difference"] = 0.02 * numbers["weight_change"]
    with pytest.raises(StepFailed, match=r"the weights differ by .* \(L2\) against a change of"):
        step_cuda_graphs(kit)


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
    from scripts.profiling.summarize_trace import summarize

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

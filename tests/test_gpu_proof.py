"""The GPU proof kit (benchmarks/gpu_proof.py): its dry run on the CPU runs every step that needs no CUDA, skips the
CUDA-only ones and reports each gpu test of tests/test_gpu.py skipped by pytest, and says so; its own reckoning
(peaks, targets, which steps and tests run, pytest's results read back) on its own."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import zygote
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
    METATENSOR_SET,
    SEED_SET,
    STEPS,
    THROUGHPUT_SETS,
    Child,
    Kit,
    StepFailed,
    _flags,
    _later_s,
    fastest_row_classes,
    format_markdown,
    fullct_rows,
    gpu_tests,
    helper_network,
    junit_records,
    kernel_classes,
    peak_bf16_tflops,
    row_classes,
    select,
    step_fullct,
    step_gpu_tests,
    targets,
)
from conftest import ROOT

KIT = ["-m", "benchmarks.gpu_proof"]
CUDA_ONLY = {s.name for s in STEPS if s.gpu_only}


def run_kit(out: Path, *options: str) -> tuple[dict, str]:
    """The kit as a user runs it, from the bundle's root (a process of its own forked from the tests' zygote, which
    has imported torch and MONAI as the kit's own preload would); its report and what it printed."""
    done = zygote.run_python([*KIT, "--output_dir", str(out), *options], ROOT, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "gpu_proof.json").read_text()), done.stdout


def by_name(report: dict) -> dict[str, dict]:
    return {step["name"]: step for step in report["steps"]}


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[dict, str, Path]:
    out = tmp_path_factory.mktemp("gpu_proof")
    report, stdout = run_kit(out, "--dry_run", "true")
    return report, stdout, out


def test_dry_run_reports_every_step_and_each_gpu_test_and_none_fails(dry_run):
    report, stdout, out = dry_run
    steps = by_name(report)
    names = [s.name for s in STEPS]
    at = names.index("gpu_tests") + 1
    assert list(steps) == [*names[:at], *gpu_tests(), *names[at:]], "each gpu test a step of its own, after theirs"
    assert not {name: s["error"] for name, s in steps.items() if s["status"] == "failed"}
    # a running total after every step, and the report's header: the machine and the versions
    assert stdout.count("| total ") == len(STEPS)
    env = report["environment"]
    assert env["torch"] and env["monai"] and env["usable_cpus"] >= 1 and env["device_name"]
    version = json.loads((ROOT / "configs" / "metadata.json").read_text())["version"]
    assert env["bundle_version"] == version, "the run's files say which version gave their numbers"
    markdown = (out / "gpu_proof.md").read_text()
    assert markdown.startswith("# GPU proof kit (DRY RUN on the CPU") and "no number here is a GPU number" in markdown
    assert all(f"| {name} |" in markdown for name in steps)


def test_cuda_only_steps_say_no_gpu_the_gpu_tests_say_why_and_the_others_ran(dry_run):
    """The dry run hides the GPU from pytest, which skips every gpu test with conftest.py's reason; the kit records
    each so, and its gpu_tests step (pytest ran, nothing failed) ok."""
    steps = by_name(dry_run[0])
    assert {"compile_cache"} == CUDA_ONLY
    for name, step in steps.items():
        expected = ("skipped", "no GPU") if name in CUDA_ONLY else ("ok", None)
        expected = ("skipped", "needs a CUDA/ROCm GPU") if name in gpu_tests() else expected
        assert (step["status"], step.get("reason")) == expected, name
    assert steps["gpu_tests"]["numbers"]["skipped"] == len(gpu_tests()) >= 10
    assert (dry_run[2] / "gpu_tests.xml").is_file(), "pytest's junit-xml, read back"


def test_the_cpu_run_says_plainly_that_it_holds_no_device_time(dry_run):
    """The kernel-class tables of a dry run: no profile test ran and no throughput row profiled busy steps (a GPU's),
    so neither the defaults nor the fastest row has a trace; both say so."""
    report, stdout, out = dry_run
    rows = by_name(report)["throughput"]["numbers"]["rows"]
    assert all(r.get("trace") is None for r in rows if r["status"] == "ok")
    found = report["kernel_classes"]
    assert found["defaults"]["reason"] == "no profiled run: the profile test and the defaults row left no trace"
    assert found["fastest"]["reason"].startswith("no trace: its busy steps were not profiled")
    markdown = (out / "gpu_proof.md").read_text()
    assert "Profiled defaults run: no profiled run: the profile test and the defaults row left no trace." in markdown
    assert f"Fastest throughput row, {found['fastest']['loop']}: no trace: its busy steps" in markdown
    assert "Where the GPU's time goes" in stdout


def test_the_kernel_class_tables_of_a_gpu_run_in_the_report(dry_run, tmp_path):
    """On a GPU both tables come from traces with kernels (here an H200's in tests/data/h200/: a profile.yaml run's
    for the defaults, a tiny kit run's busy steps for the fastest row); the fastest row is the one with the most
    patches a second, whose trace the report reads, with the row's own GPU-busy share beside the table."""
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
    assert f"Profiled defaults run, `{profile}`:" in markdown
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


def test_throughput_rows_run_in_their_steps_children_and_claim_no_gpu_number(dry_run):
    """The baseline and the throughput rows first (one child), the compile rows (a GPU's: skipped), the older rows
    last (one child); on a CPU the rows a CPU can run ran, and the others say why not."""
    report, _, out = dry_run
    steps = by_name(report)
    rows = {r["loop"]: r for r in steps["throughput"]["numbers"]["rows"]}
    assert list(rows) == list(THROUGHPUT_SETS), "every row recorded, in order"
    earlier = {r["loop"]: r for r in steps["throughput_earlier"]["numbers"]["rows"]}
    assert list(earlier) == list(LAST_SETS)
    assert steps["compile_cache"]["reason"] == "no GPU"
    ran = list(report["throughput"])
    on_a_cpu = [DEFAULTS_SET, METATENSOR_SET, HOST_CACHE_SET, SEED_SET]
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
    (``@displayable_configs#num_samples``): read raw, it would end the network step. Without the override the step
    counts train.yaml's 4 patches (here on the dry run's small network)."""
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
    assert kernel_classes({})["defaults"]["reason"].startswith("no profiled run: the profile test and the defaults row")


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
    """A run of FULLCT_RUNS (fused attention, 8 windows) may fail on a GPU: the runs after it
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


def test_a_short_budget_drops_the_tests_and_the_earlier_rows_never_the_new_rows():
    """The gpu tests and the rows of older settings run last, in steps that reserve nothing (the budget left is
    theirs), while the new rows' steps reserve the time of the steps after them; in the GPU command's selection
    (docs/performance.md's) the estimates of the new steps fit its budget of 450 s, the throughput step's new rows
    before its deadline, and a name that is no step picks the gpu tests that hold it."""
    assert STEPS[-1].name == "throughput_earlier" and set(EARLIER_SETS).isdisjoint({*THROUGHPUT_SETS, *COMPILE_SETS})
    assert {HOST_CACHE_SET, SEED_SET, "amp bfloat16"} <= set(EARLIER_SETS)
    steps, keywords = select(STEPS, "throughput,cuda_graphs,compile_cache,fullct_inference,throughput_earlier")
    assert [s.name for s in steps] == ["environment", "data", "network", "throughput", "compile_cache",
                                       "fullct_inference", "gpu_tests", "throughput_earlier"]  # fmt: skip
    assert keywords == ["cuda_graphs"] and gpu_tests(keywords) == ["test_cuda_graphs_give_the_eager_losses_and_weights"]
    kit = SimpleNamespace(steps=steps, sizes=GPU, gpu=True)
    estimate = GPU.estimates_s
    later = estimate["compile_cache"] + estimate["fullct_inference"]
    assert _later_s(kit, "throughput") == later, "the gpu tests and the earlier rows reserve nothing"
    assert _later_s(kit, "compile_cache") == estimate["fullct_inference"] and _later_s(kit, "gpu_tests") == 0
    before = sum(estimate[name] for name in ("environment", "data", "network"))
    new_rows = sum(estimate[name] for name in THROUGHPUT_SETS)
    assert new_rows <= 450 - later - before, "every new row starts before the throughput step's deadline"
    assert sum(estimate[name] for name in COMPILE_SETS) <= estimate["compile_cache"]
    assert before + new_rows + later <= 450 - 30, "with half a minute to spare for the tests and the earlier rows"


def test_peaks_come_from_the_device_name_and_an_unknown_device_gets_no_mfu():
    assert peak_bf16_tflops("NVIDIA H100 80GB HBM3", True)[0] == 989.4
    assert peak_bf16_tflops("NVIDIA H100 PCIe", True)[0] == 756.0
    assert peak_bf16_tflops("NVIDIA H200", True)[0] == 989.4
    assert peak_bf16_tflops("NVIDIA A100-SXM4-80GB", True)[0] == 312.0
    assert peak_bf16_tflops("AMD Instinct MI300X", True)[0] == 1307.4
    peak, reason = peak_bf16_tflops("NVIDIA H100 NVL", True)
    assert peak is None and "add it to PEAK_BF16_TFLOPS" in reason
    assert peak_bf16_tflops("x86_64", False)[0] is None


def test_only_runs_the_named_steps_and_the_steps_they_need_and_picks_the_gpu_tests_by_name():
    """A step's name runs it and what it needs; a name that is no step picks the gpu tests that hold it (each of the
    GPU paths one at least), running them alone; a name of neither ends the command before any GPU time."""
    first = ("environment", "data", "network", "throughput")
    assert select(STEPS, "throughput") == ([s for s in STEPS if s.name in first], [])
    steps, keywords = select(STEPS, "resume,torchrun")
    assert [s.name for s in steps] == ["environment", "gpu_tests"] and keywords == ["resume", "torchrun"]
    for path in ("train", "grad_scaler", "fused_adamw", "gpu_monitor", "resume", "profile", "summariser",
                 "evaluate_oom", "inference_oom", "torchrun", "cuda_graphs"):  # fmt: skip
        assert gpu_tests([path]), path
    assert gpu_tests(["train"]) == ["test_train_runs_an_epoch_with_validation_and_checkpoints_it"]
    with pytest.raises(SystemExit, match=r"--only: \['trian'\] name\(s\) no step and no gpu test"):
        select(STEPS, "trian")


def test_pytests_results_are_read_back_a_record_per_test(tmp_path):
    """pytest's junit-xml, as the kit has it written: a test that passed (its recorded numbers, parsed back to values),
    one that failed (its message and traceback) and one skipped (the reason)."""
    xml = tmp_path / "results.xml"
    xml.write_text(
        '<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="3">'
        '<testcase classname="tests.test_gpu" name="test_resume_continues_from_the_saved_epoch" time="12.34">'
        '<properties><property name="iteration_after" value="4"/><property name="trace" value="/tmp/1-trace.json.gz"/>'
        '<property name="seconds" value="{\'eager\': 1.5}"/></properties></testcase>'
        '<testcase classname="tests.test_gpu" name="test_fused_adamw_ran" time="0.01">'
        '<failure message="AssertionError: fused=False">trained[2] ...\nE   AssertionError</failure></testcase>'
        '<testcase classname="tests.test_gpu" name="test_torchrun_with_nccl_runs_an_epoch_and_rank_0_checkpoints" '
        'time="0">'
        '<skipped type="pytest.skip" message="needs a CUDA/ROCm GPU">tests/test_gpu.py:1</skipped></testcase>'
        "</testsuite></testsuites>"
    )
    ok, failed, skipped = junit_records(xml)
    numbers = {"iteration_after": 4, "trace": "/tmp/1-trace.json.gz", "seconds": {"eager": 1.5}}
    assert ok == {"name": "test_resume_continues_from_the_saved_epoch", "seconds": 12.3, "status": "ok",
                  "title": "resume continues from the saved epoch", "numbers": numbers}  # fmt: skip
    assert failed["status"] == "failed" and failed["error"].startswith("AssertionError: fused=False\ntrained[2]")
    assert (skipped["status"], skipped["reason"]) == ("skipped", "needs a CUDA/ROCm GPU")


def test_the_gpu_tests_step_reports_each_test_the_profile_tests_trace_and_those_the_budget_stopped(tmp_path):
    """The step as a GPU run gives it pytest's results (here written by a stand-in for the pytest child): a record per
    test with its numbers, where the GPU's time goes in the profile test's trace (an H200's, tests/data/h200/), a
    failure named in the step's error; and pytest stopped at the time limit: the tests it did not reach, skipped
    with the budget as the reason."""
    trace = str(ROOT / "tests" / "data" / "h200" / "4-chrome_trace.json.gz")
    summariser = ('<testcase name="test_summariser_agrees_with_key_averages_of_the_same_run" time="3.2"><properties>'
                  f'<property name="trace" value="{trace}"/></properties></testcase>')  # fmt: skip
    resume = ('<testcase name="test_resume_continues_from_the_saved_epoch" time="9"><failure message="AssertionError: '
              'resumed from epoch 0">...</failure></testcase>')  # fmt: skip
    kit, calls = Kit(tmp_path, dry_run=False, gpu=True, budget_s=450), []

    def pytest_child(module, args, log, timeout_s, env=None):
        calls.append((module, args, env))
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("E   AssertionError: resumed from epoch 0\n")
        cases = summariser + resume if len(calls) == 1 else summariser
        (tmp_path / "gpu_tests.xml").write_text(f"<testsuites><testsuite>{cases}</testsuite></testsuites>")
        return Child(1 if len(calls) == 1 else None, 12.0, log)

    kit.runner.module, kit.keywords = pytest_child, ["summariser", "resume"]
    with pytest.raises(StepFailed, match=r"failed: \['test_resume_continues_from_the_saved_epoch'\]") as failed:
        step_gpu_tests(kit)
    module, args, env = calls[0]
    assert module == "pytest" and args[:3] == ["-m", "gpu", str(ROOT / "tests" / "test_gpu.py")]
    assert args[-2:] == ["-k", "summariser or resume"] and "addopts=" in args and env == {"GPU_PROOF_SIZES": "full"}
    numbers = failed.value.numbers
    assert [t["status"] for t in numbers["tests"]] == ["ok", "failed"] and numbers["failed"] == 1
    assert numbers["defaults"]["trace"] == trace and numbers["defaults"]["device"]["events"] == 5132
    assert "resumed from epoch 0" in failed.value.tail
    kit.keywords = ["summariser", "profile"]
    numbers = step_gpu_tests(kit)  # stopped at its limit: the results pytest wrote when interrupted, then the rest
    assert [t["name"] for t in numbers["tests"]] == [*gpu_tests(["summariser"]), *gpu_tests(["profile"])]
    assert {k: numbers["tests"][-1][k] for k in ("status", "seconds", "reason")} == {
        "status": "skipped", "seconds": 0.0, "reason": "budget: pytest stopped after 12 s"}  # fmt: skip

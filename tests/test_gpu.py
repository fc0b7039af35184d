"""The bundle's GPU paths as users run them (``monai.bundle run`` in a process of its own), on a CUDA/ROCm device: a
training epoch with AMP fp16, GradScaler, the fused AdamW and the NVML monitor; resume from its checkpoint;
profile.yaml's trace and the trace summariser checked against torch.profiler's own ``key_averages()`` of the same
run; the sliding window's out-of-memory fallback in evaluation and inference (the error injected by
tests/faults.py); a training replayed as a CUDA graph equal to the eager one; torchrun with NCCL. Marked gpu: skipped,
with the reason, where torch sees no GPU (conftest.py); the checks' own reckoning runs everywhere.

The sizes: ``GPU_PROOF_SIZES=full`` gives train.yaml's network and patch on 512 x 512 x 120 chest CTs (the GPU proof
kit's full run, ``python -m benchmarks.gpu_proof``, which runs this file and reports each test); otherwise the kit's
tiny ones (a small BasicUNet on small cases: the paths in seconds). A test records what it measured with
``record_property``: the kit's report shows it beside the test.
"""

from __future__ import annotations

import copy
import csv
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from benchmarks.gpu_proof import GPU, TINY, write_cases
from conftest import ROOT, configs, foreign_folder
from faults import INJECTED_OOM
from scripts.common.labels import COLLECTION
from scripts.profiling.summarize_trace import SECTION_PREFIX, summarize

SIZES = GPU if os.environ.get("GPU_PROOF_SIZES") == "full" else TINY
EPOCH = {"train#trainer#epoch_length": 2}  # the training iterations of each training run (train, resume, torchrun)
PROFILE_SCHEDULE = (1, 1, 2, 1)  # profile.yaml's wait, warm-up, active, repeat
#: the device types of key_averages() rows that are the GPU's own (kernels, copies, ranges on its timeline)
DEVICE_TYPES = ("CUDA", "HIP")
FALLBACK_LOG = "out of memory in sliding-window inference"  # the inferer's warning when it runs a case again
OUT_OF_MEMORY_ONCE = {"sliding_window_inferer#_target_": "faults.OutOfMemoryOnce"}


# ------------------------------------------------------------------------------------------------------ the runs
def bundle(run_dir: Path, config_files: Sequence[str], *launcher: str, **settings: Any) -> str:
    """``monai.bundle run`` of ``config_files`` (under configs/) with ``settings`` on top of the sizes', writing under
    ``run_dir``, from a folder that is not the bundle, under torchrun with ``launcher`` as its arguments when given;
    its output (also in ``run_dir.log``). tests/faults.py is importable as ``faults``."""
    values = {"output_dir": run_dir, **SIZES.settings, **settings}
    args = ["run", "--config_file", configs(*config_files), "--bundle_root", str(ROOT)]
    args += [part for key, value in values.items() for part in (f"--{key}", str(value))]
    torchrun = ["torch.distributed.run", *launcher, "-m"] if launcher else []  # its agent: `python -m monai.bundle`
    command = [sys.executable, "-m", *torchrun, "monai.bundle", *args]
    path = os.pathsep.join(filter(None, [str(ROOT / "tests"), str(ROOT), os.environ.get("PYTHONPATH")]))
    done = subprocess.run(command, cwd=foreign_folder(), capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONPATH": path})  # fmt: skip
    output = done.stdout + done.stderr
    run_dir.with_name(f"{run_dir.name}.log").write_text(output)
    assert done.returncode == 0, f"{' + '.join(config_files)}: exit status {done.returncode}\n{output[-4000:]}"
    return output


def on_data(data: Path, run_dir: Path, **settings: Any) -> dict[str, Any]:
    """A training run's settings on the prepared data (prepared already), its weights under ``run_dir``."""
    return {"dataset_dir": data / "train", "prepared_dir": data / "prepared", "prepare_data": False,
            "model_path": run_dir / "model.pt", **settings}  # fmt: skip


def checkpoint(run_dir: Path) -> dict[str, Any]:
    """The run's ``checkpoints/latest.pt``."""
    return torch.load(run_dir / "checkpoints" / "latest.pt", map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """The sizes' synthetic training cases as DICOM (``train/``), prepared (``prepared/``)."""
    from scripts.common.cpus import usable_cpus
    from scripts.data.prepare import prepare

    tmp = tmp_path_factory.mktemp("gpu_data")
    write_cases([(tmp / "train", f"LUNG1-{i + 1:03d}", i + 1) for i in range(SIZES.training_cases)], SIZES.case)
    prepare(tmp / "train", tmp / "prepared", num_workers=usable_cpus(), progress=False)
    return tmp


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> Path:
    """Random weights of train.yaml's network at the sizes (their values do not change the paths)."""
    from monai.bundle import ConfigParser
    from scripts.training.weights import save_weights

    parser = ConfigParser()
    parser.read_config(str(ROOT / "configs" / "train.yaml"))
    parser.update(SIZES.settings)
    path = tmp_path_factory.mktemp("weights") / "model.pt"
    return save_weights(parser.get_parsed_content("network_def"), path, parser.get_parsed_content("labels"))


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory) -> tuple[Path, str, dict[str, Any]]:
    """One short epoch of train.yaml with validation and a checkpoint, at train.yaml's GPU defaults (AMP fp16 with
    GradScaler, the fused AdamW, the NVML monitor): its folder, its output and its checkpoint as it was then."""
    run_dir = tmp_path_factory.mktemp("runs") / "train"
    output = bundle(run_dir, ["train.yaml"], **on_data(data, run_dir, max_epochs=1, val_interval=1, **EPOCH))
    return run_dir, output, checkpoint(run_dir)


@pytest.fixture(scope="module")
def profiled(data, tmp_path_factory) -> Path:
    """profile.yaml's run: its ``profiler`` folder."""
    run_dir = tmp_path_factory.mktemp("runs") / "profile"
    steps = {"train#trainer#epoch_length": sum(PROFILE_SCHEDULE[:3])}  # wait, warm-up and active: one cycle
    settings = on_data(data, run_dir, max_epochs=1, val_interval=1000, profiler_schedule=list(PROFILE_SCHEDULE))
    bundle(run_dir, ["train.yaml", "profile.yaml"], **settings, **steps)
    return run_dir / "profiler"


# ------------------------------------------------------------------------------------------------------ training
@pytest.mark.gpu
def test_train_runs_an_epoch_with_validation_and_checkpoints_it(trained, record_property):
    _, output, state = trained
    assert state["trainer"]["epoch"] == 1, f"the checkpoint says epoch {state['trainer']['epoch']}, not 1"
    found = re.search(r"best validation Dice ([0-9.]+) at epoch (\d+)", output)
    record_property("iterations", int(state["trainer"]["iteration"]))
    record_property("validation_dice", float(found.group(1)) if found else None)


@pytest.mark.gpu
def test_grad_scaler_state_is_in_the_fp16_checkpoint(trained, record_property):
    """The loss was scaled: the fp16 run's checkpoint holds GradScaler's state."""
    scaler = trained[2].get("scaler") or {}
    assert scaler.get("scale"), f"no GradScaler state in the fp16 run's checkpoint: {sorted(trained[2])}"
    record_property("scale", float(scaler["scale"]))


@pytest.mark.gpu
def test_fused_adamw_ran(trained):
    """train.yaml's fused_optimizer on CUDA: AdamW's param group says fused."""
    group = trained[2]["optimizer"]["param_groups"][0]
    assert group.get("fused") is True, f"AdamW's param group says fused={group.get('fused')!r}"


@pytest.mark.gpu
def test_gpu_monitor_sampled_nvml_into_its_csv_and_png(trained, record_property):
    run_dir, output, _ = trained
    assert "GPU utilisation (nvml)" in output, "the training log has no 'GPU utilisation (nvml)' line"
    with open(run_dir / "gpu_utilisation.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    png = run_dir / "gpu_utilisation.png"
    assert rows and png.read_bytes()[:4] == b"\x89PNG", f"{len(rows)} samples, {png} there: {png.is_file()}"
    util = [float(r["util_percent"]) for r in rows if r["util_percent"] not in ("", "nan")]
    record_property("samples", len(rows))
    record_property("mean_util_percent", round(sum(util) / max(len(util), 1), 1))
    record_property("peak_mem_used_mib", max(float(r["mem_used_mib"]) for r in rows))


@pytest.mark.gpu
def test_resume_continues_from_the_saved_epoch(trained, data, record_property):
    """The training run resumed from its checkpoint for a second epoch: it starts at epoch 1 and ends at 2."""
    run_dir = trained[0]
    settings = on_data(data, run_dir, max_epochs=2, resume=True, val_interval=1000, **EPOCH)
    output = bundle(run_dir.with_name("resume"), ["train.yaml"], **{**settings, "output_dir": run_dir})
    found = re.search(r"resumed from .*: epoch (\d+), iteration (\d+)", output)
    assert found and int(found.group(1)) == 1, found.group(0) if found else "no 'resumed from' line"
    state = checkpoint(run_dir)
    assert state["trainer"]["epoch"] == 2
    record_property("iteration_after", int(state["trainer"]["iteration"]))


@pytest.mark.gpu
def test_torchrun_with_nccl_runs_an_epoch_and_rank_0_checkpoints(data, tmp_path_factory, record_property):
    """multi_gpu_train.yaml under ``torchrun --standalone --nproc_per_node=1``: an NCCL process group, a short epoch
    with validation sharded over the ranks, the checkpoint written by rank 0."""
    run_dir = tmp_path_factory.mktemp("runs") / "torchrun"
    settings = on_data(data, run_dir, max_epochs=1, val_interval=1, dist_backend="nccl", dist_timeout_minutes=5)
    settings.update(EPOCH)
    output = bundle(run_dir, ["train.yaml", "multi_gpu_train.yaml"], "--standalone", "--nproc_per_node=1", **settings)
    found = re.search(r"process group: rank 0 of (\d+), backend (\w+)", output)
    assert found and found.group(2) == "nccl", found.group(0) if found else "no process-group line"
    assert (run_dir / "checkpoints" / "latest.pt").is_file()
    record_property("backend", found.group(2))


# ------------------------------------------------------------------------------------------------------ profiling
@pytest.mark.gpu
def test_profile_writes_a_chrome_trace_with_its_key_averages_and_memory_pickle(profiled, record_property):
    traces = sorted(profiled.glob("*-chrome_trace.json.gz"))
    memory = profiled / "memory.pickle"
    assert traces and memory.is_file() and memory.stat().st_size, f"in {profiled}: {sorted(os.listdir(profiled))}"
    record_property("trace_mb", round(traces[0].stat().st_size / 1e6, 2))
    record_property("memory_pickle_mb", round(memory.stat().st_size / 1e6, 2))


@pytest.mark.gpu
def test_summariser_agrees_with_key_averages_of_the_same_run(profiled, record_property):
    """scripts.profiling.summarize_trace on the profile run's first trace against torch.profiler's key_averages() of
    the same run (an independent account of the same events); its reading speed."""
    trace = min(profiled.glob("*-chrome_trace.json.gz"), key=lambda p: int(p.name.split("-")[0]))
    work: dict[str, int] = {}
    start = time.perf_counter()
    summary = summarize(trace, work=work)
    seconds = time.perf_counter() - start
    rows = json.loads(trace.with_name(trace.name.replace("chrome_trace.json.gz", "key_averages.json")).read_text())
    record_property("trace", str(trace))  # the kit's table of where the defaults' GPU time goes
    record_property("kernels", summary["kernels"])
    record_property("mb_per_s", round(work["read"] / 1e6 / seconds, 1))
    assert summary["kernels"], f"no CUDA kernel in {trace}: the profiler recorded the CPU only"
    assert [c for c in compare_with_key_averages(summary, rows) if not c["ok"]] == []


def compare_with_key_averages(summary: dict[str, Any], rows: list[dict[str, Any]], rel: float = 0.01) -> list[dict]:
    """Checks of a trace summary against torch.profiler's key averages
    (:func:`scripts.profiling.profiler.key_average_rows`).

    Per section: the same number of instances; a CPU-timed section's total equal to its range's CPU total (``rel``,
    plus 5 us per instance for rounding); a kernel-timed one's total (first kernel start to last kernel end of each
    instance) at least the kernel time key_averages gives the range (the kernels its own thread launched in it: on
    one stream, kernels inside a span cannot take longer than the span). And the same number of kernels (copies and
    memsets are not kernels to either).

    On CUDA and ROCm ``key_averages()`` holds two rows per range: the CPU row (``device_type`` CPU: the range's CPU
    time, and the kernels launched in it) and the device row (the range as the GPU timeline shows it, no CPU time):
    CPU time is read from the first, a kernel-timed section from the second."""
    empty = {"count": 0, "cpu_time_total_us": 0.0, "device_time_total_us": 0.0}
    host = {r["name"]: r for r in rows if r.get("device_type", "CPU") == "CPU"}
    device: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("device_type", "CPU") in DEVICE_TYPES:
            device.setdefault(r["name"], []).append(r)
    checks: list[dict[str, Any]] = []
    for name, stats in summary["sections"].items():
        row = host.get(SECTION_PREFIX + name, empty)
        count, total = stats["count"], stats["mean_s"] * stats["count"]
        checks.append({"what": f"{name}: instances", "summariser": count, "key_averages": row["count"],
                       "ok": count == row["count"]})  # fmt: skip
        slack = rel + 5e-6 * count / max(total, 1e-9)
        if summary["sources"].get(name, "cpu") == "cpu":
            reference = row["cpu_time_total_us"] / 1e6
            ok = abs(total - reference) <= slack * max(reference, total)
            checks.append({"what": f"{name}: CPU seconds", "summariser": round(total, 6),
                           "key_averages": round(reference, 6), "ok": ok})  # fmt: skip
        else:  # the range as the device saw it (its rows on CUDA / HIP), else the kernels its CPU row launched
            on_device = device.get(SECTION_PREFIX + name)
            kernel_us = sum(r["device_time_total_us"] for r in on_device) if on_device else row["device_time_total_us"]
            reference = kernel_us / 1e6
            checks.append({"what": f"{name}: kernel span s >= kernel s in the range", "summariser": round(total, 6),
                           "key_averages": round(reference, 6), "busy_fraction": round(reference / max(total, 1e-9), 3),
                           "ok": reference <= total * (1 + slack)})  # fmt: skip
    copies = ("Memcpy", "Memset", "memcpy", "memset")  # device rows of copies and memsets: not kernels
    kernels = sum(r["count"] for r in rows if r.get("device_type") in DEVICE_TYPES
                  and not r["name"].startswith((*copies, SECTION_PREFIX)))  # fmt: skip
    checks.append({"what": "kernels", "summariser": summary["kernels"], "key_averages": kernels,
                   "ok": abs(summary["kernels"] - kernels) <= rel * kernels})  # fmt: skip
    return checks


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


def test_the_trace_check_passes_on_an_h200_profile():
    """An H200's profile (tests/data/h200/: its chrome trace and key_averages(), as profile.yaml wrote them): CUDA
    gives two rows per range, and the check reads the CPU row's CPU time (the summariser's 0.494 s for two steps) and
    the device row's kernel time, so every check holds."""
    data = ROOT / "tests" / "data" / "h200"
    summary = summarize(data / "4-chrome_trace.json.gz")
    rows = json.loads((data / "4-key_averages.json").read_text())
    checks = compare_with_key_averages(summary, rows)
    assert [c for c in checks if not c["ok"]] == []
    by_what = {c["what"]: c for c in checks}
    assert by_what["step: CPU seconds"]["key_averages"] == pytest.approx(0.494288, abs=1e-6)
    assert by_what["forward: kernel span s >= kernel s in the range"]["key_averages"] == pytest.approx(0.2394, abs=1e-4)
    assert by_what["kernels"]["summariser"] == 4526


# ------------------------------------------------------------------------------------- the out-of-memory fallback
def fallbacks(output: str) -> int:
    """How many times a run's sliding window ran a case again after the injected out-of-memory error."""
    assert INJECTED_OOM in output, "the injected out-of-memory error is not in the run's output"
    return output.count(FALLBACK_LOG)


@pytest.mark.gpu
def test_evaluate_oom_falls_back_once_and_scores_every_case(data, weights, tmp_path_factory, record_property):
    """evaluate.yaml on the validation case, its first case out of memory: run again with the output stitched in
    CPU memory, then scored like any other."""
    run_dir = tmp_path_factory.mktemp("runs") / "evaluate_oom"
    settings = on_data(data, run_dir, model_path=weights, eval_split="validation", eval_pictures=0,
                       inference_backend="torch", **OUT_OF_MEMORY_ONCE)  # fmt: skip
    output = bundle(run_dir, ["train.yaml", "evaluate.yaml"], **settings)
    summary = json.loads((run_dir / "eval" / "metrics_summary.json").read_text())
    assert fallbacks(output) == 1 and summary["num_cases"] >= 1 and not summary.get("failed"), summary
    record_property("cases", summary["num_cases"])


@pytest.mark.gpu
def test_inference_oom_falls_back_once_and_writes_nifti_and_seg(data, weights, tmp_path_factory):
    """inference.yaml on one DICOM CT, out of memory once, with the PyTorch backend: the NIfTI and the DICOM SEG out
    (RTSTRUCT, SR and the report are CPU work, tested on the CPU)."""
    import pydicom

    run_dir = tmp_path_factory.mktemp("runs") / "inference_oom"
    case = sorted((data / "train" / COLLECTION).iterdir())[0]
    output = bundle(run_dir, ["inference.yaml"], input_dir=case, model_path=weights, inference_backend="torch",
                    write_rtstruct=False, write_sr=False, write_report=False, **OUT_OF_MEMORY_ONCE)  # fmt: skip
    nifti, seg = sorted(run_dir.glob("*/*_seg.nii.gz")), sorted(run_dir.glob("*/*_seg.dcm"))
    assert fallbacks(output) == 1 and nifti and seg, f"under {run_dir}: NIfTI {nifti}, SEG {seg}"
    assert pydicom.dcmread(seg[0], stop_before_pixels=True).Modality == "SEG"


# ------------------------------------------------------------------------------------------------------ CUDA graphs
def train_twice(settings: dict[str, Any], device: str, steps: int = 8, patches: int = 2) -> dict[str, Any]:
    """train.yaml's network, loss and fused AdamW trained ``steps`` steps twice from the same weights on the same
    ``patches``-patch batches (fp16 AMP with GradScaler, cuDNN deterministic): with MONAI's own iteration and with
    scripts.training.graphs' (eager warm-up, capture, replays; on a CPU all eager). Each run's losses, seconds and the
    graphed run's summary; the largest loss difference, the L2 norms of the weights' difference and of the eager run's
    change in training, and whether the weights are bitwise equal."""
    from ignite.engine import Events
    from monai.bundle import ConfigParser
    from monai.engines import SupervisedTrainer
    from scripts.training.graphs import GraphedIteration

    parser = ConfigParser()
    parser.read_config(str(ROOT / "configs" / "train.yaml"))
    parser.update(settings)
    flags = torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = False, True
    where = torch.device(device)
    sync = torch.cuda.synchronize if where.type == "cuda" else lambda: None
    roi = [int(r) for r in parser.get_parsed_content("roi_size")]
    torch.manual_seed(0)
    start = parser.get_parsed_content("network_def").to(where)
    generator = torch.Generator(where).manual_seed(0)
    batches = [{"image": torch.rand(patches, 1, *roi, device=where, generator=generator),
                "label": (torch.rand(patches, 1, *roi, device=where, generator=generator) > 0.9).float()}
               for _ in range(steps)]  # fmt: skip
    runs: dict[str, dict[str, Any]] = {}
    try:
        for name, iteration in (("eager", None), ("graphed", GraphedIteration())):
            network = copy.deepcopy(start)
            optimizer = torch.optim.AdamW(network.parameters(), lr=1e-3, weight_decay=1e-5, fused=True)
            trainer = SupervisedTrainer(device=where, max_epochs=1, train_data_loader=batches, network=network,
                                        optimizer=optimizer, loss_function=parser.get_parsed_content("loss"), amp=True,
                                        amp_kwargs={"dtype": torch.float16}, iteration_update=iteration,
                                        decollate=False)  # fmt: skip
            losses: list[float] = []
            trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e, seen=losses: seen.append(
                float(e.state.output["loss"])))  # fmt: skip
            sync()
            began = time.perf_counter()
            trainer.run()
            sync()
            runs[name] = {"losses": losses, "seconds": round(time.perf_counter() - began, 3), "network": network}
            if iteration is not None:
                runs[name]["summary"] = iteration.summary()
    finally:
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = flags
    eager, graphed = runs["eager"].pop("network"), runs["graphed"].pop("network")
    pairs = list(zip(graphed.parameters(), eager.parameters(), start.parameters(), strict=True))

    def norm(tensors: Any) -> float:
        return float(sum(t.double().square().sum() for t in tensors) ** 0.5)

    return {**runs, "max_loss_difference": max(abs(a - b) for a, b in zip(runs["graphed"]["losses"],
                                                                          runs["eager"]["losses"])),
            "loss_scale": max(abs(x) for x in runs["eager"]["losses"]),
            "weight_difference": norm(g - e for g, e, _ in pairs), "weight_change": norm(e - s for _, e, s in pairs),
            "bitwise_equal": all(torch.equal(g, e) for g, e, _ in pairs)}  # fmt: skip


def graph_problems(numbers: dict[str, Any]) -> list[str]:
    """What makes a graphed training differ from the eager one: no single capture with replays; losses of a step apart
    by more than 0.1 %; weights apart by more than 1 % of what training changed them by (L2 norms: a kernel's atomics
    may order sums differently, and Adam scales a gradient near zero up to the learning rate)."""
    summary, problems = numbers["graphed"]["summary"], []
    if summary["captures"] != 1 or summary["replayed"] < 1 or summary["eager"] or summary["disabled"]:
        problems.append(f"the graphed run did not capture once and replay: {summary}")
    if numbers["max_loss_difference"] > 1e-3 * numbers["loss_scale"]:
        problems.append(f"losses differ by up to {numbers['max_loss_difference']:.3g}")
    if numbers["weight_difference"] > 1e-2 * numbers["weight_change"]:
        problems.append(f"the weights differ by {numbers['weight_difference']:.3g} (L2) against a change of "
                        f"{numbers['weight_change']:.3g} in training")  # fmt: skip
    return problems


@pytest.mark.gpu
def test_cuda_graphs_give_the_eager_losses_and_weights(record_property):
    """Two short trainings of train.yaml's network from the same weights on the same batches: MONAI's own iteration
    and scripts.training.graphs' (warm-up, capture, replays) give the same losses and weights."""
    numbers = train_twice(SIZES.settings, "cuda")
    record_property("replayed", numbers["graphed"]["summary"]["replayed"])
    record_property("max_loss_difference", numbers["max_loss_difference"])
    record_property("seconds", {name: numbers[name]["seconds"] for name in ("eager", "graphed")})
    assert graph_problems(numbers) == []


def test_the_graph_check_trains_both_ways_and_fails_without_a_capture():
    """The check on a CPU (the tiny network, 3 steps): MONAI's own iteration and scripts.training.graphs' train the same
    weights, bitwise (on a CPU every step is eager); the check fails those numbers because nothing was captured, and
    passes a graphed run that captured and replayed with the losses and weights alike."""
    numbers = train_twice(TINY.settings, "cpu", steps=3)
    assert numbers["bitwise_equal"] and numbers["max_loss_difference"] == 0 and numbers["weight_change"] > 0
    assert numbers["graphed"]["summary"]["eager"] == 3 and len(numbers["eager"]["losses"]) == 3
    assert graph_problems(numbers)[0].startswith("the graphed run did not capture once and replay")
    numbers["graphed"]["summary"] = {"captures": 1, "replayed": 4, "eager": 0, "disabled": None}
    assert graph_problems(numbers) == []
    numbers["weight_difference"] = 0.02 * numbers["weight_change"]
    assert re.match(r"the weights differ by .* \(L2\) against a change of", graph_problems(numbers)[0])

"""DDP through torchrun on CPUs (gloo): ranks agree, validation covers every case once, shards are disjoint,
a killed rank is restarted from the last checkpoint, and two "nodes" meet at a c10d rendezvous on 127.0.0.1."""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import MECHANICS_NETWORK, ROOT, configs, save_weights, tiny_dataset, torchrun, train_workflow

MULTI = configs("train.yaml", "demo.yaml", "multi_gpu_train.yaml")
# each rank one thread: two ranks of two threads each would oversubscribe the two cores
RANK_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


# two ranks share every list: 8 cases give 5 training (3 steps an epoch on each rank) and 2 validation cases
DDP_CASES = 8


@pytest.fixture(scope="module")
def ddp_data(tmp_path_factory) -> Path:
    return tiny_dataset(tmp_path_factory.mktemp("ddp"), num_cases=DDP_CASES)


def bundle_args(demo_tmp: Path, out: Path, **overrides) -> list[str]:
    settings = {"dataset_dir": demo_tmp / "data", "prepared_dir": demo_tmp / "prepared", "output_dir": out,
                "num_samples": 1, "val_interval": 1, "max_epochs": 1, "dist_timeout_minutes": 10,
                "network_def": MECHANICS_NETWORK, "demo_cases": DDP_CASES}  # fmt: skip
    settings.update(overrides)
    args = ["-m", "monai.bundle", "run", "--config_file", MULTI, "--bundle_root", str(ROOT)]
    for key, value in settings.items():
        args += [f"--{key}", str(value)]
    return args


def workers_of(pid: int) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in found]


def logged_dice(log: str, epoch: int) -> float:
    """The validation Dice rank 0's StatsHandler logged for ``epoch``."""
    matches = re.findall(r"Epoch\[(\d+)\] Metrics -- val_mean_dice: ([0-9.]+)", log)
    return float(dict(matches)[str(epoch)])


def test_two_ranks_restart_after_a_kill_and_agree(ddp_data, tmp_path):
    demo_tmp = ddp_data
    out = tmp_path / "run"
    rank_file = "'{}/rank' + str(@scripts.training.distributed.rank()) + '.pt'"
    dump = f"$torch.save(@scripts.training.weights.unwrap(@network).state_dict(), {rank_file})"
    finalize = str([dump.format(tmp_path), "$@scripts.training.distributed.cleanup()"])
    command, env = torchrun(
        ["--standalone", "--nproc_per_node=2", "--max-restarts=1"],
        bundle_args(demo_tmp, out, max_epochs=2, resume="true", finalize=finalize),
        RANK_ENV,
    )
    log_file = tmp_path / "log.txt"
    with log_file.open("w") as log:
        job = subprocess.Popen(command, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, env=env)
        latest = out / "checkpoints" / "latest.pt"
        deadline = time.monotonic() + 600
        while not latest.exists() and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        workers = workers_of(job.pid)
        assert len(workers) == 2 and job.poll() is None, log_file.read_text()[-3000:]
        os.kill(workers[-1], signal.SIGKILL)  # one rank dies during epoch 2
        job.wait(timeout=900)
    text = log_file.read_text()
    assert job.returncode == 0, text[-4000:]
    assert "resumed from" in text, "the restarted workers continued from the checkpoint"
    state = torch.load(latest, weights_only=True)
    assert state["trainer"]["epoch"] == 2
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    for name, tensor in state["network"].items():
        torch.testing.assert_close(ranks[0][name], tensor, msg=name)
        torch.testing.assert_close(ranks[1][name], tensor, msg=f"rank 1 differs from the saved weights: {name}")

    # the Dice logged under DDP (each rank validated half the cases) equals one process validating all of them
    from scripts.training.weights import load_weights

    workflow = train_workflow(["train.yaml", "demo.yaml"], demo_tmp, tmp_path / "single",
                              network_def=ast.literal_eval(MECHANICS_NETWORK))  # fmt: skip
    load_weights(workflow.parser.get_parsed_content("network"), latest)
    evaluator = workflow.parser.get_parsed_content("validate#evaluator")
    evaluator.run()
    assert evaluator.state.metrics["val_mean_dice"] == pytest.approx(logged_dice(text, 2), abs=1e-4)
    validation = json.loads((demo_tmp / "prepared" / "datalist.json").read_text())["validation"]
    shards = re.findall(r"rank (\d) holds (\d+) validation case\(s\): ([\w\- ]+)", text)
    assert sorted(c for _, _, ids in shards[-2:] for c in ids.split()) == sorted(d["case_id"] for d in validation)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_nodes(
    commands: list[list[str]], cwd: Path, timeout_s: float = 900, grace_s: float = 20, env: dict | None = None
) -> tuple:
    """Each command as one node (with ``env``, default RANK_ENV); their exit codes and logs. When a node fails, the
    others get ``grace_s`` to end and are then killed: torchrun's agent would otherwise wait 300 s at its exit barrier
    for the failed one."""
    outs = [(cwd / f"node{i}.log").open("w") for i in range(len(commands))]
    nodes = [subprocess.Popen(c, cwd=cwd, stdout=o, stderr=subprocess.STDOUT, env=env or RANK_ENV)
             for c, o in zip(commands, outs)]  # fmt: skip
    deadline, failed_at = time.monotonic() + timeout_s, None
    while any(n.poll() is None for n in nodes) and time.monotonic() < deadline:
        if failed_at is None and any(n.poll() not in (None, 0) for n in nodes):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() > failed_at + grace_s:
            break
        time.sleep(0.5)
    for node in nodes:
        if node.poll() is None:
            node.kill()
        node.wait()
    for out in outs:
        out.close()
    return [n.returncode for n in nodes], [(cwd / f"node{i}.log").read_text() for i in range(len(commands))]


def test_a_failed_node_ends_the_others_after_a_grace_instead_of_torchruns_300_s(tmp_path):
    started = time.monotonic()
    sleeper, failing = [sys.executable, "-c", "import time; time.sleep(600)"], [sys.executable, "-c", "exit(3)"]
    codes, _ = run_nodes([sleeper, failing], tmp_path, grace_s=1)
    assert codes == [-signal.SIGKILL, 3] and time.monotonic() - started < 60


def test_two_nodes_on_localhost_with_partitioned_cache(ddp_data, tmp_path):
    demo_tmp = ddp_data
    port = free_port()
    launcher = ["--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
                "--rdzv_id=pytest"]  # fmt: skip
    args = bundle_args(demo_tmp, tmp_path / "run", partition_cache="true")
    command, env = torchrun(launcher, args, RANK_ENV)
    codes, logs = run_nodes([command] * 2, tmp_path, env=env)
    assert codes == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    held = {}
    for rank, _, ids in re.findall(r"rank (\d) holds (\d+) training case\(s\): ([\w\- ]+)", "\n".join(logs)):
        held[rank] = set(ids.split())
    training = {d["case_id"] for d in json.loads((demo_tmp / "prepared" / "datalist.json").read_text())["training"]}
    assert set(held) == {"0", "1"} and not held["0"] & held["1"], "each case is cached on exactly one rank"
    assert held["0"] | held["1"] == training
    # one process writes TensorBoard: the other rank builds no handler that would open an (empty) event file
    writers = {f.name.rsplit(".", 2)[1] for f in (tmp_path / "run").glob("events.out.tfevents.*")}
    assert len(writers) == 1, f"event files from the processes {writers}"


def test_evaluation_on_two_ranks_counts_every_case_once(ddp_data, tmp_path):
    """Mechanics only, so random-initialised weights of the demo network (no other test's run is assumed)."""
    from monai.networks.nets import SwinUNETR

    demo_tmp = ddp_data
    weights = save_weights(SwinUNETR(in_channels=1, out_channels=2, feature_size=12), tmp_path / "model.pt")
    config_file = configs("train.yaml", "demo.yaml", "evaluate.yaml", "multi_gpu_evaluate.yaml")
    args = ["-m", "monai.bundle", "run", "evaluate", "--config_file", config_file, "--bundle_root", str(ROOT),
            "--dataset_dir", str(demo_tmp / "data"), "--prepared_dir", str(demo_tmp / "prepared"),
            "--output_dir", str(tmp_path / "run"), "--model_path", str(weights),
            "--eval_dir", str(tmp_path), "--eval_split", "training", "--eval_pictures", "0",
            "--inference_backend", "torch", "--demo_cases", str(DDP_CASES)]  # fmt: skip
    command, env = torchrun(["--standalone", "--nproc_per_node=2"], args, RANK_ENV)
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = (tmp_path / "metrics.csv").read_text().splitlines()[1:]
    training = json.loads((demo_tmp / "prepared" / "datalist.json").read_text())["training"]
    assert sorted(r.split(",")[0] for r in rows) == sorted(d["case_id"] for d in training)

"""The SLURM launchers (scripts/slurm/*.sbatch), submitted unchanged with ``sbatch`` to a throw-away cluster.

The cluster runs on this machine only: its own munge key and socket, a ``slurm.conf`` naming this host as the
controller and as two compute nodes (two ``slurmd`` with their own ports, ``NodeAddr=127.0.0.1``), spool and state
folders under a temporary folder, all daemons stopped at the end whatever happens. Each node declares 64 CPUs and 8
GPUs (``SlurmdParameters=config_overrides``; the GPUs are /dev/null) so that the launchers' ``#SBATCH`` lines are
accepted as written and both jobs fit at once. The jobs ask for fewer GPUs on the command line, which sets the number
of processes per node, and train a small network on CPUs (gloo) on five tiny synthetic cases for one or two epochs.
The inference array (two tasks, one GPU each as written) runs the demo's weights on four small synthetic CTs. The
``python`` and ``torchrun`` the single-node and array jobs find first on PATH fork each python process from the tests'
zygote (:func:`with_shims`); the two-node job runs the venv's own.

Skipped, with the reason, where slurmctld/slurmd/munged are not installed (Debian: slurmctld slurmd slurm-client
munge). The daemons run as the user running the tests (SlurmUser = SlurmdUser = that user; also tried as an
ordinary user with a one-line job), so root is not needed.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zygote
from conftest import MECHANICS_NETWORK

ROOT = Path(__file__).resolve().parents[1]
SLURM_TOOLS = ("slurmctld", "slurmd", "munged", "sbatch", "scontrol", "squeue", "scancel", "sinfo")
# the daemons live in /usr/sbin, which an ordinary user's PATH may lack
MISSING = [t for t in SLURM_TOOLS if not (shutil.which(t) or shutil.which(t, path=f"/usr/sbin{os.pathsep}/sbin"))]
pytestmark = [
    pytest.mark.skipif(
        bool(MISSING),
        reason=f"SLURM is not installed (missing {', '.join(MISSING)}; Debian: apt-get install slurmctld slurmd "
        "slurm-client munge)",
    ),
    pytest.mark.slow,
]

NODES = ("n1", "n2")
NUM_CASES = 5  # the split gives 4 training cases: 2 train (one step per rank and epoch), 2 validate (one per rank)
# What is tested is the launch, not the network: conftest's small BasicUNet in place of the demo's SwinUNETR. The
# bundle's ids, as a user passes them after the script name (spaces kept).
BUNDLE_OVERRIDES = [
    "--network_def", MECHANICS_NETWORK, "--roi_size", "[64,64,64]", "--spacing", "[2.0,2.0,3.0]", "--num_samples", "1",
    "--learning_rate", "3e-3", "--warmup_epochs", "1", "--sw_batch_size", "1",
    "--train#data", "$@train#datalist[:2]", "--validate#data", "$@train#datalist[2:]",
]  # fmt: skip
EXTRA_ARGS = "--num_workers 0 --gpu_monitor false"  # the launchers' EXTRA_ARGS variable: split at spaces
JOB_TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slurm_conf(base: Path, host: str, user: str, ctld_port: int, node_ports: dict[str, int]) -> str:
    nodes = "\n".join(
        f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs=64 Gres=gpu:8 State=UNKNOWN"
        for name, port in node_ports.items()
    )
    return f"""\
ClusterName=pytest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/munge
# cred_expire: how long a requeued job waits before it may start again (default 120 s)
AuthInfo=socket={base}/munge/munge.socket,cred_expire=10
StateSaveLocation={base}/state
SlurmdSpoolDir={base}/spool/%n
SlurmctldPidFile={base}/slurmctld.pid
SlurmdPidFile={base}/slurmd-%n.pid
SlurmctldLogFile={base}/log/slurmctld.log
SlurmdLogFile={base}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# no cgroups in a container: processes tracked by parent pid, no CPU binding
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/builtin
# look at pending jobs every second (default 60 s): a requeued job starts as soon as its BeginTime has passed
SchedulerParameters=sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# the nodes claim what the launchers' #SBATCH lines ask for (32 CPUs per job, 8 GPUs), whatever this machine has
SlurmdParameters=config_overrides
GresTypes=gpu
ReturnToService=2
KillWait=5
MinJobAge=600
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def stop(process: subprocess.Popen, timeout: float = 10) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def processes_with_env(entry: bytes) -> list[int]:
    """Pids of the processes whose environment holds ``entry`` (jobs of this cluster all carry its SLURM_CONF)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            with contextlib.suppress(OSError):
                if entry in (proc / "environ").read_bytes().split(b"\0"):
                    found.append(int(proc.name))
    return found


class LocalCluster:
    """munged + slurmctld + one slurmd per node on 127.0.0.1, configured and kept under ``base``."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.conf = base / "slurm.conf"
        self.daemons: list[subprocess.Popen] = []
        self.logs: list = []
        self.history: dict[str, list[tuple]] = {}
        self.user = pwd.getpwuid(os.getuid()).pw_name
        # daemons get a plain system PATH (not this venv), as on a real node
        self.env = {
            **os.environ,
            "SLURM_CONF": str(self.conf),
            "PATH": os.pathsep.join(["/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"]),
        }

    def start(self) -> None:
        base = self.base
        for sub in ("munge", "state", "log", "dev", *(f"spool/{n}" for n in NODES)):
            (base / sub).mkdir(parents=True, exist_ok=True)
        key = base / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        # --force: pytest's temporary folders are not world-searchable, which munged would otherwise refuse
        self.spawn("munged", "--foreground", "--force", f"--socket={base}/munge/munge.socket", f"--key-file={key}",
                   f"--pid-file={base}/munge/munged.pid", f"--seed-file={base}/munge/munged.seed",
                   f"--log-file={base}/munge/munged.log")  # fmt: skip
        self.wait_for(lambda: (base / "munge" / "munge.socket").exists(), "munged's socket", base / "munge")
        for i in range(8):
            (base / "dev" / f"gpu{i}").symlink_to("/dev/null")  # GPUs need device files; never opened here
        (base / "gres.conf").write_text(f"Name=gpu File={base}/dev/gpu[0-7]\n")
        host = socket.gethostname().split(".")[0]
        conf = slurm_conf(base, host, self.user, free_port(), {n: free_port() for n in NODES})
        self.conf.write_text(conf)
        self.spawn("slurmctld", "-D", "-f", str(self.conf))
        for node in NODES:
            self.spawn("slurmd", "-D", "-N", node, "-f", str(self.conf))
        self.wait_for(self.nodes_idle, "both nodes idle", base / "log")

    def spawn(self, *command: str) -> None:
        log = (self.base / "log" / f"{command[0]}-{len(self.daemons)}.out").open("w")
        self.logs.append(log)
        self.daemons.append(subprocess.Popen(command, env=self.env, stdout=log, stderr=subprocess.STDOUT))

    def nodes_idle(self) -> bool:
        states = self.cli("sinfo", "-h", "-N", "-o", "%N %T", check=False).stdout.split("\n")
        return sorted(states[:-1]) == [f"{n} idle" for n in NODES]

    def wait_for(self, condition, what: str, logs: Path, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            dead = [p.args for p in self.daemons if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                tails = "\n".join(f"--- {f}\n{f.read_text()[-1500:]}" for f in sorted(logs.glob("*")) if f.is_file())
                raise RuntimeError(f"local SLURM cluster: no {what} after {timeout} s (exited: {dead})\n{tails}")
            time.sleep(0.3)

    def cli(self, *command: str, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        kwargs.setdefault("env", self.env)
        kwargs.setdefault("timeout", 60)
        result = subprocess.run(command, capture_output=True, text=True, **kwargs)
        if check and result.returncode:
            raise RuntimeError(f"{' '.join(command)}: {result.stderr}")
        return result

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, Reason, Restarts, RunTime, StartTime, NodeList, ...)."""
        line = self.cli("scontrol", "show", "job", "-o", job_id).stdout
        return dict(re.findall(r"(\w+)=(\S*)", line))

    def wait_job(self, job_id: str, log: Path, done, what: str, timeout: float = JOB_TIMEOUT_S) -> dict[str, str]:
        """Poll the job until ``done(state)``; its state changes are kept in ``self.history[job_id]``."""
        history = self.history.setdefault(job_id, [])
        deadline = time.monotonic() + timeout
        while True:
            state = self.job(job_id)
            seen = (state["JobState"], state.get("Reason"), state.get("Restarts"))
            if not history or history[-1][1:] != seen:
                history.append((time.monotonic(), *seen))
            if done(state):
                return state
            ended = state["JobState"] in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
            message = f"job {job_id} never reached {what}: {self.transitions(job_id)}\n" + tail(log)
            assert not ended and time.monotonic() < deadline, message
            time.sleep(0.3)

    def transitions(self, job_id: str) -> str:
        """``RUNNING(None) +0.0s -> PENDING(BeginTime, restarts 1) +0.4s -> ...``: what the polls saw, when."""
        history = self.history.get(job_id, [])
        return " -> ".join(
            f"{state}({reason}{', restarts ' + restarts if restarts != '0' else ''}) +{t - history[0][0]:.1f}s"
            for t, state, reason, restarts in history
        )

    def stop(self) -> None:
        """Cancel every job (slurmd ends its processes), stop the daemons, then kill whatever the jobs left behind."""
        if self.daemons and all(p.poll() is None for p in self.daemons):
            with contextlib.suppress(Exception):
                self.cli("scancel", "--user", self.user, check=False, timeout=10)
                deadline = time.monotonic() + 15
                while self.cli("squeue", "-h", check=False, timeout=10).stdout.strip() and time.monotonic() < deadline:
                    time.sleep(0.5)
        for process in reversed(self.daemons):
            stop(process)
        for log in self.logs:
            log.close()
        for pid in processes_with_env(f"SLURM_CONF={self.conf}".encode()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def tail(log: Path, chars: int = 4000) -> str:
    return log.read_text(errors="replace")[-chars:] if log.exists() else f"(no log {log})"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[LocalCluster]:
    base = tmp_path_factory.mktemp("slurm")
    short = None
    if len(str(base)) > 60:  # unix sockets (munge, slurmd) must stay within 108 characters
        base = short = Path(tempfile.mkdtemp(prefix="slurm-"))
    cluster = LocalCluster(base)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        if short is not None:
            shutil.rmtree(short, ignore_errors=True)


@pytest.fixture(scope="module")
def dataset(cluster) -> Path:
    from scripts.data.prepare import prepare
    from scripts.data.synthetic import generate

    generate(cluster.base / "data", num_cases=NUM_CASES, shape=(64, 64, 24), seed=7)
    # prepared here, in one process: the launchers' prepare step then finds it up to date (as on a re-run)
    prepare(cluster.base / "data", cluster.base / "prepared", num_workers=1)
    return cluster.base / "data"


def submit(
    cluster: LocalCluster, script: str, sbatch_args: list[str], env: dict[str, str], overrides: list[str],
    log: Path | None = None,
) -> tuple[str, Path]:  # fmt: skip
    """``sbatch`` from the bundle root, as a user types it; returns the job id and its log file (``log``: its name or
    pattern, e.g. ``slurm-%x-%A_%a.out``; default: the script's name ``.out``, in the cluster's folder)."""
    name = Path(script).stem
    log = log or cluster.base / f"{name}.out"
    command = ["sbatch", "--parsable", f"--output={log}", *sbatch_args, f"scripts/slurm/{script}", *overrides]
    result = cluster.cli(*command, cwd=ROOT, env={**cluster.env, **env})
    return result.stdout.strip().split(";")[0], log


def user_env(cluster: LocalCluster, dataset: Path, out: Path) -> dict[str, str]:
    """The submitting shell's environment: this interpreter's bin first on PATH, as in an activated venv."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])
    env = {"PATH": path, "DATASET_DIR": str(dataset), "PREPARED_DIR": str(cluster.base / "prepared"),
           "OUTPUT_DIR": str(out), "EXTRA_ARGS": EXTRA_ARGS, "OMP_NUM_THREADS": "1"}  # fmt: skip
    return with_shims(cluster, env)


def with_shims(cluster: LocalCluster, env: dict[str, str]) -> dict[str, str]:
    """``env`` with the tests' ``python`` and ``torchrun`` first on PATH (tests/zygote.py's shims): each python process
    of the job, torchrun's ranks too, forked from the tests' zygote, which has imported torch and MONAI (a job's
    ``python`` would spend ~7 s on those imports, every run and requeue). The launchers run unchanged; the two-node job
    (``--export`` without ALL: its batch shell activates VENV) runs the venv's own."""
    return {**env, **zygote.shims(cluster.base / "bin", {**os.environ, **env})}


def times(state: dict[str, str]) -> str:
    return " ".join(f"{k}={state.get(k)}" for k in ("JobState", "Restarts", "ExitCode", "RunTime", "NodeList"))


def test_single_node_job_requeued_mid_epoch_resumes_and_completes(cluster, dataset, two_node_job):
    """2 ranks on one node. USR1 to the batch shell during epoch 2 (what ``--signal=B:USR1@120`` sends before the
    time limit) requeues the job; its second run resumes from the epoch-1 checkpoint and ends at max_epochs. A second
    USR1 (MAX_REQUEUES=1 reached) leaves that run alone."""
    out = cluster.base / "single"
    # validation (and so the best model) at epoch 2 only, in the second run
    overrides = [*BUNDLE_OVERRIDES, "--max_epochs", "2", "--val_interval", "2", "--model_path", str(out / "model.pt")]
    env = {**user_env(cluster, dataset, out), "MAX_REQUEUES": "1"}
    job, log = submit(cluster, "train_single_node.sbatch", ["--gpus-per-node=2"], env, overrides)
    latest = out / "checkpoints" / "latest.pt"
    cluster.wait_job(job, log, lambda s: latest.exists(), "the epoch-1 checkpoint")
    cluster.cli("scancel", "--batch", "--signal=USR1", job)
    cluster.wait_job(job, log, lambda s: "resumed from" in log.read_text(), "a second run resuming training")
    cluster.cli("scancel", "--batch", "--signal=USR1", job)
    final = cluster.wait_job(job, log, lambda s: s["JobState"] == "COMPLETED", "COMPLETED")
    print(f"\njob {job}: {cluster.transitions(job)}\n  {times(final)} Submit={final['SubmitTime']} "
          f"Start={final['StartTime']} End={final['EndTime']}")  # fmt: skip

    text = log.read_text()
    assert final["Restarts"] == "1" and final["ExitCode"] == "0:0", times(final)
    first, _, second = text.partition(f"slurm: job {job} run 2 ")
    assert second, f"the log holds no second run of job {job}:\n{text[-3000:]}"
    assert f"requeueing job {job}" in first, "the USR1 trap requeued the job"
    assert "Epoch[2] Complete" not in first, "the first run was stopped during epoch 2, not after it"
    resumed = "resumed from" in second and "epoch 1" in second.split("resumed from", 1)[1].splitlines()[0]
    assert resumed, "the second run continued from the epoch-1 checkpoint"
    assert "Epoch[2] Complete" in second
    assert f"job {job} was requeued 1 times (MAX_REQUEUES): not again" in second, "the second USR1 was ignored"
    for rank in (0, 1):
        assert f"process group: rank {rank} of 2" in second, f"rank {rank} missing from the log"
    import torch

    state = torch.load(latest, weights_only=True)
    assert state["trainer"]["epoch"] == 2, "training ended at max_epochs"
    assert (out / "model.pt").is_file(), "the best weights were written to --model_path"


@pytest.fixture(scope="module")
def two_node_job(cluster, dataset) -> tuple[str, Path, Path, int]:
    """The two-node job, submitted once, before the single-node test starts: the two run side by side (much of a
    job's wall time is start-up and the requeue's wait), which keeps this module within its time budget.

    Submitted with ``--export=VAR,...`` (no ALL): the batch shell activates VENV and srun passes its environment on.
    """
    out = cluster.base / "multi"
    port = free_port()
    env = user_env(cluster, dataset, out)
    settings = {"DATASET_DIR": env["DATASET_DIR"], "PREPARED_DIR": env["PREPARED_DIR"], "OUTPUT_DIR": str(out),
                "RDZV_PORT": str(port), "LOGLEVEL": "INFO", "OMP_NUM_THREADS": "1"}  # fmt: skip
    if (Path(sys.prefix) / "bin" / "activate").is_file():
        export = ",".join([f"VENV={sys.prefix}", *(f"{k}={v}" for k, v in settings.items())])
        env = {"EXTRA_ARGS": EXTRA_ARGS}  # taken by name below: it holds spaces
        export += ",EXTRA_ARGS"
    else:  # no venv to activate: the job needs the caller's PATH
        export = ",".join(["ALL", *(f"{k}={v}" for k, v in settings.items())])
    # one epoch, no validation (val_interval 2): the rendezvous and a DDP step across the nodes are what count here
    overrides = [*BUNDLE_OVERRIDES, "--max_epochs", "1", "--val_interval", "2", "--model_path", str(out / "model.pt")]
    job, log = submit(cluster, "train_multi_node.sbatch", ["--nodes=2", "--gpus-per-node=1", f"--export={export}"],
                      env, overrides)  # fmt: skip
    return job, log, out, port


def test_two_node_job_meets_at_rendezvous_and_completes(cluster, two_node_job):
    """One torchrun per node (srun), one rank each: the c10d rendezvous on the first node's NodeAddr forms."""
    job, log, out, port = two_node_job
    final = cluster.wait_job(job, log, lambda s: s["JobState"] == "COMPLETED", "COMPLETED")
    print(f"\njob {job}: {cluster.transitions(job)}\n  {times(final)} Submit={final['SubmitTime']} "
          f"Start={final['StartTime']} End={final['EndTime']}")  # fmt: skip

    text = log.read_text()
    assert final["NodeList"] == "n[1-2]" and final["ExitCode"] == "0:0", times(final)
    assert f"rendezvous at 127.0.0.1:{port} (first node n1)" in text, "the first node's NodeAddr is the endpoint"
    agents = (set(re.findall(r"group_rank=(\d+)", text)), set(re.findall(r"group_world_size=(\d+)", text)))
    assert agents == ({"0", "1"}, {"2"}), f"both torchrun agents joined one rendezvous of two nodes:\n{text[-3000:]}"
    for rank in (0, 1):
        assert f"process group: rank {rank} of 2" in text, f"rank {rank} missing from the log"
    assert (out / "checkpoints" / "latest.pt").is_file(), "the epoch was trained and checkpointed"


COHORT = ("LUNG1-001", "LUNG1-002", "LUNG1-003", "LUNG1-004")  # two CTs of 24 slices, then two of 48
# kill -9 of the run as the network runs on a case, in a task's first run only (a requeued run has SLURM_RESTART_COUNT)
KILL_ONCE = """\
evaluator#inferer:
  _target_: faults.KilledPredicting
  inferer: "@sliding_window_inferer"
  marker: "$'{case}' if os.environ.get('SLURM_RESTART_COUNT', '0') == '0' else '(none: a requeued run)'"
"""


def progress(part: int, done: int, total: int) -> re.Pattern:
    """The line a part logs as each case ends, in its task's output file."""
    return re.compile(rf"part {part} of 2: {done}/{total} cases \(0 failed\), [\d.]+ s per case, about .*\d s left")


def test_inference_array_task_killed_then_requeued_resumes_and_one_report_holds_each_case_once(cluster, demo_run):
    """``sbatch --array=0-1`` of infer_array.sbatch on four CTs: tasks 0 and 1 run parts 0 and 1 of 2 side by side.
    Task 1's python is killed (kill -9, a fault of its first run only) as the network runs on its second case: the task
    fails, ``scontrol requeue`` runs it again, and its second run takes the case the first finished as done earlier,
    infers the other and merges: the cohort's report holds every case once, done, each in its part."""
    from scripts.data.synthetic import write_case
    from scripts.inference.cohort import split

    base = cluster.base / "cohort"
    inputs, out = base / "in", base / "out"
    slices = {case: 24 * (1 + k // 2) for k, case in enumerate(COHORT)}
    for k, case in enumerate(COHORT):
        write_case(inputs / case, case, 91 + k, (96, 96, slices[case]), (1.0, 1.0), tumour_hu=400)
    parts = split(slices, 2)  # what each task computes: a small and a large CT each
    finished, killed = [case for case in COHORT if parts[case] == 1]  # task 1's cases, in the order it infers them
    fault = base / "kill_once.yaml"
    fault.write_text(KILL_ONCE.format(case=killed))
    # the submitting shell: the venv's bin first on PATH; tests/ on PYTHONPATH for the fault; one thread per task
    env = {"PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}  # fmt: skip
    env = with_shims(cluster, env)
    config = str(["configs/inference.yaml", "configs/demo.yaml", str(fault)])
    # the network in PyTorch: the CPU runtime's export would add its minutes to the suite, not to what is tested here
    overrides = ["--config_file", config, "--model_path", str(demo_run[0] / "run" / "model.pt"),
                 "--inference_backend", "torch"]  # fmt: skip
    sbatch = ["--array=0-1", f"--export=ALL,INPUT_DIR={inputs},OUTPUT_DIR={out}"]
    # the script's own file names (one per task, appended to by each run), in the cluster's folder
    job, _ = submit(cluster, "infer_array.sbatch", sbatch, env, overrides, log=cluster.base / "slurm-%x-%A_%a.out")
    tasks = [f"{job}_{k}" for k in (0, 1)]
    logs = [cluster.base / f"slurm-nsclc-infer-{task}.out" for task in tasks]

    ended = cluster.wait_job(tasks[1], logs[1], lambda s: s["JobState"] in ("FAILED", "COMPLETED"), "its end")
    assert ended["JobState"] == "FAILED", f"the fault killed task 1's first run: {times(ended)}\n{tail(logs[1])}"
    assert (out / finished / f"{finished}_run.json").is_file(), f"{finished} was done before the kill"
    assert not (out / killed).exists(), f"{killed} was not"
    cluster.cli("scontrol", "requeue", tasks[1])
    final = [cluster.wait_job(task, log, lambda s: s["JobState"] == "COMPLETED", "COMPLETED")
             for task, log in zip(tasks, logs)]  # fmt: skip
    for task, state in zip(tasks, final):
        print(f"\ntask {task}: {cluster.transitions(task)}\n  {times(state)} Start={state['StartTime']} "
              f"End={state['EndTime']}")  # fmt: skip
    assert [(s["Restarts"], s["ExitCode"]) for s in final] == [("0", "0:0"), ("1", "0:0")], [times(s) for s in final]

    text = [log.read_text() for log in logs]
    first, _, second = text[1].partition(f"slurm: array job {job} task 1 run 2 ")
    assert second, f"task 1's log holds no second run:\n{text[1][-3000:]}"
    assert f"slurm: array job {job} task 1 run 1 " in first and "part 1 of 2, " in first
    assert re.search(r"\d+ Killed .*python -m monai.bundle run inference", first), "kill -9 of its python"
    assert "part 1 of 2: 2 case(s) of 4; 0 done earlier" in first
    assert progress(1, 1, 2).search(first) and not progress(1, 2, 2).search(first), "killed in its second case"
    assert "part 1 of 2: 2 case(s) of 4; 1 done earlier with the same weights and settings, 1 to infer" in second
    assert progress(1, 1, 1).search(second), f"the requeued run inferred the other case:\n{second[-3000:]}"
    assert "part 0 of 2: 2 case(s) of 4; 0 done earlier" in text[0] and " run 2 " not in text[0]
    assert progress(0, 1, 2).search(text[0]) and progress(0, 2, 2).search(text[0]), text[0][-3000:]

    merged = json.loads((out / "inference_report.json").read_text())
    cases = merged["cases"]
    assert [c["case_id"] for c in cases] == list(COHORT) and merged["num_done"] == 4, cases
    assert {c["case_id"]: (c["status"], c["part"]) for c in cases} == {c: ("done", f"{parts[c]}-of-2") for c in COHORT}
    assert [c["case_id"] for c in cases if c.get("earlier")] == [finished], "the requeued run did it once only"
    assert merged["num_parts"] == 2 and set(merged["parts"]) == {"0-of-2", "1-of-2"}, merged["parts"]
    assert all(p["ended"] for p in merged["parts"].values()) and merged["parts"]["1-of-2"]["inferred"] == 1
    rows = list(csv.DictReader((out / "report.csv").open()))
    assert sorted(r["case"] for r in rows) == list(COHORT), "one row per case (one GTV each)"
    assert not [p.name for p in out.iterdir() if p.name.startswith((".partial-", ".old-"))], "the kill's leftovers"

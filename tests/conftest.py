"""Shared fixtures: synthetic TCIA-layout cases are written once per session, the demo is trained once, and every
workflow test reuses them. Bundle runs start from a folder that is not the bundle (``--bundle_root`` names it), as the
model zoo and SLURM jobs run them; the demo alone runs from the bundle root with relative paths, as the README says.
Each :func:`bundle_run` is a process of its own, forked from a zygote (tests/zygote.py) that imported torch and MONAI
once: a ``python -m monai.bundle`` process spends ~6 s on those imports before it reads its config.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import zygote

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
# two cores: keep torch from oversubscribing them when tests start worker processes, and let idle OpenMP threads
# sleep rather than spin (a spinning thread of one process starves the other process on the other core)
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

SMALL_SHAPE = (64, 64, 24)
# tiny_data's cases: a run of demo.yaml on them must say so (--demo_cases, --demo_shape), or its acquire_data step
# writes the demo's 10 cases into the shared folder, and every later test on that worker trains on other data
TINY_CASES, TINY_SHAPE = 4, (48, 48, 24)


def configs(*names: str) -> str:
    """A ``--config_file`` value: the bundle's configs by absolute path, in order."""
    return str([str(ROOT / "configs" / name) for name in names])


DEMO = configs("train.yaml", "demo.yaml")
# The demo as shipped runs 8 epochs (2 min 58 s to 4 min 27 s here, measured for the README); its best validation Dice
# comes at epoch 2 already (0.910 in the 8-epoch run, 0.912 in a 4-epoch one), so the tests train the first 2 epochs of
# a 4-epoch schedule (the learning rate's cosine spans DEMO_SCHEDULE_EPOCHS): the same weights at epoch 2 as the 4-epoch
# run (validation Dice 0.9115463 in both, seeded), in a quarter of the shipped time, and the same bar (Dice > 0.85) as
# the README's figure. (Two epochs on a 2-epoch schedule decay the rate sooner: Dice 0.849.)
DEMO_TEST_EPOCHS = 2
DEMO_SCHEDULE_EPOCHS = 4
# Tests of mechanics (resume, DDP restarts, profiling, SLURM launches) do not depend on the network:
# a small BasicUNet steps ~6x faster than the demo's SwinUNETR on this CPU (0.27 s against 1.6 s per patch).
MECHANICS_NETWORK = (
    "{'_target_': 'BasicUNet', 'spatial_dims': 3, 'in_channels': 1, 'out_channels': '@num_classes', "
    "'features': [8, 8, 16, 16, 32, 8]}"
)


@pytest.fixture(scope="session")
def root() -> Path:
    return ROOT


@pytest.fixture(scope="session", autouse=True)
def nothing_written_under_the_default_dataset_dir() -> Iterator[None]:
    """No test writes under train.yaml's default ``dataset_dir`` (a user's real data may live there, and a folder left
    there changes what later tests of configs left at their defaults read): every test names its own folders."""
    import yaml

    default = Path(yaml.safe_load((ROOT / "configs" / "train.yaml").read_text())["dataset_dir"])
    existed = default.exists()
    yield
    assert existed or not default.exists(), f"a test wrote under the default dataset_dir {default}: name a folder"


@pytest.fixture(scope="session")
def small_cases(tmp_path_factory) -> tuple[Path, list[dict]]:
    """Four small synthetic cases in the TCIA layout, with their truth."""
    from scripts.data.synthetic import generate

    out = tmp_path_factory.mktemp("small_cases")
    truths = generate(out, num_cases=4, shape=SMALL_SHAPE, seed=100)
    return out, truths


def bundle_run(
    *args: str, cwd: Path | None = None, timeout: int = 900, with_faults: bool = False, command: str = "run"
) -> subprocess.CompletedProcess:
    """``python -m monai.bundle run ...`` as a user types it, from ``cwd`` (default: a folder outside the bundle, so
    ``--bundle_root`` is added). ``with_faults``: the configs may name ``faults.<name>`` (tests/faults.py).
    ``command``: MONAI's subcommand (``ckpt_export``, ...), ``run`` unless given.

    The run is a process of its own with this argv, ``cwd`` and environment, but forked from this worker's zygote
    (tests/zygote.py), which imported torch and MONAI once: a ``python -m monai.bundle`` process spends ~6 s on those
    imports, and the workflow tests start dozens. What comes back is what ``subprocess.run`` gives (a run killed by
    SIGKILL: returncode -9; past ``timeout``: killed, TimeoutExpired). ``BUNDLE_RUN_SUBPROCESS=1`` in the
    environment: every run a ``python -m monai.bundle`` process of its own, as typed (to check that the zygote
    changes nothing)."""
    argv = [command, *args]
    if cwd is None:
        cwd = foreign_folder()
        argv += ["--bundle_root", str(ROOT)]
    env = dict(os.environ)
    if with_faults:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "tests"), str(ROOT), env.get("PYTHONPATH")]))
    return zygote.run(argv, cwd, env, timeout)


def torchrun(options: list[str], args: list[str], env: dict | None = None) -> tuple[list[str], dict[str, str]]:
    """``python -m torch.distributed.run *options *args`` (``args``: ``-m monai.bundle ...``) as typed, and its
    environment (default: this process's), but each rank a process of its own forked from the tests' zygote
    (tests/zygote.py): torchrun's script is ``zygote.py --exec``, served by a zygote with the ranks' start-up settings
    (torchrun sets OMP_NUM_THREADS=1 where it starts several on a node and the variable is unset). A rank's
    ``python`` would spend ~7 s importing torch and MONAI, every start and restart."""
    env = dict(os.environ if env is None else env)
    per_node = re.search(r"--nproc[_-]per[_-]node[= ](\d+)", " ".join(options))
    several = per_node is not None and int(per_node.group(1)) > 1
    ranks = {**env, "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1" if several else None)}
    script, variables = zygote.through(args, {k: v for k, v in ranks.items() if v is not None})
    return [sys.executable, "-m", "torch.distributed.run", *options, *script], {**env, **variables}


def workflow_run(*args: str, cwd: Path | None = None) -> None:
    """The ``monai.bundle run`` of ``args`` (as :func:`bundle_run` takes them) in this process, for a test that is not
    about the command line (a ``python -m monai.bundle`` process pays ~5 s importing MONAI): each value parsed as
    MONAI's command line parses it (fire's parser), the bundle named by ``--bundle_root``, from ``cwd`` (default: a
    folder that is not the bundle), and the process's logging left as it is. Raises what the run raises."""
    from fire.parser import DefaultParseValue
    from monai.bundle import run

    options: dict = {"bundle_root": str(ROOT)}
    positional, words = [], list(args)
    while words:
        word = words.pop(0)
        if word.startswith("--"):
            options[word[2:]] = DefaultParseValue(words.pop(0))
        else:
            positional.append(word)
    here = Path.cwd()
    os.chdir(cwd or foreign_folder())
    try:
        run(*positional, logging_file=False, **options)
    finally:
        os.chdir(here)


def foreign_folder() -> Path:
    """An empty folder that is not the bundle, made once per process (at import, before any test changes TMPDIR):
    bundle runs start there. Not the bundle's parent folder, whose contents no test controls (a folder named like a
    module there, e.g. ``dl``, is imported first by ``python -m`` and broke every run of a clone under a cluttered
    /tmp)."""
    _FOREIGN.mkdir(exist_ok=True)
    return _FOREIGN


_FOREIGN = Path(tempfile.mkdtemp(prefix="not-the-bundle-"))
atexit.register(shutil.rmtree, _FOREIGN, ignore_errors=True)


def tiny_dataset(tmp: Path, num_cases: int = TINY_CASES) -> Path:
    """``num_cases`` synthetic cases of ``TINY_SHAPE`` on the demo's 2 mm grid under ``tmp/data``, prepared into
    ``tmp/prepared`` with the default split; returns ``tmp``."""
    from scripts.data.prepare import prepare
    from scripts.data.synthetic import generate

    generate(tmp / "data", num_cases=num_cases, shape=TINY_SHAPE, seed=0, tumour_hu=400, pixel_spacing=2.0)
    prepare(tmp / "data", tmp / "prepared", num_workers=1, progress=False)
    return tmp


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Iterator[Path]:
    """Four 48x48x24 synthetic cases on the demo's 2 mm grid, prepared once (3 training, 1 validation): the data of
    every test of mechanics (resume, profiling, benchmark), one patch and a few seconds per step. Shared: a test
    that wrote more cases into it would change the data of the tests after it, so the session's end counts them."""
    tmp = tiny_dataset(tmp_path_factory.mktemp("tiny"))
    yield tmp
    written = sorted(p.stem for p in (tmp / "data" / "synthetic_truth").glob("*.json"))
    assert len(written) == TINY_CASES, f"a test wrote cases into the shared tiny_data folder: {written}"


def save_weights(network, path: Path, labels: tuple[str, ...] = ("GTV-1",)) -> Path:
    """``network``'s weights at ``path`` with the sidecar that says what they segment, as training writes them (for
    tests that need weights of the right shape, not trained ones)."""
    from scripts.training.weights import save_weights as save

    return save(network, path, labels)


def demo_args(tmp: Path, shrink: bool = True, config_file: str = DEMO, **overrides) -> list[str]:
    """The demo config pointed at a temporary folder; ``shrink``: a few small steps (for tests of mechanics)."""
    settings = {"dataset_dir": str(tmp / "data"), "prepared_dir": str(tmp / "prepared"), "output_dir": str(tmp / "run")}
    if shrink:
        settings.update(demo_cases=TINY_CASES, demo_shape=list(TINY_SHAPE), num_samples=1, val_interval=1)
    settings.update(overrides)
    args = ["--config_file", config_file]
    for key, value in settings.items():
        args += [f"--{key}", str(value)]
    return args


def train_workflow(configs_: list[str], demo_tmp: Path, output_dir: Path, workflow_type: str = "train", **overrides):
    """An initialised single-process ``ConfigWorkflow`` of ``configs_`` on the demo run's prepared data, built from a
    working directory that is not the bundle."""
    from monai.bundle import ConfigWorkflow

    workflow = ConfigWorkflow(
        config_file=[str(ROOT / "configs" / c) for c in configs_],
        workflow_type=workflow_type,
        bundle_root=str(ROOT),
        dataset_dir=str(demo_tmp / "data"),
        prepared_dir=str(demo_tmp / "prepared"),
        output_dir=str(output_dir),
        acquire_data="$None",
        **overrides,
    )
    workflow.initialize()
    workflow.parser.get_parsed_content("scripts")  # the run's first step: the bundle's Python, found via bundle_root
    return workflow


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory, root):
    """The demo as a user runs it from the bundle root (10 cases), only its folders moved to a temporary place and
    the first ``DEMO_TEST_EPOCHS`` epochs of a ``DEMO_SCHEDULE_EPOCHS``-epoch schedule. Trained once per test session
    in the session's shared folder, under a file lock: by the controller from the start when the whole suite runs
    (:func:`pytest_configure`), else by the first worker that needs it while the other waits; then each reads it."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    kept = json.loads(train_demo(shared).read_text())
    result = subprocess.CompletedProcess(kept["args"], kept["returncode"], kept["stdout"], kept["stderr"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return shared / "demo", result, kept["before"]


_DEMO_TRAINING: list[subprocess.Popen] = []  # the controller's demo training, ended with the session if still running


def train_demo(shared: Path) -> Path:
    """``shared/demo.json``, the record of the demo trained into ``shared/demo`` (trained here unless another process
    of this session has done it or is doing it: the lock waits for it)."""
    from filelock import FileLock

    tmp, record = shared / "demo", shared / "demo.json"
    with FileLock(str(shared / "demo.lock")):
        if not record.exists():
            model_zoo_weights = ROOT / "models" / "model.pt"
            before = model_zoo_weights.stat().st_mtime_ns if model_zoo_weights.exists() else None
            schedule = {"lr_scheduler#t_total": f"${DEMO_SCHEDULE_EPOCHS} * len(@train#dataloader)"}
            args = demo_args(tmp, shrink=False, config_file="['configs/train.yaml','configs/demo.yaml']",
                             max_epochs=DEMO_TEST_EPOCHS, **schedule)  # fmt: skip
            command = [sys.executable, "-m", "monai.bundle", "run", *args]
            process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            _DEMO_TRAINING.append(process)
            stdout, stderr = process.communicate(timeout=900)
            record.write_text(json.dumps({"args": command, "returncode": process.returncode, "stdout": stdout,
                                          "stderr": stderr, "before": before}))  # fmt: skip
    return record


#: the files that take a minute or more and do not wait for the demo's weights, largest first: pytest-xdist hands the
#: files out in collection order (``--dist loadfile``), so these go first (while the demo trains) and the short files
#: last, where they fill whichever worker ends first; in the alphabet's order the long files met at the end
LONG_FIRST = ("test_workflow_cross_validation.py", "test_monailabel.py", "test_node.py", "test_workflow_multi_gpu.py",
              "test_compilation.py", "test_model_zoo.py", "test_dicomweb.py", "test_deploy.py",
              "test_workflow_benchmark.py", "test_gpu_proof.py", "test_bench_inference.py")  # fmt: skip
#: the long files that use the demo's weights, next
LONG_WITH_DEMO = ("test_workflow_inference.py", "test_slurm.py", "test_workflow_cohort.py", "test_workflow_train.py",
                  "test_workflow_evaluate.py", "test_workflow_export.py")  # fmt: skip


def pytest_collection_modifyitems(config, items) -> None:
    """Tests marked gpu are skipped, with the reason, where torch sees no CUDA/ROCm device; the long files first
    (:data:`LONG_FIRST`, :data:`LONG_WITH_DEMO`), each file's tests in their order."""
    rank = {name: k for k, name in enumerate(LONG_FIRST + LONG_WITH_DEMO)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu:
        import torch

        if not torch.cuda.is_available():
            for item in gpu:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA/ROCm GPU"))


@pytest.hookimpl(trylast=True)
def pytest_configure(config) -> None:
    """The whole suite on pytest-xdist's workers: the controller, idle while they run, trains the demo from the start
    (in a thread; the training is its own process) instead of the first worker that needs it, while the other worker
    waits on its lock. A run of chosen files or tests trains it when a test first asks."""
    whole = config.args_source == pytest.Config.ArgsSource.TESTPATHS and not config.option.keyword
    workers = getattr(config.option, "numprocesses", None)
    if hasattr(config, "workerinput") or not whole or not workers or config.option.markexpr:
        return
    shared = config._tmp_path_factory.getbasetemp()
    threading.Thread(target=train_demo, args=(shared,), name="demo training", daemon=True).start()


def pytest_unconfigure(config) -> None:
    for process in _DEMO_TRAINING:
        if process.poll() is None:
            process.kill()

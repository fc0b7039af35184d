"""Shared fixtures: synthetic TCIA-layout cases are written once per test session and reused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
# two cores: keep torch from oversubscribing them when tests start worker processes
os.environ.setdefault("OMP_NUM_THREADS", "2")

SMALL_SHAPE = (64, 64, 24)


@pytest.fixture(scope="session")
def root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def small_cases(tmp_path_factory) -> tuple[Path, list[dict]]:
    """Four small synthetic cases in the TCIA layout, with their truth."""
    from scripts.synthetic import generate

    out = tmp_path_factory.mktemp("small_cases")
    truths = generate(out, num_cases=4, shape=SMALL_SHAPE, seed=100)
    return out, truths


DEMO = "['configs/train.yaml','configs/demo.yaml']"


def bundle_run(root: Path, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """``python -m monai.bundle run ...`` from the bundle root, as a user types it."""
    result = subprocess.run(
        [sys.executable, "-m", "monai.bundle", "run", *args],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return result


def demo_args(tmp: Path, shrink: bool = True, **overrides) -> list[str]:
    """The demo config pointed at a temporary folder; ``shrink``: a few small steps (for tests of mechanics)."""
    settings = {"dataset_dir": str(tmp / "data"), "prepared_dir": str(tmp / "prepared"), "output_dir": str(tmp / "run")}
    if shrink:
        settings.update(demo_cases=5, demo_shape="[96,96,32]", num_samples=1, val_interval=1)
    settings.update(overrides)
    args = ["--config_file", DEMO]
    for key, value in settings.items():
        args += [f"--{key}", str(value)]
    return args


def train_workflow(root: Path, configs: list[str], demo_tmp: Path, output_dir: Path):
    """An initialised single-process ``ConfigWorkflow`` of ``configs`` on the demo run's prepared data."""
    from monai.bundle import ConfigWorkflow

    workflow = ConfigWorkflow(
        config_file=[str(root / c) for c in configs],
        meta_file=str(root / "configs" / "metadata.json"),
        workflow_type="train",
        bundle_root=str(root),
        dataset_dir=str(demo_tmp / "data"),
        prepared_dir=str(demo_tmp / "prepared"),
        output_dir=str(output_dir),
        acquire_data="$None",
    )
    workflow.initialize()
    return workflow


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory, root):
    """The demo exactly as a user runs it (10 cases, 10 epochs), only its folders moved to a temporary place."""
    tmp = tmp_path_factory.mktemp("demo")
    model_zoo_weights = root / "models" / "model.pt"
    before = model_zoo_weights.stat().st_mtime_ns if model_zoo_weights.exists() else None
    result = bundle_run(root, *demo_args(tmp, shrink=False))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return tmp, result, before

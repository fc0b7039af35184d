"""Shared fixtures: synthetic TCIA-layout cases are written once per test session and reused."""

from __future__ import annotations

import os
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

"""The code passes the MONAI model zoo's own style checks, run with the zoo's settings (its setup.cfg and
runtests.sh): black with --skip-magic-trailing-comma, isort with the black profile from outside the bundle (where
`scripts` and `benchmarks` are third-party names), flake8 with bugbear, comprehensions, executable and pep8-naming.
ruff, which CI runs first, is configured to enforce the same (pyproject.toml); this test keeps the two in step."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
from conftest import ROOT

PYTHON = ["scripts", "benchmarks", "tests"]
FLAKE8_IGNORE = "E203,E501,E741,W503,W504,C408,N812,B023,B905,B028,B907,C419"


def run(*args: str, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module", autouse=True)
def tools():
    for module in ("black", "isort", "flake8"):
        pytest.importorskip(module, reason=f"{module} (requirements-dev.txt) runs the model zoo's style checks")


def test_black_as_the_model_zoo_runs_it():
    result = run("black", "--check", "--skip-magic-trailing-comma", "-l", "120", *PYTHON)
    assert result.returncode == 0, result.stderr[-3000:]


def test_isort_as_the_model_zoo_runs_it(tmp_path):
    # the zoo's settings from a folder of their own, so our pyproject.toml cannot make `scripts` first-party
    paths = [str(ROOT / p) for p in PYTHON]
    (tmp_path / ".isort.cfg").write_text("[settings]\nprofile = black\nline_length = 120\nknown_first_party = models\n")
    result = run("isort", "--check", "--settings-path", str(tmp_path), *paths, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def test_flake8_as_the_model_zoo_runs_it():
    if not shutil.which("flake8") and run("flake8", "--version").returncode:
        pytest.skip("flake8 is not installed")
    result = run("flake8", "--select", "B,C,E,F,N,P,T4,W,B9", "--ignore", FLAKE8_IGNORE, "--max-line-length", "120",
                 "--per-file-ignores", "__init__.py:F401,__main__.py:F401", *PYTHON)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:]

"""A CLI *is* its API function: ``command`` keeps the function's signature and docstring (what ``fire`` turns into
``--help``), turns the listed errors into ``<name>: <message>`` without a traceback, and makes the report's status the
exit status. The bundle's two CLIs show their API's parameters in ``--help`` and fail on a bad argument with one line.
"""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
from scripts.common.cli import command
from scripts.data.prepare import prepare
from scripts.data.tcia import download


def convert(dataset_dir: str, limit: int | None = None, *, dry_run: bool = False) -> dict:
    """Convert the cases in ``dataset_dir``.

    Args:
        dataset_dir: where the cases are.
        limit: at most this many.
    """
    if limit == 0:
        raise ValueError("limit must be positive")
    if limit == -1:
        raise KeyError("a programming error")
    return {"dataset_dir": dataset_dir, "limit": limit, "dry_run": dry_run}


class Report:
    def __init__(self, status: int | None = None) -> None:
        self.status, self.results = status, []

    def __call__(self, result) -> int | None:
        self.results.append(result)
        return self.status


def test_wrapped_function_keeps_its_signature_and_docstring():
    cli = command(convert, Report())
    assert inspect.signature(cli) == inspect.signature(convert)
    assert cli.__doc__ == convert.__doc__ and cli.__name__ == "convert"


def test_success_passes_arguments_through_and_returns_none():
    report = Report()
    assert command(convert, report)("/data", limit=3, dry_run=True) is None
    assert report.results == [{"dataset_dir": "/data", "limit": 3, "dry_run": True}]


def test_ctrl_c_is_one_line_and_status_130_not_a_traceback(capsys):
    def interrupted(dataset_dir: str) -> dict:
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as exit_info:
        command(interrupted, Report(), name="prepare")("/data")
    assert exit_info.value.code == 130
    assert exit_info.value.__suppress_context__, "no chained traceback"
    assert "prepare: interrupted." in capsys.readouterr().err


def test_listed_error_becomes_a_one_line_exit_named_after_the_function():
    report = Report()
    with pytest.raises(SystemExit) as exit_info:
        command(convert, report)("/data", limit=0)
    assert exit_info.value.code == "convert: limit must be positive"
    assert exit_info.value.__cause__ is None and exit_info.value.__suppress_context__, "no chained traceback"
    assert report.results == [], "nothing is reported for a failed run"


def test_error_prefix_is_the_given_name():
    with pytest.raises(SystemExit) as exit_info:
        command(convert, Report(), errors=(KeyError, ValueError), name="tool")("/data", limit=-1)
    assert exit_info.value.code == "tool: 'a programming error'"


def test_unlisted_error_is_raised_as_it_is():
    with pytest.raises(KeyError, match="a programming error"):
        command(convert, Report(), errors=(ValueError,))("/data", limit=-1)


@pytest.mark.parametrize("status", [1, 2])
def test_report_status_becomes_the_exit_status(status):
    with pytest.raises(SystemExit) as exit_info:
        command(convert, Report(status))("/data")
    assert exit_info.value.code == status


def test_report_status_zero_is_success():
    assert command(convert, Report(0))("/data") is None


def run_module(root, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=root, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL
    )


@pytest.mark.parametrize(
    ("args", "function"),
    [(("scripts.prepare", "--help"), prepare), (("scripts.tcia", "download", "--help"), download)],
    ids=["prepare", "tcia-download"],
)
def test_help_lists_the_api_parameters(root, args, function):
    result = run_module(root, *args)
    assert result.returncode == 0, result.stderr[-2000:]
    shown = result.stdout + result.stderr  # fire writes help to stderr when it is not a terminal
    parameters = list(inspect.signature(function).parameters)
    assert len(parameters) >= 5
    for parameter in parameters:
        assert parameter.upper() in shown, f"{parameter} missing from {' '.join(args)}"
    assert function.__doc__.splitlines()[0].strip()[:40] in shown


def test_bad_argument_exits_1_with_one_line_and_no_traceback(root, tmp_path):
    result = run_module(root, "scripts.tcia", "download", "--dataset_dir", str(tmp_path), "--limit", "0")
    assert result.returncode == 1
    assert "tcia: limit must be a positive integer" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert list(tmp_path.iterdir()) == [], "nothing was written"


def test_the_bundle_error_inside_monais_wrapper_is_found_whatever_its_class():
    """monai.bundle run wraps what a config expression raises in a RuntimeError: the bundle's own error is found in
    the chain, one of its classes (ConfigError) or a built-in class raised by its code (prepare's ValueError); an
    error no bundle code raised is not."""
    from scripts.common.cli import bundle_error
    from scripts.common.config import ConfigError
    from scripts.data.dataset import fold_cases

    def wrapped(call):
        try:
            try:
                call()
            except Exception as err:
                raise RuntimeError("Failed to evaluate ConfigExpression: ...") from err
        except RuntimeError as err:
            return err

    error = wrapped(lambda: fold_cases([{"fold": 0}], 7, held_out=True))
    assert isinstance(bundle_error(error), ConfigError) and "fold=7" in str(bundle_error(error))
    error = wrapped(lambda: prepare("nowhere", "out", label_source="mask"))
    assert type(bundle_error(error)) is ValueError and "label_source='mask'" in str(bundle_error(error))
    assert bundle_error(wrapped(lambda: int("x"))) is None and bundle_error(None) is None


def test_a_failed_bundle_run_ends_with_the_bundles_message_after_the_traceback(root):
    """The excepthook the configs install: Python's traceback as before, then the bundle's message as the last line;
    an error of the bundle that is not wrapped (its own message already ends the traceback) is not repeated; Ctrl-C
    is one line, not a traceback."""
    code = (
        "import scripts.common.cli as cli, scripts.common.config as config\n"
        "cli.summarise_errors(); cli.summarise_errors()\n"
        "try:\n    config.check_roi_size([64, 64, 40])\n"
        "except Exception as err:\n    raise RuntimeError('Failed to evaluate ConfigExpression') from err\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and "Traceback (most recent call last):" in result.stderr
    assert lines[-1].startswith("ConfigError: roi_size=[64, 64, 40]: each side must be a multiple of 32")
    assert lines[-3] == "RuntimeError: Failed to evaluate ConfigExpression", "MONAI's line, then the bundle's"
    bare = (
        "import scripts.common.cli as cli, scripts.common.config as config\n"
        "cli.summarise_errors()\nconfig.check_roi_size([40])\n"
    )
    result = subprocess.run([sys.executable, "-c", bare], cwd=root, capture_output=True, text=True, timeout=120)
    assert result.stderr.count("ConfigError: roi_size=[40]") == 1
    ctrl_c = "import scripts.common.cli as cli\ncli.summarise_errors()\nraise KeyboardInterrupt\n"
    result = subprocess.run([sys.executable, "-c", ctrl_c], cwd=root, capture_output=True, text=True, timeout=120)
    assert result.stderr.startswith("interrupted. Every file is written whole") and len(result.stderr.splitlines()) == 1
    assert result.returncode in (130, -2), "Python still ends as interrupted by SIGINT"

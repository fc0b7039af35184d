"""The bundle's command-line entry points: each CLI *is* an API function, wrapped, never a copy of its signature.

:func:`command` gives ``fire`` the function itself (its parameters and docstring are the CLI's ``--help``), with the
little a terminal needs around it: log lines on stdout, a progress bar that does not tear them, errors a user can act
on printed without a traceback, and an exit status. :func:`summarise_errors` does the same for ``monai.bundle run``,
whose errors reach the terminal wrapped in MONAI's own: after the traceback, the bundle's message comes last.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm.contrib.logging import logging_redirect_tqdm

#: the exit status of a command stopped by Ctrl-C (128 + SIGINT, as shells report it)
INTERRUPTED = 130
#: what a user is told after Ctrl-C
AFTER_CTRL_C = (
    "Every file is written whole or not at all (atomic writes): run the same command again to go on (training: "
    "with --resume true, from its last finished epoch)."
)
#: the bundle's Python: an error raised here names the setting or the file and what to do
PACKAGE = Path(__file__).resolve().parents[1]


def command(
    function: Callable[..., Any],
    report: Callable[[Any], int | None],
    errors: tuple[type[BaseException], ...] = (ValueError,),
    name: str = "",
) -> Callable[..., None]:
    """``function`` as a CLI: ``report(result)`` prints the outcome and returns the exit status (None or 0: success);
    ``errors`` are printed as ``<name>: <message>`` and exit with status 1; Ctrl-C prints one line and exits with
    :data:`INTERRUPTED`."""

    @functools.wraps(function)
    def cli(*args: Any, **kwargs: Any) -> None:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        try:
            with logging_redirect_tqdm():
                result = function(*args, **kwargs)
        except errors as err:
            raise SystemExit(f"{name or function.__name__}: {err}") from None
        except KeyboardInterrupt:  # Ctrl-C: one line, not the traceback of whichever wait it interrupted
            print(f"{name or function.__name__}: interrupted. {AFTER_CTRL_C}", file=sys.stderr)
            raise SystemExit(INTERRUPTED) from None
        status = report(result)
        if status:
            raise SystemExit(status)

    return cli


def printed(function: Callable[..., Any]) -> Callable[..., None]:
    """``function`` as a CLI that prints its own output: ``fire`` shows its parameters and docstring under ``--help``
    (a ``lambda **options`` hides them, and fire then passes ``help`` on as an option) and does not print the value it
    returns (the numbers it has already printed as a table)."""

    @functools.wraps(function)
    def cli(*args: Any, **kwargs: Any) -> None:
        function(*args, **kwargs)

    return cli


def fire_command(argv: list[str]) -> list[str]:
    """``argv`` for ``fire.Fire(..., command=...)``: a lone ``--help`` or ``-h`` as fire's own help flag
    (``-- --help``), which a function taking ``**overrides`` would otherwise receive as an override and run."""
    return ["--", "--help"] if argv in (["--help"], ["-h"]) else argv


def summarise_errors() -> None:
    """Make the last line of a failed ``monai.bundle run`` the bundle's own message.

    A setting or an input that cannot work raises one of the bundle's errors, whose message names the id or the file
    and what to do; MONAI's config wraps it ("RuntimeError: Failed to evaluate ConfigExpression", with the expression),
    so a 60-100 line traceback ended with MONAI's words and the useful line sat in its middle. The configs call this
    once, when the bundle's Python is first imported: Python's traceback is still printed, and then, when the error
    that ended the run wraps one of the bundle's, that one's class and message. Ctrl-C prints one line instead of the
    traceback of whichever wait it interrupted (Python still exits as interrupted: status 130). Idempotent."""
    previous = sys.excepthook
    if getattr(previous, "bundle_summary", False):
        return

    def hook(kind: type[BaseException], error: BaseException, traceback: Any) -> None:
        if issubclass(kind, KeyboardInterrupt):  # Ctrl-C: one line, as the bundle's other commands say it
            print(f"interrupted. {AFTER_CTRL_C}", file=sys.stderr)
            return
        previous(kind, error, traceback)
        ours = bundle_error(error)
        if ours is not None and ours is not error:
            print(f"\n{type(ours).__name__}: {ours}", file=sys.stderr)

    hook.bundle_summary = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def bundle_error(error: BaseException | None) -> BaseException | None:
    """The outermost error in ``error``'s chain (causes and contexts) that the bundle's own Python raised -- one of
    its classes, or any class raised by its code (a ``FileNotFoundError`` naming the weights) -- or None."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if type(error).__module__.split(".")[0] == PACKAGE.name or _raised_in(error, PACKAGE):
            return error
        error = error.__cause__ or error.__context__
    return None


def _raised_in(error: BaseException, folder: Path) -> bool:
    """Whether the innermost frame of ``error``'s traceback is code under ``folder``."""
    traceback = error.__traceback__
    if traceback is None:
        return False
    while traceback.tb_next is not None:
        traceback = traceback.tb_next
    return Path(traceback.tb_frame.f_code.co_filename).resolve().is_relative_to(folder)

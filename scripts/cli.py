"""The bundle's command-line entry points: each CLI *is* an API function, wrapped, never a copy of its signature.

:func:`command` gives ``fire`` the function itself (its parameters and docstring are the CLI's ``--help``), with the
little a terminal needs around it: log lines on stdout, a progress bar that does not tear them, errors a user can act
on printed without a traceback, and an exit status.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from typing import Any

from tqdm.contrib.logging import logging_redirect_tqdm

#: the exit status of a command stopped by Ctrl-C (128 + SIGINT, as shells report it)
INTERRUPTED = 130


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
            print(
                f"{name or function.__name__}: interrupted. Every file is written whole or not at all (atomic "
                "writes): run the same command again to go on.",
                file=sys.stderr,
            )
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

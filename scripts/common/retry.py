"""One retry policy for every client of a remote server: TCIA's NBIA API (scripts/data/tcia/client.py) and a DICOMweb
PACS (scripts/inference/dicomweb/client.py).

:meth:`RetryPolicy.call` runs an attempt; an attempt that raises :class:`TransientError` (the client's own judgement of
its library's error: a time-out, a cut connection, HTTP 5xx or 429, a corrupt transfer) is tried again after
``backoff_s``, then twice that, and so on (each wait up to 10 % longer, at random, so that many workers do not come
back at the same moment), never longer than :data:`MAX_WAIT_S`, or after the server's ``Retry-After`` when that asks
for longer (up to the same cap). Every retry is logged with the problem and the wait. After ``retries`` more attempts
it raises :class:`GaveUpError`, which the client turns into its own error saying what to do; any other error passes at
once. Setting ``cancelled`` (Ctrl-C in a download with several workers) ends the waits and raises
:class:`RetryCancelledError` before the next attempt.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")
#: more attempts after the first, by default (a flaky connection has recovered by the fourth)
RETRIES = 4
#: the longest wait between two attempts, whatever the back-off or a Retry-After header asks for
MAX_WAIT_S = 60.0
#: each wait is up to this share longer, at random
JITTER = 0.1


class TransientError(Exception):
    """A failure worth another attempt; ``retry_after`` (seconds) when the server said how long to wait, ``status``
    the HTTP status that answered, if any."""

    def __init__(self, problem: str, retry_after: float | None = None, status: int | None = None) -> None:
        super().__init__(problem)
        self.retry_after, self.status = retry_after, status


class GaveUpError(Exception):
    """Every attempt failed; ``attempts`` were made and ``last`` is the last one's failure."""

    def __init__(self, what: str, attempts: int, last: TransientError) -> None:
        super().__init__(f"{what}: {last}; gave up after {attempts} attempt(s)")
        self.attempts, self.last = attempts, last


class RetryCancelledError(Exception):
    """The policy's ``cancelled`` event was set."""


@dataclass
class RetryPolicy:
    """``retries`` more attempts after a :class:`TransientError` failure, waiting ``backoff_s * 2**k`` (see the module
    docstring)."""

    retries: int = RETRIES
    backoff_s: float = 1.0
    max_wait_s: float = MAX_WAIT_S
    cancelled: threading.Event = field(default_factory=threading.Event)

    def wait(self, attempt: int, retry_after: float | None = None) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (0 for the first)."""
        wait = min(self.backoff_s * 2**attempt, self.max_wait_s) * (1 + JITTER * random.random())
        return max(wait, min(retry_after, self.max_wait_s)) if retry_after is not None else wait

    def call(self, what: str, attempt: Callable[[], T]) -> T:
        """``attempt()`` until it succeeds, raises anything but :class:`TransientError`, or has failed ``retries + 1``
        times (:class:`GaveUpError`); ``what`` names it in the log."""
        for k in range(self.retries + 1):
            if self.cancelled.is_set():
                raise RetryCancelledError(f"{what}: cancelled")
            try:
                return attempt()
            except TransientError as err:
                if k == self.retries:
                    raise GaveUpError(what, k + 1, err) from None
                wait = self.wait(k, err.retry_after)
                logger.warning(
                    "%s: %s; attempt %d of %d failed, next in %.2f s", what, err, k + 1, self.retries + 1, wait
                )
                self.cancelled.wait(wait)
        raise AssertionError("unreachable")

"""The one retry policy of the NBIA and DICOMweb clients (scripts/common/retry.py): back-off, jitter, cap, Retry-After,
giving up, cancellation, a log line per retry."""

from __future__ import annotations

import logging
import threading

import pytest
import scripts.common.retry as retry
from scripts.common.retry import MAX_WAIT_S, GaveUpError, RetryCancelledError, RetryPolicy, TransientError


def failing(times: int, error: Exception | None = None):
    """An attempt that fails ``times`` times (TransientError, or ``error``), then returns its call count."""
    calls = []

    def attempt():
        calls.append(1)
        if len(calls) <= times:
            raise error or TransientError(f"HTTP 503 on call {len(calls)}")
        return len(calls)

    return attempt, calls


def test_waits_double_with_up_to_ten_percent_jitter_and_never_pass_the_cap(monkeypatch):
    policy = RetryPolicy(retries=8, backoff_s=1.0)
    monkeypatch.setattr(retry.random, "random", lambda: 0.0)
    assert [policy.wait(k) for k in range(8)] == [1, 2, 4, 8, 16, 32, MAX_WAIT_S, MAX_WAIT_S]
    monkeypatch.setattr(retry.random, "random", lambda: 0.999)
    assert policy.wait(0) == pytest.approx(1.0999) and policy.wait(10) == pytest.approx(MAX_WAIT_S * 1.0999)


def test_retry_after_is_honoured_when_longer_up_to_the_cap(monkeypatch):
    monkeypatch.setattr(retry.random, "random", lambda: 0.0)
    policy = RetryPolicy(backoff_s=1.0)
    assert policy.wait(0, retry_after=30.0) == 30.0
    assert policy.wait(3, retry_after=2.0) == 8.0, "a shorter Retry-After does not shorten the back-off"
    assert policy.wait(0, retry_after=3600.0) == MAX_WAIT_S


def test_transient_failures_are_retried_and_each_retry_is_logged(caplog):
    attempt, _ = failing(2)
    with caplog.at_level(logging.WARNING, logger="scripts.common.retry"):
        assert RetryPolicy(retries=4, backoff_s=0.001).call("GET /studies", attempt) == 3
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and lines[0].startswith("GET /studies: HTTP 503 on call 1; attempt 1 of 5 failed, next in")


def test_it_gives_up_after_the_last_attempt_naming_the_last_failure():
    attempt, calls = failing(10)
    with pytest.raises(GaveUpError) as err:
        RetryPolicy(retries=2, backoff_s=0.001).call("GET /series", attempt)
    assert len(calls) == 3 and err.value.attempts == 3 and str(err.value.last) == "HTTP 503 on call 3"
    assert str(err.value) == "GET /series: HTTP 503 on call 3; gave up after 3 attempt(s)"


def test_other_errors_pass_at_once():
    attempt, calls = failing(1, PermissionError("HTTP 403"))
    with pytest.raises(PermissionError, match="403"):
        RetryPolicy(retries=5, backoff_s=0.001).call("STOW", attempt)
    assert len(calls) == 1


def test_cancelling_ends_the_wait_and_stops_before_the_next_attempt():
    cancelled = threading.Event()
    attempt, calls = failing(10)
    policy = RetryPolicy(retries=5, backoff_s=30.0, cancelled=cancelled)
    threading.Timer(0.2, cancelled.set).start()
    with pytest.raises(RetryCancelledError, match="download: cancelled"):
        policy.call("download", attempt)  # returns in 0.2 s, not after the 30 s back-off
    assert len(calls) == 1

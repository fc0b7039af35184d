"""A tidy-up on ignite's EXCEPTION_RAISED runs first and the run's error reaches the caller exactly once."""

from __future__ import annotations

import logging

import pytest
from ignite.engine import Engine, Events
from monai.handlers import StatsHandler
from scripts.common.events import exception_handlers, on_exception_first


def failing_engine() -> Engine:
    def step(engine: Engine, batch: int) -> None:
        raise ValueError(f"case {batch}: the CT has no slices")

    return Engine(step)


def test_the_tidy_up_runs_and_the_error_propagates_when_it_is_alone():
    """ignite fires the event at each level of its loop (the epoch's, the run's): the tidy-up runs once per level,
    which is why every tidy-up the bundle registers may be called again."""
    engine, calls = failing_engine(), []
    on_exception_first(engine, lambda: calls.append("tidy"))
    with pytest.raises(ValueError, match="case 0: the CT has no slices"):
        engine.run([0, 1])
    assert calls == ["tidy", "tidy"]


def test_the_tidy_up_runs_before_a_handler_that_reraises_and_the_error_is_raised_once(caplog):
    """MONAI's StatsHandler logs and re-raises: the tidy-up must run before it, not be skipped by its raise."""
    engine, calls = failing_engine(), []
    StatsHandler(name="run", iteration_log=False, epoch_log=False).attach(engine)
    engine.add_event_handler(Events.EXCEPTION_RAISED, lambda engine, error: calls.append("later"))
    on_exception_first(engine, lambda: calls.append("tidy"))
    with caplog.at_level(logging.ERROR), pytest.raises(ValueError) as raised:
        engine.run([3])
    assert calls[0] == "tidy", "the tidy-up is first in the chain"
    assert "case 3" in str(raised.value) and raised.value.__cause__ is None
    assert len(exception_handlers(engine)) == 3


def test_an_engine_without_ignites_private_layout_has_no_handlers():
    class Bare:
        pass

    assert exception_handlers(Bare()) == []

"""ignite's ``EXCEPTION_RAISED`` for handlers that must tidy up on an error and leave the error to propagate.

ignite re-raises a run's exception by itself only when no handler listens for ``EXCEPTION_RAISED``; once one does, it
is up to the handlers, and the first that re-raises ends the chain (MONAI's ``StatsHandler`` logs the error and
re-raises it). :func:`on_exception_first` puts a tidy-up first in that chain, so that it runs whatever comes after,
and re-raises only where it is the event's only handler, so that the error is neither lost nor raised twice. ignite
fires the event at each level of its loop (the epoch's, then the run's), so a tidy-up must be safe to call again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def on_exception_first(engine: Any, tidy_up: Callable[[], None]) -> None:
    """Run ``tidy_up()`` first when ``engine`` raises, then let the error propagate (see the module docstring)."""
    from ignite.engine import Events

    def handler(engine: Any, error: BaseException) -> None:
        tidy_up()
        if len(exception_handlers(engine)) <= 1:
            raise error

    engine.add_event_handler(Events.EXCEPTION_RAISED, handler)
    handlers = exception_handlers(engine)
    if handlers:
        handlers.insert(0, handlers.pop())


def exception_handlers(engine: Any) -> list:
    """ignite's (private) list of ``EXCEPTION_RAISED`` handlers of ``engine``; empty if its layout ever changes."""
    from ignite.engine import Events

    handlers = getattr(engine, "_event_handlers", {})
    return handlers.get(Events.EXCEPTION_RAISED, []) if isinstance(handlers, dict) else []

"""The profiler handler refuses schedules it cannot follow, and an error in the run writes what was profiled before it
and propagates (the run itself: test_workflow_profile.py)."""

from __future__ import annotations

import pytest
import torch
from scripts.profiling.profiler import ProfilerHandler


@pytest.mark.parametrize("schedule", [[1, 1, 0, 1], [1, 2, 3], [-1, 1, 1, 1]])
def test_bad_schedule_is_refused(tmp_path, schedule):
    with pytest.raises(ValueError, match="wait, warmup, active, repeat"):
        ProfilerHandler(tmp_path, schedule=schedule)


def test_an_error_writes_the_steps_profiled_before_it_and_propagates(tmp_path):
    """The profiler is stopped first, before MONAI's StatsHandler re-raises (it used to be left running, unwritten)."""
    from ignite.engine import Engine
    from monai.engines.utils import IterationEvents
    from monai.handlers import StatsHandler

    def step(engine: Engine, _batch) -> None:
        torch.ones(8).sum()
        if engine.state.iteration == 3:
            raise RuntimeError("out of memory at this step")

    engine = Engine(step)
    engine.register_events(*IterationEvents)  # as MONAI's engines do
    StatsHandler(iteration_log=False).attach(engine)
    profiler = ProfilerHandler(tmp_path, schedule=[0, 0, 5, 1], memory_snapshot=False)
    profiler.attach(engine)
    with pytest.raises(RuntimeError, match="out of memory at this step"):
        engine.run(range(10), max_epochs=1)
    assert profiler.profiler is None, "stopped"
    assert [p.name for p in profiler.written if p.name.endswith(".json.gz")] == [
        "2-chrome_trace.json.gz"
    ]  # the 2 steps done

"""The profiler handler refuses schedules it cannot follow (the run itself: test_workflow_profile.py)."""

from __future__ import annotations

import pytest
from scripts.profiler import ProfilerHandler


@pytest.mark.parametrize("schedule", [[1, 1, 0, 1], [1, 2, 3], [-1, 1, 1, 1]])
def test_bad_schedule_is_refused(tmp_path, schedule):
    with pytest.raises(ValueError, match="wait, warmup, active, repeat"):
        ProfilerHandler(tmp_path, schedule=schedule)

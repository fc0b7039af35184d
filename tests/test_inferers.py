"""The sliding-window inferer that survives a CT too large for the device's memory."""

from __future__ import annotations

import logging

import pytest
import torch
from scripts.inferers import OUT_OF_MEMORY, FallbackSlidingWindowInferer


class FailsOnce(torch.nn.Module):
    """A network whose first call runs out of memory, as a full CT on a small GPU does."""

    def __init__(self, error: Exception):
        super().__init__()
        self.calls, self.error = 0, error

    def forward(self, x):
        self.calls += 1
        if self.calls == 1:
            raise self.error
        return torch.cat([x, 2 * x], dim=1)


def test_out_of_memory_is_retried_with_cpu_stitching(caplog):
    inferer = FallbackSlidingWindowInferer(roi_size=(32, 32, 32), sw_batch_size=2, overlap=0.25)
    image = torch.rand(1, 1, 48, 40, 36)
    network = FailsOnce(OUT_OF_MEMORY("CUDA out of memory. Tried to allocate 2.00 GiB"))
    with caplog.at_level(logging.WARNING, logger="scripts.inferers"):
        output = inferer(image, network)
    torch.testing.assert_close(output, torch.cat([image, 2 * image], dim=1))
    assert "out of memory" in caplog.text and "(1, 1, 48, 40, 36)" in caplog.text
    assert inferer.sw_device is None, "the inferer's own settings are restored for the next case"


def test_other_errors_are_not_swallowed():
    inferer = FallbackSlidingWindowInferer(roi_size=(32, 32, 32))
    with pytest.raises(RuntimeError, match="shape mismatch"):
        inferer(torch.rand(1, 1, 32, 32, 32), FailsOnce(RuntimeError("shape mismatch")))

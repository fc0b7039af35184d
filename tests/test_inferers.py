"""The sliding-window inferer that survives a CT too large for the device's memory."""

from __future__ import annotations

import logging

import pytest
import torch
from scripts.inferers import OUT_OF_MEMORY, FallbackSlidingWindowInferer, SameDeviced


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


def test_a_prediction_and_its_label_meet_on_one_device_before_the_metric():
    """On one device nothing moves (the same tensors); the GPU test below moves a pair split by the fallback."""
    pred, label = torch.zeros(2, 4, 4, 4), torch.ones(2, 4, 4, 4)
    moved = SameDeviced(["pred", "label", "raw"], allow_missing_keys=True)({"pred": pred, "label": label, "id": "a"})
    assert moved["pred"] is pred and moved["label"] is label and moved["id"] == "a"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm device")
def test_a_prediction_stitched_on_the_cpu_is_scored_against_a_label_on_the_gpu():
    """The H200 run's crash (evaluate_oom.log): the fallback's prediction on the CPU, the label on cuda:0, MeanDice
    between them. After SameDeviced the Dice is computed, and equals the recount."""
    from monai.metrics import DiceMetric

    pred = torch.zeros(1, 2, 8, 8, 8)
    pred[:, 1, 2:6, 2:6, 2:6] = 1
    pred[:, 0] = 1 - pred[:, 1]
    label = pred.clone().cuda()
    label[:, 1, 2:6, 2:6, 5] = 0
    label[:, 0] = 1 - label[:, 1]
    both = SameDeviced(["pred", "label"])({"pred": pred, "label": label})
    dice = DiceMetric(include_background=False)(both["pred"], both["label"])
    assert float(dice) == pytest.approx(2 * 48 / (64 + 48))

"""Inferers the bundle's configs use beyond MONAI's own.

:class:`FallbackSlidingWindowInferer` is MONAI's sliding-window inferer that, when the device runs out of memory,
retries the case once with the windows on the device and the stitched output in CPU memory. Validation during
training and inference use it alike; it imports nothing but torch and MONAI.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from monai.inferers import SlidingWindowInferer

logger = logging.getLogger(__name__)

#: torch raises this on CUDA and ROCm alike; older torch only has the CUDA name
OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


class FallbackSlidingWindowInferer(SlidingWindowInferer):
    """Sliding-window inference that survives a full CT that does not fit: on an out-of-memory error the case is
    run again once with the windows on the accelerator (``sw_device``) and the output stitched in CPU memory."""

    def __call__(self, inputs: torch.Tensor, network, *args: Any, **kwargs: Any):
        try:
            return super().__call__(inputs, network, *args, **kwargs)
        except (OUT_OF_MEMORY, RuntimeError) as err:
            if not isinstance(err, OUT_OF_MEMORY) and "out of memory" not in str(err).lower():
                raise
            logger.warning(
                "out of memory in sliding-window inference of an input of shape %s on %s (%s); retrying with the "
                "windows on %s and the output stitched on the CPU",
                tuple(inputs.shape), inputs.device, str(err).splitlines()[0], inputs.device,
            )  # fmt: skip
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            saved = self.sw_device
            self.sw_device = inputs.device
            try:
                output = super().__call__(inputs, network, *args, device=torch.device("cpu"), **kwargs)
            finally:
                self.sw_device = saved
            try:
                return output.to(inputs.device)
            except (OUT_OF_MEMORY, RuntimeError):
                return output

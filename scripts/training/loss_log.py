"""Every training step's loss in the log and TensorBoard, read from the device without making the step wait.

MONAI's ``StatsHandler`` and ``TensorBoardStatsHandler`` read the loss with ``.item()`` at the end of each step, and
its trainer's decollation reads it once more before them. On a GPU such a read waits until the step has finished, so
the device runs dry while the host starts the next step (the next batch, the first launches). Here each step's loss is
copied into pinned host memory behind the step's own work (``non_blocking``, with an event recorded after it) and
written once the device has got there: usually at the end of the next step, at the latest at the end of the epoch,
or when more than ``max_pending`` steps wait (then the oldest is waited for: the host is that far ahead of the
device, which has plenty queued). Each value is written under its own step number. On a CPU the value is there at
once and is written at once.

The log lines are MONAI's ``StatsHandler`` lines (``Epoch: 1/300, Iter: 5/96 -- train_loss: 0.7312``), the
TensorBoard scalars MONAI's (``train_loss`` at the global iteration). The copy is issued at the end of the step it
belongs to, before the next one starts: a CUDA graph's static loss, or reduce-overhead compile's, is overwritten by
the next replay.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
from ignite.engine import Engine, Events
from scripts.common.events import on_exception_first

logger = logging.getLogger(__name__)


@dataclass
class _Step:
    epoch: int
    max_epochs: int
    iteration: int  # within the epoch, from 1
    epoch_length: int
    global_step: int
    value: torch.Tensor  # on the host (pinned when it came from a GPU)
    ready: Any  # an event recorded after the copy, or None when the value is already there

    def is_ready(self) -> bool:
        return self.ready is None or self.ready.query()

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()


def to_host(loss: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """``loss`` copied to the host without waiting (a GPU's), and the event that says when the copy has landed."""
    loss = loss.detach()
    if loss.device.type == "cuda":  # ROCm's HIP devices are "cuda" to torch
        host = loss.to("cpu", non_blocking=True)  # into pinned memory, queued behind the step's kernels
        event = torch.cuda.Event()
        event.record()
        return host, event
    return loss.to("cpu"), None  # the CPU (nothing to wait for) and other devices (a plain read)


class LossLog:
    """The loss of every training iteration to the engine's logger (as MONAI's ``StatsHandler``) and to TensorBoard in
    ``log_dir`` (as ``TensorBoardStatsHandler``), written once the device has computed it (see the module docstring).

    ``log_dir`` None: the log only. ``loss_key``: where ``engine.state.output`` holds the loss (a list of per-item
    dicts, as MONAI's decollation leaves it, works too). The event file is opened at the first value, not before.
    """

    def __init__(self, log_dir: str | None = None, tag_name: str = "train_loss", loss_key: str = "loss",
                 max_pending: int = 8, copy=to_host) -> None:  # fmt: skip
        self.log_dir, self.tag_name, self.loss_key = log_dir, tag_name, loss_key
        self.max_pending = max(1, int(max_pending))
        self.copy = copy
        self.pending: deque[_Step] = deque()
        self.writer = None
        self.log = logger

    def attach(self, engine: Engine) -> None:
        self.log = engine.logger  # as MONAI's StatsHandler(name=None)
        engine.add_event_handler(Events.ITERATION_COMPLETED, self.iteration_completed)
        engine.add_event_handler(Events.EPOCH_COMPLETED, self.flush)
        engine.add_event_handler(Events.COMPLETED, self.close)
        on_exception_first(engine, self.close_on_error)

    def iteration_completed(self, engine: Engine) -> None:
        output = engine.state.output
        loss = (output[0] if isinstance(output, list) else output)[self.loss_key]
        state = engine.state
        epoch_length = state.epoch_length or 0
        iteration = (state.iteration - 1) % epoch_length + 1 if epoch_length else state.iteration
        if not isinstance(loss, torch.Tensor):
            loss = torch.as_tensor(loss)
        value, ready = self.copy(loss)
        self.pending.append(_Step(state.epoch, state.max_epochs or 0, iteration, epoch_length, state.iteration, value,
                                  ready))  # fmt: skip
        self.write(everything=False)

    def write(self, everything: bool) -> None:
        """Write the waiting values in order: those the device has computed, the oldest beyond ``max_pending``, and
        with ``everything`` all of them (waiting for each)."""
        while self.pending:
            step = self.pending[0]
            if not (everything or len(self.pending) > self.max_pending or step.is_ready()):
                break
            step.wait()
            self.pending.popleft()
            self._emit(step, float(step.value.float().mean()))

    def _emit(self, step: _Step, value: float) -> None:
        self.log.info(f"Epoch: {step.epoch}/{step.max_epochs}, Iter: {step.iteration}/{step.epoch_length} -- "
                      f"{self.tag_name}: {value:.4f} ")  # fmt: skip
        if self.log_dir is not None:
            if self.writer is None:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(log_dir=self.log_dir)
            self.writer.add_scalar(self.tag_name, value, step.global_step)

    def flush(self, engine: Engine | None = None) -> None:
        self.write(everything=True)
        if self.writer is not None:
            self.writer.flush()

    def close(self, engine: Engine | None = None) -> None:
        self.flush()
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def close_on_error(self) -> None:
        """On an error, the values computed before it are written too (the error itself propagates)."""
        try:
            self.close()
        except Exception as late:  # a failed device fails the read as well: the original error is the one to see
            logger.warning("loss log: %d step(s) not written (%s)", len(self.pending), late)
            self.pending.clear()

"""LossLog: every step's loss is written once, in order, under its own epoch and step, to the log and TensorBoard; a
value is read only once the device has computed it (never at the end of its own step while the device still works),
the values waiting are bounded, and an error still writes what was computed and propagates. With decollation off,
MONAI's trainer and LossLog read nothing off the device during a step; MONAI's own handlers do."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from host_reads import HostReads
from ignite.engine import Engine, Events
from monai.engines import SupervisedTrainer
from monai.handlers import StatsHandler
from scripts.training.loss_log import LossLog


class Device:
    """A GPU's stream as the host sees it: step k's copy has landed once the device has finished step k, which it
    does ``lag`` steps after the host issued it (or never, with ``lag`` None); ``synchronize`` waits for it."""

    def __init__(self, lag: int | None = 1) -> None:
        self.lag, self.issued, self.waits = lag, 0, []

    def copy(self, loss: torch.Tensor):
        self.issued += 1
        return loss.detach().clone(), Event(self, self.issued)


class Event:
    def __init__(self, device: Device, step: int) -> None:
        self.device, self.step = device, step

    def query(self) -> bool:
        return self.device.lag is not None and self.device.issued >= self.step + self.device.lag

    def synchronize(self) -> None:
        if not self.query():
            self.device.waits.append(self.step)


def run(log: LossLog, losses: list[list[float]], fail_at: int | None = None) -> Engine:
    """An engine whose step k returns losses[epoch][k] (the epochs as given); ``fail_at``: that global step raises."""
    flat = [v for epoch in losses for v in epoch]

    def step(engine: Engine, _batch) -> dict:
        if engine.state.iteration == fail_at:
            raise RuntimeError("out of memory at this step")
        return {"loss": torch.tensor(flat[engine.state.iteration - 1])}

    engine = Engine(step)
    log.attach(engine)
    engine.run(range(len(losses[0])), max_epochs=len(losses))
    return engine


def lines(caplog) -> list[tuple[int, int, int, int, float]]:
    found = re.findall(r"Epoch: (\d+)/(\d+), Iter: (\d+)/(\d+) -- train_loss: ([0-9.]+)", caplog.text)
    return [(int(e), int(me), int(i), int(n), float(v)) for e, me, i, n, v in found]


def scalars(log_dir) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    values = []
    for events in sorted(log_dir.glob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        values += [(e.step, round(e.value, 4)) for e in accumulator.Scalars("train_loss")]
    return values


LOSSES = [[0.9, 0.8, 0.7, 0.6], [0.5, 0.4, 0.3, 0.2]]


def test_each_step_is_written_once_under_its_own_step_one_step_late_and_never_waited_for(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    device = Device(lag=1)
    log = LossLog(log_dir=str(tmp_path), copy=device.copy)
    written_at_step_end = []

    engine = Engine(lambda e, _: {"loss": torch.tensor(LOSSES[e.state.epoch - 1][(e.state.iteration - 1) % 4])})
    log.attach(engine)
    engine.add_event_handler(Events.ITERATION_COMPLETED, lambda e: written_at_step_end.append(len(lines(caplog))))
    engine.run(range(4), max_epochs=2)

    expected = [(e + 1, 2, i + 1, 4, v) for e, epoch in enumerate(LOSSES) for i, v in enumerate(epoch)]
    assert lines(caplog) == expected
    assert scalars(tmp_path) == [(k + 1, v) for k, v in enumerate(x[-1] for x in expected)]
    # at the end of step k, steps 1..k-1 are written (the device has finished them), step k is not read yet...
    assert written_at_step_end == [0, 1, 2, 3, 4, 5, 6, 7]
    # ...and the host waited only at an epoch's end, for that epoch's last step
    assert device.waits == [4, 8]


def test_on_a_device_that_never_catches_up_at_most_max_pending_steps_wait(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    device = Device(lag=None)
    log = LossLog(copy=device.copy, max_pending=3)
    depth = []
    engine = Engine(lambda e, _: {"loss": torch.tensor(float(e.state.iteration))})
    log.attach(engine)
    engine.add_event_handler(Events.ITERATION_COMPLETED, lambda e: depth.append(len(log.pending)))
    engine.run(range(10), max_epochs=1)
    assert max(depth) == 3, "bounded: the oldest is waited for beyond max_pending"
    assert device.waits == list(range(1, 11)), "each step waited for once: 7 when the queue overflowed, 3 at the end"
    assert [v for *_, v in lines(caplog)] == [float(k) for k in range(1, 11)]


def test_an_error_writes_the_steps_computed_before_it_and_propagates_once(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    device = Device(lag=5)  # nothing has landed yet when step 3 fails
    log = LossLog(log_dir=str(tmp_path), copy=device.copy)
    with pytest.raises(RuntimeError, match="out of memory at this step"):
        run(log, LOSSES, fail_at=3)
    assert [v for *_, v in lines(caplog)] == [0.9, 0.8]
    assert scalars(tmp_path) == [(1, 0.9), (2, 0.8)]


def test_with_monais_stats_handler_the_error_still_propagates(caplog):
    caplog.set_level(logging.INFO)
    engine = Engine(lambda e, _: (_ for _ in ()).throw(ValueError("a bad case")) if e.state.iteration == 2 else
                    {"loss": torch.tensor(1.0)})  # fmt: skip
    StatsHandler(iteration_log=False).attach(engine)
    LossLog(copy=Device(lag=0).copy).attach(engine)
    with pytest.raises(ValueError, match="a bad case"):
        engine.run(range(3), max_epochs=1)
    assert lines(caplog) == [(1, 1, 1, 3, 1.0)]


def test_no_event_file_is_opened_before_a_value(tmp_path):
    LossLog(log_dir=str(tmp_path)).attach(Engine(lambda e, b: {"loss": torch.tensor(0.0)}))
    assert not list(tmp_path.iterdir())


def trainer(decollate: bool, handlers: list) -> SupervisedTrainer:
    network = torch.nn.Conv3d(1, 2, 3, padding=1)
    data = [{"image": torch.rand(1, 1, 8, 8, 8), "label": torch.randint(0, 2, (1, 2, 8, 8, 8)).float()}] * 3
    return SupervisedTrainer(device=torch.device("cpu"), max_epochs=1, train_data_loader=data, network=network,
                             optimizer=torch.optim.SGD(network.parameters(), 0.1), decollate=decollate,
                             loss_function=torch.nn.BCEWithLogitsLoss(), train_handlers=handlers)  # fmt: skip


def test_the_training_step_reads_no_loss_off_the_device_where_monais_handlers_read_each_one():
    losses = []

    def keep(engine):
        losses.append(engine.state.output["loss"] if isinstance(engine.state.output, dict) else None)

    device = Device(lag=1)
    ours = trainer(decollate=False, handlers=[LossLog(copy=device.copy)])
    ours.add_event_handler(Events.ITERATION_COMPLETED, keep)
    with HostReads() as reads:
        ours.run()
    device_losses = {loss.data_ptr() for loss in losses}
    assert len(device_losses) == 3 and not device_losses & set(reads.read), "only the host copies were read"
    assert len(reads.read) == 3

    monais = trainer(decollate=True, handlers=[StatsHandler(output_transform=lambda o: o[0]["loss"])])
    with HostReads() as reads:
        monais.run()
    assert len(reads.read) >= 3, "MONAI's decollation reads every step's loss off the device at its end"

"""Exact resume: a run stopped after epoch k and resumed from ``TrainingCheckpoint``'s file into fresh objects (another
process, other seeds) restores network, optimiser, LR scheduler, grad scaler, epoch, iteration, best metric and every
random generator, and ends bit for bit where an uninterrupted run ends. The file is replaced atomically, a missing
file starts a fresh run with a warning, a checkpoint of another pipeline or beyond ``max_epochs`` is refused with a
message naming the file, and only rank 0 writes."""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import torch
from ignite.engine import Engine, Events
from monai.transforms import Compose, RandGaussianNoise
from scripts.training import checkpoint as checkpoint_module
from scripts.training.checkpoint import TrainingCheckpoint

BATCHES = [torch.linspace(-1, 1, 12).reshape(4, 3) * (i + 1) for i in range(3)]


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


class Pipeline:
    """A tiny training setup: network with dropout, Adam, StepLR, grad scaler, a random transform, and an evaluator
    whose best metric changes every epoch. Every global generator and the transform's generator feed the loss."""

    def __init__(self, init_seed: int, max_epochs: int, path, resume: bool = False, **checkpoint_kwargs):
        torch.manual_seed(init_seed)
        self.network = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
        self.optimizer = torch.optim.Adam(self.network.parameters(), lr=0.05)
        self.lr_scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1, gamma=0.7)
        self.transforms = Compose([RandGaussianNoise(prob=1.0, std=0.2)])
        self.transforms.set_random_state(seed=init_seed)
        self.evaluator = Engine(lambda engine, batch: None)
        self.steps = 0
        self.max_epochs = max_epochs
        self.trainer = Engine(self._step)
        self.trainer.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
        self.trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda _: self.lr_scheduler.step())
        self.trainer.add_event_handler(Events.EPOCH_COMPLETED, self._validate)
        self.checkpoint = TrainingCheckpoint(
            path,
            {"network": self.network, "optimizer": self.optimizer, "lr_scheduler": self.lr_scheduler},
            evaluator=self.evaluator,
            resume=resume,
            transforms=self.transforms,
            **checkpoint_kwargs,
        )
        self.checkpoint.attach(self.trainer)

    def _step(self, engine: Engine, batch: torch.Tensor) -> float:
        self.steps += 1
        self.network.train()
        self.optimizer.zero_grad()
        x = torch.as_tensor(np.asarray(self.transforms(batch.numpy())), dtype=torch.float32)
        jitter = float(np.random.rand()) + random.random()
        loss = ((self.network(x) - jitter) ** 2).mean()
        scaler = engine.scaler
        scaler.scale(loss).backward()
        scaler.step(self.optimizer)
        scaler.update()
        return float(loss.detach())

    def _validate(self, engine: Engine) -> None:
        self.evaluator.state.best_metric = 0.5 + engine.state.epoch / 100 + float(torch.rand(()))
        self.evaluator.state.best_metric_epoch = engine.state.epoch

    def run(self) -> None:
        self.trainer.run(BATCHES, max_epochs=self.max_epochs)

    def snapshot(self) -> dict:
        """Everything a resume must restore, copied."""
        state = self.trainer.state
        return {
            "network": {k: v.clone() for k, v in self.network.state_dict().items()},
            "optimizer": _clone(self.optimizer.state_dict()),
            "lr_scheduler": _clone(self.lr_scheduler.state_dict()),
            "lr": self.optimizer.param_groups[0]["lr"],
            "scaler": _clone(self.trainer.scaler.state_dict()),
            "epoch_iteration": (state.epoch, state.iteration),
            "best": (self.evaluator.state.best_metric, self.evaluator.state.best_metric_epoch),
            "torch_rng": torch.get_rng_state(),
            "numpy_rng": _clone(np.random.get_state()),
            "python_rng": random.getstate(),
            "transform_rng": _clone(self.transforms.transforms[0].R.get_state()),
        }


def _clone(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return value


def assert_same(a, b, where: str = "state") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, np.ndarray):
        np.testing.assert_array_equal(a, b, err_msg=where)
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def test_resumed_run_restores_every_state_and_ends_like_an_uninterrupted_run(tmp_path):
    seed_everything(0)
    straight = Pipeline(init_seed=0, max_epochs=4, path=tmp_path / "straight.pt")
    straight.run()

    seed_everything(0)
    first = Pipeline(init_seed=0, max_epochs=2, path=tmp_path / "latest.pt")
    first.run()
    stopped = first.snapshot()

    seed_everything(12345)  # a new process: other global seeds, other initial weights, other transform seed
    second = Pipeline(init_seed=99, max_epochs=4, path=tmp_path / "latest.pt", resume=True)
    restored = {}
    second.trainer.add_event_handler(Events.STARTED, lambda _: restored.update(second.snapshot()))
    second.run()

    assert_same(stopped, restored, "restored at start")
    assert second.steps == 2 * len(BATCHES), "the resumed run trains epochs 3 and 4 only"
    assert_same(straight.snapshot(), second.snapshot(), "after epoch 4")
    assert straight.lr_scheduler.last_epoch == second.lr_scheduler.last_epoch == 4


def test_saved_file_loads_with_weights_only_and_records_the_epoch(tmp_path):
    seed_everything(0)
    pipeline = Pipeline(init_seed=0, max_epochs=3, path=tmp_path / "latest.pt")
    pipeline.run()
    state = torch.load(tmp_path / "latest.pt", weights_only=True)
    assert state["trainer"] == {"epoch": 3, "iteration": 3 * len(BATCHES)}
    assert state["evaluator"]["best_metric_epoch"] == 3
    assert {"network", "optimizer", "lr_scheduler", "scaler", "rng"} <= state.keys()


def test_saves_every_interval_and_after_the_last_epoch(tmp_path, monkeypatch):
    saved_epochs = []
    monkeypatch.setattr(TrainingCheckpoint, "save", lambda self, engine: saved_epochs.append(engine.state.epoch))
    seed_everything(0)
    Pipeline(init_seed=0, max_epochs=5, path=tmp_path / "latest.pt", save_interval=2).run()
    assert saved_epochs == [2, 4, 5]


def test_failed_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    seed_everything(0)
    pipeline = Pipeline(init_seed=0, max_epochs=1, path=tmp_path / "latest.pt")
    pipeline.run()
    before = (tmp_path / "latest.pt").read_bytes()

    def crash_half_way(obj, f, *args, **kwargs):
        with open(f, "wb") as handle:
            handle.write(b"PK\x03\x04 half a zip")
        raise OSError("No space left on device")

    monkeypatch.setattr(torch, "save", crash_half_way)
    pipeline.trainer.state.epoch = 2
    with pytest.raises(OSError, match="No space left"):
        pipeline.checkpoint.save(pipeline.trainer)
    monkeypatch.undo()

    assert [p.name for p in tmp_path.iterdir()] == ["latest.pt"], "no temporary file is left"
    assert (tmp_path / "latest.pt").read_bytes() == before
    assert torch.load(tmp_path / "latest.pt", weights_only=True)["trainer"]["epoch"] == 1


def test_resume_without_a_checkpoint_starts_fresh_with_a_warning(tmp_path, caplog):
    seed_everything(0)
    pipeline = Pipeline(init_seed=0, max_epochs=2, path=tmp_path / "none_yet.pt", resume="true")
    with caplog.at_level(logging.WARNING, logger="scripts.training.checkpoint"):
        pipeline.run()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("none_yet.pt" in w and "starting from epoch 1" in w for w in warnings), warnings
    assert pipeline.steps == 2 * len(BATCHES)
    assert (tmp_path / "none_yet.pt").is_file(), "the fresh run writes its checkpoint"


def test_checkpoint_of_another_pipeline_is_refused_naming_the_file(tmp_path):
    seed_everything(0)
    network = torch.nn.Linear(3, 1)
    other = TrainingCheckpoint(tmp_path / "other.pt", {"network": network}, enabled=True)
    trainer = Engine(lambda engine, batch: None)
    other.attach(trainer)
    trainer.run([0], max_epochs=1)

    pipeline = Pipeline(init_seed=0, max_epochs=3, path=tmp_path / "other.pt", resume=True)
    weights = {k: v.clone() for k, v in pipeline.network.state_dict().items()}
    with pytest.raises(RuntimeError) as err:
        pipeline.run()
    assert str(tmp_path / "other.pt") in str(err.value)
    assert "optimizer" in str(err.value) and "lr_scheduler" in str(err.value)
    assert pipeline.steps == 0
    assert_same(weights, pipeline.network.state_dict(), "the refused checkpoint changes nothing")


def test_checkpoint_beyond_max_epochs_is_refused_with_what_to_do(tmp_path):
    seed_everything(0)
    Pipeline(init_seed=0, max_epochs=3, path=tmp_path / "latest.pt").run()
    pipeline = Pipeline(init_seed=0, max_epochs=2, path=tmp_path / "latest.pt", resume=True)
    with pytest.raises(RuntimeError) as err:
        pipeline.run()
    message = str(err.value)
    assert "latest.pt" in message and "epoch 3" in message and "max_epochs=2" in message
    assert "raise max_epochs" in message and "without --resume" in message
    assert pipeline.steps == 0


def test_disabled_checkpoint_writes_nothing(tmp_path):
    seed_everything(0)
    Pipeline(init_seed=0, max_epochs=2, path=tmp_path / "latest.pt", enabled=False).run()
    assert list(tmp_path.iterdir()) == []


def test_only_rank_0_writes_by_default(tmp_path, monkeypatch):
    seed_everything(0)
    Pipeline(init_seed=0, max_epochs=1, path=tmp_path / "rank0.pt").run()
    assert (tmp_path / "rank0.pt").is_file()

    monkeypatch.setattr(checkpoint_module, "is_rank0", lambda: False)
    Pipeline(init_seed=0, max_epochs=1, path=tmp_path / "rank1.pt").run()
    assert not (tmp_path / "rank1.pt").exists()


def test_every_rank_loads_on_resume(tmp_path, monkeypatch):
    seed_everything(0)
    Pipeline(init_seed=0, max_epochs=1, path=tmp_path / "latest.pt").run()
    monkeypatch.setattr(checkpoint_module, "is_rank0", lambda: False)
    pipeline = Pipeline(init_seed=0, max_epochs=2, path=tmp_path / "latest.pt", resume=True)
    pipeline.run()
    assert pipeline.steps == len(BATCHES), "a non-zero rank resumed from epoch 1 too"


def test_the_last_line_names_the_weights_only_when_validation_wrote_them(tmp_path):
    """A run that validated names its best Dice, epoch and weights file; one that never validated (--fold with no
    case, val_interval past max_epochs) says no weights file was written and where its last state is."""
    from types import SimpleNamespace

    from scripts.training.checkpoint import final_line

    validated = SimpleNamespace(best_metric=0.91664, best_metric_epoch=8)
    assert final_line(validated, tmp_path / "model.pt", tmp_path / "checkpoints" / "latest.pt") == (
        f"best validation Dice 0.9166 at epoch 8; weights: {tmp_path / 'model.pt'}"
    )
    never = SimpleNamespace(best_metric=-1, best_metric_epoch=-1)
    line = final_line(never, tmp_path / "model.pt", tmp_path / "checkpoints" / "latest.pt")
    assert line.startswith(f"no validation ran, so no best weights were written to {tmp_path / 'model.pt'}")
    assert line.endswith(str(tmp_path / "checkpoints" / "latest.pt"))


def test_a_new_run_names_the_state_and_weights_it_will_replace_and_what_keeps_each(tmp_path, monkeypatch, caplog):
    """A run that does not resume warns for an existing checkpoint (with its epoch, read without the tensors) and
    existing weights; a resumed run, another rank of a DDP launch, or an empty folder says nothing."""
    from scripts.training.checkpoint import warn_before_replacing

    monkeypatch.delenv("RANK", raising=False)
    latest, weights = tmp_path / "checkpoints" / "latest.pt", tmp_path / "model.pt"
    assert warn_before_replacing(latest, weights, False) == [], "nothing there yet"
    Pipeline(init_seed=0, max_epochs=2, path=latest).run()
    torch.save({"w": torch.zeros(1)}, weights)
    with caplog.at_level(logging.WARNING, logger="scripts.training.checkpoint"):
        checkpoint, model = warn_before_replacing(latest, weights, "false")
    warned = [
        r.getMessage()
        for r in caplog.records
        if r.name == "scripts.training.checkpoint" and r.levelno == logging.WARNING
    ]
    assert warned == [checkpoint, model]
    assert checkpoint.startswith(f"{latest} holds the training state of epoch 2 of another run")
    assert "replaces it after its first epoch" in checkpoint and "--resume true" in checkpoint
    assert model.startswith(f"{weights} holds weights this run did not train") and "--model_path" in model
    assert warn_before_replacing(latest, weights, "true") == [], "resumed: the state is continued"
    monkeypatch.setenv("RANK", "1")
    assert warn_before_replacing(latest, weights, False) == [], "rank 0 of the launch says it once"
    monkeypatch.setenv("RANK", "0")
    latest.write_bytes(b"not a checkpoint")
    assert warn_before_replacing(latest, weights, False)[0].startswith(f"{latest} holds a training state of another")

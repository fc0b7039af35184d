"""Exact resume for the bundle's ignite workflows.

:class:`TrainingCheckpoint` saves the full training state (network, optimiser, LR scheduler, grad scaler, trainer
epoch/iteration, the evaluator's best metric and the random-number state of :mod:`scripts.training.rng`) to one file at
the end of every epoch and, with ``resume=True``, loads it when training starts, so a run stopped after epoch k
continues at epoch k + 1 and ends at ``max_epochs`` having trained every epoch once.

The file is written to a temporary sibling and renamed: a crash while saving leaves the previous checkpoint intact,
never a truncated one (MONAI's ``CheckpointSaver`` writes in place). It holds only tensors and plain Python values and
is loaded with ``torch.load(weights_only=True)``.

:func:`warn_before_replacing` says, in a new training's first lines, which existing training state and weights it
will replace, and what keeps each.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from ignite.engine import Engine, Events
from scripts.common.config import as_bool
from scripts.training import rng
from scripts.training.distributed import is_rank0
from scripts.training.weights import atomic_save, unwrap

logger = logging.getLogger(__name__)


class TrainingCheckpoint:
    """Save the whole training state each epoch; restore it at start when ``resume`` is true.

    Args:
        path: the checkpoint file (e.g. ``runs/train/checkpoints/latest.pt``).
        objects: name -> object with ``state_dict``/``load_state_dict`` (network, optimizer, lr_scheduler, ...).
            ``None`` values are skipped, so optional parts (no scheduler, no scaler) need no special casing.
        evaluator: its ``best_metric``/``best_metric_epoch`` are saved so that a resumed run does not overwrite
            the best model with a worse one.
        resume: load ``path`` at ``Events.STARTED``; if it does not exist the run starts fresh (logged), which
            lets launchers always pass ``--resume true`` (a torchrun restart then picks up where it stopped).
        transforms: a ``Compose`` (or list) whose random transforms' generators are saved too. With
            ``num_workers=0`` augmentation then continues exactly as in an uninterrupted run; with worker processes
            the workers are re-seeded from the (restored) torch generator every epoch, which is exact as well,
            except with ``persistent_workers``, whose generators live in the workers and restart from their seeds.
        save_interval: save every this many epochs (and always after the last one).
    """

    def __init__(
        self,
        path: str | Path,
        objects: Mapping[str, Any],
        evaluator: Engine | None = None,
        resume: bool | str = False,
        save_interval: int = 1,
        enabled: bool | None = None,
        transforms: Any = None,
    ) -> None:
        self.path = Path(path)
        self.objects = {k: v for k, v in objects.items() if v is not None}
        self.evaluator = evaluator
        self.resume = as_bool(resume, "resume")
        self.save_interval = max(int(save_interval), 1)
        # None: only rank 0 of a DDP run writes; every rank loads on resume (DDP syncs gradients, not weights)
        self.enabled = is_rank0() if enabled is None else as_bool(enabled, "enabled")
        self.generators = rng.random_generators(transforms)

    def attach(self, engine: Engine) -> None:
        if self.resume:
            engine.add_event_handler(Events.STARTED, self.load)
        engine.add_event_handler(Events.EPOCH_COMPLETED, self._maybe_save)

    def _maybe_save(self, engine: Engine) -> None:
        if engine.state.epoch % self.save_interval == 0 or engine.state.epoch >= engine.state.max_epochs:
            self.save(engine)

    def state_dict(self, engine: Engine) -> dict:
        state = {name: _state_of(obj) for name, obj in self.objects.items()}
        state["trainer"] = {"epoch": engine.state.epoch, "iteration": engine.state.iteration}
        scaler = getattr(engine, "scaler", None)
        if scaler is not None:
            state["scaler"] = scaler.state_dict()
        if self.evaluator is not None:
            state["evaluator"] = {
                "best_metric": float(getattr(self.evaluator.state, "best_metric", -1)),
                "best_metric_epoch": int(getattr(self.evaluator.state, "best_metric_epoch", -1)),
            }
        state["rng"] = rng.capture(self.generators)
        return state

    def save(self, engine: Engine) -> None:
        if not self.enabled:
            return
        atomic_save(self.state_dict(engine), self.path)
        logger.info("saved training state of epoch %d to %s", engine.state.epoch, self.path)

    def load(self, engine: Engine) -> None:
        if not self.path.is_file():
            logger.warning("resume requested but %s does not exist: starting from epoch 1", self.path)
            return
        state = torch.load(self.path, map_location="cpu", weights_only=True)
        missing = [name for name in self.objects if name not in state]
        if missing:
            raise RuntimeError(f"{self.path}: checkpoint has no {missing}; it was not written by this bundle.")
        for name, obj in self.objects.items():
            _load_into(obj, state[name])
        scaler = getattr(engine, "scaler", None)
        if scaler is not None and "scaler" in state:
            scaler.load_state_dict(state["scaler"])
        epoch, iteration = int(state["trainer"]["epoch"]), int(state["trainer"]["iteration"])
        if epoch > engine.state.max_epochs:
            raise RuntimeError(
                f"{self.path} was saved after epoch {epoch}, beyond max_epochs={engine.state.max_epochs}; "
                "raise max_epochs to continue training, or start a new run without --resume."
            )
        engine.state.epoch, engine.state.iteration = epoch, iteration
        if self.evaluator is not None and "evaluator" in state:
            self.evaluator.state.best_metric = state["evaluator"]["best_metric"]
            self.evaluator.state.best_metric_epoch = state["evaluator"]["best_metric_epoch"]
        if not rng.restore(state.get("rng", {}), self.generators):
            logger.warning("%s: random transform states do not match this pipeline; augmentation restarts", self.path)
        logger.info("resumed from %s: epoch %d, iteration %d", self.path, epoch, iteration)


def _state_of(obj: Any) -> Any:
    return unwrap(obj).state_dict() if isinstance(obj, torch.nn.Module) else obj.state_dict()


def _load_into(obj: Any, state: Any) -> None:
    if isinstance(obj, torch.nn.Module):
        unwrap(obj).load_state_dict(state)
    else:
        obj.load_state_dict(state)


def final_line(state: Any, model_path: str | Path, checkpoint_file: str | Path) -> str:
    """What training says last: the best validation Dice, its epoch and the weights file it wrote; or, when no
    validation ran (``val_interval`` past ``max_epochs``, no validation cases), that no weights file was written and
    where the run's last state is (``checkpoint_file``)."""
    epoch = getattr(state, "best_metric_epoch", -1)
    if epoch is None or epoch < 1:
        return (
            f"no validation ran, so no best weights were written to {model_path}: check val_interval against "
            f"max_epochs and that the run has validation cases; the last epoch's state is in {checkpoint_file}"
        )
    return f"best validation Dice {state.best_metric:.4f} at epoch {epoch}; weights: {model_path}"


def warn_before_replacing(checkpoint_file: str | Path, model_path: str | Path, resume: bool | str) -> list[str]:
    """Warn, in a new training's first lines, that it will replace another run's training state or weights.

    A run that does not resume writes ``checkpoint_file`` after its first epoch and ``model_path`` at its first
    validation: when those files already exist (a training of days in the same ``output_dir``, weights a user keeps
    at the default ``model_path``), the user learns it before the slow steps, with the option that keeps each:
    ``--resume true`` continues the training, another ``--model_path`` keeps the weights. Nothing is said when
    resuming (the state is continued and the weights replaced only by better ones). Logs on the launcher's rank 0
    only: the process group is joined later, so torchrun's ``RANK`` says which process this is. Returns the
    warnings (empty: nothing would be replaced).
    """
    if as_bool(resume, "resume") or os.environ.get("RANK", "0") != "0":
        return []
    warnings = []
    checkpoint_file, model_path = Path(checkpoint_file), Path(model_path)
    if checkpoint_file.is_file():
        epoch = saved_epoch(checkpoint_file)
        state = f"the training state of epoch {epoch}" if epoch is not None else "a training state"
        warnings.append(
            f"{checkpoint_file} holds {state} of another run: this new run (resume false) replaces it after its "
            "first epoch; stop now and pass --resume true to continue that run instead, or --output_dir to keep it."
        )
    if model_path.is_file():
        warnings.append(
            f"{model_path} holds weights this run did not train: it replaces them at its first validation; stop now "
            "and pass --model_path <another file> to keep them."
        )
    for warning in warnings:
        logger.warning(warning)
    return warnings


def read_epoch(checkpoint_file: str | Path) -> int:
    """The epoch saved in a :class:`TrainingCheckpoint` file, read through a memory map (no tensor is loaded)."""
    return int(torch.load(checkpoint_file, map_location="cpu", weights_only=True, mmap=True)["trainer"]["epoch"])


def saved_epoch(checkpoint_file: str | Path) -> int | None:
    """:func:`read_epoch`, or None when the file cannot be read as a checkpoint (another program's file, a damaged
    one)."""
    try:
        return read_epoch(checkpoint_file)
    except Exception:  # a notice: a file torch cannot read as a checkpoint is still named, without its epoch
        return None

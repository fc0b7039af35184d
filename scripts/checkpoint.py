"""Atomic checkpoints and exact resume for the bundle's ignite workflows.

* :class:`TrainingCheckpoint` saves the full training state (network, optimiser, LR scheduler, grad scaler, trainer
  epoch/iteration, the evaluator's best metric and the global RNG states) to one file at the end of every epoch and,
  with ``resume=True``, loads it when training starts, so a run stopped after epoch k continues at epoch k + 1 and
  ends at ``max_epochs`` having trained every epoch once.
* :class:`BestModelSaver` writes the network weights (a plain ``state_dict``, as model-zoo ``models/model.pt`` files
  are) whenever the evaluator's key metric improves.

Both write to a temporary file in the same folder and ``os.replace`` it: a crash while saving leaves the previous
checkpoint intact, never a truncated one. (MONAI's ``CheckpointSaver`` writes in place, non-atomically.)
Checkpoints are loaded with ``torch.load(weights_only=True)``; they hold only tensors and plain Python values.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from ignite.engine import Engine, Events

from scripts.config import as_bool
from scripts.distributed import is_rank0
from scripts.files import replace_atomically, write_json

logger = logging.getLogger(__name__)


def atomic_save(obj: Any, path: str | Path) -> None:
    """``torch.save`` to ``path`` via a temporary file and a rename."""
    replace_atomically(path, lambda tmp: torch.save(obj, tmp))


def unwrap(network: torch.nn.Module) -> torch.nn.Module:
    """The module inside DistributedDataParallel / DataParallel / torch.compile wrappers."""
    while True:
        if isinstance(network, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            network = network.module
        elif hasattr(network, "_orig_mod"):
            network = network._orig_mod
        else:
            return network


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
        self.generators = _random_generators(transforms)

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
        state["rng"] = {
            "torch": torch.get_rng_state(),
            "numpy": _numpy_rng_to_tensors(np.random.get_state()),
            "python": _python_rng_to_tensors(random.getstate()),
            "transforms": [_numpy_rng_to_tensors(r.get_state()) for r in self.generators],
        }
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
        rng = state.get("rng", {})
        if "torch" in rng:
            torch.set_rng_state(rng["torch"])
        if "numpy" in rng:
            np.random.set_state(_tensors_to_numpy_rng(rng["numpy"]))
        if "python" in rng:
            random.setstate(_tensors_to_python_rng(rng["python"]))
        saved = rng.get("transforms", [])
        if len(saved) == len(self.generators):
            for generator, generator_state in zip(self.generators, saved, strict=True):
                generator.set_state(_tensors_to_numpy_rng(generator_state))
        else:
            logger.warning("%s: random transform states do not match this pipeline; augmentation restarts", self.path)
        logger.info("resumed from %s: epoch %d, iteration %d", self.path, epoch, iteration)


class BestModelSaver:
    """Write the network's ``state_dict`` to ``path`` whenever the evaluator reports a new best key metric.

    Next to it, ``<path stem>.json`` records what the weights are for (``labels``, epoch, metric), so evaluation
    and inference can refuse weights trained for another list of structures with a clear message.
    Attach to the evaluator; MONAI's workflow updates ``state.best_metric_epoch`` before this handler runs.
    """

    def __init__(
        self,
        path: str | Path,
        network: torch.nn.Module,
        labels: Sequence[str] | None = None,
        enabled: bool | None = None,
    ) -> None:
        self.path = Path(path)
        self.network = network
        self.labels = list(labels) if labels is not None else None
        self.enabled = is_rank0() if enabled is None else as_bool(enabled, "enabled")  # None: rank 0 writes

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.EPOCH_COMPLETED, self)

    def __call__(self, engine: Engine) -> None:
        if not self.enabled or engine.state.best_metric_epoch != engine.state.epoch:
            return
        atomic_save(unwrap(self.network).state_dict(), self.path)
        info = {"labels": self.labels, "epoch": engine.state.epoch, "metric": float(engine.state.best_metric)}
        write_json(sidecar_of(self.path), info)
        logger.info(
            "new best metric %.4f at epoch %d: saved %s", engine.state.best_metric, engine.state.epoch, self.path
        )


def sidecar_of(path: str | Path) -> Path:
    """``models/model.pt`` -> ``models/model.json``: what the weights were trained for."""
    return Path(path).with_suffix(".json")


def load_weights(
    network: torch.nn.Module, path: str | Path, strict: bool = True, labels: Sequence[str] | None = None
) -> torch.nn.Module:
    """Load a ``state_dict`` (or a full training checkpoint's ``network`` entry) into ``network``.

    With ``labels``, weights whose sidecar JSON names other labels are refused; weights whose shapes do not fit the
    network (another number of structures, another ``feature_size``) get a message saying which setting to change.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no such weights file. Train first (configs/train.yaml writes the best weights there), fetch "
            "published weights (large_files.yml), or point --model_path at your weights."
        )
    sidecar = sidecar_of(path)
    if labels is not None and sidecar.is_file():
        trained_for = json.loads(sidecar.read_text()).get("labels")
        if trained_for is not None and list(trained_for) != list(labels):
            raise ValueError(
                f"{path} was trained for labels {trained_for} (see {sidecar.name}), but this run has labels "
                f'{list(labels)}; pass --labels "{trained_for}" or weights trained for {list(labels)}.'
            )
    state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state, dict) and "network" in state and isinstance(state["network"], dict):
        state = state["network"]
    state = {k.removeprefix("module.").removeprefix("_orig_mod."): v for k, v in state.items()}
    try:
        unwrap(network).load_state_dict(state, strict=strict)
    except RuntimeError as err:
        detail = next((line.strip() for line in str(err).splitlines() if "size mismatch" in line), str(err)[:300])
        raise ValueError(
            f"{path}: the weights do not fit this network ({detail}). They were saved for another number of "
            f"structures (this run: labels {list(labels) if labels is not None else '?'}) or another network_def "
            "(e.g. feature_size); use the settings they were trained with."
        ) from err
    return network


def load_pretrained_encoder(network: torch.nn.Module, path: str | Path | None) -> int:
    """Initialise SwinUNETR's Swin encoder from self-supervised weights (MONAI's ``model_swinvit.pt``).

    Keys are mapped to the network's names (``module.`` stripped, ``swin_vit`` -> ``swinViT``, bare encoder keys
    prefixed with ``swinViT.``); tensors whose name and shape match are loaded, the rest of the network keeps its
    initialisation. Returns the number of tensors loaded, which is logged; none at all is an error (wrong file).
    """
    if not path:
        return 0
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such pretrained encoder file; download it (large_files.yml) or unset it.")
    state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    target = unwrap(network).state_dict()
    loaded = {}
    for key, value in state.items():
        name = key.removeprefix("module.").replace("swin_vit", "swinViT")
        if name not in target and f"swinViT.{name}" in target:
            name = f"swinViT.{name}"
        if name in target and target[name].shape == value.shape:
            loaded[name] = value
    encoder = [k for k in target if k.startswith("swinViT.")]
    if not loaded:
        raise ValueError(
            f"{path}: no tensor matches this network's encoder ({len(encoder)} tensors, e.g. {encoder[:1]}); "
            "is it a SwinUNETR/Swin-ViT checkpoint with the same feature_size (48 for model_swinvit.pt)?"
        )
    unwrap(network).load_state_dict(loaded, strict=False)
    logger.info("pretrained encoder %s: loaded %d of %d encoder tensors", path, len(loaded), len(encoder))
    print(f"pretrained encoder: loaded {len(loaded)} of {len(encoder)} encoder tensors from {path}")
    return len(loaded)


def _random_generators(root: Any) -> list[np.random.RandomState]:
    """Every ``RandomState`` reachable from a (nested) Compose or list, in a stable order.

    Transforms keep generators in nested helpers too (``RandCropByPosNegLabeld.cropper``), so attributes are walked,
    not only ``Compose.transforms``.
    """
    found: list[np.random.RandomState] = []
    seen: set[int] = set()

    def visit(obj: Any, depth: int) -> None:
        if id(obj) in seen or depth > 8:
            return
        seen.add(id(obj))
        if isinstance(obj, np.random.RandomState):
            found.append(obj)
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                visit(item, depth + 1)
        elif isinstance(obj, dict):
            for item in obj.values():
                visit(item, depth + 1)
        elif type(obj).__module__.startswith(("monai.", "scripts.")) and hasattr(obj, "__dict__"):
            for item in vars(obj).values():
                visit(item, depth + 1)

    visit(root, 0)
    return found


def _state_of(obj: Any) -> Any:
    return unwrap(obj).state_dict() if isinstance(obj, torch.nn.Module) else obj.state_dict()


def _load_into(obj: Any, state: Any) -> None:
    if isinstance(obj, torch.nn.Module):
        unwrap(obj).load_state_dict(state)
    else:
        obj.load_state_dict(state)


# RNG states travel as tensors so that ``torch.load(weights_only=True)`` accepts the file.
def _numpy_rng_to_tensors(state: tuple) -> dict:
    return {
        "keys": torch.from_numpy(state[1].astype(np.int64)),
        "meta": torch.tensor([state[2], state[3]]),
        "gauss": torch.tensor(state[4], dtype=torch.float64),
    }


def _tensors_to_numpy_rng(state: dict) -> tuple:
    meta = state["meta"].tolist()
    return ("MT19937", state["keys"].numpy().astype(np.uint32), int(meta[0]), int(meta[1]), float(state["gauss"]))


def _python_rng_to_tensors(state: tuple) -> dict:
    return {
        "version": int(state[0]),
        "internal": torch.tensor(state[1], dtype=torch.int64),
        "gauss": state[2] if state[2] is None else float(state[2]),
    }


def _tensors_to_python_rng(state: dict) -> tuple:
    return (state["version"], tuple(int(v) for v in state["internal"].tolist()), state["gauss"])

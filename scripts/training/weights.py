"""Network weights in and out: the best model as model-zoo ``models/model.pt`` (a plain ``state_dict``) with a
``model.json`` saying what it was trained for, loading it back with clear refusals, and the self-supervised Swin
encoder as a starting point.

* :class:`BestModelSaver` writes the weights whenever the evaluator's key metric improves (atomically: a crash while
  saving leaves the previous file intact);
* :func:`load_weights` refuses weights trained for other labels, and turns shape mismatches into the setting to
  change;
* :func:`load_pretrained_encoder` maps MONAI's ``model_swinvit.pt`` keys onto SwinUNETR's encoder.

Everything is loaded with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from ignite.engine import Engine, Events
from scripts.common.config import as_bool
from scripts.common.files import replace_atomically, write_json
from scripts.training.distributed import is_rank0

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


def save_weights(network: torch.nn.Module, path: str | Path, labels: Sequence[str]) -> Path:
    """``network``'s weights at ``path`` (atomically) with the sidecar naming the ``labels`` they segment, as
    :func:`load_weights` reads it: weights of the right shape that no training wrote (tests, benchmarks, the kit)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_save(network.state_dict(), path)
    write_json(sidecar_of(path), {"labels": list(labels)})
    return path


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
            f"{path}: no such weights file, and this bundle publishes no trained weights. Train them: the README's "
            "training command (`python -m monai.bundle run training --config_file configs/train.yaml --dataset_dir "
            "<DICOM>`) writes models/model.pt, the demo (`--config_file "
            "\"['configs/train.yaml','configs/demo.yaml']\"`) runs/demo/model.pt; or pass --model_path <weights "
            "you have>."
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

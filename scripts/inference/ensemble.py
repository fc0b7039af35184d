"""Several trained networks as one, and mirror test-time augmentation (TTA), for evaluation and inference.

* :func:`find_models` -- the weight files that ``model_path`` / ``model_paths`` name: files, or folders of folds as
  :mod:`scripts.evaluation.cross_validation` writes them (``fold_<k>/model.pt``), with the post-processing that a
  cross-validated ensemble chose on its out-of-fold predictions (its folder's ``model.json``);
* :func:`ensemble` -- the network the evaluator runs: for one model without TTA the loaded network itself (exactly the
  single-model pipeline), otherwise an :class:`EnsembleNetwork` of copies of it, one per weight file;
* :class:`EnsembleNetwork` -- per sliding window, every model on the window and on each mirrored copy of it (flipped
  back), their softmax probabilities added into one running sum, and ``log(mean)`` returned.

Why ``log(mean)``: the bundle's post-processing expects logits (softmax, inversion onto the CT's grid, argmax, largest
component), and ``softmax(log p) = p`` for a probability vector, so all of it stays as it is. The sliding window
blends overlapping windows' outputs linearly; a logit differs from ``log p`` by a per-voxel constant that softmax
ignores, so a wrapper of one model gives that model's own result exactly, and an ensemble is, per window, the mean of
its models' probabilities, blended across windows as a single model is. Memory: the models' weights, one model's
activations at a time and one running sum per window -- never every model's output at once; the whole ensemble is
one pass over the windows.
"""

from __future__ import annotations

import copy
import functools
import importlib.metadata
import itertools
import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from monai.transforms import KeepLargestConnectedComponentd
from scripts.common.files import file_sha256
from scripts.inference.backends import LazyNetwork, onnx_network, openvino_network
from scripts.inference.postprocess import fast_postprocessing
from scripts.training.weights import load_weights

if TYPE_CHECKING:
    from scripts.inference.calibration import Calibration

logger = logging.getLogger(__name__)

#: the smallest positive float32: log() of a probability that underflowed stays finite
TINY = torch.finfo(torch.float32).tiny
FOLD_FOLDER = re.compile(r"fold_(\d+)$")


@dataclass(frozen=True)
class Models:
    """Weight files to run together, and the post-processing their cross-validation chose (None: none recorded)."""

    paths: tuple[Path, ...]
    keep_largest_components: int | None = None

    def components_kept(self, explicit: int | None = None) -> int:
        """The ``keep_largest_components`` in force: ``explicit`` (the config's, when given), else what the
        ensemble's ``model.json`` chose, else 1."""
        if explicit is not None:
            return int(explicit)
        return 1 if self.keep_largest_components is None else int(self.keep_largest_components)

    def postprocessing(self, transforms: Sequence, explicit: int | None = None) -> list:
        """``transforms`` (train.yaml's ``inverse_postprocessing``, built with ``explicit`` or 1 components and ending
        with its largest-component step) keeping :meth:`components_kept` components instead, computed where a
        structure can be (:func:`scripts.inference.postprocess.fast_postprocessing`: the same label map, in a fraction
        of the time).

        The steps MONAI Deploy builds from ``models/model.ts`` stay MONAI-only: only the evaluator's copy learns what
        a cross-validated ensemble chose, and runs fast."""
        *head, last = transforms
        if not isinstance(last, KeepLargestConnectedComponentd):
            raise TypeError(f"the post-processing's last step is {type(last).__name__}, not the largest-component one.")
        kept = self.components_kept(explicit)
        if explicit is not None or kept == 1:
            return fast_postprocessing(transforms)
        step = copy.deepcopy(last)
        step.converter.num_components = max(kept, 1)
        step.converter.applied_labels = step.converter.applied_labels if kept > 0 else ()
        return fast_postprocessing([*head, step])

    def record(
        self, tta_axes: Sequence[int] | None, keep_largest_components: int, backend: str = "torch",
        precision: str = "f32",
    ) -> dict[str, str]:  # fmt: skip
        """What made a prediction, for the DICOM SEG's algorithm parameters and the reports: each weight file with
        the start of its SHA-256, the TTA, the post-processing, the backend that ran the network, with its version,
        and its precision (no ``,`` or ``=``, DICOM's separators)."""
        files = "; ".join(f"{path} (sha256 {file_sha256(path)[:16]})" for path in self.paths)
        flips = mirror_flips(tta_axes)
        tta = "none" if len(flips) == 1 else f"mirror axes {'+'.join(map(str, tta_axes))} ({len(flips)} passes)"
        record = {"models": files, "num_models": str(len(self.paths)), "tta": tta,
                  "keep_largest_components": str(int(keep_largest_components)),
                  "backend": _backend_version(backend), "precision": precision}  # fmt: skip
        return {k: v.replace(",", ";").replace("=", ":") for k, v in record.items()}


def find_models(
    model_path: str | Path, model_paths: str | Path | Sequence[str | Path] | None = None, labels: Sequence[str] = ()
) -> Models:
    """The weight files to use: ``model_paths`` (files and/or folders of folds; one path or a list) if given, else
    ``model_path`` alone.

    A folder stands for the models its ``model.json`` lists (written by cross-validation, with the post-processing it
    chose), or else for its ``fold_<k>/model.pt`` files in fold order. Raises ``ValueError`` naming the folder when
    it holds no model, when its ``model.json`` was written for other ``labels``, or when two folders chose different
    post-processing.
    """
    if model_paths in (None, "", [], ()):
        return Models((Path(model_path),))
    entries = [model_paths] if isinstance(model_paths, (str, Path)) else list(model_paths)
    paths: list[Path] = []
    chosen: set[int] = set()
    for entry in map(Path, entries):
        if entry.is_dir():
            found, keep = _models_in_folder(entry, labels)
            paths += found
            chosen |= {keep} if keep is not None else set()
        else:
            paths.append(entry)
    if len(chosen) > 1:
        raise ValueError(f"model_paths {entries}: the folders chose different keep_largest_components {sorted(chosen)}"
                         "; pass --keep_largest_components N to decide.")  # fmt: skip
    return Models(tuple(paths), chosen.pop() if chosen else None)


def _models_in_folder(folder: Path, labels: Sequence[str]) -> tuple[list[Path], int | None]:
    """The models of a cross-validation folder and the post-processing its ``model.json`` chose."""
    description = folder / "model.json"
    info = json.loads(description.read_text()) if description.is_file() else {}
    if labels and info.get("labels") is not None and list(info["labels"]) != list(labels):
        raise ValueError(
            f"{description} describes models trained for labels {info['labels']}, but this run has labels "
            f'{list(labels)}; pass --labels "{info["labels"]}" or other models.'
        )
    if info.get("models"):
        return [folder / m["path"] for m in info["models"]], info.get("keep_largest_components")
    folds = [p for p in folder.glob("fold_*/model.pt") if FOLD_FOLDER.match(p.parent.name)]
    if not folds:
        raise ValueError(
            f"{folder}: no model.json listing models and no fold_<k>/model.pt in it. Give weight files, or the "
            "output folder of `python -m scripts.cross_validation run` once its folds have trained."
        )
    return sorted(folds, key=lambda p: int(FOLD_FOLDER.match(p.parent.name).group(1))), None


def mirror_flips(axes: Sequence[int] | None) -> list[tuple[int, ...]]:
    """Tensor dims to flip for mirror TTA along the spatial ``axes`` (0, 1, 2 = x, y, z): the un-flipped input and
    every combination of the axes, as nnU-Net mirrors (2^n passes)."""
    axes = sorted({int(a) for a in (axes or [])})
    if any(a not in (0, 1, 2) for a in axes):
        raise ValueError(f"tta_axes={axes}: give spatial axes among 0, 1, 2 (x, y, z), e.g. [0, 1, 2].")
    dims = [a + 2 for a in axes]  # [batch, channel, x, y, z]
    return [c for n in range(len(dims) + 1) for c in itertools.combinations(dims, n)]


class EnsembleNetwork(torch.nn.Module):
    """Mean softmax probability of ``models`` over the input and its mirrored copies (``flips``: tensor dims, as
    :func:`mirror_flips` gives them), returned as its log so that the usual softmax post-processing recovers it."""

    def __init__(self, models: Sequence[torch.nn.Module], flips: Sequence[Sequence[int]] = ((),)) -> None:
        super().__init__()
        if not models:
            raise ValueError("an ensemble needs at least one model.")
        self.models = torch.nn.ModuleList(models)
        self.flips = [tuple(int(d) for d in f) for f in flips] or [()]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total = None
        for dims in self.flips:
            view = torch.flip(x, dims) if dims else x
            for model in self.models:
                probs = torch.softmax(model(view).float(), dim=1)  # the logits are freed here
                probs = torch.flip(probs, dims) if dims else probs
                total = probs if total is None else total.add_(probs)
                del probs  # only the running sum stays alive while the next model runs
            del view
        count = len(self.flips) * len(self.models)
        return torch.log(total.div_(count).clamp_min_(TINY))


def ensemble(
    network: torch.nn.Module,
    models: Models,
    labels: Sequence[str] | None = None,
    tta_axes: Sequence[int] | None = None,
    backend: str = "torch",
    window: Sequence[int] | None = None,
    cache_dir: str | Path | None = None,
    threads: int | None = None,
    precision: str = "f32",
    calibration: Calibration | None = None,
) -> torch.nn.Module:
    """``network`` with the weights of ``models`` loaded: itself for one model without TTA, else an
    :class:`EnsembleNetwork` of ``network`` and deep copies of it, one per weight file (each checked against
    ``labels`` by :func:`scripts.training.weights.load_weights`).

    ``backend="openvino"`` or ``"onnxruntime"``: each model is run by that CPU runtime instead
    (:mod:`scripts.inference.backends`: exported once per weights file at the sliding ``window``'s shape, cached in
    ``cache_dir`` or beside the weights, ``threads`` intra-op threads; OpenVINO in ``precision``, int8 quantised on
    ``calibration``'s windows), inside the same
    ensemble and TTA; each made when first called or by :func:`scripts.inference.backends.prepare` (the runs call it
    first)."""
    flips = mirror_flips(tta_axes)
    members = []
    for i, path in enumerate(models.paths):
        member = load_weights(network if i == 0 else copy.deepcopy(network), path, labels=labels)
        if backend in ("onnxruntime", "openvino"):
            if window is None:
                raise ValueError(f"backend {backend}: give the sliding window's shape (window=roi_size).")
            if backend == "openvino":
                make = functools.partial(openvino_network, member, path, window, cache_dir, threads, precision,
                                         calibration)  # fmt: skip
            else:
                make = functools.partial(onnx_network, member, path, window, cache_dir, threads)
            member = LazyNetwork(make, f"{backend} {precision}: {path}, exported and compiled when first used")
        members.append(member)
    if len(members) == 1 and len(flips) == 1:
        return members[0]
    logger.info("ensemble of %d model(s) x %d mirror pass(es) (%s): %s", len(members), len(flips), backend,
                ", ".join(map(str, models.paths)))  # fmt: skip
    return EnsembleNetwork(members, flips)


def _backend_version(backend: str) -> str:
    """``torch 2.13.0``, ``openvino 2026.4.1`` or ``onnxruntime 1.32.0``: the backend that ran the network."""
    if backend in ("onnxruntime", "openvino"):
        return f"{backend} {importlib.metadata.version(backend)}"  # the release (openvino's __version__ has its build)
    return f"torch {torch.__version__}"

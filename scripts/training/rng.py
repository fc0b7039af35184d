"""Random-number state that survives a checkpoint: the global torch / numpy / Python generators and every generator a
transform pipeline holds, captured as tensors (so ``torch.load(weights_only=True)`` accepts the file) and restored.

With it a resumed run draws the same random crops and augmentations as an uninterrupted one.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture(generators: list[np.random.RandomState]) -> dict:
    """The global generators' states and those of ``generators`` (see :func:`random_generators`), as tensors."""
    return {
        "torch": torch.get_rng_state(),
        "numpy": _numpy_rng_to_tensors(np.random.get_state()),
        "python": _python_rng_to_tensors(random.getstate()),
        "transforms": [_numpy_rng_to_tensors(r.get_state()) for r in generators],
    }


def restore(state: dict, generators: list[np.random.RandomState]) -> bool:
    """Put back what :func:`capture` saved; False when the transform generators do not match ``generators`` (a
    different pipeline: those are then left as they are)."""
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "numpy" in state:
        np.random.set_state(_tensors_to_numpy_rng(state["numpy"]))
    if "python" in state:
        random.setstate(_tensors_to_python_rng(state["python"]))
    saved = state.get("transforms", [])
    if len(saved) != len(generators):
        return False
    for generator, generator_state in zip(generators, saved, strict=True):
        generator.set_state(_tensors_to_numpy_rng(generator_state))
    return True


def random_generators(root: Any) -> list[np.random.RandomState]:
    """Every ``RandomState`` reachable from a (nested) Compose or list, in a stable order.

    Transforms keep generators in nested helpers too (``RandCropByPosNegLabeld.cropper``), so attributes are walked,
    not only ``Compose.transforms``; a transform outside any Compose draws from MONAI's shared class-level generator,
    which is then listed (once).
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
            # a transform never seeded by a Compose draws from MONAI's class-level ``Randomizable.R`` (not in vars)
            if "R" not in vars(obj) and isinstance(getattr(obj, "R", None), np.random.RandomState):
                visit(obj.R, depth + 1)

    visit(root, 0)
    return found


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

"""Per-case items of an evaluator iteration, for handlers that look at cases one by one (metrics, pictures)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from ignite.engine import Engine


def merged_items(engine: Engine) -> list[dict]:
    """Per case, the evaluator's batch and output dicts in one (MONAI keeps ``case_id`` and other inputs in the batch,
    the network's ``image``/``pred`` and keys made by post-processing in the output)."""
    batch, output = engine.state.batch, engine.state.output
    if not isinstance(output, list):
        batch, output = [batch], [output]
    if not isinstance(batch, list) or len(batch) != len(output):
        return [dict(o) for o in output]
    return [{**b, **o} for b, o in zip(batch, output, strict=True)]


def label_map(tensor) -> np.ndarray:
    """A label map [X, Y, Z] from a one-hot [C, X, Y, Z] or a label map [1, X, Y, Z] tensor."""
    array = np.asarray(tensor.detach().cpu() if isinstance(tensor, torch.Tensor) else tensor)
    if array.ndim == 4 and array.shape[0] > 1:
        return array.argmax(0).astype(np.uint8)
    return array.reshape(array.shape[-3:]).astype(np.uint8)


def case_id_of(item: dict) -> str:
    case_id = item.get("case_id")
    if case_id is None:
        meta = getattr(item.get("image"), "meta", {})
        case_id = Path(str(meta.get("filename_or_obj", "case"))).name.split(".")[0]
    return str(case_id)

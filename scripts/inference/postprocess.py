"""The label map on the CT's own grid from the network's logits, computed only where a structure can be.

train.yaml's ``inverse_postprocessing`` is MONAI's own chain -- softmax, ``Invertd`` (the probabilities resampled
back through the preprocessing onto the CT's grid), argmax, largest component -- and MONAI Deploy and MONAI Label
run it as it is. On a 512 x 512 x 100 chest CT it took 10 s on 2 CPU cores (``python -m benchmarks.bench_outputs``):
every channel of every voxel is resampled in float64, ``torch.argmax`` over the channel axis is ~20x slower than
``torch.max`` there, and the components are labelled over the whole grid, while the tumour fills a few thousandths
of it. The evaluator's copy of the chain (``trained_postprocessing``,
:meth:`scripts.inference.ensemble.Models.postprocessing`) is :func:`fast_postprocessing` of it, which gives the same
label map:

* :class:`InvertedLabelsd` replaces softmax, ``Invertd`` and argmax. A voxel of the CT grid can take a class other
  than background only if one of the 8 voxels it is interpolated from has that class's probability at least the
  background's (trilinear interpolation is a convex combination). So the probabilities are resampled, by MONAI's own
  ``SpatialResample`` with the settings the preprocessing recorded, only over the CT voxels that draw on the bounding
  box of such voxels (grown by one voxel); every other voxel is background. Where that box reaches the edge of the
  network's grid (where the inversion pads), or the preprocessing holds a step this does not know, MONAI's chain runs
  as it is.
* :class:`BoxedLargestComponentd` runs MONAI's largest-component step on the bounding box of the labels only (no
  component reaches outside it).

``tests/test_postprocess.py`` holds both to MONAI's chain, voxel for voxel and in their metadata.
"""

from __future__ import annotations

import copy
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from monai.data import MetaTensor
from monai.transforms import (
    Activationsd,
    AsDiscreted,
    Invertd,
    KeepLargestConnectedComponentd,
    MapTransform,
    SpatialResample,
)
from scripts.common.geometry import bounding_box, shifted

#: the preprocessing steps whose inversion is the resampling between two grids' affines (MONAI's trace names)
SPATIAL_STEPS = frozenset({"Orientation", "SpatialResample", "Spacing", "CropForeground", "SpatialPad", "BorderPad",
                           "DivisiblePad", "Pad", "SpatialCrop", "CenterSpatialCrop", "Crop"})  # fmt: skip


def fast_postprocessing(transforms: Sequence) -> list:
    """``transforms`` with softmax, ``Invertd`` and argmax in a row (on one key) as one :class:`InvertedLabelsd`, and
    a last largest-component step as :class:`BoxedLargestComponentd`; anything else as it is."""
    steps = list(transforms)
    for i in range(len(steps) - 2):
        if InvertedLabelsd.replaces(*steps[i : i + 3]):
            steps[i : i + 3] = [InvertedLabelsd(*steps[i : i + 3])]
            break
    if steps and isinstance(steps[-1], KeepLargestConnectedComponentd):
        steps[-1] = BoxedLargestComponentd(steps[-1])
    return steps


class InvertedLabelsd(MapTransform):
    """Softmax, ``Invertd`` and argmax (the three MONAI steps it is made from) computed only over the CT voxels that
    can be other than background; everything else is background (see the module's docstring). The output is
    ``Invertd``'s then argmax's: the class index as float on the CT's grid, the original image's metadata with the
    CT's affine."""

    def __init__(self, activation: Activationsd, invert: Invertd, discrete: AsDiscreted) -> None:
        super().__init__(activation.keys)
        self.steps = (activation, invert, discrete)
        self.orig_key = invert.orig_keys[0]

    @staticmethod
    def replaces(activation: Any, invert: Any, discrete: Any) -> bool:
        """Whether the three steps are softmax, a linear ``Invertd`` and a plain argmax on the same single key."""
        if not (isinstance(activation, Activationsd) and isinstance(invert, Invertd)
                and isinstance(discrete, AsDiscreted)):  # fmt: skip
            return False
        keys = tuple(activation.keys)
        return (
            len(keys) == 1 and tuple(invert.keys) == keys and tuple(discrete.keys) == keys
            and activation.softmax[0] and not activation.sigmoid[0] and activation.other[0] is None
            and not activation.converter.kwargs  # softmax over the channels (dim 0)
            and not invert.nearest_interp[0] and invert.post_func[0] is None and invert.device[0] is None
            and discrete.argmax[0] and discrete.to_onehot[0] is None and discrete.threshold[0] is None
            and discrete.rounding[0] is None and not discrete.converter.kwargs  # argmax over dim 0, float out
        )  # fmt: skip

    def __call__(self, data: Mapping[Hashable, Any]) -> dict:
        d = dict(data)
        key = self.keys[0]
        if key not in d:
            return d
        labels = self._labels(d[key], d.get(self.orig_key))
        if labels is None:  # MONAI's chain, as it is
            activation, invert, discrete = self.steps
            return discrete(invert(activation(d)))
        d[key] = labels
        return d

    def _labels(self, pred: Any, image: Any) -> MetaTensor | None:
        """The label map on the CT's grid, or None where MONAI's chain must run."""
        grids = _grids(pred, image)
        if grids is None:
            return None
        shape, ct_affine, net_affine, resample = grids
        logits = pred.as_tensor().detach()
        probs = torch.softmax(logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits, 0)
        labels = torch.zeros((1, *shape), dtype=torch.float32, device=probs.device)  # AsDiscrete's dtype
        candidates = probs[1:].amax(0) >= probs[0]  # voxels where a structure is at least as likely as background
        if candidates.any():
            first, stop = bounding_box(candidates.cpu())
            low, high = first - 1, stop  # the voxels each candidate's neighbours interpolate from (last included)
            if (low < 0).any() or (high >= np.array(candidates.shape)).any():
                return None  # the inversion pads beyond the network's grid there
            block = probs[(slice(None), *(slice(a, b + 1) for a, b in zip(low, high, strict=True)))]
            out_low, out_high = _ct_box(low, high, net_affine, ct_affine, shape)
            if (out_high >= out_low).all():
                source = MetaTensor(block, affine=torch.as_tensor(shifted(net_affine, low)))
                target = torch.as_tensor(shifted(ct_affine, out_low))
                size = [int(v) for v in out_high - out_low + 1]
                values = resample(source, dst_affine=target, spatial_size=size)
                labels[(slice(None), *(slice(a, b + 1) for a, b in zip(out_low, out_high, strict=True)))] = (
                    values.as_tensor().max(0).indices.to(labels.dtype)  # torch's max: the first of equal maxima
                )
        meta = copy.deepcopy(image.meta)
        meta["affine"] = torch.as_tensor(ct_affine, dtype=torch.float64)
        return MetaTensor(labels, meta=meta)


def _grids(pred: Any, image: Any) -> tuple | None:
    """The CT's grid (shape, affine), the network's grid (affine) and the resampling the preprocessing recorded; None
    where the preprocessing is not a chain of resamplings, crops and pads, or the metadata is not MetaTensor's."""
    if not (isinstance(pred, MetaTensor) and isinstance(image, MetaTensor)) or pred.ndim != 4:
        return None
    operations = image.applied_operations
    if not operations or tuple(pred.shape[1:]) != tuple(image.shape[1:]) or "original_affine" not in image.meta:
        return None
    if any(op.get("class") not in SPATIAL_STEPS for op in operations):
        return None
    resamplings = [op for op in operations if op.get("class") in ("SpatialResample", "Spacing")]
    if len(resamplings) > 1:
        return None
    info = resamplings[0].get("extra_info", {}) if resamplings else {}
    dtype = getattr(torch, str(info.get("dtype", "float64")).replace("torch.", ""))
    resample = SpatialResample(mode=info.get("mode", "bilinear"), padding_mode=info.get("padding_mode", "border"),
                               align_corners=info.get("align_corners", False), dtype=dtype)  # fmt: skip
    shape = tuple(int(v) for v in operations[0]["orig_size"])
    ct_affine = np.asarray(image.meta["original_affine"], dtype=np.float64).reshape(4, 4)
    net_affine = np.asarray(image.affine, dtype=np.float64).reshape(4, 4)
    return shape, ct_affine, net_affine, resample


def _ct_box(low: np.ndarray, high: np.ndarray, net_affine: np.ndarray, ct_affine: np.ndarray, shape: Sequence[int]):
    """The CT voxels (first, last along each axis) whose centres lie in the network-grid box [low, high], grown by a
    voxel for rounding, clipped to the CT's grid."""
    corners = np.array([[low[0] if i & 1 else high[0], low[1] if i & 2 else high[1], low[2] if i & 4 else high[2], 1]
                        for i in range(8)], dtype=np.float64)  # fmt: skip
    in_ct = (np.linalg.inv(ct_affine) @ net_affine @ corners.T)[:3].T
    first = np.maximum(np.floor(in_ct.min(0)).astype(int) - 1, 0)
    last = np.minimum(np.ceil(in_ct.max(0)).astype(int) + 1, np.asarray(shape) - 1)
    return first, last


class BoxedLargestComponentd(MapTransform):
    """MONAI's largest-component step (``step``) run on the bounding box of the labels under its keys: every
    component lies inside that box, so the result is the same, at the cost of the box."""

    def __init__(self, step: KeepLargestConnectedComponentd) -> None:
        super().__init__(step.keys, step.allow_missing_keys)
        self.step = step

    @property
    def converter(self) -> Any:  # what scripts.inference.ensemble adjusts (num_components, applied_labels)
        return self.step.converter

    def __call__(self, data: Mapping[Hashable, Any]) -> dict:
        d = dict(data)
        for key in self.key_iterator(d):
            labels = d[key]
            if not isinstance(labels, torch.Tensor) or labels.ndim != 4 or labels.shape[0] != 1:
                d[key] = self.step.converter(labels)
                continue
            found = bounding_box((labels[0] != 0).cpu())
            if found is None:
                continue
            box = (slice(None), *(slice(a, b) for a, b in zip(*found, strict=True)))
            kept = self.step.converter(labels[box].as_tensor() if isinstance(labels, MetaTensor) else labels[box])
            out = labels.clone()
            out[box] = torch.as_tensor(kept, dtype=labels.dtype, device=labels.device)
            d[key] = out
        return d

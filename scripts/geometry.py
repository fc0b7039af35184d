"""Voxel sizes and volumes from an affine: the one place the bundle turns voxel counts into mm and ml."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def spacing_of(affine: np.ndarray | torch.Tensor) -> tuple[float, ...]:
    """Voxel size in mm along each array axis: the lengths of the affine's first three columns."""
    affine = np.asarray(affine.cpu() if isinstance(affine, torch.Tensor) else affine, dtype=float)
    return tuple(float(v) for v in np.linalg.norm(affine[:3, :3], axis=0))


def voxel_volume_ml(affine_or_spacing: np.ndarray | torch.Tensor | Sequence[float]) -> float:
    """The volume of one voxel in ml, from an affine (the determinant of its 3x3 part, right for sheared grids too)
    or from three voxel sizes in mm."""
    values = np.asarray(
        affine_or_spacing.cpu() if isinstance(affine_or_spacing, torch.Tensor) else affine_or_spacing, dtype=float
    )
    if values.ndim == 2:
        return float(abs(np.linalg.det(values[:3, :3]))) / 1000.0
    return float(np.prod(values)) / 1000.0

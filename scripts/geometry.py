"""Voxel sizes and volumes from an affine: the one place the bundle turns voxel counts into mm and ml."""

from __future__ import annotations

import numpy as np


def spacing_of(affine) -> tuple[float, ...]:
    """Voxel size in mm along each array axis: the lengths of the affine's first three columns (a numpy array or a
    torch tensor; torch is not imported here, so CLIs that only prepare data start fast)."""
    affine = _numpy(affine)
    return tuple(float(v) for v in np.linalg.norm(affine[:3, :3], axis=0))


def voxel_volume_ml(affine_or_spacing) -> float:
    """The volume of one voxel in ml, from an affine (the determinant of its 3x3 part, right for sheared grids too)
    or from three voxel sizes in mm."""
    values = _numpy(affine_or_spacing)
    if values.ndim == 2:
        return float(abs(np.linalg.det(values[:3, :3]))) / 1000.0
    return float(np.prod(values)) / 1000.0


def _numpy(values) -> np.ndarray:
    return np.asarray(values.cpu() if hasattr(values, "cpu") else values, dtype=float)

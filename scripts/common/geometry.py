"""Voxel sizes and volumes from an affine: the one place the bundle turns voxel counts into mm and ml; and the box
of a mask's voxels with the affine that places it."""

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


def bounding_box(mask) -> tuple[np.ndarray, np.ndarray] | None:
    """The first and one-past-the-last index of ``mask``'s true voxels along each axis (a numpy array or a CPU torch
    tensor), None when it has none."""
    mask = np.asarray(mask)
    present = [
        np.flatnonzero(np.any(mask, axis=tuple(b for b in range(mask.ndim) if b != a))) for a in range(mask.ndim)
    ]
    if not present[0].size:
        return None
    return np.array([p[0] for p in present]), np.array([p[-1] + 1 for p in present])


def shifted(affine: np.ndarray, offset) -> np.ndarray:
    """The affine of the grid that starts at voxel ``offset`` of ``affine``'s grid (a crop of it)."""
    shift = np.eye(4)
    shift[:3, 3] = np.asarray(offset, dtype=float)
    return np.asarray(affine, dtype=float) @ shift


def _numpy(values) -> np.ndarray:
    return np.asarray(values.cpu() if hasattr(values, "cpu") else values, dtype=float)

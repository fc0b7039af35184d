"""Voxel sizes and volumes in mm and ml, from affines of any orientation."""

from __future__ import annotations

import numpy as np
import pytest
from scripts.common.geometry import spacing_of, voxel_volume_ml


def test_spacing_comes_from_the_affine_columns():
    affine = np.diag([-0.7, -0.7, 3.0, 1.0])
    affine[:3, :3] = affine[:3, :3] @ np.array([[0, 1, 0], [1, 0, 0], [0, 0, 1]])  # swapped axes
    assert spacing_of(affine) == pytest.approx((0.7, 0.7, 3.0))


def test_voxel_volume_is_the_same_from_an_affine_or_its_spacing():
    affine = np.diag([-0.7, -0.7, 3.0, 1.0])
    assert voxel_volume_ml(affine) == pytest.approx(0.7 * 0.7 * 3.0 / 1000)
    assert voxel_volume_ml([0.7, 0.7, 3.0]) == pytest.approx(voxel_volume_ml(affine))

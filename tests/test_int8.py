"""int8's check against f32 (scripts/inference/int8.py): the share of voxels with the same class per window and the
tumour over all windows, judged by the guard the bundle's tests hold int8 to; too little tumour is judged by agreement
alone. (Quantisation, the record and the fallback to f32: tests/test_backends.py; the demo's weights on an AVX2 CPU's
kernels: tests/test_workflow_inference.py.)"""

from __future__ import annotations

import numpy as np
import pytest
from scripts.inference.int8 import GUARD, check_against_f32


def model(labels: np.ndarray):
    """A compiled model as OpenVINO's is called (``compiled([x])[0]``): two-class logits whose argmax is ``labels``."""
    logits = np.stack([1 - labels, labels], axis=1).astype(np.float32)
    return lambda inputs: [logits]


def window_of(tumour: slice, size: int = 32) -> np.ndarray:
    labels = np.zeros((1, size, size, size), np.int64)
    labels[0, tumour, tumour, tumour] = 1
    return labels


def test_the_same_label_maps_pass_and_one_voxel_in_a_thousand_lost_from_the_tumour_fails_the_volume():
    f32 = window_of(slice(8, 24))  # 4,096 tumour voxels
    assert check_against_f32(model(f32), model(f32), [None], "avx2").accepted
    smaller = f32.copy()
    smaller[0, 8, 8:24, 8:24] = 0  # 256 voxels (6.25 %) fewer: Dice 0.968, agreement 0.992
    check = check_against_f32(model(f32), model(smaller), [None], "avx2")
    assert not check.accepted and check.tumour_dice == pytest.approx(2 * 3840 / (4096 + 3840))
    assert check.volume_change == pytest.approx(-0.0625) and check.agreement_min == pytest.approx(1 - 256 / 32**3)
    assert "tumour Dice 0.9677, volume -6.25%" in check.describe()


def test_without_tumour_to_judge_by_the_share_of_matching_voxels_decides():
    empty = window_of(slice(0, 0))
    speckled = empty.copy()
    speckled[0, ::4, ::4, ::4] = 1  # 512 of 32,768 voxels differ: 98.4 % agree, below the guard
    check = check_against_f32(model(empty), model(speckled), [None, None], "avx2")
    assert check.tumour_dice is None and check.windows == 2 and not check.accepted
    assert check.agreement_min == pytest.approx(1 - 512 / 32**3) and check.agreement_min < GUARD["agreement"]
    assert "no tumour to judge by (0 voxels in f32)" in check.describe()
    assert check_against_f32(model(empty), model(empty), [None], "avx2").accepted
    assert not check_against_f32(model(empty), model(empty), [], "avx2").accepted, "no window, no proof"

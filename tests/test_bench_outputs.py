"""The outputs benchmark's thorax row is a mask built to defeat the writers -- the body without the lungs' air, a
vessel hole every 5 mm -- and its table has a row per mask that says whether the case was flagged. (The benchmark
itself writes a 512 x 512 x 100 CT: measured for docs/performance.md, not run here.)"""

from __future__ import annotations

import numpy as np
import torch
from benchmarks.bench_outputs import BODY_HU, VESSEL_PERIOD_MM, OracleInferer, format_result
from monai.data import MetaTensor


def test_the_thorax_oracle_marks_the_body_but_the_lungs_and_a_vessel_every_5_mm():
    hu = np.full((40, 40, 4), 40.0, np.float32)  # soft tissue ...
    hu[:, 20:] = -850.0  # ... and lung
    affine = np.diag([-0.5, -0.5, 3.0, 1.0])  # RAS of an LPS-stored CT, 0.5 mm pixels
    image = MetaTensor(torch.from_numpy((hu[None, None] + 1000.0) / 1500.0), affine=torch.from_numpy(affine))
    oracle = OracleInferer({}, "thorax", roi_size=(16, 16, 4), hu_window=(-1000.0, 500.0))
    tumour = oracle._logits(image, (slice(0, 40), slice(0, 40), slice(0, 4)))[0, 1].numpy() > 0
    assert not tumour[:, 20:].any(), "the lungs' air is a hole"
    i, j = np.meshgrid(np.arange(40), np.arange(40), indexing="ij")
    vessel = np.sin(2 * np.pi * 0.5 * i / VESSEL_PERIOD_MM) * np.sin(2 * np.pi * 0.5 * j / VESSEL_PERIOD_MM) > 0.5
    np.testing.assert_array_equal(tumour[:, :20, 0], ~vessel[:, :20])
    assert BODY_HU < 40.0 and 0.05 < vessel[:, :20].mean() < 0.3  # vessels: holes in the tissue, not most of it


def test_the_table_has_a_row_per_mask_saying_whether_it_was_flagged():
    run = {"repeats": 2, "first_total_s": 9.0, "total_s": 7.0, "stages": {"postprocess": 0.5, "write": 3.0},
           "transforms": {"InvertedLabelsd": 0.4}, "tumour_ml": 14.1, "analytic_tumour_ml": 14.07,
           "postprocess_and_write_s": 3.5, "flags": []}  # fmt: skip
    result = {"slices": 100, "masks": {"tumour": run, "thorax": {**run, "tumour_ml": 9504.4, "flags": ["GTV-1: big"]}}}
    lines = format_result(result).splitlines()
    assert "| tumour | 14.1 ml | no | 0.50 | 3.00 | 3.50 | 7.00 |" in lines
    assert "| thorax | 9504.4 ml | yes (1) | 0.50 | 3.00 | 3.50 | 7.00 |" in lines
    assert "flagged: GTV-1: big" in lines and "tumour: 14.1 ml written, 14.07 ml analytic" in lines


def test_the_table_gives_the_write_stage_output_by_output_and_says_which_outputs_were_on():
    run = {"repeats": 2, "first_total_s": 9.0, "total_s": 7.0, "stages": {"postprocess": 0.5, "write": 0.4},
           "transforms": {}, "outputs": {"nifti": 0.03, "dicom_seg": 0.25}, "tumour_ml": 14.1,
           "analytic_tumour_ml": 14.07, "postprocess_and_write_s": 0.9, "flags": []}  # fmt: skip
    lines = format_result({"slices": 120, "outputs": "kit", "masks": {"tumour": run}}).splitlines()
    assert "the GPU kit's outputs (NIfTI, SEG)" in lines[0]
    assert "| nifti | 0.030 |" in lines and "| dicom_seg | 0.250 |" in lines

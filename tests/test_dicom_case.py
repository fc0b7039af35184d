"""One case read whole: the CT and labels read from a SEG or an RTSTRUCT onto the same grid, from the CT's folder or
from its files as discovery lists them (which annotation a case takes is tests/test_dicom_discovery.py's)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from scripts.data.dicom.case import read_case
from scripts.data.synthetic import write_case


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> dict:
    """A small case with both a SEG (in seg/) and an RTSTRUCT (in rtstruct/), as NSCLC-Radiomics ships them."""
    out = tmp_path_factory.mktemp("case")
    return write_case(out, "P1", seed=3, shape=(48, 48, 16), pixel_spacing=(2.0, 2.0), rtstruct=True)


def test_seg_and_rtstruct_give_the_same_labels_on_the_ct_grid(case):
    from_seg = read_case(case["image_dir"], case["seg_file"])
    from_rtstruct = read_case(case["image_dir"], case["rtstruct_file"])
    np.testing.assert_array_equal(from_seg.affine, from_rtstruct.affine)
    np.testing.assert_array_equal(from_seg.image, from_rtstruct.image)
    a, b = from_seg.label == 1, from_rtstruct.label == 1
    assert 2 * (a & b).sum() / (a.sum() + b.sum()) >= 0.97
    assert from_seg.label.dtype == np.uint8 and from_seg.image.dtype == np.int16
    assert int(a.sum()) == case["tumour"]["num_voxels"]
    assert from_seg.patient_id == "P1" and from_seg.info["shape"] == [48, 48, 16]


def test_the_ct_read_from_its_files_equals_the_ct_read_from_its_folder(case, tmp_path):
    """Discovery hands the reader a list of files (a series may share its folder with others): same volume."""
    files = sorted(Path(case["image_dir"]).glob("*.dcm"), reverse=True)  # any order: slices are sorted in space
    from_files, from_folder = read_case(files, case["seg_file"]), read_case(case["image_dir"], case["seg_file"])
    np.testing.assert_array_equal(from_files.image, from_folder.image)
    np.testing.assert_array_equal(from_files.label, from_folder.label)
    np.testing.assert_array_equal(from_files.affine, from_folder.affine)

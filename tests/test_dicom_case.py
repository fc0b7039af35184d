"""One case read whole: which annotation a case's labels come from (by SOP Class, whatever the file names), and the
CT and labels read from a SEG or an RTSTRUCT onto the same grid."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from scripts.dicom import DicomCaseError
from scripts.dicom.case import find_annotation, read_case
from scripts.synthetic import write_case


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> dict:
    """A small case with both a SEG (in seg/) and an RTSTRUCT (in rtstruct/), as NSCLC-Radiomics ships them."""
    out = tmp_path_factory.mktemp("case")
    return write_case(out, "P1", seed=3, shape=(48, 48, 16), pixel_spacing=(2.0, 2.0), rtstruct=True)


def copy_of(case: dict, tmp_path: Path) -> Path:
    folder = Path(case["image_dir"]).parent
    return Path(shutil.copytree(folder, tmp_path / folder.name))


def test_auto_takes_the_seg_and_each_source_can_be_asked_for(case):
    folder = Path(case["image_dir"]).parent
    assert find_annotation(folder) == Path(case["seg_file"])
    assert find_annotation(folder, "seg") == Path(case["seg_file"])
    assert find_annotation(folder, "rtstruct") == Path(case["rtstruct_file"])


def test_auto_falls_back_to_the_rtstruct_and_file_names_do_not_matter(case, tmp_path):
    folder = copy_of(case, tmp_path)
    (folder / "seg" / "1-1.dcm").unlink()
    renamed = folder / "rtstruct" / "contours"  # no .dcm
    (folder / "rtstruct" / "1-1.dcm").rename(renamed)
    (folder / "rtstruct" / "notes.txt").write_text("not DICOM")
    assert find_annotation(folder) == renamed
    with pytest.raises(DicomCaseError, match=r"no SEG in seg/ or rtstruct/ \(it holds 1 RTSTRUCT\)"):
        find_annotation(folder, "seg")


def test_a_case_without_annotation_folders_or_with_two_segs_says_what_it_holds(case, tmp_path):
    folder = copy_of(case, tmp_path)
    shutil.copy(folder / "seg" / "1-1.dcm", folder / "seg" / "copy.dcm")
    with pytest.raises(DicomCaseError, match=r"2 SEG objects \(seg/1-1.dcm, seg/copy.dcm\)"):
        find_annotation(folder)
    shutil.rmtree(folder / "seg")
    shutil.rmtree(folder / "rtstruct")
    with pytest.raises(DicomCaseError, match="no seg folder"):
        find_annotation(folder)
    with pytest.raises(ValueError, match="label_source='contours'"):
        find_annotation(folder, "contours")


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

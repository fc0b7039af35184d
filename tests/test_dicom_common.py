"""What every DICOM reader of the bundle shares: an object's SOP Class from its header, and the one object of a
kind in a folder, whatever the file names."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from scripts.dicom import DicomCaseError
from scripts.dicom.common import find_single, sop_class_of
from scripts.synthetic import write_case


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> dict:
    return write_case(tmp_path_factory.mktemp("common"), "P1", seed=3, shape=(48, 48, 16), pixel_spacing=(2.0, 2.0))


def test_sop_class_is_read_from_the_header_and_find_single_names_what_is_missing(case, tmp_path):
    assert sop_class_of(Path(case["seg_file"])) == "1.2.840.10008.5.1.4.1.1.66.4"
    (tmp_path / "notes.txt").write_text("not DICOM")
    assert sop_class_of(tmp_path / "notes.txt") == ""
    with pytest.raises(DicomCaseError, match="no rtstruct folder"):
        find_single(tmp_path / "rtstruct", "1.2.840.10008.5.1.4.1.1.481.3", "RTSTRUCT")
    shutil.copy(case["seg_file"], tmp_path / "a.dcm")
    with pytest.raises(DicomCaseError, match=r"holds no RTSTRUCT \(a.dcm are not RTSTRUCT objects\)"):
        find_single(tmp_path, "1.2.840.10008.5.1.4.1.1.481.3", "RTSTRUCT")

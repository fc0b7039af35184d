"""What every DICOM reader of the bundle shares: an object's SOP Class from its header, whatever the file's name."""

from __future__ import annotations

from pathlib import Path

import pytest
from scripts.data.dicom.common import sop_class_of
from scripts.data.synthetic import write_case


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> dict:
    return write_case(tmp_path_factory.mktemp("common"), "P1", seed=3, shape=(48, 48, 16), pixel_spacing=(2.0, 2.0))


def test_sop_class_is_read_from_the_header(case, tmp_path):
    assert sop_class_of(Path(case["seg_file"])) == "1.2.840.10008.5.1.4.1.1.66.4"
    renamed = tmp_path / "segmentation"  # no suffix: the header decides
    renamed.write_bytes(Path(case["seg_file"]).read_bytes())
    assert sop_class_of(renamed) == "1.2.840.10008.5.1.4.1.1.66.4"
    (tmp_path / "notes.txt").write_text("not DICOM")
    assert sop_class_of(tmp_path / "notes.txt") == "" and sop_class_of(tmp_path / "missing") == ""

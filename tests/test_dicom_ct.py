"""The CT series reader: slices ordered in space, HU from the rescale tags, and every malformed series refused
with the file named."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pydicom
import pytest

from scripts.dicom import DicomCaseError, read_case, read_ct_series, to_hu
from scripts.synthetic import write_case

SHAPE = (64, 64, 24)


@pytest.fixture
def case(tmp_path) -> dict:
    return write_case(tmp_path, "LUNG1-009", seed=21, shape=SHAPE)


def slice_files_by_z(image_dir: Path) -> list[Path]:
    files = list(image_dir.glob("*.dcm"))
    return sorted(files, key=lambda p: float(pydicom.dcmread(p, stop_before_pixels=True).ImagePositionPatient[2]))


def test_hounsfield_units_come_from_rescale(tmp_path):
    truth = write_case(tmp_path, "LUNG1-001", seed=11, shape=SHAPE)
    volumes = read_case(truth["image_dir"], truth["seg_file"], ("GTV-1",))
    tumour = volumes.image[volumes.label == 1].astype(float)
    assert abs(tumour.mean() - truth["hu"]["tumour"]) < 10
    corner = volumes.image[:3, :3, :].astype(float)  # outside the body: air
    assert abs(corner.mean() - truth["hu"]["air"]) < 20
    assert volumes.image.dtype == np.int16


def test_missing_slice_is_a_gap(case):
    files = slice_files_by_z(Path(case["image_dir"]))
    files[len(files) // 2].unlink()
    with pytest.raises(DicomCaseError, match="1 missing slice"):
        read_ct_series(case["image_dir"])


def test_two_series_in_one_folder(case, tmp_path):
    other = write_case(tmp_path / "other", "LUNG1-010", seed=22, shape=SHAPE)
    shutil.copy(next(Path(other["image_dir"]).glob("*.dcm")), Path(case["image_dir"]) / "zz-intruder.dcm")
    with pytest.raises(DicomCaseError, match="2 series are mixed"):
        read_ct_series(case["image_dir"])


def test_inconsistent_orientation(case):
    path = slice_files_by_z(Path(case["image_dir"]))[3]
    ds = pydicom.dcmread(path)
    ds.ImageOrientationPatient = [1, 0, 0, 0, 0.9, -0.43588989]
    ds.save_as(path)
    with pytest.raises(DicomCaseError, match="ImageOrientationPatient") as err:
        read_ct_series(case["image_dir"])
    assert path.name in str(err.value)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_file_is_named(case, damage):
    path = slice_files_by_z(Path(case["image_dir"]))[5]
    data = path.read_bytes()
    path.write_bytes(b"not a dicom file" * 10 if damage == "garbage" else data[: len(data) // 2])
    with pytest.raises(DicomCaseError) as err:
        read_ct_series(case["image_dir"])
    assert path.name in str(err.value)


@pytest.mark.parametrize(
    ("dtype", "slope", "intercept"),
    [(np.uint16, 1, -1024), (np.int16, 1, 0), (np.uint16, 1, -1024.5), (np.int16, 0.5, -1000), (np.uint16, 2, -40000)],
)
def test_stored_values_become_hu_like_the_dicom_formula(dtype, slope, intercept):
    """HU = round(stored * slope + intercept), clipped to int16 -- by the integer shortcut or the float path alike."""
    stored = np.array([[0, 1, 1000], [2000, 4095, np.iinfo(dtype).max]], dtype=dtype)
    ds = pydicom.Dataset()
    ds.RescaleSlope, ds.RescaleIntercept = slope, intercept
    expected = np.clip(np.rint(stored.astype(np.float64) * slope + intercept), -32768, 32767).astype(np.int16)
    np.testing.assert_array_equal(to_hu(stored, ds), expected)

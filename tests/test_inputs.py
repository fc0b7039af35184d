"""Inference inputs: which cases an input folder holds, how they are named, and which are skipped and why."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import nibabel as nib
import numpy as np
import pydicom
import pytest
from conftest import SMALL_SHAPE
from dicom_factory import uneven_series, write_series
from pydicom.uid import generate_uid
from scripts.inputs import InferenceInputError, LoadCased, as_float32, find_inputs, slice_map_of

STUDY_DATE = "20260101"  # the synthetic writer's


def tcia_tree(small_cases, root, patients):
    """``root/<patient>/<series>/image`` copies of the small synthetic CT series."""
    _, truths = small_cases
    for (patient, series), truth in zip(patients, truths, strict=False):
        shutil.copytree(truth["image_dir"], root / patient / series / "image")
    return root


def as_other_study(folder: Path, dest: Path, date: str, image_type: list[str] | None = None) -> None:
    """The series in ``folder`` copied to ``dest`` as a series of another study (new UIDs), dated ``date``."""
    series, study = generate_uid(), generate_uid()
    dest.mkdir(parents=True)
    for path in sorted(folder.glob("*.dcm")):
        ds = pydicom.dcmread(path)
        ds.StudyInstanceUID, ds.SeriesInstanceUID, ds.StudyDate = study, series, date
        ds.SOPInstanceUID = ds.file_meta.MediaStorageSOPInstanceUID = generate_uid()
        if image_type:
            ds.ImageType = image_type
        ds.save_as(dest / path.name)


def test_cases_are_named_by_patient_and_study_from_the_headers_and_nifti_by_file_name(small_cases, tmp_path):
    """Folder names do not matter: two patients in one flat folder, one of them with a second study (dated), a
    series two folders deep, and a NIfTI file."""
    _, truths = small_cases
    flat = tmp_path / "export"
    flat.mkdir()
    for truth in truths[:2]:
        for path in Path(truth["image_dir"]).glob("*.dcm"):
            shutil.copy(path, flat / pydicom.dcmread(path, stop_before_pixels=True).SOPInstanceUID)  # UID-named
    as_other_study(Path(truths[0]["image_dir"]), tmp_path / "a" / "b", "20250102")
    shutil.copytree(truths[2]["image_dir"], tmp_path / "deep" / "x" / "y")
    (tmp_path / "extra").mkdir()
    nib.save(nib.Nifti1Image(np.zeros((8, 8, 8), np.int16), np.eye(4)), tmp_path / "extra" / "scan.nii.gz")
    cases = {c["case_id"]: c for c in find_inputs(tmp_path)}
    first, second, third = (t["patient_id"] for t in truths[:3])
    assert sorted(cases) == sorted([f"{first}_20250102", f"{first}_{STUDY_DATE}", second, third, "scan"])
    assert {c["source"] for c in cases.values()} == {"dicom", "nifti"}
    assert cases[second]["image"] == str(flat) and len(cases[second]["slice_paths"]) == SMALL_SHAPE[2]
    assert cases[second]["series_uid"] == truths[1]["ct_series_uid"]


def test_a_secondary_axial_series_is_inferred_when_it_is_the_best_its_study_has(small_cases, tmp_path):
    """A 4D-CT phase (DERIVED\\SECONDARY\\AXIAL), as a PACS would give it, is a case from a folder too, noted."""
    _, truths = small_cases
    as_other_study(Path(truths[0]["image_dir"]), tmp_path / "phase", "20250102", ["DERIVED", "SECONDARY", "AXIAL"])
    (case,) = find_inputs(tmp_path, report_dir=tmp_path / "out")
    assert "the study has no ORIGINAL series" in case["notes"][0]
    report = json.loads((tmp_path / "out" / "inference_report.json").read_text())
    assert "SECONDARY" in report["cases"][0]["series"]["note"] and "slice_paths" not in report["cases"][0]


def test_a_series_folder_given_directly_is_one_case(small_cases):
    _, truths = small_cases
    cases = find_inputs(truths[0]["image_dir"])
    assert len(cases) == 1 and cases[0]["source"] == "dicom"


def test_no_usable_input_is_an_error_that_names_the_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(InferenceInputError, match=str(tmp_path)):
        find_inputs(tmp_path)
    with pytest.raises(InferenceInputError, match="no such file or folder"):
        find_inputs(tmp_path / "missing")


def test_a_series_with_a_missing_slice_fails_its_check_with_the_reason_and_the_others_run(small_cases, tmp_path):
    tcia_tree(small_cases, tmp_path, [("P1", "1"), ("P2", "1")])
    from scripts.dicom import scan_ct_series

    headers, _ = scan_ct_series(tmp_path / "P2" / "1" / "image")
    headers[len(headers) // 2][0].unlink()  # a slice in the middle of the volume
    cases = find_inputs(tmp_path, report_dir=tmp_path / "out")
    truths = small_cases[1]
    assert [c["case_id"] for c in cases] == [truths[0]["patient_id"]]
    report = json.loads((tmp_path / "out" / "inference_report.json").read_text())
    (failed,) = [c for c in report["cases"] if c["status"] == "failed"]
    assert failed["case_id"] == truths[1]["patient_id"] and failed["stage"] == "check"
    assert "missing slice" in failed["reason"] and "download the series again" in failed["reason"]
    assert report["skipped"] == [], "a broken series is a failed case, not an input that is no case"


def test_a_failure_is_reported_with_our_message_not_the_library_error_under_it():
    """MONAI wraps a transform's error, ours wraps pydicom's: the report keeps ours (it names the file, what to do)."""
    from scripts.dicom import DicomCaseError
    from scripts.inputs import root_message

    try:
        try:
            try:
                raise ValueError("The number of bytes of pixel data is less than expected")
            except ValueError as err:
                raise DicomCaseError("/x/1-08.dcm: pixel data cannot be read: the file is cut or damaged") from err
        except DicomCaseError as err:
            raise RuntimeError("applying transform") from err
    except RuntimeError as err:
        assert root_message(err) == "/x/1-08.dcm: pixel data cannot be read: the file is cut or damaged"
    assert root_message(RuntimeError("x")) == "RuntimeError: x"


def test_an_uneven_tilted_series_passes_its_check_and_loads_on_an_equal_step_grid_with_its_slice_map(tmp_path):
    """The series is accepted as acquired; LoadCased gives the equal-step orthogonal grid (RAS) and records in the
    metadata where each of its 24 slices lies in it, as slice_map_of reads it back."""
    series = uneven_series(18.5)
    write_series(series, tmp_path / "GE")
    (case,) = find_inputs(tmp_path)
    image = LoadCased("image")(case)["image"]
    slices = slice_map_of(image.meta)
    assert slices is not None and len(slices.origins) == 24 and slices.shape == (64, 64)
    assert tuple(image.shape[1:]) == slices.grid_shape and slices.grid_shape[1] > 64  # widened for the tilt
    step = np.asarray(image.affine)[:3, 2]
    np.testing.assert_allclose(step[:2], 0.0, atol=1e-6)
    assert 0 < step[2] <= min(series.gaps) + 1e-6
    np.testing.assert_allclose(slices.origins[:, 2] * step[2], series.positions()[:, 2] - series.positions()[0, 2])
    assert slice_map_of({}) is None


def test_an_uneven_series_with_an_instance_number_gap_fails_its_check_as_a_missing_slice(tmp_path):
    write_series(uneven_series(), tmp_path / "GE")
    (tmp_path / "GE" / "0013.dcm").unlink()
    with pytest.raises(InferenceInputError, match=r"InstanceNumber jumps from 12 to 14.*download the series again"):
        find_inputs(tmp_path)


@pytest.mark.parametrize("dtype", [np.int16, np.uint16, np.float64, np.float32])
@pytest.mark.parametrize("threads", [1, 3])
def test_a_volume_becomes_c_ordered_float32_with_numpys_values_in_any_layout(dtype, threads):
    """as_float32, load_case's copy: the values and layout np.ascontiguousarray(..., float32) gives, for the
    Fortran-ordered volumes the reader and NIfTI give (a middle axis of 37 planes: chunks of 16 and a last of 5),
    a C-ordered one and a strided view; float64 rounds as numpy rounds it."""
    rng = np.random.default_rng(3)
    values = rng.normal(0, 2000, (9, 37, 5)) if dtype in (np.float64, np.float32) else rng.integers(0, 4000, (9, 37, 5))
    fortran = np.asfortranarray(values.astype(dtype))
    for array in (fortran, np.ascontiguousarray(fortran), fortran[:, ::2, 1:]):
        out = as_float32(array, threads=threads)
        expected = np.ascontiguousarray(array, dtype=np.float32)
        assert out.dtype == np.float32 and out.flags.c_contiguous and out.shape == array.shape
        np.testing.assert_array_equal(out, expected)

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
from scripts.inference.inputs import InferenceInputError, LoadCased, as_float32, find_inputs, slice_map_of

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


def test_no_usable_input_is_an_error_that_names_the_folder(small_cases, tmp_path):
    """Nothing found: what the folder should hold. Cases found that all failed (here series_rules refuse them): the
    advice is to fix those, not to give another folder."""
    (tmp_path / "empty").mkdir()
    with pytest.raises(InferenceInputError, match=str(tmp_path)) as err:
        find_inputs(tmp_path)
    assert str(err.value).endswith("Give a folder holding DICOM CT series (any layout: a TCIA download, a PACS "
                                   "export) or NIfTI files (.nii.gz).")  # fmt: skip
    series = tcia_tree(small_cases, tmp_path / "tree", [("P1", "1")])
    with pytest.raises(InferenceInputError, match=r"fewer than series_rules#min_slices \(500\)") as err:
        find_inputs(series, series_rules={"min_slices": 500})
    assert str(err.value).endswith("repair or replace those files, or change the series_rules that refused them.")
    with pytest.raises(InferenceInputError, match="no such file or folder"):
        find_inputs(tmp_path / "missing")


def test_a_series_with_a_missing_slice_fails_its_check_with_the_reason_and_the_others_run(small_cases, tmp_path):
    tcia_tree(small_cases, tmp_path, [("P1", "1"), ("P2", "1")])
    from scripts.data.dicom import scan_ct_series

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
    from scripts.data.dicom import DicomCaseError
    from scripts.inference.inputs import root_message

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


def as_other_series(folder: Path, dest: Path, number: int) -> str:
    """The series in ``folder`` copied to ``dest`` as another series of the same study (new UIDs, SeriesNumber
    ``number``); its SeriesInstanceUID."""
    series = generate_uid()
    dest.mkdir(parents=True)
    for path in sorted(folder.glob("*.dcm")):
        ds = pydicom.dcmread(path)
        ds.SeriesInstanceUID, ds.SeriesNumber = series, number
        ds.SOPInstanceUID = ds.file_meta.MediaStorageSOPInstanceUID = generate_uid()
        ds.save_as(dest / path.name)
    return series


def middle_slice(folder: Path, at: float = 0.5) -> Path:
    """The file of the slice ``at`` the series' length in ``folder`` (by position, not by name; 1: the last)."""
    from scripts.data.dicom import scan_ct_series

    headers, _ = scan_ct_series(folder)
    return Path(headers[min(int(len(headers) * at), len(headers) - 1)][0])


def cut(path: Path, size: int = 300) -> None:
    """``path`` cut to its first ``size`` bytes, as an interrupted copy leaves it (a DICOM file keeps its marker)."""
    path.write_bytes(path.read_bytes()[:size])


def test_a_study_whose_chosen_series_fails_its_check_runs_on_its_next_usable_series_and_says_why(small_cases, tmp_path):
    """Series 2 is the rules' choice (as thin, as many slices, the lower number) but misses a slice in its middle;
    series 5 of the same study ends a slice early and is whole: the case runs on series 5, its notes and `series.why`
    say why, and the report lists series 2 among the alternatives with its failure. With series 5 broken too, the
    case fails with both reasons."""
    _, truths = small_cases
    study = tmp_path / "in" / "P"
    first = as_other_series(Path(truths[0]["image_dir"]), study / "s2", 2)
    second = as_other_series(Path(truths[0]["image_dir"]), study / "s5", 5)
    middle_slice(study / "s2").unlink()
    middle_slice(study / "s5", at=1.0).unlink()
    (case,) = find_inputs(tmp_path / "in", report_dir=tmp_path / "out")
    assert case["series_uid"] == second and len(case["slice_paths"]) == SMALL_SHAPE[2] - 1
    assert case["notes"][0].startswith("series 2 failed its check, so series 5 is used:")
    assert "missing slice" in case["notes"][0] and "failed the check from the headers" in case["series"]["why"]
    report = json.loads((tmp_path / "out" / "inference_report.json").read_text())
    (alternative,) = [a for a in report["cases"][0]["alternatives"] if a["series_uid"] == first]
    assert alternative["reason"].startswith("failed its check:") and "missing slice" in alternative["reason"]
    assert second not in {a["series_uid"] for a in report["cases"][0]["alternatives"]}

    middle_slice(study / "s5").unlink()
    with pytest.raises(InferenceInputError) as err:
        find_inputs(tmp_path / "in", report_dir=tmp_path / "out")
    assert "none of the study's 2 usable CT series passes its check: series 2:" in str(err.value)
    assert "; series 5:" in str(err.value)


def test_a_damaged_file_among_a_series_slices_is_named_not_taken_for_a_missing_slice(small_cases, tmp_path):
    """A slice cut to 300 bytes keeps its DICOM marker: the reason names that file and says to download the series
    again. In a folder that other series share, a gap is reported with the damaged file as the likely slice."""
    _, truths = small_cases
    tcia_tree(small_cases, tmp_path / "tree", [("P1", "1")])
    damaged = middle_slice(tmp_path / "tree" / "P1" / "1" / "image")
    cut(damaged)
    with pytest.raises(InferenceInputError) as err:
        find_inputs(tmp_path / "tree")
    assert f"{damaged}: a damaged DICOM file among the slices of CT series" in str(err.value)
    assert "download the series again" in str(err.value)

    flat = tmp_path / "flat"
    flat.mkdir()
    for truth in truths[:2]:
        for path in Path(truth["image_dir"]).glob("*.dcm"):
            shutil.copy(path, flat / f"{truth['patient_id']}-{path.name}")
    damaged = flat / f"{truths[1]['patient_id']}-{middle_slice(Path(truths[1]['image_dir'])).name}"
    cut(damaged)
    cases = find_inputs(flat, report_dir=tmp_path / "out")
    assert [c["case_id"] for c in cases] == [truths[0]["patient_id"]]
    report = json.loads((tmp_path / "out" / "inference_report.json").read_text())
    (failed,) = [c for c in report["cases"] if c["status"] == "failed"]
    assert "missing slice" in failed["reason"] and failed["reason"].endswith(f"may be the slice missing: {damaged}")


def nifti(path: Path, values: np.ndarray) -> Path:
    nib.save(nib.Nifti1Image(values, np.diag([0.8, 0.8, 3.0, 1.0])), path)
    return path


def test_a_nifti_that_is_no_ct_in_hu_fails_alone_naming_the_file_and_the_others_load(tmp_path):
    """Text named .nii fails its check; a .nii.gz cut short and a label map fail when read (CaseDataset records
    the failure); the CT beside them loads."""
    from scripts.inference.inputs import CaseDataset

    folder = tmp_path / "in"
    folder.mkdir()
    ct = np.random.default_rng(0).integers(-1000, 400, (16, 16, 8)).astype(np.int16)
    nifti(folder / "ct.nii.gz", ct)
    (folder / "junk.nii").write_text("not an image")
    whole = nifti(tmp_path / "whole.nii.gz", np.random.default_rng(1).normal(0, 500, (40, 40, 40)).astype(np.float32))
    (folder / "cut.nii.gz").write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    nifti(folder / "labels.nii.gz", (ct > 0).astype(np.uint8))
    cases = find_inputs(folder, report_dir=tmp_path / "out")
    assert sorted(c["case_id"] for c in cases) == ["ct", "cut", "labels"]
    report = json.loads((tmp_path / "out" / "inference_report.json").read_text())
    (junk,) = [c for c in report["cases"] if c["status"] == "failed"]
    assert junk["reason"].startswith(f"{folder / 'junk.nii'}: not a NIfTI file nibabel can read")
    loaded = CaseDataset(cases, load=LoadCased("image"))
    reasons = {c["case_id"]: loaded[i].get("failure_reason") for i, c in enumerate(cases)}
    assert reasons["ct"] is None
    assert reasons["cut"].startswith(f"{folder / 'cut.nii.gz'}: its voxels cannot be read")
    assert "cut short or damaged" in reasons["cut"]
    assert reasons["labels"].startswith(f"{folder / 'labels.nii.gz'}: its values span 0 to 1, not a CT in Hounsfield")


def test_an_earlier_runs_outputs_and_a_second_link_inside_the_input_folder_are_not_read_and_say_why(
    small_cases, tmp_path
):
    """A first run's OUT inside DIR holds label maps that would be read as CTs; it is skipped (it holds
    inference_report.json), as is this run's own OUT and a link to a folder already read, each with its reason."""
    root = tcia_tree(small_cases, tmp_path / "in", [("P1", "1")])
    earlier = root / "out"
    (earlier / "P1").mkdir(parents=True)
    nifti(earlier / "P1" / "P1_seg.nii.gz", np.zeros((16, 16, 8), np.uint8))
    (earlier / "inference_report.json").write_text("{}")
    (root / "again").symlink_to(root / "P1", target_is_directory=True)
    (root / "out2").mkdir()
    cases = find_inputs(root, report_dir=root / "out2")
    assert [c["source"] for c in cases] == ["dicom"]
    report = json.loads((root / "out2" / "inference_report.json").read_text())
    reasons = {s["input"]: s["reason"] for s in report["skipped"]}
    assert reasons[str(root / "out")].endswith("an earlier inference run's output folder (it holds "
                                               "inference_report.json): not read.")  # fmt: skip
    assert reasons[str(root / "out2")].endswith("this run's output folder: not read.")
    assert reasons[str(root / "again")].endswith(
        f"the same folder as {root / 'P1'}, reached again through a link: read once."
    )


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

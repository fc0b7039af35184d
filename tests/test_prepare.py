"""One-time preparation: NIfTI outputs aligned with the DICOM truth, a deterministic split, bad cases reported."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import nibabel as nib
import numpy as np
import pydicom
import pytest

import scripts.prepare
from scripts.prepare import PrepareError, find_cases, prepare, split_cases
from scripts.synthetic import tumour_contains, write_case

SHAPE = (64, 64, 24)
COLLECTION = "NSCLC-Radiomics"


def slice_by_z(image_dir: Path, index: int) -> Path:
    files = sorted(
        image_dir.glob("*.dcm"),
        key=lambda p: float(pydicom.dcmread(p, stop_before_pixels=True).ImagePositionPatient[2]),
    )
    return files[index]


@pytest.fixture(scope="module")
def messy_dataset(tmp_path_factory) -> tuple[Path, dict]:
    """Three good cases and one case for every kind of bad input the issue lists."""
    root = tmp_path_factory.mktemp("messy")
    truths = {}
    for i, pid in enumerate(["LUNG1-001", "LUNG1-002", "LUNG1-003"]):  # the third stored rotated by 180 degrees
        truths[pid] = write_case(root, pid, seed=300 + i, shape=SHAPE, flip_in_plane=pid == "LUNG1-003")
    bad = {}
    # no seg folder
    t = write_case(root, "BAD-NOSEG", seed=1, shape=SHAPE)
    shutil.rmtree(Path(t["seg_file"]).parent)
    bad["BAD-NOSEG"] = "no seg folder"
    # SEG without a GTV segment
    write_case(root, "BAD-NOGTV", seed=2, shape=SHAPE, segments=["Lung-Left", "Lung-Right", "Heart"])
    bad["BAD-NOGTV"] = "no segment matches label 'GTV-1'"
    # empty GTV (post-operative scan)
    write_case(root, "BAD-EMPTYGTV", seed=3, shape=SHAPE, empty_gtv=True)
    bad["BAD-EMPTYGTV"] = "are empty"
    # corrupt file
    t = write_case(root, "BAD-CORRUPT", seed=4, shape=SHAPE)
    victim = slice_by_z(Path(t["image_dir"]), 4)
    victim.write_bytes(victim.read_bytes()[:300])
    bad["BAD-CORRUPT"] = victim.name
    # two series mixed in one image folder
    t = write_case(root, "BAD-MIXED", seed=5, shape=SHAPE)
    shutil.copy(slice_by_z(Path(truths["LUNG1-001"]["image_dir"]), 0), Path(t["image_dir"]) / "zz-other.dcm")
    bad["BAD-MIXED"] = "2 series are mixed"
    # a missing slice
    t = write_case(root, "BAD-GAP", seed=6, shape=SHAPE)
    slice_by_z(Path(t["image_dir"]), 10).unlink()
    bad["BAD-GAP"] = "missing slice"
    # inconsistent orientation
    t = write_case(root, "BAD-ORIENT", seed=7, shape=SHAPE)
    path = slice_by_z(Path(t["image_dir"]), 3)
    ds = pydicom.dcmread(path)
    ds.ImageOrientationPatient = [0, 1, 0, 1, 0, 0]
    ds.save_as(path)
    bad["BAD-ORIENT"] = "ImageOrientationPatient"
    # SEG on another frame of reference
    t = write_case(root, "BAD-FOR", seed=8, shape=SHAPE)
    seg = pydicom.dcmread(t["seg_file"])
    seg.FrameOfReferenceUID = pydicom.uid.generate_uid()
    seg.save_as(t["seg_file"])
    bad["BAD-FOR"] = "FrameOfReferenceUID"
    return root, {"truths": truths, "bad": bad}


@pytest.fixture(scope="module")
def prepared(messy_dataset, tmp_path_factory):
    root, info = messy_dataset
    out = tmp_path_factory.mktemp("prepared")
    with pytest.MonkeyPatch.context() as patch:  # two worker processes even for these few cases
        patch.setattr(scripts.prepare, "CASES_PER_WORKER", 1)
        report = prepare(root, out, labels=["GTV-1"], num_workers=2, progress=False)
    return out, report, info


def test_every_bad_case_is_reported_with_its_reason_and_the_good_ones_are_prepared(prepared):
    out, report, info = prepared
    rejected = {r["case_id"]: r["reason"] for r in report["rejected"]}
    assert set(rejected) == set(info["bad"])
    for case_id, expected in info["bad"].items():
        assert case_id in rejected[case_id] and expected in rejected[case_id], rejected[case_id]
    assert report["num_prepared"] == len(info["truths"])
    saved = json.loads((out / "prepare_report.json").read_text())
    assert {r["case_id"] for r in saved["rejected"]} == set(info["bad"])


def test_a_flipped_orientation_is_kept_and_noted(prepared):
    """The rotated case is prepared (its world-coordinate check is in the next test) and named in the report."""
    out, report, _ = prepared
    saved = json.loads((out / "prepare_report.json").read_text())
    assert [n["case_id"] for n in saved["noted"]] == ["LUNG1-003"]
    assert "RAS orientation, not the usual LPS" in saved["noted"][0]["notes"][0]
    orientation = {r["case_id"]: r.get("orientation") for r in report["cases"]}
    assert orientation["LUNG1-001"] == "LPS" and orientation["LUNG1-003"] == "RAS"


def test_nifti_label_lies_on_the_tumour_in_world_coordinates(prepared):
    out, _, info = prepared
    for pid, truth in info["truths"].items():
        image = nib.load(out / "images" / f"{pid}.nii")
        label = nib.load(out / "labels" / f"{pid}.nii.gz")
        assert image.get_data_dtype() == np.int16 and label.get_data_dtype() == np.uint8
        np.testing.assert_allclose(image.affine, label.affine)
        data = np.asarray(label.dataobj)
        ijk = np.argwhere(data == 1)
        lps = (ijk @ label.affine[:3, :3].T + label.affine[:3, 3]) * np.array([-1.0, -1.0, 1.0])
        assert tumour_contains(truth, lps).all()
        assert len(ijk) == truth["tumour"]["num_voxels"]


def test_datalist_splits_by_patient_with_folds(prepared):
    out, _, info = prepared
    datalist = json.loads((out / "datalist.json").read_text())
    ids = [e["case_id"] for key in ("training", "validation", "test") for e in datalist[key]]
    assert sorted(ids) == sorted(info["truths"])
    assert datalist["validation"], "at least one validation case"
    assert all("fold" in e for e in datalist["training"])
    for entry in datalist["training"]:
        assert (out / entry["image"]).is_file() and (out / entry["label"]).is_file()


def test_split_is_deterministic_and_independent_of_listing_order():
    records = [{"case_id": f"P{i:03d}", "patient_id": f"P{i:03d}", "image": "i", "label": "l"} for i in range(40)]
    a = split_cases(records, 0.2, 0.1, 5, seed=0)
    b = split_cases(list(reversed(records)), 0.2, 0.1, 5, seed=0)
    assert a == b
    assert (len(a["training"]), len(a["validation"]), len(a["test"])) == (28, 8, 4)
    assert split_cases(records, 0.2, 0.1, 5, seed=1) != a
    folds = [e["fold"] for e in a["training"]]
    assert sorted(set(folds)) == [0, 1, 2, 3, 4]


def test_patients_with_several_series_stay_in_one_list():
    records = [
        {"case_id": f"P{i}_{s}", "patient_id": f"P{i}", "image": "i", "label": "l"} for i in range(20) for s in (1, 2)
    ]
    datalist = split_cases(records, 0.2, 0.1, 5, seed=0)
    for key in ("training", "validation", "test"):
        others = {e["patient_id"] for k in ("training", "validation", "test") if k != key for e in datalist[k]}
        assert not others & {e["patient_id"] for e in datalist[key]}


def test_second_run_skips_up_to_date_cases_and_rewrites_nothing(prepared, messy_dataset):
    out, _, info = prepared
    root, _ = messy_dataset
    before = {p: p.stat().st_mtime_ns for p in (out / "images").glob("*.nii")}
    assert len(before) == len(info["truths"])
    report = prepare(root, out, labels=["GTV-1"], num_workers=1, progress=False)
    assert report["num_prepared"] == 0 and report["num_up_to_date"] == len(info["truths"])
    assert {p: p.stat().st_mtime_ns for p in (out / "images").glob("*.nii")} == before
    assert not list(out.rglob(".*tmp*")), "no temporary files are left behind"


def test_compressed_images_hold_the_same_voxels_and_replace_the_plain_ones(small_cases, tmp_path):
    root, _ = small_cases
    prepare(root, tmp_path, num_workers=1, progress=False)
    plain = {p.name[: -len(".nii")]: np.asarray(nib.load(p).dataobj) for p in (tmp_path / "images").glob("*.nii")}
    report = prepare(root, tmp_path, num_workers=1, progress=False, compress_images="true")
    assert report["num_prepared"] == len(plain) > 0, "a change of format re-prepares every case"
    assert not list((tmp_path / "images").glob("*.nii")), "the uncompressed files are removed"
    datalist = json.loads((tmp_path / "datalist.json").read_text())
    for entry in datalist["training"] + datalist["validation"] + datalist["test"]:
        assert entry["image"].endswith(".nii.gz")
        np.testing.assert_array_equal(np.asarray(nib.load(tmp_path / entry["image"]).dataobj), plain[entry["case_id"]])


def test_unknown_label_fails_with_the_segments_that_exist(small_cases, tmp_path):
    root, _ = small_cases
    with pytest.raises(PrepareError, match="Lung-Left"):
        prepare(root, tmp_path / "out", labels=["Tumour"], num_workers=1, progress=False)


def test_tcia_dataset_raw_folder_is_ignored(small_cases, tmp_path):
    root, truths = small_cases
    copy = tmp_path / "tcia"
    shutil.copytree(root / COLLECTION, copy / COLLECTION)
    (copy / COLLECTION / "raw" / "1.2.3").mkdir(parents=True)  # TciaDataset keeps the SEG download here
    assert [c["case_id"] for c in find_cases(copy)] == sorted(t["patient_id"] for t in truths)


def test_cli_prepares_and_reports(small_cases, tmp_path, root):
    data, truths = small_cases
    out = tmp_path / "cli"
    result = subprocess.run(
        [sys.executable, "-m", "scripts.prepare", "--dataset_dir", str(data), "--output_dir", str(out),
         "--num_workers", "1"],
        cwd=root, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert f"{len(truths)} prepared" in result.stdout
    missing = subprocess.run(
        [sys.executable, "-m", "scripts.prepare", "--dataset_dir", str(tmp_path / "nowhere"), "--output_dir", str(out)],
        cwd=root, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert missing.returncode != 0 and "scripts.tcia download" in missing.stderr

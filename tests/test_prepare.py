"""One-time preparation: NIfTI outputs aligned with the DICOM truth, a deterministic split, bad cases reported."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nibabel as nib
import numpy as np
import pydicom
import pytest
import scripts.data.prepare
from dicom_factory import Series, transcode, tumour_centre_of, uneven_series
from dicom_factory import write_case as write_factory_case
from scripts.data.prepare import PrepareError, find_cases, prepare, split_cases
from scripts.data.synthetic import tumour_contains, write_case

ROOT = Path(__file__).resolve().parents[1]
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
    # no annotation
    t = write_case(root, "BAD-NOSEG", seed=1, shape=SHAPE)
    shutil.rmtree(Path(t["seg_file"]).parent)
    bad["BAD-NOSEG"] = "no SEG or RTSTRUCT"
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
    # a slice of another patient's series copied into this case's folder: sorted by its header into its own series,
    # where it is a second copy of an instance (read once, noted); both cases are prepared
    t = write_case(root, "MIXED", seed=5, shape=SHAPE)
    shutil.copy(slice_by_z(Path(truths["LUNG1-001"]["image_dir"]), 0), Path(t["image_dir"]) / "zz-other.dcm")
    truths["MIXED"] = t
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
        patch.setattr(scripts.data.prepare, "CASES_PER_WORKER", 1)
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
    """The rotated case is prepared (its world-coordinate check is in the next test) and named in the report, and so is
    the case whose slice was also copied into another patient's folder."""
    out, report, _ = prepared
    saved = json.loads((out / "prepare_report.json").read_text())
    notes = {n["case_id"]: " ".join(n["notes"]) for n in saved["noted"]}
    assert sorted(notes) == ["LUNG1-001", "LUNG1-003"]
    assert "RAS orientation, not the usual LPS" in notes["LUNG1-003"]
    assert "MIXED/" in notes["LUNG1-001"] and "zz-other.dcm holds the same instance" in notes["LUNG1-001"]
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
    assert (out / "dicom_index.json").is_file(), "the headers read are kept for the next run"
    report = prepare(root, out, labels=["GTV-1"], num_workers=1, progress=False)
    assert report["num_prepared"] == 0 and report["num_up_to_date"] == len(info["truths"])
    assert {p: p.stat().st_mtime_ns for p in (out / "images").glob("*.nii")} == before
    assert not list(out.rglob(".*tmp*")), "no temporary files are left behind"


def test_a_prepared_file_cut_or_replaced_since_is_prepared_again_and_the_log_says_so(small_cases, tmp_path, caplog):
    """A NIfTI that prepare wrote and something cut short since (a full disk, a copy interrupted) was kept as "up to
    date" and failed later in training's cache; its size and time are recorded, so the next run prepares that case
    again (the same voxels) and only it, naming the file."""
    root, _ = small_cases
    first = prepare(root, tmp_path, num_workers=1, progress=False)
    case = first["cases"][0]
    image = tmp_path / case["image"]
    whole = np.asarray(nib.load(image, mmap=False).dataobj)  # not a map of the file cut below (SIGBUS)
    image.write_bytes(image.read_bytes()[: image.stat().st_size // 2])
    with caplog.at_level(logging.WARNING, logger="scripts.data.prepare"):
        report = prepare(root, tmp_path, num_workers=1, progress=False)
    assert report["num_prepared"] == 1 and report["num_up_to_date"] == first["num_prepared"] - 1
    np.testing.assert_array_equal(np.asarray(nib.load(image, mmap=False).dataobj), whole)
    assert f"{case['case_id']}: {image.name} changed since prepare wrote it" in caplog.text


def test_compressed_images_hold_the_same_voxels_and_replace_the_plain_ones(small_cases, tmp_path, capsys):
    """Switches given as the command line gives them (text): `--compress_images true`, `--progress false`."""
    root, _ = small_cases
    prepare(root, tmp_path, num_workers=1, progress=True)
    assert "prepare: 100%" in capsys.readouterr().err, "the progress bar the next run turns off"
    plain = {p.name[: -len(".nii")]: np.asarray(nib.load(p).dataobj) for p in (tmp_path / "images").glob("*.nii")}
    report = prepare(root, tmp_path, num_workers=1, progress="false", compress_images="true")
    assert "prepare:" not in capsys.readouterr().err, "--progress false: no bar"
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
    raw = copy / COLLECTION / "raw" / "1.2.3"  # TciaDataset keeps the SEG download here: copies of the SEGs
    raw.mkdir(parents=True)
    shutil.copy(truths[0]["seg_file"], raw / "1-1.dcm")
    found = find_cases(copy)
    assert [c["case_id"] for c in found["cases"]] == sorted(t["patient_id"] for t in truths)
    assert found["cases"][0]["annotation"]["file"] == str(copy / Path(truths[0]["seg_file"]).relative_to(root))


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


# ---------------------------------------------------------------------------------------------------------------------
# real-world exports, through the real command: each case comes out right or is refused for the right reason, and
# the others are prepared


def run_prepare(data: Path, out: Path) -> tuple[subprocess.CompletedProcess, dict]:
    """``python -m scripts.prepare`` from a folder outside the bundle, the bundle on PYTHONPATH (as documented)."""
    result = subprocess.run(
        [sys.executable, "-m", "scripts.prepare", "--dataset_dir", str(data), "--output_dir", str(out),
         "--num_workers", "1"],
        cwd=out.parent, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    return result, json.loads((out / "prepare_report.json").read_text())


@pytest.fixture(scope="module")
def realworld(tmp_path_factory):
    """Cases as clinics and PACS export them, written independently of the reader (tests/dicom_factory.py)."""
    data = tmp_path_factory.mktemp("realworld")
    coll = data / COLLECTION
    cases = {
        "GOOD": Series(patient_id="GOOD"),
        "SMALL-TILT": Series(patient_id="SMALL-TILT", tilt_deg=0.6),
        "TILTED": Series(patient_id="TILTED", tilt_deg=15.0),
        "UNEVEN": uneven_series(patient_id="UNEVEN"),
        "UNEVEN-TILTED": uneven_series(18.5, patient_id="UNEVEN-TILTED"),
        "NO-RESCALE": Series(patient_id="NO-RESCALE"),
        "CLUTTER": Series(patient_id="CLUTTER"),
        "JPEG-LOSSLESS": Series(patient_id="JPEG-LOSSLESS"),
        "STALE-SLICE": Series(patient_id="STALE-SLICE"),
        "STALE-SEG": Series(patient_id="STALE-SEG"),
        "L" * 200: Series(patient_id="LONG-FOLDER"),
        "X" * 245: Series(patient_id="LONGER-FOLDER"),
        "ANON": Series(patient_id="Ünïcødé/../pat\\ient"),  # a PatientID no file name can carry as it is
    }
    for name, series in cases.items():
        write_factory_case(series, coll / name / "300")
    not_utf8 = os.fsdecode(b"caf\xe9-latin1")  # a folder named in Latin-1, as old Windows exports do
    write_factory_case(Series(patient_id="LATIN1"), coll / not_utf8 / "300")
    image = coll / "NO-RESCALE" / "300" / "image"
    for path in image.glob("*.dcm"):
        ds = pydicom.dcmread(path)
        del ds.RescaleSlope, ds.RescaleIntercept
        ds.save_as(path)
    image = coll / "CLUTTER" / "300" / "image"
    (image / "Thumbs.db").write_bytes(b"\x00windows thumbnail cache")
    (image / "DICOMDIR").write_bytes(b"\x00" * 128 + b"DICM")  # a cut DICOMDIR: DICM but no dataset
    if shutil.which("gdcminfo") or _has_gdcm():
        for path in (coll / "JPEG-LOSSLESS" / "300" / "image").glob("*.dcm"):
            transcode(path, "1.2.840.10008.1.2.4.70")
    out = data / "prepared"
    first, report = run_prepare(data, out)
    assert first.returncode == 0, first.stderr[-3000:]
    return data, out, report, cases, not_utf8


def _has_gdcm() -> bool:
    try:
        import gdcm  # noqa: F401
    except ImportError:
        return False
    return True


def records_of(report: dict) -> dict:
    return {r["case_id"]: r for r in report["cases"]}


def test_folder_names_do_not_name_cases_and_a_patient_id_is_made_safe_for_file_names(realworld):
    """Cases are named by their PatientID: a folder named in Latin-1 (old Windows exports) or too long for the outputs'
    names changes nothing; a PatientID with slashes or dots becomes a safe file name, in any script."""
    _, out, report, _, _ = realworld
    records = records_of(report)
    for case_id in ("LATIN1", "LONG-FOLDER", "LONGER-FOLDER", "Ünïcødé_pat_ient"):
        assert records[case_id]["status"] == "prepared", records[case_id].get("reason")
        assert (out / "labels" / f"{case_id}.nii.gz").is_file()
    assert records["Ünïcødé_pat_ient"]["patient_id"] == "Ünïcødé/../pat\\ient"
    datalist = json.loads((out / "datalist.json").read_text())
    assert "GOOD" in {d["case_id"] for part in ("training", "validation", "test") for d in datalist[part]}
    assert not list(out.rglob(".tmp-*")), "no temporary file left"


def test_a_tilted_series_is_refused_and_a_barely_tilted_one_is_placed_in_millimetres(realworld):
    _, out, report, cases, _ = realworld
    records = records_of(report)
    assert records["TILTED"]["status"] == "rejected" and "gantry tilt of 15.0 deg" in records["TILTED"]["reason"]
    label = nib.load(out / "labels" / "SMALL-TILT.nii.gz")
    centre = tumour_centre_of(np.asarray(label.dataobj), label.affine)
    np.testing.assert_allclose(centre, cases["SMALL-TILT"].tumour_centre, atol=0.5)  # mm, independent truth
    assert any("sideways" in note for note in records["SMALL-TILT"]["notes"])


def test_an_uneven_series_is_refused_for_training_naming_its_spacing_and_tilt_not_asking_for_a_download(realworld):
    _, out, report, _, _ = realworld
    records = records_of(report)
    for case_id in ("UNEVEN", "UNEVEN-TILTED"):
        reason = records[case_id]["reason"]
        assert records[case_id]["status"] == "rejected" and not (out / "images" / f"{case_id}.nii").exists()
        assert "uneven slice spacing (1.10-7.40 mm along the slice normal)" in reason, reason
        assert "download the series again" not in reason and "leave it out, or resample the CT and its labels" in reason
        assert ("gantry tilt of 18.5 deg" in reason) == (case_id == "UNEVEN-TILTED")


def test_missing_rescale_tags_are_refused_not_guessed(realworld):
    _, _, report, _, _ = realworld
    assert "no RescaleSlope/RescaleIntercept" in records_of(report)["NO-RESCALE"]["reason"]


def test_clutter_beside_the_slices_is_skipped_with_a_note(realworld):
    _, out, report, _, _ = realworld
    record = records_of(report)["CLUTTER"]
    assert record["status"] == "prepared", record.get("reason")
    assert "Thumbs.db (not DICOM)" in " ".join(record["notes"])
    image = nib.load(out / "images" / "CLUTTER.nii")
    assert image.shape == Series().shape


def test_jpeg_lossless_series_prepare_like_uncompressed_ones(realworld):
    pytest.importorskip("gdcm", reason="python-gdcm (requirements-dev.txt) encodes the JPEG Lossless test case")
    _, out, report, _, _ = realworld
    assert records_of(report)["JPEG-LOSSLESS"]["status"] == "prepared"
    packed = np.asarray(nib.load(out / "images" / "JPEG-LOSSLESS.nii").dataobj)
    plain = np.asarray(nib.load(out / "images" / "GOOD.nii").dataobj)
    np.testing.assert_array_equal(packed, plain)


def test_a_rerun_notices_changed_content_whatever_the_modification_times(realworld, tmp_path):
    data, out, _, _, _ = realworld
    image = data / COLLECTION / "STALE-SLICE" / "300" / "image"
    sorted(image.glob("*.dcm"))[5].unlink()  # a slice deleted
    seg = data / COLLECTION / "STALE-SEG" / "300" / "seg" / "1-1.dcm"
    before = seg.stat()
    bigger = Series(patient_id="STALE-SEG", tumour_radius=14.0)
    write_factory_case(bigger, tmp_path / "new")  # another SEG (same UIDs for the CT), copied in with an old mtime
    shutil.copy2(tmp_path / "new" / "seg" / "1-1.dcm", seg)
    os.utime(seg, ns=(before.st_atime_ns, before.st_mtime_ns))
    old_label = np.asarray(nib.load(out / "labels" / "STALE-SEG.nii.gz").dataobj)
    result, report = run_prepare(data, out)
    assert result.returncode == 0, result.stderr[-3000:]
    records = records_of(report)
    assert records["STALE-SLICE"]["status"] == "rejected" and "missing slice" in records["STALE-SLICE"]["reason"]
    assert records["STALE-SEG"]["status"] == "prepared"
    assert np.asarray(nib.load(out / "labels" / "STALE-SEG.nii.gz").dataobj).sum() > old_label.sum()
    assert records["GOOD"]["status"] == "up_to_date"


def test_cases_prepared_from_their_rtstructs_get_the_labels_of_their_segs(tmp_path):
    truths = [write_case(tmp_path / "data", f"LUNG1-{i:03d}", seed=40 + i, shape=(64, 64, 16), rtstruct=True)
              for i in range(1, 4)]  # fmt: skip
    from_seg = prepare(tmp_path / "data", tmp_path / "seg", num_workers=1, progress=False, label_source="seg")
    from_rt = prepare(tmp_path / "data", tmp_path / "rt", num_workers=1, progress=False, label_source="rtstruct")
    assert from_seg["num_prepared"] == from_rt["num_prepared"] == len(truths)
    assert {r["annotation"]["kind"] for r in from_rt["cases"]} == {"rtstruct"}
    for truth in truths:
        name = f"{truth['patient_id']}.nii.gz"
        seg = np.asarray(nib.load(tmp_path / "seg" / "labels" / name).dataobj) == 1
        rt = np.asarray(nib.load(tmp_path / "rt" / "labels" / name).dataobj) == 1
        dice = 2 * (seg & rt).sum() / (seg.sum() + rt.sum())
        assert dice >= 0.97, f"{truth['patient_id']}: Dice {dice:.4f} between the RTSTRUCT's and the SEG's labels"


def test_auto_takes_the_seg_and_falls_back_to_the_rtstruct(tmp_path):
    truth = write_case(tmp_path / "data", "LUNG1-001", seed=7, shape=(64, 64, 16), rtstruct=True)
    shutil.rmtree(Path(truth["seg_file"]).parent)
    report = prepare(tmp_path / "data", tmp_path / "out", num_workers=1, progress=False)
    assert report["num_prepared"] == 1 and report["cases"][0]["annotation"]["file"] == truth["rtstruct_file"]


def test_an_interrupt_stops_at_the_cases_in_hand(tmp_path, monkeypatch):
    """Ctrl-C while two cases are in flight: the run stops there instead of converting every queued case first."""
    cases = [{"case_id": f"P{i:02d}", "patient_id": f"P{i:02d}", "fingerprint": ""} for i in range(12)]
    monkeypatch.setattr(
        scripts.data.prepare, "find_cases", lambda *a: {"cases": cases, "rejected": [], "root": "", "skipped": {}}
    )
    started = []

    def interrupted(case, *args):
        started.append(case["case_id"])
        if len(started) == 2:
            raise KeyboardInterrupt
        return {**case, "status": "rejected", "reason": "test"}

    monkeypatch.setattr(scripts.data.prepare, "prepare_case", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare(tmp_path, tmp_path / "out", num_workers=1, progress=False)
    assert len(started) <= 4  # the two in flight and at most the two taken up meanwhile, not all 12

"""Cases found from DICOM headers in any folder layout (scripts/data/dicom/discovery.py), and prepared alike from each.

The layouts are written here from the synthetic cases by reading their headers with pydicom -- never with the code
under test: TCIA's NBIA Data Retriever (its folder and file names, its metadata.csv columns, with and without the
manifest folder), a flat export of files named by SOPInstanceUID without extension (several patients in one folder, a
DICOMDIR beside them), and a media export written by pydicom's FileSet (DICOMDIR + PT000000/ST000000/SE000000/...).
"""

from __future__ import annotations

import csv
import json
import os
import shutil
from pathlib import Path

import nibabel as nib
import numpy as np
import pydicom
import pytest
import scripts.data.dicom.discovery as discovery
from pydicom.fileset import FileSet
from pydicom.uid import generate_uid
from scripts.data.dicom.discovery import scan
from scripts.data.prepare import prepare
from scripts.data.synthetic import write_case

COLLECTION = "NSCLC-Radiomics"
SHAPE, SPACING = (48, 48, 16), (2.0, 2.0)
PATIENTS = ("LUNG1-001", "LUNG1-002", "LUNG1-003")
#: the columns of the metadata.csv the NBIA Data Retriever writes beside the collection folder
METADATA_COLUMNS = (
    "Series UID", "Collection", "3rd Party Analysis", "Data Description URI", "Subject ID", "Study UID",
    "Study Description", "Study Date", "Series Description", "Manufacturer", "Modality", "SOP Class Name",
    "SOP Class UID", "Number of Images", "File Size", "File Location", "Download Timestamp",
)  # fmt: skip


@pytest.fixture(scope="module")
def tcia(tmp_path_factory) -> tuple[Path, list[dict]]:
    """Three cases in the TCIA layout, each with a SEG and an RTSTRUCT, as NSCLC-Radiomics ships them."""
    root = tmp_path_factory.mktemp("tcia")
    truths = [write_case(root, pid, seed=60 + i, shape=SHAPE, pixel_spacing=SPACING, rtstruct=True)
              for i, pid in enumerate(PATIENTS)]  # fmt: skip
    shutil.rmtree(root / "synthetic_truth")
    return root, truths


def dicom_files(root: Path) -> list[tuple[Path, pydicom.Dataset]]:
    return [(p, pydicom.dcmread(p, stop_before_pixels=True)) for p in sorted(root.rglob("*.dcm"))]


def retriever_layout(source: Path, dest: Path, manifest: bool = True, metadata: bool = True) -> Path:
    """``source``'s files as the NBIA Data Retriever writes a download: ``[manifest-<n>/]<Collection>/<PatientID>/
    <MM-DD-YYYY>-<StudyDescription>-<5 digits>/<SeriesNumber>.000000-<SeriesDescription>-<5 digits>/1-NNN.dcm``."""
    top = dest / "manifest-1603198545583" if manifest else dest
    series: dict[str, list[tuple[Path, pydicom.Dataset]]] = {}
    for path, ds in dicom_files(source):
        series.setdefault(ds.SeriesInstanceUID, []).append((path, ds))
    rows = []
    for uid, members in series.items():
        ds = members[0][1]
        date = f"{ds.StudyDate[4:6]}-{ds.StudyDate[6:8]}-{ds.StudyDate[:4]}"
        study = f"{date}-{ds.get('StudyDescription') or 'NA'}-{str(ds.StudyInstanceUID)[-5:]}"
        folder = f"{int(ds.SeriesNumber)}.000000-{ds.get('SeriesDescription') or 'NA'}-{uid[-5:]}"
        where = top / COLLECTION / ds.PatientID / study / folder
        where.mkdir(parents=True)
        members.sort(key=lambda m: int(m[1].get("InstanceNumber") or 1))
        for number, (path, _) in enumerate(members, start=1):
            shutil.copy(path, where / (f"1-{number:03d}.dcm" if len(members) > 1 else "1-1.dcm"))
        rows.append({
            "Series UID": uid, "Collection": COLLECTION, "3rd Party Analysis": "NO", "Subject ID": ds.PatientID,
            "Data Description URI": "https://doi.org/10.7937/K9/TCIA.2015.PF0M9REI", "Study UID": ds.StudyInstanceUID,
            "Study Description": ds.get("StudyDescription", ""), "Study Date": date, "Series Description": "",
            "Manufacturer": ds.get("Manufacturer", ""), "Modality": ds.Modality, "SOP Class Name": ds.SOPClassUID.name,
            "SOP Class UID": ds.SOPClassUID, "Number of Images": len(members),
            "File Size": sum(p.stat().st_size for p, _ in members), "Download Timestamp": "2026-11-20T10:00:00.000",
            "File Location": f"./{where.relative_to(top).as_posix()}",
        })  # fmt: skip
    if metadata:
        with open(top / "metadata.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=METADATA_COLUMNS)
            writer.writeheader()
            writer.writerows(rows)
    return dest


def flat_export(source: Path, dest: Path) -> Path:
    """Every file of every patient in one folder, named by its SOPInstanceUID without extension, a DICOMDIR beside."""
    dest.mkdir(parents=True)
    fileset = FileSet()
    for path, ds in dicom_files(source):
        shutil.copy(path, dest / ds.SOPInstanceUID)
        fileset.add(path)
    media = dest.parent / f"{dest.name}-media"
    fileset.write(media)
    shutil.copy(media / "DICOMDIR", dest / "DICOMDIR")
    shutil.rmtree(media)
    return dest


def media_export(source: Path, dest: Path) -> Path:
    """A CD/PACS media export: DICOMDIR and PT000000/ST000000/SE000000/IM000000 (pydicom's FileSet)."""
    fileset = FileSet()
    for path, _ in dicom_files(source):
        fileset.add(path)
    fileset.write(dest)
    return dest


@pytest.fixture(scope="module")
def layouts(tcia, tmp_path_factory) -> dict[str, Path]:
    root, _ = tcia
    tmp = tmp_path_factory.mktemp("layouts")
    return {
        "tcia": root,
        "retriever": retriever_layout(root, tmp / "retriever"),
        "retriever-bare": retriever_layout(root, tmp / "retriever-bare", manifest=False, metadata=False),
        "flat": flat_export(root, tmp / "flat"),
        "media": media_export(root, tmp / "media"),
    }


@pytest.fixture(scope="module")
def prepared(layouts, tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    tmp = tmp_path_factory.mktemp("prepared")
    return {name: (tmp / name, prepare(root, tmp / name, num_workers=1, progress=False))
            for name, root in layouts.items()}  # fmt: skip


# ----------------------------------------------------------------------------------------- the same in every layout
def test_the_retriever_layout_is_what_its_tool_writes(layouts):
    """The fixture itself: the Retriever's folder-name pattern and metadata.csv columns (what users have on disk)."""
    top = layouts["retriever"] / "manifest-1603198545583"
    with open(top / "metadata.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == METADATA_COLUMNS and len(rows) == 3 * len(PATIENTS)
    ct = next(r for r in rows if r["Modality"] == "CT")
    folder = top / ct["File Location"]
    assert folder.is_dir() and folder.parent.name.startswith("01-01-2026-") and ".000000-" in folder.name
    assert sorted(p.name for p in folder.iterdir())[:2] == ["1-001.dcm", "1-002.dcm"]


@pytest.mark.parametrize("layout", ["retriever", "retriever-bare", "flat", "media"])
def test_every_layout_prepares_to_the_same_images_labels_split_and_folds(prepared, layout):
    reference_dir, reference = prepared["tcia"]
    out, report = prepared[layout]
    assert report["num_prepared"] == len(PATIENTS) and report["num_rejected"] == 0, report["rejected"]
    assert json.loads((out / "datalist.json").read_text()) == json.loads((reference_dir / "datalist.json").read_text())
    for patient in PATIENTS:
        for part in ("images", "labels"):
            name = f"{patient}.nii" if part == "images" else f"{patient}.nii.gz"
            ours, theirs = nib.load(out / part / name), nib.load(reference_dir / part / name)
            np.testing.assert_array_equal(ours.affine, theirs.affine)
            np.testing.assert_array_equal(np.asarray(ours.dataobj), np.asarray(theirs.dataobj))
    case = {r["case_id"]: r for r in report["cases"]}["LUNG1-002"]
    assert case["annotation"]["kind"] == "seg" and Path(case["annotation"]["file"]).is_file()
    assert case["series_uid"] == {r["case_id"]: r for r in reference["cases"]}["LUNG1-002"]["series_uid"]


def test_the_report_names_the_series_and_the_annotation_used_and_what_was_skipped(prepared, tcia):
    _, truths = tcia
    _, report = prepared["flat"]
    case = {r["case_id"]: r for r in report["cases"]}["LUNG1-001"]
    assert case["series_uid"] == truths[0]["ct_series_uid"] and case["slices"] == SHAPE[2]
    assert case["annotation"]["series_uid"] == truths[0]["seg_series_uid"]
    assert case["annotation"]["sop_uid"] == pydicom.dcmread(truths[0]["seg_file"]).SOPInstanceUID
    assert case["other_annotations"] == [str(Path(report["searched"]) / pydicom.dcmread(
        truths[0]["rtstruct_file"]).SOPInstanceUID)]  # fmt: skip
    assert report["skipped_files"] == {"DICOMDIR": 1}


def test_label_source_picks_the_rtstruct_in_a_retriever_download(layouts, tmp_path):
    report = prepare(layouts["retriever"], tmp_path, num_workers=1, progress=False, label_source="rtstruct")
    assert {r["annotation"]["kind"] for r in report["cases"]} == {"rtstruct"} and report["num_prepared"] == 3
    assert report["skipped_files"] == {"not DICOM": 1}, "metadata.csv"


# ------------------------------------------------------------------------------------------ real-world quirks
def as_new_series(files: list[Path], dest: Path, study: str | None = None, **changes) -> str:
    """Copies of ``files`` (one series) in ``dest`` as another series of the same (or another) study."""
    uid = generate_uid()
    dest.mkdir(parents=True)
    for path in files:
        ds = pydicom.dcmread(path)
        ds.SeriesInstanceUID = uid
        ds.SOPInstanceUID = ds.file_meta.MediaStorageSOPInstanceUID = generate_uid()
        ds.StudyInstanceUID = study or ds.StudyInstanceUID
        for key, value in changes.items():
            setattr(ds, key, value)
        ds.save_as(dest / path.name)
    return uid


def another_rtstruct(path: Path, dest: Path, roi: str | None = None, date: str = "20260101") -> str:
    ds = pydicom.dcmread(path)
    ds.SeriesInstanceUID = generate_uid()
    ds.SOPInstanceUID = ds.file_meta.MediaStorageSOPInstanceUID = generate_uid()
    ds.StructureSetDate = date
    if roi is not None:
        ds.StructureSetROISequence[0].ROIName = roi
    dest.parent.mkdir(parents=True, exist_ok=True)
    ds.save_as(dest)
    return str(ds.SOPInstanceUID)


def test_a_patient_with_several_ct_series_and_studies_gets_a_case_per_annotated_series(tcia, tmp_path):
    """LUNG1-001 has a second, unannotated CT series in its study (the report names it), and a second study whose CT
    is annotated too: two cases, suffixed by their CT series numbers; the split keeps them together."""
    root, truths = tcia
    data = tmp_path / "data"
    shutil.copytree(root, data)
    image = Path(truths[0]["image_dir"].replace(str(root), str(data)))
    extra = as_new_series(sorted(image.glob("*.dcm")), data / COLLECTION / "other" / "thick", SeriesNumber=9)
    second = write_case(tmp_path / "second", "LUNG1-001", seed=99, shape=SHAPE, pixel_spacing=SPACING)
    shutil.copytree(tmp_path / "second" / COLLECTION, data / COLLECTION / "second-study")
    cases, rejected = scan(data, progress=False).training_cases()
    first = [c for c in cases if c["patient_id"] == "LUNG1-001"]
    assert not rejected and len(first) == 2 and len(cases) == len(PATIENTS) + 1
    numbers = sorted(str(pydicom.dcmread(next(Path(t["image_dir"]).glob("*.dcm"))).SeriesNumber)
                     for t in (truths[0], second))  # fmt: skip
    suffixes = numbers if numbers[0] != numbers[1] else ["1", "2"]
    assert sorted(c["case_id"] for c in first) == [f"LUNG1-001_{n}" for n in suffixes]
    notes = {c["series_uid"]: " ".join(c["notes"]) for c in first}
    assert f"not annotated, not used: CT series {extra}" in notes[truths[0]["ct_series_uid"]]
    report = prepare(data, tmp_path / "out", num_workers=1, progress=False)
    datalist = json.loads((tmp_path / "out" / "datalist.json").read_text())
    lists = {part for part in ("training", "validation", "test") for e in datalist[part] if e["patient_id"] ==
             "LUNG1-001"}  # fmt: skip
    assert report["num_prepared"] == 4 and len(lists) == 1


def test_several_annotations_of_one_kind_are_chosen_by_the_documented_rule_and_noted(tcia, tmp_path):
    """Three RTSTRUCTs on one series: one without the GTV (newest, but it lacks the label), two with it: the newer of
    those two is used; the others are named."""
    _, truths = tcia
    rt = Path(truths[0]["rtstruct_file"])
    older = another_rtstruct(rt, tmp_path / "plans" / "old.dcm", date="20250101")
    newer = another_rtstruct(rt, tmp_path / "plans" / "new.dcm", date="20260301")
    another_rtstruct(rt, tmp_path / "plans" / "organs.dcm", roi="Heart", date="20261101")
    shutil.copytree(Path(truths[0]["image_dir"]), tmp_path / "plans" / "ct")
    cases, rejected = scan(tmp_path / "plans", progress=False).training_cases(["GTV-1"], "rtstruct")
    (case,) = cases
    assert case["annotation"]["sop_uid"] == newer and not rejected
    assert "new.dcm is used, not RTSTRUCT old.dcm, RTSTRUCT organs.dcm (the rule:" in case["notes"][0]
    assert older != newer


def test_an_annotation_whose_series_is_absent_is_rejected_naming_both_uids(tcia, tmp_path):
    _, truths = tcia
    shutil.copy(truths[1]["seg_file"], tmp_path / "seg.dcm")
    shutil.copytree(Path(truths[0]["image_dir"]).parent, tmp_path / "other")  # another patient, complete
    cases, rejected = scan(tmp_path, progress=False).training_cases()
    assert [c["case_id"] for c in cases] == ["LUNG1-001"]
    (lost,) = rejected
    assert lost["case_id"] == "LUNG1-002" and truths[1]["seg_series_uid"] in lost["reason"]
    assert truths[1]["ct_series_uid"] in lost["reason"] and "download or export that CT series too" in lost["reason"]


def test_a_ct_without_annotation_is_no_training_case_but_an_inference_case(tcia, tmp_path):
    _, truths = tcia
    shutil.copytree(truths[2]["image_dir"], tmp_path / "ct")
    index = scan(tmp_path, progress=False)
    cases, rejected = index.training_cases()
    assert not cases and "no SEG or RTSTRUCT" in rejected[0]["reason"] and "inference still takes it" in rejected[0][
        "reason"]  # fmt: skip
    (inferred,), failed = index.inference_cases()
    assert inferred["case_id"] == "LUNG1-003" and inferred["series_uid"] == truths[2]["ct_series_uid"] and not failed


def test_files_that_are_not_slices_are_skipped_and_a_damaged_slice_rejects_its_case(tcia, tmp_path):
    _, truths = tcia
    for truth in truths[:2]:
        shutil.copytree(Path(truth["image_dir"]).parent, tmp_path / truth["patient_id"])
    image = tmp_path / "LUNG1-001" / "image"
    (image / "Thumbs.db").write_bytes(b"\x00windows thumbnail cache")
    (image / "readme.txt").write_text("exported by the PACS")
    victim = tmp_path / "LUNG1-002" / "image" / "1-005.dcm"
    victim.rename(victim.with_suffix(""))  # a slice named without extension, then cut in its header
    victim.with_suffix("").write_bytes(victim.with_suffix("").read_bytes()[:300])
    index = scan(tmp_path, progress=False)
    cases, rejected = index.training_cases()
    assert [c["case_id"] for c in cases] == ["LUNG1-001"]
    assert "Thumbs.db (not DICOM), readme.txt (not DICOM)" in " ".join(cases[0]["notes"])
    assert rejected[0]["case_id"] == "LUNG1-002" and "1-005: a damaged DICOM file" in rejected[0]["reason"]
    assert index.skipped() == {"damaged DICOM": 1, "not DICOM": 2}


def test_an_rtstruct_naming_no_series_is_paired_by_its_frame_of_reference_unless_two_series_share_it(tcia, tmp_path):
    _, truths = tcia
    shutil.copytree(truths[0]["image_dir"], tmp_path / "ct")
    rt = pydicom.dcmread(truths[0]["rtstruct_file"])
    for frame in rt.ReferencedFrameOfReferenceSequence:
        del frame.RTReferencedStudySequence  # some planning systems write only the frame of reference
    rt.save_as(tmp_path / "rt.dcm")
    (case,), _ = scan(tmp_path, progress=False).training_cases(["GTV-1"], "rtstruct")
    assert case["annotation"]["paired_by"] == "frame of reference"
    as_new_series(sorted((tmp_path / "ct").glob("*.dcm")), tmp_path / "phase-2")  # a 4D-CT phase: same frame
    cases, (refused,) = scan(tmp_path, progress=False).training_cases(["GTV-1"], "rtstruct")
    assert not cases and "2 CT series share its FrameOfReferenceUID" in refused["reason"]


def test_a_second_scan_reads_only_new_or_changed_files(tcia, tmp_path, monkeypatch):
    """Counted, not timed: every header is read once; a re-scan reads none; a file replaced by another of the same
    size with its old modification time put back (cp -p, rsync -a) is read again."""
    root, truths = tcia
    data = shutil.copytree(root, tmp_path / "data")
    reads = []
    read_header = discovery.read_header
    monkeypatch.setattr(discovery, "read_header", lambda path: reads.append(path) or read_header(path))
    cache = tmp_path / "out" / "dicom_index.json"
    first = scan(data, cache, progress=False)
    total = len(first.headers)
    assert len(reads) == total == len(PATIENTS) * (SHAPE[2] + 2)
    reads.clear()
    again = scan(data, cache, progress=False)
    assert reads == [] and again.headers == first.headers
    slice_file = sorted(Path(truths[0]["image_dir"].replace(str(root), str(data))).glob("*.dcm"))[3]
    before = slice_file.stat()
    content = bytearray(slice_file.read_bytes())
    content[-1] ^= 1  # one pixel changed: the same size
    slice_file.write_bytes(bytes(content))
    os.utime(slice_file, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert slice_file.stat().st_size == before.st_size and slice_file.stat().st_mtime_ns == before.st_mtime_ns
    scan(data, cache, progress=False)
    assert reads == [data / slice_file.relative_to(data)]


def test_a_missing_folder_or_one_without_dicom_says_what_to_give(tmp_path):
    from scripts.data.prepare import PrepareError

    with pytest.raises(PrepareError, match=r"no such folder.*Data Retriever"):
        prepare(tmp_path / "missing", tmp_path / "out", progress=False)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "metadata.csv").write_text("Series UID\n")
    with pytest.raises(PrepareError, match=r"holds no DICOM CT series \(1 not DICOM\)"):
        prepare(tmp_path, tmp_path / "out", progress=False)


def test_duplicate_copies_of_a_series_count_once(tcia, tmp_path):
    _, truths = tcia
    shutil.copytree(truths[0]["image_dir"], tmp_path / "a")
    shutil.copytree(truths[0]["image_dir"], tmp_path / "b")  # the same instances exported twice
    shutil.copy(truths[0]["seg_file"], tmp_path / "a" / "seg.dcm")
    (case,), _ = scan(tmp_path, progress=False).training_cases()
    assert len(case["slice_paths"]) == SHAPE[2] and all("/a/" in f for f in case["slice_paths"])
    assert "holds the same instance as a/" in " ".join(case["notes"])

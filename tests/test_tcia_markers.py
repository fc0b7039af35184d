"""Case folders on disk: a marked case counts as complete only while its file counts match, a folder that
``monai.apps.TciaDataset`` made for the same SEG is adopted, a folder of another SEG is never overwritten (the message
says what to do), moving a finished case into place replaces only our own damaged copy, and only temporary folders of
processes that no longer run are cleaned up."""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
from pathlib import Path

import pytest
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.uid import CTImageStorage, ExplicitVRLittleEndian, SegmentationStorage, generate_uid
from scripts.data.tcia import markers
from scripts.data.tcia.errors import TciaError
from scripts.data.tcia.markers import (
    MARKER,
    adopt_unmarked_case,
    existing_case,
    index_markers,
    move_into_place,
    read_marker,
    remove_stale_temps,
)

SEG_UID, OTHER_SEG_UID, CT_UID = "1.2.826.0.1.1", "1.2.826.0.1.2", "1.2.826.0.1.3"


def write_dcm(path: Path, series_uid: str, sop_class=CTImageStorage) -> None:
    ds = Dataset()
    ds.SOPClassUID, ds.SOPInstanceUID, ds.SeriesInstanceUID = sop_class, generate_uid(), series_uid
    ds.file_meta = FileMetaDataset()
    ds.file_meta.MediaStorageSOPClassUID, ds.file_meta.MediaStorageSOPInstanceUID = sop_class, ds.SOPInstanceUID
    ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
    path.parent.mkdir(parents=True, exist_ok=True)
    ds.save_as(path, enforce_file_format=True)


def make_case(coll: Path, patient: str, number: str, seg_uid: str = SEG_UID, images: int = 3) -> Path:
    """A case folder as TciaDataset or the downloader leaves it: ``seg/1-1.dcm`` and ``image/*.dcm``."""
    case = coll / patient / number
    write_dcm(case / "seg" / "1-1.dcm", seg_uid, SegmentationStorage)
    for i in range(images):
        write_dcm(case / "image" / f"1-{i + 1:02d}.dcm", CT_UID)
    (case / "image").mkdir(parents=True, exist_ok=True)
    return case


def mark(case: Path, seg_uid: str = SEG_UID, images: int = 3) -> dict:
    marker = {"seg_series_uid": seg_uid, "image_series_uid": CT_UID, "patient_id": case.parent.name,
              "series_number": case.name, "seg_folder": "seg", "seg_files": 1, "image_files": images,
              "md5_verified": True}  # fmt: skip
    (case / MARKER).write_text(json.dumps(marker))
    return marker


def entry(patient: str = "LUNG1-001", number: str = "1234", uid: str = SEG_UID) -> dict:
    return {"PatientID": patient, "SeriesNumber": number, "SeriesInstanceUID": uid}


# ---- index_markers


def test_index_lists_marked_cases_whose_files_are_all_there(tmp_path):
    a, b = make_case(tmp_path, "LUNG1-001", "1234"), make_case(tmp_path, "LUNG1-002", "77", OTHER_SEG_UID)
    mark(a)
    mark(b, OTHER_SEG_UID)
    index = index_markers(tmp_path)
    assert set(index) == {SEG_UID, OTHER_SEG_UID}
    assert index[SEG_UID]["case_dir"] == str(a) and index[SEG_UID]["md5_verified"] is True


def test_case_whose_file_counts_changed_is_left_out_with_a_warning(tmp_path, caplog):
    missing, added = make_case(tmp_path, "LUNG1-001", "1"), make_case(tmp_path, "LUNG1-002", "2", OTHER_SEG_UID)
    mark(missing)
    mark(added, OTHER_SEG_UID)
    (missing / "image" / "1-02.dcm").unlink()
    write_dcm(added / "seg" / "1-2.dcm", OTHER_SEG_UID, SegmentationStorage)
    with caplog.at_level(logging.WARNING, logger="scripts.data.tcia.markers"):
        assert index_markers(tmp_path) == {}
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert str(missing) in warned and str(added) in warned and "downloaded again" in warned


def test_files_that_are_not_dicom_do_not_change_the_count(tmp_path):
    case = make_case(tmp_path, "LUNG1-001", "1")
    mark(case)
    (case / "image" / "LICENSE.txt").write_text("CC BY")
    (case / "image" / "notes.json").write_text("{}")
    assert set(index_markers(tmp_path)) == {SEG_UID}


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", json.dumps({"seg_files": 1, "image_files": 3})])
def test_unreadable_or_incomplete_marker_is_ignored(tmp_path, content):
    case = make_case(tmp_path, "LUNG1-001", "1")
    (case / MARKER).write_text(content)
    assert index_markers(tmp_path) == {}


# ---- adopt_unmarked_case


def test_tciadataset_folder_of_the_same_seg_is_adopted(tmp_path):
    case = make_case(tmp_path, "LUNG1-001", "1234")
    adopted = adopt_unmarked_case(tmp_path, entry(), "seg")
    assert adopted is not None and adopted["case_dir"] == str(case)
    written = read_marker(case)
    assert written["adopted"] is True and written["md5_verified"] is False, "its CT files were not verified"
    assert (written["seg_series_uid"], written["image_series_uid"]) == (SEG_UID, CT_UID)
    assert (written["seg_files"], written["image_files"]) == (1, 3)
    assert set(index_markers(tmp_path)) == {SEG_UID}, "the next run counts it as complete"


@pytest.mark.parametrize(
    ("listed", "why"),
    [
        (entry(uid=OTHER_SEG_UID), "another SEG series is in the folder"),
        (entry(number="999"), "no folder at that PatientID/SeriesNumber"),
        (entry(patient=""), "no PatientID listed"),
        (entry(number=""), "no SeriesNumber listed"),
        (entry(patient=".."), "a PatientID that leaves the collection"),
        (entry(patient="LUNG1-001/1234/.."), "a PatientID with a path separator"),
    ],
)
def test_folder_is_not_adopted_when_it_is_not_this_seg(tmp_path, listed, why):
    case = make_case(tmp_path, "LUNG1-001", "1234")
    assert adopt_unmarked_case(tmp_path, listed, "seg") is None, why
    assert read_marker(case) is None


def test_folder_without_ct_files_is_not_adopted(tmp_path):
    case = make_case(tmp_path, "LUNG1-001", "1234", images=0)
    assert adopt_unmarked_case(tmp_path, entry(), "seg") is None
    assert read_marker(case) is None


def test_marked_folder_is_not_adopted_again(tmp_path):
    case = make_case(tmp_path, "LUNG1-001", "1234")
    marker = mark(case)
    assert adopt_unmarked_case(tmp_path, entry(), "seg") is None
    assert read_marker(case) == marker


# ---- existing_case


LABEL = f"SEG series {SEG_UID} (patient LUNG1-001)"


def test_free_destination_or_our_own_damaged_copy_is_to_be_filled(tmp_path):
    assert existing_case(tmp_path / "LUNG1-001" / "1234", SEG_UID, LABEL, "seg") is None
    damaged = make_case(tmp_path, "LUNG1-001", "1234")
    mark(damaged)
    assert existing_case(damaged, SEG_UID, LABEL, "seg") is None


def test_unmarked_folder_of_this_seg_with_its_ct_is_adopted(tmp_path):
    case = make_case(tmp_path, "LUNG1-001", "1234")
    found = existing_case(case, SEG_UID, LABEL, "seg")
    assert found is not None and found["adopted"] is True and found["image_series_uid"] == CT_UID
    assert read_marker(case)["adopted"] is True


def test_unmarked_folder_of_this_seg_without_ct_is_to_be_replaced(tmp_path):
    case = make_case(tmp_path, "LUNG1-001", "1234", images=0)
    assert existing_case(case, SEG_UID, LABEL, "seg") is None
    assert read_marker(case) is None


def test_marked_folder_of_another_seg_is_never_overwritten(tmp_path):
    case = make_case(tmp_path, "LUNG1-001", "1234", OTHER_SEG_UID)
    mark(case, OTHER_SEG_UID)
    with pytest.raises(TciaError) as err:
        existing_case(case, SEG_UID, LABEL, "seg")
    message = str(err.value)
    assert message.startswith(LABEL) and str(case) in message and OTHER_SEG_UID in message
    assert "refusing to overwrite" in message and "move one of them away" in message


def test_unmarked_folder_of_another_seg_is_never_overwritten(tmp_path):
    case = make_case(tmp_path, "LUNG1-001", "1234", OTHER_SEG_UID)
    with pytest.raises(TciaError, match=f"{OTHER_SEG_UID}; refusing to overwrite it -- move one away"):
        existing_case(case, SEG_UID, LABEL, "seg")
    assert read_marker(case) is None


def test_folder_without_a_readable_seg_is_refused(tmp_path):
    case = tmp_path / "LUNG1-001" / "1234"
    (case / "seg").mkdir(parents=True)
    (case / "seg" / "1-1.dcm").write_bytes(b"not dicom at all")
    with pytest.raises(TciaError, match="holds no readable SEG; move it away and re-run"):
        existing_case(case, SEG_UID, LABEL, "seg")
    assert (case / "seg" / "1-1.dcm").read_bytes() == b"not dicom at all"


# ---- move_into_place


def staged(tmp_path: Path, content: str) -> Path:
    temp = tmp_path / ".tcia-tmp" / f"{SEG_UID}.tmp-{os.getpid()}"
    (temp / "seg").mkdir(parents=True)
    (temp / "seg" / "1-1.dcm").write_text(content)
    return temp


def test_finished_case_moves_into_a_free_place(tmp_path):
    temp = staged(tmp_path, "new")
    dest = tmp_path / "NSCLC-Radiomics" / "LUNG1-001" / "1234"
    move_into_place(temp, dest)
    assert (dest / "seg" / "1-1.dcm").read_text() == "new" and not temp.exists()


def test_moving_into_place_replaces_our_damaged_copy_and_nothing_else(tmp_path):
    patient = tmp_path / "NSCLC-Radiomics" / "LUNG1-001"
    dest, neighbour = patient / "1234", patient / "5678"
    for folder, text in ((dest, "damaged"), (neighbour, "other case")):
        (folder / "seg").mkdir(parents=True)
        (folder / "seg" / "1-1.dcm").write_text(text)
    move_into_place(staged(tmp_path, "new"), dest)
    assert (dest / "seg" / "1-1.dcm").read_text() == "new"
    assert (neighbour / "seg" / "1-1.dcm").read_text() == "other case"
    assert sorted(p.name for p in patient.iterdir()) == ["1234", "5678"], "no backup left behind"


def test_moving_across_file_systems_copies(tmp_path, monkeypatch):
    temp = staged(tmp_path, "new")
    dest = tmp_path / "NSCLC-Radiomics" / "LUNG1-001" / "1234"
    (dest / "seg").mkdir(parents=True)
    rename = os.rename

    def cross_device(src, dst):
        if Path(src) == temp:
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        rename(src, dst)

    monkeypatch.setattr(markers.os, "rename", cross_device)
    move_into_place(temp, dest)
    assert (dest / "seg" / "1-1.dcm").read_text() == "new"
    assert sorted(p.name for p in dest.parent.iterdir()) == ["1234"], "neither the copy's temporary nor a backup"


def test_other_rename_errors_are_raised(tmp_path, monkeypatch):
    temp = staged(tmp_path, "new")

    def denied(src, dst):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(markers.os, "rename", denied)
    with pytest.raises(PermissionError):
        move_into_place(temp, tmp_path / "NSCLC-Radiomics" / "LUNG1-001" / "1234")
    assert (temp / "seg" / "1-1.dcm").read_text() == "new"


# ---- remove_stale_temps


def test_only_temporary_folders_of_dead_processes_are_removed(tmp_path):
    finished = subprocess.Popen(["true"])
    finished.wait()  # its pid is now free: the folder it left is stale
    staging = tmp_path / ".tcia-tmp"
    names = {
        "dead": f"1.2.3.tmp-{finished.pid}",
        "mine": f"1.2.4.tmp-{os.getpid()}",
        "alive": f"1.2.5.tmp-{os.getppid()}",
        "not a pid": "1.2.6.tmp-abc",
        "downloads": "downloads",
    }
    for name in names.values():
        (staging / name / "seg").mkdir(parents=True)
    remove_stale_temps(staging)
    assert sorted(p.name for p in staging.iterdir()) == sorted(v for k, v in names.items() if k != "dead")


def test_missing_staging_folder_is_fine(tmp_path):
    remove_stale_temps(tmp_path / ".tcia-tmp")
    assert list(tmp_path.iterdir()) == []


def test_failed_move_leaves_the_previous_folder_as_it_was(tmp_path, monkeypatch):
    dest = tmp_path / "NSCLC-Radiomics" / "LUNG1-001" / "1234"
    (dest / "seg").mkdir(parents=True)
    (dest / "seg" / "1-1.dcm").write_text("damaged")
    temp = staged(tmp_path, "new")
    rename = os.rename

    def full_disk(src, dst):
        if Path(src) == temp:
            raise OSError(errno.ENOSPC, "No space left on device")
        rename(src, dst)

    monkeypatch.setattr(markers.os, "rename", full_disk)
    with pytest.raises(OSError, match="No space left"):
        move_into_place(temp, dest)
    assert (dest / "seg" / "1-1.dcm").read_text() == "damaged"
    assert sorted(p.name for p in dest.parent.iterdir()) == ["1234"], "no hidden backup is left to pile up"
    assert (temp / "seg" / "1-1.dcm").read_text() == "new"


def test_failed_copy_across_file_systems_leaves_no_partial_copy(tmp_path, monkeypatch):
    dest = tmp_path / "NSCLC-Radiomics" / "LUNG1-001" / "1234"
    (dest / "seg").mkdir(parents=True)
    (dest / "seg" / "1-1.dcm").write_text("damaged")
    temp = staged(tmp_path, "new")
    rename, copytree = os.rename, markers.shutil.copytree

    def cross_device(src, dst):
        if Path(src) == temp:
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        rename(src, dst)

    def copy_then_full(src, dst, *args, **kwargs):
        copytree(src, dst, *args, **kwargs)  # the copy is on disk when the disk fills up
        if Path(src) == temp:
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(markers.os, "rename", cross_device)
    monkeypatch.setattr(markers.shutil, "copytree", copy_then_full)
    with pytest.raises(OSError):
        move_into_place(temp, dest)
    assert (dest / "seg" / "1-1.dcm").read_text() == "damaged"
    assert sorted(p.name for p in dest.parent.iterdir()) == ["1234"]

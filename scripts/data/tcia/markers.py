"""Case folders on disk: the ``.complete.json`` marker that says a case is whole, adoption of folders that
``monai.apps.TciaDataset`` made, the atomic move of a finished case into place, and clean-up of interrupted runs.

Each case is assembled in ``<dataset_dir>/.tcia-tmp/<SEG UID>.tmp-<pid>/`` (outside the collection folder, so neither
TciaDataset nor ``scripts.data.prepare`` ever sees a half-built case, and on the same file system, so the final rename
is atomic). The marker (UIDs, file counts, whether MD5s were checked) is written before that move, so a case folder with
a marker is complete. A case folder without one is adopted when its SEG has the listed SeriesInstanceUID and its
``image/`` holds ``.dcm`` files; an ``adopted`` marker is then written (its CT files were not verified).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import time
from pathlib import Path

import pydicom
from pydicom.errors import InvalidDicomError
from scripts.common.files import write_json
from scripts.data.tcia.errors import TciaError

logger = logging.getLogger(__name__)

MARKER = ".complete.json"
STAGING = ".tcia-tmp"


def index_markers(coll_dir: Path) -> dict[str, dict]:
    """{SEG UID: marker} for every case folder whose marker's file counts still match what is on disk."""
    done: dict[str, dict] = {}
    for marker_path in sorted(coll_dir.glob(f"*/*/{MARKER}")):
        case = marker_path.parent
        marker = read_marker(case)
        if not marker or not marker.get("seg_series_uid"):
            continue
        counts = (dcm_count(case / str(marker.get("seg_folder", "seg"))), dcm_count(case / "image"))
        if counts != (marker.get("seg_files"), marker.get("image_files")):
            logger.warning(
                "%s: files are missing or were added since it was completed; it will be downloaded again", case
            )
            continue
        done[str(marker["seg_series_uid"])] = {**marker, "case_dir": str(case)}
    return done


def adopt_unmarked_case(coll_dir: Path, entry: dict, seg_folder: str) -> dict | None:
    """A TciaDataset-made folder (no marker) at the listing's PatientID/SeriesNumber holding this SEG, or None."""
    patient, number = str(entry.get("PatientID") or ""), str(entry.get("SeriesNumber") or "")
    if not patient or not number or any(c in patient + number for c in "/\\\0") or ".." in (patient, number):
        return None
    case = coll_dir / patient / number
    if read_marker(case) is not None or not dcm_count(case / "image"):
        return None
    if series_uid_of_first(case / seg_folder) != entry["SeriesInstanceUID"]:
        return None
    return adopt(case, str(entry["SeriesInstanceUID"]), seg_folder)


def adopt(case: Path, uid: str, seg_folder: str) -> dict:
    image_uid = series_uid_of_first(case / "image")
    marker = {
        "seg_series_uid": uid,
        "image_series_uid": image_uid,
        "patient_id": case.parent.name,
        "series_number": case.name,
        "seg_folder": seg_folder,
        "seg_files": dcm_count(case / seg_folder),
        "image_files": dcm_count(case / "image"),
        "md5_verified": False,
        "adopted": True,
        "completed": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    write_json(case / MARKER, marker)
    logger.info("%s: adopted a case folder without marker (e.g. from monai.apps.TciaDataset); not re-verified", case)
    return {**marker, "case_dir": str(case)}


def read_marker(case: Path) -> dict | None:
    try:
        data = json.loads((case / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def series_uid_of_first(folder: Path) -> str | None:
    files = sorted(folder.glob("*.dcm")) if folder.is_dir() else []
    if not files:
        return None
    try:
        return (
            str(
                pydicom.dcmread(files[0], stop_before_pixels=True, specific_tags=["SeriesInstanceUID"]).get(
                    "SeriesInstanceUID", ""
                )
            )
            or None
        )
    except (InvalidDicomError, OSError, ValueError):
        return None


def dcm_count(folder: Path) -> int:
    return sum(1 for p in folder.iterdir() if p.is_file() and p.suffix.lower() == ".dcm") if folder.is_dir() else 0


def existing_case(dest: Path, uid: str, label: str, seg_folder: str) -> dict | None:
    """None when ``dest`` is free or holds an incomplete copy of this SEG series (to be replaced); the case's facts
    when it is an unmarked but complete folder of this SEG (adopted). Raises when it belongs to anything else."""
    if not dest.exists():
        return None
    marker = read_marker(dest)
    if marker is not None:
        if marker.get("seg_series_uid") == uid:
            return None  # damaged (the up-front index rejected it): replaced by the fresh download
        raise TciaError(
            f"{label}: {dest} already holds SEG series {marker.get('seg_series_uid')} (same PatientID and "
            "SeriesNumber); refusing to overwrite it -- move one of them away and re-run"
        )
    found = series_uid_of_first(dest / seg_folder)
    if found == uid:  # a folder of this very SEG without marker: adopt it when it has its CT, else replace it
        return adopt(dest, uid, seg_folder) if dcm_count(dest / "image") else None
    if found is None:
        raise TciaError(f"{label}: {dest} exists but holds no readable SEG; move it away and re-run")
    raise TciaError(f"{label}: {dest} already holds SEG series {found}; refusing to overwrite it -- move one away")


def move_into_place(temp: Path, dest: Path) -> None:
    """Rename ``temp`` to ``dest`` (replacing our own damaged copy via a backup rename), across devices if must.

    If the move fails, ``dest`` is put back as it was (no hidden backup or partial copy is left behind)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    backup = dest.parent / f".{dest.name}.old-{os.getpid()}"
    near = dest.parent / f".{dest.name}.tmp-{os.getpid()}"
    if dest.exists():
        os.rename(dest, backup)
    try:
        try:
            os.rename(temp, dest)
        except OSError as err:
            if err.errno != errno.EXDEV:
                raise
            shutil.copytree(temp, near)
            os.rename(near, dest)
    except BaseException:
        shutil.rmtree(near, ignore_errors=True)
        if backup.exists() and not dest.exists():
            os.rename(backup, dest)
        raise
    shutil.rmtree(backup, ignore_errors=True)


def remove_stale_temps(staging: Path) -> None:
    """Remove case folders left in ``staging`` by processes that no longer run."""
    if not staging.is_dir():
        return
    for temp in staging.glob("*.tmp-*"):
        pid = temp.name.rsplit(".tmp-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            logger.info("removing %s left by an interrupted run", temp)
            shutil.rmtree(temp, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. PermissionError: the process exists but is not ours
        return True
    return True


def remove_if_empty(folder: Path) -> None:
    with contextlib.suppress(OSError):
        folder.rmdir()

"""The DICOM node's queue on disk: the instances received, each study version's inference, each result's sending.

Every state is a file or a folder put in place whole (written aside, then renamed), so a node killed at any moment
(``kill -9``, a power cut after the disk has synced) leaves a state the next node continues from::

    <node folder>/
      node.lock                                       held by the running node: a second one on the folder stops
      incoming/<StudyInstanceUID>/<SOPInstanceUID>.dcm
                                                      instances received since the study was last frozen, each
                                                      written to a hidden temporary file, synced and renamed before
                                                      its C-STORE is acknowledged (temporary files left by a kill are
                                                      removed at start: their C-STORE was never acknowledged)
      incoming/<StudyInstanceUID>/.senders.json       the calling AE titles that sent them
      studies/<StudyInstanceUID>/v<N>/                a version: the study as it was when it fell quiet
                                      input/          its instances (from v2 on: the earlier version's, with the new
                                                      ones added and replacing those with their SOP Instance UID)
                                      senders.json    the calling AE titles that sent them
                                      received.json   its series and senders, written last: a version without it is
                                                      completed again at start
                                      output/         ``monai.bundle run inference``'s output folder for input/
                                      inference.log   that run's log
                                      inferred.json   the outcome (done, failed, no usable CT), written when it ended:
                                                      a version without it is inferred (again) at start
                                      sent/<AE@host_port>.json
                                                      per destination: each result's SOP Instance UID and file, which
                                                      were delivered, the attempts, the last error, the next try

File and folder names come from UIDs only after they are checked to be UIDs (digits and dots, at most 64
characters), and AE titles only through :func:`~scripts.common.files.safe_name`: nothing a sender writes into its
DICOM can name a path outside the node's folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import pydicom
from scripts.common.files import read_json, safe_name, write_json

UID = re.compile(r"[0-9]+(\.[0-9]+)*")
SENDERS = ".senders.json"
HEADER = ["SeriesInstanceUID", "Modality", "SeriesDescription", "SOPClassUID"]
#: CT Image, Enhanced CT Image and Legacy Converted Enhanced CT Image Storage
CT_IMAGES = {"1.2.840.10008.5.1.4.1.1.2", "1.2.840.10008.5.1.4.1.1.2.1", "1.2.840.10008.5.1.4.1.1.2.2"}


def is_uid(value: Any) -> bool:
    """A DICOM UID: digits in groups separated by dots, at most 64 characters (PS3.5 9.1)."""
    return isinstance(value, str) and len(value) <= 64 and UID.fullmatch(value) is not None


def destination_file_name(destination: str) -> str:
    """The file a destination's sending is recorded in: ``AE@host:port`` made safe for a file name."""
    return safe_name(destination.replace(":", "_")) + ".json"


@dataclass(frozen=True)
class Version:
    """A study as it was when it fell quiet: the unit that is inferred and whose results are sent."""

    folder: Path

    @property
    def study_uid(self) -> str:
        return self.folder.parent.name

    @property
    def number(self) -> int:
        return int(self.folder.name[1:])

    @property
    def name(self) -> str:
        return f"study {self.study_uid} v{self.number}"

    @property
    def input_dir(self) -> Path:
        return self.folder / "input"

    @property
    def output_dir(self) -> Path:
        return self.folder / "output"

    @property
    def previous(self) -> Version | None:
        earlier = self.folder.parent / f"v{self.number - 1}"
        return Version(earlier) if earlier.is_dir() else None

    @property
    def received(self) -> dict | None:
        return _read(self.folder / "received.json")

    @property
    def inferred(self) -> dict | None:
        return _read(self.folder / "inferred.json")

    def record_inferred(self, outcome: dict) -> None:
        write_json(self.folder / "inferred.json", outcome)

    def sending(self, destination: str) -> dict | None:
        return _read(self.folder / "sent" / destination_file_name(destination))

    def record_sending(self, destination: str, record: dict) -> None:
        write_json(self.folder / "sent" / destination_file_name(destination), record)


def _read(path: Path) -> dict | None:
    return read_json(path) if path.is_file() else None


class Spool:
    """The node's folder: instances in, study versions out (see the module docstring for the layout)."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder).resolve()
        self.incoming = self.folder / "incoming"
        self.studies = self.folder / "studies"
        self.incoming.mkdir(parents=True, exist_ok=True)
        self.studies.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()  # an instance written, or a study frozen: never both at once
        self._last_received: dict[str, float] = {}  # study -> when its last instance arrived
        self._senders: dict[str, list[str]] = {}  # study -> the calling AE titles of incoming/<study>/.senders.json

    # -------------------------------------------------------------------------------------------- receiving
    def remove_unacknowledged(self) -> int:
        """Remove the temporary files a killed node left (instances whose C-STORE was never acknowledged)."""
        stale = list(self.incoming.glob("*/.*.tmp"))
        for path in stale:
            path.unlink(missing_ok=True)
        return len(stale)

    def store(self, study_uid: str, sop_uid: str, write: Callable[[BinaryIO], None], sender: str) -> Path:
        """``write`` one instance into ``incoming/<study>/<sop>.dcm`` durably (synced, then renamed); on return it is
        on disk and its C-STORE may be acknowledged. Both UIDs must pass :func:`is_uid`."""
        if not (is_uid(study_uid) and is_uid(sop_uid)):
            raise ValueError(f"not a UID: StudyInstanceUID {study_uid!r}, SOPInstanceUID {sop_uid!r}")
        with self._lock:
            folder = self.incoming / study_uid
            folder.mkdir(exist_ok=True)
            path, tmp = folder / f"{sop_uid}.dcm", folder / f".{sop_uid}.tmp"
            try:
                with tmp.open("wb") as handle:
                    write(handle)
                    handle.flush()
                    os.fsync(handle.fileno())
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
            _sync_folder(folder)
            known = self._senders.get(study_uid)
            if known is None:  # the study's first instance since this node started: its file, if any, once
                known = self._senders[study_uid] = (_read(folder / SENDERS) or {"senders": []})["senders"]
            if sender not in known:
                known.append(sender)
                write_json(folder / SENDERS, {"senders": known})
            self._last_received[study_uid] = time.time()
        return path

    def quiet_studies(self, quiet_s: float, busy: set[str]) -> list[str]:
        """The studies in ``incoming/`` no association in ``busy`` is sending and none of whose instances arrived in
        the last ``quiet_s`` seconds (after a restart: by the files' modification times)."""
        with self._lock:  # never between an instance's write and its arrival time being noted
            return self._quiet(quiet_s, busy)

    def _quiet(self, quiet_s: float, busy: set[str]) -> list[str]:
        now, quiet = time.time(), []
        for folder in sorted(p for p in self.incoming.iterdir() if p.is_dir()):
            study = folder.name
            if study in busy:
                continue
            last = self._last_received.get(study)
            if last is None:  # received before this node started: the files' times, looked at once
                times = [p.stat().st_mtime for p in folder.glob("*.dcm")]
                last = self._last_received[study] = max(times, default=0.0)
            if now - last >= quiet_s:
                quiet.append(study)
        return quiet

    # -------------------------------------------------------------------------------------------- versions
    def freeze(self, study_uid: str) -> Version | None:
        """Move the study's instances received so far into a new version and complete it (:meth:`complete`); None
        when nothing arrived (an empty folder is removed)."""
        with self._lock:
            folder = self.incoming / study_uid
            if not any(folder.glob("*.dcm")):
                shutil.rmtree(folder, ignore_errors=True)
                self._last_received.pop(study_uid, None)
                self._senders.pop(study_uid, None)
                return None
            versions = self.studies / study_uid
            number = 1 + max((_number(p) for p in versions.glob("v*")), default=0)
            version = Version(versions / f"v{number}")
            version.folder.mkdir(parents=True)
            os.rename(folder, version.input_dir)
            self._last_received.pop(study_uid, None)
            self._senders.pop(study_uid, None)
            _move_senders(version)
        self.complete(version)
        return version

    def complete(self, version: Version) -> dict:
        """Add the earlier version's instances the new send did not replace, then write ``received.json`` (last):
        the version's series (modality, description, instances), senders, and a digest of its CT images (names and
        contents), by which a version that brought no new or changed CT image is told from one to infer."""
        earlier = version.folder.parent / f"v{version.number - 1}" / "input"
        if earlier.is_dir():
            for path in earlier.glob("*.dcm"):
                target = version.input_dir / path.name
                if not target.exists():
                    _link_or_copy(path, target)
        _move_senders(version)
        senders = _read(version.folder / "senders.json") or {"senders": []}
        series: dict[str, dict] = {}
        ct_images = hashlib.sha256()
        for path in sorted(version.input_dir.glob("*.dcm")):
            try:
                ds = pydicom.dcmread(path, stop_before_pixels=True, specific_tags=HEADER)
                uid, modality = str(ds.get("SeriesInstanceUID", "")), str(ds.get("Modality", ""))
                description = str(ds.get("SeriesDescription", ""))
                if str(ds.get("SOPClassUID", "")) in CT_IMAGES:
                    ct_images.update(path.name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
            except Exception as err:
                uid, modality, description = "unreadable", "", f"{type(err).__name__}: {err}"
            entry = series.setdefault(uid, {"series_uid": uid, "modality": modality, "description": description,
                                            "instances": 0})  # fmt: skip
            entry["instances"] += 1
        record = {"study_uid": version.study_uid, "version": version.number, "senders": senders["senders"],
                  "frozen": time.time(), "instances": sum(s["instances"] for s in series.values()),
                  "ct_images_sha256": ct_images.hexdigest(), "series": list(series.values())}  # fmt: skip
        write_json(version.folder / "received.json", record)
        return record

    def versions(self) -> list[Version]:
        """Every study version, in the order they were frozen (one a kill left uncompleted first)."""
        versions = [Version(p) for p in self.studies.glob("*/v*") if p.is_dir() and _number(p)]
        return sorted(versions, key=lambda v: ((v.received or {}).get("frozen", 0.0), v.study_uid, v.number))


def _number(path: Path) -> int:
    return int(path.name[1:]) if path.name[1:].isdigit() else 0


def _move_senders(version: Version) -> None:
    """The senders' list out of the input folder (which holds instances only) into the version's."""
    with contextlib.suppress(FileNotFoundError):
        os.replace(version.input_dir / SENDERS, version.folder / "senders.json")


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def _sync_folder(folder: Path) -> None:
    """The folder's entry for a renamed file on disk too (a rename alone survives ``kill -9``, not a power cut)."""
    handle = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)

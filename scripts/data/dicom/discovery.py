"""Which cases a folder holds, found from the DICOM headers of its files, whatever the folder layout.

One answer for every command: ``scripts.data.prepare`` (and so training's setup, evaluation and cross-validation, which
read what it prepares) asks :meth:`DicomIndex.training_cases`; inference from a folder asks
:meth:`DicomIndex.inference_cases`. Folder and file names are never read for meaning: a download by TCIA's NBIA Data
Retriever (``[manifest-<n>/]<Collection>/<PatientID>/<date>-<study>-<n>/<n>.000000-<series>-<n>/1-NNN.dcm``, with
or without its ``metadata.csv``), the ``monai.apps.TciaDataset`` / ``scripts.data.tcia`` layout
(``<PatientID>/<SeriesNumber>/{image,seg,rtstruct}/``), a PACS or treatment-planning export (files named by UID,
without extension, several patients in one folder, a DICOMDIR beside them) all give the same cases.

:func:`scan` reads every file's header once (``stop_before_pixels``, only the tags below) into a
:class:`DicomIndex`. With ``cache_file`` what it read is kept, keyed by each file's size, modification time and
inode change time (which no copy tool sets back: ``cp -p``, ``rsync -a`` and tar restore modification times, not the
change time), so a second scan of an unchanged tree only lists the files.

How files become cases:

* CT images are grouped by SeriesInstanceUID (an instance stored twice, by SOPInstanceUID, counts once: noted);
* a DICOM SEG annotates the CT series its ReferencedSeriesSequence names; an RTSTRUCT the series its
  RTReferencedSeriesSequence names. An annotation that names no series is paired by its FrameOfReferenceUID when
  exactly one CT series has it. An annotation whose series is not in the folder is reported with both UIDs;
* **training** (:meth:`DicomIndex.training_cases`): every annotated CT series is a case. When several annotations
  annotate one series, the rule is: the kinds ``label_source`` allows (``seg``, ``rtstruct``, or ``auto``: both),
  then one holding every requested label (names matched as :func:`scripts.common.labels.matching` does), then with
  ``auto`` a SEG before an RTSTRUCT, then the newest (SEG content date and time, RTSTRUCT structure-set date and
  time), then the lowest SOPInstanceUID; the case's notes name the others. The case id is the PatientID, with
  ``_<SeriesNumber>`` of its CT only when a patient has several annotated series. A patient's CT series without
  an annotation is named in its case's notes, or, when it has no annotated series, the patient is rejected saying
  so (such a series is still an inference case);
* **inference** (:meth:`DicomIndex.inference_cases`): one case per study, its CT series chosen by
  :mod:`scripts.data.dicom.series_rules` -- the same rule as a study from a PACS.

Files that are not DICOM (``metadata.csv``, ``Thumbs.db``, notes), a DICOMDIR and other DICOM objects (RT plans and
doses, presentation states, SRs) are skipped and counted; a case notes those lying beside its slices. A file that
looks like DICOM (named ``.dcm``, or the ``DICM`` marker) but cannot be read is *damaged*: a case whose slices share
its folder with no other series is rejected ("download the series again"), as a slice may be missing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pydicom
from pydicom.errors import InvalidDicomError
from pydicom.multival import MultiValue
from pydicom.uid import UID
from scripts.common.files import safe_name, unique_name, write_text
from scripts.common.labels import matching
from scripts.data.dicom.case import LABEL_SOURCES
from scripts.data.dicom.common import RTSTRUCT_STORAGE, SEG_STORAGE
from scripts.data.dicom.ct import CT_IMAGE_STORAGE, DICOMDIR_STORAGE, ENHANCED_CT_STORAGE
from scripts.data.dicom.series_rules import InstanceHeader, SeriesRules, choose_series, describe_series, gantry_tilt_of
from tqdm import tqdm

logger = logging.getLogger(__name__)

#: bump when what a header record holds changes: older caches are then read again
INDEX = "dicom_index.json"  # the headers a scan read, in its output folder, reused by the next run (cache_file)
INDEX_VERSION = 2  # records with a CT image's GantryDetectorTilt, another object's study, series and modality
#: the only tags read from each file (pydicom skips the rest of the header; pixel data is never read)
HEADER_TAGS = (
    "SOPClassUID",
    "SOPInstanceUID",
    "Modality",
    "PatientID",
    "StudyInstanceUID",
    "SeriesInstanceUID",
    "FrameOfReferenceUID",
    "SeriesNumber",
    "SeriesDescription",
    "StudyDate",
    "StudyDescription",
    "ImageType",
    "ImageOrientationPatient",
    "ImagePositionPatient",
    "GantryDetectorTilt",
    "ReferencedSeriesSequence",
    "ReferencedFrameOfReferenceSequence",
    "SegmentSequence",
    "StructureSetROISequence",
    "ContentDate",
    "ContentTime",
    "StructureSetDate",
    "StructureSetTime",
    "SeriesDate",
    "SeriesTime",
)
#: what is kept of a DICOM object that is neither a CT image nor an annotation
OTHER_TAGS = {
    "study": "StudyInstanceUID",
    "patient": "PatientID",
    "series": "SeriesInstanceUID",
    "number": "SeriesNumber",
    "description": "SeriesDescription",
    "modality": "Modality",
}
#: names that are never DICOM: skipped without opening (a download's listing, prepared NIfTI, logs, archives)
NOT_DICOM_SUFFIXES = (".nii", ".nii.gz", ".json", ".csv", ".txt", ".md", ".log", ".pt", ".pth", ".onnx", ".png")
NOT_DICOM_SUFFIXES += (".jpg", ".jpeg", ".zip", ".part", ".xml", ".html", ".pdf", ".py", ".yaml", ".yml")
KINDS = {
    CT_IMAGE_STORAGE: "ct",
    SEG_STORAGE: "seg",
    RTSTRUCT_STORAGE: "rtstruct",
    DICOMDIR_STORAGE: "dicomdir",
    **dict.fromkeys(ENHANCED_CT_STORAGE, "ct"),
}
ANNOTATIONS = ("seg", "rtstruct")
#: ``scan``'s ``skip_folder``: (a folder, the names of its files) -> why it is not read, or None to read it
SkipFolder = Callable[[Path, Sequence[str]], "str | None"]


class DiscoveryError(ValueError):
    """The folder cannot be searched (missing, or holds nothing usable); the message says what to give instead."""


# ------------------------------------------------------------------------------------------------ reading headers
def read_header(path: str | Path) -> dict:
    """What the cases are made of, from one file's header: ``kind`` (``ct``, ``seg``, ``rtstruct``, ``dicomdir``,
    ``other``, ``not_dicom`` or ``damaged``) and, for the kinds that matter, its UIDs, patient, series and study
    details, geometry (CT), referenced series and structure names (annotations). Never raises."""
    path = Path(path)
    try:
        ds = pydicom.dcmread(path, stop_before_pixels=True, specific_tags=list(HEADER_TAGS))
    except InvalidDicomError:  # no preamble: a raw dataset (some exports), or not DICOM at all
        try:
            ds = pydicom.dcmread(path, stop_before_pixels=True, specific_tags=list(HEADER_TAGS), force=True)
            if "SOPClassUID" not in ds or "Modality" not in ds:
                return {"kind": "damaged" if path.suffix.lower() == ".dcm" else "not_dicom"}
        except Exception:  # garbage read as DICOM
            return {"kind": "damaged" if path.suffix.lower() == ".dcm" else "not_dicom"}
    except Exception as err:  # DICOM (a preamble) that cannot be read: cut or damaged
        return {"kind": "damaged", "error": f"{type(err).__name__}: {err}"[:200]}
    try:
        return _summary(ds)
    except Exception as err:  # a header whose values cannot be read as their VR says
        return {"kind": "damaged", "error": f"{type(err).__name__}: {err}"[:200]}


def _summary(ds: pydicom.Dataset) -> dict:
    sop_class = str(ds.get("SOPClassUID", "") or getattr(ds.get("file_meta"), "MediaStorageSOPClassUID", "") or "")
    kind = KINDS.get(sop_class, "other")
    if "DirectoryRecordSequence" in ds:
        kind = "dicomdir"
    record = {"kind": kind, "sop_class": sop_class}
    if kind in ("other", "dicomdir"):
        record["what"] = "DICOMDIR" if kind == "dicomdir" else (UID(sop_class).name if sop_class else "no SOP class")
        if kind == "other":  # to list it with its study as not used (a scanner's dose screen, a key image)
            record.update({k: _text(ds, t) for k, t in OTHER_TAGS.items()})
        return record
    record.update(
        sop=_text(ds, "SOPInstanceUID"),
        series=_text(ds, "SeriesInstanceUID"),
        study=_text(ds, "StudyInstanceUID"),
        patient=_text(ds, "PatientID"),
        frame=_text(ds, "FrameOfReferenceUID"),
        number=_text(ds, "SeriesNumber"),
        description=_text(ds, "SeriesDescription"),
        study_date=_text(ds, "StudyDate"),
    )
    if kind == "ct":
        record.update(
            image_type=_texts(ds.get("ImageType")),
            orientation=_floats(ds.get("ImageOrientationPatient")),
            position=_floats(ds.get("ImagePositionPatient")),
            gantry_tilt=gantry_tilt_of(ds.get("GantryDetectorTilt")),
        )
    elif kind == "seg":
        record.update(
            refs=[_text(item, "SeriesInstanceUID") for item in ds.get("ReferencedSeriesSequence") or []],
            names=[_text(item, "SegmentLabel") for item in ds.get("SegmentSequence") or []],
            date=_date(ds, "Content") or _date(ds, "Series"),
        )
    else:
        frames = ds.get("ReferencedFrameOfReferenceSequence") or []
        record.update(
            refs=[
                _text(series, "SeriesInstanceUID")
                for frame in frames
                for study in frame.get("RTReferencedStudySequence") or []
                for series in study.get("RTReferencedSeriesSequence") or []
            ],
            names=[_text(item, "ROIName") for item in ds.get("StructureSetROISequence") or []],
            date=_date(ds, "StructureSet"),
            frame=record["frame"] or next((_text(f, "FrameOfReferenceUID") for f in frames), ""),
        )
    if kind != "ct":
        record["refs"] = [r for r in dict.fromkeys(record["refs"]) if r and r != record["series"]]
    if not record["series"] or not record["sop"]:  # every image and annotation has both: the header is cut
        return {"kind": "damaged", "error": "no SeriesInstanceUID or SOPInstanceUID"}
    return record


def _text(ds: pydicom.Dataset, keyword: str) -> str:
    """The value as text; several values (a backslash in a single-valued text, as some exports write) rejoined."""
    value = ds.get(keyword)
    if isinstance(value, MultiValue):
        return "\\".join(str(v) for v in value).strip()
    return "" if value is None else str(value).strip()


def _date(ds: pydicom.Dataset, prefix: str) -> str:
    """``<prefix>Date`` and ``<prefix>Time`` as one DICOM date-time text ("" when there is no date)."""
    date = _text(ds, f"{prefix}Date")
    return date + _text(ds, f"{prefix}Time") if date else ""


def _texts(value) -> list[str]:
    if value is None or value == "":
        return []
    return [
        str(v).strip().upper()
        for v in (value if isinstance(value, Sequence) and not isinstance(value, str) else [value])
    ]


def _floats(value) -> list[float]:
    try:
        return [float(v) for v in value] if value is not None else []
    except (TypeError, ValueError):
        return []


# ------------------------------------------------------------------------------------------------ scanning a tree
def scan(
    root: str | Path,
    cache_file: str | Path | None = None,
    exclude: Iterable[str | Path] = (),
    progress: bool = True,
    skip_folder: SkipFolder | None = None,
) -> DicomIndex:
    """Every file under ``root`` (links followed, each real folder once; hidden files and folders and ``exclude``
    skipped) with its header summary (:func:`read_header`); ``cache_file`` keeps them between runs (see the module
    docstring). ``skip_folder(path, file names)`` says why a folder (and all under it) is not read, or None. The
    index's ``folders_skipped`` gives each folder ``skip_folder`` left out (relative to ``root``) with the reason, its
    ``links_again`` each folder reached again through a link with the folder read there. :class:`DiscoveryError`
    when ``root`` does not exist."""
    root = Path(root)
    if not root.exists():
        raise DiscoveryError(f"{root}: no such folder.")
    clock = time.perf_counter()
    folders_skipped: dict[str, str] = {}
    links_again: dict[str, str] = {}
    listed = dict(_walk(root, {os.path.realpath(p) for p in exclude}, skip_folder, folders_skipped, links_again))
    timings = {"list_s": time.perf_counter() - clock}
    clock = time.perf_counter()
    cached = _load_cache(cache_file, root)
    timings["cache_read_s"] = time.perf_counter() - clock
    clock = time.perf_counter()
    fresh: dict[str, dict] = {}
    todo = [rel for rel, key in listed.items() if cached.get(rel, {}).get("stat") != key]
    for rel in tqdm(todo, desc="reading DICOM headers", unit="file", disable=not progress or len(todo) < 200):
        header = {"kind": "not_dicom"} if rel.lower().endswith(NOT_DICOM_SUFFIXES) else read_header(root / rel)
        if os.path.basename(rel).upper() == "DICOMDIR":  # a media directory, read or not: never a slice
            header = {"kind": "dicomdir", "what": "DICOMDIR"}
        elif header["kind"] == "not_dicom" and _has_dicom_marker(root / rel):
            header = {"kind": "damaged"}
        fresh[rel] = {**header, "stat": listed[rel]}
    headers = {rel: fresh.get(rel) or cached[rel] for rel in listed}  # in the listing's (sorted) order
    timings["headers_s"] = time.perf_counter() - clock
    clock = time.perf_counter()
    if cache_file is not None and (todo or len(cached) != len(headers)):
        cache = {"version": INDEX_VERSION, "root": str(root.resolve()), "files": headers}
        write_text(cache_file, json.dumps(cache, separators=(",", ":")))
    timings["cache_write_s"] = time.perf_counter() - clock
    clock = time.perf_counter()
    index = DicomIndex(root, headers)
    index.timings = {**timings, "group_s": time.perf_counter() - clock, "files": len(headers), "read": len(todo)}
    index.folders_skipped, index.links_again = folders_skipped, links_again
    logger.info(
        "%d file(s) under %s: %d header(s) read, %d from the cache",
        len(headers),
        root,
        len(todo),
        len(headers) - len(todo),
    )
    return index


def _walk(
    root: Path, exclude: set[str], skip_folder: SkipFolder | None, skipped: dict[str, str], again: dict[str, str]
) -> Iterable[tuple[str, list[int]]]:
    """(path relative to ``root``, [size, mtime_ns, ctime_ns]) of every visible file, in sorted order; the folders
    ``skip_folder`` leaves out go into ``skipped`` with the reason, those reached again through a link into ``again``
    with the folder read there (see :func:`scan`)."""
    if root.is_file():
        stat = root.stat()
        yield root.name, [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns]
        return
    visited: dict[str, str] = {}  # real path -> the folder first read there
    for folder, dirs, files in os.walk(root, followlinks=True):
        real, rel = os.path.realpath(folder), os.path.relpath(folder, root)
        if real in visited or real in exclude:
            if real in visited:
                again[rel] = visited[real]
            dirs[:] = []
            continue
        why = skip_folder(Path(folder), files) if skip_folder is not None else None
        if why:
            skipped[rel] = why
            dirs[:] = []
            continue
        visited[real] = rel
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if name.startswith("."):
                continue
            path = os.path.join(folder, name)
            try:
                stat = os.stat(path)
            except OSError:  # a broken link, or a file removed while listing
                continue
            yield os.path.relpath(path, root), [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns]


def damaged_slice(path: str | Path, series_uid: str) -> str:
    """Why a CT series with a damaged DICOM file among its slices (``path``) is refused, training's case and
    inference's alike."""
    return (
        f"{path}: a damaged DICOM file among the slices of CT series {series_uid} (it cannot be read, so a slice may "
        "be missing); download the series again"
    )


def _has_dicom_marker(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(132)[128:] == b"DICM"
    except OSError:
        return False


def _load_cache(cache_file: str | Path | None, root: Path) -> dict[str, dict]:
    """The header records of an earlier scan of ``root`` (empty when there is none, it is of another version or
    folder, or it cannot be read)."""
    if cache_file is None:
        return {}
    try:
        cache = json.loads(Path(cache_file).read_text())
    except (OSError, ValueError):
        return {}
    if cache.get("version") != INDEX_VERSION or cache.get("root") != str(root.resolve()):
        return {}
    return cache.get("files", {})


# ------------------------------------------------------------------------------------------------ the index
@dataclass
class SeriesFound:
    """A CT series as its headers describe it; ``files`` are relative to the index's root."""

    uid: str
    files: list[str]
    patient: str
    study: str
    frame: str
    number: str
    description: str
    study_date: str
    notes: list[str] = field(default_factory=list)

    @property
    def folders(self) -> list[str]:
        return sorted({os.path.dirname(f) for f in self.files})


@dataclass
class AnnotationFound:
    """A DICOM SEG or RTSTRUCT, the CT series it annotates (``target``, "" when none is found: ``problem`` says why)."""

    kind: str
    file: str
    sop: str
    series: str
    patient: str
    refs: list[str]
    frame: str
    names: list[str]
    date: str
    target: str = ""
    problem: str = ""
    paired_by: str = "series"


class DicomIndex:
    """The files under ``root`` by what their headers say (:func:`scan`), grouped into CT series and annotations."""

    def __init__(self, root: Path, headers: dict[str, dict]) -> None:
        self.root = Path(root)
        self.headers = headers
        self.series: dict[str, SeriesFound] = {}
        self.annotations: list[AnnotationFound] = []
        self.duplicates: list[tuple[str, str]] = []  # (file, the file holding the same SOPInstanceUID first)
        self.timings: dict[str, float] = {}  # seconds per step of the scan that made it (scan fills it)
        self.folders_skipped: dict[str, str] = {}  # folder (relative to root) -> why it was not read (scan fills it)
        self.links_again: dict[str, str] = {}  # folder reached again through a link -> the folder read (scan fills it)
        self._group()

    # -------------------------------------------------------------------- grouping
    def _group(self) -> None:
        first_of: dict[str, str] = {}
        members: dict[str, list[str]] = defaultdict(list)
        self._strays: dict[str, list[str]] = defaultdict(list)  # folder -> files that belong to no series
        self._series_in: dict[str, set[str]] = defaultdict(set)  # folder -> the CT series with files in it
        for rel, h in self.headers.items():
            if h["kind"] not in ("ct", *ANNOTATIONS):
                self._strays[os.path.dirname(rel)].append(rel)
                continue
            if h["kind"] == "ct":
                self._series_in[os.path.dirname(rel)].add(h["series"])
            if h.get("sop") and h["sop"] in first_of:
                self.duplicates.append((rel, first_of[h["sop"]]))
                continue
            if h.get("sop"):
                first_of[h["sop"]] = rel
            if h["kind"] == "ct":
                members[h["series"]].append(rel)
            else:
                fields = (h["sop"], h["series"], h["patient"], h["refs"], h["frame"], h["names"], h["date"])
                self.annotations.append(AnnotationFound(h["kind"], rel, *fields))
        for uid, files in members.items():
            heads = [self.headers[f] for f in files]
            patients = Counter(h["patient"] for h in heads)
            found = SeriesFound(
                uid,
                files,
                patients.most_common(1)[0][0],
                heads[0]["study"],
                heads[0]["frame"],
                heads[0]["number"],
                heads[0]["description"],
                heads[0]["study_date"],
            )
            if len(patients) > 1:
                found.notes.append(
                    f"its files carry {len(patients)} PatientIDs ({', '.join(sorted(patients))}); "
                    f"{found.patient!r}, the most common, is used"
                )
            self.series[uid] = found
        for duplicate, first in self.duplicates:
            uid = self.headers[first].get("series", "")
            if uid in self.series:
                self.series[uid].notes.append(
                    f"{duplicate} holds the same instance as {first} (SOPInstanceUID "
                    f"{self.headers[first]['sop']}): read once"
                )
        for annotation in self.annotations:
            self._pair(annotation)

    def _pair(self, a: AnnotationFound) -> None:
        """The CT series ``a`` annotates: the one it names, else the only one on its frame of reference."""
        what = f"{a.kind.upper()} {self.root / a.file} (series {a.series or '?'})"
        if a.refs:
            known = [r for r in a.refs if r in self.series]
            if known:
                a.target = known[0]
            else:
                a.problem = (
                    f"{what} annotates CT series {', '.join(a.refs)}, which is not under {self.root}: "
                    "download or export that CT series too"
                )
            return
        on_frame = sorted(uid for uid, s in self.series.items() if a.frame and s.frame == a.frame)
        if len(on_frame) == 1:
            a.target, a.paired_by = on_frame[0], "frame of reference"
        elif not on_frame:
            a.problem = (
                f"{what} names no CT series and no CT series under {self.root} has its FrameOfReferenceUID "
                f"{a.frame or '(none)'}: export the CT series it was drawn on with it"
            )
        else:
            a.problem = (
                f"{what} names no CT series, and {len(on_frame)} CT series share its FrameOfReferenceUID "
                f"{a.frame} ({', '.join(on_frame)}; e.g. the phases of a 4D-CT): which one it was drawn on "
                "cannot be told; export it again from the planning system"
            )

    # -------------------------------------------------------------------- what is not a case
    def skipped(self) -> dict[str, int]:
        """How many files were skipped, by what they are (``not DICOM``, ``DICOMDIR``, ``RT Plan Storage``, ...)."""
        counts = Counter(self._what(h) for h in self.headers.values() if h["kind"] not in ("ct", *ANNOTATIONS))
        if self.duplicates:
            counts["duplicate instance"] = len(self.duplicates)
        return dict(sorted(counts.items()))

    @staticmethod
    def _what(header: dict) -> str:
        return {"not_dicom": "not DICOM", "damaged": "damaged DICOM"}.get(header["kind"]) or header.get("what", "?")

    def _beside(self, series: SeriesFound) -> tuple[list[str], list[str], list[str]]:
        """Files beside the series' slices that belong to no series (named with what they are), the damaged ones among
        them in folders no other CT series shares (one of the series' slices, cut), and the damaged ones in folders
        it shares with other series (perhaps one of its slices)."""
        others, damaged, shared = [], [], []
        for folder in series.folders:
            alone = self._series_in[folder] == {series.uid}
            for rel in self._strays[folder]:
                others.append(f"{os.path.basename(rel)} ({self._what(self.headers[rel])})")
                if self.headers[rel]["kind"] == "damaged":
                    (damaged if alone else shared).append(rel)
        return others, damaged, shared

    # -------------------------------------------------------------------- training cases
    def training_cases(
        self, labels: Sequence[str] = ("GTV-1",), label_source: str = "auto"
    ) -> tuple[list[dict], list[dict]]:
        """Every annotated CT series as a case (see the module docstring), and every patient that gives no case
        with the reason. A case: ``case_id``, ``patient_id``, ``path`` (the CT's folder), ``series_uid``,
        ``slice_paths``, ``annotation`` (kind, file, UIDs, how it was paired), ``other_annotations``, ``notes`` and a
        ``fingerprint`` of its files (size and times: what :func:`scan` keys its cache by)."""
        if label_source not in LABEL_SOURCES:
            raise ValueError(f"label_source={label_source!r}: choose one of {list(LABEL_SOURCES)}.")
        by_target: dict[str, list[AnnotationFound]] = defaultdict(list)
        orphans: dict[str, list[AnnotationFound]] = defaultdict(list)
        for a in self.annotations:
            (by_target[a.target] if a.target else orphans[a.patient]).append(a)
        patients: dict[str, list[SeriesFound]] = defaultdict(list)
        for s in self.series.values():
            patients[s.patient].append(s)
        cases, rejected = [], []
        names: set[str] = set()
        for patient in sorted(set(patients) | set(orphans)):
            series = sorted(patients.get(patient, []), key=lambda s: (_number(s.number), s.uid))
            annotated = [s for s in series if by_target.get(s.uid)]
            lost = [a.problem for a in orphans.get(patient, [])]
            if not annotated:
                rejected.append(self._no_case(patient, series, lost, names))
                continue
            suffixes = _suffixes(annotated)
            for s in annotated:
                case = self._case(s, by_target[s.uid], labels, label_source)
                case["case_id"] = unique_name(safe_name(patient or s.uid) + suffixes[s.uid], names)
                case["notes"] += [
                    f"not annotated, not used: CT series {o.uid} ({len(o.files)} slices in {self.root / o.folders[0]})"
                    for o in series
                    if o not in annotated
                ]
                case["notes"] += [f"not used: {p}" for p in lost]
                (rejected if case.get("reason") else cases).append(case)
        return cases, rejected

    def _case(self, s: SeriesFound, annotations: list[AnnotationFound], labels: Sequence[str], source: str) -> dict:
        case = {
            "case_id": "",
            "patient_id": s.patient,
            "path": str(self.root / s.folders[0]),
            "series_uid": s.uid,
            "study_uid": s.study,
            "slice_paths": [str(self.root / f) for f in sorted(s.files)],
            "notes": list(s.notes),
        }
        if len(s.folders) > 1:
            case["notes"].append(f"its {len(s.files)} slices lie in {len(s.folders)} folders")
        others, damaged, _ = self._beside(s)
        if others:
            case["notes"].append(
                f"skipped {len(others)} file(s) beside its slices that are not CT slices: {', '.join(others[:10])}"
            )
        if damaged:
            case["reason"] = damaged_slice(self.root / damaged[0], s.uid)
        chosen, unused, note = choose_annotation(annotations, labels, source)
        if chosen is None:
            case.setdefault("reason", f"CT series {s.uid} in {case['path']}: {note}")
            return case
        case["annotation"] = {
            "kind": chosen.kind,
            "file": str(self.root / chosen.file),
            "sop_uid": chosen.sop,
            "series_uid": chosen.series,
            "paired_by": chosen.paired_by,
        }
        case["other_annotations"] = [str(self.root / a.file) for a in unused]
        if note:
            case["notes"].append(note)
        if chosen.patient and chosen.patient != s.patient:
            case["notes"].append(f"the {chosen.kind.upper()} has PatientID {chosen.patient!r}, the CT {s.patient!r}")
        case["fingerprint"] = self.fingerprint([*s.files, chosen.file])
        return case

    def _no_case(self, patient: str, series: list[SeriesFound], lost: list[str], names: set[str]) -> dict:
        if lost:
            reason = "; ".join(lost)
        else:
            listed = ", ".join(f"{s.uid} ({len(s.files)} slices in {self.root / s.folders[0]})" for s in series)
            reason = (
                f"no SEG or RTSTRUCT under {self.root} annotates its CT series {listed}: it has no labels to "
                "train on (inference still takes it)"
            )
        path = str(self.root / series[0].folders[0]) if series else str(self.root)
        return {
            "case_id": unique_name(safe_name(patient or "unknown"), names),
            "patient_id": patient,
            "path": path,
            "reason": reason,
        }

    def fingerprint(self, files: Iterable[str]) -> str:
        """What the files are, cheaply: their paths, sizes and times (:func:`scan`'s cache key)."""
        digest = hashlib.blake2b(digest_size=16)
        for rel in sorted(files):
            digest.update(os.fsencode(rel) + b"\0" + json.dumps(self.headers[rel]["stat"]).encode() + b"\0")
        return digest.hexdigest()

    # -------------------------------------------------------------------- inference cases
    def inference_cases(self, rules: SeriesRules | dict | None = None) -> tuple[list[dict], list[dict]]:
        """One case per study, its CT series chosen by ``rules`` (:mod:`scripts.data.dicom.series_rules`), and every
        study with no usable series, with the reason. A case: ``case_id``, ``image`` (the series' folder),
        ``slice_paths``, ``series_uid``, ``study_uid``, ``series`` (what the rules saw) and ``alternatives``."""
        studies: dict[tuple[str, str], list[SeriesFound]] = defaultdict(list)
        for s in self.series.values():
            studies[(s.patient, s.study)].append(s)
        others = self._other_series()
        cases, failed = [], []
        for (patient, study), series in sorted(studies.items()):
            described = [
                describe_series(
                    {
                        "series_uid": s.uid,
                        "modality": "CT",
                        "number": s.number,
                        "description": s.description,
                        "images": len(s.files),
                    },
                    [
                        InstanceHeader(
                            h["sop_class"],
                            tuple(h["image_type"]),
                            tuple(h["orientation"]),
                            tuple(h["position"]),
                            h.get("gantry_tilt"),
                        )
                        for h in (self.headers[f] for f in s.files)
                    ],
                )
                for s in series
            ]
            chosen, alternatives = choose_series(described, rules)
            alternatives += others.get((patient, study), [])
            first = min(series, key=lambda s: s.folders[0])
            record = {
                "case_id": "",
                "patient_id": patient,
                "study_uid": study,
                "study_date": first.study_date,
                "alternatives": alternatives,
            }
            if chosen is None:
                listed = "; ".join(f"series {a['number']} {a['description']!r}: {a['reason']}" for a in alternatives)
                where = self.root / first.folders[0]
                record.update(
                    image=str(where), reason=f"study {study} of {patient!r} in {where}: no usable CT series ({listed})"
                )
                failed.append(record)
                continue
            record.update(self._on_series(chosen))
            cases.append(record)
        self._name_studies(cases + failed)
        return cases, failed

    def _on_series(self, info: dict) -> dict:
        """What an inference case says of its CT series (``info``: the series as the rules saw it): the series'
        folder, its slices, its notes, and the damaged DICOM files beside its slices (``damaged``: in folders only it
        has, so one of its slices; ``damaged_nearby``: in folders it shares with other series)."""
        s = self.series[info["series_uid"]]
        _, damaged, shared = self._beside(s)
        fields = {
            "image": str(self.root / os.path.commonpath(s.folders)),
            "series_uid": s.uid,
            "series": info,
            "slice_paths": [str(self.root / f) for f in sorted(s.files)],
            "notes": list(s.notes) + ([info["note"]] if "note" in info else []),
        }
        for key, files in (("damaged", damaged), ("damaged_nearby", shared)):
            if files:
                fields[key] = [str(self.root / f) for f in files]
        return fields

    def fallbacks(self, case: dict) -> list[dict]:
        """``case`` (of :meth:`inference_cases`) on each other usable CT series of its study, in the order the rules
        prefer them: what inference tries when the chosen series fails its check (a missing or damaged slice shows
        only then). The records keep the case's identity and alternatives; the caller says why each was used."""
        usable = (a for a in case.get("alternatives", ()) if a.get("choice") and a["series_uid"] in self.series)
        return [
            {**case, **self._on_series({k: v for k, v in a.items() if k != "reason"})}
            for a in sorted(usable, key=lambda a: a["choice"])
        ]

    def _other_series(self) -> dict[tuple[str, str], list[dict]]:
        """Per (patient, study): the series of objects that are not CT images (a scanner's secondary captures, a
        dose report), each with why it is not the case's CT -- for the report's list of what was not used."""
        fields = ("patient", "study", "series", "number", "description", "modality", "what")
        others = (h for h in self.headers.values() if h["kind"] == "other" and h.get("study"))
        counts = Counter(tuple(h.get(f, "") for f in fields) for h in others)
        listed: dict[tuple[str, str], list[dict]] = defaultdict(list)
        for (patient, study, uid, number, description, modality, what), count in sorted(counts.items()):
            listed[(patient, study)].append(
                {"series_uid": uid, "modality": modality, "number": number, "description": description,
                 "images": 0, "objects": count, "reason": f"{count} {what} object(s), not CT images"}
            )  # fmt: skip
        return listed

    def _name_studies(self, records: list[dict]) -> None:
        """Case ids: the PatientID (its folder's path when the header has none), ``_<StudyDate>`` when the patient
        has several studies, ``_2``, ``_3`` ... when still repeated."""
        per_patient = Counter(r["patient_id"] for r in records)
        names: set[str] = set()
        for r in sorted(records, key=lambda r: (r["patient_id"], r["study_date"], r["study_uid"])):
            base = r["patient_id"] or "_".join(Path(r["image"]).relative_to(self.root).parts) or self.root.name
            if per_patient[r["patient_id"]] > 1 and r["study_date"]:
                base = f"{base}_{r['study_date']}"
            r["case_id"] = unique_name(safe_name(base), names)


def choose_annotation(
    annotations: Sequence[AnnotationFound], labels: Sequence[str], source: str
) -> tuple[AnnotationFound | None, list[AnnotationFound], str]:
    """The annotation a case's labels come from (the rule of the module docstring), the others, and a note when the
    choice was not the plain one (several of one kind, or a SEG passed over for lack of a label) -- or, when none
    can be used, the reason naming what the series has."""
    allowed = [a for a in annotations if source == "auto" or a.kind == source]
    if not allowed:
        held = ", ".join(f"{a.kind.upper()} {a.file}" for a in annotations)
        other = "rtstruct" if source == "seg" else "seg"
        return None, list(annotations), f"no {source.upper()} annotates it (it has {held}); set label_source to {other}"

    def holds_labels(a: AnnotationFound) -> bool:
        return all(matching(label, a.names) for label in labels)

    ranked = sorted(allowed, key=lambda a: (not holds_labels(a), a.kind != "seg", _negated(a.date), a.sop))
    chosen = ranked[0]
    others = [a for a in annotations if a is not chosen]
    same_kind = [a for a in allowed if a.kind == chosen.kind]
    if len(same_kind) == 1 and (chosen.kind == "seg" or not any(a.kind == "seg" for a in allowed)):
        return chosen, others, ""
    passed = ", ".join(f"{a.kind.upper()} {a.file}" for a in others if a in allowed)
    rule = "one holding every label, a SEG before an RTSTRUCT, the newest, the lowest SOPInstanceUID"
    note = f"{chosen.kind.upper()} {chosen.file} is used, not {passed} (the rule: {rule})"
    return chosen, others, note


def _negated(date: str) -> tuple[int, ...]:
    """A sort key that puts the newest DICOM date-time first (an absent date last)."""
    digits = re.sub(r"[^0-9]", "", date)[:20].ljust(20, "0")
    return tuple(-int(c) for c in digits) if date else (1,)


def _number(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        return float("inf")


def _suffixes(series: list[SeriesFound]) -> dict[str, str]:
    """ "" for a patient's only annotated series; else ``_<SeriesNumber>`` (``_1``, ``_2``... in series order when the
    numbers are missing or repeated)."""
    if len(series) == 1:
        return {series[0].uid: ""}
    numbers = [s.number for s in series]
    if all(numbers) and len(set(numbers)) == len(numbers):
        return {s.uid: f"_{safe_name(s.number)}" for s in series}
    return {s.uid: f"_{i}" for i, s in enumerate(series, start=1)}

"""A fake NBIA REST API on 127.0.0.1 for the downloader's tests: tiny DICOM cases served as zips, with the
faults a real server shows (503s, cut zips, bad MD5s, unsafe entries, a missing MD5 endpoint) injected on request."""

from __future__ import annotations

import hashlib
import io
import json
import threading
import zipfile
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pydicom
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.sequence import Sequence
from pydicom.uid import ExplicitVRLittleEndian, generate_uid

COLLECTION = "NSCLC-Radiomics"


CT_STORAGE = "1.2.840.10008.5.1.4.1.1.2"


SEG_STORAGE = "1.2.840.10008.5.1.4.1.1.66.4"


MD5_ENDPOINT = "getImageWithMD5Hash"


ZIP_ENDPOINTS = (MD5_ENDPOINT, "getImage")


FAST = {"backoff": 0.01, "timeout": 10.0, "progress": False}


def dicom_bytes(ds: Dataset, sop_class: str) -> bytes:
    ds.SOPClassUID = sop_class
    ds.file_meta = FileMetaDataset()
    ds.file_meta.MediaStorageSOPClassUID = sop_class
    ds.file_meta.MediaStorageSOPInstanceUID = ds.SOPInstanceUID
    ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
    buf = io.BytesIO()
    pydicom.dcmwrite(buf, ds, enforce_file_format=True)
    return buf.getvalue()


@dataclass
class FakeCase:
    patient_id: str
    seg_number: int
    study_uid: str
    ct_uid: str
    seg_uid: str
    ct_sops: list[str]
    ct_files: list[bytes] = field(default_factory=list)
    seg_files: list[bytes] = field(default_factory=list)


def make_case(patient_id: str, seg_number: int = 300, sop_only: bool = False, ct: FakeCase | None = None) -> FakeCase:
    """Three 4x4 CT slices and a SEG referencing them (by series, or only by SOP instance when ``sop_only``).

    With ``ct``, the SEG references that case's CT (a second SEG of the same patient)."""
    uid = lambda *parts: generate_uid(entropy_srcs=[patient_id, str(seg_number), *parts])  # noqa: E731
    if ct is None:
        case = FakeCase(
            patient_id, seg_number, uid("study"), uid("ct"), uid("seg"), [uid("ct", str(i)) for i in range(3)]
        )
        for i, sop in enumerate(case.ct_sops):
            ds = Dataset()
            ds.PatientID, ds.StudyInstanceUID, ds.SeriesInstanceUID = patient_id, case.study_uid, case.ct_uid
            ds.SOPInstanceUID, ds.Modality, ds.SeriesNumber, ds.InstanceNumber = sop, "CT", 2, i + 1
            ds.ImagePositionPatient = [0.0, 0.0, 3.0 * i]
            ds.ImageOrientationPatient = [1.0, 0.0, 0.0, 0.0, 1.0, 0.0]
            ds.PixelSpacing = [1.0, 1.0]
            ds.Rows = ds.Columns = 4
            ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME2"
            ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 16, 15, 1
            ds.PixelData = bytes(range(i, i + 32))
            case.ct_files.append(dicom_bytes(ds, CT_STORAGE))
    else:
        case = FakeCase(patient_id, seg_number, ct.study_uid, ct.ct_uid, uid("seg"), ct.ct_sops, ct.ct_files)
    seg = Dataset()
    seg.PatientID, seg.StudyInstanceUID, seg.SeriesInstanceUID = patient_id, case.study_uid, case.seg_uid
    seg.SOPInstanceUID, seg.Modality, seg.SeriesNumber = uid("seg", "sop"), "SEG", seg_number
    if sop_only:  # the reference hides in the per-frame functional groups, as in many real SEGs
        source = Dataset()
        source.ReferencedSOPClassUID, source.ReferencedSOPInstanceUID = CT_STORAGE, case.ct_sops[1]
        derivation = Dataset()
        derivation.SourceImageSequence = Sequence([source])
        frame = Dataset()
        frame.DerivationImageSequence = Sequence([derivation])
        seg.PerFrameFunctionalGroupsSequence = Sequence([frame])
    else:
        ref = Dataset()
        ref.SeriesInstanceUID = case.ct_uid
        ref.ReferencedInstanceSequence = Sequence([Dataset() for _ in case.ct_sops])
        for item, sop in zip(ref.ReferencedInstanceSequence, case.ct_sops, strict=True):
            item.ReferencedSOPClassUID, item.ReferencedSOPInstanceUID = CT_STORAGE, sop
        seg.ReferencedSeriesSequence = Sequence([ref])
    case.seg_files.append(dicom_bytes(seg, SEG_STORAGE))
    return case


def zip_name(i: int) -> str:
    return f"{i + 1:08d}.dcm"  # what NBIA names zip entries


class FakeNbia:
    """getSeries / getImage / getImageWithMD5Hash / getSOPInstanceUIDs over in-memory zips, with injected faults.

    Faults are keyed by series UID: ``fail_503`` (first n zip requests answer 503), ``truncate_once`` (the first zip
    response is cut in half under a full Content-Length), ``bad_md5`` (the manifest's MD5 for 00000002.dcm is wrong,
    always), ``evil`` (the zip holds ``../evil.dcm``), ``no_md5`` (MD5 endpoint answers 404), ``forbidden`` (403).
    """

    def __init__(self, cases: list[FakeCase]) -> None:
        self.series: dict[str, dict] = {}
        for c in cases:
            self.series.setdefault(c.ct_uid, {"files": c.ct_files, "Modality": "CT", "case": c, "SeriesNumber": 2})
            self.series[c.seg_uid] = {"files": c.seg_files, "Modality": "SEG", "case": c, "SeriesNumber": c.seg_number}
        self.fail_503: dict[str, int] = {}
        self.listing_503 = 0
        self.truncate_once: set[str] = set()
        self.bad_md5: set[str] = set()
        self.evil: set[str] = set()
        self.no_md5: set[str] = set()
        self.forbidden: set[str] = set()
        self.cut_unannounced: set[str] = set()  # first zip response: no Content-Length, half the body (NBIA streams)
        self.no_range: set[str] = set()  # ignore Range headers (answer 200 with the whole zip)
        self.requests: Counter = Counter()  # (endpoint, key) -> count
        self.ranges: list[tuple[str, int]] = []
        self._lock = threading.Lock()
        self._zips: dict[tuple[str, str], bytes] = {}

    # -- bookkeeping -----------------------------------------------------------------------------------------------
    def count(self, endpoint: str, key: str) -> int:
        with self._lock:
            self.requests[endpoint, key] += 1
            return self.requests[endpoint, key]

    def zip_requests(self, uid: str) -> int:
        return sum(self.requests[e, uid] for e in ZIP_ENDPOINTS)

    def reset_counts(self) -> None:
        with self._lock:
            self.requests.clear()
            self.ranges.clear()

    def entry(self, uid: str) -> dict:
        s, c = self.series[uid], self.series[uid]["case"]
        return {
            "SeriesInstanceUID": uid,
            "StudyInstanceUID": c.study_uid,
            "Modality": s["Modality"],
            "SeriesNumber": s["SeriesNumber"],
            "PatientID": c.patient_id,
            "Collection": COLLECTION,
            "ImageCount": len(s["files"]),
        }

    def zip_bytes(self, uid: str, endpoint: str) -> bytes:
        key = (uid, endpoint)
        if key not in self._zips:  # built once: identical bytes on every request, so Range resumes are valid
            buf = io.BytesIO()
            with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
                stamp = (2024, 1, 1, 0, 0, 0)
                if endpoint == "getImage":
                    zf.writestr(zipfile.ZipInfo("LICENSE", stamp), "CC BY 3.0")
                rows = ["Filename,MD5Hash"]
                for i, data in enumerate(self.series[uid]["files"]):
                    zf.writestr(zipfile.ZipInfo(zip_name(i), stamp), data)
                    digest = hashlib.md5(b"tampered" if uid in self.bad_md5 and i == 1 else data).hexdigest()
                    rows.append(f"{zip_name(i)},{digest}")
                if uid in self.evil:
                    zf.writestr(zipfile.ZipInfo("../evil.dcm", stamp), b"escaped")
                if endpoint == MD5_ENDPOINT:
                    zf.writestr(zipfile.ZipInfo("md5hashes.csv", stamp), "\n".join(rows) + "\n")
            self._zips[key] = buf.getvalue()
        return self._zips[key]

    # -- HTTP ------------------------------------------------------------------------------------------------------
    def handle(self, req: BaseHTTPRequestHandler) -> None:
        parsed = urlparse(req.path)
        endpoint = parsed.path.rsplit("/", 1)[-1]
        q = {k: v[0] for k, v in parse_qs(parsed.query).items()}
        uid = q.get("SeriesInstanceUID", "")
        n = self.count(endpoint, uid or q.get("StudyInstanceUID") or q.get("Collection", ""))
        if endpoint == "getSeries":
            if "Collection" in q and n <= self.listing_503:
                return self.send(req, 503, b"busy")
            if "Collection" in q:
                found = [self.entry(u) for u, s in self.series.items() if s["Modality"] == q.get("Modality")]
                found.sort(key=lambda d: (d["PatientID"], d["SeriesInstanceUID"]), reverse=True)  # not our order
            else:
                found = [self.entry(u) for u, s in self.series.items() if s["case"].study_uid == q["StudyInstanceUID"]]
            return self.send(req, 200, json.dumps(found).encode())
        if endpoint == "getSOPInstanceUIDs":
            files = self.series.get(uid, {}).get("files", [])
            sops = [pydicom.dcmread(io.BytesIO(f)).SOPInstanceUID for f in files]
            return self.send(req, 200, json.dumps([{"SOPInstanceUID": s} for s in sops]).encode())
        if endpoint not in ZIP_ENDPOINTS or uid not in self.series:
            return self.send(req, 404, b"not found")
        if uid in self.forbidden:
            return self.send(req, 403, b"Image with given SeriesInstanceUID is not in public domain.")
        if endpoint == MD5_ENDPOINT and uid in self.no_md5:
            return self.send(req, 404, b"not found")
        if self.zip_requests(uid) <= self.fail_503.get(uid, 0):
            return self.send(req, 503, b"Service Unavailable")
        body = self.zip_bytes(uid, endpoint)
        if uid in self.truncate_once and self.zip_requests(uid) == 1:
            req.send_response(200)
            req.send_header("Content-Length", str(len(body)))
            req.end_headers()
            req.wfile.write(body[: len(body) // 2])
            req.close_connection = True
            return None
        if uid in self.cut_unannounced and self.zip_requests(uid) == 1:
            req.send_response(200)
            req.end_headers()
            req.wfile.write(body[: len(body) // 2])
            req.close_connection = True
            return None
        rng = req.headers.get("Range", "") if uid not in self.no_range else ""
        if rng.startswith("bytes=") and rng.endswith("-"):
            start = int(rng[6:-1])
            self.ranges.append((uid, start))
            if start >= len(body):
                return self.send(req, 416, b"")
            return self.send(req, 206, body[start:], {"Content-Range": f"bytes {start}-{len(body) - 1}/{len(body)}"})
        return self.send(req, 200, body)

    def head(self, req: BaseHTTPRequestHandler) -> None:
        """HEAD of a zip endpoint: the file name, as NBIA announces it (monai's downloader asks for it first)."""
        parsed = urlparse(req.path)
        uid = parse_qs(parsed.query).get("SeriesInstanceUID", [""])[0]
        if parsed.path.rsplit("/", 1)[-1] not in ZIP_ENDPOINTS or uid not in self.series:
            return self.send(req, 404, b"")
        req.send_response(200)
        req.send_header("Content-Type", "application/zip")
        req.send_header("Content-Disposition", f"attachment; filename={uid}.zip")
        req.end_headers()
        return None

    @staticmethod
    def send(req: BaseHTTPRequestHandler, code: int, body: bytes, headers: dict | None = None) -> None:
        req.send_response(code)
        req.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            req.send_header(k, v)
        req.end_headers()
        req.wfile.write(body)

    def __enter__(self) -> FakeNbia:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802, RUF100 (http.server's name; flake8's pep8-naming flags it)
                fake.handle(self)

            def do_HEAD(self) -> None:  # noqa: N802, RUF100 (http.server's name; flake8's pep8-naming flags it)
                fake.head(self)

            def log_message(self, *args) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/"
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def case_dir(root: Path, case: FakeCase) -> Path:
    return root / COLLECTION / case.patient_id / str(case.seg_number)


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def expected_files(files: list[bytes]) -> dict[str, bytes]:
    return {zip_name(i): data for i, data in enumerate(files)}


def by_patient(results) -> dict:
    return {r.patient_id: r for r in results}


def served_case(case_root: Path) -> FakeCase:
    """A FakeCase that serves the files of a case written by scripts.data.synthetic."""
    ct_files = sorted((case_root / "image").glob("*.dcm"))
    seg_files = sorted((case_root / "seg").glob("*.dcm"))
    ct0, seg = pydicom.dcmread(ct_files[0], stop_before_pixels=True), pydicom.dcmread(seg_files[0])
    sops = [pydicom.dcmread(f, stop_before_pixels=True).SOPInstanceUID for f in ct_files]
    case = FakeCase(
        str(seg.PatientID), int(seg.SeriesNumber), ct0.StudyInstanceUID, ct0.SeriesInstanceUID,
        seg.SeriesInstanceUID, sops, [f.read_bytes() for f in ct_files], [f.read_bytes() for f in seg_files],
    )  # fmt: skip
    return case

"""TCIA download against a fake NBIA server: layout, byte-identical files, and every injected fault reported."""

from __future__ import annotations

import hashlib
import io
import json
import os
import socket
import subprocess
import sys
import threading
import zipfile
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import nibabel as nib
import numpy as np
import pydicom
import pytest
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.sequence import Sequence
from pydicom.uid import ExplicitVRLittleEndian, generate_uid

from scripts.tcia import (
    MARKER,
    STAGING,
    TciaError,
    UnsafeArchiveError,
    case_key,
    download,
    extract_series_zip,
    parse_md5_manifest,
    resolve_base_url,
)

COLLECTION = "NSCLC-Radiomics"
ROOT = Path(__file__).resolve().parents[1]
CT_STORAGE = "1.2.840.10008.5.1.4.1.1.2"
SEG_STORAGE = "1.2.840.10008.5.1.4.1.1.66.4"
MD5_ENDPOINT = "getImageWithMD5Hash"
ZIP_ENDPOINTS = (MD5_ENDPOINT, "getImage")
FAST = {"backoff": 0.01, "timeout": 10.0, "progress": False}


# ---------------------------------------------------------------------------------------------------------------------
# tiny DICOM cases


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


# ---------------------------------------------------------------------------------------------------------------------
# fake NBIA server


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
            def do_GET(self) -> None:
                fake.handle(self)

            def do_HEAD(self) -> None:
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


# ---------------------------------------------------------------------------------------------------------------------
# helpers


def case_dir(root: Path, case: FakeCase) -> Path:
    return root / COLLECTION / case.patient_id / str(case.seg_number)


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def expected_files(files: list[bytes]) -> dict[str, bytes]:
    return {zip_name(i): data for i, data in enumerate(files)}


def by_patient(results) -> dict:
    return {r.patient_id: r for r in results}


# ---------------------------------------------------------------------------------------------------------------------
# one run against every fault, then a second run


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    """Seven cases: good (503s), cut CT zip, persistent bad MD5, zip-slip entry, SOP-only reference, no MD5 endpoint,
    403 on the SEG. Yields (server, dataset_dir, cases by patient, summary, request counts of the first run)."""
    cases = {
        "LUNG1-001": make_case("LUNG1-001"),
        "LUNG1-002": make_case("LUNG1-002"),
        "LUNG1-003": make_case("LUNG1-003"),
        "LUNG1-004": make_case("LUNG1-004"),
        "LUNG1-005": make_case("LUNG1-005", sop_only=True),
        "LUNG1-006": make_case("LUNG1-006"),
        "LUNG1-007": make_case("LUNG1-007"),
    }
    root = tmp_path_factory.mktemp("faulty")
    dataset_dir = root / "dataset"
    with FakeNbia(list(cases.values())) as server:
        server.listing_503 = 1
        server.fail_503[cases["LUNG1-001"].seg_uid] = 2
        server.truncate_once.add(cases["LUNG1-002"].ct_uid)
        server.bad_md5.add(cases["LUNG1-003"].ct_uid)
        server.evil.add(cases["LUNG1-004"].ct_uid)
        server.no_md5.update({cases["LUNG1-006"].seg_uid, cases["LUNG1-006"].ct_uid})
        server.forbidden.add(cases["LUNG1-007"].seg_uid)
        summary = download(dataset_dir, base_url=server.url, num_workers=3, retries=2, **FAST)
        yield server, dataset_dir, cases, summary, Counter(server.requests), list(server.ranges)


def test_good_series_complete_with_tcia_layout_and_identical_bytes(faulty):
    _, dataset_dir, cases, summary, _, _ = faulty
    assert sorted(r.patient_id for r in summary.downloaded) == ["LUNG1-001", "LUNG1-002", "LUNG1-005", "LUNG1-006"]
    for pid in ("LUNG1-001", "LUNG1-002", "LUNG1-005", "LUNG1-006"):
        case = cases[pid]
        folder = case_dir(dataset_dir, case)
        assert sorted(p.name for p in folder.iterdir()) == [MARKER, "image", "seg"]
        assert folder_bytes(folder / "seg") == expected_files(case.seg_files)
        assert folder_bytes(folder / "image") == expected_files(case.ct_files)  # no LICENSE, no md5hashes.csv
        marker = json.loads((folder / MARKER).read_text())
        assert (marker["seg_series_uid"], marker["image_series_uid"]) == (case.seg_uid, case.ct_uid)
        assert (marker["seg_files"], marker["image_files"]) == (1, 3)
    assert by_patient(summary.downloaded)["LUNG1-001"].md5_verified is True


def test_503s_and_a_cut_zip_are_retried_and_the_cut_zip_resumed_with_range(faulty):
    _, _, cases, _, counts, ranges = faulty
    assert counts[MD5_ENDPOINT, cases["LUNG1-001"].seg_uid] == 3  # two 503s, then the zip
    assert counts["getSeries", COLLECTION] == 2  # the listing's 503 was retried too
    ct = cases["LUNG1-002"].ct_uid
    assert counts[MD5_ENDPOINT, ct] == 2
    assert len([r for r in ranges if r[0] == ct and r[1] > 0]) == 1


def test_sop_only_reference_is_resolved_through_the_study_lookup(faulty):
    _, _, cases, summary, counts, _ = faulty
    case = cases["LUNG1-005"]
    assert counts["getSeries", case.study_uid] == 1
    assert counts["getSOPInstanceUIDs", case.ct_uid] == 1
    assert by_patient(summary.downloaded)["LUNG1-005"].image_series_uid == case.ct_uid


def test_missing_md5_endpoint_falls_back_to_getimage_and_says_so(faulty):
    _, _, cases, summary, counts, _ = faulty
    case = cases["LUNG1-006"]
    assert counts["getImage", case.ct_uid] == 1
    assert by_patient(summary.downloaded)["LUNG1-006"].md5_verified is False
    assert "NO MD5 CHECK  LUNG1-006" in summary.format()


def test_bad_series_are_reported_with_reasons_and_leave_nothing_behind(faulty):
    _, dataset_dir, cases, summary, counts, _ = faulty
    failed = by_patient(summary.failed)
    assert sorted(failed) == ["LUNG1-003", "LUNG1-004", "LUNG1-007"]
    bad_md5 = failed["LUNG1-003"].reason
    assert "MD5 mismatch for 00000002.dcm" in bad_md5 and cases["LUNG1-003"].ct_uid in bad_md5
    assert counts[MD5_ENDPOINT, cases["LUNG1-003"].ct_uid] == 3  # re-fetched, then given up
    assert "'../evil.dcm'" in failed["LUNG1-004"].reason
    assert counts[MD5_ENDPOINT, cases["LUNG1-004"].ct_uid] == 1  # unsafe archives are not retried
    assert "403" in failed["LUNG1-007"].reason and cases["LUNG1-007"].seg_uid in failed["LUNG1-007"].reason
    assert counts[MD5_ENDPOINT, cases["LUNG1-007"].seg_uid] == 1
    for pid in failed:
        assert not (dataset_dir / COLLECTION / pid).exists()
    assert not list(dataset_dir.parent.rglob("evil.dcm"))
    assert not list(dataset_dir.parent.rglob("*.tmp-*"))
    leftovers = [p for p in dataset_dir.rglob("*") if p.is_file() and p.suffix not in (".dcm", ".json")]
    assert leftovers == []
    assert "Re-run the same command" in summary.format()


def test_second_run_makes_no_zip_request_for_completed_or_adopted_cases(faulty):
    server, dataset_dir, cases, first, _, _ = faulty
    # a case without marker, as monai.apps.TciaDataset leaves it, and a temp folder of a killed run
    (case_dir(dataset_dir, cases["LUNG1-001"]) / MARKER).unlink()
    stale = dataset_dir / STAGING / "1.2.3.tmp-999999999"
    (stale / "seg").mkdir(parents=True)
    server.reset_counts()
    server.listing_503 = 0
    summary = download(dataset_dir, base_url=server.url, num_workers=2, retries=0, **FAST)
    completed = [cases[r.patient_id] for r in first.downloaded]
    assert sorted(r.patient_id for r in summary.skipped) == sorted(c.patient_id for c in completed)
    for case in completed:
        assert server.zip_requests(case.seg_uid) == 0 and server.zip_requests(case.ct_uid) == 0
    assert server.requests["getSeries", COLLECTION] == 1
    adopted = json.loads((case_dir(dataset_dir, cases["LUNG1-001"]) / MARKER).read_text())
    assert adopted["adopted"] is True and adopted["image_series_uid"] == cases["LUNG1-001"].ct_uid
    assert sorted(r.patient_id for r in summary.failed) == ["LUNG1-003", "LUNG1-004", "LUNG1-007"]
    assert not stale.exists()


def test_a_damaged_case_is_downloaded_again_and_replaced(faulty):
    server, dataset_dir, cases, _, _, _ = faulty
    case = cases["LUNG1-002"]
    folder = case_dir(dataset_dir, case)
    (folder / "image" / zip_name(0)).unlink()
    server.reset_counts()
    server.truncate_once.clear()
    summary = download(dataset_dir, base_url=server.url, retries=0, **FAST)
    assert "LUNG1-002" in by_patient(summary.downloaded)
    assert server.zip_requests(case.seg_uid) == 1 and server.zip_requests(case.ct_uid) == 1
    assert folder_bytes(folder / "image") == expected_files(case.ct_files)
    assert not list(folder.parent.glob(".*"))  # the replaced copy's backup is gone


def test_cut_streams_without_content_length_or_range_support_are_fetched_again(tmp_path):
    streamed, no_range = make_case("LUNG1-030"), make_case("LUNG1-031")
    with FakeNbia([streamed, no_range]) as server:
        server.cut_unannounced.add(streamed.ct_uid)  # only the zip's own structure shows the cut
        server.truncate_once.add(no_range.ct_uid)
        server.no_range.add(no_range.ct_uid)  # the resume attempt gets the whole zip: start over
        summary = download(tmp_path, base_url=server.url, retries=1, **FAST)
        assert server.zip_requests(streamed.ct_uid) == 2 and server.zip_requests(no_range.ct_uid) == 2
    assert len(summary.downloaded) == 2
    for case in (streamed, no_range):
        assert folder_bytes(case_dir(tmp_path, case) / "image") == expected_files(case.ct_files)


# ---------------------------------------------------------------------------------------------------------------------
# --limit, the CLI, an unreachable server


def test_limit_picks_by_patient_then_series_uid_whatever_the_listing_order(tmp_path):
    first = make_case("LUNG1-009", seg_number=1)
    second = make_case("LUNG1-009", seg_number=2, ct=first)  # a second SEG of the same CT
    later = make_case("LUNG1-010")
    with FakeNbia([later, second, first]) as server:
        summary = download(tmp_path, limit=2, base_url=server.url, num_workers=3, retries=0, **FAST)
        assert server.zip_requests(later.seg_uid) == 0
    picked = sorted([first, second], key=lambda c: c.seg_uid)
    assert [r.seg_series_uid for r in summary.downloaded] == [c.seg_uid for c in picked]
    for case in picked:
        assert folder_bytes(case_dir(tmp_path, case) / "image") == expected_files(first.ct_files)


def test_cli_exits_nonzero_and_names_the_failed_series(tmp_path, root):
    good, bad = make_case("LUNG1-020"), make_case("LUNG1-021")
    with FakeNbia([good, bad]) as server:
        server.bad_md5.add(bad.ct_uid)
        cmd = [
            sys.executable,
            "-m",
            "scripts.tcia",
            "download",
            "--dataset_dir",
            str(tmp_path),
            "--base_url",
            server.url,
            "--retries",
            "1",
            "--backoff",
            "0.01",
            "--num_workers",
            "2",
        ]
        env = {k: v for k, v in os.environ.items() if k != "TCIA_BASE_URL"}
        proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 1, proc.stderr
    assert "1 downloaded" in proc.stdout and "1 failed" in proc.stdout
    assert f"FAILED  LUNG1-021  SEG {bad.seg_uid}" in proc.stdout and "00000002.dcm" in proc.stdout
    assert (case_dir(tmp_path, good) / "image").is_dir()


def test_unreachable_server_fails_the_listing_after_retries(tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(TciaError, match="gave up after 2 attempt"):
        download(tmp_path, base_url=f"http://127.0.0.1:{port}/", retries=1, **FAST)
    assert not (tmp_path / COLLECTION).exists()


# ---------------------------------------------------------------------------------------------------------------------
# pure helpers


def test_md5_manifest_parsing_tolerates_header_and_column_variants():
    a, b = "0" * 32, "ABCDEF0123456789abcdef0123456789"
    assert parse_md5_manifest(f"Filename,MD5Hash\n00000001.dcm,{a}\nsub/00000002.dcm,{b}\n") == {
        "00000001.dcm": a,
        "00000002.dcm": b.lower(),
    }
    assert parse_md5_manifest(f"\ufeffMD5Hash,Filename,Size\r\n{a},x.dcm,12\r\n\r\n") == {"x.dcm": a}
    assert parse_md5_manifest(f"{a}  y.dcm\n{b} *z.dcm\n") == {"y.dcm": a, "z.dcm": b.lower()}
    assert parse_md5_manifest("Filename,MD5Hash\n") == {}


@pytest.mark.parametrize("entry", ["../evil.dcm", "a/../../evil.dcm", "/tmp/evil.dcm", "C:/evil.dcm", "..\\evil.dcm"])
def test_unsafe_zip_entries_are_refused_before_anything_is_written(tmp_path, entry):
    archive = tmp_path / "series.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("00000001.dcm", b"fine")
        zf.writestr(entry, b"escaped")
    out = tmp_path / "out" / "image"
    with pytest.raises(UnsafeArchiveError, match="unsafe zip entry"):
        extract_series_zip(archive, out)
    assert not out.exists() and not list(tmp_path.rglob("evil.dcm"))


def test_case_key_uses_tciadataset_fallbacks_and_refuses_path_like_ids():
    ds = Dataset()
    ds.PatientID, ds.SeriesNumber = "LUNG1-001", 300
    assert case_key(ds) == ("LUNG1-001", "300")
    del ds.SeriesNumber
    ds.AcquisitionNumber = 7
    assert case_key(ds) == ("LUNG1-001", "7")
    del ds.AcquisitionNumber
    assert case_key(ds) == ("LUNG1-001", "0")
    ds.PatientID = "../../etc"
    with pytest.raises(TciaError, match="not a safe folder name"):
        case_key(ds)


def test_base_url_comes_from_argument_then_environment(monkeypatch):
    monkeypatch.setenv("TCIA_BASE_URL", "https://example.org/nbia-api/services/v4")
    assert resolve_base_url() == "https://example.org/nbia-api/services/v4/"
    assert resolve_base_url("http://127.0.0.1:9/") == "http://127.0.0.1:9/"
    monkeypatch.delenv("TCIA_BASE_URL")
    assert resolve_base_url().startswith("https://services.cancerimagingarchive.net/nbia-api/services/")


# ---------------------------------------------------------------------------------------------------------------------
# interoperability with monai.apps.TciaDataset, both ways, on real (synthetic) CT + SEG series


def served_case(case_root: Path) -> FakeCase:
    """A FakeCase that serves the files of a case written by scripts.synthetic."""
    ct_files = sorted((case_root / "image").glob("*.dcm"))
    seg_files = sorted((case_root / "seg").glob("*.dcm"))
    ct0, seg = pydicom.dcmread(ct_files[0], stop_before_pixels=True), pydicom.dcmread(seg_files[0])
    sops = [pydicom.dcmread(f, stop_before_pixels=True).SOPInstanceUID for f in ct_files]
    case = FakeCase(
        str(seg.PatientID), int(seg.SeriesNumber), ct0.StudyInstanceUID, ct0.SeriesInstanceUID,
        seg.SeriesInstanceUID, sops, [f.read_bytes() for f in ct_files], [f.read_bytes() for f in seg_files],
    )  # fmt: skip
    return case


@pytest.fixture(scope="module")
def synthetic_source(tmp_path_factory):
    from scripts.synthetic import write_case

    root = tmp_path_factory.mktemp("source")
    # two segments, every frame stored: MONAI's PydicomReader needs per-frame segment ids and no omitted frames
    # (our reader does not; the real NSCLC SEGs have both)
    truths = [
        write_case(root, f"LUNG1-00{i}", seed=i, shape=(48, 48, 12), segments=["GTV-1", "Lung-Left"], sparse_seg=False)
        for i in (1, 2)
    ]
    return root, [served_case(Path(t["image_dir"]).parent) for t in truths], truths


def prepared_labels(dataset_dir: Path, out: Path) -> dict:
    from scripts.prepare import prepare

    report = prepare(dataset_dir, out, num_workers=1, progress=False)
    assert report["num_rejected"] == 0, report["rejected"]
    return {r["case_id"]: nib.load(out / r["label"]).get_fdata() for r in report["cases"]}


def test_a_folder_downloaded_by_monai_tciadataset_prepares_unchanged(synthetic_source, tmp_path, monkeypatch):
    """MONAI's own downloader (pointed at the fake server) builds the folder; our prepare reads it as it is."""
    pytest.importorskip("requests")
    import monai.apps.tcia.utils as tcia_utils
    from monai.apps import TciaDataset

    source, cases, _ = synthetic_source
    (tmp_path / "monai").mkdir()
    with FakeNbia(cases) as server:
        monkeypatch.setattr(tcia_utils, "BASE_URL", server.url)
        TciaDataset(tmp_path / "monai", COLLECTION, "training", download=True, val_frac=0.0, progress=False,
                    transform=lambda x: x)  # fmt: skip
    made_by_monai = tmp_path / "monai" / COLLECTION
    assert (made_by_monai / "raw").is_dir()  # TciaDataset's own leftovers, ignored by prepare
    assert (case_dir(tmp_path / "monai", cases[0]) / "image" / "LICENSE").is_file()  # getImage zips carry a LICENSE
    ours = prepared_labels(source, tmp_path / "from_source")
    theirs = prepared_labels(tmp_path / "monai", tmp_path / "from_monai")
    assert sorted(theirs) == ["LUNG1-001", "LUNG1-002"]
    for case_id, label in ours.items():
        assert label.sum() > 0
        np.testing.assert_array_equal(theirs[case_id], label)


def test_monai_tciadataset_loads_a_folder_we_downloaded(synthetic_source, tmp_path):
    """The reverse direction: TciaDataset (download=False) finds image and seg in our layout and reads the GTV."""
    from monai.apps import TciaDataset
    from monai.transforms import LoadImaged

    _, cases, truths = synthetic_source
    with FakeNbia(cases) as server:
        summary = download(tmp_path, base_url=server.url, **FAST)
    assert len(summary.downloaded) == 2 and not summary.failed
    loader = LoadImaged(keys=["image", "seg"], reader="PydicomReader", label_dict={"GTV-1": 0, "Lung-Left": 1})
    dataset = TciaDataset(tmp_path, COLLECTION, "training", transform=loader, val_frac=0.0, cache_num=0, progress=False)
    gtv_voxels = {t["patient_id"]: t["tumour"]["num_voxels"] for t in truths}
    assert len(dataset) == 2
    for item in dataset:
        assert item["image"].shape == (48, 48, 12) and item["seg"].shape == (48, 48, 12, 2)
        assert int(item["seg"][..., 0].sum()) == gtv_voxels[Path(item["image"].meta["filename_or_obj"]).parts[-3]]


def train_config(tmp_path: Path, **overrides):
    from monai.bundle import ConfigParser

    parser = ConfigParser()
    parser.read_config(str(ROOT / "configs" / "train.yaml"))
    parser.update({"bundle_root": str(ROOT), "dataset_dir": str(tmp_path / "data"), "prepare_workers": 1, **overrides})
    return parser


def test_train_config_with_download_true_downloads_then_prepares(synthetic_source, tmp_path):
    """`--download true` as typed on the command line: initialize's download and prepare steps, on the fake server."""
    _, cases, _ = synthetic_source
    with FakeNbia(cases) as server:
        parser = train_config(tmp_path, download="true", tcia_base_url=server.url)
        summary = parser.get_parsed_content("acquire_data")
        report = parser.get_parsed_content("prepare")
    assert sorted(r.patient_id for r in summary.downloaded) == ["LUNG1-001", "LUNG1-002"]
    assert report["num_prepared"] == 2
    datalist = json.loads((tmp_path / "data" / "NSCLC-Radiomics-prepared" / "datalist.json").read_text())
    assert sorted(d["case_id"] for k in ("training", "validation", "test") for d in datalist[k]) == [
        "LUNG1-001", "LUNG1-002",
    ]  # fmt: skip


def test_train_config_download_stops_on_a_failed_series_and_says_how_to_resume(synthetic_source, tmp_path):
    _, cases, _ = synthetic_source
    with FakeNbia(cases) as server:
        server.forbidden.add(cases[1].seg_uid)
        parser = train_config(tmp_path, download=True, tcia_base_url=server.url)
        with pytest.raises(RuntimeError) as err:  # monai.bundle wraps the error of a config expression
            parser.get_parsed_content("acquire_data")
    cause = err.value.__cause__
    assert isinstance(cause, TciaError) and "1 series could not be downloaded" in str(cause)
    assert "LUNG1-002" in str(cause) and "Run the same command again" in str(cause)
    assert (case_dir(tmp_path / "data", cases[0]) / "image").is_dir()  # the good case is complete


def test_train_config_downloads_nothing_by_default(tmp_path):
    assert train_config(tmp_path, tcia_base_url="http://127.0.0.1:9/").get_parsed_content("acquire_data") is None

"""Download a TCIA collection's DICOM SEG series and the CT series they annotate, from the NBIA REST API.

Input: a collection name (default ``NSCLC-Radiomics``) and the NBIA base URL.
Output (the layout of ``monai.apps.TciaDataset``, so data fetched by either tool is usable by both)::

    <dataset_dir>/<collection>/<PatientID>/<SeriesNumber>/seg/*.dcm     the SEG series
    <dataset_dir>/<collection>/<PatientID>/<SeriesNumber>/image/*.dcm   the CT series the SEG references
    <dataset_dir>/<collection>/<PatientID>/<SeriesNumber>/.complete.json  marker, written last (see below)

``PatientID`` and ``SeriesNumber`` are read from the SEG file with TciaDataset's fallbacks (PatientName, then
"patient"; AcquisitionNumber, then "0"). Files are flattened: only the base name of each ``.dcm`` zip entry is kept.
With ``--modality RTSTRUCT`` the annotation folder is ``rtstruct/``, as in TciaDataset (``seg_type.lower()``).

NBIA endpoints used (all relative to the base URL)::

    getSeries?Collection=C&Modality=SEG           JSON list of series (SeriesInstanceUID, PatientID, SeriesNumber, ...)
    getImageWithMD5Hash?SeriesInstanceUID=U       zip of the series plus ``md5hashes.csv``
    getImage?SeriesInstanceUID=U                  zip of the series (fallback when the MD5 endpoint answers 404)
    getSeries?StudyInstanceUID=S, getSOPInstanceUIDs?SeriesInstanceUID=U
                                                  only when a SEG references CT instances but not the CT series

What we found about the API (no network here, so from documentation and NBIA's own source code):

* The default base URL is MONAI's, ``https://services.cancerimagingarchive.net/nbia-api/services/v1/`` -- the
  "NBIA Search REST API" for public collections, no token needed (TCIA wiki, "NBIA Search REST API Guide").
* NBIA's server source (github.com/CBIIT/NBIA-TCIA, ``software/nbia-api/src/gov/nih/nci/nbia/restAPI/v4/``)
  defines ``v4/getSeries``, ``v4/getImage``, ``v4/getImageWithMD5Hash`` and ``v4/getSOPInstanceUIDs`` with the same
  parameters, so ``--base_url https://services.cancerimagingarchive.net/nbia-api/services/v4/`` (or the
  ``TCIA_BASE_URL`` environment variable) should work unchanged once TCIA retires v1; whether v4 serves public
  collections without a token could not be checked from here. ``v2`` needs an OAuth token and is not supported.
* Both versions name zip entries ``00000001.dcm``, ``00000002.dcm``, ... and the MD5 endpoint appends
  ``md5hashes.csv`` with the header ``Filename,MD5Hash`` (we also accept no header, swapped or extra columns, and
  ``md5sum``-style lines). ``getImage`` adds a ``LICENSE`` entry, which is skipped with every other non-DICOM entry.
* The zip is streamed (usually without Content-Length) and a server-side error mid-stream still closes the zip
  cleanly, just without the remaining files and without ``md5hashes.csv``; so a missing manifest, or a listed file
  missing from the archive, counts as a cut transfer and is fetched again.

Robustness: every request is retried with exponential back-off on connection errors, timeouts, HTTP 5xx and 429;
other 4xx (except 404) fail at once. A transfer shorter than its Content-Length, a zip that does not open or fails
its CRC, and a file whose MD5 differs from ``md5hashes.csv`` are fetched again (each counts as a retry); a cut
transfer is resumed with ``Range: bytes=N-`` when the server answers 206 (restarted on 200). An archive with an
unsafe entry name (absolute path, drive letter, ``..``) fails its series at once and nothing of it is written.

Completeness: each case is assembled in ``<dataset_dir>/.tcia-tmp/<SEG UID>.tmp-<pid>/`` (outside the collection
folder, so neither TciaDataset nor ``scripts.prepare`` ever sees a half-built case, even after a crash, and on the
same file system, so the final ``rename`` is atomic) and moved into place only when both series are verified.
``.complete.json`` (UIDs, file counts, whether MD5s were checked) is written before that move, so a case folder with a
marker is complete. A re-run reads the markers and skips those SEG series without any zip request. A case folder
without a marker (made by ``monai.apps.TciaDataset``) is adopted when the listing's PatientID/SeriesNumber point at
it, both ``seg/`` and ``image/`` hold ``.dcm`` files, and the SEG file there has the listed SeriesInstanceUID; an
``adopted`` marker is then written (its CT files were not verified). Temporary folders of dead processes are removed
at the start of a run; partial ``.part`` downloads are kept in ``.tcia-tmp/downloads`` to be resumed.

CLI: ``python -m scripts.tcia download --dataset_dir DIR [--collection NSCLC-Radiomics] [--limit N]
[--base_url URL] [--num_workers K] [--retries R] [--modality SEG] [--backoff SECONDS] [--timeout SECONDS]``;
exits with status 1 when any series failed.
"""

from __future__ import annotations

import contextlib
import csv
import errno
import hashlib
import http.client
import io
import json
import logging
import os
import random
import re
import shutil
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import zipfile
import zlib
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pydicom
from pydicom.errors import InvalidDicomError
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

logger = logging.getLogger(__name__)

DEFAULT_BASE_URL = "https://services.cancerimagingarchive.net/nbia-api/services/v1/"
BASE_URL_ENV = "TCIA_BASE_URL"
MARKER = ".complete.json"
STAGING = ".tcia-tmp"
MD5_MANIFEST = "md5hashes.csv"
MD5_ENDPOINT = "getImageWithMD5Hash"
PLAIN_ENDPOINT = "getImage"
#: longest wait between two attempts, whatever the back-off or a Retry-After header asks for
MAX_DELAY_S = 60.0
_CHUNK = 1 << 20
_USER_AGENT = "nsclc-swinunetr-bundle/scripts.tcia (python urllib)"
_MD5_RE = re.compile(r"^[0-9a-fA-F]{32}$")
_T = TypeVar("_T")


class TciaError(RuntimeError):
    """A download step failed for good; the message names the series or URL and says what to do."""


class IntegrityError(TciaError):
    """A downloaded archive is cut, corrupt, or does not match its MD5 manifest (worth fetching again)."""


class UnsafeArchiveError(TciaError):
    """A zip entry would be written outside its folder (absolute path, drive letter or ``..``)."""


@dataclass
class SeriesResult:
    """What happened to one SEG series (and the CT series it references)."""

    seg_series_uid: str
    patient_id: str
    status: str  # "downloaded" | "skipped" | "failed"
    reason: str = ""
    case_dir: str | None = None
    image_series_uid: str | None = None
    md5_verified: bool | None = None


@dataclass
class DownloadSummary:
    """Per-series outcome of :func:`download`."""

    collection: str
    dataset_dir: str
    downloaded: list[SeriesResult] = field(default_factory=list)
    skipped: list[SeriesResult] = field(default_factory=list)
    failed: list[SeriesResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when no series failed."""
        return not self.failed

    def add(self, result: SeriesResult) -> None:
        """File ``result`` under its status."""
        {"downloaded": self.downloaded, "skipped": self.skipped, "failed": self.failed}[result.status].append(result)

    def as_dict(self) -> dict:
        """JSON-serialisable form."""
        return asdict(self)

    def format(self) -> str:
        """Human-readable report: counts, then one line per failed or unverified series."""
        lines = [
            f"TCIA {self.collection} -> {self.dataset_dir}: {len(self.downloaded)} downloaded, "
            f"{len(self.skipped)} skipped (already complete), {len(self.failed)} failed"
        ]
        for r in self.downloaded:
            if r.md5_verified is False:
                lines.append(f"  NO MD5 CHECK  {r.patient_id}  SEG {r.seg_series_uid}: server offered no MD5 hashes")
        for r in sorted(self.failed, key=lambda r: (r.patient_id, r.seg_series_uid)):
            lines.append(f"  FAILED  {r.patient_id}  SEG {r.seg_series_uid}: {r.reason}")
        if self.failed:
            lines.append("Re-run the same command to retry the failed series; completed cases are skipped.")
        return "\n".join(lines)


def download(
    dataset_dir: str | Path,
    collection: str = "NSCLC-Radiomics",
    limit: int | None = None,
    base_url: str | None = None,
    num_workers: int = 4,
    retries: int = 5,
    modality: str = "SEG",
    backoff: float = 1.0,
    timeout: float = 300.0,
    progress: bool = True,
) -> DownloadSummary:
    """Download every ``modality`` series of ``collection`` (sorted by PatientID, then SeriesInstanceUID; the
    first ``limit`` only) with the CT series each one references, into the TciaDataset layout.

    ``retries`` extra attempts per request (waiting ``backoff * 2**k`` seconds), ``num_workers`` series at a time.
    Series that fail are reported in the summary; only a failing series listing raises :class:`TciaError`.
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive integer or None (all series), got {limit!r}")
    if not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"num_workers must be a positive integer, got {num_workers!r}")
    if not isinstance(retries, int) or retries < 0:
        raise ValueError(f"retries must be a non-negative integer, got {retries!r}")
    if not collection or "/" in collection or "\\" in collection or collection in (".", ".."):
        raise ValueError(f"collection must be a plain TCIA collection name, got {collection!r}")
    if not re.fullmatch(r"[A-Za-z0-9_]+", modality or ""):
        raise ValueError(f"modality must be a DICOM modality such as SEG or RTSTRUCT, got {modality!r}")

    root = Path(dataset_dir)
    coll_dir = root / collection
    staging = root / STAGING
    client = _NbiaClient(resolve_base_url(base_url), retries, backoff, timeout, staging / "downloads")
    summary = DownloadSummary(collection=collection, dataset_dir=str(root))

    series = list_series(collection, modality, client=client)
    if not series:
        raise TciaError(
            f"the NBIA listing at {client.base_url} has no {modality} series for collection {collection!r}; "
            "check --collection, --modality and --base_url"
        )
    if limit is not None:
        series = series[:limit]
    logger.info("%d %s series listed for %s (after --limit)", len(series), modality, collection)

    _remove_stale_temps(staging)
    seg_folder = modality.lower()  # "seg", as TciaDataset names it (seg_type.lower())
    completed = _index_markers(coll_dir)
    todo = []
    for entry in series:
        uid = entry["SeriesInstanceUID"]
        done = completed.get(uid) or _adopt_unmarked_case(coll_dir, entry, seg_folder)
        if done is not None:
            summary.add(
                SeriesResult(
                    uid,
                    done.get("patient_id", ""),
                    "skipped",
                    case_dir=done.get("case_dir"),
                    image_series_uid=done.get("image_series_uid"),
                    md5_verified=done.get("md5_verified"),
                )
            )
        else:
            todo.append(entry)
    if summary.skipped:
        logger.info("%d series already complete, skipped", len(summary.skipped))

    install_lock = threading.Lock()
    with tqdm(total=len(todo), desc=f"TCIA {collection}", unit="series", disable=not progress) as bar:
        pool = ThreadPoolExecutor(max_workers=num_workers)
        try:
            futures = {
                pool.submit(_download_case, client, entry, coll_dir, staging, modality, install_lock): entry
                for entry in todo
            }
            for future in as_completed(futures):
                result = future.result()
                summary.add(result)
                if result.status == "failed":
                    logger.error("failed: %s", result.reason)  # the reason names the series and patient
                bar.update(1)
        except BaseException:  # Ctrl-C: stop queued and running series; temp folders are removed as they unwind
            client.cancelled.set()
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown(wait=True)
    for bucket in (summary.downloaded, summary.skipped, summary.failed):
        bucket.sort(key=lambda r: (r.patient_id, r.seg_series_uid))
    _remove_if_empty(staging / "downloads")
    _remove_if_empty(staging)
    return summary


def list_series(
    collection: str,
    modality: str = "SEG",
    base_url: str | None = None,
    retries: int = 5,
    backoff: float = 1.0,
    timeout: float = 300.0,
    *,
    client: _NbiaClient | None = None,
) -> list[dict]:
    """``getSeries`` for ``collection``/``modality``, de-duplicated and sorted by (PatientID, SeriesInstanceUID)."""
    if client is None:
        client = _NbiaClient(resolve_base_url(base_url), retries, backoff, timeout, Path("."))
    listing = client.get_json("getSeries", {"Collection": collection, "Modality": modality})
    if not isinstance(listing, list):
        raise TciaError(f"getSeries at {client.base_url} returned {type(listing).__name__}, expected a JSON list")
    unique: dict[str, dict] = {}
    for item in listing:
        if isinstance(item, dict) and item.get("SeriesInstanceUID"):
            unique.setdefault(str(item["SeriesInstanceUID"]), item)
    return sorted(unique.values(), key=lambda d: (str(d.get("PatientID") or ""), str(d["SeriesInstanceUID"])))


def resolve_base_url(base_url: str | None = None) -> str:
    """``base_url``, else ``$TCIA_BASE_URL``, else :data:`DEFAULT_BASE_URL`; always ending in ``/``."""
    url = base_url or os.environ.get(BASE_URL_ENV) or DEFAULT_BASE_URL
    if urllib.parse.urlparse(url).scheme not in ("http", "https"):
        raise ValueError(f"base_url must be an http(s) URL, got {url!r}")
    return url if url.endswith("/") else url + "/"


def parse_md5_manifest(text: str) -> dict[str, str]:
    """``md5hashes.csv`` text -> {file base name: lower-case MD5}.

    Tolerates a header row or none, any column order, extra columns, a BOM, blank lines and ``md5  name`` lines.
    """
    hashes: dict[str, str] = {}
    for row in csv.reader(io.StringIO(text.lstrip("\ufeff"))):
        cells = [c.strip() for c in row if c.strip()]
        if len(cells) == 1:  # "md5  name" or "md5 *name" (md5sum's text and binary modes)
            cells = [c.lstrip("*") for c in cells[0].split()]
        digests = [c for c in cells if _MD5_RE.match(c)]
        names = [c for c in cells if not _MD5_RE.match(c)]
        if len(digests) != 1 or not names:
            continue  # header or junk
        hashes[_base_name(names[0])] = digests[0].lower()
    return hashes


def extract_series_zip(zip_path: str | Path, out_dir: str | Path, require_md5: bool = False) -> tuple[list[str], bool]:
    """Extract the ``.dcm`` entries of an NBIA series zip into ``out_dir`` (flattened to base names), verifying
    CRCs and, when the zip holds ``md5hashes.csv``, every file's MD5.

    Returns (file names, whether MD5s were checked). Raises :class:`UnsafeArchiveError` before writing anything
    when an entry name is unsafe, and :class:`IntegrityError` for a cut/corrupt archive or an MD5 mismatch
    (files already written to ``out_dir`` are then left for the caller to remove).
    """
    out = Path(out_dir)
    try:
        zf = zipfile.ZipFile(zip_path)
    except (zipfile.BadZipFile, EOFError) as err:
        raise IntegrityError(f"the archive is cut or corrupt ({err})") from err
    with zf:
        infos = zf.infolist()
        for info in infos:
            _check_entry_name(info.filename)
        manifests = [i for i in infos if _base_name(i.filename).lower() == MD5_MANIFEST]
        hashes = None
        if manifests:
            hashes = parse_md5_manifest(_read_entry(zf, manifests[0]).decode("utf-8", errors="replace"))
        elif require_md5:
            raise IntegrityError(f"{MD5_MANIFEST} is missing from the archive (the server's stream ended early?)")
        dicoms = [i for i in infos if not i.is_dir() and _base_name(i.filename).lower().endswith(".dcm")]
        if not dicoms:
            raise IntegrityError("the archive holds no .dcm file")
        names = [_base_name(i.filename) for i in dicoms]
        dupes = sorted(n for n, count in Counter(names).items() if count > 1)
        if dupes:
            raise TciaError(f"archive entries in different folders share the file name {dupes[0]!r}")
        if hashes is not None:
            missing = sorted(set(hashes) - set(names))
            if missing:
                raise IntegrityError(
                    f"{len(missing)} file(s) listed in {MD5_MANIFEST} are missing from the archive, e.g. {missing[0]}"
                )
        out.mkdir(parents=True, exist_ok=True)
        for info, name in zip(dicoms, names, strict=True):
            digest = hashlib.md5(usedforsecurity=False)
            try:
                with zf.open(info) as src, open(out / name, "wb") as dst:
                    while chunk := src.read(_CHUNK):
                        digest.update(chunk)
                        dst.write(chunk)
            except (zipfile.BadZipFile, zlib.error, EOFError) as err:
                raise IntegrityError(f"{name} is corrupt in the archive ({err})") from err
            if hashes is not None:
                expected = hashes.get(name)
                if expected is None:
                    raise IntegrityError(f"{name} is not listed in {MD5_MANIFEST}")
                if digest.hexdigest() != expected:
                    raise IntegrityError(
                        f"MD5 mismatch for {name}: {MD5_MANIFEST} says {expected}, got {digest.hexdigest()}"
                    )
    return sorted(names), hashes is not None


def case_key(ds: pydicom.Dataset) -> tuple[str, str]:
    """(PatientID, SeriesNumber) folder names for a SEG dataset, with TciaDataset's fallbacks.

    Raises :class:`TciaError` when a value could not serve as a single folder name.
    """
    patient = str(ds.get("PatientID") or ds.get("PatientName") or "").strip() or "patient"
    number = ds.get("SeriesNumber") or ds.get("AcquisitionNumber")
    series_number = str(number).strip() if number else "0"
    for what, value in (("PatientID", patient), ("SeriesNumber", series_number)):
        if value in (".", "..") or any(c in value for c in "/\\\0") or value.startswith("."):
            raise TciaError(
                f"{what} {value!r} of SEG series {ds.get('SeriesInstanceUID', '?')} is not a safe "
                "folder name; refusing to write it"
            )
    return patient, series_number


def find_referenced_series_uid(ds: pydicom.Dataset) -> str | None:
    """The SeriesInstanceUID a SEG references: ReferencedSeriesSequence first, then any nested sequence
    (e.g. ReferencedFrameOfReferenceSequence); never the SEG's own UID. None when there is none."""
    own = str(ds.get("SeriesInstanceUID", ""))
    for item in ds.get("ReferencedSeriesSequence", None) or []:
        uid = str(item.get("SeriesInstanceUID", ""))
        if uid and uid != own:
            return uid
    for uid in _nested_values(ds, 0x0020000E):
        if uid != own:
            return uid
    return None


def find_referenced_sop_uids(ds: pydicom.Dataset) -> list[str]:
    """Every ReferencedSOPInstanceUID in the SEG's sequences (first occurrence order, no duplicates)."""
    return list(dict.fromkeys(_nested_values(ds, 0x00081155)))


def download_for_training(
    dataset_dir: str | Path,
    collection: str = "NSCLC-Radiomics",
    limit: int | None = None,
    base_url: str | None = None,
) -> DownloadSummary:
    """``download`` as ``train.yaml``'s ``download: true`` runs it: the summary is logged, and any failed series
    stops the run (training on a silently incomplete collection would change the split); re-running resumes."""
    summary = download(dataset_dir, collection, limit, base_url)
    logger.info("%s", summary.format())
    if not summary.ok:
        failed = ", ".join(f"{r.patient_id} ({r.reason})" for r in summary.failed)
        raise TciaError(
            f"{len(summary.failed)} series could not be downloaded into {dataset_dir}: {failed}. Run the same "
            "command again (complete cases are skipped), or set download: false to train on the cases present."
        )
    return summary


def download_cli(
    dataset_dir: str,
    collection: str = "NSCLC-Radiomics",
    limit: int | None = None,
    base_url: str | None = None,
    num_workers: int = 4,
    retries: int = 5,
    modality: str = "SEG",
    backoff: float = 1.0,
    timeout: float = 300.0,
) -> None:
    """Download SEG series and their CT from TCIA into DATASET_DIR/COLLECTION/<PatientID>/<SeriesNumber>/{seg,image}.

    Prints a summary and exits with status 1 when any series failed; re-running resumes and skips completed cases.

    Args:
        dataset_dir: root folder (the same ``root_dir`` monai.apps.TciaDataset uses).
        collection: TCIA collection name.
        limit: only the first N series, sorted by PatientID then SeriesInstanceUID (default: all).
        base_url: NBIA API base URL (default: $TCIA_BASE_URL, else the public v1 endpoint).
        num_workers: series downloaded in parallel.
        retries: extra attempts per request after a network error, HTTP 5xx/429 or a cut/corrupt download.
        modality: modality of the annotation series to list (SEG; RTSTRUCT lists RT structure sets).
        backoff: first wait between attempts in seconds, doubled each time.
        timeout: seconds without data before a request counts as failed.
    """
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        with logging_redirect_tqdm():
            summary = download(
                dataset_dir, collection, limit, base_url, num_workers, retries, modality, backoff, timeout
            )
    except (TciaError, ValueError) as err:
        raise SystemExit(f"tcia: {err}") from None
    print(summary.format())
    if not summary.ok:
        raise SystemExit(1)


# --------------------------------------------------------------------------------------------------------------------
# HTTP


class _Retryable(Exception):
    """A failure worth another attempt (network, 5xx/429, cut or corrupt transfer)."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class _NotFound(Exception):
    """HTTP 404."""


class _RangeRefused(Exception):
    """HTTP 416: the server will not resume from our offset."""


class _NbiaClient:
    """Requests to one NBIA base URL, with retries; series zips go through ``<downloads>/<uid>.<endpoint>.part``."""

    def __init__(self, base_url: str, retries: int, backoff: float, timeout: float, downloads: Path) -> None:
        self.base_url = base_url
        self.retries = retries
        self.backoff = backoff
        self.timeout = timeout
        self.downloads = downloads
        self.cancelled = threading.Event()  # set on Ctrl-C: workers stop at their next chunk or retry
        self._locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()

    def url(self, endpoint: str, params: dict[str, str]) -> str:
        return f"{self.base_url}{endpoint}?{urllib.parse.urlencode(params)}"

    def get_json(self, endpoint: str, params: dict[str, str]) -> Any:
        """GET ``endpoint`` and parse JSON (an empty body is an empty list)."""
        url = self.url(endpoint, params)

        def attempt() -> Any:
            try:
                with self._open(url, {}) as resp:
                    length = resp.headers.get("Content-Length")
                    body = resp.read()
            except _NotFound:
                raise TciaError(f"{url} answered 404 Not Found; check --base_url (now {self.base_url})") from None
            except (http.client.HTTPException, OSError) as err:
                raise _Retryable(f"response broke off ({err})") from None
            if length is not None and length.isdigit() and len(body) != int(length):
                raise _Retryable(f"response cut: {len(body)} of {length} bytes")
            if not body.strip():
                return []
            try:
                return json.loads(body)
            except ValueError as err:
                raise TciaError(f"{url} did not return JSON ({err}); is --base_url an NBIA API?") from err

        return self._with_retries(f"GET {url}", attempt)

    def fetch_series(self, uid: str, out_dir: Path, label: str) -> tuple[list[str], bool]:
        """Download series ``uid`` and extract it, verified, into ``out_dir`` (emptied first on every attempt)."""
        self.downloads.mkdir(parents=True, exist_ok=True)
        state = {"endpoint": MD5_ENDPOINT}

        def attempt() -> tuple[list[str], bool]:
            shutil.rmtree(out_dir, ignore_errors=True)
            endpoint = state["endpoint"]
            try:
                part = self._stream(endpoint, uid)
            except _NotFound:
                if endpoint != MD5_ENDPOINT:
                    raise TciaError(
                        f"{label}: the server does not know this series (404 from {PLAIN_ENDPOINT})"
                    ) from None
                logger.warning(
                    "%s: %s answered 404; falling back to %s (no MD5 check)", label, MD5_ENDPOINT, PLAIN_ENDPOINT
                )
                state["endpoint"] = endpoint = PLAIN_ENDPOINT
                try:
                    part = self._stream(endpoint, uid)
                except _NotFound:
                    raise TciaError(f"{label}: the server does not know this series (404)") from None
            try:
                result = extract_series_zip(part, out_dir, require_md5=endpoint == MD5_ENDPOINT)
            except IntegrityError as err:
                part.unlink(missing_ok=True)
                shutil.rmtree(out_dir, ignore_errors=True)
                raise _Retryable(str(err)) from err
            except TciaError:
                part.unlink(missing_ok=True)
                shutil.rmtree(out_dir, ignore_errors=True)
                raise
            part.unlink(missing_ok=True)
            return result

        with self._lock_for(uid):  # two SEGs may reference one CT: never share a .part between threads
            try:
                return self._with_retries(label, attempt)
            except TciaError as err:
                if str(err).startswith(label):
                    raise
                raise TciaError(f"{label}: {err}") from err

    def match_sop_in_study(self, study_uid: str, sop_uids: list[str], exclude: str) -> str | None:
        """The series of ``study_uid`` holding one of ``sop_uids`` (CT series asked first), or None."""
        listing = self.get_json("getSeries", {"StudyInstanceUID": study_uid})
        candidates = [d for d in listing if isinstance(d, dict) and d.get("SeriesInstanceUID")]
        candidates = [d for d in candidates if d["SeriesInstanceUID"] != exclude]
        candidates.sort(key=lambda d: (d.get("Modality") != "CT", str(d["SeriesInstanceUID"])))
        wanted = set(sop_uids)
        for d in candidates:
            found = self.get_json("getSOPInstanceUIDs", {"SeriesInstanceUID": d["SeriesInstanceUID"]})
            values = {str(x.get("SOPInstanceUID")) if isinstance(x, dict) else str(x) for x in found or []}
            if wanted & values:
                return str(d["SeriesInstanceUID"])
        return None

    # -- internals -----------------------------------------------------------------------------------------------

    def _lock_for(self, uid: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault(uid, threading.Lock())

    def _with_retries(self, what: str, attempt: Callable[[], _T]) -> _T:
        last = ""
        for k in range(self.retries + 1):
            if self.cancelled.is_set():
                raise TciaError(f"{what}: cancelled")
            try:
                return attempt()
            except _Retryable as err:
                last = str(err)
                if k == self.retries:
                    break
                delay = min(self.backoff * 2**k, MAX_DELAY_S) * (1 + 0.1 * random.random())
                if err.retry_after is not None:
                    delay = max(delay, min(err.retry_after, MAX_DELAY_S))
                logger.warning("%s: %s; attempt %d of %d, next in %.2f s", what, last, k + 1, self.retries + 1, delay)
                self.cancelled.wait(delay)
        raise TciaError(
            f"{what}: gave up after {self.retries + 1} attempt(s); last error: {last}. Re-run later or raise --retries"
        )

    def _open(self, url: str, headers: dict[str, str]) -> http.client.HTTPResponse:
        """urlopen with error classification: 404 -> _NotFound, 429/5xx/network -> _Retryable, other -> TciaError."""
        request = urllib.request.Request(url, headers={"User-Agent": _USER_AGENT, **headers})
        try:
            return urllib.request.urlopen(request, timeout=self.timeout)
        except urllib.error.HTTPError as err:
            detail = _error_body(err)
            if err.code == 404:
                raise _NotFound(url) from None
            if err.code == 416 and "Range" in headers:
                raise _RangeRefused(url) from None
            if err.code == 429 or err.code >= 500:
                raise _Retryable(f"HTTP {err.code} {err.reason}{detail}", _retry_after(err)) from None
            raise TciaError(
                f"HTTP {err.code} {err.reason} from {url}{detail}; this will not go away by retrying "
                "(is the series public, and --base_url right?)"
            ) from None
        except (http.client.HTTPException, OSError) as err:  # URLError, refused, reset, timeout, TLS
            raise _Retryable(f"cannot reach {url}: {getattr(err, 'reason', err)}") from None

    def _stream(self, endpoint: str, uid: str) -> Path:
        """Download a series zip to its ``.part`` file, resuming a previous partial download when possible."""
        part = self.downloads / f"{_file_safe(uid)}.{endpoint}.zip.part"
        offset = part.stat().st_size if part.exists() else 0
        headers = {"Range": f"bytes={offset}-"} if offset else {}
        url = self.url(endpoint, {"SeriesInstanceUID": uid})
        try:
            resp = self._open(url, headers)
        except _RangeRefused:  # our .part is stale or already whole: start over
            part.unlink(missing_ok=True)
            raise _Retryable("server refused to resume (HTTP 416); restarting the download") from None
        with resp:
            mode = "wb"
            if resp.status == 206:
                start = _content_range_start(resp.headers.get("Content-Range", ""))
                if start != offset:
                    part.unlink(missing_ok=True)
                    raise _Retryable(f"server resumed at byte {start}, expected {offset}; restarting")
                mode = "ab"
                logger.info("resuming %s of series %s at byte %d", endpoint, uid, offset)
            length = resp.headers.get("Content-Length")
            expected = int(length) if length and length.isdigit() else None
            received = 0
            with open(part, mode) as out:
                while True:
                    if self.cancelled.is_set():
                        raise TciaError(f"download of series {uid} cancelled")
                    try:
                        chunk = resp.read(_CHUNK)
                    except (http.client.HTTPException, OSError) as err:
                        raise _Retryable(f"transfer broke after {received} bytes ({err}); will resume") from None
                    if not chunk:
                        break
                    out.write(chunk)  # a disk error here is not retried
                    received += len(chunk)
            if expected is not None and received != expected:
                raise _Retryable(f"transfer cut: got {received} of {expected} bytes (Content-Length); will resume")
        return part


def _error_body(err: urllib.error.HTTPError) -> str:
    try:
        text = err.read(300).decode("utf-8", errors="replace").strip()
    except Exception:  # the body of an error response is only a hint
        return ""
    return f" ({text})" if text else ""


def _retry_after(err: urllib.error.HTTPError) -> float | None:
    value = err.headers.get("Retry-After", "") if err.headers else ""
    return float(value) if value.strip().isdigit() else None


def _content_range_start(value: str) -> int | None:
    match = re.match(r"\s*bytes\s+(\d+)-", value)
    return int(match.group(1)) if match else None


# --------------------------------------------------------------------------------------------------------------------
# one case


def _download_case(
    client: _NbiaClient, entry: dict, coll_dir: Path, staging: Path, modality: str, install_lock: threading.Lock
) -> SeriesResult:
    """SEG series -> read it -> referenced CT series -> marker -> atomic move into place. Never raises."""
    uid = str(entry["SeriesInstanceUID"])
    patient = str(entry.get("PatientID") or "?")
    label = f"{modality} series {uid} (patient {patient})"
    temp = staging / f"{_file_safe(uid)}.tmp-{os.getpid()}"
    try:
        shutil.rmtree(temp, ignore_errors=True)
        temp.mkdir(parents=True)
        seg_folder = modality.lower()
        seg_files, seg_md5 = client.fetch_series(uid, temp / seg_folder, label)
        ds = _read_seg(temp / seg_folder, seg_files, modality, label)
        patient, series_number = case_key(ds)
        label = f"{modality} series {uid} (patient {patient})"
        dest = coll_dir / patient / series_number
        existing = _existing_case(dest, uid, label, seg_folder)
        if existing is not None:  # an unmarked TciaDataset folder for this very SEG: adopt it, skip the CT
            return SeriesResult(
                uid,
                patient,
                "skipped",
                case_dir=str(dest),
                image_series_uid=existing.get("image_series_uid"),
                md5_verified=False,
            )
        ref_uid = find_referenced_series_uid(ds)
        if ref_uid is None:
            sops = find_referenced_sop_uids(ds)
            study = str(ds.get("StudyInstanceUID", ""))
            if sops and study:
                logger.info(
                    "%s names no referenced series; looking its %d instance(s) up in study %s", label, len(sops), study
                )
                ref_uid = client.match_sop_in_study(study, sops, exclude=uid)
        if ref_uid is None:
            raise TciaError(
                "the SEG references no CT series (no ReferencedSeriesSequence, and no referenced instance was found "
                "in its study); this case cannot be used"
            )
        image_files, image_md5 = client.fetch_series(ref_uid, temp / "image", f"CT series {ref_uid} for {label}")
        md5_verified = seg_md5 and image_md5
        marker = {
            "seg_series_uid": uid,
            "image_series_uid": ref_uid,
            "patient_id": patient,
            "series_number": series_number,
            "seg_folder": seg_folder,
            "seg_files": len(seg_files),
            "image_files": len(image_files),
            "md5_verified": md5_verified,
            "source": client.base_url,
            "completed": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        _write_json(temp / MARKER, marker)
        with install_lock:
            _existing_case(dest, uid, label, seg_folder)  # another worker may have filled dest meanwhile
            _move_into_place(temp, dest)
        logger.info("%s: complete in %s (%d CT files)", label, dest, len(image_files))
        return SeriesResult(
            uid, patient, "downloaded", case_dir=str(dest), image_series_uid=ref_uid, md5_verified=md5_verified
        )
    except TciaError as err:
        reason = str(err)
        return SeriesResult(uid, patient, "failed", reason=reason if uid in reason else f"{label}: {reason}")
    except Exception as err:  # one bad case must not stop the run; report it with its series
        logger.debug("unexpected error for %s", label, exc_info=True)
        return SeriesResult(uid, patient, "failed", reason=f"{label}: {type(err).__name__}: {err}")
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def _read_seg(seg_dir: Path, files: list[str], modality: str, label: str) -> pydicom.Dataset:
    """Header of the first file whose Modality is ``modality``."""
    for name in files:
        try:
            ds = pydicom.dcmread(seg_dir / name, stop_before_pixels=True)
        except (InvalidDicomError, OSError, ValueError) as err:
            raise TciaError(f"{label}: {name} is not a readable DICOM file ({err})") from err
        if str(ds.get("Modality", "")).upper() == modality.upper():
            return ds
    raise TciaError(f"{label}: none of its {len(files)} file(s) has Modality {modality}")


def _existing_case(dest: Path, uid: str, label: str, seg_folder: str) -> dict | None:
    """None when ``dest`` is free or holds an incomplete copy of this SEG series (to be replaced); the case's facts
    when it is an unmarked but complete folder of this SEG (adopted). Raises when it belongs to anything else."""
    if not dest.exists():
        return None
    marker = _read_marker(dest)
    if marker is not None:
        if marker.get("seg_series_uid") == uid:
            return None  # damaged (the up-front index rejected it): replaced by the fresh download
        raise TciaError(
            f"{label}: {dest} already holds SEG series {marker.get('seg_series_uid')} (same PatientID and "
            "SeriesNumber); refusing to overwrite it -- move one of them away and re-run"
        )
    found = _series_uid_of_first(dest / seg_folder)
    if found == uid:  # a folder of this very SEG without marker: adopt it when it has its CT, else replace it
        return _adopt(dest, uid, seg_folder) if _dcm_count(dest / "image") else None
    if found is None:
        raise TciaError(f"{label}: {dest} exists but holds no readable SEG; move it away and re-run")
    raise TciaError(f"{label}: {dest} already holds SEG series {found}; refusing to overwrite it -- move one away")


def _move_into_place(temp: Path, dest: Path) -> None:
    """Rename ``temp`` to ``dest`` (replacing our own damaged copy via a backup rename), across devices if must."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    backup = dest.parent / f".{dest.name}.old-{os.getpid()}"
    if dest.exists():
        os.rename(dest, backup)
    try:
        os.rename(temp, dest)
    except OSError as err:
        if err.errno != errno.EXDEV:
            raise
        near = dest.parent / f".{dest.name}.tmp-{os.getpid()}"
        shutil.copytree(temp, near)
        os.rename(near, dest)
    shutil.rmtree(backup, ignore_errors=True)


# --------------------------------------------------------------------------------------------------------------------
# completed cases on disk


def _index_markers(coll_dir: Path) -> dict[str, dict]:
    """{SEG UID: marker} for every case folder whose marker's file counts still match what is on disk."""
    done: dict[str, dict] = {}
    for marker_path in sorted(coll_dir.glob(f"*/*/{MARKER}")):
        case = marker_path.parent
        marker = _read_marker(case)
        if not marker or not marker.get("seg_series_uid"):
            continue
        counts = (_dcm_count(case / str(marker.get("seg_folder", "seg"))), _dcm_count(case / "image"))
        if counts != (marker.get("seg_files"), marker.get("image_files")):
            logger.warning(
                "%s: files are missing or were added since it was completed; it will be downloaded again", case
            )
            continue
        done[str(marker["seg_series_uid"])] = {**marker, "case_dir": str(case)}
    return done


def _adopt_unmarked_case(coll_dir: Path, entry: dict, seg_folder: str) -> dict | None:
    """A TciaDataset-made folder (no marker) at the listing's PatientID/SeriesNumber holding this SEG, or None."""
    patient, number = str(entry.get("PatientID") or ""), str(entry.get("SeriesNumber") or "")
    if not patient or not number or any(c in patient + number for c in "/\\\0") or ".." in (patient, number):
        return None
    case = coll_dir / patient / number
    if _read_marker(case) is not None or not _dcm_count(case / "image"):
        return None
    if _series_uid_of_first(case / seg_folder) != entry["SeriesInstanceUID"]:
        return None
    return _adopt(case, str(entry["SeriesInstanceUID"]), seg_folder)


def _adopt(case: Path, uid: str, seg_folder: str) -> dict:
    image_uid = _series_uid_of_first(case / "image")
    marker = {
        "seg_series_uid": uid,
        "image_series_uid": image_uid,
        "patient_id": case.parent.name,
        "series_number": case.name,
        "seg_folder": seg_folder,
        "seg_files": _dcm_count(case / seg_folder),
        "image_files": _dcm_count(case / "image"),
        "md5_verified": False,
        "adopted": True,
        "completed": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    _write_json(case / MARKER, marker)
    logger.info("%s: adopted a case folder without marker (e.g. from monai.apps.TciaDataset); not re-verified", case)
    return {**marker, "case_dir": str(case)}


def _read_marker(case: Path) -> dict | None:
    try:
        data = json.loads((case / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _series_uid_of_first(folder: Path) -> str | None:
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


def _dcm_count(folder: Path) -> int:
    return sum(1 for p in folder.iterdir() if p.is_file() and p.suffix.lower() == ".dcm") if folder.is_dir() else 0


# --------------------------------------------------------------------------------------------------------------------
# small helpers


def _check_entry_name(name: str) -> None:
    norm = name.replace("\\", "/")
    if norm.startswith("/") or re.match(r"^[A-Za-z]:", norm) or ".." in norm.split("/") or "\0" in norm:
        raise UnsafeArchiveError(f"unsafe zip entry {name!r} (absolute path, drive letter or '..'); nothing extracted")


def _base_name(name: str) -> str:
    return name.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]


def _read_entry(zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> bytes:
    try:
        return zf.read(info)
    except (zipfile.BadZipFile, zlib.error, EOFError) as err:
        raise IntegrityError(f"{info.filename} is corrupt in the archive ({err})") from err


def _nested_values(ds: pydicom.Dataset, tag: int) -> Iterable[str]:
    """Values of ``tag`` inside the sequences of ``ds`` (depth first), never at its top level."""
    for elem in ds:
        if elem.VR == "SQ":
            for item in elem.value or []:
                if tag in item and item[tag].value:
                    yield str(item[tag].value)
                yield from _nested_values(item, tag)


def _file_safe(uid: str) -> str:
    return re.sub(r"[^0-9A-Za-z._-]", "_", uid)


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def _remove_stale_temps(staging: Path) -> None:
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
    except (PermissionError, OSError):
        return True
    return True


def _remove_if_empty(folder: Path) -> None:
    with contextlib.suppress(OSError):
        folder.rmdir()


if __name__ == "__main__":
    import fire

    fire.Fire({"download": download_cli})

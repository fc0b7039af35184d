"""Requests to one NBIA REST API base URL, with retries, resumable series downloads and verified extraction.

Every request is retried with exponential back-off (scripts/common/retry.py, the policy the DICOMweb client shares) on
connection errors, timeouts, HTTP 5xx and 429; other 4xx (except 404) fail at once. A transfer shorter than its
Content-Length, a zip that does not open or fails its CRC, and a file whose MD5 differs from ``md5hashes.csv`` are
fetched again (each counts as a retry); a cut transfer is resumed with ``Range: bytes=N-`` when the server answers
206 (restarted on 200).

Endpoints used (relative to the base URL)::

    getSeries?Collection=C&Modality=SEG           JSON list of series (SeriesInstanceUID, PatientID, SeriesNumber, ...)
    getImageWithMD5Hash?SeriesInstanceUID=U       zip of the series plus ``md5hashes.csv``
    getImage?SeriesInstanceUID=U                  zip of the series (fallback when the MD5 endpoint answers 404)
    getSeries?StudyInstanceUID=S, getSOPInstanceUIDs?SeriesInstanceUID=U
                                                  only when a SEG references CT instances but not the CT series
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import re
import shutil
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from scripts.common.retry import RETRIES, GaveUpError, RetryCancelledError, RetryPolicy, TransientError
from scripts.data.tcia.archive import extract_series_zip
from scripts.data.tcia.errors import IntegrityError, TciaError

logger = logging.getLogger(__name__)

DEFAULT_BASE_URL = "https://services.cancerimagingarchive.net/nbia-api/services/v1/"
BASE_URL_ENV = "TCIA_BASE_URL"
MD5_ENDPOINT = "getImageWithMD5Hash"
PLAIN_ENDPOINT = "getImage"
_CHUNK = 1 << 20
_USER_AGENT = "nsclc-swinunetr-bundle/scripts.tcia (python urllib)"
_T = TypeVar("_T")


def resolve_base_url(base_url: str | None = None) -> str:
    """``base_url``, else ``$TCIA_BASE_URL``, else :data:`DEFAULT_BASE_URL`; always ending in ``/``."""
    url = base_url or os.environ.get(BASE_URL_ENV) or DEFAULT_BASE_URL
    if urllib.parse.urlparse(url).scheme not in ("http", "https"):
        raise ValueError(f"base_url must be an http(s) URL, got {url!r}")
    return url if url.endswith("/") else url + "/"


def list_series(
    collection: str,
    modality: str = "SEG",
    base_url: str | None = None,
    retries: int = RETRIES,
    backoff: float = 1.0,
    timeout: float = 300.0,
    *,
    client: NbiaClient | None = None,
) -> list[dict]:
    """``getSeries`` for ``collection``/``modality``, de-duplicated and sorted by (PatientID, SeriesInstanceUID)."""
    if client is None:
        client = NbiaClient(resolve_base_url(base_url), retries, backoff, timeout, Path("."))
    listing = client.get_json("getSeries", {"Collection": collection, "Modality": modality})
    if not isinstance(listing, list):
        raise TciaError(f"getSeries at {client.base_url} returned {type(listing).__name__}, expected a JSON list")
    unique: dict[str, dict] = {}
    for item in listing:
        if isinstance(item, dict) and item.get("SeriesInstanceUID"):
            unique.setdefault(str(item["SeriesInstanceUID"]), item)
    return sorted(unique.values(), key=lambda d: (str(d.get("PatientID") or ""), str(d["SeriesInstanceUID"])))


class _NotFound(Exception):
    """HTTP 404."""


class _RangeRefused(Exception):
    """HTTP 416: the server will not resume from our offset."""


class NbiaClient:
    """Requests to one NBIA base URL, with retries; series zips go through ``<downloads>/<uid>.<endpoint>.part``."""

    def __init__(self, base_url: str, retries: int, backoff: float, timeout: float, downloads: Path) -> None:
        self.base_url = base_url
        self.policy = RetryPolicy(retries, backoff)
        self.timeout = timeout
        self.downloads = downloads
        self.cancelled = self.policy.cancelled  # set on Ctrl-C: workers stop at their next chunk or retry
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
                raise TransientError(f"response broke off ({err})") from None
            if length is not None and length.isdigit() and len(body) != int(length):
                raise TransientError(f"response cut: {len(body)} of {length} bytes")
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
                raise TransientError(str(err)) from err
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
        """``attempt()`` under the retry policy (scripts/common/retry.py), its end in a :class:`TciaError`."""
        try:
            return self.policy.call(what, attempt)
        except GaveUpError as err:
            raise TciaError(
                f"{what}: gave up after {err.attempts} attempt(s); last error: {err.last}. Re-run later or "
                "raise --retries"
            ) from None
        except RetryCancelledError:
            raise TciaError(f"{what}: cancelled") from None

    def _open(self, url: str, headers: dict[str, str]) -> http.client.HTTPResponse:
        """urlopen, its errors classified: 404 -> _NotFound, 429/5xx/network -> TransientError, other -> TciaError."""
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
                raise TransientError(f"HTTP {err.code} {err.reason}{detail}", _retry_after(err)) from None
            raise TciaError(
                f"HTTP {err.code} {err.reason} from {url}{detail}; this will not go away by retrying "
                "(is the series public, and --base_url right?)"
            ) from None
        except (http.client.HTTPException, OSError) as err:  # URLError, refused, reset, timeout, TLS
            raise TransientError(f"cannot reach {url}: {getattr(err, 'reason', err)}") from None

    def _stream(self, endpoint: str, uid: str) -> Path:
        """Download a series zip to its ``.part`` file, resuming a previous partial download when possible."""
        part = self.downloads / f"{file_safe(uid)}.{endpoint}.zip.part"
        offset = part.stat().st_size if part.exists() else 0
        headers = {"Range": f"bytes={offset}-"} if offset else {}
        url = self.url(endpoint, {"SeriesInstanceUID": uid})
        try:
            resp = self._open(url, headers)
        except _RangeRefused:  # our .part is stale or already whole: start over
            part.unlink(missing_ok=True)
            raise TransientError("server refused to resume (HTTP 416); restarting the download") from None
        with resp:
            mode = "wb"
            if resp.status == 206:
                start = _content_range_start(resp.headers.get("Content-Range", ""))
                if start != offset:
                    part.unlink(missing_ok=True)
                    raise TransientError(f"server resumed at byte {start}, expected {offset}; restarting")
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
                        raise TransientError(f"transfer broke after {received} bytes ({err}); will resume") from None
                    if not chunk:
                        break
                    out.write(chunk)  # a disk error here is not retried
                    received += len(chunk)
            if expected is not None and received != expected:
                raise TransientError(f"transfer cut: got {received} of {expected} bytes (Content-Length); will resume")
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


def file_safe(uid: str) -> str:
    return re.sub(r"[^0-9A-Za-z._-]", "_", uid)

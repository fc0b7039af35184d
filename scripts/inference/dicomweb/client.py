"""One DICOMweb server: its URL, authentication (none, HTTP basic, or a bearer token -- the secret read from an
environment variable or a file, never from the command line, never logged or reported), the CA bundle for HTTPS, and
the retry policy every request runs under (scripts/common/retry.py: time-outs, dropped connections and HTTP 408/429/5xx
are retried with exponential back-off; 401, 403, 404 and the like raise a :class:`DicomWebError` at once, naming the URL
and what to do). The client is ``dicomweb-client``, one ``requests`` session per process; QIDO-RS finds studies,
series and results, WADO-RS retrieves a series (only the instances still missing after a cut transfer), STOW-RS stores.
"""

from __future__ import annotations

import base64
import logging
import os
import re
import ssl
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import pydicom
import requests
from dicomweb_client.api import DICOMwebClient
from scripts.common.retry import RETRIES, GaveUpError, RetryPolicy, TransientError
from scripts.data.dicom.identity import ALGORITHM_NAME
from scripts.inference.dicomweb.dicomjson import algorithms, first, object_of, referenced

logger = logging.getLogger(__name__)

T = TypeVar("T")
AUTH_KINDS = ("none", "basic", "bearer")
DEFAULT_SECRET_ENV = {"basic": "DICOMWEB_PASSWORD", "bearer": "DICOMWEB_TOKEN"}
#: answers worth another try: the server or a proxy in front of it is busy, restarting or timed out
TRANSIENT_STATUS = (408, 429, 500, 502, 503, 504)
#: WADO-RS: every instance in the transfer syntax it is stored in (the reader decodes the compressed ones)
AS_STORED = (("application/dicom", "*"),)
RESULT_MODALITIES = ("SEG", "RTSTRUCT", "SR")


class DicomWebError(RuntimeError):
    """A DICOMweb request failed for good; the message names the URL and what to do (never a secret). ``status``: the
    HTTP status that ended it, if any."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class DicomWebStoreError(DicomWebError):
    """Storing a case's results failed; the case fails at this stage (see :class:`scripts.inference.engine`)."""

    stage = "store"


# ------------------------------------------------------------------------------------------------ the server
class DicomWeb:
    """One DICOMweb server (see the module docstring). Nothing is contacted until a method asks; ``url`` None makes an
    inactive server (a run from ``--input_dir``).

    ``auth``: ``none``, ``basic`` (``user`` and a password) or ``bearer`` (a token). The password or token comes from
    the environment variable ``secret_env`` (default ``DICOMWEB_PASSWORD`` for basic, ``DICOMWEB_TOKEN`` for bearer)
    or from the first line of ``secret_file``. ``ca_bundle``: a PEM file of the certificate authorities to trust for
    HTTPS (default: the system's). ``retries`` more attempts after a transient failure, waiting ``backoff_s``, then
    twice that, and so on (or the server's Retry-After, up to a minute).
    """

    def __init__(
        self,
        url: str | None,
        auth: str | None = "none",
        user: str | None = None,
        secret_env: str | None = None,
        secret_file: str | Path | None = None,
        ca_bundle: str | Path | None = None,
        timeout_s: float = 60.0,
        retries: int = RETRIES,
        backoff_s: float = 1.0,
    ) -> None:
        self.url = None if url in (None, "") else _checked_url(str(url))
        self.auth = str(auth or "none").strip().lower()
        self.user = None if user is None else str(user)
        self.ca_bundle = None if ca_bundle in (None, "") else str(ca_bundle)
        self.timeout_s = float(timeout_s)
        self.policy = RetryPolicy(int(retries), float(backoff_s))
        self._secret: str | None = None
        self._secret_env = secret_env or DEFAULT_SECRET_ENV.get(self.auth)
        self._client: DICOMwebClient | None = None
        self._pid = 0
        if self.url is None:
            return
        if self.auth not in AUTH_KINDS:
            raise DicomWebError(f"dicomweb_auth {auth!r}: choose one of {', '.join(AUTH_KINDS)}.")
        if self.auth == "basic" and not self.user:
            raise DicomWebError("dicomweb_auth basic needs dicomweb_user (the password comes from the environment).")
        if self.auth != "none":
            self._secret = _read_secret(self.auth, secret_env, secret_file)
        if self.ca_bundle is not None and not Path(self.ca_bundle).is_file():
            raise DicomWebError(f"dicomweb_ca_bundle {self.ca_bundle}: no such file (a PEM file of CA certificates).")
        if self.auth != "none" and self.url.startswith("http://"):
            logger.warning("%s: credentials go to the server unencrypted (http); use https where you can", self.url)

    def __repr__(self) -> str:  # never the secret
        return f"DicomWeb({self.url!r}, auth={self.auth!r})"

    def __getstate__(self) -> dict:  # to a spawned DataLoader worker: the settings, not the live session
        return {**self.__dict__, "_client": None, "_pid": 0}

    # ---------------------------------------------------------------------------------------- requests
    def client(self) -> DICOMwebClient:
        """This process's client (a forked DataLoader worker gets its own session, not its parent's sockets)."""
        if self.url is None:
            raise DicomWebError("no DICOMweb server: give --dicomweb_url URL.")
        if self._client is None or self._pid != os.getpid():
            session = _Session()
            if self.auth == "basic":
                session.auth = (self.user, self._secret)
            elif self.auth == "bearer":
                session.headers["Authorization"] = f"Bearer {self._secret}"
            session.verify = self.ca_bundle or True
            # streamed in 64 KiB pieces (dicomweb-client's 1 MB would lose every instance of a small series to a cut)
            client = DICOMwebClient(self.url, session=session, timeout=self.timeout_s, chunk_size=2**16)
            client.set_http_retry_params(retry=False)  # one retry policy, ours, for every kind of failure
            self._client, self._pid = client, os.getpid()
        return self._client

    def request(self, what: str, url: str, call: Callable[[DICOMwebClient], T]) -> T:
        """``call(client)`` under the retry policy (scripts/common/retry.py); ``what`` and ``url`` say in messages what
        was asked of whom."""
        where = {"url": url}

        def attempt() -> T:
            try:
                return call(self.client())
            except requests.RequestException as err:
                where["url"] = getattr(getattr(err, "response", None), "url", None) or url
                transient, problem = self._diagnose(err, what)
                status = getattr(getattr(err, "response", None), "status_code", None)
                if not transient:
                    raise DicomWebError(self._redact(f"{what} {where['url']}: {problem}"), status) from None
                raise TransientError(self._redact(problem), _retry_after(err), status) from None

        try:
            return self.policy.call(self._redact(f"{what} {url}"), attempt)
        except GaveUpError as err:
            problem = f"{err.last}; gave up after {err.attempts} attempts: try again later, or raise dicomweb_retries"
            raise DicomWebError(self._redact(f"{what} {where['url']}: {problem}"), err.last.status) from None

    def _diagnose(self, err: Exception, what: str) -> tuple[bool, str]:
        """Whether another attempt may succeed, and the problem in words with what to do."""
        causes = list(_causes(err))
        if any(isinstance(e, ssl.SSLCertVerificationError) for e in causes):
            return False, (
                f"the server's HTTPS certificate is not trusted ({_short(err)}): if your organisation's CA "
                "signed it, give that CA's PEM file as --dicomweb_ca_bundle"
            )
        if isinstance(err, requests.exceptions.SSLError) and not any(isinstance(e, ssl.SSLEOFError) for e in causes):
            return False, (
                f"the HTTPS connection failed ({_short(err)}): check that the server speaks https at "
                "dicomweb_url (or http), and its certificate"
            )
        response = getattr(err, "response", None)
        if isinstance(err, requests.HTTPError) and response is not None:
            status = response.status_code
            said = f"HTTP {status} {response.reason or ''}".strip()
            body = _short(response.text, 200) if response.text else ""
            said += f" ({body})" if body else ""
            if status in TRANSIENT_STATUS:
                return True, said
            return False, f"{said}: {self._advice(status, what)}"
        if isinstance(err, requests.exceptions.ConnectTimeout):
            return True, f"no connection within {self.timeout_s:g} s"
        if isinstance(err, requests.exceptions.Timeout):
            return True, f"no answer within {self.timeout_s:g} s"
        if isinstance(err, (requests.exceptions.ChunkedEncodingError, requests.exceptions.SSLError)):
            return True, f"the connection was cut during the transfer ({_short(err)})"  # (SSL: an EOF mid-stream)
        if isinstance(err, requests.exceptions.ConnectionError):
            return True, f"cannot connect or the connection dropped ({_short(err)}); check dicomweb_url and the network"
        return False, _short(err)

    def _advice(self, status: int, what: str) -> str:
        if status == 401:
            where = {"basic": f"dicomweb_user {self.user!r} and the password", "bearer": "the token"}.get(self.auth)
            if where is None:
                return "the server wants credentials: set dicomweb_auth (basic or bearer) and the secret's source"
            return (
                f"the server refused {where} (dicomweb_auth {self.auth}; read from ${self._secret_env} or "
                "dicomweb_secret_file): check them"
            )
        if status == 403:
            return f"these credentials may not {what.split()[0]} here: ask the server's administrator for the right"
        if status == 404:
            return (
                "not found: check dicomweb_url (the DICOMweb root, e.g. https://pacs.example.org/dicom-web) and "
                "the UIDs"
            )
        if status == 400:
            return "the server refused the request: check dicomweb_query (attributes and values as QIDO-RS takes them)"
        if status in (405, 501):
            return "this server does not offer it (a read-only DICOMweb endpoint?)"
        if status == 409:
            return "the server refused to store these objects (conflict): see its log"
        if status == 413:
            return "the request is larger than the server accepts"
        return "see the server's log"

    def _redact(self, text: str) -> str:
        """``text`` without the secret, raw or as the basic-auth header carries it (no path should lead there;
        this makes sure)."""
        if self._secret:
            text = text.replace(self._secret, "***")
            if self.user is not None:
                text = text.replace(base64.b64encode(f"{self.user}:{self._secret}".encode()).decode(), "***")
        return text

    def study_url(self, study_uid: str, series_uid: str | None = None) -> str:
        return f"{self.url}/studies/{study_uid}" + (f"/series/{series_uid}" if series_uid else "")

    # ---------------------------------------------------------------------------------------- QIDO-RS, WADO-RS
    def find_studies(self, study_uids: Sequence[str] = (), query: Mapping[str, str] | None = None) -> list[dict]:
        """The studies (QIDO-RS, DICOM JSON) with these UIDs, then those matching ``query``, each once."""
        fields = [
            "StudyInstanceUID",
            "PatientID",
            "StudyDate",
            "StudyDescription",
            "AccessionNumber",
            "ModalitiesInStudy",
        ]
        studies: dict[str, dict] = {}
        for uid in study_uids:
            for study in self.request(
                "search for study",
                f"{self.url}/studies?StudyInstanceUID={uid}",
                lambda c, uid=uid: c.search_for_studies(search_filters={"StudyInstanceUID": uid}, fields=fields),
            ):
                studies.setdefault(first(study, "StudyInstanceUID"), study)
        if query:
            for study in self._search_pages(dict(query), fields):
                studies.setdefault(first(study, "StudyInstanceUID"), study)
        return list(studies.values())

    def _search_pages(self, query: dict[str, str], fields: list[str], page: int = 100) -> Iterator[dict]:
        """Every study matching ``query``, ``page`` at a time (a server that caps its answers is asked again from the
        offset reached; one that ignores the offset is noticed by the UIDs it repeats)."""
        seen: set[str] = set()
        offset = 0
        url = f"{self.url}/studies?" + "&".join(f"{k}={v}" for k, v in query.items())
        while True:
            found = self.request(
                "search for studies",
                url,
                lambda c, offset=offset: c.search_for_studies(
                    search_filters=query, fields=fields, limit=page, offset=offset
                ),
            )
            new = [s for s in found if first(s, "StudyInstanceUID") not in seen]
            yield from new
            seen.update(first(s, "StudyInstanceUID") for s in new)
            if len(found) < page or not new:
                return
            offset += len(found)

    def series_of(self, study_uid: str) -> list[dict]:
        """Every series of the study (QIDO-RS, DICOM JSON)."""
        fields = [
            "SeriesInstanceUID",
            "Modality",
            "SeriesNumber",
            "SeriesDescription",
            "NumberOfSeriesRelatedInstances",
        ]
        return self.request(
            "search for series",
            f"{self.study_url(study_uid)}/series",
            lambda c: c.search_for_series(study_uid, fields=fields),
        )

    def series_metadata(self, study_uid: str, series_uid: str) -> list[dict]:
        """Every instance's header in the series (WADO-RS metadata, DICOM JSON; no pixel data)."""
        return self.request(
            "retrieve metadata of",
            f"{self.study_url(study_uid, series_uid)}/metadata",
            lambda c: c.retrieve_series_metadata(study_uid, series_uid),
        )

    def retrieve_series(self, study_uid: str, series_uid: str, folder: str | Path, expected: int | None = None) -> Path:
        """The series' instances (WADO-RS, streamed, as stored) into ``folder``, one ``<SOPInstanceUID>.dcm`` each,
        each written to a temporary name and renamed when whole. A cut transfer is retried for the instances still
        missing only. Raises :class:`DicomWebError` when it cannot complete (``expected``: the number of instances
        the series holds)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        url = self.study_url(study_uid, series_uid)

        def fetch_missing(client: DICOMwebClient) -> None:
            have = {p.stem for p in folder.glob("*.dcm")}
            if not have:  # the whole series in one streamed answer
                stream = client.iter_series(study_uid, series_uid, media_types=AS_STORED)
            else:  # resume: only what is missing, instance by instance
                listed = client.search_for_instances(study_uid, series_uid, fields=["SOPInstanceUID"])
                missing = [first(i, "SOPInstanceUID") for i in listed if first(i, "SOPInstanceUID") not in have]
                logger.info("%s: %d instance(s) here, fetching the %d missing", url, len(have), len(missing))
                stream = (client.retrieve_instance(study_uid, series_uid, u, media_types=AS_STORED) for u in missing)
            for ds in stream:
                _write_instance(ds, folder)

        self.request("retrieve", url, fetch_missing)
        count = len(list(folder.glob("*.dcm")))
        if expected is not None and count < expected:  # an answer that ended early without an error: once more
            self.request("retrieve", url, fetch_missing)
            count = len(list(folder.glob("*.dcm")))
        if expected is not None and count < expected:
            raise DicomWebError(
                f"retrieve {url}: the server sent {count} of the series' {expected} instances; "
                "check the series on the server"
            )
        logger.info("%s: %d instance(s) retrieved into %s", url, count, folder)
        return folder

    # ---------------------------------------------------------------------------------------- results, STOW-RS
    def find_results(
        self, study_uid: str, source_series_uid: str, version: str, series: list[dict] | None = None
    ) -> list[dict]:
        """The bundle's results already in the study for this source series and version: every SEG, RTSTRUCT and SR
        whose algorithm (ManufacturerModelName and SoftwareVersions, or an SR's Algorithm Name and Version) is this
        bundle at ``version`` and which references the series. ``series``: the study's series if already listed."""
        found = []
        for item in self.series_of(study_uid) if series is None else series:
            if first(item, "Modality") not in RESULT_MODALITIES:
                continue
            for instance in self.series_metadata(study_uid, first(item, "SeriesInstanceUID")):
                if (ALGORITHM_NAME, str(version)) in algorithms(instance) and source_series_uid in referenced(
                    instance, "SeriesInstanceUID"
                ):
                    found.append(object_of(instance))
        return found

    def store(self, paths: Sequence[str | Path], study_uid: str) -> list[dict]:
        """Store the DICOM files ``paths`` into the study by STOW-RS, in one request, once each has been read and
        found to belong to the study; a transfer that fails is sent again whole (same SOP Instance UIDs: a server
        keeps one copy). Returns the objects stored; raises :class:`DicomWebStoreError` (nothing sent, or the server's
        answer instance by instance) otherwise."""
        url = f"{self.study_url(study_uid)} (STOW-RS)"
        datasets = []
        for path in paths:
            ds = pydicom.dcmread(path)
            if str(ds.get("StudyInstanceUID", "")) != study_uid:
                raise DicomWebStoreError(
                    f"store {url}: {path} belongs to study {ds.get('StudyInstanceUID')}; nothing was sent"
                )
            datasets.append(ds)
        try:
            answer = self.request("store into", url, lambda c: c.store_instances(datasets, study_uid))
        except DicomWebError as err:
            raise DicomWebStoreError(str(err), err.status) from None
        objects = {str(ds.SOPInstanceUID): object_of(ds) for ds in datasets}
        stored = {str(i.ReferencedSOPInstanceUID) for i in answer.get("ReferencedSOPSequence", [])}
        refused = {str(i.ReferencedSOPInstanceUID): i.get("FailureReason") for i in answer.get("FailedSOPSequence", [])}
        if refused or not set(objects) <= stored:
            kept = [objects[u]["modality"] for u in objects if u in stored]
            lost = [
                f"{o['modality']} {u} (failure reason {refused.get(u)})" for u, o in objects.items() if u not in stored
            ]
            raise DicomWebStoreError(
                f"store into {url}: the server did not store {', '.join(lost)}"
                + (f"; it did store the {', '.join(kept)}, which stay in the study" if kept else "; nothing was stored")
            )
        return list(objects.values())


class _Session(requests.Session):
    """A requests session in which a CA bundle set on it wins over ``REQUESTS_CA_BUNDLE``/``CURL_CA_BUNDLE`` in the
    environment (requests lets those replace a session's own ``verify``: psf/requests#3829)."""

    def merge_environment_settings(self, url, proxies, stream, verify, cert):
        settings = super().merge_environment_settings(url, proxies, stream, verify, cert)
        if isinstance(self.verify, str) and verify in (None, True):
            settings["verify"] = self.verify
        return settings


def _retry_after(err: Exception) -> float | None:
    """The seconds an answer's Retry-After header asks for (its date form is not used), or None."""
    value = str(getattr(getattr(err, "response", None), "headers", {}).get("Retry-After", "")).strip()
    return float(value) if value.isdigit() else None


def _checked_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise DicomWebError(
            f"dicomweb_url {url!r}: give the server's DICOMweb root, e.g. https://pacs.example.org/dicom-web"
        )
    if parts.username is not None or parts.password is not None:  # never echo it: it holds a secret
        raise DicomWebError(
            "dicomweb_url holds a user name or password: take it out; use dicomweb_auth basic with dicomweb_user, and "
            "the password in $DICOMWEB_PASSWORD or dicomweb_secret_file"
        )
    return url.rstrip("/")


def _read_secret(auth: str, env: str | None, file: str | Path | None) -> str:
    """The password or token: from the file if one is named, else from the environment variable."""
    if file not in (None, ""):
        path = Path(str(file))
        if not path.is_file():
            raise DicomWebError(f"dicomweb_secret_file {path}: no such file.")
        lines = path.read_text().splitlines()
        secret = lines[0].strip() if lines else ""
        if not secret:
            raise DicomWebError(f"dicomweb_secret_file {path} is empty; its first line should hold the secret.")
        return secret
    name = env or DEFAULT_SECRET_ENV[auth]
    secret = os.environ.get(name, "").strip()
    if not secret:
        raise DicomWebError(
            f"dicomweb_auth {auth}: set the {'password' if auth == 'basic' else 'token'} in the "
            f"environment variable {name} or name a file holding it with dicomweb_secret_file (never "
            "on the command line)"
        )
    return secret


def _write_instance(ds: pydicom.Dataset, folder: Path) -> Path:
    """One retrieved instance as ``<SOPInstanceUID>.dcm``, renamed into place when whole."""
    uid = str(ds.SOPInstanceUID)
    if not re.fullmatch(r"[0-9.]{1,64}", uid):
        raise DicomWebError(f"an instance with SOP Instance UID {uid!r} (not a UID) was sent; check the series")
    path = folder / f"{uid}.dcm"
    partial = folder / f".{uid}.part"
    ds.save_as(partial, enforce_file_format=True)
    os.replace(partial, path)
    return path


def _causes(error: BaseException) -> Iterator[BaseException]:
    """``error`` and every exception behind it: causes, contexts, arguments and urllib3's ``reason`` (requests wraps
    urllib3, which wraps the ssl module's errors)."""
    seen: set[int] = set()
    todo: list[Any] = [error]
    while todo:
        item = todo.pop()
        if not isinstance(item, BaseException) or id(item) in seen:
            continue
        seen.add(id(item))
        yield item
        todo += [item.__cause__, item.__context__, getattr(item, "reason", None), *item.args]


def _short(value: Any, size: int = 300) -> str:
    text = " ".join(str(value).split())
    return text if len(text) <= size else text[: size - 3] + "..."

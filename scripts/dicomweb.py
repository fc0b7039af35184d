"""Cases from a DICOMweb server (a PACS: Orthanc, dcm4chee, a cloud DICOM store), and their results stored back into
the study they came from.

* :class:`DicomWeb` is one server: its URL, the authentication (none, HTTP basic, or a bearer token -- the secret read
  from an environment variable or a file, never from the command line, never logged or reported), the CA bundle for
  HTTPS, and one retry policy for every request: time-outs, dropped connections and HTTP 408/429/5xx are retried with
  exponential back-off; 401, 403, 404 and the like raise a :class:`DicomWebError` at once, naming the URL and what to
  do. The client is ``dicomweb-client`` (one ``requests`` session per process).
* :func:`find_cases` turns StudyInstanceUIDs and/or a QIDO-RS query into cases, one per study, each with the CT series
  :func:`choose_series` picks by :class:`SeriesRules` (by default the thinnest axial series of at least 20 classic CT
  images, no localizer, no secondary capture), and writes the choice and the alternatives (each with why it was not
  chosen) into ``inference_report.json``. A study that is not found or has no usable CT series fails its ``check``
  there; with ``store``, a study where this version's results for the chosen series are already stored is skipped
  (not inferred again) unless forced.
* :class:`RetrieveSeriesd` -- the first step of a case's loading, so the next case downloads while the network runs --
  streams the chosen series by WADO-RS into a temporary folder, one file per instance, as stored on the server; after a
  cut transfer it fetches only the instances still missing. :meth:`RetrieveSeriesd.discard` removes the folder when
  the case is done (``CaseByCaseEvaluator(on_case_done=...)``), and whatever is left goes when the process ends.
* :class:`StoreResultsd` (after ``save_case``) stores the case's DICOM SEG, RTSTRUCT and SR by STOW-RS into the source
  study, in one request, once every object has been read and checked; a transfer that fails is retried with the same
  instances (STOW-RS stores an instance once, by its SOP Instance UID), so a retry completes the set rather than
  doubling it. A store that fails for good fails the case at stage ``store`` (:class:`DicomWebStoreError`) and the
  next case runs. As an evaluator handler it adds each case's store outcome to ``inference_report.json``.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import shutil
import ssl
import tempfile
import time
import weakref
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlsplit

import pydicom
import requests
from dicomweb_client.api import DICOMwebClient
from ignite.engine import Engine, Events
from monai.transforms import MapTransform
from pydicom.datadict import tag_for_keyword
from scripts.dicom.series_rules import InstanceHeader, SeriesRules, choose_series
from scripts.dicom.series_rules import describe_series as describe_rules_series
from scripts.files import safe_name, unique_name, write_json
from scripts.inputs import REPORT, write_report
from scripts.writers.seg import ALGORITHM_NAME

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
    """Storing a case's results failed; the case fails at this stage (see :class:`scripts.evaluators`)."""

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
        retries: int = 4,
        backoff_s: float = 1.0,
    ) -> None:
        self.url = None if url in (None, "") else _checked_url(str(url))
        self.auth = str(auth or "none").strip().lower()
        self.user = None if user is None else str(user)
        self.ca_bundle = None if ca_bundle in (None, "") else str(ca_bundle)
        self.timeout_s, self.retries, self.backoff_s = float(timeout_s), int(retries), float(backoff_s)
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
        """``call(client)`` under the retry policy; ``what`` and ``url`` say in messages what was asked of whom."""
        for attempt in range(self.retries + 1):
            try:
                return call(self.client())
            except requests.RequestException as err:
                url = getattr(getattr(err, "response", None), "url", None) or url
                transient, problem = self._diagnose(err, what)
                status = getattr(getattr(err, "response", None), "status_code", None)
                if not transient:
                    raise DicomWebError(self._redact(f"{what} {url}: {problem}"), status) from None
                if attempt == self.retries:
                    problem += f"; gave up after {attempt + 1} attempts: try again later, or raise dicomweb_retries"
                    raise DicomWebError(self._redact(f"{what} {url}: {problem}"), status) from None
                wait = self._wait(err, attempt)
                logger.warning(self._redact(f"{what} {url}: {problem}; retry {attempt + 1} of {self.retries} in "
                                            f"{wait:.1f} s"))  # fmt: skip
                time.sleep(wait)
        raise AssertionError("unreachable")

    def _diagnose(self, err: Exception, what: str) -> tuple[bool, str]:
        """Whether another attempt may succeed, and the problem in words with what to do."""
        causes = list(_causes(err))
        if any(isinstance(e, ssl.SSLCertVerificationError) for e in causes):
            return False, (f"the server's HTTPS certificate is not trusted ({_short(err)}): if your organisation's CA "
                           "signed it, give that CA's PEM file as --dicomweb_ca_bundle")  # fmt: skip
        if isinstance(err, requests.exceptions.SSLError) and not any(isinstance(e, ssl.SSLEOFError) for e in causes):
            return False, (f"the HTTPS connection failed ({_short(err)}): check that the server speaks https at "
                           "dicomweb_url (or http), and its certificate")  # fmt: skip
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
            return (f"the server refused {where} (dicomweb_auth {self.auth}; read from ${self._secret_env} or "
                    "dicomweb_secret_file): check them")  # fmt: skip
        if status == 403:
            return f"these credentials may not {what.split()[0]} here: ask the server's administrator for the right"
        if status == 404:
            return ("not found: check dicomweb_url (the DICOMweb root, e.g. https://pacs.example.org/dicom-web) and "
                    "the UIDs")  # fmt: skip
        if status == 400:
            return "the server refused the request: check dicomweb_query (attributes and values as QIDO-RS takes them)"
        if status in (405, 501):
            return "this server does not offer it (a read-only DICOMweb endpoint?)"
        if status == 409:
            return "the server refused to store these objects (conflict): see its log"
        if status == 413:
            return "the request is larger than the server accepts"
        return "see the server's log"

    def _wait(self, err: Exception, attempt: int) -> float:
        wait = self.backoff_s * 2**attempt
        retry_after = getattr(getattr(err, "response", None), "headers", {}).get("Retry-After", "")
        return max(wait, min(float(retry_after), 60.0)) if str(retry_after).isdigit() else wait

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
        fields = ["StudyInstanceUID", "PatientID", "StudyDate", "StudyDescription", "AccessionNumber",
                  "ModalitiesInStudy"]  # fmt: skip
        studies: dict[str, dict] = {}
        for uid in study_uids:
            for study in self.request("search for study", f"{self.url}/studies?StudyInstanceUID={uid}",
                                      lambda c, uid=uid: c.search_for_studies(search_filters={"StudyInstanceUID": uid},
                                                                              fields=fields)):  # fmt: skip
                studies.setdefault(_first(study, "StudyInstanceUID"), study)
        if query:
            for study in self._search_pages(dict(query), fields):
                studies.setdefault(_first(study, "StudyInstanceUID"), study)
        return list(studies.values())

    def _search_pages(self, query: dict[str, str], fields: list[str], page: int = 100) -> Iterator[dict]:
        """Every study matching ``query``, ``page`` at a time (a server that caps its answers is asked again from the
        offset reached; one that ignores the offset is noticed by the UIDs it repeats)."""
        seen: set[str] = set()
        offset = 0
        url = f"{self.url}/studies?" + "&".join(f"{k}={v}" for k, v in query.items())
        while True:
            found = self.request("search for studies", url, lambda c, offset=offset: c.search_for_studies(
                search_filters=query, fields=fields, limit=page, offset=offset))  # fmt: skip
            new = [s for s in found if _first(s, "StudyInstanceUID") not in seen]
            yield from new
            seen.update(_first(s, "StudyInstanceUID") for s in new)
            if len(found) < page or not new:
                return
            offset += len(found)

    def series_of(self, study_uid: str) -> list[dict]:
        """Every series of the study (QIDO-RS, DICOM JSON)."""
        fields = ["SeriesInstanceUID", "Modality", "SeriesNumber", "SeriesDescription",
                  "NumberOfSeriesRelatedInstances"]  # fmt: skip
        return self.request("search for series", f"{self.study_url(study_uid)}/series",
                            lambda c: c.search_for_series(study_uid, fields=fields))  # fmt: skip

    def series_metadata(self, study_uid: str, series_uid: str) -> list[dict]:
        """Every instance's header in the series (WADO-RS metadata, DICOM JSON; no pixel data)."""
        return self.request("retrieve metadata of", f"{self.study_url(study_uid, series_uid)}/metadata",
                            lambda c: c.retrieve_series_metadata(study_uid, series_uid))  # fmt: skip

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
                missing = [_first(i, "SOPInstanceUID") for i in listed if _first(i, "SOPInstanceUID") not in have]
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
            raise DicomWebError(f"retrieve {url}: the server sent {count} of the series' {expected} instances; "
                                "check the series on the server")  # fmt: skip
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
            if _first(item, "Modality") not in RESULT_MODALITIES:
                continue
            for instance in self.series_metadata(study_uid, _first(item, "SeriesInstanceUID")):
                if (ALGORITHM_NAME, str(version)) in _algorithms(instance) and source_series_uid in _referenced(
                    instance, "SeriesInstanceUID"
                ):
                    found.append(_object(instance))
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
                raise DicomWebStoreError(f"store {url}: {path} belongs to study {ds.get('StudyInstanceUID')}; nothing "
                                         "was sent")  # fmt: skip
            datasets.append(ds)
        try:
            answer = self.request("store into", url, lambda c: c.store_instances(datasets, study_uid))
        except DicomWebError as err:
            raise DicomWebStoreError(str(err), err.status) from None
        objects = {str(ds.SOPInstanceUID): _object(ds) for ds in datasets}
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


def _checked_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise DicomWebError(f"dicomweb_url {url!r}: give the server's DICOMweb root, e.g. https://pacs.example.org/"
                            "dicom-web")  # fmt: skip
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
        raise DicomWebError(f"dicomweb_auth {auth}: set the {'password' if auth == 'basic' else 'token'} in the "
                            f"environment variable {name} or name a file holding it with dicomweb_secret_file (never "
                            "on the command line)")  # fmt: skip
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


# ------------------------------------------------------------------------------------------------ DICOM JSON
def _tag(keyword: str) -> str:
    return f"{tag_for_keyword(keyword):08X}"


def _values(item: Mapping, keyword: str) -> list:
    return list((item.get(_tag(keyword)) or {}).get("Value") or [])


def _first(item: Mapping, keyword: str, default: Any = None) -> Any:
    values = _values(item, keyword)
    return values[0] if values else default


def _walk(item: Mapping) -> Iterator[Mapping]:
    """``item`` and every item nested in its sequences (DICOM JSON)."""
    yield item
    for element in item.values():
        if isinstance(element, Mapping) and element.get("vr") == "SQ":
            for sub in element.get("Value") or []:
                yield from _walk(sub)


def _referenced(instance: Mapping, keyword: str) -> set[str]:
    """Every value of ``keyword`` in the items nested in the instance's sequences (its references)."""
    return {str(v) for item in _walk(instance) if item is not instance for v in _values(item, keyword)}


def _code(item: Mapping) -> str | None:
    return _first(_first(item, "ConceptNameCodeSequence", {}) or {}, "CodeValue")


def _algorithms(instance: Mapping) -> set[tuple[str, str]]:
    """(name, version) of the algorithms an object says made it: ManufacturerModelName with SoftwareVersions (SEG,
    RTSTRUCT), and an SR's Algorithm Name (DCM 111001) with its Algorithm Version (111003)."""
    found = {(str(_first(instance, "ManufacturerModelName")), str(_first(instance, "SoftwareVersions")))}
    for item in _walk(instance):
        texts = {_code(c): _first(c, "TextValue") for c in _values(item, "ContentSequence")}
        if texts.get("111001"):
            found.add((str(texts["111001"]), str(texts.get("111003"))))
    return found


def _object(instance: Mapping | pydicom.Dataset) -> dict:
    """Modality, series and SOP Instance UID of a DICOM JSON header or a dataset (what the report names)."""
    if isinstance(instance, pydicom.Dataset):
        keys = (instance.get("Modality"), instance.get("SeriesInstanceUID"), instance.get("SOPInstanceUID"))
    else:
        keys = (_first(instance, "Modality"), _first(instance, "SeriesInstanceUID"), _first(instance, "SOPInstanceUID"))
    return {"modality": str(keys[0]), "series_uid": str(keys[1]), "sop_uid": str(keys[2])}


# ------------------------------------------------------------------------------------------------ choosing a series
def describe_series(series: Mapping, instances: Sequence[Mapping] | None) -> dict:
    """:func:`scripts.dicom.series_rules.describe_series` of a series from its QIDO-RS record and, when examined, its
    instances' headers (WADO-RS metadata, DICOM JSON)."""
    summary = {"series_uid": str(_first(series, "SeriesInstanceUID")), "modality": str(_first(series, "Modality", "")),
               "number": _first(series, "SeriesNumber"), "description": _first(series, "SeriesDescription", ""),
               "images": _first(series, "NumberOfSeriesRelatedInstances", 0)}  # fmt: skip
    headers = None if instances is None else [
        InstanceHeader(str(_first(i, "SOPClassUID")), tuple(str(v) for v in _values(i, "ImageType")),
                       tuple(float(v) for v in _values(i, "ImageOrientationPatient")),
                       tuple(float(v) for v in _values(i, "ImagePositionPatient")))
        for i in instances
    ]  # fmt: skip
    return describe_rules_series(summary, headers)


# ------------------------------------------------------------------------------------------------ cases
def find_cases(
    server: DicomWeb,
    study_uids: str | Sequence[str] | None = None,
    query: Mapping[str, Any] | str | None = None,
    series_rules: SeriesRules | Mapping | None = None,
    report_dir: str | Path | None = None,
    store: bool = False,
    force_store: bool = False,
    algorithm_version: str | None = None,
) -> list[dict]:
    """Cases on the server, one per study (``study_uids`` and/or those the QIDO-RS ``query`` finds, e.g.
    ``{"ModalitiesInStudy": "CT", "StudyDate": "20250101-20250131"}``), each
    ``{"case_id", "image", "source": "dicom", "source_path", "study_uid", "series_uid", "instances"}`` with the CT
    series :func:`choose_series` picks (``image`` is the series' URL until :class:`RetrieveSeriesd` brings it here).

    A study that is not found, or whose CT series all break the rules, fails its ``check`` (the reason lists each
    series and why); a study the query found without any CT series is skipped, and so is one whose results for the
    chosen series are already stored by this ``algorithm_version`` when ``store`` is on and not ``force_store``. With
    ``report_dir`` all of it goes to ``<report_dir>/inference_report.json``: the choice and the alternatives of
    every study. A failing request to the server (credentials, certificate, URL) raises :class:`DicomWebError`.
    """
    if server.url is None:
        raise DicomWebError("no DICOMweb server: give --dicomweb_url URL.")
    uids = _study_uids(study_uids)
    filters = _query(query)
    if not uids and not filters:
        raise DicomWebError("--dicomweb_url needs --study_uids \"['1.2.3']\" or --dicomweb_query, e.g. "
                            "\"{'ModalitiesInStudy':'CT','StudyDate':'20250101-20250131'}\"")  # fmt: skip
    rules = SeriesRules.of(series_rules)
    studies = server.find_studies(uids, filters)
    found = {_first(s, "StudyInstanceUID") for s in studies}
    records, failed, skipped, names = [], [], [], set()
    for uid in uids:
        if uid not in found:
            failed.append({"case_id": uid, "image": server.study_url(uid), "source": "dicom", "status": "failed",
                           "stage": "check", "reason": f"study {uid}: not found on {server.url} (QIDO-RS found no "
                           "study with this StudyInstanceUID)"})  # fmt: skip
    for study in studies:
        case_id = _case_id(study, names)
        record, problem = _study_case(server, study, case_id, rules, store and not force_store, algorithm_version)
        if problem is None:
            records.append(record)
        elif problem == "skipped" or (problem == "no CT" and _first(study, "StudyInstanceUID") not in uids):
            skipped.append({"input": record["image"], "case_id": case_id, "reason": record["reason"]})
        else:
            failed.append({**record, "status": "failed", "stage": "check"})
    for entry in failed:
        logger.error("failed: %s", entry["reason"])
    for entry in skipped:
        logger.warning("skipped: %s", entry["reason"])
    if report_dir is not None:
        report = {"dicomweb_url": server.url, "study_uids": uids, "dicomweb_query": filters}
        write_report(
            report_dir, {**report, "series_rules": asdict(rules), "cases": records + failed, "skipped": skipped}
        )
    if not studies and not uids:
        logger.warning("the query %s found no study on %s", filters, server.url)
    logger.info("%d case(s) to infer from %s; %d failed their check, %d skipped", len(records), server.url, len(failed),
                len(skipped))  # fmt: skip
    keep = ("case_id", "image", "source", "source_path", "study_uid", "series_uid", "instances")
    return [{k: r[k] for k in keep} for r in records]


def _study_case(
    server: DicomWeb, study: Mapping, case_id: str, rules: SeriesRules, dedup: bool, version: str | None
) -> tuple[dict, str | None]:
    """The case record of one study, and None, or a problem (``failed``, ``no CT``, ``skipped``) with its reason in
    the record."""
    uid = str(_first(study, "StudyInstanceUID"))
    record: dict[str, Any] = {"case_id": case_id, "image": server.study_url(uid), "source": "dicom", "study_uid": uid,
                              "study": _study_summary(study)}  # fmt: skip
    try:
        series = server.series_of(uid)
        described = []
        for item in (s for s in series if _first(s, "Modality") == "CT"):
            enough = int(_first(item, "NumberOfSeriesRelatedInstances", rules.min_slices) or 0) >= rules.min_slices
            headers = server.series_metadata(uid, _first(item, "SeriesInstanceUID")) if enough else None
            described.append(describe_series(item, headers))
        chosen, alternatives = choose_series(described, rules)
        record["alternatives"] = alternatives
        if chosen is None:
            listed = "; ".join(f"series {a['number']} {a['description']!r}: {a['reason']}" for a in alternatives)
            record["reason"] = f"study {uid} ({case_id}): " + (
                f"no usable CT series ({listed})" if alternatives else "no CT series"
            )
            return record, "failed" if alternatives else "no CT"
        series_url = server.study_url(uid, chosen["series_uid"])
        record.update(image=series_url, source_path=series_url, series_uid=chosen["series_uid"],
                      instances=chosen["images"], series=chosen)  # fmt: skip
        if dedup:
            there = server.find_results(uid, chosen["series_uid"], str(version), series)
            if there:
                kinds = ", ".join(f"{o['modality']} {o['sop_uid']}" for o in there)
                record["reason"] = (f"study {uid} ({case_id}): {ALGORITHM_NAME} {version}'s results for series "
                                    f"{chosen['series_uid']} are already stored ({kinds}): not inferred again "
                                    "(--force_store true infers and stores again)")  # fmt: skip
                return record, "skipped"
    except DicomWebError as err:
        if err.status in (401, 403):
            raise  # the credentials: no other study will do better
        record["reason"] = f"study {uid} ({case_id}): {err}"
        return record, "failed"
    return record, None


def _study_summary(study: Mapping) -> dict:
    return {"patient_id": str(_first(study, "PatientID", "") or ""), "date": str(_first(study, "StudyDate", "") or ""),
            "description": str(_first(study, "StudyDescription", "") or ""),
            "accession": str(_first(study, "AccessionNumber", "") or "")}  # fmt: skip


def _case_id(study: Mapping, taken: set[str]) -> str:
    """``<PatientID>_<StudyDate>`` in characters every file system takes (``_2``, ``_3``, ... when repeated)."""
    parts = [str(_first(study, "PatientID", "") or "study"), str(_first(study, "StudyDate", "") or "")]
    return unique_name(safe_name("_".join(p for p in parts if p)), taken)


def _study_uids(value: str | Sequence[str] | None) -> list[str]:
    """StudyInstanceUIDs from the config: a list, or one string (several separated by commas or spaces)."""
    if value is None or value == "":
        return []
    items = re.split(r"[,\s]+", value) if isinstance(value, str) else [str(v) for v in value]
    uids = list(dict.fromkeys(u.strip() for u in items if u.strip()))
    bad = [u for u in uids if not re.fullmatch(r"[0-9]+(\.[0-9]+)+", u)]
    if bad:
        raise DicomWebError(f"study_uids: {bad} are not UIDs (digits and dots, e.g. 1.2.840.113619.2.55.3)")
    return uids


def _query(value: Mapping[str, Any] | str | None) -> dict[str, str]:
    """QIDO-RS filters from the config: a mapping, or ``key=value&key=value``."""
    if value is None or value == "":
        return {}
    pairs = parse_qsl(value, strict_parsing=True) if isinstance(value, str) else dict(value).items()
    return {str(k): ",".join(map(str, v)) if isinstance(v, list | tuple) else str(v) for k, v in pairs}


# ------------------------------------------------------------------------------------------------ transforms
class RetrieveSeriesd(MapTransform):
    """Bring a case's series from the server into a temporary folder (:meth:`DicomWeb.retrieve_series`) and put the
    folder under ``keys`` and ``source_path``, where :class:`scripts.inputs.LoadCased` and the writers read it. A
    retrieval that fails removes its folder and raises (the case fails; the others go on). The folders live under one
    temporary folder made here, removed with whatever is left when this process ends."""

    def __init__(self, server: DicomWeb, keys: Any = "image", temp_dir: str | Path | None = None) -> None:
        super().__init__(keys)
        self.server = server
        self.root: Path | None = None
        if server.url is not None:  # made by the main process, before DataLoader workers start: theirs too
            self.root = Path(tempfile.mkdtemp(prefix="nsclc-dicomweb-", dir=temp_dir))
            weakref.finalize(self, _remove_own_folder, self.root, os.getpid())

    def __call__(self, data: Mapping[Hashable, Any]) -> dict:
        d = dict(data)
        if self.root is None:
            raise DicomWebError("no DICOMweb server to retrieve from: give --dicomweb_url URL.")
        folder = self.root / str(d["case_id"])
        try:
            self.server.retrieve_series(d["study_uid"], d["series_uid"], folder, d.pop("instances", None))
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        for key in self.key_iterator(d):
            d[key] = str(folder)
        d["source_path"] = str(folder)
        return d

    def discard(self, case: Mapping) -> None:
        """Remove the case's retrieved series (anything else is left alone)."""
        path = Path(str(case.get("source_path", "")))
        if self.root is not None and path.parent == self.root:
            shutil.rmtree(path, ignore_errors=True)


def _remove_own_folder(path: Path, owner: int) -> None:
    if os.getpid() == owner:  # never from a DataLoader worker that inherited the object
        shutil.rmtree(path, ignore_errors=True)


class StoreResultsd(MapTransform):
    """After ``save_case``: store the case's DICOM SEG, RTSTRUCT and SR (``<keys>_files``) into its study
    (:meth:`DicomWeb.store`), unless this ``algorithm_version``'s results for its series are there already (checked
    just before; ``force`` stores anyway). Also an evaluator handler: each case's outcome -- ``stored`` (the objects)
    or ``already_stored`` (those found) -- goes into ``<output_dir>/inference_report.json`` as the case's ``store``.
    """

    def __init__(
        self,
        server: DicomWeb,
        algorithm_version: str,
        output_dir: str | Path,
        keys: Any = "pred",
        enabled: bool = True,
        force: bool = False,
    ) -> None:
        super().__init__(keys)
        if enabled and server.url is None:
            raise DicomWebError("--store true stores into a DICOMweb server: give --dicomweb_url URL.")
        self.server, self.version, self.output_dir = server, str(algorithm_version), Path(output_dir)
        self.enabled, self.force = bool(enabled), bool(force)
        self.outcomes: dict[str, dict] = {}

    def __call__(self, data: Mapping[Hashable, Any]) -> dict:
        d = dict(data)
        if not self.enabled:
            return d
        files = {kind: path for key in self.keys for kind, path in (d.get(f"{key}_files") or {}).items()}
        paths = [files[kind] for kind in ("dicom_seg", "rtstruct", "sr") if kind in files]
        study, series, case_id = str(d["study_uid"]), str(d["series_uid"]), str(d["case_id"])
        outcome: dict[str, Any] = {"url": self.server.study_url(study)}
        if not paths:
            outcome.update(status="nothing_to_store", reason="no DICOM object was written (write_dicom_seg, ...)")
        elif not self.force and (there := self.server.find_results(study, series, self.version)):
            outcome.update(status="already_stored", objects=there)
            logger.warning("%s: %s %s's results for series %s are already in study %s: not stored again", case_id,
                           ALGORITHM_NAME, self.version, series, study)  # fmt: skip
        else:
            try:
                outcome.update(status="stored", objects=self.server.store(paths, study))
            except DicomWebError as err:
                where = Path(paths[0]).parent
                message = f"{err}. The case's results are in {where}; a new run stores them"
                raise DicomWebStoreError(message, err.status) from None
            logger.info("%s: stored %s into %s", case_id, ", ".join(o["modality"] for o in outcome["objects"]),
                        outcome["url"])  # fmt: skip
        self.outcomes[case_id] = outcome
        return d

    def attach(self, engine: Engine) -> None:
        """Record the outcomes after every case and at the end (listed after ``InferenceSummary``, which rewrites the
        report each time)."""
        engine.add_event_handler(Events.ITERATION_COMPLETED, self._record)
        engine.add_event_handler(Events.COMPLETED, self._record)

    def _record(self, engine: Engine) -> None:
        path = self.output_dir / REPORT
        if not self.outcomes or not path.is_file():
            return
        report = json.loads(path.read_text())
        for case in report.get("cases", []):
            if case.get("case_id") in self.outcomes:
                case["store"] = self.outcomes[case["case_id"]]
        write_json(path, report)

"""scripts.inference.dicomweb against a real DICOMweb server, and inference from a PACS and back through the bundle's
workflow.

The server is Orthanc with its DICOMweb plugin (Debian's ``orthanc`` and ``orthanc-dicomweb``), started here once for
the module on 127.0.0.1 at a free port, with its own storage folder and configuration and HTTP basic authentication.
The clients reach it over HTTPS through :class:`Gateway`, a TLS front in this module (Python's ``ssl``, a self-signed
certificate made by ``openssl``; the clients trust it through ``dicomweb_ca_bundle``), as nginx fronts an Orthanc in
production: Debian 12's Orthanc 1.10.1 cannot serve HTTPS itself -- its civetweb 1.15 looks up OpenSSL 1.1's
``SSL_get_peer_certificate``, which OpenSSL 3 does not have, and the server dies of a segmentation fault (a call
through a null pointer) at the first HTTPS connection. A second gateway stands for a token-checking gateway (Orthanc
has no bearer tokens): it answers 401 unless ``Authorization: Bearer <token>`` comes with the request, and forwards
what passes with Orthanc's basic credentials. Both gateways inject the faults of a network on demand: an answer cut
in the middle, or a refusal.

Synthetic studies (``scripts.data.synthetic``, 64x64 pixels) are uploaded by STOW-RS once; the bundle's inference
workflow runs twice (the demo-sized network with random weights): by StudyInstanceUIDs with basic authentication, then
by a QIDO-RS query (modality CT, a date range) with a bearer token. The results are found again by QIDO-RS in the same
studies and read back with highdicom. The query runs once more as a cohort in two parts into one folder, each part
taking its studies by their instances, and a part run again finds its cases done earlier. Without Orthanc, its plugin
or openssl the server tests are skipped with the reason; ``.ci/run`` installs them.
"""

from __future__ import annotations

import contextlib
import copy
import csv
import glob
import json
import logging
import re
import shutil
import socket
import ssl
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import highdicom as hd
import numpy as np
import pydicom
import pytest
import requests
from conftest import ROOT, bundle_run, save_weights
from dicomweb_client.api import DICOMwebClient
from pydicom.uid import generate_uid
from scripts.inference.dicomweb import DicomWeb, DicomWebError, DicomWebStoreError, RetrieveSeriesd, StoreResultsd

ORTHANC = shutil.which("Orthanc") or shutil.which("Orthanc", path="/usr/sbin:/sbin")
PLUGIN = next(iter(sorted(glob.glob("/usr/share/orthanc/plugins/libOrthancDicomWeb.so*")
                          + glob.glob("/usr/lib/orthanc/libOrthancDicomWeb.so*"))), None)  # fmt: skip
OPENSSL = shutil.which("openssl")
MISSING = [name for name, found in (("orthanc", ORTHANC), ("orthanc-dicomweb", PLUGIN), ("openssl", OPENSSL))
           if not found]  # fmt: skip
needs_orthanc = pytest.mark.skipif(
    bool(MISSING),
    reason=f"needs Debian's {', '.join(MISSING)} (apt-get install orthanc orthanc-dicomweb openssl; .ci/run does)",
)

USER, PASSWORD, TOKEN = "radiology", "orthanc-pw-7d1e", "tok-3f9a61c2-never-logged"
SHAPE = (64, 64, 24)  # small CTs: the demo-sized network runs them in a second or two
# the demo-sized network, run by PyTorch (no ONNX export: the run is about DICOMweb, not the backend)
NETWORK = ["--feature_size", "12", "--roi_size", "[64,64,32]", "--spacing", "[2.0,2.0,3.0]", "--sw_batch_size", "1",
           "--inference_backend", "torch"]  # fmt: skip
RUN_DATE = "20250315"  # the studies the workflow infers; the other tests' studies are dated 2024
VERSION = json.loads((ROOT / "configs" / "metadata.json").read_text())["version"]


# ------------------------------------------------------------------------------------------ settings and secrets
def test_a_pacs_series_tilted_as_scanners_write_it_is_chosen_by_the_same_rule_as_a_folder():
    """WADO-RS metadata (DICOM JSON) of a GE-style tilted series (tilted planes, positions along z, GantryDetectorTilt)
    and of an oblique reformat: the rule folders use takes the first as axial with its angle, the second not."""
    from dicom_factory import Series, ct_slice
    from scripts.data.dicom.series_rules import choose_series
    from scripts.inference.dicomweb import describe_series

    def metadata(**options) -> list[dict]:
        series = Series(**options)
        return [ct_slice(series, k).to_json_dict() for k in range(series.shape[2])]

    record = {"0020000E": {"vr": "UI", "Value": ["1.2.3"]}, "00080060": {"vr": "CS", "Value": ["CT"]}}
    tilted = describe_series(record, metadata(tilt_deg=18.5, tilt_form="scanner"))
    assert tilted["orientation"] == "axial" and "gantry tilt of 18.5 deg" in tilted["geometry"]
    assert "GantryDetectorTilt 18.5" in tilted["geometry"] and choose_series([tilted])[0] is not None
    reformat = describe_series(record, metadata(tilt_deg=18.5, tilt_form="reformat", patient_id="R"))
    assert choose_series([reformat])[0] is None and "oblique reformat" in reformat["geometry"]


def test_credentials_come_from_the_environment_or_a_file_and_never_from_the_url(tmp_path, monkeypatch):
    monkeypatch.delenv("DICOMWEB_PASSWORD", raising=False)
    with pytest.raises(DicomWebError, match=r"environment variable DICOMWEB_PASSWORD .*never on the command line"):
        DicomWeb("https://pacs.example.org/dicom-web", auth="basic", user="alice")
    with pytest.raises(DicomWebError, match="needs dicomweb_user"):
        DicomWeb("https://pacs.example.org/dicom-web", auth="basic")
    with pytest.raises(DicomWebError) as refused:
        DicomWeb("https://alice:hunter2@pacs.example.org/dicom-web")
    assert "hunter2" not in str(refused.value) and "take it out" in str(refused.value)
    monkeypatch.setenv("MY_TOKEN", "from-env")
    assert DicomWeb("https://pacs.example.org/dicom-web", auth="bearer", secret_env="MY_TOKEN")._secret == "from-env"
    (tmp_path / "token").write_text("from-file\n")
    server = DicomWeb("https://pacs.example.org/dicom-web", auth="bearer", secret_file=tmp_path / "token")
    assert server._secret == "from-file" and "from-file" not in repr(server)
    with pytest.raises(DicomWebError, match="choose one of none, basic, bearer"):
        DicomWeb("https://pacs.example.org/dicom-web", auth="kerberos")
    with pytest.raises(DicomWebError, match=r"dicomweb_ca_bundle .*: no such file"):
        DicomWeb("https://pacs.example.org/dicom-web", ca_bundle=tmp_path / "missing.pem")
    assert DicomWeb(None).url is None, "no URL: an inactive server (inference from --input_dir)"


# ------------------------------------------------------------------------------------------ Orthanc and the proxy
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def orthanc(tmp_path_factory):
    """Orthanc with DICOMweb on http://127.0.0.1:<free port>/dicom-web and basic authentication, stopped at the end.
    (Orthanc 1.10 has no bind address: it listens on every interface and answers local clients only,
    ``RemoteAccessAllowed: false``.)"""
    if MISSING:
        pytest.skip(f"needs Debian's {', '.join(MISSING)} (apt-get install orthanc orthanc-dicomweb openssl)")
    base = tmp_path_factory.mktemp("orthanc")
    port = free_port()
    config = {
        "Name": "bundle-tests", "StorageDirectory": str(base / "db"), "IndexDirectory": str(base / "db"),
        "HttpPort": port, "DicomServerEnabled": False, "RemoteAccessAllowed": False, "AuthenticationEnabled": True,
        "RegisteredUsers": {USER: PASSWORD}, "HttpCompressionEnabled": False, "SaveJobs": False,
        "HttpThreadsCount": 8, "Plugins": [PLUGIN],
        "DicomWeb": {"Enable": True, "Root": "/dicom-web/", "EnableWado": False, "StudiesMetadata": "Full",
                     "SeriesMetadata": "Full"},
    }  # fmt: skip
    (base / "orthanc.json").write_text(json.dumps(config))
    log = open(base / "orthanc.log", "w")  # noqa: SIM115 (open for the server's lifetime)
    process = subprocess.Popen([ORTHANC, str(base / "orthanc.json")], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(requests.RequestException):
                if requests.get(f"{url}/system", auth=(USER, PASSWORD), timeout=5).ok:
                    break
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"Orthanc did not start: {(base / 'orthanc.log').read_text()[-3000:]}")
            time.sleep(0.2)
        yield {"url": f"{url}/dicom-web", "base": base}
    finally:
        process.terminate()
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> dict[str, str]:
    """A self-signed certificate for 127.0.0.1 (its own CA: the file the clients are given as the CA bundle)."""
    if MISSING:
        pytest.skip(f"needs Debian's {', '.join(MISSING)}")
    base = tmp_path_factory.mktemp("tls")
    cert, key = base / "cert.pem", base / "key.pem"
    subprocess.run([OPENSSL, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "2", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)  # fmt: skip
    return {"cert": str(cert), "key": str(key)}


class Gateway(ThreadingHTTPServer):
    """HTTPS in front of Orthanc on https://127.0.0.1:<port>/dicom-web (see the module docstring). Without ``token``
    the client's Authorization goes through to Orthanc, which checks it; with ``token``, a request without
    ``Authorization: Bearer <token>`` gets 401 and the others go on with Orthanc's basic credentials. ``faults``:
    ``[pattern, action, times]`` -- a request whose ``"<METHOD> <path>"`` matches the pattern gets, ``times`` times,
    the action: ``"cut"`` (Orthanc's answer, cut after half its body) or an HTTP status."""

    daemon_threads = True

    def __init__(self, upstream: str, certificate: dict[str, str], token: str | None = None) -> None:
        super().__init__(("127.0.0.1", 0), GatewayHandler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(certificate["cert"], certificate["key"])
        self.socket = context.wrap_socket(self.socket, server_side=True)
        self.upstream, self.token = upstream.rstrip("/"), token
        self.faults: list[list] = []
        self.authorized = 0
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.server_address[1]}/dicom-web"

    def fault_for(self, request: str) -> str | int | None:
        with self.lock:
            for fault in self.faults:
                if fault[2] > 0 and re.search(fault[0], request):
                    fault[2] -= 1
                    return fault[1]
        return None


class GatewayHandler(BaseHTTPRequestHandler):
    server: Gateway

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_GET(self) -> None:  # noqa: N802, RUF100 (http.server's name; flake8's pep8-naming flags it)
        self.forward()

    def do_POST(self) -> None:  # noqa: N802, RUF100 (http.server's name; flake8's pep8-naming flags it)
        self.forward()

    def forward(self) -> None:
        body = self.body()
        headers = {k: v for k, v in self.headers.items() if k.lower() in ("accept", "content-type", "authorization")}
        auth = None
        if self.server.token is not None:
            if headers.pop("Authorization", None) != f"Bearer {self.server.token}":
                return self.answer(401, b"bearer token required", {"WWW-Authenticate": "Bearer"})
            auth = (USER, PASSWORD)
            with self.server.lock:
                self.server.authorized += 1
        fault = self.server.fault_for(f"{self.command} {self.path}")
        if isinstance(fault, int):
            return self.answer(fault, b"refused by the test's gateway")
        upstream = requests.request(self.command, self.server.upstream + self.path.removeprefix("/dicom-web"),
                                    data=body, headers=headers, auth=auth, timeout=60)  # fmt: skip
        content = upstream.content
        keep = {k: v for k, v in upstream.headers.items() if k.lower() in ("content-type", "www-authenticate")}
        if fault == "cut":  # the status line, the headers with the full length, half the body, then the end
            self.send_response(upstream.status_code)
            for k, v in {**keep, "Content-Length": str(len(content))}.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(content[: len(content) // 2])
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True
            return None
        return self.answer(upstream.status_code, content, keep)

    def body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            parts = []
            while (size := int(self.rfile.readline().strip().split(b";")[0], 16)) > 0:
                parts.append(self.rfile.read(size))
                self.rfile.readline()
            self.rfile.readline()
            return b"".join(parts)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def answer(self, status: int, content: bytes, headers: dict | None = None) -> None:
        self.send_response(status)
        for k, v in {**(headers or {}), "Content-Length": str(len(content))}.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(content)


@contextlib.contextmanager
def serving(server: Gateway):
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def gateway(orthanc, certificate):
    """The HTTPS DICOMweb endpoint with basic authentication (checked by Orthanc)."""
    with serving(Gateway(orthanc["url"], certificate)) as server:
        yield server


@pytest.fixture(scope="module")
def token_gateway(orthanc, certificate):
    """The HTTPS DICOMweb endpoint that takes a bearer token."""
    with serving(Gateway(orthanc["url"], certificate, TOKEN)) as server:
        yield server


def admin(orthanc) -> DICOMwebClient:
    """A plain dicomweb-client on Orthanc itself (uploads and checks), independent of the code under test."""
    session = requests.Session()
    session.auth = (USER, PASSWORD)
    return DICOMwebClient(orthanc["url"], session=session)


def server_of(gateway: Gateway, certificate: dict, **kwargs) -> DicomWeb:
    """The code under test on an HTTPS gateway: basic authentication, or with ``token`` a bearer token from a file."""
    if gateway.token is not None:
        return DicomWeb(gateway.url, auth="bearer", secret_file=kwargs.pop("token"), ca_bundle=certificate["cert"],
                        backoff_s=0.05, **kwargs)  # fmt: skip
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DICOMWEB_PASSWORD", kwargs.pop("password", PASSWORD))
        return DicomWeb(gateway.url, auth="basic", user=USER, ca_bundle=certificate["cert"], backoff_s=0.05, **kwargs)


# ------------------------------------------------------------------------------------------ the studies
def read_series(folder: str | Path) -> list[pydicom.Dataset]:
    return [pydicom.dcmread(p) for p in sorted(Path(folder).glob("*.dcm"))]


def as_new_series(slices: list[pydicom.Dataset], number: int, description: str, study: str | None = None,
                  image_type: list[str] | None = None) -> list[pydicom.Dataset]:  # fmt: skip
    """Copies of ``slices`` as another series (new series and instance UIDs; another study if given)."""
    series_uid, copies = generate_uid(), []
    for ds in slices:
        ds = copy.deepcopy(ds)
        ds.SeriesInstanceUID, ds.SeriesNumber, ds.SeriesDescription = series_uid, number, description
        ds.SOPInstanceUID = ds.file_meta.MediaStorageSOPInstanceUID = generate_uid()
        if study is not None:
            ds.StudyInstanceUID = study
        if image_type is not None:
            ds.ImageType = image_type
        copies.append(ds)
    return copies


@pytest.fixture(scope="module")
def studies(orthanc, tmp_path_factory):
    """Uploaded by STOW-RS: A, D, E one CT each (D's a 4D-CT phase: DERIVED/SECONDARY); B a 1.5 mm series of 40
    slices, the same resampled to 3 mm (20 slices) and a 2-image scout; C only a 4-slice CT (no usable series); F
    (dated 2024, outside the workflow's query) for the tests of storing. Each study's CT slices as written are kept
    to compare with."""
    from scripts.data.synthetic import write_case

    tmp = tmp_path_factory.mktemp("studies")
    made: dict[str, dict] = {}
    for name, seed, kwargs in (("A", 11, {}), ("B", 12, {"slice_spacing": 1.5, "shape": (64, 64, 40)}), ("D", 14, {}),
                               ("E", 15, {}), ("F", 16, {})):  # fmt: skip
        options = {"shape": SHAPE, "pixel_spacing": (2.0, 2.0), **kwargs}
        truth = write_case(tmp, f"PAT-{name}", seed=seed, **options)
        made[name] = {"truth": truth, "study": truth["study_uid"], "ct": read_series(truth["image_dir"])}
    made["B"]["thick"] = as_new_series(made["B"]["ct"][::2], 7, "3 mm")
    made["B"]["scout"] = as_new_series(made["B"]["ct"][:2], 8, "scout", image_type=["ORIGINAL", "PRIMARY", "LOCALIZER"])
    for ds in made["D"]["ct"]:  # a 4D-CT phase, as scanners mark it: radiotherapy contours on such series
        ds.ImageType = ["DERIVED", "SECONDARY", "AXIAL"]
    made["C"] = {"study": generate_uid()}
    made["C"]["ct"] = as_new_series(made["A"]["ct"][:4], 2, "4 slices", study=made["C"]["study"])
    client = admin(orthanc)
    for name, study in made.items():
        date = "20240101" if name == "F" else RUN_DATE
        for ds in study["ct"] + study.get("thick", []) + study.get("scout", []):
            ds.StudyDate = date
            if name == "C":
                ds.PatientID = "PAT-C"
        uploaded = study["ct"] + study.get("thick", []) + study.get("scout", [])
        answer = client.store_instances(uploaded)
        assert len(answer.ReferencedSOPSequence) == len(uploaded) and not answer.get("FailedSOPSequence")
    return made


def results_in(client: DICOMwebClient, study: str) -> dict[str, list]:
    """The SEG, RTSTRUCT and SR instances of a study, by modality, found by QIDO-RS."""
    found: dict[str, list] = {}
    for item in client.search_for_series(study):
        modality = item["00080060"]["Value"][0]
        if modality in ("SEG", "RTSTRUCT", "SR"):
            uid = item["0020000E"]["Value"][0]
            found.setdefault(modality, []).extend(client.search_for_instances(study, uid))
    return found


# ------------------------------------------------------------------------------------------ the clear outcomes
@needs_orthanc
def test_a_wrong_password_is_refused_naming_the_url_and_what_to_check(gateway, certificate, studies):
    server = server_of(gateway, certificate, password="not-the-password")
    with pytest.raises(DicomWebError) as refused:
        server.find_studies([studies["A"]["study"]])
    message = str(refused.value)
    assert refused.value.status == 401 and gateway.url in message and "HTTP 401" in message
    assert f"dicomweb_user '{USER}' and the password" in message and "$DICOMWEB_PASSWORD" in message
    assert "not-the-password" not in message


@needs_orthanc
def test_https_is_verified_against_the_ca_bundle(gateway, certificate, studies):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DICOMWEB_PASSWORD", PASSWORD)
        untrusted = DicomWeb(gateway.url, auth="basic", user=USER, backoff_s=0.05)
    with pytest.raises(DicomWebError, match=r"certificate is not trusted .*--dicomweb_ca_bundle") as refused:
        untrusted.find_studies([studies["A"]["study"]])
    assert refused.value.status is None
    found = server_of(gateway, certificate).find_studies([studies["A"]["study"]])
    assert [s["0020000D"]["Value"][0] for s in found] == [studies["A"]["study"]]


@needs_orthanc
def test_a_missing_study_or_series_is_a_404_naming_the_url(gateway, certificate, studies, tmp_path):
    server = server_of(gateway, certificate)
    assert server.find_studies(["1.2.3.4.5.6.7.999"]) == [], "QIDO-RS: a study that is not there is no study"
    missing = f"{gateway.url}/studies/{studies['A']['study']}/series/1.2.3.4.5.999"
    with pytest.raises(DicomWebError, match="HTTP 404") as refused:
        server.retrieve_series(studies["A"]["study"], "1.2.3.4.5.999", tmp_path / "case")
    assert missing in str(refused.value) and "check dicomweb_url" in str(refused.value)
    retrieve = RetrieveSeriesd(server)
    with pytest.raises(DicomWebError):
        retrieve({"case_id": "gone", "study_uid": studies["A"]["study"], "series_uid": "1.2.3.4.5.999"})
    assert list(retrieve.root.iterdir()) == [], "a failed retrieval leaves no folder behind"


@needs_orthanc
def test_a_transfer_cut_midway_is_resumed_and_the_series_arrives_whole(gateway, certificate, studies, caplog):
    caplog.set_level(logging.INFO, logger="scripts.inference.dicomweb")
    study, ct = studies["A"]["study"], studies["A"]["ct"]
    gateway.faults = [[rf"GET .*/series/{ct[0].SeriesInstanceUID}$", "cut", 1]]
    retrieve = RetrieveSeriesd(server_of(gateway, certificate))
    case = retrieve({"case_id": "A", "image": "url", "study_uid": study, "series_uid": ct[0].SeriesInstanceUID,
                     "instances": len(ct)})  # fmt: skip
    assert gateway.faults[0][2] == 0, "the series' answer was cut once"
    assert "connection was cut during the transfer" in caplog.text and "fetching the" in caplog.text
    got = {ds.SOPInstanceUID: ds for ds in read_series(case["image"])}
    assert set(got) == {ds.SOPInstanceUID for ds in ct} and case["source_path"] == case["image"]
    for ds in ct:
        np.testing.assert_array_equal(got[ds.SOPInstanceUID].pixel_array, ds.pixel_array)
    assert not list(Path(case["image"]).glob(".*")), "no partial file left"
    retrieve.discard(case)
    assert not Path(case["image"]).exists(), "the case's folder goes when the case is done"


@needs_orthanc
def test_a_connection_cut_every_time_gives_up_naming_the_url(gateway, certificate, studies, tmp_path):
    study, series_uid = studies["A"]["study"], studies["A"]["ct"][0].SeriesInstanceUID
    gateway.faults = [[rf"/series/{series_uid}", "cut", 100]]
    try:
        with pytest.raises(DicomWebError, match=r"cut during the transfer.*gave up after 3 attempts") as failed:
            server_of(gateway, certificate, retries=2).retrieve_series(study, series_uid, tmp_path / "case", 24)
    finally:
        gateway.faults = []
    assert f"{gateway.url}/studies/{study}/series/{series_uid}" in str(failed.value)


@needs_orthanc
def test_the_bearer_token_is_sent_and_a_request_without_it_is_told_what_to_set(
    token_gateway, certificate, studies, tmp_path
):
    with pytest.raises(DicomWebError, match=r"HTTP 401.*set dicomweb_auth") as refused:
        DicomWeb(token_gateway.url, ca_bundle=certificate["cert"]).find_studies([studies["A"]["study"]])
    assert token_gateway.url in str(refused.value)
    before = token_gateway.authorized
    server = server_of(token_gateway, certificate, token=token_file(tmp_path))
    assert len(server.find_studies([studies["A"]["study"]])) == 1 and token_gateway.authorized == before + 1
    with pytest.raises(DicomWebError, match=r"HTTP 401.*the server refused the token \(dicomweb_auth bearer; read"):
        server_of(token_gateway, certificate, token=token_file(tmp_path, "a-stale-token")).find_studies(["1.2.3.4"])


def token_file(folder: Path, token: str = TOKEN) -> Path:
    (folder / "token").write_text(token + "\n")
    return folder / "token"


# ------------------------------------------------------------------------------------------ storing
@pytest.fixture(scope="module")
def our_seg(studies, tmp_path_factory) -> Path:
    """A DICOM SEG written by the bundle's writer on study F's CT (a block of tumour), as inference writes one."""
    from scripts.data.dicom.identity import algorithm_identification
    from scripts.inference.writers.seg import write_dicom_seg

    labels = np.zeros(SHAPE, np.uint8)
    labels[20:30, 20:30, 8:14] = 1
    path = tmp_path_factory.mktemp("seg") / "F_seg.dcm"
    write_dicom_seg(labels, studies["F"]["truth"]["image_dir"], ["GTV-1"], path, algorithm_identification(VERSION))
    return path


@needs_orthanc
def test_results_are_stored_once_found_again_and_stored_twice_only_when_forced(
    gateway, certificate, studies, our_seg, tmp_path
):
    server, study = server_of(gateway, certificate), studies["F"]["study"]
    ct_series = studies["F"]["ct"][0].SeriesInstanceUID
    case = {"case_id": "F", "study_uid": study, "series_uid": ct_series, "pred_files": {"dicom_seg": str(our_seg)}}
    store = StoreResultsd(server, tmp_path)
    store(case)
    assert store.outcomes["F"]["status"] == "stored"
    store(case)
    assert store.outcomes["F"]["status"] == "already_stored", "the same version's results for the series: not again"
    assert [o["sop_uid"] for o in store.outcomes["F"]["objects"]] == [pydicom.dcmread(our_seg).SOPInstanceUID]
    assert server.find_results(study, ct_series, "0.0.0-other") == [], "another version's results do not count"
    assert server.find_results(study, "1.2.3.4.5.6", VERSION) == [], "nor results for another series"
    seg = pydicom.dcmread(our_seg)  # a new run's SEG of the same series
    seg.SOPInstanceUID = seg.file_meta.MediaStorageSOPInstanceUID = generate_uid()
    seg.SeriesInstanceUID = generate_uid()
    seg.save_as(tmp_path / "second.dcm")
    forced = StoreResultsd(server, tmp_path, force=True)
    forced({**case, "pred_files": {"dicom_seg": str(tmp_path / "second.dcm")}})
    assert forced.outcomes["F"]["status"] == "stored" and len(server.find_results(study, ct_series, VERSION)) == 2


@needs_orthanc
def test_a_store_whose_answer_is_cut_is_sent_again_and_the_study_holds_each_object_once(
    gateway, certificate, orthanc, studies
):
    study, seg_file = studies["F"]["study"], studies["F"]["truth"]["seg_file"]  # F's synthetic SEG: not a result
    gateway.faults = [[rf"POST .*/studies/{study}$", "cut", 1]]
    stored = server_of(gateway, certificate).store([seg_file], study)
    assert gateway.faults[0][2] == 0, "Orthanc stored it, the answer was cut, the request went again"
    assert [o["modality"] for o in stored] == ["SEG"]
    uid = pydicom.dcmread(seg_file).SOPInstanceUID
    assert len(admin(orthanc).search_for_instances(study, search_filters={"SOPInstanceUID": uid})) == 1


@needs_orthanc
def test_nothing_is_sent_when_a_file_belongs_to_another_study(gateway, certificate, studies, our_seg):
    with pytest.raises(DicomWebStoreError, match=r"belongs to study .*nothing was sent"):
        server_of(gateway, certificate).store([our_seg], studies["E"]["study"])


# ------------------------------------------------------------------------------------------ the workflow
@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> Path:
    import torch
    from monai.networks.nets import SwinUNETR

    torch.manual_seed(0)
    return save_weights(SwinUNETR(in_channels=1, out_channels=2, feature_size=12),
                        tmp_path_factory.mktemp("weights") / "model.pt")  # fmt: skip


def infer(
    *args: str, tmp: Path, env: dict, workers: str = "1", timeout: int = 900
) -> tuple[subprocess.CompletedProcess, dict, Path]:
    """The bundle's inference from DICOMweb (MONAI's CLI, from a folder outside the bundle), its report, and the
    temporary folder it used (runs given the same ``tmp`` share it: a cohort's parts into one output folder)."""
    (tmp / "tmp").mkdir(parents=True, exist_ok=True)
    with pytest.MonkeyPatch.context() as patch:
        for key, value in {**env, "TMPDIR": str(tmp / "tmp")}.items():
            patch.setenv(key, value)
        result = bundle_run("inference", "--config_file", str(ROOT / "configs" / "inference.yaml"), "--output_dir",
                            str(tmp / "out"), *NETWORK, "--num_workers", workers, *args, timeout=timeout)  # fmt: skip
    report_file = tmp / "out" / "inference_report.json"
    assert report_file.is_file(), result.stdout[-3000:] + result.stderr[-5000:]
    return result, json.loads(report_file.read_text()), tmp


@pytest.fixture(scope="module")
def by_uids(gateway, certificate, studies, weights, tmp_path_factory):
    """Run 1: studies A, B, C and one that is not there, by StudyInstanceUID, over HTTPS with basic authentication,
    storing the results."""
    uids = [studies[n]["study"] for n in "ABC"] + ["1.2.3.4.5.6.7.999"]
    return infer("--dicomweb_url", gateway.url, "--study_uids", str(uids), "--dicomweb_auth", "basic",
                 "--dicomweb_user", USER, "--dicomweb_ca_bundle", certificate["cert"], "--store", "true",
                 "--model_path", str(weights), tmp=tmp_path_factory.mktemp("run1"),
                 env={"DICOMWEB_PASSWORD": PASSWORD})  # fmt: skip


@pytest.fixture(scope="module")
def by_query(by_uids, token_gateway, certificate, studies, weights, tmp_path_factory):
    """Run 2, after run 1: the studies of March 2025 with a CT (A to E), by a QIDO-RS query with a bearer token,
    storing the results; the gateway cuts the transfer of E's series once and refuses storing into D."""
    e_series, d_study = studies["E"]["ct"][0].SeriesInstanceUID, studies["D"]["study"]
    token_gateway.faults = [[rf"GET .*/series/{e_series}$", "cut", 1], [rf"POST .*/studies/{d_study}$", 403, 9]]
    try:
        query = "{'ModalitiesInStudy': 'CT', 'StudyDate': '20250301-20250331'}"
        return infer("--dicomweb_url", token_gateway.url, "--dicomweb_query", query, "--dicomweb_auth", "bearer",
                     "--dicomweb_ca_bundle", certificate["cert"], "--store", "true", "--dicomweb_retries", "1",
                     "--model_path", str(weights), tmp=tmp_path_factory.mktemp("run2"),
                     env={"DICOMWEB_TOKEN": TOKEN})  # fmt: skip
    finally:
        token_gateway.faults = []


def cases_of(report: dict) -> dict[str, dict]:
    return {c["case_id"]: c for c in report["cases"]}


@needs_orthanc
def test_inference_by_study_uids_stores_seg_rtstruct_and_sr_into_each_study(by_uids, orthanc, studies):
    result, report, tmp = by_uids
    cases = cases_of(report)
    done = {k for k, c in cases.items() if c["status"] == "done"}
    assert done == {f"PAT-A_{RUN_DATE}", f"PAT-B_{RUN_DATE}"}, result.stderr[-4000:]
    client = admin(orthanc)
    for name in "AB":
        case = cases[f"PAT-{name}_{RUN_DATE}"]
        assert case["store"]["status"] == "stored"
        assert sorted(o["modality"] for o in case["store"]["objects"]) == ["RTSTRUCT", "SEG", "SR"]
        found = results_in(client, studies[name]["study"])
        assert sorted(found) == ["RTSTRUCT", "SEG", "SR"] and all(len(v) == 1 for v in found.values())
        seg_uid = found["SEG"][0]["00080018"]["Value"][0]
        assert seg_uid == pydicom.dcmread(case["outputs"]["dicom_seg"]).SOPInstanceUID, "the SEG written is stored"
    assert (tmp / "out" / f"PAT-A_{RUN_DATE}" / f"PAT-A_{RUN_DATE}_seg.nii.gz").is_file()
    assert not list((tmp / "tmp").iterdir()), "every retrieved series was removed"


@needs_orthanc
def test_the_seg_found_again_lies_on_the_chosen_series_instances(by_uids, orthanc, studies):
    """highdicom reads the SEG retrieved from the study: it references the chosen CT series (B: the 1.5 mm one, not
    the 3 mm one), each frame the CT instance at its own position, in the CT's frame of reference."""
    client = admin(orthanc)
    for name in "AB":
        study, ct = studies[name]["study"], studies[name]["ct"]
        found = results_in(client, study)["SEG"][0]
        series_uid = found["0020000E"]["Value"][0]
        seg = hd.seg.Segmentation.from_dataset(client.retrieve_instance(study, series_uid,
                                                                        found["00080018"]["Value"][0]))  # fmt: skip
        assert seg.StudyInstanceUID == study and seg.FrameOfReferenceUID == ct[0].FrameOfReferenceUID
        assert {s for _, s, _ in seg.get_source_image_uids()} == {ct[0].SeriesInstanceUID}
        position = {ds.SOPInstanceUID: [float(v) for v in ds.ImagePositionPatient] for ds in ct}
        assert seg.NumberOfFrames >= 1
        for frame in seg.PerFrameFunctionalGroupsSequence:
            source = frame.DerivationImageSequence[0].SourceImageSequence[0].ReferencedSOPInstanceUID
            at = [float(v) for v in frame.PlanePositionSequence[0].ImagePositionPatient]
            np.testing.assert_allclose(at, position[source], atol=1e-3)
        assert seg.SegmentSequence[0].SegmentLabel == "GTV-1"


@needs_orthanc
def test_the_report_names_the_chosen_series_the_alternatives_and_each_failed_study(by_uids, studies):
    result, report, _ = by_uids
    cases = cases_of(report)
    b = cases[f"PAT-B_{RUN_DATE}"]
    assert b["series"]["series_uid"] == studies["B"]["ct"][0].SeriesInstanceUID and b["series"]["spacing_mm"] == 1.5
    reasons = {a["series_uid"]: a["reason"] for a in b["alternatives"]}
    thick = reasons[studies["B"]["thick"][0].SeriesInstanceUID]
    assert thick == "usable, but 3 mm slices, thicker than the chosen 1.5 mm"
    assert "2 images, fewer than series_rules#min_slices" in reasons[studies["B"]["scout"][0].SeriesInstanceUID]
    c = cases[f"PAT-C_{RUN_DATE}"]
    assert c["status"] == "failed" and c["stage"] == "check" and "no usable CT series" in c["reason"]
    assert "4 images, fewer than series_rules#min_slices (10)" in c["reason"]
    missing = cases["1.2.3.4.5.6.7.999"]
    assert missing["stage"] == "check" and "not found on" in missing["reason"]
    assert result.returncode == 1 and "2 case(s) failed" in result.stderr
    assert PASSWORD not in result.stdout + result.stderr + json.dumps(report)


@needs_orthanc
def test_by_query_a_study_already_done_is_skipped_a_refused_store_fails_alone_and_a_cut_transfer_recovers(
    by_query, orthanc, studies
):
    result, report, tmp = by_query
    cases = cases_of(report)
    skipped = {s["case_id"]: s["reason"] for s in report["skipped"]}
    assert set(skipped) == {f"PAT-A_{RUN_DATE}", f"PAT-B_{RUN_DATE}"}, report
    assert "already stored" in skipped[f"PAT-A_{RUN_DATE}"] and "SR " in skipped[f"PAT-A_{RUN_DATE}"]
    d, e = cases[f"PAT-D_{RUN_DATE}"], cases[f"PAT-E_{RUN_DATE}"]
    assert d["status"] == "failed" and d["stage"] == "store" and "HTTP 403" in d["reason"], d
    assert f"/studies/{studies['D']['study']}" in d["reason"] and "a new run stores them" in d["reason"]
    assert (tmp / "out" / f"PAT-D_{RUN_DATE}" / f"PAT-D_{RUN_DATE}_seg.dcm").is_file(), "the results stay on disk"
    assert "ImageType AXIAL/DERIVED/SECONDARY" in d["series"]["note"], "D, a 4D-CT phase, is inferred, and noted"
    assert e["status"] == "done" and e["store"]["status"] == "stored"
    assert "connection was cut during the transfer" in result.stdout + result.stderr
    assert cases[f"PAT-C_{RUN_DATE}"]["stage"] == "check"
    client = admin(orthanc)
    assert results_in(client, studies["D"]["study"]) == {}, "nothing of D was stored"
    assert all(len(v) == 1 for v in results_in(client, studies["A"]["study"]).values()), "A's results not twice"
    assert sorted(results_in(client, studies["E"]["study"])) == ["RTSTRUCT", "SEG", "SR"]
    assert result.returncode == 1 and "2 case(s) failed" in result.stderr
    assert not list((tmp / "tmp").iterdir())


@needs_orthanc
def test_the_token_is_used_and_never_written_to_a_log_or_a_report(by_query, token_gateway):
    result, _, tmp = by_query
    assert token_gateway.authorized > 0
    assert TOKEN not in result.stdout + result.stderr
    for path in (tmp / "out").rglob("*"):
        if path.is_file():
            assert TOKEN.encode() not in path.read_bytes(), path


@needs_orthanc
def test_a_pacs_query_in_two_parts_splits_its_studies_by_instances_and_a_part_run_again_infers_nothing(
    gateway, certificate, studies, weights, tmp_path
):
    """The workflow's query (A to E, not storing) in parts 0 and 1 of 2, one after the other into one folder: each
    part finds the studies itself and takes its share, weighed by the chosen series' instances (B's 40 against A's
    and D's 24 + 24: part 0 B and E, part 1 A, D and C, which fails its check and weighs one). Part 0 run again
    infers nothing: its cases are done earlier."""
    query = "{'ModalitiesInStudy': 'CT', 'StudyDate': '" + RUN_DATE + "'}"
    names = {n: f"PAT-{n}_{RUN_DATE}" for n in "ABCDE"}
    expected = {"0-of-2": {names["B"], names["E"]}, "1-of-2": {names["A"], names["C"], names["D"]}}

    def part(k: int) -> tuple[subprocess.CompletedProcess, dict, Path]:
        return infer("--dicomweb_url", gateway.url, "--dicomweb_query", query, "--dicomweb_auth", "basic",
                     "--dicomweb_user", USER, "--dicomweb_ca_bundle", certificate["cert"], "--model_path",
                     str(weights), "--num_parts", "2", "--part_id", str(k), tmp=tmp_path,
                     env={"DICOMWEB_PASSWORD": PASSWORD}, workers="0", timeout=300)  # fmt: skip

    first, second = part(0), part(1)
    out = tmp_path / "out"
    for k, (result, _, _) in enumerate((first, second)):
        log, mine = result.stdout + result.stderr, len(expected[f"{k}-of-2"])
        line = f"part {k} of 2: {mine} case(s) of 5; 0 done earlier with the same weights and settings, 2 to infer"
        assert line in log, log[-4000:]
    assert first[0].returncode == 0, first[0].stderr[-4000:]
    assert second[0].returncode == 1 and "1 case(s) failed" in second[0].stderr, "C's failed check is part 1's"
    parts = {name: json.loads((out / ".parts" / name / "inference_report.json").read_text()) for name in expected}
    found = {name: {c["case_id"] for c in report["cases"]} for name, report in parts.items()}
    assert found == expected, f"every study found in one part, the parts balanced by instances: {found}"
    assert {c["study_uid"] for r in parts.values() for c in r["cases"]} == {studies[n]["study"] for n in "ABCDE"}
    merged = second[1]
    cases = cases_of(merged)
    assert [c["case_id"] for c in merged["cases"]] == sorted(names.values()), "each study's case once"
    for name, ids in expected.items():
        assert all(cases[i]["part"] == name for i in ids)
    done = {i for i, c in cases.items() if c["status"] == "done"}
    assert done == {names[n] for n in "ABDE"} and merged["num_done"] == 4 and merged["num_failed"] == 1
    assert cases[names["C"]]["stage"] == "check" and "no usable CT series" in cases[names["C"]]["reason"]
    assert set(merged["parts"]) == set(expected) and all(p["ended"] for p in merged["parts"].values())
    assert sorted(r["case"] for r in csv.DictReader((out / "report.csv").open())) == sorted(done)
    assert all((out / i / f"{i}_seg.nii.gz").is_file() for i in done)
    assert not list((tmp_path / "tmp").iterdir()), "every retrieved series was removed"

    again, merged, _ = part(0)
    log = again.stdout + again.stderr
    assert again.returncode == 0, again.stderr[-4000:]
    assert "part 0 of 2: 2 case(s) of 5; 2 done earlier with the same weights and settings, 0 to infer" in log, log
    assert "no case to infer in 0-of-2" in log and not list((tmp_path / "tmp").iterdir()), "nothing retrieved"
    cases = cases_of(merged)
    assert merged["num_done"] == 4 and merged["num_done_earlier"] == 2
    assert all(cases[i]["earlier"] and cases[i]["part"] == "0-of-2" for i in expected["0-of-2"])
    assert len(list(csv.DictReader((out / "report.csv").open()))) == 4, "the earlier cases keep their rows"

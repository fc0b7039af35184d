"""The bundle as a DICOM node (scripts/inference/node/), against real DICOM peers.

The spool, the receiver and the sender alone first (in this process, with pynetdicom as the peer): UIDs that would
name a path outside the node's folder, versions of a study that grows, a caller not allowed, the free-space guard,
TLS, the back-off of a destination that is down.

Then one night of a node, as ``monai.bundle run serve`` runs it, killed with ``kill -9`` three times: dcmtk's
``storescu`` sends a study and ``storescp`` (the planning system, TPS) receives the results; a second destination
(LATE, a pynetdicom SCP of this test) hangs once midway through a result; a sender is cut after 6 of its slices;
Orthanc sends a study from its store to the node (its ``/modalities/<node>/store``) and receives the results back as a
destination. Each fact the night shows is its own test below.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pydicom
import pytest
import requests
import zygote
from conftest import ROOT, foreign_folder, save_weights
from dicom_factory import Series, ct_slice, write_scanner_study
from pydicom.uid import CTImageStorage, ExplicitVRLittleEndian, generate_uid
from pynetdicom import AE, AllStoragePresentationContexts, evt
from pynetdicom.sop_class import Verification
from scripts.inference.node.receive import Receiver
from scripts.inference.node.send import Destination, new_record, send
from scripts.inference.node.serve import forwarded_args, infer, unchanged
from scripts.inference.node.spool import Spool, Version

# the module (the package exports its function serve under the same name)
serve_module = importlib.import_module("scripts.inference.node.serve")

# dcmtk's, not the Python ones of the same name pynetdicom installs into the environment
DCMTK = "/usr/local/bin:/usr/bin:/bin"
STORESCU, STORESCP = shutil.which("storescu", path=DCMTK), shutil.which("storescp", path=DCMTK)
ORTHANC = shutil.which("Orthanc") or shutil.which("Orthanc", path="/usr/sbin:/sbin")
OPENSSL = shutil.which("openssl")
NETWORK = ["--feature_size", "12", "--roi_size", "[64,64,32]", "--spacing", "[2.0,2.0,3.0]", "--sw_batch_size", "1",
           "--inference_backend", "torch", "--num_workers", "0"]  # fmt: skip
NODE_AE = "NSCLC_GTV"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(condition, what: str, timeout: float = 120.0, log=None):
    """Poll ``condition()`` until it returns something true; fail naming ``what`` (with the end of ``log``: a file, or
    a node's output) if it never does."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(0.2)
    if hasattr(log, "text"):
        tail = log.text()[-4000:]
    else:
        tail = log.read_text(errors="replace")[-4000:] if log and log.is_file() else ""
    pytest.fail(f"{what}: not within {timeout:.0f} s\n{tail}")


def slices_of(series: Series, count: int | None = None) -> list[pydicom.Dataset]:
    return [ct_slice(series, k) for k in range(count or series.shape[2])]


# ------------------------------------------------------------------------------------------------ the parts alone
def test_forwarded_args_are_serves_own_but_the_run_id_and_the_folders():
    argv = ["__main__.py", "run", "serve", "--config_file", "c.yaml", "--output_dir", "N", "--model_path=m.pt",
            "--input_dir", "X", "--num_parts", "2", "--dicom_port", "104", "--tta", "true", "--dicom_launcher",
            "srun python"]  # fmt: skip
    assert forwarded_args(argv) == ["--config_file", "c.yaml", "--model_path=m.pt", "--dicom_port", "104", "--tta",
                                    "true"]  # fmt: skip


def test_a_destination_is_ae_at_host_port_and_anything_else_is_refused_saying_so():
    assert str(Destination.parse(" TPS@tps.example.org:104 ")) == "TPS@tps.example.org:104"
    assert Destination.parse("PACS@[::1]:11112").host == "::1"
    for wrong in ("TPS@host", "tps.example.org:104", "TPS@host:port", "A_TITLE_OF_17_CHARS@h:104", "TPS@h:70000"):
        with pytest.raises(ValueError, match="is not AE@host:port"):
            Destination.parse(wrong)


def test_uids_that_would_name_a_path_outside_the_node_are_refused(tmp_path):
    spool = Spool(tmp_path / "node")
    for study, sop in (("../../etc", "1.2.3"), ("1.2.3", "../x"), ("1.2.3", "/abs"), ("1.2" * 40, "1.2.3")):
        with pytest.raises(ValueError, match="not a UID"):
            spool.store(study, sop, lambda handle: handle.write(b"x"), sender="S")
    assert sorted(p.name for p in (tmp_path / "node").iterdir()) == ["incoming", "studies"]
    assert not list((tmp_path / "node").rglob("*.dcm"))


def test_a_study_that_grows_is_a_new_version_holding_the_earlier_instances_and_the_new_ones(tmp_path):
    spool = Spool(tmp_path / "node")

    def put(sop: str, content: bytes) -> None:
        spool.store("1.2.3", sop, lambda handle: handle.write(content), sender="SCANNER")

    put("1.1", b"a")
    put("1.2", b"b")
    assert spool.quiet_studies(0.0, busy={"1.2.3"}) == [], "a study an open association sends to is not quiet"
    assert spool.quiet_studies(60.0, busy=set()) == [], "nor one that received an instance within the quiet period"
    assert spool.quiet_studies(0.0, busy=set()) == ["1.2.3"]
    first = spool.freeze("1.2.3")
    put("1.2", b"B")  # sent again, changed
    put("1.3", b"c")
    second = spool.freeze("1.2.3")
    assert (first.number, second.number) == (1, 2)
    content = {p.name: p.read_bytes() for p in second.input_dir.iterdir()}
    assert content == {"1.1.dcm": b"a", "1.2.dcm": b"B", "1.3.dcm": b"c"}
    assert {p.name: p.read_bytes() for p in first.input_dir.iterdir()} == {"1.1.dcm": b"a", "1.2.dcm": b"b"}
    assert second.received["instances"] == 3 and second.received["senders"] == ["SCANNER"]
    assert [v.number for v in spool.versions()] == [1, 2]
    assert spool.freeze("1.2.3") is None, "nothing new: no version"


def test_a_version_with_no_new_ct_image_is_not_inferred_again(tmp_path):
    """A PACS that sends the node's own results back, or an RTSTRUCT sent alone, makes a version with the same CT
    images: recorded as unchanged, not inferred, nothing sent."""
    spool = Spool(tmp_path / "node")
    series = Series(shape=(16, 16, 2), patient_id="RX-2")
    for ds in slices_of(series):
        spool.store(ds.StudyInstanceUID, ds.SOPInstanceUID, lambda h, ds=ds: ds.save_as(h, enforce_file_format=True),
                    sender="CT")  # fmt: skip
    first = spool.freeze(series.uid("study"))
    assert unchanged(first) is None, "the first version is inferred"
    ds = slices_of(series, 1)[0]
    ds.SOPClassUID, ds.Modality, ds.SOPInstanceUID = "1.2.840.10008.5.1.4.1.1.481.3", "RTSTRUCT", generate_uid()
    ds.SeriesInstanceUID = generate_uid()
    spool.store(
        ds.StudyInstanceUID, ds.SOPInstanceUID, lambda h: ds.save_as(h, enforce_file_format=True), sender="PACS"
    )
    second = spool.freeze(series.uid("study"))
    assert unchanged(second)["status"] == "unchanged" and second.inferred["results"] == []
    assert "no new or changed CT image since v1 (the study holds CT, RTSTRUCT)" in second.inferred["reason"]
    ds = slices_of(series, 1)[0]
    ds.PixelData = bytes(len(ds.PixelData))  # the same instance sent again, its image changed
    spool.store(ds.StudyInstanceUID, ds.SOPInstanceUID, lambda h: ds.save_as(h, enforce_file_format=True), sender="CT")
    assert unchanged(spool.freeze(series.uid("study"))) is None, "a changed CT image is inferred"


def test_a_temporary_file_a_kill_left_is_removed_and_a_version_left_incomplete_is_completed(tmp_path):
    spool = Spool(tmp_path / "node")
    (spool.incoming / "1.2.3").mkdir()
    (spool.incoming / "1.2.3" / ".1.9.tmp").write_bytes(b"half an instance")
    assert spool.remove_unacknowledged() == 1 and not list(spool.incoming.rglob("*.tmp"))
    (spool.studies / "1.2.3" / "v1" / "input").mkdir(parents=True)  # killed between the rename and received.json
    version = Version(spool.studies / "1.2.3" / "v1")
    assert version.received is None
    assert spool.complete(version)["instances"] == 0 and version.received is not None


@pytest.fixture()
def receiver(tmp_path, caplog):
    """A receiver on a free port of 127.0.0.1 accepting AE CLIENT only, stopped at the end."""
    caplog.set_level("INFO", logger="scripts.inference.node")
    node = Receiver(Spool(tmp_path / "node"), NODE_AE, 0, "127.0.0.1", allowed_callers=["CLIENT"], min_free_gb=0)
    node.start()
    yield node
    node.stop()


def associate(port: int, calling: str = "CLIENT", tls: tuple | None = None):
    ae = AE(ae_title=calling)
    ae.add_requested_context(Verification)
    ae.add_requested_context(CTImageStorage, ExplicitVRLittleEndian)
    return ae.associate("127.0.0.1", port, ae_title=NODE_AE, tls_args=tls)


def test_an_instance_is_on_disk_as_sent_when_its_c_store_is_acknowledged(receiver, tmp_path):
    series = Series(shape=(32, 32, 3), patient_id="RX-1")
    sent = slices_of(series)
    assoc = associate(receiver.port)
    assert assoc.is_established
    assert assoc.send_c_echo().Status == 0
    for ds in sent:
        assert assoc.send_c_store(ds).Status == 0
        stored = receiver.spool.incoming / ds.StudyInstanceUID / f"{ds.SOPInstanceUID}.dcm"
        assert stored.is_file(), "on disk before the acknowledgement reached the sender"
        back = pydicom.dcmread(stored)
        assert back.PixelData == ds.PixelData and back.ImagePositionPatient == ds.ImagePositionPatient
        assert back.file_meta.TransferSyntaxUID == ExplicitVRLittleEndian
    assert receiver.busy == {sent[0].StudyInstanceUID}, "the study is busy while its association is open"
    assoc.release()
    wait_for(lambda: not receiver.busy, "the study free once the association ended")


def test_a_caller_not_allowed_is_rejected_with_the_reason_logged(receiver, caplog):
    assoc = associate(receiver.port, calling="INTRUDER")
    assert assoc.is_rejected
    assert "refused an association from AE 'INTRUDER'" in caplog.text and "dicom_allowed_callers" in caplog.text


def test_below_the_free_space_limit_new_associations_are_refused_naming_the_folder(tmp_path, caplog):
    caplog.set_level("INFO", logger="scripts.inference.node")
    node = Receiver(Spool(tmp_path / "node"), NODE_AE, 0, "127.0.0.1", min_free_gb=1e9)
    node.start()
    try:
        assoc = associate(node.port)
        assert assoc.is_rejected
    finally:
        node.stop()
    assert f"GB free in {tmp_path / 'node'}, below dicom_min_free_gb" in caplog.text


@pytest.mark.skipif(OPENSSL is None, reason="needs openssl (apt-get install openssl)")
def test_with_a_certificate_the_association_is_tls_and_a_plain_one_gets_nowhere(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run([OPENSSL, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "2", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)  # fmt: skip
    node = Receiver(Spool(tmp_path / "node"), NODE_AE, 0, "127.0.0.1", min_free_gb=0, tls_cert=str(cert),
                    tls_key=str(key))  # fmt: skip
    node.start()
    try:
        import ssl

        client = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(cert))
        secure = associate(node.port, tls=(client, "127.0.0.1"))
        assert secure.is_established and secure.send_c_echo().Status == 0
        secure.release()
        assert not associate(node.port).is_established
    finally:
        node.stop()


def test_a_destination_that_is_down_is_tried_again_later_and_then_given_up(tmp_path):
    version = Version(tmp_path / "studies" / "1.2.3" / "v1")
    version.folder.mkdir(parents=True)
    result = tmp_path / "result.dcm"
    slices_of(Series(shape=(8, 8, 1), patient_id="RX-3"))[0].save_as(result, enforce_file_format=True)
    version.record_inferred({"status": "done", "results": [["rtstruct", str(result)]]})
    down = Destination("TPS", "127.0.0.1", free_port())
    record = new_record(version, down)
    assert record["objects"][0]["transfer_syntax"] == ExplicitVRLittleEndian, "the file's own, read once"
    waits = []
    for attempt in (1, 2, 3):
        before = time.time()
        record = send(version, down, record, NODE_AE, retry_s=2.0, attempts=3)
        assert record["attempts"] == attempt and "gave no association" in record["last_error"]
        waits.append(record["next_try"] - before if record["status"] == "pending" else None)
    assert record["status"] == "failed" and version.sending(str(down))["status"] == "failed"
    assert 2.0 <= waits[0] < 3.0 and 4.0 <= waits[1] < 5.0 and waits[2] is None, f"back-off doubles: {waits}"


def test_a_study_is_inferred_by_the_launcher_given_found_on_path_and_its_failure_recorded_from_the_log(tmp_path):
    """--dicom_launcher's words start the study's inference in place of python (here a shell that records what it was
    asked to run, then fails): looked up on PATH, given ``-m monai.bundle run inference`` with serve's options and
    the version's folders; the failure recorded with the log's last line."""
    version = Version(tmp_path / "studies" / "1.2.3" / "v1")
    version.input_dir.mkdir(parents=True)
    asked = tmp_path / "asked.txt"
    launcher = ["sh", "-c", f'printf "%s\\n" "$@" > {shlex.quote(str(asked))}; echo no GPU here; exit 3', "sh"]
    outcome = infer(version, ["--model_path", "m.pt"], python=launcher)
    assert asked.read_text().splitlines() == ["-m", "monai.bundle", "run", "inference", "--model_path", "m.pt",
                                              "--input_dir", str(version.input_dir), "--output_dir",
                                              str(version.output_dir)]  # fmt: skip
    assert outcome["status"] == "failed" and outcome["returncode"] == 3
    assert outcome["reason"] == "inference ended with status 3: no GPU here"


def test_without_a_launcher_a_study_is_inferred_by_this_python_wrapped_to_die_with_the_node(tmp_path, monkeypatch):
    """The default, which the night's node does not take (it is given the tests' zygote as its launcher)."""
    started = []

    class Finished:
        returncode = 0

        def __init__(self, command, **kwargs) -> None:
            started.append(command)

        def poll(self) -> int:
            return 0

    monkeypatch.setattr(serve_module.subprocess, "Popen", Finished)
    version = Version(tmp_path / "studies" / "1.2.3" / "v1")
    version.folder.mkdir(parents=True)
    (version.folder / "inference.log").write_text("")
    infer(version, ["--tta", "true"])
    wrapper, command = started[0][:4], started[0][4:]
    assert wrapper == [sys.executable, "-c", serve_module._WITH_PARENT, str(os.getpid())]
    assert command[:7] == [sys.executable, "-m", "monai.bundle", "run", "inference", "--tta", "true"]


# ------------------------------------------------------------------------------------------------ a night of a node
class ScriptedDestination:
    """LATE: a pynetdicom SCP that stores every object it is sent, except the second C-STORE of its first association,
    which it holds until :attr:`release` is set (the node is killed meanwhile) and then refuses."""

    def __init__(self) -> None:
        self.acknowledged: Counter = Counter()  # SOP Instance UID -> times acknowledged
        self.holding, self.release = threading.Event(), threading.Event()
        self._stores, self._lock = 0, threading.Lock()
        ae = AE(ae_title="LATE")
        for context in AllStoragePresentationContexts:
            ae.add_supported_context(context.abstract_syntax, [ExplicitVRLittleEndian, "1.2.840.10008.1.2"])
        self.server = ae.start_server(("127.0.0.1", 0), block=False, evt_handlers=[(evt.EVT_C_STORE, self._store)])
        self.port = self.server.server_address[1]

    def _store(self, event) -> int:
        with self._lock:
            self._stores += 1
            hold = self._stores == 2
        if hold:
            self.holding.set()
            self.release.wait(120)
            return 0xA700
        with self._lock:
            self.acknowledged[event.request.AffectedSOPInstanceUID] += 1
        return 0x0000


class Node:
    """``monai.bundle run serve``, each start a process of its own, its output gathered in ``log`` across starts. The
    node and each study's inference child are forked from the tests' zygote, which imported torch and MONAI once: the
    children by way of ``--dicom_launcher`` (``python tests/zygote.py --exec``, started by the node as it starts any
    launcher, and dying with it)."""

    def __init__(self, folder: Path, port: int, destinations: list[str], weights: Path) -> None:
        self.folder, self.port, self.log = folder, port, folder.parent / "node.log"
        self.argv = ["run", "serve", "--config_file", str(ROOT / "configs" / "inference.yaml"), "--bundle_root",
                     str(ROOT), "--output_dir", str(folder), "--dicom_port", str(port), "--dicom_bind", "127.0.0.1",
                     "--dicom_destinations", str(destinations), "--dicom_allowed_callers",
                     "['STORESCU','CLIENT','ORTHANC']", "--dicom_quiet_s", "1", "--dicom_retry_s", "1",
                     "--dicom_min_free_gb", "0.1", "--model_path", str(weights), *NETWORK]  # fmt: skip
        self.env, launch = dict(os.environ), zygote.launcher()
        if launch is not None:
            self.argv += ["--dicom_launcher", shlex.join(launch[0])]
            self.env.update(launch[1])
        self.started: zygote.Started | None = None
        self.earlier = ""  # the output of the starts before this one

    def start(self) -> None:
        self.earlier = self.text()
        self.started = zygote.start(self.argv, foreign_folder(), self.env)
        wait_for(lambda: "listening on" in self.text()[len(self.earlier) :] or self.returncode() is not None,
                 "the node listening", 120, self)  # fmt: skip
        assert self.returncode() is None, self.text()[-4000:]

    def returncode(self) -> int | None:
        return self.started.poll() if self.started else None

    def signal(self, sig: int) -> int:
        """Send ``sig``; the node's exit status once it has ended."""
        self.started.signal(sig)
        assert self.started.wait(60) is not None, "the node ended"
        self.log.write_text(self.text())
        return self.returncode()

    def kill(self) -> None:
        self.signal(signal.SIGKILL)

    def text(self) -> str:
        return self.earlier + "".join(self.started.output()) if self.started else self.earlier

    def version(self, study: str, number: int = 1) -> Version:
        return Version(self.folder / "studies" / study / f"v{number}")


def storescu(port: int, *paths: Path, calling: str = "STORESCU") -> subprocess.CompletedProcess:
    return subprocess.run([STORESCU, "-aet", calling, "-aec", NODE_AE, "+sd", "+r", "127.0.0.1", str(port),
                           *map(str, paths)], capture_output=True, text=True, timeout=120)  # fmt: skip


def start_orthanc(base: Path, node_port: int) -> tuple[subprocess.Popen, str, int]:
    """Orthanc with its DICOM server on a free port as AE ORTHANC, the node known to it as modality ``gtv``."""
    http, dicom = free_port(), free_port()
    config = {"Name": "node-tests", "StorageDirectory": str(base / "db"), "IndexDirectory": str(base / "db"),
              "HttpPort": http, "DicomServerEnabled": True, "DicomAet": "ORTHANC", "DicomPort": dicom,
              "RemoteAccessAllowed": False, "AuthenticationEnabled": False, "SaveJobs": False,
              "DicomModalities": {"gtv": [NODE_AE, "127.0.0.1", node_port]}}  # fmt: skip
    (base / "orthanc.json").write_text(json.dumps(config))
    log = (base / "orthanc.log").open("w")
    process = subprocess.Popen([ORTHANC, str(base / "orthanc.json")], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{http}"

    def up() -> bool:
        with contextlib.suppress(requests.RequestException):
            return requests.get(f"{url}/system", timeout=5).ok
        return False

    wait_for(up, "Orthanc up", 60, base / "orthanc.log")
    return process, url, dicom


def inference_children(version: Version) -> list[int]:
    """The processes inferring ``version``: their command line names its input folder (the node's child, and a
    launcher's), or their stdout is its inference log (a run forked from the tests' zygote has the zygote's command
    line)."""
    found, log = [], str(version.folder / "inference.log")
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if proc.name.isdigit() and (str(version.input_dir).encode() in (proc / "cmdline").read_bytes()
                                        or os.readlink(proc / "fd" / "1") == log):  # fmt: skip
                found.append(int(proc.name))
    return found


@pytest.fixture(scope="module")
def night(tmp_path_factory):
    """The night, step by step (each step's facts kept for the tests below):

    1. node 1 starts; storescu sends study A's axial series; A v1's results go to TPS (storescp) and LATE, which
       acknowledges the RTSTRUCT and holds the SEG; meanwhile CLIENT sends 6 of study B's 20 slices, and node 1 is
       killed (``kill -9``) while sending to LATE and while receiving B;
    2. node 2 starts: B, 6 slices, is recorded as having no usable CT; A v1's SEG and SR reach LATE; Orthanc sends
       study C to the node, and node 2 is killed while inferring C;
    3. node 3 starts: C is inferred and its results reach TPS, LATE and Orthanc; INTRUDER is refused; node 3 is
       stopped (SIGTERM). (A study that grows into v2, and one whose new version brings no new CT image: the spool's
       tests above, without a node.)"""
    missing = [n for n, p in (("dcmtk's storescu", STORESCU), ("storescp", STORESCP), ("orthanc", ORTHANC)) if not p]
    if missing:
        pytest.skip(f"needs Debian's {', '.join(missing)} (apt-get install dcmtk orthanc; .ci/run does)")
    import torch
    from monai.networks.nets import SwinUNETR

    base = tmp_path_factory.mktemp("night")
    torch.manual_seed(0)
    weights = save_weights(SwinUNETR(in_channels=1, out_channels=2, feature_size=12), base / "model.pt")
    studies = {name: write_scanner_study(base / f"study_{name}", f"NODE-{name}") for name in "AC"}
    study_uid = {name: pydicom.dcmread(next((base / f"study_{name}" / "SE000002").iterdir())).StudyInstanceUID
                 for name in "AC"}  # fmt: skip
    b_series = Series(shape=(64, 64, 20), patient_id="NODE-B", name="b")
    study_uid["B"] = b_series.uid("study")

    tps_dir, tps_log = base / "tps", base / "tps_received.txt"
    tps_dir.mkdir()
    tps_port, late = free_port(), ScriptedDestination()
    tps = subprocess.Popen([STORESCP, "-aet", "TPS", "-od", str(tps_dir), "-xcr", f"echo #f >> {tps_log}",
                            str(tps_port)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)  # fmt: skip
    node_port = free_port()
    orthanc, orthanc_url, orthanc_port = start_orthanc(base, node_port)
    destinations = [f"TPS@127.0.0.1:{tps_port}", f"LATE@127.0.0.1:{late.port}",
                    f"ORTHANC@127.0.0.1:{orthanc_port}"]  # fmt: skip
    node = Node(base / "node", node_port, destinations, weights)
    facts: dict = {"node": node, "study": study_uid, "series": studies, "tps_dir": tps_dir, "late": late,
                   "orthanc": orthanc_url}  # fmt: skip
    try:
        # ---- 1
        node.start()
        facts["storescu_a"] = storescu(node_port, base / "study_A" / "SE000002")
        assert facts["storescu_a"].returncode == 0, facts["storescu_a"].stdout + facts["storescu_a"].stderr
        wait_for(late.holding.is_set, "LATE holding A v1's second object", 180, node)
        client = AE(ae_title="CLIENT")
        client.add_requested_context(CTImageStorage, ExplicitVRLittleEndian)
        assoc = client.associate("127.0.0.1", node_port, ae_title=NODE_AE)
        b_slices = slices_of(b_series, 6)
        facts["b_statuses"] = [int(assoc.send_c_store(ds).Status) for ds in b_slices]
        facts["a_late_before_kill"] = node.version(study_uid["A"]).sending(destinations[1])
        node.kill()
        late.release.set()
        assoc.abort()
        facts["b_on_disk"] = {
            p.name: pydicom.dcmread(p) for p in (node.folder / "incoming" / study_uid["B"]).glob("*.dcm")
        }
        facts["b_versions"] = list((node.folder / "studies").glob(f"{study_uid['B']}/v*"))
        facts["b_sent"] = {f"{ds.SOPInstanceUID}.dcm": ds for ds in b_slices}
        # ---- 2
        node.start()
        wait_for(lambda: node.version(study_uid["B"]).inferred, "B inferred", 120, node)
        wait_for(lambda: (node.version(study_uid["A"]).sending(destinations[1]) or {}).get("status") == "delivered",
                 "A v1 delivered to LATE", 60, node)  # fmt: skip
        for path in sorted((base / "study_C").rglob("IM*")):
            requests.post(f"{orthanc_url}/instances", data=path.read_bytes(), timeout=30).raise_for_status()
        lookup = requests.post(f"{orthanc_url}/tools/lookup", data=study_uid["C"], timeout=30).json()
        orthanc_study = next(found["ID"] for found in lookup if found["Type"] == "Study")
        store = {"Resources": [orthanc_study], "Synchronous": True}
        facts["orthanc_store"] = requests.post(f"{orthanc_url}/modalities/gtv/store", json=store, timeout=120)
        c_v1 = node.version(study_uid["C"])
        wait_for(lambda: c_v1.output_dir.is_dir() and inference_children(c_v1), "C's inference running", 120, node)
        time.sleep(1)  # into its run: MONAI importing, or the case being read or inferred
        facts["c_inferred_before_kill"] = c_v1.inferred
        node.kill()
        facts["children_after_kill"] = wait_for(lambda: not inference_children(c_v1) and [0], "no child left", 30)
        # ---- 3
        node.start()
        wait_for(lambda: all((c_v1.sending(d) or {}).get("status") == "delivered" for d in destinations),
                 "C's results at every destination", 180, node)  # fmt: skip
        facts["intruder"] = storescu(node_port, base / "study_A" / "SE000001", calling="INTRUDER")
        facts["returncode"] = node.signal(signal.SIGTERM)
        facts["orthanc_series"] = [requests.get(f"{orthanc_url}/series/{s}", timeout=30).json()["MainDicomTags"]
                                   for s in requests.get(f"{orthanc_url}/studies/{orthanc_study}", timeout=30)
                                   .json()["Series"]]  # fmt: skip
        facts["tps_received"] = tps_log.read_text().split()
        yield facts
    finally:
        if node.started and node.returncode() is None:
            node.kill()
        for process in (tps, orthanc):
            if process.poll() is None:
                process.kill()
                process.wait()
        late.release.set()
        late.server.shutdown()


def results_at_tps(facts: dict, study: str) -> dict[str, pydicom.Dataset]:
    folder = facts["tps_dir"]
    return {ds.SOPInstanceUID: ds for ds in map(pydicom.dcmread, folder.rglob("*")) if ds.StudyInstanceUID == study}


def test_storescu_sends_a_series_and_storescp_receives_an_rtstruct_seg_and_sr_on_that_series(night):
    a, axial = night["study"]["A"], night["series"]["A"]["axial"]
    assert night["storescu_a"].returncode == 0, night["storescu_a"].stderr
    v1 = night["node"].version(a).inferred
    assert v1["status"] == "done" and [kind for kind, _ in v1["results"]] == ["rtstruct", "dicom_seg", "sr"]
    sent = {pydicom.dcmread(path).SOPInstanceUID for _, path in v1["results"]}
    received = results_at_tps(night, a)
    assert sent <= set(received), "A v1's three objects at the TPS"
    rtstruct = next(ds for uid, ds in received.items() if uid in sent and ds.Modality == "RTSTRUCT")
    referenced = rtstruct.ReferencedFrameOfReferenceSequence[0].RTReferencedStudySequence[0]
    assert referenced.RTReferencedSeriesSequence[0].SeriesInstanceUID == axial
    text = night["node"].text()
    assert re.search(
        rf"received series {axial} of study {a} v1: CT, 20 instance\(s\), 'Chest 5mm', from STORESCU", text
    )
    assert re.search(rf"inferred study {a} v1 in [0-9.]+ s: case NODE-A done", text)
    assert re.search(rf"sent study {a} v1 to TPS@127.0.0.1:[0-9]+: rtstruct, dicom_seg, sr in", text)


def test_every_instance_acknowledged_before_a_kill_is_on_disk_and_the_study_is_then_inferred(night):
    assert night["b_statuses"] == [0] * 6
    assert night["b_versions"] == [], "B was not frozen while its sender's association was open"
    assert set(night["b_on_disk"]) == set(night["b_sent"]), "each acknowledged slice of B survived the kill, whole"
    for name, ds in night["b_on_disk"].items():
        assert ds.PixelData == night["b_sent"][name].PixelData
    outcome = night["node"].version(night["study"]["B"]).inferred
    assert outcome["status"] == "no usable CT", outcome
    assert "6 CT images, fewer than series_rules#min_slices (10)" in outcome["reason"]
    assert not outcome["results"] and not list((night["node"].version(night["study"]["B"]).folder / "sent").glob("*"))
    assert re.search(
        rf"inferred study {night['study']['B']} v1 in [0-9.]+ s: no usable CT: NODE-B: ", night["node"].text()
    )


def test_a_result_half_sent_when_the_node_was_killed_is_finished_once_with_the_same_uids(night):
    before = night["a_late_before_kill"]
    assert [bool(o["delivered_at"]) for o in before["objects"]] == [True, False, False], before
    after = night["node"].version(night["study"]["A"]).sending(f"LATE@127.0.0.1:{night['late'].port}")
    assert after["status"] == "delivered"
    assert [o["sop_instance_uid"] for o in after["objects"]] == [o["sop_instance_uid"] for o in before["objects"]]
    acknowledged = night["late"].acknowledged
    assert all(acknowledged[o["sop_instance_uid"]] == 1 for o in after["objects"]), "each object stored once"
    received = Counter(night["tps_received"])
    assert received and max(received.values()) == 1, f"nothing delivered to the TPS twice: {received}"


def test_a_study_whose_inference_was_killed_is_inferred_after_the_restart_with_no_child_left(night):
    assert night["c_inferred_before_kill"] is None and night["children_after_kill"] == [0]
    outcome = night["node"].version(night["study"]["C"]).inferred
    assert outcome["status"] == "done" and len(outcome["results"]) == 3
    assert night["node"].text().count(f"inferred study {night['study']['C']} v1") == 1


def test_orthanc_sends_a_study_to_the_node_and_receives_its_results_as_a_destination(night):
    assert night["orthanc_store"].ok, night["orthanc_store"].text
    modalities = Counter(series["Modality"] for series in night["orthanc_series"])
    assert modalities["RTSTRUCT"] == 1 and modalities["SEG"] == 1 and modalities["SR"] == 1, modalities
    received = night["node"].version(night["study"]["C"]).received
    assert received["senders"] == ["ORTHANC"]
    kinds = Counter(series["modality"] for series in received["series"])
    assert kinds == {"CT": 4}, "the scout, both series and the captures (Modality CT, as scanners write them) arrived"
    chosen = [case["series_uid"] for case in night["node"].version(night["study"]["C"]).inferred["cases"]]
    assert chosen == [night["series"]["C"]["axial"]]


def test_a_caller_not_allowed_gets_nothing_and_the_node_stops_cleanly_on_sigterm(night):
    assert night["intruder"].returncode != 0
    text = night["node"].text()
    assert "refused an association from AE 'INTRUDER'" in text
    assert night["returncode"] == 0 and "DICOM node NSCLC_GTV stopped" in text
    assert not list((night["node"].folder / "incoming").rglob("*.dcm")), "nothing of the intruder's was stored"
    assert os.path.isfile(night["node"].folder / "node.lock")

"""The node's listening side: a pynetdicom Application Entity that answers C-ECHO and takes C-STORE into the spool.

* **Who may talk to it.** An association from a calling AE title not in ``allowed_callers`` is rejected (permanent,
  "calling AE title not recognised"), and one that arrives while the node's folder has less than ``min_free_gb`` free
  is rejected (transient, "local limit exceeded"), each with a log line saying who and why. With a certificate and
  key the associations are TLS (with ``tls_ca``: the callers' certificates are required and checked against it).
* **What it takes.** Any storage SOP class (a CT study comes with scouts, secondary captures, an RTSTRUCT; inference
  chooses its series and leaves the rest, as from a folder) in the transfer syntaxes the bundle reads. An instance is
  written as it arrived -- the encoded data set behind its file meta information -- synced to disk, and only then
  acknowledged; one whose Study or SOP Instance UID is not a UID is refused (0xC000) rather than named into a path.
* **When a study is complete.** The receiver tracks which studies each open association has sent to: a study is
  quiet once no open association has sent to it and nothing new arrived for the quiet period (:mod:`.spool`).
"""

from __future__ import annotations

import logging
import shutil
import ssl
import threading
from collections import Counter
from pathlib import Path
from typing import Any

from pydicom.filebase import DicomFileLike
from pydicom.filewriter import write_file_meta_info
from pydicom.uid import (
    JPEG2000,
    DeflatedExplicitVRLittleEndian,
    ExplicitVRBigEndian,
    ExplicitVRLittleEndian,
    ImplicitVRLittleEndian,
    JPEG2000Lossless,
    JPEGBaseline8Bit,
    JPEGExtended12Bit,
    JPEGLossless,
    JPEGLosslessSV1,
    JPEGLSLossless,
    JPEGLSNearLossless,
    RLELossless,
)
from pynetdicom import AE, AllStoragePresentationContexts, evt
from pynetdicom.sop_class import Verification
from scripts.inference.node.spool import Spool, is_uid

logger = logging.getLogger(__name__)

#: what the bundle reads (pydicom with pylibjpeg, openjpeg and pyjpegls: requirements.txt)
TRANSFER_SYNTAXES = [ExplicitVRLittleEndian, ImplicitVRLittleEndian, DeflatedExplicitVRLittleEndian,
                     ExplicitVRBigEndian, JPEGLosslessSV1, JPEGLossless, JPEGBaseline8Bit, JPEGExtended12Bit,
                     JPEGLSLossless, JPEGLSNearLossless, JPEG2000Lossless, JPEG2000, RLELossless]  # fmt: skip
SUCCESS, OUT_OF_RESOURCES, CANNOT_UNDERSTAND = 0x0000, 0xA700, 0xC000


class Receiver:
    """C-ECHO and C-STORE into ``spool`` on ``bind:port`` as ``ae_title``; :meth:`start`, then :meth:`stop`."""

    def __init__(
        self, spool: Spool, ae_title: str, port: int, bind: str = "0.0.0.0", allowed_callers: list[str] | None = None,
        min_free_gb: float = 5.0, tls_cert: str | None = None, tls_key: str | None = None, tls_ca: str | None = None,
    ) -> None:  # fmt: skip
        self.spool, self.port, self.bind, self.min_free_gb = spool, int(port), bind, float(min_free_gb)
        self.allowed = None if allowed_callers is None else {str(a).strip() for a in allowed_callers}
        self.ae = AE(ae_title=ae_title)
        for context in AllStoragePresentationContexts:
            self.ae.add_supported_context(context.abstract_syntax, TRANSFER_SYNTAXES)
        self.ae.add_supported_context(Verification)
        self.ssl_context = tls_context(tls_cert, tls_key, tls_ca)
        self._lock = threading.Lock()
        self._studies_of: dict[int, set[str]] = {}  # open association (id) -> the studies it sent to
        self._counts: dict[int, Counter] = {}
        self._server: Any = None

    @property
    def busy(self) -> set[str]:
        """The studies an open association has sent instances of."""
        with self._lock:
            return set().union(*self._studies_of.values())

    def start(self) -> None:
        handlers = [(evt.EVT_REQUESTED, self._on_requested), (evt.EVT_C_STORE, self._on_store),
                    (evt.EVT_C_ECHO, self._on_echo), (evt.EVT_RELEASED, self._on_end), (evt.EVT_ABORTED, self._on_end),
                    (evt.EVT_CONN_CLOSE, self._on_end)]  # fmt: skip
        self._server = self.ae.start_server((self.bind, self.port), block=False, evt_handlers=handlers,
                                            ssl_context=self.ssl_context)  # fmt: skip
        self.port = self._server.server_address[1]

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server = None

    # -------------------------------------------------------------------------------------------- events
    def _on_requested(self, event: Any) -> None:
        requestor = event.assoc.requestor
        caller, host, port = requestor.primitive.calling_ae_title.strip(), requestor.address, requestor.port
        if self.allowed is not None and caller.strip() not in self.allowed:
            logger.warning("refused an association from AE %r at %s:%s: the calling AE title is not in "
                           "dicom_allowed_callers %s", caller, host, port, sorted(self.allowed))  # fmt: skip
            _reject(event.assoc, 0x01, 0x01, 0x03)  # permanent; service user; calling AE title not recognised
            return
        free_gb = shutil.disk_usage(self.spool.folder).free / 1e9
        if free_gb < self.min_free_gb:
            logger.error("refused an association from AE %r at %s:%s: %.1f GB free in %s, below dicom_min_free_gb "
                         "%.1f: free space there (results of earlier studies can be removed once sent)", caller, host,
                         port, free_gb, self.spool.folder, self.min_free_gb)  # fmt: skip
            _reject(event.assoc, 0x02, 0x03, 0x02)  # transient; service provider; local limit exceeded

    def _on_echo(self, event: Any) -> int:
        logger.info("C-ECHO from AE %r", event.assoc.requestor.ae_title)
        return SUCCESS

    def _on_store(self, event: Any) -> int:
        caller = event.assoc.requestor.ae_title.strip()
        if shutil.disk_usage(self.spool.folder).free / 1e9 < self.min_free_gb:
            logger.error("refused an instance from AE %r: the disk of %s is below dicom_min_free_gb", caller,
                         self.spool.folder)  # fmt: skip
            return OUT_OF_RESOURCES
        try:
            study = str(event.dataset.get("StudyInstanceUID", ""))
        except Exception as err:
            logger.error("refused an instance from AE %r that cannot be decoded: %s", caller, err)
            return CANNOT_UNDERSTAND
        sop = str(event.request.AffectedSOPInstanceUID)
        if not (is_uid(study) and is_uid(sop)):
            logger.error("refused an instance from AE %r: StudyInstanceUID %r or SOPInstanceUID %r is not a UID",
                         caller, study[:80], sop[:80])  # fmt: skip
            return CANNOT_UNDERSTAND

        def write(handle: Any) -> None:
            handle.write(b"\x00" * 128 + b"DICM")
            write_file_meta_info(DicomFileLike(handle), event.file_meta, enforce_standard=True)
            handle.write(event.request.DataSet.getvalue())

        with self._lock:  # busy before the first byte is written: the study is never frozen under an instance
            self._studies_of.setdefault(id(event.assoc), set()).add(study)
        self.spool.store(study, sop, write, sender=caller)
        with self._lock:
            self._counts.setdefault(id(event.assoc), Counter())[study] += 1
        return SUCCESS

    def _on_end(self, event: Any) -> None:
        with self._lock:
            studies = self._studies_of.pop(id(event.assoc), set())
            counts = self._counts.pop(id(event.assoc), Counter())
        if studies:
            logger.info("association from AE %r ended: %d instance(s) of %d study(ies) received",
                        event.assoc.requestor.ae_title.strip(), sum(counts.values()), len(studies))  # fmt: skip


def _reject(assoc: Any, result: int, source: int, reason: int) -> None:
    """Answer an association request with A-ASSOCIATE-RJ, as pynetdicom's own checks do: the rejection, then the
    association ended once it has gone out (closing the socket at once would reach the caller as an abort)."""
    assoc.acse.send_reject(result, source, reason)
    evt.trigger(assoc, evt.EVT_REJECTED, {})
    assoc.kill()


def tls_context(cert: str | Path | None, key: str | Path | None, ca: str | Path | None = None) -> ssl.SSLContext | None:
    """The server's TLS context from a PEM certificate and key (both or neither); with ``ca``, callers must present a
    certificate it signed."""
    if not cert and not key:
        if ca:
            raise ValueError("dicom_tls_ca needs dicom_tls_cert and dicom_tls_key: the node's own certificate and key")
        return None
    if not (cert and key):
        raise ValueError("TLS needs both dicom_tls_cert and dicom_tls_key (PEM files)")
    for name, path in (("dicom_tls_cert", cert), ("dicom_tls_key", key), ("dicom_tls_ca", ca)):
        if path and not Path(path).is_file():
            raise ValueError(f"{name} {path}: no such file")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(str(cert), str(key))
    if ca:
        context.load_verify_locations(str(ca))
        context.verify_mode = ssl.CERT_REQUIRED
    return context

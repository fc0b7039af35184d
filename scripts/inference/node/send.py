"""The node's results back by C-STORE: each study version's RTSTRUCT, SEG and SR to every destination.

Each destination's sending is recorded in the version's ``sent/<destination>.json`` (:mod:`.spool`): the objects
with their SOP Instance UIDs and files, which were delivered and when, the attempts, the last error and when to try
next. An object is marked delivered as soon as the destination acknowledges its C-STORE, so a node killed midway sends
only the rest when it starts again; one sent twice (acknowledged, then the node killed before it wrote that down) is
the same file with the same SOP Instance UID, which a receiver stores once, replacing it. A destination that is down,
refuses the association or fails a C-STORE is tried again after ``retry_s``, then twice as long each time (at most
10 minutes between tries), ``attempts`` times in all; after that its record says ``failed`` and the node tries again
only when it is started again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pydicom
from pydicom.errors import InvalidDicomError
from pydicom.uid import ExplicitVRLittleEndian, ImplicitVRLittleEndian
from pynetdicom import AE, _config
from scripts.inference.node.spool import Version

MAX_WAIT_S = 600.0
#: C-STORE statuses that mean the destination holds the object (success; warnings: coerced, elements discarded)
STORED = {0x0000, 0xB000, 0xB006, 0xB007}
TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Destination:
    """A DICOM node results go to: ``AE@host:port``."""

    ae_title: str
    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> Destination:
        ae_title, at, address = str(text).strip().partition("@")
        host, colon, port = address.rpartition(":")
        valid_port = port.isdigit() and 0 < int(port) < 65536
        if not (at and colon and ae_title and host and valid_port and len(ae_title) <= 16):
            raise ValueError(f"dicom_destinations: {text!r} is not AE@host:port (an AE title of at most 16 characters, "
                             "e.g. TPS@tps.example.org:104)")  # fmt: skip
        return cls(ae_title, host.strip("[]"), int(port))

    def __str__(self) -> str:
        return f"{self.ae_title}@{self.host}:{self.port}"


def new_record(version: Version, destination: Destination) -> dict:
    """A destination's sending before the first try: every result of the version, none delivered."""
    objects = []
    for kind, path in (version.inferred or {}).get("results", []):
        ds = pydicom.dcmread(path, stop_before_pixels=True, specific_tags=["SOPInstanceUID", "SOPClassUID"])
        objects.append({"kind": kind, "file": str(path), "sop_instance_uid": str(ds.SOPInstanceUID),
                        "sop_class_uid": str(ds.SOPClassUID),
                        "transfer_syntax": str(ds.file_meta.TransferSyntaxUID), "delivered_at": None})  # fmt: skip
    return {"destination": str(destination), "status": "pending", "attempts": 0, "last_error": None, "next_try": 0.0,
            "objects": objects}  # fmt: skip


def due(record: dict, now: float | None = None) -> bool:
    """Whether the destination should be tried now: pending, and its back-off has passed."""
    return record["status"] == "pending" and (now or time.time()) >= record["next_try"]


def send(version: Version, destination: Destination, record: dict, calling_ae: str, retry_s: float,
         attempts: int) -> dict:  # fmt: skip
    """One try at delivering what ``record`` lists as not yet delivered; the record, updated and written after every
    acknowledged object, is returned (status delivered, pending with its next try, or failed)."""
    record["attempts"] += 1
    started = time.monotonic()
    try:
        _deliver(version, destination, record, calling_ae)
    except SendError as err:
        record["last_error"] = str(err)
        if record["attempts"] >= attempts:
            record["status"] = "failed"
        else:
            record["next_try"] = time.time() + min(retry_s * 2 ** (record["attempts"] - 1), MAX_WAIT_S)
    else:
        record.update(status="delivered", last_error=None, seconds=round(time.monotonic() - started, 2))
    version.record_sending(str(destination), record)
    return record


def _store(assoc: AE, path: str) -> Any:
    """C-STORE of the file at ``path`` as it is encoded on disk (an RTSTRUCT of a large tumour holds thousands of
    contours: decoding and encoding it again costs seconds); where the destination accepted only another transfer
    syntax, decoded and encoded in that one."""
    chunked = _config.STORE_SEND_CHUNKED_DATASET
    try:
        _config.STORE_SEND_CHUNKED_DATASET = True
        return assoc.send_c_store(path)
    except ValueError:  # no accepted presentation context in the file's own transfer syntax
        _config.STORE_SEND_CHUNKED_DATASET = False
        return assoc.send_c_store(path)
    finally:
        _config.STORE_SEND_CHUNKED_DATASET = chunked


class SendError(RuntimeError):
    """A destination down, refusing, or failing a C-STORE: tried again later."""


def _deliver(version: Version, destination: Destination, record: dict, calling_ae: str) -> None:
    pending = [o for o in record["objects"] if not o["delivered_at"]]
    if not pending:
        return
    for obj in pending:
        if not Path(obj["file"]).is_file():
            raise SendError(f"{obj['file']} is missing: the node's folder was changed by hand")
    ae = AE(ae_title=calling_ae)
    ae.acse_timeout = ae.dimse_timeout = ae.network_timeout = TIMEOUT_S
    # a context in each file's own transfer syntax (the file goes as it is encoded), another in the usual ones
    for sop_class, syntax in sorted({(o["sop_class_uid"], o["transfer_syntax"]) for o in pending}):
        ae.add_requested_context(sop_class, [syntax])
        usual = [s for s in (ExplicitVRLittleEndian, ImplicitVRLittleEndian) if s != syntax]
        ae.add_requested_context(sop_class, usual)
    assoc = ae.associate(destination.host, destination.port, ae_title=destination.ae_title)
    if not assoc.is_established:
        why = "rejected the association" if assoc.is_rejected else "gave no association (down, unreachable or slow)"
        raise SendError(f"{destination} {why}")
    try:
        for obj in pending:
            try:
                answer = _store(assoc, obj["file"])
            except (OSError, InvalidDicomError) as err:
                raise SendError(f"{obj['file']} cannot be read ({err}): the node's folder was changed by hand") from err
            status = int(answer.get("Status", -1)) if answer else -1
            if status not in STORED:
                answer = f"with status 0x{status:04X}" if status >= 0 else "with nothing (cut or timed out)"
                raise SendError(f"{destination} answered the C-STORE of the {obj['kind']} {answer}")
            obj["delivered_at"] = time.time()
            version.record_sending(str(destination), record)
    finally:
        if assoc.is_established:
            assoc.release()

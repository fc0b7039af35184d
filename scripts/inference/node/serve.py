"""The node's life: receive, freeze each study when it falls quiet, infer it, send its results; pick up after a crash.

Three loops share the spool on disk and nothing else: the receiver's threads (:mod:`.receive`) write instances; the
main thread freezes quiet studies into versions and infers them one at a time, each by ``monai.bundle run inference``
in a child process with the node's own options (its configs, weights, device, backend, outputs, series rules), so a
study is inferred exactly as ``run inference`` infers a folder, and a crash or a leak in one study never takes the node
down; a sending thread delivers each version's results (:mod:`.send`). The child dies with the node (Linux's
parent-death signal), so a killed node leaves no inference running; started again, the node completes what a kill
interrupted: versions not yet inferred are inferred (cases finished before the kill are kept, as a cohort resumes),
results not yet delivered are sent.
"""

from __future__ import annotations

import logging
import os
import queue
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from scripts.common.config import unset
from scripts.common.files import hold_lock, read_json
from scripts.inference.cohort import part_report_path
from scripts.inference.node.receive import Receiver
from scripts.inference.node.send import Destination, due, new_record, send
from scripts.inference.node.spool import Spool, Version

logger = logging.getLogger(__name__)

#: options of the node's command line that a study's inference does not take from it (it gets its own input and
#: output folders, a single part, a fresh start)
NOT_FORWARDED = {"input_dir", "output_dir", "run_id", "num_parts", "part_id", "dicomweb_url", "study_uids",
                 "dicomweb_query", "store", "force_store", "redo", "dicom_launcher"}  # fmt: skip
#: the RTSTRUCT first: the object a planning system imports
RESULTS = ("rtstruct", "dicom_seg", "sr")
# a child that dies with its parent (PR_SET_PDEATHSIG survives execve), and not at all if the parent is already gone;
# its command looked up on PATH (a launcher: srun, apptainer)
_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None).prctl(1, signal.SIGKILL)\n"
    "os.getppid() == int(sys.argv[1]) or sys.exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


class NodeLockedError(RuntimeError):
    """Another node runs on the same folder."""


def serve(
    output_dir: str | Path, ae_title: str, port: int, destinations: Sequence[str] | str = (),
    allowed_callers: Sequence[str] | str | None = None, bind: str = "0.0.0.0", quiet_s: float = 10.0,
    retry_s: float = 5.0, send_attempts: int = 20, min_free_gb: float = 5.0, tls_cert: str | None = None,
    tls_key: str | None = None, tls_ca: str | None = None, inference_args: Sequence[str] | None = None,
    weights: Sequence[str | Path] = (), stop: threading.Event | None = None, poll_s: float = 0.5,
    launcher: str | None = None,
) -> None:  # fmt: skip
    """Run the node until SIGTERM, SIGINT or ``stop``: listen as ``ae_title`` on ``bind:port``, queue in
    ``output_dir``, infer each study with ``inference_args`` (default: this process's own ``monai.bundle run`` options)
    and send its RTSTRUCT, SEG and SR to every ``AE@host:port`` of ``destinations``; ``weights`` are checked to be
    there before it listens. ``launcher``: the command that starts each study's inference in place of ``python``
    (``"srun --gres=gpu:1 python"``, ``"apptainer exec --nv nsclc.sif python"``)."""
    missing = [str(path) for path in weights if not Path(path).is_file()]
    if missing:
        raise FileNotFoundError(f"the weights {', '.join(missing)}: no such file (pass --model_path or --model_paths)")
    spool = Spool(output_dir)
    holder = hold_lock(spool.folder / "node.lock")
    if holder:
        raise NodeLockedError(f"a DICOM node already runs on {spool.folder} ({holder}): stop it, or give this one "
                              "another --output_dir")  # fmt: skip
    targets = [Destination.parse(d) for d in _as_list(destinations)]
    allowed = None if unset(allowed_callers) else _as_list(allowed_callers)
    args = list(inference_args) if inference_args is not None else forwarded_args(sys.argv)
    python = () if unset(launcher) else shlex.split(launcher)
    logging.getLogger("pynetdicom").setLevel(logging.WARNING)  # a line per PDU otherwise; the node logs its own
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    versions = spool.versions()
    recovered = _recover(spool, versions)
    receiver = Receiver(spool, ae_title, port, bind, allowed, min_free_gb, tls_cert, tls_key, tls_ca)
    receiver.start()
    logger.info("DICOM node %s listening on %s:%d%s; queue %s; results to %s; callers: %s; %s", ae_title, bind,
                receiver.port, " (TLS)" if receiver.ssl_context else "", spool.folder,
                ", ".join(map(str, targets)) or "nowhere (dicom_destinations is empty)",
                ", ".join(sorted(allowed)) if allowed is not None else "any AE title", recovered)  # fmt: skip
    if allowed is None:
        logger.warning("dicom_allowed_callers is not set: any calling AE title may send this node CTs")
    outbox: queue.Queue[Version] = queue.Queue()  # versions inferred: the sender's to look at
    for version in versions:
        outbox.put(version)
    sender = threading.Thread(target=_send_loop, args=(outbox, targets, ae_title, retry_s, send_attempts, stop, poll_s),
                              name="node sender", daemon=True)  # fmt: skip
    sender.start()
    try:
        todo = [version for version in versions if version.inferred is None]
        _infer_loop(spool, receiver, todo, outbox, args, quiet_s, stop, poll_s, python)
    finally:
        stop.set()
        receiver.stop()
        sender.join(timeout=TIMEOUT_JOIN_S)
        logger.info("DICOM node %s stopped", ae_title)


TIMEOUT_JOIN_S = 120.0


def forwarded_args(argv: Sequence[str]) -> list[str]:
    """The options of ``monai.bundle run serve ...`` (``argv`` as :data:`sys.argv` holds it) that a study's
    ``monai.bundle run inference`` takes too: all but the run id and :data:`NOT_FORWARDED`."""
    words, args = list(argv[1:]), []
    if words[:1] == ["run"]:
        words = words[1:]
    while words:
        word = words.pop(0)
        if not word.startswith("--"):
            continue  # the run id
        key, eq, _ = word[2:].partition("=")
        taken = [word] if eq or not words else [word, words.pop(0)]
        if key.replace("-", "_") not in NOT_FORWARDED:
            args += taken
    return args


def _as_list(value: Sequence[str] | str) -> list[str]:
    if isinstance(value, str):
        return [value] if value.strip() else []
    return [str(v) for v in value]


def _recover(spool: Spool, versions: list[Version]) -> str:
    """What a killed node left, made whole: unacknowledged instances removed, ``versions`` completed, failed sendings
    tried again. Returns a summary for the start's log line."""
    removed = spool.remove_unacknowledged()
    for version in versions:
        if version.received is None:
            spool.complete(version)
            _log_received(version)
        for record_file in (version.folder / "sent").glob("*.json"):
            record = read_json(record_file)
            if record.get("status") == "failed":  # a restart is an operator's action: try again
                version.record_sending(record["destination"], {**record, "status": "pending", "attempts": 0})
    to_infer = sum(v.inferred is None for v in versions)
    return (f"{len(versions)} study version(s) queued, {to_infer} to infer"
            + (f"; {removed} unacknowledged instance(s) removed" if removed else ""))  # fmt: skip


# ------------------------------------------------------------------------------------------------ inference
def _infer_loop(spool: Spool, receiver: Receiver, todo: list[Version], outbox: queue.Queue, args: list[str],
                quiet_s: float, stop: threading.Event, poll_s: float, python: Sequence[str]) -> None:  # fmt: skip
    """Freeze the studies that fell quiet and infer the versions ``todo`` lists, oldest first, one at a time; each
    inferred version goes to the sender's ``outbox``. Work is found in memory, not by rescanning the spool: a node that
    has served thousands of studies polls as cheaply as a new one."""
    while not stop.is_set():
        for study in spool.quiet_studies(quiet_s, receiver.busy):
            try:
                version = spool.freeze(study)
            except OSError as err:  # a full disk, say: the instances stay in incoming/ for the next try
                logger.error("could not queue study %s for inference: %s", study, err)
                continue
            if version is not None:
                _log_received(version)
                todo.append(version)
        if not todo:
            stop.wait(poll_s)
            continue
        version = todo[0]
        try:
            outcome = unchanged(version) or infer(version, args, stop, python)
        except Exception as err:  # recorded; the node goes on with the next study
            outcome = {"status": "failed", "reason": f"{type(err).__name__}: {err}", "cases": [], "results": []}
            version.record_inferred(outcome)
            logger.exception("%s: inference could not run", version.name)
        if outcome is not None:  # None: stopped midway, inferred at the next start
            todo.pop(0)
            outbox.put(version)


def _log_received(version: Version) -> None:
    received = version.received or {}
    senders = ", ".join(received.get("senders", [])) or "an AE before a restart"
    for series in received.get("series", []):
        logger.info("received series %s of %s: %s, %d instance(s)%s, from %s", series["series_uid"], version.name,
                    series["modality"] or "no modality", series["instances"],
                    f", {series['description']!r}" if series["description"] else "", senders)  # fmt: skip


def unchanged(version: Version) -> dict | None:
    """The outcome of a version that brought no new or changed CT image (say, the node's own results sent back to it
    by a PACS, or an RTSTRUCT alone): recorded as ``unchanged`` and not inferred; None for a version to infer."""
    received, previous = version.received or {}, version.previous
    earlier = (previous.received or {}) if previous else {}
    if not previous or earlier.get("ct_images_sha256") != received.get("ct_images_sha256"):
        return None
    kinds = sorted({s["modality"] or "?" for s in received.get("series", [])})
    outcome = {"status": "unchanged", "reason": f"no new or changed CT image since v{previous.number} (the study holds "
               f"{', '.join(kinds)}): nothing to infer", "cases": [], "results": [], "seconds": 0.0}  # fmt: skip
    version.record_inferred(outcome)
    logger.info("%s: %s", version.name, outcome["reason"])
    return outcome


def infer(
    version: Version, args: Sequence[str], stop: threading.Event | None = None, python: Sequence[str] = ()
) -> dict | None:
    """``monai.bundle run inference`` on the version's input into its output folder, in a child process that dies
    with this one, started by ``python`` (default: this interpreter); its outcome recorded in ``inferred.json`` and
    returned (None if ``stop`` ended it: not recorded, so it runs again)."""
    command = [*(python or [sys.executable]), "-m", "monai.bundle", "run", "inference", *args, "--input_dir",
               str(version.input_dir), "--output_dir", str(version.output_dir)]  # fmt: skip
    started = time.monotonic()
    with (version.folder / "inference.log").open("ab") as log:
        child = subprocess.Popen([sys.executable, "-c", _WITH_PARENT, str(os.getpid()), *command], stdout=log,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)  # fmt: skip
        while child.poll() is None:
            if stop is not None and stop.wait(0.2):
                child.terminate()
                child.wait()
                return None
    outcome = outcome_of(version, child.returncode, time.monotonic() - started)
    version.record_inferred(outcome)
    _log_inferred(version, outcome)
    return outcome


def outcome_of(version: Version, returncode: int, seconds: float) -> dict:
    """The version's outcome from its inference report (the merged one, else its part's, which a run that found no
    usable input leaves): ``done`` with the results to send; ``no usable CT`` (every case refused at its check, or
    none found), with why; or ``failed``, with the failed cases' reasons or the end of the log."""
    merged, own = version.output_dir / "inference_report.json", part_report_path(1, 0, version.output_dir)
    report = read_json(merged) or read_json(own)
    cases = [{"case_id": c.get("case_id"), "status": c.get("status"), "reason": c.get("reason"),
              "stage": c.get("stage"), "flags": c.get("flags", []), "series_uid": c.get("series_uid")}
             for c in report.get("cases", [])]  # fmt: skip
    done = [c for c in report.get("cases", []) if c.get("status") == "done"]
    results = [[kind, c["outputs"][kind]] for c in done for kind in RESULTS if kind in c.get("outputs", {})]
    outcome = {"returncode": returncode, "seconds": round(seconds, 1), "cases": cases, "results": results,
               "report": str(version.output_dir / "inference_report.json")}  # fmt: skip
    if done:
        return {"status": "done", **outcome}
    failed = [c for c in cases if c["status"] == "failed"]
    reasons = [f"{c['case_id']}: {c['reason']}" for c in failed]
    if report and all(c["stage"] == "check" for c in failed):
        skipped = [f"{s.get('input', '?')}: {s.get('reason', '?')}" for s in report.get("skipped", [])]
        return {"status": "no usable CT", "reason": "; ".join(reasons + skipped) or "no CT series in the study",
                **outcome}  # fmt: skip
    if not reasons:
        log = (version.folder / "inference.log").read_text(errors="replace").strip().splitlines()
        reasons = [f"inference ended with status {returncode}: " + " | ".join(log[-3:])]
    return {"status": "failed", "reason": "; ".join(reasons), **outcome}


def _log_inferred(version: Version, outcome: dict) -> None:
    if outcome["status"] == "done":
        for case in outcome["cases"]:
            flags = "; ".join(map(str, case["flags"])) or "none"
            logger.info("inferred %s in %.1f s: case %s %s (flags: %s)", version.name, outcome["seconds"],
                        case["case_id"], case["status"], flags)  # fmt: skip
    else:
        logger.error("inferred %s in %.1f s: %s: %s (inference report %s)", version.name, outcome["seconds"],
                     outcome["status"], outcome["reason"], outcome["report"])  # fmt: skip


# ------------------------------------------------------------------------------------------------ sending
def _send_loop(outbox: queue.Queue, targets: list[Destination], ae_title: str, retry_s: float, attempts: int,
               stop: threading.Event, poll_s: float) -> None:  # fmt: skip
    """Deliver the results of every version the outbox brings to every destination, each when its back-off allows;
    a version leaves the list once nothing of it is left to send. Each version's records are read from disk once and
    kept here, so a destination that is down costs no I/O between its tries."""
    pending: dict[Version, dict[str, dict]] = {}  # version -> destination -> its sending record, as written
    while not stop.is_set():
        while not outbox.empty():
            version = outbox.get()
            try:
                records = _records(version, targets)
            except Exception:  # logged; the other versions go on
                logger.exception("%s: its results cannot be read; tried again when the node starts again", version.name)
                continue
            if records:
                pending[version] = records
        for version, records in list(pending.items()):
            if stop.is_set():
                break
            try:
                left = _send_version(version, records, targets, ae_title, retry_s, attempts)
            except Exception:  # logged; the other versions go on
                logger.exception("%s: sending failed; it is tried again when the node starts again", version.name)
                left = False
            if not left:
                del pending[version]
        stop.wait(poll_s)


def _records(version: Version, targets: list[Destination]) -> dict[str, dict]:
    """Each destination's sending record of an inferred version (a new one where none was written yet); none for a
    version with nothing to send."""
    outcome = version.inferred or {}
    if outcome.get("status") != "done" or not outcome.get("results"):
        return {}
    return {str(target): version.sending(str(target)) or new_record(version, target) for target in targets}


def _send_version(version: Version, records: dict[str, dict], targets: list[Destination], ae_title: str,
                  retry_s: float, attempts: int) -> bool:  # fmt: skip
    """Try each destination that is due (``records`` updated); whether anything of the version is left to send."""
    left = False
    for target in targets:
        record = records[str(target)]
        if due(record):
            record = records[str(target)] = send(version, target, record, ae_title, retry_s, attempts)
            _log_sent(version, target, record, attempts)
        left |= record["status"] == "pending"
    return left


def _log_sent(version: Version, target: Destination, record: dict, attempts: int) -> None:
    kinds = ", ".join(o["kind"] for o in record["objects"])
    if record["status"] == "delivered":
        logger.info("sent %s to %s: %s in %.2f s (attempt %d)", version.name, target, kinds, record["seconds"],
                    record["attempts"])  # fmt: skip
    elif record["status"] == "failed":
        logger.error("gave up sending %s to %s after %d attempts: %s (start the node again to try again)",
                     version.name, target, attempts, record["last_error"])  # fmt: skip
    else:
        wait = record["next_try"] - time.time()
        logger.warning("sending %s to %s failed (attempt %d of %d): %s; next try in %.0f s", version.name, target,
                       record["attempts"], attempts, record["last_error"], wait)  # fmt: skip

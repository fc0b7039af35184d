"""Download a TCIA collection's annotation series (SEG, or RTSTRUCT) and the CT series each one annotates.

:func:`download` lists the series, skips cases already complete on disk (:mod:`~scripts.data.tcia.markers`), fetches the
rest ``num_workers`` at a time through :class:`~scripts.data.tcia.client.NbiaClient`, and moves each case into place
only when both of its series are verified. One failed series never stops the others; the :class:`DownloadSummary` says
which failed and why.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path

from scripts.common.files import write_json
from scripts.common.labels import COLLECTION
from scripts.common.retry import RETRIES
from scripts.data.tcia.client import NbiaClient, file_safe, list_series, resolve_base_url
from scripts.data.tcia.errors import TciaError
from scripts.data.tcia.markers import (
    MARKER,
    STAGING,
    adopt_unmarked_case,
    existing_case,
    index_markers,
    move_into_place,
    remove_if_empty,
    remove_stale_temps,
)
from scripts.data.tcia.references import case_key, find_referenced_series_uid, find_referenced_sop_uids, read_annotation
from tqdm import tqdm

logger = logging.getLogger(__name__)


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
    collection: str = COLLECTION,
    limit: int | None = None,
    base_url: str | None = None,
    num_workers: int = 4,
    retries: int = RETRIES,
    modality: str = "SEG",
    backoff: float = 1.0,
    timeout: float = 300.0,
    progress: bool = True,
) -> DownloadSummary:
    """Download every ``modality`` series of ``collection`` with the CT series each one references, into
    ``<dataset_dir>/<collection>/<PatientID>/<SeriesNumber>/{seg,image}/``. Series that fail are reported in the
    summary (re-running retries them; completed cases are skipped); only a failing series listing raises.

    Args:
        dataset_dir: root folder (the same ``root_dir`` monai.apps.TciaDataset uses).
        collection: TCIA collection name.
        limit: only the first N series, sorted by PatientID then SeriesInstanceUID (default: all).
        base_url: NBIA API base URL (default: $TCIA_BASE_URL, else the public v1 endpoint).
        num_workers: series downloaded in parallel.
        retries: extra attempts per request after a network error, HTTP 5xx/429 or a cut/corrupt download (waiting
            ``backoff * 2**k`` seconds).
        modality: modality of the annotation series to list (SEG; RTSTRUCT lists RT structure sets, into
            ``rtstruct/`` as TciaDataset names it).
        backoff: first wait between attempts in seconds, doubled each time.
        timeout: seconds without data before a request counts as failed.
        progress: show a progress bar.
    """
    _check_arguments(collection, limit, num_workers, retries, modality)
    root = Path(dataset_dir)
    staging = root / STAGING
    client = NbiaClient(resolve_base_url(base_url), retries, backoff, timeout, staging / "downloads")
    series = list_series(collection, modality, client=client)
    if not series:
        raise TciaError(
            f"the NBIA listing at {client.base_url} has no {modality} series for collection {collection!r}; "
            "check --collection, --modality and --base_url"
        )
    series = series[:limit] if limit is not None else series
    logger.info("%d %s series listed for %s (after --limit)", len(series), modality, collection)

    remove_stale_temps(staging)
    summary = DownloadSummary(collection=collection, dataset_dir=str(root))
    todo = _skip_completed(series, root / collection, modality.lower(), summary)
    job = _CaseJob(client, root / collection, staging, modality)
    with tqdm(total=len(todo), desc=f"TCIA {collection}", unit="series", disable=not progress) as bar:
        _run_in_pool(job, todo, num_workers, summary, bar)
    for bucket in (summary.downloaded, summary.skipped, summary.failed):
        bucket.sort(key=lambda r: (r.patient_id, r.seg_series_uid))
    remove_if_empty(staging / "downloads")
    remove_if_empty(staging)
    return summary


def _check_arguments(collection: str, limit: int | None, num_workers: int, retries: int, modality: str) -> None:
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


def _skip_completed(series: list[dict], coll_dir: Path, seg_folder: str, summary: DownloadSummary) -> list[dict]:
    """Record the series whose case is complete on disk (marker, or an adoptable TciaDataset folder) as skipped;
    return the others, still to download."""
    completed = index_markers(coll_dir)
    todo = []
    for entry in series:
        uid = entry["SeriesInstanceUID"]
        done = completed.get(uid) or adopt_unmarked_case(coll_dir, entry, seg_folder)
        if done is None:
            todo.append(entry)
            continue
        summary.add(
            SeriesResult(uid, done.get("patient_id", ""), "skipped", case_dir=done.get("case_dir"),
                         image_series_uid=done.get("image_series_uid"), md5_verified=done.get("md5_verified"))
        )  # fmt: skip
    if summary.skipped:
        logger.info("%d series already complete, skipped", len(summary.skipped))
    return todo


def _run_in_pool(job: _CaseJob, todo: list[dict], num_workers: int, summary: DownloadSummary, bar: tqdm) -> None:
    """Download ``todo`` ``num_workers`` at a time; Ctrl-C stops queued and running series (their temporary folders
    are removed as they unwind)."""
    pool = ThreadPoolExecutor(max_workers=num_workers)
    try:
        for future in as_completed([pool.submit(job, entry) for entry in todo]):
            result = future.result()
            summary.add(result)
            if result.status == "failed":
                logger.error("failed: %s", result.reason)  # the reason names the series and patient
            bar.update(1)
    except BaseException:
        job.client.cancelled.set()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


class _CaseJob:
    """One case: annotation series -> read it -> the CT series it references -> marker -> atomic move into place.

    Called once per listed series from the worker threads; never raises -- a failure becomes a ``failed`` result whose
    reason names the series and patient, and the case's temporary folder is always removed.
    """

    def __init__(self, client: NbiaClient, coll_dir: Path, staging: Path, modality: str) -> None:
        self.client, self.coll_dir, self.staging, self.modality = client, coll_dir, staging, modality
        self.folder = modality.lower()  # "seg", as TciaDataset names it (seg_type.lower())
        self.install_lock = threading.Lock()

    def __call__(self, entry: dict) -> SeriesResult:
        uid = str(entry["SeriesInstanceUID"])
        patient = str(entry.get("PatientID") or "?")
        label = f"{self.modality} series {uid} (patient {patient})"
        temp = self.staging / f"{file_safe(uid)}.tmp-{os.getpid()}"
        try:
            shutil.rmtree(temp, ignore_errors=True)
            temp.mkdir(parents=True)
            annotation_files, annotation_md5 = self.client.fetch_series(uid, temp / self.folder, label)
            ds = read_annotation(temp / self.folder, annotation_files, self.modality, label)
            patient, series_number = case_key(ds)
            label = f"{self.modality} series {uid} (patient {patient})"
            dest = self.coll_dir / patient / series_number
            existing = existing_case(dest, uid, label, self.folder)
            if existing is not None:  # an unmarked TciaDataset folder for this very SEG: adopted, CT not fetched
                return SeriesResult(uid, patient, "skipped", case_dir=str(dest),
                                    image_series_uid=existing.get("image_series_uid"), md5_verified=False)  # fmt: skip
            ref_uid = self._referenced_ct(ds, uid, label)
            image_files, image_md5 = self.client.fetch_series(
                ref_uid, temp / "image", f"CT series {ref_uid} for {label}"
            )
            marker = {
                "seg_series_uid": uid, "image_series_uid": ref_uid, "patient_id": patient,
                "series_number": series_number, "seg_folder": self.folder, "seg_files": len(annotation_files),
                "image_files": len(image_files), "md5_verified": annotation_md5 and image_md5,
                "source": self.client.base_url, "completed": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }  # fmt: skip
            self._install(temp, dest, marker, label)
            return SeriesResult(uid, patient, "downloaded", case_dir=str(dest), image_series_uid=ref_uid,
                                md5_verified=marker["md5_verified"])  # fmt: skip
        except TciaError as err:
            reason = str(err)
            return SeriesResult(uid, patient, "failed", reason=reason if uid in reason else f"{label}: {reason}")
        except Exception as err:  # one bad case must not stop the run; report it with its series
            logger.debug("unexpected error for %s", label, exc_info=True)
            return SeriesResult(uid, patient, "failed", reason=f"{label}: {type(err).__name__}: {err}")
        finally:
            shutil.rmtree(temp, ignore_errors=True)

    def _referenced_ct(self, ds, uid: str, label: str) -> str:
        """The CT series the annotation references: named in it, else found by its instances in the same study."""
        ref_uid = find_referenced_series_uid(ds)
        if ref_uid is None:
            sops = find_referenced_sop_uids(ds)
            study = str(ds.get("StudyInstanceUID", ""))
            if sops and study:
                logger.info("%s names no referenced series; looking its %d instance(s) up in study %s", label,
                            len(sops), study)  # fmt: skip
                ref_uid = self.client.match_sop_in_study(study, sops, exclude=uid)
        if ref_uid is None:
            raise TciaError(
                "the SEG references no CT series (no ReferencedSeriesSequence, and no referenced instance was found "
                "in its study); this case cannot be used"
            )
        return ref_uid

    def _install(self, temp: Path, dest: Path, marker: dict, label: str) -> None:
        """Marker last into the complete folder, then the folder into place (another worker may have filled
        ``dest`` meanwhile: checked again under the lock)."""
        write_json(temp / MARKER, marker)
        with self.install_lock:
            existing_case(dest, marker["seg_series_uid"], label, self.folder)
            move_into_place(temp, dest)
        logger.info("%s: complete in %s (%d CT files)", label, dest, marker["image_files"])


def download_for_training(
    dataset_dir: str | Path, collection: str = COLLECTION, limit: int | None = None, base_url: str | None = None
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

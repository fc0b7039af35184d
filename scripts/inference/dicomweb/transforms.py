"""The two steps of a case from a PACS: :class:`RetrieveSeriesd` brings its series here (the first step of its loading,
so the next case downloads while the network runs), :class:`StoreResultsd` stores its results back into its study."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import weakref
from collections.abc import Hashable, Mapping
from pathlib import Path
from typing import Any

from ignite.engine import Engine, Events
from monai.transforms import MapTransform
from scripts.data.dicom.identity import ALGORITHM_NAME, bundle_version
from scripts.inference.dicomweb.client import DicomWeb, DicomWebError, DicomWebStoreError
from scripts.inference.records import update_run_report

logger = logging.getLogger(__name__)


class RetrieveSeriesd(MapTransform):
    """Bring a case's series from the server into a temporary folder (:meth:`DicomWeb.retrieve_series`) and put the
    folder under ``keys`` and ``source_path``, where :class:`scripts.inference.inputs.LoadCased` and the writers read
    it. A retrieval that fails removes its folder and raises (the case fails; the others go on). The folders live under
    one temporary folder made here, removed with whatever is left when this process ends."""

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
    (:meth:`DicomWeb.store`), unless this ``algorithm_version``'s (None: the bundle's) results for its series are there
    already (checked just before; ``force`` stores anyway). Also an evaluator handler: each case's outcome --
    ``stored`` (the objects) or ``already_stored`` (those found) -- goes into ``<output_dir>/inference_report.json`` as
    the case's ``store``.
    """

    stage = "store"  # what CaseByCaseEvaluator times it as

    def __init__(
        self,
        server: DicomWeb,
        output_dir: str | Path,
        keys: Any = "pred",
        enabled: bool = True,
        force: bool = False,
        algorithm_version: str | None = None,
    ) -> None:
        super().__init__(keys)
        if enabled and server.url is None:
            raise DicomWebError("--store true stores into a DICOMweb server: give --dicomweb_url URL.")
        self.server, self.output_dir = server, Path(output_dir)
        self.version = str(algorithm_version or bundle_version())
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
            stored = ", ".join(o["modality"] for o in outcome["objects"])
            logger.info("%s: stored %s into %s", case_id, stored, outcome["url"])
        self.outcomes[case_id] = outcome
        return d

    def attach(self, engine: Engine) -> None:
        """Record the outcomes after every case and at the end (listed after ``InferenceSummary``, which rewrites the
        report each time)."""
        engine.add_event_handler(Events.ITERATION_COMPLETED, self._record)
        engine.add_event_handler(Events.COMPLETED, self._record)

    def _record(self, engine: Engine) -> None:
        update_run_report(self.output_dir, {case_id: {"store": outcome} for case_id, outcome in self.outcomes.items()})

"""A case as inference carries it (:class:`Case`: a dict at run time, as MONAI passes them, its keys declared once),
the run's report of every case (``inference_report.json``: this module alone reads and writes it, for ``find_inputs``,
``find_cases``, ``InferenceSummary`` and ``StoreResultsd``), and the per-case items of an evaluator iteration for the
handlers that look at cases one by one (metrics, pictures)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypedDict

import numpy as np
import torch
from ignite.engine import Engine
from scripts.common.files import write_json

#: the run's report, in its output folder (a folder holding one is an inference run's output, never an input)
REPORT = "inference_report.json"


class Case(TypedDict, total=False):
    """A case's record: what found it (a folder's discovery, a DICOMweb query, a datalist), then how it ended."""

    case_id: str  # its name: its output folder, its files' prefix, its rows in report.csv and metrics.csv
    image: Any  # the CT: a series' folder (or URL), a NIfTI file; once loaded, the MetaTensor
    source: str  # dicom, nifti or unknown
    source_path: str  # where the CT was read from: the writers read the series' headers there
    series_uid: str  # a DICOM case's CT series, its study and its slices (on a PACS: how many)
    study_uid: str
    slice_paths: list[str]
    instances: int
    study: dict  # a PACS study's patient, date, description and accession number
    series: dict  # the series chosen and why (scripts.data.dicom.series_rules), the others and why not
    alternatives: list[dict]
    notes: list[str]
    status: str  # in the report: pending, done or failed
    stage: str  # where it failed: check, read, preprocess, collate, predict, postprocess, write or store
    reason: str  # why, naming the file


class Skipped(TypedDict, total=False):
    """An input that is no case, and why (a folder without a CT, a study found without one, results already stored)."""

    input: str
    case_id: str
    reason: str


def as_failed(case: Mapping, stage: str, reason: str | None = None) -> Case:
    """``case`` as the report lists it when it failed at ``stage``, for ``reason`` (None: the one it holds)."""
    return {**case, "status": "failed", "stage": stage, **({} if reason is None else {"reason": reason})}


def report_path(folder: str | Path) -> Path:
    """The run's report in ``folder``: ``<folder>/inference_report.json``."""
    return Path(folder) / REPORT


def write_run_report(folder: str | Path, report: Mapping) -> Path:
    """The run's report (every case with its outcome, and the inputs skipped) into ``folder``, atomically."""
    return write_json(report_path(folder), report)


def read_run_report(folder: str | Path) -> dict:
    """The run's report in ``folder``; one without cases where there is none."""
    path = report_path(folder)
    return json.loads(path.read_text()) if path.is_file() else {"cases": [], "skipped": []}


def update_run_report(folder: str | Path, fields: Mapping[str, Mapping]) -> None:
    """Add ``fields[case_id]`` to each case's record in the run's report in ``folder``, if there is a report."""
    if fields and report_path(folder).is_file():
        report = read_run_report(folder)
        for case in report.get("cases", []):
            case.update(fields.get(case.get("case_id"), {}))
        write_run_report(folder, report)


def merged_items(engine: Engine) -> list[dict]:
    """Per case, the evaluator's batch and output dicts in one (MONAI keeps ``case_id`` and other inputs in the batch,
    the network's ``image``/``pred`` and keys made by post-processing in the output)."""
    batch, output = engine.state.batch, engine.state.output
    if not isinstance(output, list):
        batch, output = [batch], [output]
    if not isinstance(batch, list) or len(batch) != len(output):
        return [dict(o) for o in output]
    return [{**b, **o} for b, o in zip(batch, output, strict=True)]


def label_map(tensor) -> np.ndarray:
    """A label map [X, Y, Z] from a one-hot [C, X, Y, Z] or a label map [1, X, Y, Z] tensor."""
    array = np.asarray(tensor.detach().cpu() if isinstance(tensor, torch.Tensor) else tensor)
    if array.ndim == 4 and array.shape[0] > 1:
        return array.argmax(0).astype(np.uint8)
    return array.reshape(array.shape[-3:]).astype(np.uint8)


def case_id_of(item: Mapping) -> str:
    """The case's id; for an item without one, its image's file name without the extension (``case`` without it)."""
    case_id = item.get("case_id")
    if case_id is None:
        meta = getattr(item.get("image"), "meta", {})
        case_id = Path(str(meta.get("filename_or_obj", "case"))).name.split(".")[0]
    return str(case_id)

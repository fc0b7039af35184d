"""Cases from a DICOMweb server: one per study (StudyInstanceUIDs and/or a QIDO-RS query), each with the CT series
the rules of scripts/data/dicom/series_rules.py choose (the rule a folder's studies get too), the choice and the
alternatives -- each with why it was not chosen -- written into ``inference_report.json``."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

import scripts.data.dicom.series_rules
from scripts.common.files import safe_name, unique_name
from scripts.data.dicom.identity import ALGORITHM_NAME, bundle_version
from scripts.data.dicom.series_rules import InstanceHeader, SeriesRules, choose_series, gantry_tilt_of
from scripts.inference.dicomweb.client import DicomWeb, DicomWebError
from scripts.inference.dicomweb.dicomjson import first, values
from scripts.inference.records import Case, Skipped, as_failed, write_run_report

logger = logging.getLogger(__name__)


def describe_series(series: Mapping, instances: Sequence[Mapping] | None) -> dict:
    """:func:`scripts.data.dicom.series_rules.describe_series` of a series from its QIDO-RS record and, when examined,
    its instances' headers (WADO-RS metadata, DICOM JSON)."""
    summary = {
        "series_uid": str(first(series, "SeriesInstanceUID")),
        "modality": str(first(series, "Modality", "")),
        "number": first(series, "SeriesNumber"),
        "description": first(series, "SeriesDescription", ""),
        "images": first(series, "NumberOfSeriesRelatedInstances", 0),
    }
    headers = (
        None
        if instances is None
        else [
            InstanceHeader(
                str(first(i, "SOPClassUID")),
                tuple(str(v) for v in values(i, "ImageType")),
                tuple(float(v) for v in values(i, "ImageOrientationPatient")),
                tuple(float(v) for v in values(i, "ImagePositionPatient")),
                gantry_tilt_of(first(i, "GantryDetectorTilt")),
            )
            for i in instances
        ]
    )
    return scripts.data.dicom.series_rules.describe_series(summary, headers)


def find_cases(
    server: DicomWeb,
    study_uids: str | Sequence[str] | None = None,
    query: Mapping[str, Any] | str | None = None,
    series_rules: SeriesRules | Mapping | None = None,
    report_dir: str | Path | None = None,
    store: bool = False,
    force_store: bool = False,
    algorithm_version: str | None = None,
) -> list[Case]:
    """Cases on the server, one per study (``study_uids`` and/or those the QIDO-RS ``query`` finds, e.g.
    ``{"ModalitiesInStudy": "CT", "StudyDate": "20250101-20250131"}``), each
    ``{"case_id", "image", "source": "dicom", "source_path", "study_uid", "series_uid", "instances"}`` with the CT
    series :func:`choose_series` picks (``image`` is the series' URL until :class:`RetrieveSeriesd` brings it here).

    A study that is not found, or whose CT series all break the rules, fails its ``check`` (the reason lists each
    series and why); a study the query found without any CT series is skipped, and so is one whose results for the
    chosen series are already stored by this ``algorithm_version`` (None: the bundle's) when ``store`` is on and not
    ``force_store``. With ``report_dir`` all of it goes to ``<report_dir>/inference_report.json``: the choice and the
    alternatives of every study. A failing request to the server (credentials, certificate, URL) raises
    :class:`DicomWebError`.
    """
    if server.url is None:
        raise DicomWebError("no DICOMweb server: give --dicomweb_url URL.")
    uids = _study_uids(study_uids)
    filters = _query(query)
    if not uids and not filters:
        raise DicomWebError(
            "--dicomweb_url needs --study_uids \"['1.2.3']\" or --dicomweb_query, e.g. "
            "\"{'ModalitiesInStudy':'CT','StudyDate':'20250101-20250131'}\""
        )
    rules = SeriesRules.of(series_rules)
    studies = server.find_studies(uids, filters)
    found = {first(s, "StudyInstanceUID") for s in studies}
    records, failed, skipped, names = [], [], [], set()
    for uid in (u for u in uids if u not in found):
        why = f"study {uid}: not found on {server.url} (QIDO-RS found no study with this StudyInstanceUID)"
        failed.append(as_failed(Case(case_id=uid, image=server.study_url(uid), source="dicom"), "check", why))
    version = algorithm_version or bundle_version()
    for study in studies:
        case_id = _case_id(study, names)
        record, problem = _study_case(server, study, case_id, rules, store and not force_store, version)
        if problem is None:
            records.append(record)
        elif problem == "skipped" or (problem == "no CT" and first(study, "StudyInstanceUID") not in uids):
            skipped.append(Skipped(input=record["image"], case_id=case_id, reason=record["reason"]))
        else:
            failed.append(as_failed(record, "check"))
    for entry in failed:
        logger.error("failed: %s", entry["reason"])
    for entry in skipped:
        logger.warning("skipped: %s", entry["reason"])
    if report_dir is not None:
        report = {"dicomweb_url": server.url, "study_uids": uids, "dicomweb_query": filters}
        write_run_report(
            report_dir, {**report, "series_rules": asdict(rules), "cases": records + failed, "skipped": skipped}
        )
    if not studies and not uids:
        logger.warning("the query %s found no study on %s", filters, server.url)
    counts = (len(records), server.url, len(failed), len(skipped))
    logger.info("%d case(s) to infer from %s; %d failed their check, %d skipped", *counts)
    keep = ("case_id", "image", "source", "source_path", "study_uid", "series_uid", "instances")
    return [{k: r[k] for k in keep} for r in records]


def _study_case(
    server: DicomWeb, study: Mapping, case_id: str, rules: SeriesRules, dedup: bool, version: str
) -> tuple[Case, str | None]:
    """The case record of one study, and None, or a problem (``failed``, ``no CT``, ``skipped``) with its reason in
    the record."""
    uid = str(first(study, "StudyInstanceUID"))
    record = Case(
        case_id=case_id, image=server.study_url(uid), source="dicom", study_uid=uid, study=_study_summary(study)
    )
    try:
        series = server.series_of(uid)
        described = []
        for item in (s for s in series if first(s, "Modality") == "CT"):
            enough = int(first(item, "NumberOfSeriesRelatedInstances", rules.min_slices) or 0) >= rules.min_slices
            headers = server.series_metadata(uid, first(item, "SeriesInstanceUID")) if enough else None
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
        record.update(
            image=series_url,
            source_path=series_url,
            series_uid=chosen["series_uid"],
            instances=chosen["images"],
            series=chosen,
        )
        if dedup:
            there = server.find_results(uid, chosen["series_uid"], version, series)
            if there:
                kinds = ", ".join(f"{o['modality']} {o['sop_uid']}" for o in there)
                record["reason"] = (
                    f"study {uid} ({case_id}): {ALGORITHM_NAME} {version}'s results for series "
                    f"{chosen['series_uid']} are already stored ({kinds}): not inferred again "
                    "(--force_store true infers and stores again)"
                )
                return record, "skipped"
    except DicomWebError as err:
        if err.status in (401, 403):
            raise  # the credentials: no other study will do better
        record["reason"] = f"study {uid} ({case_id}): {err}"
        return record, "failed"
    return record, None


def _study_summary(study: Mapping) -> dict:
    return {
        "patient_id": str(first(study, "PatientID", "") or ""),
        "date": str(first(study, "StudyDate", "") or ""),
        "description": str(first(study, "StudyDescription", "") or ""),
        "accession": str(first(study, "AccessionNumber", "") or ""),
    }


def _case_id(study: Mapping, taken: set[str]) -> str:
    """``<PatientID>_<StudyDate>`` in characters every file system takes (``_2``, ``_3``, ... when repeated)."""
    parts = [str(first(study, "PatientID", "") or "study"), str(first(study, "StudyDate", "") or "")]
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

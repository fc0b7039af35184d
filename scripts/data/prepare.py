"""One-time conversion of DICOM cases to NIfTI, a deterministic split, and a report of bad cases.

Input: any folder of DICOM -- a download by TCIA's NBIA Data Retriever as it is, the ``monai.apps.TciaDataset`` /
``scripts.data.tcia`` / ``scripts.data.synthetic`` layout ``<collection>/<PatientID>/<SeriesNumber>/{image,seg}/``, a
PACS or treatment-planning export. The cases are found from the files' headers by :mod:`scripts.data.dicom.discovery` (a
CT series and the SEG or RTSTRUCT that annotates it; the case id is the PatientID), which keeps what it read in
``<output_dir>/dicom_index.json`` so that a re-run reads only new or changed files. When ``<dataset_dir>/<collection>``
exists only that folder is searched (other collections may lie beside it); else the whole ``dataset_dir``, less the
output folder.

Output (``<output_dir>``):

* ``images/<case>.nii`` -- CT in HU, int16, on the scanner grid (resampling happens in the training transforms).
  Uncompressed by default: gzip (even at level 1) costs ~1 s per 512x512x120 CT to write and ~0.5 s to read back,
  several times the DICOM read itself, for ~2x less disk; ``compress_images=True`` writes ``.nii.gz`` instead;
* ``labels/<case>.nii.gz`` -- uint8, 0 = background, ``i + 1`` = ``labels[i]`` (1 = GTV by default);
* ``datalist.json`` -- ``training`` (each case with a ``fold``), ``validation`` and ``test`` lists. The split depends
  only on the patient ids and the seed (a hash order), never on the file system's listing order or the machine;
* ``prepare_report.json`` -- every case with its status; rejected cases carry a reason naming the file, and
  prepared cases that look unusual carry ``notes`` (listed together under ``noted``).

Content checks (no patient id is hard-coded): a case is rejected when its CT has a missing slice (a gap of whole
steps in the positions, or a jump in InstanceNumber: "download the series again"), slices at uneven spacing or with a
gantry tilt as the scanner acquired them (the reason names the gaps in mm and the angle, and says what to do: a
NIfTI volume needs one step on an orthogonal grid; inference takes such a series as it is), mixed series or
orientations, or undecodable files, when the SEG does not sit on the CT, or when a requested structure is empty
(NSCLC-Radiomics holds post-operative scans without a GTV). A CT stored in an unusual
orientation (rows/columns flipped, as for some prone or feet-first scans) is kept -- its affine places it correctly and
training reorients to RAS -- and noted, so that a user checking the data knows which cases to look at.

DICOM is parsed here once; training reads only the NIfTI files. A re-run skips cases that were prepared for the same
labels from the same files (paths, sizes, modification and inode change times -- the change time, which copy tools do
not set back, catches a file replaced by one carrying an old modification time). Every file is written under a
temporary name and renamed, so a killed run never leaves a half-written file behind.
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor, as_completed
from pathlib import Path

import nibabel as nib
import numpy as np
from scripts.common.config import as_bool
from scripts.common.cpus import usable_cpus
from scripts.common.files import display_name, save_nifti, write_json
from scripts.common.geometry import voxel_volume_ml
from scripts.common.labels import COLLECTION, check_labels
from scripts.data.dicom import LABEL_SOURCES, DicomCaseError, read_case
from scripts.data.dicom.discovery import INDEX, DiscoveryError, scan
from tqdm import tqdm

logger = logging.getLogger(__name__)

DATALIST = "datalist.json"
REPORT = "prepare_report.json"
USUAL_ORIENTATION = "LPS"  # NIfTI axis codes of an axial CT with ImageOrientationPatient [1,0,0,0,1,0], head up
CASES_PER_WORKER = 8


class PrepareError(RuntimeError):
    """The whole run cannot proceed (no cases, or a configuration that matches no case)."""


def prepare(
    dataset_dir: str | Path,
    output_dir: str | Path,
    labels: Sequence[str] = ("GTV-1",),
    collection: str = COLLECTION,
    val_fraction: float = 0.2,
    test_fraction: float = 0.1,
    num_folds: int = 5,
    seed: int = 0,
    num_workers: int | None = None,
    progress: bool = True,
    compress_images: bool = False,
    label_source: str = "auto",
) -> dict:
    """Convert every case under ``dataset_dir`` and write the datalist and the report.

    Args:
        dataset_dir: the DICOM in any folder layout (a TCIA download as it is, a PACS export); cases are found from
            the files' headers.
        output_dir: where ``images/``, ``labels/``, ``datalist.json`` and ``prepare_report.json`` go.
        labels: structures to prepare, SEG segment names or patterns; label ``i + 1`` is ``labels[i]``.
        collection: where ``dataset_dir`` holds a folder of this name, only that folder is searched.
        val_fraction: share of the patients held out for validation.
        test_fraction: share of the patients held out for test.
        num_folds: folds of the training patients (``fold`` in the datalist).
        seed: seed of the patient split (a hash order; change it only to draw another split).
        num_workers: cases converted in parallel (default: one per CPU).
        progress: show a progress bar.
        compress_images: write ``images/<case>.nii.gz`` instead of ``.nii`` (see the module docstring).
        label_source: where labels come from: ``seg`` (DICOM SEG), ``rtstruct`` (RTSTRUCT contours, rasterised on
            the CT grid) or ``auto`` (the SEG when a case has one, else its RTSTRUCT).

    Returns the report (also saved as ``prepare_report.json``). Raises :class:`PrepareError` when no case could
    be prepared, with the most common reasons, so that a wrong ``labels`` value fails at once.
    """
    labels = check_labels(labels, collection=None)
    compress_images = as_bool(compress_images, "compress_images")
    progress = as_bool(progress, "progress")  # `--progress false` comes from the command line as text
    if label_source not in LABEL_SOURCES:
        raise ValueError(f"label_source={label_source!r}: choose one of {list(LABEL_SOURCES)}.")
    if not 0 <= val_fraction < 1 or not 0 <= test_fraction < 1 or val_fraction + test_fraction >= 1:
        raise ValueError(f"val_fraction={val_fraction} and test_fraction={test_fraction} must leave training cases.")
    output_dir = Path(output_dir)
    found = find_cases(dataset_dir, collection, labels, label_source, output_dir, progress)
    cases = found["cases"]
    records, todo = _reuse_up_to_date(cases, output_dir, {"labels": labels, "label_source": label_source},
                                      compress_images)  # fmt: skip
    for sub in ("images", "labels"):
        (output_dir / sub).mkdir(parents=True, exist_ok=True)
    for record in _convert(todo, output_dir, labels, compress_images, num_workers, progress):
        records[record["case_id"]] = record

    rejected = [{**{k: v for k, v in r.items() if k != "slice_paths"}, "status": "rejected"} for r in found["rejected"]]
    ordered = sorted([records[c["case_id"]] for c in cases] + rejected, key=lambda r: r["case_id"])
    good = [r for r in ordered if r["status"] != "rejected"]
    _log_outcomes(ordered)
    if not good:
        reasons = sorted({r["reason"] for r in ordered})[:5]
        raise PrepareError(
            f"none of the {len(ordered)} cases under {found['root']} could be prepared for labels "
            f"{labels}. Reasons include:\n  " + "\n  ".join(reasons)
        )
    datalist = split_cases(good, val_fraction, test_fraction, num_folds, seed)
    datalist.update({"labels": labels, "collection": collection})
    report = _report(dataset_dir, collection, labels, ordered)
    report.update(label_source=label_source, searched=found["root"], skipped_files=found["skipped"])
    write_json(output_dir / DATALIST, datalist)
    write_json(output_dir / REPORT, report)
    logger.info("prepared %d, up to date %d, rejected %d -> %s", report["num_prepared"], report["num_up_to_date"],
                report["num_rejected"], output_dir)  # fmt: skip
    return report


def _reuse_up_to_date(
    cases: list[dict], output_dir: Path, settings: dict, compress: bool
) -> tuple[dict[str, dict], list[dict]]:
    """Records of the cases a previous run prepared with the same ``settings`` (labels, label source) and whose
    outputs are up to date, and the cases still to convert."""
    previous = _load_json(output_dir / REPORT) or {}
    same = all(previous.get(k, "auto" if k == "label_source" else None) == v for k, v in settings.items())
    old_records = {r["case_id"]: r for r in previous.get("cases", [])} if same else {}
    records: dict[str, dict] = {}
    todo = []
    for case in cases:
        old = old_records.get(case["case_id"])
        if old and old.get("status") in ("prepared", "up_to_date") and _up_to_date(case, old, output_dir, compress):
            records[case["case_id"]] = {**old, "status": "up_to_date"}
        else:
            todo.append(case)
    return records, todo


def _convert(
    todo: list[dict], output_dir: Path, labels: list[str], compress: bool, num_workers: int | None, progress: bool
) -> list[dict]:
    """:func:`prepare_case` for every case of ``todo``: in worker processes when there are cases enough for several,
    else in two threads of this process."""
    # a worker process costs seconds to start (it imports the launching program -- torch and MONAI under
    # `monai.bundle run`), about as much as converting a few cases: each worker gets CASES_PER_WORKER at least
    workers = min(num_workers if num_workers is not None else usable_cpus(), len(todo) // CASES_PER_WORKER)
    records = []
    with tqdm(total=len(todo), desc="prepare", unit="case", disable=not progress or not todo) as bar:
        if workers <= 1:
            # two cases in flight in threads: one's NIfTI writes (file I/O and zlib, which release the GIL) overlap
            # the next one's reading -- 0.1 s of a 0.3 s case on one CPU
            pool = ThreadPoolExecutor(2, thread_name_prefix="prepare")
        else:  # spawn, not fork: the parent may hold torch/OpenMP threads that a forked child would inherit broken
            pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
        with pool:
            futures = [pool.submit(prepare_case, case, output_dir, labels, compress) for case in todo]
            try:
                for future in as_completed(futures):
                    records.append(future.result())
                    bar.update()
            except BaseException:  # Ctrl-C: finish the cases in hand (their files are written whole), start no other
                pool.shutdown(cancel_futures=True)
                raise
    return records


def _log_outcomes(records: list[dict]) -> None:
    for record in records:
        if record["status"] == "rejected":
            logger.warning("rejected %s: %s", display_name(record["case_id"]), record["reason"])
        for note in record.get("notes", []):
            logger.info("note %s: %s", record["case_id"], note)


def _report(dataset_dir: str | Path, collection: str, labels: list[str], records: list[dict]) -> dict:
    good = [r for r in records if r["status"] != "rejected"]
    rejected = [r for r in records if r["status"] == "rejected"]
    return {
        "dataset_dir": str(Path(dataset_dir).resolve()),
        "collection": collection,
        "labels": labels,
        "num_cases": len(records),
        "num_prepared": sum(r["status"] == "prepared" for r in records),
        "num_up_to_date": sum(r["status"] == "up_to_date" for r in records),
        "num_rejected": len(rejected),
        "rejected": [{k: r[k] for k in ("case_id", "path", "reason")} for r in rejected],
        "noted": [{"case_id": r["case_id"], "notes": r["notes"]} for r in good if r.get("notes")],
        "cases": records,
    }


def find_cases(
    dataset_dir: str | Path,
    collection: str = COLLECTION,
    labels: Sequence[str] = ("GTV-1",),
    label_source: str = "auto",
    output_dir: str | Path | None = None,
    progress: bool = False,
) -> dict:
    """The cases under ``dataset_dir`` (see the module docstring): ``{"root": the folder searched, "cases": [...],
    "rejected": [...], "skipped": {what: count}}``, each case as :meth:`~scripts.data.dicom.discovery.DicomIndex.
    training_cases` gives it, sorted by case id. With ``output_dir``, that folder is not searched and the headers
    read are kept in ``<output_dir>/dicom_index.json``. :class:`PrepareError` when the folder holds no DICOM CT."""
    dataset_dir = Path(dataset_dir)
    root = dataset_dir / collection if (dataset_dir / collection).is_dir() else dataset_dir
    exclude = [root / "raw"] if root != dataset_dir else []  # TciaDataset's download cache: copies of case files
    if output_dir is not None:
        exclude.append(Path(output_dir))
    try:
        index = scan(root, None if output_dir is None else Path(output_dir) / INDEX, exclude, progress)
    except DiscoveryError as err:
        raise PrepareError(
            f"{err} Point --dataset_dir at the folder holding the DICOM files (a TCIA download as it is, e.g. the "
            f"Data Retriever's folder, or the folder that contains '{collection}/'); `python -m scripts.tcia "
            f"download --dataset_dir {dataset_dir}` downloads the collection."
        ) from None
    cases, rejected = index.training_cases(labels, label_source)
    if not cases and not rejected:
        skipped = ", ".join(f"{n} {what}" for what, n in index.skipped().items()) or "no files"
        raise PrepareError(
            f"{root} holds no DICOM CT series ({skipped}). Point --dataset_dir at the folder holding the DICOM files "
            f"(a TCIA download as it is), or download them: `python -m scripts.tcia download --dataset_dir "
            f"{dataset_dir}`."
        )
    found = {"root": str(root), "skipped": index.skipped(), "timings": index.timings}
    for key, records in (("cases", cases), ("rejected", rejected)):
        found[key] = sorted(records, key=lambda record: record["case_id"])
    return found


def prepare_case(case: dict, output_dir: str | Path, labels: Sequence[str], compress_images: bool = False) -> dict:
    """Convert one case found by :func:`find_cases`; never raises for bad data -- returns a ``rejected`` record with
    the reason instead. The record names the CT series and the annotation used (paths and UIDs), not every file."""
    output_dir = Path(output_dir)
    record = {k: v for k, v in case.items() if k != "slice_paths"}
    record.update(status="rejected", slices=len(case["slice_paths"]))
    annotation = Path(case["annotation"]["file"])
    try:
        volumes = read_case(case["slice_paths"], annotation, labels)
        voxels = {name: int(np.count_nonzero(volumes.label == index + 1)) for index, name in enumerate(labels)}
        for name, count in voxels.items():
            if not count:
                raise DicomCaseError(
                    f"{annotation}: segment(s) {volumes.segments[name]} for label {name!r} are empty "
                    "(e.g. a post-operative scan without tumour); the case cannot be used for training."
                )
        image_path, label_path = _outputs(case, output_dir, compress_images)
        save_nifti(image_path, volumes.image, volumes.affine)
        save_nifti(label_path, volumes.label, volumes.affine)  # labels are ~99 % zeros: gzip is fast and ~200x
        _outputs(case, output_dir, not compress_images)[0].unlink(missing_ok=True)  # the other format, if any
    except DicomCaseError as err:
        record["reason"] = f"{case['case_id']}: {err}"
        return record
    except Exception as err:  # an unexpected failure in one case must not end a 422-case run
        logger.exception("unexpected error in %s", case["case_id"])
        record["reason"] = f"{case['case_id']}: unexpected {type(err).__name__} in {case['path']}: {err}"
        return record

    spacing = [round(s, 4) for s in volumes.info["spacing"]]
    orientation = "".join(nib.aff2axcodes(volumes.affine))
    notes = case["notes"] + list(volumes.info.get("notes", []))
    if orientation != USUAL_ORIENTATION:
        notes.append(
            f"stored in {orientation} orientation, not the usual {USUAL_ORIENTATION} (flipped or rotated rows/columns, "
            "e.g. a prone or feet-first scan): kept with its true affine; training reorients it to RAS."
        )
    voxel_ml = voxel_volume_ml(volumes.affine)
    record.update(
        status="prepared",
        image=f"images/{image_path.name}",
        label=f"labels/{label_path.name}",
        shape=volumes.info["shape"],
        spacing=spacing,
        orientation=orientation,
        notes=notes,
        segments=volumes.segments,
        volumes_ml={name: round(count * voxel_ml, 3) for name, count in voxels.items()},
        written=_stats(image_path, label_path),
    )
    return record


def _stats(*paths: Path) -> dict[str, list[int]]:
    """``[size, modification time ns]`` of each output, by its name: what :func:`_up_to_date` finds again unless the
    file was cut, rewritten or replaced since."""
    stats = {path.name: path.stat() for path in paths}
    return {name: [stat.st_size, stat.st_mtime_ns] for name, stat in stats.items()}


def split_cases(records: Sequence[dict], val_fraction: float, test_fraction: float, num_folds: int, seed: int) -> dict:
    """Split cases by patient into training (with folds), validation and test lists.

    Patients are ordered by ``sha256(f"{seed}:{patient_id}")``: the split is the same on every machine, and adding
    or removing a case moves few others. All series of a patient land in the same list (no leakage).
    """
    order = lambda p: hashlib.sha256(f"{seed}:".encode() + os.fsencode(p)).digest()  # noqa: E731 (bytes: any name)
    patients = sorted({r["patient_id"] for r in records}, key=order)
    n = len(patients)
    n_test = round(n * test_fraction)
    n_val = round(n * val_fraction)
    if n >= 2 and val_fraction > 0:
        n_val = max(n_val, 1)
    n_test = min(n_test, max(n - n_val - 1, 0))
    role = dict.fromkeys(patients[:n_test], "test")
    role.update(dict.fromkeys(patients[n_test : n_test + n_val], "validation"))
    train_patients = patients[n_test + n_val :]
    fold = {p: i % max(num_folds, 1) for i, p in enumerate(train_patients)}

    datalist: dict = {"seed": seed, "num_folds": num_folds, "training": [], "validation": [], "test": []}
    for r in sorted(records, key=lambda r: r["case_id"]):
        entry = {"image": r["image"], "label": r["label"], "case_id": r["case_id"], "patient_id": r["patient_id"]}
        if r["patient_id"] in fold:
            datalist["training"].append({**entry, "fold": fold[r["patient_id"]]})
        else:
            datalist[role[r["patient_id"]]].append(entry)
    return datalist


def _outputs(case: dict, output_dir: Path, compress_images: bool) -> tuple[Path, Path]:
    image = output_dir / "images" / f"{case['case_id']}.nii{'.gz' if compress_images else ''}"
    return image, output_dir / "labels" / f"{case['case_id']}.nii.gz"


def _up_to_date(case: dict, old: dict, output_dir: Path, compress_images: bool) -> bool:
    """True when the outputs exist as they were written (size and modification time, where the record has them: a
    NIfTI cut short or replaced since is prepared again, said in the log) and were made from the same files
    (:meth:`~scripts.data.dicom.discovery.DicomIndex.fingerprint`: paths, sizes, modification and change times)."""
    outputs = _outputs(case, output_dir, compress_images)
    if not all(p.is_file() for p in outputs):
        return False
    written, now = old.get("written"), _stats(*outputs)
    if written is not None and now != written:
        changed = [name for name, stat in now.items() if stat != written.get(name)]
        logger.warning("%s: %s changed since prepare wrote it (size or time): prepared again", case["case_id"],
                       ", ".join(changed))  # fmt: skip
        return False
    return bool(old.get("fingerprint")) and old["fingerprint"] == case["fingerprint"]


def _load_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def print_report(report: dict) -> None:
    print(
        f"{report['num_prepared']} prepared, {report['num_up_to_date']} up to date, {report['num_rejected']} "
        f"rejected (see {REPORT} in the output folder)"
    )

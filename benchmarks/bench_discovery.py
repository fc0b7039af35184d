"""Benchmark of finding the cases of a whole collection from DICOM headers (scripts/data/dicom/discovery.py).

It writes a tree the size of NSCLC-Radiomics as TCIA's NBIA Data Retriever lays it out -- 422 patients, each a CT
series of 120 slices of 512 x 512, a DICOM SEG and an RTSTRUCT (~51,500 files) under
``manifest-<n>/NSCLC-Radiomics/<PatientID>/<date>-<study>-<n>/<n>.000000-<series>-<n>/1-NNN.dcm`` with its
``metadata.csv`` -- and times ``scripts.data.prepare.find_cases`` on it twice: the first scan (every header read), then
a second one that reuses what the first learned (``dicom_index.json``: paths, sizes and times). It prints files/s and
where the time goes: listing the tree (``os.walk`` + ``stat``), reading headers, reading / writing the cache, grouping
files into cases.

The files are real DICOM of realistic size: each slice's header is what the synthetic writer makes for a 512 x 512 x
120 case (patched with the patient's UIDs), followed by the pixel data element of 512 KiB; the SEG and RTSTRUCT are the
synthetic writer's whole objects (hundreds of contours, the SEG's per-frame sequences), re-pointed at each patient's
CT. The pixel data are sparse zeros (``truncate``), so the tree needs ~1 GB of disk, not 27 GB; a header scan never
reads them, so its work is the same. Each scan runs in a fresh child process (its own imports and memory)::

    python -m benchmarks.bench_discovery [--patients 422] [--slices 120] [--output_dir DIR] [--keep false]
                                         [--json_out FILE] [--finder prepare|inference] [--parts N]

The page cache is warm after writing (and after the first scan); ``--drop_caches true`` asks the kernel to drop it
before the first scan (needs root), as on a freshly mounted disk.
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
COLLECTION = "NSCLC-Radiomics"
MANIFEST = "manifest-1622561045123"
#: the pixel data element of a 512 x 512 16-bit slice in explicit VR little endian: tag, VR OW, reserved, length
PIXEL_BYTES = 512 * 512 * 2


def main(
    patients: int = 422,
    slices: int = 120,
    output_dir: str | None = None,
    keep: bool | str = False,
    drop_caches: bool | str = False,
    json_out: str | None = None,
    finder: str = "prepare",
    parts: int = 1,
) -> dict[str, Any]:
    """Write the tree (kept between runs in ``output_dir``), scan it twice in child processes, print the table.
    ``finder``: ``prepare`` (its ``find_cases``) or ``inference`` (``find_inputs``, as each part of a cohort runs it:
    the inference cases, each checked from its headers; of ``parts``, the first part's share)."""
    from scripts.common.config import as_bool

    folder = Path(output_dir) if output_dir else Path(tempfile.mkdtemp(prefix="bench_discovery_"))
    tree, out = folder / "download", folder / "prepared"
    try:
        start = time.perf_counter()
        files = write_tree(tree, int(patients), int(slices), folder / "templates")
        written_s = time.perf_counter() - start
        shutil.rmtree(out, ignore_errors=True)
        if as_bool(drop_caches, "drop_caches"):
            _drop_caches()
        first = _child(tree, out, finder, parts)
        second = _child(tree, out, finder, parts)
        for scan in (first, second):
            scan.setdefault("files_per_s", round(files / max(scan["total_s"], 0.01)))
        report = {"patients": int(patients), "slices": int(slices), "files": files, "write_s": round(written_s, 1),
                  "tree_bytes": _tree_bytes(tree), "finder": finder, "parts": int(parts), "first": first,
                  "second": second}  # fmt: skip
        print(format_report(report))
        if json_out:
            Path(json_out).write_text(json.dumps(report, indent=2))
        return report
    finally:
        if not output_dir and not as_bool(keep, "keep"):
            shutil.rmtree(folder, ignore_errors=True)


def child(tree: str, out: str, finder: str = "prepare", parts: int = 1) -> None:
    """One scan, as prepare (or inference) runs it: print its timings as JSON (run by :func:`_child` in a fresh
    process)."""
    from scripts.data.prepare import find_cases

    if finder == "inference":
        from scripts.inference.cohort import Part
        from scripts.inference.inputs import find_inputs

        start = time.perf_counter()
        cases = find_inputs(tree, out, None, out, Part(0, int(parts)))
        total = round(time.perf_counter() - start, 2)
        print(json.dumps({"total_s": total, "cases": len(cases), "peak_rss_mb": _peak_rss_mb()}))
        return
    start = time.perf_counter()
    found = find_cases(tree, output_dir=out, progress=False)
    total = time.perf_counter() - start
    timings = found["timings"]
    result = {
        "total_s": round(total, 2),
        "cases": len(found["cases"]),
        "rejected": len(found["rejected"]),
        "files": timings["files"],
        "headers_read": timings["read"],
        "files_per_s": round(timings["files"] / total),
        "peak_rss_mb": _peak_rss_mb(),
        **{k: round(v, 2) for k, v in timings.items() if k.endswith("_s")},
    }
    result["cases_s"] = round(total - sum(v for k, v in timings.items() if k.endswith("_s")), 2)
    print(json.dumps(result))


def _child(tree: Path, out: Path, finder: str = "prepare", parts: int = 1) -> dict:
    command = [sys.executable, "-m", "benchmarks.bench_discovery", "child", str(tree), str(out), finder, str(parts)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    if result.returncode:
        raise RuntimeError(f"the scan failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _peak_rss_mb() -> int:
    """This process's peak resident memory since it started (VmHWM: ru_maxrss would also count the parent's memory
    that the fork copied before exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024)
    return -1


def _drop_caches() -> None:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as err:
        print(f"(the page cache could not be dropped: {err}; the first scan reads from a warm cache)")


def _tree_bytes(tree: Path) -> int:
    return sum(p.stat().st_size for p in tree.rglob("*") if p.is_file())


# ------------------------------------------------------------------------------------------------ the tree
def write_tree(tree: Path, patients: int, slices: int, templates: Path) -> int:
    """The Retriever-layout tree (kept when it already holds ``patients`` cases); the number of files in it."""
    marker = tree / f".complete-{patients}x{slices}"
    if marker.is_file():
        return int(marker.read_text())
    import pydicom
    from tqdm import tqdm

    shutil.rmtree(tree, ignore_errors=True)
    ct, seg, rtstruct = _templates(templates, slices)
    top = tree / MANIFEST
    rows, count = [], 0
    for p in tqdm(range(patients), desc="writing the tree", unit="patient"):
        patient = f"LUNG1-{p + 1:03d}"
        uids = {k: pydicom.uid.generate_uid(entropy_srcs=[patient, k]) for k in ("study", "ct", "seg", "rt", "for")}
        study = top / COLLECTION / patient / f"01-01-2014-StudyID-{uids['study'][-5:]}"
        series = {"CT": study / f"0.000000-NA-{uids['ct'][-5:]}", "SEG": study / f"300.000000-Segmentation-"
                  f"{uids['seg'][-5:]}", "RTSTRUCT": study / f"1.000000-NA-{uids['rt'][-5:]}"}  # fmt: skip
        for folder in series.values():
            folder.mkdir(parents=True)
        for k, header in enumerate(ct):
            _write_slice(series["CT"] / f"1-{k + 1:03d}.dcm", header, patient, uids, k)
        _write_annotation(series["SEG"] / "1-1.dcm", seg, patient, uids, "seg")
        _write_annotation(series["RTSTRUCT"] / "1-1.dcm", rtstruct, patient, uids, "rt")
        count += len(ct) + 2
        for modality, folder in series.items():
            rows.append({"Series UID": uids[{"CT": "ct", "SEG": "seg", "RTSTRUCT": "rt"}[modality]],
                         "Collection": COLLECTION, "Subject ID": patient, "Study UID": uids["study"],
                         "Modality": modality, "Number of Images": len(ct) if modality == "CT" else 1,
                         "File Location": f"./{folder.relative_to(top).as_posix()}"})  # fmt: skip
    columns = ["Series UID", "Collection", "3rd Party Analysis", "Data Description URI", "Subject ID", "Study UID",
               "Study Description", "Study Date", "Series Description", "Manufacturer", "Modality", "SOP Class Name",
               "SOP Class UID", "Number of Images", "File Size", "File Location", "Download Timestamp"]  # fmt: skip
    with open(top / "metadata.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, restval="")
        writer.writeheader()
        writer.writerows(rows)
    marker.write_text(str(count + 1))
    return count + 1


def _templates(folder: Path, slices: int) -> tuple[list, Any, Any]:
    """The synthetic writer's CT headers (no pixel data), SEG and RTSTRUCT for one 512 x 512 x ``slices`` case."""
    import pydicom
    from scripts.data.synthetic import write_case

    truth_file = folder / "synthetic_truth" / "TEMPLATE.json"
    if truth_file.is_file() and json.loads(truth_file.read_text())["shape"][2] == slices:
        truth = json.loads(truth_file.read_text())
    else:
        shutil.rmtree(folder, ignore_errors=True)
        truth = write_case(folder, "TEMPLATE", seed=1, shape=(512, 512, slices), rtstruct=True)
    ct = []
    for path in sorted(Path(truth["image_dir"]).glob("*.dcm")):
        ds = pydicom.dcmread(path)
        del ds.PixelData
        ct.append(ds)
    return ct, pydicom.dcmread(truth["seg_file"]), pydicom.dcmread(truth["rtstruct_file"])


def _write_slice(path: Path, header: Any, patient: str, uids: dict, k: int) -> None:
    """The slice header with the patient's UIDs, then a 512 KiB pixel data element left sparse (zeros)."""
    import pydicom

    header.PatientID = header.PatientName = patient
    header.StudyInstanceUID, header.SeriesInstanceUID = uids["study"], uids["ct"]
    header.FrameOfReferenceUID = uids["for"]
    header.SOPInstanceUID = header.file_meta.MediaStorageSOPInstanceUID = pydicom.uid.generate_uid(
        entropy_srcs=[uids["ct"], str(k)])  # fmt: skip
    buffer = io.BytesIO()
    header.save_as(buffer, enforce_file_format=True)
    element = struct.pack("<HH2sHI", 0x7FE0, 0x0010, b"OW", 0, PIXEL_BYTES)
    with open(path, "wb") as f:
        f.write(buffer.getvalue() + element)
        f.truncate(len(buffer.getvalue()) + len(element) + PIXEL_BYTES)


def _write_annotation(path: Path, ds: Any, patient: str, uids: dict, kind: str) -> None:
    """The template SEG or RTSTRUCT, whole, re-pointed at the patient's study, CT series and frame of reference."""
    import pydicom

    ds.PatientID = ds.PatientName = patient
    ds.StudyInstanceUID, ds.SeriesInstanceUID = uids["study"], uids[kind]
    ds.SOPInstanceUID = ds.file_meta.MediaStorageSOPInstanceUID = pydicom.uid.generate_uid(entropy_srcs=[uids[kind]])
    ds.FrameOfReferenceUID = uids["for"]
    if kind == "seg":
        ds.ReferencedSeriesSequence[0].SeriesInstanceUID = uids["ct"]
    else:
        frame = ds.ReferencedFrameOfReferenceSequence[0]
        frame.FrameOfReferenceUID = uids["for"]
        frame.RTReferencedStudySequence[0].RTReferencedSeriesSequence[0].SeriesInstanceUID = uids["ct"]
    ds.save_as(path, enforce_file_format=True)


# ------------------------------------------------------------------------------------------------ the table
def format_report(report: dict) -> str:
    lines = [
        f"{report['files']} files ({report['tree_bytes'] / 1e9:.1f} GB as listed, sparse on disk): "
        f"{report['patients']} patients x ({report['slices']} CT slices + SEG + RTSTRUCT) + metadata.csv, "
        f"NBIA Data Retriever layout; written in {report['write_s']:.0f} s",
        "",
        "| scan | total s | files/s | headers read | list s | cache read s | headers s | cache write s | "
        "group s | cases s | cases | peak RSS MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in ("first", "second"):
        r = {"headers_read": "-", **report[name]}  # inference's finder reports its total only
        steps = ("list_s", "cache_read_s", "headers_s", "cache_write_s", "group_s", "cases_s")
        parts = " | ".join(f"{r[k]:.1f}" if k in r else "-" for k in steps)
        head = f"| {name} | {r['total_s']:.1f} | {r['files_per_s']} | {r['headers_read']} | {parts}"
        lines.append(f"{head} | {r['cases']} | {r['peak_rss_mb']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    import fire
    from scripts.common.cli import printed

    if len(sys.argv) > 1 and sys.argv[1] == "child":
        fire.Fire(child, command=sys.argv[2:])
    else:
        fire.Fire(printed(main))

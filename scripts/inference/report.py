"""A per-case tumour report: what a radiologist reads off a segmentation -- volume, RECIST-style axes, largest 3D
diameter, position and density of each structure -- as numbers in mm, ml and HU; and whether a tumour looks like one.

Input: a label map ``[X, Y, Z]`` (uint8, ``i`` = ``names[i - 1]``), the CT in HU on the same grid (or None) and the
NIfTI (RAS) affine that places it. Output: ``{structure: measurements}`` (:func:`tumour_report`), written as
``<case>_report.json`` (:func:`write_tumour_report`) and as rows of ``report.csv`` (:func:`report_rows`,
:func:`write_report_csv`). All writes are atomic.

How each number is measured (any voxel size and orientation; "axial" slices are the array's planes closest to the
patient's axial plane, i.e. along the voxel axis that moves most in S):

* ``volume_ml``: voxel count x voxel volume; ``components``: 26-connected pieces;
* ``centroid_lps``: mean of the voxel centres (LPS mm); ``side``: the patient's left when its x > 0 (LPS +x points to
  the patient's left), right when x < 0 -- x = 0 is the scanner's axis, not the patient's midline;
* diameters are measured on the largest component (RECIST measures one lesion), on its outline in each axial slice
  traced halfway between voxel centres inside and outside (:mod:`scripts.inference.contours`), at the slice's own
  position: ``long_axis_mm`` is the longest distance between two outline points of one slice, in the slice where it
  is longest; ``short_axis_mm`` the longest extent of that slice's outline along a line perpendicular to the long axis
  (edge to edge, across any concavity or hole, as a calliper is laid); ``max_3d_diameter_mm`` the longest distance
  between outline points of any two slices (through the convex hull), so it is never below the long axis;
* ``slice_first``/``slice_last``: axial slice indices, ``z_first_mm``/``z_last_mm`` their S position; ``hu_mean``,
  ``hu_std``: over every voxel of the structure; ``region_border_fraction``: the share of the voxels on the faces of
  the region the network ran on (the whole grid unless given) that the structure holds.

A structure absent from the label map is reported with ``present: False``, zeros for its size and None elsewhere.
:func:`implausible` lists what makes a tumour structure unlikely to be a lung GTV (bigger than any is likely to be, in
more pieces, filling most of the region's border), with :data:`WHAT_TO_CHECK`.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from scipy import ndimage
from scripts.common.files import write_json, write_text
from scripts.common.geometry import bounding_box, shifted, voxel_volume_ml
from scripts.common.labels import normalize_name
from scripts.inference.contours import farthest_pair, lps, mean_index, recist, row_extremes

CSV_COLUMNS = ("case", "structure", "present", "volume_ml", "components", "long_axis_mm", "short_axis_mm",
               "max_3d_diameter_mm", "centroid_x_lps", "centroid_y_lps", "centroid_z_lps", "side", "slice_first",
               "slice_last", "z_first_mm", "z_last_mm", "hu_mean", "hu_std")  # fmt: skip
#: what a user checks when a tumour is flagged as implausible (the report, the log, the SR say it with the flag)
WHAT_TO_CHECK = ("check that the weights were trained for these labels (a lung GTV on CT) and that the input is a "
                 "chest CT: body region, modality")  # fmt: skip
#: the measurement each limit of :func:`implausible` bounds, and how a flag says it
LIMITS = {"max_volume_ml": ("volume_ml", "{value:.1f} ml, more than a lung GTV is likely to be (limit {limit:g} ml)"),
          "max_components": ("components", "{value} separate pieces (limit {limit})"),
          "max_border_fraction": ("region_border_fraction", "fills {value:.0%} of the border of the region the "
                                  "network ran on (limit {limit:.0%})")}  # fmt: skip


def tumour_report(
    labels: np.ndarray,
    hu: np.ndarray | None,
    affine_ras: np.ndarray,
    names: Sequence[str],
    region: tuple[Sequence[int], Sequence[int]] | None = None,
) -> dict[str, dict]:
    """The measurements of each structure ``names[i - 1]`` (label ``i``) of ``labels`` (see the module docstring);
    ``region``: the (start, stop) voxel indices of the box the network ran on, whose faces ``region_border_fraction``
    is measured on (None: the whole grid)."""
    labels = np.asarray(labels)
    affine = np.asarray(affine_ras, dtype=float)
    if hu is not None and np.shape(hu) != labels.shape:
        raise ValueError(f"CT shape {np.shape(hu)} differs from the label map's {labels.shape}.")
    axial = int(np.argmax(np.abs(affine[2, :3])))
    border = _border_fractions(labels, len(names), region)
    # measured on the labels' bounding box (a tumour fills a few thousandths of a CT): its affine places it, and the
    # slice indices are the whole grid's again below
    low, high = bounding_box(labels) or (np.zeros(3, int), np.zeros(3, int))
    box = tuple(slice(a, b) for a, b in zip(low, high, strict=True))
    labels, hu, affine = labels[box], None if hu is None else np.asarray(hu)[box], shifted(affine, low)
    report = {}
    for index, name in enumerate(names, start=1):
        measured = _structure(labels == index, hu, affine, axial)
        measured["region_border_fraction"] = float(border[index])
        for key in ("axes_slice", "slice_first", "slice_last"):
            if measured[key] is not None:
                measured[key] = int(measured[key]) + int(low[axial])
        report[name] = measured
    return report


def implausible(report: Mapping[str, dict], limits: Mapping[str, float]) -> list[dict]:
    """What makes each tumour structure of ``report`` (a name starting with GTV) unlikely to be a lung GTV: a
    measurement above its limit in ``limits`` (:data:`LIMITS`' keys; a missing or None limit is not checked). One
    finding per measurement: structure, measurement, value, limit and a sentence saying it."""
    unknown = set(limits) - set(LIMITS)
    if unknown:
        raise ValueError(f"unknown plausibility limit(s) {sorted(unknown)}: choose among {sorted(LIMITS)}.")
    findings = []
    for name, measured in report.items():
        if not measured.get("present") or not normalize_name(name).startswith("gtv"):
            continue
        for key, limit in limits.items():
            field, says = LIMITS[key]
            value = measured.get(field)
            if limit is not None and value is not None and value > limit:
                findings.append({"structure": name, "measurement": field, "value": value, "limit": limit,
                                 "finding": f"{name}: " + says.format(value=value, limit=limit)})  # fmt: skip
    return findings


def _border_fractions(labels: np.ndarray, count: int, region) -> np.ndarray:
    """For each label 0..count, the share of the voxels on the faces of ``region`` ((start, stop) voxel indices, None:
    the whole grid) that hold it."""
    start, stop = (np.zeros(3, int), np.array(labels.shape)) if region is None else map(np.asarray, region)
    start, stop = np.clip(start, 0, labels.shape), np.clip(stop, 0, labels.shape)
    box = labels[tuple(slice(a, b) for a, b in zip(start, stop, strict=True))]
    faces = []  # each voxel on the faces once: the two faces across axis 0, then what is left of those across 1, 2
    for axis in range(3):
        rest = box[tuple(slice(1, -1) if a < axis else slice(None) for a in range(3))]
        for end in sorted({0, rest.shape[axis] - 1}) if rest.shape[axis] else ():  # in memory order: only counted
            faces.append(rest[tuple(end if a == axis else slice(None) for a in range(3))].ravel(order="K"))
    on_faces = np.concatenate(faces) if faces else np.zeros(0, labels.dtype)
    return np.bincount(on_faces, minlength=count + 1)[: count + 1] / max(on_faces.size, 1)


def _structure(mask: np.ndarray, hu: np.ndarray | None, affine: np.ndarray, axial: int) -> dict:
    """The measurements of one structure's ``mask``."""
    count = int(mask.sum())
    if count == 0:
        return _absent()
    components, n_components = ndimage.label(mask, structure=np.ones((3, 3, 3), bool))
    largest = components == (np.bincount(components.ravel())[1:].argmax() + 1)
    points, slices = row_extremes(largest, axial)
    long_axis, short_axis, measured_slice, ends, corners = recist(largest, points, slices, affine, axial)
    diameter = farthest_pair(np.vstack(corners))[0]
    profile = mask.sum(axis=tuple(a for a in range(3) if a != axial))
    first, last = (int(i) for i in np.flatnonzero(profile)[[0, -1]])
    values = None if hu is None else np.asarray(hu)[mask].astype(float)
    centroid = lps(mean_index(mask), affine)[0]
    return {
        "present": True,
        "voxels": count,
        "volume_ml": count * voxel_volume_ml(affine),
        "components": int(n_components),
        "largest_component_ml": float(largest.sum()) * voxel_volume_ml(affine),
        "long_axis_mm": long_axis,
        "short_axis_mm": short_axis,
        "max_3d_diameter_mm": diameter,
        "axes_slice": measured_slice,
        "long_axis_ends_lps": ends[0],
        "short_axis_ends_lps": ends[1],
        "centroid_lps": [float(v) for v in centroid],
        "side": "left" if centroid[0] > 0 else "right" if centroid[0] < 0 else "midline",
        "slice_first": first,
        "slice_last": last,
        "z_first_mm": float(lps(mean_index(mask, axial, first), affine)[0, 2]),
        "z_last_mm": float(lps(mean_index(mask, axial, last), affine)[0, 2]),
        "hu_mean": None if values is None else float(values.mean()),
        "hu_std": None if values is None else float(values.std()),
    }


def _absent() -> dict:
    """The measurements of a structure that is not in the label map: zero size, no position, no density."""
    sizes = ("volume_ml", "largest_component_ml", "long_axis_mm", "short_axis_mm", "max_3d_diameter_mm")
    report = dict.fromkeys(sizes, 0.0)
    report.update(present=False, voxels=0, components=0)
    for key in ("axes_slice", "long_axis_ends_lps", "short_axis_ends_lps", "centroid_lps", "side", "slice_first",
                "slice_last", "z_first_mm", "z_last_mm", "hu_mean", "hu_std"):  # fmt: skip
        report[key] = None
    return report


def write_tumour_report(report: dict[str, dict], case_id: str, output_dir: str | Path, **context) -> Path:
    """``<output_dir>/<case_id>_report.json`` (atomic): the case, its units and each structure's measurements;
    ``context`` (e.g. the CT series UID, the model version) is stored as given."""
    units = {"volume_ml": "ml", "*_mm": "mm", "centroid_lps": "mm, DICOM patient coordinates (x: right to left, "
             "y: anterior to posterior, z: feet to head)", "hu_*": "Hounsfield units"}  # fmt: skip
    data = {"case": str(case_id), **context, "units": units, "structures": report}
    return write_json(Path(output_dir) / f"{case_id}_report.json", data)


def report_rows(case_id: str, report: dict[str, dict]) -> list[dict]:
    """One flat row per structure for ``report.csv`` (columns :data:`CSV_COLUMNS`; empty cells for None; numbers to
    6 significant digits as a spreadsheet shows them: 13.56 ml, not 13.560000000000006; the JSON keeps them whole)."""
    rows = []
    for name, m in report.items():
        centroid = m["centroid_lps"] or [None, None, None]
        row = {"case": str(case_id), "structure": name, **{k: m[k] for k in CSV_COLUMNS if k in m}}
        row.update(centroid_x_lps=centroid[0], centroid_y_lps=centroid[1], centroid_z_lps=centroid[2])
        rows.append({k: _cell(row.get(k)) for k in CSV_COLUMNS})
    return rows


def _cell(value: object) -> object:
    """A ``report.csv`` cell: "" for None, a float to 6 significant digits, anything else as it is."""
    if value is None:
        return ""
    return f"{value:.6g}" if isinstance(value, float) else value


def write_report_csv(path: str | Path, rows: list[dict], replace: bool = False) -> Path:
    """``report.csv`` with ``rows`` (from :func:`report_rows`) replacing any earlier rows of the same cases, so a
    case inferred again is listed once (``replace``: replacing every earlier row); written atomically."""
    path = Path(path)
    cases = {str(row["case"]) for row in rows}
    kept = []
    if path.is_file() and not replace:
        with path.open(newline="") as handle:
            kept = [row for row in csv.DictReader(handle) if row.get("case") not in cases]
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_COLUMNS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows([*kept, *rows])
    return write_text(path, buffer.getvalue())

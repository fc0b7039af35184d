"""A per-case tumour report: what a radiologist reads off a segmentation -- volume, RECIST-style axes, largest 3D
diameter, position and density of each structure -- as numbers in mm, ml and HU.

Input: a label map ``[X, Y, Z]`` (uint8, ``i`` = ``names[i - 1]``), the CT in HU on the same grid (or None) and the
NIfTI (RAS) affine that places it. Output: ``{structure: measurements}`` (:func:`tumour_report`), written as
``<case>_report.json`` (:func:`write_report`) and as rows of ``report.csv`` (:func:`report_rows`,
:func:`write_report_csv`). All writes are atomic.

How each number is measured (any voxel size and orientation; "axial" slices are the array's planes closest to the
patient's axial plane, i.e. along the voxel axis that moves most in S):

* ``volume_ml``: voxel count x voxel volume; ``components``: 26-connected pieces;
* ``centroid_lps``: mean of the voxel centres (LPS mm); ``side``: the patient's left when its x > 0 (LPS +x points to
  the patient's left), right when x < 0 -- x = 0 is the scanner's axis, not the patient's midline;
* diameters are measured on the largest component (RECIST measures one lesion), on its outline in each axial slice
  traced halfway between voxel centres inside and outside (marching squares), at the slice's own position:
  ``long_axis_mm`` is the longest distance between two outline points of one slice, in the slice where it is longest;
  ``short_axis_mm`` the longest extent of that slice's outline along a line perpendicular to the long axis (edge to
  edge, across any concavity or hole, as a calliper is laid); ``max_3d_diameter_mm`` the longest distance between
  outline points of any two slices (through the convex hull), so it is never below the long axis;
* ``slice_first``/``slice_last``: axial slice indices, ``z_first_mm``/``z_last_mm`` their S position; ``hu_mean``,
  ``hu_std``: over every voxel of the structure.

A structure absent from the label map is reported with ``present: False``, zeros for its size and None elsewhere.
"""

from __future__ import annotations

import csv
import io
import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from scipy import ndimage
from scipy.spatial import ConvexHull, QhullError
from scipy.spatial.distance import pdist
from scripts.files import write_json, write_text
from scripts.geometry import bounding_box, shifted, voxel_volume_ml
from skimage.measure import find_contours

logger = logging.getLogger(__name__)

RAS_TO_LPS = np.array([-1.0, -1.0, 1.0])
CSV_COLUMNS = ("case", "structure", "present", "volume_ml", "components", "long_axis_mm", "short_axis_mm",
               "max_3d_diameter_mm", "centroid_x_lps", "centroid_y_lps", "centroid_z_lps", "side", "slice_first",
               "slice_last", "z_first_mm", "z_last_mm", "hu_mean", "hu_std")  # fmt: skip


def tumour_report(
    labels: np.ndarray, hu: np.ndarray | None, affine_ras: np.ndarray, names: Sequence[str]
) -> dict[str, dict]:
    """The measurements of each structure ``names[i - 1]`` (label ``i``) of ``labels`` (see the module docstring)."""
    labels = np.asarray(labels)
    affine = np.asarray(affine_ras, dtype=float)
    if hu is not None and np.shape(hu) != labels.shape:
        raise ValueError(f"CT shape {np.shape(hu)} differs from the label map's {labels.shape}.")
    axial = int(np.argmax(np.abs(affine[2, :3])))
    # measured on the labels' bounding box (a tumour fills a few thousandths of a CT): its affine places it, and the
    # slice indices are the whole grid's again below
    low, high = bounding_box(labels) or (np.zeros(3, int), np.zeros(3, int))
    box = tuple(slice(a, b) for a, b in zip(low, high, strict=True))
    labels, hu, affine = labels[box], None if hu is None else np.asarray(hu)[box], shifted(affine, low)
    report = {name: _structure(labels == index, hu, affine, axial) for index, name in enumerate(names, start=1)}
    for measured in report.values():
        for key in ("axes_slice", "slice_first", "slice_last"):
            if measured[key] is not None:
                measured[key] = int(measured[key]) + int(low[axial])
    return report


def _structure(mask: np.ndarray, hu: np.ndarray | None, affine: np.ndarray, axial: int) -> dict:
    """The measurements of one structure's ``mask``."""
    count = int(mask.sum())
    if count == 0:
        return _absent()
    components, n_components = ndimage.label(mask, structure=np.ones((3, 3, 3), bool))
    largest = components == (np.bincount(components.ravel())[1:].argmax() + 1)
    voxels = np.argwhere(mask)
    centroid = _lps(voxels, affine).mean(0)
    outlines = _axial_outlines(largest, affine, axial)
    long_axis, short_axis, measured_slice, ends = _recist(outlines, affine, axial)
    diameter = _farthest_pair(np.vstack([p for lines in outlines.values() for p in lines]))[0]
    first, last = int(voxels[:, axial].min()), int(voxels[:, axial].max())
    values = None if hu is None else np.asarray(hu)[mask].astype(float)
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
        "z_first_mm": float(_lps(voxels[voxels[:, axial] == first], affine)[:, 2].mean()),
        "z_last_mm": float(_lps(voxels[voxels[:, axial] == last], affine)[:, 2].mean()),
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


def _lps(ijk: np.ndarray, affine: np.ndarray) -> np.ndarray:
    """World LPS mm of (N, 3) voxel coordinates through the RAS affine."""
    return (np.asarray(ijk, dtype=float) @ affine[:3, :3].T + affine[:3, 3]) * RAS_TO_LPS


def _axial_outlines(mask: np.ndarray, affine: np.ndarray, axial: int) -> dict[int, list[np.ndarray]]:
    """Each axial slice's outlines of ``mask`` ((N, 3) LPS mm), traced halfway between voxel centres inside and
    outside (marching squares on the padded slice: every outline is closed)."""
    in_plane = [a for a in range(3) if a != axial]
    outlines = {}
    for k in np.unique(np.nonzero(mask)[axial]):
        plane = np.take(mask, k, axis=axial)
        rows, cols = np.nonzero(plane)
        r0, c0 = rows.min(), cols.min()
        crop = np.pad(plane[r0 : rows.max() + 1, c0 : cols.max() + 1], 1).astype(np.float32)
        lines = []
        for traced in find_contours(crop, 0.5):
            ijk = np.empty((len(traced), 3))
            ijk[:, in_plane[0]], ijk[:, in_plane[1]] = traced[:, 0] + r0 - 1, traced[:, 1] + c0 - 1
            ijk[:, axial] = k
            lines.append(_lps(ijk, affine))
        outlines[int(k)] = lines
    return outlines


def _recist(outlines: dict[int, list[np.ndarray]], affine: np.ndarray, axial: int) -> tuple:
    """Long axis (the longest in-slice distance, in the slice where it is longest) and short axis (the longest
    extent perpendicular to it in that slice), their slice and their end points (LPS mm)."""
    best = max(outlines, key=lambda k: _farthest_pair(np.vstack(outlines[k]))[0])
    long_axis, p, q = _farthest_pair(np.vstack(outlines[best]))
    in_plane = [affine[:3, a] * RAS_TO_LPS for a in range(3) if a != axial]
    normal = np.cross(*in_plane)
    normal /= np.linalg.norm(normal)
    u = (q - p) / long_axis if long_axis > 0 else in_plane[0] / np.linalg.norm(in_plane[0])
    v = np.cross(normal, u)
    short_axis, a, b = _perpendicular_extent(outlines[best], u, v)
    ends = [[p.tolist(), q.tolist()], [a.tolist(), b.tolist()]]
    return float(long_axis), float(short_axis), best, ends


def _perpendicular_extent(lines: list[np.ndarray], u: np.ndarray, v: np.ndarray) -> tuple[float, np.ndarray, ...]:
    """The longest extent along ``v`` of the closed ``lines`` on any line perpendicular to ``u`` (first crossing to
    last), and its two end points. The extent is largest at a vertex's position along ``u`` (between two vertices
    it is a convex function of the position), so only those positions are tried."""
    starts = np.vstack(lines)
    ends = np.vstack([np.roll(line, -1, axis=0) for line in lines])
    su, eu, sv, ev = starts @ u, ends @ u, starts @ v, ends @ v
    best, best_at = -1.0, (starts[0], starts[0])
    for positions in np.array_split(np.unique(su), max(1, len(su) // 256)):
        t = positions[:, None]
        span = eu - su
        flat = np.abs(span) < 1e-12
        s = np.where(flat, 0.0, (t - su) / np.where(flat, 1.0, span))
        hits = ~flat & (s >= 0) & (s <= 1) | flat & (np.abs(su - t) < 1e-9)
        crossing = sv + np.clip(s, 0, 1) * (ev - sv)
        high = np.where(hits, np.maximum(crossing, np.where(flat, ev, crossing)), -np.inf).max(1)
        low = np.where(hits, np.minimum(crossing, np.where(flat, ev, crossing)), np.inf).min(1)
        extent = high - low
        i = int(np.argmax(extent))
        if extent[i] > best:
            best = float(extent[i])
            base = positions[i] * u
            best_at = (base + low[i] * v, base + high[i] * v)
    plane_offset = starts[0] - (starts[0] @ u) * u - (starts[0] @ v) * v  # the slice plane's offset along its normal
    return max(best, 0.0), best_at[0] + plane_offset, best_at[1] + plane_offset


def _farthest_pair(points: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
    """The largest distance between two of ``points`` (N, 3) and the two points: among the vertices of their convex
    hull (computed in the subspace they span, so a single slice or a line of voxels works too)."""
    candidates = points
    if len(points) > 3:
        centred = points - points.mean(0)
        _, singular, basis = np.linalg.svd(centred, full_matrices=False)
        rank = int((singular > 1e-9 * max(singular[0], 1e-12)).sum())
        if rank == 1:
            along = centred @ basis[0]
            candidates = points[[int(along.argmin()), int(along.argmax())]]
        elif rank >= 2:
            try:
                candidates = points[ConvexHull(centred @ basis[:rank].T).vertices]
            except QhullError:  # degenerate beyond what the rank shows: every point is a candidate
                logger.debug("convex hull failed on %d points; comparing all pairs", len(points))
    if len(candidates) < 2:
        return 0.0, candidates[0], candidates[0]
    distances = pdist(candidates)
    i, j = np.triu_indices(len(candidates), k=1)
    best = int(distances.argmax())
    return float(distances[best]), candidates[i[best]], candidates[j[best]]


def write_report(report: dict[str, dict], case_id: str, output_dir: str | Path, **context) -> Path:
    """``<output_dir>/<case_id>_report.json`` (atomic): the case, its units and each structure's measurements;
    ``context`` (e.g. the CT series UID, the model version) is stored as given."""
    units = {"volume_ml": "ml", "*_mm": "mm", "centroid_lps": "mm, DICOM patient coordinates (x: right to left, "
             "y: anterior to posterior, z: feet to head)", "hu_*": "Hounsfield units"}  # fmt: skip
    data = {"case": str(case_id), **context, "units": units, "structures": report}
    return write_json(Path(output_dir) / f"{case_id}_report.json", data)


def report_rows(case_id: str, report: dict[str, dict]) -> list[dict]:
    """One flat row per structure for ``report.csv`` (columns :data:`CSV_COLUMNS`; empty cells for None)."""
    rows = []
    for name, m in report.items():
        centroid = m["centroid_lps"] or [None, None, None]
        row = {"case": str(case_id), "structure": name, **{k: m[k] for k in CSV_COLUMNS if k in m}}
        row.update(centroid_x_lps=centroid[0], centroid_y_lps=centroid[1], centroid_z_lps=centroid[2])
        rows.append({k: "" if row.get(k) is None else row[k] for k in CSV_COLUMNS})
    return rows


def write_report_csv(path: str | Path, rows: list[dict]) -> Path:
    """``report.csv`` with ``rows`` (from :func:`report_rows`) replacing any earlier rows of the same cases, so a
    case inferred again is listed once; written atomically."""
    path = Path(path)
    cases = {str(row["case"]) for row in rows}
    kept = []
    if path.is_file():
        with path.open(newline="") as handle:
            kept = [row for row in csv.DictReader(handle) if row.get("case") not in cases]
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_COLUMNS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows([*kept, *rows])
    return write_text(path, buffer.getvalue())

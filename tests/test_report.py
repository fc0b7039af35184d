"""The tumour report against geometry with known answers: spheres, ellipsoids turned in plane and separate balls,
drawn by voxel-centre membership on anisotropic grids (0.7 x 0.7 x 3 mm) under several orientations of the affine.

Every diameter of a voxelised shape is known only to within a voxel (each end lies somewhere between the last voxel
centre inside and the first outside), so each measurement is checked to one in-plane voxel (half a voxel per end)
and the axes' mean error over random placements to half a voxel.
"""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from scripts.figures import render_planes
from scripts.report import CSV_COLUMNS, report_rows, tumour_report, write_report, write_report_csv

PIXEL, SLICE = 0.7, 3.0
SHAPE = (110, 100, 20)


def affines() -> dict[str, np.ndarray]:
    """RAS affines of 0.7 x 0.7 x 3 mm grids: as a CT is read (LPS axes), flipped in plane, and with the slice axis
    first and the in-plane axes swapped and turned by 90 degrees."""
    ct = np.diag([-PIXEL, -PIXEL, SLICE, 1.0])
    flipped = np.diag([PIXEL, PIXEL, SLICE, 1.0])
    permuted = np.zeros((4, 4))
    permuted[:3, :3] = [[0, 0, PIXEL], [0, -PIXEL, 0], [-SLICE, 0, 0]]  # i: head to feet, j: to P, k: to R
    permuted[3, 3] = 1
    for a in (ct, flipped, permuted):
        a[:3, 3] = -a[:3, :3] @ (np.array(shape_for(a)) / 2)  # the grid centred on the world origin
    return {"ct": ct, "flipped": flipped, "permuted": permuted}


def shape_for(affine: np.ndarray) -> tuple[int, int, int]:
    """:data:`SHAPE` reordered so the 3 mm axis has 20 voxels, whatever axis it is."""
    slice_axis = int(np.argmax(np.linalg.norm(affine[:3, :3], axis=0)))
    shape = [SHAPE[0], SHAPE[1]]
    shape.insert(slice_axis, SHAPE[2])
    return tuple(shape)


def centres_lps(affine: np.ndarray) -> np.ndarray:
    """World LPS mm of every voxel centre, [X, Y, Z, 3]."""
    shape = shape_for(affine)
    ijk = np.stack(np.meshgrid(*[np.arange(n) for n in shape], indexing="ij"), -1).reshape(-1, 3)
    return ((ijk @ affine[:3, :3].T + affine[:3, 3]) * [-1, -1, 1]).reshape(*shape, 3)


def ellipsoid(lps: np.ndarray, centre, radii, angle_deg: float = 0.0) -> np.ndarray:
    """Voxels whose centre is inside an ellipsoid turned by ``angle_deg`` about the S axis."""
    t = np.deg2rad(angle_deg)
    rotation = np.array([[np.cos(t), -np.sin(t), 0], [np.sin(t), np.cos(t), 0], [0, 0, 1]])
    return ((((lps - centre) @ rotation) / radii) ** 2).sum(-1) <= 1


@pytest.mark.parametrize("orientation", ["ct", "flipped", "permuted"])
def test_sphere_volume_diameter_centroid_and_side(orientation):
    affine = affines()[orientation]
    lps = centres_lps(affine)
    centre, radius = np.array([14.23, -3.61, 1.37]), 15.0
    mask = ellipsoid(lps, centre, [radius] * 3)
    m = tumour_report(mask.astype(np.uint8), None, affine, ["GTV-1"])["GTV-1"]
    assert m["voxels"] == mask.sum() and m["volume_ml"] == pytest.approx(mask.sum() * PIXEL * PIXEL * SLICE / 1000)
    assert m["volume_ml"] == pytest.approx(4 / 3 * np.pi * radius**3 / 1000, rel=0.02)
    assert abs(m["max_3d_diameter_mm"] - 2 * radius) <= PIXEL
    assert abs(m["long_axis_mm"] - 2 * radius) <= PIXEL and abs(m["short_axis_mm"] - 2 * radius) <= PIXEL
    assert m["max_3d_diameter_mm"] >= m["long_axis_mm"] >= m["short_axis_mm"]
    assert (np.abs(np.array(m["centroid_lps"]) - centre) <= [PIXEL / 2, PIXEL / 2, SLICE / 2]).all()
    assert m["side"] == "left" and m["components"] == 1
    axial = int(np.argmax(np.abs(affine[2, :3])))
    slices = np.nonzero(mask.any(axis=tuple(a for a in range(3) if a != axial)))[0]
    assert (m["slice_first"], m["slice_last"]) == (slices[0], slices[-1])
    low, high = sorted([m["z_first_mm"], m["z_last_mm"]])
    assert centre[2] - radius <= low < centre[2] - radius + SLICE
    assert centre[2] + radius - SLICE < high <= centre[2] + radius


@pytest.mark.parametrize("orientation", ["ct", "permuted"])
def test_ellipse_recist_axes_in_the_widest_slice(orientation):
    """An ellipsoid turned in plane, its equator on a slice: long axis 2a, short axis 2b, there."""
    affine = affines()[orientation]
    lps = centres_lps(affine)
    axial = int(np.argmax(np.abs(affine[2, :3])))
    equator = float(np.take(lps[..., 2], 9, axis=axial).mean())
    rng = np.random.default_rng(4)
    errors = []
    for _ in range(6):
        a, b, angle = rng.uniform(10, 16), rng.uniform(5, 8), rng.uniform(0, 180)
        centre = np.array([*rng.uniform(-15, 15, 2), equator])
        mask = ellipsoid(lps, centre, [a, b, 9.0], angle)
        m = tumour_report(mask.astype(np.uint8), None, affine, ["GTV-1"])["GTV-1"]
        assert m["axes_slice"] == 9
        errors.append([m["long_axis_mm"] - 2 * a, m["short_axis_mm"] - 2 * b])
        ends = np.array(m["long_axis_ends_lps"])
        direction = (ends[1] - ends[0]) / np.linalg.norm(ends[1] - ends[0])
        along = abs(direction @ [np.cos(np.deg2rad(angle)), np.sin(np.deg2rad(angle)), 0])
        assert along > 0.99, (angle, direction)  # the long axis lies along the ellipse's major axis
        short = np.array(m["short_axis_ends_lps"])
        assert abs((short[1] - short[0]) @ direction) < 1e-6  # perpendicular to it
    errors = np.array(errors)
    assert (np.abs(errors) <= PIXEL).all(), errors
    assert (np.abs(errors).mean(0) <= PIXEL / 2).all(), errors


def test_components_side_hu_and_absent_structures():
    affine = affines()["ct"]
    lps = centres_lps(affine)
    right = ellipsoid(lps, [-25.0, 0.0, 0.0], [6.0, 6.0, 6.0]) | ellipsoid(lps, [-25.0, 20.0, 0.0], [5.0, 5.0, 6.0])
    labels = right.astype(np.uint8)
    labels[50, 50, 10] = labels[51, 51, 11] = 2  # two voxels touching at a corner: one 26-connected piece
    hu = np.random.default_rng(0).normal(40, 15, labels.shape).astype(np.int16)
    report = tumour_report(labels, hu, affine, ["GTV-1", "GTV-2", "GTV-3"])
    assert report["GTV-1"]["components"] == 2 and report["GTV-1"]["side"] == "right"
    assert report["GTV-2"]["components"] == 1
    assert report["GTV-1"]["largest_component_ml"] < report["GTV-1"]["volume_ml"]
    assert report["GTV-1"]["hu_mean"] == pytest.approx(hu[right].astype(float).mean())
    assert report["GTV-1"]["hu_std"] == pytest.approx(hu[right].astype(float).std())
    absent = report["GTV-3"]
    assert absent["present"] is False and absent["volume_ml"] == 0.0 and absent["components"] == 0
    assert absent["long_axis_mm"] == absent["max_3d_diameter_mm"] == 0.0
    assert absent["centroid_lps"] is None and absent["side"] is None and absent["hu_mean"] is None
    assert tumour_report(labels, None, affine, ["GTV-1"])["GTV-1"]["hu_mean"] is None


def test_report_json_and_csv(tmp_path):
    affine = affines()["ct"]
    labels = ellipsoid(centres_lps(affine), [10.0, 0.0, 0.0], [8.0, 6.0, 7.0]).astype(np.uint8)
    report = tumour_report(labels, None, affine, ["GTV-1", "Heart"])
    path = write_report(report, "LUNG1-001", tmp_path, ct_series_uid="1.2.3")
    assert path.name == "LUNG1-001_report.json"
    data = json.loads(path.read_text())
    assert data["case"] == "LUNG1-001" and data["ct_series_uid"] == "1.2.3"
    assert data["structures"]["GTV-1"]["volume_ml"] == pytest.approx(report["GTV-1"]["volume_ml"])
    table = tmp_path / "report.csv"
    write_report_csv(table, report_rows("LUNG1-001", report))
    write_report_csv(table, report_rows("LUNG1-002", report))
    write_report_csv(table, report_rows("LUNG1-001", report))  # again: replaces, does not duplicate
    with table.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert tuple(rows[0]) == CSV_COLUMNS
    assert [(r["case"], r["structure"]) for r in rows] == [
        ("LUNG1-002", "GTV-1"), ("LUNG1-002", "Heart"), ("LUNG1-001", "GTV-1"), ("LUNG1-001", "Heart")
    ]  # fmt: skip
    assert rows[1]["present"] == "False" and rows[1]["centroid_x_lps"] == ""
    assert float(rows[0]["long_axis_mm"]) == pytest.approx(report["GTV-1"]["long_axis_mm"])


@pytest.mark.parametrize("orientation", ["ct", "flipped", "permuted"])
def test_planes_picture_is_radiological(orientation):
    """A tumour in the patient's left lung is drawn on the image's right in the axial and coronal panels."""
    affine = affines()[orientation]
    lps = centres_lps(affine)
    labels = ellipsoid(lps, [20.0, -5.0, 0.0], [6.0, 6.0, 7.0]).astype(np.uint8)
    ct = np.where(labels > 0, 40, -800).astype(np.int16)
    rgb = render_planes(ct, labels, affine, title="test")
    left_right = int(np.argmax(np.abs(affine[0, :3])))  # the voxel axis along the patient's left-right
    width = round(shape_for(affine)[left_right] * np.linalg.norm(affine[:3, left_right]) / PIXEL)  # the axial panel
    red_columns = np.nonzero((rgb[:, :width] == [255, 60, 60]).all(-1).any(0))[0]
    assert red_columns.size and red_columns.min() > width / 2  # the grid is centred on x = 0

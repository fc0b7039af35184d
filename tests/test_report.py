"""The tumour report against geometry with known answers: spheres, ellipsoids turned in plane and separate balls,
drawn by voxel-centre membership on anisotropic grids (0.7 x 0.7 x 3 mm) under several orientations of the affine.

Every diameter of a voxelised shape is known only to within a voxel (each end lies somewhere between the last voxel
centre inside and the first outside), so each measurement is checked to one in-plane voxel (half a voxel per end)
and the axes' mean error over random placements to half a voxel.

A tumour no lung GTV is likely to be is flagged, with the measurement, its limit and what to check. The outlines and
the geometry the axes are measured with are tests/test_contours.py's.
"""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from scripts.inference.figures import picture_pixel_mm, render_planes
from scripts.inference.report import (
    CSV_COLUMNS,
    WHAT_TO_CHECK,
    implausible,
    report_rows,
    tumour_report,
    write_report_csv,
    write_tumour_report,
)

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
    path = write_tumour_report(report, "LUNG1-001", tmp_path, ct_series_uid="1.2.3")
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
    assert float(rows[0]["long_axis_mm"]) == pytest.approx(report["GTV-1"]["long_axis_mm"], rel=1e-5)
    assert float(rows[0]["volume_ml"]) == pytest.approx(report["GTV-1"]["volume_ml"], rel=1e-5)
    assert all(len(r[k].lstrip("-").replace(".", "")) <= 6 for r in rows for k in ("volume_ml", "centroid_x_lps")
               if r[k]), "6 significant digits at most, as a spreadsheet shows them"  # fmt: skip


@pytest.mark.parametrize("orientation", ["ct", "flipped", "permuted"])
def test_planes_picture_is_radiological(orientation):
    """A tumour in the patient's left lung is drawn on the image's right in the axial and coronal panels."""
    affine = affines()[orientation]
    lps = centres_lps(affine)
    labels = ellipsoid(lps, [20.0, -5.0, 0.0], [6.0, 6.0, 7.0]).astype(np.uint8)
    ct = np.where(labels > 0, 40, -800).astype(np.int16)
    rgb = render_planes(ct, labels, affine, title="test")
    left_right = int(np.argmax(np.abs(affine[0, :3])))  # the voxel axis along the patient's left-right
    spacing = np.linalg.norm(affine[:3, :3], axis=0)
    pixel_mm = picture_pixel_mm(spacing, shape_for(affine))
    width = round(shape_for(affine)[left_right] * spacing[left_right] / pixel_mm)  # the axial panel
    red_columns = np.nonzero((rgb[:, :width] == [255, 60, 60]).all(-1).any(0))[0]
    assert red_columns.size and red_columns.min() > width / 2  # the grid is centred on x = 0


@pytest.mark.parametrize("orientation", ["ct", "permuted"])
def test_report_and_picture_are_the_same_whatever_the_label_maps_memory_order(orientation):
    """The writers get the label map in NIfTI's (Fortran) order (scripts.inference.outputs.label_volume): the
    measurements, the border fractions and the picture (its centre, its CT planes from int16) are those of the C-ordered
    map."""
    affine = affines()[orientation]
    lps = centres_lps(affine)
    labels = ellipsoid(lps, [20.0, -5.0, 0.0], [6.0, 6.0, 7.0]).astype(np.uint8)
    labels += ellipsoid(lps, [-20.0, 5.0, 3.0], [4.0, 3.0, 5.0]).astype(np.uint8) * 2
    ct = np.where(labels > 0, 40, -800).astype(np.int16)
    region = (np.array([2, 3, 1]), np.array(shape_for(affine)) - 2)
    fortran = np.asfortranarray(labels)
    assert tumour_report(fortran, ct, affine, ["GTV-1", "Heart"], region) == tumour_report(
        labels, ct, affine, ["GTV-1", "Heart"], region
    )
    picture = render_planes(ct, labels, affine, title="t")
    np.testing.assert_array_equal(render_planes(np.asfortranarray(ct), fortran, affine, title="t"), picture)
    np.testing.assert_array_equal(render_planes(ct.astype(np.float32), labels, affine, title="t"), picture)


@pytest.mark.parametrize(("shape", "spacing", "side"), [((64, 64, 40), (2.0, 2.0, 3.0), 384),
                                                        ((512, 512, 120), (0.98, 0.98, 3.0), 512),
                                                        ((1024, 1024, 300), (0.5, 0.5, 1.0), 512)])  # fmt: skip
def test_the_picture_of_a_small_ct_is_enlarged_and_of_a_large_one_reduced(shape, spacing, side):
    """The panels' longest side: a small volume enlarged to at least 384 pixels (the demo's 64 x 64 x 40 would be a
    thumbnail), a planning CT at a pixel per voxel, a larger volume reduced to 512."""
    extent = max(n * s for n, s in zip(shape, spacing, strict=True))
    assert round(extent / picture_pixel_mm(spacing, shape)) == side


def test_a_tumour_no_lung_gtv_is_likely_to_be_is_flagged_with_what_to_check():
    affine = affines()["ct"]
    lps = centres_lps(affine)
    realistic = ellipsoid(lps, [10.0, 0.0, 0.0], [12.0, 10.0, 12.0]).astype(np.uint8)
    limits = {"max_volume_ml": 1000, "max_components": 10, "max_border_fraction": 0.5}
    assert implausible(tumour_report(realistic, None, affine, ["GTV-1"]), limits) == []
    everything = np.ones(shape_for(affine), np.uint8)  # a whole grid: 46 ml here, so a lower volume limit
    pieces = np.zeros(shape_for(affine), np.uint8)
    pieces[::4, ::4, ::4] = 1  # 3500 separate voxels
    labels = {"GTV-1": everything, "GTV-2": pieces, "Lung-Left": everything}
    report = {name: tumour_report(mask, None, affine, [name])[name] for name, mask in labels.items()}
    findings = implausible(report, {**limits, "max_volume_ml": 40})
    by = {(f["structure"], f["measurement"]): f for f in findings}
    assert set(by) == {("GTV-1", "volume_ml"), ("GTV-1", "region_border_fraction"), ("GTV-2", "components")}
    assert (
        by[("GTV-1", "region_border_fraction")]["value"] == 1.0 and by[("GTV-2", "components")]["value"] == pieces.sum()
    )
    assert "more than a lung GTV is likely to be (limit 40 ml)" in by[("GTV-1", "volume_ml")]["finding"]
    assert implausible(report, {"max_volume_ml": None}) == []  # a check turned off
    assert "weights" in WHAT_TO_CHECK and "body region" in WHAT_TO_CHECK and "modality" in WHAT_TO_CHECK
    with pytest.raises(ValueError, match="max_volume"):
        implausible(report, {"max_volume": 1})


def test_the_border_fraction_is_measured_on_the_region_the_network_ran_on():
    labels = np.zeros((20, 20, 10), np.uint8)
    labels[5:15, 5:15, 2:8] = 1  # fills the box [5, 15) x [5, 15) x [2, 8), inside the grid
    affine = np.diag([1.0, 1.0, 3.0, 1.0])
    assert tumour_report(labels, None, affine, ["GTV-1"])["GTV-1"]["region_border_fraction"] == 0.0
    region = ((5, 5, 2), (15, 15, 8))
    assert tumour_report(labels, None, affine, ["GTV-1"], region)["GTV-1"]["region_border_fraction"] == 1.0

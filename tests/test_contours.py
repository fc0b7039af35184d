"""Contours and RECIST geometry, bounded whatever the label map: the outlines are marching squares' (skimage's
segments, proved on random masks), the short axis' sweep gives the numbers of its definition -- every vertex position
against every segment, kept here as the reference -- on random outlines, convex or not, with holes, and on a whole
thorax with holes the crossings it computes are counted: n log n in the outline's length, not vertices x segments.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import scripts.inference.contours as contours
from scipy import ndimage
from scripts.inference.contours import outlines
from scripts.inference.report import tumour_report
from skimage.measure import find_contours


def pairwise_extent(lines: list[np.ndarray], u: np.ndarray, v: np.ndarray) -> float:
    """The short axis' definition, computed as it reads: at every vertex position along ``u``, the
    crossings of every segment of the closed ``lines`` (first to last along ``v``; a segment along ``v`` counts
    whole), the longest extent -- vertices x segments."""
    starts = np.vstack(lines)
    ends = np.vstack([np.roll(line, -1, axis=0) for line in lines])
    su, eu, sv, ev = starts @ u, ends @ u, starts @ v, ends @ v
    t = np.unique(su)[:, None]
    span = eu - su
    flat = np.abs(span) < 1e-12
    s = np.where(flat, 0.0, (t - su) / np.where(flat, 1.0, span))
    hits = ~flat & (s >= 0) & (s <= 1) | flat & (np.abs(su - t) < 1e-9)
    crossing = sv + np.clip(s, 0, 1) * (ev - sv)
    high = np.where(hits, np.maximum(crossing, np.where(flat, ev, crossing)), -np.inf).max(1)
    low = np.where(hits, np.minimum(crossing, np.where(flat, ev, crossing)), np.inf).min(1)
    return float((high - low).max())


def as_segments(lines: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Closed ``lines`` as the sweep takes them: their points and, for each, the index of the next."""
    following = [offset + (np.arange(len(line)) + 1) % len(line) for offset, line in
                 zip(np.cumsum([0] + [len(line) for line in lines[:-1]]), lines, strict=True)]  # fmt: skip
    return np.vstack(lines), np.concatenate(following)


def random_outlines(rng) -> list[np.ndarray]:
    """Closed outlines that do not cross: a random star-shaped polygon (not convex) with a polygon hole inside it,
    or marching squares' outlines of a random mask (pieces, holes, corners touching)."""
    if rng.random() < 0.4:
        angles = np.sort(rng.uniform(0, 2 * np.pi, rng.integers(3, 40)))
        radii = rng.uniform(5, 20, len(angles))
        star = np.stack([radii * np.cos(angles), radii * np.sin(angles), np.zeros(len(angles))], 1)
        hole = np.stack([np.cos(angles), np.sin(angles), np.zeros(len(angles))], 1) * min(radii.min(), 4) / 2
        return [star, hole[::-1]]
    mask = ndimage.gaussian_filter(rng.random(tuple(rng.integers(4, 30, 2))), rng.uniform(0, 2)) > rng.uniform(0.4, 0.6)
    mask[rng.integers(0, mask.shape[0]), rng.integers(0, mask.shape[1])] = True
    points, _, starts = outlines(mask[:, :, None])
    points = np.column_stack([points * [0.7, 0.9], np.zeros(len(points))])
    return [points[a:b] for a, b in itertools.pairwise(starts)]


def test_the_short_axis_sweep_gives_the_numbers_of_its_definition_on_random_outlines():
    rng = np.random.default_rng(11)
    for trial in range(150):
        lines = random_outlines(rng)
        theta = rng.choice([0.0, np.pi / 2, np.pi / 4, rng.uniform(0, np.pi)])
        u, v = np.array([np.cos(theta), np.sin(theta), 0.0]), np.array([-np.sin(theta), np.cos(theta), 0.0])
        extent, a, b = contours._perpendicular_extent(*as_segments(lines), u, v)
        assert extent == pytest.approx(pairwise_extent(lines, u, v), rel=1e-9, abs=1e-9), trial
        assert abs((b - a) @ u) < 1e-9 and (b - a) @ v == pytest.approx(extent, abs=1e-9), trial


def test_outlines_are_the_segments_find_contours_traces_closed_and_turning_one_way():
    rng = np.random.default_rng(3)
    for trial in range(60):
        mask = rng.random((*rng.integers(1, 14, 2), 3)) < rng.uniform(0.2, 0.8)
        points, planes, starts = outlines(mask)
        for k in range(mask.shape[2]):
            expected = {frozenset(map(tuple, pair)) for line in find_contours(np.pad(mask[:, :, k], 1).astype(float),
                        0.5) for pair in zip(line[:-1] - 1, line[1:] - 1, strict=True)}  # fmt: skip
            traced = set()
            for a, b in itertools.pairwise(starts):
                if planes[a] == k:
                    line = points[a:b]
                    traced |= {frozenset(map(tuple, pair)) for pair in zip(line, np.roll(line, -1, 0), strict=True)}
            assert traced == expected, (trial, k)
        assert all((planes[a:b] == planes[a]).all() for a, b in itertools.pairwise(starts))
        # inside always on the same side: outer outlines and holes have areas of opposite signs, summing to the mask's
        area = sum(shoelace(points[a:b]) for a, b in itertools.pairwise(starts))
        assert abs(area) == pytest.approx(mask.sum() - 0.5 * corners_cut(mask), abs=1e-9), trial


def shoelace(points: np.ndarray) -> float:
    x, y = points[:, 0], points[:, 1]
    return float((x * np.roll(y, -1) - np.roll(x, -1) * y).sum() / 2)


def corners_cut(mask: np.ndarray) -> float:
    """What marching squares cuts off the voxels' squares: 1/4 voxel per convex corner, given back 1/4 per concave
    one -- counted per 2 x 2 cell: a lone inside corner loses 1/8, three inside corners gain 1/8 (x 2 from 1/2)."""
    padded = np.pad(mask, ((1, 1), (1, 1), (0, 0))).astype(int)
    inside = padded[:-1, :-1] + padded[:-1, 1:] + padded[1:, :-1] + padded[1:, 1:]
    diagonal = (padded[:-1, :-1] == padded[1:, 1:]) & (padded[:-1, 1:] == padded[1:, :-1]) & (inside == 2)
    return 0.25 * ((inside == 1).sum() - (inside == 3).sum() + 2 * diagonal.sum())


def thorax_with_holes(scale: float) -> np.ndarray:
    """A whole thorax as wrong weights mark it: an ellipse of 200 x 140 voxels x ``scale``, the lungs two holes in it,
    vessels a hole every 5 voxels (2 slices)."""
    i, j = np.meshgrid(*(np.arange(int(n * scale) + 4) for n in (200, 140)), indexing="ij")
    x, y = (i - i.max() / 2) / scale, (j - j.max() / 2) / scale
    body = (x / 100) ** 2 + (y / 70) ** 2 <= 1
    lungs = ((np.abs(x) - 45) / 35) ** 2 + (y / 50) ** 2 <= 1
    vessels = (np.sin(2 * np.pi * i / 5) * np.sin(2 * np.pi * j / 5)) > 0.5
    return np.repeat((body & ~lungs & ~vessels)[:, :, None], 2, axis=2)


def test_a_thorax_with_holes_costs_n_log_n_crossings_not_vertices_times_segments(monkeypatch):
    """The short axis by its definition is vertices x segments, tens of seconds on a real CT marked by random weights:
    the sweep's crossings grow as n log n with the outline's length n; the hulls see at most 4 points per row."""
    crossings, hull_points = [], []
    crossing, hull = contours._crossing, contours._hull_corners
    monkeypatch.setattr(contours, "_crossing", lambda *a: crossings.append(np.size(crossing(*a))) or crossing(*a))
    monkeypatch.setattr(contours, "_hull_corners", lambda p: hull_points.append(len(p)) or hull(p))
    affine = np.diag([0.9, 0.9, 3.0, 1.0])
    counts = {}
    for scale in (1.0, 2.0**0.5):
        mask = thorax_with_holes(scale)
        crossings.clear()
        hull_points.clear()
        measured = tumour_report(mask.astype(np.uint8), None, affine, ["GTV-1"])["GTV-1"]
        vertices = len(outlines(mask[:, :, :1])[0])
        counts[scale] = (sum(crossings), vertices)
        assert vertices > 5000 and measured["short_axis_mm"] > 0
        assert sum(crossings) < 8 * vertices * np.log2(vertices), "n log n"
        assert sum(crossings) < vertices**2 / 50, "far from vertices x segments"
        assert max(hull_points[:-1]) <= 4 * (mask.shape[0] + 1), "a slice's hull: four points per row at most"
    (small, n_small), (large, n_large) = counts.values()
    assert 1.8 < n_large / n_small < 2.2  # the outline doubles ...
    assert large / small < 2.6, counts  # ... and so, with a log factor, does the work

"""Contours of a label map (:func:`outlines`, which the RTSTRUCT writer writes) and the geometry the tumour report
measures on them (:func:`recist`, :func:`farthest_pair`, :func:`mean_index`), in time linear in the voxels and the
outlines' length (n log n at most) whatever the label map: a wrong prediction's whole thorax with holes costs as much to
measure as to write. Diameters come from the outline points that can be corners of a convex hull (:func:`row_extremes`:
the first and last of each row, found without tracing), the short axis from a sweep over the one slice's outline."""

from __future__ import annotations

import logging

import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import connected_components
from scipy.spatial import ConvexHull, QhullError
from scipy.spatial.distance import cdist
from scripts.common.geometry import bounding_box

logger = logging.getLogger(__name__)

RAS_TO_LPS = np.array([-1.0, -1.0, 1.0])


def outlines(mask: np.ndarray, axis: int = 2) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The closed outlines of ``mask`` in each of its planes across ``axis``, traced halfway between voxel centres
    inside and outside (marching squares at level 0.5: the segments of ``skimage.measure.find_contours`` on each
    padded plane, two inside voxels that touch at a corner only kept apart), in time linear in the voxels.

    Returns ``points`` (N, 2) in each plane's voxel coordinates (its two axes in order), ``planes`` (N,) the index of
    each point's plane along ``axis``, and ``starts`` (M + 1,): outline ``j`` is ``points[starts[j]:starts[j + 1]]``,
    in order, not closed by a repeated point."""
    points, planes, following = _crossings(mask, axis)
    order, starts = _cycles(following, planes)
    return points[order], planes[order], starts


def lps(ijk: np.ndarray, affine: np.ndarray) -> np.ndarray:
    """World LPS mm of (N, 3) voxel coordinates through the RAS affine."""
    return (np.asarray(ijk, dtype=float).reshape(-1, 3) @ affine[:3, :3].T + affine[:3, 3]) * RAS_TO_LPS


def mean_index(mask: np.ndarray, axis: int | None = None, index: int = 0) -> np.ndarray:
    """The mean voxel index of ``mask``'s true voxels (of its plane ``index`` across ``axis`` when given), from the
    counts along each axis: no (N, 3) list of a whole thorax's voxels."""
    part = mask if axis is None else np.expand_dims(np.take(mask, index, axis=axis), axis)
    mean = []
    for a in range(3):
        counts = part.sum(axis=tuple(b for b in range(3) if b != a))
        mean.append(float(counts @ np.arange(len(counts))) / float(counts.sum()))
    if axis is not None:
        mean[axis] = float(index)
    return np.array(mean)


def row_extremes(mask: np.ndarray, axial: int) -> tuple[np.ndarray, np.ndarray]:
    """Of each axial slice's outline vertices (halfway between an inside and an outside voxel, as :func:`outlines`
    places them), those that can be corners of the slice's convex hull: the first and the last on each row, on the
    rows of voxel centres and on the rows between them -- (N, 2) in-plane voxel coordinates and their slices, at most
    four per row, found without tracing. Every hull corner is one: a point between two others on a line is none."""
    in_plane = [a for a in range(3) if a != axial]
    grid = np.ascontiguousarray(np.moveaxis(mask, (axial, *in_plane), (0, 1, 2)))  # [slice, row, column]
    columns = grid.shape[2]
    between = np.concatenate([grid[:, :1], grid[:, :-1] ^ grid[:, 1:], grid[:, -1:]], axis=1)  # rows r-1 | r
    points, slices = [], []
    for crossed, row_offset, column_offset in ((grid, 0.0, 0.5), (between, -0.5, 0.0)):
        k, row = np.nonzero(crossed.any(axis=2))
        first = crossed.argmax(axis=2)[k, row]
        last = columns - 1 - crossed[:, :, ::-1].argmax(axis=2)[k, row]
        if column_offset:  # on a row of voxel centres: before the first inside voxel and after the last
            first, last = first - column_offset, last + column_offset
        for column in (first, last):
            points.append(np.stack([row + row_offset, column], axis=1))
            slices.append(k)
    return np.concatenate(points).astype(float), np.concatenate(slices)


def _in_slice(points: np.ndarray, k: int, affine: np.ndarray, axial: int) -> np.ndarray:
    """LPS mm of in-plane voxel coordinates (N, 2) on axial slice ``k``."""
    ijk = np.empty((len(points), 3))
    ijk[:, [a for a in range(3) if a != axial]] = points
    ijk[:, axial] = k
    return lps(ijk, affine)


def recist(largest: np.ndarray, points: np.ndarray, slices: np.ndarray, affine: np.ndarray, axial: int) -> tuple:
    """Long axis (the longest in-slice distance, in the slice where it is longest) and short axis (the longest
    extent perpendicular to it in that slice), their slice and their end points (LPS mm); and each slice's hull
    corners (LPS mm), which hold the 3D diameter."""
    order = np.argsort(slices, kind="stable")
    ks, firsts = np.unique(slices[order], return_index=True)
    corners, longest = [], []
    for k, chunk in zip(ks, np.split(order, firsts[1:]), strict=True):
        corners.append(_hull_corners(_in_slice(points[chunk], int(k), affine, axial)))
        longest.append(farthest_pair(corners[-1]))
    best = int(np.argmax([pair[0] for pair in longest]))  # the first slice where it is longest
    long_axis, p, q = longest[best]
    k = int(ks[best])
    in_plane = [affine[:3, a] * RAS_TO_LPS for a in range(3) if a != axial]
    normal = np.cross(*in_plane)
    normal /= np.linalg.norm(normal)
    u = (q - p) / long_axis if long_axis > 0 else in_plane[0] / np.linalg.norm(in_plane[0])
    v = np.cross(normal, u)
    plane = np.expand_dims(np.take(largest, k, axis=axial), 2)
    traced, _, following = _crossings(plane, 2)
    short_axis, a, b = _perpendicular_extent(_in_slice(traced, k, affine, axial), following, u, v)
    ends = [[p.tolist(), q.tolist()], [a.tolist(), b.tolist()]]
    return float(long_axis), float(short_axis), k, ends, corners


def _crossing(start_u, span, start_v, rise, t):
    """Where segments (starting at ``start_u``, ``start_v`` along u and v, ``span`` and ``rise`` long along them)
    cross the line u = ``t``: their v there, clipped to the segment."""
    return start_v + np.clip((t - start_u) / span, 0.0, 1.0) * rise


def _perpendicular_extent(points: np.ndarray, following: np.ndarray, u: np.ndarray, v: np.ndarray) -> tuple:
    """The longest extent along ``v`` of closed outlines (segments ``points[i]`` -> ``points[following[i]]``, which
    do not cross: marching squares' never do) on any line perpendicular to ``u`` (first crossing to last), and its
    two end points.

    Between two consecutive vertex positions along ``u`` the highest crossing is a maximum of linear functions (convex)
    and the lowest a minimum (concave), so the extent is largest at a vertex position; only those are tried. The
    highest and lowest crossing at each come from a segment tree over the positions: a segment is kept at the
    O(log n) nodes whose whole interval it spans, each node keeps its highest and its lowest segment (segments that do
    not cross keep one order over an interval they all span) and a position's crossings are its nodes' keepers' --
    O(n log n) crossings computed, not vertices x segments."""
    along, across = points @ u, points @ v
    positions, at = np.unique(along, return_inverse=True)
    high, low = np.full(len(positions), -np.inf), np.full(len(positions), np.inf)
    np.maximum.at(high, at, across)
    np.minimum.at(low, at, across)
    span, rise = along[following] - along, across[following] - across
    flat = np.abs(span) < 1e-12
    if flat.any():  # a segment along v counts, both ends, at each position within 1e-9 of it
        segment = np.flatnonzero(flat)
        first = np.searchsorted(positions, along[segment] - 1e-9, "left")
        count = np.searchsorted(positions, along[segment] + 1e-9, "right") - first
        where = np.repeat(first - np.cumsum(count) + count, count) + np.arange(count.sum())
        for value in (across[segment], across[following[segment]]):
            np.maximum.at(high, where, np.repeat(value, count))
            np.minimum.at(low, where, np.repeat(value, count))
    segments = np.flatnonzero(~flat)
    if len(positions) > 1 and segments.size:
        top, bottom = _envelopes(positions, np.sort([at[segments], at[following[segments]]], axis=0),
                                 (along[segments], span[segments], across[segments], rise[segments]))  # fmt: skip
        high = np.maximum(high, top)
        low = np.minimum(low, bottom)
    extent = high - low
    i = int(np.argmax(extent))
    base = positions[i] * u
    plane_offset = points[0] - (points[0] @ u) * u - (points[0] @ v) * v  # the slice plane's offset along its normal
    return max(float(extent[i]), 0.0), base + low[i] * v + plane_offset, base + high[i] * v + plane_offset


def _envelopes(positions: np.ndarray, spans: np.ndarray, segments: tuple) -> tuple[np.ndarray, np.ndarray]:
    """The highest and the lowest crossing of the (non-crossing) ``segments`` at each of ``positions``: ``spans``
    (2, n) the indices of each segment's first and last position, ``segments`` its start, span, start v and rise
    (see :func:`_crossing`); -inf / inf where none crosses."""
    leaves = len(positions) - 1  # leaf j: the open interval between positions j and j + 1
    size = 1 << int(np.ceil(np.log2(leaves))) if leaves > 1 else 1
    lo, hi, owner = spans[0] + size, spans[1] + size, np.arange(spans.shape[1])
    nodes, owners, levels, level = [], [], [], 0
    while lo.size:  # each segment's interval of leaves as the nodes that cover it (a segment tree, built bottom-up)
        for take, node in (((lo & 1) == 1, lo), ((hi & 1) == 1, hi - 1)):
            nodes.append(node[take & (lo < hi)])
            owners.append(owner[take & (lo < hi)])
            levels.append(np.full(nodes[-1].size, level))
        lo, hi = (lo + (lo & 1)) >> 1, (hi - (hi & 1)) >> 1
        keep = lo < hi
        lo, hi, owner, level = lo[keep], hi[keep], owner[keep], level + 1
    node, owner, level = np.concatenate(nodes), np.concatenate(owners), np.concatenate(levels)
    first = (node << level) - size  # the node's first leaf, and its last position
    middle = (positions[first] + positions[np.minimum(((node + 1) << level) - size, leaves)]) / 2
    value = _crossing(*(part[owner] for part in segments), middle)
    order = np.lexsort((value, node))
    node, owner = node[order], owner[order]
    starts = np.flatnonzero(np.r_[True, node[1:] != node[:-1]])
    ends = np.r_[starts[1:], node.size] - 1
    depth = int(np.log2(size)) + 1
    ancestors = (np.arange(leaves)[:, None] + size) >> np.arange(depth)[None, :]  # each leaf's nodes, leaf to root
    envelopes = []
    for keeper, best in ((ends, np.argmax), (starts, np.argmin)):
        kept = np.full(2 * size, -1)
        kept[node[keeper]] = owner[keeper]
        candidate = kept[ancestors]
        middle = (positions[:-1] + positions[1:]) / 2
        value = np.where(candidate >= 0, _crossing(*(part[candidate] for part in segments), middle[:, None]), np.nan)
        fill = -np.inf if best is np.argmax else np.inf
        chosen = candidate[np.arange(leaves), best(np.where(np.isnan(value), fill, value), axis=1)]
        side = np.full((2, len(positions)), fill)
        has = chosen >= 0
        leaf = np.flatnonzero(has)
        for end, shift in ((0, 0), (1, 1)):  # the leaf's keeper at its left and right position
            side[end, leaf + shift] = _crossing(*(part[chosen[has]] for part in segments), positions[leaf + shift])
        envelopes.append(side.max(0) if best is np.argmax else side.min(0))
    return envelopes[0], envelopes[1]


def _hull_corners(points: np.ndarray) -> np.ndarray:
    """The corners of the convex hull of ``points`` (N, 3), computed in the subspace they span (a single slice or a
    line of voxels works too); every point when the hull cannot be computed."""
    if len(points) <= 3:
        return points
    centred = points - points.mean(0)
    _, singular, basis = np.linalg.svd(centred, full_matrices=False)
    rank = int((singular > 1e-9 * max(singular[0], 1e-12)).sum())
    if rank == 1:
        along = centred @ basis[0]
        return points[[int(along.argmin()), int(along.argmax())]]
    if rank >= 2:
        try:
            return points[ConvexHull(centred @ basis[:rank].T).vertices]
        except QhullError:  # degenerate beyond what the rank shows: every point is a candidate
            logger.debug("convex hull failed on %d points; comparing all pairs", len(points))
    return points


def farthest_pair(points: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
    """The largest distance between two of ``points`` (N, 3) and the two points: among the corners of their convex
    hull, compared a block at a time (memory bounded however many corners there are)."""
    candidates = _hull_corners(points)
    if len(candidates) < 2:
        return 0.0, candidates[0], candidates[0]
    best, pair = -1.0, (0, 0)
    for offset in range(0, len(candidates), 1024):
        distances = cdist(candidates[offset : offset + 1024], candidates)
        i, j = np.unravel_index(int(distances.argmax()), distances.shape)
        if distances[i, j] > best:
            best, pair = float(distances[i, j]), (offset + int(i), int(j))
    return best, candidates[pair[0]], candidates[pair[1]]


def _segment_table() -> np.ndarray:
    """Marching squares' segments in a 2 x 2 cell by its corners inside (bit ``i`` for corner ``i``, clockwise from
    the top left), each from the edge where the outline leaves the inside corners to the edge where it meets them
    (edge ``i`` joins corners ``i`` and ``i + 1``), so every outline runs one way: [case, slot] -> (from, to), -1 for
    none. Two inside corners facing across the cell are apart (``find_contours``' default)."""
    table = np.full((16, 2, 2), -1, np.int64)
    for case in range(1, 15):
        inside = [(case >> i) & 1 for i in range(4)]
        slot = 0
        for start in range(4):
            if inside[start] and not inside[start - 1]:  # a run of inside corners starts here
                end = start
                while inside[(end + 1) % 4]:
                    end = (end + 1) % 4
                table[case, slot] = (end, (start - 1) % 4)
                slot += 1
    return table


SEGMENTS = _segment_table()


def _crossings(mask: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Marching squares on every plane of ``mask`` across ``axis`` at once: each vertex (halfway between an inside
    and an outside voxel of a padded plane) as in-plane coordinates (N, 2), its plane (N,), and the vertex its
    segment leads to (N,): a permutation whose cycles are the closed outlines. Linear in the voxels."""
    grid = np.moveaxis(np.asarray(mask, bool), axis, -1)
    box = bounding_box(grid)
    if box is None:
        return np.zeros((0, 2)), np.zeros(0, int), np.zeros(0, int)
    grid = grid[tuple(slice(a, b) for a, b in zip(*box, strict=True))]
    rows, columns, planes = grid.shape
    padded = np.zeros((rows + 2, columns + 2, planes), np.uint8)
    padded[1:-1, 1:-1] = grid
    # the vertices, numbered: first those between columns c and c + 1 of a row, then between rows r and r + 1
    across = np.flatnonzero(padded[:, :-1] != padded[:, 1:])  # in an array of shape (rows + 2, columns + 1, planes)
    down = np.flatnonzero(padded[:-1] != padded[1:])  # (rows + 1, columns + 2, planes)
    number_across = np.zeros((rows + 2) * (columns + 1) * planes, np.int32)
    number_across[across] = np.arange(across.size)
    number_down = np.zeros((rows + 1) * (columns + 2) * planes, np.int32)
    number_down[down] = np.arange(across.size, across.size + down.size)
    case = padded[:-1, :-1] | padded[:-1, 1:] << 1 | padded[1:, 1:] << 2 | padded[1:, :-1] << 3
    cells = np.flatnonzero((case != 0) & (case != 15))  # in (rows + 1, columns + 1, planes)
    case = case.ravel()[cells]
    at_across, at_down = cells, cells + cells // ((columns + 1) * planes) * planes  # the cell's top left in each
    vertices = np.stack([number_across[at_across], number_down[at_down + planes],
                         number_across[at_across + (columns + 1) * planes], number_down[at_down]], axis=1)  # fmt: skip
    following = np.empty(across.size + down.size, np.int64)
    for slot in range(2):  # edges 0 top, 1 right, 2 bottom, 3 left of each cell (see SEGMENTS)
        segment = SEGMENTS[case, slot]
        present = np.flatnonzero(segment[:, 0] >= 0)
        ends = np.take_along_axis(vertices[present], segment[present], axis=1)
        following[ends[:, 0]] = ends[:, 1]
    ar, ac, ak = np.unravel_index(across, (rows + 2, columns + 1, planes))
    dr, dc, dk = np.unravel_index(down, (rows + 1, columns + 2, planes))
    points = np.concatenate([np.stack([ar - 1.0, ac - 0.5], 1), np.stack([dr - 0.5, dc - 1.0], 1)])
    points += box[0][:2]
    return points, np.concatenate([ak, dk]) + box[0][2], following


def _cycles(following: np.ndarray, key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The cycles of the permutation ``following``, each in order from its smallest member, the cycles sorted by
    ``key`` of that member: ``order`` (N,) and ``starts`` (M + 1,) -- by list ranking (pointer jumping), O(N log L)
    for cycles up to L long."""
    n = len(following)
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(1, np.int64)
    graph = csr_matrix((np.ones(n, np.int8), (np.arange(n), following)), shape=(n, n))
    count, cycle = connected_components(graph, directed=True, connection="weak")
    head = np.full(count, n, np.int64)
    np.minimum.at(head, cycle, np.arange(n))
    rank = np.argsort(key[head], kind="stable")
    renumber = np.empty(count, np.int64)
    renumber[rank] = np.arange(count)
    cycle, head = renumber[cycle], head[rank]
    lengths = np.bincount(cycle, minlength=count)
    successor = following.copy()
    last = successor == head[cycle]  # each cycle cut before its head: a list from the head to this member
    successor[last] = np.flatnonzero(last)
    steps = (~last).astype(np.int64)  # to the successor; at the end, to the list's last member
    active = np.flatnonzero(~last)
    while active.size:
        ahead = successor[active]
        steps[active] += steps[ahead]
        successor[active] = successor[ahead]
        active = active[successor[active] != successor[successor[active]]]
    starts = np.concatenate([[0], np.cumsum(lengths)])
    order = np.empty(n, np.int64)
    order[starts[cycle] + lengths[cycle] - 1 - steps] = np.arange(n)
    return order, starts

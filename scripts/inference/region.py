"""Where in a CT a lung tumour can be: the thorax, found from the CT itself, so the network runs only there.

:func:`find_thorax` works on the network's input as preprocessing makes it (RAS, ``spacing``, body-cropped, HU
windowed to [0, 1]) on a coarse grid (about 4 x 4 x 6 mm):

1. the body: voxels above -500 HU, each axial slice's holes filled (so the lungs, enclosed by the chest wall, count);
2. air inside the body (below -400 HU), opened in plane by a 12 mm disc: the trachea and bronchi (and the thinnest
   tips of the lungs) go, the lungs stay;
3. the lungs: the largest such 3-D component, and any other of at least :data:`OTHER_LUNG` of its volume (the other
   lung; a stomach bubble may join, which only makes the region larger); none of :data:`MIN_LUNG_ML` -> no lung;
4. their bounding box, mirrored left-right about the body's midline (so a lung with no air -- collapsed, filled by a
   tumour or an effusion -- is covered by its partner's mirror image), grown by ``margin_mm`` and clipped to the
   image, never smaller than the network's window.

What the margin covers: a tumour inside either lung or in the mediastinum between them (inside the box by
construction), chest-wall invasion up to ``margin_mm[0:2]`` beyond the lungs' outer edge, a Pancoast tumour or a
node up to ``margin_mm[2]`` above the apex, a mass on the diaphragm down to the same distance below the lowest lung
voxel. What it does not: a tumour further outside the thorax (a supraclavicular or axillary node beyond the margin,
a metastasis in the liver or an adrenal), a lung with no air on both sides (no lung is found: the whole body is used,
and the region says so), and a scan whose lungs are displaced off the body's midline by more than the margin.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from scipy import ndimage
from torch.nn import functional

#: voxels above this are body (the body crop's threshold)
BODY_HU = -500.0
#: voxels below this inside the body are air (aerated lung is about -850 HU)
AIR_HU = -400.0
#: the coarse grid the lungs are found on (mm)
COARSE_MM = (4.0, 4.0, 6.0)
#: the radius (mm) of the in-plane opening that removes the airways
AIRWAY_MM = 12.0
#: the smallest air component (ml) that counts as a lung
MIN_LUNG_ML = 150.0
#: another air component counts as the second lung when it holds at least this share of the largest one's volume
OTHER_LUNG = 0.3
#: the default margin (mm) around the lungs: x, y (chest wall, ribs, invasion) and z (apex, diaphragm)
MARGIN_MM = (30.0, 30.0, 40.0)


@dataclass
class Region:
    """The box the network runs on, in voxels of the input (``start`` inclusive, ``stop`` exclusive), and how it was
    found (``method``: ``thorax``, ``body`` when asked for, or ``body (no lung found)``)."""

    start: tuple[int, int, int]
    stop: tuple[int, int, int]
    method: str
    lung_ml: float = 0.0

    def slices(self) -> tuple[slice, slice, slice]:
        return tuple(slice(a, b) for a, b in zip(self.start, self.stop, strict=True))

    def mask(self, shape: Sequence[int]) -> np.ndarray:
        """The box as a boolean mask of ``shape`` (the volume's, a leading channel axis allowed), for transforms that
        crop to a mask's bounding box (``CropForegroundd(select_fn=...)``)."""
        mask = np.zeros(tuple(shape), bool)
        mask[(..., *self.slices())] = True
        return mask

    def corners_world(self, affine: np.ndarray) -> np.ndarray:
        """The box's extent in world coordinates of ``affine`` (the outer faces of its first and last voxels): the
        (min, max) corners, (2, 3)."""
        ijk = np.array([[a - 0.5 for a in self.start], [b - 0.5 for b in self.stop]])
        grid = np.array(np.meshgrid(*ijk.T, indexing="ij")).reshape(3, -1).T
        world = grid @ np.asarray(affine, float)[:3, :3].T + np.asarray(affine, float)[:3, 3]
        return np.stack([world.min(0), world.max(0)])


def find_thorax(
    volume: np.ndarray | torch.Tensor,
    spacing: Sequence[float],
    hu_window: Sequence[float],
    window: Sequence[int],
    margin_mm: Sequence[float] = MARGIN_MM,
) -> Region:
    """The thorax box of ``volume`` (x = left-right, y, z = slices; values HU windowed to [0, 1] by ``hu_window``),
    never smaller than ``window`` voxels where the volume allows (see the module docstring). A tensor is reduced to
    the coarse grid where it lies (on a GPU: the volume never crosses to the host, only its coarse grid, 1/32 of it)."""
    shape = np.array(volume.shape[-3:])
    factors = np.maximum(np.rint(np.array(COARSE_MM) / np.asarray(spacing, float)).astype(int), 1)
    hu = _coarse(volume.reshape(tuple(shape)), factors) * (hu_window[1] - hu_window[0]) + hu_window[0]
    voxel_ml = float(np.prod(factors * np.asarray(spacing, float))) / 1000.0
    body = hu > BODY_HU
    filled = np.stack([ndimage.binary_fill_holes(body[:, :, k]) for k in range(body.shape[2])], axis=2)
    air = (hu < AIR_HU) & filled
    radius = max(round(float(AIRWAY_MM / (factors[0] * spacing[0]))), 1)
    disc = np.hypot(*np.mgrid[-radius : radius + 1, -radius : radius + 1]) <= radius
    air = ndimage.binary_opening(air, structure=disc[:, :, None])
    labels, count = ndimage.label(air)
    sizes = np.bincount(labels.ravel(), minlength=count + 1)[1:] * voxel_ml
    if not count or sizes.max() < MIN_LUNG_ML:
        return _at_least(Region((0, 0, 0), tuple(int(s) for s in shape), "body (no lung found)"), window, shape)
    kept = np.flatnonzero(sizes >= OTHER_LUNG * sizes.max()) + 1
    box = ndimage.find_objects(np.isin(labels, kept).astype(np.int8))[0]
    low = np.array([b.start for b in box]) * factors  # voxels of the input
    high = np.minimum(np.array([b.stop for b in box]) * factors, shape)
    middle = _midline(filled, box[2]) * factors[0] + (factors[0] - 1) / 2  # the body's midline, input voxels
    low[0], high[0] = (
        min(low[0], int(np.floor(2 * middle - high[0] + 1))),
        max(high[0], int(np.ceil(2 * middle - low[0])) + 1),
    )
    grow = np.rint(np.asarray(margin_mm, float) / np.asarray(spacing, float)).astype(int)
    start, stop = np.maximum(low - grow, 0), np.minimum(high + grow, shape)
    lung_ml = round(float(sizes[kept - 1].sum()), 1)
    return _at_least(
        Region(tuple(int(v) for v in start), tuple(int(v) for v in stop), "thorax", lung_ml), window, shape
    )


def _coarse(volume: np.ndarray | torch.Tensor, factors: np.ndarray) -> np.ndarray:
    """Block means of ``volume`` (x, y, z) over ``factors`` voxels, the edge blocks padded with their edge values, as
    float32 on the host: one average pooling on the tensor's device (2.7x numpy's block mean on 2 CPU cores)."""
    if isinstance(volume, np.ndarray):
        volume = np.require(volume, np.float32, ["W"])  # a read-only array is copied (torch wants a writable one)
    tensor = torch.as_tensor(volume).detach().as_subclass(torch.Tensor).to(torch.float32)[None, None]  # no metadata
    pads = [(-n) % int(f) for n, f in zip(tensor.shape[2:], factors, strict=True)]
    if any(pads):
        tensor = functional.pad(tensor, (0, pads[2], 0, pads[1], 0, pads[0]), mode="replicate")
    pooled = functional.avg_pool3d(tensor, kernel_size=tuple(int(f) for f in factors))
    return pooled[0, 0].cpu().numpy()


def _midline(body: np.ndarray, slices: slice) -> float:
    """The body's left-right centre (coarse x) over the axial ``slices``: its voxels' mean x."""
    xs = np.nonzero(body[:, :, slices])[0]
    return float(xs.mean()) if xs.size else (body.shape[0] - 1) / 2


def _at_least(region: Region, window: Sequence[int], shape: np.ndarray) -> Region:
    """``region`` widened about its centre to at least ``window`` voxels on each axis (as far as the volume
    allows)."""
    start, stop = np.array(region.start), np.array(region.stop)
    size = np.minimum(np.asarray(window), shape)
    small = stop - start < size
    centre = (start + stop) / 2
    start = np.where(small, np.clip(np.rint(centre - size / 2).astype(int), 0, shape - size), start)
    stop = np.where(small, start + size, stop)
    return Region(tuple(int(v) for v in start), tuple(int(v) for v in stop), region.method, region.lung_ml)

"""A chest CT as a real one holds it, for the benchmark and the tests of the thorax region
(scripts/inference/region.py).

In patient (LPS) millimetres, relative to the lung apex, which lies ``apex_mm`` below the top slice (40 mm: the root
of the neck above it, as a planning CT starts): a torso 340 x 230 mm with a 23-28 mm chest wall, the neck above the
shoulders, the arms beside the body (optional), the couch under the back; two lungs (294 mm across both, 184 mm front
to back, 270 mm from apex to the posterior recesses, the diaphragm's domes pushing up 65 mm into their bases) with
the heart, spine, trachea and main bronchi between them; below them the upper abdomen with a stomach gas bubble under
the left dome. A 512 x 512 x 120 grid of 0.98 x 0.98 x 3 mm (a 500 mm field of view, 357 mm long) then holds the
neck above the lungs (40 mm) and the upper abdomen below them (~47 mm), as a chest CT does.

``pathology`` puts the tumour (an ellipsoid, its own HU) where a method that looks for lung air is weakest: a lung
collapsed or filled by a central mass, a pleural effusion, the apex (Pancoast), the diaphragm, the chest wall, a
mediastinal node. The truth -- the tumour mask, in the same grid -- comes with the HU. Nothing here is shared with the
region finder.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

HU = {"air": -1000.0, "body": 40.0, "lung": -850.0, "heart": 45.0, "bone": 700.0, "couch": -100.0, "fluid": 10.0,
      "collapsed": 35.0}  # fmt: skip
#: where each pathology's tumour sits (centre, LPS mm from the apex of the midline; semi-axes, mm) and what it does
PATHOLOGIES = {
    "none": ((95.0, -10.0, -110.0), (15.0, 14.0, 16.0)),
    "collapsed_left": ((40.0, -10.0, -100.0), (28.0, 25.0, 30.0)),  # the whole left lung airless
    "effusion_right": ((-90.0, -30.0, -70.0), (15.0, 14.0, 16.0)),  # fluid fills the right lung below -120 mm
    "large_central": ((-45.0, -5.0, -110.0), (45.0, 40.0, 50.0)),  # and the right lung airless within 70 mm of it
    "apex": ((-90.0, 10.0, 0.0), (20.0, 18.0, 25.0)),  # 25 mm above the apex into the thoracic inlet
    "diaphragm": ((80.0, 40.0, -232.0), (18.0, 16.0, 15.0)),  # on the left dome, in the posterior recess
    "chest_wall": ((150.0, -10.0, -120.0), (24.0, 20.0, 22.0)),  # through the ribs to the skin
    "mediastinal_node": ((0.0, 5.0, -85.0), (13.0, 12.0, 14.0)),  # subcarinal
}


def chest(
    xs: np.ndarray,
    ys: np.ndarray,
    zs: np.ndarray,
    pathology: str = "none",
    apex_mm: float = 40.0,
    arms: bool = True,
    tumour_hu: float = 45.0,
    noise_hu: float = 20.0,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray, dict]:
    """HU (float32, [x, y, z] over the voxel centres ``xs``, ``ys``, ``zs`` in LPS mm), the tumour mask, and the
    truth (where the apex and the tumour are, in mm)."""
    if pathology not in PATHOLOGIES:
        raise ValueError(f"pathology={pathology!r}: choose one of {list(PATHOLOGIES)}.")
    x, y, z = np.meshgrid(xs, ys, zs - (float(np.max(zs)) - apex_mm), indexing="ij", sparse=True)  # z: from the apex
    torso = ((x / 170.0) ** 2 + (y / 115.0) ** 2 <= 1) & (z <= 25)
    neck = (x / 60.0) ** 2 + ((y - 15.0) / 60.0) ** 2 <= 1
    body = torso | neck
    if arms:
        body |= ((np.abs(x) - 228.0) / 45.0) ** 2 + (y / 55.0) ** 2 <= 1
    couch = (np.abs(x) <= 240) & (y >= 116) & (y <= 128)
    spine = x**2 + (y - 80.0) ** 2 <= 22.0**2
    heart = _ellipsoid(x, y, z, (25.0, -35.0, -175.0), (65.0, 55.0, 60.0))
    lungs = {}
    for name, side in (("Lung-Left", 1.0), ("Lung-Right", -1.0)):
        lung = _ellipsoid(x, y, z, (85.0 * side, -5.0, -135.0), (62.0, 92.0, 135.0))
        lung &= ~_ellipsoid(x, y, z, (70.0 * side, -20.0, -280.0), (120.0, 120.0, 75.0))  # the diaphragm's dome
        lungs[name] = lung & ~heart & ~spine & torso
    airways = _tube(x, y, z, (0.0, -15.0, 80.0), (0.0, -15.0, -60.0), 9.0) & body
    for side in (1.0, -1.0):
        airways |= _tube(x, y, z, (0.0, -15.0, -60.0), (50.0 * side, -10.0, -90.0), 6.0)
    stomach = _ellipsoid(x, y, z, (55.0, -40.0, -265.0), (45.0, 35.0, 28.0)) & torso & ~lungs["Lung-Left"]
    centre, radii = PATHOLOGIES[pathology]
    tumour = _ellipsoid(x, y, z, centre, radii) & body

    shape = (len(xs), len(ys), len(zs))
    hu = np.full(shape, HU["air"], np.float32)
    hu[np.broadcast_to(couch, shape)] = HU["couch"]
    hu[np.broadcast_to(body, shape)] = HU["body"]
    hu[np.broadcast_to(heart & body, shape)] = HU["heart"]
    for lung in lungs.values():
        hu[np.broadcast_to(lung, shape)] = HU["lung"]
    hu[np.broadcast_to(airways | stomach, shape)] = HU["air"]
    hu[np.broadcast_to(spine & body, shape)] = HU["bone"]
    _pathology(hu, pathology, lungs, x, y, z, shape)
    tumour = np.broadcast_to(tumour, shape)
    hu[tumour] = tumour_hu
    hu += np.random.default_rng(seed).normal(0.0, noise_hu, shape).astype(np.float32)
    apex = float(np.max(zs)) - apex_mm
    truth = {"pathology": pathology, "apex_z_mm": apex, "tumour_centre_lps": [centre[0], centre[1], apex + centre[2]],
             "tumour_radii_mm": list(radii), "tumour_voxels": int(tumour.sum())}  # fmt: skip
    return hu, np.array(tumour), truth  # its own writable array, not a read-only broadcast view


def _pathology(hu: np.ndarray, pathology: str, lungs: dict, x, y, z, shape: tuple) -> None:
    """What the pathology does to the lungs' air (the tumour is drawn after)."""
    if pathology == "collapsed_left":
        hu[np.broadcast_to(lungs["Lung-Left"], shape)] = HU["collapsed"]
    elif pathology == "effusion_right":
        hu[np.broadcast_to(lungs["Lung-Right"] & (z < -120.0), shape)] = HU["fluid"]
    elif pathology == "large_central":
        near = (x + 45.0) ** 2 + (y + 5.0) ** 2 + (z + 110.0) ** 2 <= 70.0**2
        hu[np.broadcast_to(lungs["Lung-Right"] & near, shape)] = HU["collapsed"]


def _ellipsoid(x, y, z, centre: Sequence[float], radii: Sequence[float]) -> np.ndarray:
    return sum(((c - m) / r) ** 2 for c, m, r in zip((x, y, z), centre, radii, strict=True)) <= 1


def _tube(x, y, z, start: Sequence[float], end: Sequence[float], radius: float) -> np.ndarray:
    """Points within ``radius`` of the segment from ``start`` to ``end``."""
    a, b = np.asarray(start, float), np.asarray(end, float)
    d = b - a
    t = np.clip(((x - a[0]) * d[0] + (y - a[1]) * d[1] + (z - a[2]) * d[2]) / float(d @ d), 0.0, 1.0)
    return (x - a[0] - t * d[0]) ** 2 + (y - a[1] - t * d[1]) ** 2 + (z - a[2] - t * d[2]) ** 2 <= radius**2

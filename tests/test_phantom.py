"""The chest phantom is the CT its docstring describes (scripts/data/phantom.py), measured on the image it returns.

Every position is computed here from the test's own affine (2.5 x 2.0 x 3 mm, a different spacing and voxel count on
each axis, so a swapped axis shows), in LPS millimetres from the lung apex that lies ``apex_mm`` below the top slice;
tissues are told apart by plausible HU bands, not by the module's table. The phantom is built noise-free (and with its
tumour at 300 HU, which no tissue has) where a measurement needs exact tissues, and as shipped (20 HU noise) for the
HU of each tissue. tests/test_region.py puts the same phantom through the region finder; this file checks the
phantom itself. Two claims of the docstring do not hold; they are marked xfail(strict) with what was measured.
"""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
from scipy import ndimage
from scripts.data.phantom import PATHOLOGIES, chest

AFFINE = np.array([[2.5, 0.0, 0.0, -248.75], [0.0, 2.0, 0.0, -149.0], [0.0, 0.0, 3.0, -180.0], [0.0, 0.0, 0.0, 1.0]])
SHAPE = (200, 150, 119)  # a 500 x 300 x 357 mm field: the body, arms and couch, the neck above, the abdomen below
SPACING = tuple(float(np.linalg.norm(AFFINE[:3, a])) for a in range(3))
VOXEL_ML = abs(np.linalg.det(AFFINE[:3, :3])) / 1000.0
XS, YS, ZS = (AFFINE[a, 3] + AFFINE[a, a] * np.arange(n) for a, n in enumerate(SHAPE))  # voxel centres, mm
APEX_MM = 40.0  # the default: the root of the neck above the lungs
APEX_Z = float(ZS.max()) - APEX_MM
NOISELESS = {"noise_hu": 0.0, "tumour_hu": 300.0}  # exact tissues, and a tumour HU no tissue has
X, Y, Z = XS[:, None, None], YS[None, :, None], ZS[None, None, :] - APEX_Z  # Z: mm above the apex


def world(indices: np.ndarray) -> np.ndarray:
    """(N, 3) voxel indices -> (N, 3) LPS mm, through the affine."""
    return np.asarray(indices, float) @ AFFINE[:3, :3].T + AFFINE[:3, 3]


def voxel(x: float, y: float, z_from_apex: float) -> tuple[int, int, int]:
    """The voxel nearest an LPS point given relative to the apex."""
    point = np.array([x, y, APEX_Z + z_from_apex]) - AFFINE[:3, 3]
    return tuple(int(v) for v in np.rint(np.linalg.solve(AFFINE[:3, :3], point)))


def air(hu: np.ndarray) -> np.ndarray:
    return hu < -950.0


def aerated_lung(hu: np.ndarray) -> np.ndarray:
    return (hu >= -950.0) & (hu < -500.0)


def span(coordinates: np.ndarray) -> float:
    """The distance between the outermost voxel centres (mm)."""
    return float(coordinates.max() - coordinates.min())


@pytest.fixture(scope="module")
def phantom():
    """``chest`` on the test grid; each set of arguments is built once for the module (read-only use)."""

    @functools.cache
    def build(pathology: str = "none", **kwargs):
        return chest(XS, YS, ZS, pathology, **kwargs)

    return build


def small_grid(step: float = 5.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A coarse 500 x 300 x 357 mm grid for the tests that build the phantom several times."""
    return np.arange(-250.0, 250.0, step) + step / 2, np.arange(-150.0, 150.0, step) + step / 2, np.arange(119) * 3.0


def test_the_ct_is_float32_hu_over_the_given_voxel_centres_with_its_mask_and_a_json_truth(phantom):
    hu, tumour, truth = phantom()
    assert hu.shape == tumour.shape == SHAPE and hu.dtype == np.float32 and tumour.dtype == bool
    assert tumour.flags.c_contiguous
    assert truth["pathology"] == "none" and truth["apex_z_mm"] == APEX_Z
    assert truth["tumour_voxels"] == int(tumour.sum()) > 0
    assert json.loads(json.dumps(truth)) == truth, "the benchmark writes it as truth.json"


@pytest.mark.parametrize("pathology", list(PATHOLOGIES))
def test_the_tumour_lies_where_the_phantom_says_in_millimetres(phantom, pathology):
    """The mask is the recorded ellipsoid (centre and semi-axes in LPS mm, the centre apex-relative as asked for),
    cut only where it leaves the body (the chest-wall tumour, at the skin): its centroid, extent and volume are the
    ellipsoid's, measured through the affine."""
    hu, tumour, truth = phantom(pathology, **NOISELESS)
    asked_centre, asked_radii = PATHOLOGIES[pathology]
    centre, radii = np.add(asked_centre, [0.0, 0.0, APEX_Z]), np.array(asked_radii)
    assert truth["tumour_centre_lps"] == pytest.approx(centre) and truth["tumour_radii_mm"] == pytest.approx(radii)
    assert truth["tumour_voxels"] == int(tumour.sum()) > 0

    q = ((XS[:, None, None] - centre[0]) / radii[0]) ** 2 + ((YS[None, :, None] - centre[1]) / radii[1]) ** 2
    q = q + ((ZS[None, None, :] - centre[2]) / radii[2]) ** 2
    assert not (tumour & (q > 1 + 1e-9)).any(), "no tumour voxel outside the ellipsoid"
    assert (hu[tumour] == 300.0).all() and not ((hu == 300.0) & ~tumour).any(), "the mask is the tumour's voxels"
    cut = (q < 1 - 1e-9) & ~tumour
    assert air(hu[cut]).all(), "the ellipsoid is cut only outside the body"
    assert cut.any() == (pathology == "chest_wall")
    if pathology == "chest_wall":
        return
    where = world(np.argwhere(tumour))
    assert where.mean(0) == pytest.approx(centre, abs=0.5)
    for a in range(3):
        assert 2 * radii[a] - 2 * SPACING[a] <= span(where[:, a]) <= 2 * radii[a], ("xyz"[a], span(where[:, a]))
    assert tumour.sum() * VOXEL_ML == pytest.approx(4 / 3 * np.pi * radii.prod() / 1000, rel=0.03)


def test_the_chest_hangs_from_the_apex_apex_mm_below_the_top_slice_wherever_the_grid_starts():
    xs, ys, zs = small_grid()
    hu, tumour, truth = chest(xs, ys, zs, noise_hu=0.0)
    assert truth["apex_z_mm"] == zs.max() - 40.0
    higher, higher_tumour, higher_truth = chest(xs, ys, zs + 500.0, noise_hu=0.0)
    assert np.array_equal(higher, hu) and np.array_equal(higher_tumour, tumour)
    assert higher_truth["tumour_centre_lps"] == pytest.approx(np.add(truth["tumour_centre_lps"], [0.0, 0.0, 500.0]))
    lower, lower_tumour, lower_truth = chest(xs, ys, zs, apex_mm=70.0, noise_hu=0.0)  # 30 mm = 10 slices lower
    assert np.array_equal(lower[:, :, :-10], hu[:, :, 10:])
    assert np.array_equal(lower_tumour[:, :, :-10], tumour[:, :, 10:])
    assert lower_truth["apex_z_mm"] == truth["apex_z_mm"] - 30.0
    assert lower_truth["tumour_centre_lps"][2] == pytest.approx(truth["tumour_centre_lps"][2] - 30.0)


def test_the_order_of_the_voxel_centres_only_orders_the_volume():
    """A grid given right to left and feet to head (an RAS or a DICOM slice order) gives the same chest, reversed."""
    xs, ys, zs = small_grid()
    hu, tumour, truth = chest(xs, ys, zs, "apex", noise_hu=0.0)
    flipped, flipped_tumour, flipped_truth = chest(xs[::-1], ys, zs[::-1], "apex", noise_hu=0.0)
    assert np.array_equal(flipped, hu[::-1, :, ::-1]) and np.array_equal(flipped_tumour, tumour[::-1, :, ::-1])
    assert flipped_truth == truth


def test_the_noise_is_noise_hu_gaussian_and_the_seed_alone_decides_it():
    xs, ys, zs = small_grid()
    clean, tumour, truth = chest(xs, ys, zs, noise_hu=0.0)
    first, first_tumour, first_truth = chest(xs, ys, zs, noise_hu=15.0, seed=3)
    again = chest(xs, ys, zs, noise_hu=15.0, seed=3)[0]
    other, other_tumour, other_truth = chest(xs, ys, zs, noise_hu=15.0, seed=4)
    assert np.array_equal(first, again) and not np.array_equal(first, other)
    assert np.array_equal(first_tumour, tumour) and np.array_equal(other_tumour, tumour)
    assert first_truth == other_truth == truth
    noise, other_noise = (first - clean).astype(float), (other - clean).astype(float)
    assert abs(noise.mean()) < 0.1 and noise.std() == pytest.approx(15.0, rel=0.01)
    assert abs(np.corrcoef(noise.ravel(), other_noise.ravel())[0, 1]) < 0.01, "another seed, independent noise"


def test_an_unknown_pathology_is_refused_with_the_choices():
    xs, ys, zs = small_grid(50.0)
    with pytest.raises(ValueError, match=r"pathology='pancoast': choose one of \['none', 'collapsed_left', .*'apex'"):
        chest(xs, ys, zs, "pancoast")


#: a few voxels round a point where the docstring (or the anatomy it names) puts a tissue: (x, y, mm above the apex)
TISSUES = {
    "air outside the body": ((-240.0, -140.0, -135.0), (-1010.0, -990.0)),
    "right lung": ((-85.0, -5.0, -135.0), (-900.0, -700.0)),
    "left lung": ((100.0, -5.0, -160.0), (-900.0, -700.0)),
    "lateral chest wall": ((-158.0, -5.0, -135.0), (0.0, 80.0)),
    "heart": ((25.0, -35.0, -175.0), (0.0, 80.0)),
    "spine": ((0.0, 80.0, -135.0), (300.0, 2000.0)),
    "neck": ((30.0, 20.0, 30.0), (0.0, 80.0)),
    "trachea in the neck": ((0.0, -15.0, 20.0), (-1010.0, -950.0)),
    "upper abdomen": ((-60.0, -40.0, -290.0), (0.0, 80.0)),
    "stomach gas under the left dome": ((55.0, -40.0, -265.0), (-1010.0, -950.0)),
    "arm": ((-228.0, 0.0, -135.0), (0.0, 80.0)),
    "couch under the back": ((0.0, 122.0, -135.0), (-500.0, 0.0)),
}


@pytest.mark.parametrize("tissue", list(TISSUES))
def test_each_tissue_has_plausible_hu_where_the_anatomy_puts_it(phantom, tissue):
    hu, _, _ = phantom()
    (x, y, z), (low, high) = TISSUES[tissue]
    i, j, k = voxel(x, y, z)
    roi = hu[i - 2 : i + 3, j - 2 : j + 3, k - 2 : k + 3]
    assert low <= roi.mean() <= high, (tissue, float(roi.mean()))
    assert roi.std() == pytest.approx(20.0, rel=0.25), "the default noise, 20 HU"


def test_the_tumour_has_the_hu_it_is_asked_for(phantom):
    hu, tumour, _ = phantom()
    assert hu[tumour].mean() == pytest.approx(45.0, abs=3.0)  # the default, a soft-tissue mass
    hu, tumour, _ = phantom(**NOISELESS)
    assert (hu[tumour] == 300.0).all()


def test_the_torso_neck_and_couch_have_the_docstrings_proportions(phantom):
    """A torso 340 x 230 mm up to 25 mm above the apex, the neck (120 mm) above it, the couch under the back."""
    hu, _, _ = phantom(noise_hu=0.0, arms=False)
    body = (hu > -50.0) | aerated_lung(hu)  # tissue and lung: neither air nor the couch
    i0, j0, k = voxel(0.0, 0.0, -135.0)
    assert 340.0 - 2 * SPACING[0] <= span(XS[body[:, j0, k]]) <= 340.0
    assert 230.0 - 2 * SPACING[1] <= span(YS[body[i0, :, k]]) <= 230.0
    for y, z, width in ((0.0, 0.0, 340.0), (15.0, 40.0, 120.0)):  # the apex's slice; the top slice, 40 mm above it
        _, j, k = voxel(0.0, y, z)
        assert width - 2 * SPACING[0] <= span(XS[body[:, j, k]]) <= width, z
    couch = (hu > -500.0) & (hu < -50.0)
    _, j, _ = np.nonzero(couch)
    assert YS[j].min() >= 116.0 and YS[j].max() <= 128.0, "116-128 mm behind the centre"
    assert YS[np.nonzero(body)[1]].max() < YS[j].min(), "behind the body's back"
    assert couch.any(axis=(0, 1)).all(), "under every slice"


def test_the_lungs_have_the_docstrings_proportions_from_the_apex_to_the_domes(phantom):
    """294 mm across both, 184 mm front to back, their tops at the apex, the right dome 205 mm below it (65 mm above
    the lungs' nominal 270 mm)."""
    hu, _, _ = phantom(noise_hu=0.0, arms=False)
    where = world(np.argwhere(aerated_lung(hu)))
    assert 294.0 - 2 * SPACING[0] <= span(where[:, 0]) <= 294.0
    assert 184.0 - 2 * SPACING[1] <= span(where[:, 1]) <= 184.0
    assert APEX_Z - SPACING[2] <= where[:, 2].max() <= APEX_Z
    assert where[:, 0].min() < 0 < where[:, 0].max() and not (np.abs(where[:, 0]) < 20.0).any(), "the mediastinum"
    i, j, _ = voxel(-70.0, -20.0, 0.0)
    base = ZS[np.nonzero(aerated_lung(hu[i, j]))[0]].min() - APEX_Z
    assert -205.0 <= base <= -205.0 + SPACING[2]


def test_the_arms_lie_beside_the_torso_with_air_between_and_only_when_asked(phantom):
    row = voxel(0.0, 0.0, -135.0)
    with_arms, without = (phantom(noise_hu=0.0, arms=arms)[0][:, row[1], row[2]] for arms in (True, False))
    outer = np.abs(XS) > 175.0
    assert not air(with_arms[outer & (XS < 0)]).all() and not air(with_arms[outer & (XS > 0)]).all()
    assert air(with_arms[(np.abs(XS) > 172.0) & (np.abs(XS) < 182.0)]).all(), "apart from the torso"
    assert air(without[np.abs(XS) > 171.0]).all()
    assert np.array_equal(with_arms[np.abs(XS) < 171.0], without[np.abs(XS) < 171.0])


@pytest.mark.parametrize("pathology", list(PATHOLOGIES))
def test_each_pathology_takes_the_air_out_of_the_lung_it_names_and_nothing_else(phantom, pathology):
    """Compared with a phantom whose tumour lies outside the lungs (or the one without pathology, for that one): the
    whole left lung collapsed, fluid in the right lung below 120 mm under the apex, the right lung airless within
    70 mm of a central mass -- as soft tissue or fluid HU -- and no other voxel changed but the tumours'."""
    ref_hu, ref_tumour, _ = phantom("none" if pathology == "mediastinal_node" else "mediastinal_node", **NOISELESS)
    hu, tumour, _ = phantom(pathology, **NOISELESS)
    lung = aerated_lung(ref_hu)
    airless = {
        "collapsed_left": lung & (X > 0),
        "effusion_right": lung & (X < 0) & (Z < -120.0),
        "large_central": lung & (X < 0) & ((X + 45.0) ** 2 + (Y + 5.0) ** 2 + (Z + 110.0) ** 2 <= 70.0**2),
    }.get(pathology, np.zeros(SHAPE, bool))
    assert not ((hu != ref_hu) & ~(airless | tumour | ref_tumour)).any()
    filled = hu[airless & ~tumour]
    assert ((filled >= 0.0) & (filled <= 80.0)).all()
    if pathology in ("collapsed_left", "effusion_right", "large_central"):
        assert filled.size * VOXEL_ML > 300.0, "a large part of a lung"


def test_the_apex_tumour_rises_25_mm_above_the_apex_into_the_thoracic_inlet(phantom):
    lung = aerated_lung(phantom("mediastinal_node", **NOISELESS)[0])
    _, tumour, _ = phantom("apex", **NOISELESS)
    where = world(np.argwhere(tumour))
    assert APEX_Z + 25.0 - SPACING[2] <= where[:, 2].max() <= APEX_Z + 25.0
    assert (where[:, 0] < 0).all() and (tumour & lung & (X < 0)).any(), "over the right lung's apex"


def test_the_chest_wall_tumour_runs_from_the_lung_through_the_wall_to_the_skin(phantom):
    lung = aerated_lung(phantom("mediastinal_node", **NOISELESS)[0])
    hu, tumour, _ = phantom("chest_wall", **NOISELESS)
    assert (tumour & lung).any(), "in the lung"
    _, j, k = voxel(150.0, -10.0, -120.0)
    for jj in range(j - 2, j + 3):
        outermost = np.nonzero(tumour[:, jj, k])[0].max()
        assert air(hu[outermost + 1, jj, k]), "the tumour ends at the skin: air next to it"


def test_the_mediastinal_node_lies_between_the_lungs_below_the_carina(phantom):
    ref_hu = phantom("none", **NOISELESS)[0]
    lung = aerated_lung(ref_hu)
    _, tumour, _ = phantom("mediastinal_node", **NOISELESS)
    assert not (tumour & lung).any()
    where = world(np.argwhere(tumour))
    _, j, k = voxel(0.0, 5.0, -85.0)
    row = XS[lung[:, j, k]]
    assert (row < where[:, 0].min()).any() and (row > where[:, 0].max()).any(), "a lung on either side"
    i, j, _ = voxel(0.0, -15.0, 0.0)
    carina = ZS[np.nonzero(air(ref_hu[i, j]))[0]].min()  # the lowest air in the trachea's axis
    assert where[:, 2].max() < carina < APEX_Z


def test_the_diaphragm_tumour_sits_on_the_left_dome_posteriorly(phantom):
    lung = aerated_lung(phantom("mediastinal_node", **NOISELESS)[0])
    _, tumour, truth = phantom("diaphragm", **NOISELESS)
    where = world(np.argwhere(tumour))
    left_lung = world(np.argwhere(lung & (X > 0)))
    assert (where[:, 0] > 0).all() and where[:, 1].mean() > left_lung[:, 1].mean(), "left, posterior"
    i, j, _ = voxel(*truth["tumour_centre_lps"][:2], 0.0)
    base = ZS[np.nonzero(lung[i, j])[0]].min()  # the dome: the lung's floor in the tumour's axis
    top = ZS[np.nonzero(tumour[i, j])[0]].max()
    assert truth["tumour_centre_lps"][2] < base and abs(base - top) <= SPACING[2], "against the dome, from below"


@pytest.mark.xfail(strict=True, reason="phantom.py: the lungs are clipped to the torso ellipse, so antero-laterally "
                   "(98 to 173 mm below the apex) they reach the skin: 0 mm of chest wall, not 23-28 mm")  # fmt: skip
def test_the_chest_wall_encloses_the_lungs_at_least_20_mm_thick(phantom):
    hu = phantom("mediastinal_node", **NOISELESS)[0]
    labels, _ = ndimage.label(air(hu))
    border = np.unique(np.concatenate([labels[[0, -1]].ravel(), labels[:, [0, -1]].ravel()]))
    outside = np.isin(labels, border[border > 0])  # air reaching the field's sides (not the trachea at the top)
    distance = ndimage.distance_transform_edt(~outside, sampling=SPACING)
    assert distance[aerated_lung(hu)].min() >= 20.0


@pytest.mark.xfail(strict=True, reason="phantom.py: the dome ellipsoid cuts the lungs' bases, so they end ~226 mm "
                   "below the apex, not 270 mm (and ~90 mm of abdomen lie below them, not ~47 mm)")  # fmt: skip
def test_the_lungs_reach_270_mm_below_the_apex_in_the_posterior_recesses(phantom):
    hu = phantom("mediastinal_node", **NOISELESS)[0]
    lowest = world(np.argwhere(aerated_lung(hu)))[:, 2].min()
    assert APEX_Z - 270.0 <= lowest <= APEX_Z - 270.0 + SPACING[2]


def test_the_tumour_mask_is_an_array_of_its_own_that_can_be_edited(phantom):
    _, tumour, _ = phantom()
    assert tumour.flags.writeable and tumour.flags.owndata

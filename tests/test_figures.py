"""Pictures of a segmentation: a volume stored in any orientation is shown the same way -- axial slice with the most
truth, patient's right on the image's left and anterior at the top (radiological) -- with truth contours green,
prediction red and their overlap yellow, with or without a CT; the picture is a PNG, and the validation picture reaches
TensorBoard from rank 0 only."""

from __future__ import annotations

import io
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from ignite.engine import Engine
from monai.data import MetaTensor
from PIL import Image
from scripts.inference import figures
from scripts.inference.figures import BOTH_RGB, PRED_RGB, TRUTH_RGB, ValidationPicture, png_bytes, render_case, to_lps
from tensorboard.backend.event_processing.event_accumulator import IMAGES, EventAccumulator

# RAS affine of a volume whose voxel axes point L, P, S: x and y run against RAS, anisotropic spacing, an origin
AFFINE_LPS = np.array([[-0.7, 0, 0, 150.0], [0, -0.9, 0, 120.0], [0, 0, 2.5, -300.0], [0, 0, 0, 1]])


def stored(volume_lps: np.ndarray, perm: tuple[int, int, int], flips: tuple[bool, bool, bool], rotate_deg=0.0):
    """``volume_lps`` as another scanner would store it -- stored axis ``a`` is LPS axis ``perm[a]``, reversed where
    ``flips[a]`` -- and the affine that places it at the same world position (optionally slightly oblique)."""
    data = np.transpose(volume_lps, perm)
    index_map = np.zeros((4, 4))
    index_map[3, 3] = 1
    for a, (axis, flip) in enumerate(zip(perm, flips, strict=True)):
        index_map[axis, a] = -1.0 if flip else 1.0
        index_map[axis, 3] = data.shape[a] - 1 if flip else 0
    data = np.flip(data, [a for a, f in enumerate(flips) if f])
    affine = AFFINE_LPS @ index_map
    if rotate_deg:
        c, s = np.cos(np.radians(rotate_deg)), np.sin(np.radians(rotate_deg))
        rotation = np.eye(4)
        rotation[:2, :2] = [[c, -s], [s, c]]
        affine = rotation @ affine
    return np.ascontiguousarray(data), affine


ORIENTATIONS = {
    "LPS": ((0, 1, 2), (False, False, False)),
    "RAS": ((0, 1, 2), (True, True, False)),
    "RAI": ((0, 1, 2), (True, True, True)),
    "LAS": ((0, 1, 2), (False, True, False)),
    "sagittal-PSR": ((1, 2, 0), (False, False, True)),
    "coronal-ISL": ((2, 0, 1), (True, False, False)),
}


@pytest.mark.parametrize("name", ORIENTATIONS)
def test_to_lps_puts_an_asymmetric_object_at_the_same_lps_place(name):
    volume_lps = np.arange(5 * 6 * 4).reshape(5, 6, 4)  # every voxel different: any flip or swap shows
    data, affine = stored(volume_lps, *ORIENTATIONS[name])
    # the construction itself: the marker voxel sits at the same world point in both storages
    marker = int(volume_lps.max())
    world = [(a @ [*np.argwhere(v == marker)[0], 1])[:3] for v, a in ((volume_lps, AFFINE_LPS), (data, affine))]
    np.testing.assert_allclose(world[0], world[1])
    np.testing.assert_array_equal(to_lps(data, affine), volume_lps)


def test_to_lps_of_a_slightly_oblique_volume_uses_the_nearest_axes():
    volume_lps = np.arange(5 * 6 * 4).reshape(5, 6, 4)
    data, affine = stored(volume_lps, *ORIENTATIONS["RAS"], rotate_deg=10.0)
    np.testing.assert_array_equal(to_lps(data, affine), volume_lps)


# A scene in LPS voxel order (x: toward the patient's left, y: toward posterior, z: up), 40 x 32 x 6.
SHAPE = (40, 32, 6)
MOST_TRUTH_SLICE = 4


def scene() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Truth: an 8 x 8 square on the patient's right and anterior on slice 4, a smaller one on the left and posterior
    on slice 1 (fewer voxels). Prediction on slice 4: the same square moved 4 voxels posterior."""
    truth, pred = np.zeros(SHAPE, bool), np.zeros(SHAPE, bool)
    truth[2:10, 2:10, MOST_TRUTH_SLICE] = True
    truth[30:34, 24:28, 1] = True
    pred[2:10, 6:14, MOST_TRUTH_SLICE] = True
    ct = np.zeros(SHAPE, np.float32)  # 0 HU everywhere: mid-grey in the default window
    return ct, truth, pred


def ring(rows: range, cols: range) -> np.ndarray:
    """The outline of a rectangle on the displayed slice (rows = posterior, columns = patient's left)."""
    mask = np.zeros((SHAPE[1], SHAPE[0]), bool)
    mask[rows.start : rows.stop, cols.start : cols.stop] = True
    mask[rows.start + 1 : rows.stop - 1, cols.start + 1 : cols.stop - 1] = False
    return mask


def first_panel(picture: np.ndarray) -> np.ndarray:
    """The whole-slice panel, found from the picture: below the caption (the first row with CT grey), left of the
    first column that is black all the way down (the gap between the panels), sampled once per voxel."""
    grey = (picture == picture[-1, 0]).all(-1) & (picture[-1, 0] > 0).all()
    top = int(np.argmax(grey.any(1)))
    below = picture[top:]
    gap = int(np.argmax((below == 0).all(-1).all(0)))
    scale = gap // SHAPE[0]
    assert gap == scale * SHAPE[0] and scale >= 1, "the panel is the slice enlarged by a whole factor"
    return below[: SHAPE[1] * scale : scale, :gap:scale]


def colour(panel: np.ndarray, rgb) -> np.ndarray:
    return (panel == np.asarray(rgb, np.uint8)).all(-1)


@pytest.mark.parametrize("name", ["LPS", "RAS", "RAI", "sagittal-PSR"])
def test_truth_green_prediction_red_overlap_yellow_radiological_whatever_the_storage(name):
    ct, truth, pred = scene()
    (ct_s, affine), (truth_s, _), (pred_s, _) = (stored(v, *ORIENTATIONS[name]) for v in (ct, truth, pred))
    picture = render_case(ct_s, truth_s, pred_s, affine, title="LUNG1-001")
    assert picture.dtype == np.uint8 and picture.ndim == 3 and picture.shape[2] == 3

    panel = first_panel(picture)
    truth_ring, pred_ring = ring(range(2, 10), range(2, 10)), ring(range(6, 14), range(2, 10))
    np.testing.assert_array_equal(colour(panel, TRUTH_RGB), truth_ring & ~pred_ring)
    np.testing.assert_array_equal(colour(panel, PRED_RGB), pred_ring & ~truth_ring)
    np.testing.assert_array_equal(colour(panel, BOTH_RGB), truth_ring & pred_ring)
    assert (truth_ring & pred_ring).any()
    # the structure is on the patient's right and anterior: the image's left and top
    columns, rows = np.nonzero(colour(panel, TRUTH_RGB).T)
    assert columns.max() < SHAPE[0] / 2 and rows.max() < SHAPE[1] / 2


def test_without_a_ct_the_contours_are_the_same_on_black():
    ct, truth, pred = scene()
    with_ct = render_case(ct, truth, pred, AFFINE_LPS)
    without = render_case(None, truth, pred, AFFINE_LPS)
    assert without.shape == with_ct.shape
    for rgb in (TRUTH_RGB, PRED_RGB, BOTH_RGB):
        assert colour(with_ct, rgb).any()
        np.testing.assert_array_equal(colour(without, rgb), colour(with_ct, rgb))
    drawn = colour(without, TRUTH_RGB) | colour(without, PRED_RGB) | colour(without, BOTH_RGB)
    top = int(np.argmax((with_ct == with_ct[-1, 0]).all(-1).any(1)))  # below the caption: the first row of CT grey
    assert (with_ct[top:][~drawn[top:]] > 0).any(), "the CT shows where it is given"
    assert (without[top:][~drawn[top:]] == 0).all(), "everything but the contours is black without it"


def test_slice_is_chosen_by_the_prediction_when_there_is_no_truth():
    _, _, pred = scene()
    truth = np.zeros(SHAPE, bool)
    picture = render_case(np.zeros(SHAPE), truth, pred, AFFINE_LPS)
    panel = first_panel(picture)
    np.testing.assert_array_equal(colour(panel, PRED_RGB), ring(range(6, 14), range(2, 10)))
    assert not colour(picture, TRUTH_RGB).any()


def test_png_bytes_is_a_png_of_the_picture():
    _, truth, pred = scene()
    picture = render_case(None, truth, pred, AFFINE_LPS)
    data = png_bytes(picture)
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    np.testing.assert_array_equal(np.asarray(Image.open(io.BytesIO(data)).convert("RGB")), picture)


def validation_output(scene_ras) -> tuple[dict, dict]:
    ct, truth, pred = scene_ras
    _, affine = stored(ct, *ORIENTATIONS["RAS"])
    image = MetaTensor(torch.from_numpy(ct[None] + 0.5), affine=torch.from_numpy(affine))
    one_hot = [torch.from_numpy(np.stack([~m, m]).astype(np.float32)) for m in (truth, pred)]
    return {"case_id": "LUNG1-001"}, {"image": image, "label": one_hot[0], "pred": one_hot[1]}


def ras_scene():
    return tuple(stored(v, *ORIENTATIONS["RAS"])[0] for v in scene())


def tensorboard_images(log_dir) -> dict[str, list]:
    events = EventAccumulator(str(log_dir), size_guidance={IMAGES: 0})
    events.Reload()
    return {tag: events.Images(tag) for tag in events.Tags()[IMAGES]}


def test_validation_picture_reaches_tensorboard(tmp_path):
    scene_ras = ras_scene()
    batch, output = validation_output(scene_ras)
    engine = SimpleNamespace(state=SimpleNamespace(batch=[batch], output=[output], epoch=3))
    ValidationPicture(str(tmp_path), enabled=True)(engine)

    images = tensorboard_images(tmp_path)
    assert list(images) == ["validation/LUNG1-001"]
    (event,) = images["validation/LUNG1-001"]
    assert event.step == 3
    logged = np.asarray(Image.open(io.BytesIO(event.encoded_image_string)).convert("RGB"))
    ct, truth, pred = scene_ras
    expected = render_case(ct + 0.5, truth, pred, stored(ct, *ORIENTATIONS["RAS"])[1], (0.0, 1.0), "validation")
    np.testing.assert_array_equal(logged, expected)


def test_validation_picture_is_drawn_once_per_validation_run(tmp_path):
    batch, output = validation_output(ras_scene())
    evaluator = Engine(lambda engine, b: [output])
    ValidationPicture(str(tmp_path), enabled=True).attach(evaluator)
    evaluator.run([[batch]] * 3, max_epochs=1)
    assert [len(v) for v in tensorboard_images(tmp_path).values()] == [1]


def test_validation_picture_is_written_by_rank_0_only(tmp_path, monkeypatch):
    batch, output = validation_output(ras_scene())
    engine = SimpleNamespace(state=SimpleNamespace(batch=[batch], output=[output], epoch=1))
    monkeypatch.setattr(figures, "is_rank0", lambda: False)
    ValidationPicture(str(tmp_path / "rank1"))(engine)
    ValidationPicture(str(tmp_path / "disabled"), enabled=False)(engine)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(figures, "is_rank0", lambda: True)
    ValidationPicture(str(tmp_path / "rank0"))(engine)
    assert list(tensorboard_images(tmp_path / "rank0")) == ["validation/LUNG1-001"]

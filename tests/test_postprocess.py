"""The fast post-processing against MONAI's own chain (softmax, Invertd, argmax, largest component), voxel for voxel
and in the metadata the writers read, on CTs whose grids defeat a shortcut: oblique, flipped, anisotropic, a
structure at the edge of the network's grid (where the fast path must hand over to MONAI), none at all, three classes
with exact ties, two pieces of tumour. And in mm against the truth it was drawn from: the logits are written from a
ball's centre in world LPS mm, independently of the code under test."""

from __future__ import annotations

from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
from monai.bundle import ConfigParser
from monai.data import MetaTensor
from monai.transforms import Compose, KeepLargestConnectedComponentd
from scripts.inference.inputs import load_case
from scripts.inference.postprocess import BoxedLargestComponentd, InvertedLabelsd, fast_postprocessing

ROOT = Path(__file__).resolve().parents[1]
#: where the tumour and a small second piece are drawn (LPS mm): inside the body, away from the grid's edges
CENTRE, SMALL = (-2.0, 3.0, -12.0), (14.0, -10.0, -27.0)


def inference_config(**overrides) -> ConfigParser:
    """``configs/inference.yaml`` with ``overrides``, at the shipped spacing."""
    parser = ConfigParser()
    parser.read_config(str(ROOT / "configs" / "inference.yaml"))
    parser.update({"bundle_root": str(ROOT), "spacing": [1.0, 1.0, 3.0], **overrides})
    return parser


@pytest.fixture(scope="module")
def chain():
    """train.yaml's preprocessing (on the host, wherever the tests run) and post-processing, as inference builds them
    (MONAI's transforms only)."""
    parser = inference_config(preprocessing_device="cpu")
    return parser.get_parsed_content("preprocessing"), parser.get_parsed_content("inverse_postprocessing")


def oblique_ras(spacing=(0.8, 0.7, 2.5), degrees=12.0, flip=True) -> np.ndarray:
    """A CT's RAS affine: turned about S by ``degrees``, in-plane axes flipped as DICOM's LPS reads, anisotropic."""
    t = np.deg2rad(degrees)
    rotation = np.array([[np.cos(t), -np.sin(t), 0], [np.sin(t), np.cos(t), 0], [0, 0, 1]])
    affine = np.eye(4)
    affine[:3, :3] = rotation @ np.diag([-1.0 if flip else 1.0, -1.0 if flip else 1.0, 1.0]) @ np.diag(spacing)
    affine[:3, 3] = [30.0, 20.0, -40.0]
    return affine


def write_ct(folder: Path, affine: np.ndarray, shape=(72, 64, 22), fill: bool = False) -> Path:
    """Air around an elliptic body of soft tissue (so the preprocessing crops), as a NIfTI file; ``fill``: soft tissue
    everywhere (nothing to crop: the network's grid reaches the CT's edges where it is wider than a window)."""
    i, j = np.meshgrid(np.arange(shape[0]), np.arange(shape[1]), indexing="ij")
    body = ((i - shape[0] / 2) / (shape[0] * 0.38)) ** 2 + ((j - shape[1] / 2) / (shape[1] * 0.4)) ** 2 <= 1
    hu = np.where(body[..., None] | fill, 30.0, -1000.0) * np.ones(shape)
    path = folder / "ct.nii.gz"
    nib.save(nib.Nifti1Image(hu.astype(np.int16), affine), path)
    return path


def world_lps(image: MetaTensor) -> np.ndarray:
    """The LPS mm of each voxel centre of ``image``'s grid, [X, Y, Z, 3] (its affine is RAS)."""
    affine = np.asarray(image.affine, float)
    ijk = np.stack(np.meshgrid(*[np.arange(n) for n in image.shape[1:]], indexing="ij"), -1)
    return (ijk @ affine[:3, :3].T + affine[:3, 3]) * [-1.0, -1.0, 1.0]


def ball_logits(lps: np.ndarray, centre, radius: float) -> np.ndarray:
    """Tumour logits: sure inside a ball, falling off over a few mm at its surface, sure background far away."""
    distance = np.linalg.norm(lps - np.asarray(centre, float), axis=-1)
    return np.clip((radius - distance) * 2.0, -12.0, 12.0)


def both(chain, tmp_path, logits_of, affine=None, **ct) -> tuple[dict, dict, MetaTensor]:
    """The preprocessed CT, logits made from its world coordinates, through MONAI's chain and the fast one."""
    preprocessing, post = chain
    path = write_ct(tmp_path, oblique_ras() if affine is None else affine, **ct)
    image = preprocessing({"image": load_case(path, "nifti")})["image"]
    logits = torch.from_numpy(np.stack(logits_of(world_lps(image))).astype(np.float32))
    pred = MetaTensor(logits, meta=dict(image.meta))
    slow = Compose(post)({"image": image, "pred": pred.clone()})
    fast = Compose(fast_postprocessing(post))({"image": image, "pred": pred.clone()})
    return slow, fast, image


@pytest.fixture
def handed_over(monkeypatch) -> list:
    """Whether each call of the fast path computed the labels (an array) or handed over to MONAI's chain (None)."""
    calls = []
    original = InvertedLabelsd._labels

    def recorded(self, *args):
        labels = original(self, *args)
        calls.append(None if labels is None else "fast")
        return labels

    monkeypatch.setattr(InvertedLabelsd, "_labels", recorded)
    return calls


def assert_same(slow: dict, fast: dict) -> None:
    a, b = slow["pred"], fast["pred"]
    assert isinstance(b, MetaTensor) and b.dtype == a.dtype and b.shape == a.shape
    assert torch.equal(a.as_tensor(), b.as_tensor()), f"{int((a != b).sum())} voxels differ"
    assert torch.allclose(a.affine, b.affine) and set(a.meta) == set(b.meta)
    assert torch.equal(torch.as_tensor(a.meta["original_affine"]), torch.as_tensor(b.meta["original_affine"]))


def test_the_fast_path_is_what_inference_runs(chain):
    steps = fast_postprocessing(chain[1])
    assert [type(s) for s in steps] == [InvertedLabelsd, BoxedLargestComponentd]
    assert isinstance(chain[1][-1], KeepLargestConnectedComponentd), "MONAI's own list (MONAI Deploy's) is untouched"


@pytest.mark.parametrize("degrees", [0.0, 12.0])
def test_a_tumour_inside_gives_monais_label_map_and_lies_where_it_was_drawn_in_mm(
    chain, tmp_path, degrees, handed_over
):
    centre, radius = CENTRE, 9.0
    slow, fast, _ = both(chain, tmp_path, lambda lps: [np.zeros(lps.shape[:3]), ball_logits(lps, centre, radius)],
                         oblique_ras(degrees=degrees))  # fmt: skip
    assert_same(slow, fast)
    assert handed_over == ["fast"]
    labels = fast["pred"]
    assert labels.shape[1:] == (72, 64, 22), "on the CT's own grid"
    found = world_lps(MetaTensor(labels, affine=labels.meta["original_affine"]))[labels[0].numpy() == 1]
    assert len(found) > 100
    assert np.linalg.norm(found.mean(0) - centre) < 1.5, "the tumour's centroid within 1.5 mm of the ball's centre"
    assert np.linalg.norm(found - centre, axis=1).max() < radius + 2.0


def test_a_structure_at_the_edge_of_the_networks_grid_hands_over_to_monai(chain, tmp_path, handed_over):
    def at_the_edge(lps):  # sure tumour along the CT's left edge, which is the network grid's edge too
        tumour = np.where(lps[..., 0] > lps[..., 0].max() - 4.0, 8.0, -8.0)
        return [np.zeros(lps.shape[:3]), tumour]

    slow, fast, _ = both(chain, tmp_path, at_the_edge, oblique_ras(degrees=0.0), shape=(130, 64, 22), fill=True)
    assert handed_over == [None], "MONAI's chain ran"
    assert_same(slow, fast)
    assert int((fast["pred"] == 1).sum()) > 0


def test_no_tumour_anywhere_is_an_empty_map_like_monais(chain, tmp_path, handed_over):
    slow, fast, _ = both(chain, tmp_path, lambda lps: [np.full(lps.shape[:3], 3.0), np.zeros(lps.shape[:3])])
    assert_same(slow, fast)
    assert int(fast["pred"].sum()) == 0 and handed_over == ["fast"]


def test_three_classes_with_exact_ties_take_the_first_like_monai(chain, tmp_path, handed_over):
    def classes(lps):
        one = ball_logits(lps, CENTRE, 8.0)
        two = one.copy()  # the same logits as class 1 in the ball: a tie, which argmax gives to class 1
        two[lps[..., 0] < CENTRE[0]] += 0.5  # but class 2 wins in its right half
        return [np.zeros(lps.shape[:3]), one, two]

    slow, fast, _ = both(chain, tmp_path, classes)
    assert_same(slow, fast)
    assert {1, 2} <= set(torch.unique(fast["pred"]).int().tolist()) and handed_over == ["fast"]


def pieces(lps: np.ndarray) -> list[np.ndarray]:
    """Background and tumour logits: a 9 mm ball at CENTRE and a 4 mm one at SMALL."""
    return [np.zeros(lps.shape[:3]), np.maximum(ball_logits(lps, CENTRE, 9.0), ball_logits(lps, SMALL, 4.0))]


def test_two_pieces_keep_the_larger_like_monai(chain, tmp_path, handed_over):
    slow, fast, _ = both(chain, tmp_path, pieces)
    assert_same(slow, fast)
    labels = fast["pred"][0].numpy()
    found = world_lps(MetaTensor(fast["pred"], affine=fast["pred"].meta["original_affine"]))[labels == 1]
    assert np.linalg.norm(found - SMALL, axis=1).min() > 4.0, "the small piece is gone"
    assert handed_over == ["fast"]


def test_the_boxed_largest_component_equals_monais_on_a_plain_tensor():
    labels = torch.zeros(1, 30, 30, 10)
    labels[0, 2:6, 2:6, 2:4] = 1
    labels[0, 20:28, 20:28, 5:9] = 1
    labels[0, 10:12, 25:27, 0:2] = 2
    step = KeepLargestConnectedComponentd("pred", applied_labels=[1, 2], num_components=1, independent=True)
    expected = step({"pred": labels.clone()})["pred"]
    np.testing.assert_array_equal(BoxedLargestComponentd(step)({"pred": labels.clone()})["pred"], expected)
    empty = torch.zeros(1, 5, 5, 5)
    assert torch.equal(BoxedLargestComponentd(step)({"pred": empty})["pred"], empty)


@pytest.fixture
def resampled(monkeypatch) -> list:
    """The CT voxels each resampling of the fast path produced (its ``spatial_size``: the work it does)."""
    from scripts.inference import postprocess

    sizes = []

    class Counted(postprocess.SpatialResample):  # only the fast path's: MONAI's chain builds its own
        def __call__(self, img, *args, spatial_size=None, **kwargs):
            sizes.append(int(np.prod(spatial_size)))
            return super().__call__(img, *args, spatial_size=spatial_size, **kwargs)

    monkeypatch.setattr(postprocess, "SpatialResample", Counted)
    return sizes


def test_the_work_is_the_tumours_box_and_never_more_than_the_whole_grid(chain, tmp_path, resampled, handed_over):
    """Counted, not timed. A 9 mm ball: the voxels resampled lie in the index box of the CT voxels within the ball's
    radius plus the interpolation's reach (two network voxels and one CT voxel, in mm), computed here from the CT's
    own grid. Candidates at two opposite corners (the shape that defeats a box): at most the CT grid once, where
    MONAI's chain resamples it once per class."""
    radius = 9.0
    slow, fast, _ = both(chain, tmp_path, lambda lps: [np.zeros(lps.shape[:3]), ball_logits(lps, CENTRE, radius)])
    assert_same(slow, fast)
    labels = fast["pred"]
    ct_lps = world_lps(MetaTensor(labels, affine=labels.meta["original_affine"]))
    reach = np.linalg.norm([2 * 1.0, 2 * 1.0, 2 * 3.0]) + np.linalg.norm([0.8, 0.7, 2.5])  # network 1x1x3, CT grid
    near = np.argwhere(np.linalg.norm(ct_lps - CENTRE, axis=-1) <= radius + reach)
    bound = int(np.prod(near.max(0) - near.min(0) + 1))
    grid = int(np.prod(labels.shape[1:]))
    assert len(resampled) == 1 and (labels == 1).sum() <= resampled[0] <= bound < grid / 2, (resampled, bound, grid)

    resampled.clear()

    def corners(lps):  # two small balls near opposite corners of the body, inside the network's grid
        low, high = lps.reshape(-1, 3).min(0), lps.reshape(-1, 3).max(0)
        a, b = low + 0.3 * (high - low), high - 0.3 * (high - low)
        return [np.zeros(lps.shape[:3]), np.maximum(ball_logits(lps, a, 3.0), ball_logits(lps, b, 3.0))]

    slow, fast, _ = both(chain, tmp_path, corners)
    assert_same(slow, fast)
    assert handed_over[-1] == "fast" and len(resampled) == 1 and grid / 4 < resampled[0] <= grid, (resampled, grid)


DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm device")],
    ),
]


@pytest.mark.parametrize("device", DEVICES)
def test_preprocessed_on_the_device_the_image_and_both_label_maps_are_the_hosts(tmp_path, device, handed_over):
    """inference.yaml's preprocessing with the image on ``device`` (preprocessing_device: MONAI's transforms on the
    device's tensors) against the host's chain (channel first, then ct_transforms), on an oblique, flipped,
    anisotropic CT; then MONAI's inversion (MONAI Deploy's) and the fast one (the evaluator's) of the same logits,
    on the device, against the host's.

    On a CPU both are one computation: equal to the bit. On a GPU the resampling is the same float64 interpolation run
    by another kernel, rounded to float32: the image may differ by a float32 step of the HU before the window (6e-5
    HU at 1000 HU, 4e-8 after it), so within 1e-6 (0.0015 HU); a label may differ only where the two classes'
    probabilities on the CT's grid are within 1e-5 of each other (float32 softmax on two kernels)."""
    parser = inference_config(preprocessing_device=device)
    host_chain = Compose([parser.get_parsed_content("channel_first"), *parser.get_parsed_content("ct_transforms")])
    path = write_ct(tmp_path, oblique_ras())
    host = host_chain({"image": load_case(path, "nifti")})["image"]
    image = parser.get_parsed_content("preprocessing")({"image": load_case(path, "nifti")})["image"]
    assert image.device.type == device and image.shape == host.shape
    if device == "cpu":
        assert torch.equal(image.as_tensor(), host.as_tensor())
    torch.testing.assert_close(image.as_tensor().cpu(), host.as_tensor(), atol=1e-6, rtol=0)
    assert torch.equal(image.affine, host.affine) and image.affine.device.type == "cpu"
    assert [op["class"] for op in image.applied_operations] == [op["class"] for op in host.applied_operations]

    values = torch.from_numpy(np.stack(pieces(world_lps(host))).astype(np.float32))
    post = parser.get_parsed_content("inverse_postprocessing")
    probabilities = Compose(post[:2])({"image": host, "pred": MetaTensor(values.clone(), meta=dict(host.meta))})
    margin = (probabilities["pred"][1] - probabilities["pred"][0]).abs()
    for steps in (post, fast_postprocessing(post)):
        expected = Compose(steps)({"image": host, "pred": MetaTensor(values.clone(), meta=dict(host.meta))})["pred"]
        found = Compose(steps)({"image": image, "pred": MetaTensor(values.to(device), meta=dict(image.meta))})["pred"]
        assert found.shape == expected.shape == (1, *load_case(path, "nifti").shape[1:]), "on the CT's own grid"
        differ = found.as_tensor().cpu()[0] != expected.as_tensor()[0]
        assert (margin[differ] < 1e-5).all(), f"{int(differ.sum())} labels differ where the classes are not tied"
        assert int((expected == 1).sum()) > 100 and int(differ.sum()) <= 1e-4 * differ.numel()
        assert torch.equal(
            torch.as_tensor(found.meta["original_affine"]), torch.as_tensor(expected.meta["original_affine"])
        )
        assert torch.allclose(found.affine, expected.affine)
    assert handed_over == ["fast", "fast"], "the fast inversion ran on the host's and the device's tensors alike"

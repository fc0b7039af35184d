"""The thorax region never cuts a tumour (scripts/inference/region.py, through scripts/inference/inferers.py).

Each case is the chest phantom (scripts/data/phantom.py, which shares nothing with the region finder) with its tumour
where a method that looks for lung air is weakest, written as NIfTI and put through inference.yaml's own preprocessing
(RAS, body crop, HU window; at 2 x 2 x 3 mm here, 4x fewer voxels than the shipped 1 x 1 x 3 mm, which
benchmarks/bench_inference.py runs). The network is a stand-in that marks the tumour's HU band, pointwise, so
its full-field label map is the tumour itself: the region's label map must equal it (no voxel lost), the tumour must
lie in the region's box in voxels, and the box in world mm must hold the phantom's tumour as the phantom defines it.
"""

from __future__ import annotations

import nibabel as nib
import numpy as np
import pytest
import torch
from conftest import ROOT
from monai.bundle import ConfigParser
from scripts.data.phantom import PATHOLOGIES, chest
from scripts.inference.inferers import FallbackSlidingWindowInferer
from scripts.inference.inputs import load_case
from scripts.inference.region import Region, _coarse, find_thorax

TUMOUR_HU = 300.0  # nothing else in the phantom lies within 100 HU of it
HU_WINDOW = (-1000.0, 500.0)
SPACING = (2.0, 2.0, 3.0)  # the test's network grid: the region is found in mm, the windows cover 192 mm in plane
ROI = (96, 96, 96)


class TumourBand(torch.nn.Module):
    """Logits of background and tumour: the tumour where the windowed HU lie within 100 HU of TUMOUR_HU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        low, high = ((TUMOUR_HU + d - HU_WINDOW[0]) / (HU_WINDOW[1] - HU_WINDOW[0]) for d in (-100.0, 100.0))
        inside = ((x > low) & (x < high)).float()
        return torch.cat([1.0 - inside, inside], dim=1)


@pytest.fixture(scope="module")
def preprocessing():
    parser = ConfigParser()
    parser.read_config(str(ROOT / "configs" / "inference.yaml"))
    parser["bundle_root"], parser["spacing"] = str(ROOT), list(SPACING)
    return parser.get_parsed_content("preprocessing")


def case(tmp_path, preprocessing, pathology="none", fov_mm=500.0, length_mm=357.0, apex_mm=40.0, arms=True):
    """The phantom as a NIfTI (2 mm pixels, 3 mm slices), preprocessed; its tumour mask preprocessed alike."""
    xs = np.arange(-fov_mm / 2, fov_mm / 2, 2.0) + 1.0
    zs = np.arange(0.0, length_mm, 3.0) - 300.0
    hu, tumour, truth = chest(xs, xs, zs, pathology, apex_mm=apex_mm, arms=arms, tumour_hu=TUMOUR_HU)
    lps = np.array([[2.0, 0, 0, xs[0]], [0, 2.0, 0, xs[0]], [0, 0, 3.0, zs[0]], [0, 0, 0, 1]])
    ras = np.diag([-1.0, -1.0, 1.0, 1.0]) @ lps
    nib.save(nib.Nifti1Image(hu.astype(np.int16), ras), tmp_path / "ct.nii.gz")
    nib.save(nib.Nifti1Image(tumour.astype(np.uint8), ras), tmp_path / "tumour.nii.gz")
    data = {
        "image": load_case(tmp_path / "ct.nii.gz", "nifti"),
        "label": load_case(tmp_path / "tumour.nii.gz", "nifti"),
    }
    out = preprocessing(data)
    return out["image"][None], out["label"][0].numpy() > 0.5, truth


def run(image, region):
    inferer = FallbackSlidingWindowInferer(roi_size=ROI, sw_batch_size=4, overlap=0.25, region=region,
                                           spacing=SPACING, hu_window=HU_WINDOW)  # fmt: skip
    labels = inferer(image, TumourBand()).argmax(dim=1)[0].numpy()
    return labels, inferer.last


def check(image, tumour, truth, expected_method="thorax"):
    """The region's label map equals the full field's, the tumour lies in the box (voxels and world mm)."""
    full, whole = run(image, "body")
    ours, last = run(image, "thorax")
    assert last["method"] == expected_method
    box = tuple(slice(a, b) for a, b in zip(last["start_voxel"], last["stop_voxel"], strict=True))
    assert (ours == full).mean() >= 0.999 and (ours[box] == full[box]).all(), "outside the box only"
    assert (ours[tumour & (full == 1)] == 1).all(), "no tumour voxel is lost"
    assert tumour.sum() > 0 and tumour[box].sum() == tumour.sum()
    low, high = np.array(last["box_lps_mm"])
    centre, radii = np.array(truth["tumour_centre_lps"]), np.array(truth["tumour_radii_mm"])
    assert (low <= centre - radii + 3.0).all() or expected_method != "thorax", (low, centre - radii)
    assert (high >= np.minimum(centre + radii, high) - 3.0).all()
    assert whole["windows"] == whole["windows_whole_input"] and last["windows"] <= whole["windows"]
    return last, whole


@pytest.mark.parametrize("pathology", sorted(PATHOLOGIES))
def test_the_region_holds_the_tumour_wherever_it_lies(tmp_path, preprocessing, pathology):
    image, tumour, truth = case(tmp_path, preprocessing, pathology)
    last, whole = check(image, tumour, truth)
    assert last["windows"] < whole["windows"], "the arms, neck and abdomen are left out"


def test_a_truncated_field_of_view_and_a_partial_scan_keep_the_tumour(tmp_path, preprocessing):
    """A 300 mm field of view (the chest wall and arms cut), and a scan of the lungs' lower half only."""
    image, tumour, truth = case(tmp_path, preprocessing, "chest_wall", fov_mm=300.0)
    check(image, tumour, truth)
    image, tumour, truth = case(tmp_path, preprocessing, "diaphragm", length_mm=180.0, apex_mm=-120.0, arms=False)
    check(image, tumour, truth)


def test_without_lungs_the_whole_body_is_used_and_the_region_says_so(tmp_path, preprocessing):
    """An abdomen below the lungs (the scan starts 280 mm under the apex): no lung air, so no region is guessed."""
    image, _, _ = case(tmp_path, preprocessing, "none", length_mm=120.0, apex_mm=-280.0)
    _, last = run(image, "thorax")
    assert last["method"] == "body (no lung found)" and last["windows"] == last["windows_whole_input"]
    assert last["start_voxel"] == [0, 0, 0] and last["stop_voxel"] == list(image.shape[2:])


def test_the_region_is_never_smaller_than_a_window_and_a_bad_name_is_refused():
    small = torch.zeros(1, 1, 120, 100, 40)
    _, last = run(small, "thorax")
    assert last["method"] == "body (no lung found)"
    with pytest.raises(ValueError, match=r"roi_region='lungs': choose one of \['thorax', 'body'\]"):
        FallbackSlidingWindowInferer(roi_size=ROI, region="lungs")


def test_the_region_as_a_mask_crops_to_exactly_its_box():
    """MONAI Label's pre_transforms crop to the region through a mask (CropForegroundd): the mask's bounding box is the
    box, with or without a channel axis."""
    box = Region((3, 0, 5), (9, 4, 6), "thorax")
    for shape in [(12, 6, 8), (1, 12, 6, 8)]:
        mask = box.mask(shape)
        assert mask.shape == shape and mask.sum() == 6 * 4 * 1
        where = np.argwhere(mask)[:, -3:]
        assert tuple(where.min(0)) == box.start and tuple(where.max(0) + 1) == box.stop


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_coarse_grid_is_the_block_mean_with_edge_blocks_padded_and_the_box_is_the_same_on_any_input(
    preprocessing, tmp_path, device
):
    """The lungs are found on block means of the input: equal, within float32 rounding, to a mean written here over
    explicit blocks (the last block of an axis that does not divide evenly holds copies of the edge voxel), whether the
    volume comes as a NumPy array, a read-only one or a tensor on the device the network runs on; the box is the
    same."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA/ROCm device")
    rng = np.random.default_rng(3)
    volume, factors = rng.random((13, 10, 7), dtype=np.float32), np.array([4, 3, 2])
    expected = np.empty((4, 4, 4), np.float32)
    for i, j, k in np.ndindex(expected.shape):
        cells = [volume[min(i * 4 + a, 12), min(j * 3 + b, 9), min(k * 2 + c, 6)]
                 for a in range(4) for b in range(3) for c in range(2)]  # fmt: skip
        expected[i, j, k] = np.mean(np.array(cells, np.float64))
    np.testing.assert_allclose(_coarse(volume, factors), expected, atol=1e-6)
    np.testing.assert_allclose(_coarse(torch.from_numpy(volume).to(device), factors), expected, atol=1e-6)
    image, _, _ = case(tmp_path, preprocessing)
    volume = image[0, 0].numpy()
    read_only = volume.copy()
    read_only.setflags(write=False)
    found = [find_thorax(v, SPACING, HU_WINDOW, ROI) for v in (volume, read_only, image[0, 0].to(device))]
    assert found[0].method == "thorax" and found[1] == found[0] and found[2] == found[0]

"""int8's calibration windows (scripts/inference/calibration.py): the very windows inference's sliding window runs over
each calibration CT, spread over its region and over the source's cases; a key that changes with the cases, their number
and the settings; a training run's datalist gives its training cases only; the chest phantom through the config's own
preprocessing when no source is given; a clear error for a source that holds no CT."""

from __future__ import annotations

import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
from conftest import ROOT
from monai.transforms import Orientationd, ScaleIntensityRanged
from scripts.data.phantom import chest
from scripts.inference.calibration import Calibration, CalibrationError
from scripts.inference.inferers import FallbackSlidingWindowInferer

WINDOW = (32, 32, 16)
PREPROCESSING = [Orientationd(keys="image", axcodes="RAS"),
                 ScaleIntensityRanged(keys="image", a_min=-1000, a_max=500, b_min=0, b_max=1, clip=True)]  # fmt: skip


def small_chest(path: Path, seed: int, slices: int = 24) -> Path:
    """A 4 mm chest phantom written as NIfTI (LPS centres to a RAS affine, independently of the module under test)."""
    xs, ys, zs = (np.arange(128) - 63.5) * 4.0, (np.arange(96) - 47.5) * 4.0, np.arange(slices) * 6.0
    hu, _, _ = chest(xs, ys, zs, seed=seed)
    affine = np.diag([-4.0, -4.0, 6.0, 1.0])
    affine[:3, 3] = [-xs[0], -ys[0], zs[0]]
    nib.save(nib.Nifti1Image(hu.astype(np.int16), affine), path)
    return path


@pytest.fixture(scope="module")
def ct_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("calibration_cts")
    for i, slices in enumerate((24, 30, 36)):
        small_chest(folder / f"case{i}.nii.gz", seed=i, slices=slices)
    return folder


def inferer() -> FallbackSlidingWindowInferer:
    return FallbackSlidingWindowInferer(WINDOW, 4, 0.25, region="body", spacing=(4.0, 4.0, 6.0))


def every_window(path: Path, window=None) -> torch.Tensor:
    """The windows the sliding window (``window``: of another size) gives a network for this CT, recorded here by a
    network of our own."""
    from scripts.inference.inputs import load_case

    seen = []

    def network(x):
        seen.append(x.clone())
        return torch.zeros((x.shape[0], 2, *x.shape[2:]))

    image = PREPROCESSING[1](PREPROCESSING[0]({"image": load_case(path, "nifti")}))["image"]
    sliding = inferer() if window is None else FallbackSlidingWindowInferer(window, 4, 0.25)
    sliding(torch.as_tensor(image)[None], network)
    return torch.cat(seen)


def test_the_windows_are_those_inference_runs_spread_over_the_region_and_the_cases(ct_folder):
    calibration = Calibration(ct_folder, 6, PREPROCESSING, inferer())
    assert [case["case_id"] for case in calibration.cases()] == ["case0", "case2", "case1"], "2 CTs of 3 planned"
    windows = calibration.windows()
    assert len(windows) == 6 and all(w.shape == (1, 1, *WINDOW) and w.dtype == np.float32 for w in windows)
    for case, chosen in (("case0", windows[:3]), ("case2", windows[3:])):
        run = every_window(ct_folder / f"{case}.nii.gz")
        found = [next(i for i in range(run.shape[0]) if torch.equal(run[i : i + 1], torch.from_numpy(w)))
                 for w in chosen]  # fmt: skip
        assert found[0] == 0 and found[2] == run.shape[0] - 1 > 3, f"{case}: the first and the last of {run.shape[0]}"
        assert abs(found[1] - (run.shape[0] - 1) / 2) <= 0.5, f"{case}: and the middle one"
    assert Calibration(ct_folder, 6, PREPROCESSING, inferer()).windows()[4].tobytes() == windows[4].tobytes()


def test_the_key_changes_with_the_cases_their_number_and_the_settings(ct_folder, tmp_path):
    def key(folder=ct_folder, count=6, spacing=(4.0, 4.0, 6.0)):
        region = FallbackSlidingWindowInferer(WINDOW, 4, 0.25, region="body", spacing=spacing)
        return Calibration(folder, count, PREPROCESSING, region).key

    assert key() == key()
    assert key(count=5) != key() and key(spacing=(3.0, 3.0, 6.0)) != key()
    copy = tmp_path / "copy"
    copy.mkdir()
    for path in ct_folder.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    assert key(copy) == key(), "the same cases elsewhere: the same windows"
    small_chest(copy / "case2.nii.gz", seed=9, slices=40)
    assert key(copy) != key(), "a case changed"


def test_cases_with_few_windows_leave_the_rest_to_the_next_cases(ct_folder):
    """Small CTs (the demo's) hold fewer windows than their share: the windows asked for still come, from more CTs."""
    big = (48, 48, 16)
    calibration = Calibration(ct_folder, 8, PREPROCESSING, FallbackSlidingWindowInferer(big, 4, 0.25))
    windows = calibration.windows()
    assert len(windows) == 8 and len({w.tobytes() for w in windows}) == 8


def test_a_datalist_gives_its_training_cases_only(ct_folder, tmp_path):
    datalist = tmp_path / "datalist.json"
    datalist.write_text(json.dumps({
        "training": [{"image": str(ct_folder / "case1.nii.gz"), "case_id": "train-1"}],
        "validation": [{"image": str(ct_folder / "case0.nii.gz"), "case_id": "val-0"}],
        "test": [{"image": str(ct_folder / "case2.nii.gz"), "case_id": "test-2"}]}))  # fmt: skip
    calibration = Calibration(datalist, 8, PREPROCESSING, inferer())
    assert [case["case_id"] for case in calibration.cases()] == ["train-1"]
    assert len(calibration.windows()) == 8, "one case gives every window asked for (it has more)"


def test_a_source_without_a_ct_is_refused_naming_it(tmp_path):
    for source, message in ((tmp_path / "missing", "no such file or folder"),
                            (tmp_path, "no CT|nothing|no case|no usable"),  # an empty folder
                            (tmp_path / "list.json", "not a datalist with a 'training' list")):  # fmt: skip
        if source.suffix == ".json":
            source.write_text("[]")
        with pytest.raises(CalibrationError, match=message) as caught:
            Calibration(source, 4, PREPROCESSING, inferer()).windows()
        assert "--int8_calibration" in str(caught.value)
    with pytest.raises(CalibrationError, match="at least one window"):
        Calibration(None, 0, PREPROCESSING, inferer())


def test_without_a_source_the_chest_phantom_goes_through_the_configs_own_preprocessing():
    """MONAI Label's inferer passes the config file: its ct_transforms (1 x 1 x 3 mm, HU window) and the thorax's
    96^3 windows over a 512 x 512 chest; the windows hold lung air and soft tissue."""
    region = FallbackSlidingWindowInferer((96, 96, 96), 4, 0.25, region="thorax", spacing=(1.0, 1.0, 3.0))
    calibration = Calibration(None, 2, ROOT / "configs" / "inference.yaml", region)
    assert calibration.cases()[0]["case_id"] == "phantom-none"
    windows = calibration.windows()
    assert len(windows) == 2 and windows[0].shape == (1, 1, 96, 96, 96)
    both = np.concatenate(windows)
    assert both.min() >= 0.0 and both.max() <= 1.0
    assert (both < 0.15).mean() > 0.05 and ((both > 0.6) & (both < 0.75)).mean() > 0.05, "lung and soft tissue"


def test_the_checks_windows_are_held_out_from_calibration_and_a_datalist_adds_its_validation_cases(ct_folder, tmp_path):
    """int8 is checked against f32 on windows calibration never saw: those its cases left, then a datalist's validation
    cases (held out from training too), and never the test split."""
    folder = Calibration(ct_folder, 4, PREPROCESSING, inferer(), check_count=4)
    calibrated = {w.tobytes() for w in folder.windows()}
    held = folder.check_windows()
    assert len(held) == 4 and not calibrated & {w.tobytes() for w in held}
    everything = {w[None].numpy().tobytes() for p in sorted(ct_folder.glob("*.nii.gz")) for w in every_window(p)}
    assert {w.tobytes() for w in held} <= everything, "each held-out window is one inference runs"
    datalist = tmp_path / "datalist.json"
    datalist.write_text(json.dumps({
        "training": [{"image": str(ct_folder / "case1.nii.gz"), "case_id": "train-1"}],
        "validation": [{"image": str(ct_folder / "case0.nii.gz"), "case_id": "val-0"}],
        "test": [{"image": str(ct_folder / "case2.nii.gz"), "case_id": "test-2"}]}))  # fmt: skip
    big = (48, 48, 16)  # 36 windows in train-1: calibration asks more, so it takes every one of them
    listed = Calibration(datalist, 64, PREPROCESSING, FallbackSlidingWindowInferer(big, 4, 0.25), check_count=8)
    train = {w[None].numpy().tobytes() for w in every_window(ct_folder / "case1.nii.gz", big)}
    val = {w[None].numpy().tobytes() for w in every_window(ct_folder / "case0.nii.gz", big)}
    assert {w.tobytes() for w in listed.windows()} == train
    assert len(val) > 8 and {w.tobytes() for w in listed.check_windows()} < val, "validation's windows, not test's"


def test_a_calibration_set_beside_the_weights_travels_with_them_and_gives_the_same_windows(ct_folder, tmp_path):
    """Training writes its windows beside its weights; int8_calibration naming nothing then takes that set, whose
    windows are the CTs' to float16's rounding, with its held-out windows for the check; a set of another window
    size is refused naming it; no weights written (no validation ran), no set."""
    from types import SimpleNamespace

    from scripts.inference.calibration import SET_SUFFIX, source_for, write_set

    weights = tmp_path / "model.pt"
    assert source_for(None, weights) is None and source_for("null", weights) is None
    assert source_for("/gone/datalist.json", weights) == "/gone/datalist.json", "refused when int8 is made"
    made = Calibration(ct_folder, 6, PREPROCESSING, inferer(), check_count=3)
    assert write_set(made, weights, SimpleNamespace(best_metric_epoch=-1)) is None
    written = write_set(made, weights, SimpleNamespace(best_metric_epoch=2))
    assert written == tmp_path / f"model.pt{SET_SUFFIX}" and source_for(None, weights) == str(written)
    assert source_for(ct_folder, weights) == str(ct_folder), "a source named wins"
    assert source_for(tmp_path / "moved" / "datalist.json", weights) == str(written), "one that is gone does not"
    kept = Calibration(source_for(None, weights), 6, PREPROCESSING, inferer(), check_count=3)
    assert kept.is_set and kept.key != made.key
    for ours, theirs in ((kept.windows(), made.windows()), (kept.check_windows(), made.check_windows())):
        assert len(ours) == len(theirs) and all(a.dtype == np.float32 for a in ours)
        np.testing.assert_allclose(np.concatenate(ours), np.concatenate(theirs), atol=1e-3)
    other = Calibration(written, 6, PREPROCESSING, FallbackSlidingWindowInferer((16, 16, 8), 4, 0.25))
    with pytest.raises(
        CalibrationError, match=r"model.pt.calibration.npz: its windows are \[32, 32, 16\], the sliding"
    ):
        other.windows()

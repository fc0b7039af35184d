"""Ensembles and mirror TTA: the softmax of the wrapper is the mean of the models' (and flipped-back copies')
probabilities, one model stays the model itself, a model's output is gone before the next runs, all models run in one
pass over the sliding windows, and weight files are found in cross-validation folders."""

from __future__ import annotations

import gc
import json
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from conftest import save_weights as save
from scripts.inference.ensemble import EnsembleNetwork, Models, ensemble, find_models, mirror_flips
from scripts.inference.inferers import FallbackSlidingWindowInferer

ALL_FLIPS = [(), (2,), (3,), (4,), (2, 3), (2, 4), (3, 4), (2, 3, 4)]


def tiny_net(seed: int) -> torch.nn.Module:
    """Two classes from one channel; random asymmetric 3x3x3 kernels, so not equivariant under flips."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv3d(1, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv3d(4, 2, 3, padding=1)
    ).eval()


def image(shape=(1, 1, 12, 10, 8)) -> torch.Tensor:
    return torch.rand(shape, generator=torch.Generator().manual_seed(7))


@torch.no_grad()
def test_the_ensemble_softmax_is_the_mean_of_the_models_probabilities():
    nets, x = [tiny_net(0), tiny_net(1), tiny_net(2)], image()
    expected = torch.stack([torch.softmax(n(x), 1) for n in nets]).mean(0)
    torch.testing.assert_close(torch.softmax(EnsembleNetwork(nets)(x), 1), expected, atol=1e-6, rtol=0)


@torch.no_grad()
def test_tta_changes_a_network_that_is_not_flip_equivariant_and_equals_the_hand_made_average():
    net, x = tiny_net(3), image()
    plain = torch.softmax(net(x), 1)
    tta = torch.softmax(EnsembleNetwork([net], mirror_flips([0, 1, 2]))(x), 1)
    assert (tta - plain).abs().max() > 1e-3, "mirroring must change this network's prediction"
    by_hand = torch.stack([torch.softmax(net(x.flip(d)), 1).flip(d) if d else plain for d in ALL_FLIPS]).mean(0)
    torch.testing.assert_close(tta, by_hand, atol=1e-6, rtol=0)


def test_mirror_flips_are_every_combination_of_the_axes_and_wrong_axes_are_refused():
    assert mirror_flips([0, 1, 2]) == ALL_FLIPS
    assert mirror_flips([0, 1]) == [(), (2,), (3,), (2, 3)]
    assert mirror_flips(None) == [()]
    with pytest.raises(ValueError, match="tta_axes"):
        mirror_flips([3])


class Recorder(torch.nn.Module):
    """A model that counts, when it runs, the two-channel tensors of its output's shape still alive: at most the
    running sum (no earlier model's logits or probabilities are kept)."""

    alive: ClassVar[list[int]] = []

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.net = tiny_net(seed)

    def forward(self, x):
        shape = (x.shape[0], 2, *x.shape[2:])
        Recorder.alive.append(sum(isinstance(o, torch.Tensor) and tuple(o.shape) == shape for o in gc.get_objects()))
        return self.net(x)


@torch.no_grad()
def test_only_the_running_sum_is_held_while_the_next_model_runs():
    Recorder.alive = []
    EnsembleNetwork([Recorder(0), Recorder(1)], mirror_flips([2]))(image())
    assert Recorder.alive == [0, 1, 1, 1], "two models x two mirror passes: after the first, only the sum is held"


class Counting(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        self.net, self.calls = tiny_net(seed), 0

    def forward(self, x):
        self.calls += x.shape[0]
        return self.net(x)


@torch.no_grad()
def test_all_models_run_in_one_pass_over_the_windows():
    inferer = FallbackSlidingWindowInferer(roi_size=(8, 8, 8), sw_batch_size=2, overlap=0.0)
    models, x = [Counting(0), Counting(1)], image((1, 1, 16, 16, 8))  # 4 windows, no overlap
    out = torch.softmax(inferer(x, EnsembleNetwork(models)), 1)
    assert [m.calls for m in models] == [4, 4]
    separately = torch.stack([torch.softmax(inferer(x, m.net), 1) for m in models]).mean(0)
    torch.testing.assert_close(out, separately, atol=1e-6, rtol=0)


@torch.no_grad()
def test_a_wrapper_of_one_model_gives_that_model_through_overlapping_windows():
    """Overlapping windows are blended in the log domain, as a single model's logits are: nothing changes."""
    inferer = FallbackSlidingWindowInferer(roi_size=(8, 8, 8), sw_batch_size=2, overlap=0.5, mode="gaussian")
    net, x = tiny_net(4), image((1, 1, 20, 14, 11))
    torch.testing.assert_close(
        torch.softmax(inferer(x, EnsembleNetwork([net])), 1), torch.softmax(inferer(x, net), 1), atol=1e-5, rtol=0
    )


def test_one_model_without_tta_is_the_loaded_network_itself(tmp_path):
    save(tiny_net(1), tmp_path / "model.pt")
    network = tiny_net(0)
    assert ensemble(network, find_models(tmp_path / "model.pt"), ["GTV-1"]) is network
    torch.testing.assert_close(network[0].weight, tiny_net(1)[0].weight)


@torch.no_grad()
def test_an_ensemble_loads_each_weight_file_into_its_own_copy(tmp_path):
    for k in (0, 1):
        save(tiny_net(10 + k), tmp_path / "cv" / f"fold_{k}" / "model.pt")
    wrapper = ensemble(tiny_net(0), find_models("unused.pt", str(tmp_path / "cv")), ["GTV-1"])
    x = image()
    expected = (torch.softmax(tiny_net(10)(x), 1) + torch.softmax(tiny_net(11)(x), 1)) / 2
    torch.testing.assert_close(torch.softmax(wrapper(x), 1), expected, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match=r"trained for labels \['GTV-1'\]"):
        ensemble(tiny_net(0), find_models("unused.pt", [tmp_path / "cv"]), ["Heart"])


def test_folds_are_found_in_fold_order_with_the_chosen_postprocessing(tmp_path):
    for k in (10, 2, 0):
        save(tiny_net(k), tmp_path / f"fold_{k}" / "model.pt")
    (tmp_path / "fold_x").mkdir()
    assert [p.parent.name for p in find_models("m.pt", tmp_path).paths] == ["fold_0", "fold_2", "fold_10"]
    assert find_models("m.pt", tmp_path).components_kept() == 1, "no decision recorded: the default"
    (tmp_path / "model.json").write_text(json.dumps({"labels": ["GTV-1"], "keep_largest_components": 0,
                                                     "models": [{"path": "fold_2/model.pt"}]}))  # fmt: skip
    models = find_models("m.pt", [str(tmp_path), tmp_path / "fold_0" / "model.pt"], ["GTV-1"])
    assert models.paths == (tmp_path / "fold_2" / "model.pt", tmp_path / "fold_0" / "model.pt")
    assert models.components_kept() == 0 and models.components_kept(explicit=2) == 2, "the config's value wins"
    with pytest.raises(ValueError, match="labels"):
        find_models("m.pt", tmp_path, ["Heart"])
    with pytest.raises(ValueError, match=r"no fold_<k>/model\.pt"):
        find_models("m.pt", tmp_path / "fold_x")
    assert find_models("m.pt", None).paths == (Path("m.pt"),)


def test_the_chosen_components_change_only_the_evaluators_copy_of_the_last_step():
    from monai.transforms import AsDiscreted, KeepLargestConnectedComponentd

    largest = KeepLargestConnectedComponentd(keys="pred", applied_labels=[1], num_components=1, independent=True)
    base = [AsDiscreted(keys="pred", argmax=True), largest]
    logits = torch.zeros(2, 8, 8, 8)
    logits[1, 1:3, 1:3, 1:3] = logits[1, 5:8, 5:8, 5:8] = 1.0  # two tumour pieces: 8 and 27 voxels
    tumour = {"raw": 35, "largest": 27, "two largest": 35}

    def voxels(transforms) -> int:
        data = {"pred": logits.clone()}
        for t in transforms:
            data = t(data)
        return int((data["pred"] == 1).sum())

    assert voxels(base) == tumour["largest"]
    raw = Models((Path("a.pt"),), keep_largest_components=0)
    assert voxels(raw.postprocessing(base)) == tumour["raw"], "the ensemble chose the raw argmax"
    assert voxels(Models((Path("a.pt"),), 2).postprocessing(base)) == tumour["two largest"]
    chosen = raw.postprocessing(base, explicit=1)  # a value given in the config wins (base was built with it)
    assert voxels(chosen) == tumour["largest"] and chosen[-1].converter is base[-1].converter
    assert voxels(base) == tumour["largest"] and base[-1].converter.num_components == 1, "MONAI Deploy's list untouched"
    with pytest.raises(TypeError, match="largest-component"):
        raw.postprocessing(base[:1])


def test_the_record_names_each_file_with_its_hash_and_no_dicom_separators(tmp_path):
    save(tiny_net(0), tmp_path / "a,b=c" / "model.pt")
    record = Models((tmp_path / "a,b=c" / "model.pt",)).record([0, 1, 2], 1)
    assert record["num_models"] == "1" and record["tta"] == "mirror axes 0+1+2 (8 passes)"
    assert "sha256 " in record["models"] and record["keep_largest_components"] == "1"
    assert not any("," in v or "=" in v for v in record.values())

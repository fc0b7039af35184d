"""scripts.data.dataset: each cache mode and loader builds what it promises, and the compact training cache keeps less
while the crops drawn from it are exactly MONAI's crops."""

from __future__ import annotations

import copy
import itertools
import json

import numpy as np
import pytest
import torch
from monai.bundle import ConfigParser
from monai.data import CacheDataset, DataLoader, Dataset, MetaTensor, PersistentDataset
from monai.transforms import Compose, RandCropByPosNegLabeld
from scripts.common.config import ConfigError
from scripts.data.dataset import (
    CACHED_INDEX_BYTES,
    STEP_BASE_GIB,
    STEP_GIB_PER_PATCH,
    CompactForCropd,
    Passes,
    ThreadDataLoader,
    cached_bytes,
    choose_cache,
    loader_workers,
    make_dataset,
    make_loader,
)
from scripts.data.prepare import prepare

ROI = [32, 32, 16]


@pytest.fixture(scope="module")
def train_config(small_cases, tmp_path_factory, root) -> ConfigParser:
    """train.yaml on the small synthetic cases, prepared once, with a patch size that fits them."""
    dicom_dir, _ = small_cases
    prepared = tmp_path_factory.mktemp("prepared_for_cache")
    prepare(dicom_dir, prepared, progress=False, num_workers=1)
    parser = ConfigParser()
    parser.read_config(str(root / "configs" / "train.yaml"))
    settings = {"bundle_root": str(root), "dataset_dir": str(dicom_dir), "prepared_dir": str(prepared),
                "roi_size": ROI, "num_samples": 8, "cache": "memory"}  # fmt: skip
    parser.update(settings)
    return parser


def first_case(parser: ConfigParser) -> dict:
    """One training case after the deterministic transforms (what would be cached without the compact step)."""
    case = parser.get_parsed_content("train#data")[0]
    return Compose(parser.get_parsed_content("train#deterministic_transforms"))(case)


def test_cached_case_is_compact_and_keeps_every_tumour_voxel(train_config):
    full = first_case(train_config)
    compact = Compose(train_config.get_parsed_content("train#compact_transforms"))(copy.deepcopy(full))

    assert compact["image"].dtype == torch.float16 and compact["label"].dtype == torch.uint8
    assert float((compact["image"].float() - full["image"]).abs().max()) < 1e-3  # < 1.5 HU of the [-1000, 500] window
    assert torch.equal(compact["label"].long(), full["label"].long())
    assert compact["image"].affine.tolist() == full["image"].affine.tolist(), "geometry travels with the cached image"

    label = full["label"][0].numpy()
    np.testing.assert_array_equal(compact["fg_indices"], np.flatnonzero(label > 0))
    body_background = np.flatnonzero((label == 0) & (full["image"][0].numpy() > 0))
    assert len(compact["bg_indices"]) == len(body_background) > 0
    assert compact["fg_indices"].dtype == np.int32 and compact["bg_indices"].dtype == np.int32

    voxels = full["image"].numel()
    volumes = sum(compact[k].numel() * compact[k].element_size() for k in ("image", "label"))
    assert volumes == 3 * voxels, "2 bytes of image + 1 of label per voxel, instead of 4 + 4 as float32"
    indices = compact["fg_indices"].nbytes + compact["bg_indices"].nbytes
    assert indices <= 4 * 2 * 100_000, "at most max_indices of each kind, 4 bytes each, whatever the volume size"


def test_large_index_sets_are_a_fixed_random_subset(train_config):
    full = first_case(train_config)
    subset = CompactForCropd(max_indices=500)
    a, b = subset(copy.deepcopy(full)), subset(copy.deepcopy(full))
    body_background = np.flatnonzero((full["label"][0].numpy() == 0) & (full["image"][0].numpy() > 0))
    assert len(a["bg_indices"]) == 500 and np.isin(a["bg_indices"], body_background).all()
    assert len(np.unique(a["bg_indices"])) == 500, "drawn without replacement"
    np.testing.assert_array_equal(a["bg_indices"], b["bg_indices"])  # same cache content in every run
    spread = np.unravel_index(a["bg_indices"], full["label"].shape[1:])[2]
    assert spread.min() < full["label"].shape[3] * 0.25 and spread.max() > full["label"].shape[3] * 0.75


def test_crops_from_the_cache_equal_monai_searching_the_volume(train_config):
    """Same random state, same patches: the precomputed indices change the speed, not the sampling."""
    full = first_case(train_config)
    cached = Compose(train_config.get_parsed_content("train#compact_transforms"))(copy.deepcopy(full))
    ours = train_config.get_parsed_content("train#random_transforms")[0]
    assert isinstance(ours, RandCropByPosNegLabeld)
    monai_search = RandCropByPosNegLabeld(
        keys=["image", "label"], label_key="label", spatial_size=ROI, pos=1, neg=1, num_samples=8,
        image_key="image", image_threshold=0,
    )  # fmt: skip
    ours.set_random_state(seed=7)
    monai_search.set_random_state(seed=7)
    patches, expected = ours(cached), monai_search(copy.deepcopy(full))
    assert len(patches) == len(expected) == 8
    for patch, reference in zip(patches, expected, strict=True):
        assert "fg_indices" not in patch and "bg_indices" not in patch, "the indices must not reach collate"
        assert torch.equal(patch["label"].long(), reference["label"].long())
        assert float((patch["image"].float() - reference["image"]).abs().max()) < 1e-3
    assert sum(bool(p["label"].any()) for p in patches) >= 3, "pos_fraction 0.5 should give tumour patches"


def test_training_patches_are_float32_of_the_patch_size(train_config):
    case = train_config.get_parsed_content("train#data")[0]
    patches = train_config.get_parsed_content("train#preprocessing")(case)
    for patch in patches:
        assert patch["image"].dtype == torch.float32 and patch["label"].dtype == torch.float32
        assert list(patch["image"].shape) == [1, *ROI] and list(patch["label"].shape) == [1, *ROI]
    datalist = json.loads(json.dumps(train_config.get_parsed_content("validate#data")))
    validation = train_config.get_parsed_content("validate#preprocessing")(datalist[0])
    assert validation["image"].dtype == torch.float32, "validation and inference keep the full-precision volume"
    assert "fg_indices" not in validation


def test_drawing_patches_leaves_the_cached_cases_untouched(train_config):
    """train.yaml caches without MONAI's per-draw deep copy: no random transform may write into a cached case."""
    dataset = train_config.get_parsed_content("train#dataset")
    assert dataset.copy_cache is False
    before = [{k: copy.deepcopy(c[k]) for k in ("image", "label", "fg_indices", "bg_indices")} for c in dataset._cache]
    operations = [len(c["image"].applied_operations) for c in dataset._cache]
    for _ in range(3):
        for index in range(len(dataset)):
            for patch in dataset[index]:
                patch["image"] += 1.0  # what an in-place augmentation would do
    for cached, saved, count in zip(dataset._cache, before, operations, strict=True):
        assert torch.equal(cached["image"], saved["image"]) and torch.equal(cached["label"], saved["label"])
        np.testing.assert_array_equal(cached["fg_indices"], saved["fg_indices"])
        np.testing.assert_array_equal(cached["bg_indices"], saved["bg_indices"])
        assert len(cached["image"].applied_operations) == count, "no transform history piles up on the cache"


DATA = [{"x": i} for i in range(4)]


def test_a_fold_trains_on_the_other_folds_validates_on_its_own_and_a_fold_with_no_case_fails_at_start(train_config):
    """train.yaml's `fold`: fold k's cases validate and the other training cases train, every case once; a fold no
    case is in (the demo prepares 0 to 4; --fold 7) is a ConfigError naming the folds, not a run that trains on
    everything, validates nothing and writes no weights."""
    from scripts.common.config import ConfigError

    cases = train_config.get_parsed_content("train#datalist")
    folds = sorted({d["fold"] for d in cases})
    train_config["fold"] = folds[0]
    train = train_config.get_parsed_content("train#data", lazy=False)
    held = train_config.get_parsed_content("validate#data", lazy=False)
    assert held and all(d["fold"] == folds[0] for d in held) and all(d["fold"] != folds[0] for d in train)
    assert sorted(d["case_id"] for d in train + held) == sorted(d["case_id"] for d in cases)
    train_config["fold"] = 7
    with pytest.raises(RuntimeError) as err:  # MONAI's config wraps what an expression raises
        train_config.get_parsed_content("train#data", lazy=False)
    assert isinstance(err.value.__cause__, ConfigError)
    assert (
        str(err.value.__cause__)
        == f"fold=7: no training case is in fold 7; the prepared data has folds 0 to {folds[-1]}."
    )
    train_config["fold"] = None
    assert len(train_config.get_parsed_content("train#data", lazy=False)) == len(cases)


@pytest.mark.parametrize(("cache", "kind"), [("none", Dataset), ("memory", CacheDataset), ("disk", PersistentDataset)])
def test_cache_modes_build_their_dataset(cache, kind, tmp_path):
    dataset = make_dataset(cache, DATA, transform=None, cache_dir=tmp_path / "cache")
    assert type(dataset) is kind
    assert [dataset[i]["x"] for i in range(4)] == [0, 1, 2, 3]


def test_unknown_cache_mode_and_disk_without_folder_are_config_errors():
    with pytest.raises(ConfigError, match=r"'ram' is not one of \['none', 'memory', 'disk', 'gpu'\]"):
        make_dataset("ram", DATA, transform=None)
    with pytest.raises(ConfigError, match="cache_dir"):
        make_dataset("disk", DATA, transform=None, cache_dir=None)


def test_loaders():
    dataset = Dataset(DATA)
    gpu = make_loader(dataset, cache="gpu", num_workers=4)
    assert type(gpu) is ThreadDataLoader and gpu.num_workers == 0, "CUDA tensors never go to worker processes"
    assert type(make_loader(dataset, thread_loader="true")) is ThreadDataLoader  # as --thread_loader true arrives
    workers = make_loader(dataset, num_workers=2, persistent_workers="true")
    assert type(workers) is DataLoader and workers.persistent_workers
    assert not make_loader(dataset, num_workers=0).persistent_workers


def test_an_epoch_over_few_cases_runs_as_long_as_asked_one_loader_start_in_it():
    """epoch_batches (benchmark.yaml: all its steps) over 4 cases: one epoch of 10 batches, the cases taken pass after
    pass, each pass a permutation; the loader's thread starts once for it (three times without it: an epoch per pass,
    each waiting for a first batch made from nothing)."""
    import threading

    torch.manual_seed(0)
    starts = []
    real_start = threading.Thread.start

    def counted(thread):
        starts.append(thread)
        real_start(thread)

    for settings in ({"cache": "gpu"}, {"num_workers": 0}):
        loader = make_loader(Dataset(DATA), batch_size=1, shuffle=True, epoch_batches=10, **settings)
        assert len(loader) == 10 and isinstance(loader.sampler, Passes)
        threading.Thread.start = counted
        try:
            drawn = [b["x"].item() for b in loader]
        finally:
            threading.Thread.start = real_start
        assert len(drawn) == 10 and all(sorted(drawn[i : i + 4]) == [0, 1, 2, 3] for i in (0, 4)), drawn
    assert len(starts) == 1, "the gpu cache's thread loader: one thread for the whole epoch"
    threading.Thread.start = counted
    try:
        loader, steps = make_loader(Dataset(DATA), cache="gpu", shuffle=True), 0
        while steps < 10:  # the trainer's epochs: the loader iterated again after each pass
            steps += sum(1 for _ in itertools.islice(loader, 10 - steps))
    finally:
        threading.Thread.start = real_start
    assert len(starts) == 1 + 3, "without it: a thread for each of the three epochs"
    plain = make_loader(Dataset(DATA), batch_size=2, shuffle=True, epoch_batches=2)
    assert len(plain) == 2 and not isinstance(plain.sampler, Passes), "a pass already as long: unchanged"
    assert len(make_loader(Dataset(DATA), batch_size=3, epoch_batches=5)) == 5
    assert [b["x"].tolist() for b in make_loader(Dataset(DATA), batch_size=3, epoch_batches=3)] == [
        [0, 1, 2], [3, 0, 1], [2, 3, 0]]  # fmt: skip


def test_passes_over_a_distributed_sampler_give_each_rank_its_shard_in_a_new_order_each_pass():
    """Under DDP the base is the DistributedSampler: each pass calls set_epoch with its number, so every pass of a rank
    holds its shard, in an order all ranks agree on, and the passes differ."""
    from torch.utils.data.distributed import DistributedSampler

    ranks = []
    for rank in range(2):
        base = DistributedSampler(list(range(6)), num_replicas=2, rank=rank, shuffle=True, seed=3)
        ranks.append(list(Passes(base, 9)))
    for drawn in ranks:
        assert len(drawn) == 9 and sorted(drawn[:3]) == sorted(drawn[3:6]) and drawn[:3] != drawn[3:6]
    assert sorted(ranks[0][:3] + ranks[1][:3]) == list(range(6)), "the two ranks' shards of a pass cover the cases"
    with pytest.raises(ValueError, match="no case"):
        list(Passes(DistributedSampler([], num_replicas=1, rank=0), 3))
    shard = DistributedSampler(list(range(6)), num_replicas=2, rank=0)  # 3 a rank: shorter than 4 batches, 6 cases not
    loader = make_loader(Dataset(list(range(6))), shuffle=True, sampler=shard, epoch_batches=4)
    assert isinstance(loader.sampler, Passes) and len(loader) == 4


def _fails_on(bad: int):
    def transform(item: dict) -> dict:
        if item["x"] == bad:
            raise ValueError(f"case {bad} is broken")
        return item

    return transform


@pytest.mark.parametrize("settings", [{"cache": "gpu"}, {"thread_loader": "true", "num_workers": 1}])
def test_a_transform_error_in_the_loaders_thread_ends_the_epoch_with_that_error(settings):
    """MONAI's ThreadDataLoader ended the epoch silently when its thread died (the H200 run: a training of empty
    epochs); ours raises the error where the batches are read, after the batches before it, like a DataLoader."""
    loader = make_loader(Dataset(DATA, transform=_fails_on(2)), **settings)
    seen = []
    with pytest.raises(RuntimeError, match="applying transform") as raised:
        for batch in loader:
            seen += batch["x"].tolist()
    assert seen == [0, 1] and "case 2 is broken" in f"{raised.value} {raised.value.__cause__}"  # a worker's: text
    assert [b["x"].tolist() for b in make_loader(Dataset(DATA), **settings)] == [[0], [1], [2], [3]], "and reuses"


def _parser_like(parser: ConfigParser, **settings) -> ConfigParser:
    """A fresh parser of the same config as ``parser`` with ``settings`` on top (nothing parsed carried over)."""
    fresh = ConfigParser()
    fresh.read_config(parser.get())  # the raw config, before any parsing
    fresh.update(settings)
    return fresh


def test_the_device_pipeline_draws_the_same_crops_as_the_host_pipeline(train_config):
    """cache gpu (here on the CPU device): plain tensors cached after EnsureTyped, crops and augmentation on them --
    for the same seed, the very patches of the host pipeline (cache memory, MetaTensors)."""
    draws = {}
    for cache in ("memory", "gpu"):
        parser = _parser_like(train_config, cache=cache, device="$torch.device('cpu')")
        assert parser.get_parsed_content("training_cache") == cache
        dataset = parser.get_parsed_content("train#dataset")
        loader = parser.get_parsed_content("train#dataloader")
        assert type(loader) is (ThreadDataLoader if cache == "gpu" else DataLoader)
        parser.get_parsed_content("train#preprocessing").set_random_state(seed=11)
        draws[cache] = [dataset[i] for i in range(len(dataset))] + [dataset[0]]  # the first case twice: fresh draws
    cached = _parser_like(train_config, cache="gpu", device="$torch.device('cpu')")
    assert not isinstance(cached.get_parsed_content("train#dataset")._cache[0]["image"], MetaTensor), "untracked"
    for host, device in zip(draws["memory"], draws["gpu"], strict=True):
        assert len(host) == len(device) == 8
        for a, b in zip(host, device, strict=True):
            assert torch.equal(torch.as_tensor(a["image"]), torch.as_tensor(b["image"]))
            assert torch.equal(torch.as_tensor(a["label"]), torch.as_tensor(b["label"]))
    assert not torch.equal(torch.as_tensor(draws["gpu"][0][0]["image"]), torch.as_tensor(draws["gpu"][-1][0]["image"]))


def _fake_card(free_gib: float, total_gib: float = 80.0):
    return lambda device: (int(free_gib * 2**30), int(total_gib * 2**30))


def test_cache_auto_puts_the_compact_cache_on_the_device_only_when_it_fits(train_config, caplog):
    data = train_config.get_parsed_content("train#data")
    spacing, roi = train_config["spacing"], ROI
    need, unknown = cached_bytes(data, spacing, roi)
    assert unknown is None and need > 0
    real = train_config.get_parsed_content("train#dataset")._cache
    compact = sum(c[k].numel() * c[k].element_size() for c in real for k in ("image", "label"))
    assert compact <= need, "the header-based size is an upper bound of what the cache holds"

    cuda = torch.device("cuda", 0)
    caplog.set_level("INFO", logger="scripts.data.dataset")
    step_gib = STEP_BASE_GIB + STEP_GIB_PER_PATCH * 8 * np.prod(roi) / 96**3  # 8 patches at feature_size 48
    roomy = step_gib + 0.1 * 80 + need / 2**30 + 0.01
    assert choose_cache("auto", cuda, data, spacing, roi, 8, memory_info=_fake_card(roomy)) == "gpu"
    assert f"the compact cache of {len(data)} case(s)" in caplog.text and "fits cuda:0" in caplog.text
    assert choose_cache("auto", cuda, data, spacing, roi, 8, memory_info=_fake_card(roomy - 0.02)) == "memory"
    assert "does not fit cuda:0" in caplog.text
    bigger_patches = choose_cache("auto", cuda, data, spacing, roi, 16, memory_info=_fake_card(roomy))
    assert bigger_patches == "memory", "more patches a step leave less room for the cache"

    assert choose_cache("auto", "cpu", data, spacing, roi, 8) == "memory"
    assert choose_cache("GPU", "cpu", data, spacing, roi, 8) == "gpu", "a setting overrides the choice"
    missing = [{"image": "/nowhere/LUNG1-404_image.nii"}]
    assert choose_cache("auto", cuda, missing, spacing, roi, 8, memory_info=_fake_card(1000)) == "memory"
    assert "/nowhere/LUNG1-404_image.nii" in caplog.text
    with pytest.raises(ConfigError, match=r"'ram' is not one of \['auto', 'none'"):
        choose_cache("ram", cuda, data, spacing, roi, 8)


def test_cache_size_follows_the_headers_in_mm(tmp_path):
    """200 x 100 voxels of 0.5 mm x 40 slices of 2.5 mm, stored with the slice axis first: 100 x 50 x 100 mm, at
    1 x 1 x 2 mm 100 x 50 x 50 voxels -- padded to the patch (64 along y)."""
    import nibabel as nib

    affine = np.zeros((4, 4))
    affine[0, 1], affine[1, 2], affine[2, 0], affine[3, 3] = -0.5, 0.5, 2.5, 1.0  # voxel axes (z, x, y)
    nib.save(nib.Nifti1Image(np.zeros((40, 200, 100), np.int16), affine), tmp_path / "ct.nii")
    need, unknown = cached_bytes([{"image": str(tmp_path / "ct.nii")}], [1.0, 1.0, 2.0], [32, 64, 32])
    assert unknown is None and need == 3 * 100 * 64 * 50 + CACHED_INDEX_BYTES


def test_auto_workers_leave_the_main_process_a_core(monkeypatch):
    monkeypatch.setattr("scripts.data.dataset.usable_cpus", lambda: 16)
    assert loader_workers("auto", "cuda") == 15 and loader_workers(None, "cuda:1") == 15
    assert loader_workers("auto", "cpu") == 4
    assert loader_workers("6", "cuda") == 6 and loader_workers(0, "cuda") == 0, "a number is kept"
    monkeypatch.setattr("scripts.data.dataset.usable_cpus", lambda: 1)
    assert loader_workers("auto", "cuda") == 1 and loader_workers("auto", "cpu") == 0

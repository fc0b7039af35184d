"""Where the training data lives between epochs, and how it reaches the network: one switch each.

* ``cache``: ``none`` (``Dataset``: every transform every epoch, as the original scripts did), ``memory``
  (``CacheDataset``: the deterministic transforms run once, results kept in RAM), ``disk`` (``PersistentDataset``:
  kept as files under ``cache_dir``, shared by later runs; for data larger than RAM) or ``gpu`` (``CacheDataset``
  whose last deterministic transform moved the volumes to the device, so the random crops and augmentation run
  there, without metadata tracking, and nothing crosses PCIe per step).
* What is cached for training (:class:`CompactForCropd`, the last step before the cache): the image in float16, the
  label in uint8 and the crop centres' candidate positions (foreground / background voxel indices), so a cached case
  is ~4x smaller than float32 tensors and the random crops do no search over the volume each epoch.
* The loader: ``DataLoader`` with worker processes, or MONAI's ``ThreadDataLoader`` (a background thread; no
  process start-up or pickling). GPU-cached data is always loaded by a thread in the main process: CUDA tensors
  cannot be shared with worker processes.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from monai.data import CacheDataset, DataLoader, Dataset, MetaTensor, PersistentDataset, ThreadDataLoader
from monai.engines import default_prepare_batch
from monai.transforms import MapTransform
from scripts.config import ConfigError, as_bool

CACHE_MODES = ("none", "memory", "disk", "gpu")


def check_cache(cache: str) -> str:
    cache = str(cache).lower()
    if cache not in CACHE_MODES:
        raise ConfigError(f"cache: {cache!r} is not one of {list(CACHE_MODES)}.")
    return cache


def make_dataset(
    cache: str,
    data: Sequence[dict],
    transform: Callable,
    cache_rate: float = 1.0,
    num_workers: int | None = None,
    cache_dir: str | Path | None = None,
    copy_cache: bool | str = True,
) -> Dataset:
    """The dataset for ``cache`` (see the module docstring).

    ``copy_cache=False`` skips MONAI's deep copy of a cached case before each draw of the random transforms (~60 MB
    per 512x512x120 case, a third of a cached epoch): safe only when no random transform writes into its input --
    train.yaml's first random transforms crop and then cast the patches to float32, new tensors.
    """
    cache = check_cache(cache)
    if cache == "none":
        return Dataset(data=data, transform=transform)
    if cache == "disk":
        if not cache_dir:
            raise ConfigError("cache: 'disk' needs cache_dir, a folder for the cached volumes.")
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        return PersistentDataset(data=data, transform=transform, cache_dir=cache_dir)
    return CacheDataset(
        data=data,
        transform=transform,
        cache_rate=cache_rate,
        num_workers=num_workers or None,
        copy_cache=as_bool(copy_cache, "copy_cache"),
    )


def make_loader(
    dataset: Dataset,
    cache: str = "memory",
    thread_loader: bool | str = False,
    batch_size: int = 1,
    shuffle: bool = False,
    num_workers: int = 0,
    persistent_workers: bool | str = True,
    sampler=None,
    collate_fn=None,
) -> DataLoader:
    """``ThreadDataLoader`` for GPU-cached data or when asked, else ``DataLoader`` with ``num_workers`` processes.

    With a ``sampler`` (DDP's ``DistributedSampler``) the sampler shuffles, not the loader. ``collate_fn``: MONAI's
    ``list_data_collate`` when None (evaluation's case by case loader gives :func:`scripts.inputs.collate_cases`)."""
    num_workers = int(num_workers)
    shuffle = bool(shuffle) and sampler is None
    common = {"batch_size": batch_size, "shuffle": shuffle, "sampler": sampler}
    if collate_fn is not None:
        common["collate_fn"] = collate_fn
    if check_cache(cache) == "gpu":
        return ThreadDataLoader(dataset, num_workers=0, **common)
    if as_bool(thread_loader, "thread_loader"):
        return ThreadDataLoader(dataset, num_workers=num_workers, **common)
    persistent = as_bool(persistent_workers, "persistent_workers") and num_workers > 0
    return DataLoader(dataset, num_workers=num_workers, persistent_workers=persistent, **common)


def plain_tensor_batch(batchdata, device=None, non_blocking: bool = False, **kwargs):
    """MONAI's ``default_prepare_batch`` with the metadata dropped, for a ``torch.compile``d network.

    Compiled graphs want plain tensors; MONAI's own round trip (strip, then re-wrap the batch metadata after the
    forward pass) fails as soon as a batch holds more than one patch (its collated ``original_channel_dim`` is a
    tensor), so the trainer is given plain tensors from the start.
    """
    image, label = default_prepare_batch(batchdata, device, non_blocking, **kwargs)
    return _plain(image), _plain(label)


def _plain(x):
    return x.as_tensor() if isinstance(x, MetaTensor) else x


class CompactForCropd(MapTransform):
    """Shrink a preprocessed training case for the cache and precompute where its random crops may be centred.

    ``RandCropByPosNegLabeld`` otherwise searches the whole volume for foreground and background voxels every time
    it draws patches (the slowest step of an epoch on cached data), and the cache holds float32 images and labels.
    This transform, placed after the deterministic transforms, stores:

    * ``fg_indices``: flat indices of voxels with any structure (label > 0), the same set MONAI computes;
    * ``bg_indices``: flat indices of label-0 voxels whose intensity is above ``image_threshold`` (MONAI's rule),
      a fixed random subset of at most ``max_indices`` of them (the full set is ~10^7 voxels and 8 bytes each;
      patch centres drawn uniformly from 10^5 random body voxels cover the body just as well), likewise for
      foreground when it is larger (multi-structure labels such as the lungs);
    * the image as float16 (the scaled HU window [0, 1] keeps a step of ~0.7 HU) and the label as uint8.

    The subset is drawn with a fixed ``seed``, so the cached result is the same in every run (and for ``cache:
    disk``). Indices are int32 when the volume allows. Random transforms after the crop cast back to float32.
    """

    def __init__(
        self,
        image_key: str = "image",
        label_key: str = "label",
        image_threshold: float = 0.0,
        max_indices: int = 100_000,
        image_dtype: torch.dtype = torch.float16,
        label_dtype: torch.dtype = torch.uint8,
        fg_indices_key: str = "fg_indices",
        bg_indices_key: str = "bg_indices",
        seed: int = 0,
    ) -> None:
        super().__init__(keys=[image_key, label_key])
        self.image_key, self.label_key = image_key, label_key
        self.image_threshold = image_threshold
        self.max_indices = int(max_indices)
        self.image_dtype, self.label_dtype = image_dtype, label_dtype
        self.fg_indices_key, self.bg_indices_key = fg_indices_key, bg_indices_key
        self.seed = seed

    def __call__(self, data: Mapping[Hashable, torch.Tensor]) -> dict[Hashable, object]:
        d = dict(data)
        image, label = d[self.image_key], d[self.label_key]
        foreground = (label > 0).any(dim=0).flatten()
        body = (image > self.image_threshold).any(dim=0).flatten()
        rng = np.random.default_rng(self.seed)
        index_dtype = np.int32 if foreground.numel() < 2**31 else np.int64
        d[self.fg_indices_key] = self._subset(foreground, rng, index_dtype)
        d[self.bg_indices_key] = self._subset(~foreground & body, rng, index_dtype)
        d[self.image_key] = image.to(self.image_dtype)
        d[self.label_key] = label.to(self.label_dtype)
        return d

    def _subset(self, mask: torch.Tensor, rng: np.random.Generator, dtype: type) -> np.ndarray:
        indices = torch.nonzero(mask).squeeze(1).cpu().numpy()
        if len(indices) > self.max_indices:
            indices = np.sort(rng.choice(indices, size=self.max_indices, replace=False))
        return indices.astype(dtype)

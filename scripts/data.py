"""Where the training data lives between epochs, and how it reaches the network: one switch each.

* ``cache``: ``none`` (``Dataset``: every transform every epoch, as the original scripts did), ``memory``
  (``CacheDataset``: the deterministic transforms run once, results kept in RAM), ``disk`` (``PersistentDataset``:
  kept as files under ``cache_dir``, shared by later runs; for data larger than RAM) or ``gpu`` (``CacheDataset``
  whose last deterministic transform moved the volumes to the device, so the random crops and augmentation run
  there, without metadata tracking, and nothing crosses PCIe per step).
* The loader: ``DataLoader`` with worker processes, or MONAI's ``ThreadDataLoader`` (a background thread; no
  process start-up or pickling). GPU-cached data is always loaded by a thread in the main process: CUDA tensors
  cannot be shared with worker processes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from monai.data import CacheDataset, DataLoader, Dataset, MetaTensor, PersistentDataset, ThreadDataLoader
from monai.engines import default_prepare_batch

from scripts.checks import ConfigError, as_bool

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
) -> Dataset:
    """The dataset for ``cache`` (see the module docstring)."""
    cache = check_cache(cache)
    if cache == "none":
        return Dataset(data=data, transform=transform)
    if cache == "disk":
        if not cache_dir:
            raise ConfigError("cache: 'disk' needs cache_dir, a folder for the cached volumes.")
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        return PersistentDataset(data=data, transform=transform, cache_dir=cache_dir)
    return CacheDataset(data=data, transform=transform, cache_rate=cache_rate, num_workers=num_workers or None)


def make_loader(
    dataset: Dataset,
    cache: str = "memory",
    thread_loader: bool | str = False,
    batch_size: int = 1,
    shuffle: bool = False,
    num_workers: int = 0,
    persistent_workers: bool | str = True,
    sampler=None,
) -> DataLoader:
    """``ThreadDataLoader`` for GPU-cached data or when asked, else ``DataLoader`` with ``num_workers`` processes.

    With a ``sampler`` (DDP's ``DistributedSampler``) the sampler shuffles, not the loader."""
    num_workers = int(num_workers)
    shuffle = bool(shuffle) and sampler is None
    common = {"batch_size": batch_size, "shuffle": shuffle, "sampler": sampler}
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

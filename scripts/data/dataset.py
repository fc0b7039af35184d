"""Where the training data lives between epochs, and how it reaches the network: one switch each.

* ``cache``: ``auto`` (the default: ``gpu`` when the compact cache fits on the device beside training, else
  ``memory``; :func:`choose_cache` decides and logs why), ``none`` (``Dataset``: every transform every epoch, as the
  original scripts did), ``memory`` (``CacheDataset``: the deterministic transforms run once, results kept in RAM),
  ``disk`` (``PersistentDataset``: kept as files under ``cache_dir``, shared by later runs; for data larger than RAM)
  or ``gpu`` (``CacheDataset`` whose last deterministic transform moved the volumes to the device, so the random crops
  and augmentation run there, without metadata tracking, and nothing crosses PCIe per step). Only training's cache
  goes to the device: validation reads each case once every few epochs, so its cache stays in host memory.
* What is cached for training (:class:`CompactForCropd`, the last step before the cache): the image in float16, the
  label in uint8 and the crop centres' candidate positions (foreground / background voxel indices), so a cached case
  is ~4x smaller than float32 tensors and the random crops do no search over the volume each epoch.
* The loader: ``DataLoader`` with worker processes, or MONAI's ``ThreadDataLoader`` (a background thread; no
  process start-up or pickling). GPU-cached data is always loaded by a thread in the main process: CUDA tensors
  cannot be shared with worker processes. ``num_workers: auto`` (:func:`loader_workers`): on a GPU the usable CPUs
  less one (the main process launches the GPU's kernels), on a CPU at most 4 of them less one.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from monai.data import CacheDataset, DataLoader, Dataset, MetaTensor, PersistentDataset
from monai.data import ThreadDataLoader as MonaiThreadDataLoader
from monai.data.thread_buffer import ThreadBuffer
from monai.engines import default_prepare_batch
from monai.transforms import MapTransform
from scripts.common.config import ConfigError, as_bool
from scripts.common.cpus import usable_cpus
from torch.utils.data import RandomSampler, Sampler, SequentialSampler

logger = logging.getLogger(__name__)

CACHE_MODES = ("none", "memory", "disk", "gpu")
#: what one cached training voxel costs (CompactForCropd: float16 image + uint8 label), and a case's crop indices
CACHED_BYTES_PER_VOXEL = 3
CACHED_INDEX_BYTES = 2 * 100_000 * 4
#: device memory of a training step, measured on an H200: the allocator's peak was 17.5 GiB for 4 patches
#: of 96^3 through SwinUNETR f48 under AMP. Activations grow with the patch's voxels and the network's width, so the
#: rule is a base (weights, AdamW state, cuDNN workspaces) plus this much per 96^3 patch at feature_size 48.
STEP_BASE_GIB = 2.0
STEP_GIB_PER_PATCH = 4.5
DEVICE_MARGIN = 0.1  # of the card, never planned for: the allocator's fragmentation, validation's windows


def fold_cases(datalist: Sequence[dict], fold: int | str | None, held_out: bool) -> list[dict]:
    """The training cases for cross-validation's ``fold``: those outside it, to train on, or (``held_out``) those in
    it, to validate on; ``fold`` None: every case (the prepared validation split validates). A fold no case is in is a
    :class:`~scripts.common.config.ConfigError` naming the folds prepare made, before any training: a run on it would
    train on every case, validate on none and write no weights."""
    if fold is None:
        return list(datalist)
    try:
        chosen = int(fold)
    except (TypeError, ValueError):
        raise ConfigError(f"fold={fold!r}: give a fold number, e.g. --fold 0, or leave it out (null).") from None
    folds = sorted({int(d["fold"]) for d in datalist if d.get("fold") is not None})
    if chosen not in folds:
        made = f"folds {folds[0]} to {folds[-1]}" if folds else "no folds (prepare with num_folds > 1)"
        raise ConfigError(f"fold={fold}: no training case is in fold {chosen}; the prepared data has {made}.")
    return [d for d in datalist if (d.get("fold") == chosen) == held_out]


def check_cache(cache: str, allow_auto: bool = False) -> str:
    cache = str(cache).lower()
    modes = ("auto", *CACHE_MODES) if allow_auto else CACHE_MODES
    if cache not in modes:
        raise ConfigError(f"cache: {cache!r} is not one of {list(modes)}.")
    return cache


def choose_cache(
    cache: str,
    device: torch.device | str,
    data: Sequence[Mapping],
    spacing: Sequence[float],
    roi_size: Sequence[int],
    patches_per_step: int,
    feature_size: int = 48,
    memory_info: Callable[[torch.device], tuple[int, int]] | None = None,
) -> str:
    """Where training's cache lives this run: ``cache`` itself unless it is ``auto``, which is ``gpu`` on a CUDA/ROCm
    device when the compact cache of ``data`` fits beside the training step, else ``memory``. Logs the choice and why.

    The cache's size is an upper bound read from the images' NIfTI headers (:func:`cached_bytes`: resampled to
    ``spacing``, before the body crop, which only shrinks it); the step's memory follows :data:`STEP_GIB_PER_PATCH`;
    :data:`DEVICE_MARGIN` of the card stays free. ``memory_info`` (free, total bytes) is ``torch.cuda.mem_get_info``.
    """
    cache = check_cache(cache, allow_auto=True)
    device = torch.device(device)
    if cache != "auto":
        logger.info(f"training data: cache {cache} (as set)")
        return cache
    if device.type != "cuda":
        logger.info(f"training data: cache memory (cache auto on {device.type}: the data is beside the network)")
        return "memory"
    need, unknown = cached_bytes(data, spacing, roi_size)
    if unknown:
        logger.info(f"training data: cache memory (cache auto: the cache's size is unknown, {unknown})")
        return "memory"
    free, total = (memory_info or torch.cuda.mem_get_info)(device)
    step = (STEP_BASE_GIB + STEP_GIB_PER_PATCH * int(patches_per_step) * math.prod(roi_size) / 96**3
            * int(feature_size) / 48) * 2**30  # fmt: skip
    room = free - step - DEVICE_MARGIN * total
    fits = need <= room
    gib = 2**30
    logger.info(
        f"training data: cache {'gpu' if fits else 'memory'} (cache auto: the compact cache of {len(data)} case(s), "
        f"at most {need / gib:.1f} GiB, {'fits' if fits else 'does not fit'} {device}: {free / gib:.1f} GiB free, "
        f"{step / gib:.1f} GiB kept for training {patches_per_step} patch(es) of {'x'.join(map(str, roi_size))} a "
        f"step, {DEVICE_MARGIN * total / gib:.1f} GiB margin)"
    )
    return "gpu" if fits else "memory"


def cached_bytes(
    data: Sequence[Mapping], spacing: Sequence[float], roi_size: Sequence[int], key: str = "image"
) -> tuple[int, str | None]:
    """An upper bound of the compact training cache of ``data`` in bytes, from each image's NIfTI header: its extent
    in mm along each RAS axis over ``spacing``, at least ``roi_size`` (the padding), 3 bytes a voxel plus the crop
    indices. ``(0, why)`` when an image's header cannot be read (a name and a reason; the cache then stays on the
    host)."""
    import nibabel as nib

    total = 0
    for item in data:
        path = item.get(key) if isinstance(item, Mapping) else None
        try:
            image = nib.load(str(path))
            affine, shape = np.asarray(image.affine, dtype=float), image.shape[:3]
        except Exception as error:  # any file nibabel cannot read: the size stays unknown
            return 0, f"{path}: {type(error).__name__}: {error}"
        extent = np.zeros(3)
        for axis in range(3):  # a voxel axis runs along the world axis it is closest to (Orientationd's RAS)
            column = affine[:3, axis]
            extent[int(np.argmax(np.abs(column)))] += shape[axis] * float(np.linalg.norm(column))
        voxels = math.prod(max(math.ceil(e / float(s)), int(r)) for e, s, r in zip(extent, spacing, roi_size))
        total += CACHED_BYTES_PER_VOXEL * voxels + CACHED_INDEX_BYTES
    return total, None


def loader_workers(num_workers: int | str | None, device: torch.device | str) -> int:
    """``num_workers`` as a number: as set, or for ``auto`` (or None) the usable CPUs less one on a GPU (the main
    process keeps a core to launch the GPU's kernels), and on a CPU at most 4 of them less one (the workers compete
    with the network for the same cores)."""
    if num_workers is not None and str(num_workers).lower() != "auto":
        return int(num_workers)
    spare = max(usable_cpus() - 1, 0)
    return max(spare, 1) if torch.device(device).type == "cuda" else min(spare, 4)


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
    epoch_batches: int | None = None,
) -> DataLoader:
    """``ThreadDataLoader`` for GPU-cached data or when asked, else ``DataLoader`` with ``num_workers`` processes.

    With a ``sampler`` (DDP's ``DistributedSampler``) the sampler shuffles, not the loader. ``collate_fn``: MONAI's
    ``list_data_collate`` when None (evaluation's case by case loader gives
    :func:`scripts.inference.inputs.collate_cases`). ``epoch_batches``: an epoch of at least that many batches, the
    cases taken pass after pass (:class:`Passes`), where one pass over them holds fewer (None or 0: one pass, as a
    ``DataLoader``)."""
    num_workers = int(num_workers)
    shuffle = bool(shuffle) and sampler is None
    if epoch_batches and len(dataset):
        base = sampler if sampler is not None else RandomSampler(dataset) if shuffle else SequentialSampler(dataset)
        if math.ceil(len(base) / batch_size) < int(epoch_batches):  # a pass (a DDP rank's shard) holds fewer
            sampler, shuffle = Passes(base, int(epoch_batches) * batch_size), False
    common = {"batch_size": batch_size, "shuffle": shuffle, "sampler": sampler}
    if collate_fn is not None:
        common["collate_fn"] = collate_fn
    if check_cache(cache) == "gpu":
        return ThreadDataLoader(dataset, num_workers=0, **common)
    if as_bool(thread_loader, "thread_loader"):
        return ThreadDataLoader(dataset, num_workers=num_workers, **common)
    persistent = as_bool(persistent_workers, "persistent_workers") and num_workers > 0
    return DataLoader(dataset, num_workers=num_workers, persistent_workers=persistent, **common)


class Passes(Sampler):
    """``sampler``'s order, pass after pass, until ``length`` indices: an epoch over a few cases as long as asked.

    Why: a loader starts again at every epoch -- ``ThreadDataLoader`` a new thread, ``DataLoader`` its first batches --
    and the trainer waits for the epoch's first batch to be made from nothing. A training over hundreds of cases
    pays that once per hundreds of steps; the benchmark over the GPU kit's 3 training cases paid it every third step
    (the H200 rows waited 4 to 6 ms a step for data, whatever their speed: about one batch made from nothing every
    third step). ``benchmark.yaml`` runs all its steps in one epoch this way.
    Each pass is a new order of the base sampler (``set_epoch`` is called with the pass's number where the sampler
    has it, as ``DistributedSampler`` needs), so every case is drawn once per pass."""

    def __init__(self, sampler: Sampler, length: int) -> None:
        self.sampler, self.length = sampler, int(length)
        self.passes = 0

    def __len__(self) -> int:
        return self.length

    def __iter__(self):
        taken = 0
        while taken < self.length:
            if hasattr(self.sampler, "set_epoch"):
                self.sampler.set_epoch(self.passes)
            self.passes += 1
            drawn = 0
            for index in self.sampler:
                if taken == self.length:
                    return
                yield index
                taken += 1
                drawn += 1
            if not drawn:
                raise ValueError("Passes: the sampler yields no index; there is no case to take")


class RaisingThreadBuffer(ThreadBuffer):
    """MONAI's ``ThreadBuffer`` whose thread hands its error to the loop that reads it.

    MONAI's thread dies on an exception and its reader ends as if the data were exhausted: a transform failing on a
    case gave an empty epoch, and the trainer ran on through every remaining epoch without a step (thousands of
    tracebacks, no training, no error). Here the error is kept and raised in the reader."""

    def __init__(self, src, buffer_size: int = 1, timeout: float = 0.01) -> None:
        super().__init__(src, buffer_size=buffer_size, timeout=timeout)
        self.error: Exception | None = None

    def enqueue_values(self) -> None:
        try:
            super().enqueue_values()
        except Exception as error:  # handed over to __iter__, which raises it in the reading thread
            self.error = error

    def __iter__(self):
        self.error = None
        yield from super().__iter__()
        if self.error is not None:
            raise self.error


class ThreadDataLoader(MonaiThreadDataLoader):
    """MONAI's ``ThreadDataLoader`` (batches made in a background thread) with :class:`RaisingThreadBuffer`: an error
    in a transform ends the epoch with that error, as in a ``DataLoader``, instead of an empty epoch."""

    def __iter__(self):
        buffer = RaisingThreadBuffer(super(MonaiThreadDataLoader, self).__iter__(), self.buffer_size,
                                     self.buffer_timeout)  # fmt: skip
        for batch in buffer:
            for _ in range(self.repeats):
                yield batch


def plain_tensor_batch(batchdata, device=None, non_blocking: bool = False, **kwargs):
    """MONAI's ``default_prepare_batch`` with the metadata dropped: the training step's batch, compiled or not.

    Nothing in a training step reads the patches' metadata, and carrying it costs host time on every operation of the
    forward pass: MetaTensor's ``__torch_function__`` wraps each one, and indexing a batched MetaTensor decollates its
    metadata (SwinUNETR's ``qkv[0]`` in every window attention: 1,632 ``.item()`` calls a step on the demo network).
    Compiled graphs want plain tensors as well; MONAI's own round trip (strip, then re-wrap the batch metadata after
    the forward pass) fails as soon as a batch holds more than one patch (its collated ``original_channel_dim`` is a
    tensor).
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

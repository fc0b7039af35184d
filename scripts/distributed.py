"""torch.distributed plumbing for the bundle's multi-GPU configs: process group, ranks, rank-0 work, data shards.

Launch with PyTorch's own launcher (``torchrun``; under SLURM ``srun torchrun ...``): it sets ``RANK``,
``LOCAL_RANK`` and ``WORLD_SIZE``. Everything here is a no-op in a single process, so ``train.yaml`` can call
:func:`is_rank0` and :func:`barrier` unconditionally.

* :func:`setup` initialises the process group (``nccl`` on GPUs, ``gloo`` on CPU unless told otherwise) and binds
  this process to the GPU ``LOCAL_RANK``.
* :func:`shard` gives each rank a disjoint part of a case list -- for validation (no case counted twice or dropped)
  and, with ``partition_cache``, for training (each rank caches only its part, as MONAI's BraTS recipe does).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


def local_device() -> torch.device:
    """``cuda:<LOCAL_RANK>`` when GPUs are visible, else the CPU."""
    if torch.cuda.is_available():
        return torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
    return torch.device("cpu")


def setup(backend: str | None = None, timeout_minutes: float = 30.0) -> dict:
    """Join the process group started by torchrun; returns ``{"rank", "world_size", "backend"}``."""
    if "WORLD_SIZE" not in os.environ:
        raise RuntimeError(
            "multi_gpu_train.yaml runs under torchrun, which sets RANK/WORLD_SIZE: "
            'torchrun --standalone --nproc_per_node=N -m monai.bundle run --config_file "[...]"'
        )
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(local_device())
        timeout = timedelta(minutes=float(timeout_minutes))
        dist.init_process_group(
            backend=backend, store=_attempt_store(timeout), rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout,
        )  # fmt: skip
    info = {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "backend": dist.get_backend()}
    logger.info("process group: rank %(rank)d of %(world_size)d, backend %(backend)s", info)
    return info


def _attempt_store(timeout: timedelta) -> dist.Store:
    """torchrun's key-value store, with a prefix per restart of the workers.

    When torchrun restarts failed workers (``--max-restarts``) the new ones meet in the same store; without a fresh
    prefix they can read the addresses the dead ones published and fail ("Gloo connectFullMesh failed ...
    Connection refused") -- in the default group or in the helper group ignite creates for MONAI's metrics.
    """
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
        is_master=not agent_store and int(os.environ["RANK"]) == 0, timeout=timeout,
    )  # fmt: skip
    return dist.PrefixStore(f"bundle/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_rank0() -> bool:
    return rank() == 0


def for_this_rank(handlers: Sequence, rank0_only: tuple[type, ...]) -> list:
    """``handlers`` without those of the ``rank0_only`` types on ranks other than 0 (logs and TensorBoard once)."""
    return list(handlers) if is_rank0() else [h for h in handlers if not isinstance(h, rank0_only)]


def barrier() -> None:
    """Wait for every rank (e.g. until rank 0 has prepared the data); nothing to wait for in one process."""
    if world_size() > 1:
        dist.barrier()


def shard(data: Sequence, partition: bool = True, seed: int = 0, even: bool = False, name: str = "") -> list:
    """This rank's part of ``data``: disjoint parts that together hold every case exactly once.

    ``even`` (training): the cases are shuffled with ``seed`` first, and a rank with one case fewer repeats one of its
    own, so every rank takes the same number of steps per epoch (DDP needs that) and no case is held by two ranks.
    """
    data = list(data)
    if not partition or world_size() == 1:
        return data
    if len(data) < world_size():
        raise ValueError(
            f"{len(data)} case(s) cannot be shared by {world_size()} ranks (each needs at least one); "
            "use fewer processes or more cases."
        )
    if even:
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(int(seed))).tolist()
        data = [data[i] for i in order]
    part = data[rank() :: world_size()]
    if even:
        size = -(-len(data) // world_size())
        part += part[: size - len(part)]
    ids = [str(d.get("case_id", i)) if isinstance(d, dict) else str(i) for i, d in enumerate(part)]
    logger.info("rank %d holds %d %s case(s): %s", rank(), len(part), name, " ".join(ids))
    return part


def cleanup() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()

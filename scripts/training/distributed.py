"""torch.distributed plumbing for the bundle's multi-GPU configs: process group, ranks, rank-0 work, data shards.

Launch with PyTorch's own launcher (``torchrun``; under SLURM ``srun torchrun ...``): it sets ``RANK``,
``LOCAL_RANK`` and ``WORLD_SIZE``. Everything here is a no-op in a single process, so ``train.yaml`` can call
:func:`is_rank0` and :func:`barrier` unconditionally.

* :func:`setup` initialises the process group (``nccl`` on GPUs, ``gloo`` on CPU unless told otherwise) and binds
  this process to the GPU ``LOCAL_RANK``.
* :func:`shard` gives each rank a disjoint part of a case list -- for validation (no case counted twice or dropped)
  and, with ``partition_cache``, for training (each rank caches only its part, as MONAI's BraTS recipe does).
* :func:`cleanup` leaves the group so that the process exits cleanly (see :func:`settle_gloo_workers`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

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
    if info["rank"] != 0:
        quiet_logs()
    return info


def quiet_logs() -> None:
    """This rank's log: warnings and errors only. Every rank runs the same engines, so ignite's "Epoch[k] Complete"
    and MONAI's "Got new best metric" came once per rank, and a log read for epoch times counted each epoch N times;
    rank 0 logs the run, the others only what goes wrong."""
    logging.getLogger().setLevel(logging.WARNING)
    for handler in logging.getLogger().handlers:
        handler.setLevel(max(handler.level, logging.WARNING))
    for name, existing in logging.root.manager.loggerDict.items():  # loggers given their own level (MONAI's engines)
        if isinstance(existing, logging.Logger) and existing.level and existing.level < logging.WARNING:
            logging.getLogger(name).setLevel(logging.WARNING)


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
    size = -(-len(data) // world_size())
    parts = [data[r :: world_size()] for r in range(world_size())]
    parts = [part + part[: size - len(part)] if even else part for part in parts]
    if rank() == 0:  # one log for the run (quiet_logs): rank 0 says what every rank holds
        for r, part in enumerate(parts):
            ids = [str(d.get("case_id", i)) if isinstance(d, dict) else str(i) for i, d in enumerate(part)]
            logger.info("rank %d holds %d %s case(s): %s", r, len(part), name, " ".join(ids))
    return parts[rank()]


def cleanup() -> None:
    """Leave the process group at the end of a run: every rank first reaches this point (so no rank leaves while
    another still communicates), then the group is destroyed and gloo's worker threads are let finish."""
    if dist.is_available() and dist.is_initialized():
        barrier()
        dist.destroy_process_group()
        settle_gloo_workers()


GLOO_WORKER = "pt_gloo_runloop"  # the name torch gives ProcessGroupGloo's worker threads (c10::setThreadName)
THREADS = Path("/proc/self/task")  # Linux: one folder per thread of this process


def settle_gloo_workers(timeout_s: float = 30.0, quiet_s: float = 0.05, tasks: Path = THREADS) -> bool:
    """Wait, the GIL released, until every gloo worker thread of this process has slept through ``quiet_s``.

    Why: a gloo worker hands a collective's result back (the caller's ``wait`` returns) before it drops its own
    reference to the work, and with it to the tensors; where Python has dropped them first, the worker takes the GIL
    to free them. If the interpreter is finalising by then, CPython ends that thread with ``pthread_exit``, which
    unwinds through a C++ destructor and aborts the process ("terminate called without an active exception",
    SIGABRT; pytorch/pytorch#190489). ``destroy_process_group`` would join the workers, but DistributedDataParallel
    keeps the group alive to the end, so they outlive it. A rank that ended right after its last validation metric
    (an all-gather) aborted so on a loaded 2-core CI machine, and the other node's torchrun then waited 300 s at its
    exit barrier.

    A worker counts as settled when it is asleep (state S) in two samples ``quiet_s`` apart with no context switch
    between them: it did not run in that time although the GIL was free, so it is waiting for work. Linux only (no
    ``/proc``: nothing to do). Returns False, with a warning, if they have not settled within ``timeout_s``.
    """
    before = _thread_states(tasks, GLOO_WORKER)
    if not before:
        return True
    deadline = time.monotonic() + timeout_s
    while True:
        time.sleep(quiet_s)
        after = _thread_states(tasks, GLOO_WORKER)
        if after == before and all(state == "S" for state, _ in after.values()):
            return True
        if time.monotonic() > deadline:
            busy = sorted(tid for tid, now in after.items() if now != before.get(tid) or now[0] != "S")
            logger.warning("gloo worker thread(s) %s still busy after %.0f s; exiting anyway", busy, timeout_s)
            return False
        before = after


def _thread_states(tasks: Path, name: str) -> dict[int, tuple[str, int]]:
    """{thread id: (scheduler state, context switches so far)} of this process's threads called ``name``."""
    states = {}
    for task in tasks.glob("[0-9]*") if tasks.is_dir() else ():
        try:
            if (task / "comm").read_text().strip() != name:
                continue
            state = (task / "stat").read_text().rpartition(")")[2].split()[0]  # the name in (...) may hold spaces
            fields = dict(line.split(":", 1) for line in (task / "status").read_text().splitlines() if ":" in line)
            switches = int(fields["voluntary_ctxt_switches"]) + int(fields["nonvoluntary_ctxt_switches"])
        except (OSError, KeyError, ValueError, IndexError):  # the thread ended while being read
            continue
        states[int(task.name)] = (state, switches)
    return states

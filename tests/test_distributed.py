"""torch.distributed plumbing: in one process everything is a no-op (rank 0 of 1, barrier returns); ``shard`` gives
the ranks disjoint parts that hold every case exactly once (``even`` equalises counts by repeating a rank's own case)
and refuses fewer cases than ranks; rank-0-only handlers are dropped elsewhere; ``setup`` outside torchrun says how to
launch. A real two-process gloo group checks ``setup``, ``shard`` and ``barrier`` together."""

from __future__ import annotations

import json
import os
import socket
import time
from collections import Counter
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from scripts import distributed


def cases(n: int) -> list[dict]:
    return [{"case_id": f"LUNG1-{i:03d}", "image": f"images/LUNG1-{i:03d}.nii"} for i in range(n)]


def parts_of(data: list, world: int, monkeypatch, **kwargs) -> list[list]:
    """``shard`` as each of ``world`` ranks sees it."""
    parts = []
    monkeypatch.setattr(distributed, "world_size", lambda: world)
    for r in range(world):
        monkeypatch.setattr(distributed, "rank", lambda r=r: r)
        parts.append(distributed.shard(data, **kwargs))
    return parts


def test_single_process_is_rank_0_of_1_and_barrier_returns(monkeypatch):
    assert not dist.is_initialized()

    def no_group_barrier(*args, **kwargs):
        raise AssertionError("barrier() must not call torch.distributed without a process group")

    monkeypatch.setattr(dist, "barrier", no_group_barrier)
    assert (distributed.rank(), distributed.world_size(), distributed.is_rank0()) == (0, 1, True)
    assert distributed.barrier() is None
    data = cases(3)
    assert distributed.shard(data) == data and distributed.shard(data, even=True) == data


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("n", [4, 7, 10])
def test_parts_are_disjoint_and_hold_every_case_once(monkeypatch, world, n):
    data = cases(n)
    parts = parts_of(data, world, monkeypatch)
    held = Counter(c["case_id"] for part in parts for c in part)
    assert held == Counter(c["case_id"] for c in data), "every case on exactly one rank"
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("n", [4, 7, 10])
def test_even_parts_have_equal_counts_by_repeating_their_own_cases(monkeypatch, world, n):
    data = cases(n)
    parts = parts_of(data, world, monkeypatch, even=True, seed=5)
    assert {len(part) for part in parts} == {-(-n // world)}, "every rank takes the same number of steps"
    distinct = [{c["case_id"] for c in part} for part in parts]
    assert set().union(*distinct) == {c["case_id"] for c in data}
    for i, a in enumerate(distinct):
        for b in distinct[i + 1 :]:
            assert not a & b, "a repeated case is the rank's own, never another rank's"
    assert sum(map(len, distinct)) == n


def test_even_parts_depend_on_the_seed_not_on_the_rank(monkeypatch):
    data = cases(9)
    assert parts_of(data, 3, monkeypatch, even=True, seed=1) == parts_of(data, 3, monkeypatch, even=True, seed=1)
    assert parts_of(data, 3, monkeypatch, even=True, seed=1) != parts_of(data, 3, monkeypatch, even=True, seed=2)


def test_partition_false_gives_every_rank_everything(monkeypatch):
    data = cases(5)
    assert parts_of(data, 2, monkeypatch, partition=False) == [data, data]


def test_fewer_cases_than_ranks_is_refused_with_what_to_do(monkeypatch):
    with pytest.raises(ValueError, match=r"2 case\(s\) cannot be shared by 3 ranks.*fewer processes or more cases"):
        parts_of(cases(2), 3, monkeypatch)


def test_rank0_only_handlers_are_dropped_on_other_ranks(monkeypatch):
    class TensorBoardLike:
        pass

    class Checkpointer:
        pass

    handlers = [TensorBoardLike(), Checkpointer(), TensorBoardLike()]
    assert distributed.for_this_rank(handlers, (TensorBoardLike,)) == handlers
    monkeypatch.setattr(distributed, "rank", lambda: 1)
    assert distributed.for_this_rank(handlers, (TensorBoardLike,)) == [handlers[1]]


def test_setup_outside_torchrun_names_torchrun(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(RuntimeError, match="torchrun --standalone --nproc_per_node=N"):
        distributed.setup()
    assert not dist.is_initialized()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    info = distributed.setup(backend="gloo", timeout_minutes=1)
    late = Path(out) / "late"
    if rank == 1:
        time.sleep(1.0)
        late.write_text("rank 1 was here")
    distributed.barrier()
    result = {
        **info,
        "is_rank0": distributed.is_rank0(),
        "saw_late_after_barrier": late.exists(),
        "plain": [c["case_id"] for c in distributed.shard(cases(5))],
        "even": [c["case_id"] for c in distributed.shard(cases(5), even=True, seed=3)],
    }
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
    distributed.cleanup()


def test_two_process_gloo_group_shards_and_waits(tmp_path):
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [(r["rank"], r["world_size"], r["backend"], r["is_rank0"]) for r in ranks] == [
        (0, 2, "gloo", True),
        (1, 2, "gloo", False),
    ]
    assert ranks[0]["saw_late_after_barrier"], "rank 0 waited at the barrier for rank 1"
    assert sorted(ranks[0]["plain"] + ranks[1]["plain"]) == [c["case_id"] for c in cases(5)]
    assert len(ranks[0]["even"]) == len(ranks[1]["even"]) == 3
    assert not set(ranks[0]["even"]) & set(ranks[1]["even"])
    assert set(ranks[0]["even"]) | set(ranks[1]["even"]) == {c["case_id"] for c in cases(5)}

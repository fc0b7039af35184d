"""torch.distributed plumbing: in one process everything is a no-op (rank 0 of 1, barrier returns); ``shard`` gives
the ranks disjoint parts that hold every case exactly once (``even`` equalises counts by repeating a rank's own case)
and refuses fewer cases than ranks; ``setup`` outside torchrun says how to launch; ``cleanup`` lets gloo's worker
threads finish before the process exits. A real two-process gloo group checks ``setup``, ``shard``, ``barrier`` and
``cleanup`` together, under DistributedDataParallel."""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from scripts.training import distributed


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


def test_setup_outside_torchrun_names_torchrun(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(RuntimeError, match="torchrun --standalone --nproc_per_node=N"):
        distributed.setup()
    assert not dist.is_initialized()


def fake_thread(tasks: Path, tid: int, name: str, state: str, switches: int) -> None:
    """A thread as Linux shows it under /proc/self/task (only the fields ``settle_gloo_workers`` reads)."""
    task = tasks / str(tid)
    task.mkdir(parents=True, exist_ok=True)
    (task / "comm").write_text(name + "\n")
    (task / "stat").write_text(f"{tid} ({name}) {state} 1 1 1 0 -1 4194368 0 0\n")
    (task / "status").write_text(f"Name:\t{name}\nState:\t{state} (x)\nvoluntary_ctxt_switches:\t{switches - 1}\n"
                                 "nonvoluntary_ctxt_switches:\t1\n")  # fmt: skip


def test_cleanup_waits_for_the_gloo_workers_to_sleep_through_a_quiet_interval(tmp_path, monkeypatch):
    """The worker is running, then asleep having just run, then asleep and untouched: settled at the third sample,
    not before; other threads (the main one, gloo's I/O loop) are not waited for."""
    tasks = tmp_path / "task"
    fake_thread(tasks, 10, "python", "R", 50)
    fake_thread(tasks, 11, "gloo_tcp_loop", "R", 7)
    fake_thread(tasks, 12, distributed.GLOO_WORKER, "S", 3)
    fake_thread(tasks, 13, distributed.GLOO_WORKER, "R", 40)
    script = [(13, "S", 41), (13, "S", 42), None, None]  # what changes at each sleep
    sleeps = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        step = script[len(sleeps) - 1]
        if step:
            fake_thread(tasks, step[0], distributed.GLOO_WORKER, *step[1:])

    monkeypatch.setattr(distributed.time, "sleep", sleep)
    assert distributed.settle_gloo_workers(quiet_s=0.05, tasks=tasks) is True
    assert sleeps == [0.05] * 3


def test_workers_that_never_settle_are_left_with_a_warning_naming_them(tmp_path, monkeypatch, caplog):
    tasks = tmp_path / "task"
    fake_thread(tasks, 12, distributed.GLOO_WORKER, "S", 3)
    fake_thread(tasks, 13, distributed.GLOO_WORKER, "R", 40)
    clock = iter(range(0, 1000, 5))
    monkeypatch.setattr(distributed.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(distributed.time, "sleep", lambda seconds: None)
    assert distributed.settle_gloo_workers(timeout_s=30, tasks=tasks) is False
    assert "gloo worker thread(s) [13] still busy after 30 s" in caplog.text


def test_without_proc_or_gloo_workers_there_is_nothing_to_wait_for(tmp_path, monkeypatch):
    monkeypatch.setattr(distributed.time, "sleep", lambda seconds: pytest.fail("waited for no thread"))
    assert distributed.settle_gloo_workers(tasks=tmp_path / "no-proc")
    fake_thread(tmp_path / "task", 10, "python", "R", 5)
    assert distributed.settle_gloo_workers(tasks=tmp_path / "task")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    logging.basicConfig(level=logging.INFO)  # as monai.bundle run's logging config: INFO, an engine with its own level
    logging.getLogger("ignite.engine.engine.SupervisedTrainer").setLevel(logging.INFO)
    info = distributed.setup(backend="gloo", timeout_minutes=1)
    engine_log = logging.getLogger("ignite.engine.engine.SupervisedTrainer")
    logs = {"info": engine_log.isEnabledFor(logging.INFO) and logging.getLogger("scripts").isEnabledFor(logging.INFO),
            "warning": engine_log.isEnabledFor(logging.WARNING)}  # fmt: skip
    late = Path(out) / "late"
    if rank == 1:
        time.sleep(1.0)
        late.write_text("rank 1 was here")
    distributed.barrier()
    result = {
        **info,
        "logs": logs,
        "is_rank0": distributed.is_rank0(),
        "saw_late_after_barrier": late.exists(),
        "plain": [c["case_id"] for c in distributed.shard(cases(5))],
        "even": [c["case_id"] for c in distributed.shard(cases(5), even=True, seed=3)],
    }
    # the end of a training run: DDP, then a metric's all-gather whose Python tensors die before gloo's worker drops
    # them, then cleanup, then the exit (which aborted when the worker freed them during finalisation)
    network = torch.nn.parallel.DistributedDataParallel(torch.nn.Conv3d(1, 2, 3))
    network(torch.ones(1, 1, 5, 5, 5)).sum().backward()
    gathered = [torch.zeros(2) for _ in range(world)]
    dist.all_gather(gathered, torch.full((2,), float(rank)))
    result["gathered"] = torch.cat(gathered).tolist()
    del gathered
    tasks = distributed.THREADS
    result["workers_before_cleanup"] = len(distributed._thread_states(tasks, distributed.GLOO_WORKER))
    distributed.cleanup()
    result["workers_after_cleanup"] = sorted(distributed._thread_states(tasks, distributed.GLOO_WORKER).values())
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))


def test_two_process_gloo_group_shards_and_waits(tmp_path):
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [(r["rank"], r["world_size"], r["backend"], r["is_rank0"]) for r in ranks] == [
        (0, 2, "gloo", True),
        (1, 2, "gloo", False),
    ]
    assert ranks[0]["saw_late_after_barrier"], "rank 0 waited at the barrier for rank 1"
    assert ranks[0]["logs"] == {"info": True, "warning": True}, "rank 0 logs the run"
    assert ranks[1]["logs"] == {"info": False, "warning": True}, "the other ranks log only what goes wrong"
    assert sorted(ranks[0]["plain"] + ranks[1]["plain"]) == [c["case_id"] for c in cases(5)]
    assert len(ranks[0]["even"]) == len(ranks[1]["even"]) == 3
    assert not set(ranks[0]["even"]) & set(ranks[1]["even"])
    assert set(ranks[0]["even"]) | set(ranks[1]["even"]) == {c["case_id"] for c in cases(5)}
    assert ranks[1]["gathered"] == [0.0, 0.0, 1.0, 1.0]
    # torch's gloo workers are found by their name (two per group), and DDP keeps them past destroy_process_group;
    # after cleanup they sleep, waiting for work that will not come
    assert ranks[0]["workers_before_cleanup"] == ranks[1]["workers_before_cleanup"] == 2
    for r in ranks:
        assert [state for state, _ in r["workers_after_cleanup"]] == ["S", "S"], r

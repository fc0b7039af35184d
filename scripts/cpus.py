"""How many CPUs this process may use: the bundle's one count (ONNX Runtime's threads, prepare's worker processes)."""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def usable_cpus(root: Path = CGROUP_ROOT) -> int:
    """The CPUs this process may use: its affinity mask (taskset, SLURM's binding), reduced to a cgroup CPU quota
    where one is set (Docker's --cpus, Kubernetes limits), rounded up; at least 1."""
    try:
        count = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        count = os.cpu_count() or 1
    quota = cgroup_cpu_quota(root)
    return max(1, min(count, math.ceil(quota)) if quota else count)


def cgroup_cpu_quota(root: Path = CGROUP_ROOT) -> float | None:
    """CPUs allowed by the cgroup's quota (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``)."""
    try:
        text = (root / "cpu.max").read_text().split()
        if text and text[0] != "max":
            return int(text[0]) / int(text[1])
        return None
    except (OSError, ValueError, IndexError, ZeroDivisionError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None

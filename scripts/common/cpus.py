"""How many CPUs this process may use: the bundle's one count (ONNX Runtime's threads, prepare's worker processes)."""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
CPUINFO = Path("/proc/cpuinfo")


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


#: oneDNN's instruction-set levels that matter to the CPU runtimes' int8 and bf16, oldest first, as oneDNN names them
#: (``ONEDNN_MAX_CPU_ISA`` takes these names and caps oneDNN at the one given: "this ISA and older")
ISA_LEVELS = ("sse41", "avx2", "avx2_vnni", "avx512_core", "avx512_core_vnni", "avx512_core_bf16", "avx512_core_amx")
#: the levels that sum int8 products in 32 bits (VNNI, AMX); below them int8 products are summed in pairs in 16 bits
#: (``vpmaddubsw``), which saturates for large weights and activations
INT8_VNNI = ("avx2_vnni", "avx512_core_vnni", "avx512_core_bf16", "avx512_core_amx")
#: the levels that compute bf16 natively
NATIVE_BF16 = ("avx512_core_bf16", "avx512_core_amx")


def cpu_isa(cpuinfo: Path = CPUINFO, cap: str | None = None) -> str | None:
    """The CPU's instruction-set level as oneDNN (inside OpenVINO and PyTorch) will use it: the newest of
    :data:`ISA_LEVELS` that the CPU's flags hold, capped by ``ONEDNN_MAX_CPU_ISA`` (``cap``; oneDNN's own switch, so
    a newer CPU runs, and this bundle judges, the kernels of an older one). None where the flags cannot be read (not
    Linux): the caller then trusts the runtime's own report."""
    try:
        flags = set(cpuinfo.read_text().split())
    except OSError:
        return None
    level = "sse41"
    if "avx2" in flags:
        level = "avx2_vnni" if "avx_vnni" in flags else "avx2"
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        level = "avx512_core"
        if "avx512_vnni" in flags:
            level = "avx512_core_vnni"
            if "avx512_bf16" in flags:
                level = "avx512_core_bf16"
                if {"amx_int8", "amx_bf16", "amx_tile"} <= flags:
                    level = "avx512_core_amx"
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "") if cap is None else cap
    if cap.strip().lower() in ISA_LEVELS:
        level = ISA_LEVELS[min(ISA_LEVELS.index(level), ISA_LEVELS.index(cap.strip().lower()))]
    return level

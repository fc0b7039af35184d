"""The bundle's count of usable CPUs: the affinity mask, reduced to a cgroup CPU quota (either cgroup version)."""

from __future__ import annotations

import os

import pytest
import scripts.common.cpus as cpus


def test_usable_cpus_are_the_affinity_mask_reduced_to_a_cgroup_quota(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5}, raising=False)
    monkeypatch.setattr(cpus, "cgroup_cpu_quota", lambda root: None)
    assert cpus.usable_cpus() == 6, "the affinity mask (taskset, SLURM's binding)"
    monkeypatch.setattr(cpus, "cgroup_cpu_quota", lambda root: 2.5)
    assert cpus.usable_cpus() == 3, "a container's CPU quota (Docker --cpus 2.5), rounded up"
    monkeypatch.setattr(cpus, "cgroup_cpu_quota", lambda root: 0.5)
    assert cpus.usable_cpus() == 1


@pytest.mark.parametrize(
    ("files", "quota"),
    [({"cpu.max": "150000 100000\n"}, 1.5), ({"cpu.max": "max 100000\n"}, None), ({"cpu.max": "5 0\n"}, None),
     ({"cpu/cpu.cfs_quota_us": "200000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 2.0),
     ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None), ({}, None)],
    ids=["cgroup2 quota", "cgroup2 no quota", "cgroup2 zero period", "cgroup1 quota", "cgroup1 no quota", "no cgroup"],
)  # fmt: skip
def test_the_cgroup_cpu_quota_is_read_from_both_cgroup_versions(tmp_path, files, quota):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cpus.cgroup_cpu_quota(tmp_path) == quota


AVX512_CORE = "avx2 avx512f avx512bw avx512vl avx512dq"


@pytest.mark.parametrize(
    ("flags", "cap", "isa"),
    [
        ("fma avx avx2", "", "avx2"),  # a Zen 3, a Haswell: int8 products summed in 16 bits
        ("avx2 avx_vnni", "", "avx2_vnni"),  # an Alder Lake
        (AVX512_CORE, "", "avx512_core"),  # a Skylake-SP: AVX-512 without VNNI
        (AVX512_CORE + " avx512_vnni avx512_bf16", "", "avx512_core_bf16"),  # a Zen 4
        (AVX512_CORE + " avx512_vnni avx512_bf16 amx_tile amx_int8 amx_bf16", "", "avx512_core_amx"),  # Sapphire R.
        (AVX512_CORE + " avx512_vnni avx512_bf16", "AVX2", "avx2"),  # oneDNN's cap
        (AVX512_CORE + " avx512_vnni avx512_bf16", "avx512_core", "avx512_core"),
        ("avx2", "AVX512_CORE_AMX", "avx2"),  # a cap above the CPU changes nothing
        ("avx2", "ALL", "avx2"),  # a cap this bundle does not rank is left to oneDNN
        ("sse4_2", "", "sse41"),
    ],
)
def test_the_cpus_instruction_set_level_is_its_flags_capped_as_onednn_caps_it(tmp_path, flags, cap, isa):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: fpu {flags}\n")
    assert cpus.cpu_isa(cpuinfo, cap) == isa
    assert (isa in cpus.INT8_VNNI) == (isa not in ("avx2", "avx512_core", "sse41"))


def test_without_cpu_flags_the_level_is_unknown_and_the_runtime_decides(tmp_path, monkeypatch):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert cpus.cpu_isa(tmp_path / "missing") is None
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("flags : avx2 avx512f avx512bw avx512vl avx512dq avx512_vnni\n")
    assert cpus.cpu_isa(cpuinfo) == "avx2", "the environment's cap, as oneDNN reads it"

"""The bundle's count of usable CPUs: the affinity mask, reduced to a cgroup CPU quota (either cgroup version)."""

from __future__ import annotations

import os

import pytest
import scripts.cpus as cpus


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

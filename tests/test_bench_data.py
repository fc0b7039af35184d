"""bench_data's prepare timing: prepare and a bare pydicom read timed in fresh child processes, on cases it writes."""

from __future__ import annotations

import numpy as np
import pytest
from benchmarks import bench_data


@pytest.fixture(scope="module")
def dicom_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bench_data") / "dicom"
    bench_data._write_cases(folder, 2, (64, 64, 20))
    return folder


def test_the_bare_read_stacks_every_slice_in_position_order(dicom_dir):
    image_dir = sorted((dicom_dir / bench_data.COLLECTION).glob("*/*/image"))[0]
    volume = bench_data.bare_read(image_dir)
    assert volume.shape == (20, 64, 64)
    assert np.ptp(volume) > 0  # decoded pixels, not an empty buffer


def test_prepare_and_the_bare_read_are_timed_per_case_in_fresh_processes(dicom_dir, tmp_path):
    timing = bench_data._time_prepare(dicom_dir, tmp_path / "prepared", rounds=1, passes=1)
    assert [len(timing["passes"][kind]) for kind in ("bare", "prepare")] == [1, 1]  # one pass in one child each
    for key in ("bare_pydicom_read_s_per_case", "prepare_s_per_case", "prepare_cpu_s_per_case"):
        assert 0 < timing[key] < 30
    # the ratio is of the unrounded times; each time is rounded to 1 ms, which at a few ms a case moves it by ~10 %
    wall, bare, half_ms = timing["prepare_s_per_case"], timing["bare_pydicom_read_s_per_case"], 0.0005
    assert (wall - half_ms) / (bare + half_ms) - 0.005 <= timing["ratio"] <= (wall + half_ms) / (bare - half_ms) + 0.005
    assert (tmp_path / "prepared" / "datalist.json").is_file()  # prepare really ran, in the child
    epochs = {"first_epoch_s": 1.0, "steady_epoch_s": 1.0, "speedup_vs_original": 1.0, "peak_rss_mb": 1.0}
    approaches = {name: {**epochs, "cached_mb_per_case": 1.0} for name in bench_data.APPROACHES}
    report = bench_data.format_report({"cases": 2, "shape": [64, 64, 20], "cpus": 2, "prepare": timing, **approaches})
    assert f"({timing['ratio']:.2f}x); CPU" in report

"""benchmarks.bench_host: the host's time and host reads of a training step on the meta device; the batch with a
NIfTI CT's metadata is read to the host thousands of times a step through SwinUNETR's attention, the plain one never."""

from __future__ import annotations

import re

from benchmarks import bench_host


def test_the_metatensor_batch_is_read_to_the_host_and_the_plain_one_is_not(capsys):
    bench_host.main(["--feature_size", "12", "--patches", "2", "--roi", "64", "--steps", "1"])
    rows = dict(re.findall(r"\| (MetaTensor|plain) \(\w+\) \| [0-9.]+ \| (\d+) \|", capsys.readouterr().out))
    assert int(rows["MetaTensor"]) > 1000 and int(rows["plain"]) == 0, rows

"""benchmarks/bench_switches.py: rows that cannot run here are recorded with the reason (no GPU, the deadline) without
building anything, and the table puts each row against the first that ran."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from benchmarks.bench_switches import SWITCH_SETS, overrides, run, run_rows, table_of
from monai.bundle import ConfigParser

CONFIGS = [str(Path(__file__).resolve().parents[1] / "configs" / name) for name in ("train.yaml", "benchmark.yaml")]

GPU_SET = "amp bfloat16"
CPU_SET = "bundle defaults (cache auto)"


def test_rows_past_the_deadline_or_without_a_gpu_are_skipped_with_the_reason(tmp_path):
    seen = []
    records = run_rows([CPU_SET, GPU_SET], [], {}, tmp_path, deadline=time.monotonic() + 5,
                       estimate_s={CPU_SET: 60}, progress=lambda r: seen.append(len(r)))  # fmt: skip
    assert records[0]["status"] == "skipped" and records[0]["reason"].startswith("budget: ~60 s more")
    if not torch.cuda.is_available():
        assert records[1] == {"set": GPU_SET, "switches": SWITCH_SETS[GPU_SET][0], "status": "skipped",
                              "reason": "no GPU"}  # fmt: skip
    assert seen == [1, 2], "the records are handed on after every row"
    assert not list(tmp_path.iterdir()), "nothing was run"


def test_table_puts_each_row_against_the_first_that_ran():
    def report(patches_per_s: float, busy: float | None) -> dict:
        result = {"ms_per_step_median": 1000 / patches_per_s, "ms_per_step_p90": 1100 / patches_per_s,
                  "patches_per_s": patches_per_s, "data_wait_fraction": 0.05, "gpu_busy_fraction": busy,
                  "peak_memory_gib": 17.5, "first_step_s": 4.0}  # fmt: skip
        return {"result": result, "device": {"device_name": "NVIDIA H200", "backend": "cuda"}}

    records = [{"set": "a", "status": "skipped", "reason": "no GPU"},
               {"set": "b", "status": "ok", "report": report(10.0, None)},
               {"set": "c", "status": "ok", "report": report(25.0, 0.9)}]  # fmt: skip
    table = table_of(records).splitlines()
    assert table[0].startswith("device: NVIDIA H200 (cuda)")
    assert table[4] == "| a | skipped: no GPU | | | | | | | |"
    assert table[5].endswith("| n/a | 17.50 | 4.0 | 1.00x |") and table[6].endswith("| 90.0% | 17.50 | 4.0 | 2.50x |")


@pytest.mark.parametrize("name", sorted(SWITCH_SETS))
def test_every_set_gives_the_config_values_of_the_types_it_reads(name):
    """A row is a GPU row (skipped here), so its overrides are checked on the config itself: each id parses to the
    type train.yaml's own value has (the H200 run's "8 patches" rows failed on num_samples "8", a string) or, for a
    switch, to a string the bundle reads as a bool."""
    defaults = ConfigParser()
    defaults.read_config(CONFIGS)
    parser = ConfigParser()
    parser.read_config(CONFIGS)
    parser.update(overrides(name))
    for key in SWITCH_SETS[name][0]:
        default, value = defaults.get_parsed_content(key), parser.get_parsed_content(key)
        if isinstance(default, bool):
            assert value in (True, False, "true", "false"), (key, value)
        elif key == "num_workers":  # "auto" or a count
            assert isinstance(value, int), (key, value)
        else:
            assert type(value) is type(default), (key, value, default)
    if "num_samples" in SWITCH_SETS[name][0]:
        assert parser.get_parsed_content("num_samples") == int(SWITCH_SETS[name][0]["num_samples"])


def test_an_only_that_matches_no_row_and_a_misspelt_option_fail_naming_the_choices(tmp_path):
    """--only "channel_last" printed an empty table with status 0; --onlyy reached every row as a new config id.
    Both now fail before any row runs."""
    from scripts.common.config import ConfigError

    with pytest.raises(SystemExit, match=r"--only 'channel_last' is in no row's name; the rows: .*channels_last"):
        run(output_dir=str(tmp_path), only="channel_last")
    with pytest.raises(ConfigError, match=r"--onlyy: no config of the bundle defines that id"):
        run(output_dir=str(tmp_path), onlyy="channels_last")
    assert not list(tmp_path.iterdir()), "no row ran"

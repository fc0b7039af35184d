"""benchmarks/bench_switches.py: rows that cannot run here are recorded with the reason (no GPU, the deadline) without
building anything, and the table puts each row against the first that ran."""

from __future__ import annotations

import time

import torch
from benchmarks.bench_switches import SWITCH_SETS, run_rows, table_of

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

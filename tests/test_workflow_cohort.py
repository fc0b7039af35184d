"""inference.yaml over a cohort, as a user runs it: torchrun's two ranks as two parts side by side, a part run again
by --num_parts/--part_id (another setting infers again: tests/test_cohort.py); a run killed at each stage of a case,
and run again. Every case is in the cohort's report once, done once, and its outputs are those of an uninterrupted
run."""

from __future__ import annotations

import csv
import json
import subprocess
from pathlib import Path

import pytest
from conftest import ROOT, bundle_run, configs, foreign_folder, torchrun
from scripts.data.synthetic import write_case

DEMO_INFERENCE = configs("inference.yaml", "demo.yaml")
CASES = ["LUNG1-001", "LUNG1-002", "LUNG1-003", "LUNG1-004"]


@pytest.fixture(scope="module")
def cohort(demo_run, tmp_path_factory) -> tuple[Path, str]:
    """Four unseen synthetic CTs of two sizes, and the demo's weights."""
    inputs = tmp_path_factory.mktemp("cohort_in")
    for k, case in enumerate(CASES):  # two of 24 slices, two of 48
        write_case(inputs / case, case, 91 + k, (96, 96, 24 * (1 + k // 2)), (1.0, 1.0), tumour_hu=400)
    return inputs, str(demo_run[0] / "run" / "model.pt")


def inference(inputs: Path, weights: str, out: Path, *more: str, config: str = DEMO_INFERENCE) -> list[str]:
    return ["inference", "--config_file", config, "--input_dir", str(inputs), "--output_dir", str(out),
            "--model_path", weights, *more]  # fmt: skip


def report(out: Path) -> dict:
    return json.loads((out / "inference_report.json").read_text())


def labels(out: Path) -> dict[str, bytes]:
    return {case: (out / case / f"{case}_seg.nii.gz").read_bytes() for case in CASES}


@pytest.fixture(scope="module")
def side_by_side(cohort, tmp_path_factory) -> tuple[Path, str, dict[str, bytes]]:
    """torchrun's two ranks as parts 0 and 1 of 2, at once into one folder: the log, and the label maps written."""
    inputs, weights = cohort
    out = tmp_path_factory.mktemp("cohort_out")
    command, env = torchrun(
        ["--standalone", "--nproc_per_node", "2"],
        ["-m", "monai.bundle", "run", *inference(inputs, weights, out), "--bundle_root", str(ROOT)],
    )
    run = subprocess.run(command, cwd=foreign_folder(), capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return out, run.stdout + run.stderr, labels(out)


def test_two_parts_at_once_give_one_report_with_each_case_once(side_by_side):
    """torchrun's ranks are the parts, each on its share of the CPU cores; the report merged as each ended."""
    out, log, _ = side_by_side
    merged = report(out)
    assert [c["case_id"] for c in merged["cases"]] == CASES and merged["num_done"] == 4
    assert {c["part"] for c in merged["cases"]} == {"0-of-2", "1-of-2"} and all(c["host"] for c in merged["cases"])
    assert set(merged["parts"]) == {"0-of-2", "1-of-2"} and all(p["ended"] for p in merged["parts"].values())
    parts = {part: sorted(c["case_id"][-1] for c in merged["cases"] if c["part"] == part) for part in merged["parts"]}
    small_and_large = [len(cases) == 2 and cases[0] in "12" and cases[1] in "34" for cases in parts.values()]
    assert all(small_and_large), f"each part a small and a large CT: {parts}"
    rows = list(csv.DictReader((out / "report.csv").open()))
    assert sorted(r["case"] for r in rows) == CASES
    for k in (0, 1):
        assert f"rank {k} of 2 on this node: CPU cores" in log
        assert f"part {k} of 2: 2 case(s) of 4; 0 done earlier" in log and f"part {k} of 2: 2/2 cases" in log
    assert "cases per hour" in log


def test_run_again_a_part_infers_nothing(cohort, side_by_side):
    inputs, weights = cohort
    out, _, _ = side_by_side
    again = bundle_run(*inference(inputs, weights, out, "--num_parts", "2", "--part_id", "1"))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "part 1 of 2: 2 case(s) of 4; 2 done earlier with the same weights and settings, 0 to infer" in (
        again.stdout + again.stderr
    )
    merged = report(out)
    assert merged["num_done"] == 4 and merged["num_done_earlier"] == 2
    assert all(Path(path).is_file() for c in merged["cases"] if c.get("earlier") for path in c["outputs"].values())
    assert len(list(csv.DictReader((out / "report.csv").open()))) == 4, "the earlier cases keep their rows"


KILLS = {
    "read": "kill_read: {_target_: faults.KilledReading, case_id: LUNG1-001}\n"
    'dataset#load: "$monai.transforms.Compose([@kill_read, @load_case])"\n',
    "predict": 'evaluator#inferer: {_target_: faults.KilledPredicting, inferer: "@sliding_window_inferer", '
    "marker: LUNG1-002}\n",
    "write": "save_case#_target_: faults.SaveCasedKilledFor\nsave_case#kill_case: LUNG1-003\n",
}


def test_a_run_killed_at_each_stage_then_run_again_does_each_case_once_as_an_uninterrupted_run(
    cohort, side_by_side, tmp_path
):
    """kill -9 while a case is read, then while the network runs on another, then once a third's outputs are staged;
    the fourth run finishes: every case done once, its label map byte for byte the uninterrupted run's."""
    inputs, weights = cohort
    out = tmp_path / "out"
    for stage, fault in KILLS.items():
        extra = tmp_path / f"kill_{stage}.yaml"
        extra.write_text(fault)
        killed = bundle_run(*inference(inputs, weights, out, config=DEMO_INFERENCE[:-1] + f", '{extra}']"),
                            with_faults=True)  # fmt: skip
        assert killed.returncode == -9, f"{stage}: {killed.returncode} {killed.stderr[-2000:]}"
    assert any(p.name.startswith(".partial-") for p in out.iterdir()), "the write kill left its staging folder"
    done = bundle_run(*inference(inputs, weights, out))
    assert done.returncode == 0, done.stderr[-3000:]
    merged = report(out)
    assert [c["case_id"] for c in merged["cases"]] == CASES and merged["num_done"] == 4
    assert sum(bool(c.get("earlier")) for c in merged["cases"]) == 2, "two cases finished before the kills"
    assert labels(out) == side_by_side[2]
    assert not [p.name for p in out.iterdir() if p.name.startswith((".partial-", ".old-"))]

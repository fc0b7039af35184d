"""A cohort in parts: the split covers every case once and balances slices, a case counts as done only with complete
outputs of the same key, one part cannot run twice at once, and the merge gives every case once whatever order the
parts end in, however many merge at once."""

from __future__ import annotations

import itertools
import json
import multiprocessing
import subprocess
import sys
import time
from pathlib import Path

import pytest
from scripts.common import files
from scripts.common.config import ConfigError
from scripts.inference import cohort
from scripts.inference.cohort import Part, done_earlier, merge, outputs_key, split, take_part, write_run_record
from scripts.inference.records import read_run_report, write_run_report


def test_every_case_is_in_one_part_and_the_parts_are_balanced_by_slices():
    sizes = {f"LUNG1-{i:03d}": s for i, s in enumerate([900, 90, 95, 100, 110, 120, 130, 140, 800, 85, 300, 310])}
    for count in (1, 2, 3, 5):
        parts = split(sizes, count)
        assert set(parts) == set(sizes) and set(parts.values()) <= set(range(count))
        load = [sum(s for c, s in sizes.items() if parts[c] == p) for p in range(count)]
        assert max(load) - min(load) <= max(sizes.values()), load  # greedy: within one case of even
    two = split(sizes, 2)
    assert two["LUNG1-000"] != two["LUNG1-008"], "the two large CTs go to different parts, not by count"
    shuffled = dict(reversed(list(sizes.items())))
    assert split(shuffled, 3) == split(sizes, 3), "the same split whatever order the cases were found in"


def test_the_part_comes_from_the_options_or_from_torchrun(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert Part.of(4, 3) == Part(3, 4) and Part.of("2", "1") == Part(1, 2)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert Part.of() == Part(1, 2)
    assert Part.of(3, 2) == Part(2, 3), "given options win over torchrun's"
    with pytest.raises(ConfigError, match="--part_id must be 0 to num_parts - 1"):
        Part.of(2, 2)


def finished_case(out: Path, case_id: str, key: dict) -> None:
    """A case's outputs as SaveCased leaves them: its files, then its run record, in its folder."""
    folder = out / case_id
    folder.mkdir(parents=True)
    (folder / f"{case_id}_seg.nii.gz").write_bytes(b"labels")
    (folder / f"{case_id}_report.json").write_text(json.dumps({"structures": {}}))
    outputs = {"nifti": str(folder / f"{case_id}_seg.nii.gz"), "report": str(folder / f"{case_id}_report.json")}
    write_run_record(folder, case_id, key, outputs)


KEY = {"key": "a" * 64, "depends_on": {"weights_sha256": ["a"]}}


def test_a_case_is_done_only_with_all_its_outputs_and_the_same_key(tmp_path):
    finished_case(tmp_path, "LUNG1-001", KEY)
    assert set(done_earlier(tmp_path, "LUNG1-001", KEY["key"])["outputs"]) == {"nifti", "report"}
    assert done_earlier(tmp_path, "LUNG1-001", "b" * 64) is None, "other weights or settings: infer again"
    (tmp_path / "LUNG1-001" / "LUNG1-001_report.json").unlink()
    assert done_earlier(tmp_path, "LUNG1-001", KEY["key"]) is None, "an output missing: infer again"
    assert done_earlier(tmp_path, "LUNG1-404", KEY["key"]) is None


def found(out: Path, part: Part, case_ids: list[str]) -> list[dict]:
    """What the finder leaves: every case found, pending, in the part's report; the cases it returns."""
    cases = [{"case_id": c, "image": f"/in/{c}", "source": "dicom", "slice_paths": ["x"] * (100 + i)}
             for i, c in enumerate(case_ids)]  # fmt: skip
    report = {"input_dir": "/in", "cases": [{**c, "status": "pending"} for c in cases], "skipped": []}
    write_run_report(part.folder(out), report)
    return cases


def run_part(out: Path, part: Part, case_ids: list[str], redo: bool = False) -> list[str]:
    todo = take_part(found(out, part, case_ids), part.count, part.index, out, KEY, redo)
    return [c["case_id"] for c in todo]


def test_a_part_skips_what_an_earlier_run_finished_and_redo_infers_it_again(tmp_path):
    ids = [f"LUNG1-{i:03d}" for i in range(6)]
    finished_case(tmp_path, "LUNG1-002", KEY)
    (tmp_path / ".partial-999-LUNG1-003").mkdir()  # a run killed while writing LUNG1-003
    todo = run_part(tmp_path, Part(0, 1), ids)
    assert todo == [c for c in ids if c != "LUNG1-002"]
    assert not (tmp_path / ".partial-999-LUNG1-003").exists(), "what the killed run left is removed"
    report = read_run_report(Part(0, 1).folder(tmp_path))
    earlier = [c for c in report["cases"] if c.get("earlier")]
    assert [c["case_id"] for c in earlier] == ["LUNG1-002"] and earlier[0]["status"] == "done"
    assert earlier[0]["outputs"]["nifti"].endswith("LUNG1-002/LUNG1-002_seg.nii.gz")
    assert run_part(tmp_path, Part(0, 1), ids, redo=True) == ids, "again in the same process: its lock is its own"


def test_another_setting_makes_every_case_done_earlier_inferred_again(tmp_path):
    """outputs_key: the same weights and settings give the same key; another setting (the window overlap) another,
    under which a part infers again every case that a run with the first finished."""
    weights = tmp_path / "model.pt"
    weights.write_bytes(b"weights")
    record = {"models": [str(weights)], "backend": "onnxruntime", "precision": "f32"}
    settings = {"roi_size": [96, 96, 32], "sw_overlap": 0.25, "outputs": {"nifti": True, "report": True}}
    key = outputs_key([weights], record, settings)
    assert outputs_key([weights], dict(record), dict(settings)) == key, "the same weights and settings: the same key"
    other = outputs_key([weights], record, {**settings, "sw_overlap": 0.5})
    assert other["key"] != key["key"]
    out, ids = tmp_path / "out", ["LUNG1-001", "LUNG1-002"]
    for case_id in ids:
        finished_case(out, case_id, key)
    assert take_part(found(out, Part(0, 1), ids), 1, 0, out, key) == [], "the same settings: every case done earlier"
    todo = take_part(found(out, Part(0, 1), ids), 1, 0, out, other)
    assert [c["case_id"] for c in todo] == ids, "another setting: every case inferred again"


def test_a_second_run_of_the_same_part_stops_naming_the_first(tmp_path):
    """The first holds the part's lock in another process; the second is refused with who holds it."""
    folder = Part(1, 2).folder(tmp_path)
    code = (
        f"import time; from pathlib import Path; from scripts.inference.cohort import lock_part; "
        f"lock_part(Path({str(folder)!r})); print('held', flush=True); time.sleep(60)"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).parents[1])  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        refused = rf"part 1-of-2: already running into .* \(process {holder.pid} on "
        with pytest.raises(cohort.PartLockedError, match=refused):
            cohort.lock_part(folder)
    finally:
        holder.kill()
        holder.wait()
    cohort.lock_part(folder)  # its lock went with the killed process
    files._HELD.pop(folder / "lock").close()


def part_reports(out: Path, count: int, ids: list[str], parts: list[int] | None = None) -> None:
    """Each part's finished report (of ``parts``; None: all): its cases done, the first case failed."""
    assigned = split(dict.fromkeys(ids, 1.0), count)
    for index in range(count) if parts is None else parts:
        mine = [c for c in ids if assigned[c] == index]
        cases = [{"case_id": c, "status": "failed" if c == ids[0] else "done", "part": f"{index}-of-{count}"}
                 for c in mine]  # fmt: skip
        for c in mine:
            if c != ids[0]:
                finished_case(out, c, KEY)
        report = {"input_dir": "/in", "cases": cases, "skipped": [], "started": time.time() - 60, "ended": time.time()}
        write_run_report(Part(index, count).folder(out), {**report, "skipped": [{"input": "x"}] if index == 0 else []})


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_the_merge_lists_each_case_once_whatever_order_the_parts_end_in(tmp_path, order):
    ids = [f"LUNG1-{i:03d}" for i in range(7)]
    assigned, present = split(dict.fromkeys(ids, 1.0), 3), []
    for ended in order:  # each part merges as it ends: the parts present so far
        part_reports(tmp_path, 3, ids, [ended])
        present.append(ended)
        merged = merge(tmp_path, 3)
        assert [c["case_id"] for c in merged["cases"]] == [c for c in ids if assigned[c] in present]
    assert [c["case_id"] for c in merged["cases"]] == ids
    assert merged["num_done"] == 6 and merged["num_failed"] == 1 and len(merged["skipped"]) == 1
    assert set(merged["parts"]) == {"0-of-3", "1-of-3", "2-of-3"}
    rows = (tmp_path / "report.csv").read_text().splitlines()
    assert rows[0].startswith("case,") and len(rows) == 1, "no structure in these reports: the header alone"


def _merge(out: str) -> int:
    return len(merge(out, 4)["cases"])


def test_merges_at_once_never_lose_or_repeat_a_case(tmp_path):
    ids = [f"LUNG1-{i:03d}" for i in range(20)]
    part_reports(tmp_path, 4, ids)
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        assert pool.map(_merge, [str(tmp_path)] * 8) == [20] * 8
    assert [c["case_id"] for c in read_run_report(tmp_path)["cases"]] == ids


def test_parts_made_with_other_weights_are_listed_stale_never_mixed_into_the_results(tmp_path, caplog):
    ids = [f"LUNG1-{i:03d}" for i in range(4)]
    part_reports(tmp_path, 2, ids)
    newer = read_run_report(Part(1, 2).folder(tmp_path))
    older = read_run_report(Part(0, 2).folder(tmp_path))
    write_run_report(Part(0, 2).folder(tmp_path), {**older, "outputs_key": KEY, "started": newer["started"] - 3600})
    write_run_report(Part(1, 2).folder(tmp_path), {**newer, "outputs_key": {**KEY, "key": "b" * 64}})
    merged = merge(tmp_path, 2)
    stale = [c for c in merged["cases"] if c["status"] == "stale"]
    assert stale and {c["part"] for c in stale} == {"0-of-2"} and merged["num_stale"] == len(stale)
    assert "run part(s) 0-of-2 again" in stale[0]["reason"] and "run part(s) 0-of-2 again" in caplog.text
    rows = {r.split(",")[0] for r in (tmp_path / "report.csv").read_text().splitlines()[1:]}
    assert not rows & {c["case_id"] for c in stale}

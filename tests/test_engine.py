"""One case never ends a batch run: a case that fails while being read, preprocessed, predicted, post-processed or
written is recorded with its stage and reason, leaves nothing half-written, and every other case is processed."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from monai.data import DataLoader, MetaTensor
from monai.handlers import MeanDice, from_engine
from monai.inferers import SimpleInferer
from monai.transforms import AsDiscreted, Compose
from scripts.inference.engine import CaseByCaseEvaluator
from scripts.inference.inputs import CaseDataset
from scripts.inference.outputs import InferenceSummary, SaveCased, exit_on_failures
from scripts.inference.records import write_run_report

CASES = ["good-1", "unreadable", "bad-shape", "unwritable", "good-2"]


def load(item: dict) -> dict:
    """A loader that reads 'unreadable' as a cut file, and gives 'bad-shape' an image the network refuses."""
    if item["case_id"] == "unreadable":
        raise OSError(f"{item['image']}: truncated pixel data")
    size = 7 if item["case_id"] == "bad-shape" else 8
    image = MetaTensor(torch.rand(1, size, 8, 8), affine=torch.eye(4), meta={"original_affine": torch.eye(4)})
    return {**item, "image": image, "label": (image > 0.5).float()}


class EvenSizesOnly(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[2] % 2:
            raise RuntimeError(f"odd size {tuple(x.shape)}")
        return torch.cat([1 - x, x], dim=1)


class FullDiskFor(SaveCased):
    """The writer, with the disk full after the first file of one case."""

    def __init__(self, case_id: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.case_id = case_id

    def _write(self, d: dict, tensor, case_id: str, folder):
        files = super()._write(d, tensor, case_id, folder)
        if case_id == self.case_id:
            raise OSError("disk full")
        return files


def evaluated(names: list[str], out, after_writing, **kwargs) -> CaseByCaseEvaluator:
    """The cases ``names`` (pending in ``out``'s inference_report.json) run case by case, ``after_writing`` being
    the post-processing after the class decision; ``kwargs`` go to the evaluator."""
    data = [{"case_id": c, "image": f"/data/{c}", "source": "nifti", "source_path": f"/data/{c}"} for c in names]
    write_run_report(out, {"cases": [{**d, "status": "pending"} for d in data], "skipped": []})
    evaluator = CaseByCaseEvaluator(
        device=torch.device("cpu"),
        val_data_loader=DataLoader(CaseDataset(data, load=load), batch_size=1, num_workers=0),
        network=EvenSizesOnly(),
        inferer=SimpleInferer(),
        postprocessing=Compose([AsDiscreted(keys="pred", argmax=True), after_writing]),
        val_handlers=[InferenceSummary(out)],
        decollate=True,
        **kwargs,
    )
    evaluator.run()
    return evaluator


@pytest.fixture
def run(tmp_path):
    (tmp_path / "unwritable").mkdir()
    (tmp_path / "unwritable" / "earlier.txt").write_text("outputs of an earlier run")
    writer = FullDiskFor("unwritable", keys="pred", output_dir=tmp_path, labels=["GTV-1"], write_seg=False)
    dice = MeanDice(output_transform=from_engine(["pred", "label"]), include_background=True)
    return tmp_path, evaluated(CASES, tmp_path, writer, key_val_metric={"dice": dice})


def test_each_failing_case_is_recorded_with_its_stage_and_the_others_run(run):
    out, evaluator = run
    stages = {f["case_id"]: f["stage"] for f in evaluator.failures}
    assert stages == {"unreadable": "read", "bad-shape": "predict", "unwritable": "write"}
    report = json.loads((out / "inference_report.json").read_text())
    status = {c["case_id"]: c["status"] for c in report["cases"]}
    assert status == {"good-1": "done", "unreadable": "failed", "bad-shape": "failed", "unwritable": "failed",
                      "good-2": "done"}  # fmt: skip
    reasons = {c["case_id"]: c.get("reason", "") for c in report["cases"]}
    assert "truncated pixel data" in reasons["unreadable"] and "/data/unreadable" in reasons["unreadable"]
    assert "odd size" in reasons["bad-shape"] and "disk full" in reasons["unwritable"]
    assert report["num_done"] == 2 and report["num_failed"] == 3


def test_a_case_failing_while_written_leaves_its_earlier_outputs_and_no_partial_files(run):
    out, _ = run
    assert [p.name for p in (out / "unwritable").iterdir()] == ["earlier.txt"]
    assert not [p for p in out.iterdir() if p.name.startswith(".")], "no staging folder left behind"
    assert (out / "good-2" / "good-2_seg.nii.gz").is_file()


def test_the_metric_counts_only_the_cases_that_ran(run):
    _, evaluator = run
    assert 0 <= evaluator.state.metrics["dice"] <= 1


def test_exit_status_says_whether_any_case_failed(run, tmp_path):
    out, _ = run
    with pytest.raises(SystemExit, match=r"3 case\(s\) failed: unreadable \(read\)"):
        exit_on_failures(out / "inference_report.json")
    (tmp_path / "clean.json").write_text(json.dumps({"cases": [{"case_id": "a", "status": "done"}], "failed": []}))
    assert exit_on_failures(tmp_path / "clean.json") is None


def test_failure_records_travel_through_dataloader_workers(tmp_path):
    data = [{"case_id": "unreadable", "image": "/data/x"}, {"case_id": "good-1", "image": "/data/y"}]
    batches = list(DataLoader(CaseDataset(data, load=load), batch_size=1, num_workers=1))
    assert batches[0]["failure_stage"] == ["read"] and "truncated" in batches[0]["failure_reason"][0]
    assert np.asarray(batches[1]["image"]).shape == (1, 1, 8, 8, 8)


class ArchiveRefused(RuntimeError):
    """An error that names its own stage, as scripts.inference.dicomweb's store errors do."""

    stage = "store"


def test_an_error_naming_its_stage_is_recorded_there_and_every_case_is_handed_on_when_finished(tmp_path):
    names = ["good-1", "unreadable", "unstorable", "bad-shape"]
    finished = []

    def store(d: dict) -> dict:  # after the writer: the archive refuses one case
        if d["case_id"] == "unstorable":
            raise ArchiveRefused("the archive said no")
        return d

    def case_done(case: dict) -> None:  # e.g. removing the case's retrieved series; its own failure ends nothing
        finished.append(case["case_id"])
        if case["case_id"] == "good-1":
            raise OSError("cannot remove the folder")

    evaluator = evaluated(names, tmp_path, store, on_case_done=case_done)
    assert {f["case_id"]: f["stage"] for f in evaluator.failures} == {
        "unreadable": "read", "unstorable": "store", "bad-shape": "predict"
    }  # fmt: skip
    assert finished == names, "every case, done or failed, once"
    report = {c["case_id"]: c for c in json.loads((tmp_path / "inference_report.json").read_text())["cases"]}
    assert report["good-1"]["status"] == "done"
    assert report["unstorable"]["stage"] == "store" and "the archive said no" in report["unstorable"]["reason"]

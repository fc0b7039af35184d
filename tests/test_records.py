"""A case's record and the run's report: a failed case listed with its stage and reason, the report written, read
(an empty one where there is none) and completed case by case. Per-case items of an evaluator iteration: batch and
output dicts merged case by case (a list or a single dict; mismatched lengths fall back to the outputs), label maps
from one-hot or single-channel tensors, and the case id from ``case_id`` or the image's file name."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from monai.data import MetaTensor
from scripts.inference.records import (
    REPORT,
    Case,
    as_failed,
    case_id_of,
    label_map,
    merged_items,
    read_run_report,
    report_path,
    update_run_report,
    write_run_report,
)


def test_a_failed_case_keeps_its_record_and_says_where_and_why():
    case = Case(case_id="A", image="/in/A", source="dicom", reason="its own")
    assert as_failed(case, "check") == {**case, "status": "failed", "stage": "check"}
    assert list(as_failed(case, "check", "another")) == ["case_id", "image", "source", "reason", "status", "stage"]
    assert as_failed(Case(case_id="B"), "read", "why")["reason"] == "why"


def test_the_run_report_is_written_read_and_completed_case_by_case(tmp_path):
    assert read_run_report(tmp_path) == {"cases": [], "skipped": []}
    update_run_report(tmp_path, {"A": {"store": "x"}})
    assert not report_path(tmp_path).exists(), "no report: nothing to complete, none made"
    write_run_report(tmp_path, {"cases": [Case(case_id="A"), Case(case_id="B")], "skipped": []})
    assert report_path(tmp_path) == tmp_path / REPORT == tmp_path / "inference_report.json"
    update_run_report(tmp_path, {"B": {"store": {"status": "stored"}}, "C": {"store": "not in the report"}})
    written = json.loads(report_path(tmp_path).read_text())
    assert (
        written
        == read_run_report(tmp_path)
        == {"cases": [{"case_id": "A"}, {"case_id": "B", "store": {"status": "stored"}}], "skipped": []}
    )


def engine_with(batch, output) -> SimpleNamespace:
    return SimpleNamespace(state=SimpleNamespace(batch=batch, output=output))


def test_list_batches_and_outputs_merge_case_by_case_output_winning():
    batch = [{"case_id": "A", "image": "raw A", "source": "dicom"}, {"case_id": "B", "image": "raw B"}]
    output = [{"image": "net A", "pred": 1}, {"image": "net B", "pred": 2}]
    items = merged_items(engine_with(batch, output))
    assert items == [
        {"case_id": "A", "image": "net A", "source": "dicom", "pred": 1},
        {"case_id": "B", "image": "net B", "pred": 2},
    ]


def test_single_batch_and_output_give_one_item():
    items = merged_items(engine_with({"case_id": "A", "label": 0}, {"pred": 1}))
    assert items == [{"case_id": "A", "label": 0, "pred": 1}]


@pytest.mark.parametrize(
    "batch", [[{"case_id": "A"}], {"case_id": ["A", "B"]}], ids=["fewer-batch-items", "collated-batch-dict"]
)
def test_batch_that_does_not_line_up_falls_back_to_the_outputs(batch):
    output = [{"pred": 1}, {"pred": 2}]
    items = merged_items(engine_with(batch, output))
    assert items == [{"pred": 1}, {"pred": 2}]
    items[0]["pred"] = 99
    assert output[0]["pred"] == 1, "items are copies: handlers may add keys without touching the engine's output"


def test_one_hot_tensor_becomes_its_argmax_label_map():
    labels = np.zeros((4, 5, 6), np.uint8)
    labels[1:3, 1:4, 2:5] = 1
    labels[0, 0, 0] = 2
    one_hot = torch.nn.functional.one_hot(torch.from_numpy(labels).long(), 3).permute(3, 0, 1, 2).float()
    result = label_map(one_hot)
    assert result.dtype == np.uint8 and result.shape == (4, 5, 6)
    np.testing.assert_array_equal(result, labels)


@pytest.mark.parametrize("wrap", [torch.from_numpy, lambda a: a, lambda a: MetaTensor(torch.from_numpy(a))])
def test_single_channel_label_map_is_squeezed_to_three_axes(wrap):
    labels = np.random.default_rng(0).integers(0, 3, (1, 4, 5, 6)).astype(np.float32)
    result = label_map(wrap(labels))
    assert result.dtype == np.uint8 and result.shape == (4, 5, 6)
    np.testing.assert_array_equal(result, labels[0])


def test_label_map_of_a_tensor_that_requires_grad():
    logits = torch.zeros(2, 2, 2, 2, requires_grad=True)
    with torch.no_grad():
        logits[1, 0, 0, 0] = 1.0
    assert label_map(logits * 1.0).sum() == 1


def test_case_id_comes_from_the_item_first():
    image = MetaTensor(torch.zeros(1, 2, 2, 2), meta={"filename_or_obj": "/data/images/OTHER.nii.gz"})
    assert case_id_of({"case_id": "LUNG1-001", "image": image}) == "LUNG1-001"
    assert case_id_of({"case_id": 7}) == "7"


@pytest.mark.parametrize("name", ["/data/prepared/images/LUNG1-002.nii.gz", "LUNG1-002.nii", "rel/LUNG1-002.nii"])
def test_case_id_falls_back_to_the_image_file_name(name):
    image = MetaTensor(torch.zeros(1, 2, 2, 2), meta={"filename_or_obj": name})
    assert case_id_of({"image": image}) == "LUNG1-002"


def test_case_id_without_any_clue_is_case():
    assert case_id_of({"image": torch.zeros(1, 2, 2, 2)}) == "case"
    assert case_id_of({}) == "case"

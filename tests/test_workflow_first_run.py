"""configs/first_run.yaml end to end, as a user runs its three documented commands: five patients downloaded from the
NBIA stand-in (tests/fake_nbia.py), prepared into a split with a test patient, trained into first_run_dir/model.pt,
evaluated on the test patient, and the test patient's CT segmented into a DICOM SEG that references it. The cases and
the network are shrunk to seconds; every path, split and file is the one the documented commands use."""

from __future__ import annotations

import csv
import hashlib
import json
from pathlib import Path

import pydicom
import pytest
from conftest import MECHANICS_NETWORK, ROOT, TINY_SHAPE, bundle_run, configs
from fake_nbia import COLLECTION, SEG_STORAGE, FakeNbia, served_case

PATIENTS = [f"LUNG1-00{i}" for i in range(1, 6)]  # the ids of the first five NSCLC-Radiomics patients
TRAINING = configs("train.yaml", "first_run.yaml")
EVALUATE = configs("train.yaml", "first_run.yaml", "evaluate.yaml")
INFERENCE = configs("inference.yaml", "first_run.yaml")
# what makes it seconds: tiny cases on the demo's grid (one window each) and the mechanics network, in all three
# commands (inference.yaml must be told the network and grid the weights were trained with); in training, one epoch of
# one patch per case, validated once (so model.pt is written); no worker processes beside the network on two cores
NETWORK = ["--network_def", MECHANICS_NETWORK, "--roi_size", "[64, 64, 32]", "--spacing", "[2.0, 2.0, 3.0]"]
HOST = ["--num_workers", "0", "--prepare_workers", "1"]
SCHEDULE = ["--max_epochs", "1", "--val_interval", "1", "--num_samples", "1"]


def split_order(patient_id: str, seed: int = 0) -> bytes:
    """prepare's split order: patients sorted by sha256 of "<split_seed>:<PatientID>"; the first
    round(n * test_fraction) are the test patients, the next round(n * val_fraction) the validation ones."""
    return hashlib.sha256(f"{seed}:{patient_id}".encode()).digest()


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """The three documented commands, run one after the other against the stand-in server."""
    from scripts.data.synthetic import write_case

    tmp = tmp_path_factory.mktemp("first_run")
    truths = [write_case(tmp / "source", p, seed=i, shape=TINY_SHAPE, pixel_spacing=(2.0, 2.0), tumour_hu=400)
              for i, p in enumerate(PATIENTS)]  # fmt: skip
    cases = {t["patient_id"]: served_case(Path(t["image_dir"]).parent) for t in truths}
    zoo_weights = ROOT / "models" / "model.pt"
    before = zoo_weights.stat().st_mtime_ns if zoo_weights.exists() else None
    run_dir = tmp / "runs" / "first_run"
    with FakeNbia(list(cases.values())) as server:
        where = ["--first_run_dir", str(run_dir), "--tcia_base_url", server.url]
        trained = bundle_run("training", "--config_file", TRAINING, *where, *NETWORK, *HOST, *SCHEDULE)
        assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
        server.reset_counts()
        # evaluate as documented, offline (--download false): the prepared data as it is, nothing fetched
        evaluated = bundle_run("evaluate", "--config_file", EVALUATE, *where, "--eval_split", "test", "--download",
                               "false", *NETWORK, *HOST)  # fmt: skip
        assert evaluated.returncode == 0, evaluated.stdout[-3000:] + evaluated.stderr[-3000:]
        refetched = sum(server.zip_requests(c.ct_uid) + server.zip_requests(c.seg_uid) for c in cases.values())
    datalist = json.loads((run_dir / "data" / f"{COLLECTION}-prepared" / "datalist.json").read_text())
    test_patient = datalist["test"][0]["patient_id"]
    out = tmp / "inference"  # not first_run_dir: the weights are found by first_run.yaml's model_path all the same
    input_dir = run_dir / "data" / COLLECTION / test_patient
    inferred = bundle_run("inference", "--config_file", INFERENCE, "--first_run_dir", str(run_dir), *NETWORK,
                          "--input_dir", str(input_dir), "--output_dir", str(out))  # fmt: skip
    assert inferred.returncode == 0, inferred.stdout[-3000:] + inferred.stderr[-3000:]
    after = zoo_weights.stat().st_mtime_ns if zoo_weights.exists() else None
    return {
        "run_dir": run_dir,
        "cases": cases,
        "datalist": datalist,
        "out": out,
        "zoo_weights": (before, after),
        "refetched": refetched,
    }


def test_first_run_downloads_and_prepares_five_patients_into_a_split_with_a_test_patient(first_run):
    run_dir, datalist = first_run["run_dir"], first_run["datalist"]
    downloaded = sorted(p.name for p in (run_dir / "data" / COLLECTION).iterdir() if p.is_dir())
    assert downloaded == PATIENTS
    assert first_run["refetched"] == 0, "evaluate downloaded complete cases again"
    report = json.loads((run_dir / "data" / f"{COLLECTION}-prepared" / "prepare_report.json").read_text())
    assert report["num_rejected"] == 0  # (evaluate's setup found the five up to date: prepared by training)
    assert sorted(c["case_id"] for c in report["cases"]) == PATIENTS
    assert all((run_dir / "data" / f"{COLLECTION}-prepared" / c["image"]).is_file() for c in report["cases"])
    split = {k: sorted(d["patient_id"] for d in datalist[k]) for k in ("training", "validation", "test")}
    by_order = sorted(PATIENTS, key=split_order)
    assert split == {"training": sorted(by_order[2:]), "validation": [by_order[1]], "test": [by_order[0]]}
    assert split["test"] == ["LUNG1-004"]  # the same five ids give the same test patient on the real collection


def test_first_run_writes_its_weights_in_first_run_dir_not_in_models(first_run):
    run_dir = first_run["run_dir"]
    assert (run_dir / "model.pt").is_file()
    assert json.loads((run_dir / "model.json").read_text())["labels"] == ["GTV-1"]
    assert (run_dir / "checkpoints" / "latest.pt").is_file()
    before, after = first_run["zoo_weights"]
    assert before == after, "models/model.pt was written"


def test_first_run_evaluates_the_test_patient(first_run):
    rows = list(csv.DictReader((first_run["run_dir"] / "eval" / "metrics.csv").open()))
    assert [r["case_id"] for r in rows] == [d["case_id"] for d in first_run["datalist"]["test"]]
    assert 0.0 <= float(rows[0]["GTV-1_dice"]) <= 1.0


def test_first_run_segments_the_test_patient_into_a_dicom_seg_of_its_ct(first_run):
    test_patient = first_run["datalist"]["test"][0]["patient_id"]
    seg_file = first_run["out"] / test_patient / f"{test_patient}_seg.dcm"
    seg = pydicom.dcmread(seg_file)
    assert seg.SOPClassUID == SEG_STORAGE and seg.Modality == "SEG" and seg.PatientID == test_patient
    ct = first_run["cases"][test_patient]
    assert seg.ReferencedSeriesSequence[0].SeriesInstanceUID == ct.ct_uid
    assert seg.StudyInstanceUID == ct.study_uid

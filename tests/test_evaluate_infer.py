"""Evaluate and infer with the demo-trained network, through MONAI's CLI as users run them.

The demo network (trained once per session by the ``demo_run`` fixture) is evaluated case by case in original space
and run on new synthetic DICOM series: the DICOM SEG it writes must read back voxel for voxel as the NIfTI it
writes, reference the source CT, and find the tumour.
"""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys

import highdicom as hd
import nibabel as nib
import numpy as np
import pytest
import torch
from conftest import DEMO, bundle_run, demo_args

from scripts.dicom import read_ct_series, read_seg_labels
from scripts.synthetic import generate

DEMO_EVALUATE = DEMO[:-1] + ",'configs/evaluate.yaml']"
# the demo network's settings, given to the standalone inference config on the command line
DEMO_NETWORK = ["--feature_size", "12", "--roi_size", "[64,64,64]", "--spacing", "[2,2,3]", "--num_workers", "0"]


def dice(a: np.ndarray, b: np.ndarray) -> float:
    return 2.0 * np.logical_and(a, b).sum() / (a.sum() + b.sum())


@pytest.fixture(scope="module")
def evaluated(demo_run, root, tmp_path_factory):
    tmp, _, _ = demo_run
    eval_dir = tmp_path_factory.mktemp("eval")
    args = demo_args(tmp, shrink=False)
    args[args.index("--config_file") + 1] = DEMO_EVALUATE
    result = bundle_run(root, "evaluate", *args, "--eval_dir", str(eval_dir), "--save_predictions", "true",
                        "--eval_pictures", "1")  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return tmp, eval_dir, result


def test_evaluate_writes_one_row_per_case_with_dice_equal_to_a_recount(evaluated):
    tmp, eval_dir, _ = evaluated
    datalist = json.loads((tmp / "prepared" / "datalist.json").read_text())
    rows = list(csv.DictReader((eval_dir / "metrics.csv").open()))
    assert sorted(r["case_id"] for r in rows) == sorted(d["case_id"] for d in datalist["validation"])
    for row in rows:
        case = row["case_id"]
        pred_file = eval_dir / "predictions" / case / f"{case}_seg.nii.gz"
        label_file = tmp / "prepared" / "labels" / f"{case}.nii.gz"
        pred, label = nib.load(pred_file), nib.load(label_file)
        # predictions are back on the CT's own grid, not the 2 mm training grid
        assert pred.shape == label.shape and np.allclose(pred.affine, label.affine, atol=1e-4)
        recount = dice(np.asarray(pred.dataobj) == 1, np.asarray(label.dataobj) == 1)
        assert float(row["GTV-1_dice"]) == pytest.approx(recount, abs=1e-5)
        assert float(row["GTV-1_hd95_mm"]) >= 0 and 0 <= float(row["GTV-1_surface_dice"]) <= 1
    summary = json.loads((eval_dir / "metrics_summary.json").read_text())
    assert summary["num_cases"] == len(rows)
    assert summary["metrics"]["GTV-1_dice"]["mean"] > 0.7  # the demo network finds the synthetic tumour


def test_evaluate_draws_the_worst_case(evaluated):
    _, eval_dir, _ = evaluated
    rows = list(csv.DictReader((eval_dir / "metrics.csv").open()))
    worst = min(rows, key=lambda r: float(r["GTV-1_dice"]))["case_id"]
    pictures = list((eval_dir / "pictures").glob("*.png"))
    assert [p.stem for p in pictures] == [worst]
    from PIL import Image

    image = np.asarray(Image.open(pictures[0]).convert("RGB"))
    assert image.shape[0] >= 256
    green = (image[..., 1] > 200) & (image[..., 0] < 80)
    assert green.sum() > 20, "the truth contour is drawn"


@pytest.fixture(scope="module")
def inferred(demo_run, root, tmp_path_factory):
    """Two unseen synthetic DICOM cases, one of them also as NIfTI, and three bad inputs."""
    tmp, _, _ = demo_run
    inputs = tmp_path_factory.mktemp("infer_in")
    truths = generate(inputs / "tcia", num_cases=2, shape=(128, 128, 40), seed=777, tumour_hu=400)
    ct = read_ct_series(truths[0]["image_dir"])
    as_nifti = nib.Nifti1Image(ct.hu, ct.affine_ras)
    nib.save(as_nifti, inputs / "first_case.nii.gz")
    (inputs / "no_ct_here").mkdir()
    (inputs / "no_ct_here" / "notes.txt").write_text("not a CT")
    (inputs / "one_slice").mkdir()
    shutil.copy(ct.files[0], inputs / "one_slice" / "1-001.dcm")
    nib.save(nib.Nifti1Image(np.zeros((8, 8, 8, 2), np.int16), np.eye(4)), inputs / "four_d.nii.gz")
    out = tmp_path_factory.mktemp("infer_out")
    weights = str(tmp / "run" / "model.pt")
    result = bundle_run(root, "inference", "--config_file", "configs/inference.yaml", "--input_dir", str(inputs),
                        "--output_dir", str(out), "--model_path", weights, *DEMO_NETWORK)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return truths, inputs, out, result


def test_inference_writes_a_dicom_seg_that_matches_the_nifti_and_references_the_ct(inferred):
    truths, _, out, result = inferred
    for truth in truths:
        case = truth["patient_id"]
        nifti = nib.load(out / case / f"{case}_seg.nii.gz")
        seg_file = out / case / f"{case}_seg.dcm"
        ct = read_ct_series(truth["image_dir"])
        assert np.allclose(nifti.affine, ct.affine_ras, atol=1e-4), "NIfTI on the CT's own grid"
        prediction = np.asarray(nifti.dataobj)
        seg = hd.seg.segread(seg_file)
        assert seg.FrameOfReferenceUID == ct.frame_of_reference_uid
        assert seg.ReferencedSeriesSequence[0].SeriesInstanceUID == ct.series_uid
        referenced = {i.ReferencedSOPInstanceUID for i in seg.ReferencedSeriesSequence[0].ReferencedInstanceSequence}
        assert referenced <= set(ct.sop_instance_uids)
        segment = seg.SegmentSequence[0]
        assert segment.SegmentLabel == "GTV-1" and segment.SegmentAlgorithmType == "AUTOMATIC"
        assert segment.SegmentedPropertyTypeCodeSequence[0].CodeMeaning == "Neoplasm"
        decoded, _ = read_seg_labels(seg_file, ct, ["GTV-1"])  # frames placed by the instances they reference
        np.testing.assert_array_equal(decoded, prediction)
        truth_label, _ = read_seg_labels(truth["seg_file"], ct, ["GTV-1"])
        assert dice(prediction == 1, truth_label == 1) > 0.6, f"{case}: the tumour is found in an unseen case"
    assert "s per case" in result.stdout


def test_inference_gives_the_same_answer_for_nifti_and_dicom_input(inferred):
    truths, _, out, _ = inferred
    from_dicom = np.asarray(nib.load(out / truths[0]["patient_id"] / f"{truths[0]['patient_id']}_seg.nii.gz").dataobj)
    from_nifti = nib.load(out / "first_case" / "first_case_seg.nii.gz")
    np.testing.assert_array_equal(np.asarray(from_nifti.dataobj), from_dicom)
    assert not (out / "first_case" / "first_case_seg.dcm").exists(), "no DICOM SEG without a DICOM source"


def test_inference_skips_bad_inputs_and_names_them(inferred):
    _, inputs, out, result = inferred
    report = json.loads((out / "inference_report.json").read_text())
    reasons = {r["input"]: r["reason"] for r in report["skipped"]}
    assert "no CT series" in reasons[str(inputs / "no_ct_here")]
    assert "only 1 slice" in reasons[str(inputs / "one_slice")]
    assert "3D CT" in reasons[str(inputs / "four_d.nii.gz")]
    assert len(report["cases"]) == 3
    assert "skipped 3" in result.stdout


def test_inference_refuses_weights_trained_for_other_labels(demo_run, root, tmp_path):
    tmp, _, _ = demo_run
    inputs = tmp / "data"
    result = bundle_run(root, "inference", "--config_file", "configs/inference.yaml", "--input_dir", str(inputs),
                        "--output_dir", str(tmp_path), "--model_path", str(tmp / "run" / "model.pt"),
                        "--labels", "['Heart']", *DEMO_NETWORK, timeout=300)  # fmt: skip
    assert result.returncode != 0
    assert "was trained for labels ['GTV-1']" in result.stdout + result.stderr
    assert str(tmp / "run" / "model.pt") in result.stdout + result.stderr


def export(root, demo_run, command: str, filepath) -> tuple[torch.nn.Module, torch.Tensor]:
    """``monai.bundle <command>`` of the demo network at its patch size; the eager network and a test input."""
    tmp, _, _ = demo_run
    weights = tmp / "run" / "model.pt"
    args = [sys.executable, "-m", "monai.bundle", command, "network_def", "--filepath", str(filepath),
            "--ckpt_file", str(weights), "--meta_file", "configs/metadata.json", "--config_file",
            "configs/inference.yaml", "--use_trace", "True", "--input_shape", "[1,1,64,64,64]",
            "--feature_size", "12"]  # fmt: skip
    result = subprocess.run(args, cwd=root, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    from monai.networks.nets import SwinUNETR

    from scripts.checkpoint import load_weights

    eager = load_weights(SwinUNETR(in_channels=1, out_channels=2, feature_size=12), weights).eval()
    return eager, torch.rand(1, 1, 64, 64, 64, generator=torch.Generator().manual_seed(0))


def test_traced_export_matches_the_eager_network(demo_run, root, tmp_path):
    """SwinUNETR cannot be scripted; traced at the patch size it is, and gives the eager network's output."""
    eager, x = export(root, demo_run, "ckpt_export", tmp_path / "model.ts")
    traced = torch.jit.load(str(tmp_path / "model.ts")).eval()
    with torch.no_grad():
        torch.testing.assert_close(traced(x), eager(x), rtol=1e-4, atol=1e-4)


def test_onnx_export_matches_the_eager_network(demo_run, root, tmp_path):
    import onnxruntime

    eager, x = export(root, demo_run, "onnx_export", tmp_path / "model.onnx")
    session = onnxruntime.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    with torch.no_grad():
        expected = eager(x).numpy()
    actual = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
    np.testing.assert_allclose(actual, expected, rtol=1e-3, atol=1e-3)


def test_inference_network_matches_the_metadata(root):
    """``verify_net_in_out``: metadata.json's input/output description fits the inference config's network."""
    args = [sys.executable, "-m", "monai.bundle", "verify_net_in_out", "network_def", "--meta_file",
            "configs/metadata.json", "--config_file", "configs/inference.yaml", "--feature_size", "12"]  # fmt: skip
    result = subprocess.run(args, cwd=root, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "verified with no error" in result.stdout + result.stderr, result.stderr[-2000:]


def test_validation_picture_reaches_tensorboard(demo_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tmp, _, _ = demo_run
    tags = []
    for events in (tmp / "run").glob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(events), size_guidance={"images": 0})
        accumulator.Reload()
        tags += accumulator.Tags()["images"]
    assert any(tag.startswith("validation/") for tag in tags), tags


def test_inference_config_satisfies_monai_inference_properties(demo_run, root, tmp_path, monkeypatch):
    from monai.bundle import ConfigWorkflow

    tmp, _, _ = demo_run
    monkeypatch.chdir(root)  # inference.yaml reads train.yaml's numbers relative to the bundle root
    workflow = ConfigWorkflow(
        config_file=str(root / "configs" / "inference.yaml"),
        meta_file=str(root / "configs" / "metadata.json"),
        workflow_type="infer",
        input_dir=str(tmp / "data"),
        output_dir=str(tmp_path),
        model_path=str(tmp / "run" / "model.pt"),
        feature_size=12,
    )
    workflow.initialize()
    assert workflow.check_properties() == []

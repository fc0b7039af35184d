"""inference.yaml with the demo-trained network, through MONAI's CLI from a foreign working directory.

New synthetic DICOM series go in; the DICOM SEG written must read back voxel for voxel as the NIfTI written,
reference the source CT and find the tumour; NIfTI input gives the same answer; bad inputs are skipped and named.
"""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import highdicom as hd
import nibabel as nib
import numpy as np
import pydicom
import pytest
import torch
import yaml
from conftest import ROOT, bundle_run, configs, workflow_run
from dicom_factory import Series, write_scanner_study, write_series
from pydicom.uid import generate_uid
from scripts.data.dicom import read_ct_series, read_rtstruct_labels, read_seg_labels
from scripts.data.synthetic import generate, write_case

SCANNER = "SCANNER-01"  # the patient of the study written as a scanner exports it

# inference with the demo's weights: inference.yaml stands alone, demo.yaml layered on it sets the demo network's ids
DEMO_INFERENCE = configs("inference.yaml", "demo.yaml")


def dice(a: np.ndarray, b: np.ndarray) -> float:
    return 2.0 * np.logical_and(a, b).sum() / (a.sum() + b.sum())


# one case failing at each stage after the check, by a fault the test puts into the configs (tests/faults.py)
FAULTS = {"preprocess": "FAULT-PREPROCESS", "collate": "FAULT-COLLATE", "predict": "FAULT-PREDICT",
          "postprocess": "FAULT-POSTPROCESS", "write": "FAULT-WRITE"}  # fmt: skip
FAULTS_CONFIG = f"""
fault_preprocess: {{_target_: faults.FailCased, case_id: {FAULTS["preprocess"]}, stage: preprocessing}}
fault_collate: {{_target_: faults.UncollatableCased, case_id: {FAULTS["collate"]}}}
fault_postprocess: {{_target_: faults.FailCased, case_id: {FAULTS["postprocess"]}, stage: post-processing}}
preprocessing#transforms: "$[@channel_first] + @ct_transforms + [@fault_preprocess, @fault_collate]"
evaluator#inferer: {{_target_: faults.FailingInferer, inferer: "@sliding_window_inferer", marker: {FAULTS["predict"]}}}
evaluator#postprocessing: >-
  $monai.transforms.Compose([@fault_postprocess] + @trained_postprocessing + [@save_case, @store_results])
save_case#_target_: faults.SaveCasedFailingFor
save_case#fail_case: {FAULTS["write"]}
"""


CHEST = "CHEST-512"


def cpu_isa() -> str:
    """The CPU's kind as the bundle names it in int8.json (scripts.common.cpus.cpu_isa, which OpenVINO does not
    load)."""
    from scripts.common.cpus import cpu_isa as isa

    return isa()


def cpu_has_bf16() -> bool:
    """Whether this CPU computes bf16 natively as the bundle judges it (its flags, capped where ONEDNN_MAX_CPU_ISA caps
    OpenVINO's kernels; OpenVINO itself is not loaded into the test worker)."""
    from scripts.common.cpus import NATIVE_BF16

    return cpu_isa() in NATIVE_BF16


@pytest.fixture(scope="module")
def inferred(demo_run, tmp_path_factory):
    """Two unseen synthetic DICOM cases, one of them also as NIfTI, and the inputs a real folder holds: a folder
    without a CT, a one-slice series, a 4-D NIfTI, a series whose pixel data are cut, a series under a 240-byte
    folder name, clutter beside the slices, a second copy of a series and a link back up the tree (a loop); a study as
    a scanner exports it (scout, 5 mm axial, a 2.5 mm series with a gantry tilt, secondary captures), a study of
    only a scout and captures, and a case failing at each later stage by an injected fault (FAULTS). Run with the
    configs' own loader settings (DataLoader worker processes)."""
    tmp, _, _ = demo_run
    inputs = tmp_path_factory.mktemp("infer_in")
    truths = generate(inputs / "tcia", num_cases=2, shape=(128, 128, 40), seed=777, tumour_hu=400)
    # a CT of a real scanner's grid (512 x 512 of 0.98 mm), for the bf16 / f32 comparison
    write_case(inputs / "tcia" / "chest512", CHEST, 31, (512, 512, 40), (0.9765625, 0.9765625), tumour_hu=400)
    ct = read_ct_series(truths[0]["image_dir"])
    as_nifti = nib.Nifti1Image(ct.hu, ct.affine_ras)
    nib.save(as_nifti, inputs / "first_case.nii.gz")
    (inputs / "no_ct_here").mkdir()
    (inputs / "no_ct_here" / "notes.txt").write_text("not a CT")
    as_series_of(ct.files[:1], inputs / "one_slice", "one_slice")
    nib.save(nib.Nifti1Image(np.zeros((8, 8, 8, 2), np.int16), np.eye(4)), inputs / "four_d.nii.gz")
    cut = as_series_of(sorted(Path(truths[1]["image_dir"]).glob("*.dcm")), inputs / "cut_pixels", "cut_pixels")
    damaged = sorted(cut.glob("*.dcm"))[7]
    damaged.write_bytes(damaged.read_bytes()[:-5000])  # the header is whole, the pixel data are not
    as_series_of(sorted(Path(truths[1]["image_dir"]).glob("*.dcm")), inputs / ("L" * 240), "long_folder")
    shutil.copytree(truths[0]["image_dir"], inputs / "copy")  # the same instances again: one case, not two
    (Path(truths[0]["image_dir"]) / "Thumbs.db").write_bytes(b"\x00thumbnail cache")
    (inputs / "tcia" / "loop").symlink_to(inputs / "tcia")
    scanner = write_scanner_study(inputs / "scanner" / "DICOM", SCANNER)
    write_scanner_study(inputs / "scout_only", "SCOUT-ONLY")
    for series in ("SE000002", "SE000003"):
        shutil.rmtree(inputs / "scout_only" / series)
    for case in FAULTS.values():
        write_series(Series(shape=(64, 64, 20), patient_id=case), inputs / case)
    faults = inputs.parent / f"{inputs.name}_faults.yaml"
    faults.write_text(FAULTS_CONFIG)
    out = tmp_path_factory.mktemp("infer_out")
    weights = str(tmp / "run" / "model.pt")
    result = bundle_run("inference", "--config_file", configs("inference.yaml", "demo.yaml")[:-1] + f", '{faults}']",
                        "--input_dir", str(inputs), "--output_dir", str(out), "--model_path", weights,
                        with_faults=True)  # fmt: skip
    assert (out / "inference_report.json").is_file(), result.stdout[-2000:] + result.stderr[-3000:]
    report = json.loads((out / "inference_report.json").read_text())
    return truths, inputs, out, result, report, scanner


def as_series_of(files: list[Path], dest: Path, patient: str) -> Path:
    """``files`` copied to ``dest`` as a series of their own (new UIDs, its own study) of patient ``patient``."""
    dest.mkdir(parents=True)
    study, series = generate_uid(), generate_uid()
    for path in files:
        ds = pydicom.dcmread(path)
        ds.PatientID, ds.StudyInstanceUID, ds.SeriesInstanceUID = patient, study, series
        ds.SOPInstanceUID = ds.file_meta.MediaStorageSOPInstanceUID = generate_uid()
        ds.save_as(dest / path.name)
    return dest


def test_inference_writes_a_dicom_seg_that_matches_the_nifti_and_references_the_ct(inferred):
    truths, _, out, result, _, _ = inferred
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


def test_the_inference_config_alone_runs_from_another_folder_and_equals_the_layered_demo(inferred, demo_run, tmp_path):
    """The command every zoo README shows: configs/inference.yaml ALONE (no train.yaml), the demo network's ids on
    the command line instead of demo.yaml, from a folder that is not the bundle: the same label map, every output."""
    truths, _, out, _, _, _ = inferred
    tmp, _, _ = demo_run
    demo = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    network_ids = [part for key in ("feature_size", "roi_size", "spacing", "sw_batch_size", "channels_last")
                   for part in (f"--{key}", str(demo[key]))]  # fmt: skip
    case = truths[0]["patient_id"]
    alone = bundle_run("--config_file", str(ROOT / "configs" / "inference.yaml"), "--input_dir",
                       str(Path(truths[0]["image_dir"]).parents[1]), "--output_dir", str(tmp_path), "--model_path",
                       str(tmp / "run" / "model.pt"), "--num_workers", "0", *network_ids)  # fmt: skip
    assert alone.returncode == 0, alone.stderr[-3000:]
    for suffix in ("_seg.nii.gz", "_seg.dcm", "_rtstruct.dcm", "_sr.dcm", "_report.json", "_report.png"):
        assert (tmp_path / case / f"{case}{suffix}").is_file(), suffix
    ours = np.asarray(nib.load(tmp_path / case / f"{case}_seg.nii.gz").dataobj)
    np.testing.assert_array_equal(ours, np.asarray(nib.load(out / case / f"{case}_seg.nii.gz").dataobj))


def test_openvino_runs_the_network_on_a_cpu_and_onnx_runtime_runs_the_same_export(inferred, demo_run):
    """On a CPU the default backend is OpenVINO (the `inferred` run), in bf16 where the CPU computes it natively: the
    network exported once and kept beside the demo's weights with the compiled model, the log, the reports and the
    SEG's algorithm parameters naming the backend and the precision. ONNX Runtime, the second CPU runtime, runs the same
    export to PyTorch's logits within 1e-3 on a batch of windows. (Labels through the whole sliding window, an ensemble
    and TTA: test_backends.py.)"""
    from monai.networks.nets import SwinUNETR
    from scripts.inference.backends import OnnxNetwork
    from scripts.training.weights import load_weights

    truths, _, out, result, report, _ = inferred
    tmp, _, _ = demo_run
    precision = "bf16" if cpu_has_bf16() else "int8"  # auto: int8 without bf16, as demo.yaml names calibration data
    assert (tmp / "run" / "model.pt.onnx").is_file() and (tmp / "run" / "model.pt.onnx.json").is_file()
    assert (tmp / "run" / f"model.pt.onnx.openvino-{precision}").is_dir()
    assert "OpenVINO 2026" in result.stdout + result.stderr and f", {precision}, " in result.stdout + result.stderr
    assert report["models"]["backend"].startswith("openvino ") and report["models"]["precision"] == precision
    case = truths[0]["patient_id"]
    assert json.loads((out / case / f"{case}_report.json").read_text())["models"]["backend"].startswith("openvino")
    parameters = hd.seg.segread(out / case / f"{case}_seg.dcm").SegmentSequence[0]
    parameters = parameters.SegmentationAlgorithmIdentificationSequence[0].AlgorithmParameters
    assert "backend=openvino " in parameters and f"precision={precision}" in parameters
    eager = load_weights(SwinUNETR(in_channels=1, out_channels=2, feature_size=12), tmp / "run" / "model.pt").eval()
    windows = torch.rand(2, 1, 64, 64, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(OnnxNetwork(tmp / "run" / "model.pt.onnx")(windows), eager(windows), rtol=1e-3,
                                   atol=1e-3)  # fmt: skip


def precision_run(inputs: Path, demo: Path, out: Path, precision: str) -> Path:
    """The weights of the demo trained in ``demo`` on ``inputs`` in ``precision``, only the NIfTI written."""
    workflow_run("inference", "--config_file", configs("inference.yaml", "demo.yaml"), "--input_dir", str(inputs),
                 "--output_dir", str(out), "--model_path", str(demo / "run" / "model.pt"), "--prepared_dir",
                 str(demo / "prepared"), "--cpu_precision", precision, "--num_workers", "0", "--write_dicom_seg",
                 "false", "--write_rtstruct", "false", "--write_sr", "false", "--write_report", "false")  # fmt: skip
    assert json.loads((out / "inference_report.json").read_text())["models"]["precision"] == precision
    return out


@pytest.fixture(scope="module")
def f32_inferred(inferred, demo_run, tmp_path_factory):
    """The reference of the bf16 and int8 guards: the demo cases and the 512 x 512 CT in f32."""
    _, inputs, _, _, _, _ = inferred
    tmp, _, _ = demo_run
    return precision_run(inputs / "tcia", tmp, tmp_path_factory.mktemp("f32_out"), "f32")


def assert_same_tumour(out: Path, reference: Path, cases: list[str]) -> None:
    """Tumour Dice >= 0.99 and volumes within 1 % of the reference's, case by case."""
    for case in cases:
        found = np.asarray(nib.load(out / case / f"{case}_seg.nii.gz").dataobj) > 0
        expected = np.asarray(nib.load(reference / case / f"{case}_seg.nii.gz").dataobj) > 0
        assert expected.sum() > 100, f"{case}: the demo network finds the tumour"
        assert dice(found, expected) >= 0.99, case
        assert abs(int(found.sum()) - int(expected.sum())) <= 0.01 * expected.sum(), case


def test_bf16_and_f32_give_the_same_tumour_on_the_demo_cases_and_a_scanner_sized_ct(inferred, demo_run, f32_inferred):
    """The accuracy guard of bf16: the demo's trained weights on two unseen demo cases and a 512 x 512 CT, in bf16
    (the `inferred` run: OpenVINO's precision where the CPU computes it natively) and in f32 (--cpu_precision f32):
    tumour Dice >= 0.99, volumes within 1 %; each precision's compiled model is kept beside the weights."""
    if not cpu_has_bf16():
        pytest.skip("this CPU has no native bf16: auto ran f32, nothing to compare")
    truths, _, bf16_out, _, _, _ = inferred
    tmp, _, _ = demo_run
    assert (tmp / "run" / "model.pt.onnx.openvino-f32").is_dir() and (
        tmp / "run" / "model.pt.onnx.openvino-bf16"
    ).is_dir()
    assert_same_tumour(bf16_out, f32_inferred, [t["patient_id"] for t in truths] + [CHEST])


def test_int8_gives_the_tumour_of_f32_on_the_demo_cases_and_a_scanner_sized_ct(inferred, demo_run, f32_inferred,
                                                                               tmp_path):  # fmt: skip
    """The accuracy guard of int8 (--cpu_precision int8, calibrated as demo.yaml says on the demo's training cases):
    the demo's trained weights on the same cases as bf16's guard, tumour Dice >= 0.99 and volumes within 1 % of f32;
    the quantised model kept beside the compiled ones, named by its calibration."""
    truths, inputs, _, _, _, _ = inferred
    tmp, _, _ = demo_run
    precision_run(inputs / "tcia", tmp, tmp_path, "int8")
    record = json.loads((tmp / "run" / "model.pt.onnx.openvino-int8" / "int8.json").read_text())
    assert record["describe"] == f"16 windows of 64x64x32 from {tmp / 'prepared' / 'datalist.json'}"
    assert record["overflow_fix"] == "enable" and record["windows"] == 14, "the 7 training CTs' 2 windows each"
    check = record["checks"][cpu_isa()]
    assert check["accepted"] and check["windows"] >= 4, "the demo's validation cases: 2 windows each, held out"
    assert check["tumour_dice"] >= 0.99, "the held-out windows hold the validation cases' tumours"
    assert_same_tumour(tmp_path, f32_inferred, [t["patient_id"] for t in truths] + [CHEST])


def test_on_an_avx2_cpu_auto_chooses_int8_proves_it_and_gives_the_tumour_of_f32(inferred, demo_run, f32_inferred,
                                                                                tmp_path):  # fmt: skip
    """A CPU without bf16 or VNNI, as most clinics' PCs are (oneDNN capped at AVX2, so OpenVINO runs an AVX2 CPU's
    int8 kernels, whose 16-bit sums of products saturated before every layer's weights were quantised in 7 bits): the
    demo's inference with the default settings chooses int8 (demo.yaml names the demo's training data), says why,
    checks the quantised model (the one made on this machine's own kernels: the same for every CPU) against f32 on the
    held-out windows on this kind of CPU, and gives f32's tumour (Dice >= 0.99, volume within 1 %)."""
    truths, inputs, _, _, _, _ = inferred
    tmp, _, _ = demo_run
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
        result = bundle_run("inference", "--config_file", configs("inference.yaml", "demo.yaml"), "--input_dir",
                            str(inputs / "tcia" / "NSCLC-Radiomics"), "--output_dir", str(tmp_path), "--model_path",
                            str(tmp / "run" / "model.pt"), "--prepared_dir", str(tmp / "prepared"), "--num_workers",
                            "0", "--write_rtstruct", "false", "--write_sr", "false", "--write_report",
                            "false")  # fmt: skip
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-3000:]
    assert "cpu_precision auto: int8 in OpenVINO (no native bf16 on this CPU (avx2); int8 calibrated on " in log
    # checked now, or earlier in this session where every test runs under the cap (the decision is kept per CPU kind)
    assert "int8 proved against f32 (" in log and " held-out windows on avx2: " in log
    assert json.loads((tmp_path / "inference_report.json").read_text())["models"]["precision"] == "int8"
    checks = json.loads((tmp / "run" / "model.pt.onnx.openvino-int8" / "int8.json").read_text())["checks"]
    assert checks["avx2"]["accepted"]
    assert_same_tumour(tmp_path, f32_inferred, [t["patient_id"] for t in truths])


def test_inference_without_an_input_dir_says_what_to_pass(tmp_path):
    result = bundle_run("--config_file", str(ROOT / "configs" / "inference.yaml"), "--output_dir", str(tmp_path),
                        timeout=300)  # fmt: skip
    assert result.returncode == 1 and "inference needs --input_dir DIR" in result.stderr, result.stderr[-2000:]


def test_inference_gives_the_same_answer_for_nifti_and_dicom_input(inferred):
    truths, _, out, _, _, _ = inferred
    from_dicom = np.asarray(nib.load(out / truths[0]["patient_id"] / f"{truths[0]['patient_id']}_seg.nii.gz").dataobj)
    from_nifti = nib.load(out / "first_case" / "first_case_seg.nii.gz")
    np.testing.assert_array_equal(np.asarray(from_nifti.dataobj), from_dicom)
    assert not (out / "first_case" / "first_case_seg.dcm").exists(), "no DICOM SEG without a DICOM source"


def test_each_bad_input_is_failed_or_skipped_by_name_and_the_others_are_written(inferred):
    """One case failing at each stage -- its study's record (no usable series), check, read, preprocess, collate,
    predict, postprocess, write -- among good ones, run as users run it (DataLoader workers): each failure is in the
    report with its stage and a reason that says what, the others are written, nothing is left of a failed case, and
    the command ends with status 1."""
    truths, inputs, out, result, report, _ = inferred
    skipped = {r["input"]: r["reason"] for r in report["skipped"]}
    assert "no CT series" in skipped[str(inputs / "no_ct_here")]
    cases = {c["case_id"]: c for c in report["cases"]}
    failed = {k: c for k, c in cases.items() if c["status"] == "failed"}
    expected = {"one_slice", "four_d", "cut_pixels", "SCOUT-ONLY", *FAULTS.values()}
    assert set(failed) == expected, (set(failed), result.stderr[-3000:])
    assert failed["one_slice"]["stage"] == "check" and "1 CT images, fewer than" in failed["one_slice"]["reason"]
    assert failed["four_d"]["stage"] == "check" and "3D CT" in failed["four_d"]["reason"]
    assert failed["cut_pixels"]["stage"] == "read" and "cut or damaged" in failed["cut_pixels"]["reason"]
    scout_only = failed["SCOUT-ONLY"]
    assert scout_only["stage"] == "check" and "no usable CT series" in scout_only["reason"]
    assert "LOCALIZER" in scout_only["reason"] and "2 Secondary Capture Image Storage" in scout_only["reason"]
    for stage, case in FAULTS.items():
        assert failed[case]["stage"] == stage, (case, failed[case])
    assert "a fault injected in preprocessing" in failed[FAULTS["preprocess"]]["reason"]
    assert "cannot be batched" in failed[FAULTS["collate"]]["reason"]
    assert "forward pass" in failed[FAULTS["predict"]]["reason"]
    assert "a fault injected in post-processing" in failed[FAULTS["postprocess"]]["reason"]
    assert "No space left on device" in failed[FAULTS["write"]]["reason"]
    done = {k for k, c in cases.items() if c["status"] == "done"}
    assert done == {t["patient_id"] for t in truths} | {"first_case", "long_folder", SCANNER, CHEST}, "the others ran"
    for case in ("cut_pixels", *FAULTS.values()):
        assert not (out / case).exists(), f"{case}: a failed case leaves no outputs"
    assert not list(out.glob(".partial-*")) and not list(out.glob(".old-*")), "no half-written folder is left"
    assert result.returncode == 1 and f"{len(expected)} case(s) failed" in result.stderr, result.stderr[-2000:]
    assert f"failed {len(expected)}, skipped 1" in result.stdout


def test_a_study_as_a_scanner_exports_it_gives_its_axial_series_and_says_what_was_not_used(inferred):
    """Scout, 5 mm axial, 2.5 mm with a -18.5 degree gantry tilt, two secondary captures, each series in its own
    folder: the untilted axial series is segmented (its SEG references it), and the report lists the others with why."""
    _, _, out, _, report, scanner = inferred
    case = {c["case_id"]: c for c in report["cases"]}[SCANNER]
    assert case["status"] == "done" and case["series"]["series_uid"] == scanner["axial"]
    assert "the first of 2 usable series" in case["series"]["why"]
    reasons = {a["series_uid"]: a["reason"] for a in case["alternatives"]}
    assert reasons[scanner["scout"]] == "ImageType LOCALIZER (series_rules#exclude_image_types)"
    assert reasons[scanner["tilted"]] == (
        "usable, but a gantry tilt of 18.5 deg (it would be resampled onto an orthogonal grid), and the study has an "
        "untilted series"
    )
    assert reasons[scanner["captures"]] == "2 Secondary Capture Image Storage object(s), not CT images"
    seg = hd.seg.segread(out / SCANNER / f"{SCANNER}_seg.dcm")
    assert {s for _, s, _ in seg.get_source_image_uids()} == {scanner["axial"]}


def test_the_report_gives_each_case_its_region_its_windows_and_its_seconds_per_stage(inferred):
    """The demo-sized synthetic chest (125 mm across, lungs of ~150 ml) holds no lung a real chest would: the region
    says so and the windows cover the body crop (tests/test_region.py and bench_inference run the thorax itself)."""
    truths, _, _, _, report, _ = inferred
    cases = {c["case_id"]: c for c in report["cases"]}
    for truth in truths:
        case = cases[truth["patient_id"]]
        assert set(case["stage_seconds"]) == {"read", "preprocess", "region", "predict", "postprocess", "write"}
        assert all(v >= 0 for v in case["stage_seconds"].values()) and case["stage_seconds"]["predict"] > 0
        region = case["region"]
        assert region["method"] == "body (no lung found)" and region["windows"] == region["windows_whole_input"] > 0
        low, high = np.array(region["box_lps_mm"])
        for ellipsoid in truth["tumour"]["ellipsoids"]:
            centre, radii = np.array(ellipsoid["center_lps"]), np.array(ellipsoid["radii_mm"])
            assert (low <= centre - radii).all() and (high >= centre + radii).all(), (low, high, centre, radii)


def test_clutter_and_a_link_loop_do_not_change_the_cases(inferred):
    truths, _, _, _, report, _ = inferred
    inputs = [c["image"] for c in report["cases"]]
    assert (
        len(inputs) == len(set(inputs)) and sum(truths[0]["patient_id"] in c["case_id"] for c in report["cases"]) == 1
    )


def test_inference_refuses_weights_trained_for_other_labels(demo_run, root, tmp_path):
    tmp, _, _ = demo_run
    inputs = tmp / "data"
    result = bundle_run("inference", "--config_file", DEMO_INFERENCE, "--input_dir", str(inputs),
                        "--output_dir", str(tmp_path), "--model_path", str(tmp / "run" / "model.pt"),
                        "--labels", "['Heart']", "--num_workers", "0", timeout=300)  # fmt: skip
    assert result.returncode != 0
    assert "was trained for labels ['GTV-1']" in result.stdout + result.stderr
    assert str(tmp / "run" / "model.pt") in result.stdout + result.stderr


def test_inference_config_satisfies_monai_inference_properties(demo_run, tmp_path):
    from monai.bundle import ConfigWorkflow

    tmp, _, _ = demo_run
    workflow = ConfigWorkflow(
        config_file=[str(ROOT / "configs" / c) for c in ("inference.yaml", "demo.yaml")],
        workflow_type="infer",
        bundle_root=str(ROOT),
        input_dir=str(tmp / "data"),
        output_dir=str(tmp_path),
        model_path=str(tmp / "run" / "model.pt"),
    )
    workflow.initialize()
    assert workflow.check_properties() == []


def keep_largest(labels: np.ndarray, keep: int, names: list[str]) -> np.ndarray:
    """The largest-component step of train.yaml's inverse post-processing (what evaluate and inference apply)."""
    from monai.bundle import ConfigParser
    from monai.transforms import KeepLargestConnectedComponentd

    parser = ConfigParser()
    parser.read_config(str(ROOT / "configs" / "train.yaml"))
    parser.update({"bundle_root": str(ROOT), "labels": names, "keep_largest_components": keep})
    step = next(
        t for t in parser.get_parsed_content("inverse_postprocessing") if isinstance(t, KeepLargestConnectedComponentd)
    )
    return np.asarray(step({"pred": torch.as_tensor(labels[None])})["pred"][0])


def test_keep_largest_components_per_structure():
    labels = np.zeros((20, 20, 20), np.uint8)
    labels[1:6, 1:6, 1:6] = 1  # 125 voxels
    labels[10:12, 10:12, 10:12] = 1  # 8 voxels: a stray island
    labels[15:18, 1:4, 1:4] = 2  # another structure: kept on its own account
    kept = keep_largest(labels, 1, ["GTV-1", "Heart"])
    assert (kept == 1).sum() == 125 and (kept == 2).sum() == 27
    assert (keep_largest(labels, 2, ["GTV-1", "Heart"]) == labels).all()
    assert (keep_largest(labels, 0, ["GTV-1", "Heart"]) == labels).all(), "0: the raw argmax"


def test_diagonal_neighbours_are_one_component():
    labels = np.zeros((6, 6, 6), np.uint8)
    labels[1, 1, 1] = labels[2, 2, 2] = 1  # touch at a corner: 26-connected
    assert (keep_largest(labels, 1, ["GTV-1"]) == labels).all()


def test_dicom_cases_also_get_an_rtstruct_an_sr_and_a_report(inferred):
    truths, _, out, _, _, _ = inferred
    rows = list(csv.DictReader((out / "report.csv").open()))
    done = [t["patient_id"] for t in truths] + ["first_case", "long_folder", SCANNER, CHEST]
    assert sorted(r["case"] for r in rows) == sorted(done), "a row per case written, none for a failed one"
    for truth in truths:
        case = truth["patient_id"]
        folder = out / case
        prediction = np.asarray(nib.load(folder / f"{case}_seg.nii.gz").dataobj) == 1
        ct = read_ct_series(truth["image_dir"])
        contoured, _ = read_rtstruct_labels(folder / f"{case}_rtstruct.dcm", ct, ["GTV-1"])
        assert dice(contoured == 1, prediction) >= 0.95, "the RTSTRUCT's contours are the prediction's outline"
        report = json.loads((folder / f"{case}_report.json").read_text())["structures"]["GTV-1"]
        voxel_ml = abs(np.linalg.det(ct.affine_lps[:3, :3])) / 1000
        assert report["volume_ml"] == pytest.approx(prediction.sum() * voxel_ml, rel=1e-3)
        assert report["long_axis_mm"] >= report["short_axis_mm"] > 0 and report["side"] == truth["tumour"]["side"]
        sr = hd.sr.srread(folder / f"{case}_sr.dcm")
        seg_uid = hd.seg.segread(folder / f"{case}_seg.dcm").SOPInstanceUID
        assert seg_uid in str(sr), "the SR references the SEG it measures"
        assert (folder / f"{case}_report.png").read_bytes()[:4] == b"\x89PNG"
        # a plausible tumour is not flagged (a thorax of tumour is: tests/test_outputs.py)
        assert "implausible" not in json.loads((folder / f"{case}_report.json").read_text())
        assert "flags" not in next(c for c in inferred[4]["cases"] if c["case_id"] == case)


def test_the_demos_training_leaves_a_calibration_set_that_inference_takes_when_none_is_named(demo_run):
    """Weights travel with data to quantise on: the demo's training wrote its windows beside its weights (the
    training cases' for calibration, the validation cases' for the check), and inference.yaml with int8_calibration
    left at null calibrates on them."""
    from monai.bundle import ConfigParser
    from scripts.inference.calibration import SET_SUFFIX

    tmp, _, _ = demo_run
    weights = tmp / "run" / "model.pt"
    with np.load(f"{weights}{SET_SUFFIX}") as kept:
        assert kept["windows"].shape == (14, 1, 64, 64, 32) and kept["windows"].dtype == np.float16
        assert kept["check"].shape == (4, 1, 64, 64, 32), "the 2 validation cases' 2 windows each"
    parser = ConfigParser()
    parser.read_config(str(ROOT / "configs" / "inference.yaml"))
    parser.update({"bundle_root": str(ROOT), "model_path": str(weights)})
    assert parser.get_parsed_content("int8_calibration_source") == f"{weights}{SET_SUFFIX}"
    parser.update({"int8_calibration": str(tmp / "prepared" / "datalist.json")})
    parser.parse()
    assert parser.get_parsed_content("int8_calibration_source") == str(tmp / "prepared" / "datalist.json")

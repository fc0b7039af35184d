"""What inference writes per case: ``<out>/<case>/<case>_seg.nii.gz`` as uint8 labels on the input's original grid
(``original_affine``, not the network's grid), the structure volumes in the log, and for DICOM input a
``<case>_seg.dcm`` that highdicom reads back with the same voxels; nothing when disabled; and the one line printed at
the end with the number of cases and of skipped cases."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import highdicom as hd
import nibabel as nib
import numpy as np
import pydicom
import pytest
import torch
from ignite.engine import Engine
from monai.data import MetaTensor
from scripts.outputs import InferenceSummary, SaveCased
from scripts.synthetic import write_case

LABELS = ["GTV-1", "Heart"]
# the input's own grid: 2 x 2 x 3 mm voxels (0.012 ml), axes flipped as a DICOM CT is in RAS
ORIGINAL = np.array([[-2.0, 0, 0, 100.0], [0, -2.0, 0, 80.0], [0, 0, 3.0, -200.0], [0, 0, 0, 1]])
NETWORK_GRID = np.diag([1.5, 1.5, 1.5, 1.0])


def label_map(shape=(10, 8, 6)) -> np.ndarray:
    labels = np.zeros(shape, np.uint8)
    labels[1:6, 2:6, 1:6] = 1  # 100 voxels = 1.2 ml
    labels[7:9, 0:2, 0:1] = 2  # 4 voxels = 0.048 ml
    return labels


def prediction(labels: np.ndarray, original_affine: np.ndarray | None = ORIGINAL) -> MetaTensor:
    """A post-processed prediction as SaveCased receives it: [1, X, Y, Z] float, carrying the original affine."""
    meta = {} if original_affine is None else {"original_affine": torch.from_numpy(original_affine)}
    return MetaTensor(
        torch.from_numpy(labels[None].astype(np.float32)), affine=torch.from_numpy(NETWORK_GRID), meta=meta
    )


def test_nifti_is_written_on_the_original_grid_as_uint8_labels(tmp_path):
    labels = label_map()
    out = SaveCased("pred", tmp_path, LABELS)({"case_id": "LUNG1-001", "pred": prediction(labels), "source": "nifti"})
    path = tmp_path / "LUNG1-001" / "LUNG1-001_seg.nii.gz"
    assert out["pred_files"] == {"nifti": str(path)}
    image = nib.load(path)
    np.testing.assert_allclose(image.affine, ORIGINAL, atol=1e-5)
    assert image.get_data_dtype() == np.uint8
    np.testing.assert_array_equal(np.asarray(image.dataobj), labels)
    assert sorted(p.name for p in (tmp_path / "LUNG1-001").iterdir()) == ["LUNG1-001_seg.nii.gz"], "no DICOM SEG"


def test_without_an_original_affine_the_tensor_affine_is_used(tmp_path):
    SaveCased("pred", tmp_path, LABELS)({"case_id": "c", "pred": prediction(label_map(), original_affine=None)})
    np.testing.assert_allclose(nib.load(tmp_path / "c" / "c_seg.nii.gz").affine, NETWORK_GRID, atol=1e-5)


def test_structure_volumes_are_logged_in_ml(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="scripts.outputs"):
        SaveCased("pred", tmp_path, LABELS)({"case_id": "LUNG1-001", "pred": prediction(label_map())})
    (line,) = [r.getMessage() for r in caplog.records if r.name == "scripts.outputs"]
    assert line.startswith("LUNG1-001: ") and "LUNG1-001_seg.nii.gz" in line
    assert "{'GTV-1': 1.2, 'Heart': 0.048}" in line


def test_disabled_writes_nothing(tmp_path):
    data = {"case_id": "LUNG1-001", "pred": prediction(label_map()), "source": "dicom", "source_path": "/nowhere"}
    out = SaveCased("pred", tmp_path / "out", LABELS, enabled=False)(data)
    assert out == data and "pred_files" not in out
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def dicom_case(tmp_path_factory):
    """A small synthetic CT series and a label map on its grid ([columns, rows, slices] in slice-normal order)."""
    tmp = tmp_path_factory.mktemp("dicom")
    truth = write_case(tmp, "P1", seed=1, shape=(48, 48, 12), segments=["GTV-1"])
    slices = [pydicom.dcmread(p, stop_before_pixels=True) for p in Path(truth["image_dir"]).glob("*.dcm")]
    slices.sort(key=lambda ds: float(ds.ImagePositionPatient[2]))  # axial, head up: z orders the slices
    labels = np.zeros((48, 48, 12), np.uint8)
    labels[10:20, 5:30, 3:6] = 1
    labels[30:45, 30:34, 8:9] = 2
    return truth, slices, labels


def test_dicom_input_also_gets_a_seg_with_the_same_voxels(tmp_path, dicom_case):
    truth, slices, labels = dicom_case
    data = {"case_id": "P1", "pred": prediction(labels), "source": "dicom", "source_path": truth["image_dir"]}
    out = SaveCased("pred", tmp_path, LABELS, algorithm_version="2.0.1")(data)
    seg_path = tmp_path / "P1" / "P1_seg.dcm"
    assert out["pred_files"] == {"nifti": str(tmp_path / "P1" / "P1_seg.nii.gz"), "dicom_seg": str(seg_path)}

    seg = hd.seg.segread(seg_path)
    pixels = seg.get_pixels_by_source_instance(
        [ds.SOPInstanceUID for ds in slices], segment_numbers=[1, 2], assert_missing_frames_are_empty=True
    )
    back = np.zeros_like(labels)
    for s in range(2):
        back[pixels[..., s].transpose(2, 1, 0) > 0] = s + 1
    np.testing.assert_array_equal(back, labels)
    assert [s.SegmentLabel for s in seg.SegmentSequence] == LABELS
    assert seg.SegmentSequence[0].SegmentationAlgorithmIdentificationSequence[0].AlgorithmVersion == "2.0.1"
    assert seg.FrameOfReferenceUID == truth["frame_of_reference_uid"]


@pytest.mark.parametrize(("write_seg", "source"), [(False, "dicom"), (True, "nifti")])
def test_no_seg_unless_asked_for_and_the_input_is_dicom(tmp_path, dicom_case, write_seg, source):
    truth, _, labels = dicom_case
    data = {"case_id": "P1", "pred": prediction(labels), "source": source, "source_path": truth["image_dir"]}
    out = SaveCased("pred", tmp_path, LABELS, write_seg=write_seg)(data)
    assert list(out["pred_files"]) == ["nifti"]
    assert sorted(p.name for p in (tmp_path / "P1").iterdir()) == ["P1_seg.nii.gz"]


def run_inference(output_dir: Path, cases: int, failed: tuple[str, ...] = ()) -> None:
    """An engine whose iterations are cases: each one's output names its files, as SaveCased leaves them, unless it
    is in ``failed`` (then the engine records it, as CaseByCaseEvaluator does, and the output is empty)."""

    def step(engine: Engine, case_id: str):
        engine.state.batch = [{"case_id": case_id}]
        if case_id in failed:
            engine.failures.append({"case_id": case_id, "stage": "read", "reason": f"{case_id}: cut pixel data"})
            engine.state.batch = []
            return []
        return [{"pred_files": {"nifti": str(output_dir / case_id / f"{case_id}_seg.nii.gz")}}]

    engine = Engine(step)
    engine.failures = []
    InferenceSummary(output_dir).attach(engine)
    engine.run([f"C{i}" for i in range(cases)], max_epochs=1)


def test_summary_records_each_case_and_prints_one_line(tmp_path, capsys):
    report = {"cases": [{"case_id": f"C{i}", "status": "pending"} for i in range(3)],
              "skipped": [{"input": "A", "reason": "no CT"}, {"input": "B", "reason": "no CT"}]}  # fmt: skip
    (tmp_path / "inference_report.json").write_text(json.dumps(report))
    run_inference(tmp_path, 3, failed=("C1",))
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("inferred 2 case(s) in ") and "s per case" in lines[0]
    assert f"-> {tmp_path}; failed 1, skipped 2 (see inference_report.json)" in lines[0]
    written = json.loads((tmp_path / "inference_report.json").read_text())
    status = {c["case_id"]: c["status"] for c in written["cases"]}
    assert status == {"C0": "done", "C1": "failed", "C2": "done"}
    failed = next(c for c in written["cases"] if c["case_id"] == "C1")
    assert failed["stage"] == "read" and "cut pixel data" in failed["reason"]
    assert written["num_done"] == 2 and written["num_failed"] == 1 and written["num_skipped"] == 2


def test_summary_without_a_report_counts_each_run_afresh(tmp_path, capsys):
    run_inference(tmp_path, 2)
    (tmp_path / "inference_report.json").unlink()
    run_inference(tmp_path, 4)
    first, second = capsys.readouterr().out.splitlines()
    assert first.startswith("inferred 2 case(s)") and second.startswith("inferred 4 case(s)")
    assert first.endswith("failed 0, skipped 0 (see inference_report.json)")

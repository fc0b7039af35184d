"""The RTSTRUCT reader, checked in world millimetres against shapes whose contours this test computes analytically.

The test writes its own RTSTRUCT (pydicom only): ellipse cross-sections of known ellipsoids on every CT slice, as a
planning system draws them, on a CT with 0.7 x 0.7 x 3 mm voxels (also rotated by 180 degrees in plane). The truth is
the analytic shape: a voxel belongs to it when its centre is inside, and its centroid is computed from the ellipsoids'
volumes, never from a rasterised mask. Contour Data stored as UN, as another writer's Explicit VR file holds a value
longer than a DS length can say, is read as its decimal text.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pydicom
import pytest
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.uid import ExplicitVRLittleEndian, RTStructureSetStorage, generate_uid
from scripts.data.dicom import RTSTRUCT_STORAGE, DicomCaseError, is_rtstruct, read_ct_series, read_rtstruct_labels
from scripts.data.dicom.rtstruct import _contour_data
from scripts.data.synthetic import write_case

PIXEL_MM, SLICE_MM = 0.7, 3.0
SHAPE = (96, 96, 16)  # columns, rows, slices: 67 x 67 x 45 mm


def shapes(z_mid: float) -> dict[str, list[dict]]:
    """The ROIs (LPS mm): each a list of ellipsoids, ``hole`` ones cut out of the others (even-odd)."""
    return {
        "GTV-1": [  # an ellipsoid with an off-centre hole
            {"centre": (-10.0, -5.0, z_mid + 1.1), "radii": (12.0, 9.0, 10.0)},
            {"centre": (-8.0, -4.0, z_mid + 0.5), "radii": (5.0, 4.0, 4.5), "hole": True},
        ],
        "gtv_2": [  # two separate tumours: two contours on each slice
            {"centre": (14.0, 12.0, z_mid - 4.0), "radii": (5.0, 4.0, 6.0)},
            {"centre": (14.0, -14.0, z_mid - 4.0), "radii": (4.0, 6.0, 7.0)},
        ],
        "Lung-Left": [  # contains GTV-1, partly outside the field of view
            {"centre": (-10.0, -5.0, z_mid), "radii": (25.0, 22.0, 20.0)}
        ],
    }


def ellipse(centre, radii, z: float, points: int = 360) -> np.ndarray | None:
    """The cross-section of an axis-aligned ellipsoid at ``z`` as an (N, 3) polygon in LPS mm, or None."""
    t = 1.0 - ((z - centre[2]) / radii[2]) ** 2
    if t <= 0:
        return None
    theta = np.linspace(0, 2 * np.pi, points, endpoint=False)
    a, b = radii[0] * np.sqrt(t), radii[1] * np.sqrt(t)
    return np.column_stack([centre[0] + a * np.cos(theta), centre[1] + b * np.sin(theta), np.full(points, z)])


def inside(points: np.ndarray, ellipsoids: list[dict]) -> np.ndarray:
    """Analytic membership of (N, 3) LPS points: inside an odd number of the ellipsoids (holes cut out)."""
    count = np.zeros(len(points), int)
    for e in ellipsoids:
        count += (((points - e["centre"]) / e["radii"]) ** 2).sum(1) <= 1
    return count % 2 == 1


def analytic_centroid(ellipsoids: list[dict]) -> np.ndarray:
    """The centroid of solid ellipsoids minus their holes (volume-weighted centres; a hole weighs negative)."""
    weights = np.array([np.prod(e["radii"]) * (-1 if e.get("hole") else 1) for e in ellipsoids])
    return (weights[:, None] * np.array([e["centre"] for e in ellipsoids])).sum(0) / weights.sum()


def image_ref(ds: Dataset) -> Dataset:
    item = Dataset()
    item.ReferencedSOPClassUID, item.ReferencedSOPInstanceUID = ds.SOPClassUID, ds.SOPInstanceUID
    return item


def write_rtstruct(path: Path, headers: list[Dataset], rois: dict[str, list[tuple[int, np.ndarray]]]) -> Path:
    """An RTSTRUCT whose ROIs are ``{name: [(ct slice index, (N, 3) LPS polygon), ...]}`` on the CT ``headers``."""
    ct = headers[0]
    ds = Dataset()
    ds.file_meta = FileMetaDataset()
    ds.file_meta.MediaStorageSOPClassUID = RTStructureSetStorage
    ds.file_meta.MediaStorageSOPInstanceUID = ds.SOPInstanceUID = generate_uid()
    ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds.SOPClassUID, ds.Modality = RTStructureSetStorage, "RTSTRUCT"
    ds.PatientID, ds.StudyInstanceUID, ds.SeriesInstanceUID = ct.PatientID, ct.StudyInstanceUID, generate_uid()
    series = Dataset()
    series.SeriesInstanceUID, series.ContourImageSequence = ct.SeriesInstanceUID, [image_ref(h) for h in headers]
    study = Dataset()
    study.RTReferencedSeriesSequence = [series]
    frame = Dataset()
    frame.FrameOfReferenceUID, frame.RTReferencedStudySequence = ct.FrameOfReferenceUID, [study]
    ds.ReferencedFrameOfReferenceSequence = [frame]
    ds.StructureSetROISequence, ds.ROIContourSequence = [], []
    for number, (name, contours) in enumerate(rois.items(), start=1):
        roi = Dataset()
        roi.ROINumber, roi.ROIName, roi.ReferencedFrameOfReferenceUID = number, name, ct.FrameOfReferenceUID
        ds.StructureSetROISequence.append(roi)
        item = Dataset()
        item.ReferencedROINumber, item.ContourSequence = number, []
        for k, points in contours:
            contour = Dataset()
            contour.ContourImageSequence = [image_ref(headers[k])]
            contour.ContourGeometricType, contour.NumberOfContourPoints = "CLOSED_PLANAR", len(points)
            contour.ContourData = [round(float(v), 4) for v in points.ravel()]
            item.ContourSequence.append(contour)
        ds.ROIContourSequence.append(item)
    path.parent.mkdir(parents=True, exist_ok=True)
    ds.save_as(path, enforce_file_format=True)
    return path


def contours_of(ellipsoids: list[dict], zs: np.ndarray) -> list[tuple[int, np.ndarray]]:
    sections = [(k, ellipse(e["centre"], e["radii"], z)) for k, z in enumerate(zs) for e in ellipsoids]
    return [(k, p) for k, p in sections if p is not None]


@pytest.fixture(scope="module", params=[False, True], ids=["axial", "rotated-in-plane"])
def case(tmp_path_factory, request):
    """A CT with 0.7 x 0.7 x 3 mm voxels, its headers in slice order, and an RTSTRUCT of :func:`shapes` plus two
    sub-pixel GTVs (a 0.15 mm circle and a single point, both between voxel centres)."""
    tmp = tmp_path_factory.mktemp("rtstruct")
    truth = write_case(tmp, "LUNG1-001", seed=3, shape=SHAPE, pixel_spacing=(PIXEL_MM, PIXEL_MM),
                       slice_spacing=SLICE_MM, flip_in_plane=request.param)  # fmt: skip
    ct = read_ct_series(truth["image_dir"])
    headers = [pydicom.dcmread(f, stop_before_pixels=True) for f in ct.files]
    zs = np.array([float(h.ImagePositionPatient[2]) for h in headers])
    rois = {name: contours_of(e, zs) for name, e in shapes(float(zs.mean())).items()}
    tiny_centre = np.array([float(truth["origin_lps"][0]) + 40.25 * PIXEL_MM, float(truth["origin_lps"][1])
                            + 20.25 * PIXEL_MM, zs[5]])  # fmt: skip
    circle = ellipse(tiny_centre, (0.15, 0.15, 1.0), zs[5], points=12)
    rois["GTV_4R"] = [(5, circle)]
    point = tiny_centre + np.array([6.2 * PIXEL_MM, 3.3 * PIXEL_MM, 0.0])
    rois["gtv-pre-op"] = [(5, point[None, :])]
    path = write_rtstruct(tmp / "rtstruct" / "1-1.dcm", headers, rois)
    return {"ct": ct, "headers": headers, "zs": zs, "path": path, "rois": rois, "tiny": [tiny_centre, point]}


def voxel_centres(ct) -> np.ndarray:
    ijk = np.stack(np.meshgrid(*[np.arange(n) for n in ct.hu.shape], indexing="ij"), -1).reshape(-1, 3)
    return ijk @ ct.affine_lps[:3, :3].T + ct.affine_lps[:3, 3]


def dice(a: np.ndarray, b: np.ndarray) -> float:
    return 2.0 * float((a & b).sum()) / float(a.sum() + b.sum())


def measure(case) -> dict[str, dict]:
    """Dice against the analytic voxel mask and centroid error (mm, per LPS axis) of each analytic ROI."""
    ct, z_mid = case["ct"], float(case["zs"].mean())
    labels = ["GTV-1", "GTV-2", "Lung-Left"]
    label, names = read_rtstruct_labels(case["path"], ct, labels)
    centres = voxel_centres(ct)
    figures = {"names": names}
    for index, (name, ellipsoids) in enumerate(shapes(z_mid).items(), start=1):
        truth = inside(centres, ellipsoids).reshape(ct.hu.shape)
        if name == "Lung-Left":  # GTV-1 was requested first: it keeps the voxels the two share
            truth &= ~inside(centres, shapes(z_mid)["GTV-1"]).reshape(ct.hu.shape)
            centroid_error = None
        else:
            got = centres[(label == index).reshape(-1)].mean(0)
            centroid_error = np.abs(got - analytic_centroid(ellipsoids))
        figures[name] = {"dice": dice(label == index, truth), "centroid_error_mm": centroid_error}
    return figures


def test_contoured_shapes_match_the_analytic_truth_in_world_mm(case):
    figures = measure(case)
    assert figures.pop("names") == {"GTV-1": ["GTV-1"], "GTV-2": ["gtv_2"], "Lung-Left": ["Lung-Left"]}
    half_voxel = np.array([PIXEL_MM, PIXEL_MM, SLICE_MM]) / 2
    for name, result in figures.items():
        assert result["dice"] >= 0.97, (name, result)
        if result["centroid_error_mm"] is not None:
            assert (result["centroid_error_mm"] <= half_voxel).all(), (name, result)


def test_hole_is_cut_out_and_both_tumours_are_kept(case):
    ct, z_mid = case["ct"], float(case["zs"].mean())
    label, _ = read_rtstruct_labels(case["path"], ct, ["GTV-1", "GTV-2"])
    centres = voxel_centres(ct)
    hole = shapes(z_mid)["GTV-1"][1]
    in_hole = ((((centres - hole["centre"]) / hole["radii"]) ** 2).sum(1) <= 1).reshape(ct.hu.shape)
    assert in_hole.sum() > 50 and not (label[in_hole] == 1).any()
    tumours = shapes(z_mid)["gtv_2"]
    for e in tumours:
        near = ((((centres - e["centre"]) / e["radii"]) ** 2).sum(1) <= 1).reshape(ct.hu.shape)
        assert (label[near] == 2).all()


def test_sub_pixel_gtvs_are_not_lost(case):
    """A 0.15 mm contour and a one-point contour cover no voxel centre; each still marks the voxel it lies in."""
    ct = case["ct"]
    label, names = read_rtstruct_labels(case["path"], ct, ["GTV_4R", "gtv-pre-op"])
    assert names == {"GTV_4R": ["GTV_4R"], "gtv-pre-op": ["gtv-pre-op"]}
    centres = voxel_centres(ct)
    for index, centre in enumerate(case["tiny"], start=1):
        marked = centres[(label == index).reshape(-1)]
        assert len(marked) == 1, f"label {index}: {len(marked)} voxels"
        assert (np.abs(marked[0] - centre) <= [PIXEL_MM / 2, PIXEL_MM / 2, 1e-3]).all()


def test_gtv_star_merges_every_gtv_and_names_them(case):
    label, names = read_rtstruct_labels(case["path"], case["ct"], ["GTV*"])
    assert names == {"GTV*": ["GTV-1", "gtv_2", "GTV_4R", "gtv-pre-op"]}
    separate, _ = read_rtstruct_labels(case["path"], case["ct"], ["GTV-1", "GTV-2", "GTV_4R", "gtv-pre-op"])
    np.testing.assert_array_equal(label == 1, separate > 0)


def rewrite(case, tmp_path: Path, change) -> Path:
    """A copy of the case's RTSTRUCT with ``change(dataset)`` applied."""
    ds = pydicom.dcmread(case["path"])
    change(ds)
    path = tmp_path / "changed.dcm"
    ds.save_as(path)
    return path


def shift_first_contour(ds: Dataset, mm: float) -> None:
    contour = ds.ROIContourSequence[0].ContourSequence[0]
    data = np.asarray(contour.ContourData, float).reshape(-1, 3)
    data[:, 2] += mm
    contour.ContourData = [round(float(v), 4) for v in data.ravel()]


def test_contour_between_slices_is_refused(case, tmp_path):
    path = rewrite(case, tmp_path, lambda ds: shift_first_contour(ds, SLICE_MM / 2))
    with pytest.raises(DicomCaseError, match=r"ROI 'GTV-1' contour 1 .* not on a CT slice") as err:
        read_rtstruct_labels(path, case["ct"], ["GTV-1"])
    assert path.name in str(err.value)


def test_contour_within_tolerance_of_a_slice_is_kept(case, tmp_path):
    path = rewrite(case, tmp_path, lambda ds: shift_first_contour(ds, 0.05 * SLICE_MM))
    label, _ = read_rtstruct_labels(path, case["ct"], ["GTV-1"])
    original, _ = read_rtstruct_labels(case["path"], case["ct"], ["GTV-1"])
    np.testing.assert_array_equal(label, original)


def test_contour_across_slices_is_refused(case, tmp_path):
    def tilt(ds):
        contour = ds.ROIContourSequence[0].ContourSequence[0]
        data = np.asarray(contour.ContourData, float).reshape(-1, 3)
        data[::2, 2] += SLICE_MM
        contour.ContourData = [round(float(v), 4) for v in data.ravel()]

    with pytest.raises(DicomCaseError, match="not on a CT slice"):
        read_rtstruct_labels(rewrite(case, tmp_path, tilt), case["ct"], ["GTV-1"])


def test_another_frame_of_reference_is_refused(case, tmp_path):
    def move(ds):
        ds.StructureSetROISequence[0].ReferencedFrameOfReferenceUID = generate_uid()

    path = rewrite(case, tmp_path, move)
    with pytest.raises(DicomCaseError, match=r"ROI 'GTV-1' references FrameOfReferenceUID .* another scan") as err:
        read_rtstruct_labels(path, case["ct"], ["GTV-1"])
    assert path.name in str(err.value)


def test_reference_to_another_slice_is_refused(case, tmp_path):
    def point_elsewhere(ds):
        image = ds.ROIContourSequence[0].ContourSequence[0].ContourImageSequence[0]
        image.ReferencedSOPInstanceUID = case["headers"][0].SOPInstanceUID

    with pytest.raises(DicomCaseError, match=r"lies on CT slice \d+ but references slice 0"):
        read_rtstruct_labels(rewrite(case, tmp_path, point_elsewhere), case["ct"], ["GTV-1"])


def test_another_series_is_refused(case, tmp_path):
    def other_series(ds):
        ds.ReferencedFrameOfReferenceSequence[0].RTReferencedStudySequence[0].RTReferencedSeriesSequence[
            0
        ].SeriesInstanceUID = generate_uid()

    with pytest.raises(DicomCaseError, match="references series"):
        read_rtstruct_labels(rewrite(case, tmp_path, other_series), case["ct"], ["GTV-1"])


def store_as_un(contour: Dataset, value: bytes) -> None:
    """Contour Data replaced by ``value`` with VR UN, as an Explicit VR writer stores a value longer than 65,534 bytes
    (PS3.5 6.2.2; pydicom keeps a known tag's UN value of that length as bytes when it reads it)."""
    assert len(value) > 0xFFFF
    del contour.ContourData
    contour.add_new(0x30060050, "UN", value + b" " * (len(value) % 2))


def test_contour_data_stored_as_un_is_read_as_its_decimal_text(case, tmp_path):
    """The first GTV contour's polygon with 11 points inserted along each edge (~4,000 points, > 64 KB of text) as UN:
    its numbers are the text's, and the mask is the original's."""
    text = []

    def densify(ds):
        contour = ds.ROIContourSequence[0].ContourSequence[0]
        corners = np.asarray(contour.ContourData, float).reshape(-1, 3)
        steps = np.arange(12)[None, :, None] / 12
        points = (corners[:, None] + steps * (np.roll(corners, -1, axis=0) - corners)[:, None]).reshape(-1, 3)
        text.append("\\".join(f"{v:.4f}" for v in points.ravel()))
        contour.NumberOfContourPoints = len(points)
        store_as_un(contour, text[0].encode())

    path = rewrite(case, tmp_path, densify)
    stored = pydicom.dcmread(path).ROIContourSequence[0].ContourSequence[0]
    assert stored["ContourData"].VR == "UN" and isinstance(stored.ContourData, bytes)  # pydicom's defaults
    numbers = _contour_data(stored, path, "GTV-1", 1)
    np.testing.assert_array_equal(numbers, [float(v) for v in text[0].split("\\")])
    label, _ = read_rtstruct_labels(path, case["ct"], ["GTV-1"])
    original, _ = read_rtstruct_labels(case["path"], case["ct"], ["GTV-1"])
    np.testing.assert_array_equal(label, original)


def test_contour_data_stored_as_un_that_is_not_numbers_is_named(case, tmp_path):
    path = rewrite(case, tmp_path, lambda ds: store_as_un(ds.ROIContourSequence[0].ContourSequence[1], b"\xff" * 70000))
    with pytest.raises(DicomCaseError, match=r"ROI 'GTV-1' contour 2: its Contour Data, stored as UN .*Export") as err:
        read_rtstruct_labels(path, case["ct"], ["GTV-1"])
    assert str(path) in str(err.value)


def test_missing_roi_names_the_file_and_the_rois(case):
    with pytest.raises(DicomCaseError, match=r"no ROI matches label 'Heart'.*GTV-1.*Lung-Left") as err:
        read_rtstruct_labels(case["path"], case["ct"], ["GTV-1", "Heart"])
    assert case["path"].name in str(err.value)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "a CT slice"])
def test_unreadable_rtstruct_is_named(case, tmp_path, damage):
    path = tmp_path / "1-1.dcm"
    if damage == "a CT slice":
        shutil.copy(case["ct"].files[0], path)
    else:
        data = case["path"].read_bytes()
        path.write_bytes(b"not a dicom file" * 10 if damage == "garbage" else data[: len(data) // 2])
    with pytest.raises(DicomCaseError, match=r"not a readable DICOM RTSTRUCT.*download the case again") as err:
        read_rtstruct_labels(path, case["ct"], ["GTV-1"])
    assert str(path) in str(err.value)
    assert is_rtstruct(path) == (damage == "truncated")  # the header still says RT Structure Set


def test_is_rtstruct(case, tmp_path):
    assert RTSTRUCT_STORAGE == "1.2.840.10008.5.1.4.1.1.481.3"
    assert is_rtstruct(case["path"]) and not is_rtstruct(case["ct"].files[0]) and not is_rtstruct(tmp_path / "none")

"""Synthetic NSCLC-like cases written as real DICOM in the TCIA layout (the demo's and the tests' data).

Output: ``<output_dir>/<collection>/<PatientID>/<SeriesNumber>/image/*.dcm`` (a CT series, one file per slice) and
``.../seg/1-1.dcm`` (a DICOM SEG written with highdicom, NSCLC-Radiomics segment names), the layout of
``monai.apps.TciaDataset``; the analytic truth goes to ``<output_dir>/synthetic_truth/<PatientID>.json``.

Anatomy is defined analytically in patient (LPS) millimetres: a body, two lungs, heart, oesophagus, spinal cord and
a tumour made of two ellipsoids, so it is asymmetric along every axis and any flip or axis swap in a reader shows.
A voxel belongs to a structure when its centre, computed from the DICOM geometry written here, is inside it.
This module deliberately shares no code with ``scripts.data.dicom``: the tests compare the two.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import highdicom as hd
import numpy as np
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.uid import CTImageStorage, ExplicitVRLittleEndian, RTStructureSetStorage, generate_uid
from scripts.common.config import ConfigError
from scripts.common.labels import COLLECTION
from scripts.data.dicom import segment_description
from tqdm import tqdm

logger = logging.getLogger(__name__)

SEGMENT_NAMES: tuple[str, ...] = ("GTV-1", "Lung-Left", "Lung-Right", "Heart", "Esophagus", "Spinal-Cord")
HU = {"air": -1000.0, "body": 40.0, "lung": -850.0, "heart": 50.0, "esophagus": 20.0, "bone": 700.0, "tumour": 45.0}
INTERCEPT = -1024.0
#: where :func:`generate` keeps each case's analytic truth (``<PatientID>.json``); it marks a folder as its own
TRUTH_DIR = "synthetic_truth"


@dataclass
class _Grid:
    """Voxel centres of the volume in patient (LPS) mm: voxel (i, j, k) is at (xs[i], ys[j], zs[k]).

    The mesh is sparse: every expression over it broadcasts to the volume only in its (boolean) result, so a
    realistic 512 x 512 x 120 case needs hundreds of MB, not tens of GB of float64 temporaries.
    """

    xs: np.ndarray
    ys: np.ndarray
    zs: np.ndarray
    row_spacing: float
    col_spacing: float
    slice_spacing: float

    @property
    def shape(self) -> tuple[int, int, int]:
        return len(self.xs), len(self.ys), len(self.zs)

    @property
    def mesh(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return np.meshgrid(self.xs, self.ys, self.zs, indexing="ij", sparse=True)

    @property
    def size_mm(self) -> tuple[float, float, float]:
        """Width along x and y (edge to edge), and the distance between the first and last slice centres."""
        return len(self.xs) * self.col_spacing, len(self.ys) * self.row_spacing, float(self.zs[-1] - self.zs[0])


def write_case(
    output_dir: str | Path,
    patient_id: str,
    seed: int,
    shape: Sequence[int] = (128, 128, 40),
    pixel_spacing: Sequence[float] = (0.9765625, 0.9765625),
    slice_spacing: float = 3.0,
    sparse_seg: bool = True,
    reverse_instance_numbers: bool = False,
    shuffle_file_names: bool = False,
    segments: Sequence[str] | None = None,
    gtv_name: str = "GTV-1",
    empty_gtv: bool = False,
    flip_in_plane: bool = False,
    collection: str = COLLECTION,
    tumour_hu: float = HU["tumour"],
    rtstruct: bool = False,
) -> dict:
    """Write one case and return its truth (also saved as JSON). ``shape`` is (columns, rows, slices).

    ``rtstruct`` also writes ``<case>/rtstruct/1-1.dcm``: the tumour as an RTSTRUCT ROI named ``gtv_name``, contoured
    analytically from its ellipsoids (see :func:`_write_rtstruct`); its path is then the truth's ``rtstruct_file``.

    ``flip_in_plane`` stores the slices rotated by 180 degrees (ImageOrientationPatient ``[-1, 0, 0, 0, -1, 0]``,
    as some scanners write prone or feet-first patients): the same anatomy in the same world position.
    """
    nx, ny, nz = (int(v) for v in shape)
    if min(nx, ny) < 32 or nz < 8:
        raise ValueError(f"shape={list(shape)}: need at least 32 x 32 x 8 voxels to draw the anatomy.")
    rng = np.random.default_rng(seed)  # every draw below, in this order, is part of the case's identity
    grid = _make_grid((nx, ny, nz), pixel_spacing, slice_spacing, rng)
    masks, body, lung_centres, lung_radii = _anatomy(grid)
    ellipsoids, side = _tumour(grid, lung_centres, lung_radii, rng)
    tumour = np.zeros(grid.shape, bool)
    for e in ellipsoids:
        tumour |= _ellipsoid(*grid.mesh, e["center_lps"], e["radii_mm"])
    masks["GTV-1"] = np.zeros(grid.shape, bool) if empty_gtv else tumour
    stored = _stored_pixels(grid, body, masks, None if empty_gtv else tumour, tumour_hu, rng)

    uid = _uid_maker(seed, patient_id)
    ct_series_number = 1 + int(rng.integers(1, 5))
    seg_series_number = 1000 + int(rng.integers(1, 400))
    case_dir = Path(output_dir) / collection / patient_id / str(seg_series_number)
    slices = _write_ct(case_dir / "image", grid, stored, patient_id, uid, ct_series_number, reverse_instance_numbers,
                       rng if shuffle_file_names else None, flip_in_plane)  # fmt: skip
    names = list(SEGMENT_NAMES if segments is None else segments)
    names = [gtv_name if n == "GTV-1" and segments is None else n for n in names]
    written = _write_seg(case_dir / "seg" / "1-1.dcm", slices, masks, names, gtv_name, uid, seg_series_number,
                         omit_empty=sparse_seg and not empty_gtv, flip_in_plane=flip_in_plane)  # fmt: skip

    x, y, z = grid.mesh
    voxels = np.stack([np.broadcast_to(c, grid.shape)[tumour] for c in (x, y, z)], -1)
    truth = {
        "patient_id": patient_id,
        "collection": collection,
        "seed": seed,
        "series_number": str(seg_series_number),
        "ct_series_uid": uid("ct"),
        "seg_series_uid": uid("seg"),
        "study_uid": uid("study"),
        "frame_of_reference_uid": uid("for"),
        "shape": [nx, ny, nz],
        "pixel_spacing": [grid.row_spacing, grid.col_spacing],
        "slice_spacing": float(slice_spacing),
        "origin_lps": [float(grid.xs[0]), float(grid.ys[0]), float(grid.zs[0])],
        "hu": {"air": HU["air"], "body": HU["body"], "lung": HU["lung"], "tumour": float(tumour_hu)},
        "tumour": {
            "ellipsoids": ellipsoids,
            "side": side,
            "num_voxels": int(tumour.sum()),
            "centroid_lps": [float(v) for v in voxels.mean(0)],
        },
        "structures": {n: {"num_voxels": int(masks["GTV-1" if n == gtv_name else n].sum())} for n in written},
        "segments": written,
        "sparse_seg": sparse_seg,
        "reverse_instance_numbers": reverse_instance_numbers,
        "shuffle_file_names": shuffle_file_names,
        "empty_gtv": empty_gtv,
        "flip_in_plane": flip_in_plane,
        "image_dir": str(case_dir / "image"),
        "seg_file": str(case_dir / "seg" / "1-1.dcm"),
    }
    if rtstruct:
        truth["rtstruct_file"] = _write_rtstruct(case_dir / "rtstruct" / "1-1.dcm", slices, grid, [] if empty_gtv
                                                 else ellipsoids, gtv_name, uid, seg_series_number + 1)  # fmt: skip
    truth_dir = Path(output_dir) / TRUTH_DIR
    truth_dir.mkdir(parents=True, exist_ok=True)
    (truth_dir / f"{patient_id}.json").write_text(json.dumps(truth, indent=2))
    return truth


def _make_grid(shape: tuple[int, int, int], pixel_spacing: Sequence[float], slice_spacing: float, rng) -> _Grid:
    """The volume centred on x = y = 0, its first slice near z = -300 mm (drawn: cases differ in position)."""
    nx, ny, nz = shape
    row_spacing, col_spacing = (float(v) for v in pixel_spacing)
    width_x, width_y = nx * col_spacing, ny * row_spacing
    origin = np.array([-width_x / 2 + col_spacing / 2, -width_y / 2 + row_spacing / 2, -300.0 + rng.uniform(-20, 20)])
    return _Grid(
        xs=origin[0] + np.arange(nx) * col_spacing,
        ys=origin[1] + np.arange(ny) * row_spacing,
        zs=origin[2] + np.arange(nz) * float(slice_spacing),
        row_spacing=row_spacing,
        col_spacing=col_spacing,
        slice_spacing=float(slice_spacing),
    )


def _anatomy(grid: _Grid) -> tuple[dict[str, np.ndarray], np.ndarray, dict[str, list[float]], list[float]]:
    """Body, lungs, heart, oesophagus and spinal cord as masks of the volume; also the lungs' centres and radii."""
    x, y, z = grid.mesh
    width_x, width_y, z_len = grid.size_mm
    z_mid = float(grid.zs.mean())
    body = (x / (0.44 * width_x)) ** 2 + (y / (0.36 * width_y)) ** 2 <= 1
    lung_r = [0.17 * width_x, 0.24 * width_y, 0.45 * z_len + grid.slice_spacing]
    lung_centres = {
        "Lung-Left": [0.2 * width_x, -0.02 * width_y, z_mid],
        "Lung-Right": [-0.2 * width_x, -0.02 * width_y, z_mid],
    }
    masks = {name: _ellipsoid(x, y, z, c, lung_r) & body for name, c in lung_centres.items()}
    heart_c = [0.05 * width_x, -0.12 * width_y, z_mid - 0.15 * z_len]
    masks["Heart"] = _ellipsoid(x, y, z, heart_c, [0.1 * width_x, 0.09 * width_y, 0.25 * z_len]) & body
    masks["Esophagus"] = ((x - 0.02 * width_x) ** 2 + (y - 0.1 * width_y) ** 2 <= (0.025 * width_x) ** 2) & body
    masks["Spinal-Cord"] = (x**2 + (y - 0.27 * width_y) ** 2 <= (0.03 * width_x) ** 2) & body
    masks = {name: np.broadcast_to(mask, grid.shape) for name, mask in masks.items()}
    return masks, np.broadcast_to(body, grid.shape), lung_centres, lung_r


def _tumour(grid: _Grid, lung_centres: dict, lung_radii: list[float], rng) -> tuple[list[dict], str]:
    """A main ellipsoid and an offset lobe inside one lung (LPS +x is the patient's left): asymmetric along every
    axis, so any flip or axis swap in a reader shows."""
    width_x, width_y, _ = grid.size_mm
    side = "left" if rng.random() < 0.5 else "right"
    lung_c = np.array(lung_centres["Lung-Left" if side == "left" else "Lung-Right"])
    radii = rng.uniform([10, 9, 10], [min(18, 0.08 * width_x + 8), min(16, 0.08 * width_y + 7), 24])
    centre = lung_c + rng.uniform(-0.3, 0.3, 3) * (np.array(lung_radii) - radii - 2)
    lobe_r = radii * rng.uniform(0.45, 0.6, 3)
    direction = np.array([rng.choice([-1, 1]) * 0.8, 0.6, rng.choice([-1, 1]) * 0.7])
    lobe_c = centre + direction * radii * 0.8
    ellipsoids = [
        {"center_lps": [float(v) for v in centre], "radii_mm": [float(v) for v in radii]},
        {"center_lps": [float(v) for v in lobe_c], "radii_mm": [float(v) for v in lobe_r]},
    ]
    return ellipsoids, side


def _stored_pixels(grid: _Grid, body, masks: dict, tumour: np.ndarray | None, tumour_hu: float, rng) -> np.ndarray:
    """HU of each structure plus noise (20 HU), as the 12-bit values a CT stores (HU - intercept)."""
    hu = np.full(grid.shape, HU["air"])
    hu[body] = HU["body"]
    for name in ("Lung-Left", "Lung-Right"):
        hu[masks[name]] = HU["lung"]
    hu[masks["Heart"]] = HU["heart"]
    hu[masks["Esophagus"]] = HU["esophagus"]
    hu[masks["Spinal-Cord"]] = HU["bone"]
    if tumour is not None:
        hu[tumour] = tumour_hu
    hu += rng.normal(0, 20, hu.shape)
    return np.clip(np.rint(hu - INTERCEPT), 0, 4095).astype(np.uint16)


def _uid_maker(seed: int, patient_id: str) -> Callable[[str], str]:
    """UIDs derived from the seed and patient: the same case always gets the same UIDs."""

    def uid(tag: str) -> str:
        return generate_uid(entropy_srcs=[str(seed), patient_id, tag])

    return uid


def _write_ct(
    image_dir: Path, grid: _Grid, stored: np.ndarray, patient_id: str, uid, series_number: int,
    reverse_instance_numbers: bool, shuffle_rng, flip_in_plane: bool,
) -> list[Dataset]:  # fmt: skip
    """One file per slice. InstanceNumber 1 = highest z (head first) unless reversed; file names follow
    InstanceNumber unless shuffled. Flipped in plane, column/row indices run towards -x/-y from the far corner."""
    nz = grid.shape[2]
    image_dir.mkdir(parents=True, exist_ok=True)
    instance = {k: (k + 1 if reverse_instance_numbers else nz - k) for k in range(nz)}
    name_of = {k: f"1-{instance[k]:03d}.dcm" for k in range(nz)}
    if shuffle_rng is not None:
        perm = shuffle_rng.permutation(nz)
        name_of = {k: f"1-{perm[k] + 1:03d}.dcm" for k in range(nz)}
    corner, orientation, in_plane = (grid.xs[0], grid.ys[0]), [1, 0, 0, 0, 1, 0], slice(None)
    if flip_in_plane:
        corner, orientation, in_plane = (grid.xs[-1], grid.ys[-1]), [-1, 0, 0, 0, -1, 0], slice(None, None, -1)
    slices = []
    for k in range(nz):
        ds = _ct_slice(stored[in_plane, in_plane, k].T, patient_id, uid("study"), uid("ct"), uid("for"),
                       uid(f"sop{k}"), series_number, instance[k],
                       [float(corner[0]), float(corner[1]), float(grid.zs[k])], orientation, grid.row_spacing,
                       grid.col_spacing, grid.slice_spacing)  # fmt: skip
        ds.save_as(image_dir / name_of[k], enforce_file_format=True)
        slices.append(ds)
    return slices


def _write_seg(
    path: Path, slices: list[Dataset], masks: dict, names: list[str], gtv_name: str, uid, series_number: int,
    omit_empty: bool, flip_in_plane: bool,
) -> list[str]:  # fmt: skip
    """A highdicom SEG with one segment per name (GTV-1 under ``gtv_name``); the names written (none: no file)."""
    seg_masks, descriptions = [], []
    for number, name in enumerate(names, start=1):
        key = "GTV-1" if name == gtv_name else name
        if key not in masks:
            raise ValueError(f"segment {name!r}: unknown; choose from {list(SEGMENT_NAMES)}.")
        seg_masks.append(masks[key])
        descriptions.append(segment_description(number, name))
    path.parent.mkdir(parents=True, exist_ok=True)
    if not descriptions:
        return []
    in_plane = slice(None, None, -1) if flip_in_plane else slice(None)
    stacked = np.stack(seg_masks, -1)[in_plane, in_plane]
    pixel = np.stack([stacked[:, :, k].transpose(1, 0, 2) for k in range(len(slices))]).astype(np.uint8)
    seg = hd.seg.Segmentation(
        source_images=slices,
        pixel_array=pixel,
        segmentation_type=hd.seg.SegmentationTypeValues.BINARY,
        segment_descriptions=descriptions,
        series_instance_uid=uid("seg"),
        series_number=series_number,
        sop_instance_uid=uid("segsop"),
        instance_number=1,
        manufacturer="NSCLC SwinUNETR bundle",
        manufacturer_model_name="scripts.synthetic",
        software_versions="1",
        device_serial_number="0",
        omit_empty_frames=omit_empty,
        content_date="20260101",
        content_time="120000",
    )
    seg.save_as(path)
    return names


def generate(
    output_dir: str | Path,
    num_cases: int = 10,
    shape: Sequence[int] = (128, 128, 40),
    seed: int = 0,
    collection: str = COLLECTION,
    tumour_hu: float = HU["tumour"],
    pixel_spacing: float = 0.9765625,
) -> list[dict]:
    """Write ``num_cases`` cases LUNG1-001, ...; case i uses ``seed + i``; cases already written are kept.

    Only into a folder of its own: one that does not exist, is empty, or holds this function's ``synthetic_truth/``.
    A folder holding anything else is refused (:class:`~scripts.common.config.ConfigError`): ``configs/demo.yaml``
    writes into ``--dataset_dir``, and a user's NSCLC-Radiomics copy has the demo's patient IDs (LUNG1-001, ...), so its
    cases would be overwritten or filled up with synthetic slices.

    ``tumour_hu`` defaults to a realistic soft-tissue value (the tumour is as bright as the body wall and stands out
    only against the lung); the demo raises it so that a tiny network learns the tumour in minutes on a CPU.
    ``pixel_spacing`` (mm, rows and columns): the demo writes its cases at its training grid's 2 mm, so that no
    interpolation blurs the tumour's edge.
    """
    _own_folder(Path(output_dir))
    truths = []
    for i in tqdm(range(int(num_cases)), desc="synthetic cases", unit="case"):
        pid = f"LUNG1-{i + 1:03d}"
        truth_file = Path(output_dir) / TRUTH_DIR / f"{pid}.json"
        if truth_file.is_file():
            truths.append(json.loads(truth_file.read_text()))
        else:
            spacing = (float(pixel_spacing), float(pixel_spacing))
            truths.append(write_case(output_dir, pid, int(seed) + i, shape, spacing, collection=collection,
                                     tumour_hu=tumour_hu))  # fmt: skip
    return truths


def _own_folder(folder: Path) -> None:
    """:class:`~scripts.common.config.ConfigError` when ``folder`` holds files :func:`generate` did not write."""
    if not folder.is_dir() or (folder / TRUTH_DIR).is_dir():
        return
    other = next((p for p in sorted(folder.iterdir()) if not p.name.startswith(".")), None)
    if other is not None:
        raise ConfigError(
            f"dataset_dir={folder}: the synthetic demo writes its cases only into an empty folder or one it wrote, and "
            f"this one holds other data ({other.name}): a real dataset would get synthetic slices among its own. For "
            "the demo leave out --dataset_dir (runs/demo/data) or give a new folder; for your data leave out "
            "configs/demo.yaml."
        )


def write_chest_case(
    output_dir: str | Path,
    patient_id: str = "P1",
    shape: Sequence[int] = (512, 512, 120),
    pixel_spacing: float = 0.9765625,
    slice_spacing: float = 3.0,
    pathology: str = "none",
    arms: bool = True,
    seed: int = 0,
) -> dict:
    """A chest CT as a real one holds it (:func:`scripts.data.phantom.chest`: neck, shoulders and arms, lungs,
    mediastinum, upper abdomen, couch) written as DICOM with a SEG of its tumour, in the TCIA layout; its truth."""
    from scripts.data.phantom import chest

    nx, ny, nz = (int(v) for v in shape)
    rng = np.random.default_rng(seed)
    grid = _make_grid((nx, ny, nz), (pixel_spacing, pixel_spacing), slice_spacing, rng)
    hu, tumour, truth = chest(grid.xs, grid.ys, grid.zs, pathology, arms=arms, seed=seed)
    stored = np.clip(np.rint(hu - INTERCEPT), 0, 4095).astype(np.uint16)
    uid = _uid_maker(seed, patient_id)
    case_dir = Path(output_dir) / COLLECTION / patient_id / "1"
    slices = _write_ct(case_dir / "image", grid, stored, patient_id, uid, 2, False, None, False)
    _write_seg(case_dir / "seg" / "1-1.dcm", slices, {"GTV-1": tumour}, ["GTV-1"], "GTV-1", uid, 1000, True, False)
    truth.update(patient_id=patient_id, shape=[nx, ny, nz], image_dir=str(case_dir / "image"),
                 seg_file=str(case_dir / "seg" / "1-1.dcm"))  # fmt: skip
    return truth


def tumour_contains(truth: dict, points_lps: np.ndarray) -> np.ndarray:
    """True for each (N, 3) LPS point inside the analytic tumour of ``truth``."""
    points = np.asarray(points_lps, dtype=float).reshape(-1, 3)
    inside = np.zeros(len(points), bool)
    for e in truth["tumour"]["ellipsoids"]:
        inside |= (((points - e["center_lps"]) / e["radii_mm"]) ** 2).sum(1) <= 1
    return inside


def _ellipsoid(x, y, z, centre, radii) -> np.ndarray:
    dx, dy, dz = (x - centre[0]) / radii[0], (y - centre[1]) / radii[1], (z - centre[2]) / radii[2]
    return dx**2 + dy**2 + dz**2 <= 1


def _ct_slice(pixels, patient_id, study_uid, series_uid, for_uid, sop_uid, series_number, instance, position,
              orientation, row_spacing, col_spacing, thickness) -> Dataset:  # fmt: skip
    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = CTImageStorage
    meta.MediaStorageSOPInstanceUID = sop_uid
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = Dataset()
    ds.file_meta = meta
    ds.SOPClassUID, ds.SOPInstanceUID = CTImageStorage, sop_uid
    ds.PatientID, ds.PatientName, ds.PatientSex, ds.PatientBirthDate = patient_id, f"{patient_id}^", "O", ""
    ds.StudyInstanceUID, ds.SeriesInstanceUID, ds.FrameOfReferenceUID = study_uid, series_uid, for_uid
    ds.StudyDate = ds.SeriesDate = ds.ContentDate = "20260101"
    ds.StudyTime = ds.SeriesTime = ds.ContentTime = "120000"
    ds.StudyID, ds.AccessionNumber, ds.ReferringPhysicianName = "1", "", ""
    ds.Modality, ds.Manufacturer, ds.SeriesNumber, ds.InstanceNumber = "CT", "synthetic", series_number, instance
    ds.AcquisitionNumber, ds.PatientPosition, ds.BodyPartExamined = 1, "HFS", "CHEST"  # a valid CT Image (dciodvfy)
    ds.ImageType = ["ORIGINAL", "PRIMARY", "AXIAL"]
    ds.ImagePositionPatient = [round(v, 4) for v in position]
    ds.ImageOrientationPatient = list(orientation)
    ds.PixelSpacing = [row_spacing, col_spacing]
    ds.SliceThickness = thickness
    ds.PositionReferenceIndicator = ""
    ds.Rows, ds.Columns = pixels.shape
    ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME2"
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 12, 11, 0
    ds.RescaleSlope, ds.RescaleIntercept, ds.RescaleType = 1, INTERCEPT, "HU"
    ds.KVP = 120
    ds.PixelData = np.ascontiguousarray(pixels, dtype=np.uint16).tobytes()
    return ds


def _write_rtstruct(
    path: Path, slices: list[Dataset], grid: _Grid, ellipsoids: list[dict], roi_name: str, uid, series_number: int
) -> str:
    """An RTSTRUCT with one ROI, the tumour, contoured analytically on every CT slice it crosses (no ellipsoid: the
    ROI has no contour); returns its path.

    Independent of the bundle's RTSTRUCT reader and writer: each contour is a dense polygon (720 points) of the
    exact cross-section of the ellipsoids at the slice's z, in LPS mm, never a traced voxel mask. Where the two
    cross-sections overlap, the contour is the outline of their union (one contour, as a planning system draws it:
    two overlapping contours would make the overlap a hole under the even-odd rule).
    """
    contours = []
    for k, z in enumerate(grid.zs):
        for outline in _tumour_outlines(ellipsoids, float(z)):
            points = np.column_stack([outline, np.full(len(outline), float(z))])
            contours.append((slices[k], points))
    ds = _rtstruct_dataset(slices, contours, roi_name, uid, series_number)
    path.parent.mkdir(parents=True, exist_ok=True)
    ds.save_as(path, enforce_file_format=True)
    return str(path)


def _tumour_outlines(ellipsoids: list[dict], z: float, points: int = 720) -> list[np.ndarray]:
    """The outlines ``(N, 2)`` (x, y in LPS mm) of the tumour's cross-section at ``z``: one per separate piece."""
    sections = []  # (cx, cy, a, b): axis-aligned ellipses in the plane z
    for e in ellipsoids:
        (cx, cy, cz), (rx, ry, rz) = e["center_lps"], e["radii_mm"]
        t = 1.0 - ((z - cz) / rz) ** 2
        if t > 0:
            sections.append((cx, cy, rx * np.sqrt(t), ry * np.sqrt(t)))
    if not sections:
        return []
    theta = np.linspace(0.0, 2 * np.pi, points, endpoint=False)
    centre = _point_inside_all(sections)
    if centre is not None:  # convex pieces with a common point: their union is star-shaped around it
        radius = np.max([_ray_to_ellipse(centre, theta, s) for s in sections], axis=0)
        return [centre + radius[:, None] * np.column_stack([np.cos(theta), np.sin(theta)])]
    outlines = [np.column_stack([cx + a * np.cos(theta), cy + b * np.sin(theta)]) for cx, cy, a, b in sections]
    for i, outline in enumerate(outlines):
        for j, (cx, cy, a, b) in enumerate(sections):
            if i != j and (((outline[:, 0] - cx) / a) ** 2 + ((outline[:, 1] - cy) / b) ** 2 <= 1).any():
                raise ValueError(f"z={z}: tumour cross-sections overlap without a common point found; cannot outline.")
    return outlines


def _point_inside_all(sections: list[tuple[float, float, float, float]]) -> np.ndarray | None:
    """A point strictly inside every ellipse of ``sections`` (searched on a grid over their common bounding box),
    or None when they share none."""
    low = np.max([(cx - a, cy - b) for cx, cy, a, b in sections], axis=0)
    high = np.min([(cx + a, cy + b) for cx, cy, a, b in sections], axis=0)
    if (low >= high).any():
        return None
    xs, ys = np.meshgrid(np.linspace(low[0], high[0], 41), np.linspace(low[1], high[1], 41))
    candidates = np.column_stack([xs.ravel(), ys.ravel()])
    margin = np.min([1 - ((candidates[:, 0] - cx) / a) ** 2 - ((candidates[:, 1] - cy) / b) ** 2
                     for cx, cy, a, b in sections], axis=0)  # fmt: skip
    best = int(margin.argmax())
    return candidates[best] if margin[best] > 1e-3 else None


def _ray_to_ellipse(origin: np.ndarray, theta: np.ndarray, section: tuple[float, float, float, float]) -> np.ndarray:
    """Distance from ``origin`` (inside the ellipse) to its boundary along each direction ``theta``: the positive
    root of |origin + r (cos, sin) - centre|_ellipse = 1."""
    cx, cy, a, b = section
    dx, dy = np.cos(theta), np.sin(theta)
    ox, oy = origin[0] - cx, origin[1] - cy
    qa = (dx / a) ** 2 + (dy / b) ** 2
    qb = 2 * (ox * dx / a**2 + oy * dy / b**2)
    qc = (ox / a) ** 2 + (oy / b) ** 2 - 1
    return (-qb + np.sqrt(qb**2 - 4 * qa * qc)) / (2 * qa)


def _rtstruct_dataset(
    slices: list[Dataset], contours: list[tuple[Dataset, np.ndarray]], roi_name: str, uid, series_number: int
) -> Dataset:
    """The RT Structure Set of one ROI (number 1, ``roi_name``) with ``contours`` (CT slice, (N, 3) LPS points)."""
    ct = slices[0]
    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID, meta.MediaStorageSOPInstanceUID = RTStructureSetStorage, uid("rtstructsop")
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = Dataset()
    ds.file_meta = meta
    ds.SOPClassUID, ds.SOPInstanceUID = RTStructureSetStorage, uid("rtstructsop")
    for key in ("PatientID", "PatientName", "PatientSex", "PatientBirthDate", "StudyInstanceUID", "StudyDate",
                "StudyTime", "StudyID", "AccessionNumber", "ReferringPhysicianName"):  # fmt: skip
        setattr(ds, key, ct.get(key))
    ds.Modality, ds.SeriesInstanceUID, ds.SeriesNumber = "RTSTRUCT", uid("rtstruct"), series_number
    ds.InstanceNumber, ds.FrameOfReferenceUID, ds.PositionReferenceIndicator = 1, ct.FrameOfReferenceUID, ""
    ds.Manufacturer, ds.OperatorsName, ds.StructureSetLabel = "synthetic", "", "synthetic"
    ds.StructureSetDate, ds.StructureSetTime = "20260101", "120000"
    series = Dataset()
    series.SeriesInstanceUID = ct.SeriesInstanceUID
    series.ContourImageSequence = [_image_reference(s) for s in slices]
    study = Dataset()
    study.ReferencedSOPClassUID, study.ReferencedSOPInstanceUID = "1.2.840.10008.3.1.2.3.1", ct.StudyInstanceUID
    study.RTReferencedSeriesSequence = [series]
    frame = Dataset()
    frame.FrameOfReferenceUID, frame.RTReferencedStudySequence = ct.FrameOfReferenceUID, [study]
    ds.ReferencedFrameOfReferenceSequence = [frame]
    roi = Dataset()
    roi.ROINumber, roi.ReferencedFrameOfReferenceUID, roi.ROIName = 1, ct.FrameOfReferenceUID, roi_name
    roi.ROIGenerationAlgorithm = "MANUAL"
    ds.StructureSetROISequence = [roi]
    roi_contour = Dataset()
    roi_contour.ReferencedROINumber, roi_contour.ROIDisplayColor = 1, [255, 0, 0]
    if contours:
        roi_contour.ContourSequence = [_contour_item(n, s, points) for n, (s, points) in enumerate(contours, 1)]
    ds.ROIContourSequence = [roi_contour]
    observation = Dataset()
    observation.ObservationNumber, observation.ReferencedROINumber = 1, 1
    observation.RTROIInterpretedType, observation.ROIInterpreter = "GTV", ""
    ds.RTROIObservationsSequence = [observation]
    return ds


def _image_reference(ct_slice: Dataset) -> Dataset:
    item = Dataset()
    item.ReferencedSOPClassUID, item.ReferencedSOPInstanceUID = ct_slice.SOPClassUID, ct_slice.SOPInstanceUID
    return item


def _contour_item(number: int, ct_slice: Dataset, points: np.ndarray) -> Dataset:
    """One CLOSED_PLANAR contour on ``ct_slice``, its points rounded to 0.1 micrometre (short DS strings)."""
    item = Dataset()
    item.ContourNumber, item.ContourImageSequence = number, [_image_reference(ct_slice)]
    item.ContourGeometricType, item.NumberOfContourPoints = "CLOSED_PLANAR", len(points)
    item.ContourData = [round(float(v), 4) for v in points.ravel()]
    return item

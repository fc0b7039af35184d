"""Synthetic NSCLC-like cases written as real DICOM in the TCIA layout (the demo's and the tests' data).

Output: ``<output_dir>/<collection>/<PatientID>/<SeriesNumber>/image/*.dcm`` (a CT series, one file per slice) and
``.../seg/1-1.dcm`` (a DICOM SEG written with highdicom, NSCLC-Radiomics segment names), the layout of
``monai.apps.TciaDataset``; the analytic truth goes to ``<output_dir>/synthetic_truth/<PatientID>.json``.

Anatomy is defined analytically in patient (LPS) millimetres: a body, two lungs, heart, oesophagus, spinal cord and
a tumour made of two ellipsoids, so it is asymmetric along every axis and any flip or axis swap in a reader shows.
A voxel belongs to a structure when its centre, computed from the DICOM geometry written here, is inside it.
This module deliberately shares no code with ``scripts.dicom``: the tests compare the two.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

import highdicom as hd
import numpy as np
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.uid import CTImageStorage, ExplicitVRLittleEndian, generate_uid
from tqdm import tqdm

from scripts.dicom import segment_description

logger = logging.getLogger(__name__)

SEGMENT_NAMES: tuple[str, ...] = ("GTV-1", "Lung-Left", "Lung-Right", "Heart", "Esophagus", "Spinal-Cord")
HU = {"air": -1000.0, "body": 40.0, "lung": -850.0, "heart": 50.0, "esophagus": 20.0, "bone": 700.0, "tumour": 45.0}
INTERCEPT = -1024.0


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
    collection: str = "NSCLC-Radiomics",
    tumour_hu: float = HU["tumour"],
) -> dict:
    """Write one case and return its truth (also saved as JSON). ``shape`` is (columns, rows, slices).

    ``flip_in_plane`` stores the slices rotated by 180 degrees (ImageOrientationPatient ``[-1, 0, 0, 0, -1, 0]``,
    as some scanners write prone or feet-first patients): the same anatomy in the same world position.
    """
    nx, ny, nz = (int(v) for v in shape)
    if min(nx, ny) < 32 or nz < 8:
        raise ValueError(f"shape={list(shape)}: need at least 32 x 32 x 8 voxels to draw the anatomy.")
    rng = np.random.default_rng(seed)
    row_spacing, col_spacing = (float(v) for v in pixel_spacing)
    names = list(SEGMENT_NAMES if segments is None else segments)
    names = [gtv_name if n == "GTV-1" and segments is None else n for n in names]

    # geometry: voxel (i, j, k) centre = origin + i * col_spacing * x + j * row_spacing * y + k * slice_spacing * z
    width_x, width_y = nx * col_spacing, ny * row_spacing
    origin = np.array([-width_x / 2 + col_spacing / 2, -width_y / 2 + row_spacing / 2, -300.0 + rng.uniform(-20, 20)])
    xs = origin[0] + np.arange(nx) * col_spacing
    ys = origin[1] + np.arange(ny) * row_spacing
    zs = origin[2] + np.arange(nz) * slice_spacing
    # sparse grids: every expression below broadcasts to the volume only in its (boolean) result, so a realistic
    # 512 x 512 x 120 case needs hundreds of MB, not tens of GB of float64 temporaries
    x, y, z = np.meshgrid(xs, ys, zs, indexing="ij", sparse=True)
    shape = (nx, ny, nz)
    z_mid, z_len = zs.mean(), zs[-1] - zs[0]

    body_a, body_b = 0.44 * width_x, 0.36 * width_y
    body = (x / body_a) ** 2 + (y / body_b) ** 2 <= 1
    lung_r = [0.17 * width_x, 0.24 * width_y, 0.45 * z_len + slice_spacing]
    lung_centres = {
        "Lung-Left": [0.2 * width_x, -0.02 * width_y, z_mid],
        "Lung-Right": [-0.2 * width_x, -0.02 * width_y, z_mid],
    }
    masks = {name: _ellipsoid(x, y, z, c, lung_r) & body for name, c in lung_centres.items()}
    heart_c = [0.05 * width_x, -0.12 * width_y, z_mid - 0.15 * z_len]
    masks["Heart"] = _ellipsoid(x, y, z, heart_c, [0.1 * width_x, 0.09 * width_y, 0.25 * z_len]) & body
    masks["Esophagus"] = ((x - 0.02 * width_x) ** 2 + (y - 0.1 * width_y) ** 2 <= (0.025 * width_x) ** 2) & body
    masks["Spinal-Cord"] = (x**2 + (y - 0.27 * width_y) ** 2 <= (0.03 * width_x) ** 2) & body
    body = np.broadcast_to(body, shape)
    masks = {name: np.broadcast_to(mask, shape) for name, mask in masks.items()}

    # tumour: a main ellipsoid and an offset lobe inside one lung; LPS +x is the patient's left
    side = "left" if rng.random() < 0.5 else "right"
    lung_c = np.array(lung_centres["Lung-Left" if side == "left" else "Lung-Right"])
    radii = rng.uniform([10, 9, 10], [min(18, 0.08 * width_x + 8), min(16, 0.08 * width_y + 7), 24])
    centre = lung_c + rng.uniform(-0.3, 0.3, 3) * (np.array(lung_r) - radii - 2)
    lobe_r = radii * rng.uniform(0.45, 0.6, 3)
    direction = np.array([rng.choice([-1, 1]) * 0.8, 0.6, rng.choice([-1, 1]) * 0.7])
    lobe_c = centre + direction * radii * 0.8
    ellipsoids = [
        {"center_lps": [float(v) for v in centre], "radii_mm": [float(v) for v in radii]},
        {"center_lps": [float(v) for v in lobe_c], "radii_mm": [float(v) for v in lobe_r]},
    ]
    tumour = np.zeros(shape, bool)
    for e in ellipsoids:
        tumour |= _ellipsoid(x, y, z, e["center_lps"], e["radii_mm"])
    if empty_gtv:
        masks["GTV-1"] = np.zeros(shape, bool)
    else:
        masks["GTV-1"] = tumour

    hu = np.full(shape, HU["air"])
    hu[body] = HU["body"]
    for name in ("Lung-Left", "Lung-Right"):
        hu[masks[name]] = HU["lung"]
    hu[masks["Heart"]] = HU["heart"]
    hu[masks["Esophagus"]] = HU["esophagus"]
    hu[masks["Spinal-Cord"]] = HU["bone"]
    if not empty_gtv:
        hu[tumour] = tumour_hu
    hu += rng.normal(0, 20, hu.shape)
    stored = np.clip(np.rint(hu - INTERCEPT), 0, 4095).astype(np.uint16)

    # UIDs: deterministic from the seed
    def uid(tag: str) -> str:
        return generate_uid(entropy_srcs=[str(seed), patient_id, tag])

    study_uid, ct_uid, seg_uid, for_uid = uid("study"), uid("ct"), uid("seg"), uid("for")
    ct_series_number = 1 + int(rng.integers(1, 5))
    seg_series_number = 1000 + int(rng.integers(1, 400))
    case_dir = Path(output_dir) / collection / patient_id / str(seg_series_number)
    image_dir, seg_dir = case_dir / "image", case_dir / "seg"
    image_dir.mkdir(parents=True, exist_ok=True)
    seg_dir.mkdir(parents=True, exist_ok=True)

    # InstanceNumber 1 = highest z (head first), unless reversed; names follow InstanceNumber unless shuffled
    instance = {k: (k + 1 if reverse_instance_numbers else nz - k) for k in range(nz)}
    name_of = {k: f"1-{instance[k]:03d}.dcm" for k in range(nz)}
    if shuffle_file_names:
        perm = rng.permutation(nz)
        name_of = {k: f"1-{perm[k] + 1:03d}.dcm" for k in range(nz)}
    slices = []
    # the first stored pixel and the in-plane directions; flipped, column/row indices run towards -x/-y
    corner, orientation, in_plane = (xs[0], ys[0]), [1, 0, 0, 0, 1, 0], slice(None)
    if flip_in_plane:
        corner, orientation, in_plane = (xs[-1], ys[-1]), [-1, 0, 0, 0, -1, 0], slice(None, None, -1)
    for k in range(nz):
        ds = _ct_slice(stored[in_plane, in_plane, k].T, patient_id, study_uid, ct_uid, for_uid, uid(f"sop{k}"),
                       ct_series_number, instance[k], [float(corner[0]), float(corner[1]), float(zs[k])], orientation,
                       row_spacing, col_spacing, slice_spacing)  # fmt: skip
        ds.save_as(image_dir / name_of[k], enforce_file_format=True)
        slices.append(ds)

    # SEG
    seg_masks, descriptions = [], []
    for number, name in enumerate(names, start=1):
        key = "GTV-1" if name == gtv_name else name
        if key not in masks:
            raise ValueError(f"segment {name!r}: unknown; choose from {list(SEGMENT_NAMES)}.")
        seg_masks.append(masks[key])
        descriptions.append(segment_description(number, name))
    written = []
    if descriptions:
        stacked = np.stack(seg_masks, -1)[in_plane, in_plane]
        pixel = np.stack([stacked[:, :, k].transpose(1, 0, 2) for k in range(nz)]).astype(np.uint8)
        seg = hd.seg.Segmentation(
            source_images=slices,
            pixel_array=pixel,
            segmentation_type=hd.seg.SegmentationTypeValues.BINARY,
            segment_descriptions=descriptions,
            series_instance_uid=seg_uid,
            series_number=seg_series_number,
            sop_instance_uid=uid("segsop"),
            instance_number=1,
            manufacturer="NSCLC SwinUNETR bundle",
            manufacturer_model_name="scripts.synthetic",
            software_versions="1",
            device_serial_number="0",
            omit_empty_frames=sparse_seg and not empty_gtv,
            content_date="20260101",
            content_time="120000",
        )
        seg.save_as(seg_dir / "1-1.dcm")
        written = names

    voxels = np.stack([np.broadcast_to(c, shape)[tumour] for c in (x, y, z)], -1)
    truth = {
        "patient_id": patient_id,
        "collection": collection,
        "seed": seed,
        "series_number": str(seg_series_number),
        "ct_series_uid": ct_uid,
        "seg_series_uid": seg_uid,
        "study_uid": study_uid,
        "frame_of_reference_uid": for_uid,
        "shape": [nx, ny, nz],
        "pixel_spacing": [row_spacing, col_spacing],
        "slice_spacing": float(slice_spacing),
        "origin_lps": [float(v) for v in origin],
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
        "image_dir": str(image_dir),
        "seg_file": str(seg_dir / "1-1.dcm"),
    }
    truth_dir = Path(output_dir) / "synthetic_truth"
    truth_dir.mkdir(parents=True, exist_ok=True)
    (truth_dir / f"{patient_id}.json").write_text(json.dumps(truth, indent=2))
    return truth


def generate(
    output_dir: str | Path,
    num_cases: int = 10,
    shape: Sequence[int] = (128, 128, 40),
    seed: int = 0,
    collection: str = "NSCLC-Radiomics",
    tumour_hu: float = HU["tumour"],
) -> list[dict]:
    """Write ``num_cases`` cases LUNG1-001, ...; case i uses ``seed + i``; cases already written are kept.

    ``tumour_hu`` defaults to a realistic soft-tissue value (the tumour is as bright as the body wall and stands out
    only against the lung); the demo raises it so that a tiny network learns the tumour in minutes on a CPU.
    """
    truths = []
    for i in tqdm(range(int(num_cases)), desc="synthetic cases", unit="case"):
        pid = f"LUNG1-{i + 1:03d}"
        truth_file = Path(output_dir) / "synthetic_truth" / f"{pid}.json"
        if truth_file.is_file():
            truths.append(json.loads(truth_file.read_text()))
        else:
            truths.append(
                write_case(output_dir, pid, seed=int(seed) + i, shape=shape, collection=collection, tumour_hu=tumour_hu)
            )
    return truths


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


if __name__ == "__main__":
    import fire

    fire.Fire(generate)

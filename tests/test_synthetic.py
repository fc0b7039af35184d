"""The synthetic case writer: its RTSTRUCT agrees with its SEG and with the analytic tumour, and the RTSTRUCT option
leaves every other output (and the random draws that make a case) as it was."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pydicom
import pytest
from scripts.data.dicom import read_ct_series, read_rtstruct_labels, read_seg_labels
from scripts.data.synthetic import tumour_contains, write_case

SHAPE = (64, 64, 24)
CASES = {  # id -> write_case options
    "plain": {"seed": 7},
    "rotated-in-plane": {"seed": 8, "flip_in_plane": True},
    "shuffled-reversed": {"seed": 9, "shuffle_file_names": True, "reverse_instance_numbers": True},
    "renamed-gtv": {"seed": 10, "gtv_name": "gtv 1"},
    "fine-pixels": {"seed": 11, "pixel_spacing": (0.7, 0.7), "shape": (96, 96, 16)},
}


def dice(a: np.ndarray, b: np.ndarray) -> float:
    return 2.0 * float((a & b).sum()) / float(a.sum() + b.sum())


def compare(tmp_path: Path, options: dict) -> dict:
    """Dice of the synthetic RTSTRUCT's GTV against the synthetic SEG's and against the analytic tumour."""
    options = {"shape": SHAPE, **options}
    truth = write_case(tmp_path, "LUNG1-001", rtstruct=True, **options)
    ct = read_ct_series(truth["image_dir"])
    from_seg, _ = read_seg_labels(truth["seg_file"], ct, ["GTV-1"])
    from_rtstruct, names = read_rtstruct_labels(truth["rtstruct_file"], ct, ["GTV-1"])
    ijk = np.stack(np.meshgrid(*[np.arange(n) for n in ct.hu.shape], indexing="ij"), -1).reshape(-1, 3)
    analytic = tumour_contains(truth, ijk @ ct.affine_lps[:3, :3].T + ct.affine_lps[:3, 3]).reshape(ct.hu.shape)
    return {
        "names": names,
        "dice_seg": dice(from_rtstruct == 1, from_seg == 1),
        "dice_analytic": dice(from_rtstruct == 1, analytic),
        "voxels": int((from_rtstruct == 1).sum()),
    }


@pytest.mark.parametrize("options", CASES.values(), ids=CASES.keys())
def test_synthetic_rtstruct_gives_the_labels_of_the_synthetic_seg(tmp_path, options):
    result = compare(tmp_path, options)
    assert result["names"] == {"GTV-1": [options.get("gtv_name", "GTV-1")]}
    assert result["voxels"] > 100
    assert result["dice_seg"] >= 0.97, result
    assert result["dice_analytic"] >= 0.97, result


def test_synthetic_rtstruct_of_an_empty_gtv_has_the_roi_and_no_contour(tmp_path, caplog):
    truth = write_case(tmp_path, "LUNG1-001", seed=4, shape=SHAPE, empty_gtv=True, rtstruct=True)
    with caplog.at_level(logging.WARNING):
        label, names = read_rtstruct_labels(truth["rtstruct_file"], read_ct_series(truth["image_dir"]), ["GTV-1"])
    assert names == {"GTV-1": ["GTV-1"]} and not label.any()
    assert "no closed contour" in caplog.text


def outputs(out: Path, truth: dict) -> dict[str, bytes]:
    """Every file of a written case but the RTSTRUCT: CT slices as bytes, the SEG without the values highdicom makes
    new on every write (creation time, dimension organisation UID), the truth without the output folder and the
    RTSTRUCT's path."""
    files = {}
    for path in sorted(p for p in out.rglob("*") if p.is_file() and "rtstruct" not in p.parts):
        key = str(path.relative_to(out))
        if path.suffix == ".json":
            data = json.loads(path.read_text().replace(str(out), "OUT"))
            data.pop("rtstruct_file", None)
            files[key] = json.dumps(data).encode()
        elif path.parent.name == "seg":
            seg = pydicom.dcmread(path)
            del seg.InstanceCreationTime, seg.ContributingEquipmentSequence, seg.DimensionOrganizationSequence
            for item in seg.DimensionIndexSequence:
                del item.DimensionOrganizationUID
            files[key] = repr(seg).encode() + seg.PixelData
        else:
            files[key] = path.read_bytes()
    assert files, truth
    return files


def test_rtstruct_option_changes_no_other_output(tmp_path):
    options = {"seed": 12, "shape": (40, 36, 10), "flip_in_plane": True, "shuffle_file_names": True}
    without = write_case(tmp_path / "a", "LUNG1-001", **options)
    with_rtstruct = write_case(tmp_path / "b", "LUNG1-001", rtstruct=True, **options)
    assert "rtstruct_file" not in without and Path(with_rtstruct["rtstruct_file"]).is_file()
    assert not (tmp_path / "a" / "NSCLC-Radiomics" / "LUNG1-001" / without["series_number"] / "rtstruct").exists()
    assert outputs(tmp_path / "a", without) == outputs(tmp_path / "b", with_rtstruct)


#: digests of cases written by the code before the RTSTRUCT option (commit f2775a8): decoded CT pixels, positions,
#: UIDs and instance numbers, file names, and the truth JSON (its output folder replaced)
DIGESTS = {
    "plain": "6e18233bbda0156d26da6afd060c493ef6683e8d034c75a9fe24e683cabfb261",
    "rotated-shuffled": "caa0dc3fcfd9af4dd16aaebf6c27a9bbfaddc3cd9e889a78c19dc5983e1fb429",
}


@pytest.mark.parametrize(
    "name, options", [("plain", {}), ("rotated-shuffled", {"flip_in_plane": True, "shuffle_file_names": True})]
)
def test_write_case_without_rtstruct_writes_what_it_wrote_before(tmp_path, name, options):
    truth = write_case(tmp_path, "LUNG1-002", seed=11, shape=(40, 36, 10), **options)
    digest = hashlib.sha256()
    for path in sorted(Path(truth["image_dir"]).iterdir()):
        ds = pydicom.dcmread(path)
        digest.update(path.name.encode())
        digest.update(ds.PixelData)
        digest.update(str(list(ds.ImagePositionPatient)).encode())
        digest.update(str(ds.SOPInstanceUID).encode())
        digest.update(str(ds.InstanceNumber).encode())
    digest.update((tmp_path / "synthetic_truth" / "LUNG1-002.json").read_text().replace(str(tmp_path), "OUT").encode())
    assert digest.hexdigest() == DIGESTS[name]


@pytest.mark.skipif(shutil.which("dciodvfy") is None, reason="dciodvfy (Debian's dicom3tools) is not installed")
def test_synthetic_ct_and_seg_are_valid_dicom_for_dciodvfy(tmp_path):
    truth = write_case(tmp_path, "LUNG1-001", seed=1, shape=(48, 48, 12), rtstruct=True)
    files = [sorted(Path(truth["image_dir"]).glob("*.dcm"))[0], Path(truth["seg_file"]), Path(truth["rtstruct_file"])]
    for path in files:
        result = subprocess.run(["dciodvfy", str(path)], capture_output=True, text=True, timeout=60)
        errors = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("Error")]
        assert errors == [], f"{path.name}: {errors}"


def test_the_demo_writes_only_into_a_folder_of_its_own_and_never_into_a_users_dataset(tmp_path):
    """configs/demo.yaml writes into --dataset_dir: a user's NSCLC-Radiomics copy (the demo's patient IDs) is refused,
    naming the setting and leaving every file as it was; a new folder is written, and a second run keeps its cases."""
    from scripts.common.config import ConfigError
    from scripts.data.synthetic import generate

    users = tmp_path / "tcia"
    series = users / "NSCLC-Radiomics" / "LUNG1-001" / "1" / "image"
    series.mkdir(parents=True)
    (series / "1-001.dcm").write_bytes(b"\0" * 128 + b"DICM" + b"a user's slice")
    before = {p: p.read_bytes() for p in users.rglob("*") if p.is_file()}
    with pytest.raises(ConfigError, match=rf"dataset_dir={users}: the synthetic demo .* holds other data \(NSCLC"):
        generate(users, num_cases=1, shape=(32, 32, 8))
    assert {p: p.read_bytes() for p in users.rglob("*") if p.is_file()} == before, "the user's folder is untouched"

    (first,) = generate(tmp_path / "demo", num_cases=1, shape=(32, 32, 8))
    (again,) = generate(tmp_path / "demo", num_cases=1, shape=(32, 32, 8), seed=5)
    assert again == first, "a folder it wrote is its own: the case written is kept"

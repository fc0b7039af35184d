"""Atomic writes: a reader never sees half a file, a failed write keeps the previous version and leaves no temporary
file behind, writers that choose their format by extension get the right one, JSON is written as documented, and a
NIfTI carries its affine as both qform and sform."""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import scripts.common.files
from conftest import ROOT
from scripts.common.files import csv_text, hold_lock, replace_atomically, save_nifti, write_json, write_text


def test_successful_write_puts_the_file_in_place_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "deep" / "er" / "report.txt"
    seen = []

    def write(tmp: Path) -> None:
        seen.append(tmp)
        assert not target.exists(), "the target appears only once the write is complete"
        tmp.write_text("done")

    assert replace_atomically(target, write) == target
    assert target.read_text() == "done"
    assert seen[0].parent == target.parent, "the temporary file is a sibling (same file system: atomic rename)"
    assert seen[0].name.startswith("."), "the temporary file is hidden from folder listings"
    assert sorted(p.name for p in target.parent.iterdir()) == ["report.txt"]


def test_failed_write_keeps_the_previous_version_and_removes_the_temporary(tmp_path):
    target = tmp_path / "labels.json"
    write_json(target, {"version": 1})

    def half_then_crash(tmp: Path) -> None:
        tmp.write_text('{"version": 2, "trunc')
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        replace_atomically(target, half_then_crash)
    assert json.loads(target.read_text()) == {"version": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["labels.json"]


def test_writer_that_fails_before_creating_anything_leaves_nothing(tmp_path):
    def crash(tmp: Path) -> None:
        raise ValueError("bad data")

    with pytest.raises(ValueError, match="bad data"):
        replace_atomically(tmp_path / "new.txt", crash)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("name", "suffix"),
    [("case.nii.gz", ".nii.gz"), ("case.nii", ".nii"), ("model.pt", ".pt"), ("LUNG1-001_seg.dcm", ".dcm")],
)
def test_temporary_file_keeps_the_full_suffix(tmp_path, name, suffix):
    names = []
    replace_atomically(tmp_path / name, lambda tmp: (names.append(tmp.name), tmp.write_bytes(b"x")))
    assert names[0].endswith(suffix)
    assert not names[0].endswith(".gz" + suffix), "no suffix is doubled"
    assert Path(names[0]).name != name


@pytest.mark.parametrize(("name", "gzipped"), [("volume.nii.gz", True), ("volume.nii", False)])
def test_nibabel_writes_the_format_the_final_name_asks_for(tmp_path, name, gzipped):
    path = save_nifti(tmp_path / name, np.arange(24, dtype=np.int16).reshape(2, 3, 4), np.eye(4))
    magic = path.read_bytes()[:2]
    assert (magic == b"\x1f\x8b") is gzipped
    if gzipped:
        gzip.decompress(path.read_bytes())  # a whole gzip stream, not a renamed plain file
    assert nib.load(path).get_fdata().sum() == sum(range(24))


def test_write_json_is_indented_ends_with_a_newline_and_passes_kwargs(tmp_path):
    path = write_json(tmp_path / "r.json", {"b": Path("/data/x"), "a": [1, 2]}, default=str, sort_keys=True)
    text = path.read_text()
    assert text == '{\n  "a": [\n    1,\n    2\n  ],\n  "b": "/data/x"\n}\n'
    with pytest.raises(TypeError):
        write_json(tmp_path / "s.json", {"b": Path("/data/x")})  # without default=str a Path is not JSON
    assert not (tmp_path / "s.json").exists()
    assert write_text(tmp_path / "t.txt", "hello").read_text() == "hello"


def lps_like_affine() -> np.ndarray:
    """A CT-like affine: anisotropic spacing, x and y flipped (an LPS-stored volume seen in RAS), an origin."""
    affine = np.diag([-0.8, -0.8, 2.5, 1.0])
    affine[:3, 3] = [120.0, 95.5, -310.0]
    return affine


def test_save_nifti_sets_qform_and_sform_to_the_affine_and_round_trips(tmp_path):
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 3, size=(7, 6, 5)).astype(np.uint8)
    affine = lps_like_affine()
    image = nib.load(save_nifti(tmp_path / "seg.nii.gz", labels, affine))
    qform, qcode = image.get_qform(coded=True)
    sform, scode = image.get_sform(coded=True)
    assert (int(qcode), int(scode)) == (1, 1)
    np.testing.assert_allclose(qform, affine, atol=1e-5)
    np.testing.assert_allclose(sform, affine, atol=1e-5)
    np.testing.assert_allclose(image.affine, affine, atol=1e-5)
    assert image.get_data_dtype() == np.uint8
    np.testing.assert_array_equal(np.asarray(image.dataobj), labels)


@pytest.mark.parametrize(("name", "dtype"), [("ct.nii", np.int16), ("seg.nii.gz", np.uint8), ("ct.nii.gz", np.int16)])
def test_save_nifti_writes_in_one_piece_the_bytes_nibabel_writes(tmp_path, monkeypatch, name, dtype):
    """Volumes in NIfTI order (as the DICOM readers make them) are written header-then-memory, gzipped in large
    chunks: the same bytes as nibabel.save, gzip header and compressed stream included; any other layout goes through
    nibabel itself."""
    monkeypatch.setattr(scripts.common.files, "NIFTI_GZIP_CHUNK", 1000)  # several zlib calls even for a small volume
    rng = np.random.default_rng(1)
    volume = np.asfortranarray(rng.integers(0, 120, size=(9, 8, 7)).astype(dtype))
    affine = lps_like_affine()
    reference = nib.Nifti1Image(volume, affine)
    reference.set_qform(affine, code=1)
    reference.set_sform(affine, code=1)
    nib.save(reference, tmp_path / f"nibabel-{name}")
    ours = save_nifti(tmp_path / name, volume, affine)
    assert ours.read_bytes() == (tmp_path / f"nibabel-{name}").read_bytes()
    c_order = np.ascontiguousarray(volume)  # not NIfTI's order: nibabel writes it
    np.testing.assert_array_equal(
        np.asarray(nib.load(save_nifti(tmp_path / f"c-{name}", c_order, affine)).dataobj), volume
    )


def test_save_nifti_replaces_an_existing_file(tmp_path):
    path = tmp_path / "seg.nii.gz"
    save_nifti(path, np.zeros((2, 2, 2), np.uint8), np.eye(4))
    save_nifti(path, np.ones((3, 3, 3), np.uint8), lps_like_affine())
    image = nib.load(path)
    assert image.shape == (3, 3, 3) and np.asarray(image.dataobj).all()
    assert [p.name for p in tmp_path.iterdir()] == ["seg.nii.gz"]


def test_csv_text_has_the_header_in_order_and_floats_to_six_digits():
    text = csv_text([{"case_id": "A", "dice": 0.123456789, "voxels": 12}], ["case_id", "dice", "voxels"])
    assert text == "case_id,dice,voxels\nA,0.123457,12\n"
    assert csv_text([], ["case_id"]) == "case_id\n"


@pytest.mark.parametrize(
    ("text", "expected"),
    [("LUNG1-001", "LUNG1-001"), ("Ünïcødé/../pat\\ient", "Ünïcødé_pat_ient"), ("..", "case"), (".hidden", "hidden"),
     ("a b\tc", "a_b_c"), ("1.2.840.1", "1.2.840.1"), ("张伟" * 40, "张伟" * 21)],
)  # fmt: skip
def test_safe_names_carry_any_script_and_never_a_path(text, expected):
    from scripts.common.files import safe_name

    assert safe_name(text) == expected
    assert len(safe_name(text).encode("utf-8")) <= 128 and "/" not in safe_name(text)


def test_unique_names_count_on_from_two():
    from scripts.common.files import unique_name

    taken: set[str] = set()
    assert [unique_name(n, taken) for n in ("a", "a", "b", "a")] == ["a", "a_2", "b", "a_3"]


def test_a_lock_is_held_for_the_process_life_and_another_process_is_told_who_holds_it(tmp_path):
    path = tmp_path / "sub" / "lock"
    assert hold_lock(path) is None and hold_lock(path) is None, "taken, then already this process's"
    code = f"from scripts.common.files import hold_lock; print(hold_lock({str(path)!r}))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert re.fullmatch(rf"process {os.getpid()} on \S+ since [0-9-]+ [0-9:]+\n", other.stdout), other.stdout

"""The CT series reader: slices ordered in space, HU from the rescale tags, and every malformed series refused
with the file named."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pydicom
import pytest
from dicom_factory import (
    TUMOUR_HU,
    UNEVEN_GAPS,
    Series,
    ct_slice,
    transcode,
    tumour_centre_of,
    uneven_series,
    write_series,
)
from scripts.data.dicom import DicomCaseError, read_case, read_ct_series, scan_ct_series, to_hu
from scripts.data.dicom.ct import read_hu
from scripts.data.synthetic import write_case

SHAPE = (64, 64, 24)


@pytest.fixture
def case(tmp_path) -> dict:
    return write_case(tmp_path, "LUNG1-009", seed=21, shape=SHAPE)


def slice_files_by_z(image_dir: Path) -> list[Path]:
    files = list(image_dir.glob("*.dcm"))
    return sorted(files, key=lambda p: float(pydicom.dcmread(p, stop_before_pixels=True).ImagePositionPatient[2]))


def test_hounsfield_units_come_from_rescale(tmp_path):
    truth = write_case(tmp_path, "LUNG1-001", seed=11, shape=SHAPE)
    volumes = read_case(truth["image_dir"], truth["seg_file"], ("GTV-1",))
    tumour = volumes.image[volumes.label == 1].astype(float)
    assert abs(tumour.mean() - truth["hu"]["tumour"]) < 10
    corner = volumes.image[:3, :3, :].astype(float)  # outside the body: air
    assert abs(corner.mean() - truth["hu"]["air"]) < 20
    assert volumes.image.dtype == np.int16


def test_missing_slice_is_a_gap(case):
    files = slice_files_by_z(Path(case["image_dir"]))
    files[len(files) // 2].unlink()
    with pytest.raises(DicomCaseError, match="1 missing slice"):
        read_ct_series(case["image_dir"])


def test_two_series_in_one_folder(case, tmp_path):
    other = write_case(tmp_path / "other", "LUNG1-010", seed=22, shape=SHAPE)
    shutil.copy(next(Path(other["image_dir"]).glob("*.dcm")), Path(case["image_dir"]) / "zz-intruder.dcm")
    with pytest.raises(DicomCaseError, match="2 series are mixed"):
        read_ct_series(case["image_dir"])


def test_inconsistent_orientation(case):
    path = slice_files_by_z(Path(case["image_dir"]))[3]
    ds = pydicom.dcmread(path)
    ds.ImageOrientationPatient = [1, 0, 0, 0, 0.9, -0.43588989]
    ds.save_as(path)
    with pytest.raises(DicomCaseError, match="ImageOrientationPatient") as err:
        read_ct_series(case["image_dir"])
    assert path.name in str(err.value)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_file_is_named(case, damage):
    path = slice_files_by_z(Path(case["image_dir"]))[5]
    data = path.read_bytes()
    path.write_bytes(b"not a dicom file" * 10 if damage == "garbage" else data[: len(data) // 2])
    with pytest.raises(DicomCaseError) as err:
        read_ct_series(case["image_dir"])
    assert path.name in str(err.value)


@pytest.mark.parametrize(
    ("dtype", "slope", "intercept"),
    [(np.uint16, 1, -1024), (np.int16, 1, 0), (np.uint16, 1, -1024.5), (np.int16, 0.5, -1000), (np.uint16, 2, -40000)],
)
def test_stored_values_become_hu_like_the_dicom_formula(dtype, slope, intercept):
    """HU = round(stored * slope + intercept), clipped to int16 -- by the integer shortcut or the float path alike."""
    stored = np.array([[0, 1, 1000], [2000, 4095, np.iinfo(dtype).max]], dtype=dtype)
    ds = pydicom.Dataset()
    ds.RescaleSlope, ds.RescaleIntercept = slope, intercept
    expected = np.clip(np.rint(stored.astype(np.float64) * slope + intercept), -32768, 32767).astype(np.int16)
    np.testing.assert_array_equal(to_hu(stored, ds), expected)


@pytest.mark.parametrize(
    ("representation", "bits_stored", "slope", "intercept", "padding", "fast"),
    [
        (0, 12, 1, -1024, None, True),  # the usual CT: unsigned 12 bits (garbage written above them)
        (0, 12, 1, -1024, 4000, True),  # with a padding value
        (1, 16, 1, 0, None, True),  # signed 16 bits, already HU
        (1, 12, 1, -24, -2000, True),  # signed 12 bits: the sign must be extended from bit 11
        (0, 15, 1, -1024, None, True),  # unsigned 15 bits: still fits int16
        (0, 16, 1, -1024, None, False),  # unsigned 16 bits: does not fit int16 -> the generic path
        (0, 12, 1, -1024.5, None, False),  # fractional intercept -> the generic path
        (1, 16, 2, -100, None, False),  # slope 2 -> the generic path
        (1, 16, 1, 30000, None, False),  # HU beyond int16 -> the generic path, clipped
    ],
)
def test_the_fast_slice_conversion_equals_pydicoms_decoder_and_the_formula(
    tmp_path, monkeypatch, representation, bits_stored, slope, intercept, padding, fast
):
    """read_hu's shortcut for uncompressed 16-bit slices gives exactly to_hu(pixel_array) -- high bits above
    BitsStored ignored (masked, or the sign extended), padding turned to air -- and anything else takes that path."""
    rng = np.random.default_rng(bits_stored)
    dtype = np.int16 if representation else np.uint16
    info = np.iinfo(dtype)
    raw = rng.integers(info.min, info.max, size=(16, 20), endpoint=True).astype(dtype)  # garbage in the unused bits
    ds = ct_slice(Series(shape=(20, 16, 1)), 0)
    ds.PixelRepresentation, ds.BitsStored, ds.HighBit = representation, bits_stored, bits_stored - 1
    ds.RescaleSlope, ds.RescaleIntercept = slope, intercept
    if padding is not None:
        raw[:2, :2] = padding
        ds.PixelPaddingValue = padding
    ds.PixelData = raw.tobytes()
    ds.save_as(tmp_path / "slice.dcm", enforce_file_format=True)
    ds = pydicom.dcmread(tmp_path / "slice.dcm")
    expected = to_hu(ds.pixel_array, ds)  # pydicom's decoder, then the formula
    out = np.empty((16, 20), np.int16)
    if fast:  # the shortcut must not fall back to the generic decoder
        monkeypatch.setattr("scripts.data.dicom.ct.decode", lambda *a: pytest.fail("took the generic path"))
    np.testing.assert_array_equal(read_hu(tmp_path / "slice.dcm", ds, out), expected)
    if padding is not None:
        assert (out[:2, :2] == -1024).all()


# ---------------------------------------------------------------------------------------------------------------------
# real-world exports (series written by tests/dicom_factory.py, independently of the reader)


def test_a_small_gantry_tilt_is_kept_exactly_in_world_coordinates(tmp_path):
    series = Series(tilt_deg=0.6)  # 0.03 mm sideways per slice: 0.47 mm over 16 slices, under half a 2 mm pixel
    write_series(series, tmp_path)
    ct = read_ct_series(tmp_path)
    step = ct.affine_lps[:3, 2]
    np.testing.assert_allclose(step, series.positions()[1] - series.positions()[0], atol=1e-3)
    centre = tumour_centre_of(ct.hu == TUMOUR_HU, ct.affine_ras)
    np.testing.assert_allclose(centre, series.tumour_centre, atol=0.5)  # mm
    assert any("sideways" in note for note in ct.notes)


def test_a_gantry_tilt_beyond_half_a_pixel_is_refused_with_the_angle(tmp_path):
    write_series(Series(tilt_deg=15.0), tmp_path)
    with pytest.raises(DicomCaseError, match=r"gantry tilt of 15\.0 deg.*dcm2niix"):
        read_ct_series(tmp_path)


def test_a_ct_without_rescale_tags_is_refused_not_guessed(tmp_path):
    write_series(Series(), tmp_path)
    path = sorted(tmp_path.glob("*.dcm"))[3]
    ds = pydicom.dcmread(path)
    del ds.RescaleIntercept
    ds.save_as(path)
    with pytest.raises(DicomCaseError, match="no RescaleSlope/RescaleIntercept") as err:
        read_ct_series(tmp_path)
    assert path.name in str(err.value)


def test_padding_outside_the_field_of_view_becomes_air(tmp_path):
    series = Series()
    slices = write_series(series, tmp_path)
    for ds in slices:  # the corners are outside the scanner's circle: stored as padding
        pixels = np.frombuffer(ds.PixelData, np.uint16).reshape(ds.Rows, ds.Columns).copy()
        pixels[:4, :4] = 4000
        ds.PixelData, ds.PixelPaddingValue = pixels.tobytes(), 4000
        ds.save_as(tmp_path / f"{ds.InstanceNumber:04d}.dcm", enforce_file_format=True)
    ct = read_ct_series(tmp_path)
    assert (ct.hu[:4, :4, :] == -1024).all() and ct.hu.max() == TUMOUR_HU


def test_non_image_objects_in_the_folder_are_skipped_by_what_they_are(tmp_path):
    series = Series()
    write_series(series, tmp_path)
    (tmp_path / "Thumbs.db").write_bytes(b"\x00\x01windows thumbnail cache")
    (tmp_path / "README").write_text("exported by PACS")
    presentation = ct_slice(series, 0)  # the same header as a slice, but a presentation state
    presentation.SOPClassUID = presentation.file_meta.MediaStorageSOPClassUID = "1.2.840.10008.5.1.4.1.1.11.1"
    presentation.SOPInstanceUID = presentation.file_meta.MediaStorageSOPInstanceUID = series.uid("pr")
    presentation.save_as(tmp_path / "PR000001", enforce_file_format=True)
    directory = pydicom.Dataset()
    directory.file_meta = pydicom.dataset.FileMetaDataset()
    directory.file_meta.MediaStorageSOPClassUID = "1.2.840.10008.1.3.10"
    directory.file_meta.MediaStorageSOPInstanceUID = series.uid("dicomdir")
    directory.file_meta.TransferSyntaxUID = pydicom.uid.ExplicitVRLittleEndian
    directory.DirectoryRecordSequence = []
    directory.save_as(tmp_path / "DICOMDIR", enforce_file_format=True)
    ct = read_ct_series(tmp_path)
    assert ct.hu.shape == series.shape
    note = " ".join(ct.notes)
    for name in ("Thumbs.db (not DICOM)", "README (not DICOM)", "DICOMDIR (DICOMDIR)", "PR000001 (Grayscale Softcopy"):
        assert name in note, note


@pytest.mark.parametrize(
    "syntax",
    ["1.2.840.10008.1.2.4.70", "1.2.840.10008.1.2.4.57", "1.2.840.10008.1.2.4.80", "1.2.840.10008.1.2.4.90",
     "1.2.840.10008.1.2.5", "1.2.840.10008.1.2.1.99"],
    ids=["jpeg-lossless-sv1", "jpeg-lossless", "jpeg-ls", "jpeg-2000", "rle", "deflate"],
)  # fmt: skip
def test_compressed_series_decode_to_the_same_hounsfield_units(tmp_path, syntax):
    pytest.importorskip("gdcm", reason="python-gdcm (requirements-dev.txt) encodes the JPEG test files")
    series = Series(shape=(32, 32, 6))
    write_series(series, tmp_path / "plain")
    write_series(series, tmp_path / "packed")
    for path in (tmp_path / "packed").glob("*.dcm"):
        transcode(path, syntax)
    assert str(pydicom.dcmread(path).file_meta.TransferSyntaxUID) == syntax
    plain, packed = read_ct_series(tmp_path / "plain"), read_ct_series(tmp_path / "packed")
    np.testing.assert_array_equal(packed.hu, plain.hu)  # every syntax here is lossless


def test_an_undecodable_syntax_names_the_syntax_and_the_package(tmp_path, monkeypatch):
    pytest.importorskip("gdcm", reason="python-gdcm (requirements-dev.txt) encodes the JPEG test files")
    write_series(Series(shape=(32, 32, 4)), tmp_path)
    for path in tmp_path.glob("*.dcm"):
        transcode(path, "1.2.840.10008.1.2.4.70")
    from pydicom.pixels.decoders import JPEGLosslessSV1Decoder

    monkeypatch.setattr(JPEGLosslessSV1Decoder, "_available", {})  # as on a machine without the decoder packages
    with pytest.raises(DicomCaseError, match=r"JPEG Lossless.*1\.2\.840\.10008\.1\.2\.4\.70.*install one of") as err:
        read_ct_series(tmp_path)
    assert "download" not in str(err.value)


def test_cut_pixel_data_is_named_as_cut(tmp_path):
    write_series(Series(), tmp_path)
    path = sorted(tmp_path.glob("*.dcm"))[2]
    ds = pydicom.dcmread(path)
    ds.PixelData = ds.PixelData[: len(ds.PixelData) // 2]
    ds.save_as(path)
    with pytest.raises(DicomCaseError, match="cut or damaged") as err:
        read_ct_series(tmp_path)
    assert path.name in str(err.value)


def test_an_enhanced_multiframe_ct_is_refused_with_what_it_is(tmp_path):
    series = Series()
    write_series(series, tmp_path)
    enhanced = ct_slice(series, 0)
    enhanced.SOPClassUID = enhanced.file_meta.MediaStorageSOPClassUID = "1.2.840.10008.5.1.4.1.1.2.1"
    enhanced.save_as(tmp_path / "enhanced.dcm", enforce_file_format=True)
    with pytest.raises(DicomCaseError, match=r"Enhanced CT Image.*multi-frame.*one file per slice"):
        read_ct_series(tmp_path)


# ---------------------------------------------------------------------------------------------------------------------
# slices as scanners acquire them: uneven gaps, gantry tilt, and the missing files that look like them


def test_uneven_spacing_is_refused_by_default_naming_the_gaps_and_not_asking_for_a_download(tmp_path):
    write_series(uneven_series(), tmp_path)
    with pytest.raises(DicomCaseError, match=r"uneven slice spacing \(1\.10-7\.40 mm along the slice normal\)") as err:
        read_ct_series(tmp_path)
    message = str(err.value)
    assert "a gantry tilt of" not in message and "download the series again" not in message
    assert "point to no missing file" in message and "Inference takes the series as it is" in message


def test_uneven_spacing_with_a_gantry_tilt_names_both(tmp_path):
    write_series(uneven_series(tilt_deg=18.5), tmp_path)
    with pytest.raises(DicomCaseError, match=r"uneven slice spacing \(1\.10-7\.40 mm.* and a gantry tilt of 18\.5 deg"):
        read_ct_series(tmp_path)


def test_a_gantry_tilt_alone_is_named_without_uneven_spacing(tmp_path):
    write_series(Series(shape=SHAPE, tilt_deg=15.0), tmp_path)
    with pytest.raises(DicomCaseError) as err:
        read_ct_series(tmp_path)
    assert "uneven" not in str(err.value) and "download the series again" not in str(err.value)


@pytest.mark.parametrize("resample", [False, True])
def test_a_gap_of_whole_steps_is_a_missing_slice_to_download_again_even_when_resampling(case, resample):
    files = slice_files_by_z(Path(case["image_dir"]))
    files[7].unlink()
    files[15].unlink()
    files[16].unlink()
    with pytest.raises(DicomCaseError, match=r"1 missing slice\(s\) between .*\(3 missing in all, at 2 gaps\); "
                       r"download the series again\.$"):  # fmt: skip
        read_ct_series(case["image_dir"], resample=resample)


@pytest.mark.parametrize("resample", [False, True])
def test_an_instance_number_gap_in_an_uneven_series_is_a_missing_slice(tmp_path, resample):
    write_series(uneven_series(), tmp_path)
    (tmp_path / "0013.dcm").unlink()  # gaps 1.7 + 7.4 = 9.1 mm: uneven like the others, but instance 13 is gone
    with pytest.raises(DicomCaseError, match=r"1 missing slice\(s\): InstanceNumber jumps from 12 to 14 between "
                       r"0012\.dcm .* 9\.10 mm apart.*; download the series again\.$"):  # fmt: skip
        read_ct_series(tmp_path, resample=resample)


def test_instance_numbers_out_of_spatial_order_prove_no_missing_file(tmp_path):
    for ds in write_series(uneven_series(), tmp_path):
        name = f"{ds.InstanceNumber:04d}.dcm"
        ds.InstanceNumber = (ds.InstanceNumber * 7) % 25  # numbers in no spatial order: no evidence either way
        ds.save_as(tmp_path / name, enforce_file_format=True)
    (tmp_path / "0013.dcm").unlink()  # the slice whose loss the previous test detects from ordered numbers
    ct = read_ct_series(tmp_path, resample=True)
    assert len(ct.sop_instance_uids) == 23 and any("uneven slice spacing" in note for note in ct.notes)


@pytest.mark.parametrize(
    ("tilt_deg", "gaps"),
    [(0.0, UNEVEN_GAPS), (18.5, UNEVEN_GAPS), (-18.5, UNEVEN_GAPS), (15.0, ())],
    ids=["uneven", "tilted-uneven", "tilted-back-uneven", "tilted"],
)
def test_a_resampled_series_places_the_tumour_in_world_mm_and_maps_back_onto_its_slices(tmp_path, tilt_deg, gaps):
    """resample=True: an orthogonal grid at an equal step no larger than the smallest gap, the first and last planes
    on the first and last slices, the tumour (the bright voxels) centred where the writer put it, and thresholded on
    the grid then mapped back, on every original slice what the writer drew there."""
    series = uneven_series(tilt_deg, gaps)
    write_series(series, tmp_path)
    for path in sorted(tmp_path.glob("*.dcm")):  # names in reverse z order: the order comes from the positions
        path.rename(tmp_path / f"z{25 - int(path.stem):04d}.dcm")
    ct = read_ct_series(tmp_path, resample=True)
    positions = series.positions()
    assert ct.sop_instance_uids == [series.uid(f"sop{k}") for k in range(24)]  # every slice, in z order
    step = ct.affine_lps[:3, 2]
    np.testing.assert_allclose(step[:2], 0.0, atol=1e-6 if tilt_deg else 1e-2)  # along the normal (z): orthogonal
    assert step[2] <= min(np.diff(positions[:, 2])) + 1e-6
    assert ct.hu.shape[2] == round((positions[-1, 2] - positions[0, 2]) / step[2]) + 1
    np.testing.assert_allclose(ct.slices.origins[[0, -1], 2], [0, ct.hu.shape[2] - 1], atol=1e-6)
    i, j = ct.slices.origins[0, :2].astype(int)  # the grid's pixels are the first slice's (widened for the tilt)
    np.testing.assert_array_equal(ct.slices.origins[0, :2], (i, j))
    assert i == 0 and (j == 0) == (tilt_deg >= 0)
    np.testing.assert_array_equal(ct.hu[i : i + 64, j : j + 64, 0].T, series.hu(0))  # a plane on a slice: its HU
    centre = tumour_centre_of(ct.hu > (TUMOUR_HU / 2), ct.affine_ras)
    np.testing.assert_allclose(centre, series.tumour_centre, atol=0.5)  # mm
    back = ct.slices.to_slices((ct.hu > TUMOUR_HU / 2).astype(np.uint8)).astype(bool)
    truth = series.tumour_on_slices()
    assert (back != truth).sum() <= 0.02 * truth.sum(), f"{(back != truth).sum()} of {truth.sum()} voxels differ"
    (note,) = [n for n in ct.notes if "resampled" in n]
    assert note.startswith("24 slices with ") and "labels are written back on the original slices" in note
    assert ("uneven slice spacing (1.10-7.40 mm" in note) == bool(gaps)
    assert (f"gantry tilt of {abs(tilt_deg):.1f} deg" in note) == bool(tilt_deg)


def test_a_regular_series_is_read_as_before_without_a_slice_map(case):
    ct = read_ct_series(case["image_dir"], resample=True)
    plain = read_ct_series(case["image_dir"])
    assert ct.slices is None and plain.slices is None
    np.testing.assert_array_equal(ct.hu, plain.hu)
    np.testing.assert_array_equal(ct.affine_lps, plain.affine_lps)


def test_the_slices_are_read_ahead_and_the_volume_is_the_one_read_without(case, monkeypatch):
    """The kernel is asked to read every slice ahead (posix_fadvise WILLNEED) before pydicom parses them, once, only
    when the pixels are read; the volume and its order are those read without the hint, and a platform without
    posix_fadvise reads the same."""
    monkeypatch.delattr(os, "posix_fadvise", raising=False)
    plain = read_ct_series(case["image_dir"])
    advised = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, offset, length, advice: advised.append((fd, advice)),
                        raising=False)  # fmt: skip
    hinted = read_ct_series(case["image_dir"])
    assert len(advised) == SHAPE[2] and {a for _, a in advised} == {os.POSIX_FADV_WILLNEED}
    np.testing.assert_array_equal(hinted.hu, plain.hu)
    assert hinted.hu.strides == plain.hu.strides and hinted.sop_instance_uids == plain.sop_instance_uids
    advised.clear()
    scan_ct_series(case["image_dir"])  # headers only: nothing to read ahead
    assert not advised


def test_a_label_map_on_another_grid_is_not_mapped_back(tmp_path):
    write_series(uneven_series(), tmp_path)
    ct = read_ct_series(tmp_path, resample=True)
    with pytest.raises(ValueError, match="not on the resampled grid"):
        ct.slices.to_slices(np.zeros((64, 64, 24), np.uint8))


def test_a_tiny_gap_caps_the_grid_at_four_times_the_slices_and_says_so(tmp_path):
    gaps = (3.0,) * 11 + (0.2,) + (3.0,) * 11  # one slice 0.2 mm above another: a 0.2 mm step would take 330 planes
    write_series(uneven_series(gaps=gaps), tmp_path)
    ct = read_ct_series(tmp_path, resample=True)
    assert ct.hu.shape[2] == 4 * 24
    np.testing.assert_allclose(ct.spacing[2], sum(gaps) / (4 * 24 - 1))
    assert "4x the slices at most, so above the smallest gap" in ct.notes[-1]


def test_an_uneven_series_off_its_line_by_more_than_half_a_pixel_is_refused(tmp_path):
    write_series(uneven_series(), tmp_path)
    ds = pydicom.dcmread(tmp_path / "0010.dcm")
    ds.ImagePositionPatient = [ds.ImagePositionPatient[0] + 1.5, *ds.ImagePositionPatient[1:]]  # 3/4 of a pixel
    ds.save_as(tmp_path / "0010.dcm")
    with pytest.raises(DicomCaseError, match=r"do not lie on one straight line \(off by 1\.50 mm\)"):
        read_ct_series(tmp_path, resample=True)


@pytest.mark.parametrize(
    ("tilt_deg", "gaps", "tagged"),
    [(18.5, UNEVEN_GAPS, True), (-18.5, (), False)],
    ids=["ge-uneven-tagged", "philips-untagged"],
)
def test_a_tilt_written_as_scanners_write_it_is_read_onto_an_orthogonal_grid_in_world_mm(
    tmp_path, tilt_deg, gaps, tagged
):
    """GE and Philips write a gantry tilt as tilted planes (ImageOrientationPatient [1, 0, 0, 0, cos, -sin]) whose
    positions step straight along z: a sheared stack like the factory's other form. Read with resample=True, the grid
    is orthogonal (its axes the slices' row, column and normal), the tumour is where the writer put it in mm, and a
    label map thresholded on the grid comes back onto every original slice as the writer drew it there."""
    series = uneven_series(tilt_deg, gaps, tilt_form="scanner", gantry_tag=tagged)
    if not gaps:
        series.slice_spacing = 2.5
    write_series(series, tmp_path)
    ct = read_ct_series(tmp_path, resample=True)
    assert len(ct.sop_instance_uids) == 24
    axes = ct.affine_lps[:3, :3] / np.linalg.norm(ct.affine_lps[:3, :3], axis=0)
    np.testing.assert_allclose(axes.T @ axes, np.eye(3), atol=1e-6)  # orthogonal
    row, column = series.directions()
    np.testing.assert_allclose(axes[:, 2], np.cross(row, column), atol=1e-6)  # the third axis is the planes' normal
    centre = tumour_centre_of(ct.hu > (TUMOUR_HU / 2), ct.affine_ras)
    np.testing.assert_allclose(centre, series.tumour_centre, atol=0.5)  # mm
    back = ct.slices.to_slices((ct.hu > TUMOUR_HU / 2).astype(np.uint8)).astype(bool)
    truth = series.tumour_on_slices()
    assert truth.sum() > 0 and (back != truth).sum() <= 0.02 * truth.sum()
    (note,) = [n for n in ct.notes if "resampled" in n]
    assert f"gantry tilt of {abs(tilt_deg):.1f} deg" in note

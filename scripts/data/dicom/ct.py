"""A CT series folder (one file per slice) -> HU volume on its own voxel grid, with the LPS affine that places it.

* :func:`scan_ct_series` reads the headers and checks, before any pixel is decoded, that the folder holds one
  series, one orientation, one in-plane geometry and slices on a straight line. Slices are ordered by their position
  along the slice normal -- never by file name or InstanceNumber.
* :func:`read_ct_series` then decodes the pixels into an int16 HU volume indexed ``[column, row, slice]``.

What a folder may hold besides the slices is classified by SOP Class, not by failing: a DICOMDIR, presentation
states, key objects, SRs, SEGs, RTSTRUCTs, secondary captures and files that are not DICOM at all (``Thumbs.db``,
``LICENSE``) are skipped and listed in :attr:`CtSeries.notes`. What cannot be placed or converted correctly is
refused with :class:`DicomCaseError` naming the file and the cause:

* a file that is DICOM but cut or damaged, or a slice without the tags that place it in space;
* a missing file: a gap between slices that is a whole multiple (2x, 3x, ...) of the usual step, or -- in a series
  whose gaps vary -- a jump in InstanceNumber where the numbers otherwise count the slices one by one along the
  normal. Only these messages say "download the series again";
* a slice without RescaleSlope / RescaleIntercept (Type 1 in the CT Image module; HU are never guessed);
* an Enhanced (multi-frame) CT object -- one file holding the whole series -- which this reader does not convert;
* pixel data that cannot be decoded: the message names the transfer syntax and the package that decodes it, or says
  that the data are cut.

Series as scanners acquire them but NIfTI cannot hold -- slices at **uneven spacing** (gaps that vary and are not
whole multiples of one step: no file is missing), or stepped sideways by a **gantry tilt** of more than half a pixel
over the series (a sheared grid, which NIfTI readers using the qform would misplace) -- are refused by default, with
the gaps (mm) and the tilt (degrees) found, both when both are present: ``scripts.data.prepare`` refuses them, as the
training labels lie on the slices as acquired. With ``resample=True`` (inference) such a series is read onto an
**equal-step orthogonal grid** instead, as dcm2niix does (its ``_Eq`` volumes and its tilt correction):

* the step along the slice normal is the span from the first to the last slice divided into equal parts no longer
  than the smallest real gap (dcm2niix's rule; at most :data:`MAX_GRID_FACTOR` times the slice count, where dcm2niix
  caps at 2x). So the first and last slices lie on grid planes, no two slices share a nearest plane, and every slice
  is at most half a step -- half its smallest gap -- from one: labels written back from the nearest plane are off by
  less than half the slice's distance to its neighbours. A finer grid costs memory, not accuracy: the network's
  preprocessing resamples to its own spacing anyway, and the prediction is inverted onto this grid;
* each grid plane is the linear interpolation, along the normal, of the two real slices around it (dcm2niix's
  choice; HU rounded to int16), so a plane on a slice is that slice exactly; a tilted series is first moved in plane
  by each slice's sideways offset (bilinear), onto a grid whose axes are the slices' row, column and normal
  directions, widened so that every slice's pixels lie inside it (air, -1024 HU, where no slice reaches);
* :attr:`CtSeries.slices` (a :class:`SliceMap`) says where every real slice lies in that grid, so a label map
  predicted on the grid is written back onto the original slices (:meth:`SliceMap.to_slices`: the nearest grid
  voxel, at most half a step along the normal and half a pixel in plane away), and what was done is noted in
  :attr:`CtSeries.notes`.

A tilt of at most half a pixel over a regularly spaced series is kept exactly in the (slightly sheared) affine and
noted. ``PixelPaddingValue`` voxels (outside the scanner's field of view) become air, -1024 HU.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pydicom
from pydicom.errors import InvalidDicomError
from pydicom.pixels.decoders.base import get_decoder
from pydicom.uid import UID
from scipy import ndimage
from scripts.data.dicom.common import LPS_TO_RAS, DicomCaseError

logger = logging.getLogger(__name__)

CT_IMAGE_STORAGE = "1.2.840.10008.5.1.4.1.1.2"
ENHANCED_CT_STORAGE = ("1.2.840.10008.5.1.4.1.1.2.1", "1.2.840.10008.5.1.4.1.1.2.2")  # enhanced, legacy converted
DICOMDIR_STORAGE = "1.2.840.10008.1.3.10"
#: positions along the slice normal must agree with a uniform grid to this fraction of the slice spacing
SLICE_TOLERANCE = 0.1
#: a series resampled to an equal step gets at most this many times its slice count (dcm2niix: 2x): the step stays
#: at or below the smallest real gap unless a gap is under about a quarter of the mean spacing
MAX_GRID_FACTOR = 4
#: direction cosines of two slices count as equal below this difference
ORIENTATION_TOLERANCE = 1e-4
#: HU written where the scanner marked a voxel as padding (outside its field of view)
PADDING_HU = -1024
#: tags without which a slice cannot be placed in its series and in space, or turned into HU
REQUIRED_CT_TAGS = (
    "SeriesInstanceUID",
    "ImageOrientationPatient",
    "ImagePositionPatient",
    "PixelSpacing",
    "Rows",
    "Columns",
)
RESCALE_TAGS = ("RescaleSlope", "RescaleIntercept")
#: transfer syntaxes whose pixel data pydicom hands over as the plain little-endian values (deflate is inflated on read)
NATIVE_LITTLE_ENDIAN = ("1.2.840.10008.1.2", "1.2.840.10008.1.2.1", "1.2.840.10008.1.2.1.99")
#: a CT series given as its folder, or as the list of its files (a series found by its headers in any layout)
SeriesSource = str | Path | Sequence[str | Path]


class ScannedSeries(NamedTuple):
    """A series' headers (each slice as acquired, sorted along the slice normal) and its LPS affine, as
    :func:`scan_ct_series` returns them. The writers take one in place of the series' folder or files, so the objects
    of one case read the headers once (:attr:`CtSeries.scanned` gives it with the pixels read)."""

    headers: list[tuple[Path, pydicom.Dataset]]
    affine: np.ndarray


@dataclass(frozen=True)
class SliceMap:
    """Where the slices as acquired lie in the volume a series was resampled to (``read_ct_series(resample=True)``).

    Slice ``k`` -- the ``k``-th along the slice normal, as :attr:`CtSeries.sop_instance_uids` lists them -- has its
    pixel (column ``i``, row ``j``) at voxel ``origins[k] + (i, j, 0)`` (fractional) of the volume, whose shape is
    ``grid_shape``; ``shape`` is a slice's (columns, rows). The volume's first two axes are the slices' own row and
    column directions at their pixel spacing, so only that offset differs from slice to slice.
    """

    origins: np.ndarray  # (slices, 3) voxel coordinates of each slice's first pixel
    shape: tuple[int, int]
    grid_shape: tuple[int, int, int]

    def to_slices(self, volume: np.ndarray) -> np.ndarray:
        """``volume`` (a label map on the resampled grid, ``grid_shape``) on the original slices, ``[columns, rows,
        slices]``: each pixel takes the nearest voxel, half a grid step along the normal and half a pixel in plane
        away at most. A label map is not interpolated (argmax of an interpolated one-hot between two grid planes is
        the nearer one anyway)."""
        if tuple(volume.shape) != tuple(self.grid_shape):
            raise ValueError(f"a volume of shape {volume.shape} is not on the resampled grid {self.grid_shape}.")
        columns, rows = self.shape
        out = np.zeros((columns, rows, len(self.origins)), dtype=volume.dtype, order="F")  # a slice: one piece
        for k, (a, b, c) in enumerate(np.rint(self.origins).astype(int)):
            i0, j0 = max(0, -a), max(0, -b)  # the part of the slice inside the volume
            i1, j1 = min(columns, volume.shape[0] - a), min(rows, volume.shape[1] - b)
            if 0 <= c < volume.shape[2] and i1 > i0 and j1 > j0:
                out[i0:i1, j0:j1, k] = volume[a + i0 : a + i1, b + j0 : b + j1, c]
        return out


@dataclass
class CtSeries:
    """A CT series sorted along its slice normal; ``hu`` is indexed ``[column, row, slice]``.

    ``sop_instance_uids`` and ``files`` are the slices as acquired. For a series read with ``resample=True`` that
    needed it (uneven gaps, gantry tilt), ``hu`` and ``affine_lps`` are the equal-step grid and ``slices`` says where
    each acquired slice lies in it; otherwise ``slices`` is None and slice ``k`` of ``hu`` is instance ``k``.
    """

    hu: np.ndarray
    affine_lps: np.ndarray
    sop_instance_uids: list[str]
    files: list[Path]
    series_uid: str
    frame_of_reference_uid: str
    patient_id: str
    notes: list[str] = field(default_factory=list)  # files skipped (not CT slices), geometry kept with a remark
    slices: SliceMap | None = None
    headers: list[tuple[Path, pydicom.Dataset]] = field(default_factory=list, repr=False)  # without their pixels

    @property
    def scanned(self) -> ScannedSeries:
        """The headers and affine :func:`scan_ct_series` would read again (for the writers)."""
        return ScannedSeries(self.headers, self.affine_lps)

    @property
    def affine_ras(self) -> np.ndarray:
        return LPS_TO_RAS @ self.affine_lps

    @property
    def spacing(self) -> tuple[float, float, float]:
        return tuple(float(s) for s in np.linalg.norm(self.affine_lps[:3, :3], axis=0))


def scan_ct_series(
    image_dir: SeriesSource | ScannedSeries,
    with_pixels: bool = False,
    notes: list[str] | None = None,
    resample: bool = False,
) -> ScannedSeries:
    """The headers of a CT series -- a folder, or its files as :mod:`scripts.data.dicom.discovery` found them -- sorted
    along the slice normal, and its LPS affine.

    Pixel data is not read unless ``with_pixels`` (then each file is read once, its pixels still undecoded). What
    was skipped or kept with a remark is appended to ``notes``. A series at uneven spacing or with a gantry tilt is
    refused unless ``resample`` (see the module docstring); then the affine is that of the equal-step grid
    :func:`read_ct_series` puts it on, and the headers are still every slice as acquired. A :class:`ScannedSeries`
    (scanned with ``resample``, without pixels) is returned as it is.
    """
    if isinstance(image_dir, ScannedSeries):
        return image_dir
    headers, affine, _ = _scan(image_dir, with_pixels, [] if notes is None else notes, resample)
    return ScannedSeries(headers, affine)


def read_ct_series(image_dir: SeriesSource, resample: bool = False) -> CtSeries:
    """Read every CT slice in ``image_dir`` (a folder, or the series' files) as one series, sorted by position along
    the slice normal.

    The checks of :func:`scan_ct_series`, then stored values converted to HU with each slice's rescale
    slope/intercept, padding set to air. ``resample``: a series at uneven spacing or with a gantry tilt is put on an
    equal-step orthogonal grid (:attr:`CtSeries.slices` maps it back; see the module docstring) instead of refused.

    The files are read one after another, the kernel asked to read them all ahead (:func:`read_ahead`). Not in
    threads: pydicom parses under Python's lock, and so do the JPEG, JPEG-LS and JPEG 2000 decoders it calls; threads
    were slower from the page cache and no faster from disk than the readahead.
    """
    notes: list[str] = []
    headers, affine, slices = _scan(image_dir, True, notes, resample)  # every file read once
    ds0 = headers[0][1]
    # slices contiguous in memory: (columns, rows, slices) seen through a transpose of (slices, rows, columns), i.e.
    # Fortran order -- what NIfTI stores, so writing it is a plain copy
    by_slice = np.empty((len(headers), int(ds0.Rows), int(ds0.Columns)), dtype=np.int16)
    for k, (path, ds) in enumerate(headers):
        read_hu(path, ds, out=by_slice[k])
        del ds.PixelData  # the decoded slice is kept; its bytes are not needed twice
    if slices is not None:
        by_slice = _resample(by_slice, slices)
    return CtSeries(
        hu=by_slice.transpose(2, 1, 0),
        affine_lps=affine,
        sop_instance_uids=[str(ds.SOPInstanceUID) for _, ds in headers],
        files=[p for p, _ in headers],
        series_uid=str(ds0.get("SeriesInstanceUID", "")),
        frame_of_reference_uid=str(ds0.get("FrameOfReferenceUID", "")),
        patient_id=str(ds0.get("PatientID", "")),
        notes=notes,
        slices=slices,
        headers=headers,
    )


def to_hu(stored: np.ndarray, ds: pydicom.Dataset) -> np.ndarray:
    """Stored values to HU (int16, clipped) with the slice's rescale slope and intercept; integer arithmetic for the
    usual slope 1 and whole-number intercept, float (rounded) otherwise. Padding values become :data:`PADDING_HU`."""
    slope, intercept = float(ds.RescaleSlope), float(ds.RescaleIntercept)
    if slope == 1.0 and intercept.is_integer() and stored.dtype.kind in "iu":
        values = stored.astype(np.int32) + int(intercept)
    else:
        values = np.rint(stored.astype(np.float32) * slope + intercept)
    hu = np.clip(values, -32768, 32767).astype(np.int16)
    padding = _padding_mask(stored, ds)
    if padding is not None:
        hu[padding] = PADDING_HU
    return hu


def read_hu(path: Path, ds: pydicom.Dataset, out: np.ndarray) -> np.ndarray:
    """The slice's HU written into ``out`` (int16, rows x columns): ``to_hu(decode(path, ds), ds)``, computed straight
    from the file's bytes in int16 for the usual CT slice -- uncompressed little-endian 16-bit values whose HU fit in
    int16 without clipping (slope 1, whole-number intercept) -- which takes a third of the time of pydicom's generic
    decoder followed by the conversion and gives the same values; any other slice goes that way."""
    stored = _native_stored_values(ds, out.shape)
    intercept = float(ds.RescaleIntercept)
    if stored is None or float(ds.RescaleSlope) != 1.0 or not intercept.is_integer():
        out[...] = to_hu(decode(path, ds), ds)
        return out
    bits = int(ds.get("BitsStored", 16))
    low, high = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if stored.dtype.kind == "i" else (0, (1 << bits) - 1)
    if high > np.iinfo(np.int16).max or low + intercept < -32768 or high + intercept > 32767:
        out[...] = to_hu(decode(path, ds), ds)  # values that do not fit int16 before or after the rescale
        return out
    np.add(stored.view("<i2"), np.int16(intercept), out=out)
    padding = _padding_mask(stored, ds)
    if padding is not None:
        out[padding] = PADDING_HU
    return out


def _native_stored_values(ds: pydicom.Dataset, shape: tuple[int, int]) -> np.ndarray | None:
    """The stored values of an uncompressed little-endian 16-bit single-frame slice as an array over its bytes (bits
    above BitsStored cleared, or sign-extended when signed, as pydicom's decoder does); None for anything else."""
    meta = getattr(ds, "file_meta", None)
    syntax = str(meta.get("TransferSyntaxUID", "")) if meta is not None else ""
    if (
        syntax not in NATIVE_LITTLE_ENDIAN
        or int(ds.get("BitsAllocated", 0)) != 16
        or int(ds.get("SamplesPerPixel", 1)) != 1
        or int(ds.get("NumberOfFrames", 1) or 1) != 1
        or "PixelData" not in ds
        or (int(ds.Rows), int(ds.Columns)) != shape
    ):
        return None
    data = ds.PixelData
    if not isinstance(data, bytes) or len(data) < 2 * shape[0] * shape[1]:
        return None  # cut pixel data: the generic decoder says so
    signed = int(ds.get("PixelRepresentation", 0)) == 1
    stored = np.frombuffer(data, "<i2" if signed else "<u2", shape[0] * shape[1]).reshape(shape)
    unused = 16 - int(ds.get("BitsStored", 16))
    if 0 < unused < 16:
        stored = np.right_shift(np.left_shift(stored, unused), unused)
    return stored


def decode(path: Path, ds: pydicom.Dataset) -> np.ndarray:
    """The slice's stored values, or :class:`DicomCaseError` saying whether the data are cut or the transfer syntax
    needs a decoder package (named) that is not installed."""
    meta = getattr(ds, "file_meta", None)
    syntax = UID(str(meta.get("TransferSyntaxUID", ""))) if meta is not None else UID("")
    try:
        return ds.pixel_array
    except Exception as err:  # pixel decoding raises many types (truncated data, codec errors)
        if syntax.is_transfer_syntax and syntax.is_compressed:
            try:
                decoder = get_decoder(syntax)
            except NotImplementedError:
                decoder = None
            if decoder is None or not decoder.is_available:
                needs = f"install one of {decoder.missing_dependencies}" if decoder else "pydicom has no decoder for it"
                raise DicomCaseError(
                    f"{path}: pixel data in {syntax.name} ({syntax}) cannot be decoded here: {needs} (requirements.txt "
                    "pins pylibjpeg-libjpeg, pylibjpeg-openjpeg and pyjpegls), or export the series uncompressed."
                ) from err
            raise DicomCaseError(
                f"{path}: pixel data in {syntax.name} ({syntax}) could not be decoded ({err}): the compressed data are "
                "damaged or cut; download the case again."
            ) from err
        raise DicomCaseError(
            f"{path}: pixel data cannot be read ({err}): the file is cut or damaged; download the case again."
        ) from err


def series_paths(source: SeriesSource) -> tuple[list[Path], Path]:
    """The files of a series source (a folder's visible files, or the list given) and the folder that error messages
    name (the folder, or the one holding every file of the list)."""
    if isinstance(source, str | Path):
        folder = Path(source)
        return sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")), folder
    files = sorted(Path(p) for p in source)
    if not files:
        raise DicomCaseError("an empty list of CT files was given: nothing to read.")
    return files, Path(os.path.commonpath([str(p.parent) for p in files]))


def _read_headers(
    source: SeriesSource, with_pixels: bool, notes: list[str]
) -> tuple[list[tuple[Path, pydicom.Dataset]], Path]:
    """The CT slices of the folder (or list) and the folder messages name; every other file is skipped by what it is
    (noted), a damaged one refused."""
    files, image_dir = series_paths(source)
    if with_pixels:
        read_ahead(files)
    headers, skipped = [], []
    for path in files:
        ds = _read_dicom(path, with_pixels)
        if ds is None and path.suffix.lower() == ".dcm":
            raise DicomCaseError(f"{path}: named .dcm but not DICOM: the file is damaged; download the case again.")
        kind = "not DICOM" if ds is None else _not_a_ct_slice(ds)
        if kind:
            skipped.append(f"{path.name} ({kind})")
            continue
        missing = [tag for tag in REQUIRED_CT_TAGS if tag not in ds]
        if missing:
            raise DicomCaseError(
                f"{path}: a CT image without {missing}, which every CT slice carries to place it in space: the file "
                "is cut or damaged; download the case again."
            )
        if any(tag not in ds for tag in RESCALE_TAGS):
            raise DicomCaseError(
                f"{path}: no RescaleSlope/RescaleIntercept (required in every CT image): its stored values cannot be "
                "turned into Hounsfield units and are not guessed. Export the series again with its rescale tags."
            )
        headers.append((path, ds))
    if skipped:
        notes.append(f"skipped {len(skipped)} file(s) that are not CT slices: {', '.join(skipped[:10])}")
    if not headers:
        detail = f" (only {', '.join(skipped[:5])})" if skipped else ""
        raise DicomCaseError(f"{image_dir}: no CT slices in the image folder{detail}; download the case again.")
    return headers, image_dir


def read_ahead(files: Sequence[Path]) -> None:
    """Ask the kernel to read ``files`` into the page cache now (``posix_fadvise`` WILLNEED, where the platform has
    it): it reads them in the background while pydicom parses the first ones, and costs nothing where they are cached
    already. Nothing is changed where it cannot."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return
    for path in files:
        try:
            descriptor = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # reading it says what is wrong
        try:
            advise(descriptor, 0, 0, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        finally:
            os.close(descriptor)


def _read_dicom(path: Path, with_pixels: bool) -> pydicom.Dataset | None:
    """The file's dataset; None when it is not DICOM at all; :class:`DicomCaseError` when it is DICOM but damaged."""
    try:
        return pydicom.dcmread(path, stop_before_pixels=not with_pixels)
    except InvalidDicomError:
        pass  # no DICOM preamble: perhaps a raw dataset (some exports write those), perhaps not DICOM at all
    except (OSError, EOFError, ValueError, KeyError) as err:
        raise DicomCaseError(f"{path}: a DICOM file that cannot be read ({err}): it is cut or damaged.") from err
    try:
        ds = pydicom.dcmread(path, stop_before_pixels=not with_pixels, force=True)
        return ds if "SOPClassUID" in ds and "Modality" in ds else None
    except Exception:  # garbage read as DICOM: not DICOM
        return None


def _not_a_ct_slice(ds: pydicom.Dataset) -> str:
    """Empty for a CT image slice; else what the object is (to skip it), or an error for an Enhanced CT."""
    sop = str(ds.get("SOPClassUID", "") or getattr(ds.get("file_meta"), "MediaStorageSOPClassUID", ""))
    if sop == DICOMDIR_STORAGE or "DirectoryRecordSequence" in ds:
        return "DICOMDIR"
    if sop in ENHANCED_CT_STORAGE:
        raise DicomCaseError(
            f"{ds.filename}: an {UID(sop).name} (SOP class {sop}): one multi-frame file holding the whole series, "
            "which this reader does not convert. Export the series as classic CT images (CT Image Storage, one "
            "file per slice), e.g. with your PACS or `dcm2niix`, and give that folder (or the NIfTI) instead."
        )
    if sop == CT_IMAGE_STORAGE:
        return ""
    return UID(sop).name if sop else f"no SOP class, modality {ds.get('Modality', 'unknown')}"


def _check_one_volume(headers: list[tuple[Path, pydicom.Dataset]], image_dir: Path) -> None:
    """One series, one orientation and one in-plane geometry, or :class:`DicomCaseError` naming the odd file."""
    series = Counter(str(ds.get("SeriesInstanceUID", "")) for _, ds in headers)
    if len(series) > 1:
        detail = ", ".join(f"{uid} ({n} files)" for uid, n in series.most_common())
        raise DicomCaseError(
            f"{image_dir}: {len(series)} series are mixed in one image folder: {detail}; keep one series per folder."
        )
    path0, ds0 = headers[0]
    iop0 = np.asarray(ds0.ImageOrientationPatient, dtype=float)
    for path, ds in headers:
        iop = np.asarray(ds.ImageOrientationPatient, dtype=float)
        if np.abs(iop - iop0).max() > ORIENTATION_TOLERANCE:
            raise DicomCaseError(
                f"{path}: ImageOrientationPatient {iop.tolist()} differs from {iop0.tolist()} in {path0.name}; "
                "slices of one volume must share one orientation (is this a localizer or a reformatted series?)."
            )
        if (ds.Rows, ds.Columns) != (ds0.Rows, ds0.Columns) or not np.allclose(
            np.asarray(ds.PixelSpacing, dtype=float), np.asarray(ds0.PixelSpacing, dtype=float), rtol=1e-4
        ):
            raise DicomCaseError(f"{path}: Rows/Columns/PixelSpacing differ from {path0.name}; mixed geometry.")


def _scan(
    source: SeriesSource, with_pixels: bool, notes: list[str], resample: bool
) -> tuple[list[tuple[Path, pydicom.Dataset]], np.ndarray, SliceMap | None]:
    """:func:`scan_ct_series`, and where the slices lie on the equal-step grid when the series is resampled."""
    headers, image_dir = _read_headers(source, with_pixels, notes)
    _check_one_volume(headers, image_dir)
    iop = np.asarray(headers[0][1].ImageOrientationPatient, dtype=float)
    normal = np.cross(iop[:3], iop[3:])
    xyz = np.array([np.asarray(ds.ImagePositionPatient, dtype=float) for _, ds in headers])
    order = np.argsort(xyz @ normal, kind="stable")
    headers, xyz = [headers[i] for i in order], xyz[order]
    first = headers[0][1]  # the first along the normal: the grid's origin
    uneven = _check_slice_spacing(xyz @ normal, headers, image_dir)
    pixel = float(min(np.asarray(first.PixelSpacing, dtype=float)))
    step = _slice_step(xyz, normal, uneven, pixel, image_dir)
    sideways = step - float(step @ normal) * normal
    drift = float(np.linalg.norm(sideways)) * (len(xyz) - 1)
    tilt = float(np.degrees(np.arctan2(np.linalg.norm(sideways), abs(float(step @ normal)))))
    tilted = drift > 0.5 * pixel  # the grid is sheared by more than half a pixel over the series
    if not uneven and not tilted:
        if drift > 1e-3:
            notes.append(f"slices step {drift:.3f} mm sideways over the series (tilt {tilt:.3f} deg): kept in the "
                         "affine")  # fmt: skip
        return headers, _affine(first, step), None
    spacing = np.diff(xyz @ normal)
    found = []
    if uneven:
        found.append(f"uneven slice spacing ({spacing.min():.2f}-{spacing.max():.2f} mm along the slice normal)")
    if tilted:
        found.append(f"a gantry tilt of {tilt:.1f} deg (the slices step {np.linalg.norm(sideways):.3f} mm sideways per "
                     f"slice, {drift:.1f} mm over the series)")  # fmt: skip
    if not resample:
        raise DicomCaseError(_refusal(image_dir, found, uneven))
    affine, slices = _grid(first, xyz, normal, tilted)
    notes.append(_resampling_note(found, spacing, slices, tilted))
    return headers, affine, slices


def _refusal(image_dir: Path, found: list[str], uneven: bool) -> str:
    """Why a series at uneven spacing or with a gantry tilt (``found``: what, in mm and degrees) is refused without
    ``resample``, and what to do instead."""
    return (
        f"{image_dir}: {' and '.join(found)}. "
        + ("The gaps are not whole multiples of one step and point to no missing file: downloading the series again "
           "will not change them; this is how it was acquired. " if uneven else "")
        + "A NIfTI volume needs equal steps on an orthogonal grid (NIfTI readers that use the qform, ITK and 3D "
        "Slicer, would misplace these slices), so the case is not converted for training: leave it out, or resample "
        "the CT and its labels to an equal-step orthogonal grid first (for the CT, `dcm2niix` does this: its _Eq "
        "volume, and it corrects gantry tilt). Inference takes the series as it is: it resamples it for the network "
        "and writes the labels back on the original slices."
    )  # fmt: skip


def _resampling_note(found: list[str], spacing: np.ndarray, slices: SliceMap, tilted: bool) -> str:
    """What was done to a series put on an equal-step grid, for :attr:`CtSeries.notes` and the case's report."""
    count = slices.grid_shape[2]
    step = float(spacing.sum()) / (count - 1)
    capped = ""
    if step > spacing.min() + 1e-6:
        capped = f"; {MAX_GRID_FACTOR}x the slices at most, so above the smallest gap"
    grid = "an orthogonal grid at " if tilted else ""
    return (
        f"{len(spacing) + 1} slices with {' and '.join(found)} resampled to {grid}an equal step of {step:.2f} mm "
        f"({count} planes, each linear between the two nearest slices{capped}) for "
        "prediction; labels are written back on the original slices"
    )


def _check_slice_spacing(positions: np.ndarray, headers: list[tuple[Path, pydicom.Dataset]], image_dir: Path) -> bool:
    """Whether the slices are unevenly spaced as acquired (False: one step, to :data:`SLICE_TOLERANCE`); raise on
    duplicate positions and on evidence of a missing file -- gaps that are whole multiples of the usual step, or a
    jump in InstanceNumber (:func:`_check_instance_numbers`)."""
    files = [p for p, _ in headers]
    if len(positions) < 2:
        raise DicomCaseError(f"{image_dir}: only {len(positions)} slice; a 3D CT needs at least two.")
    diffs = np.diff(positions)
    duplicate = np.flatnonzero(diffs < 1e-3)
    if duplicate.size:
        i = duplicate[0]
        raise DicomCaseError(
            f"{files[i + 1]}: same slice position as {files[i].name} ({positions[i]:.2f} mm); duplicate slices."
        )
    step = float(np.median(diffs))
    off = np.flatnonzero(np.abs(diffs - step) > SLICE_TOLERANCE * step)
    if not off.size:
        return False
    multiple = np.rint(diffs / step)
    if (multiple >= 1).all() and (np.abs(diffs - multiple * step) <= SLICE_TOLERANCE * step).all():
        i = off[0]
        more = f" ({int(multiple[off].sum()) - off.size} missing in all, at {off.size} gaps)" if off.size > 1 else ""
        raise DicomCaseError(
            f"{image_dir}: {int(multiple[i]) - 1} missing slice(s) between {files[i].name} ({positions[i]:.2f} mm) "
            f"and {files[i + 1].name} ({positions[i + 1]:.2f} mm), expected steps of {step:.2f} mm{more}; download the "
            "series again."
        )
    _check_instance_numbers(positions, headers, image_dir)
    return True


def _check_instance_numbers(
    positions: np.ndarray, headers: list[tuple[Path, pydicom.Dataset]], image_dir: Path
) -> None:
    """In a series whose gaps vary, InstanceNumbers that count the slices one by one along the normal but jump
    somewhere name files that are missing: :class:`DicomCaseError`. Numbers absent, repeated, out of spatial order or
    counting in other steps prove nothing and are ignored."""
    try:
        numbers = np.array([int(ds.InstanceNumber) for _, ds in headers])
    except (AttributeError, TypeError, ValueError):  # absent or empty: no evidence either way
        return
    steps = np.abs(np.diff(numbers))
    ordered = (np.diff(numbers) > 0).all() or (np.diff(numbers) < 0).all()
    jumps = np.flatnonzero(steps > 1)
    if not ordered or not jumps.size or np.median(steps) != 1:
        return
    i, files = jumps[0], [p for p, _ in headers]
    raise DicomCaseError(
        f"{image_dir}: {int(steps.sum()) - len(steps)} missing slice(s): InstanceNumber jumps from {numbers[i]} to "
        f"{numbers[i + 1]} between {files[i].name} ({positions[i]:.2f} mm) and {files[i + 1].name} "
        f"({positions[i + 1]:.2f} mm), {positions[i + 1] - positions[i]:.2f} mm apart, where the numbers otherwise "
        "count the slices one by one; download the series again."
    )


def _slice_step(xyz: np.ndarray, normal: np.ndarray, uneven: bool, pixel: float, image_dir: Path) -> np.ndarray:
    """The mean vector from one slice position to the next (a regular series' affine column, exactly as the positions
    give it); :class:`DicomCaseError` when the positions leave a straight line: at even steps, every step must be the
    mean one to :data:`SLICE_TOLERANCE` of its length along the normal; at uneven steps, every slice must lie on the
    first-to-last line to half a pixel (``pixel`` mm). A gantry tilt steps the slices sideways as well as along the
    normal, still on one line."""
    step = (xyz[-1] - xyz[0]) / (len(xyz) - 1)
    if uneven:  # each slice where the first-to-last line is at its height along the normal
        height = (xyz - xyz[0]) @ normal
        off = np.linalg.norm(xyz - xyz[0] - np.outer(height / height[-1], xyz[-1] - xyz[0]), axis=1)
        tolerance = 0.5 * pixel
    else:
        off, tolerance = np.abs(np.diff(xyz, axis=0) - step), SLICE_TOLERANCE * abs(float(step @ normal))
    if (off > tolerance).any():
        raise DicomCaseError(
            f"{image_dir}: slice positions do not lie on one straight line{'' if uneven else ' at even steps'} (off "
            f"by {off.max():.2f} mm); the series mixes acquisitions or was reformatted. Keep one regular series per "
            "folder."
        )
    return step


def _grid(first: pydicom.Dataset, xyz: np.ndarray, normal: np.ndarray, tilted: bool) -> tuple[np.ndarray, SliceMap]:
    """The LPS affine of the equal-step grid an uneven or tilted series is resampled to, and where its slices (sorted,
    positions ``xyz``) lie in it: see the module docstring. A drift under half a pixel is kept in the affine, as for
    a regular series; a tilt gives an orthogonal grid widened to every slice's pixels."""
    z = (xyz - xyz[0]) @ normal
    count = min(int(np.ceil(z[-1] / np.diff(z).min() - 1e-6)) + 1, MAX_GRID_FACTOR * len(z))
    step = z[-1] / (count - 1)
    iop = np.asarray(first.ImageOrientationPatient, dtype=float)
    row_spacing, col_spacing = (float(v) for v in first.PixelSpacing)
    size = np.array([int(first.Columns), int(first.Rows)])
    if tilted:
        pixels = (xyz - xyz[0]) @ np.stack([iop[:3] / col_spacing, iop[3:] / row_spacing], axis=1)  # (column, row)
        low, high = np.floor(pixels.min(0) + 1e-6), np.ceil(pixels.max(0) - 1e-6)
        in_plane, third = pixels - low, step * normal
        origin = xyz[0] + low[0] * col_spacing * iop[:3] + low[1] * row_spacing * iop[3:]
        grid = size + (high - low).astype(int)
    else:
        in_plane, third, origin, grid = np.zeros((len(z), 2)), (xyz[-1] - xyz[0]) / (count - 1), xyz[0], size
    slices = SliceMap(np.column_stack([in_plane, z / step]), (int(size[0]), int(size[1])),
                      (int(grid[0]), int(grid[1]), count))  # fmt: skip
    return _affine(first, third, origin), slices


def _resample(by_slice: np.ndarray, slices: SliceMap) -> np.ndarray:
    """The acquired slices (int16 ``[slice, row, column]``) on the grid of ``slices``, the same layout: each grid
    plane linear along the normal between the two slices around it, each slice first moved in plane onto the grid
    (bilinear; air beyond its edge). A plane on a slice is that slice's HU exactly."""
    columns, rows, count = slices.grid_shape
    depth = slices.origins[:, 2]
    out = np.empty((count, rows, columns), np.int16)
    placed: dict[int, np.ndarray] = {}  # the slices moved onto the grid, while planes still need them

    def on_grid(k: int) -> np.ndarray:
        if k not in placed:
            plane, (a, b) = by_slice[k].astype(np.float32), slices.origins[k, :2]
            if a or b or plane.shape != (rows, columns):
                plane = ndimage.affine_transform(plane, np.eye(2), offset=(-b, -a), output_shape=(rows, columns),
                                                 order=1, cval=PADDING_HU)  # fmt: skip
            placed[k] = plane
        return placed[k]

    for m in range(count):
        high = min(max(int(np.searchsorted(depth, m)), 1), len(depth) - 1)
        weight = float(np.clip((m - depth[high - 1]) / (depth[high] - depth[high - 1]), 0.0, 1.0))
        for k in [k for k in placed if k < high - 1]:
            del placed[k]
        out[m] = np.rint(on_grid(high - 1) * (1.0 - weight) + on_grid(high) * weight)
    return out


def _affine(first: pydicom.Dataset, step: np.ndarray, origin: np.ndarray | None = None) -> np.ndarray:
    """The LPS affine of voxel (column, row, slice) indices, from the first slice along the normal (or ``origin``)."""
    iop = np.asarray(first.ImageOrientationPatient, dtype=float)
    row_spacing, col_spacing = (float(v) for v in first.PixelSpacing)
    affine = np.eye(4)
    affine[:3, 0] = iop[:3] * col_spacing  # i = column index, moves along a row
    affine[:3, 1] = iop[3:] * row_spacing  # j = row index, moves down a column
    affine[:3, 2] = step
    affine[:3, 3] = np.asarray(first.ImagePositionPatient, dtype=float) if origin is None else origin
    return affine


def _padding_mask(stored: np.ndarray, ds: pydicom.Dataset) -> np.ndarray | None:
    """Where the stored values are PixelPaddingValue (or within [value, PixelPaddingRangeLimit]); None if none."""
    if "PixelPaddingValue" not in ds:
        return None
    value = int(ds.PixelPaddingValue)
    limit = int(ds.get("PixelPaddingRangeLimit", value))
    low, high = min(value, limit), max(value, limit)
    mask = (stored >= low) & (stored <= high)
    return mask if mask.any() else None

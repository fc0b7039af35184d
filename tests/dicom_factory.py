"""CT series and SEGs written the way clinic and PACS exports write them, for the real-world DICOM tests.

Independent of ``scripts.data.dicom`` (and of ``scripts.data.synthetic``): slices are rendered from a world-space (LPS
mm) description -- a body of soft tissue with a spherical tumour -- at whatever positions, orientation, tilt, encoding
and tags a test asks for, so the reader's geometry can be checked against the analytic truth in millimetres.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import highdicom as hd
import numpy as np
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.sr.codedict import codes
from pydicom.uid import CTImageStorage, ExplicitVRLittleEndian, SecondaryCaptureImageStorage, generate_uid

TUMOUR_HU, BODY_HU, AIR_HU = 60.0, 0.0, -1000.0
#: z distances (mm) between consecutive slices of a GE-like head CT series: 1.1 to 7.4 mm, median 4.0 mm, and most
#: not a whole multiple of it -- unevenly spaced as acquired, no file missing
UNEVEN_GAPS = (1.1, 2.5, 4.0, 7.4, 3.2, 5.5, 1.1, 4.0, 6.3, 2.5, 4.0, 1.7, 7.4, 3.2, 4.0, 2.5, 5.5, 1.1, 4.0, 6.3,
               2.5, 3.2, 4.0)  # fmt: skip


@dataclass
class Series:
    """What to write: ``shape`` (columns, rows, slices), geometry in LPS mm, and the tumour sphere."""

    shape: tuple[int, int, int] = (48, 48, 16)
    pixel_spacing: float = 2.0
    slice_spacing: float = 3.0
    tilt_deg: float = 0.0  # a gantry tilt (degrees), written as tilt_form says
    # how the tilt is written: "sheared" -- axial planes, each slice stepped sideways (+y) by tan(tilt) * its z step;
    # "scanner" -- as GE and Philips write it: the planes tilted about the left-right axis (ImageOrientationPatient
    # [1, 0, 0, 0, cos, -sin]), ImagePositionPatient stepping straight along z, GantryDetectorTilt = tilt_deg (when
    # gantry_tag); "reformat" -- an oblique reformat: the same tilted planes, positions stepping along their own normal
    tilt_form: str = "sheared"
    gantry_tag: bool = True
    gaps: tuple[float, ...] = ()  # uneven spacing: the z distances (mm) from each slice to the next, shape[2] - 1
    tumour_centre: tuple[float, float, float] = (8.0, -6.0, 18.0)
    tumour_radius: float = 10.0
    patient_id: str = "RW-001"
    uids: dict = field(default_factory=dict)
    name: str = ""  # another series of the same study (and frame of reference) when set: its own series and SOP UIDs
    series_number: int = 2
    description: str = ""

    def uid(self, tag: str) -> str:
        shared = tag in ("study", "for") or not self.name
        sources = [self.patient_id, tag] if shared else [self.patient_id, self.name, tag]
        return self.uids.setdefault(tag, generate_uid(entropy_srcs=sources))

    def directions(self) -> tuple[np.ndarray, np.ndarray]:
        """The row and column direction cosines (ImageOrientationPatient)."""
        if self.tilt_form == "sheared":
            return np.array([1.0, 0.0, 0.0]), np.array([0.0, 1.0, 0.0])
        t = np.radians(self.tilt_deg)
        return np.array([1.0, 0.0, 0.0]), np.array([0.0, np.cos(t), -np.sin(t)])

    def positions(self) -> np.ndarray:
        """ImagePositionPatient of each slice, first slice first."""
        nx, ny, nz = self.shape
        if self.tilt_form != "sheared":  # each slice centred on the body axis, at its height z (or along its normal)
            row, column = self.directions()
            z = np.concatenate([[0.0], np.cumsum(self.gaps)]) if self.gaps else self.slice_spacing * np.arange(nz)
            step = np.cross(row, column) if self.tilt_form == "reformat" else np.array([0.0, 0.0, 1.0])
            corner = -(nx - 1) * self.pixel_spacing / 2 * row - (ny - 1) * self.pixel_spacing / 2 * column
            return corner + np.outer(z, step)
        corner = np.array([-(nx - 1) * self.pixel_spacing / 2, -(ny - 1) * self.pixel_spacing / 2, 0.0])
        if self.gaps:  # z of each slice: the sum of the gaps below it; sideways by tan(tilt) * z, as the scanner steps
            if len(self.gaps) != nz - 1:
                raise ValueError(f"{len(self.gaps)} gaps for {nz} slices")
            z = np.concatenate([[0.0], np.cumsum(self.gaps)])
            return corner + np.stack([np.zeros(nz), np.tan(np.radians(self.tilt_deg)) * z, z], axis=1)
        sideways = np.tan(np.radians(self.tilt_deg)) * self.slice_spacing
        return np.array([corner + np.array([0.0, k * sideways, k * self.slice_spacing]) for k in range(nz)])

    def voxel_centres(self, k: int) -> np.ndarray:
        """LPS mm of every pixel centre of slice k, shape (rows, columns, 3)."""
        nx, ny, _ = self.shape
        cols, rows = np.meshgrid(np.arange(nx), np.arange(ny))
        row, column = self.directions()
        return self.positions()[k] + self.pixel_spacing * (cols[..., None] * row + rows[..., None] * column)

    def tumour(self, k: int) -> np.ndarray:
        """Tumour mask of slice k (rows, columns): pixel centres inside the sphere."""
        return np.linalg.norm(self.voxel_centres(k) - self.tumour_centre, axis=-1) <= self.tumour_radius

    def tumour_on_slices(self) -> np.ndarray:
        """Tumour mask of every slice, [column, row, slice] (the label map's axis order)."""
        return np.stack([self.tumour(k).T for k in range(self.shape[2])], axis=-1)

    def hu(self, k: int) -> np.ndarray:
        nx, ny, _ = self.shape
        cols, rows = np.meshgrid(np.arange(nx), np.arange(ny))
        body = ((cols - nx / 2) / (0.45 * nx)) ** 2 + ((rows - ny / 2) / (0.4 * ny)) ** 2 <= 1
        values = np.where(body, BODY_HU, AIR_HU)
        return np.where(self.tumour(k), TUMOUR_HU, values)


def uneven_series(tilt_deg: float = 0.0, gaps: tuple[float, ...] = UNEVEN_GAPS, **options) -> Series:
    """A 64 x 64 x 24 series at 2 mm pixels spaced by ``gaps`` (none: 3 mm), tilted by ``tilt_deg``, with the tumour
    (radius 12 mm) across several of the gaps."""
    return Series(shape=(64, 64, 24), gaps=gaps, tilt_deg=tilt_deg, tumour_centre=(8.0, -6.0, 40.0),
                  tumour_radius=12.0, **options)  # fmt: skip


def ct_slice(series: Series, k: int, intercept: float = -1024.0) -> Dataset:
    """One CT Image Storage slice of ``series`` (uncompressed, explicit VR little endian)."""
    sop = series.uid(f"sop{k}")
    ds = Dataset()
    ds.file_meta = FileMetaDataset()
    ds.file_meta.MediaStorageSOPClassUID, ds.file_meta.MediaStorageSOPInstanceUID = CTImageStorage, sop
    ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds.SOPClassUID, ds.SOPInstanceUID, ds.Modality = CTImageStorage, sop, "CT"
    ds.PatientID, ds.PatientName, ds.PatientBirthDate, ds.PatientSex = series.patient_id, "Real^World", "", "O"
    ds.StudyInstanceUID, ds.SeriesInstanceUID = series.uid("study"), series.uid("series")
    ds.FrameOfReferenceUID, ds.PositionReferenceIndicator = series.uid("for"), ""
    ds.StudyDate = ds.SeriesDate = ds.ContentDate = "20250101"
    ds.StudyTime = ds.SeriesTime = ds.ContentTime = "080000"
    ds.StudyID, ds.AccessionNumber, ds.ReferringPhysicianName, ds.Manufacturer = "1", "", "", "factory"
    ds.SeriesNumber, ds.InstanceNumber, ds.AcquisitionNumber = series.series_number, k + 1, 1
    if series.description:
        ds.SeriesDescription = series.description
    ds.ImageType, ds.KVP, ds.PatientPosition = ["ORIGINAL", "PRIMARY", "AXIAL"], 120, "HFS"
    ds.BodyPartExamined = "CHEST"
    ds.ImagePositionPatient = [round(float(v), 4) for v in series.positions()[k]]
    ds.ImageOrientationPatient = [round(float(v), 6) for v in np.concatenate(series.directions())]
    if series.tilt_form == "scanner" and series.gantry_tag:
        ds.GantryDetectorTilt = series.tilt_deg
    ds.PixelSpacing = [series.pixel_spacing, series.pixel_spacing]
    ds.SliceThickness = series.slice_spacing
    ds.Rows, ds.Columns = series.shape[1], series.shape[0]
    ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME2"
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 12, 11, 0  # 12-bit: every JPEG codes it
    ds.RescaleSlope, ds.RescaleIntercept, ds.RescaleType = 1, intercept, "HU"
    ds.PixelData = np.clip(np.rint(series.hu(k) - intercept), 0, 4095).astype(np.uint16).tobytes()
    return ds


def write_series(series: Series, image_dir: Path) -> list[Dataset]:
    """Every slice of ``series`` into ``image_dir`` (file names by instance number)."""
    image_dir.mkdir(parents=True, exist_ok=True)
    slices = [ct_slice(series, k) for k in range(series.shape[2])]
    for ds in slices:
        ds.save_as(image_dir / f"{ds.InstanceNumber:04d}.dcm", enforce_file_format=True)
    return slices


def write_scanner_study(folder: Path, patient_id: str, shape: tuple[int, int, int] = (64, 64, 20)) -> dict[str, str]:
    """One patient's CT study as a scanner exports it, each series in its own folder (``SE<number>/IM<n>``, no
    extension): a one-image scout (LOCALIZER, coronal: ``SE000001``), the 5 mm axial series (``SE000002``), the same
    range at 2.5 mm with a -18.5 degree gantry tilt as Philips writes it (tilted planes, positions along z,
    GantryDetectorTilt: ``SE000003``) and two secondary captures (the dose report screens: ``SE000999``). Returns the
    SeriesInstanceUID of each by name (scout, axial, tilted, captures)."""
    axial = Series(shape=shape, slice_spacing=5.0, patient_id=patient_id, name="axial", description="Chest 5mm",
                   tumour_centre=(8.0, -6.0, 45.0))  # fmt: skip
    tilted = Series(shape=(shape[0], shape[1], 2 * shape[2] - 1), slice_spacing=2.5, tilt_deg=-18.5,
                    tilt_form="scanner", patient_id=patient_id, name="tilted", series_number=3,
                    description="Chest 2.5mm tilt", tumour_centre=(8.0, -6.0, 45.0))  # fmt: skip
    scout = Series(shape=(shape[0], shape[1], 1), patient_id=patient_id, name="scout", series_number=1,
                   description="Surview")  # fmt: skip
    for series, number in ((axial, 2), (tilted, 3)):
        for ds in (ct_slice(series, k) for k in range(series.shape[2])):
            _save(ds, folder / f"SE{number:06d}" / f"IM{ds.InstanceNumber:06d}")
    ds = ct_slice(scout, 0)
    ds.ImageType = ["ORIGINAL", "PRIMARY", "LOCALIZER"]
    ds.ImageOrientationPatient = [1, 0, 0, 0, 0, -1]  # a frontal projection, shown as a coronal image
    ds.ImagePositionPatient = [-63.0, 0.0, 120.0]
    _save(ds, folder / "SE000001" / "IM000001")
    captures = Series(patient_id=patient_id, name="captures").uid("series")
    for k in (1, 2):
        _save(secondary_capture(axial, captures, k), folder / "SE000999" / f"IM{k:06d}")
    return {"scout": scout.uid("series"), "axial": axial.uid("series"), "tilted": tilted.uid("series"),
            "captures": captures}  # fmt: skip


def secondary_capture(series: Series, series_uid: str, k: int) -> Dataset:
    """A scanner's screen capture (a dose report page) in ``series``' study: Secondary Capture Image Storage,
    modality CT, series 999 -- as GE and Philips put them beside the images."""
    sop = generate_uid(entropy_srcs=[series_uid, str(k)])
    ds = Dataset()
    ds.file_meta = FileMetaDataset()
    ds.file_meta.MediaStorageSOPClassUID = ds.SOPClassUID = SecondaryCaptureImageStorage
    ds.file_meta.MediaStorageSOPInstanceUID = ds.SOPInstanceUID = sop
    ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds.Modality, ds.ConversionType, ds.ImageType = "CT", "WSD", ["DERIVED", "SECONDARY", "SCREEN SAVE"]
    ds.PatientID, ds.PatientName = series.patient_id, "Real^World"
    ds.StudyInstanceUID, ds.SeriesInstanceUID = series.uid("study"), series_uid
    ds.StudyDate, ds.SeriesNumber, ds.InstanceNumber, ds.SeriesDescription = "20250101", 999, k, "Dose Report"
    ds.Rows = ds.Columns = 16
    ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME2"
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 8, 8, 7, 0
    ds.PixelData = bytes(16 * 16)
    return ds


def _save(ds: Dataset, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    ds.save_as(path, enforce_file_format=True)


def write_seg(series: Series, slices: list[Dataset], path: Path) -> Path:
    """A highdicom SEG of the tumour (GTV-1) on ``slices``."""
    description = hd.seg.SegmentDescription(
        segment_number=1, segment_label="GTV-1", segmented_property_category=codes.SCT.MorphologicallyAbnormalStructure,
        segmented_property_type=codes.SCT.Neoplasm, algorithm_type="MANUAL",
    )  # fmt: skip
    seg = hd.seg.Segmentation(
        source_images=slices, pixel_array=np.stack([series.tumour(k) for k in range(len(slices))]).astype(np.uint8),
        segmentation_type=hd.seg.SegmentationTypeValues.BINARY, segment_descriptions=[description],
        series_instance_uid=series.uid("segseries"), series_number=300, sop_instance_uid=series.uid("segsop"),
        instance_number=1, manufacturer="factory", manufacturer_model_name="tests", software_versions="1",
        device_serial_number="1", omit_empty_frames=True,
    )  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    seg.save_as(path)
    return path


def write_case(series: Series, case_dir: Path) -> tuple[Path, Path]:
    """A TCIA-layout case: ``case_dir/image/*.dcm`` and ``case_dir/seg/1-1.dcm``; returns both paths."""
    slices = write_series(series, case_dir / "image")
    return case_dir / "image", write_seg(series, slices, case_dir / "seg" / "1-1.dcm")


def tumour_centre_of(label: np.ndarray, affine_ras: np.ndarray) -> np.ndarray:
    """Centroid (LPS mm) of a label volume [X, Y, Z] placed by a NIfTI (RAS) affine."""
    ijk = np.argwhere(label > 0)
    ras = ijk @ affine_ras[:3, :3].T + affine_ras[:3, 3]
    return (ras * [-1, -1, 1]).mean(0)


def transcode(path: Path, syntax: str) -> None:
    """Re-encode one file in place in ``syntax``: JPEG Lossless (4.57, 4.70) through GDCM (pydicom has no encoder),
    JPEG-LS, JPEG 2000 and RLE through pydicom's encoders, deflate by writing a deflated dataset."""
    import pydicom
    from pydicom.uid import DeflatedExplicitVRLittleEndian

    gdcm_syntaxes = {
        "1.2.840.10008.1.2.4.70": "JPEGLosslessProcess14_1",
        "1.2.840.10008.1.2.4.57": "JPEGLosslessProcess14",
    }
    if syntax in gdcm_syntaxes:
        import gdcm

        reader = gdcm.ImageReader()
        reader.SetFileName(str(path))
        assert reader.Read(), path
        change = gdcm.ImageChangeTransferSyntax()
        change.SetTransferSyntax(gdcm.TransferSyntax(getattr(gdcm.TransferSyntax, gdcm_syntaxes[syntax])))
        change.SetInput(reader.GetImage())
        assert change.Change(), f"GDCM cannot encode {syntax}"
        writer = gdcm.ImageWriter()
        writer.SetFileName(str(path))
        writer.SetFile(reader.GetFile())
        writer.SetImage(change.GetOutput())
        assert writer.Write(), path
        return
    ds = pydicom.dcmread(path)
    if syntax == DeflatedExplicitVRLittleEndian:
        ds.file_meta.TransferSyntaxUID = syntax
        ds.save_as(path, enforce_file_format=True)
        return
    ds.compress(syntax)
    ds.save_as(path, enforce_file_format=True)

"""A predicted label map as a DICOM SEG that references the source CT series and instances, shares their frame of
reference and names and codes each segment, so OHIF or 3D Slicer overlays it on the CT exactly."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import highdicom as hd
import numpy as np
import pydicom
from scripts.common.files import replace_atomically
from scripts.data.dicom import ScannedSeries, SeriesSource, scan_ct_series, segment_description
from scripts.data.dicom.identity import ALGORITHM_NAME, MANUFACTURER

#: Type 2 attributes of the Patient, General Study and Frame of Reference modules that every object we write carries
#: (highdicom copies them from the source CT): present, empty when unknown, as the standard allows
PATIENT_STUDY_TYPE_2 = ("PatientName", "PatientID", "PatientBirthDate", "PatientSex", "StudyDate", "StudyTime")
PATIENT_STUDY_TYPE_2 += ("ReferringPhysicianName", "StudyID", "AccessionNumber", "PositionReferenceIndicator")


def with_type_2(slices: Sequence[pydicom.Dataset]) -> list[pydicom.Dataset]:
    """``slices`` with every attribute of :data:`PATIENT_STUDY_TYPE_2` that a source CT lacks (anonymisers delete
    them, although Type 2 asks for them present) added empty, so the objects written from them are complete."""
    for ds in slices:
        for keyword in PATIENT_STUDY_TYPE_2:
            if keyword not in ds:
                setattr(ds, keyword, "")
    return list(slices)


def source_images(series: ScannedSeries) -> list[pydicom.Dataset]:
    """The series' headers as a SEG's source images, completed in place (once is enough): the Type 2 attributes of
    :func:`with_type_2`, and SliceThickness where it is missing (Type 2, deleted by some anonymisers: the SEG's pixel
    measures need it) as the step between slices. :class:`scripts.inference.outputs.SaveCased` completes them before its
    writers read them side by side."""
    source = with_type_2([ds for _, ds in series.headers])
    for ds in source:
        if ds.get("SliceThickness") in (None, ""):
            ds.SliceThickness = round(float(np.linalg.norm(series.affine[:3, 2])), 6)
    return source


def write_dicom_seg(
    labels: np.ndarray,
    image_dir: SeriesSource | ScannedSeries,
    names: Sequence[str],
    path: str | Path,
    algorithm: hd.AlgorithmIdentificationSequence,
) -> hd.seg.Segmentation:
    """A DICOM SEG of the label map ``labels`` [X, Y, Z] on the slices of the series in ``image_dir`` as acquired
    (``Z`` = its number of slices, even when they are unevenly spaced or tilted: each frame takes its slice's own
    position from the CT header).

    Frame ``k`` annotates the ``k``-th slice along the slice normal, the order :func:`scan_ct_series` sorts by, so
    every frame references the CT instance it lies on. Segment ``i`` is ``names[i - 1]``; empty frames are omitted.
    ``image_dir``: the series' folder or files, or its :class:`~scripts.data.dicom.ScannedSeries` (headers read once for
    all of a case's objects; the empty Type 2 attributes and a missing SliceThickness are filled in there).
    """
    series = scan_ct_series(image_dir, resample=True)  # every slice as acquired, whatever its spacing
    headers = series.headers
    if labels.shape != (int(headers[0][1].Columns), int(headers[0][1].Rows), len(headers)):
        raise ValueError(f"{headers[0][0].parent}: prediction shape {labels.shape} does not match the series' grid.")
    source = source_images(series)
    frames = np.ascontiguousarray(labels.transpose(2, 1, 0))  # [slice, row, column], as the CT stores pixels
    seg = hd.seg.Segmentation(
        source_images=source,
        pixel_array=frames,
        segmentation_type=hd.seg.SegmentationTypeValues.BINARY,
        segment_descriptions=[segment_description(i, name, algorithm) for i, name in enumerate(names, start=1)],
        series_instance_uid=hd.UID(),
        series_number=int(source[0].get("SeriesNumber", 0) or 0) + 9000,
        sop_instance_uid=hd.UID(),
        instance_number=1,
        manufacturer=MANUFACTURER,
        manufacturer_model_name=ALGORITHM_NAME,
        software_versions=str(algorithm[0].AlgorithmVersion),
        device_serial_number="none",
        content_label="GTV" if names and names[0].upper().startswith("GTV") else "SEGMENTATION",
        content_description="SwinUNETR segmentation",
        omit_empty_frames=True,
    )
    replace_atomically(path, seg.save_as)
    return seg

"""The tumour report as a DICOM Structured Report (TID 1500 Measurement Report, highdicom's ``hd.sr``), so a PACS or
viewer shows each structure's volume and diameters next to the CT and the SEG they were measured on.

Input: a report from :func:`scripts.inference.report.tumour_report`, the CT series (folder or headers), the SEG written
for the same label map (dataset or path; None when there is none) and the model version. Output: one Comprehensive 3D
SR, written atomically, with one measurement group per structure:

* a structure found: TID 1411 Volumetric ROI group referencing its SEG segment (``ReferencedSegment``), or -- without
  a SEG -- a volume surface POINT at its centroid in the CT's frame of reference and series; measurements: volume
  (mm3), long axis, short axis, maximum diameter (mm), mean and standard deviation of the attenuation (HU) when the
  report has them; laterality (left/right) as a qualitative evaluation;
* a structure not found: TID 1501 group with volume 0 mm3, so "looked for, found nothing" is stated, not implied;
* a structure flagged as implausible (:func:`scripts.inference.report.implausible`): in its group, one qualitative
  evaluation "Quality Finding" (DCM 111052) per finding -- its value coded in this bundle's private scheme
  :data:`SCHEME` (declared in the Coding Scheme Identification Sequence), e.g. "Volume above what a lung GTV is likely
  to be" -- and one whose value says what to check ("Check the weights' labels, the input's body region and
  modality"), so a PACS shows the warning beside the numbers it is about.

Finding type and category reuse the SNOMED codes of the SEG segments (:func:`scripts.data.dicom.segment_description`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import highdicom as hd
import numpy as np
import pydicom
from pydicom.sr.codedict import codes
from scripts.common.files import replace_atomically
from scripts.common.labels import normalize_name
from scripts.data.dicom import SEG_STORAGE, ScannedSeries, SeriesSource, scan_ct_series, segment_description
from scripts.data.dicom.identity import ALGORITHM_NAME, MANUFACTURER
from scripts.inference.writers.seg import with_type_2

logger = logging.getLogger(__name__)

SERIES_NUMBER_OFFSET = 9200  # the SEG takes the CT's series number + 9000, the RTSTRUCT + 9100
#: this bundle's private coding scheme for its findings (PS3.16: a designator starting with 99 is private)
SCHEME = "99NSCLCSWIN"
#: the coded value of each finding of :func:`scripts.inference.report.implausible` (by measurement), and of what to
#: check
FINDINGS = {
    "volume_ml": hd.sr.CodedConcept("IMPL-VOLUME", SCHEME, "Volume above what a lung GTV is likely to be"),
    "components": hd.sr.CodedConcept("IMPL-PIECES", SCHEME, "More separate pieces than a lung GTV is likely to have"),
    "region_border_fraction": hd.sr.CodedConcept("IMPL-BORDER", SCHEME, "Fills most of the analysed region's border"),
}
OUR_SCHEME = hd.coding_schemes.CodingSchemeIdentificationItem(
    designator=SCHEME, name=f"{ALGORITHM_NAME} findings", responsible_organization=MANUFACTURER
)
CHECK = hd.sr.CodedConcept("CHECK-INPUT", SCHEME, "Check the weights' labels, the input's body region and modality")


def write_sr(
    report: dict[str, dict],
    ct: SeriesSource | ScannedSeries | Sequence[pydicom.Dataset],
    seg: pydicom.Dataset | str | Path | None,
    path: str | Path,
    algorithm_version: str,
    flags: Sequence[dict] = (),
) -> hd.sr.Comprehensive3DSR:
    """A TID 1500 measurement report of ``report`` ({structure: measurements}) on the CT series ``ct`` (its folder, its
    files or its headers), referencing the segments of ``seg`` by name (None: the CT itself), with ``flags``
    (:func:`scripts.inference.report.implausible`'s findings) as quality findings of their structures, written
    atomically to ``path``."""
    given = [ct] if isinstance(ct, str | Path) else list(ct)
    if not all(isinstance(item, pydicom.Dataset) for item in given):  # a folder or files: read the headers
        given = [ds for _, ds in scan_ct_series(ct, resample=True)[0]]
    slices = with_type_2(given)
    seg_ds = pydicom.dcmread(seg, stop_before_pixels=True) if isinstance(seg, str | Path) else seg
    if seg_ds is not None and str(seg_ds.SOPClassUID) != SEG_STORAGE:
        raise ValueError(f"{seg}: not a DICOM SEG (SOP class {seg_ds.SOPClassUID}); pass the SEG or None.")
    algorithm = hd.sr.AlgorithmIdentification(name=ALGORITHM_NAME, version=str(algorithm_version))
    groups = [
        _group(name, number, measured, slices[0], seg_ds, algorithm, [f for f in flags if f["structure"] == name])
        for number, (name, measured) in enumerate(report.items(), start=1)
    ]
    observer = hd.sr.ObserverContext(
        observer_type=codes.DCM.Device,
        observer_identifying_attributes=hd.sr.DeviceObserverIdentifyingAttributes(
            uid=hd.UID(), name=ALGORITHM_NAME, manufacturer_name=MANUFACTURER, model_name=ALGORITHM_NAME
        ),
    )
    content = hd.sr.MeasurementReport(
        observation_context=hd.sr.ObservationContext(observer_device_context=observer),
        procedure_reported=codes.LN.CTUnspecifiedBodyRegion,
        imaging_measurements=groups,
        title=codes.cid7021.ImagingMeasurementReport,
    )
    sr = hd.sr.Comprehensive3DSR(
        evidence=slices + ([seg_ds] if seg_ds is not None else []),
        content=content[0],
        series_instance_uid=hd.UID(),
        series_number=int(slices[0].get("SeriesNumber", 0) or 0) + SERIES_NUMBER_OFFSET,
        sop_instance_uid=hd.UID(),
        instance_number=1,
        manufacturer=MANUFACTURER,
        series_description=f"{ALGORITHM_NAME} measurements"[:64],
        is_complete=True,
        coding_schemes=[OUR_SCHEME] if flags else None,
    )
    replace_atomically(path, sr.save_as)
    return sr


def _group(name: str, number: int, measured: dict, ct: pydicom.Dataset, seg, algorithm, flags: Sequence[dict]):
    """The measurement group of one structure (see the module docstring)."""
    description = segment_description(number, name)
    finding = {
        "tracking_identifier": hd.sr.TrackingIdentifier(uid=hd.UID(), identifier=name),
        "finding_type": hd.sr.CodedConcept.from_dataset(description.SegmentedPropertyTypeCodeSequence[0]),
        "finding_category": hd.sr.CodedConcept.from_dataset(description.SegmentedPropertyCategoryCodeSequence[0]),
        "algorithm_id": algorithm,
    }
    if not measured.get("present"):
        volume = hd.sr.Measurement(name=codes.SCT.Volume, value=0.0, unit=codes.UCUM.CubicMillimeter)
        return hd.sr.MeasurementsAndQualitativeEvaluations(measurements=[volume], **finding)
    source = hd.sr.SourceSeriesForSegmentation(str(ct.SeriesInstanceUID))
    if seg is not None:
        where = {"referenced_segment": hd.sr.ReferencedSegment(
            sop_class_uid=str(seg.SOPClassUID), sop_instance_uid=str(seg.SOPInstanceUID),
            segment_number=_segment_number(seg, name), source_series=source)}  # fmt: skip
    else:
        where = {"referenced_volume_surface": hd.sr.VolumeSurface(
            graphic_type=hd.sr.GraphicTypeValues3D.POINT, graphic_data=np.array([measured["centroid_lps"]]),
            frame_of_reference_uid=str(ct.FrameOfReferenceUID), source_series=source)}  # fmt: skip
    laterality = {"left": codes.SCT.Left, "right": codes.SCT.Right}.get(str(measured.get("side")))
    evaluations = [] if laterality is None else [hd.sr.QualitativeEvaluation(codes.SCT.Laterality, laterality)]
    findings = [FINDINGS[flag["measurement"]] for flag in flags] + ([CHECK] if flags else [])
    evaluations += [hd.sr.QualitativeEvaluation(codes.DCM.QualityFinding, value) for value in findings]
    return hd.sr.VolumetricROIMeasurementsAndQualitativeEvaluations(
        measurements=_measurements(measured), qualitative_evaluations=evaluations or None, **where, **finding
    )


def _measurements(measured: dict) -> list[hd.sr.Measurement]:
    """Volume, axes, maximum diameter and (when known) attenuation of one structure, in DICOM units."""
    mm = codes.UCUM.Millimeter
    items = [
        hd.sr.Measurement(name=codes.SCT.Volume, value=1000.0 * measured["volume_ml"], unit=codes.UCUM.CubicMillimeter),
        hd.sr.Measurement(name=codes.SCT.LongAxis, value=measured["long_axis_mm"], unit=mm),
        hd.sr.Measurement(name=codes.SCT.ShortAxis, value=measured["short_axis_mm"], unit=mm),
        hd.sr.Measurement(
            name=codes.SCT.Diameter, value=measured["max_3d_diameter_mm"], unit=mm, derivation=codes.SCT.Maximum
        ),
    ]
    for key, derivation in (("hu_mean", codes.SCT.Mean), ("hu_std", codes.SCT.StandardDeviation)):
        if measured.get(key) is not None:
            items.append(hd.sr.Measurement(name=codes.DCM.AttenuationCoefficient, value=measured[key],
                                           unit=codes.UCUM.HounsfieldUnit, derivation=derivation))  # fmt: skip
    return items


def _segment_number(seg: pydicom.Dataset, name: str) -> int:
    """The number of the SEG segment labelled ``name`` (case, spaces and punctuation ignored)."""
    numbers = {normalize_name(s.SegmentLabel): int(s.SegmentNumber) for s in seg.SegmentSequence}
    if normalize_name(name) not in numbers:
        labels = [str(s.SegmentLabel) for s in seg.SegmentSequence]
        raise ValueError(f"SEG {seg.SOPInstanceUID}: no segment named {name!r} (it has {labels}); report and SEG must "
                         "come from the same label map and names.")  # fmt: skip
    return numbers[normalize_name(name)]

"""Reading the collection's DICOM into volumes on the CT's own voxel grid.

* :mod:`~scripts.data.dicom.ct` -- a CT series folder -> HU volume + LPS affine (checked before any pixel is decoded;
  for inference, a series at uneven spacing or with a gantry tilt on an equal-step grid that maps back to its slices);
* :mod:`~scripts.data.dicom.seg` -- a DICOM SEG -> label volume on that CT's grid (sparse SEGs, tolerant names);
* :mod:`~scripts.data.dicom.rtstruct` -- an RTSTRUCT -> label volume on that CT's grid (its world-mm contours filled);
* :mod:`~scripts.data.dicom.case` -- both together, as ``scripts.data.prepare`` writes them;
* :mod:`~scripts.data.dicom.discovery` -- which cases a folder holds, from the files' headers, in any layout;
* :mod:`~scripts.data.dicom.series_rules` -- which CT series of a study is the case's CT (folders and PACS alike);
* :mod:`~scripts.data.dicom.codes` -- how structures are coded when the bundle writes DICOM;
* :mod:`~scripts.data.dicom.identity` -- who the bundle says it is there: its name, manufacturer and version.

Problems raise :class:`DicomCaseError` with a message that names the file and says what to do.
"""

from scripts.data.dicom.case import LABEL_SOURCES, CaseVolumes, read_case
from scripts.data.dicom.codes import segment_description
from scripts.data.dicom.common import LPS_TO_RAS, RTSTRUCT_STORAGE, SEG_STORAGE, DicomCaseError
from scripts.data.dicom.ct import CtSeries, ScannedSeries, SeriesSource, SliceMap, read_ct_series, scan_ct_series, to_hu
from scripts.data.dicom.rtstruct import is_rtstruct, read_rtstruct_labels
from scripts.data.dicom.seg import read_seg_labels

__all__ = [
    "LABEL_SOURCES",
    "LPS_TO_RAS",
    "RTSTRUCT_STORAGE",
    "SEG_STORAGE",
    "CaseVolumes",
    "CtSeries",
    "DicomCaseError",
    "ScannedSeries",
    "SeriesSource",
    "SliceMap",
    "is_rtstruct",
    "read_case",
    "read_ct_series",
    "read_rtstruct_labels",
    "read_seg_labels",
    "scan_ct_series",
    "segment_description",
    "to_hu",
]

"""DICOM objects the bundle writes for a predicted case, each referencing the CT series it was predicted from.

* :mod:`~scripts.inference.writers.seg` -- a DICOM SEG (highdicom): one segment per structure, coded in SNOMED CT;
* :mod:`~scripts.inference.writers.rtstruct` -- an RTSTRUCT (pydicom): one ROI per structure, closed planar contours;
* :mod:`~scripts.inference.writers.sr` -- a DICOM SR (highdicom, TID 1500): each structure's volume and diameters.
"""

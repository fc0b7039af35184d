"""The inference stage: cases in, the network on a GPU or a CPU runtime (single, ensemble, TTA), post-processing,
the outputs (NIfTI, DICOM SEG, RTSTRUCT, SR, the tumour report), a PACS through DICOMweb."""

from scripts import lazy_submodules

__getattr__ = lazy_submodules(__name__)

"""The data stage: download from TCIA, find and read DICOM by its headers, prepare NIfTI once, the training
dataset and its cache, synthetic cases."""

from scripts import lazy_submodules

__getattr__ = lazy_submodules(__name__)

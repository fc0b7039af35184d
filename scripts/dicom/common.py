"""What every DICOM reader of the bundle shares: its error type and the constants of the standard it relies on."""

from __future__ import annotations

import numpy as np

#: LPS (DICOM patient) to RAS (NIfTI world) coordinates
LPS_TO_RAS = np.diag([-1.0, -1.0, 1.0, 1.0])
SEG_STORAGE = "1.2.840.10008.5.1.4.1.1.66.4"  # Segmentation Storage SOP class
RTSTRUCT_STORAGE = "1.2.840.10008.5.1.4.1.1.481.3"  # RT Structure Set Storage SOP class


class DicomCaseError(ValueError):
    """A case that cannot be read; the message names the case, the file and what to do."""

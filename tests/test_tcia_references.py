"""scripts.data.tcia.references: case folders named as monai.apps.TciaDataset names them, and never by a path."""

from __future__ import annotations

import pytest
from pydicom.dataset import Dataset
from scripts.data.tcia import TciaError, case_key


def test_case_key_uses_tciadataset_fallbacks_and_refuses_path_like_ids():
    ds = Dataset()
    ds.PatientID, ds.SeriesNumber = "LUNG1-001", 300
    assert case_key(ds) == ("LUNG1-001", "300")
    del ds.SeriesNumber
    ds.AcquisitionNumber = 7
    assert case_key(ds) == ("LUNG1-001", "7")
    del ds.AcquisitionNumber
    assert case_key(ds) == ("LUNG1-001", "0")
    ds.PatientID = "../../etc"
    with pytest.raises(TciaError, match="not a safe folder name"):
        case_key(ds)

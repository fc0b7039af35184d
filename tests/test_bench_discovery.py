"""bench_discovery: the tree it writes is a Retriever download that discovery reads whole, and the second scan reads
no header (the numbers themselves are the benchmark's, printed when it runs)."""

from __future__ import annotations

import pydicom
from benchmarks import bench_discovery


def test_the_tree_is_found_whole_and_the_second_scan_reads_no_header(tmp_path, capsys):
    report = bench_discovery.main(patients=2, slices=12, output_dir=str(tmp_path))
    assert report["files"] == 2 * (12 + 2) + 1  # slices, SEG and RTSTRUCT per patient, and metadata.csv
    first, second = report["first"], report["second"]
    assert first["cases"] == second["cases"] == 2 and first["rejected"] == 0
    assert first["headers_read"] == report["files"] and second["headers_read"] == 0
    assert "| first |" in capsys.readouterr().out
    slice_file = next((tmp_path / "download").rglob("1-001.dcm"))
    assert slice_file.stat().st_size > 512 * 512 * 2  # the listed size of a real slice (its pixels sparse on disk)
    ds = pydicom.dcmread(slice_file)
    assert ds.Rows == 512 and len(ds.PixelData) == 512 * 512 * 2 and ds.PatientID == "LUNG1-001"

"""scripts.data.tcia.archive: MD5 manifests in every spelling NBIA and md5sum write, and unsafe zip entries refused."""

from __future__ import annotations

import zipfile

import pytest
from scripts.data.tcia import UnsafeArchiveError, extract_series_zip, parse_md5_manifest


def test_md5_manifest_parsing_tolerates_header_and_column_variants():
    a, b = "0" * 32, "ABCDEF0123456789abcdef0123456789"
    assert parse_md5_manifest(f"Filename,MD5Hash\n00000001.dcm,{a}\nsub/00000002.dcm,{b}\n") == {
        "00000001.dcm": a,
        "00000002.dcm": b.lower(),
    }
    assert parse_md5_manifest(f"\ufeffMD5Hash,Filename,Size\r\n{a},x.dcm,12\r\n\r\n") == {"x.dcm": a}
    assert parse_md5_manifest(f"{a}  y.dcm\n{b} *z.dcm\n") == {"y.dcm": a, "z.dcm": b.lower()}
    assert parse_md5_manifest("Filename,MD5Hash\n") == {}


@pytest.mark.parametrize("entry", ["../evil.dcm", "a/../../evil.dcm", "/tmp/evil.dcm", "C:/evil.dcm", "..\\evil.dcm"])
def test_unsafe_zip_entries_are_refused_before_anything_is_written(tmp_path, entry):
    archive = tmp_path / "series.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("00000001.dcm", b"fine")
        zf.writestr(entry, b"escaped")
    out = tmp_path / "out" / "image"
    with pytest.raises(UnsafeArchiveError, match="unsafe zip entry"):
        extract_series_zip(archive, out)
    assert not out.exists() and not list(tmp_path.rglob("evil.dcm"))

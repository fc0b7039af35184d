"""NBIA series zips: extracted flat, every CRC checked, every file's MD5 checked against ``md5hashes.csv`` when the
archive carries one, and unsafe entry names (absolute paths, drive letters, ``..``) refused before anything is
written.

NBIA names zip entries ``00000001.dcm``, ``00000002.dcm``, ... and its MD5 endpoint appends ``md5hashes.csv`` with the
header ``Filename,MD5Hash``; we also accept no header, swapped or extra columns, and ``md5sum``-style lines.
``getImage`` adds a ``LICENSE`` entry, which is skipped with every other non-DICOM entry. A server-side error
mid-stream still closes the zip cleanly, just without the remaining files and without ``md5hashes.csv``; so a missing
manifest, or a listed file missing from the archive, counts as a cut transfer.
"""

from __future__ import annotations

import csv
import hashlib
import io
import re
import zipfile
import zlib
from collections import Counter
from pathlib import Path

from scripts.data.tcia.errors import IntegrityError, TciaError, UnsafeArchiveError

MD5_MANIFEST = "md5hashes.csv"
_CHUNK = 1 << 20
_MD5_RE = re.compile(r"^[0-9a-fA-F]{32}$")


def parse_md5_manifest(text: str) -> dict[str, str]:
    """``md5hashes.csv`` text -> {file base name: lower-case MD5}.

    Tolerates a header row or none, any column order, extra columns, a BOM, blank lines and ``md5  name`` lines.
    """
    hashes: dict[str, str] = {}
    for row in csv.reader(io.StringIO(text.lstrip("\ufeff"))):
        cells = [c.strip() for c in row if c.strip()]
        if len(cells) == 1:  # "md5  name" or "md5 *name" (md5sum's text and binary modes)
            cells = [c.lstrip("*") for c in cells[0].split()]
        digests = [c for c in cells if _MD5_RE.match(c)]
        names = [c for c in cells if not _MD5_RE.match(c)]
        if len(digests) != 1 or not names:
            continue  # header or junk
        hashes[_base_name(names[0])] = digests[0].lower()
    return hashes


def extract_series_zip(zip_path: str | Path, out_dir: str | Path, require_md5: bool = False) -> tuple[list[str], bool]:
    """Extract the ``.dcm`` entries of an NBIA series zip into ``out_dir`` (flattened to base names), verifying
    CRCs and, when the zip holds ``md5hashes.csv``, every file's MD5.

    Returns (file names, whether MD5s were checked). Raises :class:`UnsafeArchiveError` before writing anything
    when an entry name is unsafe, and :class:`IntegrityError` for a cut/corrupt archive or an MD5 mismatch
    (files already written to ``out_dir`` are then left for the caller to remove).
    """
    out = Path(out_dir)
    try:
        zf = zipfile.ZipFile(zip_path)
    except (zipfile.BadZipFile, EOFError) as err:
        raise IntegrityError(f"the archive is cut or corrupt ({err})") from err
    with zf:
        infos = zf.infolist()
        for info in infos:
            _check_entry_name(info.filename)
        manifests = [i for i in infos if _base_name(i.filename).lower() == MD5_MANIFEST]
        hashes = None
        if manifests:
            hashes = parse_md5_manifest(_read_entry(zf, manifests[0]).decode("utf-8", errors="replace"))
        elif require_md5:
            raise IntegrityError(f"{MD5_MANIFEST} is missing from the archive (the server's stream ended early?)")
        dicoms = [i for i in infos if not i.is_dir() and _base_name(i.filename).lower().endswith(".dcm")]
        if not dicoms:
            raise IntegrityError("the archive holds no .dcm file")
        names = [_base_name(i.filename) for i in dicoms]
        dupes = sorted(n for n, count in Counter(names).items() if count > 1)
        if dupes:
            raise TciaError(f"archive entries in different folders share the file name {dupes[0]!r}")
        if hashes is not None:
            missing = sorted(set(hashes) - set(names))
            if missing:
                raise IntegrityError(
                    f"{len(missing)} file(s) listed in {MD5_MANIFEST} are missing from the archive, e.g. {missing[0]}"
                )
        out.mkdir(parents=True, exist_ok=True)
        for info, name in zip(dicoms, names, strict=True):
            digest = hashlib.md5(usedforsecurity=False)
            try:
                with zf.open(info) as src, open(out / name, "wb") as dst:
                    while chunk := src.read(_CHUNK):
                        digest.update(chunk)
                        dst.write(chunk)
            except (zipfile.BadZipFile, zlib.error, EOFError) as err:
                raise IntegrityError(f"{name} is corrupt in the archive ({err})") from err
            if hashes is not None:
                expected = hashes.get(name)
                if expected is None:
                    raise IntegrityError(f"{name} is not listed in {MD5_MANIFEST}")
                if digest.hexdigest() != expected:
                    raise IntegrityError(
                        f"MD5 mismatch for {name}: {MD5_MANIFEST} says {expected}, got {digest.hexdigest()}"
                    )
    return sorted(names), hashes is not None


def _check_entry_name(name: str) -> None:
    norm = name.replace("\\", "/")
    if norm.startswith("/") or re.match(r"^[A-Za-z]:", norm) or ".." in norm.split("/") or "\0" in norm:
        raise UnsafeArchiveError(f"unsafe zip entry {name!r} (absolute path, drive letter or '..'); nothing extracted")


def _base_name(name: str) -> str:
    return name.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]


def _read_entry(zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> bytes:
    try:
        return zf.read(info)
    except (zipfile.BadZipFile, zlib.error, EOFError) as err:
        raise IntegrityError(f"{info.filename} is corrupt in the archive ({err})") from err

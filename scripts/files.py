"""Atomic file writes: every output goes to a hidden temporary file in the same folder, then ``os.replace`` puts it in
place, so a reader (or a crash) never sees half a file and a previous version survives a failed write."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np


def replace_atomically(path: str | Path, write: Callable[[Path], Any]) -> Path:
    """``write(tmp)`` to a temporary sibling of ``path`` (same suffixes, so writers that go by extension work),
    then rename it to ``path``; the temporary file is removed if writing fails.

    The temporary name is short whatever the final name (a 240-byte case name stays within the file system's
    255-byte limit): a hidden ``.tmp-<pid>-<thread>-<hash of the name><suffixes>``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    suffixes = "".join(path.suffixes[-2:]) if path.name.endswith(".nii.gz") else path.suffix
    tag = hashlib.blake2b(os.fsencode(path.name), digest_size=4).hexdigest()
    tmp = path.with_name(f".tmp-{os.getpid()}-{threading.get_ident()}-{tag}{suffixes[:16]}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


#: the longest suffix the bundle appends to a case name in a file name (``_rtstruct.dcm``, with room to spare)
CASE_SUFFIX_BYTES = 16
#: a file name may hold 255 bytes on every common file system
NAME_MAX_BYTES = 255


def check_case_name(name: str) -> None:
    """A case name every output file can carry: valid UTF-8 (it goes into JSON, CSV and DICOM) and short enough for
    the longest output name; ValueError saying why and what to do otherwise."""
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        raise ValueError(
            f"the name {os.fsencode(name)!r} is not valid UTF-8 (a folder named in another encoding): rename it"
        ) from None
    if size + CASE_SUFFIX_BYTES > NAME_MAX_BYTES:
        raise ValueError(
            f"the name is {size} bytes long; with the bundle's file suffixes it would pass the file system's "
            f"{NAME_MAX_BYTES}-byte limit: rename it to at most {NAME_MAX_BYTES - CASE_SUFFIX_BYTES} bytes"
        )


def display_name(name: str) -> str:
    """``name`` as text that can always be printed and logged (undecodable bytes shown as ``\\xNN``)."""
    return os.fsencode(name).decode("utf-8", "backslashreplace")


def fingerprint(folder: str | Path, head_bytes: int = 16384) -> str:
    """What a folder's files are, cheaply: every file's relative path and size and a hash of its first bytes (a
    DICOM file's header, with its UIDs). Changes when a file is added, removed, renamed or replaced by another, even
    one carrying an old modification time (``cp -p``, ``rsync -a``, tar); modification times are not used."""
    folder = Path(folder)
    digest = hashlib.blake2b(digest_size=16)
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        with open(path, "rb") as f:
            head = f.read(head_bytes)
        digest.update(os.fsencode(path.relative_to(folder)) + b"\0" + str(path.stat().st_size).encode() + b"\0")
        digest.update(hashlib.blake2b(head, digest_size=16).digest())
    return digest.hexdigest()


def write_text(path: str | Path, text: str) -> Path:
    return replace_atomically(path, lambda tmp: tmp.write_text(text))


def csv_text(rows: Sequence[dict], columns: Sequence[str]) -> str:
    """``rows`` as CSV text with a header of ``columns``, floats to 6 significant digits (metrics tables)."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(columns), lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})
    return buffer.getvalue()


def write_json(path: str | Path, data: Any, **kwargs: Any) -> Path:
    """JSON, indented, with a final newline; ``kwargs`` go to ``json.dumps`` (e.g. ``default=str``)."""
    return write_text(path, json.dumps(data, indent=2, **kwargs) + "\n")


def save_nifti(path: str | Path, array: np.ndarray, affine: np.ndarray) -> Path:
    """A NIfTI with ``affine`` as both qform and sform (viewers and nibabel then agree on the geometry)."""
    image = nib.Nifti1Image(array, affine)
    image.set_qform(affine, code=1)
    image.set_sform(affine, code=1)
    return replace_atomically(path, lambda tmp: nib.save(image, tmp))

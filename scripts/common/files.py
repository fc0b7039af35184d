"""Atomic file writes: every output goes to a hidden temporary file in the same folder, then ``os.replace`` puts it in
place, so a reader (or a crash) never sees half a file and a previous version survives a failed write."""

from __future__ import annotations

import csv
import fcntl
import hashlib
import io
import json
import os
import re
import socket
import threading
import time
import zlib
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


def safe_name(text: str) -> str:
    """``text`` (a PatientID, a series number) as a name every file system takes: letters (any script), digits, ``.``,
    ``_`` and ``-``, any other run of characters (and ``..``) as one ``_``, no leading dot, at most 64 characters (a
    PatientID's own limit) and 128 bytes (room for the bundle's suffixes within 255)."""
    name = re.sub(r"_+", "_", re.sub(r"[^\w.-]+|\.\.+", "_", str(text))).strip("._")[:64]
    while len(name.encode("utf-8")) > 128:
        name = name[:-1]
    return name or "case"


def unique_name(name: str, taken: set[str]) -> str:
    """``name``, or ``name_2``, ``name_3``, ... when it is taken already; the result is added to ``taken``."""
    unique, number = name, 1
    while unique in taken:
        number += 1
        unique = f"{name}_{number}"
    taken.add(unique)
    return unique


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


def file_sha256(path: str | Path) -> str:
    """The SHA-256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


_HELD: dict[Path, Any] = {}  # the locks this process holds, open for its life (the kernel frees them at its end)


def hold_lock(path: str | Path) -> str | None:
    """Take the lock file ``path`` for this process's life (an flock, freed by the kernel when the process ends, however
    it ends) and write who holds it; None once held, or the holder's line ("process P on HOST since ...") if another
    process holds it."""
    path = Path(path)
    if path in _HELD:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = path.open("a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        return holder
    handle.seek(0)
    handle.truncate()
    handle.write(f"process {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    handle.flush()
    _HELD[path] = handle
    return None


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


def read_json(path: str | Path) -> dict:
    """A JSON object from ``path``; ``{}`` where it is missing, unreadable or not an object (a record to make anew)."""
    try:
        found = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def save_nifti(path: str | Path, array: np.ndarray, affine: np.ndarray) -> Path:
    """A NIfTI with ``affine`` as both qform and sform (viewers and nibabel then agree on the geometry).

    An integer array already in NIfTI's voxel order (Fortran-contiguous, little endian: what the DICOM readers make) is
    written in one piece -- nibabel's header, then the array's memory, gzipped in a few large zlib calls for
    ``.nii.gz`` -- the bytes nibabel writes, gzip header included (tests/test_files.py), without its copy of every
    slice. Each large write or zlib call runs without the GIL, so a case written in one thread costs little to the one
    reading the next case (scripts.data.prepare), or to the writers beside it (scripts.inference.outputs); nibabel's
    per-slice writes had to win the GIL back hundreds of times per file. Any other
    array goes through ``nibabel.save``."""
    image = nib.Nifti1Image(array, affine)
    image.set_qform(affine, code=1)
    image.set_sform(affine, code=1)
    if not array.flags.f_contiguous or array.dtype.byteorder == ">" or array.dtype.kind not in "iu":
        return replace_atomically(path, lambda tmp: nib.save(image, tmp))
    header = image.header  # its data type already the array's
    header.set_slope_inter(1.0, 0.0)  # what nibabel records for integers stored as they are
    header["vox_offset"] = NIFTI_DATA_OFFSET
    head = header.binaryblock + b"\0" * (NIFTI_DATA_OFFSET - len(header.binaryblock))  # no extensions
    data = memoryview(array.T).cast("B")  # the Fortran-ordered voxels, as bytes, no copy

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            if not str(path).endswith(".gz"):
                f.write(head)
                f.write(data)
                return
            packer = zlib.compressobj(NIFTI_GZIP_LEVEL, zlib.DEFLATED, 31)  # 31: a gzip container
            f.write(_as_python_gzip(packer.compress(head)))
            for start in range(0, len(data), NIFTI_GZIP_CHUNK):
                f.write(packer.compress(data[start : start + NIFTI_GZIP_CHUNK]))
            f.write(packer.flush())

    return replace_atomically(path, write)


def _as_python_gzip(start: bytes) -> bytes:
    """The first bytes zlib gives for a gzip container, its 10-byte header naming the operating system as Python's
    ``gzip`` (and so nibabel) does, 255 (unknown), rather than zlib's 3 (Unix): with it the whole file is nibabel's,
    byte for byte."""
    if len(start) < 10 or start[:3] != b"\x1f\x8b\x08":
        raise RuntimeError(f"zlib began a gzip stream with {start[:10]!r}, not a whole gzip header")
    return start[:9] + b"\xff" + start[10:]


#: bytes before the voxels of a single-file NIfTI-1 without extensions: the 348-byte header and 4 extension bytes
NIFTI_DATA_OFFSET = 352
#: nibabel's gzip level for .nii.gz (fast; labels are ~99 % zeros)
NIFTI_GZIP_LEVEL = 1
NIFTI_GZIP_CHUNK = 1 << 23

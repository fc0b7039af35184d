"""Atomic file writes: every output goes to a hidden temporary file in the same folder, then ``os.replace`` puts it in
place, so a reader (or a crash) never sees half a file and a previous version survives a failed write."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np


def replace_atomically(path: str | Path, write: Callable[[Path], Any]) -> Path:
    """``write(tmp)`` to a temporary sibling of ``path`` (same suffixes, so writers that go by extension work),
    then rename it to ``path``; the temporary file is removed if writing fails."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    suffixes = "".join(path.suffixes[-2:]) if path.name.endswith(".nii.gz") else path.suffix
    stem = path.name[: len(path.name) - len(suffixes)] if suffixes else path.name
    tmp = path.with_name(f".{stem}.tmp{os.getpid()}-{threading.get_ident()}{suffixes}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_text(path: str | Path, text: str) -> Path:
    return replace_atomically(path, lambda tmp: tmp.write_text(text))


def write_json(path: str | Path, data: Any, **kwargs: Any) -> Path:
    """JSON, indented, with a final newline; ``kwargs`` go to ``json.dumps`` (e.g. ``default=str``)."""
    return write_text(path, json.dumps(data, indent=2, **kwargs) + "\n")


def save_nifti(path: str | Path, array: np.ndarray, affine: np.ndarray) -> Path:
    """A NIfTI with ``affine`` as both qform and sform (viewers and nibabel then agree on the geometry)."""
    image = nib.Nifti1Image(array, affine)
    image.set_qform(affine, code=1)
    image.set_sform(affine, code=1)
    return replace_atomically(path, lambda tmp: nib.save(image, tmp))

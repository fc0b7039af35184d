"""The windows OpenVINO's int8 quantisation is calibrated on (``cpu_precision: int8``,
:mod:`scripts.inference.backends`).

Post-training quantisation measures the range of every activation on a few real inputs and picks each int8 scale
from it: windows unlike those inference feeds (random noise, an empty volume) give scales that clip a CT's tissue or
waste the 256 levels on values never seen. So the windows are the very ones inference would run: each calibration CT
goes through the bundle's own loading and CT preprocessing (:class:`scripts.inference.inputs.LoadCased`,
``ct_transforms``) and its own sliding window (``sliding_window_inferer``: the windows of the thorax region), and a few
of those windows, spread evenly over the region, are kept. Where they come from (``int8_calibration``):

* ``null`` -- :data:`PATHOLOGIES` of the chest phantom (:mod:`scripts.data.phantom`: a planning CT's 512 x 512 x 100
grid
  with neck, arms, lungs, mediastinum, upper abdomen, couch; a tumour in a collapsed lung, a large central mass, an
  effusion), built in memory: nothing to download, the same windows on every machine;
* a training run's ``datalist.json`` -- its ``training`` cases (the images ``scripts.data.prepare`` wrote), the data the
  weights were trained on;
* a folder -- the cases ``--input_dir`` would find in it (DICOM series, NIfTI files);
* a calibration set (``.npz``) -- windows kept by :func:`write_set`: training writes one beside its weights
  (``model.pt.calibration.npz``, windows of its training CTs and, for the check, of its validation CTs), and
  :func:`source_for` takes it when ``int8_calibration`` names nothing, so weights handed to someone without the
  training data still quantise on that data.

:class:`Calibration` makes the windows only when asked (:meth:`Calibration.windows`: a quantisation that is cached
never loads a CT) and names them by :attr:`Calibration.key` -- the source (each case's file names and sizes), the
number of windows and the settings that shape them -- so the cache of the quantised model is used again only for the
same calibration.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from monai.data import MetaTensor
from monai.inferers import SlidingWindowInferer
from monai.transforms import Compose
from monai.utils.enums import MetaKeys
from scripts.common.files import file_sha256, replace_atomically
from scripts.inference.inputs import InferenceInputError, LoadCased, find_inputs

logger = logging.getLogger(__name__)

#: the phantom's chests (``int8_calibration: null``): an ordinary one and three whose lungs hold little air
PATHOLOGIES = ("none", "large_central", "collapsed_left", "effusion_right")
#: the phantom's grid: 512 x 512 pixels of 0.98 mm (a 500 mm field of view), 100 slices of 3 mm
PHANTOM_SHAPE = (512, 512, 100)
PHANTOM_SPACING = (0.9765625, 0.9765625, 3.0)
#: windows taken from each CT: several CTs with a few windows each cover more anatomy than one CT's every window
WINDOWS_PER_CASE = 4
#: the calibration set beside a weights file (``model.pt`` -> ``model.pt.calibration.npz``)
SET_SUFFIX = ".calibration.npz"
#: windows held out from calibration on which int8 is checked against f32 (:mod:`scripts.inference.int8`)
CHECK_WINDOWS = 8
#: what of the sliding window shapes the windows besides their size, in the key
INFERER_SETTINGS = ("spacing", "hu_window", "region", "margin_mm", "overlap")
#: bump when the way windows are chosen changes: every quantised model is then calibrated again
VERSION = 1


class CalibrationError(ValueError):
    """The calibration source holds no usable CT; the message names it and what to pass."""


class Calibration:
    """``count`` windows of the network's input, taken from the CTs of ``source`` as inference would run them.

    ``preprocessing``: the config's ``ct_transforms`` (a CT as :func:`scripts.inference.inputs.load_case` reads it ->
    the network's input), or the path of a config that defines them (read when the windows are made: MONAI Label's
    inferer, which the config builds without them); ``inferer``: ``sliding_window_inferer``, whose windows are
    recorded, and whose window and settings (:data:`INFERER_SETTINGS`) shape them, for the key; ``out_channels``: what
    the recorded network returns per window (the inferer stitches it, then it is discarded)."""

    def __init__(
        self,
        source: str | Path | None,
        count: int,
        preprocessing: Sequence[Callable] | str | Path,
        inferer: SlidingWindowInferer,
        out_channels: int = 2,
        check_count: int = CHECK_WINDOWS,
    ) -> None:
        if int(count) < 1:
            raise CalibrationError(f"int8_calibration_windows={count}: at least one window is needed.")
        self.source = None if source in (None, "", "null") else Path(source)
        self.count, self.window = int(count), [int(w) for w in inferer.roi_size]
        self.preprocessing, self.inferer = preprocessing, inferer
        self.out_channels = int(out_channels)
        self.check_count = int(check_count)
        # the bundle's run (sliding_window_inferer) and MONAI Label (its inferer) give the same settings: one model
        self.settings = {name: getattr(inferer, name) for name in INFERER_SETTINGS}
        self._cases: list[dict] | None = None
        self._planned = 0  # the cases meant to give the windows; the others give what these lack
        self._made: tuple[list[np.ndarray], list[np.ndarray]] | None = None  # calibration's and the check's

    def describe(self) -> str:
        where = "the chest phantom" if self.source is None else str(self.source)
        return f"{self.count} windows of {'x'.join(map(str, self.window))} from {where}"

    @property
    def is_set(self) -> bool:
        """Whether the source is a calibration set (:func:`write_set`), its windows made already."""
        return self.source is not None and self.source.name.endswith(".npz")

    @property
    def key(self) -> str:
        """What the windows depend on: the source's cases (names and file sizes) or a set's bytes, their number, the
        window and the settings; the same key, the same windows."""
        made = [file_sha256(self.source)] if self.is_set else [_fingerprint(case) for case in self.cases()]
        parts = {"version": VERSION, "count": self.count, "window": self.window, "settings": self.settings,
                 "cases": made}  # fmt: skip
        return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()

    def cases(self) -> list[dict]:
        """The source's cases in the order the windows are taken from them: ``ceil(count / WINDOWS_PER_CASE)`` spread
        evenly over their sorted order first, then the others in order while windows are still missing."""
        if self._cases is None:
            every = _source_cases(self.source)
            first = _spread(len(every), max(1, math.ceil(self.count / WINDOWS_PER_CASE)))
            planned = set(first)
            rest = [i for i in range(len(every)) if i not in planned]
            self._cases = [every[i] for i in first + rest]
            self._planned = len(first)
        return self._cases

    def windows(self) -> list[np.ndarray]:
        """The windows, ``[1, 1, *window]`` float32 each: from each planned case (:meth:`cases`) its share of
        ``count``, spread evenly over the windows its sliding window runs (MONAI's order: along the last axis first);
        a case with fewer windows than its share leaves the rest to the next cases."""
        return self._make()[0]

    def check_windows(self) -> list[np.ndarray]:
        """``check_count`` windows that :meth:`windows` does not hold, on which int8 is checked against f32: the
        windows of the calibration cases that calibration left, then the cases it did not need, then a datalist's
        validation cases (held out from training as well), each case's spread evenly as calibration's are."""
        return self._make()[1]

    def _make(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        if self._made is None and self.is_set:
            self._made = _read_set(self.source, self.window, self.count)
        if self._made is not None:
            return self._made
        cases = self.cases() + _check_only_cases(self.source)
        inferer = copy.copy(self.inferer)  # what it records of a case (last, ...) is set on the copy, not the run's
        preprocessing = Compose(_ct_transforms(self.preprocessing))
        chosen: list[np.ndarray] = []
        held: list[np.ndarray] = []
        for number, case in enumerate(cases):
            missing, held_missing = self.count - len(chosen), self.check_count - len(held)
            if number >= len(self.cases()):
                missing = 0  # a case calibration may not see
            if missing == 0 and held_missing <= 0:
                break
            share = math.ceil(missing / max(1, self._planned - number)) if missing else 0
            held_share = min(held_missing, math.ceil(self.check_count / max(1, self._planned)))
            # a phantom in memory, or a case read by inference's reader (which refuses a NIfTI label map as there)
            ct = case["ct"]() if "ct" in case else LoadCased("image")(case)["image"]
            image = preprocessing({"image": ct})["image"]
            seen: list[torch.Tensor] = []
            with torch.no_grad():
                inferer(torch.as_tensor(image)[None], _Recorder(seen, self.out_channels))
            every = torch.cat(seen) if seen else torch.empty(0)
            taken = _spread(every.shape[0], share) if share else []
            calibrating = set(taken)
            rest = [i for i in range(every.shape[0]) if i not in calibrating]
            kept = [rest[i] for i in _spread(len(rest), held_share)] if held_share > 0 else []
            chosen += [every[i : i + 1].detach().to("cpu", torch.float32).contiguous().numpy() for i in taken]
            held += [every[i : i + 1].detach().to("cpu", torch.float32).contiguous().numpy() for i in kept]
            logger.info("int8 calibration: %d of the %d windows of %s, %d held out for the check", len(taken),
                        every.shape[0], case["case_id"], len(kept))  # fmt: skip
        if not chosen:
            raise CalibrationError(f"--int8_calibration {self.source}: no window of the network ran on its CTs; give "
                                   "another.")  # fmt: skip
        if len(chosen) < self.count:
            logger.warning("int8 calibration: %d windows, not %d: every window of every CT of %s", len(chosen),
                           self.count, self.source)  # fmt: skip
        if len(held) < self.check_count:
            logger.warning("int8 check: %d held-out windows, not %d: %s holds no more windows that calibration did "
                           "not take", len(held), self.check_count, self.source)  # fmt: skip
        self._made = (chosen, held)
        return self._made


def source_for(source: str | Path | None, weights: str | Path | None) -> str | None:
    """What int8 calibrates on: ``source`` (``int8_calibration``) when it names one that exists; else the calibration
    set beside ``weights`` (``<weights>.calibration.npz``, :func:`write_set`) where there is one -- also in place of a
    named source that does not exist (demo.yaml names the demo's datalist under the bundle, which weights run
    elsewhere may not have), said in the log; else ``source`` as named (a missing one is refused when int8 is made)
    or None (the chest phantom, and ``cpu_precision: auto`` stays f32)."""
    named = None if source in (None, "", "null") else str(source)
    if named is not None and Path(named).exists():
        return named
    beside = Path(f"{weights}{SET_SUFFIX}") if weights not in (None, "") else None
    if beside is not None and beside.is_file():
        if named is not None:
            logger.warning("int8_calibration %s does not exist: the calibration set beside the weights is used (%s)",
                           named, beside)  # fmt: skip
        return str(beside)
    return named


def write_set(calibration: Calibration, weights: str | Path, state: Any = None) -> Path | None:
    """``calibration``'s windows and its check's, as float16, into ``<weights>.calibration.npz`` (whole or not at
    all), so that the weights travel with data to quantise on. ``state``: the run's evaluator state; nothing is
    written when the run wrote no weights (it never validated). Returns the file, or None."""
    if state is not None and (getattr(state, "best_metric_epoch", -1) or -1) < 1:
        return None
    start = time.perf_counter()
    windows, held = calibration.windows(), calibration.check_windows()
    path = Path(f"{weights}{SET_SUFFIX}")

    empty = np.empty((0, 1, *calibration.window), np.float16)

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as handle:  # a file object: numpy adds no .npz to the temporary name
            np.savez_compressed(handle, windows=np.concatenate(windows).astype(np.float16),
                                check=np.concatenate(held).astype(np.float16) if held else empty,
                                source=np.array(calibration.describe()))  # fmt: skip

    replace_atomically(path, write)
    logger.info("int8 calibration set: %d windows and %d for the check, beside the weights in %.1f s (%.1f MB) -> %s",
                len(windows), len(held), time.perf_counter() - start, path.stat().st_size / 1e6, path)  # fmt: skip
    return path


def _read_set(path: Path, window: Sequence[int], count: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """A calibration set's first ``count`` windows and its check's, float32, refused when they are not ``window``'s
    shape (weights trained with another roi_size) or unreadable."""
    try:
        with np.load(path) as kept:
            windows, held = kept["windows"], kept["check"]
    except (OSError, ValueError, KeyError) as err:
        raise CalibrationError(f"--int8_calibration {path}: not a calibration set ({err}); delete it, or give a "
                               "training run's datalist.json or a folder of CTs.") from None  # fmt: skip
    if tuple(windows.shape[2:]) != tuple(window):
        raise CalibrationError(f"--int8_calibration {path}: its windows are {list(windows.shape[2:])}, the sliding "
                               f"window is {list(window)}: give CTs instead (a datalist or a folder).")  # fmt: skip
    as_list = lambda array: [a[None].astype(np.float32) for a in array]  # noqa: E731
    return as_list(windows[:count]), as_list(held)


class _Recorder:
    """Stands in for the network in the sliding window: keeps each batch of windows, returns background logits."""

    def __init__(self, seen: list[torch.Tensor], out_channels: int) -> None:
        self.seen, self.out_channels = seen, out_channels

    def __call__(self, windows: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.seen.append(windows.detach().cpu())
        return torch.zeros((windows.shape[0], self.out_channels, *windows.shape[2:]), dtype=windows.dtype)


def _ct_transforms(preprocessing: Sequence[Callable] | str | Path) -> list[Callable]:
    """The CT preprocessing itself, or ``ct_transforms`` of the config file it names (on the CPU)."""
    if not isinstance(preprocessing, (str, Path)):
        return list(preprocessing)
    from monai.bundle import ConfigParser

    parser = ConfigParser()
    parser.read_config(str(preprocessing))
    parser["bundle_root"] = str(Path(preprocessing).resolve().parents[1])
    return list(parser.get_parsed_content("ct_transforms"))


def _spread(total: int, wanted: int) -> list[int]:
    """``wanted`` indices of ``range(total)``, evenly spaced, first and last included (all of them if fewer)."""
    if wanted >= total:
        return list(range(total))
    return sorted({round(float(i)) for i in np.linspace(0, total - 1, wanted)})


def _source_cases(source: Path | None) -> list[dict]:
    """The cases of ``source`` as ``find_inputs`` gives them (or the phantom's, with their CT built in memory)."""
    if source is None:
        return [{"case_id": f"phantom-{name}", "pathology": name, "ct": _LazyPhantom(name)} for name in PATHOLOGIES]
    if not source.exists():
        raise CalibrationError(f"--int8_calibration {source}: no such file or folder; give a training run's "
                               "datalist.json, a folder of CTs, or null for the chest phantom.")  # fmt: skip
    if source.is_file() and source.suffix == ".json":
        try:
            cases = _listed(source, json.loads(source.read_text())["training"])
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise CalibrationError(f"--int8_calibration {source}: not a datalist with a 'training' list "
                                   f"({err}).") from None  # fmt: skip
    else:
        try:
            cases = find_inputs(source)
        except InferenceInputError as err:
            raise CalibrationError(f"--int8_calibration: {err}") from None
    if not cases:
        raise CalibrationError(f"--int8_calibration {source}: no CT in it; give a training run's datalist.json, a "
                               "folder of CTs, or null for the chest phantom.")  # fmt: skip
    return sorted(cases, key=lambda case: str(case["case_id"]))


def _check_only_cases(source: Path | None) -> list[dict]:
    """A datalist's validation cases: held out from the weights' training, so from calibration too (none for another
    source)."""
    if source is None or not (source.is_file() and source.suffix == ".json"):
        return []
    try:
        return _listed(source, json.loads(source.read_text()).get("validation") or [])
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        return []


def _listed(datalist: Path, items: list[dict]) -> list[dict]:
    """A datalist's items as inference's cases: the images prepare wrote, beside the datalist."""
    return [{"image": str((datalist.parent / item["image"]).resolve()), "case_id": str(item.get("case_id", i)),
             "source": "nifti"} for i, item in enumerate(items)]  # fmt: skip


def _fingerprint(case: Mapping[str, Any]) -> list:
    """A case's name and the sizes of its files (the phantom's: its pathology and grid)."""
    if "pathology" in case:
        return [case["pathology"], list(PHANTOM_SHAPE), list(PHANTOM_SPACING)]
    files = [Path(p) for p in case.get("slice_paths") or [case["image"]]]
    return [str(case["case_id"]), len(files), sum(p.stat().st_size for p in files if p.is_file())]


class _LazyPhantom:
    """The phantom chest of one pathology as ``load_case`` returns a CT: ``[1, X, Y, Z]`` HU, RAS affine."""

    def __init__(self, pathology: str) -> None:
        self.pathology = pathology

    def __call__(self) -> MetaTensor:
        from scripts.data.phantom import chest

        (nx, ny, nz), (dx, dy, dz) = PHANTOM_SHAPE, PHANTOM_SPACING
        xs = (np.arange(nx) - (nx - 1) / 2) * dx  # LPS mm: x to the patient's left, y to the back, z up
        ys = (np.arange(ny) - (ny - 1) / 2) * dy
        zs = np.arange(nz) * dz
        hu, _, _ = chest(xs, ys, zs, pathology=self.pathology)
        ras = np.array([[-dx, 0, 0, -xs[0]], [0, -dy, 0, -ys[0]], [0, 0, dz, zs[0]], [0, 0, 0, 1]], dtype=float)
        meta = {"filename_or_obj": f"phantom-{self.pathology}", "source": "phantom",
                "original_affine": torch.as_tensor(ras), MetaKeys.ORIGINAL_CHANNEL_DIM: 0}  # fmt: skip
        return MetaTensor(torch.from_numpy(np.ascontiguousarray(hu, dtype=np.float32))[None], affine=ras, meta=meta)

"""int8 on a CPU (``cpu_precision: int8``, or ``auto`` where the CPU has no native bf16): the ONNX export quantised
once by NNCF, proved against f32 on windows held out from its calibration, and the decision kept beside the quantised
model, so that it is made once per weights, calibration and kind of CPU.

Why every layer is quantised with NNCF's overflow fix (7-bit weights): CPUs without VNNI (AVX2, AVX-512 without
VNNI) multiply int8 with ``vpmaddubsw``, which sums two u8 x s8 products in 16 bits. 255 x 127 x 2 = 64,770 does not
fit in 32,767, so large activations meeting large weights saturate; 255 x 64 x 2 = 32,640 does. With 7-bit weights
no product pair can saturate on any CPU, so one quantised model runs right on AVX2, AVX-512 VNNI and AMX alike, and a
model quantised on one node of a cluster is right on the others (docs/inference.md#int8-on-a-cpu-without-bf16 has
the tumour Dice each way, measured with oneDNN capped at AVX2).

Why proved each time it is made: quantisation is an approximation whose error depends on the weights, the
calibration and the CPU's kernels, none of which a test of other weights covers. So each quantised model is run beside
f32 on :meth:`scripts.inference.calibration.Calibration.check_windows` (windows calibration never saw), on this CPU, and
judged by the guard the bundle's tests hold int8 to (:data:`GUARD`). A model that fails it is not used: the run goes on
in f32, the log gives the numbers, and ``int8.json`` records the decision for this CPU kind, so it is not tried again.

Files, in ``<model_file>.openvino-int8/``: :data:`INT8_MODEL` (OpenVINO IR, ``.xml`` + ``.bin``) and
:data:`INT8_RECORD` -- what it was quantised from (the calibration's key, the export's and the IR's SHA-256, NNCF's
version, the overflow fix) and ``checks``, one decision per CPU kind (:func:`scripts.common.cpus.cpu_isa`) with its
numbers.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from scripts.common.cpus import cpu_isa
from scripts.common.files import file_sha256, read_json, write_json

if TYPE_CHECKING:
    from scripts.inference.calibration import Calibration

logger = logging.getLogger(__name__)

INT8_MODEL, INT8_RECORD = "int8.xml", "int8.json"
#: what ``cpu_precision: int8`` needs beyond OpenVINO (requirements-int8.txt)
INT8_EXTRA = "pip install -r requirements-int8.txt"
#: NNCF's overflow fix on every layer (see the module's docstring); part of the record, so a model quantised otherwise
#: is quantised again
OVERFLOW_FIX = "enable"
#: the guard int8 must pass against f32 on the held-out windows: the tumour's Dice and volume over all of them (where
#: f32 finds at least ``min_tumour_voxels`` tumour voxels), and the share of voxels with the same class in each window
GUARD = {"tumour_dice": 0.99, "volume_change": 0.01, "agreement": 0.99, "min_tumour_voxels": 100}


class QuantisationError(ValueError):
    """int8 cannot be made here (NNCF missing, NNCF failing); the message says what to do."""


@dataclass
class Check:
    """int8 against f32 on the held-out windows, on one kind of CPU."""

    cpu: str
    windows: int
    agreement_min: float  # the lowest share of voxels of one window with the same class in both
    tumour_voxels: int  # f32's tumour voxels over all windows
    tumour_dice: float | None  # None: too little tumour in the windows to judge by it
    volume_change: float | None  # int8's tumour volume against f32's, as a fraction (+0.004: 0.4 % more)
    seconds: float
    accepted: bool = False

    def judge(self) -> Check:
        judged_by_tumour = self.tumour_dice is not None and self.volume_change is not None
        self.accepted = (
            self.windows > 0
            and self.agreement_min >= GUARD["agreement"]
            and (
                not judged_by_tumour
                or (self.tumour_dice >= GUARD["tumour_dice"] and abs(self.volume_change) <= GUARD["volume_change"])
            )
        )
        return self

    def describe(self) -> str:
        tumour = (f"tumour Dice {self.tumour_dice:.4f}, volume {self.volume_change:+.2%} (guard >= "
                  f"{GUARD['tumour_dice']}, within {GUARD['volume_change']:.0%})" if self.tumour_dice is not None
                  else f"no tumour to judge by ({self.tumour_voxels} voxels in f32)")  # fmt: skip
        return (
            f"{self.windows} held-out windows on {self.cpu}: same class in >= {self.agreement_min:.4f} of each "
            f"window's voxels (guard >= {GUARD['agreement']}), {tumour}; {self.seconds:.1f} s"
        )


@dataclass
class Int8Model:
    """What :func:`quantised` decided: ``model`` (the IR's path, or the model in memory where nothing can be kept) to
    compile, or None where int8 failed its check here; ``check``, the numbers behind the decision."""

    model: Any
    check: Check


def quantised(
    model_file: Path, calibration: Calibration, folder: Path | None, compile_model: Callable[[Any, str], Any]
) -> Int8Model:
    """The ONNX export ``model_file`` quantised to int8 on ``calibration``'s windows and checked against f32 on this
    CPU, each once: a model quantised from the same export and calibration is loaded, a check made on this CPU kind
    is read back (a rejection too). ``folder`` (``<model_file>.openvino-int8/``, its lock held by the caller) keeps
    both; None (read-only): both made each time. ``compile_model(model, precision)`` compiles as the run will, f32 or
    int8. Progress and seconds go to the log."""
    kind = cpu_isa() or "this CPU"
    key, export_sha = calibration.key, _export_sha256(model_file)
    record: dict = {}
    model: Any = None
    if folder is not None:
        xml, record_file = folder / INT8_MODEL, folder / INT8_RECORD
        record = read_json(record_file)
        weights_file = xml.with_suffix(".bin")
        if (record.get("calibration") == key and record.get("onnx_sha256") == export_sha
                and record.get("overflow_fix") == OVERFLOW_FIX and xml.is_file() and weights_file.is_file()
                and file_sha256(weights_file) == record.get("bin_sha256")):  # fmt: skip
            model = str(xml)
            earlier = _read_check(record.get("checks", {}).get(kind))
            if earlier is not None:
                check = earlier
                _log_decision(check, calibration, "earlier")
                return Int8Model(model if check.accepted else None, check)
            logger.info("int8: the model quantised on %s earlier (%s); checking it on %s", calibration.describe(), xml,
                        kind)  # fmt: skip
        else:
            for child in folder.iterdir():  # another calibration or export, or none: what was compiled from it goes too
                shutil.rmtree(child) if child.is_dir() else child.unlink()
            record = {}
    if model is None:
        model, windows = _quantise(model_file, calibration)
        if folder is not None:
            model = _save(model, folder, {"calibration": key, "describe": calibration.describe(),
                                          "onnx_sha256": export_sha, "overflow_fix": OVERFLOW_FIX,
                                          "windows": windows})  # fmt: skip
            record = read_json(folder / INT8_RECORD)
    check = check_against_f32(compile_model(str(model_file), "f32"), compile_model(model, "int8"),
                              calibration.check_windows(), kind)  # fmt: skip
    _log_decision(check, calibration, "now")
    if folder is not None:
        record.setdefault("checks", {})[kind] = asdict(check)
        write_json(folder / INT8_RECORD, record)
    return Int8Model(model if check.accepted else None, check)


def check_against_f32(f32: Any, int8: Any, windows: Sequence[np.ndarray], cpu: str) -> Check:
    """Both compiled models on each window: the share of voxels whose class (argmax) is the same, per window, and the
    tumour (every class but the background) over all windows, as :data:`GUARD` judges them."""
    start = time.perf_counter()
    agreement, both, f32_tumour, int8_tumour = [], 0, 0, 0
    for number, window in enumerate(windows, 1):
        expected = np.asarray(f32([window])[0]).argmax(1)
        found = np.asarray(int8([window])[0]).argmax(1)
        agreement.append(float((expected == found).mean()))
        both += int(((expected > 0) & (found > 0)).sum())
        f32_tumour += int((expected > 0).sum())
        int8_tumour += int((found > 0).sum())
        logger.info("int8 check: window %d of %d, same class in %.4f of its voxels", number, len(windows),
                    agreement[-1])  # fmt: skip
    judged = f32_tumour >= GUARD["min_tumour_voxels"]
    return Check(
        cpu=cpu,
        windows=len(windows),
        agreement_min=min(agreement, default=0.0),
        tumour_voxels=f32_tumour,
        tumour_dice=2 * both / (f32_tumour + int8_tumour) if judged else None,
        volume_change=(int8_tumour - f32_tumour) / f32_tumour if judged else None,
        seconds=time.perf_counter() - start,
    ).judge()


def _quantise(model_file: Path, calibration: Calibration) -> tuple[Any, int]:
    """NNCF's post-training quantisation of the export: activations' ranges measured on the calibration's windows,
    SmoothQuant and bias correction for the attention's products (``ModelType.TRANSFORMER``), every layer's weights in
    7 bits (:data:`OVERFLOW_FIX`). Returns the model and the number of windows it was calibrated on."""
    try:
        import nncf
        from nncf.quantization.advanced_parameters import AdvancedQuantizationParameters, OverflowFix
    except ImportError as err:  # an optional extra (requirements-int8.txt), not in metadata.json's requirements
        raise QuantisationError(f"cpu_precision=int8 needs NNCF: {INT8_EXTRA}.") from err
    import openvino

    logger.info("int8: quantising %s on %s (NNCF %s; once per weights and calibration)", model_file.name,
                calibration.describe(), nncf.__version__)  # fmt: skip
    start = time.perf_counter()
    windows = calibration.windows()
    logger.info("int8: %d calibration windows made in %.1f s", len(windows), time.perf_counter() - start)
    start = time.perf_counter()
    advanced = AdvancedQuantizationParameters(overflow_fix=OverflowFix(OVERFLOW_FIX))
    try:
        model = nncf.quantize(openvino.Core().read_model(str(model_file)), nncf.Dataset(windows),
                              model_type=nncf.ModelType.TRANSFORMER, subset_size=len(windows),
                              advanced_parameters=advanced)  # fmt: skip
    except Exception as err:  # NNCF raises its own and OpenVINO's exception types
        raise QuantisationError(f"{model_file}: int8 quantisation failed ({type(err).__name__}: {str(err)[:300]}); "
                                "use --cpu_precision f32.") from err  # fmt: skip
    logger.info("int8: quantised in %.1f s on %d windows", time.perf_counter() - start, len(windows))
    return model, len(windows)


def _save(model: Any, folder: Path, record: dict) -> str:
    """The IR into ``folder`` (staged, then moved in), then its record, written last: a crash leaves no record, so
    the next run quantises again."""
    import nncf
    import openvino

    xml = folder / INT8_MODEL
    staging = folder / ".quantised"
    staging.mkdir(exist_ok=True)
    openvino.save_model(model, str(staging / INT8_MODEL))
    os.replace(staging / xml.with_suffix(".bin").name, xml.with_suffix(".bin"))
    os.replace(staging / INT8_MODEL, xml)
    staging.rmdir()
    write_json(folder / INT8_RECORD, {**record, "bin_sha256": file_sha256(xml.with_suffix(".bin")),
                                      "nncf": nncf.__version__})  # fmt: skip
    return str(xml)


def _read_check(kept: Any) -> Check | None:
    """A check as ``int8.json`` keeps it, or None where it is not one (another version's record: checked again)."""
    try:
        return Check(**kept) if isinstance(kept, dict) else None
    except TypeError:
        return None


def _log_decision(check: Check, calibration: Calibration, when: str) -> None:
    if check.accepted:
        logger.info("int8 proved against f32 (%s): %s", when, check.describe())
    else:
        logger.warning("int8 refused (%s): it fails its guard against f32 on %s: %s. The run goes on in f32; "
                       "int8 is not tried again for these weights and this calibration on this CPU kind (delete "
                       "int8.json to try again).", when, calibration.describe(), check.describe())  # fmt: skip


def _export_sha256(model_file: Path) -> str:
    """The export's SHA-256 as its sidecar recorded it (else hashed now: an ONNX file made elsewhere)."""
    return read_json(model_file.with_name(model_file.name + ".json")).get("onnx_sha256") or file_sha256(model_file)

"""The sliding-window inferer of validation, evaluation and inference: MONAI's, run only where a lung tumour can be,
and surviving a CT that does not fit in memory.

:class:`FallbackSlidingWindowInferer` with ``region="thorax"`` finds the thorax in its input
(:func:`scripts.inference.region.find_thorax`: the lungs, mirrored about the midline, grown by a margin) and runs the
windows only in that box; everything outside is background (log-probability 0 for the background, :data:`OUTSIDE` for
every structure, so a softmax gives it probability 1). ``region="body"`` runs them over the whole input (preprocessing's
body crop). What it did for the last input -- the box in voxels and world mm, the windows run and the windows the
whole input would have needed, the seconds spent finding the region and predicting -- is in :attr:`last`. On an
out-of-memory error the case is run again once with the windows on the accelerator (``sw_device``) and the output
stitched in CPU memory.
:class:`RuntimeSlidingWindowInferer` is inference.yaml's ``inferer`` where the bundle's Python is importable: the same
sliding window over the PyTorch network it is handed (MONAI Label hands it its own ``network_def`` with
``models/model.pt``), run on a CPU by the bundle's CPU runtime, through the export cache ``monai.bundle run inference``
uses (:class:`scripts.inference.backends.WeightsRuntime`).
:class:`SameDeviced` ends the post-processing of validation and evaluation: the prediction and the label meet on one
device before any metric, wherever the fallback left the prediction.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from monai.data.utils import dense_patch_slices
from monai.inferers import SlidingWindowInferer
from monai.inferers.utils import _get_scan_interval
from monai.transforms import MapTransform
from monai.utils import convert_to_dst_type, ensure_tuple_rep, fall_back_tuple
from scripts.data.dicom.common import LPS_TO_RAS
from scripts.inference.backends import CPU_BACKENDS, WeightsRuntime, device_of, resolve, resolve_precision
from scripts.inference.region import MARGIN_MM, Region, find_thorax

if TYPE_CHECKING:
    from scripts.inference.calibration import Calibration

logger = logging.getLogger(__name__)

#: torch raises this on CUDA and ROCm alike; older torch only has the CUDA name
OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
#: the structures' logit (log-probability) outside the region; the background's is 0 (fp16-safe)
OUTSIDE = -30.0
REGIONS = ("thorax", "body")


class FallbackSlidingWindowInferer(SlidingWindowInferer):
    """MONAI's sliding-window inference, only in the ``region`` of each input (see the module docstring), retried
    once on out-of-memory with the output stitched in CPU memory.

    ``spacing`` (mm) and ``hu_window`` are the preprocessing's: the input's voxel size and how HU were scaled to [0, 1]
    (the region finder reads HU); ``margin_mm`` grows the lungs' box (x, y, z)."""

    def __init__(
        self,
        *args: Any,
        region: str = "body",
        spacing: Sequence[float] = (1.0, 1.0, 3.0),
        hu_window: Sequence[float] = (-1000.0, 500.0),
        margin_mm: Sequence[float] = MARGIN_MM,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if region not in REGIONS:
            raise ValueError(f"roi_region={region!r}: choose one of {list(REGIONS)}.")
        self.region, self.spacing, self.hu_window = region, [float(s) for s in spacing], [float(h) for h in hu_window]
        self.margin_mm = [float(m) for m in margin_mm]
        self.last: dict[str, Any] = {}

    def __call__(self, inputs: torch.Tensor, network, *args: Any, **kwargs: Any):
        clock = time.perf_counter()
        shape = tuple(int(n) for n in inputs.shape[2:])
        if self.region == "thorax":
            box = find_thorax(inputs[0, 0].detach(), self.spacing, self.hu_window, self.roi_size, self.margin_mm)
        else:
            box = Region((0, 0, 0), shape, "body")
        found_s = time.perf_counter() - clock
        windows: list[int] = []

        def counted(window: torch.Tensor, *a: Any, **k: Any):
            windows.append(int(window.shape[0]))
            return network(window, *a, **k)

        clock = time.perf_counter()
        whole = box.start == (0, 0, 0) and box.stop == shape
        crop = inputs if whole else inputs[(slice(None), slice(None), *box.slices())]
        output = self._run(crop, counted, *args, **kwargs)
        if not whole:
            output = self._place(output, box, inputs)
        self.last = self._record(box, inputs, shape, sum(windows), found_s, time.perf_counter() - clock)
        return output

    def _run(self, inputs: torch.Tensor, network, *args: Any, **kwargs: Any):
        """The sliding window over ``inputs``; on out-of-memory, once more with the output stitched on the CPU."""
        try:
            return super().__call__(inputs, network, *args, **kwargs)
        except (OUT_OF_MEMORY, RuntimeError) as err:
            if not isinstance(err, OUT_OF_MEMORY) and "out of memory" not in str(err).lower():
                raise
            logger.warning(
                "out of memory in sliding-window inference of an input of shape %s on %s (%s); retrying with the "
                "windows on %s and the output stitched on the CPU",
                tuple(inputs.shape), inputs.device, str(err).splitlines()[0], inputs.device,
            )  # fmt: skip
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            saved = self.sw_device
            self.sw_device = inputs.device
            try:
                output = super().__call__(inputs, network, *args, device=torch.device("cpu"), **kwargs)
            finally:
                self.sw_device = saved
            try:
                return output.to(inputs.device)
            except (OUT_OF_MEMORY, RuntimeError):
                return output

    def windows_for(self, shape: Sequence[int]) -> int:
        """How many windows the sliding window runs over an input of spatial ``shape`` (MONAI's placement)."""
        roi = fall_back_tuple(self.roi_size, shape)
        size = tuple(max(int(n), r) for n, r in zip(shape, roi, strict=True))
        interval = _get_scan_interval(size, roi, len(size), ensure_tuple_rep(self.overlap, len(size)))
        return len(dense_patch_slices(size, roi, interval))

    @staticmethod
    def _place(output: torch.Tensor, box: Region, inputs: torch.Tensor) -> torch.Tensor:
        """``output`` (the box's) in an output the size of ``inputs``: background everywhere else."""
        full = torch.full((*output.shape[:2], *inputs.shape[2:]), OUTSIDE, dtype=output.dtype, device=output.device)
        full[:, 0] = 0.0
        full[(slice(None), slice(None), *box.slices())] = output
        return convert_to_dst_type(full, inputs, device=output.device, dtype=output.dtype)[0]

    def _record(self, box: Region, inputs: torch.Tensor, shape: tuple, windows: int, found_s: float, run_s: float):
        """What :attr:`last` says of an input: the region (voxels, world LPS mm), windows, seconds."""
        affine = getattr(inputs, "affine", None)
        record = {"method": box.method, "start_voxel": list(box.start), "stop_voxel": list(box.stop),
                  "lung_ml": box.lung_ml, "windows": windows, "windows_whole_input": self.windows_for(shape),
                  "seconds": {"region": round(found_s, 3), "predict": round(run_s, 3)}}  # fmt: skip
        if affine is not None:
            ras = np.asarray(affine.detach().cpu() if isinstance(affine, torch.Tensor) else affine, float)
            lps = box.corners_world(LPS_TO_RAS @ ras.reshape(-1, 4, 4)[0])
            record["box_lps_mm"] = [[round(float(v), 1) for v in corner] for corner in lps]
        return record


class RuntimeSlidingWindowInferer(FallbackSlidingWindowInferer):
    """:class:`FallbackSlidingWindowInferer` over the network it is handed, which on a CPU runs in the bundle's CPU
    runtime.

    ``backend`` and ``precision`` are the settings ``inference_backend`` and ``cpu_precision``, resolved as the
    bundle's inference resolves them (:func:`scripts.inference.backends.resolve`,
    :func:`scripts.inference.backends.resolve_precision`) on the device of the network of each call: on a CPU with a CPU
    runtime in force, the network's weights are run by that runtime (:class:`scripts.inference.backends.WeightsRuntime`:
    exported and compiled for new weights, cached beside ``weights`` or in ``cache_dir``, the same compiled model while
    the weights stay); elsewhere (a GPU, ``inference_backend: torch``, a TorchScript module such as MONAI Deploy's
    ``model.ts``) the network itself."""

    def __init__(
        self,
        *args: Any,
        backend: str = "auto",
        precision: str = "auto",
        weights: str = "models/model.pt",
        cache_dir: str | None = None,
        threads: int | None = None,
        calibration: str | None = None,
        calibration_windows: int = 16,
        config_file: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.backend, self.precision, self.weights = backend, precision, weights
        self.cache_dir, self.threads = cache_dir, threads
        self.calibration, self.calibration_windows, self.config_file = calibration, calibration_windows, config_file
        self.runtime: WeightsRuntime | None = None

    def __call__(self, inputs: torch.Tensor, network, *args: Any, **kwargs: Any):
        return super().__call__(inputs, self.network_for(network), *args, **kwargs)

    def network_for(self, network):
        """What runs the windows: the CPU runtime's network for ``network``'s weights, or ``network`` itself."""
        if isinstance(network, torch.jit.ScriptModule) or not isinstance(network, torch.nn.Module):
            return network
        backend = resolve(self.backend, device_of(network))
        if backend not in CPU_BACKENDS:
            return network
        if self.runtime is None:
            from scripts.inference.calibration import source_for

            precision = resolve_precision(self.precision, backend, source_for(self.calibration, self.weights))
            calibration = self._calibration() if precision == "int8" else None
            self.runtime = WeightsRuntime(backend, self.weights, self.roi_size, self.cache_dir, self.threads, precision,
                                          calibration)  # fmt: skip
        return self.runtime(network)

    def _calibration(self) -> Calibration:
        """int8's calibration windows: from ``calibration`` (as ``int8_calibration``), through the CT preprocessing of
        ``config_file`` (the config this inferer is built from) and this sliding window (the recorder that stands in
        for the network is no module, so it runs as it is)."""
        from scripts.inference.calibration import Calibration, source_for

        if not self.config_file:
            raise ValueError("cpu_precision int8 in the inferer: give config_file, the config holding ct_transforms.")
        return Calibration(source_for(self.calibration, self.weights), self.calibration_windows, self.config_file, self)


class SameDeviced(MapTransform):
    """Put the tensors under ``keys`` on one device before a metric compares them: left where they are when they
    share one, else all moved to the CPU. The prediction of a case that ran out of memory is stitched on the CPU and
    may stay there (when the accelerator has no room for it either), while the label it is scored against came on the
    accelerator (validation) or from disk (evaluation): a metric given both would stop the run."""

    def __call__(self, data: Mapping[Hashable, Any]) -> dict:
        d = dict(data)
        keys = [k for k in self.key_iterator(d) if isinstance(d[k], torch.Tensor)]
        if len({d[k].device for k in keys}) > 1:
            for key in keys:
                d[key] = d[key].cpu()
        return d

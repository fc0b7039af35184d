"""The network that evaluation and inference run: PyTorch itself, or the same weights run by OpenVINO or ONNX Runtime
on a CPU.

Most hospitals that would run this model have no GPU, and on a CPU the CPU runtimes run SwinUNETR several times faster
than PyTorch's eager mode -- OpenVINO fastest, in bf16 faster still where the CPU computes bf16 natively
(docs/performance.md, ``python -m benchmarks.bench_inference``). The choice is one id, ``inference_backend``, and the
CPU's precision a second, ``cpu_precision``:

* :func:`resolve` -- ``torch`` | ``openvino`` | ``onnxruntime`` | ``auto`` (on a CPU the first installed of
  :data:`AUTO_ORDER`, else PyTorch; PyTorch on a GPU) to the backend in force, refusing the CPU runtimes on a GPU.
* :func:`resolve_precision` -- ``auto`` | ``bf16`` | ``f32``: ``auto`` is bf16 in OpenVINO where the CPU computes
  bf16 natively (AVX-512 BF16 or AMX, as OpenVINO reports it), f32 elsewhere; ONNX Runtime and PyTorch on a CPU run
  f32.
* :func:`openvino_network` -- the ONNX export below (one export path, one cache), compiled by OpenVINO; its compiled
  model is kept beside the ONNX file, one folder per precision (``model.pt.onnx.openvino-bf16/``; OpenVINO 2026.4's
  cache key leaves the precision out, and an f32 blob loaded for bf16 crashes the process), removed whenever the ONNX
  file is exported anew, so the second run loads it in about a second instead of compiling again.
* :func:`onnx_network` -- a network with its weights loaded, exported to ONNX once and cached beside its weights file
  (``model.pt`` -> ``model.pt.onnx`` and ``model.pt.onnx.json``). The cache is keyed by the SHA-256 of the weights
  the network holds (:func:`weights_sha256`: its tensors, wherever they were loaded from) and of what the export
  depends on (the network's architecture, the window shape, the opset, PyTorch and this module's export version): a
  cache written for other weights or settings is exported again; one whose bytes are not those written (a cut copy, a
  disk error) is refused with a message saying which file to delete.
* :class:`WeightsRuntime` -- the runtime's network for whatever weights a PyTorch network holds when it is asked:
  MONAI Label hands the bundle's ``inferer`` its own ``network_def`` with ``models/model.pt`` loaded, reloaded when
  its training writes new weights; the same weights get the same compiled model, new ones a new export.
* :class:`OnnxNetwork` -- the ONNX Runtime session as a ``torch.nn.Module``, so the sliding window, the ensemble and
  mirror TTA (:mod:`scripts.inference.ensemble`) call it exactly as they call the PyTorch network.
* ONNX Runtime's thread count is :func:`scripts.common.cpus.usable_cpus`: the CPUs this process may use (its
  affinity mask, and a cgroup CPU quota as containers set it).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from scripts.common.cpus import NATIVE_BF16, cpu_isa, usable_cpus
from scripts.common.files import file_sha256, read_json, replace_atomically, write_json
from scripts.inference import int8

if TYPE_CHECKING:
    from scripts.inference.calibration import Calibration

logger = logging.getLogger(__name__)

BACKENDS = ("torch", "openvino", "onnxruntime", "auto")
CPU_BACKENDS = ("openvino", "onnxruntime")
#: what ``auto`` picks on a CPU, the first installed: OpenVINO (3x ONNX Runtime's speed in bf16, docs/performance.md),
#: else ONNX Runtime
AUTO_ORDER = ("openvino", "onnxruntime")
PRECISIONS = ("auto", "bf16", "f32", "int8")
#: OpenVINO: at most this many windows run side by side (sw_batch_size, the windows that arrive together, is 4)
MAX_STREAMS = 4
#: the ONNX opset of the export: the lowest torch's exporter writes (ONNX Runtime 1.32 runs up to 23)
OPSET = 18
#: bump when the way the network is exported changes: every cache is then exported again
EXPORT_VERSION = 2
CACHE_SUFFIX = ".onnx"


class BackendError(ValueError):
    """A backend that cannot run here, or an ONNX cache that cannot be used; the message says what to do."""


def resolve(backend: str, device: torch.device | str) -> str:
    """The backend in force: ``auto`` is the first of :data:`AUTO_ORDER` installed on a CPU (else ``torch``) and
    ``torch`` on a GPU; a CPU runtime on a GPU is refused (the packages in requirements.txt run on the
    CPU)."""
    name = str(backend).strip().lower()
    if name not in BACKENDS:
        raise BackendError(f"inference_backend={backend!r}: choose one of {', '.join(BACKENDS)}.")
    on_cpu = torch.device(device).type == "cpu"
    if name == "auto":
        name = next((b for b in AUTO_ORDER if _available(b)), "torch") if on_cpu else "torch"
    if name in CPU_BACKENDS:
        if not on_cpu:
            raise BackendError(
                f"inference_backend={name} runs on the CPU, but device is {device}: use --inference_backend "
                "torch on a GPU (or auto), or --device cpu."
            )
        if not _available(name):
            raise BackendError(f"inference_backend={name} needs `pip install {name} onnx onnxscript` "
                               "(requirements.txt).")  # fmt: skip
    return name


def resolve_precision(precision: str, backend: str, calibration: str | Path | None = None) -> str:
    """The precision the network runs in on a CPU. For OpenVINO ``auto`` is ``bf16`` where the CPU computes bf16
    natively (:func:`native_bf16`); elsewhere ``int8`` when ``calibration`` (``int8_calibration``: a training run's
    datalist or a folder of CTs, else the calibration set beside the weights) is given and NNCF is installed -- int8
    is 1.8x f32's speed on such CPUs (docs/performance.md) and proves itself against f32 when it is made
    (:mod:`scripts.inference.int8`) -- else ``f32``; the log says which and why. ``bf16`` is refused on a CPU without
    it, and by ONNX Runtime and PyTorch, which run ``f32`` (the message says what to set); ``int8`` is OpenVINO's only,
    with NNCF installed."""
    name = str(precision).strip().lower()
    if name not in PRECISIONS:
        raise BackendError(f"cpu_precision={precision!r}: choose one of {', '.join(PRECISIONS)}.")
    nncf = importlib.util.find_spec("nncf") is not None
    if name == "int8":
        if backend != "openvino":
            raise BackendError(f"cpu_precision=int8 runs in OpenVINO, not {backend}: --inference_backend openvino (or "
                               "auto on a CPU), or --cpu_precision f32.")  # fmt: skip
        if not nncf:
            raise BackendError(f"cpu_precision=int8 needs NNCF, OpenVINO's quantiser, which is an optional extra: "
                               f"{int8.INT8_EXTRA}; or use --cpu_precision auto.")  # fmt: skip
        return name
    if backend == "openvino":
        if name == "bf16" and not native_bf16():
            raise BackendError("cpu_precision=bf16: this CPU does not compute bf16 natively (no AVX-512 BF16 or AMX; "
                               "OpenVINO would emulate it): use --cpu_precision f32 or auto.")  # fmt: skip
        if name != "auto":
            return name
        cpu = f"no native bf16 on this CPU ({cpu_isa() or 'unknown'})"
        if native_bf16():
            chosen, why = "bf16", "the CPU computes bf16 natively"
        elif calibration not in (None, "", "null") and not Path(calibration).exists():
            chosen, why = "f32", f"{cpu}; int8_calibration {calibration} does not exist: give CTs to calibrate on"
        elif calibration not in (None, "", "null") and nncf:
            chosen, why = "int8", (f"{cpu}; int8 calibrated on {calibration} and checked against f32 once, f32 "
                                   "where it fails the check")  # fmt: skip
        else:
            missing = ("--int8_calibration <a training run's datalist.json or a folder of CTs>, or keep the "
                       "<weights>.calibration.npz training writes beside the weights")  # fmt: skip
            missing += "" if nncf else f"; and {int8.INT8_EXTRA}"
            chosen, why = "f32", f"{cpu}; int8 runs faster here: give {missing}"
        logger.info("cpu_precision auto: %s in OpenVINO (%s)", chosen, why)
        return chosen
    if name == "bf16":
        raise BackendError(f"cpu_precision=bf16 runs in OpenVINO, not {backend}: --inference_backend openvino (or "
                           "auto on a CPU), or --cpu_precision f32.")  # fmt: skip
    return "f32"


@functools.cache
def native_bf16() -> bool:
    """Whether OpenVINO's CPU plugin computes bf16 natively on this CPU (AVX-512 BF16, AMX): it lists ``BF16`` among
    its optimisation capabilities only then. oneDNN capped below AVX-512 BF16 (``ONEDNN_MAX_CPU_ISA``,
    :func:`scripts.common.cpus.cpu_isa`) makes it a CPU without, as its kernels then are."""
    import openvino

    isa = cpu_isa()
    if isa is not None and isa not in NATIVE_BF16:
        return False
    return "BF16" in openvino.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")


def precision_in_force(network: torch.nn.Module, precision: str) -> str:
    """The precision the CPU runtime runs ``network`` (made, see :func:`prepare`) in, for the reports: ``precision``,
    or f32 where int8 failed its check against f32 (``f32 (int8 refused by its check)``; an ensemble whose members
    differ names each)."""
    found = [m.precision for m in network.modules() if isinstance(m, OpenVinoNetwork)]
    if not found or set(found) == {precision}:
        return precision
    if len(set(found)) == 1:
        return f"{found[0]} ({precision} refused by its check)"
    return " + ".join(found) + f" ({precision} refused by its check for some models)"


def onnx_network(
    network: torch.nn.Module,
    weights: str | Path,
    window: Sequence[int],
    cache_dir: str | Path | None = None,
    threads: int | None = None,
) -> OnnxNetwork:
    """``network`` (its weights from ``weights`` already loaded) as an ONNX Runtime session, exported once.

    ``window``: the spatial shape of the sliding window, the only input shape it will see (exported for one window;
    :class:`OnnxNetwork` runs a batch window by window).
    ``cache_dir``: where the export is kept (None: beside ``weights``). ``threads``: intra-op threads (None: every
    CPU this process may use).
    """

    return OnnxNetwork(onnx_file(network, weights, window, cache_dir), threads)


def openvino_network(
    network: torch.nn.Module,
    weights: str | Path,
    window: Sequence[int],
    cache_dir: str | Path | None = None,
    threads: int | None = None,
    precision: str = "f32",
    calibration: Calibration | None = None,
) -> OpenVinoNetwork:
    """``network`` (its weights from ``weights`` already loaded) compiled by OpenVINO for the CPU in ``precision``
    (``bf16``, ``f32``, or ``int8`` quantised on ``calibration``'s windows), from the ONNX export of
    :func:`onnx_file`; arguments as :func:`onnx_network`'s."""
    return OpenVinoNetwork(onnx_file(network, weights, window, cache_dir), threads, precision,
                           calibration=calibration)  # fmt: skip


def onnx_file(
    network: torch.nn.Module,
    weights: str | Path,
    window: Sequence[int],
    cache_dir: str | Path | None = None,
    digest: str | None = None,
) -> Path:
    """The ONNX export of ``network`` for ``window``, exported once and kept in ``cache_dir`` (None: beside
    ``weights``, the file its weights came from, which names the export) with its key; what an earlier export left for
    the CPU runtimes (OpenVINO's compiled models) is removed when it is exported anew. ``digest``: the network's
    :func:`weights_sha256`, where the caller has it already."""
    weights = Path(weights)
    folder = Path(cache_dir) if cache_dir is not None else weights.parent
    model_file = folder / f"{weights.name}{CACHE_SUFFIX}"
    key = cache_key(network, digest or weights_sha256(network), window)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        lock = open(str(model_file) + ".lock", "a")  # noqa: SIM115 -- held until the cache is checked
    except OSError as err:
        raise BackendError(
            f"{folder}: cannot keep the ONNX export of {weights.name} there ({err.strerror or err}); pass "
            "--onnx_cache_dir <a writable folder>, or --inference_backend torch."
        ) from err
    with lock:  # one process exports, the others (DDP ranks, parallel tests) wait and read its file
        _exclusive(lock)
        if _cached_key(model_file) != key:
            for compiled in folder.glob(f"{model_file.name}.openvino-*"):  # compiled from the file replaced below
                shutil.rmtree(compiled, ignore_errors=True)
            export(network, model_file, window, key, weights)  # hashes what it wrote: nothing to check again
        else:
            check_cache(model_file)
    return model_file


def weights_sha256(network: torch.nn.Module) -> str:
    """The SHA-256 of the weights ``network`` holds: each entry of its ``state_dict`` in order, its name, dtype, shape
    and bytes. The key of the export (:func:`onnx_file`): the bundle's run, which loads a weights file into the
    network, and MONAI Label, which loads ``models/model.pt`` into its own copy of ``network_def``, find the same export
    for the same weights, and weights that differ in one value never get another's. f48's 63 M parameters take 0.13 s
    on one core of this project's machine (AMD EPYC; reading and hashing the file took as long)."""
    digest = hashlib.sha256()
    for name, tensor in network.state_dict().items():
        tensor = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name} {tensor.dtype} {tuple(tensor.shape)}\n".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def cache_key(network: torch.nn.Module, weights_digest: str, window: Sequence[int]) -> str:
    """What an export depends on: the weights (:func:`weights_sha256`), the architecture (every layer and its shape,
    as ``repr`` prints them), the window, the opset, PyTorch and this module's export version."""
    parts = [weights_digest, repr(network), str([int(w) for w in window]), str(OPSET), torch.__version__,
             str(EXPORT_VERSION)]  # fmt: skip
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def export(network: torch.nn.Module, model_file: Path, window: Sequence[int], key: str, weights: Path) -> Path:
    """``network`` to ONNX at ``model_file`` (one window of shape ``window``), then its sidecar
    ``<model_file>.json`` with the cache key and the file's SHA-256; both written whole or not at all."""

    shape = (1, 1, *(int(w) for w in window))
    logger.info("exporting %s to ONNX for the CPU runtime (once per weights file and settings) -> %s", weights,
                model_file)  # fmt: skip
    start = time.perf_counter()
    was_training = network.training
    network.eval()
    example = torch.zeros(shape, dtype=torch.float32, device=device_of(network))

    def write(tmp: Path) -> None:
        with torch.no_grad():  # one window: every shape in the graph is fixed
            program = torch.onnx.export(network, (example,), dynamo=True, opset_version=OPSET, optimize=False,
                                        input_names=["image"], output_names=["logits"], verbose=False)  # fmt: skip
        _simplify(program.model)
        program.save(str(tmp), external_data=False)

    _sidecar(model_file).unlink(missing_ok=True)  # a crash below leaves no sidecar, so the next run exports again
    try:
        with _quiet_exporter():
            replace_atomically(model_file, write)
    except Exception as err:  # the exporter's messages can run to pages: keep their first line
        reason = (str(err).strip().splitlines() or [""])[0][:300]
        raise BackendError(f"{weights}: exporting the network to ONNX failed ({type(err).__name__}: {reason}); "
                           "run with --inference_backend torch.") from err  # fmt: skip
    finally:
        network.train(was_training)
    record = {"key": key, "onnx_sha256": file_sha256(model_file), "weights": str(weights), "window": list(shape[2:]),
              "opset": OPSET, "torch": torch.__version__}  # fmt: skip
    write_json(_sidecar(model_file), record)
    logger.info("exported in %.1f s (%.0f MB)", time.perf_counter() - start, model_file.stat().st_size / 1e6)
    return model_file


def device_of(network: torch.nn.Module) -> torch.device:
    """Where ``network`` runs: its first parameter's or buffer's device; the CPU for a module with neither (a
    threshold baseline, a stand-in), which any backend must run as well."""
    tensor = next(network.parameters(), None)
    tensor = next(network.buffers(), None) if tensor is None else tensor
    return torch.device("cpu") if tensor is None else tensor.device


def _simplify(model: Any) -> None:
    """What the exported graph needs before ONNX Runtime reads it, and no more: shape computations folded to constants,
    and the all-zero bias that torch's exporter gives a convolution without one removed (ONNX Runtime refuses that
    bias's shape). The exporter's own optimiser does this too, but with every rewrite rule it has: ~2x the export time
    for a graph that ONNX Runtime optimises again when it loads it (no measurable difference per window)."""
    import onnxscript
    from onnxscript.rewriter.rules.common import (
        remove_optional_bias_from_conv_rule,
        remove_optional_bias_from_conv_transpose_rule,
    )

    onnxscript.optimizer.fold_constants(model)
    onnxscript.rewriter.rewrite(
        model, [remove_optional_bias_from_conv_rule, remove_optional_bias_from_conv_transpose_rule]
    )
    onnxscript.optimizer.remove_unused_nodes(model)


def check_cache(model_file: Path) -> None:
    """Refuse an ONNX file whose bytes are not the ones its sidecar recorded at export, naming what to delete."""

    sidecar = _sidecar(model_file)
    try:
        expected = json.loads(sidecar.read_text())["onnx_sha256"]
    except (OSError, ValueError, KeyError) as err:
        raise BackendError(f"{sidecar}: unreadable ({err}); delete it and {model_file.name}, and run again to "
                           "export the network anew.") from None  # fmt: skip
    if not model_file.is_file() or file_sha256(model_file) != expected:
        raise BackendError(
            f"{model_file}: the cached ONNX model is corrupt (missing, or its SHA-256 is not the one written at "
            f"export in {sidecar.name}); delete {model_file.name} and {sidecar.name} and run again to export it anew."
        )


class OnnxNetwork(torch.nn.Module):
    """An ONNX Runtime session called like the PyTorch network: float32 ``[B, 1, *window]`` in, logits out, on the
    CPU, one window at a time (each window's convolutions already keep every core busy). It has no parameters;
    ``eval()``/``train()`` change nothing (the export is in evaluation mode)."""

    def __init__(self, model_file: str | Path, threads: int | None = None) -> None:
        super().__init__()
        import onnxruntime

        self.model_file = Path(model_file)
        self.threads = int(threads) if threads else usable_cpus()
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = self.threads
        options.inter_op_num_threads = 1
        options.execution_mode = onnxruntime.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
        try:
            self.session = onnxruntime.InferenceSession(str(self.model_file), options,
                                                        providers=["CPUExecutionProvider"])  # fmt: skip
        except Exception as err:  # onnxruntime raises its own exception types
            raise BackendError(
                f"{self.model_file}: ONNX Runtime cannot load it ({str(err)[:300]}); delete it and "
                f"{_sidecar(self.model_file).name}, and run again to export it anew."
            ) from err
        self.input_name = self.session.get_inputs()[0].name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        array = torch.as_tensor(x).detach().to("cpu", torch.float32).numpy()
        logits = [self.session.run(None, {self.input_name: np.ascontiguousarray(array[i : i + 1])})[0]
                  for i in range(array.shape[0])]  # fmt: skip
        return torch.from_numpy(np.concatenate(logits) if len(logits) > 1 else logits[0])

    def extra_repr(self) -> str:
        return f"model_file={self.model_file}, threads={self.threads}"


class OpenVinoNetwork(torch.nn.Module):
    """The ONNX export compiled by OpenVINO for the CPU, called like the PyTorch network: float32 ``[B, 1, *window]``
    in, float32 logits out, in ``precision`` (``bf16``: OpenVINO's bf16 inference precision, weights and activations
    in bf16 with f32 accumulation; ``f32``; ``int8``: the model quantised on ``calibration``'s windows and checked
    against f32 by :func:`scripts.inference.int8.quantised`, or f32 where it failed that check). The compiled model is
    cached in ``<model_file>.openvino-<precision>/``; the log says whether it was compiled (and in how many seconds) or
    loaded.

    ``streams``: how many windows of a batch run side by side, the threads shared among them (OpenVINO's streams;
    None: as many as threads, at most :data:`MAX_STREAMS`). On this project's 2-core machine the chest phantom's 30
    windows took 51.1 s and 57.2 s in the network with two streams of one thread, 60.3 s with one stream of two
    threads in between (``python -m benchmarks.bench_inference --cases chest --backends openvino-bf16 --regions
    thorax``, f48): a window's small layers and reorders keep two threads waiting for each other."""

    def __init__(
        self,
        model_file: str | Path,
        threads: int | None = None,
        precision: str = "f32",
        streams: int | None = None,
        calibration: Calibration | None = None,
    ) -> None:
        super().__init__()
        self.model_file = Path(model_file)
        self.threads = int(threads) if threads else usable_cpus()
        self.precision = precision
        self.streams = max(1, min(int(streams) if streams else MAX_STREAMS, self.threads))
        if precision == "int8" and calibration is None:
            raise BackendError(f"{self.model_file}: cpu_precision=int8 needs calibration windows (int8_calibration).")
        #: why the network runs in another precision than asked (int8 refused by its check against f32), or None
        self.fallback: str | None = None
        start = time.perf_counter()
        # int8: quantised and checked once (kept beside the compiled models), else f32 (None: nothing compiled yet)
        compiled = self._int8(calibration) if precision == "int8" else None
        if compiled is None:
            with self._cache_lock(self.precision) as folder:
                compiled = self._compile(str(self.model_file), self.precision, folder)
        self.compiled = compiled
        self.setup_s = time.perf_counter() - start  # quantised, checked, compiled or loaded: each step logs its own
        # one request per stream, started and waited for from this thread: no Python callback runs on OpenVINO's
        # threads. (An AsyncInferQueue's callback took the GIL on a stream's thread after wait_all() had returned;
        # destroying the compiled model, which holds the GIL and joins those threads, then waited forever: reproduced
        # under load in tests/test_backends.py, it hung a clean clone's suite.)
        self.requests = [self.compiled.create_infer_request() for _ in range(self.streams)]
        # OpenVINO's objects are destroyed only by release(), never when this module is dropped (_KEPT says why), and
        # never in a forked child (_keep_inherited_openvino)
        self._kept = (self.requests, self.compiled, _FORKS[0])
        _KEPT[id(self._kept)] = self._kept

    @contextlib.contextmanager
    def _cache_lock(self, precision: str) -> Iterator[Path | None]:
        """The folder that keeps ``precision``'s compiled model (``<model_file>.openvino-<precision>/``), locked while
        held: one process compiles, the others load its blob. None where it cannot be made (a read-only folder:
        compiled each run, nothing kept)."""
        folder = self.model_file.with_name(f"{self.model_file.name}.openvino-{precision}")
        try:
            folder.mkdir(exist_ok=True)
            lock = open(f"{folder}.lock", "a")  # noqa: SIM115 -- closed below
        except OSError:
            yield None
            return
        with lock:
            _exclusive(lock)
            yield folder

    def _int8(self, calibration: Calibration) -> Any:
        """The int8 model compiled (:func:`scripts.inference.int8.quantised`: quantised and checked against f32 once),
        or None where it failed its check here: the network then runs f32 (:attr:`fallback` says why)."""
        made: dict[str, Any] = {}

        def compile_for_check(model: Any, precision: str) -> Any:  # f32 into f32's own folder, int8 into this one
            if precision == "int8":
                made["int8"] = self._compile(model, "int8", folder)
            else:
                with self._cache_lock("f32") as f32_folder:
                    made["f32"] = self._compile(model, "f32", f32_folder)
            return made[precision]

        with self._cache_lock("int8") as folder:
            try:
                decided = int8.quantised(self.model_file, calibration, folder, compile_for_check)
            except int8.QuantisationError as err:
                raise BackendError(str(err)) from err
            if decided.model is not None:
                return made.get("int8") or self._compile(decided.model, "int8", folder)
        self.precision, self.fallback = "f32", f"int8 refused by its check: {decided.check.describe()}"
        return made.get("f32")

    def _compile(self, model: Any, precision: str, folder: Path | None) -> Any:
        """``model`` (a file, or a model in memory) compiled for this CPU in ``precision`` with this network's threads
        and streams, its blob kept in ``folder`` (None: not kept). The log says whether it was compiled or loaded,
        and in how many seconds."""
        import openvino

        # int8: the quantised layers run in int8, what stays unquantised in f32 (the CPUs int8 is for have no bf16)
        config = {"INFERENCE_PRECISION_HINT": "f32" if precision == "int8" else precision,
                  "INFERENCE_NUM_THREADS": self.threads}  # fmt: skip
        if self.streams > 1:
            config.update(PERFORMANCE_HINT="THROUGHPUT", NUM_STREAMS=self.streams)
        else:
            config.update(PERFORMANCE_HINT="LATENCY")
        if folder is not None:
            config["CACHE_DIR"] = str(folder)
        start = time.perf_counter()
        loaded = folder is not None and any(folder.glob("*.blob"))
        try:
            compiled = openvino.Core().compile_model(model, "CPU", config)
        except Exception as err:  # OpenVINO raises its own exception types
            raise BackendError(
                f"{self.model_file}: OpenVINO cannot compile it ({str(err)[:300]}); delete it, "
                f"{_sidecar(self.model_file).name} and {self.model_file.name}.openvino-*/, and run again to export it "
                "anew."
            ) from err
        logger.info("OpenVINO %s on the CPU, %s, %d threads in %d stream(s): %s in %.1f s (%s)", openvino.__version__,
                    precision, self.threads, self.streams, "loaded" if loaded else "compiled",
                    time.perf_counter() - start, folder or "not cached: the folder is read-only")  # fmt: skip
        return compiled

    def release(self) -> bool:
        """Destroy OpenVINO's objects now (a server replacing the weights it serves), unless this process has forked
        since they were made: then they stay for the life of the process (:data:`_KEPT`). True if destroyed."""
        requests, _, forks = self._kept
        if forks != _FORKS[0]:
            logger.info("OpenVINO's compiled model %s kept: this process has forked since it was made", self.model_file)
            return False
        for request in requests:
            request.wait()
        del _KEPT[id(self._kept)]
        self.__dict__.pop("requests", None)
        self.__dict__.pop("compiled", None)
        self._kept = (None, None, forks)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        array = torch.as_tensor(x).detach().to("cpu", torch.float32).numpy()
        logits: list[np.ndarray] = []
        for start in range(0, array.shape[0], len(self.requests)):  # `streams` windows at once (they take as long)
            running = list(zip(self.requests, range(start, min(start + len(self.requests), array.shape[0]))))
            for request, i in running:
                request.start_async({0: np.ascontiguousarray(array[i : i + 1])})
            for request, _ in running:
                request.wait()
                logits.append(np.array(request.get_output_tensor(0).data))  # a copy: the request's buffer is reused
        return torch.from_numpy(np.concatenate(logits) if len(logits) > 1 else logits[0])

    def extra_repr(self) -> str:
        return (f"model_file={self.model_file}, threads={self.threads}, streams={self.streams}, "
                f"precision={self.precision}")  # fmt: skip


#: every network's OpenVINO objects (infer requests, compiled model, this process's fork count when made), kept for the
#: life of the process unless :meth:`OpenVinoNetwork.release` destroys them. OpenVINO 2026.4 corrupts the heap of a
#: process that destroys compiled models after a fork (a DataLoader worker) made while two or more were alive: the
#: next subprocess that process starts dies with SIGSEGV (reproduced in tests/test_backends.py; it killed pytest
#: workers "without a trace"). So a network dropped by a run is not destroyed, and a server that replaces its weights
#: releases the old network, which is destroyed only if the process has not forked since it was made.
_KEPT: dict[int, tuple] = {}
_FORKS = [0]  # fork() calls of this process (os.register_at_fork's "before" hook, in the parent)


def _count_fork() -> None:
    _FORKS[0] += 1


def _keep_inherited_openvino() -> None:
    """In a child forked from this process (a DataLoader worker): the OpenVINO objects it inherited are never destroyed
    there. OpenVINO's destructor waits for its streams' threads, which a forked child does not have: a child that
    destroyed an inherited network (or ended as a Python program ends, clearing :data:`_KEPT`) waited forever. One
    reference more, never given back, keeps them; the child's memory is its own copy."""
    for requests, compiled, _ in list(_KEPT.values()):
        for part in (requests, compiled):
            if part is not None:
                ctypes.pythonapi.Py_IncRef(ctypes.py_object(part))


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_count_fork, after_in_child=_keep_inherited_openvino)


class LazyNetwork(torch.nn.Module):
    """A CPU runtime's network (:func:`openvino_network`, :func:`onnx_network`) made when it is first called, or by
    :func:`prepare`: the export and the compilation take ~40 s for f48, and MONAI's tools build the evaluator only to
    inspect a config (``initialize``, the model zoo's property check), where nothing should be exported. The runs
    themselves call :func:`prepare` before the first case, so an export that fails ends the run there."""

    def __init__(self, make: Callable[[], torch.nn.Module], description: str) -> None:
        super().__init__()
        self._make, self.description = make, description
        self.network: torch.nn.Module | None = None

    def prepare(self) -> torch.nn.Module:
        if self.network is None:
            self.network = self._make()
            self._make = None  # the PyTorch network it was made from (its weights) can go
        return self.network

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.prepare()(x)

    def extra_repr(self) -> str:
        return self.description if self.network is None else ""


class WeightsRuntime:
    """A CPU runtime's network (``backend``: openvino or onnxruntime) for the weights a PyTorch network holds when it
    is called: made from the export cache (:func:`onnx_file`, exported where it holds no export of these weights) the
    first time, then the same compiled model for as long as the weights are the same; new weights drop it and get
    their own. Each call hashes the weights (:func:`weights_sha256`, 0.13 s for f48), so weights changed in place or
    reloaded are never run by an export of other weights.

    ``weights``: the file the weights are kept in (``models/model.pt``), which names the export and, without
    ``cache_dir``, holds it beside itself; ``window``, ``threads``, ``precision``, ``calibration`` as
    :func:`openvino_network`'s."""

    def __init__(
        self,
        backend: str,
        weights: str | Path,
        window: Sequence[int],
        cache_dir: str | Path | None = None,
        threads: int | None = None,
        precision: str = "f32",
        calibration: Calibration | None = None,
    ) -> None:
        if backend not in CPU_BACKENDS:
            raise BackendError(f"{backend!r} is not a CPU runtime: one of {', '.join(CPU_BACKENDS)}.")
        self.backend, self.weights, self.window = backend, Path(weights), [int(w) for w in window]
        self.cache_dir, self.threads, self.precision = cache_dir, threads, precision
        self.calibration = calibration
        self.digest: str | None = None
        self.network: torch.nn.Module | None = None
        self._lock = threading.Lock()  # requests served side by side make one compiled model, not one each

    def __call__(self, network: torch.nn.Module) -> torch.nn.Module:
        start = time.perf_counter()
        digest = weights_sha256(network)
        hashed = time.perf_counter() - start
        with self._lock:
            if digest == self.digest:
                logger.info("%s %s: the weights (sha256 %s, hashed in %.2f s) are those it runs already",
                            self.backend, self.precision, digest[:16], hashed)  # fmt: skip
                return self.network
            if isinstance(self.network, OpenVinoNetwork):  # the old weights' compiled model goes before the new one
                self.network.release()
            self.network = self.digest = None
            model_file = onnx_file(network, self.weights, self.window, self.cache_dir, digest)
            if self.backend == "openvino":
                self.network = OpenVinoNetwork(model_file, self.threads, self.precision, calibration=self.calibration)
            else:
                self.network = OnnxNetwork(model_file, self.threads)
            self.digest = digest
            _return_freed_memory()
            logger.info("%s %s: weights sha256 %s ready in %.1f s (hashed, exported or found, compiled or loaded)",
                        self.backend, self.precision, digest[:16], time.perf_counter() - start)  # fmt: skip
            return self.network


def _return_freed_memory() -> None:
    """Give the system back the heap an export and a compilation freed (glibc keeps it otherwise): a server that
    exports each new set of weights then grew ~4 MB a time instead of ~15-55 MB (SwinUNETR f12, 4 sets of weights).
    Nothing where the C library has no ``malloc_trim``."""
    gc.collect()  # the exporter's graphs hold cycles
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


def prepare(network: torch.nn.Module) -> torch.nn.Module:
    """``network`` with every :class:`LazyNetwork` in it (an ensemble's members) made now; returned for the configs'
    run lists (``$@scripts.inference.backends.prepare(@network)``)."""
    for module in list(network.modules()):
        if isinstance(module, LazyNetwork):
            module.prepare()
    return network


def _exclusive(handle: Any) -> None:
    """Hold an exclusive lock on an open file until it is closed (POSIX; elsewhere processes do not wait)."""
    try:
        import fcntl
    except ImportError:  # Windows: no lock; a second process exports again and replaces the file atomically
        return
    fcntl.flock(handle.fileno(), fcntl.LOCK_EX)


def _cached_key(model_file: Path) -> str | None:
    return read_json(_sidecar(model_file)).get("key")


def _sidecar(model_file: Path) -> Path:
    return model_file.with_name(model_file.name + ".json")


def _available(runtime: str) -> bool:
    """Whether ``runtime`` (openvino, onnxruntime) and the ONNX export's packages are installed."""
    import importlib.util

    return all(importlib.util.find_spec(name) is not None for name in (runtime, "onnx", "onnxscript"))


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """The exporter and the ONNX optimiser it runs log each pass at INFO and WARNING (hundreds of lines, e.g. that
    torchvision's operators are skipped): only their errors reach the bundle's log while it exports."""
    names = ("torch.onnx", "torch.export", "onnx_ir", "onnxscript")
    saved = {name: logging.getLogger(name).level for name in names}
    for name in names:
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)

"""The network that evaluation and inference run: PyTorch itself, or the same weights run by ONNX Runtime on a CPU.

Most hospitals that would run this model have no GPU, and on a CPU ONNX Runtime runs SwinUNETR several times faster
than PyTorch's eager mode (docs/performance.md, ``python -m benchmarks.bench_inference``). The choice is one id,
``inference_backend``:

* :func:`resolve` -- ``torch`` | ``onnxruntime`` | ``auto`` (ONNX Runtime on a CPU, PyTorch on a GPU) to the backend
  in force, refusing ``onnxruntime`` on a GPU (this build of ONNX Runtime runs on the CPU only).
* :func:`onnx_network` -- a network with its weights loaded, exported to ONNX once and cached beside its weights file
  (``model.pt`` -> ``model.pt.onnx`` and ``model.pt.onnx.json``). The cache is keyed by the SHA-256 of the weights
  and of what the export depends on (the network's architecture, the window shape, the opset, PyTorch and this
  module's export version): a cache written for other weights or settings is exported again; one whose bytes are
  not those written (a cut copy, a disk error) is refused with a message saying which file to delete.
* :class:`OnnxNetwork` -- the ONNX Runtime session as a ``torch.nn.Module``, so the sliding window, the ensemble and
  mirror TTA (:mod:`scripts.ensemble`) call it exactly as they call the PyTorch network.
* ONNX Runtime's thread count is :func:`scripts.cpus.usable_cpus`: the CPUs this process may use (its
  affinity mask, and a cgroup CPU quota as containers set it).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scripts.cpus import usable_cpus
from scripts.files import file_sha256, replace_atomically, write_json

logger = logging.getLogger(__name__)

BACKENDS = ("torch", "onnxruntime", "auto")
#: the ONNX opset of the export: the lowest torch's exporter writes (ONNX Runtime 1.32 runs up to 23)
OPSET = 18
#: bump when the way the network is exported changes: every cache is then exported again
EXPORT_VERSION = 2
CACHE_SUFFIX = ".onnx"


class BackendError(ValueError):
    """A backend that cannot run here, or an ONNX cache that cannot be used; the message says what to do."""


def resolve(backend: str, device: torch.device | str) -> str:
    """The backend in force: ``auto`` is ``onnxruntime`` on a CPU (when ONNX Runtime is installed) and ``torch`` on a
    GPU; ``onnxruntime`` on a GPU is refused (the package in requirements.txt runs on the CPU)."""
    name = str(backend).strip().lower()
    if name not in BACKENDS:
        raise BackendError(f"inference_backend={backend!r}: choose one of {', '.join(BACKENDS)}.")
    on_cpu = torch.device(device).type == "cpu"
    if name == "auto":
        name = "onnxruntime" if on_cpu and _onnxruntime_available() else "torch"
    if name == "onnxruntime":
        if not on_cpu:
            raise BackendError(
                f"inference_backend=onnxruntime runs on the CPU, but device is {device}: use --inference_backend "
                "torch on a GPU (or auto), or --device cpu."
            )
        if not _onnxruntime_available():
            raise BackendError("inference_backend=onnxruntime needs `pip install onnxruntime onnx` (requirements.txt).")
    return name


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

    weights = Path(weights)
    folder = Path(cache_dir) if cache_dir is not None else weights.parent
    model_file = folder / f"{weights.name}{CACHE_SUFFIX}"
    key = cache_key(network, file_sha256(weights), window)
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
            export(network, model_file, window, key, weights)  # hashes what it wrote: nothing to check again
        else:
            check_cache(model_file)
    return OnnxNetwork(model_file, threads)


def cache_key(network: torch.nn.Module, weights_sha256: str, window: Sequence[int]) -> str:
    """What an export depends on: the weights, the architecture (every layer and its shape, as ``repr`` prints
    them), the window, the opset, PyTorch and this module's export version."""
    parts = [weights_sha256, repr(network), str([int(w) for w in window]), str(OPSET), torch.__version__,
             str(EXPORT_VERSION)]  # fmt: skip
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def export(network: torch.nn.Module, model_file: Path, window: Sequence[int], key: str, weights: Path) -> Path:
    """``network`` to ONNX at ``model_file`` (one window of shape ``window``), then its sidecar
    ``<model_file>.json`` with the cache key and the file's SHA-256; both written whole or not at all."""

    shape = (1, 1, *(int(w) for w in window))
    logger.info("exporting %s to ONNX for ONNX Runtime (once per weights file and settings) -> %s", weights,
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


def _exclusive(handle: Any) -> None:
    """Hold an exclusive lock on an open file until it is closed (POSIX; elsewhere processes do not wait)."""
    try:
        import fcntl
    except ImportError:  # Windows: no lock; a second process exports again and replaces the file atomically
        return
    fcntl.flock(handle.fileno(), fcntl.LOCK_EX)


def _cached_key(model_file: Path) -> str | None:
    try:
        return json.loads(_sidecar(model_file).read_text()).get("key")
    except (OSError, ValueError, AttributeError):
        return None


def _sidecar(model_file: Path) -> Path:
    return model_file.with_name(model_file.name + ".json")


def _onnxruntime_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("onnxruntime") is not None and importlib.util.find_spec("onnx") is not None


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

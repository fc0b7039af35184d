"""Per-backend performance settings and a device report, applied at the start of a run, before the network exists.

ROCm, CUDA and CPU builds of PyTorch want different knobs, and the ROCm ones are environment variables that MIOpen
and TunableOp read once, at their first use -- so they must be set before the first convolution or GEMM, not in
the shell of whoever happens to launch the run. :func:`configure` sets, for the device's :func:`backend`:

* ``rocm`` (a ``cuda`` device on a HIP build): ``MIOPEN_FIND_MODE``, ``MIOPEN_FIND_ENFORCE``, a persistent MIOpen
  user database and kernel cache under ``<output_dir>/miopen/`` (kernel tuning is paid once per output folder, not
  once per run), optionally TunableOp with its results in ``<output_dir>/tunableop/``, and ``cudnn.benchmark``;
* ``cuda``: ``cudnn.benchmark`` and TF32 for matmuls and convolutions;
* ``cpu``: the number of intra-op threads, when given.

Other device types (``xpu``, ``hpu``, ``mps``, ...) are used as given, with nothing applied. A variable the user
already exported wins over the config. What is in force, and where it came from, is logged and written with the
library versions and the device's name and memory to ``<output_dir>/device_report.json`` (rank 0 only), so a
benchmark number can always be traced to the settings that produced it.
"""

from __future__ import annotations

import logging
import os
import platform
from pathlib import Path
from typing import Any

import torch
from scripts.common.config import ConfigError, as_bool
from scripts.common.files import write_json

logger = logging.getLogger(__name__)

#: environment variables this module may set, and only on ROCm
ROCM_ENV_PREFIXES = ("MIOPEN_", "PYTORCH_TUNABLEOP_")

# values this process's earlier configure() calls exported: on a second call (e.g. another output_dir in the same
# process) they are ours to replace, not the user's to keep
_exported: dict[str, str] = {}


def backend(device: torch.device | str) -> str:
    """``"rocm"``, ``"cuda"`` or ``"cpu"`` for the device; any other device type is returned as it is (``"xpu"``)."""
    kind = torch.device(device).type
    if kind == "cuda":
        return "rocm" if getattr(torch.version, "hip", None) else "cuda"
    return kind


def configure(
    device: torch.device | str,
    output_dir: str | Path,
    *,
    miopen_find_mode: int | str | None = 1,
    miopen_find_enforce: int | str | None = 3,
    miopen_cache: bool | str = True,
    tunableop: bool | str = False,
    cudnn_benchmark: bool | str = True,
    tf32: bool | str = True,
    cpu_threads: int | str | None = None,
    report: bool | str = True,
    rank: int | str | None = None,
) -> dict[str, Any]:
    """Apply the settings for ``device``'s backend and return the device report (also logged, and saved on rank 0).

    Args:
        device: the device the network will run on (``torch.device`` or a string such as ``"cuda:0"``).
        output_dir: the run's output folder; MIOpen/TunableOp caches and ``device_report.json`` go here.
        miopen_find_mode: ``MIOPEN_FIND_MODE`` (1 NORMAL ... 5 DYNAMIC_HYBRID); ``None`` leaves MIOpen's default.
        miopen_find_enforce: ``MIOPEN_FIND_ENFORCE`` (3 SEARCH tunes kernels missing from the database);
            ``None`` leaves MIOpen's default.
        miopen_cache: keep MIOpen's user database and compiled kernels in ``<output_dir>/miopen/``.
        tunableop: enable PyTorch TunableOp (GEMM tuning) with results in ``<output_dir>/tunableop/``.
        cudnn_benchmark: ``torch.backends.cudnn.benchmark`` on CUDA and ROCm (MIOpen honours it).
        tf32: TF32 matmuls and convolutions on CUDA (``torch.backends.cuda.matmul``/``cudnn.allow_tf32``).
        cpu_threads: ``torch.set_num_threads`` on CPU; ``None`` keeps torch's default.
        report: write ``<output_dir>/device_report.json`` (rank 0 only).
        rank: this process's rank; default the ``RANK`` environment variable, else 0.

    Flags accept the strings "true"/"false", as they arrive from ``--tf32 false`` on the command line.
    """
    device = torch.device(device)
    kind = backend(device)
    output_dir = Path(output_dir).absolute()
    rank = int(os.environ.get("RANK", 0) if rank in (None, "") else rank)

    settings = _apply(kind, output_dir, miopen_find_mode, miopen_find_enforce, miopen_cache, tunableop,
                      cudnn_benchmark, tf32, cpu_threads)  # fmt: skip
    info = device_report(device, settings, rank=rank)
    (logger.info if rank == 0 else logger.debug)("device report:\n%s", _as_lines(info))
    if as_bool(report, "report") and rank == 0:
        path = output_dir / "device_report.json"
        write_json(path, info, default=str)
        logger.info("device report written to %s", path)
    return info


def _apply(kind: str, output_dir: Path, find_mode, find_enforce, miopen_cache, tunableop, cudnn_benchmark, tf32,
           cpu_threads) -> dict[str, Any]:  # fmt: skip
    """The settings of ``kind``'s backend, applied; what is in force and where each value came from."""
    if kind == "rocm":
        return _configure_rocm(
            output_dir,
            find_mode=find_mode,
            find_enforce=find_enforce,
            cache=as_bool(miopen_cache, "miopen_cache"),
            tunableop=as_bool(tunableop, "tunableop"),
            benchmark=as_bool(cudnn_benchmark, "cudnn_benchmark"),
        )
    if kind == "cuda":
        return _configure_cuda(as_bool(cudnn_benchmark, "cudnn_benchmark"), as_bool(tf32, "tf32"))
    if kind == "cpu":
        return _configure_cpu(cpu_threads)
    logger.info("device type %r: used as given, no backend settings applied", kind)
    return {}


def device_report(device: torch.device | str, settings: dict[str, Any] | None = None, rank: int = 0) -> dict[str, Any]:
    """Versions, device name/memory and ``settings`` as a JSON-serialisable dict; queries only, changes nothing."""
    import monai

    device = torch.device(device)
    kind = backend(device)
    info: dict[str, Any] = {
        "backend": kind,
        "device": str(device),
        "rank": rank,
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "monai": monai.__version__,
        "hip": getattr(torch.version, "hip", None),
        "cuda": getattr(torch.version, "cuda", None),
    }
    if kind in ("cuda", "rocm"):
        info["dnn_library"] = "MIOpen" if kind == "rocm" else "cuDNN"
        info["dnn_version"] = _dnn_version()
        info.update(_gpu_info(device))
        for name in ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
            if name in os.environ:
                info[name] = os.environ[name]
    elif kind == "cpu":
        info["device_name"] = platform.processor() or platform.machine()
        info["total_memory_gib"] = _system_memory_gib()
        info["cpu_count"] = os.cpu_count()
        info["num_threads"] = torch.get_num_threads()
    info["settings"] = dict(settings or {})
    return info


def _configure_rocm(
    output_dir: Path,
    *,
    find_mode: int | str | None,
    find_enforce: int | str | None,
    cache: bool,
    tunableop: bool,
    benchmark: bool,
) -> dict[str, Any]:
    settings = {
        "MIOPEN_FIND_MODE": _set_env("MIOPEN_FIND_MODE", _env_value(find_mode)),
        "MIOPEN_FIND_ENFORCE": _set_env("MIOPEN_FIND_ENFORCE", _env_value(find_enforce)),
    }
    for name, folder in (("MIOPEN_USER_DB_PATH", "miopen/userdb"), ("MIOPEN_CUSTOM_CACHE_DIR", "miopen/cache")):
        wanted = str(output_dir / folder) if cache else None
        settings[name] = _set_env(name, wanted)
        if settings[name]["source"] == "config" and wanted is not None:
            Path(wanted).mkdir(parents=True, exist_ok=True)

    results = str(output_dir / "tunableop" / "results%d.csv")  # %d: TunableOp inserts the device ordinal
    enabled = _set_env("PYTORCH_TUNABLEOP_ENABLED", "1" if tunableop else None)
    filename = _set_env("PYTORCH_TUNABLEOP_FILENAME", results if tunableop else None)
    settings["PYTORCH_TUNABLEOP_ENABLED"] = enabled
    settings["PYTORCH_TUNABLEOP_FILENAME"] = filename
    if tunableop:
        if filename["source"] == "config":
            Path(results).parent.mkdir(parents=True, exist_ok=True)
        # the variables are read when TunableOp is first used; if torch already used it, only the API still counts
        tunable = getattr(torch.cuda, "tunable", None)
        if enabled["source"] == "config":
            _call_tunable(tunable, "enable", True)
        if filename["source"] == "config":
            _call_tunable(tunable, "set_filename", results, insert_device_ordinal=True)

    torch.backends.cudnn.benchmark = benchmark
    settings["torch.backends.cudnn.benchmark"] = {"value": benchmark, "source": "config"}
    return settings


def _configure_cuda(benchmark: bool, tf32: bool) -> dict[str, Any]:
    torch.backends.cudnn.benchmark = benchmark
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    settings = {
        "torch.backends.cudnn.benchmark": {"value": benchmark, "source": "config"},
        "torch.backends.cuda.matmul.allow_tf32": {"value": tf32, "source": "config"},
        "torch.backends.cudnn.allow_tf32": {"value": tf32, "source": "config"},
    }
    if "NVIDIA_TF32_OVERRIDE" in os.environ:  # "0" disables TF32 in the CUDA libraries whatever torch asks for
        settings["NVIDIA_TF32_OVERRIDE"] = {"value": os.environ["NVIDIA_TF32_OVERRIDE"], "source": "environment"}
    return settings


def _configure_cpu(cpu_threads: int | str | None) -> dict[str, Any]:
    if isinstance(cpu_threads, str) and cpu_threads.strip().lower() in ("", "none", "null"):
        cpu_threads = None
    if cpu_threads is None:
        source = "environment" if "OMP_NUM_THREADS" in os.environ else "default"
        return {"torch.num_threads": {"value": torch.get_num_threads(), "source": source}}
    try:
        threads = int(cpu_threads)
    except ValueError:
        threads = 0
    if threads < 1:
        raise ConfigError(
            f"cpu_threads={cpu_threads!r}: give a positive number of threads, or null for torch's default."
        )
    torch.set_num_threads(threads)
    return {"torch.num_threads": {"value": torch.get_num_threads(), "source": "config"}}


def _set_env(name: str, wanted: str | None) -> dict[str, Any]:
    """Export ``name=wanted`` unless the user exported it already; the value in force and its source."""
    current = os.environ.get(name)
    if current is not None and _exported.get(name) != current:
        logger.info("%s=%s kept from the environment (the config asks for %s)", name, current, wanted or "it unset")
        return {"value": current, "source": "environment"}
    if wanted is None:
        if current is not None:  # exported by an earlier configure() of this process; this config leaves it unset
            del os.environ[name]
        _exported.pop(name, None)
    else:
        os.environ[name] = wanted
        _exported[name] = wanted
    return {"value": wanted, "source": "config"}


def _env_value(value: int | str | None) -> str | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "null")):
        return None
    return str(value).strip()


def _call_tunable(tunable: Any, function: str, *args: Any, **kwargs: Any) -> None:
    call = getattr(tunable, function, None)
    if call is None:
        logger.warning("torch.cuda.tunable.%s is not available in torch %s", function, torch.__version__)
        return
    try:
        call(*args, **kwargs)
    except (RuntimeError, AttributeError) as error:
        logger.warning("torch.cuda.tunable.%s failed (%s); the environment variable still applies", function, error)


def _dnn_version() -> int | None:
    try:
        return torch.backends.cudnn.version()
    except (RuntimeError, AttributeError):
        return None


def _gpu_info(device: torch.device) -> dict[str, Any]:
    try:
        properties = torch.cuda.get_device_properties(device)
        info: dict[str, Any] = {
            "device_name": torch.cuda.get_device_name(device),
            "total_memory_gib": round(properties.total_memory / 2**30, 2),
            "visible_devices": torch.cuda.device_count(),
        }
    except (RuntimeError, AssertionError, ValueError) as error:  # no driver, or a CPU-only build given "cuda"
        logger.warning("cannot query %s: %s", device, error)
        return {"device_name": None, "total_memory_gib": None, "visible_devices": 0}
    arch = getattr(properties, "gcnArchName", None)
    if arch:
        info["gcn_arch"] = arch
    return info


def _system_memory_gib() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 2)
    except (AttributeError, ValueError, OSError):  # not a POSIX system
        return None


def _as_lines(info: dict[str, Any]) -> str:
    lines = [f"  {key}: {value}" for key, value in info.items() if key != "settings"]
    settings = info.get("settings", {})
    lines.append("  settings:" if settings else "  settings: none applied")
    lines += [f"    {name} = {entry['value']} ({entry['source']})" for name, entry in settings.items()]
    return "\n".join(lines)

"""``torch.compile`` of the network's repeated blocks (``compile: true``, ``compile_scope: regional``).

Compiling the whole SwinUNETR gives inductor one large graph of forward and backward to trace, partition and tune:
on an H200 that was still compiling or running ~196 s after the training step began. A SwinUNETR is
a few block classes repeated: 8 Swin transformer blocks (window attention + MLP), 4 patch mergings and 10 residual
convolution blocks of the UNETR decoder. :func:`compile_regions` compiles each of those blocks in place
(``nn.Module.compile``): dynamo traces a block's code once per stage's shape and every instance of that stage reuses
the graph (PyTorch's "regional compilation" recipe), and the glue between blocks (the encoder's reshapes, the skip
connections, the output convolution) stays eager. Parameters, buffers and state-dict keys are untouched (no
``_orig_mod.`` prefix), so checkpoints move between compiled and plain networks as they are.

Each distinct shape gets its own static graph (``dynamic=False``: a SwinUNETR has ~22 of them in training, one per
block and stage; validation's windows in ``no_grad`` another set), so dynamo's limit of 8 recompilations per block's
code (hit by the 10 residual blocks of different widths: the rest would run uncompiled, with one warning) is raised to
:data:`RECOMPILE_LIMIT`. Shape-generic kernels would compile fewer graphs but run slower for all 300 epochs.

``compile_scope: whole`` keeps the former behaviour: the trainer compiles the whole network. The proof kit measures
both the compile time (the first step, reported apart from the steady state) and the speed of each.

``compile: auto`` (the default) is decided once, when the run starts, by :func:`decide`: on where the run's training
steps save more than the first step costs, by the numbers measured on a GPU (:data:`MEASURED`); off on a CPU, for the
demo and for the benchmark's short runs. The log says which and why. ``compile: true`` / ``false`` are obeyed as set.

:func:`use_cache` keeps the compiled code in a folder the config names (``compile_cache_dir``): inductor's FX graph
cache and AOTAutograd's cache (the Triton kernels bundled with them), so a second run, a resumed one and every DDP
rank or SLURM node that sees the folder load the first compilation instead of repeating it. :func:`cache_counters`
reads torch's own hit and miss counters, which the benchmark reports and the tests count.
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from scripts.common.config import ConfigError, as_bool, unset
from scripts.training.attention import dense_bias_attention

logger = logging.getLogger(__name__)

#: the repeated blocks of MONAI's SwinUNETR (v1 and v2): the units compiled by ``compile_scope: regional``
REGIONS = ("SwinTransformerBlock", "PatchMerging", "PatchMergingV2", "UnetResBlock", "UnetBasicBlock")
SCOPES = ("regional", "whole")
RECOMPILE_LIMIT = 64  # graphs per block's code: stages x (training, no_grad) x (shifted windows or not), with room


@dataclass(frozen=True)
class CompileCost:
    """What regional compilation cost and saved where it was measured: ms a step eager and compiled, and the first
    step's seconds of each (compilation and cuDNN's algorithm search happen in the first step)."""

    where: str
    eager_ms_per_step: float
    compiled_ms_per_step: float
    eager_first_step_s: float
    compiled_first_step_s: float

    def break_even_steps(self) -> int:
        """The training steps after which the time saved a step has paid for the longer first step."""
        extra_s = self.compiled_first_step_s - self.eager_first_step_s
        return math.ceil(1000 * extra_s / (self.eager_ms_per_step - self.compiled_ms_per_step))


#: the one measurement ``compile: auto`` decides by (docs/performance.md, "One NVIDIA H200", "Training throughput"):
#: SwinUNETR f48, 4 patches of 96^3 a step, fp16, the cache
#: on the GPU, the defaults' CUDA graphs. A step: eager 151 ms, compiled 109 ms (the rows "eager, fp16 + cuda_graphs"
#: and "a full training's defaults"); the first step of a fresh process: eager 20.0 s (the cache built, cuDNN's
#: search), compiled 148.0 s with an empty compile cache (the graphs start after it, at the fourth step)
MEASURED = CompileCost("an NVIDIA H200 (docs/performance.md)", eager_ms_per_step=151.0,
                       compiled_ms_per_step=109.0, eager_first_step_s=20.0, compiled_first_step_s=148.0)  # fmt: skip


def decide(setting: bool | str, device: torch.device | str, steps: int, cost: CompileCost = MEASURED) -> bool:
    """Whether training compiles: ``setting`` true or false as set; ``auto`` on a GPU (CUDA or ROCm) when the run's
    ``steps`` training steps save more than the longer first step costs (:data:`MEASURED`), off on any other device
    (compilation was measured to pay on a GPU only). The decision and its reason are logged."""
    if str(setting).strip().lower() != "auto":
        on = as_bool(setting, "compile")
        logger.info("compile: %s (compile: %s)", "on" if on else "off", str(setting).strip().lower())
        return on
    kind = torch.device(device).type
    if kind != "cuda":
        logger.info("compile: off (auto: the device is %s; compilation was measured to pay on a GPU only; "
                    "compile: true compiles anyway)", kind)  # fmt: skip
        return False
    steps, needed = int(steps), cost.break_even_steps()
    saved_s = steps * (cost.eager_ms_per_step - cost.compiled_ms_per_step) / 1000
    extra_s = cost.compiled_first_step_s - cost.eager_first_step_s
    on = steps >= needed
    logger.info(
        "compile: %s (auto: %d training steps x %.0f ms saved a step = %.0f s against a first step %.0f s longer; "
        "compiling pays after %d steps, as measured on %s)", "on" if on else "off", steps,
        cost.eager_ms_per_step - cost.compiled_ms_per_step, saved_s, extra_s, needed, cost.where,
    )  # fmt: skip
    return on


# the folder this process's use_cache set (a variable set otherwise is the user's, and wins)
_cache_set: str | None = None


def use_cache(folder: str | Path | None) -> str | None:
    """Keep compiled code in ``folder`` (``TORCHINDUCTOR_CACHE_DIR``, read by inductor when it first compiles: the FX
    graph cache, AOTAutograd's cache and the Triton kernels), with both caches on; the folder in force, logged. None
    (or a folder that cannot be written) leaves torch's default (a folder under /tmp, per user and machine). A
    ``TORCHINDUCTOR_CACHE_DIR`` exported before the run wins, as the device settings' variables do."""
    global _cache_set
    exported = os.environ.get("TORCHINDUCTOR_CACHE_DIR")  # before importing inductor's config, which sets it
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    inductor_config.fx_graph_cache = True
    functorch_config.enable_autograd_cache = True
    if exported and exported not in (_cache_set, default_cache_dir()):  # not ours, nor torch's own default
        logger.info("compile cache: %s (TORCHINDUCTOR_CACHE_DIR, exported: it wins over compile_cache_dir)", exported)
        return exported
    if unset(folder):
        if _cache_set and os.environ.get("TORCHINDUCTOR_CACHE_DIR") == _cache_set:  # an earlier run's, here
            del os.environ["TORCHINDUCTOR_CACHE_DIR"]
        logger.info("compile cache: torch's default folder (compile_cache_dir: null)")
        return None
    path = Path(folder).expanduser().resolve()
    try:
        path.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as error:
        logger.warning("compile cache: %s cannot be written (%s): torch's default folder is used", path, error)
        return None
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _cache_set = str(path)
    logger.info("compile cache: %s (compiled once, loaded by every later run, rank and node that sees it)", path)
    return str(path)


def cache_counters() -> dict[str, int]:
    """This process's compile-cache hits and misses so far, from torch's own counters (FX graphs: inductor's
    compiled graphs; AOTAutograd: the forward and backward split, one entry per compiled region and mode)."""
    from torch._dynamo.utils import counters

    return {"fx_graph_hits": counters["inductor"]["fxgraph_cache_hit"],
            "fx_graph_misses": counters["inductor"]["fxgraph_cache_miss"],
            "aot_autograd_hits": counters["aot_autograd"]["autograd_cache_hit"],
            "aot_autograd_misses": counters["aot_autograd"]["autograd_cache_miss"]}  # fmt: skip


def check_scope(scope: str) -> str:
    scope = str(scope).lower()
    if scope not in SCOPES:
        raise ConfigError(f"compile_scope: {scope!r} is not one of {list(SCOPES)}.")
    return scope


def compile_regions(
    network: torch.nn.Module,
    enabled: bool = True,
    scope: str = "regional",
    mode: str | None = "default",
    backend: str = "inductor",
    regions: Iterable[str] = REGIONS,
    cache_dir: str | Path | None = None,
) -> torch.nn.Module:
    """``network`` with each module whose class is named in ``regions`` compiled in place (outermost first: a block
    inside a compiled block is compiled with it), when ``enabled`` and ``scope`` is ``regional``; otherwise unchanged
    (``whole``: the trainer compiles the whole network). When ``enabled``, either scope keeps its compiled code in
    ``cache_dir`` (:func:`use_cache`) and makes its window attentions' bias as one tensor
    (:func:`scripts.training.attention.dense_bias_attention`: the same numbers, a softmax kernel inductor does not
    gather in). A network with none of those blocks is a configuration error that says what to set instead."""
    if not enabled:
        return network
    scope = check_scope(scope)
    use_cache(cache_dir)
    dense_bias_attention(network)  # the window attention's bias as one tensor: inductor's softmax reads, not gathers
    if scope != "regional":
        return network
    names = set(regions)
    config = torch._dynamo.config
    for limit in ("recompile_limit", "cache_size_limit"):  # the name since torch 2.7, and before it
        if hasattr(config, limit):
            setattr(config, limit, max(getattr(config, limit), RECOMPILE_LIMIT))
    compiled = []
    for name, module in network.named_modules():
        if type(module).__name__ in names and not any(name.startswith(f"{outer}.") for outer in compiled):
            module.compile(mode=None if mode in (None, "default") else mode, backend=backend, dynamic=False)
            compiled.append(name)
    if not compiled:
        raise ConfigError(
            f"compile_scope: regional found none of the blocks {sorted(names)} in {type(network).__name__}: set "
            "compile_scope: whole to compile the whole network."
        )
    return network


def compiled_regions(network: torch.nn.Module) -> list[str]:
    """The names of the modules of ``network`` compiled in place (``nn.Module.compile``)."""
    return [name for name, m in network.named_modules() if getattr(m, "_compiled_call_impl", None) is not None]

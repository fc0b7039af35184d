"""``torch.compile`` of the network's repeated blocks (``compile: true``, ``compile_scope: regional``).

Compiling the whole SwinUNETR gives inductor one large graph of forward and backward to trace, partition and tune:
on the first H200 run (0.7.0) that was still compiling or running ~196 s after the training step began. A SwinUNETR is
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
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from scripts.config import ConfigError

#: the repeated blocks of MONAI's SwinUNETR (v1 and v2): the units compiled by ``compile_scope: regional``
REGIONS = ("SwinTransformerBlock", "PatchMerging", "PatchMergingV2", "UnetResBlock", "UnetBasicBlock")
SCOPES = ("regional", "whole")
RECOMPILE_LIMIT = 64  # graphs per block's code: stages x (training, no_grad) x (shifted windows or not), with room


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
) -> torch.nn.Module:
    """``network`` with each module whose class is named in ``regions`` compiled in place (outermost first: a block
    inside a compiled block is compiled with it), when ``enabled`` and ``scope`` is ``regional``; otherwise unchanged
    (``whole``: the trainer compiles the whole network). A network with none of those blocks is a configuration error
    that says what to set instead."""
    if not enabled or check_scope(scope) != "regional":
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

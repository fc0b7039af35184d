"""The softmax kernels inductor writes for a Swin block's window attention, read without a GPU.

Why: on an H200 the compiled training step's softmax kernels take 29.8 % of its GPU time, 4x the eager step's
(docs/performance.md, "Where a training step's GPU time goes"). The kernels are Triton code inductor writes before
any GPU is involved; it can target Triton on a CPU (``cpu_backend = "triton"``), then writing the same kind of Triton
kernels as for CUDA, for the same fused nodes. This script makes it write them for one Swin block of the first stage
(forward and backward); the Triton compile then fails, as nothing here runs Triton on a CPU, but the code is written.
For each kernel that computes a softmax or its backward, the script prints what decides its memory traffic:

* persistent (one pass: the row held in registers) or looped (N passes over the row, each reading it again);
* the indirect loads (a gather through an index, each with a bounds assert: the relative-position bias looked up for
  every logit);
* the atomic adds (a scatter into the bias table).

It prints one table for MONAI's ``WindowAttention`` and one for
:class:`scripts.training.attention.DenseBiasWindowAttention`, whose bias is one opaque operator's output. It needs the
``triton`` package (``pip install triton``; a CPU machine is fine) and patches one torch helper that asks Triton for a
GPU backend. That is a private detail: a newer torch may need another patch, and the script says so. The kernels' speed
is for the GPU kit to measure (``--only compile_cache``).

    python -m benchmarks.inductor_kernels [--patches 1] [--shifted]
"""

from __future__ import annotations

import argparse
import copy
import logging
import re
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Kernel:
    """One generated Triton kernel, with what decides its memory traffic."""

    name: str
    persistent: bool
    passes: int  # loops over the reduced row (0 for a persistent kernel)
    indirect_loads: int  # loads through an index, each checked by a device assert
    atomic_adds: int

    @classmethod
    def parse(cls, name: str, source: str) -> Kernel:
        return cls(name=name, persistent=name.startswith("triton_per_"),
                   passes=len(re.findall(r"for r0_offset in", source)),
                   indirect_loads=source.count("tl.device_assert"),
                   atomic_adds=source.count("tl.atomic_add"))  # fmt: skip


def kernels_in(output_code: str) -> list[Kernel]:
    """The kernels of inductor's output code, each parsed from its ``@triton.jit`` source."""
    found = []
    for match in re.finditer(r"async_compile\.triton\('(\w+)', '''(.*?)'''", output_code, flags=re.S):
        found.append(Kernel.parse(match.group(1), match.group(2)))
    return found


def captured_graphs(module: torch.nn.Module, *inputs: torch.Tensor | None) -> dict[str, tuple[Any, list]]:
    """The forward and backward graphs (with their example inputs) that ``torch.compile`` hands inductor for
    ``module(*inputs)`` -- AOTAutograd's, with inductor's decompositions -- under the training step's mixed precision
    (bf16 here, fp16 on the GPU), the backward from the output's sum. Nothing is compiled."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._inductor.decomposition import select_decomp_table

    graphs = {}

    def keep(which):
        def compiler(graph, example_inputs):
            graphs[which] = (graph, example_inputs)
            return make_boxed_func(graph.forward)

        return compiler

    def backend(graph_module, example_inputs):
        return aot_module_simplified(graph_module, example_inputs, fw_compiler=keep("forward"),
                                     bw_compiler=keep("backward"), decompositions=select_decomp_table())  # fmt: skip

    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = torch.compile(module, backend=backend, dynamic=False)(*inputs)
    out.float().sum().backward()
    return graphs


def generated_code(module: torch.nn.Module, x: torch.Tensor, mask: torch.Tensor | None) -> str:
    """Inductor's Triton output code for ``module``'s forward and backward graphs (the Triton compile that follows
    fails on a CPU and is ignored)."""
    import torch._inductor.config as inductor_config
    import torch.utils._triton as torch_triton
    from torch._inductor.codecache import PyCodeCache
    from torch._inductor.compile_fx import compile_fx_inner

    if not hasattr(torch_triton, "triton_hash_with_backend"):
        raise SystemExit("this torch has no torch.utils._triton.triton_hash_with_backend to patch: update the script")
    graphs = captured_graphs(module, x.requires_grad_(), mask)

    written: list[str] = []
    write = PyCodeCache.write.__func__

    def keep_source(cls, source_code: str, extra: str = "") -> tuple[str, str]:
        written.append(source_code)
        return write(cls, source_code, extra)

    failures = logging.getLogger("torch._inductor.runtime.triton_heuristics")  # each failed compile, logged at length
    failures.disabled = True
    backend_hash = torch_triton.triton_hash_with_backend
    torch_triton.triton_hash_with_backend = lambda: "cpu-no-backend"  # the one call that asks Triton for a GPU
    PyCodeCache.write = classmethod(keep_source)  # inductor's output code, as it is written to its cache
    try:
        with inductor_config.patch(cpu_backend="triton", compile_threads=1, fx_graph_cache=False):
            for which in ("forward", "backward"):
                graph, inputs = graphs[which]
                try:
                    compile_fx_inner(graph, inputs, is_backward=which == "backward")
                except Exception as error:  # the Triton compile: no CPU backend in the triton package
                    if "backend" not in str(error) and "driver" not in str(error):
                        raise
    finally:
        PyCodeCache.write = classmethod(write)
        torch_triton.triton_hash_with_backend = backend_hash
        failures.disabled = False
    return "\n".join(written)


def main(argv: list[str] | None = None) -> list[tuple[str, list[Kernel]]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--patches", type=int, default=1, help="96^3 patches a step (the kit's step has 4)")
    parser.add_argument("--shifted", action="store_true", help="the block with shifted windows (its mask added)")
    args = parser.parse_args(argv)
    try:
        import triton  # noqa: F401
    except ImportError:
        raise SystemExit("needs the triton package: pip install triton (no GPU needed)") from None
    from monai.networks.nets.swin_unetr import SwinTransformerBlock, compute_mask
    from scripts.training.attention import dense_bias_attention

    # the first stage of SwinUNETR f48 on 96^3 patches: 48^3 tokens of 48 channels, 3 heads, 7^3 windows
    torch.manual_seed(0)
    shift = (3, 3, 3) if args.shifted else (0, 0, 0)
    block = SwinTransformerBlock(dim=48, num_heads=3, window_size=(7, 7, 7), shift_size=shift).train()
    x = torch.randn(args.patches, 48, 48, 48, 48)
    mask = compute_mask([49, 49, 49], (7, 7, 7), shift, x.device) if args.shifted else None  # 48 padded to 49
    tables = []
    for label, module in (("MONAI's WindowAttention", block),
                          ("DenseBiasWindowAttention", dense_bias_attention(copy.deepcopy(block)))):  # fmt: skip
        softmax = [k for k in kernels_in(generated_code(module, x.clone(), mask)) if "softmax" in k.name]
        tables.append((label, softmax))
        print(f"\n{label} ({args.patches} patch(es), {'shifted' if args.shifted else 'plain'} windows):")
        print(f"{'kernel':<92} {'kind':<10} {'passes':>6} {'gathers':>7} {'atomics':>7}")
        for k in softmax:
            kind = "persistent" if k.persistent else "looped"
            print(f"{k.name[:92]:<92} {kind:<10} {k.passes:>6} {k.indirect_loads:>7} {k.atomic_adds:>7}")
    return tables


if __name__ == "__main__":
    main()

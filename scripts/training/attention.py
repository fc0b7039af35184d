"""SwinUNETR's window attention, two ways PyTorch runs it faster than MONAI's module does.

**The relative-position bias as one tensor, for compiled networks** (:func:`dense_bias_attention`; every compiled
training network gets it, ``scripts/training/compilation.py``). MONAI's ``WindowAttention`` looks its bias up as
``table[index]`` inside the attention. Eagerly that is a small gather (heads x n x n, n = 343 for 7^3 windows) added to
the logits. Inductor, though, inlines the gather into the softmax kernel: every logit (1,372 windows x 3 heads x 343^2
= 484 M in the first stage of a 4 x 96^3 step) loads an int64 index and a table entry, behind a bounds assert, and the
softmax is three looped passes over each row instead of one persistent pass. On an H200 the compiled step's softmax
kernels took 29.8 % of its GPU time, 4x the eager step's (docs/performance.md, "Where a training step's GPU time
goes"). :func:`relative_position_bias` is a custom operator,
opaque to inductor, that makes the bias one contiguous (heads, n, n) tensor; the softmax kernel reads it as it reads
the logits. Its backward (the gradient summed back into the table) stays in the graph, fused with the sum over windows
as before. ``python -m benchmarks.inductor_kernels`` prints the kernels inductor writes for both: with the operator,
the plain windows' softmax is one persistent pass without a gather; the shifted windows' stays three passes (its
mask is broadcast over heads, an index inductor does not take as contiguous), without the gathers. Eagerly the numbers
are MONAI's bit for bit: the same lookup, the same additions (under deterministic algorithms; otherwise a CPU's threads
sum the table's gradient with atomic adds in any order, in MONAI's module too). What it saves on a GPU is not measured
yet (the kit's compile rows measure it).

**One fused kernel in training too** (``fused_attention: true``, :func:`fuse_window_attention`). MONAI 1.6 computes
``softmax(q k^T * scale + bias) v`` as separate kernels -- two batched matrix products, an add of the
relative-position bias (and, in shifted windows, of the mask), a softmax, and their backward passes -- and takes
``torch.nn.functional.scaled_dot_product_attention`` only when no gradient is recorded (``use_flash_attention``).
:class:`FusedWindowAttention` takes it always: the bias and mask go in as the additive ``attn_mask`` (PyTorch then
picks its memory-efficient kernel on CUDA/ROCm, which computes the gradient of the bias too), dropout as ``dropout_p``
while training. On an H200 it saved 2.8 GiB and no time (docs/performance.md, "Training throughput"); on a 2-core CPU a
training step of the demo network is slower with it, so it stays off by default.

Both keep the class's parameters, buffers and state-dict keys (only ``forward`` changes), so weights move between
them and a plain network both ways; ``tests/test_attention.py`` proves outputs and gradients equal to MONAI's module.
"""

from __future__ import annotations

from typing import Any

import torch
from monai.networks.nets.swin_unetr import WindowAttention
from torch.nn import functional


@torch.library.custom_op("nsclc_swin::relative_position_bias", mutates_args=())
def relative_position_bias(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The (heads, n, n) bias of an n-token window: ``table`` (positions, heads) looked up by ``index`` (n, n), as
    MONAI's ``WindowAttention`` does it, returned as one contiguous tensor that inductor cannot fuse into its consumers
    (see the module docstring)."""
    return _bias_lookup(table, index).contiguous()


def _bias_lookup(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """MONAI's lookup of a window's relative-position bias: ``table`` (positions, heads) by ``index`` (n, n), as a
    (heads, n, n) view."""
    n = index.shape[0]
    return table[index.reshape(-1)].reshape(n, n, -1).permute(2, 0, 1)


@relative_position_bias.register_fake
def _relative_position_bias_shape(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return table.new_empty((table.shape[1], index.shape[0], index.shape[0]))


def _keep_index(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    table, index = inputs
    ctx.save_for_backward(index)
    ctx.positions = table.shape[0]


def _bias_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    """Each bias entry's gradient summed into the table row it was read from (indexing's own backward)."""
    (index,) = ctx.saved_tensors
    heads = grad.shape[0]
    rows = grad.permute(1, 2, 0).reshape(-1, heads)
    return grad.new_zeros((ctx.positions, heads)).index_put((index.reshape(-1),), rows, accumulate=True), None


relative_position_bias.register_autograd(_bias_backward, setup_context=_keep_index)


class DenseBiasWindowAttention(WindowAttention):
    """MONAI's ``WindowAttention`` computed the same way, with the relative-position bias made by
    :func:`relative_position_bias` (see the module docstring); without gradients and with ``use_flash_attention``,
    MONAI's own forward (its ``scaled_dot_product_attention`` path)."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        if self.use_flash_attention and not torch.is_grad_enabled():
            return super().forward(x, mask)
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, c // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        bias = relative_position_bias(self.relative_position_bias_table, self.relative_position_index[:n, :n])
        attn = (q * self.scale) @ k.transpose(-2, -1) + bias.unsqueeze(0)
        if mask is not None:
            windows = mask.shape[0]
            attn = attn.view(b // windows, windows, self.num_heads, n, n) + mask.unsqueeze(1).unsqueeze(0)
            attn = attn.view(-1, self.num_heads, n, n)
        attn = self.attn_drop(self.softmax(attn)).to(v.dtype)
        x = (attn @ v).transpose(1, 2).reshape(b, n, c)
        return self.proj_drop(self.proj(x))


class FusedWindowAttention(WindowAttention):
    """MONAI's ``WindowAttention`` whose forward pass is one ``scaled_dot_product_attention`` call, with or without
    gradients (see the module docstring)."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, c // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        bias = _bias_lookup(self.relative_position_bias_table, self.relative_position_index[:n, :n])
        if mask is not None:  # shifted windows: the mask of each window added to every head's bias
            windows = mask.shape[0]
            bias = bias.unsqueeze(0).unsqueeze(0) + mask.reshape(1, windows, 1, n, n)
            bias = bias.expand(b // windows, windows, self.num_heads, n, n).reshape(b, self.num_heads, n, n)
        else:
            bias = bias.unsqueeze(0)
        dropout = self.attn_drop.p if self.training else 0.0
        x = functional.scaled_dot_product_attention(
            q, k, v, attn_mask=bias.to(q.dtype), dropout_p=dropout, scale=self.scale
        )
        return self.proj_drop(self.proj(x.transpose(1, 2).reshape(b, n, c)))


def fuse_window_attention(network: torch.nn.Module, enabled: bool = True) -> torch.nn.Module:
    """``network`` with every MONAI ``WindowAttention`` in it turned into :class:`FusedWindowAttention` in place
    (``enabled`` false: unchanged). Parameters, buffers and state-dict keys stay as they are."""
    return _swap(network, FusedWindowAttention) if enabled else network


def dense_bias_attention(network: torch.nn.Module) -> torch.nn.Module:
    """``network`` with every plain MONAI ``WindowAttention`` in it turned into :class:`DenseBiasWindowAttention` in
    place (a :class:`FusedWindowAttention` keeps its lookup: the bias only builds its ``attn_mask``, and a network an
    exporter converts keeps plain operators). Parameters, buffers and state-dict keys stay."""
    return _swap(network, DenseBiasWindowAttention)


def _swap(network: torch.nn.Module, kind: type[WindowAttention]) -> torch.nn.Module:
    for module in network.modules():
        if type(module) is WindowAttention:
            module.__class__ = kind
    return network

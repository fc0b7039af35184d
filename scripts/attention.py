"""SwinUNETR's window attention as one fused kernel in training too (``fused_attention: true``).

MONAI 1.6's ``WindowAttention`` computes ``softmax(q k^T * scale + bias) v`` as separate kernels -- two batched matrix
products, an add of the relative-position bias (and, in shifted windows, of the mask), a softmax, and their backward
passes -- and takes ``torch.nn.functional.scaled_dot_product_attention`` only when no gradient is recorded
(``use_flash_attention``). :func:`fuse_window_attention` makes every window attention of a network take it always:
the bias and mask go in as the additive ``attn_mask`` (PyTorch then picks its memory-efficient kernel on CUDA/ROCm,
which computes the gradient of the bias too), dropout as ``dropout_p`` while training.

The module keeps its class's parameters, buffers and state-dict keys (only its ``forward`` changes), so weights move
between a fused and a plain network both ways; ``tests/test_attention.py`` proves outputs and gradients equal to
MONAI's module within float32 tolerance. Whether it is faster on a GPU is for the proof kit to measure (a row of its
own, ``throughput_fused_attention``); on the 2-core CPU of CI it is slower (a training step of the demo network, two
64x64x32 patches: median 3.36 and 3.56 s fused against 3.25 and 2.97 s plain in two runs of 5 alternated steps), so
the default stays off until a GPU run shows it wins.
"""

from __future__ import annotations

import torch
from monai.networks.nets.swin_unetr import WindowAttention
from torch.nn import functional


class FusedWindowAttention(WindowAttention):
    """MONAI's ``WindowAttention`` whose forward pass is one ``scaled_dot_product_attention`` call, with or without
    gradients (see the module docstring)."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, c // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        index = self.relative_position_index[:n, :n].reshape(-1)
        bias = self.relative_position_bias_table[index].reshape(n, n, -1).permute(2, 0, 1)  # (heads, n, n)
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
    if enabled:
        for module in network.modules():
            if type(module) is WindowAttention:
                module.__class__ = FusedWindowAttention
    return network

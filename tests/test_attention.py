"""SwinUNETR's window attention fused into one kernel (scripts/attention.py): the same module to its weights, the same
outputs and gradients as MONAI's, in training and in evaluation, with and without shifted-window masks."""

from __future__ import annotations

import copy

import pytest
import torch
from monai.networks.nets import SwinUNETR
from monai.networks.nets.swin_unetr import WindowAttention
from scripts.attention import FusedWindowAttention, fuse_window_attention


@pytest.fixture(scope="module")
def networks() -> tuple[SwinUNETR, SwinUNETR]:
    """The demo-sized SwinUNETR (f12) as MONAI builds it, and a fused copy of the same weights."""
    torch.manual_seed(0)
    plain = SwinUNETR(in_channels=1, out_channels=2, feature_size=12, spatial_dims=3)
    with torch.no_grad():  # a relative-position bias that is not ~0, so that a bias left out would show
        for module in plain.modules():
            if isinstance(module, WindowAttention):
                module.relative_position_bias_table.normal_(0.0, 1.0)
    return plain, fuse_window_attention(copy.deepcopy(plain))


def test_fusing_keeps_every_parameter_buffer_and_state_dict_key(networks):
    plain, fused = networks
    assert plain.state_dict().keys() == fused.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), fused.state_dict().values(), strict=True))
    kinds = [type(m) for m in fused.modules() if isinstance(m, WindowAttention)]
    assert kinds and set(kinds) == {FusedWindowAttention}


def test_outputs_and_gradients_equal_monais_in_training(networks):
    """A training step's forward and backward (shifted windows included: 64x32x32 has them in the first stages)."""
    plain, fused = networks
    plain.train()
    fused.train()
    image = torch.randn(1, 1, 64, 32, 32)
    out_plain, out_fused = plain(image), fused(image)
    torch.testing.assert_close(out_fused, out_plain, rtol=1e-4, atol=1e-4)
    target = torch.randn_like(out_plain)
    ((out_plain - target) ** 2).mean().backward()
    ((out_fused - target) ** 2).mean().backward()
    grads = dict(fused.named_parameters())
    for name, parameter in plain.named_parameters():
        torch.testing.assert_close(grads[name].grad, parameter.grad, rtol=1e-3, atol=1e-5, msg=name)
    bias = "swinViT.layers1.0.blocks.1.attn.relative_position_bias_table"  # a shifted block's bias learns too
    assert grads[bias].grad.abs().sum() > 0


def test_weights_move_both_ways_and_inference_agrees(networks):
    plain, fused = networks
    again = SwinUNETR(in_channels=1, out_channels=2, feature_size=12, spatial_dims=3)
    again.load_state_dict(fused.state_dict())  # fused -> plain
    refused = fuse_window_attention(SwinUNETR(in_channels=1, out_channels=2, feature_size=12, spatial_dims=3))
    refused.load_state_dict(plain.state_dict())  # plain -> fused
    image = torch.randn(1, 1, 64, 32, 32)
    with torch.no_grad():
        expected = plain.eval()(image)
        torch.testing.assert_close(again.eval()(image), expected, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(refused.eval()(image), expected, rtol=1e-4, atol=1e-4)


def test_fusing_is_a_switch():
    network = SwinUNETR(in_channels=1, out_channels=2, feature_size=12, spatial_dims=3)
    assert fuse_window_attention(network, enabled=False) is network
    assert not any(isinstance(m, FusedWindowAttention) for m in network.modules())

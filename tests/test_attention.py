"""SwinUNETR's window attention (scripts/training/attention.py), fused into one kernel and with its bias made as one
tensor for compiled networks: the same module to its weights, the same outputs and gradients as MONAI's (the dense bias
bit for bit), in training and in evaluation, with and without shifted-window masks; the compiled graph reads the
bias."""

from __future__ import annotations

import copy

import pytest
import torch
from monai.networks.nets import SwinUNETR
from monai.networks.nets.swin_unetr import WindowAttention
from scripts.training.attention import (
    DenseBiasWindowAttention,
    FusedWindowAttention,
    dense_bias_attention,
    fuse_window_attention,
    relative_position_bias,
)


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


@pytest.fixture
def deterministic():
    """torch's deterministic algorithms for one test: on a CPU with several threads, the table's gradient (an
    accumulating index_put over 117,649 entries) is summed with atomic adds, in another order each run, MONAI's own
    module included (20 runs of it here: not all equal)."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


def test_the_dense_bias_attention_is_monais_bit_for_bit_in_training(networks, deterministic):
    """What a compiled network runs eagerly: the same numbers as MONAI's module, not merely close (the same lookup and
    additions; only the bias is made by one custom operator), shifted windows included."""
    plain, _ = networks
    dense = dense_bias_attention(copy.deepcopy(plain))
    assert {type(m) for m in dense.modules() if isinstance(m, WindowAttention)} == {DenseBiasWindowAttention}
    assert dense.state_dict().keys() == plain.state_dict().keys()
    plain.train()
    dense.train()
    image = torch.randn(1, 1, 64, 32, 32)
    out_plain, out_dense = plain(image), dense(image)
    assert torch.equal(out_dense, out_plain)
    plain.zero_grad()  # the fixture's network may hold another test's gradients
    out_plain.square().mean().backward()
    out_dense.square().mean().backward()
    grads = dict(dense.named_parameters())
    for name, parameter in plain.named_parameters():
        assert torch.equal(grads[name].grad, parameter.grad), name
    plain.zero_grad()


def test_the_bias_operator_is_a_well_formed_custom_op():
    """torch's own checks of a custom operator: its schema, its shape function against the real output, its gradient
    against the lookup's, its tracing by AOTAutograd (what torch.compile does to it)."""
    module = WindowAttention(dim=24, num_heads=3, window_size=(7, 7, 7), qkv_bias=True)
    table = torch.randn_like(module.relative_position_bias_table, requires_grad=True)
    index = module.relative_position_index[:343, :343]
    torch.library.opcheck(relative_position_bias, (table, index))
    bias = relative_position_bias(table, index)
    assert bias.shape == (3, 343, 343) and bias.is_contiguous()
    expected = table[index.reshape(-1)].reshape(343, 343, 3).permute(2, 0, 1)
    assert torch.equal(bias, expected)


def test_compiled_attention_reads_its_bias_instead_of_gathering_it():
    """The graph torch.compile hands inductor: MONAI's module puts the table lookup (aten.index) in it, where inductor
    fuses it into the softmax kernel (an indirect load for each logit); the dense-bias module gives inductor the bias
    as an opaque operator's output, so the softmax kernel reads a contiguous tensor."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._inductor.decomposition import select_decomp_table

    def forward_ops(module: torch.nn.Module) -> list[str]:
        """The operators of the forward graph AOTAutograd hands inductor (with inductor's decompositions)."""
        graphs = []

        def keep(graph, example_inputs):
            graphs.append(graph)
            return make_boxed_func(graph.forward)

        def backend(graph_module, example_inputs):
            return aot_module_simplified(graph_module, example_inputs, fw_compiler=keep,
                                         decompositions=select_decomp_table())  # fmt: skip

        torch._dynamo.reset()
        torch.compile(module, backend=backend, dynamic=False)(torch.randn(2, 343, 24, requires_grad=True), None)
        return [str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"]

    torch.manual_seed(0)
    plain = WindowAttention(dim=24, num_heads=3, window_size=(7, 7, 7), qkv_bias=True)
    monai_ops = forward_ops(plain)
    dense_ops = forward_ops(dense_bias_attention(copy.deepcopy(plain)))
    assert "aten.index.Tensor" in monai_ops
    assert "aten.index.Tensor" not in dense_ops and "nsclc_swin.relative_position_bias.default" in dense_ops

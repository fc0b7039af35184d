"""scripts.compilation: regional compilation compiles SwinUNETR's repeated blocks in place -- the same weights and
state-dict keys, the same outputs and gradients -- and the bundle asks the trainer to compile only for scope whole."""

from __future__ import annotations

import copy

import pytest
import torch
from monai.bundle import ConfigParser
from monai.networks.nets import BasicUNet, SwinUNETR
from scripts.compilation import compile_regions, compiled_regions
from scripts.config import ConfigError


def _graph_counter() -> tuple[list, object]:
    """A dynamo backend that records each graph it is given and runs it as traced (no inductor: seconds, not minutes,
    on a 2-core CPU); what the blocks compute is then exactly what dynamo captured."""
    graphs: list = []

    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    return graphs, backend


def test_regional_compilation_keeps_weights_outputs_and_gradients():
    torch.manual_seed(0)
    plain = SwinUNETR(in_channels=1, out_channels=2, feature_size=12, spatial_dims=3, depths=(1, 1, 1, 1))
    network = copy.deepcopy(plain)
    graphs, backend = _graph_counter()
    assert compile_regions(network, True, "regional", backend=backend) is network, "compiled in place"

    regions = compiled_regions(network)
    assert len(regions) == 4 + 4 + 10, "4 Swin blocks, 4 patch mergings, 10 residual conv blocks of the decoder"
    assert "swinViT.layers1.0.blocks.0" in regions and "decoder1.conv_block" in regions
    assert list(network.state_dict()) == list(plain.state_dict()), "no _orig_mod. prefix: checkpoints interchange"
    network.load_state_dict(plain.state_dict())  # and load both ways

    x = torch.rand(2, 1, 64, 32, 32)
    out, ref = network(x), plain(x)
    out.square().mean().backward()
    ref.square().mean().backward()
    traced = len(graphs)
    assert traced == len(regions), "each block traced once for its shape"
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for (name, a), b in zip(network.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)
    network(x)
    assert len(graphs) == traced, "the next step reuses the graphs: nothing is traced again"


def test_off_or_whole_leaves_the_network_alone_and_unknown_blocks_are_an_error():
    network = BasicUNet(spatial_dims=3, in_channels=1, out_channels=2, features=(4, 4, 8, 8, 16, 4))
    assert compile_regions(network, False) is network and not compiled_regions(network)
    assert compile_regions(network, True, "whole") is network and not compiled_regions(network)
    with pytest.raises(ConfigError, match=r"found none of the blocks .* in BasicUNet: set compile_scope: whole"):
        compile_regions(network, True, "regional")
    with pytest.raises(ConfigError, match=r"compile_scope: 'layers' is not one of \['regional', 'whole'\]"):
        compile_regions(network, True, "layers")


@pytest.mark.parametrize(("scope", "trainer_compiles"), [("regional", False), ("whole", True)])
def test_the_trainer_compiles_only_for_scope_whole(root, scope, trainer_compiles):
    parser = ConfigParser()
    parser.read_config(str(root / "configs" / "train.yaml"))
    parser.update({"bundle_root": str(root), "compile": "true", "compile_scope": scope, "feature_size": 12,
                   "device": "$torch.device('cpu')"})  # fmt: skip
    parser.get_parsed_content("scripts")
    assert parser.get_parsed_content("train#trainer#compile") is trainer_compiles
    assert bool(compiled_regions(parser.get_parsed_content("training_network"))) is not trainer_compiles

"""scripts.training.compilation: regional compilation compiles SwinUNETR's repeated blocks in place -- the same weights
and state-dict keys, the same outputs and gradients -- and the bundle asks the trainer to compile only for scope whole;
compile auto is on for a full GPU training and off for the demo, the benchmark and a CPU, and says why; a second
process compiles from the compile cache the first filled (torch's hit counters) several times faster."""

from __future__ import annotations

import copy
import json
import logging
import os

import pytest
import torch
import zygote
from conftest import ROOT
from monai.bundle import ConfigParser
from monai.networks.nets import BasicUNet, SwinUNETR
from monai.networks.nets.swin_unetr import WindowAttention
from scripts.common.config import ConfigError
from scripts.training.compilation import MEASURED, compile_regions, compiled_regions, decide


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
    attentions = {type(m).__name__ for m in network.modules() if isinstance(m, WindowAttention)}
    assert attentions == {"DenseBiasWindowAttention"}, "the bias made as one tensor (scripts/training/attention.py)"

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
    swin = SwinUNETR(in_channels=1, out_channels=2, feature_size=12, spatial_dims=3, depths=(1, 1, 1, 1))
    assert compile_regions(swin, False) is swin
    assert {type(m) for m in swin.modules() if isinstance(m, WindowAttention)} == {WindowAttention}, "eager: MONAI's"
    network = BasicUNet(spatial_dims=3, in_channels=1, out_channels=2, features=(4, 4, 8, 8, 16, 4))
    assert compile_regions(network, False) is network and not compiled_regions(network)
    assert compile_regions(network, True, "whole") is network and not compiled_regions(network)
    with pytest.raises(ConfigError, match=r"found none of the blocks .* in BasicUNet: set compile_scope: whole"):
        compile_regions(network, True, "regional")
    with pytest.raises(ConfigError, match=r"compile_scope: 'layers' is not one of \['regional', 'whole'\]"):
        compile_regions(network, True, "layers")


@pytest.mark.parametrize(("scope", "trainer_compiles"), [("regional", False), ("whole", True)])
def test_the_trainer_compiles_only_for_scope_whole(root, scope, trainer_compiles, tmp_path, monkeypatch):
    # the compile cache is set for this process and the processes it starts (TORCHINDUCTOR_CACHE_DIR): undone after,
    # or a later test's bundle run would find it exported
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    parser = ConfigParser()
    parser.read_config(str(root / "configs" / "train.yaml"))
    settings = {
        "bundle_root": str(root),
        "compile": "true",
        "compile_scope": scope,
        "feature_size": 12,
        "device": "$torch.device('cpu')",
        "training_steps": 0,
        "compile_cache_dir": str(tmp_path / "compiled"),
    }  # fmt: skip (not the default, under /data/tcia)
    parser.update(settings)
    parser.get_parsed_content("scripts")
    assert parser.get_parsed_content("train#trainer#compile") is trainer_compiles
    assert bool(compiled_regions(parser.get_parsed_content("training_network"))) is not trainer_compiles


def test_compile_auto_weighs_the_runs_steps_against_the_measured_first_step(caplog):
    """3,048 steps pay for a first step 128 s longer at 42 ms saved a step (the H200's fp16 rows with CUDA graphs);
    auto compiles from there on a GPU, never on a CPU; true and false are obeyed. Each decision is logged with its
    reason."""
    assert MEASURED.break_even_steps() == 3048
    with caplog.at_level(logging.INFO, logger="scripts.training.compilation"):
        assert decide("auto", "cuda", 3048) and not decide("auto", torch.device("cuda:1"), 3047)
        assert not decide("auto", "cpu", 10**6)
        assert decide("true", "cpu", 1) and not decide(False, "cuda", 10**6)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == (
        "compile: on (auto: 3048 training steps x 42 ms saved a step = 128 s against a first step 128 s longer; "
        "compiling pays after 3048 steps, as measured on an NVIDIA H200 (docs/performance.md))"
    )
    assert lines[1].startswith("compile: off (auto: 3047 training steps")
    assert lines[2].startswith("compile: off (auto: the device is cpu; compilation was measured to pay on a GPU only")
    assert lines[3:] == ["compile: on (compile: true)", "compile: off (compile: false)"]
    with pytest.raises(ConfigError, match="compile='sometimes': expected true or false"):
        decide("sometimes", "cuda", 1)


@pytest.mark.parametrize(
    ("configs", "device", "batches", "steps", "on"),
    [
        (["train.yaml"], "cuda", 300, 300 * 300, True),  # the full schedule: 300 epochs of ~300 training cases
        (["train.yaml", "demo.yaml"], "cuda", 8, 8 * 8, False),  # the demo's 8 epochs of 8 cases, even on a GPU
        (["train.yaml", "benchmark.yaml"], "cuda", 300, 5 + 30 + 5, False),  # warm-up + timed + busy steps
        (["train.yaml"], "cpu", 300, 300 * 300, False),
    ],
)
def test_compile_auto_in_the_configs(root, configs, device, batches, steps, on):
    parser = ConfigParser()
    parser.read_config([str(root / "configs" / c) for c in configs])
    parser.update({"bundle_root": str(root), "device": f"$torch.device('{device}')",
                   "train#dataloader": f"$list(range({batches}))"})  # fmt: skip
    parser.get_parsed_content("scripts")
    assert parser["compile"] == "auto", "the default"
    assert parser.get_parsed_content("training_steps") == steps
    assert parser.get_parsed_content("compile_on") is on


CHILD = """
import json, sys, time
import torch
from monai.networks.nets.swin_unetr import SwinTransformerBlock
from scripts.training.compilation import cache_counters, compile_regions

class Block(torch.nn.Module):  # a Swin block of the network, its window attention with the bias operator
    def __init__(self):
        super().__init__()
        self.block = SwinTransformerBlock(dim=24, num_heads=3, window_size=(7, 7, 7), shift_size=(0, 0, 0))

    def forward(self, x):
        return self.block(x, None)

torch.manual_seed(0)
network = compile_regions(Block(), True, regions=("SwinTransformerBlock",), cache_dir=sys.argv[1])
assert type(network.block.attn).__name__ == "DenseBiasWindowAttention"
start = time.perf_counter()
network(torch.randn(1, 14, 14, 14, 24)).sum().backward()
print(json.dumps({"seconds": time.perf_counter() - start, **cache_counters()}))
"""


def test_a_second_process_compiles_from_the_cache_the_first_filled(tmp_path):
    """compile_regions with a cache_dir: the first process compiles a Swin block's forward and backward (inductor's C++
    on a CPU; the attention's bias operator in the graph) and fills the folder; the second finds both graphs there --
    FX-graph and AOTAutograd hits, no miss -- and is several times faster. TORCHINDUCTOR_CACHE_DIR is unset in the
    children: the folder comes from the argument alone."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHINDUCTOR_")}
    runs = []
    for _ in range(2):
        done = zygote.run_python(["-c", CHILD, str(tmp_path / "cache")], ROOT, env, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, second = runs
    print(f"first compile {first}, second {second}")
    assert first["fx_graph_misses"] == 2 and first["aot_autograd_misses"] == 1 and first["fx_graph_hits"] == 0
    assert second["fx_graph_hits"] == 2 and second["aot_autograd_hits"] == 1
    assert second["fx_graph_misses"] == second["aot_autograd_misses"] == 0
    assert second["seconds"] * 3 < first["seconds"], "several times faster"
    assert (tmp_path / "cache" / "fxgraph").is_dir() and (tmp_path / "cache" / "aotautograd").is_dir()

"""Export of the demo-trained network with MONAI's own command, from a foreign working directory: the traced
TorchScript gives the eager network's output. (The ONNX export that CPU inference runs -- torch.onnx's, as MONAI's
``onnx_export`` makes it -- is compared with the eager network in tests/test_backends.py and
tests/test_workflow_inference.py.)"""

from __future__ import annotations

import torch
import yaml
from conftest import ROOT, bundle_run, configs

PATCH = [1, 1, *yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())["roi_size"]]  # the demo's window


def export(demo_run, command: str, filepath, *extra: str) -> tuple[torch.nn.Module, torch.Tensor]:
    """``monai.bundle <command>`` of the demo network at its patch size; the eager network and a test input."""
    tmp, _, _ = demo_run
    weights = tmp / "run" / "model.pt"
    args = ["network_def", "--filepath", str(filepath), "--ckpt_file", str(weights), "--meta_file",
            str(ROOT / "configs" / "metadata.json"), "--config_file", configs("inference.yaml", "demo.yaml"),
            "--bundle_root", str(ROOT), "--use_trace", "True", "--input_shape", str(PATCH), *extra]  # fmt: skip
    result = bundle_run(*args, command=command, cwd=filepath.parent, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    from monai.networks.nets import SwinUNETR
    from scripts.training.weights import load_weights

    eager = load_weights(SwinUNETR(in_channels=1, out_channels=2, feature_size=12), weights).eval()
    return eager, torch.rand(*PATCH, generator=torch.Generator().manual_seed(0))


def test_traced_export_matches_the_eager_network(demo_run, tmp_path):
    """SwinUNETR cannot be scripted; traced at the patch size it is, and gives the eager network's output."""
    eager, x = export(demo_run, "ckpt_export", tmp_path / "model.ts")
    traced = torch.jit.load(str(tmp_path / "model.ts")).eval()
    with torch.no_grad():
        torch.testing.assert_close(traced(x), eager(x), rtol=1e-4, atol=1e-4)

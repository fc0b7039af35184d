"""The sliding-window inferer that survives a CT too large for the device's memory."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch
from conftest import ROOT
from monai.inferers import SlidingWindowInferer
from scripts.inference.inferers import OUT_OF_MEMORY, FallbackSlidingWindowInferer, SameDeviced


class FailsOnce(torch.nn.Module):
    """A network whose first call runs out of memory, as a full CT on a small GPU does."""

    def __init__(self, error: Exception):
        super().__init__()
        self.calls, self.error = 0, error

    def forward(self, x):
        self.calls += 1
        if self.calls == 1:
            raise self.error
        return torch.cat([x, 2 * x], dim=1)


def test_out_of_memory_is_retried_with_cpu_stitching(caplog):
    inferer = FallbackSlidingWindowInferer(roi_size=(32, 32, 32), sw_batch_size=2, overlap=0.25)
    image = torch.rand(1, 1, 48, 40, 36)
    network = FailsOnce(OUT_OF_MEMORY("CUDA out of memory. Tried to allocate 2.00 GiB"))
    with caplog.at_level(logging.WARNING, logger="scripts.inference.inferers"):
        output = inferer(image, network)
    torch.testing.assert_close(output, torch.cat([image, 2 * image], dim=1))
    assert "out of memory" in caplog.text and "(1, 1, 48, 40, 36)" in caplog.text
    assert inferer.sw_device is None, "the inferer's own settings are restored for the next case"


def test_other_errors_are_not_swallowed():
    inferer = FallbackSlidingWindowInferer(roi_size=(32, 32, 32))
    with pytest.raises(RuntimeError, match="shape mismatch"):
        inferer(torch.rand(1, 1, 32, 32, 32), FailsOnce(RuntimeError("shape mismatch")))


def test_a_prediction_and_its_label_meet_on_one_device_before_the_metric():
    """On one device nothing moves (the same tensors); the GPU test below moves a pair split by the fallback."""
    pred, label = torch.zeros(2, 4, 4, 4), torch.ones(2, 4, 4, 4)
    moved = SameDeviced(["pred", "label", "raw"], allow_missing_keys=True)({"pred": pred, "label": label, "id": "a"})
    assert moved["pred"] is pred and moved["label"] is label and moved["id"] == "a"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm device")
def test_a_prediction_stitched_on_the_cpu_is_scored_against_a_label_on_the_gpu():
    """The H200 run's crash (evaluate_oom.log): the fallback's prediction on the CPU, the label on cuda:0, MeanDice
    between them. After SameDeviced the Dice is computed, and equals the recount."""
    from monai.metrics import DiceMetric

    pred = torch.zeros(1, 2, 8, 8, 8)
    pred[:, 1, 2:6, 2:6, 2:6] = 1
    pred[:, 0] = 1 - pred[:, 1]
    label = pred.clone().cuda()
    label[:, 1, 2:6, 2:6, 5] = 0
    label[:, 0] = 1 - label[:, 1]
    both = SameDeviced(["pred", "label"])({"pred": pred, "label": label})
    dice = DiceMetric(include_background=False)(both["pred"], both["label"])
    assert float(dice) == pytest.approx(2 * 48 / (64 + 48))


# ------------------------------------------------------------------------------------------------------------------
# inference.yaml's `inferer` where the bundle's Python is importable (MONAI Label): the CPU runtime for the weights
# of the network it is handed. A small 3-D network stands in for SwinUNETR (tests/test_monailabel.py runs SwinUNETR)
def small_network(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Conv3d(1, 4, 3, padding=1), torch.nn.InstanceNorm3d(4),
                               torch.nn.LeakyReLU(0.01), torch.nn.Conv3d(4, 2, 1)).eval()  # fmt: skip


def test_on_a_cpu_the_handed_networks_weights_run_in_the_runtime_and_new_weights_are_exported_anew(tmp_path, caplog):
    """The handed network's weights in OpenVINO (f32: PyTorch's output within 1e-4), exported beside ``weights`` on the
    first call; later calls with the same weights -- the same network, or another one holding equal tensors, as MONAI
    Label's reload of an unchanged file -- use the same compiled model; weights loaded into the same network in place
    are exported and compiled anew, and their output is theirs."""
    from monai.inferers import SlidingWindowInferer
    from scripts.inference.inferers import RuntimeSlidingWindowInferer

    caplog.set_level(logging.INFO, logger="scripts.inference.backends")
    window = (16, 16, 8)
    inferer = RuntimeSlidingWindowInferer(window, 2, 0.25, backend="openvino", precision="f32",
                                          weights=str(tmp_path / "model.pt"))  # fmt: skip
    reference = SlidingWindowInferer(window, 2, 0.25)
    volume = torch.rand(1, 1, 30, 20, 12, generator=torch.Generator().manual_seed(1))
    network, other = small_network(0), small_network(1)
    exports = lambda: sum(r.getMessage().startswith("exporting ") for r in caplog.records)  # noqa: E731

    compiled = []
    for handed in (network, small_network(0), network):
        with torch.no_grad():
            torch.testing.assert_close(inferer(volume, handed), reference(volume, handed), rtol=1e-4, atol=1e-4)
        compiled.append(inferer.runtime.network)
    assert exports() == 1 and compiled[0] is compiled[1] is compiled[2], "exported and compiled once"
    assert (tmp_path / "model.pt.onnx").is_file() and list((tmp_path / "model.pt.onnx.openvino-f32").glob("*.blob"))
    network.load_state_dict(other.state_dict())  # new weights, the same network and tensors
    with torch.no_grad():
        torch.testing.assert_close(inferer(volume, network), reference(volume, other), rtol=1e-4, atol=1e-4)
    assert exports() == 2 and inferer.runtime.network is not compiled[0]


def test_in_int8_the_inferer_calibrates_on_its_configs_preprocessing_and_its_own_windows(tmp_path):
    """MONAI Label with cpu_precision int8: the inferer quantises the weights it is handed once, on windows of
    int8_calibration's CTs preprocessed by the config it names, of its own window size; then serves them: the sliding
    window over the int8 model the backend loads from the cache. (Its accuracy on trained weights:
    tests/test_workflow_inference.py.)"""
    import nibabel as nib
    from scripts.inference.backends import OpenVinoNetwork
    from scripts.inference.inferers import RuntimeSlidingWindowInferer

    cts = tmp_path / "cts"
    cts.mkdir()
    hu = np.full((40, 40, 12), -1000.0, np.float32)
    hu[5:35, 5:35] = 40.0
    hu[10:20, 10:30, 2:10] = -850.0  # a lung
    nib.save(nib.Nifti1Image(hu, np.diag([1.0, 1.0, 3.0, 1.0])), cts / "ct.nii.gz")
    window = (16, 16, 8)
    inferer = RuntimeSlidingWindowInferer(window, 2, 0.25, backend="openvino", precision="int8",
                                          weights=str(tmp_path / "model.pt"), calibration=str(cts),
                                          calibration_windows=4,
                                          config_file=str(ROOT / "configs" / "inference.yaml"))  # fmt: skip
    network = small_network(0)
    volume = torch.from_numpy((hu + 1000.0) / 1500.0)[None, None]  # the CT as the preprocessing scales it
    with torch.no_grad():
        found = inferer(volume, network)
    record = json.loads((tmp_path / "model.pt.onnx.openvino-int8" / "int8.json").read_text())
    assert record["windows"] == 4 and record["describe"] == f"4 windows of 16x16x8 from {cts}"
    assert inferer.network_for(network) is inferer.runtime.network, "the same weights: the same quantised model"
    calibration = inferer._calibration()  # a second calibration of the same settings: the same key, no window made
    calibration.windows = None
    direct = OpenVinoNetwork(tmp_path / "model.pt.onnx", precision="int8", calibration=calibration)
    with torch.no_grad():
        torch.testing.assert_close(found, SlidingWindowInferer(window, 2, 0.25)(volume, direct))


def test_on_a_gpu_with_torch_or_for_torchscript_the_inferer_runs_the_network_itself(tmp_path, monkeypatch):
    """As MONAI's SlidingWindowInferer: nothing exported, the handed network called (MONAI Deploy hands model.ts)."""
    from scripts.inference.inferers import RuntimeSlidingWindowInferer

    network = small_network(0)
    scripted = torch.jit.trace(network, torch.rand(1, 1, 8, 8, 8))
    torch_inferer = RuntimeSlidingWindowInferer((8, 8, 8), backend="torch", weights=str(tmp_path / "model.pt"))
    auto = RuntimeSlidingWindowInferer((8, 8, 8), backend="auto", weights=str(tmp_path / "model.pt"))
    assert torch_inferer.network_for(network) is network and auto.network_for(scripted) is scripted
    monkeypatch.setattr("scripts.inference.inferers.device_of", lambda module: torch.device("cuda", 0))
    assert auto.network_for(network) is network
    assert not list(tmp_path.iterdir()), "nothing exported"

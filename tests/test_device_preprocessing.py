"""Inference's CT preprocessing on the GPU it runs on (inference.yaml's ``preprocessing_device``): where it runs and who
loads the cases, and a whole inference run with the cases read and preprocessed in the run's own process giving the
label map of the host's DataLoader workers. The image and the label maps on a device's tensors against the host's:
tests/test_postprocess.py. The ``cuda`` cases run where torch sees a CUDA/ROCm device (marked gpu)."""

from __future__ import annotations

import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
from conftest import configs, workflow_run
from monai.bundle import ConfigParser
from monai.transforms import ToDeviced
from scripts.training.weights import save_weights

ROOT = Path(__file__).resolve().parents[1]
CUDA = pytest.param(
    "cuda",
    marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm device")],
)
#: a network whose label map follows the CT as smoothly as the CT itself: one 1x1x1 convolution (THRESHOLD_WEIGHTS)
THRESHOLD_NETWORK = "{'_target_': 'torch.nn.Conv3d', 'in_channels': 1, 'out_channels': 2, 'kernel_size': 1}"


@pytest.mark.parametrize(
    ("device", "forced", "where", "workers"),
    [("cpu", None, "cpu", 2), ("cuda", None, "cuda", 0), ("cuda:1", None, "cuda:1", 0), ("cuda", "cpu", "cpu", 2)],
)
def test_the_preprocessing_runs_on_the_gpu_inference_runs_on_and_its_cases_load_in_the_runs_process(
    device, forced, where, workers
):
    """On a GPU the image goes to it before the CT transforms, and the DataLoader has no worker processes (CUDA cannot
    start in a forked one); on a CPU, or with --preprocessing_device cpu, the host preprocesses in num_workers
    processes, as before."""
    parser = ConfigParser()
    parser.read_config(str(ROOT / "configs" / "inference.yaml"))
    parser.update({"bundle_root": str(ROOT), "device": device, **({"preprocessing_device": forced} if forced else {})})
    assert str(parser.get_parsed_content("preprocessing_device")) == where
    assert parser.get_parsed_content("dataloader#num_workers") == workers
    _, moved, *ct = parser.get_parsed_content("preprocessing").transforms
    assert isinstance(moved, ToDeviced) and str(moved.converter.device) == where
    assert ct == parser.get_parsed_content("ct_transforms"), "then train.yaml's CT preprocessing, as it is"


@pytest.fixture(scope="module")
def threshold_weights(tmp_path_factory) -> Path:
    """THRESHOLD_NETWORK's weights: the tumour's logit exceeds the background's by 100 x (image - 0.6), i.e. tumour
    above -100 HU (soft tissue and bone), so every label follows the preprocessed CT."""
    network = torch.nn.Conv3d(1, 2, kernel_size=1)
    with torch.no_grad():
        network.weight.copy_(torch.tensor([-50.0, 50.0]).reshape(2, 1, 1, 1, 1))
        network.bias.copy_(torch.tensor([30.0, -30.0]))
    return save_weights(network, tmp_path_factory.mktemp("threshold") / "model.pt", ["GTV-1"])


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_a_case_read_and_preprocessed_in_the_runs_process_gives_the_host_workers_label_map(
    device, small_cases, threshold_weights, tmp_path
):
    """inference.yaml run twice on a DICOM series: as a GPU runs it (cuda: preprocessing on the device, the case read in
    the run's process; cpu: the run's process, --num_workers 0) and with --preprocessing_device cpu (the host's
    DataLoader workers). The NIfTI label maps are equal (cpu: one computation) or differ in at most 1 voxel in 10,000
    (cuda: the network is f32 and the label a threshold of the CT, so only voxels within ~1e-7 of -100 HU after the
    window could turn)."""
    _, truths = small_cases
    common = ["inference", "--config_file", configs("inference.yaml"), "--input_dir", truths[0]["image_dir"],
              "--model_path", str(threshold_weights), "--network_def", THRESHOLD_NETWORK, "--roi_size", "[64,32,32]",
              "--device", device, "--amp", "false", "--inference_backend", "torch", "--keep_largest_components", "0",
              "--write_dicom_seg", "false", "--write_rtstruct", "false", "--write_sr", "false",
              "--write_report", "false"]  # fmt: skip
    runs = {"device": ["--num_workers", "0"] if device == "cpu" else [], "host": ["--preprocessing_device", "cpu"]}
    maps = {}
    for name, settings in runs.items():
        workflow_run(*common, "--output_dir", str(tmp_path / name), *settings)
        (case,) = json.loads((tmp_path / name / "inference_report.json").read_text())["cases"]
        assert case["status"] == "done" and case["stage_seconds"]["preprocess"] >= 0
        maps[name] = nib.load(case["outputs"]["nifti"])
    device_map, host_map = (np.asarray(m.dataobj) for m in maps.values())
    np.testing.assert_array_equal(maps["device"].affine, maps["host"].affine)
    assert device_map.shape == host_map.shape and 0 < int((host_map == 1).sum()) < host_map.size
    differ = int((device_map != host_map).sum())
    assert differ == 0 if device == "cpu" else differ <= 1e-4 * host_map.size, f"{differ} voxels differ"

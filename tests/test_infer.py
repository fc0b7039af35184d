"""Inference building blocks: finding cases, post-processing, the out-of-memory fallback, loading weights."""

from __future__ import annotations

import json
import logging
import shutil

import numpy as np
import pytest
import torch
from monai.networks.nets import SwinUNETR

from scripts.checkpoint import load_pretrained_encoder, load_weights
from scripts.infer import (
    OUT_OF_MEMORY,
    FallbackSlidingWindowInferer,
    InferenceInputError,
    find_inputs,
    keep_largest_components,
)


def test_keep_largest_components_per_structure():
    labels = np.zeros((20, 20, 20), np.uint8)
    labels[1:6, 1:6, 1:6] = 1  # 125 voxels
    labels[10:12, 10:12, 10:12] = 1  # 8 voxels: a stray island
    labels[15:18, 1:4, 1:4] = 2  # another structure: kept on its own account
    kept = keep_largest_components(labels, 1)
    assert (kept == 1).sum() == 125 and (kept == 2).sum() == 27
    assert (keep_largest_components(labels, 2) == labels).all()


def test_diagonal_neighbours_are_one_component():
    labels = np.zeros((6, 6, 6), np.uint8)
    labels[1, 1, 1] = labels[2, 2, 2] = 1  # touch at a corner: 26-connected
    labels[4, 4, 4] = 0
    assert (keep_largest_components(labels, 1) == labels).all()


def tcia_tree(small_cases, root, patients):
    """``root/<patient>/<series>/image`` copies of the small synthetic CT series."""
    _, truths = small_cases
    for (patient, series), truth in zip(patients, truths, strict=False):
        shutil.copytree(truth["image_dir"], root / patient / series / "image")
    return root


def test_case_ids_follow_the_tcia_tree_and_file_names(small_cases, tmp_path):
    tcia_tree(small_cases, tmp_path, [("P1", "1.0"), ("P2", "1.0"), ("P2", "2.0")])
    (tmp_path / "extra").mkdir()
    import nibabel as nib

    nib.save(nib.Nifti1Image(np.zeros((8, 8, 8), np.int16), np.eye(4)), tmp_path / "extra" / "scan.nii.gz")
    cases = find_inputs(tmp_path)
    assert sorted(c["case_id"] for c in cases) == ["P1", "P2_1.0", "P2_2.0", "scan"]
    assert {c["source"] for c in cases} == {"dicom", "nifti"}


def test_a_series_folder_given_directly_is_one_case(small_cases):
    _, truths = small_cases
    cases = find_inputs(truths[0]["image_dir"])
    assert len(cases) == 1 and cases[0]["source"] == "dicom"


def test_no_usable_input_is_an_error_that_names_the_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(InferenceInputError, match=str(tmp_path)):
        find_inputs(tmp_path)
    with pytest.raises(InferenceInputError, match="no such file or folder"):
        find_inputs(tmp_path / "missing")


def test_a_series_with_a_missing_slice_is_skipped_with_the_reason(small_cases, tmp_path):
    tcia_tree(small_cases, tmp_path, [("P1", "1"), ("P2", "1")])
    from scripts.dicom import scan_ct_series

    headers, _ = scan_ct_series(tmp_path / "P2" / "1" / "image")
    headers[len(headers) // 2][0].unlink()  # a slice in the middle of the volume
    cases = find_inputs(tmp_path, report_dir=tmp_path / "out")
    assert [c["case_id"] for c in cases] == ["P1"]
    report = json.loads((tmp_path / "out" / "inference_report.json").read_text())
    assert "missing slice" in report["skipped"][0]["reason"]


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
    with caplog.at_level(logging.WARNING, logger="scripts.infer"):
        output = inferer(image, network)
    torch.testing.assert_close(output, torch.cat([image, 2 * image], dim=1))
    assert "out of memory" in caplog.text and "(1, 1, 48, 40, 36)" in caplog.text
    assert inferer.sw_device is None, "the inferer's own settings are restored for the next case"


def test_other_errors_are_not_swallowed():
    inferer = FallbackSlidingWindowInferer(roi_size=(32, 32, 32))
    with pytest.raises(RuntimeError, match="shape mismatch"):
        inferer(torch.rand(1, 1, 32, 32, 32), FailsOnce(RuntimeError("shape mismatch")))


def small_net(out_channels: int = 2) -> SwinUNETR:
    return SwinUNETR(in_channels=1, out_channels=out_channels, feature_size=12)


def test_missing_weights_say_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match="Train first"):
        load_weights(small_net(), tmp_path / "model.pt")


def test_weights_for_another_number_of_structures_are_refused_by_name(tmp_path):
    torch.save(small_net(3).state_dict(), tmp_path / "model.pt")
    with pytest.raises(ValueError, match=r"model\.pt: the weights do not fit this network"):
        load_weights(small_net(2), tmp_path / "model.pt", labels=["GTV-1"])


def test_weights_for_other_labels_are_refused_by_their_sidecar(tmp_path):
    torch.save(small_net(2).state_dict(), tmp_path / "model.pt")
    (tmp_path / "model.json").write_text(json.dumps({"labels": ["Heart"]}))
    with pytest.raises(ValueError, match=r"trained for labels \['Heart'\]"):
        load_weights(small_net(2), tmp_path / "model.pt", labels=["GTV-1"])
    load_weights(small_net(2), tmp_path / "model.pt", labels=["Heart"])  # the right labels load


def test_pretrained_encoder_keys_are_mapped_and_counted(tmp_path):
    source = small_net()
    encoder = {k: v for k, v in source.state_dict().items() if k.startswith("swinViT.")}
    # the self-supervised checkpoint's naming: DataParallel's "module." and no "swinViT." prefix
    ssl = {"state_dict": {"module." + k.removeprefix("swinViT."): v for k, v in encoder.items()}}
    torch.save(ssl, tmp_path / "model_swinvit.pt")
    target = small_net()
    assert load_pretrained_encoder(target, tmp_path / "model_swinvit.pt") == len(encoder)
    for name, tensor in encoder.items():
        torch.testing.assert_close(target.state_dict()[name], tensor)
    torch.save({"state_dict": {"something.else": torch.zeros(3)}}, tmp_path / "wrong.pt")
    with pytest.raises(ValueError, match="no tensor matches"):
        load_pretrained_encoder(small_net(), tmp_path / "wrong.pt")

"""Weights in and out: clear refusals of weights for another network or other labels, and the
self-supervised encoder mapped onto SwinUNETR."""

from __future__ import annotations

import json

import pytest
import torch
from monai.networks.nets import SwinUNETR
from scripts.training.weights import load_pretrained_encoder, load_weights


def small_net(out_channels: int = 2) -> SwinUNETR:
    return SwinUNETR(in_channels=1, out_channels=out_channels, feature_size=12)


def test_missing_weights_say_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError) as missing:
        load_weights(small_net(), tmp_path / "model.pt")
    message = str(missing.value)
    assert message.startswith(f"{tmp_path / 'model.pt'}: no such weights file, and this bundle publishes no trained")
    assert "--config_file configs/train.yaml" in message and "runs/demo/model.pt" in message
    assert "--model_path" in message and "large_files" not in message, "no published weights to fetch"


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

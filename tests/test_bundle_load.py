"""``monai.bundle.load`` on this bundle, as MONAI 1.6.1 implements it and a model-zoo user calls it.

Without ``model=``, ``load`` builds the network from ``configs/<workflow_type>.json`` -- ``configs/train.json``, which
``python -m scripts.build_configs`` writes from ``train.yaml`` -- running its (light) ``initialize`` and then
``network_def``, from whatever folder the user is in. Both need MONAI only, so the bundle's network comes back with
``models/model.pt`` loaded, and nothing is written. ``load_ts_module=True`` returns the TorchScript that
``ckpt_export`` wrote from ``configs/inference.yaml`` alone, with the metadata and the config stored inside it.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from conftest import ROOT, save_weights

NAME = "nsclc_swinunetr"


def network_of(**ids) -> torch.nn.Module:
    """``network_def`` of train.yaml with ``ids`` changed, built as the bundle builds it."""
    from monai.bundle import ConfigParser

    parser = ConfigParser()
    parser.read_config(str(ROOT / "configs" / "train.yaml"))
    parser.update({"bundle_root": str(ROOT), **ids})
    return parser.get_parsed_content("network_def")


def bundle_with(tmp_path, network: torch.nn.Module):
    """``<tmp>/bundles/nsclc_swinunetr/``: the bundle's configs and ``network``'s weights as models/model.pt."""
    folder = tmp_path / "bundles" / NAME
    folder.mkdir(parents=True)
    (folder / "configs").symlink_to(ROOT / "configs", target_is_directory=True)
    save_weights(network, folder / "models" / "model.pt")
    return tmp_path / "bundles"


def assert_same_weights(network: torch.nn.Module, expected: torch.nn.Module) -> None:
    got, want = network.state_dict(), expected.state_dict()
    assert list(got) == list(want)
    assert all(torch.equal(got[k], want[k]) for k in want), "every tensor of models/model.pt loaded"


@pytest.mark.parametrize(
    "override",
    [{}, {"feature_size": 12}],
    ids=["the bundle's network (feature size 48)", "the demo's (feature size 12)"],
)
def test_load_returns_the_network_with_the_weights_from_another_folder(tmp_path, monkeypatch, override):
    from monai.bundle import load
    from monai.networks.nets import SwinUNETR

    torch.manual_seed(0)
    saved = network_of(**override)
    bundle_dir = bundle_with(tmp_path, saved)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        network = load(NAME, bundle_dir=str(bundle_dir), device="cpu", net_override=override)  # the zoo's call
    assert not [w for w in caught if "Cannot find the config file" in str(w.message) or "state dict" in str(w.message)]
    assert isinstance(network, SwinUNETR)
    assert_same_weights(network, saved)
    patch = torch.rand(1, 1, 64, 64, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(network.eval()(patch), saved.eval()(patch))
    assert list(elsewhere.iterdir()) == [], "load writes nothing where it is called"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Random demo-sized weights and their export models/model.ts (MONAI's ckpt_export, traced, from
    configs/inference.yaml alone, as docs/README.md runs it); the eager network's output on two patches."""
    from monai.bundle import ckpt_export

    tmp = tmp_path_factory.mktemp("exported")
    torch.manual_seed(0)
    eager = network_of(feature_size=12).eval()
    bundle_dir = bundle_with(tmp, eager)
    models = bundle_dir / NAME / "models"
    # the trace's own re-run check is left out: the test compares the traced output with the eager one
    ckpt_export("network_def", filepath=str(models / "model.ts"), ckpt_file=str(models / "model.pt"),
                meta_file=str(ROOT / "configs" / "metadata.json"), config_file=str(ROOT / "configs" / "inference.yaml"),
                bundle_root=str(ROOT), feature_size=12, use_trace=True, input_shape=[1, 1, 64, 64, 32],
                converter_kwargs={"check_trace": False})  # fmt: skip
    patch = torch.rand(2, 1, 64, 64, 32, generator=torch.Generator().manual_seed(0))  # a batch: sw_batch_size
    with torch.no_grad():
        expected = eager(patch)
    return bundle_dir, patch, expected


def test_load_ts_module_returns_the_exported_network_with_its_metadata_and_config(exported):
    from monai.bundle import ConfigParser, load

    bundle_dir, patch, expected = exported
    network, metadata, configs = load(NAME, bundle_dir=str(bundle_dir), load_ts_module=True,
                                      config_files=("inference.json",), device="cpu")  # fmt: skip
    with torch.no_grad():
        torch.testing.assert_close(network(patch), expected, rtol=1e-4, atol=1e-4)
    meta_file = json.loads((ROOT / "configs" / "metadata.json").read_text())
    assert metadata["version"] == meta_file["version"]
    assert metadata["network_data_format"] == meta_file["network_data_format"]
    # the standalone inference config's own content, stored at export: what MONAI Deploy reads by default
    assert json.loads(configs["inference.json"]) == ConfigParser.load_config_file(
        str(ROOT / "configs" / "inference.yaml")
    )
